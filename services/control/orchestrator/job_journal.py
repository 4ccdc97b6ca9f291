"""A job's journal form: the bookkeeping a restarted control needs to continue the job
(``_runtime``, journaled with every event) and its reading back (``_load_runtime``), with
the forms of the one activity in flight (a recovery's ``_Incident``, a resize's ``_Scale``,
a rollback's ``_Reload``). One file so that what is written and what is read stay side by
side: a key added to one and not the other is lost across a control restart."""

from __future__ import annotations

import base64
import time
from collections import Counter

from services.contract import control_pb2, engine_pb2
from services.control.orchestrator.job import FROZEN, PLACING, RESTORING, _Incident, _Job, _Reload, _Scale
from services.jobspec import spec_from_json, spec_to_json


def _runtime(job: _Job) -> dict:
    """The bookkeeping a restarted control needs to continue the job (journaled with every
    event): who started / paused / finished, a pause or stop in flight, restart budgets
    spent, checkpoint versions, the workers excluded, the recovery in flight (its cause,
    the version it loads, whether its relaunch was commanded and completed), the verdicts the
    ranks may ask for again and the standing orders withdrawn from them."""
    return {
        "started": sorted(job.started),
        "paused": sorted(job.paused),
        # (int keys, as placement's: JSON writes them as strings; a copy in C, per record: one
        # per rank's finish and exit, O(world) each, the str() of every key was most of a finish)
        "finished": dict(job.finished),
        "pending": job.pending,
        "pending_at": job.pending_at,
        "pending_seq": job.pending_seq,
        "commands": job.commands,
        "in_flight": [
            [type(m).__name__, base64.b64encode(m.SerializeToString()).decode()] for m in job.in_flight.values()
        ],
        "running_since": job.running_since,
        "exited": sorted(job.exited),
        "restarts": dict(job.restarts),
        "ignored": dict(job.ignored),
        "versions": [list(v) for v in job.versions],
        "unusable": sorted(job.unusable),
        "excluded": sorted(job.excluded),
        "placement": dict(job.placement),  # (int keys: JSON writes them as strings; a copy in C, per event)
        "launched": dict(job.launched),  # (empty once every rank reported ready)
        "generations": dict(job.generations),
        "start_held": job.start_held,
        "abandoned": sorted(job.abandoned),
        "incident": _incident_to_json(job.incident) if job.incident is not None else None,
        "draining": job.draining,
        "parked": job.parked,
        "resume_after_pause": job.resume_after_pause,
        "drain_own_pause": job.drain_own_pause,
        "drain_unsaved_step": job.drain_unsaved_step,
        "drain_save_step": job.drain_save_step,
        "claim_until": job.claim_until,
        "relaunch": job.relaunch,
        "verdicts": [base64.b64encode(v.SerializeToString()).decode() for v in job.verdicts.values()],
        "revoked": {str(order): list(revoked) for order, revoked in job.revoked.items()},
        "queued": job.queued.to_json() if job.queued is not None else None,
        "grow_to": list(job.grow_to),
        "last_resize": job.last_resize,
        "micro_batch_cap": job.micro_batch_cap_seen,
        "throughput": list(job.throughput),
        "scale": _scale_to_json(job.scale) if job.scale is not None else None,
        "reload": [job.reload.version, job.reload.step, job.reload.phase, job.reload.asked_unix]
        if job.reload is not None
        else None,
    }


def _incident_to_json(i: _Incident) -> dict:
    return {
        "cause": base64.b64encode(i.cause.SerializeToString()).decode(),
        "fault_class": i.fault_class,
        "action": i.action,
        # (int keys, as placement's, zeros kept and dropped at load: a copy in C, per record; the
        # comprehension with str() of every key was O(world) Python per rank exit of a recovery)
        "dying": dict(i.dying),
        "version": i.version,
        "bound": i.bound,
        "exclude": list(i.exclude),
        "lost": list(i.lost),
        "shrunk": spec_to_json(i.shrunk) if i.shrunk is not None else "",
        "relaunched": i.relaunched,
        "phase": i.phase,
        "paused": i.paused,
        "frozen_until": i.frozen_until,
        "reload": i.reload,
        "verdict": base64.b64encode(i.verdict.SerializeToString()).decode() if i.verdict is not None else "",
    }


