"""Evaluation from the terminal: the held-out check at submit (and ``--dry-run``), and
``surgectl eval`` / ``surgectl generate --checkpoint`` without a running stack: the version
is resolved read-only in the store's catalog under SURGE_HOME (the checkpoint manager's
``read_committed``), its files checked as they are read, and the dataset is mounted and
streamed by the data pipeline's own modules in this process."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.cli import stack_access
from services.cli.errors import CliError
from services.contract import data_pb2
from services.jobspec import JobSpec

EVAL_OFF = "eval: {every_steps: 0, at_end: false}"


def evaluates(spec: JobSpec) -> bool:
    """Whether the job evaluates at all (``eval.every_steps`` 0 with ``at_end`` false: never)."""
    return spec.eval.every_steps > 0 or spec.eval.at_end


def check_held_out(spec: JobSpec, dataset: data_pb2.DatasetReady, spec_path: Path | str) -> None:
    """Refuse a job that evaluates on a dataset version with no held-out document: its eval
    loss would be ``nan`` at every evaluation (no batch), reported as if it were a value.

    Raises:
        CliError (exit 2): one line naming ``eval`` and the dataset, with the way out.
    """
    if evaluates(spec) and dataset.val_documents == 0:
        raise CliError(
            f"{spec_path}: eval: dataset {dataset.name}@{dataset.version} has no held-out split "
            f"(0 val documents); turn evaluation off ({EVAL_OFF}) or prepare a version with "
            "--val-fraction > 0 from at least two files",
            code=2,
        )


# ---------------------------------------------------------------------- without a stack


@dataclass(frozen=True)
class Checkpoint:
    """A committed version found under the store root, its recorded verdict ok."""

    version: str
    step: int
    path: str
    spec: JobSpec


@dataclass(frozen=True)
class EvalResult:
    version: str
    step: int
    dataset: str
    split: str
    batches: int
    tokens: int
    loss: float
    seconds: float

    def __str__(self) -> str:
        ppl = math.exp(self.loss) if self.loss < 700 else math.inf
        return (
            f"{self.version} (step {self.step}) on {self.dataset} {self.split}: loss {self.loss:.4f} "
            f"(perplexity {ppl:.4g}) over {self.tokens:,} tokens in {self.batches} batches, {self.seconds:.1f} s"
        )


def find_checkpoint(version: str) -> Checkpoint:
    """``version`` (``<job>:<n>``, ``<job>:latest`` or ``latest``) resolved in the catalog
    under the store root (``$SURGE_STORE_ROOT`` or ``$SURGE_HOME/store``) by the checkpoint
    manager's own rules, read-only (``read_committed``; no service needed): its recorded
    verdict must be ok and its manifest unchanged. The files themselves are checked against the
    manifest as they are read (services/compute/inference.py).

    Raises:
        CliError: exit 2 for a malformed version, none under the root or an unknown
            version; 1 for one recorded damaged (one line each).
    """
    from services.common import paths
    from services.jobspec import spec_from_json
    from services.store.checkpoint_manager import CATALOG, CheckpointRejected

    root = paths.store_root()
    # A version that is not there (none at all, or not this one) is the user's input: exit 2,
    # as `resume --from` and `rollback --version` answer it; one there but damaged: exit 1.
    if not (root / "checkpoints" / CATALOG).is_file():
        raise CliError(
            f"checkpoint {version}: no checkpoints under {root} (set SURGE_HOME or SURGE_STORE_ROOT)", code=2
        )
    try:
        info = read_version(root, version, f"checkpoint {version}")
    except CheckpointRejected as e:
        raise CliError(" ".join(str(e).split())) from None
    except ValueError as e:
        raise CliError(" ".join(str(e).split()), code=2) from None
    return Checkpoint(info.version, info.step, info.path, spec_from_json(info.spec_json))


def read_version(root: Path, version: str, what: str):
    """``read_committed(root, version)`` (read-only: a running store may own the catalog) as
    this caller may read it: where the stack checks tokens, ``latest`` of every job is refused,
    a missing version names no other job's, and control is asked for the job first (``what``:
    the command, for its refusal). One place for `export`, `generate` and `eval`.

    Raises:
        CliError: a missing version (exit 2) or a refusal (stack_access); CheckpointRejected,
        ValueError: as read_committed (each caller words them)."""
    from services.store.checkpoint_manager import CheckpointNotFound, read_committed

    stack_access.check_any_latest(version)
    version = _with_job_id(root, version)
    try:
        info = read_committed(root, version)
    except CheckpointNotFound as e:
        raise CliError(stack_access.not_found_text(e), code=2) from None
    stack_access.check_local_read(info.version.rpartition(":")[0], what)
    return info


def _with_job_id(root: Path, version: str) -> str:
    """``version`` (``JOB:N``, ``JOB:latest``) with its job part, when that is a job's name and
    no id of the catalog under ``root``, replaced by the id it names as `versions` and
    `checkpoints` resolve it (services/cli/jobs.py ``resolve_versions_job``: control's answer,
    else the one catalog id ``<name>-<6 hex>``; several: one line, ambiguous). Unchanged when
    nothing knows the name (read_committed then names the version it lacks).

    Raises:
        CliError (exit 2): the name is ambiguous."""
    from services.cli.jobs import resolve_versions_job
    from services.store.checkpoint_manager import catalog_job_ids

    job, sep, n = version.rpartition(":")
    if not sep or not job:
        return version
    try:
        ids = catalog_job_ids(root)
    except (ValueError, OSError):
        return version  # (read_committed says what is wrong with the catalog)
    if job in ids:
        return version  # (an id: nothing asked)
    return f"{resolve_versions_job(job, unknown_as_is=True, ids=ids)}:{n}"


class VersionRemoved(CliError):
    """The version was deleted while it was read (a running job's ``checkpoint.keep_last``
    removes its older versions as it commits newer ones)."""


@contextlib.contextmanager
def reading(version: str, path: str) -> Iterator[None]:
    """Around a read of ``version``'s files at ``path``: whatever the read raises becomes one
    line. Whether the version was removed meanwhile is read from the disk (its directory gone),
    never from the error's words: DCP's reader fails on a vanished file with an AssertionError.

    Raises:
        VersionRemoved: the directory is gone; CliError: a file differs from the manifest or is
        gone, or the weights do not fit (exit 1)."""
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException: DCP's gathered errors)

    from services.compute.inference import ShardDigestMismatch

    try:
        yield
    except CliError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - one line whatever the reader raised
        if not Path(path).is_dir():
            raise VersionRemoved(
                f"checkpoint {version} was removed while it was read (its job's checkpoint.keep_last deletes older "
                "versions as it commits newer ones): try again, or name a version that is kept"
            ) from None
        if isinstance(e, ShardDigestMismatch):
            raise CliError(_named(version, e)) from None
        if isinstance(e, (FileNotFoundError, RuntimeError)):
            raise CliError(f"checkpoint {version}: cannot load: {' '.join(str(e).split())[:300]}") from None
        raise


def load_model(ckpt: Checkpoint):
    """The checkpoint's model on the CPU in eval mode, every file checked as it is read.

    Raises:
        CliError: a file differs from the manifest or is gone, the version was removed
        meanwhile (VersionRemoved), or the weights do not fit.
    """
    from services.compute.inference import load_model_for_inference

    with reading(ckpt.version, ckpt.path):
        return load_model_for_inference(ckpt.path, ckpt.spec)


def _named(version: str, error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if text.startswith(f"checkpoint {version}") else f"checkpoint {version}: {text}"


def mount(dataset: str, verify: bool) -> data_pb2.DatasetReady:
    """``name@version`` found and checked under the data root by L4-1 in this process.

    Raises:
        CliError: exit 2 for a malformed name or one not prepared (as `submit` and `delete
            dataset` answer it), else 1 (corrupt, unreadable): one line.
    """
    from services.common import paths
    from services.data.dataset_versions import DatasetVersions
    from services.data.errors import DataError, DatasetNotFound

    name, sep, version = dataset.partition("@")
    if not (sep and name and version):
        raise CliError(f"--dataset {dataset!r}: expected name@version", code=2)
    try:
        versions = DatasetVersions(paths.datasets_root(), lambda *a, **k: None, lambda *a, **k: None)
        return versions.mount_dataset(data_pb2.MountDataset(name=name, version=version, verify=verify))
    except DatasetNotFound as e:
        raise CliError(" ".join(str(e).split()), code=2) from None
    except (DataError, OSError) as e:
        raise CliError(" ".join(str(e).split())) from None


def evaluate(version: str, dataset: str | None, batches: int | None, split: str = "val") -> EvalResult:
    """The mean loss per token of checkpoint ``version`` on ``split`` of ``dataset`` (default:
    the dataset it was trained on), in this process: the job's eval stream (no shuffle, from
    the start, the job's seq_len, micro-batch size, packing and filter) as one rank reads
    it, through the data pipeline's own modules (services/data/__main__.build_stream), for
    ``batches`` micro-batches (default: the job's ``eval.batches`` x its dp ranks, i.e. the
    rows of the job's own evaluation). Float32 on the CPU, whatever the job's precision.

    Raises:
        CliError: the version, the dataset or the split cannot be used (one line); exit 2
            when ``dataset`` was prepared with another tokenizer than the job's own dataset
            (or that one is gone, so it cannot be checked: services/cli/tokenizer_check.py).
    """
    import numpy as np
    import torch
    from torch.nn import functional

    from services.common import paths
    from services.data.__main__ import build_stream
    from services.data.errors import DataError

    t0 = time.perf_counter()
    if split not in ("val", "train"):
        raise CliError(f"--split: expected 'val' or 'train', got {split!r}", code=2)
    ckpt = find_checkpoint(version)
    spec, d = ckpt.spec, ckpt.spec.data
    ready = mount(dataset or f"{d.name}@{d.version}", verify=True)  # (a mixture: its first dataset)
    label = f"{ready.name}@{ready.version}"
    if ready.vocab_size > spec.model.vocab_size:
        raise CliError(
            f"--dataset {label}: its vocabulary ({ready.vocab_size}, {ready.tokenizer}) is larger than "
            f"the model's (model.vocab_size {spec.model.vocab_size})"
        )
    if dataset is not None:
        from services.cli.tokenizer_check import trained_with_mismatch

        problem = trained_with_mismatch("", d.dataset, ready, ask_service=False)
        if problem:
            raise CliError(f"--dataset {label}: checkpoint {ckpt.version}: {problem}", code=2)
    if split == "val" and ready.val_documents == 0:
        raise CliError(f"--dataset {label}: no held-out split (0 val documents); try --split train")
    n = batches or spec.eval.batches * spec.parallel.dp
    model = load_model(ckpt)
    relay = build_stream(paths.datasets_root())
    pack = d.pack == "pack"
    req = data_pb2.OpenStream(
        mount=data_pb2.MountDataset(name=ready.name, version=ready.version, verify=False),  # verified above
        prefetch=data_pb2.SetPrefetch(watermark=d.prefetch.watermark, threads=d.prefetch.threads),
        shuffle=data_pb2.ShufflePlan(seed=d.shuffle_seed, epoch=0, enabled=False),
        filter=data_pb2.FilterRules(
            min_tokens=d.filter.min_tokens, max_tokens=d.filter.max_tokens,
            banned_bytes=d.filter.banned_bytes.encode("utf-8"), banned_tokens=d.filter.banned_tokens,
        ),
        packer=data_pb2.PackerConfig(
            seq_len=d.seq_len, micro_batch_size=d.micro_batch_size, pad_id=d.pad_id,
            mode=data_pb2.PACK if pack else data_pb2.PAD, separator_id=0 if pack else -1, rank=0, world_size=1,
        ),
        split=split, start=data_pb2.DataPosition(), repeat=False, max_batches=n,
    )  # fmt: skip
    loss_sum, tokens, seen = 0.0, 0, 0
    try:
        with torch.no_grad():
            for mb in relay.batches(req):
                shape = (mb.batch_size, mb.seq_len)
                x = torch.from_numpy(np.frombuffer(mb.input_ids, dtype="<i4").reshape(shape).astype(np.int64))
                y = torch.from_numpy(np.frombuffer(mb.labels, dtype="<i4").reshape(shape).astype(np.int64))
                logits = model(x).float()
                loss_sum += float(
                    functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
                )
                tokens += int((y != -100).sum())
                seen += 1
    except (DataError, OSError, ValueError) as e:
        raise CliError(f"--dataset {label}: {' '.join(str(e).split())}") from None
    if tokens == 0:
        raise CliError(f"--dataset {label}: split {split}: no token left to evaluate on after the job's filter")
    return EvalResult(ckpt.version, ckpt.step, label, split, seen, tokens, loss_sum / tokens, time.perf_counter() - t0)


def generate(version: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> str:
    """Continue ``prompt`` with checkpoint ``version``'s model (:func:`generate_many`, one prompt)."""
    return generate_many(version, [prompt], max_new_tokens, temperature, top_k, seed)[0]


def generate_many(
    version: str, prompts: list[str], max_new_tokens: int, temperature: float, top_k: int, seed: int
) -> list[str]:
    """Continue each of ``prompts`` with checkpoint ``version``'s model, in this process (the
    version and the tokenizer of the dataset it trained on are read under SURGE_HOME; the
    model loaded once, prompts of one length decoded as a batch: inference.generate_texts).

    Raises:
        CliError: the version or its dataset cannot be used (one line).
    """
    from services.compute.inference import generate_texts
    from services.jobspec import spec_to_json

    ckpt = find_checkpoint(version)
    tokenizer = mount(f"{ckpt.spec.data.name}@{ckpt.spec.data.version}", verify=False).tokenizer
    try:
        with reading(ckpt.version, ckpt.path):
            return generate_texts(
                ckpt.path, spec_to_json(ckpt.spec), prompts, max_new_tokens, temperature, top_k, seed, tokenizer
            )
    except ValueError as e:  # a byte-level tokenizer for a model whose vocabulary is not 256
        raise CliError(f"generate: {e}") from None
