"""Exactly-once node agent events across a control restart: per-incarnation sequence numbers,
dedupe and acknowledgement in control's session relay (cursor journaled with the event's
effect), the agent's outbox that keeps events until acknowledged and resends the rest, and
re-attaching the ranks a node agent still runs."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from services.contract import Module, audit_pb2, control_pb2, engine_pb2, worker_pb2
from services.contract.bus import BoundaryViolation
from services.contract.relay import Routed, pack
from services.control.__main__ import build
from services.control.job_store import JobStore
from services.worker.control_link import TOGETHER_MAX_S, Outbox

from .conftest import Plane, drain, kinds, registration, settle, to_ranks

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(30)


def step_event(job_id: str, n: int, seq: int) -> control_pb2.WorkerEvent:
    step = engine_pb2.StepCompleted(job_id=job_id, rank=0, step=n, loss=3.0 - 0.1 * n, tokens=64)
    routed = pack(step, Module.L2_TRAINING_LOOP)
    return control_pb2.WorkerEvent(rank_event=worker_pb2.RankEvent(job_id=job_id, rank=0, routed=routed), seq=seq)


@pytest.fixture(autouse=True)
def store(store_with_no_versions):
    """Every plane of this module asks a store that knows no version."""


def open_plane(db) -> tuple[Plane, JobStore]:
    journal = JobStore(db)
    return Plane(build(journal, data_address="d:1", store_address="s:1", persist_interval_s=0.0)), journal


def running_job(plane: Plane, incarnation: str = "i1"):
    """wa (incarnation ``incarnation``) runs rank 0 of a dp=1 job; RUNNING."""
    reg = registration("wa")
    reg.incarnation = incarnation
    session = plane.c.sessions.open(reg)
    job_id = plane.submit(dp=1, steps=50).job_id
    (launch,) = drain(session)
    plane.rank_event(session, job_id, 0, started=engine_pb2.TrainingLoopStarted(rank=0))
    drain(session)
    return job_id, session, launch.launch


def acks(plane: Plane, session, timeout: float = 5.0) -> list[int]:
    """The EventAck seqs queued on the session (other commands dropped), after an ack held
    for its session's interval (services/control/ack_pacer.py) was queued too."""
    out = []
    deadline = time.monotonic() + timeout
    while session.ack_queued or not session.commands.empty():
        if session.commands.empty():  # held: due within the interval
            assert time.monotonic() < deadline, "an ack held past its interval"
            time.sleep(0.02)
            continue
        cmd = plane.c.sessions.next_command(session)
        if cmd is not None and cmd.WhichOneof("command") == "ack":
            out.append(cmd.ack.seq)
    return out


def test_a_resent_event_is_applied_once_and_every_applied_seq_is_acknowledged(tmp_path):
    plane, journal = open_plane(tmp_path / "control.db")
    job_id, session, _ = running_job(plane)
    hub = plane.c.sessions
    for seq, n in ((1, 1), (2, 2), (3, 3)):
        hub.on_worker_event(session, step_event(job_id, n, seq))
    assert acks(plane, session) == [3]  # coalesced: one ack, of the latest applied seq
    for seq, n in ((2, 2), (3, 3), (4, 4)):  # a reconnect resends 2 and 3 with the new 4
        hub.on_worker_event(session, step_event(job_id, n, seq))
    assert [s for s, _ in journal.steps(job_id)] == [1, 2, 3, 4]
    assert hub.duplicates == 2
    assert acks(plane, session) == [4]
    assert journal.worker_cursor("wa") == ("i1", 4)
    journal.close()


def test_the_last_applied_seq_survives_a_restart_and_a_new_incarnation_starts_a_new_sequence(tmp_path):
    db = tmp_path / "control.db"
    plane, journal = open_plane(db)
    job_id, session, launch = running_job(plane)
    for seq in (1, 2, 3):
        plane.c.sessions.on_worker_event(session, step_event(job_id, seq, seq))
    journal.close()  # control is killed: nothing more is written

    plane, journal = open_plane(db)
    reg = registration("wa")
    reg.incarnation = "i1"
    reg.running.append(launch)  # the agent still runs rank 0: re-attach
    session = plane.c.sessions.open(reg)
    assert session.applied == 3  # sent down as the surge-last-seq header: the agent resends 4..
    plane.c.sessions.on_worker_event(session, step_event(job_id, 3, 3))  # in flight at the kill
    plane.c.sessions.on_worker_event(session, step_event(job_id, 4, 4))
    assert [s for s, _ in journal.steps(job_id)] == [1, 2, 3, 4]
    assert plane.get(job_id).state == JobState.RUNNING and plane.get(job_id).step == 4
    # A restarted node agent (new incarnation) counts from 1 again: nothing of it is applied.
    plane.c.sessions.close(session)
    reg.incarnation = "i2"
    del reg.running[:]
    assert plane.c.sessions.open(reg).applied == 0
    journal.close()


