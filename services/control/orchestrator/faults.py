"""Fault intake: graded ``FaultReport`` (L1-3), failed saves and verifications (L5-1) and
resource pressure (L1-2), each recorded and handed to a decision or to triage. A report of a
worker itself (no job) goes to worker_health.py."""

from __future__ import annotations

import time
from typing import Any

import structlog

from services.common import save_failing
from services.contract import Module, control_pb2, route_pb2, store_pb2
from services.control import fault_decision as fd
from services.control.orchestrator.job import (
    ORCH,
    VERIFYING,
    WAITING_STORE,
    FaultGrade,
    JobState,
    StoreFailureCause,
    _HeldFailure,
    _Incident,
    _Job,
)
from services.control.orchestrator.texts import (
    _broken_text,
    _failed_text,
    _failure_name,
    _gib,
    _newest,
    _write_error_name,
)
from services.control.orchestrator.triage import (
    _EXITS,
    _HANDLED_ON_RECEIPT,
    CONSEQUENCE,
    JOB_ENDED,
    LATE,
    NORMAL_END,
    RELEASED,
    RESUMED,
    STALE,
    STORE_WAIT,
    _stale_text,
    consequence_event,
    triage,
)
from services.jobspec import (
    IN_PLACE_ACTIONS,
    JobSpec,
)

_log = structlog.get_logger("orchestrator")


# L1-3's slow-rank findings (services/control/fault_detector/rules.py SLOW_RANK, SLOW_RANK_CLEARED).
SLOW_RANK, SLOW_RANK_CLEARED = "slow_rank", "slow_rank_cleared"


# L1-3's data-plane link findings (services/control/fault_detector/rules.py LINK_DOWN,
# LINK_DEGRADED): kept in the job's status until the report that ``cleared`` them.
LINK_CLASSES = ("link_down", "link_degraded")


# L1-3's report of a rank's data relay reconnecting to an unreachable data service (or, with
# ``cleared``, of it answering again): a wait (``_data_outage``), not a fault to decide.
DATA_SERVICE_UNREACHABLE = "DataServiceUnreachable"


# L1-3's grade of this module's own failure event when its journal refused a write (services/
# control/journal_failure.py; rules.py JOURNAL_WRITE_FAILED): control's fault, not the job's.
JOURNAL_WRITE_FAILED = "journal_write_failed"


# Beyond L1-3's hold of a comm_error, the time for its cause's decision to open an incident.
DECISION_MARGIN_SECONDS = 1.0


# A record held longer than this tells the operator nothing more (a heartbeat timeout of hours).
MAX_ATTRIBUTION_SECONDS = 60.0


def _attribution_window(spec: JobSpec) -> float:
    """How long a failed collective waits for its cause: as long as L1-3 holds a comm_error
    while a peer may be going quiet (its heartbeat timeout), plus the decision's margin."""
    live = spec.liveness
    window = max(live.attribution_seconds, live.heartbeat_timeout_seconds + 0.5) + DECISION_MARGIN_SECONDS
    return min(window, MAX_ATTRIBUTION_SECONDS)


def _old_world_save(incident: _Incident | None, msg: store_pb2.SnapshotFailed) -> _Incident | None:
    """``incident``, if ``msg`` is a save its survivors began before it (a step no later than
    the job's when it was decided, or than the step its rebuilt group started at: a rank's
    steps reach control up to a beat late, so the job's step may lag the ranks' at the
    decision): dropped with the group it rebuilt, reported by the relay at the next save,
    long after the recovery. A save of the new group is of a later step than it started at."""
    if incident is None or incident.action not in IN_PLACE_ACTIONS:
        return None
    began_before = 0 < msg.step <= max(incident.at_step, incident.started_at)
    return incident if msg.operation == "save" and began_before else None


