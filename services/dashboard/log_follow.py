"""The logs page's follow: the lines a browser has not shown yet, from an offset per rank.

The page (``pages.logs_page``) carries what it shows as ``seen``, each rank's count of lines
(``"0:120,1:118"``); its script asks ``/job/<job>/logs/lines?seen=...`` every
``POLL_SECONDS`` and appends what comes back. Why per rank: the lines are every rank's merged
by time (services/cli/observe.py ``merge``), and a rank's line may be older than another's
already shown (each rank's file is read as written, at its own pace), so a single offset into
the merged list would show a line twice or never. Within a rank the merge keeps file order:
its first ``n`` lines are the ones already shown, none repeated, none skipped. A rank whose
file holds fewer lines than the page saw (a file written again from the start) is sent from
its first line.

Pure functions: the server reads the lines (control's StreamLogs, as the page does).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence

from services.cli.observe import LogLine

POLL_SECONDS = 2  # the page asks for new lines this often while the job is live
MAX_LINES = 2000  # per answer at most (the newest): a page away for long does not get a flood


def seen_text(lines: Sequence[LogLine]) -> str:
    """Each rank's count of ``lines``, as the page carries it (``"0:12,1:15"``)."""
    return ",".join(f"{rank}:{n}" for rank, n in sorted(Counter(line.rank for line in lines).items()))


def parse_seen(text: str) -> dict[int, int]:
    """``seen_text``'s form back to {rank: count}.

    Raises:
        ValueError: not ``RANK:COUNT`` pairs of non-negative integers (one line).
    """
    seen: dict[int, int] = {}
    for part in filter(None, text.split(",")):
        rank, sep, count = part.partition(":")
        if not sep or not rank.isdigit() or not count.isdigit():
            raise ValueError(f"seen: expected RANK:COUNT pairs separated by commas, got {part!r}")
        seen[int(rank)] = int(count)
    return seen


def new_lines(lines: Sequence[LogLine], seen: dict[int, int]) -> list[LogLine]:
    """The lines after each rank's first ``seen[rank]`` (in ``lines``' order, the merged one)."""
    total = Counter(line.rank for line in lines)
    skip = {rank: n if n <= total[rank] else 0 for rank, n in seen.items()}  # (a file begun again: all of it)
    out, passed = [], Counter()
    for line in lines:
        passed[line.rank] += 1
        if passed[line.rank] > skip.get(line.rank, 0):
            out.append(line)
    return out


def answer(lines: Sequence[LogLine] | None, seen: dict[int, int], live: bool) -> str:
    """The JSON the page's script reads: ``lines`` (the new lines as the page shows them, text,
    the newest ``MAX_LINES``), ``seen`` (its new counts), ``live`` (keep asking), ``error``
    (control could not stream the logs: nothing new, ask again)."""
    if lines is None:
        return json.dumps({"lines": [], "seen": ",".join(f"{r}:{n}" for r, n in sorted(seen.items())), "live": live,
                           "error": "control could not stream the rank logs"})  # fmt: skip
    fresh = new_lines(lines, seen)
    return json.dumps(
        {"lines": [line.human() for line in fresh[-MAX_LINES:]], "seen": seen_text(lines), "live": live, "error": ""}
    )


# The page's one script: ask for the lines after ``seen`` every POLL_SECONDS while the job is
# live, append them as text (never HTML: a line is a rank's text), keep the view at the end
# when it was there. A failed request is tried again at the next tick.
SCRIPT = """
(function () {
  const pre = document.getElementById('logs');
  if (!pre || pre.dataset.live !== '1') return;
  let seen = pre.dataset.seen, busy = false;
  async function tick() {
    if (busy) return;
    busy = true;
    try {
      const r = await fetch(pre.dataset.src + '?seen=' + encodeURIComponent(seen),
                            {credentials: 'same-origin', cache: 'no-store'});
      if (!r.ok) return;
      const got = await r.json();
      const atEnd = window.innerHeight + window.scrollY >= document.body.scrollHeight - 4;
      if (got.lines.length) {
        pre.append((pre.textContent ? '\\n' : '') + got.lines.join('\\n'));
        pre.dataset.count = String(Number(pre.dataset.count) + got.lines.length);
      }
      seen = pre.dataset.seen = got.seen;
      if (atEnd) window.scrollTo(0, document.body.scrollHeight);
      if (!got.live) { clearInterval(timer); pre.dataset.live = '0'; }
    } catch (e) {
    } finally {
      busy = false;
    }
  }
  const timer = setInterval(tick, Number(pre.dataset.every) * 1000);
})();
"""
