"""The dashboard's HTTP side in-process, over a real socket, with canned sources: the token
gate (header, cookie, the URL's token once), read-only methods, a missing job, the TLS peer
check's names."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from http.client import HTTPConnection

import grpc
import pytest

from services.common.job_refs import pick_job
from services.contract import control_pb2
from services.dashboard import series
from services.dashboard.access import Access, certificate_names, operator_certificate
from services.dashboard.server import Dashboard, Server, make_handler
from services.dashboard.sources import JobRecords

TOKEN = "s3cret-token"


class NotFound(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.NOT_FOUND

    def details(self):
        return "no job nope"


class Canned:
    """Stands in for ``Sources``: one RUNNING job with 500 events (each fifth a fault, the
    rest steps), selected as control's journal does; ``asked`` holds each events read's
    (job, tail, types)."""

    def __init__(self):
        self.asked: list[tuple[str, int, list[str]]] = []
        self.history = [
            control_pb2.JobEvent(job_id="demo-1", seq=n, type="fault" if n % 5 == 0 else "step", message=f"event {n}")
            for n in range(1, 501)
        ]

    def jobs(self):
        return control_pb2.JobList(
            jobs=[control_pb2.JobStatus(job_id="demo-1", name="demo", state=control_pb2.RUNNING, world_size=4)]
        )

    def resolve(self, ref):  # (the CLI's rule over this list, as Sources.resolve reads control's)
        return pick_job(ref, self.jobs().jobs)

    def job(self, job_id):
        if job_id != "demo-1":
            raise NotFound()
        return self.jobs().jobs[0]

    def events(self, job_id, tail=0, types=()):
        self.asked.append((job_id, tail, list(types)))
        kept = [ev for ev in self.history if not types or ev.type in types]
        return kept[-tail:] if tail else kept

    def series(self, job_id, rank=0):
        return series.from_events([])

    def checkpoints(self, job_id):
        return []

    def logs(self, job_id):
        return []

    def job_records(self, job_id, rank=0):
        return JobRecords(self.series(job_id, rank), None, None)

    def samples(self, job_id):
        return None

    def scores(self, job_id):
        return None

    def slots(self):
        return []


@pytest.fixture(scope="module")
def canned():
    return Canned()


@pytest.fixture(scope="module")
def base(canned):
    server = Server(("127.0.0.1", 0), make_handler(Dashboard(canned), Access(TOKEN), client_certificates=False))
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    t.join(timeout=10)


def get(base: str, path: str, method: str = "GET", headers: dict | None = None):
    conn = HTTPConnection(base, timeout=10)
    conn.request(method, path, headers=headers or {})
    r = conn.getresponse()
    body = r.read().decode()
    conn.close()
    return r, body


def test_a_page_without_the_token_is_refused_and_health_says_nothing_but_ok(base):
    r, body = get(base, "/")
    assert r.status == 401 and "demo-1" not in body and r.getheader("WWW-Authenticate")
    r, _ = get(base, "/", headers={"Authorization": "Bearer wrong"})
    assert r.status == 401
    r, body = get(base, "/healthz")
    assert (r.status, body) == (200, "ok")


def test_the_bearer_token_opens_every_page_with_its_time(base):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/", "/queue", "/cluster", "/job/demo-1", "/job/demo-1/logs", "/compare"):
        r, body = get(base, path, headers=auth)
        assert r.status == 200, (path, body)
        assert r.getheader("Server-Timing", "").startswith("page;dur=")
    assert "demo-1" in get(base, "/", headers=auth)[1]


def test_the_urls_token_is_traded_for_a_cookie_and_a_redirect_without_it(base):
    r, _ = get(base, f"/job/demo-1?type=fault&token={TOKEN}")
    assert r.status == 303 and r.getheader("Location") == "/job/demo-1?type=fault"
    cookie = r.getheader("Set-Cookie")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    r, body = get(base, "/job/demo-1?type=fault", headers={"Cookie": cookie.split(";")[0]})
    assert r.status == 200 and "job demo-1" in body
    r, _ = get(base, "/?token=wrong")
    assert r.status == 401


def test_the_dashboard_is_read_only_and_a_missing_job_is_404(base):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert get(base, "/job/demo-1", method=method, headers=auth)[0].status == 405
    r, body = get(base, "/job/nope", headers=auth)
    assert r.status == 404 and "no job &#x27;nope&#x27;: no job has that id or name" in body, body
    assert get(base, "/nothing-here", headers=auth)[0].status == 404


def test_a_job_is_named_by_its_id_or_its_name_and_an_unknown_event_type_is_refused_as_the_cli_does(base):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/job/demo", "/job/demo/logs", "/compare?job=demo&job=demo-1"):
        r, body = get(base, path, headers=auth)
        assert r.status == 200 and "demo-1" in body, (path, r.status, body)
    r, body = get(base, "/job/demo-1?type=bogus", headers=auth)
    assert r.status == 400 and "type: unknown event type bogus (one of: state, " in body, body
    assert get(base, "/job/demo-1?type=fault,decision", headers=auth)[0].status == 200


def test_the_job_pages_rank_is_a_whole_number_shown_in_its_form(base):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for bad in ("x", "-1", "1.5", "99999999999"):
        r, body = get(base, f"/job/demo-1?rank={bad}", headers=auth)
        assert r.status == 400 and "rank: expected a whole number &gt;= 0" in body, (bad, body)
    r, body = get(base, "/job/demo-1?rank=3", headers=auth)
    assert r.status == 200 and '<form id=rank-pick action="/job/demo-1" method=get>' in body
    # A rank the job does not have: said, not rank 0's curves under another rank's name (a new
    # user's trial: /job/J?rank=5 of a dp 2 job answered 200 with rank 0's curves).
    r, body = get(base, "/job/demo-1?rank=4", headers=auth)
    assert r.status == 404 and "rank: demo-1 has no rank 4 (its ranks are 0-3)" in body, body


def test_only_a_certificate_naming_the_operators_role_passes_under_mutual_tls():
    user = {"subject": ((("commonName", "someone"),),), "subjectAltName": (("DNS", "surge-user"),)}
    worker = {"subject": ((("commonName", "surge-worker"),),)}
    assert certificate_names(user) == {"someone", "surge-user"}
    assert operator_certificate(user) and not operator_certificate(worker) and not operator_certificate(None)


def test_a_dashboard_without_a_token_cannot_be_built():
    with pytest.raises(ValueError):
        Access("")


def test_urllib_gets_the_page_with_the_header(base):
    req = urllib.request.Request(f"http://{base}/cluster", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and "No worker is registered." in r.read().decode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{base}/cluster", timeout=10)
    assert refused.value.code == 401


def test_the_cookie_carries_a_token_with_characters_a_cookie_value_may_not_hold():
    odd = "a token; with=odd,chars"
    access = Access(odd)
    header = access.cookie_header(odd)
    assert header.startswith("surge_dashboard=a%20token%3B%20with%3Dodd%2Cchars;") and "HttpOnly" in header
    assert access.by_header_or_cookie(None, header.split(";")[0]) == odd
    assert access.by_header_or_cookie(None, "surge_dashboard=a%20token") is None


def test_the_job_page_asks_control_for_its_newest_events_of_the_types_and_links_to_more(base, canned):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r, body = get(base, "/job/demo-1?type=step", headers=auth)
    assert r.status == 200 and canned.asked[-1] == ("demo-1", 200, ["step"])  # not the whole history
    rows = re.findall(r'<tr class="event ev-(\w+)"><td class=num>(\d+)</td>', body)
    assert len(rows) == 200 and {t for t, _ in rows} == {"step"}
    assert [int(n) for _, n in rows] == sorted(int(n) for _, n in rows) and rows[-1][1] == "499"
    assert "The newest 200 events of these types" in body
    assert 'id=events-more href="/job/demo-1?type=step&amp;events=2000#events"' in body
    assert 'id=events-all href="/job/demo-1?type=step&amp;events=all#events"' in body

    r, body = get(base, "/job/demo-1?type=step&events=all&rank=2", headers=auth)
    assert r.status == 200 and canned.asked[-1] == ("demo-1", 0, ["step"])
    assert len(re.findall(r'<tr class="event ', body)) == 400 and "All 400 events of these types." in body
    assert '<input type=hidden name=events value="all">' in body  # the type filter keeps the choice
    r, body = get(base, "/job/demo-1?events=2000", headers=auth)
    assert r.status == 200 and canned.asked[-1] == ("demo-1", 2000, [])
    assert "All 500 events." in body and "events-more" not in body
    r, body = get(base, "/job/demo-1?type=fault&events=50", headers=auth)
    assert canned.asked[-1] == ("demo-1", 50, ["fault"]) and "events-more" in body
    for bad in ("0", "x", "-3", "10000000"):
        r, body = get(base, f"/job/demo-1?events={bad}", headers=auth)
        assert r.status == 400 and "events: expected &#x27;all&#x27; or a whole number" in body, (bad, body)
