"""A recovery's verification and placement steps as pure transitions (issue 28 item 1): what the
store's verdicts teach the job, what a store that could not be asked means, which version the
relaunch loads and how (relaunched, or loaded into the live ranks), and the report of a
relaunch that did not come up in time. recovery.py performs the effects; nothing here reads a
clock, sends, journals or takes a lock, so tests/control/test_verification_machine.py gives
every case as a table. And a fault reported while a recovery restored from the journal waits
for its relaunch's ranks (``resumed_fault``).

Why a machine: these were inline in recovery.py (``_verified``, ``_verification_failed``,
``_place``'s version choice, ``_reload_live``, ``_restore_overdue``, ``_on_resumed_fault``), each reading and
writing the job as it went, and so only testable through a bus and a store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.contract import Module, control_pb2, engine_pb2, store_pb2
from services.control import fault_decision as fd
from services.control.orchestrator.effects import Record, ToRanks
from services.control.orchestrator.job import ORCH, RECOVERY_TIMEOUT, FaultGrade
from services.jobspec import IN_PLACE_ACTIONS, FaultPolicySpec, JobSpec

StoreFailureCause = store_pb2.StoreFailureCause

# A failed verdict strikes a version only for its bytes (a store older than the typed verdict
# sends none: it said not-ok only for a hash failure).
_BYTES = (store_pb2.VERDICT_UNSPECIFIED, store_pb2.VERDICT_CORRUPT, store_pb2.VERDICT_MISSING_FILE)
# The store could not be asked (as opposed to: it answered and refused).
_UNREACHED = (StoreFailureCause.UNREACHABLE, StoreFailureCause.TIMEOUT)


@dataclass(frozen=True)
class Strike:
    """``version`` fails verification for its bytes: never loaded (``_Job.unusable``)."""

    version: str


@dataclass(frozen=True)
class Learn:
    """``version`` at ``step`` is committed (its completion report never arrived): one of the
    job's versions (``_Job.versions``)."""

    step: int
    version: str


@dataclass(frozen=True)
class Place:
    """Go on to placement (the version's choice, then the relaunch)."""


@dataclass(frozen=True)
class WaitStore:
    """The store could not be asked: the recovery waits for it (``what``), asking again with
    backoff up to the policy's ``store_wait_seconds``."""

    what: str


@dataclass(frozen=True)
class ArmRestore:
    """The relaunched (or reloading) ranks have the policy's ``recovery_timeout`` wait to be
    ready (``restore_seconds``; a rebuild's ``rebuild_seconds``: ``in_place``)."""

    in_place: bool


def verified(
    verdicts: Iterable[store_pb2.CheckpointVerdict],
    versions: Sequence[tuple[int, str]],
    abandoned: frozenset[str],
    unusable: frozenset[str],
) -> list[Strike | Learn | Record]:
    """The store's ``verdicts`` on the job's versions (``versions``: (step, version) known;
    ``abandoned``: another branch of its history, never a lost report; ``unusable``: struck
    already). A version whose bytes fail is struck (once, said); one committed that the job
    never heard of is learnt (said); any other verdict (ok and known, or a failure that is not
    the bytes': the store could not read it now) changes nothing."""
    known = {v for _, v in versions} | abandoned
    effects: list[Strike | Learn | Record] = []
    struck = set(unusable)
    for verdict in verdicts:
        version, step = verdict.info.version, verdict.info.step
        if version in abandoned:
            continue
        if not verdict.ok:
            if verdict.cause in _BYTES and version not in struck:
                struck.add(version)
                effects += [
                    Strike(version),
                    Record(
                        Module.L5_CHECKPOINT_MANAGER,
                        "checkpoint",
                        f"checkpoint {version} at step {step} fails verification ({verdict.reason}); never loaded",
                    ),
                ]
        elif version not in known:
            known.add(version)
            effects += [
                Learn(step, version),
                Record(
                    Module.L5_CHECKPOINT_MANAGER,
                    "checkpoint",
                    f"checkpoint {version} at step {step} verified: committed by the store, "
                    "its completion report never arrived",
                ),
            ]
    return effects