def _incident_from_json(d: dict) -> _Incident:
    """The recovery in flight as journaled, ``resumed``: until a relaunched rank reports
    ready, nothing says its relaunch reached the node agents. Even one journaled as done
    (``relaunched``) was only queued to the sessions: control killed right after may never
    have sent it (seen in CI: the old ranks still ran and the new never came).
    Its clock (``decided``) starts again now: the time before the restart is not measured."""
    relaunched = bool(d.get("relaunched", False))
    phase = d.get("phase", RESTORING if relaunched else PLACING)
    verdict = engine_pb2.StepVerdict.FromString(base64.b64decode(d["verdict"])) if d.get("verdict") else None
    return _Incident(
        cause=control_pb2.FaultReport.FromString(base64.b64decode(d["cause"])),
        fault_class=d["fault_class"],
        # A rebuild caught by a control restart stays one: if its ranks report ready, it
        # completed; if it must be commanded again, the allocator no longer knows the
        # placement and the orchestrator falls back to relaunching every rank (_place).
        action=d["action"],
        lost=[int(r) for r in d.get("lost", ())],
        shrunk=spec_from_json(d["shrunk"]) if d.get("shrunk") else None,
        decided=time.monotonic(),
        dying=Counter({int(r): int(n) for r, n in d.get("dying", {}).items() if int(n) > 0}),
        version=d.get("version", ""),
        bound=d.get("bound"),
        exclude=list(d.get("exclude", ())),
        relaunched=relaunched,
        # (held for inspection: nothing was relaunched, the failed generation's ranks re-attach)
        resumed=phase != FROZEN,
        phase=phase,
        paused=bool(d.get("paused", False)),
        frozen_until=float(d.get("frozen_until", 0.0)),
        reload=bool(d.get("reload", False)),
        verdict=verdict,
    )


def _load_runtime(job: _Job, rt: dict) -> None:
    job.started, job.paused = set(rt.get("started", ())), set(rt.get("paused", ()))
    job.finished = {int(r): bool(v) for r, v in rt.get("finished", {}).items()}
    # ("scale" / "reload": the restored activity's phase says it)
    job.boundary, job.pending_at = (
        rt.get("pending", "") if rt.get("pending") in ("pause", "stop") else "",
        int(rt.get("pending_at", 0)),
    )
    job.pending_seq, job.commands = int(rt.get("pending_seq", 0)), int(rt.get("commands", 0))
    sent = (getattr(engine_pb2, kind).FromString(base64.b64decode(b)) for kind, b in rt.get("in_flight", ()))
    job.in_flight = {m.seq: m for m in sent}
    job.running_since = float(rt.get("running_since", 0.0))
    job.exited = set(rt.get("exited", ()))
    job.restarts, job.ignored = Counter(rt.get("restarts", {})), Counter(rt.get("ignored", {}))
    job.versions = [(int(step), str(v)) for step, v in rt.get("versions", ())]
    job.unusable = set(rt.get("unusable", ()))
    job.excluded = set(rt.get("excluded", ()))
    job.placement = {int(r): str(w) for r, w in rt.get("placement", {}).items()}
    job.launched = {int(r): str(w) for r, w in rt.get("launched", {}).items()}
    job.generations = {int(r): int(g) for r, g in rt.get("generations", {}).items()}
    job.start_held = bool(rt.get("start_held", False))
    job.abandoned = set(rt.get("abandoned", ()))
    job.draining, job.parked = bool(rt.get("draining", False)), bool(rt.get("parked", False))
    job.resume_after_pause = bool(rt.get("resume_after_pause", False))
    job.drain_own_pause = bool(rt.get("drain_own_pause", False))
    job.drain_unsaved_step = int(rt.get("drain_unsaved_step", 0))
    job.drain_save_step = int(rt.get("drain_save_step", 0))
    job.claim_until = float(rt.get("claim_until", 0.0))
    job.relaunch = rt.get("relaunch") or None
    verdicts = (engine_pb2.StepVerdict.FromString(base64.b64decode(v)) for v in rt.get("verdicts", ()))
    job.verdicts = {(v.step, v.kind): v for v in verdicts}
    # (a journal of an older control: the step it named, no number)
    job.revoked = {
        int(order): tuple(int(v) for v in r) if isinstance(r, list) else (0, int(r))
        for order, r in rt.get("revoked", {}).items()
    }
    # (one activity is journaled at a time; a journal of an older control holding two keeps
    # the recovery, which gave the others up)
    if rt.get("incident"):
        job.activity = _incident_from_json(rt["incident"])
    job.grow_to = tuple(int(n) for n in rt.get("grow_to", ()))
    job.last_resize = float(rt.get("last_resize", 0.0))
    job.micro_batch_cap_seen = int(rt.get("micro_batch_cap", 0))
    # (the window goes on across a control restart, a `down` / `up`; the restored ranks' first
    # step is left out again, as a start-up's: throughput_warm is not journaled)
    tokens, seconds, mfu_seconds = rt.get("throughput") or (0, 0.0, 0.0)
    job.throughput = (int(tokens), float(seconds), float(mfu_seconds))
    if rt.get("reload") and job.activity is None:
        version, step, phase, *asked = rt["reload"]  # (an older control's journal: no time asked)
        job.activity = _Reload(
            str(version),
            int(step),
            phase=str(phase),
            since=time.monotonic(),
            asked_unix=float(asked[0] if asked else 0),
        )
    if rt.get("scale") and job.activity is None:
        d = rt["scale"]
        job.activity = _Scale(
            spec_from_json(d["spec"]), d["why"], phase=d["phase"], old_dp=int(d["old_dp"]), since=time.monotonic()
        )


def _scale_to_json(scale: _Scale) -> dict:
    return {"spec": spec_to_json(scale.spec), "why": scale.why, "phase": scale.phase, "old_dp": scale.old_dp}
