"""``init_from:`` checked at submit, before control is asked: what the spec's own validation
cannot see (the files and the version it names).

* ``hf``: the directory holds ``config.json`` and ``*.safetensors``, the config describes
  the spec's model, and the files' headers hold each of its tensors of its shape
  (services/hf_config.py ``check_hf_directory``, without torch; control checks it too; the
  model fields a spec leaves out were filled in from it when it was parsed). Read here, on
  the submitting machine: the path must be the same on the ranks' nodes.
* ``checkpoint``: the store knows the version and its recorded verdict is ok; the model it
  was written with has this spec's tensors (names and shapes, from both specs: the first
  that differs is named); with ``weights+optimizer``, the source job kept optimizer state
  for every parameter this job trains. ``<job>:latest`` is pinned to the version it names at
  submit (:func:`pin_latest`).
* both: the weights were trained with the tokenizer of this job's dataset
  (services/cli/tokenizer_check.py): a checkpoint's source job names its dataset, whose
  tokenizer must be this one's (that dataset deleted: refused, it cannot be checked); an HF
  directory's ``tokenizer.json``, when it has one, must be this dataset's.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from services.cli import clients
from services.cli.errors import CliError
from services.cli.tokenizer_check import hf_mismatch, trained_with_mismatch
from services.contract import data_pb2, store_pb2
from services.hf_config import HfFormatError, check_hf_directory
from services.jobspec import JobSpec, frozen_parameters, model_parameters, read_spec_mapping, spec_from_json


def check_init_from(spec: JobSpec, source: str | Path, dataset: data_pb2.DatasetReady) -> None:
    """``spec``'s ``init_from`` against its model and its dataset version ``dataset``.

    Raises CliError (exit 2), one line naming ``source`` and the ``init_from`` field."""
    init = spec.init_from
    if init is None:
        return
    if init.hf is not None:
        try:
            check_hf_directory(init.hf, spec.model)
        except HfFormatError as e:
            raise CliError(f"{source}: {e}", code=2) from None
        problem = hf_mismatch(init.hf, dataset)
        if problem:
            raise CliError(f"{source}: init_from.hf: {problem}", code=2)
        return
    info = committed(init.checkpoint, source)
    trained = spec_from_json(info.spec_json)
    problem = weights_mismatch(trained, spec, init.load == "weights+optimizer") or trained_with_mismatch(
        "data.dataset", trained.data.dataset, dataset
    )
    if problem:
        raise CliError(f"{source}: init_from.checkpoint: {info.version}: {problem}", code=2)


def committed(version: str, source: str) -> store_pb2.CheckpointInfo:
    """Where ``version`` is and the spec it was written with: asked of the store when one is
    known and answers (its recorded verdict must be ok), else read from the catalog under
    ``$SURGE_HOME``'s store directly, the same checks read-only (``submit --dry-run`` with
    the stack down).

    Raises:
        CliError (exit 2): no such version, not ok, or the store refused (one line naming
            ``source`` and ``init_from.checkpoint``).
    """
    version = _job_id_for_name(version)
    try:
        addr = clients.address("store")
    except CliError:
        addr = None  # no stack here, no address given
    if addr is not None:
        try:
            return clients.call("store", lambda s: s.Load(store_pb2.LoadCheckpoint(version=version), timeout=60)).info
        except CliError as e:
            if not e.unreachable:
                raise CliError(f"{source}: init_from.checkpoint: {e}", code=2) from None
    from services.common import paths
    from services.store.checkpoint_manager import CheckpointNotFound, CheckpointRejected, read_committed

    try:
        return read_committed(paths.store_root(), version)
    except (CheckpointNotFound, CheckpointRejected, ValueError, OSError) as e:
        raise CliError(f"{source}: init_from.checkpoint: {' '.join(str(e).split())}", code=2) from None


def _job_id_for_name(version: str) -> str:
    """``version`` with its job part, when that is a job's name rather than an id, replaced
    by the id `versions` and `checkpoints` resolve it to (services/cli/jobs.py
    ``resolve_versions_job``: the newest live job of the name, else its one ended or deleted
    job): the checkpoints a user means by ``demo:latest`` are the running demo's. Unchanged
    when control is not reachable or nothing knows the name (the store then names the
    version it lacks).

    Raises:
        CliError (exit 2): the name is ambiguous (several ended jobs share it), the same one
            line as `versions`."""
    from services.cli.jobs import resolve_versions_job  # (jobs imports this module)

    job, sep, n = version.rpartition(":")
    if not sep or not job:
        return version
    try:
        return f"{resolve_versions_job(job, unknown_as_is=True)}:{n}"
    except CliError as e:
        if e.unreachable:
            return version
        raise


def pin_latest(spec: JobSpec, text: str, source: str) -> str:
    """The YAML to submit: ``text`` with ``init_from.checkpoint: <job>:latest`` replaced by
    the version it names now (asked of the store), and a job's name by its id, so that the job, and a relaunch of it
    before its own first checkpoint, loads those weights even if the source job commits more;
    ``text`` itself when there is nothing to pin. (The effective spec, ``surgectl spec JOB``,
    shows the version.)

    Raises:
        CliError (exit 2): the store refuses the version (one line naming the field).
    """
    init = spec.init_from
    if init is None or init.checkpoint is None:
        return text
    asked = init.checkpoint
    pinned = committed(asked, source).version if asked.endswith(":latest") else _job_id_for_name(asked)
    if pinned == asked:
        return text
    raw = read_spec_mapping(text, source)
    raw["init_from"]["checkpoint"] = pinned
    return yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)


def weights_mismatch(source: JobSpec, target: JobSpec, optimizer: bool) -> str:
    """Why the weights of a checkpoint of ``source`` cannot start ``target`` ("" if they
    can): a tensor of ``target``'s model missing or of another size in ``source``'s (named),
    or, with ``optimizer``, a parameter ``target`` trains that ``source`` kept frozen (no
    moments saved)."""
    if source.model.n_heads != target.model.n_heads:  # same shapes, other heads: not the same function
        return f"its model.n_heads is {source.model.n_heads}, this job's {target.model.n_heads}"
    have = {name: numel for name, _, numel in model_parameters(source.model)}
    for name, _, numel in model_parameters(target.model):
        if name not in have:
            return f"holds no tensor {name} (its model: {_shape(source)}; this job's: {_shape(target)})"
        if have[name] != numel:
            return (
                f"tensor {name} has {have[name]} elements, this job's needs {numel} "
                f"(its model: {_shape(source)}; this job's: {_shape(target)})"
            )
    if optimizer:
        frozen_then = _frozen(source)
        trained_now = {o for _, o, _ in model_parameters(target.model)} - _frozen(target)
        missing = sorted(trained_now & frozen_then)
        if missing:
            return f"init_from.load weights+optimizer: its job froze {missing[0]}, which this job trains (no moments saved)"
    return ""


def _frozen(spec: JobSpec) -> set:
    if not spec.model.freeze:
        return set()
    return frozen_parameters(spec.model.freeze, ((n, o) for n, o, _ in model_parameters(spec.model)))


def _shape(spec: JobSpec) -> str:
    m = spec.model
    return (
        f"n_layers {m.n_layers}, d_model {m.d_model}, n_heads {m.n_heads}, n_kv_heads {m.kv_heads}, mlp {m.mlp}, "
        f"vocab_size {m.vocab_size}, tie_embeddings {m.tie_embeddings}"
    )
