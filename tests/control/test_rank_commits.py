"""A job's per-rank events other than its ready events (issue 28, session 30's remnant): every
rank's paused report (a pause, a stop's, a scale's, a drain's), its finish, its clean exit
after it, a consequence of an incident, are applied back to back and their records
group-committed; what must not precede durability (the ack, the commands, the release) is
released by the commit (services/control/orchestrator/commit_later.py). Before, the applier
waited for each rank's commit before the next: one commit per rank, serial (a pause of 8,192
ranks, 8,192 fsyncs). A last rank's decision that registers an undo or asks for the queue's
head still waits (session 28's order)."""

from __future__ import annotations

import time

import pytest

from services.contract import Module, control_pb2, engine_pb2, store_pb2, worker_pb2
from services.contract.relay import pack

from .conftest import settle
from .test_commit_undo import full
from .test_start_commits import commits, decided, ready, sent, start_job, writer_held

JobState = control_pb2.JobState
JobOutcome = control_pb2.JobOutcome
pytestmark = pytest.mark.timeout(60)


def loop_event(msg, seq: int) -> control_pb2.WorkerEvent:
    """A rank's loop event (TrainingLoopPaused, TrainingLoopFinished, ...) as its node agent
    sends it (sequenced)."""
    routed = pack(msg, Module.L2_TRAINING_LOOP)
    return control_pb2.WorkerEvent(
        rank_event=worker_pb2.RankEvent(job_id=msg.job_id, rank=msg.rank, routed=routed), seq=seq
    )


def exited(job_id: str, rank: int, worker_id: str, seq: int) -> control_pb2.WorkerEvent:
    """The rank's clean exit, as its node agent reports it (sequenced)."""
    ev = control_pb2.RankExited(job_id=job_id, rank=rank, worker_id=worker_id, exit_code=0)
    return control_pb2.WorkerEvent(rank_exited=ev, seq=seq)


def running_job(plane, nodes: int, slots: int):
    """A job over ``nodes`` x ``slots`` ranks, RUNNING, every ready event acked: (job id,
    worker id -> session, worker id -> its ranks, worker id -> its next event seq)."""
    job_id, sessions, ranks = start_job(plane, nodes, slots)
    applier = plane.c.servicer.applier
    for w, rs in ranks.items():
        for seq, rank in enumerate(rs, start=1):
            applier.event(sessions[w], ready(job_id, rank, w, seq))
    settle(lambda: plane.get(job_id).state, JobState.RUNNING)
    for w, session in sessions.items():
        settle(lambda session=session: session.durable, len(ranks[w]))
        sent(plane, session)  # (StartTraining and the acks: read)
    return job_id, sessions, ranks, {w: len(rs) + 1 for w, rs in ranks.items()}


def applied(sessions: dict, counts: dict[str, int], timeout_s: float = 20.0) -> None:
    """Until every session's ``applied`` reaches its count (the applier does not wait for
    the journal); fails with what was applied."""
    deadline = time.monotonic() + timeout_s
    while any(sessions[w].applied < n for w, n in counts.items()):
        assert time.monotonic() < deadline, {w: s.applied for w, s in sessions.items()}
        time.sleep(0.01)


def test_a_pauses_paused_reports_are_applied_back_to_back_and_group_committed(plane):
    """32 ranks pause, the journal's writer held up meanwhile: every paused report is applied
    and the job is PAUSED in the view, nothing acked; released, every report is acked in a
    few commits and the journal ends with the pause (the old code: the applier stopped at the
    first paused report until its commit, one commit per rank)."""
    job_id, sessions, ranks, nxt = running_job(plane, nodes=8, slots=4)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))
    acked = {w: s.durable for w, s in sessions.items()}
    applier = plane.c.servicer.applier
    before = commits()
    with writer_held(plane):
        for w, rs in ranks.items():
            for i, rank in enumerate(rs):
                paused = engine_pb2.TrainingLoopPaused(job_id=job_id, rank=rank, step=7)
                applier.event(sessions[w], loop_event(paused, nxt[w] + i))
        applied(sessions, {w: nxt[w] + len(rs) - 1 for w, rs in ranks.items()})  # the old code: stuck
        assert plane.get(job_id).state == JobState.PAUSED  # decided (the view) ...
        assert {w: s.durable for w, s in sessions.items()} == acked  # ... nothing acked before the commit
    for w, session in sessions.items():
        settle(lambda w=w, session=session: session.durable, nxt[w] + len(ranks[w]) - 1)
    assert commits() - before <= 5  # 32 writes (31 ranks' bookkeeping, PAUSED with the last) in a few groups
    events = [e.message for e in plane.events(job_id)]
    assert events[-1] == "RUNNING -> PAUSED: all ranks paused after step 7"


