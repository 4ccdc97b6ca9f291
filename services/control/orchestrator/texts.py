"""The sentences L1-1 writes into a job's events and status (pure functions)."""

from __future__ import annotations

from collections import Counter

from services.common.sizes import size_text
from services.contract import control_pb2, route_pb2, store_pb2
from services.control import fault_decision as fd
from services.control.orchestrator.job import _Incident, _Job
from services.control.orchestrator.triage import _clipped
from services.jobspec import (
    IN_PLACE_ACTIONS,
    JobSpec,
)


def _failed_text(what: str, cause: str, msg: store_pb2.SnapshotFailed) -> str:
    """E.g. "checkpoint save failed (timeout: ...); training continues, the next interval
    tries again". A refused write names which (its WriteError) and leaves what follows to
    the fault policy's decision (class checkpoint_write_failed), recorded next."""
    if msg.cause == store_pb2.StoreFailureCause.WRITE_REFUSED:
        return f"{what} failed ({cause}, {_write_error_name(msg)}: {msg.reason}); older versions are intact"
    text = f"{what} failed ({cause}: {msg.reason})"
    return text + ("; training continues, the next interval tries again" if msg.operation == "save" else "")


def _write_error_name(msg: store_pb2.SnapshotFailed) -> str:
    """E.g. "no_space" for WRITE_NO_SPACE; "unknown" when the writer could not say."""
    kind = msg.write_error
    return route_pb2.WriteError.Name(kind).removeprefix("WRITE_").lower() if kind else "unknown"


def _broken_text(what: str, msg: store_pb2.SnapshotFailed, incident: _Incident | None) -> str:
    """The record of a save or load whose collectives failed, e.g. "checkpoint save of j:7
    failed, expected: CommunicationFailed: ... (consequence of rank 1's rank_exit)" (what
    follows is the recovery's, in its own records)."""
    if incident is None:
        return _failed_text(what, "communication", msg)
    of = f"rank {incident.cause.rank}'s {incident.fault_class}"
    return f"{what} failed, expected: {_clipped(msg.reason)} (consequence of {of})"


def _failure_name(msg: store_pb2.SnapshotFailed) -> str:
    """A failure with no store cause, by its typed failure cause ("communication": a peer lost
    in the save's collectives); "unknown" only when it has none."""
    cause = msg.failure.cause if msg.HasField("failure") else 0
    return route_pb2.FailureCause.Name(cause).removeprefix("FAILURE_").lower() if cause else "unknown"


def _overdue(job: _Job, incident: _Incident, missing: list[int]) -> str:
    in_place = incident.action in IN_PLACE_ACTIONS
    limit = fd.wait_seconds(job.spec.fault_policy, fd.RECOVERY_TIMEOUT, in_place=in_place)
    if in_place:
        return (
            f"ranks {missing} not ready {limit:g} s (fault_policy.rebuild_seconds) after the "
            f"rebuild in place for rank {incident.cause.rank}'s {incident.fault_class} was commanded"
        )
    return f"ranks {missing} not ready {limit:g} s (fault_policy.restore_seconds) after the relaunch"


def _healed_text(incident: _Incident, world_size: int) -> str:
    """What a rebuild in place did, e.g. "group of 2 rebuilt in place: rank 1 healed from
    rank 0's memory, 1 rank kept its process"."""
    # (The survivors restore the source's state too: only the replacements are news.)
    healed = sorted((r, src) for r, src in incident.healed_from.items() if r in incident.lost and r != src)
    kept = len([r for r in range(world_size) if r not in incident.lost])
    text = f"group of {world_size} rebuilt in place: "
    if healed:
        text += ", ".join(f"rank {r} healed from rank {src}'s memory" for r, src in healed) + ", "
    return text + _kept_text(kept)


def _kept_text(kept: int) -> str:
    """E.g. "1 rank kept its process", "2 ranks kept their processes"."""
    return f"{kept} rank{'' if kept == 1 else 's'} kept {'its process' if kept == 1 else 'their processes'}"


def _version_number(version: str) -> int:
    """The commit number of ``<job>:<n>`` (0 if it has none)."""
    tail = version.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def checkpoint_text(msg: store_pb2.SaveCompleted) -> str:
    """The event of a committed version: its size, and what its save wrote (a baseline: every
    chunk; a delta: the chunks that changed). Parsers rely on "checkpoint V at step N (" and
    " bytes, " (tests/faults)."""
    total = size_text(msg.bytes)
    if msg.baseline:
        wrote = f"{total}, baseline"
    elif msg.written_bytes >= msg.bytes > 0:  # a delta in which every chunk changed (all weights moved)
        wrote = f"{total}, delta: every chunk changed"
    elif msg.written_bytes:  # (the share new, so that 9.97 of 10 MB does not read as "10 MB of 10 MB")
        share = 100.0 * msg.written_bytes / msg.bytes if msg.bytes else 100.0
        wrote = f"{total} total, {size_text(msg.written_bytes)} written ({share:.1f} % new), delta"
    else:  # a version of plain files (or a delta that wrote nothing: SaveCompleted cannot tell)
        wrote = total
    return f"checkpoint {msg.version} at step {msg.step} ({wrote}; {msg.bytes} bytes, {msg.files} files)"


# How a recovery's event names where its ranks' chunks came from.
_SOURCE_TEXT = {"memory": "memory (own node)", "peer": "the peer's memory", "store": "the store"}


