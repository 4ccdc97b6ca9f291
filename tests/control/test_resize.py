"""Resizing a running job in place (issue 16, parts 2 and 3), control's side on an in-process
plane: ``shrink`` when no slot is free for a lost rank's replacement, growing back when a
worker registers, and ``surgectl scale`` (ScaleJobRequest). The ranks are played by the test
(their events through the node agents' sessions); what each node agent is told is read off
its session. The ranks' side (a group rebuilt at a new size) is tests/engine/."""

from __future__ import annotations

import contextlib
import time

import pytest

from services.contract import control_pb2, engine_pb2, worker_pb2
from services.control import fault_decision as fd
from services.control.orchestrator import IllegalTransition, InsufficientResources
from services.jobspec import JobSpecError, spec_from_json

from .conftest import Plane, drain, to_ranks
from .test_fault_policy import commands, decisions, running

JobState = control_pb2.JobState

SHRINK = (
    "liveness: {attribution_seconds: 0}\n"
    "fault_policy: {actions: {rank_exit: shrink, worker_lost: shrink, worker_departed: shrink}}"
)


def routed(session, name: str) -> list:
    """The commands named ``name`` routed to the ranks of one node agent since the last look."""
    return [to_ranks(c) for c in drain(session) if c.WhichOneof("command") == "routed" and name in c.routed.type]


def ready(plane: Plane, job_id: str, sessions: dict, step: int, generation: int) -> None:
    """Every rank of the rebuilt group reports ready (rank -> its node agent's session)."""
    for rank, session in sessions.items():
        started = engine_pb2.TrainingLoopStarted(
            rank=rank, start_step=step, rebuild_generation=generation, healed=True, healed_from_rank=0
        )
        plane.rank_event(session, job_id, rank, started=started)


def paused(plane: Plane, job_id: str, sessions: dict, step: int) -> None:
    for rank, session in sessions.items():
        plane.rank_event(session, job_id, rank, paused=engine_pb2.TrainingLoopPaused(rank=rank, step=step))


def test_a_lost_node_with_no_spare_shrinks_the_job_and_a_new_worker_grows_it_back(plane):
    job_id, w = running(plane, "wa", "wb", "wc", dp=3, extra=SHRINK)
    for session in w.values():
        drain(session)
    plane.c.sessions.close(w["wc"])  # rank 2's node agent is lost: no slot for its replacement

    said = decisions(plane, job_id)
    assert said[0].startswith("shrink after worker_lost of rank 2"), said
    assert said[1].startswith("shrink after worker_lost of rank 2: placing the ranks"), said
    assert "no free slot for a replacement of rank 2" in said[1], said
    # The global batch of 6 rows (2 x 1 x 3) is kept: 3 rows per rank, as 1 x 3.
    assert (
        "parallel.dp 3 -> 2, data.micro_batch_size 2 -> 1, data.grad_accum 1 -> 3, eval.batches 8 -> 24 (world "
        "size 3 -> 2; the global batch of 6 rows kept)" in said[1]
    ), said
    s = plane.get(job_id)
    assert (s.state, s.world_size, s.dp, s.micro_batch_size, s.grad_accum) == (JobState.FAULT_FROZEN, 2, 2, 1, 3)
    # No rank is launched or killed on the survivors' nodes: they get the rendezvous at dp 2, and
    # their probe peers without the lost node (they had been told to probe it: a launch of no rank).
    for session, peer in ((w["wa"], "wb"), (w["wb"], "wa")):
        cmds = drain(session)
        assert [[p.worker_id for p in c.launch.link_probe.peers] for c in cmds if not c.launch.ranks and
                c.WhichOneof("command") == "launch"] == [[peer]]  # fmt: skip
        (group,) = [to_ranks(c) for c in cmds if c.WhichOneof("command") == "routed"]
        assert isinstance(group, engine_pb2.RebuildParallelGroup)
        assert (group.world_size, group.layout.dp, group.layout.micro_batch_size, group.layout.grad_accum) == (
            2,
            2,
            1,
            3,
        )
    ready(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=7, generation=2)
    s = plane.get(job_id)
    assert (s.state, s.world_size) == (JobState.RUNNING, 2)
    assert "group of 2 rebuilt in place" in s.message, s.message

    # A worker registers: the job grows back to dp 3, its ranks pausing first (no checkpoint).
    wd = plane.register("wd")
    deadline = time.monotonic() + 10
    while not (pauses := routed(w["wa"], "PauseTraining")) and time.monotonic() < deadline:
        time.sleep(0.05)
    (pause,) = pauses
    assert not pause.checkpoint
    drain(w["wb"])
    paused(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=pause.at_step)
    on_d = commands(wd)
    # (The resume reaches the new rank too: a loop that is not paused drops a rebuild's resume.)
    assert [(k, m if k == "routed" else "") for k, m in on_d] == [
        ("launch", ""),
        ("routed", "RebuildParallelGroup"),
        ("routed", "ResumeTraining"),
    ], on_d
    launch = on_d[0][1]
    (assignment,) = launch.ranks
    assert (assignment.rank, assignment.world_size) == (2, 3)
    assert launch.init.heal_from_peer and spec_from_json(launch.init.spec_json).data.micro_batch_size == 2
    for session in (w["wa"], w["wb"]):
        got = [to_ranks(c) for c in drain(session) if c.WhichOneof("command") == "routed"]
        (group,) = [m for m in got if isinstance(m, engine_pb2.RebuildParallelGroup)]
        assert (group.world_size, group.layout.dp, group.layout.micro_batch_size, group.layout.grad_accum) == (
            3,
            3,
            2,
            1,
        )
        (resume,) = [m for m in got if isinstance(m, engine_pb2.ResumeTraining)]
        assert resume.rebuild
    ready(plane, job_id, {0: w["wa"], 1: w["wb"], 2: wd}, step=pause.at_step, generation=3)
    s = plane.get(job_id)
    assert (s.state, s.world_size, s.dp, s.micro_batch_size, s.grad_accum) == (JobState.RUNNING, 3, 3, 2, 1)
    (done,) = [e.message for e in plane.events(job_id) if e.type == "scale"]
    assert done.startswith(f"grow back (slots returned) done: dp 2 -> 3 at step {pause.at_step}"), done
    assert [type(m).__name__ for m in (to_ranks(c) for c in drain(wd)) if m is not None] == ["StartTraining"]


