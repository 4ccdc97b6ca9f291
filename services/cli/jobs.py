"""What `surgectl` and `make demo` both do with a job: submit it (after checking its
dataset), follow it to its end, and sample text from one of its checkpoints."""

from __future__ import annotations

import re
import shlex
import sys
import uuid
from collections.abc import Collection, Sequence
from pathlib import Path

import grpc

from services.cli import clients, render, spec_tools, stack
from services.cli.errors import CliError
from services.cli.evaluation import check_held_out
from services.cli.init_from import check_init_from, pin_latest
from services.common.job_refs import AmbiguousJob, UnknownJob, pick_job
from services.contract import control_pb2, data_pb2, store_pb2
from services.jobspec import JobSpec

# A submit whose reply was lost (control restarting, a deadline) is sent again with its
# request id, which control answers with the job the first one created: a few times, the
# waits doubling, about 7 s in all (a control restart's journal restore fits in that).
SUBMIT_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)


def submit_job(spec_path: Path, overrides: Sequence[str] = (), priority: int = 0) -> control_pb2.JobStatus:
    """Submit the spec of ``spec_path`` with ``overrides`` (``--set KEY=VALUE``) applied,
    after the checks of :func:`check_submission`; control validates it again. Ranks that do
    not fit now: control queues the job (STANDBY, ``queue_position``), FIFO within ``priority``."""
    return send_submit(*checked_submission(spec_path, overrides), priority)


def checked_submission(spec_path: Path, overrides: Sequence[str] = ()) -> tuple[str, str]:
    """What :func:`submit_job` sends, every check of a submit passed (the datasets mounted and
    verified, :func:`check_submission`, ``init_from``'s ``latest`` pinned): (spec text,
    source). Raises CliError (exit 2) as a submit would, before anything is sent."""
    spec, text, source = spec_tools.load_spec(spec_path, overrides)
    infos = []
    for i, (name, version, _) in enumerate(spec.data.datasets):  # (a mixture: every component, each verified)
        ds = data_pb2.MountDataset(name=name, version=version, verify=True)
        try:
            infos.append(clients.call("data", lambda s, ds=ds: s.Mount(ds, timeout=120)))
        except CliError as e:  # (an unknown or corrupt version: the field that names it, as --dry-run says)
            if e.unreachable:
                raise
            field = "data.dataset" if spec.data.mixture is None else f"data.mixture[{i}].dataset"
            raise CliError(f"{source}: {field}: {e}", code=e.code, status=e.status) from None
    for info in infos[1:]:
        if info.vocab_size > spec.model.vocab_size:
            raise CliError(
                f"{source}: data.mixture: dataset {info.name}@{info.version} has vocab_size {info.vocab_size} "
                f"> model.vocab_size {spec.model.vocab_size}",
                code=2,
            )
    check_submission(spec, infos[0], source)
    return pin_latest(spec, text, source), source  # init_from.checkpoint <job>:latest -> the version it is now


def send_submit(text: str, source: str, priority: int = 0) -> control_pb2.JobStatus:
    """SubmitJob of the spec ``text`` under a new request id (one per invocation), sent again
    with the same id after a failure that may have lost the reply (``SUBMIT_RETRY_DELAYS_S``):
    one job however many times it reached control."""
    req = control_pb2.SubmitJobRequest(
        spec_yaml=text, spec_path=source, priority=priority, request_id=str(uuid.uuid4())
    )
    try:
        return clients.call("control", lambda s: s.SubmitJob(req, timeout=60), retry_delays=SUBMIT_RETRY_DELAYS_S)
    except CliError as e:
        # A spec control refuses as FAILED_PRECONDITION at submit is the spec's fault: exit 2
        # like its other errors. (Ranks that do not fit are no refusal: the job is queued.)
        if e.status == grpc.StatusCode.FAILED_PRECONDITION:
            e.code = 2
        raise


def check_submission(spec: JobSpec, info: data_pb2.DatasetReady, source: str) -> None:
    """What surgectl checks of a valid spec before control sees it (a submit and a
    ``--dry-run`` alike), against its dataset version ``info``. Raises CliError (exit 2).

    ``init_from`` first: a model whose shape ``init_from.hf``'s config.json could not give is
    ModelSpec's defaults, and the directory's problem (no config.json, no weights) is the
    one to name, not the default vocabulary's size against the dataset's."""
    check_init_from(spec, source, info)
    spec_tools.check_dataset(spec, info, source)
    check_held_out(spec, info, source)


def dry_run_job(spec_path: Path, overrides: Sequence[str] = ()) -> str:
    """``surgectl submit --dry-run`` (services/cli/spec_tools.py): the report and the
    effective spec; nothing submitted."""
    return spec_tools.dry_run(spec_path, overrides, check_submission)


def resolve_job(ref: str, stub: object | None = None) -> str:
    """The job id of ``ref``, a job id or a job's name (``name:`` of its spec), as every
    command that takes a JOB argument reads it.

    A name several jobs share means its one live job (not TERMINATED); with several live ones,
    or none and several ended, it is ambiguous (``pick_job``). ``stub``: a control stub to ask
    (default: a new channel).

    Raises:
        CliError (exit 2): no job has that id or name, or the name is ambiguous (one line
            listing the ids).
    """
    if not ref:
        raise CliError("JOB: a job id or name is required", code=2)
    # (Ctrl-C here, control slow to answer: the command asked nothing yet; was exit 130, silent)
    again = shlex.join(["surgectl", *sys.argv[1:]]) if sys.argv[1:] else "the command"
    with stack.exit_on_interrupt(
        f"interrupted while looking up job {ref!r}: nothing was asked of it yet; `{again}` again"
    ):
        return _resolve_job(ref, stub)