def restored_from_text(bytes_from: dict[str, int] | Counter[str]) -> str:
    """Where the ranks of a recovery read their checkpoint's chunks, from the bytes per
    source they reported: "read from memory (own node)" (one source), or with the bytes of
    each when mixed ("read from memory (own node) 1.2 MB + the peer's memory 300 KB");
    "" when nothing was reported (a version of plain files, or ranks of an older release)."""
    order = list(_SOURCE_TEXT) + sorted(set(bytes_from) - set(_SOURCE_TEXT))
    used = [(name, bytes_from[name]) for name in order if bytes_from.get(name)]
    if not used:
        return ""
    if len(used) == 1:
        return f"read from {_SOURCE_TEXT.get(used[0][0], used[0][0])}"
    return "read from " + " + ".join(f"{_SOURCE_TEXT.get(n, n)} {size_text(b)}" for n, b in used)


def _usable(job: _Job) -> list[tuple[int, str]]:
    """The job's committed versions not known unusable and not of a branch a rollback left,
    (step, version): what a plain resume can take (an abandoned one only by name)."""
    return [(step, v) for step, v in job.versions if v not in job.unusable and v not in job.abandoned]


def newest_usable(job: _Job) -> tuple[int, str] | None:
    """(step, version) of the newest of ``_usable``; None without one."""
    usable = _usable(job)
    return max(usable, key=lambda sv: (sv[0], _version_number(sv[1]))) if usable else None


def _newest(job: _Job) -> str:
    """The job's newest committed version a plain resume can take, as text."""
    newest = newest_usable(job)
    if newest is None:
        return "(no checkpoint yet)"
    step, version = newest
    return f"checkpoint {version} (step {step})"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


# What a queued job's reason says when it can never run as things stand (JobStatus.cannot_run).
CANNOT_RUN = "can never run as things stand"


class CannotRun(str):
    """A queued job's reason when it can never run as things stand: the text, and ``cause``
    (``quota`` or ``cluster``: JobStatus.cannot_run, counted by `surgectl queue` and the
    ``surge_queue_cannot_run`` gauge). A str: it goes wherever a reason goes."""

    cause: str

    def __new__(cls, text: str, cause: str) -> CannotRun:
        why = super().__new__(cls, text)
        why.cause = cause
        return why


def cause_of(why: str) -> str:
    """``why``'s CannotRun cause ("": the job may run as things stand)."""
    return getattr(why, "cause", "")


def quota_wait(reason: str, never: bool) -> str:
    """A queued job's reason from its team's quota's answer (``never``: it can never start
    under the quota as it stands, e.g. lowered since its submit: said, and counted)."""
    if not never:
        return reason
    return CannotRun(f"{CANNOT_RUN}: {reason}; it starts once its team's quota allows it", "quota")


def _beyond_cluster(reply: control_pb2.ResourcesInsufficient) -> bool:
    """Whether the allocator refused because the job needs more ranks than the placeable
    workers' slots together (it can start only once more workers join or come back)."""
    return reply.registered_ranks < reply.requested_ranks


def _waits_for(job: _Job, reply: control_pb2.ResourcesInsufficient, spec: JobSpec | None = None) -> str:
    """What a queued job waits for, from the allocator's refusal to place it (``spec``: the
    layout it waits to start at, when not the job's own: a queued `resume --dp`). Beyond every
    registered slot of its kind (placeable or not): it can never run as things stand
    (``CannotRun``); beyond the placeable ones only: how many are not placeable and why."""
    n = reply.requested_ranks or job.status.world_size
    needs = f"needs {n} rank{'' if n == 1 else 's'} ({_degrees(spec or job.spec)})"
    if _beyond_cluster(reply):
        kind = (spec or job.spec).parallel.device_kind  # (the allocator counted that kind's slots only)
        of = "" if kind == "any" else f" {kind} slots"
        if reply.all_registered_ranks < reply.requested_ranks:
            return _beyond_registered(needs, kind, reply.all_registered_ranks, reply.not_placeable)
        return (
            f"{needs}, more than the {reply.registered_ranks}{of} placeable of the {reply.all_registered_ranks} "
            f"registered ({reply.not_placeable}): waits for them to be placeable again or for workers to join"
        )
    return f"{needs}; {reply.reason}: waits for ranks to free up"


def beyond_registered(spec: JobSpec, registered: control_pb2.KindSlots | None) -> CannotRun | None:
    """Why a job of ``spec`` can never run as things stand when it needs more slots of its kind
    than ``registered`` (the allocator's last offer: every registered slot per kind, placeable
    or not; None: no offer yet), else None. What a queued job says when it waits behind
    another and is not tried (the allocator's refusal says the same, with the slots not
    placeable named, when it is)."""
    if registered is None:
        return None
    kind, n = spec.parallel.device_kind, spec.world_size
    have = registered.gpu + registered.cpu if kind == "any" else getattr(registered, kind)
    if n <= have:
        return None
    return _beyond_registered(f"needs {n} rank{'' if n == 1 else 's'} ({_degrees(spec)})", kind, have, "")


def _beyond_registered(needs: str, kind: str, registered: int, not_placeable: str) -> CannotRun:
    if kind != "any" and not registered:  # (a gpu job on a CPU-only cluster: say so)
        what = "a GPU" if kind == "gpu" else "CPU slots"
        return CannotRun(
            f"{needs} on {kind}: no node with {what} is registered: {CANNOT_RUN}; waits for one to join", "cluster"
        )
    of = "" if kind == "any" else f" {kind} slots"
    unplaceable = f" ({not_placeable})" if not_placeable else ""
    return CannotRun(
        f"{needs}, more than the {registered}{of} registered{unplaceable}: {CANNOT_RUN}; waits for workers to join",
        "cluster",
    )


def _degrees(spec: JobSpec) -> str:
    """The parallel degrees a job's rank count comes from, as its spec names them."""
    p = spec.parallel
    return f"parallel.dp={p.dp}" + (f" x tp={p.tp} x pp={p.pp}" if p.tp * p.pp > 1 else "")
