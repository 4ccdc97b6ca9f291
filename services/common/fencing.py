"""Fencing: an older incarnation of a rank is refused everywhere (issue 29 item 4).

Every launch of a (job, rank) carries a generation (``RankAssignment.generation``, larger for
every launch of the same rank: L1-2 takes max(previous + 1, wall-clock ms), so it grows across
control restarts too). A rank names it on every gRPC call it makes: the process sets its
identity once it has its assignment (:func:`set_identity`) and every Surge channel adds
``x-surge-generation: <job>/<rank>/<generation>`` to each call (services/common/grpc_server.py,
like the calling module's header). Each Surge server keeps one :class:`GenerationFence` per
process (:data:`FENCE`): the newest generation it was told of per (job, rank), by a call of
that generation or by its owner (the node agent from control's ReleaseRanks / LaunchRanks,
control's session relay from the launches it sends). A call of an older generation is refused
before its handler runs: FAILED_PRECONDITION with the typed cause ``FAILURE_FENCED`` in the
trailing metadata (``surge-failure-cause``), so the rank's failure event carries that cause,
never one read from text (services/contract/failures.py ``cause_of``).

That is the pattern of leases with fencing tokens (Kleppmann, "How to do distributed locking",
2016; ZooKeeper's zxid, etcd's revision): a process that was paused past its lease and woke up
cannot tell it was replaced, so the receivers check its token. A generation of 0 is not
fenced (a launcher that predates generations, tests that build a bare assignment).
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import Counter

from services.contract import route_pb2

GENERATION_METADATA = "x-surge-generation"

FENCED_CALLS = Counter(
    "surge_fenced_calls_total",
    "Calls and events refused because they came from an older incarnation (generation) of a rank "
    "than the newest this process was told of, by where they were refused",
    ["where"],
)


class StaleGeneration(Exception):
    """A message of an older generation of ``(job_id, rank)`` than ``newest``: the sender was
    replaced. Typed (``FAILURE_FENCED``), never read from its text."""

    failure_cause = route_pb2.FailureCause.FAILURE_FENCED

    def __init__(self, job_id: str, rank: int, generation: int, newest: int):
        super().__init__(
            f"rank {rank} of job {job_id} generation {generation} was replaced by generation {newest}: refused"
        )
        self.job_id, self.rank, self.generation, self.newest = job_id, rank, generation, newest


class GenerationFence:
    """The newest generation told of per (job, rank); thread-safe, one dict entry per rank
    (kept for the process's life: a few dozen bytes per rank ever launched)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest: dict[tuple[str, int], int] = {}

    def tell(self, job_id: str, rank: int, generation: int) -> int:
        """Learn that ``generation`` of (job, rank) exists; returns the newest known now."""
        with self._lock:
            key = (job_id, rank)
            newest = max(self._newest.get(key, 0), generation)
            self._newest[key] = newest
            return newest

    def newest(self, job_id: str, rank: int) -> int:
        with self._lock:
            return self._newest.get((job_id, rank), 0)

    def admit(self, job_id: str, rank: int, generation: int) -> None:
        """Take a message of ``generation`` (0: unfenced, always taken): it raises the newest
        known when it is newer.

        Raises:
            StaleGeneration: an older generation than the newest told of.
        """
        if not generation:
            return
        with self._lock:
            key = (job_id, rank)
            newest = self._newest.get(key, 0)
            if generation < newest:
                raise StaleGeneration(job_id, rank, generation, newest)
            self._newest[key] = generation


# The fence of this process: every Surge server checks the calls it serves against it.
FENCE = GenerationFence()

# This process's own identity as a rank (job, rank, generation), or None: not a rank, or one
# not yet assigned (before its setup arrived from the node agent).
_identity: tuple[str, int, int] | None = None


def set_identity(job_id: str, rank: int, generation: int) -> None:
    """This process is ``generation`` of (job, rank): every call it makes from now on names it."""
    global _identity
    _identity = (job_id, rank, generation) if generation else None


def identity_header() -> tuple[str, str] | None:
    """The header a Surge channel adds to each call of this process (None: not a rank)."""
    ident = _identity
    if ident is None:
        return None
    return GENERATION_METADATA, f"{ident[0]}/{ident[1]}/{ident[2]}"


def parse(value: Any) -> tuple[str, int, int] | None:
    """(job, rank, generation) from a header's value; None when malformed (not fenced: a
    malformed header is no identity, the module header's check speaks for the caller)."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    job_id, _, rest = str(value).rpartition("/")
    job_id, _, rank = job_id.rpartition("/")
    if not job_id or not rank.isdigit() or not rest.isdigit():
        return None
    return job_id, int(rank), int(rest)


def check_call(metadata: Any, where: str) -> StaleGeneration | None:
    """The refusal of a call whose ``x-surge-generation`` (in ``metadata``, the call's
    invocation metadata) is older than the newest this process was told of, else None
    (and the newest is raised to it)."""
    for key, value in metadata or ():
        if key != GENERATION_METADATA:
            continue
        ident = parse(value)
        if ident is None:
            return None
        try:
            FENCE.admit(*ident)
        except StaleGeneration as e:
            FENCED_CALLS.labels(where).inc()
            return e
        return None
    return None
