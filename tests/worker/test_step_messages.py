"""Fewer RankSession messages per step (issue 28 item 3: the stack's CPU per step): a rank's
session sends what it has queued as one message (``RankEvent.more``), a rank other than 0 its
step's events with its next beat (services/rank/session_batches.py), the agent takes each
event of it as if it came alone; the store's acks of a rank's metric records go down at once
only when the rank waits on them, else with its next beat (services/worker/metric_acks.py)."""

from __future__ import annotations

import itertools
import queue
import threading
import time

import pytest

from services.common.phase import PhaseMarker
from services.contract import Module, engine_pb2, store_pb2, worker_pb2
from services.contract.relay import pack
from services.rank import session_batches
from services.rank.__main__ import Session
from services.worker.metric_acks import MetricAcks
from services.worker.rank_session import unbatched

pytestmark = pytest.mark.timeout(30)

KEY = ("j", 1, 4242)


def ev(**kw) -> worker_pb2.RankEvent:
    return worker_pb2.RankEvent(job_id="j", rank=1, **kw)


def step_record(seq: int, step: int) -> worker_pb2.RankEvent:
    return ev(metrics=store_pb2.MetricRecord(seq=seq, step=engine_pb2.StepCompleted(step=step)))


def requests_of(events: list) -> tuple[list[worker_pb2.RankEvent], queue.Queue]:
    """The messages ``Session._requests`` yields for ``events`` all queued before it runs."""
    session = object.__new__(Session)  # (no channel: only its queue and request generator)
    session._out = queue.Queue()
    for e in events:
        session._out.put(e)
    return list(session._requests()), session._out


# ------------------------------------------------------------------ RankEvent.more


def test_what_is_queued_together_goes_as_one_message_in_order_and_comes_apart_at_the_agent():
    beat = ev(heartbeat=worker_pb2.RankHeartbeat(job_id="j", rank=1, step=6))
    messages, _ = requests_of([ev(hello=worker_pb2.RankHello(job_id="j", rank=1)), step_record(1, 7), beat, None])
    assert len(messages) == 1 and len(messages[0].more) == 2
    parts = unbatched(messages[0])
    assert [p.WhichOneof("event") for p in parts] == ["hello", "metrics", "heartbeat"]
    assert parts[1].metrics.step.step == 7 and parts[2].heartbeat.step == 6
    assert all(not p.more for p in parts)  # (relayed up as they are: nothing rides twice)


def test_the_end_of_the_queue_still_sends_what_came_before_it_and_nothing_after():
    messages, out = requests_of([step_record(1, 1), None, step_record(2, 2)])
    assert [len(unbatched(m)) for m in messages] == [1]
    assert out.qsize() == 1  # (what came after the end is not sent)


def test_a_lone_event_goes_alone_and_a_later_one_in_its_own_message():
    session = object.__new__(Session)
    session._out = queue.Queue()
    gen = session._requests()
    session._out.put(step_record(1, 1))
    first = next(gen)
    got: list = []
    t = threading.Thread(target=lambda: got.append(next(gen)))
    t.start()
    session._out.put(step_record(2, 2))
    t.join(5)
    assert not first.more and first.metrics.seq == 1 and got[0].metrics.seq == 2


def test_a_message_without_more_is_itself():
    e = step_record(3, 3)
    assert unbatched(e) == [e]


# ------------------------------------------------------------------ a step's events ride with the beat


def step_completed(step: int) -> worker_pb2.RankEvent:
    return ev(routed=pack(engine_pb2.StepCompleted(job_id="j", rank=1, step=step), Module.L2_TRAINING_LOOP))


def sender(ride_s: float) -> tuple[queue.Queue, queue.Queue, threading.Thread]:
    """``session_batches.messages`` on a thread: (the rank's queue, the messages sent, the thread)."""
    out: queue.Queue = queue.Queue()
    sent: queue.Queue = queue.Queue()

    def run() -> None:
        for message in session_batches.messages(out, lambda: ride_s):
            sent.put(message)
        sent.put(None)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return out, sent, t


