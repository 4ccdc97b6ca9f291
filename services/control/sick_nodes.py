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

from collections import Counter, deque
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
    return _named([f for f in counted(recent) if f.worker_id == worker_id and f.at > since], worker_id, policy)


def _named(mine: list[NodeFault], worker_id: str, policy: SickNodePolicy) -> SickNode | None:
    """``worker_id`` named sick for ``mine`` (its faults that count, in the window), or None."""
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


class _Incident:
    """The window's faults of one (job, incident), indexed for ``counted``'s rule: by launch
    (generation, 0: none stated), each launch's nodes per kind, and by node; kept as faults
    come and leave the window (both in time order), so that a look-up costs the node's own
    faults, not the incident's."""

    def __init__(self) -> None:
        self.by_gen: dict[int, deque[tuple[int, NodeFault]]] = {}  # (arrival, fault), in order
        self.kinds: dict[int, dict[str, Counter[str]]] = {}  # generation -> kind -> node -> faults
        self.of_node: dict[str, deque[NodeFault]] = {}

    def add(self, n: int, fault: NodeFault) -> None:
        self.by_gen.setdefault(fault.generation, deque()).append((n, fault))
        self.kinds.setdefault(fault.generation, {}).setdefault(fault.kind, Counter())[fault.worker_id] += 1
        self.of_node.setdefault(fault.worker_id, deque()).append(fault)

    def drop_oldest(self, fault: NodeFault) -> bool:
        """``fault`` (the oldest of the window, so each index's first) left it; True: none is left."""
        gen, node = fault.generation, fault.worker_id
        self.by_gen[gen].popleft()
        if not self.by_gen[gen]:
            del self.by_gen[gen]
        nodes = self.kinds[gen][fault.kind]
        nodes[node] -= 1
        if not nodes[node]:
            del nodes[node]
            if not nodes:
                del self.kinds[gen][fault.kind]
        self.of_node[node].popleft()
        if not self.of_node[node]:
            del self.of_node[node]
        return not self.by_gen

    def counted(self, node: str) -> list[NodeFault]:
        """``counted``'s rule for ``node``'s faults here: those of a launch whose first fault
        (among its own and the incident's that name no launch) was on ``node``, of a kind that
        launch had on no other node."""
        out = []
        for fault in self.of_node.get(node, ()):
            gen = fault.generation
            pool = [self.by_gen[gen][0]] + ([self.by_gen[0][0]] if gen and 0 in self.by_gen else [])
            if min(pool, key=lambda first: first[0])[1].worker_id != node:
                continue  # (the launch's cause was on another node: this is a consequence)
            kinds = [self.kinds[gen][fault.kind]] + (
                [self.kinds[0].get(fault.kind, {})] if gen and 0 in self.kinds else []
            )
            if all(not nodes or (len(nodes) == 1 and node in nodes) for nodes in kinds):  # (``node`` alone, or none)
                out.append(fault)
        return out


class SickNodes:
    """The faults of the window, kept by L1-3 (under its lock): :meth:`record` each graded
    fault of a node class, and it answers the node when the fault makes it sick (``sick``'s
    rule, kept incrementally: a record costs the node's own faults in the window, not every
    fault of it; one launch of 8,192 ranks lost at once was O(n^2), ~11 s of L1-3's lock)."""

    def __init__(self, policy: SickNodePolicy | None = None):
        self.policy = policy or SickNodePolicy()
        self._faults: deque[NodeFault] = deque()
        self._incidents: dict[tuple[str, int], _Incident] = {}
        self._of_node: dict[str, Counter[tuple[str, int]]] = {}  # node -> its incidents -> its faults there
        self._named: dict[str, float] = {}  # worker -> when it was last named
        self._arrivals = 0

    def record(self, fault: NodeFault) -> SickNode | None:
        if self.policy.faults <= 0:
            return None  # (quarantine off: nothing kept)
        while self._faults and self._faults[0].at <= fault.at - self.policy.window_seconds:
            self._forget(self._faults.popleft())  # out of the window for good (faults come in time order)
        self._faults.append(fault)
        key = (fault.job_id, fault.incident)
        self._arrivals += 1
        self._incidents.setdefault(key, _Incident()).add(self._arrivals, fault)
        self._of_node.setdefault(fault.worker_id, Counter())[key] += 1
        since = self._named.get(fault.worker_id, float("-inf"))
        mine = [
            f
            for incident in self._of_node[fault.worker_id]
            for f in self._incidents[incident].counted(fault.worker_id)
            if f.at > since
        ]
        found = _named(mine, fault.worker_id, self.policy)
        if found is not None:
            # Named once: it starts from nothing (its faults stay, still each incident's
            # cause, so that the consequences on other nodes are never counted instead).
            self._named[fault.worker_id] = fault.at
        return found

    def _forget(self, fault: NodeFault) -> None:
        key, node = (fault.job_id, fault.incident), fault.worker_id
        if self._incidents[key].drop_oldest(fault):
            del self._incidents[key]
        mine = self._of_node[node]
        mine[key] -= 1
        if not mine[key]:
            del mine[key]
            if not mine:
                del self._of_node[node]