def scaled_to_one(plane: Plane, job_id: str, w: dict, generation: int) -> None:
    """`surgectl scale JOB --dp 1` of a dp 2 job on wa, wb: its ranks pause, rank 1's release
    is its exit, rank 0 rebuilds alone and reports ready (``generation``)."""
    plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=1))
    (pause,) = routed(w["wa"], "PauseTraining")
    paused(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=pause.at_step)
    ev = control_pb2.RankExited(job_id=job_id, rank=1, exit_code=-9, released=True)
    plane.c.sessions.on_worker_event(w["wb"], control_pb2.WorkerEvent(rank_exited=ev))
    ready(plane, job_id, {0: w["wa"]}, step=pause.at_step, generation=generation)


def test_surgectl_scale_grows_and_shrinks_a_running_job_without_touching_the_ranks_that_stay(plane):
    job_id, w = running(plane, "wa", "wb", "wc", "wd", dp=2, extra="")
    for session in w.values():
        drain(session)
    status = plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=4))
    assert status.state == JobState.RUNNING  # (paused only at the boundary, for the rebuild)
    (pause,) = routed(w["wa"], "PauseTraining")
    assert not pause.checkpoint
    drain(w["wb"])
    paused(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=pause.at_step)
    for node, rank in (("wc", 2), ("wd", 3)):
        on = commands(w[node])
        assert [k for k, _ in on] == ["launch", "routed", "routed"]
        (assignment,) = on[0][1].ranks
        assert (assignment.rank, assignment.world_size) == (rank, 4)
    for session in (w["wa"], w["wb"]):  # the ranks that stay: a rendezvous and a resume, no kill
        on = commands(session)  # (their agents: the new layout's link probe peers, a launch of no rank)
        assert [k for k, _ in on] == ["launch", "routed", "routed"] and not on[0][1].ranks
    ready(plane, job_id, dict(enumerate(w.values())), step=pause.at_step, generation=1)
    s = plane.get(job_id)
    assert (s.state, s.dp, s.micro_batch_size, s.grad_accum) == (JobState.RUNNING, 4, 1, 1)

    # Down to 1: ranks 1 to 3 are released, rank 0 rebuilds alone; the 4 rows as 2 x 2: the
    # micro-batch goes back to the largest the job ran with (2), never above it.
    plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=1))
    (pause,) = routed(w["wa"], "PauseTraining")
    paused(plane, job_id, dict(enumerate(w.values())), step=pause.at_step)
    released = [m for node in ("wb", "wc", "wd") for k, m in commands(w[node]) if k == "release"]
    assert sorted(r for m in released for r in m.ranks) == [1, 2, 3] and all(m.kill for m in released)
    for rank, node in ((1, "wb"), (2, "wc"), (3, "wd")):  # their exits were asked for: no fault decided
        ev = control_pb2.RankExited(job_id=job_id, rank=rank, exit_code=-9, released=True)
        plane.c.sessions.on_worker_event(w[node], control_pb2.WorkerEvent(rank_exited=ev))
    ready(plane, job_id, {0: w["wa"]}, step=pause.at_step, generation=2)
    s = plane.get(job_id)
    assert (s.state, s.world_size, s.dp, s.micro_batch_size, s.grad_accum) == (JobState.RUNNING, 1, 1, 2, 2)
    done = [e.message for e in plane.events(job_id) if e.type == "scale"]
    assert done[-1].startswith(f"scale by the operator done: dp 4 -> 1 at step {pause.at_step}"), done
    assert decisions(plane, job_id)[-1].startswith("scale by the operator: parallel.dp 4 -> 1")