class FaultIntake:
    """Fault intake (a part of ``Orchestrator``, see core.py)."""

    # ------------------------------------------------------------ fault reports (L1-3)

    def on_fault_report(self, msg: control_pb2.FaultReport, payload: Any = None) -> None:
        """Decide on a graded fault, once per incident, by the job's fault policy.

        What the report is to the job is ``triage``'s (a pure function, triage.py); this
        records it and does what follows. A report from a rank of a generation being
        recovered from is a consequence of the incident: recorded, not decided on. An exit
        control asked for (``rank_released``) or the clean exit of a rank that had finished
        needs no decision, nor the end of an incarnation the job already replaced (``STALE``:
        recorded as that incarnation's end, not counted as a fault). A clean exit of a rank
        that never finished is a lost rank (decided as ``rank_exit``).
        """
        if not msg.job_id:
            self._on_worker_fault(msg)
            return
        received = time.time()
        with self._lock:
            job = self._jobs.get(msg.job_id)
            if job is None:
                return
            if msg.fault_class in (SLOW_RANK, SLOW_RANK_CLEARED) and self._slow_rank(job, msg):
                return
            if msg.fault_class in LINK_CLASSES and self._link_fault(job, msg):
                return
            if msg.event == DATA_SERVICE_UNREACHABLE:
                if (since := self._data_outage(job, msg)) is not None:
                    # A new wait (the first rank's report of it): the policy's deadline for it.
                    if job.data_timer is not None:
                        job.data_timer.cancel()
                    limit = fd.wait_seconds(job.spec.fault_policy, fd.DATA_OUTAGE)
                    job.data_timer = self._deadlines.after(limit, self._data_outage_due, (msg.job_id, since))
                return
            if msg.fault_class == JOURNAL_WRITE_FAILED and self._journal_refused(job, msg):
                return
            kind = triage(msg, job)
            if kind == JOB_ENDED:
                return  # e.g. ranks exiting after the job ended: expected, nothing to decide
            if kind not in (NORMAL_END, STALE) and msg.fault_class != "rank_released":
                # (a finished rank's clean exit, an exit control asked for and a replaced
                # incarnation's end are no faults: counted, an alert on MEDIUM fired at every
                # successful job, and one frozen agent counted twice)
                self._metrics.fault_reported(msg, received, consequence=kind in (CONSEQUENCE, LATE, STORE_WAIT))
            if kind == STALE:
                self._commit_later(msg)
                self._record(job, Module.L1_FAULT_DETECTOR, "rank", _stale_text(msg))
                return
            if self._handled_on_receipt(job, msg):
                return
            text = f"{FaultGrade.Name(msg.grade)} {fd.named(msg.fault_class, msg)}: {msg.detail}"
            ended = msg.fault_class in _EXITS
            incident = job.incident
            if kind == RESUMED:
                self._on_resumed_fault(job, incident, msg, text)
                return
            if kind == STORE_WAIT:  # (a relaunched rank's load the store did not answer)
                self._load_outage(job, incident, msg, text)
                return
            if kind in (LATE, CONSEQUENCE, NORMAL_END, RELEASED):
                # A rank's report recorded only (every rank of a group reports its end, or the
                # incident's consequence): not waited for when applied by the event applier
                # (commit_later.py); what follows from it is the incident's, already decided.
                self._commit_later(msg)
            if kind == LATE:
                late = job.last_incident
                self._record(
                    job,
                    Module.L1_FAULT_DETECTOR,
                    *consequence_event(
                        msg, f"rank {late.cause.rank}'s {late.fault_class}, reported after the recovery"
                    ),
                )
                return
            if kind == CONSEQUENCE:
                if ended and incident.dying[msg.rank] > 0:
                    incident.dying[msg.rank] -= 1
                cause = incident.cause
                self._record(
                    job, Module.L1_FAULT_DETECTOR, *consequence_event(msg, f"rank {cause.rank}'s {cause.fault_class}")
                )
                return
            if ended:
                job.exited.add(msg.rank)
            if kind == NORMAL_END:
                self._keep(job)
                return  # its loop reported finished first: the normal end of that rank, no fault
            if kind == RELEASED:  # an exit control asked for (a stop, a drain, a preemption): no fault
                self._record(
                    job, Module.L1_FAULT_DETECTOR, "rank", f"rank {msg.rank} ended after its release: {msg.detail}"
                )
                return
            self._record(job, Module.L1_FAULT_DETECTOR, "fault", text)
            self._decide(job, msg)

    def _journal_refused(self, job: _Job, msg: control_pb2.FaultReport) -> bool:
        """Control's journal refused a write of the job's (L1-3's ``journal_write_failed``: the
        write's error typed by its SQLite result code or errno, never by its text). Where the
        job's policy ignores it (the default), the decision that write carried was undone and
        the operator's command refused already (undos.py ``_undo_if_lost``); the job goes on,
        and control's health says the journal fails (``JobStore.health``). Nothing is recorded
        in the job's log: the journal is what refuses, and a record it refused would come back
        as one more failure of this module, again and again while the disk is full. A policy
        that names another action for the class (``stop``) is decided as any fault."""
        if fd.action_of(job.spec.fault_policy, msg) != "ignore":
            return False
        self._metrics.decided(fd.fault_class_of(msg), "ignore")
        _log.warning(
            "control's journal refused a write: the job goes on",
            job_id=msg.job_id,
            detail=msg.detail,
            journal=self._journal.health.failing(),
        )
        return True

    def _slow_rank(self, job: _Job, msg: control_pb2.FaultReport) -> bool:
        """Keep the job's slow ranks (``JobStatus.slow_ranks``, shown by ``surgectl status``)
        as L1-3 names and clears them; True when nothing follows (a clearing: recorded, never
        decided on; any report of an ended job). A rank named slow goes on to the decision
        (fault_policy ``actions.slow_rank``: ignore by default)."""
        if job.status.state == JobState.TERMINATED:
            return True
        kept = [r for r in job.status.slow_ranks if r.rank != msg.rank]
        del job.status.slow_ranks[:]
        job.status.slow_ranks.extend(kept)
        if msg.fault_class == SLOW_RANK_CLEARED:
            self._record(job, Module.L1_FAULT_DETECTOR, "fault", f"{msg.fault_class}: {msg.detail}")
            return True
        job.status.slow_ranks.add(
            rank=msg.rank, worker_id=msg.worker_id, step=msg.step, detail=msg.detail, unix_time=msg.detected_unix
        )
        return False

    def _link_fault(self, job: _Job, msg: control_pb2.FaultReport) -> bool:
        """Keep the job's faulty links (``JobStatus.links``, shown by ``surgectl status``) as
        L1-3 names them and clears them; True when nothing follows (a clearing: recorded,
        never decided on; any report of an ended job). A link named goes on to the decision
        (link_degraded: ignore by default; link_down: exclude_node)."""
        if job.status.state == JobState.TERMINATED:
            return True
        ends = {e.worker_id for e in msg.link_ends}
        kept = [f for f in job.status.links if set(f.worker_ids) != ends]
        del job.status.links[:]
        job.status.links.extend(kept)
        if msg.cleared:
            self._record(job, Module.L1_FAULT_DETECTOR, "fault", f"{msg.fault_class} cleared: {msg.detail}")
            return True
        job.status.links.add(
            fault_class=msg.fault_class, worker_ids=sorted(ends), detail=msg.detail, unix_time=msg.detected_unix
        )
        return False

    # ------------------------------------------------------------ fault decisions

    def _data_outage(self, job: _Job, msg: control_pb2.FaultReport) -> float | None:
        """A rank's data relay cannot reach the data service and reconnects (``cleared``: it
        answers again). A data service down is no training fault: the ranks stay alive and
        continue at the batch where they stopped when it is back, so the job waits, its status
        saying for what and what brings it back, up to ``fault_policy.data_outage_seconds``
        from the first rank's report; past it (``_data_outage_due``) the policy decides
        ``data_outage`` (pause by default). The wait ends when every waiting rank's relay
        is through again. Returns when a new wait began (time.monotonic()), for the caller to
        arm its deadline; else None. Under the lock; nothing here blocks (a record)."""
        if job.status.state == JobState.TERMINATED or (job.status.state == JobState.PAUSED and job.parked):
            return None
        now = time.monotonic()
        if msg.cleared:
            if msg.rank not in job.data_waiting:
                return None
            job.data_waiting.discard(msg.rank)
            if job.data_waiting:
                return None
            self._end_data_wait(job)
            text = (
                f"data service back after {now - job.data_since:.1f} s of waiting; training continues at step "
                f"{job.status.step + 1}, at the batch where it stopped"
            )
            self._record(job, Module.L1_FAULT_DETECTOR, "data", text, status_message=text)
            return None
        first = not job.data_waiting
        job.data_waiting.add(msg.rank)
        if not first:
            return None
        job.data_since = now
        limit = fd.wait_seconds(job.spec.fault_policy, fd.DATA_OUTAGE)
        text = (
            f"waiting for the data service: {msg.detail}; `surgectl up` starts what is down (or `surgectl restart "
            f"data`), and the job continues at the batch where it stopped; the fault policy decides after "
            f"{limit:g} s (fault_policy.data_outage_seconds)"
        )
        self._record(job, Module.L1_FAULT_DETECTOR, "data", text, status_message=text)
        return now

    def _data_outage_due(self, job_id: str, since: float) -> None:
        """The wait for the data service begun at ``since`` lasted the policy's
        ``data_outage_seconds``: ``data_outage`` decided like any fault (pause by default:
        PAUSED, ranks gone, every checkpoint kept, with the hint)."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or not job.data_waiting or job.data_since != since:
                return
            if job.status.state == JobState.TERMINATED or (job.status.state == JobState.PAUSED and job.parked):
                return
            job.data_timer = None
            limit = fd.wait_seconds(job.spec.fault_policy, fd.DATA_OUTAGE)
            waiting = sorted(job.data_waiting)
            report = control_pb2.FaultReport(
                job_id=job_id,
                grade=FaultGrade.SEVERE,
                fault_class=fd.DATA_OUTAGE,
                source=Module.L4_DATASET_VERSIONS,
                rank=waiting[0],
                detected_unix=time.time(),
                occurred_unix=time.time() - (time.monotonic() - since),
                step=job.status.step,
                detail=(
                    f"the data service stayed unreachable for {limit:g} s (fault_policy.data_outage_seconds; "
                    f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} waiting)"
                ),
            )
            self._record(job, ORCH, "fault", f"SEVERE {fd.DATA_OUTAGE}: {report.detail}")
            self._end_data_wait(job)
            self._decide(job, report)

    @staticmethod
    def _end_data_wait(job: _Job) -> None:
        """The wait for the data service is over (back, decided, or the ranks replaced)."""
        job.data_waiting.clear()
        if job.data_timer is not None:
            job.data_timer.cancel()
            job.data_timer = None

    def _handled_on_receipt(self, job: _Job, msg: control_pb2.FaultReport) -> bool:
        """L1-3's grade of a failure event this module handled itself when it arrived
        (``_HANDLED_ON_RECEIPT``), which the job's policy ignores (the default: MINOR): the
        decision is counted, nothing is recorded. Why: the event's own record ("checkpoint save
        of ... failed (timeout: ...); training continues") already tells the operator what
        happened and what follows; a "fault" record and an "ignore ... N ignored so far"
        decision next to it read as a second fault, and a store outage is none (no restart,
        no step lost). A policy that does not ignore the class is decided as any fault."""
        if msg.event not in _HANDLED_ON_RECEIPT:
            return False
        if fd.action_of(job.spec.fault_policy, msg) != "ignore":
            return False
        self._metrics.decided(fd.fault_class_of(msg), "ignore")
        return True

    def on_checkpoint_corrupt(self, msg: store_pb2.CheckpointCorrupt, payload: Any = None) -> None:
        """The store's scrub found a committed version's bytes wrong: it is never named for
        a load again (verified at commit, re-verified in the background, never on the
        recovery's path)."""
        with self._lock:
            job = self._jobs.get(msg.job_id)
            if job is None or msg.version in job.unusable:
                return
            job.unusable.add(msg.version)
            self._record(
                job,
                Module.L5_CHECKPOINT_MANAGER,
                "checkpoint",
                f"checkpoint {msg.version} at step {msg.step} found {StoreFailureCause.Name(msg.cause).lower()} by the "
                f"store's scrub ({msg.reason}); never loaded",
            )

    def on_snapshot_failed(self, msg: store_pb2.SnapshotFailed, payload: Any = None) -> None:
        """A store operation failed, with its typed cause. ``verify``: the recovery's
        verification step could not be done (the store unreachable or slow): the job waits
        and the step is retried. ``save``: a checkpoint could not be written; training goes on
        and the next interval tries again (no decision: a store outage is not a training
        fault)."""
        if msg.failure.replaced or self._resume_answered(msg):
            return  # (a replaced incarnation's save: recorded stale through L1-3's grade, no failed save)
        with self._lock:
            job = self._jobs.get(msg.job_id)
            if job is None or job.status.state == JobState.TERMINATED:
                return
            if msg.operation == "verify":
                incident = job.incident
                if incident is not None and incident.phase in (VERIFYING, WAITING_STORE):
                    self._verification_failed(job, incident, msg)
                return
            self._save_failed(job, msg)

    def _save_failed(self, job: _Job, msg: store_pb2.SnapshotFailed) -> None:
        """A save the store could not take (training went on), or a rank's load that failed
        (its loop reports the failure itself, decided as a fault). A load that found the
        version's bytes wrong has the store re-hash the job's versions (``ScrubCheckpoints``),
        so that its catalog, and so ``latest``, knows it too."""
        cause = StoreFailureCause.Name(msg.cause).lower() if msg.cause else _failure_name(msg)
        self._metrics.checkpoint_failed(cause)
        what = f"checkpoint {msg.operation}" + (f" of {msg.version}" if msg.version else "")
        peer = not msg.cause and msg.failure.cause == route_pb2.FailureCause.FAILURE_COMMUNICATION
        if msg.operation == "save" and not peer:  # (a peer lost in its collectives: the recovery's to tell)
            save_failing.note(job.status.save_failing, msg, time.time())  # (`surgectl status`, `down`: why)
        if msg.operation == "save" and job.pending and msg.step == job.pending_at:
            # The boundary checkpoint of a pause, stop or drain (a drain's save in place of a
            # paused step too: operator.py ``_drain_unsaved_pause``): nothing continues after it.
            job.boundary_failed = True
            cause += f", {_write_error_name(msg)}" if msg.cause == StoreFailureCause.WRITE_REFUSED else ""  # (which)
            self._record(
                job,
                Module.L5_CHECKPOINT_MANAGER,
                "checkpoint",
                f"{what} failed ({cause}: {msg.reason}): the {'drain' if job.draining else job.pending} after step "
                f"{msg.step} has no checkpoint of it; the newest is {_newest(job) or 'none'}",
            )
            return
        if peer:
            self._broken_by_peer(job, msg, what)
            return
        self._record(job, Module.L5_CHECKPOINT_MANAGER, "checkpoint", _failed_text(what, cause, msg))
        corrupt = msg.cause in (StoreFailureCause.CORRUPT, StoreFailureCause.MISSING_FILE)
        if msg.operation == "load" and corrupt:
            # The rank read the version's bytes and they fail their digest (or a file is gone):
            # a finding about the bytes, so the version is struck at once (L1-3's report of it,
            # checkpoint_error, is then decided by the policy and relaunches from an older one).
            if msg.version and msg.version not in job.unusable:
                job.unusable.add(msg.version)
                self._record(
                    job,
                    ORCH,
                    "checkpoint",
                    f"checkpoint {msg.version} fails its digest check on load; never loaded again",
                )
            if self._checkpoints is not None:
                self._checkpoints(store_pb2.ScrubCheckpoints(job_id=job.status.job_id))  # answered as events

    def _broken_by_peer(self, job: _Job, msg: store_pb2.SnapshotFailed, what: str) -> None:
        """A save or load whose own collectives failed: almost always a peer lost during it
        (its rank killed, its node gone), whose fault L1-3 reports on its own path, often a
        moment after this (a node agent's session closing, a silence). Recorded as that
        incident's consequence, never as a failure of its own: the save is lost with the
        generation, and the recovery, not the store, is what the operator needs to read
        about. With no incident open yet, the record waits as long as L1-3 holds a comm_error
        for its cause (``_attribution_window``); an incident opened by then is the cause, else
        the failure is recorded as it is (a save's next interval tries again either way)."""
        incident = job.incident or _old_world_save(job.last_incident, msg)
        if incident is not None:
            self._record(job, Module.L5_CHECKPOINT_MANAGER, "checkpoint", _broken_text(what, msg, incident))
            return
        held = _HeldFailure(msg, what)
        held.timer = self._deadlines.after(
            _attribution_window(job.spec), self._broken_by_peer_due, (job.status.job_id, held)
        )
        job.held.append(held)

    def _broken_by_peer_due(self, job_id: str, held: _HeldFailure) -> None:
        """A held failure's window passed with no incident opened: recorded as it is."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and any(h is held for h in job.held):  # (not yet released by an incident or the end)
                job.held = [h for h in job.held if h is not held]
                self._record(job, Module.L5_CHECKPOINT_MANAGER, "checkpoint", _broken_text(held.what, held.msg, None))

    def _release_held(self, job: _Job, incident: _Incident | None) -> None:
        """Record the failures held for their cause (``_broken_by_peer``), oldest first: as
        ``incident``'s consequences (it opened), or as they are (a window passed, the job
        ends)."""
        held, job.held = job.held, []
        for h in held:
            if h.timer is not None:
                h.timer.cancel()
            self._record(job, Module.L5_CHECKPOINT_MANAGER, "checkpoint", _broken_text(h.what, h.msg, incident))

    def on_checkpoint_scrubbed(self, msg: store_pb2.CheckpointScrubbed, payload: Any = None) -> None:
        """The store re-hashed a job's versions: those it found corrupt for the first time
        are struck, as when its scrub publishes them."""
        for corrupt in msg.newly_corrupt:
            self.on_checkpoint_corrupt(corrupt)

    # ------------------------------------------------------------ resource events (L1-2)

    def on_resource_pressure(self, msg: control_pb2.ResourcePressure, payload: Any = None) -> None:
        """Append a "resource" event to the log of every live job named, e.g. ``memory
        pressure on wa: 1.2 GiB of 24.0 GiB available`` (GiB = 2**30 bytes)."""
        # Recorded only: what to do about pressure (pause, shrink, checkpoint and move)
        # is the fault policy's to decide, in a later issue; this method takes no action.
        what = "memory pressure" if msg.under_pressure else "memory pressure relieved"
        where = f"{msg.worker_id} {msg.device}" if msg.device else msg.worker_id  # (a device's, or the host's)
        text = f"{what} on {where}: {_gib(msg.available_bytes)} of {_gib(msg.total_bytes)} available"
        with self._lock:
            for job_id in msg.job_ids:
                job = self._jobs.get(job_id)
                if job is not None and job.status.state != JobState.TERMINATED:
                    self._record(job, Module.L1_RESOURCE_ALLOCATOR, "resource", text)
