"""A job's start at scale (issue 28): its ranks' ready events are applied back to back, their
records group-committed by the journal's writer, and what must not precede durability (the
ack to the node agent, StartTraining, a failed write's report) released by the commit
(services/control/orchestrator/commit_later.py). Before, the applier waited for each ready
event's commit before the next: one commit per rank, serial."""

from __future__ import annotations

import contextlib
import time

import pytest
from prometheus_client import REGISTRY

from services.contract import Module, control_pb2, engine_pb2, worker_pb2
from services.contract.relay import pack

from .conftest import launched, registration, settle
from .test_commit_undo import full

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(60)


def ready(job_id: str, rank: int, worker_id: str, seq: int) -> control_pb2.WorkerEvent:
    """Rank ``rank``'s TrainingLoopStarted as its node agent sends it (sequenced)."""
    msg = engine_pb2.TrainingLoopStarted(job_id=job_id, rank=rank, worker_id=worker_id)
    routed = pack(msg, Module.L2_TRAINING_LOOP)
    return control_pb2.WorkerEvent(rank_event=worker_pb2.RankEvent(job_id=job_id, rank=rank, routed=routed), seq=seq)


def sent(plane, session) -> list[control_pb2.WorkerCommand]:
    """The commands queued on the session so far, an ack marker as the EventAck it becomes."""
    out = []
    while not session.commands.empty():
        cmd = plane.c.sessions.command(session, session.commands.get_nowait())
        if cmd is not None:
            out.append(cmd)
    return out


def commits() -> float:
    return REGISTRY.get_sample_value("surge_control_journal_commits_total") or 0.0


@contextlib.contextmanager
def writer_held(plane):
    """The journal's writer commits nothing meanwhile (its transactions take the store's lock)."""
    with plane.c.journal._lock:
        yield


def decided(cls: str, action: str) -> float:
    return REGISTRY.get_sample_value("surge_fault_decisions_total", {"class": cls, "action": action}) or 0.0


def start_job(plane, nodes: int, slots: int):
    """``nodes`` node agents of ``slots`` slots, one job over every slot, launched: (job id,
    worker id -> session, worker id -> its ranks)."""
    sessions = {}
    for i in range(nodes):
        reg = registration(f"w{i}", slots)
        reg.incarnation = f"i{i}"
        sessions[reg.worker_id] = plane.c.sessions.open(reg)
    job_id = plane.submit(dp=nodes * slots, steps=50).job_id
    got = launched(sessions, nodes)
    ranks = {
        w: [a.rank for c in cmds if c.WhichOneof("command") == "launch" for a in c.launch.ranks]
        for w, cmds in got.items()
    }
    return job_id, sessions, ranks


def test_a_starts_ready_events_are_applied_back_to_back_and_group_committed(plane):
    """32 ranks' ready events, the journal's writer held up meanwhile: every one is applied
    (the applier does not wait for each commit), nothing is acked and StartTraining is not sent
    before the writes are durable; once the writer commits, a few groups carry all 32 writes
    (the old code: the applier stopped at the first ready event until its commit, then one
    commit per rank)."""
    job_id, sessions, ranks = start_job(plane, nodes=8, slots=4)
    applier = plane.c.servicer.applier
    before = commits()
    with writer_held(plane):
        for w, rs in ranks.items():
            for seq, rank in enumerate(rs, start=1):
                applier.event(sessions[w], ready(job_id, rank, w, seq))
        deadline = time.monotonic() + 20
        while any(sessions[w].applied < len(rs) for w, rs in ranks.items()):
            assert time.monotonic() < deadline, {w: s.applied for w, s in sessions.items()}  # the old code: stuck at 1
            time.sleep(0.01)
        assert plane.get(job_id).state == JobState.RUNNING  # decided (the view) ...
        for session in sessions.values():  # ... but nothing released before the commit
            assert session.durable == 0
            assert [c for c in sent(plane, session) if c.WhichOneof("command") != "ack" or c.ack.seq] == []
    for w, session in sessions.items():
        settle(lambda session=session: session.durable, len(ranks[w]))
    got = {w: [] for w in sessions}
    deadline = time.monotonic() + 10
    while not all(any(c.WhichOneof("command") == "routed" for c in cmds) for cmds in got.values()):
        assert time.monotonic() < deadline, got
        for w, session in sessions.items():
            got[w] += sent(plane, session)
        time.sleep(0.01)
    for cmds in got.values():
        assert [c.routed.type for c in cmds if c.WhichOneof("command") == "routed"] == ["surge.v1.StartTraining"]
    assert commits() - before <= 4  # 33 writes (32 ready records, RUNNING with the last) in a few groups
    events = [e.message for e in plane.events(job_id)]
    assert sum(m.startswith("rank ") and " ready at step " in m for m in events) == 32
    assert events[-1].startswith("WARMING_UP -> RUNNING")