def test_the_ranks_a_scale_adds_are_launched_without_a_standing_order_the_kept_ranks_had_withdrawn(plane):
    job_id, w = running(plane, "wa", "wb", "wc", "wd", dp=2, extra="")
    seq = plane.c.orchestrator._withdraw_standing_order(job_id, 1)
    plane.rank_event(
        w["wa"], job_id, 0, step=engine_pb2.StepCompleted(step=5, loss=2.0, tokens=64, commands_agreed=seq)
    )
    for session in w.values():
        drain(session)
    plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=4))
    (pause,) = routed(w["wa"], "PauseTraining")
    drain(w["wb"])
    paused(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=pause.at_step)
    (launch,) = [m for k, m in commands(w["wc"]) if k == "launch"]
    assert [r.rank for r in launch.ranks] == [2] and launch.init.heal_from_peer
    policy = spec_from_json(launch.init.spec_json).fault_policy
    assert 1 in [o.id for o in fd.standing_orders(policy)]  # (the policy's: the job's first ranks held it)
    assert 1 not in [o.id for o in launch.init.standing_orders], launch.init.standing_orders


def test_the_node_of_a_rank_kept_by_a_shrink_lost_later_is_its_fault_not_a_replaced_incarnations_end(plane):
    # A shrink launches no rank: its reply's generation was noted as every kept rank's, newer
    # than the process running, so the loss of that process's node later was recorded as "ended
    # after its generation was replaced" (no fault) and the survivors' broken collectives were
    # decided instead, against another class's budget (a fresh user, session 41).
    job_id, w = running(plane, "wa", "wb", dp=2, extra="")
    for session in w.values():
        drain(session)
    scaled_to_one(plane, job_id, w, generation=2)
    assert plane.get(job_id).world_size == 1
    plane.c.sessions.close(w["wa"])  # rank 0's node agent is lost
    said = decisions(plane, job_id)
    assert said[-1].startswith("restart_ranks after worker_lost of rank 0"), [
        f"{e.type}: {e.message[:150]}" for e in plane.events(job_id)
    ][-6:]
    stale = [e.message for e in plane.events(job_id) if "ended after its generation was replaced" in e.message]
    assert stale == [], stale