def verification_failed(cause: int, reason: str) -> list[Record | Place | WaitStore]:
    """The store did not give its verdicts (``cause``, a StoreFailureCause, and its
    ``reason``). Unreachable or timed out: the recovery waits for it, nothing struck. It
    answered and refused (e.g. it knows no version of the job): the versions reported by
    SaveCompleted are all there is to choose from, and placement goes on."""
    if cause not in _UNREACHED:
        said = f"checkpoint verification refused ({reason}); choosing among the versions reported"
        return [Record(Module.L5_CHECKPOINT_MANAGER, "recovery", said), Place()]
    return [
        WaitStore(
            f"waiting for the store ({StoreFailureCause.Name(cause).lower()}: {reason}) to verify the checkpoints"
        )
    ]


def pick_version(versions: Sequence[tuple[int, str]], unusable: Iterable[str], bound: int | None) -> str:
    """The newest committed version (``versions``: (step, version), oldest first) not known
    unusable and not after step ``bound`` (None: any); "" none."""
    bad = set(unusable)
    for step, version in reversed(versions):
        if version not in bad and (bound is None or step <= bound):
            return version
    return ""


@dataclass(frozen=True)
class Counted:
    """A decision the recovery took on its own (``no_checkpoint``), counted in the metrics."""

    fault_class: str
    action: str


@dataclass(frozen=True)
class Stop:
    """The job ends (``outcome``, said ``message``), its ranks killed."""

    outcome: int
    message: str


@dataclass(frozen=True)
class NoReload:
    """A rollback in place finds no version to load: every rank is relaunched instead."""


@dataclass(frozen=True)
class ReloadInPlace:
    """The live ranks load ``version`` (``reload_live``)."""

    version: str


@dataclass(frozen=True)
class Relaunch:
    """The recovery controller relaunches the ranks (or rebuilds in place: ``version`` "") to
    load ``version`` ("" and not in place: from scratch); ``source`` says from what."""

    version: str
    source: str


def placement(
    *,
    action: str,
    fault_class: str,
    rank: int,
    reload: bool,
    version: str,
    versions: int,
    policy: FaultPolicySpec,
) -> list[Counted | Record | Stop | NoReload | ReloadInPlace | Relaunch]:
    """The version is chosen (``version``: ``pick_version``'s answer; "" none; ``versions``: how
    many the job committed): how the recovery of ``action`` after ``fault_class`` of ``rank``
    places its ranks. A rebuild in place loads no version (the survivors heal the new ranks).
    No usable version: the policy's ``no_checkpoint`` decides (from scratch, a step of the
    incident's one decision; or stop, a decision of its own). A rollback in place loads the
    version into the live ranks, or, with none, relaunches every rank."""
    if action in IN_PLACE_ACTIONS:
        return [Relaunch("", "a live peer's memory")]
    effects: list[Counted | Record | Stop | NoReload | ReloadInPlace | Relaunch] = []
    if not version:
        decision = fd.no_checkpoint(policy, fault_class, rank, versions)
        stop = decision.action == "stop"
        effects += [
            Counted(decision.fault_class, decision.counted),
            Record(ORCH, "decision" if stop else "recovery", decision.text),
        ]
        if stop:
            return [*effects, Stop(decision.outcome, decision.final)]
        if reload:  # (from scratch: the relaunch path)
            effects += [Record(ORCH, "recovery", "no version to load in place: every rank is relaunched"), NoReload()]
    elif reload:
        return [ReloadInPlace(version)]
    return [*effects, Relaunch(version, f"checkpoint {version}" if version else "scratch")]


@dataclass(frozen=True)
class Shrunk:
    """The relaunched group is at the shrunk layout ``spec`` from now on (its ranks above the
    new size released); the job grows back to its layout before, once slots return (the
    first shrink's: a second shrink keeps that target)."""

    spec: JobSpec


@dataclass(frozen=True)
class Placed:
    """The ranks were placed and relaunched (``recovery_machine.placed``: the waits' state),
    the relaunch said (``source``: what it loads), the queue's head tried (it was held for the
    recovery)."""

    source: str


