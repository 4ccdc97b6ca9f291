"""A job's one activity in flight as a table (services/control/orchestrator/activity.py):
what a second ask gets beside the activity in flight, and the slot's writers. No bus, no
process: the activity in flight and an ask in, one admission out."""

from __future__ import annotations

import pytest

from services.contract import control_pb2
from services.control.orchestrator.activity import (
    FOLD,
    REFUSE,
    START,
    SUPERSEDE,
    ForceDownAsk,
    PauseAsk,
    ReloadAsk,
    ResumeAsk,
    ScaleAsk,
    StopAsk,
    admit,
    begin,
    end,
    idle,
    ready_for,
)
from services.control.orchestrator.job import (
    _Incident,
    _Job,
    _Recovered,
    _Reload,
    _Resume,
    _Scale,
)
from services.control.orchestrator.job_journal import _load_runtime, _runtime
from services.jobspec import at_data_parallel_size, parse_job_spec

from .conftest import spec_yaml

JobState = control_pb2.JobState
SPEC = parse_job_spec(spec_yaml(dp=4))
TO_DP2 = at_data_parallel_size(SPEC, 2, source="--dp 2")


def incident(fault_class: str = "rank_exit") -> _Incident:
    return _Incident(
        cause=control_pb2.FaultReport(job_id="j"), fault_class=fault_class, action="restart_ranks", decided=0.0
    )


def scale() -> _Scale:
    return _Scale(TO_DP2, "scale by the operator", old_dp=4)


def reload() -> _Reload:
    return _Reload("j:20", 20)


# (name, the activity in flight, the ask, its verdict, a word its refusal names)
CASES = [
    ("a recovery on an idle job", None, incident(), START, ""),
    ("a resize on an idle job", None, ScaleAsk(2), START, ""),
    ("a rollback on an idle job", None, ReloadAsk("j:20"), START, ""),
    ("a resume on an idle job", None, ResumeAsk(), START, ""),
    ("a pause on an idle job", None, PauseAsk(), START, ""),
    # A fault replaces whatever ran: its ranks are being replaced.
    ("a fault during a recovery", incident(), incident("comm_error"), SUPERSEDE, ""),
    ("a fault during a resize", scale(), incident(), SUPERSEDE, ""),
    ("a fault during a rollback", reload(), incident(), SUPERSEDE, ""),
    ("a fault while a resume asks the store", _Resume(), incident(), SUPERSEDE, ""),
    # The same ask again (a `surgectl scale` cut short, run again) is the one in flight.
    ("the same resize again", scale(), ScaleAsk(2), FOLD, ""),
    ("the same resize with its own micro-batch named", scale(), ScaleAsk(2, TO_DP2.data.micro_batch_size), FOLD, ""),
    ("the same rollback again", reload(), ReloadAsk("j:20"), FOLD, ""),
    ("a rollback to the newest again", reload(), ReloadAsk(""), FOLD, ""),
    # Anything else is refused, naming what is in flight.
    ("another resize during a resize", scale(), ScaleAsk(3), REFUSE, "resized to dp 2"),
    ("a resize with another micro-batch", scale(), ScaleAsk(2, 7), REFUSE, "resized"),
    ("a rollback during a resize", scale(), ReloadAsk("j:20"), REFUSE, "resized"),
    ("a pause during a resize", scale(), PauseAsk(), REFUSE, "resized"),
    ("another rollback during a rollback", reload(), ReloadAsk("j:10"), REFUSE, "rolled back in place to j:20"),
    ("a resize during a rollback", reload(), ScaleAsk(2), REFUSE, "rolled back"),
    ("a pause during a rollback", reload(), PauseAsk(), REFUSE, "rolled back"),
    ("a rollback during a recovery", incident(), ReloadAsk(), REFUSE, "recovering from rank_exit"),
    ("a resize during a recovery", incident(), ScaleAsk(2), REFUSE, "recovering"),
    ("a second resume", _Resume(), ResumeAsk(), REFUSE, "already being resumed"),
    ("a resize while a resume asks the store", _Resume(), ScaleAsk(2), REFUSE, "being resumed"),
    # A recovery keeps an operator's pause (``_Incident.paused``): no refusal.
    ("a pause during a recovery", incident(), PauseAsk(), START, ""),
    ("a pause while a resume asks the store", _Resume(), PauseAsk(), START, ""),
    # A stop or a forced down: only a resize refuses it (it says what to do after it).
    ("a stop during a resize", scale(), StopAsk(), REFUSE, "; stop it once its events say the resize is done"),
    ("a forced down during a resize", scale(), ForceDownAsk(), REFUSE, "`surgectl down --force` again once"),
    ("a stop during a rollback", reload(), StopAsk(), START, ""),
    ("a stop during a recovery", incident(), StopAsk(), START, ""),
    ("a forced down during a recovery", incident(), ForceDownAsk(), START, ""),
    ("a forced down while a resume asks the store", _Resume(), ForceDownAsk(), START, ""),
]


