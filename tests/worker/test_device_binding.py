"""The rank's binding on its node (services/worker/device_binding.py): the device it is told
is the device it sees, its CPUs near its GPU, torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE; and
where the node agent learns where each GPU sits (services/worker/hardware.py, from a
stand-in nvidia-smi and a sysfs tree written here: no GPU on this machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common.cpu_list import format_cpu_list, parse_cpu_list
from services.contract import control_pb2, engine_pb2
from services.worker.device_binding import bind_rank
from services.worker.hardware import detect_cuda_devices, sysfs_bus_id


def gpu(index: int, cpus: str = "", numa: int | None = None) -> control_pb2.Device:
    d = control_pb2.Device(kind="cuda", index=index, name="NVIDIA H200", memory_bytes=141 * 2**30, cpu_list=cpus)
    if numa is not None:
        d.numa_node = numa
    return d


def assignment(rank: int, device: str, rank_nodes: list[str], threads: int = 0) -> engine_pb2.RankAssignment:
    return engine_pb2.RankAssignment(
        rank=rank,
        world_size=len(rank_nodes),
        device=device,
        num_threads=threads,
        rank_nodes=rank_nodes,
        worker_id=rank_nodes[rank] if rank_nodes else "",
    )


ONE_GPU = [gpu(0, "0-15", 0)]
TWO_GPUS = [gpu(0, "0-31", 0), gpu(1, "0-31", 0)]
# Two sockets: GPUs 0-3 on NUMA node 0 (CPUs 0-31), 4-7 on node 1 (CPUs 32-63).
EIGHT_GPUS = [gpu(i, "0-31" if i < 4 else "32-63", 0 if i < 4 else 1) for i in range(8)]

# (case, node devices, rank, device, rank_nodes, num_threads) ->
# (CUDA_VISIBLE_DEVICES, device told, LOCAL_RANK, LOCAL_WORLD_SIZE, CPUs, NUMA node, OMP threads)
CASES = [
    ("1 GPU per node", ONE_GPU, 0, "cuda:0", ["a"], 0, ("0", "cuda:0", "0", "1", "0-15", "0", "16")),
    ("2 per node, rank 0", TWO_GPUS, 0, "cuda:0", ["a", "a"], 0, ("0", "cuda:0", "0", "2", "0-15", "0", "16")),
    ("2 per node, rank 1", TWO_GPUS, 1, "cuda:1", ["a", "a"], 0, ("1", "cuda:0", "1", "2", "16-31", "0", "16")),
    ("8 per node, rank 0", EIGHT_GPUS, 0, "cuda:0", ["a"] * 8, 0, ("0", "cuda:0", "0", "8", "0-7", "0", "8")),
    ("8 per node, rank 3", EIGHT_GPUS, 3, "cuda:3", ["a"] * 8, 0, ("3", "cuda:0", "3", "8", "24-31", "0", "8")),
    ("8 per node, rank 4", EIGHT_GPUS, 4, "cuda:4", ["a"] * 8, 0, ("4", "cuda:0", "4", "8", "32-39", "1", "8")),
    ("8 per node, rank 7", EIGHT_GPUS, 7, "cuda:7", ["a"] * 8, 0, ("7", "cuda:0", "7", "8", "56-63", "1", "8")),
    # A job on GPUs 2 and 5 of 8: each rank keeps its GPU's own slice (a second job on the
    # other GPUs never shares a CPU with it), and they are local ranks 0 and 1 of 2.
    ("GPUs 2,5 of 8: rank 0", EIGHT_GPUS, 0, "cuda:2", ["a", "a"], 0, ("2", "cuda:0", "0", "2", "16-23", "0", "8")),
    ("GPUs 2,5 of 8: rank 1", EIGHT_GPUS, 1, "cuda:5", ["a", "a"], 0, ("5", "cuda:0", "1", "2", "40-47", "1", "8")),
    # Two nodes of 8: rank 11 is the fourth rank of node b.
    ("2 nodes of 8, rank 11", EIGHT_GPUS, 11, "cuda:3", ["a"] * 8 + ["b"] * 8, 0,
     ("3", "cuda:0", "3", "8", "24-31", "0", "8")),
    ("threads_per_rank wins", EIGHT_GPUS, 1, "cuda:1", ["a"] * 8, 4, ("1", "cuda:0", "1", "8", "8-15", "0", "4")),
    # A node that reports no NUMA node or local CPUs: masked, not pinned.
    ("no locality reported", [gpu(0), gpu(1)], 1, "cuda:1", ["a", "a"], 0, ("1", "cuda:0", "1", "2", "", "", "")),
    # A device the node never registered is still masked (the rank then refuses it).
    ("unregistered GPU", TWO_GPUS, 0, "cuda:9", ["a"], 0, ("9", "cuda:0", "0", "1", "", "", "")),
    # CPU ranks: no mask, no pinning, the spec's thread count.
    ("cpu rank", [], 1, "cpu", ["a", "a"], 2, ("", "cpu", "1", "2", "", "", "2")),
    ("bare cuda sees all", TWO_GPUS, 0, "cuda", [], 0, ("", "cuda", "0", "1", "", "", "")),
]  # fmt: skip


@pytest.mark.parametrize(
    "node, rank, device, rank_nodes, threads, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_rank_is_told_the_device_it_sees_and_bound_near_its_gpu(node, rank, device, rank_nodes, threads, expected):
    binding = bind_rank(assignment(rank, device, rank_nodes, threads), node)
    env = binding.env
    got = (
        env.get("CUDA_VISIBLE_DEVICES", ""),
        binding.device,
        env["LOCAL_RANK"],
        env["LOCAL_WORLD_SIZE"],
        env.get("SURGE_CPU_AFFINITY", ""),
        env.get("SURGE_NUMA_NODE", ""),
        env.get("OMP_NUM_THREADS", ""),
    )
    assert got == expected
    assert env.get("MKL_NUM_THREADS", "") == expected[6]
    if expected[0]:
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # the index means nvidia-smi's
    assert format_cpu_list(binding.cpus) == expected[4]


@pytest.mark.parametrize(
    "node, rank, device, rank_nodes, threads, expected",
    [c[1:] for c in CASES if c[4]],
    ids=[c[0] for c in CASES if c[4]],
)
def test_a_ranks_place_on_its_node_as_l1_2_sends_it_binds_as_the_worlds_list_did(
    node, rank, device, rank_nodes, threads, expected
):
    """L1-2 sends no list of the world's nodes now (issue 28, launch35): each assignment says
    the rank's place among its node's ranks (``local_rank``, ``local_world_size``). The same
    binding as the list gave (the old code, without the list: LOCAL_RANK 11 of 16 for rank 11
    of two nodes of 8, where it is 3 of 8)."""
    told = assignment(rank, device, [], threads)
    told.world_size, told.worker_id = len(rank_nodes), rank_nodes[rank]
    told.local_rank = rank_nodes[:rank].count(rank_nodes[rank])
    told.local_world_size = rank_nodes.count(rank_nodes[rank])
    legacy = bind_rank(assignment(rank, device, rank_nodes, threads), node)
    binding = bind_rank(told, node)
    assert (binding.env, binding.device, binding.cpus) == (legacy.env, legacy.device, legacy.cpus)
    assert (binding.env["LOCAL_RANK"], binding.env["LOCAL_WORLD_SIZE"]) == expected[2:4]


def test_every_rank_of_a_full_node_gets_its_own_cpus_and_together_all_of_them():
    bindings = [bind_rank(assignment(r, f"cuda:{r}", ["a"] * 8), EIGHT_GPUS) for r in range(8)]
    cpus = [c for b in bindings for c in b.cpus]
    assert sorted(cpus) == list(range(64)) and len(set(cpus)) == 64
    assert {b.device for b in bindings} == {"cuda:0"}
    assert [b.env["CUDA_VISIBLE_DEVICES"] for b in bindings] == [str(r) for r in range(8)]


def test_an_uneven_split_gives_the_remainder_to_the_first_gpus():
    node = [gpu(i, "0-9", 0) for i in range(3)]
    assert [format_cpu_list(bind_rank(assignment(0, f"cuda:{i}", ["a"]), node).cpus) for i in range(3)] == [
        "0-3",
        "4-6",
        "7-9",
    ]


def test_cpu_lists_read_and_write_as_the_kernel_does():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")


def test_bus_ids_become_sysfs_names():
    assert sysfs_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert sysfs_bus_id("0000:dc:00.0") == "0000:dc:00.0"
    assert sysfs_bus_id("[N/A]") is None


def fake_node(tmp: Path, smi_lines: list[str], pci: dict[str, tuple[str, str]]) -> tuple[Path, Path]:
    """A stand-in ``nvidia-smi`` printing ``smi_lines`` for the agent's query, and a sysfs
    tree with ``numa_node`` and ``local_cpulist`` per PCI bus id."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    body = "".join(f"{line}\\n" for line in smi_lines)
    exe.write_text(f"#!/bin/sh\ncase \"$1\" in --query-gpu=index,name,memory.total,pci.bus_id) ;; *) exit 9;; esac\n"
                   f"printf '{body}'\n")  # fmt: skip
    exe.chmod(0o755)
    sysfs = tmp / "sys"
    for bus_id, (numa, cpus) in pci.items():
        d = sysfs / "bus" / "pci" / "devices" / bus_id
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{numa}\n")
        (d / "local_cpulist").write_text(f"{cpus}\n")
    return bin_dir, sysfs


