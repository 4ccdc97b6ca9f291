"""Sick nodes (issue 29 item 6): which worker's rank faults, across jobs, say the node itself is
failing. Pure: the fault detector (L1-3) feeds it the faults it grades and sends L1-1 a
``FaultBacklogAlert`` for a node it names; L1-1 quarantines that node (a cordon held until
`surgectl uncordon`). No clock, no lock, no I/O here: table-tested in
tests/control/test_sick_nodes.py.

What counts against a node, within ``window_seconds`` (10 min):

* only the faults of a rank process or a node agent (``NODE_FAULT_CLASSES``: a rank that exits,
  runs out of memory, goes silent or stalls outside a collective, an agent lost): a failed
  collective, a config or data error, a released rank are never the node's;
* of one launch in one incident (a job's faults between two recoveries: L1-3's ledger round;
  a launch: the ranks' generation, see below), only those on the node of its first such fault
  (its cause): the survivors' exits after it are its consequences, on other nodes;
* never a fault that the same launch in that incident also had on another node (the same
  class and exit cause): the job's own doing (a bad configuration, a model too big for every
  device).

What counts is not each fault but each launch of a job's ranks that died on the node in an
incident (``NodeFault.death``: job, incident, generation; the generation is the launch's,
RankAssignment.generation, stated on the rank's exit): a lost node that took all its ranks of
one launch down at once counts once, while a rank relaunched there that dies again (a new
generation) counts again, even inside one incident (a node that kills every rank at its start
never lets a recovery finish: measure29 saw 5 such deaths in 25 s and no quarantine when the
incident was the unit). A fault that names no generation (a silence, a stall, an agent of an
older release) is its incident's: one per (job, incident).

A node is sick when those deaths reach ``faults`` (3) from at least ``incidents`` (2) distinct
launches (job, generation; the incident where the generation is unknown): one fault, or one
launch however many ranks it took down, never quarantines. Once named, its faults before are
not counted again: it starts from nothing when an operator releases it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

# Fault classes that can be a node's (services/control/fault_detector/rules.py names them).
NODE_FAULT_CLASSES = frozenset(
    {"rank_exit", "rank_oom", "rank_memory_error", "rank_silent", "rank_stalled", "worker_lost"}
)


@dataclass(frozen=True)
class SickNodePolicy:
    """Control's settings (``--sick-node-*``): ``faults`` 0 names no node sick (quarantine off)."""

    window_seconds: float = 600.0
    faults: int = 3
    incidents: int = 2


@dataclass(frozen=True)
class NodeFault:
    """One graded fault of a job's rank on a worker."""

    worker_id: str
    job_id: str
    incident: int  # the job's incident round (faults between two recoveries)
    kind: str  # the fault class, with an exit's cause: the same kind on two nodes is the job's
    at: float  # unix seconds
    generation: int = 0  # the launch of the rank (RankAssignment.generation); 0: not stated

    @property
    def death(self) -> tuple[str, int, int]:
        """What counts once against the node: this launch's ranks that died in this incident."""
        return (self.job_id, self.incident, self.generation)

    @property
    def launch(self) -> tuple[str, int, int]:
        """The launch it struck (job, generation), or its incident where that is unknown."""
        return (self.job_id, self.generation, -1 if self.generation else self.incident)


@dataclass(frozen=True)
class SickNode:
    """A node named sick: what counted against it."""

    worker_id: str
    faults: int
    incidents: int
    jobs: tuple[str, ...]
    kinds: tuple[str, ...]
    window_seconds: float

    @property
    def detail(self) -> str:
        return (
            f"{self.faults} rank faults on {self.worker_id} in {self.incidents} incidents within "
            f"{self.window_seconds:g} s ({', '.join(self.kinds)}; jobs {', '.join(self.jobs)})"
        )


def counted(faults: Iterable[NodeFault]) -> list[NodeFault]:
    """The faults that count against their node (see the module's rules), in order. The
    cause and the job-wide kinds are taken per launch within an incident (a relaunch that dies
    has its own cause), among that launch's faults and those that name no launch (a silence
    before the survivors' exits is still their cause)."""
    by_incident: dict[tuple[str, int], list[NodeFault]] = {}
    for f in faults:
        by_incident.setdefault((f.job_id, f.incident), []).append(f)
    out = []
    for group in by_incident.values():
        for gen in {f.generation for f in group}:
            pool = [f for f in group if f.generation in (gen, 0)]
            cause_node = pool[0].worker_id
            nodes_of_kind: dict[str, set[str]] = {}
            for f in pool:
                nodes_of_kind.setdefault(f.kind, set()).add(f.worker_id)
            out += [
                f for f in pool if f.generation == gen and f.worker_id == cause_node and len(nodes_of_kind[f.kind]) == 1
            ]
    return sorted(out, key=lambda f: f.at)


def sick(
    faults: Iterable[NodeFault], worker_id: str, now: float, policy: SickNodePolicy, since: float = float("-inf")
) -> SickNode | None:
    """Whether ``worker_id`` is sick at ``now`` given the faults graded so far (None: not),
    counting only its faults after ``since`` (when it was last named)."""
    recent = [f for f in faults if f.at > now - policy.window_seconds]
    mine = [f for f in counted(recent) if f.worker_id == worker_id and f.at > since]
    deaths = {f.death for f in mine}
    launches = {f.launch for f in mine}
    if len(deaths) < policy.faults or len(launches) < policy.incidents:
        return None
    return SickNode(
        worker_id=worker_id,
        faults=len(deaths),
        incidents=len(launches),
        jobs=tuple(sorted({f.job_id for f in mine})),
        kinds=tuple(sorted({f.kind for f in mine})),
        window_seconds=policy.window_seconds,
    )


class SickNodes:
    """The faults of the window, kept by L1-3 (under its lock): :meth:`record` each graded
    fault of a node class, and it answers the node when the fault makes it sick."""

    def __init__(self, policy: SickNodePolicy | None = None):
        self.policy = policy or SickNodePolicy()
        self._faults: deque[NodeFault] = deque()
        self._named: dict[str, float] = {}  # worker -> when it was last named

    def record(self, fault: NodeFault) -> SickNode | None:
        if self.policy.faults <= 0:
            return None  # (quarantine off: nothing kept)
        while self._faults and self._faults[0].at <= fault.at - self.policy.window_seconds:
            self._faults.popleft()  # out of the window for good (faults come in time order)
        self._faults.append(fault)
        since = self._named.get(fault.worker_id, float("-inf"))
        found = sick(self._faults, fault.worker_id, fault.at, self.policy, since)
        if found is not None:
            # Named once: it starts from nothing (its faults stay, still each incident's
            # cause, so that the consequences on other nodes are never counted instead).
            self._named[fault.worker_id] = fault.at
        return found
