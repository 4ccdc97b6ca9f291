"""The logs page follows a live job (issue 31 item 1, "logs that follow"): new lines are
appended from each rank's offset, none repeated, none skipped, without reloading the page.
Pure functions, the HTTP route over a real socket, and a real headless chromium appending the
lines a growing canned source writes."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from services.cli.observe import merge, parse
from services.contract import control_pb2
from services.dashboard import log_follow
from services.dashboard.access import Access
from services.dashboard.server import Dashboard, Server, make_handler

from .test_server import TOKEN, Canned


def line(rank: int, second: int, text: str):
    return parse(rank, json.dumps({"timestamp": f"2026-12-06T04:00:{second:02d}.000Z", "level": "info", "event": text}))


def test_a_rank_s_line_older_than_another_s_shown_one_is_sent_once_not_lost():
    first = merge([line(0, 1, "a0"), line(0, 5, "a1"), line(1, 2, "b0")])
    seen = log_follow.parse_seen(log_follow.seen_text(first))
    assert seen == {0: 2, 1: 1}
    # Rank 1's next line is older than rank 0's last shown one: a single offset into the merged
    # list would have skipped it (it sorts before a1) and sent a1 again.
    later = merge([line(0, 1, "a0"), line(0, 5, "a1"), line(0, 7, "a2"), line(1, 2, "b0"), line(1, 3, "b1")])
    assert [x.record["event"] for x in log_follow.new_lines(later, seen)] == ["b1", "a2"]
    assert log_follow.new_lines(later, log_follow.parse_seen(log_follow.seen_text(later))) == []
    # A rank's file begun again (fewer lines than were seen): all of it; a new rank: all of it.
    assert [x.record["event"] for x in log_follow.new_lines([line(1, 9, "c0")], {1: 5})] == ["c0"]
    assert [x.record["event"] for x in log_follow.new_lines([line(2, 9, "d0")], {0: 1})] == ["d0"]
    for bad in ("0", "0:x", "-1:2", "0:1;1:2"):
        with pytest.raises(ValueError, match="seen: expected RANK:COUNT"):
            log_follow.parse_seen(bad)


class Growing(Canned):
    """A running job whose two ranks write a line each time the test says (``write``)."""

    def __init__(self) -> None:
        self.lines: list = []
        self.state = control_pb2.RUNNING
        self.n = 0

    def write(self, k: int = 1) -> None:
        for _ in range(k):
            self.n += 1
            self.lines.append(parse(self.n % 2, f"line {self.n}"))

    def jobs(self):
        return control_pb2.JobList(jobs=[control_pb2.JobStatus(job_id="demo-1", name="demo", state=self.state)])

    def logs(self, job_id):
        return list(self.lines)


@pytest.fixture
def growing():
    src = Growing()
    server = Server(("127.0.0.1", 0), make_handler(Dashboard(src), Access(TOKEN), client_certificates=False))
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    yield src, f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    t.join(timeout=10)


def _get(base: str, path: str):
    req = urllib.request.Request(f"http://{base}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
    return urllib.request.urlopen(req, timeout=10)


def test_the_lines_route_answers_the_lines_after_each_rank_s_offset_as_json(growing):
    src, base = growing
    src.write(3)  # line 1 (rank 1), 2 (rank 0), 3 (rank 1)
    with _get(base, "/job/demo/logs/lines?seen=") as r:
        assert r.headers["Content-Type"] == "application/json"
        got = json.load(r)
    assert [x.split("  ", 1)[1] for x in got["lines"]] == ["line 1", "line 2", "line 3"]
    assert (got["seen"], got["live"], got["error"]) == ("0:1,1:2", True, "")
    src.write(2)
    with _get(base, f"/job/demo-1/logs/lines?seen={got['seen']}") as r:
        again = json.load(r)
    assert [x.split("  ", 1)[1] for x in again["lines"]] == ["line 4", "line 5"]  # none repeated
    src.state = control_pb2.TERMINATED
    with _get(base, f"/job/demo-1/logs/lines?seen={again['seen']}") as r:
        assert json.load(r) == {"lines": [], "seen": "0:2,1:3", "live": False, "error": ""}
    with pytest.raises(urllib.error.HTTPError) as bad:
        _get(base, "/job/demo-1/logs/lines?seen=zero")
    assert bad.value.code == 400 and bad.value.headers["Content-Type"] == "application/json"
    assert json.load(bad.value) == {"error": "seen: expected RANK:COUNT pairs separated by commas, got 'zero'"}
    with pytest.raises(urllib.error.HTTPError) as unknown:  # a script's errors are JSON, a page's HTML
        _get(base, "/job/nosuch/logs/lines?seen=")
    assert unknown.value.code == 404 and "error" in json.load(unknown.value)
    with pytest.raises(urllib.error.HTTPError) as refused:  # behind the token like every page
        urllib.request.urlopen(f"http://{base}/job/demo-1/logs/lines?seen=", timeout=10)
    assert refused.value.code == 401


@pytest.mark.timeout(180)
def test_a_real_browser_appends_new_lines_without_reloading_the_page(growing):
    from selenium.webdriver.common.by import By

    from tests.dashboard.browser import chromium, load

    src, base = growing
    src.write(2)
    with chromium() as browser:
        load(browser, f"http://{base}/job/demo-1/logs?token={TOKEN}")  # (the token traded for a cookie)
        browser.execute_script("window.__sameDocument = 1")  # gone if the page reloads
        pre = browser.find_element(By.ID, "logs")
        assert pre.text.splitlines() == [f"rank {n % 2}  line {n}" for n in (1, 2)]
        src.write(3)

        def shown() -> list[str]:
            return browser.find_element(By.ID, "logs").text.splitlines()

        deadline = time.monotonic() + 60  # polls every 2 s; a loaded host may take longer
        while len(shown()) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert shown() == [f"rank {n % 2}  line {n}" for n in range(1, 6)]  # appended, none repeated
        assert browser.execute_script("return window.__sameDocument") == 1  # never reloaded
        src.state = control_pb2.TERMINATED
        src.write(1)
        while browser.find_element(By.ID, "logs").get_attribute("data-live") == "1" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert shown()[-1] == "rank 0  line 6" and len(shown()) == 6  # the last lines, then it stops asking
        assert browser.find_element(By.ID, "logs").get_attribute("data-live") == "0"