def test_a_steps_events_wait_for_the_next_beat_and_go_with_it_in_order():
    out, sent, _ = sender(ride_s=60)
    for n in (1, 2):
        out.put(step_completed(n))
        out.put(step_record(n, n))
    with pytest.raises(queue.Empty):
        sent.get(timeout=0.5)  # (a step's events wait: the beat comes within its period)
    out.put(ev(heartbeat=worker_pb2.RankHeartbeat(job_id="j", rank=1, step=2)))
    parts = unbatched(sent.get(timeout=10))
    assert [p.WhichOneof("event") for p in parts] == ["routed", "metrics", "routed", "metrics", "heartbeat"]
    assert [p.metrics.seq for p in parts if p.HasField("metrics")] == [1, 2]


def test_a_steps_events_wait_at_most_the_period():
    out, sent, _ = sender(ride_s=0.4)
    t0 = time.monotonic()
    out.put(step_completed(1))
    out.put(step_record(1, 1))
    message = sent.get(timeout=20)
    assert time.monotonic() - t0 >= 0.35  # (a bound that holds on a loaded host: waits only get longer)
    assert [p.WhichOneof("event") for p in unbatched(message)] == ["routed", "metrics"]


@pytest.mark.parametrize(
    "boundary",
    [
        pack(store_pb2.SaveCompleted(job_id="j", step=2, version="j:1"), Module.L5_CHECKPOINT_MANAGER),
        pack(engine_pb2.TrainingLoopPaused(job_id="j", rank=1, step=2), Module.L2_TRAINING_LOOP),
        pack(engine_pb2.TrainingLoopFinished(job_id="j", rank=1), Module.L2_TRAINING_LOOP),
        None,  # the session's end
        store_pb2.MetricRecord(seq=3, stop=store_pb2.StopLogCollection(job_id="j")),
    ],
)
def test_anything_else_sends_what_waits_at_once(boundary):
    out, sent, t = sender(ride_s=60)
    out.put(step_completed(2))
    out.put(step_record(2, 2))
    if boundary is None:
        out.put(None)
    elif isinstance(boundary, store_pb2.MetricRecord):
        out.put(ev(metrics=boundary))
    else:
        out.put(ev(routed=boundary))
    parts = unbatched(sent.get(timeout=10))  # (not the 60 s)
    assert [p.WhichOneof("event") for p in parts][:2] == ["routed", "metrics"]
    assert len(parts) == (2 if boundary is None else 3)
    if boundary is None:
        assert sent.get(timeout=10) is None
        t.join(10)


def test_every_ranks_steps_ride_for_a_beat_period():
    zero = object.__new__(Session)
    zero._rank, zero._beat_interval = 0, 2.0
    other = object.__new__(Session)
    other._rank, other._beat_interval = 1, 2.0
    assert zero._ride_s() == 2.0 and other._ride_s() == 2.0
    assert session_batches.rides(step_completed(1)) and session_batches.rides(step_record(1, 1))
    assert not session_batches.rides(ev(heartbeat=worker_pb2.RankHeartbeat(job_id="j", rank=1)))
    assert not session_batches.rides(ev(metrics=store_pb2.MetricRecord(eval=engine_pb2.EvalCompleted(job_id="j"))))


def test_the_steps_control_decides_on_at_once_are_the_loops_first_a_new_agreement_and_a_skip():
    urgency = session_batches.StepUrgency()
    S = engine_pb2.StepCompleted
    assert urgency.at_once(S(step=1))  # (the loop's first: a recovery's or a resize's end)
    assert not urgency.at_once(S(step=2))
    assert urgency.at_once(S(step=3, commands_agreed=1))  # (a pause / stop / scale / revoke's boundary)
    assert not urgency.at_once(S(step=4, commands_agreed=1))
    assert urgency.at_once(S(step=5, commands_agreed=1, skipped=True))
    assert not urgency.at_once(S(step=6, commands_agreed=1))
    urgency.started()  # (a new loop: a resume, a rebuild in place)
    assert urgency.at_once(S(step=7, commands_agreed=1))