def test_the_cursor_is_journaled_with_the_effect_and_not_when_applying_fails(tmp_path):
    journal = JobStore(tmp_path / "control.db")
    journal.create_job(control_pb2.JobStatus(job_id="j", name="j"), "{}")
    with journal.applying("wa", "i1", 7):
        journal.record_step("j", 1, 2.0, 64, 0.0)
        assert journal.worker_cursor("wa") == ("i1", 7)  # committed with the step row
    with pytest.raises(RuntimeError):
        with journal.applying("wa", "i1", 8):
            raise RuntimeError("the relay failed before any effect")
    assert journal.worker_cursor("wa") == ("i1", 7)
    with journal.applying("wa", "i1", 9):
        pass  # an event with no journaled effect (a heartbeat): the cursor alone
    assert journal.worker_cursor("wa") == ("i1", 9)
    journal.close()


def test_reattached_ranks_hold_their_slots_and_their_job_can_be_released(tmp_path):
    db = tmp_path / "control.db"
    plane, journal = open_plane(db)
    job_id, session, launch = running_job(plane)
    journal.close()

    plane, journal = open_plane(db)
    reg = registration("wa")
    reg.incarnation = "i1"
    reg.running.append(launch)
    session = plane.c.sessions.open(reg)
    other = plane.submit(name="other", dp=1)  # its one slot is the re-attached rank's
    assert (
        other.message
        == "queued: needs 1 rank (parallel.dp=1); 0 are free on 1 registered worker: waits for ranks to free up"
    )
    stopped = plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert stopped.state == JobState.RUNNING
    (stop,) = [c for c in drain(session) if kinds([c]) == ["StopTraining"]]
    assert stop.job_id == to_ranks(stop).job_id == job_id  # relayed to the re-attached rank's node
    plane.rank_event(session, job_id, 0, finished=engine_pb2.TrainingLoopFinished(rank=0, step=9, stopped=True))
    assert (plane.get(job_id).state, plane.get(job_id).outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    settle(lambda: plane.get(other.job_id).state, JobState.WARMING_UP)  # the freed slot goes to the queued job
    assert [c.WhichOneof("command") for c in drain(session)] == ["release", "launch"]
    journal.close()


def test_the_outbox_keeps_events_until_acknowledged_and_resends_the_unacknowledged_ones():
    box = Outbox()
    for n in range(5):
        box.put(control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure(available_bytes=n)))
    never = threading.Event()
    assert box.resume(0) == (5, 0)
    sent = [box.get(never).seq for _ in range(3)]
    assert sent == [1, 2, 3]
    box.ack(1)
    box.pause()  # the stream broke with 2 and 3 in flight, 4 and 5 queued
    # The new control says it applied up to 2: 3 is resent, then 4 and 5.
    assert box.resume(2) == (3, 1)
    assert [box.get(never).seq for _ in range(3)] == [3, 4, 5]
    assert not box.wait_empty(0.01)
    box.ack(5)
    assert box.wait_empty(0.01) and box.resent == 1


def test_the_agents_own_beat_goes_ahead_of_the_queue_without_a_seq_and_is_never_resent():
    box = Outbox()
    box.put(control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure(available_bytes=1)))
    for t in (1.0, 2.0):  # two beats while no session is open: only the newest is kept
        box.beat(control_pb2.WorkerEvent(heartbeat=control_pb2.AgentHeartbeat(unix_time=t)))
    never = threading.Event()
    assert box.resume(0) == (1, 0)
    beat = box.get(never)
    assert (beat.WhichOneof("event"), beat.heartbeat.unix_time, beat.seq) == ("heartbeat", 2.0, 0)
    assert box.get(never).seq == 1
    box.pause()
    assert box.resume(0) == (1, 1)  # the sequenced event is resent, the beat is not
    assert box.get(never).seq == 1


