"""The resource allocator: registry, rank layout, quotas, backend, insufficient, release.

The test plays the orchestrator (the allocator's only commander) on the real bus; the
launches land on real in-process node-agent sessions."""

from __future__ import annotations

import pytest

from services.contract import Module, control_pb2, engine_pb2
from services.contract.bus import Bus
from services.control.resource_allocator import RELEASE_GRACE_SECONDS, ResourceAllocator
from services.jobspec import parse_job_spec, spec_to_json

from .conftest import drain, registration, spec_yaml

pytestmark = pytest.mark.timeout(30)


def allocate(plane, job_id: str, dp: int, backend: str = "auto", threads: int = 1):
    return allocate_on(plane.c.bus, job_id, dp, backend, threads)


def allocate_on(bus: Bus, job_id: str, dp: int, backend: str = "auto", threads: int = 1):
    spec = parse_job_spec(spec_yaml(dp=dp, backend=backend, threads=threads))
    msg = control_pb2.AllocateResources(
        job_id=job_id,
        world_size=dp,
        backend=backend,
        init=engine_pb2.InitJob(job_id=job_id, spec_json=spec_to_json(spec)),
    )
    return bus.command(Module.L1_ORCHESTRATOR, Module.L1_RESOURCE_ALLOCATOR, msg).message


def release(plane, job_id: str, kill: bool = False) -> None:
    plane.c.bus.command(
        Module.L1_ORCHESTRATOR, Module.L1_RESOURCE_ALLOCATOR, control_pb2.ReleaseResources(job_id=job_id, kill=kill)
    )


def test_ranks_fill_workers_in_registration_order(plane):
    a = plane.register("wa", slots=2, host="10.0.0.1")
    b = plane.register("wb", slots=2, host="10.0.0.2")
    ready = allocate(plane, "j-1", dp=3, threads=2)
    assert isinstance(ready, control_pb2.ResourcesReady)
    assert (list(ready.worker_ids), ready.master_addr, ready.world_size) == (["wa", "wb"], "10.0.0.1", 3)
    (la,), (lb,) = drain(a), drain(b)
    got = [(r.rank, r.local_rank, r.worker_id) for r in [*la.launch.ranks, *lb.launch.ranks]]
    assert got == [(0, 0, "wa"), (1, 1, "wa"), (2, 0, "wb")]
    ports = {r.master_port for r in [*la.launch.ranks, *lb.launch.ranks]}
    assert ports == {ready.master_port} and ready.master_port > 0
    assert {(r.backend, r.device, r.num_threads, r.world_size) for r in la.launch.ranks} == {("gloo", "cpu", 2, 3)}
    assert la.launch.init.job_id == "j-1"


def test_the_rendezvous_is_rank_0s_advertised_address_not_its_machine_name(plane):
    # Hosts that share a machine name (network namespaces, containers) or whose name other
    # nodes cannot resolve: the rendezvous must be the address the node agent advertised.
    sessions = []
    for worker_id, ip in (("wa", "10.9.0.2"), ("wb", "10.9.0.3")):
        reg = registration(worker_id, host=ip)
        reg.host = "vm"  # socket.gethostname(), the same on both
        sessions.append(plane.c.sessions.open(reg))
    ready = allocate(plane, "j-1", dp=2)
    assert ready.master_addr == "10.9.0.2"
    assert {r.master_addr for s in sessions for (cmd,) in [drain(s)] for r in cmd.launch.ranks} == {"10.9.0.2"}
    again = rebuild(plane, "j-1", version="j-1:1")
    assert again.master_addr == "10.9.0.2"


def test_cpu_quota_is_host_memory_per_slot_and_cuda_quota_is_device_memory(plane):
    cpu = plane.register("cpu", slots=4, memory=16 << 30)
    allocate(plane, "j-cpu", dp=1)
    assert drain(cpu)[0].launch.ranks[0].memory_quota_bytes == 4 << 30
    release(plane, "j-cpu")
    plane.c.sessions.close(cpu)
    gpu = plane.register("gpu", slots=2, cuda=2)
    ready = allocate(plane, "j-gpu", dp=2)
    ranks = drain(gpu)[0].launch.ranks
    assert [(r.device, r.backend, r.memory_quota_bytes) for r in ranks] == [
        ("cuda:0", "nccl", 80 << 30),
        ("cuda:1", "nccl", 80 << 30),
    ]
    assert ready.world_size == 2


