"""Specs people can drive from the command line: ``surgectl submit JOB.yaml --set
optimizer.lr=1e-3`` (overrides validated like the file), ``surgectl submit --dry-run``
(validate, resolve the dataset, estimate memory per rank, on the CPU and on a GPU, print
the effective spec; submit nothing) and ``surgectl spec JOB`` (a submitted job's effective
spec, as control journaled it).

The overrides know nothing of particular fields: a path is checked against the job spec's
pydantic model (services/jobspec/), so a section added to it is overridable at once.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import yaml
from pydantic import BaseModel, ValidationError

from services.cli import clients
from services.cli.errors import CliError, from_rpc
from services.common import free_space
from services.contract import data_pb2
from services.hf_config import HfFormatError, source_report
from services.jobspec import JobSpec, JobSpecError, parse_job_spec, read_spec_mapping, spec_from_json, yaml_value
from services.memory_estimate import estimate_gpu_memory, estimate_memory, human_bytes

SHM_ROOT = "/dev/shm"  # where node agents keep the in-memory checkpoint copies (services/worker/memory_copies.py)

# A submit's checks of a valid spec against its dataset version (source: what to name).
Checks = Callable[[JobSpec, data_pb2.DatasetReady, str], None] | None


def load_spec(path: Path, overrides: Sequence[str] = ()) -> tuple[JobSpec, str, str]:
    """The job spec of file ``path`` with ``overrides`` (``KEY=VALUE``: a dotted field path
    and a YAML value) applied in order, validated as a whole like the file.

    Returns:
        (spec, the YAML text to submit, the source to name in messages): without overrides
        the file's own text and path; with them the edited mapping as YAML and
        ``<path> with --set <KEY=VALUE>, ...``.

    Raises:
        CliError (exit 2), one line: the file unreadable or invalid, naming the file and the
        field; an override that is not KEY=VALUE, names no field (with the nearest names) or
        whose value is malformed YAML, naming the --set; an override's value out of range,
        naming the file, the overrides and the field.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise CliError(f"{path}: cannot read job spec: {e.strerror}", code=2) from None
    except UnicodeDecodeError as e:
        raise CliError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})", code=2) from None
    source = str(path)
    try:
        raw = read_spec_mapping(text, source)
        for item in overrides:
            apply_override(raw, item)
        if not overrides and not _made_absolute(raw):
            return parse_job_spec(text, source), text, source  # (the file's own text, comments kept)
        _made_absolute(raw)
        text = yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)
        if overrides:
            source = f"{path} with --set {', '.join(overrides)}"
        return parse_job_spec(text, source), text, source
    except JobSpecError as e:
        raise CliError(str(e), code=2) from None


def _made_absolute(raw: dict) -> bool:
    """Make a relative (or ``~``) ``init_from.hf`` absolute against the current directory,
    in place; whether it changed. Why: the ranks read it on their nodes, from directories of
    their own, so control takes absolute paths only; a path as the user typed it
    (``surgectl export ... --out exports/notes-hf``, then ``init_from: {hf: exports/notes-hf}``)
    means the one they see here."""
    init = raw.get("init_from")
    hf = init.get("hf") if isinstance(init, dict) else None
    if not isinstance(hf, str) or not hf or os.path.isabs(hf):
        return False
    init["hf"] = os.path.abspath(os.path.expanduser(hf))
    return True


def apply_override(raw: dict, item: str, option: str = "") -> None:
    """Set the field ``item`` (``a.b.c=VALUE``) names in ``raw`` (a job file's mapping, not
    validated), creating the sections on its way. A section the file wrote in a short form
    (``precision: bf16``) is expanded as the spec's own reader does first.

    Raises:
        JobSpecError, one line naming ``option`` (``--set <item>`` unless given: a sweep's
            ``--grid``/``--random``): not KEY=VALUE, an unknown field or a path through a
            value, malformed YAML.
    """
    option = option or f"--set {item}"
    key, eq, text = item.partition("=")
    keys = key.strip().split(".")
    if not eq or not all(keys):
        raise JobSpecError(f"{option}: expected KEY=VALUE with KEY a dotted field path (e.g. optimizer.lr=1e-3)")
    value = yaml_value(text, option)
    models: tuple[type[BaseModel], ...] = (JobSpec,)
    free: object = None  # the type of a mapping's values (inside a dict field), else None
    node = raw
    for i, name in enumerate(keys):
        here = ".".join(keys[: i + 1])
        if models:
            found = _field(models, name)
            if found is None:
                raise JobSpecError(f"{option}: {here}: unknown key ({_hint(models, keys[:i], name)})")
            owner, field_name, annotation, spellings = found
            # Write where the file already has it (an alias or the field's name), else as typed.
            slot = next((s for s in spellings if s in node), name)
        else:
            owner, field_name, annotation, slot = None, name, free, name
        if i == len(keys) - 1:
            node[slot] = value
            return
        models, free = _inside(annotation)
        if not models and free is None:
            raise JobSpecError(f"{option}: {here} is a value, not a section ({here}.{keys[i + 1]} does not exist)")
        child = node.get(slot)
        if child is None:
            child = {}
        elif not isinstance(child, dict) and owner is not None:
            child = _expanded(owner, field_name, child)
        if not isinstance(child, dict):
            raise JobSpecError(f"{option}: {here} is {child!r} in the file, not a mapping; set it whole ({here}=...)")
        node[slot] = child
        node = child


