"""Inspect before acting (issue 29 item 9): a decided relaunch held while the ranks stay alive.

With ``fault_policy.freeze_seconds`` (``fault_decision.freeze_for`` says which decisions), the
incident is opened as usual (its restart spent, its failed generation's reports consequences)
but its recovery does not start: its phase is ``FROZEN``, the job FAULT_FROZEN with a message
saying until when and what the operator can do, and every rank gets FreezeTraining (it stays
where it is, alive and idle, its beats saying PHASE_FROZEN: the fault detector keeps no
progress deadline on it). The hold ends when its deadline (the orchestrator's deadline pool)
fires or the operator thaws the job (`surgectl thaw JOB`, or `surgectl resume JOB`): the step
fault's verdict held back goes to the ranks and the recovery starts (``_recover``); a rebuild or
shrink in place first thaws its survivors (``FreezeTraining.thaw``: they go on and rebuild their
group, the lost ranks are killed by the recovery as without a hold). `surgectl
stop JOB` ends the job instead (its ranks killed, as for any recovery). A control restarted
during the hold keeps it: the incident is journaled with ``frozen_until`` and the verdict, and
the restored control arms what is left of it (``_restore_freeze``).
"""

from __future__ import annotations

import time

from services.contract import engine_pb2
from services.control.fault_decision import named
from services.control.orchestrator.job import FROZEN, ORCH, JobState, _Incident, _Job
from services.jobspec import IN_PLACE_ACTIONS


def _clock(unix: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(unix))


def frozen_text(job: _Job, incident: _Incident) -> str:
    """The job's status message while held: why, until when, what runs then, what the operator can do."""
    job_id = job.status.job_id
    return (
        f"held for inspection after {named(incident.fault_class, incident.cause)} of rank {incident.cause.rank} until "
        f"{_clock(incident.frozen_until)} (fault_policy.freeze_seconds): its ranks are alive and idle; "
        f"then {incident.action} runs; `surgectl thaw {job_id}` runs it now, `surgectl stop {job_id}` ends the job"
    )


class Freezing:
    """The hold before a decided relaunch (a part of ``Orchestrator``, see core.py)."""

    def _freeze(self, job: _Job, incident: _Incident, seconds: float) -> None:
        """Under the lock, ``incident`` just decided: hold its recovery ``seconds``. Journaled
        (with the incident) before FreezeTraining goes to the ranks."""
        incident.phase, incident.frozen_until = FROZEN, time.time() + seconds
        message = frozen_text(job, incident)
        if job.status.state != JobState.FAULT_FROZEN:
            self._transition(job, JobState.FAULT_FROZEN, ORCH, message)
        else:
            self._record(job, ORCH, "state", f"FAULT_FROZEN: {message}", status_message=message)
        self._loop(
            engine_pb2.FreezeTraining(job_id=job.status.job_id, reason=message, until_unix=incident.frozen_until)
        )
        self._arm(incident, seconds, self._thaw_due, job.status.job_id)

    def _thaw_due(self, job_id: str, incident: _Incident) -> None:
        """The hold ran out (a deadline callback): the decided action runs."""
        with self._lock:
            job = self._current(job_id, incident, FROZEN)
            if job is not None:
                self._thaw(job, incident, "the hold for inspection ran out")

    def _thaw(self, job: _Job, incident: _Incident, why: str) -> None:
        """Under the lock: end the hold of ``incident`` (``why``), send the verdict held back
        and start its recovery. The recovery's clock starts now (the hold is not recovery time)."""
        self._cancel_timer(incident)
        incident.decided = time.monotonic()
        message = f"recovering from {named(incident.fault_class, incident.cause)} of rank {incident.cause.rank}"
        self._record(
            job, ORCH, "decision", f"{why}: {incident.action} after {incident.fault_class} of rank "
            f"{incident.cause.rank} runs now", status_message=message,
        )  # fmt: skip
        if incident.verdict is not None:
            verdict, incident.verdict = incident.verdict, None
            self._loop(verdict)
        if incident.action in IN_PLACE_ACTIONS:
            # The survivors go on in place (a relaunch kills what it held instead): nothing else
            # ends their hold. Each leaves it and rebuilds its group as it would have without one
            # (a rank held at a step boundary steps into the broken group first); the lost ranks
            # are killed by the recovery, thawed or not.
            self._loop(engine_pb2.FreezeTraining(job_id=job.status.job_id, thaw=True))
        self._recover(job, incident)

    def _thaw_request(self, job: _Job) -> bool:
        """Under the lock, an operator's thaw or resume: True when it ended a hold."""
        incident = job.incident
        if incident is None or incident.phase != FROZEN:
            return False
        self._thaw(job, incident, "thawed by the operator")
        return True

    def _restore_freeze(self, job: _Job) -> bool:
        """A control restarted during a hold (the job's incident journaled FROZEN): the hold
        goes on for what is left of it (the decided action runs at once if none is). True
        when the job was held."""
        incident = job.incident
        if incident is None or incident.phase != FROZEN:
            return False
        left = max(0.0, incident.frozen_until - time.time())
        message = frozen_text(job, incident)
        self._record(
            job, ORCH, "state", f"FAULT_FROZEN: control restarted during the hold; {message}", status_message=message,
        )  # fmt: skip
        self._arm(incident, left, self._thaw_due, job.status.job_id)
        return True
