"""What the allocator keeps of a worker and of a job's placement, and what each slot offers:
its device, its memory quota, the host of the rendezvous, the node's memory peer, and the
memory a job's rank needs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.contract import control_pb2
from services.jobspec import JobSpec, LinksSpec
from services.memory_estimate import estimate_memory


@dataclass
class _Worker:
    reg: control_pb2.WorkerRegistration
    busy: dict[str, list[int]] = field(default_factory=dict)  # job_id -> slot indices
    under_pressure: bool = False  # the seed's 资源紧张 state, per worker (host memory)
    devices_under_pressure: set[int] = field(default_factory=set)  # ... per device (NVML index)
    departing: bool = False  # the node agent said it is leaving: nothing new is placed here

    def free_slots(self) -> list[int]:
        taken = {s for slots in self.busy.values() for s in slots}
        return [s for s in range(self.reg.slots) if s not in taken]

    def free_count(self) -> int:
        """``len(free_slots())`` without the list (an offer counts every worker's)."""
        return self.reg.slots - len({s for slots in self.busy.values() for s in slots if s < self.reg.slots})


@dataclass
class _Placement:
    """Where a job's ranks run (index = rank: worker id, slot), the backend chosen at launch,
    and the generation of the rendezvous its survivors last got (a rebuild in place)."""

    ranks: list[tuple[str, int]]
    backend: str
    generation: int = 0
    # worker id -> the link probe its node agent was last told for this job (None: none): what
    # a rebuild compares its new peers with, addresses included (an agent back at a new
    # address under the same id). Unknown after a control restart (re-attached placement).
    probes: dict[str, control_pb2.LinkProbe | None] = field(default_factory=dict)
    # (worker id, slot) -> its kind ("gpu"/"cpu") when a rank was placed there: what ``_placed``
    # counts a rank by once its worker is gone (a loss not yet reported for every rank).
    kinds: dict[tuple[str, int], str] = field(default_factory=dict)
    # worker id -> the memory peer its node agent was told at launch (None: none): the node that
    # holds a copy of its ranks' state, where a rank whose own node is gone is relaunched first
    # (``ResourceAllocator.rebuild_communicator``). Unknown after a control restart.
    peers: dict[str, str] = field(default_factory=dict)


def _reachable_host(reg: control_pb2.WorkerRegistration) -> str:
    """The host other nodes reach this node agent at: its advertised address's (rank 0's
    host is the rendezvous). Not ``reg.host``, the machine's own name, which another node
    may not resolve, or resolve to itself (hosts sharing one name: containers, namespaces)."""
    host = reg.address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host  # "[v6]:port"


def _gpu_slots(w: _Worker) -> int:
    """How many of the worker's slots have a CUDA device (the first ones: slot i, device i)."""
    return min(w.reg.slots, sum(1 for d in w.reg.devices if d.kind == "cuda"))


def _device_kind(w: _Worker, slot: int) -> str:
    return "cuda" if slot < _gpu_slots(w) else "cpu"


def _slot_kind(w: _Worker, slot: int) -> str:
    """The scheduler's name of the slot's kind (issue 30): ``gpu`` (a CUDA device) or ``cpu``."""
    return "gpu" if _device_kind(w, slot) == "cuda" else "cpu"


def _of_kind(w: _Worker, slot: int, kind: str) -> bool:
    """Whether a job asking for ``kind`` (``gpu``, ``cpu`` or ``any``) may run a rank on the slot."""
    return kind == "any" or _slot_kind(w, slot) == kind


def _placed(workers: dict[str, _Worker], placement: _Placement) -> control_pb2.KindSlots:
    """A job's ranks counted per device kind: where an ``any`` job landed (L1-1 counts its
    team's usage there, issue 30). A rank on a worker gone meanwhile counts as the kind it was
    placed on (remembered in ``placement.kinds``; before, it counted as cpu, and an ``any`` job
    on GPUs that kept such a rank through a shrink was counted against both kinds)."""
    gpu = 0
    for wid, s in placement.ranks:
        if wid in workers:
            placement.kinds[(wid, s)] = _slot_kind(workers[wid], s)
        gpu += placement.kinds.get((wid, s), "cpu") == "gpu"
    return control_pb2.KindSlots(gpu=gpu, cpu=len(placement.ranks) - gpu)


def _device_name(w: _Worker, slot: int) -> str:
    devices = [d for d in w.reg.devices if d.kind == "cuda"]
    return f"cuda:{devices[slot].index}" if slot < len(devices) else "cpu"


def _memory_quota(w: _Worker, slot: int) -> int:
    devices = [d for d in w.reg.devices if d.kind == "cuda"]
    if slot < len(devices):
        return devices[slot].memory_bytes
    return w.reg.memory_bytes // max(w.reg.slots, 1)


def _rank_memory(spec: JobSpec) -> int:
    """The job's estimated memory per rank in bytes (services/memory_estimate.py); 0 where the
    estimate cannot be made (a layout the planner refuses: the rank refuses it in one line)."""
    try:
        return estimate_memory(spec).total
    except ValueError:
        return 0


class _Ring:
    """Node ids in order (first occurrence, none empty), each with its index: built once per
    launch and looked up per node. Why: a list's ``index`` per launched node was O(nodes) each,
    O(nodes²) for a job over 10,000 node agents (py-spy, session 34: most of a 4,000-node
    launch)."""

    def __init__(self, ids: Iterable[str]):
        self.ids = list(dict.fromkeys(i for i in ids if i))
        self.index = {w: i for i, w in enumerate(self.ids)}


def _memory_peer(usable: list[_Worker], worker_id: str, ring: _Ring | None = None) -> control_pb2.MemoryPeer | None:
    """The worker after ``worker_id`` among ``usable`` (registration order, wrapping); None
    when it is the only one. ``ring``: ``_Ring`` of ``usable``'s ids, when the caller asks for
    many workers."""
    ring = ring if ring is not None else _Ring(w.reg.worker_id for w in usable)
    i = ring.index.get(worker_id)
    if i is None or len(usable) < 2:
        return None
    nxt = usable[(i + 1) % len(usable)].reg
    return control_pb2.MemoryPeer(worker_id=nxt.worker_id, address=nxt.address)


def _link_probe(
    links: LinksSpec,
    rank_nodes: list[str],
    workers: dict[str, _Worker],
    worker_id: str,
    ring: _Ring | None = None,
) -> control_pb2.LinkProbe | None:
    """The node agents ``worker_id`` probes for a job whose ranks run on ``rank_nodes`` (index:
    rank): its neighbours in the ring of the job's nodes (in the order of their first rank)
    and rank 0's node; rank 0's node probes every other (so both ends of each link probe it).
    At most 3 peers a node but rank 0's: bounded, not a mesh. None: the job has one node.
    ``ring``: ``_Ring(rank_nodes)``, when the caller asks for many workers."""
    ring = ring if ring is not None else _Ring(rank_nodes)
    nodes, i = ring.ids, ring.index.get(worker_id)
    if len(nodes) < 2 or i is None:
        return None
    n = len(nodes)
    peers = set(nodes) if i == 0 else {nodes[(i - 1) % n], nodes[(i + 1) % n], nodes[0]}
    peers.discard(worker_id)
    probe = control_pb2.LinkProbe(
        interval_seconds=links.probe_seconds,
        degraded_loss=links.degraded_loss,
        down_probes=links.down_probes,
    )
    for peer in sorted(peers, key=ring.index.__getitem__):
        if peer in workers:
            probe.peers.add(worker_id=peer, address=workers[peer].reg.address)
    return probe if probe.peers else None
