"""A recovery's waits and timers (a part of ``Orchestrator``, see core.py): the one place the
waits' machine (recovery_machine.py) takes effect, the retries and the deadline of a
recovery step, and the fault policy's decision once a wait ran past its limit."""

from __future__ import annotations

import time
from typing import Any

from services.control import fault_decision as fd
from services.control.orchestrator import recovery_machine as rm
from services.control.orchestrator.job import ORCH, WAITING_STORE, _Incident, _Job


class RecoveryWaits:
    """A recovery step's waits, retries and timers (a part of ``Orchestrator``)."""

    def _retry(self, job_id: str, incident: _Incident, phase: str) -> None:
        """A wait's backoff ran out: the step it waits in is commanded again."""
        with self._lock:
            job = self._current(job_id, incident, phase)
            if job is None:
                return
            if phase == WAITING_STORE:  # (its answer may take the RPC's whole deadline)
                job.status.message = f"asking the store again (retry {incident.retries}) to verify the checkpoints"
                job.status.updated_unix = time.time()
                self._publish(job)
                self._ask_verification(job, incident)
            else:
                self._place(job, incident)

    def _wait(self, job: _Job, incident: _Incident, phase: str, fault_class: str, limit_s: float, what: str) -> None:
        """Enter (or stay in) a wait state: say what the job waits for in its status, retry
        the step with backoff; past ``limit_s`` of waiting the policy decides ``fault_class``
        (recovery_machine.py's ``blocked``)."""
        state = rm.waits_of(incident)
        self._apply(job, incident, *rm.blocked(state, phase, fault_class, limit_s, what, time.monotonic()))

    def _apply(self, job: _Job, incident: _Incident, state: rm.Waits, effects: list[rm.Effect]) -> None:
        """Under the lock: a transition of the recovery's waits takes effect: ``state``
        becomes the incident's, then each effect is performed in order (the incident's
        timer and the policy's decision here, the rest by ``_apply_effects``)."""
        incident.phase, incident.waiting_for = state.phase, state.waiting_for
        incident.waiting_since, incident.asked_since, incident.retries = (
            state.waiting_since,
            state.asked_since,
            state.retries,
        )
        for effect in effects:
            if isinstance(effect, rm.Retry):
                self._arm(incident, effect.delay, self._retry, job.status.job_id, effect.phase)
            elif isinstance(effect, rm.GiveUp):
                self._give_up(job, incident, effect.fault_class, effect.why)
            else:  # (a record or a status: effects.py's)
                self._apply_effects(job, [effect])

    def _give_up(self, job: _Job, incident: _Incident, fault_class: str, why: str) -> None:
        """A recovery step waited as long as the policy allows: its class decides. ``stop``
        ends the job FAILED with every version kept (``surgectl resume`` continues it
        later). Any other action goes on: without the store's verdicts (``store_unreachable``:
        the newest version reported is named; the ranks check its digests as they load it),
        or waiting another period for capacity (``no_capacity``: nothing else can place the
        ranks)."""
        decision = fd.give_up(job.spec.fault_policy, fault_class, why)
        self._metrics.decided(fault_class, decision.counted)
        self._record(job, ORCH, "decision", decision.text)
        if decision.action == "stop":
            self._terminate(job, decision.outcome, decision.final, kill=True)
            return
        self._apply(job, incident, rm.gave_up(rm.waits_of(incident), fault_class), [])
        self._place(job, incident)

    def _current(self, job_id: str, incident: _Incident, phase: str) -> _Job | None:
        """The job if ``incident`` is still its recovery in ``phase`` (a timer may fire after
        the incident ended or moved on)."""
        job = self._jobs.get(job_id)
        if job is None or job.incident is not incident or incident.phase != phase:
            return None
        incident.timer = None
        return job

    def _arm(self, incident: _Incident, seconds: float, fn: Any, job_id: str, *args: Any) -> None:
        self._cancel_timer(incident)
        incident.timer = self._deadlines.after(seconds, fn, (job_id, incident, *args))

    @staticmethod
    def _cancel_timer(incident: _Incident | None) -> None:
        if incident is not None and incident.timer is not None:
            incident.timer.cancel()
            incident.timer = None