def test_a_finish_and_the_clean_exits_go_on_and_the_last_finish_waits_for_its_release(plane):
    """31 of 32 ranks finish and exit cleanly, the writer held up: all 62 events are applied
    (none waits for its commit), the job still RUNNING; the last rank's finish is decided
    (TERMINATED in the view) but its release (ReleaseRanks) and every ack wait for the commit;
    released, the job is FINISHED in a few commits (the old code: stuck at the first finish)."""
    job_id, sessions, ranks, nxt = running_job(plane, nodes=8, slots=4)
    acked = {w: s.durable for w, s in sessions.items()}
    last_w, last_rank = "w7", ranks["w7"][-1]
    applier = plane.c.servicer.applier
    before = commits()
    with writer_held(plane):
        for w, rs in ranks.items():
            for rank in rs:
                if rank == last_rank:
                    continue
                applier.event(
                    sessions[w], loop_event(engine_pb2.TrainingLoopFinished(job_id=job_id, rank=rank, step=50), nxt[w])
                )
                applier.event(sessions[w], exited(job_id, rank, w, nxt[w] + 1))
                nxt[w] += 2
        applied(sessions, {w: nxt[w] - 1 for w in ranks})  # the old code: stuck at the first finish
        assert plane.get(job_id).state == JobState.RUNNING
        applier.event(
            sessions[last_w],
            loop_event(engine_pb2.TrainingLoopFinished(job_id=job_id, rank=last_rank, step=50), nxt[last_w]),
        )
        settle(lambda: plane.get(job_id).state, JobState.TERMINATED)  # decided ...
        time.sleep(0.2)  # (a release sent before the commit would be queued by now)
        assert {w: s.durable for w, s in sessions.items()} == acked  # ... nothing acked, nothing released
        for session in sessions.values():
            assert [c for c in sent(plane, session) if c.WhichOneof("command") == "release"] == []
    settle(lambda: sessions[last_w].durable, nxt[last_w])
    for w, session in sessions.items():
        settle(lambda w=w, session=session: session.durable, nxt[w] - (w != last_w))
    settle(
        lambda: sum(c.WhichOneof("command") == "release" for s in sessions.values() for c in sent(plane, s)) > 0, True
    )
    assert plane.get(job_id).outcome == JobOutcome.FINISHED
    assert commits() - before <= 6  # 33 writes (31 finishes, 31 exits' bookkeeping, the end) in a few groups
    events = [e.message for e in plane.events(job_id)]
    assert events[-1].startswith("RUNNING -> TERMINATED: FINISHED: all ranks finished at step 50")


def test_a_paused_report_whose_write_the_disk_refuses_is_not_acked_and_is_reported(plane, monkeypatch):
    """Every journal transaction fails (a full disk) while a rank reports paused: the report is
    applied (the rank counts as paused in memory), not acked, and L1-1's failure reaches L1-3
    (journal_write_failed, decided ignore); the disk back, the other rank's paused report is
    journaled with the job's whole bookkeeping (the first rank's included: nothing to undo),
    and the first rank's resend after a reconnect is applied again harmlessly: the job is
    PAUSED once."""
    job_id, sessions, ranks, nxt = running_job(plane, nodes=2, slots=1)
    plane.user(control_pb2.PauseJobRequest(job_id=job_id, no_checkpoint=True))
    a, b = sessions["w0"], sessions["w1"]
    ignored = decided("journal_write_failed", "ignore")

    def disk_full(writes) -> None:
        raise full()

    monkeypatch.setattr(plane.c.journal._writer, "_transaction", disk_full)
    paused0 = engine_pb2.TrainingLoopPaused(job_id=job_id, rank=ranks["w0"][0], step=3)
    plane.c.servicer.applier.event(a, loop_event(paused0, nxt["w0"]))
    settle(lambda: decided("journal_write_failed", "ignore") - ignored, 1.0)
    settle(lambda: a.applied, nxt["w0"])
    assert a.durable == nxt["w0"] - 1
    monkeypatch.undo()

    paused1 = engine_pb2.TrainingLoopPaused(job_id=job_id, rank=ranks["w1"][0], step=3)
    plane.c.servicer.applier.event(b, loop_event(paused1, nxt["w1"]))
    settle(lambda: plane.get(job_id).state, JobState.PAUSED)
    settle(lambda: b.durable, nxt["w1"])
    # The agent of w0 reconnects (same incarnation) and resends from its ack.
    from .conftest import registration

    reg = registration("w0", 1)
    reg.incarnation = "i0"
    reg.running.append(control_pb2.LaunchRanks(job_id=job_id, ranks=[engine_pb2.RankAssignment(rank=ranks["w0"][0])]))
    again = plane.c.sessions.open(reg)
    assert again.applied == nxt["w0"] - 1
    plane.c.servicer.applier.event(again, loop_event(paused0, nxt["w0"]))
    settle(lambda: again.durable, nxt["w0"])
    events = [e.message for e in plane.events(job_id)]
    assert sum(m.startswith("RUNNING -> PAUSED") for m in events) == 1
    assert plane.get(job_id).state == JobState.PAUSED


