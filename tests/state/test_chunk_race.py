"""The two-ended read's claims (services/state/chunk_race.py), on a real TailRead with an
in-process source: a chunk that occurs twice in one load (identical bytes in two places,
e.g. every parameter's AdamW ``step`` tensor) is handed over by the tail once, and its next
claim is the front's. Before: the second claim waited on the tail's copy already taken, and
a resumed job hung in its checkpoint load (tests/cli/test_operator_actions.py's drain)."""

from __future__ import annotations

import hashlib
import time

from services.state.chunk_race import TailRead


class Source:
    def __init__(self, chunks: dict[str, bytes]):
        self.chunks = chunks

    def get(self, sha: str, nbytes: int) -> bytes | None:
        return self.chunks.get(sha)


def test_a_chunk_twice_in_a_load_is_taken_from_the_tail_once_then_claimed_by_the_front():
    a, b = b"\x00" * 64, b"\x01" * 64
    sa, sb = hashlib.sha256(a).hexdigest(), hashlib.sha256(b).hexdigest()
    race = TailRead(
        [(sa, 64), (sb, 64), (sa, 64)],
        Source({sa: a, sb: b}),
        accept=lambda source, sha, n, data: hashlib.sha256(data).hexdigest() == sha,
        front_has=lambda sha: False,
        threads=1,
    )
    deadline = time.monotonic() + 5
    while not race.tail_took(sb) and time.monotonic() < deadline:  # the tail read the back two
        time.sleep(0.01)
    assert race.tail_took(sa) and race.tail_took(sb)
    assert race.claim(sa) is False  # the tail has it: taken once
    assert race.take(sa) == (True, a)
    assert race.claim(sa) is True  # its second occurrence is the front's (no wait on a copy gone)
    assert race.claim(sb) is False and race.take(sb) == (True, b)
    race.close()