def rank_session(rank: int) -> Session:
    """A ``Session`` without a channel: its queue, its request generator and ``send_up``."""
    session = object.__new__(Session)
    session._out, session._rank, session._beat_interval = session_batches.Outgoing(), rank, 60.0
    session._progress_lock, session._phase = threading.Lock(), PhaseMarker()
    session._urgency, session._stepping = session_batches.StepUrgency(), True
    session._job_id, session._terminal_sent = "j", threading.Event()
    return session


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_0s_urgent_step_goes_at_once_and_a_plain_one_waits_for_the_beat(rank):
    session = rank_session(rank)
    sent: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [sent.put(m) for m in session._requests()], daemon=True).start()

    def step(n: int, agreed: int = 0) -> None:
        msg = engine_pb2.StepCompleted(job_id="j", rank=rank, step=n, commands_agreed=agreed)
        session.send_up(pack(msg, Module.L2_TRAINING_LOOP), msg)

    step(1)  # the loop's first
    if rank == 0:
        assert len(unbatched(sent.get(timeout=10))) == 1  # (not the 60 s beat period)
    step(2)
    step(3)
    with pytest.raises(queue.Empty):
        sent.get(timeout=0.5)  # (plain steps wait for the beat)
    step(4, agreed=1)  # a boundary command agreed: control records its boundary at once
    if rank == 0:
        parts = unbatched(sent.get(timeout=10))
        steps = [engine_pb2.StepCompleted.FromString(p.routed.body).step for p in parts]
        assert steps == [2, 3, 4]  # (what waited goes with it, in order)
    else:
        with pytest.raises(queue.Empty):
            sent.get(timeout=0.5)  # (another rank's step tells control nothing: it rides)
    session._out.put(ev(heartbeat=worker_pb2.RankHeartbeat(job_id="j", rank=rank)))
    kinds = [p.WhichOneof("event") for p in unbatched(sent.get(timeout=10))]
    assert kinds == (["heartbeat"] if rank == 0 else ["routed"] * 4 + ["heartbeat"])


def test_a_steps_events_do_not_wake_the_sender_while_it_waits_for_the_beat():
    out = session_batches.Outgoing()
    sent: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: [sent.put(m) for m in session_batches.messages(out, lambda: 60.0)], daemon=True
    ).start()
    out.put(step_completed(1))  # the first wakes it: its ride starts
    deadline = time.monotonic() + 10
    while out.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)  # (taken: the sender now waits for the beat)
    time.sleep(0.1)
    woken = out.notified
    for n in range(2, 12):
        out.put(step_record(n - 1, n - 1))
        out.put(step_completed(n))
    assert out.notified == woken  # twenty events of steps, no wake-up
    with pytest.raises(queue.Empty):
        sent.get(timeout=0.3)
    out.put(ev(heartbeat=worker_pb2.RankHeartbeat(job_id="j", rank=1)))  # the beat wakes it: all go
    parts = unbatched(sent.get(timeout=10))
    assert len(parts) == 22 and parts[-1].WhichOneof("event") == "heartbeat" and out.notified == woken + 1


def test_the_outgoing_queue_ends_a_ride_at_its_period_and_hands_out_in_order():
    out = session_batches.Outgoing()
    out.put(step_completed(1))
    out.put(step_record(1, 1))
    t0 = time.monotonic()
    (message,) = list(itertools.islice(session_batches.messages(out, lambda: 0.3), 1))
    assert time.monotonic() - t0 >= 0.25  # (a lower bound: holds on a loaded host)
    assert [p.WhichOneof("event") for p in unbatched(message)] == ["routed", "metrics"]
    with pytest.raises(queue.Empty):
        out.get_nowait()
    out.put(None)
    assert list(session_batches.messages(out)) == []


