"""How a job's ranks and links are watched: phase budgets, heartbeats (``LivenessSpec``) and
the data-plane link probes (``LinksSpec``)."""

from __future__ import annotations

from pydantic import (
    Field,
    model_validator,
)

from services.jobspec.base import _Strict

PHASE_SECONDS_MAX = 7 * 24 * 3600.0  # a week: longer is a typo, not a budget


class PhaseSecondsSpec(_Strict):
    """Progress budgets of the phases that are slow by nature (seconds; ``liveness.phase_seconds``).

    ``evaluation``: the floor of an evaluation's budget (0: ``stall_min_seconds``), to which
    ``stall_step_factor`` x the median evaluation-batch time x ``eval.batches`` is added.
    ``checkpoint_staging``: copying a checkpoint's state out and committing it.
    ``compile``: the first step of a ``operators.compile`` job (forward and backward compile).
    ``profile_export``: ending a profile (``surgectl profile``): the profiler's post-processing
    and the trace's export, which hold the rank's interpreter lock (its beats may stop), so the
    budget stands for its silence too; ``stall_step_factor`` x the median step time x the
    profiled steps is added (a longer profile has more events to write). An export that
    overruns it is a profile that failed (reported, the job trains on), never a fault.
    Each budget restarts whenever the phase's progress advances (an evaluation batch done).
    """

    evaluation: float = Field(0.0, ge=0, le=PHASE_SECONDS_MAX)
    checkpoint_staging: float = Field(600.0, gt=0, le=PHASE_SECONDS_MAX)
    compile: float = Field(900.0, gt=0, le=PHASE_SECONDS_MAX)
    profile_export: float = Field(120.0, gt=0, le=PHASE_SECONDS_MAX)


class LivenessSpec(_Strict):
    """Deadlines the fault detector keeps on every rank, reset by its heartbeats (seconds).

    A rank beats every ``heartbeat_interval_seconds`` from a side thread; silent for
    ``heartbeat_timeout_seconds``: declared silent, unless its node agent states that its
    process runs (not stopped by a signal): then its beats are late, not gone (a loaded host,
    a slow relay), and it is declared silent after ``heartbeat_timeout_running_seconds``. A
    process its agent states stopped (SIGSTOP, ^Z, a debugger's stop) has
    ``heartbeat_timeout_seconds`` counted from the stop: a stop explains a silence, it never
    shortens it (a shorter stop is no fault); stopped for good, it is declared within the
    timeout plus one beat period after its last beat. (A cgroup freeze is no stop ``waitid``
    reports: the process stays stated running.) Each beat says the rank's phase (data
    wait, forward, backward, collective, optimizer, evaluation, checkpoint staging,
    compile). Beating but no progress (no new step, phase or unit of the phase) for the
    phase's budget: stalled. The budget of a training step's phases is
    max(``stall_min_seconds``, ``stall_step_factor`` x median step time); evaluation,
    checkpoint staging and compile have theirs (``phase_seconds``). A rank stalled while it
    waits in a collective is ``rank_stalled_in_collective``: a consequence of the peer that
    stopped outside one. A communication error waits ``attribution_seconds`` for the fault
    that caused it (a peer's death), so the survivor is not blamed. A collective waits for a
    peer at most ``collective_timeout_seconds`` (the process group's timeout; 0: derived from
    these deadlines, at least 60 s: services/engine/parallel_strategy.collective_timeout_s).
    """

    heartbeat_interval_seconds: float = Field(1.0, gt=0)
    heartbeat_timeout_seconds: float = Field(3.0, gt=0)
    heartbeat_timeout_running_seconds: float = Field(15.0, gt=0)
    stall_min_seconds: float = Field(30.0, gt=0)
    stall_step_factor: float = Field(5.0, gt=0, le=10_000)  # (a step 10^4 x the median is stalled)
    attribution_seconds: float = Field(1.0, ge=0)
    collective_timeout_seconds: float = Field(0.0, ge=0, le=PHASE_SECONDS_MAX)
    phase_seconds: PhaseSecondsSpec = PhaseSecondsSpec()

    @model_validator(mode="after")
    def _timeout_covers_beats(self) -> LivenessSpec:
        if self.heartbeat_timeout_seconds < 2 * self.heartbeat_interval_seconds:
            raise ValueError(
                f"heartbeat_timeout_seconds ({self.heartbeat_timeout_seconds}) must be at least twice "
                f"heartbeat_interval_seconds ({self.heartbeat_interval_seconds})"
            )
        if self.heartbeat_timeout_running_seconds < self.heartbeat_timeout_seconds:
            raise ValueError(
                f"heartbeat_timeout_running_seconds ({self.heartbeat_timeout_running_seconds}) must be at least "
                f"heartbeat_timeout_seconds ({self.heartbeat_timeout_seconds})"
            )
        return self


# A checkpoint version of another job: "<job_id>:<n>" or "<job_id>:latest" (the store's forms).
class LinksSpec(_Strict):
    """The data-plane links between the job's nodes (issue 29 item 5, "cut links").

    Each node agent probes its peers among the job's nodes (its ring neighbours and rank 0's
    node) every ``probe_seconds`` with a UDP echo (services/worker/link_probe.py). A link both
    ends hear nothing on for ``down_probes`` probes is down: ``link_down`` once it stayed down
    for the job's ``liveness.heartbeat_timeout_seconds`` while both node agents and every rank
    beat, or earlier when a collective of ranks that still beat stalls (or fails) across it.
    One that loses ``degraded_loss`` of
    its probes or more, either way, is degraded (``link_degraded``, a warning). A cut is seen
    ``down_probes`` x ``probe_seconds`` after it, plus one period at most.
    """

    probe_seconds: float = Field(1.0, ge=0.05, le=60.0)  # (0.05 s: 20 packets a second per peer at most)
    down_probes: int = Field(3, ge=2, le=100)
    degraded_loss: float = Field(0.2, gt=0, lt=1)