def test_a_ready_event_whose_write_the_disk_refuses_is_not_acked_and_is_reported(plane, monkeypatch):
    """Every journal transaction fails (a full disk): the ready event's decision goes on, but
    its ack never covers it, and L1-1's failure (reported from the write's callback now, not
    raised by the handler) reaches L1-3, graded journal_write_failed and decided by the policy
    (ignore). The disk back, the agent's resend after a reconnect (from its last ack) is
    applied and acked. (A guard: what held before holds on the new path; it passes on the
    old code too, where the handler's raise was the report.)"""
    job_id, sessions, ranks = start_job(plane, nodes=2, slots=1)
    a = sessions["w0"]
    ignored = decided("journal_write_failed", "ignore")

    def disk_full(writes) -> None:
        raise full()

    monkeypatch.setattr(plane.c.journal._writer, "_transaction", disk_full)
    plane.c.servicer.applier.event(a, ready(job_id, ranks["w0"][0], "w0", 1))
    settle(lambda: decided("journal_write_failed", "ignore") - ignored, 1.0)
    settle(lambda: a.applied, 1)
    assert a.durable == 0 and [c.ack.seq for c in sent(plane, a) if c.WhichOneof("command") == "ack"] in ([], [0])
    monkeypatch.undo()

    # The agent reconnects (same incarnation, its rank still running) and resends from its ack (0).
    reg = registration("w0", 1)
    reg.incarnation = "i0"
    reg.running.append(control_pb2.LaunchRanks(job_id=job_id, ranks=[engine_pb2.RankAssignment(rank=0)]))
    again = plane.c.sessions.open(reg)
    assert again.applied == 0
    plane.c.servicer.applier.event(again, ready(job_id, 0, "w0", 1))
    plane.c.servicer.applier.event(sessions["w1"], ready(job_id, 1, "w1", 1))
    settle(lambda: plane.get(job_id).state, JobState.RUNNING)
    settle(lambda: (again.durable, sessions["w1"].durable), (1, 1))


def test_an_operators_command_still_waits_for_its_commit(plane, monkeypatch):
    """Only a rank's event applied by the applier goes on before its commit: an operator's
    stop on a refusing disk is refused, its reply the typed error, and undone (as before; a
    guard of what did not change, it passes on the old code too)."""
    job_id, sessions, ranks = start_job(plane, nodes=2, slots=1)
    for w, rs in ranks.items():
        plane.c.servicer.applier.event(sessions[w], ready(job_id, rs[0], w, 1))
    settle(lambda: plane.get(job_id).state, JobState.RUNNING)

    def disk_full(writes) -> None:
        raise full()

    monkeypatch.setattr(plane.c.journal._writer, "_transaction", disk_full)
    with pytest.raises(Exception, match="FAILURE_WRITE_REFUSED"):
        plane.user(control_pb2.StopJobRequest(job_id=job_id))
    assert plane.c.orchestrator._jobs[job_id].pending == ""  # undone before the reply