def effective_yaml(spec: JobSpec) -> str:
    """``spec`` with every default filled, as a job file (fields spelled as a file spells
    them, ``checkpoint.async``); :func:`parse_job_spec` of it gives ``spec`` back."""
    return yaml.safe_dump(spec.model_dump(mode="json", by_alias=True), sort_keys=False, allow_unicode=True)


def show_spec(spec_json: str, output: str) -> str:
    """A job's journaled spec (JobStatus.spec_json) as text for ``surgectl spec``: YAML, or
    JSON with ``output`` "json" (both a job file `surgectl submit` takes).

    A spec this version no longer reads (a field since renamed) is shown as journaled.
    Raises CliError (exit 2): an unknown ``output``."""
    if output not in ("yaml", "json"):
        raise CliError(f"--output: expected 'yaml' or 'json', got {output!r}", code=2)
    try:
        fields = spec_from_json(spec_json).model_dump(mode="json", by_alias=True)
    except ValidationError:
        fields = json.loads(spec_json)
    if output == "json":
        return json.dumps(fields, indent=2) + "\n"
    return yaml.safe_dump(fields, sort_keys=False, allow_unicode=True)


# ---------------------------------------------------------------- dry run


def dry_run(path: Path, overrides: Sequence[str] = (), checks: Checks = None) -> str:
    """``surgectl submit --dry-run``: validate the spec (with its overrides), resolve its
    dataset (the data service when the stack is up, else the catalog under $SURGE_HOME read
    directly), run a submit's ``checks`` of the spec against it (default:
    :func:`check_dataset`), estimate the memory of one rank (its tensors; on a GPU, the
    device's and the host's totals). Submits nothing,
    asks control nothing.

    Returns:
        A YAML document: the report as ``#`` comment lines, then the effective spec (so
        the output is itself a job file).

    Raises:
        CliError (exit 2): what a submit would refuse, one line naming the field.
    """
    spec, text, source = load_spec(path, overrides)
    info, where = resolve_dataset(spec, source)
    (checks or check_dataset)(spec, info, source)
    try:
        hf = source_report(spec, read_spec_mapping(text, source).get("model"))  # (the model's shape from init_from.hf)
    except (HfFormatError, JobSpecError) as e:  # (the default checks do not read the directory)
        raise CliError(f"{source}: {e}", code=2) from None
    d, p = spec.data, spec.parallel
    tokens = spec.steps * spec.tokens_per_step
    epochs = f", {tokens / info.train_tokens:.2f} epochs of the train split" if info.train_tokens else ""
    lines = [
        f"{source}: valid; nothing submitted (--dry-run)",
        f"dataset {d.dataset} ({where}): {info.train_documents:,} train documents, {info.train_tokens:,} tokens; "
        f"{info.val_documents:,} held-out documents, {info.val_tokens:,} tokens; tokenizer {info.tokenizer}, "
        f"vocabulary {info.vocab_size} (model.vocab_size {spec.model.vocab_size})",
        f"training: {spec.steps:,} steps x {spec.tokens_per_step:,} tokens a step (dp {p.dp} x micro_batch_size "
        f"{d.micro_batch_size} x grad_accum {d.grad_accum} x seq_len {d.seq_len}) = {tokens:,} tokens{epochs}",
        f"ranks: {spec.world_size} (dp {p.dp} x tp {p.tp} x pp {p.pp}, {p.data_parallel}), "
        f"precision {spec.precision.dtype}",
        *hf,
        *(est := estimate_memory(spec)).lines(),
        *estimate_gpu_memory(spec, est).lines(),
        memory_copy_line(est.checkpoint_bytes),
        "effective spec (every default filled; this output is a job file `surgectl submit` takes):",
    ]
    return "".join(f"# {line}\n" for line in lines) + effective_yaml(spec)


def memory_copy_line(needed: int, room: free_space.Room | None | object = None) -> str:
    """The in-memory checkpoint copy of one rank (services/worker/memory_copies.py): its
    expected size and the room in this machine's /dev/shm (statvfs, and the cgroup's memory
    left), with a warning when it does not fit (the copy is skipped at each save, typed:
    MemoryCopySkipped). A node holds its own ranks' copies and its peer node's."""
    room = free_space.room(SHM_ROOT) if room is None else room
    line = (
        f"memory copy per rank (newest checkpoint, in the node agent's shared memory): {human_bytes(needed)} "
        f"(float32 parameters and AdamW moments); a node holds its ranks' copies and one peer node's"
    )
    if not isinstance(room, free_space.Room):
        return line + f"; {SHM_ROOT} cannot be read here (no copies: the store's files only)"
    line += f"; here: {room.describe()}"
    if room.bytes < needed:
        line += " - too little for one copy: every save's copy would be skipped (MemoryCopySkipped)"
    return line


