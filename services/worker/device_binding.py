"""Where a rank runs on its node: the device it sees, its CPUs, its torchrun variables.

One pure function, :func:`bind_rank`, from what L1-2 assigned (``RankAssignment.device``:
the node's physical index, ``cuda:5``) and what the node registered (its devices, with
their NUMA node and local CPUs where it reports them) to what the rank process gets:

* ``CUDA_VISIBLE_DEVICES=<physical index>`` (with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so the
  index means what ``nvidia-smi`` and the registration mean by it): the rank sees exactly
  its own GPU, as ``cuda:0``, and that is the device it is told (the assignment it gets
  says ``cuda:0``). A process that sees one device cannot touch another rank's (no stray
  CUDA context on GPU 0); NCCL still finds its peers' GPUs by bus id and uses P2P/NVLink
  between processes that cannot see each other's device (CUDA >= 10.1).
* ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` as torchrun sets them: the rank's place among the
  job's ranks on this node and their number (``local_rank``, ``local_world_size``, which
  L1-2 sets; from an older L1-2, ``rank_nodes``), for code that does
  node-local work once. They are not a device ordinal here: the rank's device is set
  (``torch.cuda.set_device``) before any DeviceMesh, so torch's LOCAL_RANK fallback in
  DeviceMesh never applies.
* CPU affinity near the GPU: the GPU's local CPUs (its NUMA node's, as the node reported
  them) split evenly among the node's GPUs that share them, in device order, so ranks on
  one node never share a CPU whatever job holds the other GPUs (torchrun's
  ``--numa-binding=exclusive`` does the same by physical core: ``torch/numa/binding.py``).
  The slice travels as ``SURGE_CPU_AFFINITY`` (a cpulist) and the rank applies it
  (``os.sched_setaffinity``) before its threads start; ``SURGE_NUMA_NODE`` names the node.
* ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``: ``num_threads`` (the spec's
  ``parallel.threads_per_rank``, 1 by default as torchrun sets for several processes per
  node); an assignment without one gets the size of its CPU slice (a rank pinned to its
  own CPUs can use them all without oversubscribing).

A ``cpu`` rank (no GPU) is neither masked nor pinned, as before; a bare ``cuda`` sees every
device. A device the node did not register is still masked: the rank then sees no device
and refuses it in one line (``services/engine/parallel_strategy.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.cpu_list import CPU_AFFINITY_ENV, format_cpu_list, parse_cpu_list
from services.contract import control_pb2, engine_pb2

NUMA_NODE_ENV = "SURGE_NUMA_NODE"


@dataclass(frozen=True)
class RankBinding:
    """What :func:`bind_rank` gives a rank: ``env``, the variables set on top of the agent's;
    ``device``, the device the rank uses ("cuda:0", "cuda" or "cpu"); ``cpus``, the CPUs it
    is pinned to (empty: not pinned); ``numa_node`` (None: not reported)."""

    env: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    cpus: tuple[int, ...] = ()
    numa_node: int | None = None


def cuda_index(device: str) -> int | None:
    """Physical CUDA index of an assignment's device ("cuda:3" -> 3); None for "cpu" or a
    bare "cuda" (then the rank sees every device)."""
    m = re.fullmatch(r"cuda:(\d+)", device.strip())
    return int(m.group(1)) if m else None


def bind_rank(assignment: engine_pb2.RankAssignment, node_devices: Sequence[control_pb2.Device]) -> RankBinding:
    """The binding of the rank ``assignment`` names on a node with ``node_devices`` (its
    registration's devices). Pure: the same inputs give the same binding (module docstring)."""
    env: dict[str, str] = {}
    local_rank, local_world_size = _local_place(assignment)
    env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"] = str(local_rank), str(local_world_size)
    index = cuda_index(assignment.device)
    device = assignment.device.strip() or "cpu"
    cpus: tuple[int, ...] = ()
    numa_node: int | None = None
    if index is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(index)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the numbering of nvidia-smi and of the registration
        device = "cuda:0"  # the only device the rank sees
        gpu = next((d for d in node_devices if d.kind == "cuda" and d.index == index), None)
        if gpu is not None:
            numa_node = gpu.numa_node if gpu.HasField("numa_node") else None
            cpus = _cpu_slice(gpu, node_devices)
    if cpus:
        env[CPU_AFFINITY_ENV] = format_cpu_list(cpus)
    if numa_node is not None:
        env[NUMA_NODE_ENV] = str(numa_node)
    threads = assignment.num_threads or len(cpus)
    if threads > 0:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return RankBinding(env=env, device=device, cpus=cpus, numa_node=numa_node)


def _local_place(assignment: engine_pb2.RankAssignment) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE): the rank's index among the job's ranks on its node
    and their number, as L1-2 sends them (``local_world_size`` set), else from ``rank_nodes``
    (index = rank: an older L1-2's launch sent the world's nodes); without either, one node."""
    nodes = list(assignment.rank_nodes)
    if assignment.local_world_size and not nodes:
        return assignment.local_rank, assignment.local_world_size
    if assignment.rank >= len(nodes):
        return assignment.rank, max(assignment.world_size, assignment.rank + 1)
    mine = nodes[assignment.rank]
    return nodes[: assignment.rank].count(mine), nodes.count(mine)


def _cpu_slice(gpu: control_pb2.Device, node_devices: Sequence[control_pb2.Device]) -> tuple[int, ...]:
    """``gpu``'s share of its local CPUs: they are split into equal contiguous parts among
    the node's GPUs with the same local CPUs, in device index order (a remainder goes to
    the first parts). Empty when the node reported none."""
    if not gpu.cpu_list:
        return ()
    try:
        local = parse_cpu_list(gpu.cpu_list)
    except ValueError:
        return ()
    sharing = sorted(d.index for d in node_devices if d.kind == "cuda" and d.cpu_list == gpu.cpu_list)
    parts, place = len(sharing), sharing.index(gpu.index)
    size, extra = divmod(len(local), parts)
    if size == 0:  # fewer CPUs than GPUs: every GPU's rank gets them all rather than none
        return tuple(local)
    start = place * size + min(place, extra)
    return tuple(local[start : start + size + (1 if place < extra else 0)])
