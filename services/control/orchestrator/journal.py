"""Restore after a control restart: every job found in the journal comes back in its state, a
live one waits for its ranks to re-attach, one caught mid-recovery resumes that recovery."""

from __future__ import annotations

from services.contract import control_pb2, engine_pb2
from services.control import fault_decision as fd
from services.control.monitoring import start_monitoring
from services.control.orchestrator.activity import end
from services.control.orchestrator.job import (
    ORCH,
    REATTACH_MESSAGE,
    RESTART_MESSAGE,
    RESUME_MESSAGE,
    VERIFYING,
    WAITING_CAPACITY,
    WAITING_STORE,
    JobState,
    _Incident,
    _Job,
)
from services.control.orchestrator.job_journal import _load_runtime
from services.control.orchestrator.layout import _set_layout
from services.jobspec import (
    spec_from_json,
)

# The recovery steps before its placement, as a restored incident's record says them.
_BEFORE_PLACEMENT = {
    VERIFYING: "it was asking the store which checkpoints verify",
    WAITING_STORE: "it was waiting for the store to answer",
    WAITING_CAPACITY: "it was waiting for free slots",
}


class JournalRestore:
    """Restore after a control restart (a part of ``Orchestrator``, see core.py)."""

    def _restore_cordons(self) -> None:
        """The journaled cordons, commanded to L1-2 again with the node agent incarnation
        each holds for (another registering ends it)."""
        for c in self._journal.load_cordons():
            again = control_pb2.CordonWorker(
                worker_id=c.worker_id, reason=c.reason, incarnation=c.incarnation, unix_time=c.unix_time,
                quarantine=c.quarantine,
            )  # fmt: skip
            self.on_worker_cordoned(self._allocator(again).message)

    # ------------------------------------------------------------ private

    def _restore(self) -> None:
        """Jobs from the journal. A live job (warming up, running, paused) keeps its state
        and bookkeeping: its node agents keep its ranks training while control is down and
        re-attach them, resending the events control has not applied; the fault detector
        watches it again, and a rank that does not re-attach in time is declared silent
        (then recovered by the policy). Workers excluded by earlier exclude_node decisions
        stay excluded (the adopted allocation names them).

        A job that was mid-recovery (FAULT_FROZEN with its incident journaled) resumes it:
        monitored and adopted like a live job, its incident restored with the restart it
        already spent. A relaunch journaled as done waits for the relaunched ranks to
        re-attach and report ready. One not known done waits for the re-attached ranks to
        tell: a relaunched rank's ready report says it happened (not repeated); a fault
        report first (a rank not re-attached in time, an exit) says it did not, and it is
        commanded again (``_on_resumed_fault``). A frozen job without a journaled incident
        (journal of an older control) stays frozen; the operator can stop it. Cordoned
        workers stay cordoned."""
        self._restore_cordons()
        for stored in self._journal.load_jobs():
            job = _Job(
                status=stored.status,
                spec=spec_from_json(stored.spec_json),
                seq=stored.last_seq,
                request_id=stored.request_id,  # (a retried submit still gets this job)
                spec_sha256=stored.spec_sha256,
            )
            _load_runtime(job, stored.runtime)
            _set_layout(job.status, job.spec)  # (a journal of an older control has none)
            self._jobs[stored.status.job_id] = job
            state = job.status.state
            if state != JobState.FAULT_FROZEN:
                end(job, _Incident)  # (journaled only while frozen)
            if state == JobState.TERMINATED:
                # (an older control left a resize in the journal of a job a fault ended
                # during it: nothing is in flight for an ended job, and a resume must not
                # be refused for it)
                end(job)
            if state == JobState.STANDBY and stored.runtime.get("queued"):  # waits in the queue, in its place
                # (a journal of an older control: no submission time, its job's creation's)
                queued = {"submitted": job.status.created_unix, **stored.runtime["queued"]}
                job.queued = self._queue.restore(job.status.job_id, queued)
                continue
            if self._restore_parked(job):  # (operator half: drained / parked jobs have no ranks to wait for)
                continue
            if state in (JobState.WARMING_UP, JobState.RUNNING, JobState.PAUSED) or (
                state == JobState.FAULT_FROZEN and job.incident
            ):
                # The detector starts over (its slow-rank comparison lives in memory): a rank
                # still slow is named again within its window, one that recovered meanwhile
                # would otherwise stay listed for good.
                del job.status.slow_ranks[:]
                del job.status.links[:]  # (likewise: a link still faulty is stated again)
                self._faults(
                    start_monitoring(
                        job.status.job_id,
                        job.spec,
                        restored=True,
                        placement={**job.launched, **job.placement},  # (ready ranks: where they reported it)
                        step=job.status.step,
                        generations=job.generations,
                    )
                )
                # The allocator learns the job again (what a recovery relaunches), with the
                # workers it must not use; its slots are taken as the node agents re-attach
                # the ranks.
                self._allocator(
                    control_pb2.AllocateResources(
                        job_id=job.status.job_id,
                        world_size=job.status.world_size,
                        backend=job.spec.parallel.backend,
                        init=engine_pb2.InitJob(
                            job_id=job.status.job_id,
                            spec_json=stored.spec_json,
                            data_address=self._data_address,
                            store_address=self._store_address,
                            **fd.launch_policy(job.spec.fault_policy),
                        ),
                        exclude_worker_ids=sorted(job.excluded),
                        adopt=True,
                    )
                )
                if state != JobState.FAULT_FROZEN:
                    self._reattaching.restored(job.status.job_id, job.status.world_size)
                    self._sent_before_restart[job.status.job_id] = job.commands
                    self._record(
                        job,
                        ORCH,
                        "state",
                        f"{JobState.Name(state)}: {REATTACH_MESSAGE}",
                        status_message=REATTACH_MESSAGE,
                    )
                    continue
                if self._restore_freeze(job):  # (held for inspection: the hold goes on)
                    continue
                incident = job.incident
                what = f"{incident.action} after {incident.fault_class} of rank {incident.cause.rank}"
                before = _BEFORE_PLACEMENT.get(incident.phase)
                if incident.relaunched:
                    how = "its ranks were relaunched; waiting for them to re-attach and report ready"
                elif before:  # (a fresh user read "commanded but not confirmed" of a recovery waiting for the store)
                    how = (
                        f"its relaunch was not commanded yet ({before}); waiting for the ranks to re-attach, "
                        "then it goes on (a rank missing: relaunched)"
                    )
                else:
                    how = (
                        "its relaunch was commanded but not confirmed; waiting for the ranks to re-attach "
                        "(ready relaunched ranks: done; a rank missing: relaunched again)"
                    )
                self._record(
                    job, ORCH, "state", f"FAULT_FROZEN: {RESUME_MESSAGE} ({what}): {how}", status_message=RESUME_MESSAGE
                )
            elif state == JobState.FAULT_FROZEN:
                self._record(job, ORCH, "state", f"FAULT_FROZEN: {RESTART_MESSAGE}", status_message=RESTART_MESSAGE)
            elif state == JobState.STANDBY:
                self._transition(job, JobState.FAULT_FROZEN, ORCH, RESTART_MESSAGE)