def resolve_dataset(spec: JobSpec, source: str) -> tuple[data_pb2.DatasetReady, str]:
    """``spec``'s dataset version, verified (every file's hash): from the data service when
    one is known and answers, else from the catalog under the data root, read directly
    with the data service's own code. Returns the version and where it was read.

    Raises:
        CliError: no such version or a corrupt one (exit 2, naming ``data.dataset``).
    """
    mount = data_pb2.MountDataset(name=spec.data.name, version=spec.data.version, verify=True)
    note = ""
    try:
        addr = clients.address("data")
    except CliError:
        addr = None  # no stack here, no address given
    if addr is not None:
        try:
            with clients.open_channel(addr) as ch:
                return clients.new_stub("data", ch).Mount(mount, timeout=120), f"the data service at {addr}"
        except grpc.RpcError as e:
            err = from_rpc(e, "data", addr)
            if not err.unreachable:
                raise CliError(f"{source}: data.dataset: {err}", code=err.code) from None
            note = f"data service unreachable at {addr}; "
    from services.common import paths
    from services.data.dataset_versions import DatasetVersions
    from services.data.errors import DataError

    root = paths.datasets_root()
    catalog = DatasetVersions(root, emit=lambda *_: None, activate_source=lambda *_: None)
    try:
        ready = catalog.mount_dataset(mount)
    except DataError as e:
        raise CliError(f"{source}: data.dataset: {' '.join(str(e).split())}", code=2) from None
    return ready, f"{note}read from the catalog under {root}"


def check_dataset(spec: JobSpec, info: data_pb2.DatasetReady, source: str) -> None:
    """What a spec asks of its dataset version ``info``, checked at submit rather than when
    the ranks start.

    Raises:
        CliError (exit 2), one line naming the field: the dataset's tokenizer has more
            tokens than the model's embedding has rows (``model.vocab_size``);
            ``data.filter.banned_bytes`` on a dataset whose tokens are not bytes (the data
            service's filter refuses it when the ranks open their streams).
    """
    if info.vocab_size > spec.model.vocab_size:
        raise CliError(
            f"{source}: model.vocab_size: {spec.model.vocab_size} is smaller than the "
            f"dataset's vocabulary ({info.vocab_size}, {info.tokenizer})",
            code=2,
        )
    if spec.data.filter.banned_bytes and info.tokenizer != "bytes":
        raise CliError(
            f"{source}: data.filter.banned_bytes: needs a dataset of the bytes tokenizer, "
            f"{info.name}@{info.version} uses {info.tokenizer} (use data.filter.banned_tokens)",
            code=2,
        )


# ---------------------------------------------------------------- the model's fields


def _unwrap(annotation: object) -> object:
    """``Annotated[X, ...]`` -> ``X``."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _inside(annotation: object) -> tuple[tuple[type[BaseModel], ...], object]:
    """What a path may continue into below a field of ``annotation``: the section models
    (a model, ``Model | None``, a union of models), or a mapping's value type (a dict
    field: the next key is the mapping's); ``((), None)``: a plain value."""
    annotation = _unwrap(annotation)
    members = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    models = tuple(m for m in map(_unwrap, members) if isinstance(m, type) and issubclass(m, BaseModel))
    if models:
        return models, None
    for m in map(_unwrap, members):
        if typing.get_origin(m) is dict:
            return (), typing.get_args(m)[1] if typing.get_args(m) else object
    return (), None


def _field(models: Sequence[type[BaseModel]], key: str) -> tuple[type[BaseModel], str, object, tuple[str, ...]] | None:
    """The field ``key`` names (its name or alias) in the first of ``models`` that has it:
    (model, field name, annotation, its spellings in a file)."""
    for model in models:
        for name, info in model.model_fields.items():
            spellings = tuple(dict.fromkeys(s for s in (info.alias, name) if s))
            if key in spellings:
                return model, name, info.annotation, spellings
    return None


def _hint(models: Sequence[type[BaseModel]], parent: Sequence[str], key: str) -> str:
    names = sorted({(info.alias or name) for model in models for name, info in model.model_fields.items()})
    prefix = "".join(f"{p}." for p in parent)
    near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if near:
        return f"did you mean {prefix}{near[0]}?"
    return f"{'.'.join(parent) or 'the spec'} has: {', '.join(names)}"


def _expanded(model: type[BaseModel], field_name: str, value: object) -> object:
    """``value`` of ``model.field_name`` through the model's own "before" validators of that
    field (``precision: bf16`` -> ``{dtype: bf16}``), so an override can reach inside."""
    for dec in model.__pydantic_decorators__.field_validators.values():
        if dec.info.mode == "before" and field_name in dec.info.fields:
            if len(inspect.signature(dec.func).parameters) == 1:  # (cls bound): takes the value only
                value = dec.func(value)
    return value