def test_insufficient_slots_reserve_nothing(plane):
    a, b = plane.register("wa"), plane.register("wb")
    reply = allocate(plane, "j-big", dp=3)
    assert isinstance(reply, control_pb2.ResourcesInsufficient)
    assert (reply.requested_ranks, reply.available_ranks) == (3, 2)
    assert reply.reason == "2 are free on 2 registered workers"
    assert drain(a) == [] and drain(b) == []
    assert isinstance(allocate(plane, "j-fits", dp=2), control_pb2.ResourcesReady)


def test_nccl_on_cpu_slots_is_refused(plane):
    plane.register("wa")
    reply = allocate(plane, "j-nccl", dp=1, backend="nccl")
    assert isinstance(reply, control_pb2.ResourcesInsufficient)
    # nccl implies parallel.device gpu: only GPU slots count, and none is registered (it waits
    # for a worker with GPUs, not for CPU slots to free up)
    assert (reply.reason, reply.registered_ranks) == ("0 gpu slots are free on 1 registered worker", 0)


def test_release_frees_the_slots_and_tells_each_holding_worker(plane):
    a, b = plane.register("wa"), plane.register("wb")
    allocate(plane, "j-1", dp=2)
    drain(a), drain(b)
    assert isinstance(allocate(plane, "j-2", dp=1), control_pb2.ResourcesInsufficient)
    release(plane, "j-1")
    for session in (a, b):
        (cmd,) = drain(session)
        assert (cmd.release.job_id, cmd.release.kill, cmd.release.grace_seconds) == (
            "j-1",
            False,
            RELEASE_GRACE_SECONDS,
        )
    release(plane, "j-1")  # nothing held any more: a no-op
    assert drain(a) == []
    assert isinstance(allocate(plane, "j-2", dp=2), control_pb2.ResourcesReady)


def test_a_withdrawn_worker_has_no_slots_and_a_reregistered_one_keeps_its_busy_slots(plane):
    plane.register("wa", slots=2), plane.register("wb")
    allocate(plane, "j-1", dp=2)  # wa: slots 0 and 1
    # Zero slots: the relay's encoding of "this node agent is gone".
    plane.c.bus.publish(Module.EXT_HARDWARE, control_pb2.WorkerRegistration(worker_id="wb", slots=0))
    assert allocate(plane, "j-2", dp=1).reason == "0 are free on 1 registered worker"
    # A reconnect with three slots: the job's two ranks may still run there.
    plane.c.bus.publish(Module.EXT_HARDWARE, registration("wa", slots=3))
    assert allocate(plane, "j-2", dp=2).reason == "1 is free on 1 registered worker"
    release(plane, "j-1")
    assert list(allocate(plane, "j-2", dp=3).worker_ids) == ["wa"]


def rebuild(plane, job_id: str, version: str = "", exclude=()):
    msg = control_pb2.RebuildCommunicator(
        job_id=job_id, reason="test", resume_version=version, exclude_worker_ids=exclude
    )
    return plane.c.bus.command(Module.L1_RECOVERY_CONTROLLER, Module.L1_RESOURCE_ALLOCATOR, msg).message


def test_a_rebuild_kills_the_ranks_and_relaunches_them_on_a_fresh_port_with_the_version_to_load(plane):
    a, b = plane.register("wa"), plane.register("wb")
    first = allocate(plane, "j-1", dp=2)
    drain(a), drain(b)
    again = rebuild(plane, "j-1", version="j-1:3")
    assert isinstance(again, control_pb2.ResourcesReady) and list(again.worker_ids) == ["wa", "wb"]
    assert again.master_port != first.master_port
    for session, rank in ((a, 0), (b, 1)):
        kill, launch = drain(session)  # in this order on each session: the agent reaps, then starts
        assert (kill.release.job_id, kill.release.kill) == ("j-1", True)
        assert [r.rank for r in launch.launch.ranks] == [rank]
        assert launch.launch.ranks[0].master_port == again.master_port
        assert launch.launch.init.resume_version == "j-1:3"