def test_a_nodes_rank_beats_go_in_order_without_a_seq_and_are_neither_acknowledged_nor_resent():
    box = Outbox()
    box.put(control_pb2.WorkerEvent(rank_beats=control_pb2.RankBeats(job_id="j")))  # before any session
    never = threading.Event()
    assert box.resume(0) == (0, 0)  # (old news by the time a session opens: dropped)
    box.put(control_pb2.WorkerEvent(rank_beats=control_pb2.RankBeats(job_id="j")))  # first: an ack must not drop it
    box.put(control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure(available_bytes=1)))
    box.put(control_pb2.WorkerEvent(rank_beats=control_pb2.RankBeats(job_id="j")))
    box.put(control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure(available_bytes=2)))
    box.ack(2)  # (a late ack: nothing of this session sent yet)
    sent = [box.get(never) for _ in range(4)]
    # In the order put (a beat never overtakes a later event of its rank), the beats unsequenced.
    assert [(e.WhichOneof("event"), e.seq) for e in sent] == [
        ("rank_beats", 0), ("memory_pressure", 1), ("rank_beats", 0), ("memory_pressure", 2),
    ]  # fmt: skip
    box.ack(2)
    assert box.wait_empty(0.01)  # the beats were forgotten once sent: nothing waits for an ack of them
    # A beat still queued when the session ends is old news by the next: dropped, not resent.
    box.put(control_pb2.WorkerEvent(rank_beats=control_pb2.RankBeats(job_id="j")))
    box.put(control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure(available_bytes=3)))
    box.pause()
    assert box.resume(2) == (1, 0)
    assert [(e.WhichOneof("event"), e.seq) for e in [box.get(never)]] == [("memory_pressure", 3)]


def test_a_full_outbox_drops_the_oldest_and_the_gap_shows_in_the_sequence():
    box = Outbox(max_events=2)
    for _ in range(3):
        box.put(control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure()))
    box.resume(0)
    never = threading.Event()
    assert [box.get(never).seq for _ in range(2)] == [2, 3] and box.dropped == 1


def test_a_job_restored_with_no_rank_left_is_recovered_on_its_adopted_allocation(tmp_path):
    # Every rank died while control was down: no node agent re-attaches any, yet the
    # recovery the policy decides can relaunch them (the allocation was adopted at restore).
    db = tmp_path / "control.db"
    plane, journal = open_plane(db)
    job_id, session, _ = running_job(plane)
    journal.close()
    plane, journal = open_plane(db)
    reg = registration("wa")
    reg.incarnation = "i1"
    session = plane.c.sessions.open(reg)  # nothing running any more
    plane.rank_exited(session, job_id, 0, exit_code=-9)
    launches = [c.launch for c in drain(session) if c.WhichOneof("command") == "launch"]
    assert [(launch.job_id, [r.rank for r in launch.ranks]) for launch in launches] == [(job_id, [0])]
    assert plane.get(job_id).state == JobState.FAULT_FROZEN  # relaunched, until the rank restores
    journal.close()


def test_with_a_control_that_tracks_no_sequence_sent_events_count_as_delivered():
    box = Outbox()
    never = threading.Event()
    box.put(control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure()))
    assert box.resume(None) == (1, 0)  # no surge-last-seq header
    assert box.get(never).seq == 1 and box.wait_empty(0.01)  # forgotten once sent
    box.put(control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure()))
    box.pause()
    assert box.resume(None) == (1, 0)  # only what was never sent goes on the next session


def test_a_node_agents_own_routed_event_is_published_as_its_sender_and_a_forged_one_refused(plane):
    session = plane.register("wa")
    refused = audit_pb2.BoundaryViolationReported(
        process="wa", sender=Module.L1_ORCHESTRATOR, message="surge.v1.ReleaseRanks", receiver=Module.EXT_HARDWARE
    )
    before = plane.c.bus.snapshot().sent.get(
        (Module.EXT_CONTRACT, "surge.v1.BoundaryViolationReported", Module.L1_FAULT_DETECTOR), 0
    )
    plane.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(routed=pack(refused, Module.EXT_CONTRACT)))
    assert (
        plane.c.bus.snapshot().sent[
            (Module.EXT_CONTRACT, "surge.v1.BoundaryViolationReported", Module.L1_FAULT_DETECTOR)
        ]
        == before + 1
    )
    # A node may not speak for an L1 module: refused, counted, and nothing delivered.
    forged = pack(control_pb2.ReleaseResources(job_id="x"), Module.L1_ORCHESTRATOR, Module.L1_RESOURCE_ALLOCATOR)
    with pytest.raises(BoundaryViolation):
        plane.c.sessions.on_worker_event(session, control_pb2.WorkerEvent(routed=forged))
    assert (
        plane.c.bus.snapshot().refused[
            (Module.L1_ORCHESTRATOR, "surge.v1.ReleaseResources", Module.L1_RESOURCE_ALLOCATOR)
        ]
        >= 1
    )