@pytest.mark.parametrize(("current", "ask", "verdict", "names"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_admit(current, ask, verdict, names) -> None:
    admission = admit("j", current, ask)
    assert admission.verdict == verdict
    if verdict == REFUSE:
        assert admission.reason.startswith("job j is ") and names in admission.reason
        assert "\n" not in admission.reason  # (one line)
    else:
        assert admission.reason == ""
    assert admission.previous is (current if verdict == SUPERSEDE else None)


def job() -> _Job:
    return _Job(status=control_pb2.JobStatus(job_id="j", state=JobState.RUNNING, world_size=4), spec=SPEC)


def test_one_slot_read_by_kind() -> None:
    """Each kind's view of the slot sees only its own kind: never two in flight."""
    j = job()
    assert begin(j, scale()) is None
    assert j.scale is not None and j.incident is None and j.reload is None and not j.resuming
    fault = incident()
    previous = begin(j, fault)
    assert isinstance(previous, _Scale)
    assert j.incident is fault and j.scale is None
    runtime = _runtime(j)
    assert runtime["incident"] is not None and runtime["scale"] is None  # (journaled as its kind)


def test_end_leaves_a_successor() -> None:
    """A resume whose store answer comes after a fault superseded it leaves the recovery."""
    j = job()
    resume = _Resume()
    begin(j, resume)
    assert j.resuming
    fault = incident()
    begin(j, fault)
    end(j, resume)
    assert j.incident is fault
    end(j, _Scale)  # (a kind not in flight: nothing)
    assert j.incident is fault
    end(j, _Incident)
    assert j.activity is None
    begin(j, reload())
    end(j)
    assert j.activity is None


def test_a_resizes_or_rollbacks_pause_in_flight_is_its_activitys() -> None:
    """``pending`` names the boundary command in flight: the operator's pause or stop is set
    on the job; a resize's or a rollback's pause is read from the slot (its phase), so it ends
    with it: superseded by a recovery, or moved on once every rank paused."""
    j = job()
    begin(j, scale())  # (phase "pausing" until every rank paused)
    assert j.pending == "scale"
    runtime = _runtime(j)
    assert runtime["pending"] == "scale"  # (the journal's form is unchanged)
    begin(j, incident())  # a fault supersedes the resize: its pause is no longer in flight
    assert j.pending == ""
    begin(j, _Reload("j:20", 20))
    assert j.pending == "reload"
    j.activity = _Reload("j:20", 20, phase="loading")  # (every rank paused: it loads)
    assert j.pending == ""
    j.pending = "stop"  # the operator's
    assert (j.pending, j.boundary) == ("stop", "stop")
    with pytest.raises(ValueError, match="only a pause or a stop"):
        j.pending = "scale"


def test_a_restored_resize_pause_comes_back_from_its_activity() -> None:
    """A journal (of this control or an older one) that says "scale" in flight restores it
    through the resize it holds, not as a second record of it."""
    j = job()
    begin(j, scale())
    runtime = _runtime(j)
    restored = job()
    _load_runtime(restored, runtime)
    assert (restored.boundary, restored.pending) == ("", "scale")
    assert isinstance(restored.activity, _Scale) and restored.activity.phase == "pausing"


@pytest.mark.parametrize(
    "ask",
    [incident(), ScaleAsk(2), ReloadAsk("j:20"), ResumeAsk(), PauseAsk(), StopAsk(), ForceDownAsk()],
    ids=lambda a: type(a).__name__,
)
def test_a_recovery_awaiting_its_first_step_is_idle_to_every_ask(ask) -> None:
    """``recovered`` is in the slot (the incident's last phase, ``_Recovered``), and nothing
    asked meanwhile is refused for it: it starts (a fault: no recovery to supersede)."""
    admission = admit("j", _Recovered(incident()), ask)
    assert (admission.verdict, admission.reason, admission.previous) == (START, "", None)


def test_a_recovered_job_awaits_its_first_step_in_the_slot_and_whatever_starts_replaces_it() -> None:
    j = job()
    fault = incident()
    begin(j, _Recovered(fault))
    assert j.recovered is fault and idle(j) and ready_for(j.activity) == "started"
    assert (j.incident, j.scale, j.reload, j.pending, j.resuming) == (None, None, None, "", False)
    assert _runtime(j)["incident"] is None  # (not journaled: a restarted control awaits no first step)
    begin(j, scale())  # (a resize asked before the first step: it starts)
    assert j.recovered is None and not idle(j)
    begin(j, _Recovered(fault))
    end(j, _Recovered)  # (its first step came)
    assert j.recovered is None and j.activity is None and idle(j)