def test_the_node_reports_each_gpus_numa_node_and_local_cpus_from_sysfs(tmp_path, monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    mine = format_cpu_list(allowed)
    bin_dir, sysfs = fake_node(
        tmp_path,
        [
            "0, NVIDIA H200, 143771, 00000000:1B:00.0",
            "1, NVIDIA H200, 143771, 00000000:9C:00.0",
            "2, NVIDIA H200, 143771, 00000000:DC:00.0",
        ],
        # GPU 0: this machine's CPUs plus one it may not use (a cpuset narrows them);
        # GPU 1: no NUMA information (-1); GPU 2: no sysfs entry at all.
        {"0000:1b:00.0": ("1", f"{mine},{max(allowed) + 1000}"), "0000:9c:00.0": ("-1", mine)},
    )
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = detect_cuda_devices(str(sysfs))
    got = [
        (d.index, d.pci_bus_id, d.numa_node if d.HasField("numa_node") else None, d.cpu_list, d.memory_bytes)
        for d in devices
    ]
    assert got == [
        (0, "0000:1b:00.0", 1, mine, 143771 * 2**20),
        (1, "0000:9c:00.0", None, mine, 143771 * 2**20),
        (2, "0000:dc:00.0", None, "", 143771 * 2**20),
    ]
    # ... and what the node reported is what a rank on GPU 0 is pinned to: its half of the
    # CPUs it shares with GPU 1.
    binding = bind_rank(assignment(0, "cuda:0", ["a"]), devices)
    half = allowed[: (len(allowed) + 1) // 2] if len(allowed) > 1 else allowed
    assert binding.env["SURGE_NUMA_NODE"] == "1" and list(binding.cpus) == half