# ------------------------------------------------------------------ metric acks


def ack(seq: int, records: int = 1, routed: int = 0) -> store_pb2.MetricsAck:
    a = store_pb2.MetricsAck(seq=seq, records=records)
    for i in range(routed):
        a.routed.add(type=f"surge.v1.Failure{i}")
    return a


def test_acks_while_the_loop_runs_are_held_merged_and_go_with_the_next_beat():
    acks = MetricAcks(beats_per_ack=1)
    assert acks.beat(KEY) is None  # (nothing held: a beat sends nothing)
    for seq in (1, 2, 3):
        acks.submitted(KEY, step_record(seq, seq).metrics)
        assert acks.acked(KEY, ack(seq)) is None
    merged = acks.beat(KEY)
    assert (merged.seq, merged.records) == (3, 3) and acks.held == 2
    assert acks.beat(KEY) is None


def test_an_ack_with_routed_failure_events_goes_at_once_with_what_was_held():
    acks = MetricAcks()
    assert acks.acked(KEY, ack(1)) is None
    now = acks.acked(KEY, ack(2, routed=1))
    assert (now.seq, now.records, len(now.routed)) == (2, 2, 1)
    assert acks.beat(KEY) is None


def test_the_ack_covering_the_loops_stop_record_goes_at_once():
    acks = MetricAcks()
    acks.submitted(KEY, step_record(1, 1).metrics)
    acks.submitted(KEY, store_pb2.MetricRecord(seq=2, stop=store_pb2.StopLogCollection(job_id="j")))
    assert acks.acked(KEY, ack(1)) is None  # (before the stop: held)
    assert acks.acked(KEY, ack(2)).seq == 2


def test_after_the_loops_end_every_ack_goes_at_once_and_the_held_one_goes_then():
    acks = MetricAcks()
    assert acks.acked(KEY, ack(1)) is None
    assert acks.loop_ended(KEY).seq == 1  # (the rank waits for every ack before it exits)
    assert acks.acked(KEY, ack(2)).seq == 2


def test_ranks_are_paced_apart_and_a_closed_sessions_acks_are_forgotten():
    acks, other = MetricAcks(beats_per_ack=1), ("j", 2, 4343)
    assert acks.acked(KEY, ack(5)) is None and acks.acked(other, ack(9)) is None
    acks.forget(KEY)
    assert acks.beat(KEY) is None and acks.beat(other).seq == 9


def test_while_the_loop_runs_the_held_ack_goes_down_every_nth_beat_covering_every_record_before_it():
    """Session 36: one ack down per ``beats_per_ack`` beats (the rank reads them only at its
    loop's end), cumulative: the one that goes says every record up to its seq was written."""
    acks = MetricAcks(beats_per_ack=3)
    sent = []
    for seq in range(1, 10):  # a record a beat, each acked by the store before the rank's next beat
        assert acks.acked(KEY, ack(seq)) is None
        if (down := acks.beat(KEY)) is not None:
            sent.append((down.seq, down.records))
    assert sent == [(3, 3), (6, 3), (9, 3)]  # what each says: every record up to it, counted once
    assert acks.beat(KEY) is None  # (nothing held)


def test_an_ack_lost_with_a_broken_session_is_covered_by_the_next_and_the_loops_end_gets_every_one_at_once():
    acks = MetricAcks(beats_per_ack=3)
    assert acks.acked(KEY, ack(1)) is None and acks.acked(KEY, ack(2)) is None
    acks.forget(KEY)  # the session broke with seq 2 held: that news is lost with it
    acks.submitted(KEY, store_pb2.MetricRecord(seq=4, stop=store_pb2.StopLogCollection(job_id="j")))
    assert acks.acked(KEY, ack(3)) is None  # (held: not a beat's turn, not the stop's ack)
    now = acks.acked(KEY, ack(4))  # the loop's stop record: at once, whatever the beats
    assert (now.seq, now.records) == (4, 2)  # seq 4 covers 1..4: the lost ack's records with it