def test_a_scale_whose_new_ranks_do_not_fit_is_refused_before_any_rank_pauses(plane):
    """`surgectl scale J --dp 4` with no free slot: refused at once with the line a submit that
    does not fit gets, no rank paused (was: the ranks paused, then "no free slot for new rank
    2" and they went on at dp 2: a fresh operator's trial)."""
    job_id, w = running(plane, "wa", "wb", dp=2, extra="")
    for session in w.values():
        drain(session)
    before = len(plane.events(job_id))
    with pytest.raises(InsufficientResources) as refused:
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=4))
    assert refused.value.refusal == control_pb2.REFUSED_NO_CAPACITY
    assert str(refused.value) == (
        "--dp 4: needs 2 more ranks (dp 2 -> 4); 0 are free on 2 registered workers; "
        "not scaled: the job goes on at dp 2 (no rank paused)"
    )
    assert all(drain(session) == [] for session in w.values())  # no PauseTraining, nothing else
    assert len(plane.events(job_id)) == before  # nothing decided or recorded
    s = plane.get(job_id)
    assert (s.state, s.world_size, s.dp) == (JobState.RUNNING, 2, 2)
    other = plane.submit(name="other", dp=2, extra="")  # (the submit's reason: the same allocator line)
    assert "0 are free on 2 registered workers" in other.message, other.message
    # Asked again at its own size it is a no-op; a new micro-batch split at the same size is
    # a resize like any other (every rank gets the layout).
    assert plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=2)).dp == 2
    assert not [e for e in plane.events(job_id) if e.message.startswith("scale by the operator: parallel")]
    plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=2, micro_batch_size=1))
    (pause,) = routed(w["wa"], "PauseTraining")
    drain(w["wb"])
    paused(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=pause.at_step)
    (group,) = routed(w["wa"], "RebuildParallelGroup")
    assert (group.world_size, group.layout.dp, group.layout.micro_batch_size, group.layout.grad_accum) == (2, 2, 1, 2)


def test_a_scale_whose_free_slot_is_taken_while_the_ranks_pause_goes_on_at_its_size(plane):
    """The slot the scale's probe found is taken before the ranks paused (another job started
    on it): the rebuild is refused and the paused ranks go on at the old size."""
    job_id, w = running(plane, "wa", "wb", "wc", "wd", dp=2, extra="")
    for session in w.values():
        drain(session)
    plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=4))
    (pause,) = routed(w["wa"], "PauseTraining")
    other = plane.submit(name="other", dp=1, extra="")
    assert other.state == JobState.WARMING_UP  # (on wc's slot)
    paused(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=pause.at_step)
    (not_done,) = [e.message for e in plane.events(job_id) if e.type == "scale"]
    assert "scale by the operator to dp 4 not done:" in not_done and "no free slot for new rank 3" in not_done
    assert not_done.endswith(f"the ranks go on at dp 2 from step {pause.at_step}"), not_done
    (resume,) = routed(w["wa"], "ResumeTraining")
    assert not resume.rebuild  # a plain resume: the same group goes on
    assert commands(w["wb"]) == [("routed", "PauseTraining"), ("routed", "ResumeTraining")]  # nothing released
    s = plane.get(job_id)
    assert (s.state, s.world_size, s.dp) == (JobState.RUNNING, 2, 2)


@pytest.mark.parametrize("when", ["rebuilding", "pausing"])
def test_a_fault_during_a_scale_says_the_size_the_job_is_at_not_given_up_when_its_layout_was_taken(plane, when):
    """`surgectl scale J --dp 2` from dp 1, rank 0 killed meanwhile: once the rebuild was
    commanded the layout is the job's (its recovery takes the ranks over at dp 2), and the
    `scale` event `surgectl scale` prints says so (was: "given up", rc 0, while status showed
    dp 2: a fresh operator's trial); before it, the job stays at dp 1."""
    job_id, w = running(plane, "wa", "wb", dp=1, extra="")
    plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=2))
    (pause,) = routed(w["wa"], "PauseTraining")
    if when == "rebuilding":
        paused(plane, job_id, {0: w["wa"]}, step=pause.at_step)
        assert plane.get(job_id).dp == 2  # (the rebuild at dp 2 commanded)
    plane.rank_exited(w["wa"], job_id, 0, exit_code=-9)
    (said,) = [e for e in plane.events(job_id) if e.type == "scale"]
    if when == "rebuilding":
        assert said.message.startswith("scale by the operator to dp 2: the job is at dp 2 (world size 2)"), said.message
        assert "given up" not in said.message and said.status.dp == 2
    else:
        assert said.message.startswith("scale by the operator to dp 2 given up: "), said.message
        assert said.message.endswith("; the job stays at dp 1") and said.status.dp == 1


