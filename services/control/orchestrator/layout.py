"""A job's data-parallel layout: an operator's requested layout, a shrink's, and how it is said."""

from __future__ import annotations

from services.contract import control_pb2, engine_pb2
from services.control.orchestrator.job import _Incident, _Job
from services.jobspec import (
    JobSpec,
    JobSpecError,
    at_data_parallel_size,
    with_layout,
)


def _layout_asked(msg: control_pb2.ResumeJobRequest) -> bool:
    """Whether an operator resume names a data-parallel layout."""
    return bool(msg.dp or msg.micro_batch_size or msg.grad_accum)


def _layout_flags(msg: control_pb2.ResumeJobRequest) -> str:
    """The layout options of an operator resume, as `surgectl resume` spells them."""
    named = (("--dp", msg.dp), ("--micro-batch-size", msg.micro_batch_size), ("--grad-accum", msg.grad_accum))
    return " ".join(f"{flag} {value}" for flag, value in named if value)


def _new_layout(spec: JobSpec, msg: control_pb2.ResumeJobRequest) -> JobSpec | None:
    """The job's spec at the data-parallel layout an operator resume asks for (0: the job's
    own value); None when it asks for none, or for the job's own. The global batch
    (micro_batch_size x grad_accum x dp rows) must stay: the data position is a cursor into
    one global sequence of global batches, and the step count, schedule and losses are per
    global batch. tp and pp cannot be asked for (a reshape of the model's shards is another
    matter); the allocator says whether the new world size fits.

    Raises:
        JobSpecError: one line naming the options and the field at fault; nothing changed.
    """
    if not _layout_asked(msg):
        return None
    p, d = spec.parallel, spec.data
    dp, mbs, accum = msg.dp or p.dp, msg.micro_batch_size or d.micro_batch_size, msg.grad_accum or d.grad_accum
    if (dp, mbs, accum) == (p.dp, d.micro_batch_size, d.grad_accum):
        return None
    rows, kept = mbs * accum * dp, d.micro_batch_size * d.grad_accum * p.dp
    flags = _layout_flags(msg)
    if rows != kept:
        raise JobSpecError(
            f"{flags}: the global batch (data.micro_batch_size x data.grad_accum x parallel.dp) would be "
            f"{mbs} x {accum} x {dp} = {rows} rows, not the job's {kept} ({d.micro_batch_size} x {d.grad_accum} x "
            f"{p.dp}); a resume keeps it: choose --micro-batch-size and --grad-accum so the product stays {kept}"
        )
    return with_layout(spec, dp=dp, micro_batch_size=mbs, grad_accum=accum, source=flags)


def _layout_change(old: JobSpec, new: JobSpec) -> str:
    """What a resume at a new layout changes, as text (the decision's)."""
    fields = (
        ("parallel.dp", old.parallel.dp, new.parallel.dp),
        ("data.micro_batch_size", old.data.micro_batch_size, new.data.micro_batch_size),
        ("data.grad_accum", old.data.grad_accum, new.data.grad_accum),
        ("eval.batches", old.eval.batches, new.eval.batches),
    )
    changed = ", ".join(f"{name} {a} -> {b}" for name, a, b in fields if a != b)
    rows = new.parallel.dp * new.data.micro_batch_size * new.data.grad_accum
    return f"{changed} (world size {old.world_size} -> {new.world_size}; the global batch of {rows} rows kept)"


def _set_layout(status: control_pb2.JobStatus, spec: JobSpec) -> None:
    """The job's data-parallel layout in its published status."""
    status.dp, status.micro_batch_size, status.grad_accum = (
        spec.parallel.dp,
        spec.data.micro_batch_size,
        spec.data.grad_accum,
    )


def _set_size(status: control_pb2.JobStatus, spec: JobSpec) -> None:
    """The job's world size and layout in its published status: a queued resume shows the size
    it waits to start at (the layout asked with it, which admission counts), and the size it
    last ran at again once it leaves the queue unplaced."""
    status.world_size = spec.world_size
    _set_layout(status, spec)


def _layout_of(spec: JobSpec) -> tuple[int, int, int]:
    return spec.parallel.dp, spec.data.micro_batch_size, spec.data.grad_accum


def _layout_msg(spec: JobSpec) -> engine_pb2.DataParallelLayout:
    dp, mbs, accum = _layout_of(spec)
    return engine_pb2.DataParallelLayout(dp=dp, micro_batch_size=mbs, grad_accum=accum)


def _shrink_to(job: _Job, incident: _Incident, free_slots: int) -> JobSpec | None:
    """The job at the largest data-parallel size its remaining ranks allow (issue 16's
    shrink), or None: the survivors plus the free slots, below the job's size, with the
    global batch split evenly (:func:`services.jobspec.at_data_parallel_size`) and a
    survivor among the kept ranks 0..dp-1 (ranks keep their ids: one holding the state
    must remain to heal the others)."""
    world = job.status.world_size
    survivors = [r for r in range(world) if r not in incident.lost]
    for dp in range(min(len(survivors) + free_slots, world - 1), 0, -1):
        if not any(r < dp for r in survivors):
            continue
        try:
            return at_data_parallel_size(job.spec, dp, largest=job.micro_batch_cap, source="shrink")
        except JobSpecError:
            continue
    return None