def test_a_relaunch_puts_each_rank_back_where_it_ran_when_that_slot_is_still_there(plane):
    # Each node keeps its ranks' memory copies (issue 29 item 8): a rank relaunched on its own
    # node reads its state from memory there (1.3 s against 2.2 s from the store, `make bench`).
    # Placed in registration order instead, a worker freed meanwhile took rank 0 and moved the
    # rest one node on: every rank read the store (ci14, test_memory_recovery).
    a, b, c = plane.register("wa"), plane.register("wb"), plane.register("wc")
    allocate(plane, "other", dp=1)  # wa
    allocate(plane, "j-1", dp=2)  # wb, wc
    release(plane, "other", kill=True)  # wa is free again
    drain(a), drain(b), drain(c)
    again = rebuild(plane, "j-1", version="j-1:3")
    assert list(again.rank_worker_ids) == ["wb", "wc"]
    launched = {s: [r.rank for k in drain(session) if k.WhichOneof("command") == "launch" for r in k.launch.ranks]
                for s, session in (("wa", a), ("wb", b), ("wc", c))}  # fmt: skip
    assert launched == {"wa": [], "wb": [0], "wc": [1]}
    # Its node gone, a rank goes to the first free slot; the others stay where they ran.
    plane.c.bus.publish(Module.EXT_HARDWARE, control_pb2.WorkerRegistration(worker_id="wb", slots=0))
    assert list(rebuild(plane, "j-1", version="j-1:4").rank_worker_ids) == ["wa", "wc"]


def test_a_lost_nodes_rank_is_relaunched_on_the_node_that_holds_its_memory_copy(plane):
    # wb's memory peer is wc (the next registered worker): wc holds the copy of rank 0's state.
    # Placed in registration order it went to wa, where no copy was (ci14's flaky memory test).
    plane.register("wa"), plane.register("wb"), plane.register("wc", slots=2)
    allocate(plane, "other", dp=1)  # wa
    first = allocate(plane, "j-1", dp=2)  # wb, wc
    assert list(first.rank_worker_ids) == ["wb", "wc"]
    release(plane, "other", kill=True)
    plane.c.bus.publish(Module.EXT_HARDWARE, control_pb2.WorkerRegistration(worker_id="wb", slots=0))
    assert list(rebuild(plane, "j-1", version="j-1:4").rank_worker_ids) == ["wc", "wc"]


def test_a_rebuild_excluding_a_worker_places_the_ranks_elsewhere_or_reports_they_do_not_fit(plane):
    plane.register("wa")
    b = plane.register("wb")
    plane.register("wc")
    allocate(plane, "j-1", dp=2)  # wa, wb
    again = rebuild(plane, "j-1", exclude=["wb"])
    assert list(again.worker_ids) == ["wa", "wc"]
    assert [cmd.WhichOneof("command") for cmd in drain(b)] == ["launch", "release"]  # killed, not relaunched
    short = rebuild(plane, "j-1", exclude=["wa"])  # wb stays excluded: only wc is left
    assert isinstance(short, control_pb2.ResourcesInsufficient)
    assert short.reason == "1 is free on 1 registered worker (excluding wa, wb)"
    assert isinstance(rebuild(plane, "j-unknown"), control_pb2.ResourcesInsufficient)


def test_a_kill_of_a_job_unknown_here_goes_to_every_worker(plane):
    # e.g. a job restored after a restart whose ranks may still run somewhere
    a, b = plane.register("wa"), plane.register("wb")
    release(plane, "j-before-restart", kill=True)
    for session in (a, b):
        (cmd,) = drain(session)
        assert (cmd.release.job_id, cmd.release.kill, cmd.release.grace_seconds) == ("j-before-restart", True, 0.0)