def test_scale_refusals_are_one_line_and_change_nothing(plane):
    job_id, w = running(plane, "wa", "wb", dp=2, extra="")
    with pytest.raises(JobSpecError, match=r"^--dp 3: the global batch of 4 rows .* does not split over 3 ranks$"):
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=3))
    with pytest.raises(JobSpecError, match=r"^--dp 2 --grad-accum 3: data.micro_batch_size x data.grad_accum must"):
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=2, grad_accum=3))
    with pytest.raises(JobSpecError, match="^--dp: the new data-parallel size must be >= 1"):
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=0))
    assert plane.get(job_id).dp == 2
    for session in w.values():
        drain(session)
    plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=1))
    events = len(plane.events(job_id))
    assert plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=1)).state == JobState.RUNNING  # asked again
    assert len(plane.events(job_id)) == events  # (the same resize: nothing new asked or recorded)
    with pytest.raises(IllegalTransition, match="is being resized to dp 1"):
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=4))
    with pytest.raises(IllegalTransition, match="is being resized"):
        plane.user(control_pb2.PauseJobRequest(job_id=job_id))
    # A stop too (was accepted: its boundary never came, the ranks paused for the scale and
    # the job hung RUNNING, found by the fresh-user trial).
    with pytest.raises(IllegalTransition, match="is being resized to dp 1 .*; stop it once"):
        plane.user(control_pb2.StopJobRequest(job_id=job_id))

    other = plane.submit(name="tp", dp=1, extra="").job_id  # (STANDBY: waits for slots)
    with pytest.raises(IllegalTransition, match="not RUNNING"):
        plane.user(control_pb2.ScaleJobRequest(job_id=other, dp=2))


def test_scale_is_refused_for_a_plan_whose_state_is_not_whole_on_every_rank(plane):
    text = (
        "name: tp2\nsteps: 5\nmodel: {n_layers: 1, d_model: 32, n_heads: 2}\n"
        "data: {dataset: x@v1, seq_len: 16, micro_batch_size: 2}\nparallel: {dp: 1, tp: 2}\n"
    )
    job_id = plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="job.yaml")).job_id
    # The plan is refused first, whatever the job's state: no scale of it can ever be done.
    with pytest.raises(JobSpecError, match=r"^--dp 2: scaling in place needs tp = pp = 1"):
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=2))


def test_a_shrink_that_would_keep_no_rank_holding_the_state_relaunches_every_rank_from_the_checkpoint(plane):
    # Rank 0's node is lost at dp 2 with no spare: dp 1 would keep only rank 0, which is gone
    # (ranks keep their ids), so nothing is kept: every rank from the checkpoint, as before.
    job_id, w = running(plane, "wa", "wb", dp=2, extra=SHRINK)
    plane.c.sessions.close(w["wa"])
    said = decisions(plane, job_id)
    assert said[0].startswith("shrink after worker_lost of rank 0"), said
    assert said[1].startswith("restart_ranks instead of rebuild after worker_lost of rank 0"), said
    assert "no free slot for a replacement of rank 0" in said[1], said
    s = plane.get(job_id)
    assert (s.state, s.dp, s.world_size) == (JobState.FAULT_FROZEN, 2, 2)  # waits for capacity at its size


@contextlib.contextmanager
def restarted_control(tmp_path, extra: str):
    """A dp 2 job RUNNING on wa, wb (wc free), control stopped and built again on the same
    journal, and the three node agents re-attached (wa, wb with their ranks). Yields
    (plane, job_id, sessions by worker)."""
    from services.control.__main__ import build
    from services.control.job_store import JobStore

    from .conftest import registration, stop_plane

    db = tmp_path / "control.db"
    control = build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    job_id, _ = running(Plane(control), "wa", "wb", "wc", dp=2, extra=extra)
    stop_plane(control)
    control.journal.close()

    control = build(JobStore(db), data_address="d:1", store_address="s:1", persist_interval_s=0.0)
    plane = Plane(control)
    try:
        w = {}
        for rank, name in enumerate(("wa", "wb", "wc")):  # the node agents re-attach the ranks they still run
            reg = registration(name)
            if rank < 2:
                assignment = engine_pb2.RankAssignment(rank=rank, world_size=2)
                reg.running.append(control_pb2.LaunchRanks(job_id=job_id, ranks=[assignment]))
            w[name] = plane.c.sessions.open(reg)
        yield plane, job_id, w
    finally:
        stop_plane(control)
        control.journal.close()