def relaunched(
    shrunk: JobSpec | None, world_size: int, in_place: bool, source: str
) -> list[Shrunk | Placed | ArmRestore]:
    """The recovery controller relaunched the ranks (RecoveryCompleted): a shrink's smaller
    layout is the job's (``shrunk``, when its size differs from ``world_size``, the group's
    now); the relaunch is placed and said; the ranks have the policy's ``recovery_timeout``
    wait to be ready."""
    taken: list[Shrunk | Placed | ArmRestore] = []
    if shrunk is not None and shrunk.world_size != world_size:
        taken.append(Shrunk(shrunk))
    return [*taken, Placed(source), ArmRestore(in_place=in_place)]


def reload_live(job_id: str, version: str, world_size: int) -> list[Record | ToRanks | ArmRestore]:
    """A rollback done in place: every rank waits in its loop; each loads ``version`` into its
    live process (ResumeTraining.reload_version) and reports ready at its step, within the
    policy's ``restore_seconds`` (else ``recovery_timeout``, decided as any fault: a relaunch)."""
    said = f"loading checkpoint {version} into the {world_size} live ranks (none relaunched)"
    return [
        Record(ORCH, "recovery", said),
        ToRanks(engine_pb2.ResumeTraining(job_id=job_id, reload_version=version)),
        ArmRestore(in_place=False),
    ]


def missing(world_size: int, started: Iterable[int]) -> list[int]:
    """The ranks of a group of ``world_size`` not among those ``started`` (ready), in order."""
    return sorted(set(range(world_size)) - set(started))


def overdue_report(
    job_id: str, action: str, cause_rank: int, missing: Sequence[int], detail: str, now: float
) -> control_pb2.FaultReport:
    """The relaunched ranks did not all report ready in time (``missing``: those not ready): a
    fault of the recovery itself (``recovery_timeout``, SEVERE), decided by the policy like any
    other. A rebuild's is named after the rank it replaces (the survivors not ready are in
    ``detail``: naming one would blame a healthy peer); a relaunch's after its first missing rank."""
    return control_pb2.FaultReport(
        job_id=job_id,
        grade=FaultGrade.SEVERE,
        fault_class=RECOVERY_TIMEOUT,
        source=Module.L1_RECOVERY_CONTROLLER,
        rank=cause_rank if action in IN_PLACE_ACTIONS else missing[0] if missing else 0,
        detected_unix=now,
        occurred_unix=now,
        detail=detail,
    )


@dataclass(frozen=True)
class RelaunchAgain:
    """The relaunch of a recovery restored from the journal is commanded again, for the same
    incident (its restart was spent when it was decided): the incident no longer waits to
    learn whether it reached the node agents, the generation's ranks are forgotten, and the
    recovery starts over at its first step (``_recover``)."""


def resumed_fault(
    cause: control_pb2.FaultReport, incident_class: str, fault_class: str, rank: int, text: str
) -> list[Record | RelaunchAgain]:
    """A fault report (``fault_class`` of ``rank``, said as ``text``) while a recovery restored
    from the journal (of ``incident_class``, its ``cause``) waits to learn whether its relaunch
    reached the node agents. Recorded; an exit control asked for (``rank_released``) says
    nothing of the relaunch; anything else (a rank not re-attached in time and declared
    silent, one that died, a stall) says the relaunched ranks are not all there: relaunched
    again, no further restart spent. (The exit of a rank of the failed generation is a
    consequence: ``triage`` keeps it from here.)"""
    said = [
        Record(
            Module.L1_FAULT_DETECTOR,
            "fault",
            f"{text} (during the recovery from rank {cause.rank}'s {cause.fault_class}, resumed after a control "
            "restart)",
        )
    ]
    if fault_class == "rank_released":
        return said
    again = (
        f"relaunch again for the recovery from {incident_class} of rank {cause.rank} interrupted by the control "
        f"restart: the relaunched ranks are not all there ({fault_class} of rank {rank}); no further restart spent"
    )
    return [*said, RelaunchAgain(), Record(ORCH, "decision", again)]