def test_memory_pressure_on_a_worker_is_published_naming_the_jobs_holding_ranks_there():
    # The allocator alone on a real bus: the test subscribes where the node agents'
    # relay and the orchestrator would, and records what reaches them.
    bus = Bus()
    launches: list[str] = []
    pressures: list[control_pb2.ResourcePressure] = []
    bus.subscribe(Module.EXT_HARDWARE, control_pb2.LaunchRanks, lambda msg, worker_id: launches.append(worker_id))
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.ResourcePressure, lambda msg, payload: pressures.append(msg))
    allocator = ResourceAllocator(
        hardware=bus.port(Module.L1_RESOURCE_ALLOCATOR, Module.EXT_HARDWARE),
        emit=bus.emitter(Module.L1_RESOURCE_ALLOCATOR),
    )
    for msg_type, handler in (
        (control_pb2.WorkerRegistration, allocator.on_worker_registration),
        (control_pb2.MemoryPressure, allocator.on_memory_pressure),
        (control_pb2.AllocateResources, allocator.allocate_resources),
    ):
        bus.subscribe(Module.L1_RESOURCE_ALLOCATOR, msg_type, handler)
    bus.publish(Module.EXT_HARDWARE, registration("wa", slots=2))
    bus.publish(Module.EXT_HARDWARE, registration("wb", slots=2))
    allocate_on(bus, "j-both", dp=3)  # wa: ranks 0, 1; wb: rank 2
    allocate_on(bus, "j-wb", dp=1)  # wb
    assert launches == ["wa", "wb", "wb"]

    def report(worker_id: str, under: bool, available: int) -> None:
        bus.publish(
            Module.EXT_HARDWARE,
            control_pb2.MemoryPressure(
                worker_id=worker_id, available_bytes=available, total_bytes=24 << 30, under_pressure=under
            ),
        )

    report("wb", True, 1 << 30)
    (p,) = pressures
    assert (p.worker_id, list(p.job_ids), p.available_bytes, p.total_bytes, p.under_pressure) == (
        "wb",
        ["j-both", "j-wb"],
        1 << 30,
        24 << 30,
        True,
    )
    report("wb", True, 1 << 29)  # no change of state: nothing new to say
    assert len(pressures) == 1
    report("wa", True, 2 << 30)
    assert [(q.worker_id, list(q.job_ids)) for q in pressures[1:]] == [("wa", ["j-both"])]
    report("wb", False, 12 << 30)
    assert [(q.worker_id, list(q.job_ids), q.available_bytes, q.under_pressure) for q in pressures[2:]] == [
        ("wb", ["j-both", "j-wb"], 12 << 30, False),
    ]
    report("gone", True, 1 << 30)  # not registered (or withdrawn): no worker, no jobs
    assert len(pressures) == 3


def test_a_departing_worker_gets_no_rank_until_it_registers_again_and_a_rebuild_that_did_not_fit_can_be_repeated(plane):
    a, b = plane.register("wa"), plane.register("wb")
    allocate(plane, "j-1", dp=2)  # wa, wb
    drain(a), drain(b)
    departing = registration("wb")
    departing.departing = True
    plane.c.bus.publish(Module.EXT_HARDWARE, departing)  # wb's agent was asked to stop
    short = rebuild(plane, "j-1", version="j-1:2")
    assert isinstance(short, control_pb2.ResourcesInsufficient)
    assert short.reason == "1 is free on 1 placeable of 2 registered workers (wb leaving)"
    assert [c.WhichOneof("command") for c in drain(b)] == ["release"]  # killed there, nothing relaunched
    back = plane.register("wb")  # restarted in place: a new registration under the same id
    again = rebuild(plane, "j-1", version="j-1:2")  # the allocation was kept: the same command places it
    assert isinstance(again, control_pb2.ResourcesReady) and list(again.worker_ids) == ["wa", "wb"]
    (launch,) = [c.launch for c in drain(back) if c.WhichOneof("command") == "launch"]
    assert ([r.rank for r in launch.ranks], launch.init.resume_version) == ([1], "j-1:2")


def test_each_launch_names_the_next_worker_as_the_peer_of_its_memory_copies(plane):
    a = plane.register("wa", slots=2, host="10.0.0.1")
    b = plane.register("wb", slots=1, host="10.0.0.2")
    c = plane.register("wc", slots=1, host="10.0.0.3")
    allocate(plane, "j-ring", dp=3)  # ranks on wa (2) and wb: wc holds none, yet is wb's peer
    (la,), (lb,) = drain(a), drain(b)
    assert drain(c) == []
    assert (la.launch.memory_peer.worker_id, la.launch.memory_peer.address) == ("wb", "10.0.0.2:0")
    assert (lb.launch.memory_peer.worker_id, lb.launch.memory_peer.address) == ("wc", "10.0.0.3:0")
    release(plane, "j-ring")
    plane.c.sessions.close(b)
    plane.c.sessions.close(c)
    allocate(plane, "j-alone", dp=1)  # one worker left: no peer
    assert not drain(a)[-1].launch.HasField("memory_peer")