def test_after_a_control_restart_the_reattached_ranks_placement_lets_a_scale_and_a_rebuild_keep_them(
    tmp_path, store_with_no_versions
):
    # The allocator of a restarted control knows where each rank runs from its node agent's
    # re-attach (was: "no known placement (control restarted)", every scale refused and every
    # rebuild fell back to relaunching all ranks, found by the fresh-user trial).
    with restarted_control(tmp_path, SHRINK) as (plane, job_id, w):
        for session in w.values():
            drain(session)
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=1))
        (pause,) = routed(w["wa"], "PauseTraining")
        paused(plane, job_id, {0: w["wa"], 1: w["wb"]}, step=pause.at_step)
        (group,) = [m for m in routed(w["wa"], "RebuildParallelGroup")]
        assert group.generation > 1_000_000  # (from the clock: newer than any the ranks joined before)
        assert [m.ranks for k, m in commands(w["wb"]) if k == "release"] == [[1]]
        ready(plane, job_id, {0: w["wa"]}, step=pause.at_step, generation=group.generation)
        assert (plane.get(job_id).state, plane.get(job_id).dp) == (JobState.RUNNING, 1)


def test_a_node_lost_after_a_control_restart_is_replaced_in_place_from_the_reattached_placement(
    tmp_path, store_with_no_versions
):
    # Once every rank re-attached, the placement is fixed: a node lost afterwards (its ranks
    # leave the re-attached set with its session) is replaced in place. Was: "no known
    # placement (control restarted)", every rank relaunched from scratch (the netns test bed).
    rebuild = "liveness: {attribution_seconds: 0}\nfault_policy: {actions: {worker_lost: rebuild}}"
    with restarted_control(tmp_path, rebuild) as (plane, job_id, w):
        for rank, name in enumerate(("wa", "wb")):  # the re-attached ranks beat again
            beat = worker_pb2.RankHeartbeat(job_id=job_id, rank=rank, step=5, stepping=True)
            plane.rank_event(w[name], job_id, rank, heartbeat=beat)
        for session in w.values():
            drain(session)
        plane.c.sessions.close(w["wb"])  # rank 1's node agent is lost

        said = decisions(plane, job_id)
        assert said[0].startswith("rebuild after worker_lost of rank 1"), said
        assert not any("no known placement" in d or "restart_ranks" in d for d in said), said
        (group,) = routed(w["wa"], "RebuildParallelGroup")  # rank 0 keeps its process
        assert not [c for k, c in commands(w["wa"]) if k == "release"]
        (launch,) = [c.launch for c in drain(w["wc"]) if c.WhichOneof("command") == "launch"]
        assert [(a.rank, a.world_size) for a in launch.ranks] == [(1, 2)]  # the replacement, on the spare