def test_consecutive_events_go_up_as_one_batch_each_with_its_seq_to_a_control_that_reads_batches():
    # A launch of a node's ranks states each rank's process and start: one message each was
    # 16,384 messages on control's loop for 8,192 ranks (issue 28). What piled up since the
    # last send goes as one WorkerEvent.batch (each event keeps its seq), a fact keeps its place
    # in it (a beat's rank-0 steps and the node's rank beats after them: one message a beat).
    def pressure(n: int) -> control_pb2.WorkerEvent:
        return control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure(available_bytes=n))

    box = Outbox()
    never = threading.Event()
    assert box.resume(0, batches=True) == (0, 0)
    for n in range(3):
        box.put(pressure(n))
    box.put(control_pb2.WorkerEvent(rank_beats=control_pb2.RankBeats(job_id="j")))
    box.put(pressure(3))
    (sent,) = [box.get(never)]
    assert [(e.WhichOneof("event"), e.seq) for e in sent.batch.events] == [
        ("memory_pressure", 1), ("memory_pressure", 2), ("memory_pressure", 3), ("rank_beats", 0), ("memory_pressure", 4),
    ]  # fmt: skip
    box.ack(2)
    box.pause()  # 3 and 4 in flight: resent, together
    assert box.resume(2, batches=True) == (2, 2)
    (again,) = [box.get(never)]
    assert [e.seq for e in again.batch.events] == [3, 4]
    # To a control that does not say it reads batches: one by one, as before.
    box.pause()
    assert box.resume(2) == (2, 2)
    assert [box.get(never).seq for _ in range(2)] == [3, 4]
    for n in range(70):  # at most MAX_BATCH (64) in one message
        box.put(pressure(n))
    box.pause()
    box.resume(4, batches=True)
    assert [len(box.get(never).batch.events) for _ in range(2)] == [64, 6]
    big = control_pb2.WorkerEvent(routed=Routed(type="surge.v1.X", body=b"x" * (600 << 10)))
    for _ in range(2):  # and at most MAX_BATCH_BYTES (1 MiB): these two go alone
        box.put(control_pb2.WorkerEvent.FromString(big.SerializeToString()))
    assert [box.get(never).WhichOneof("event") for _ in range(2)] == ["routed", "routed"]


def test_what_is_put_together_goes_up_as_one_message_and_a_long_block_holds_nothing_back():
    # A rank's RankSession message (a beat period's steps, then its beat) is relayed event by
    # event: the session must not wake after the first and send the rest in a second message.
    def pressure(n: int) -> control_pb2.WorkerEvent:
        return control_pb2.WorkerEvent(memory_pressure=control_pb2.MemoryPressure(available_bytes=n))

    box = Outbox()
    never = threading.Event()
    box.resume(0, batches=True)
    got: queue.Queue = queue.Queue()
    taker = threading.Thread(target=lambda: got.put(box.get(never)), daemon=True)
    taker.start()
    with box.together():
        for n in range(3):
            box.put(pressure(n))
            time.sleep(0.01)  # (the session would have taken the first by now)
        box.put(control_pb2.WorkerEvent(rank_beats=control_pb2.RankBeats(job_id="j")))
    taker.join(10)
    one = got.get(timeout=1)
    assert [(e.WhichOneof("event"), e.seq) for e in one.batch.events] == [
        ("memory_pressure", 1), ("memory_pressure", 2), ("memory_pressure", 3), ("rank_beats", 0),
    ]  # fmt: skip
    # A block that lasts: the session sends what is there after TOGETHER_MAX_S (a report is never held).
    with box.together():
        box.put(pressure(4))
        t0 = time.monotonic()
        assert box.get(never).seq == 4
        assert time.monotonic() - t0 >= TOGETHER_MAX_S * 0.9