def resolve_versions_job(ref: str, unknown_as_is: bool = False, ids: Collection[str] | None = None) -> str:
    """The job id whose checkpoint versions ``ref`` (a job id or name) names: control's answer
    (``resolve_job``) while it has the job; once the job was deleted (control forgot it, its
    versions stay in the store: `surgectl delete job`'s hint), an id the store holds versions
    of, or a name that exactly one such id carries (``<name>-<6 hex>``, as control makes them).
    ``unknown_as_is``: ``ref`` itself when neither knows it (the caller's next call says why).
    ``ids``: the job ids that have versions, read by the caller (a local catalog: `export`,
    `generate`, `eval`), instead of the store's; control unreachable then, they alone decide.

    Raises:
        CliError (exit 2): neither control nor the store knows it (unless ``unknown_as_is``),
            or the name is ambiguous (``unknown_as_is`` or not: control's ended jobs that
            share it, when the store holds no one id of the name either).
    """
    try:
        found = resolve_job(ref)
    except CliError as e:
        if not ref or not (e.code == 2 or (ids is not None and e.unreachable)):
            raise
        unknown = e
    else:
        return found if found == ref else _run_with_versions(ref, found, ids)
    if ids is None:
        try:
            ids = _ids_with_versions()
        except CliError:  # (the store down: the job is unknown as control says)
            if unknown_as_is and not isinstance(unknown, AmbiguousName):
                return ref
            raise unknown from None
    if ref in ids:
        return ref
    named = _runs_named(ref, ids)
    if len(named) > 1:
        # (control down: it could not say which live; ambiguous to control: some may be its ended jobs)
        which = "deleted jobs" if not (unknown.unreachable or isinstance(unknown, AmbiguousName)) else "jobs"
        raise CliError(
            f"job name {ref!r} is ambiguous: {which} {', '.join(named)} have checkpoint versions; name one by its id",
            code=2,
        )
    if named:
        return named[0]
    if unknown_as_is and not isinstance(unknown, AmbiguousName):
        return ref
    raise unknown


def _run_with_versions(name: str, live: str, ids: Collection[str] | None) -> str:
    """For a version, the job ``name`` means is its newest run that has versions: control's
    live job of the name (``live``) unless it has none and exactly one other run of the
    name has (fresh37b: a queued ``joba`` with no versions hid the running one's; ``joba:1``
    was "not found"). The store unreachable: ``live``, whose lookup then says why."""
    if ids is None:
        try:
            ids = _ids_with_versions()
        except CliError:
            return live
    if live in ids:
        return live
    named = _runs_named(name, ids)
    return named[0] if len(named) == 1 else live


def _ids_with_versions() -> set[str]:
    """The job ids the store holds checkpoint versions of (raises CliError: the store down)."""
    listed = clients.call("store", lambda s: s.List(store_pb2.CheckpointQuery(job_id=""), timeout=10))
    return {c.job_id for c in listed.checkpoints}


def _runs_named(name: str, ids: Collection[str]) -> list[str]:
    """The ids among ``ids`` of runs of job ``name`` (``<name>-<6 hex>``, as control makes them)."""
    return sorted(i for i in ids if re.fullmatch(re.escape(name) + r"-[0-9a-f]{6}", i))


class AmbiguousName(CliError):
    """A job name several of control's jobs share, ended or live (``pick_job``'s AmbiguousJob), exit 2:
    never taken for an unknown name that a caller may pass on as typed."""


def _resolve_job(ref: str, stub: object | None) -> str:
    query = control_pb2.JobQuery()
    jobs = (stub.ListJobs(query, timeout=10) if stub is not None else _list_jobs(query)).jobs
    try:
        return pick_job(ref, jobs)
    except AmbiguousJob as e:
        raise AmbiguousName(str(e), code=2) from None
    except UnknownJob as e:
        unknown = CliError(str(e), code=2)
    # Not listed: an id control may still answer for by its own refusal (another team's job,
    # where a tokens file binds identities: "job X belongs to team Y; ..."), else unknown.
    try:
        ask = stub if stub is not None else None
        if ask is not None:
            ask.GetJob(control_pb2.JobQuery(job_id=ref), timeout=10)
        else:
            clients.call("control", lambda s: s.GetJob(control_pb2.JobQuery(job_id=ref), timeout=10))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.PERMISSION_DENIED:
            raise CliError(e.details(), code=1, status=e.code()) from None
        raise unknown from None
    except CliError as e:
        if e.status == grpc.StatusCode.PERMISSION_DENIED:
            raise
        raise unknown from None
    return ref


def _list_jobs(query: control_pb2.JobQuery) -> control_pb2.JobList:
    return clients.call("control", lambda s: s.ListJobs(query, timeout=10))


def follow_job(job_id: str, reconnect_s: float = 60.0, training: bool = True) -> render.History:
    """Progress of ``job_id`` until it ends, through a control restart (services/cli/follow.py);
    ``training=False``: an evaluation job's (a spinner, no step bar)."""
    from services.cli import follow as following

    return render.follow(following.job_events(job_id, reconnect_s), training=training)


def sample_text(version: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> str:
    """``surgectl generate``'s sample (services/cli/evaluation.py: in this process, the
    version and its dataset's tokenizer read under SURGE_HOME; no service asked)."""
    from services.cli.evaluation import generate

    return generate(version, prompt, max_new_tokens, temperature, top_k, seed)