def test_a_collective_error_of_a_relaunched_generation_reported_after_the_recovery_is_a_consequence(plane):
    # A rank dies; every rank is relaunched (restart_ranks). The other rank's failed
    # collective, held one second for attribution, is reported after the new ranks are ready:
    # it happened before the recovery, so it is that incident's consequence, not a second
    # fault (was: a second relaunch, a comm_error restart spent and the survivor blamed).
    job_id, w = running(plane, "wa", "wb", dp=2, extra="liveness: {attribution_seconds: 1.0}")
    plane.rank_exited(w["wb"], job_id, 1, exit_code=-9)
    broken = engine_pb2.ParallelTopologyError(rank=0, fault_class="comm_error", detail="Connection closed by peer")
    broken.failure.cause = 7  # FAILURE_COMMUNICATION
    plane.rank_event(w["wa"], job_id, 0, broken=broken)  # (held: attribution_seconds)
    # (Its process is killed by the relaunch: an exit control asked for, never a fault.)
    ev = control_pb2.RankExited(job_id=job_id, rank=0, exit_code=-9, released=True)
    plane.c.sessions.on_worker_event(w["wa"], control_pb2.WorkerEvent(rank_exited=ev))
    for rank, session in ((0, w["wa"]), (1, w["wb"])):
        plane.rank_event(session, job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    assert plane.get(job_id).state == JobState.RUNNING
    deadline = time.monotonic() + 10
    while not any("reported after the recovery" in e.message for e in plane.events(job_id)):
        assert time.monotonic() < deadline, [e.message for e in plane.events(job_id)]
        time.sleep(0.1)
    assert len(decisions(plane, job_id)) == 1, decisions(plane, job_id)
    assert plane.get(job_id).state == JobState.RUNNING


def test_a_shrink_by_scale_starts_the_job_queued_for_the_slots_it_frees(plane):
    """The released ranks' slots are the queue's: a job waiting for one starts once the
    shrink is done, not at the next unrelated event (a fresh user's trial: it waited until an
    uncordon)."""
    from .conftest import settle

    job_id, w = running(plane, "wa", "wb", dp=2, extra="")
    waiting = plane.submit(name="waits", dp=1)
    assert waiting.queue_position == 1
    for session in w.values():
        drain(session)
    scaled_to_one(plane, job_id, w, generation=1)
    assert plane.get(job_id).dp == 1
    settle(lambda: plane.get(waiting.job_id).queue_position, 0)
    launched = [m for k, m in commands(w["wb"]) if k == "launch" and m.job_id == waiting.job_id]
    assert len(launched) == 1 and [a.rank for a in launched[0].ranks] == [0]


@pytest.mark.parametrize("queued_priority", [0, 7, -1])
def test_a_scale_does_not_take_the_slots_a_queued_job_of_its_priority_or_higher_waits_for(plane, queued_priority):
    """The fairness a grow-back after a shrink gets (grow_rule.py's rule 2): a running job's
    growth does not take free slots while a queued job of its priority or higher waits for
    slots; it is refused before any rank pauses, naming that job. A queued job of a lower
    priority does not hold it back. (Was: the scale took 2 of the 3 free slots the queued
    dp 4 job waited for.)"""
    from .conftest import spec_yaml

    w = {name: plane.register(name) for name in ("wa", "wb", "wc", "wd", "we")}
    job_id = plane.submit(dp=2, steps=20).job_id
    for rank, name in enumerate(("wa", "wb")):
        plane.rank_event(w[name], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    waits = plane.user(
        control_pb2.SubmitJobRequest(spec_yaml=spec_yaml("waits", dp=4), spec_path="job.yaml", priority=queued_priority)
    )
    assert waits.queue_position == 1 and "3 are free" in waits.message, waits.message
    for session in w.values():
        drain(session)
    if queued_priority < 0:
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=4))
        (pause,) = routed(w["wa"], "PauseTraining")  # (a lower priority waits behind it, as at a submit)
        return
    with pytest.raises(InsufficientResources) as refused:
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=4))
    assert str(refused.value) == (
        f"--dp 4: job {waits.job_id} (priority {queued_priority}) waits in the queue for slots, at position 1; "
        "a running job grows only past queued jobs of a lower priority than its own (0); "
        "not scaled: the job goes on at dp 2 (no rank paused)"
    )
    assert all(drain(session) == [] for session in w.values())
    assert (plane.get(job_id).state, plane.get(job_id).dp) == (JobState.RUNNING, 2)


def test_a_scale_beyond_its_teams_hard_limit_is_refused_before_any_rank_pauses(plane):
    """A submit's quota admission holds for a scale's growth too (as for a grow-back,
    teams.py ``_grow_room``): team vision may hold 2 slots; its dp 2 job is not scaled to
    dp 4 though 2 slots are free (was: it paused and grew to 4 slots)."""
    from .conftest import spec_yaml
    from .test_teams import set_team

    set_team(plane, "vision", hard_limit=2)
    w = {name: plane.register(name) for name in ("wa", "wb", "wc", "wd")}
    text = spec_yaml(dp=2, steps=20, extra="team: vision")
    job_id = plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="job.yaml")).job_id
    for rank, name in enumerate(("wa", "wb")):
        plane.rank_event(w[name], job_id, rank, started=engine_pb2.TrainingLoopStarted(rank=rank))
    for session in w.values():
        drain(session)
    with pytest.raises(InsufficientResources) as refused:
        plane.user(control_pb2.ScaleJobRequest(job_id=job_id, dp=4))
    assert str(refused.value) == (
        "--dp 4: 2 more slots: team vision at its hard limit (2 of 2 slots held, this job needs 2); "
        "not scaled: the job goes on at dp 2 (no rank paused)"
    )
    assert all(drain(session) == [] for session in w.values())
    assert plane.get(job_id).dp == 2