def test_a_last_paused_report_whose_decision_registers_an_undo_still_waits(plane):
    """A drain's pause (its checkpoint committed): the first rank's paused report goes on, but
    the last one's decision (the move off the node, which registers its undo) waits for its
    commit before the job's next event is applied (session 28's order: an undo runs before the
    next decision of the job). (The old code fails at the first report, which waited too.)"""
    job_id, sessions, ranks, nxt = running_job(plane, nodes=2, slots=1)
    plane.user(control_pb2.DrainWorkerRequest(worker_id="w0", deadline_seconds=600.0))
    saved = store_pb2.SaveCompleted(job_id=job_id, version=f"{job_id}:1", step=9, seconds=0.5)
    plane.rank_event(sessions["w0"], job_id, ranks["w0"][0], saved=saved)
    applier = plane.c.servicer.applier
    with writer_held(plane):
        for w in ("w0", "w1"):
            paused = engine_pb2.TrainingLoopPaused(job_id=job_id, rank=ranks[w][0], step=9)
            applier.event(sessions[w], loop_event(paused, nxt[w]))
        # One more event of the job behind the last paused report (w1's): not applied while it waits.
        again = engine_pb2.TrainingLoopPaused(job_id=job_id, rank=ranks["w1"][0], step=9)
        applier.event(sessions["w1"], loop_event(again, nxt["w1"] + 1))
        applied(sessions, {"w0": nxt["w0"]})  # (the first rank's report went on)
        settle(lambda: plane.get(job_id).state, JobState.STANDBY)  # the last one's decided (moved: queued) ...
        time.sleep(0.3)
        # ... and its thread waits for the move's commit: neither it nor the event behind it is done
        assert sessions["w1"].applied == nxt["w1"] - 1
    settle(lambda: sessions["w1"].applied, nxt["w1"] + 1)


def test_a_profiles_reports_of_every_rank_are_applied_back_to_back(plane):
    """A profile of 32 ranks: each rank's ProfileRecorded is one record; with the writer held
    up all 32 are applied and none acked; released, all are journaled in a few commits (the
    old code: stuck at the first report)."""
    job_id, sessions, ranks, nxt = running_job(plane, nodes=8, slots=4)
    seq = plane.user(control_pb2.ProfileJobRequest(job_id=job_id, steps=1)).profiles[-1].seq
    acked = {w: s.durable for w, s in sessions.items()}
    applier = plane.c.servicer.applier
    before = commits()
    with writer_held(plane):
        for w, rs in ranks.items():
            for i, rank in enumerate(rs):
                report = engine_pb2.ProfileRecorded(job_id=job_id, rank=rank, seq=seq, first_step=3, last_step=3)
                applier.event(sessions[w], loop_event(report, nxt[w] + i))
        applied(sessions, {w: nxt[w] + len(rs) - 1 for w, rs in ranks.items()})  # the old code: stuck
        assert {w: s.durable for w, s in sessions.items()} == acked
    for w, session in sessions.items():
        settle(lambda w=w, session=session: session.durable, nxt[w] + len(ranks[w]) - 1)
    assert commits() - before <= 5
    assert len(plane.get(job_id).profiles[-1].recorded) == 32
    assert sum(": profile #" in e.message and " stored" in e.message for e in plane.events(job_id)) == 32
