"""L5-2's sinks beside the JSONL file and Prometheus: TensorBoard event files and W&B runs.

Nothing here raises: every failure goes to ``on_failure``. The metrics logger calls in on
one thread at a time, in arrival order (the service's sink thread).

A job chooses them in its spec (``metrics: {tensorboard: true, wandb: {project: P}}``); its
ranks push that choice as ``LogCollectionConfig`` before their first record and the metrics
logger hands it here (:meth:`Sinks.configure`). The copy is kept in
``<metrics>/<job>/sinks.json`` (written atomically), so a store restart writes on where it
left off. Files of a job live beside its JSONL file::

    <store root>/metrics/<job>.jsonl             every record (metrics_logger.py)
    <store root>/metrics/<job>/sinks.json        the job's sink choice, as pushed
    <store root>/metrics/<job>/tensorboard/      events.out.tfevents.*  (tensorboard --logdir)
    <store root>/metrics/<job>/wandb/            wandb/offline-run-*     (wandb sync)

What is written: the records of rank 0 only (every rank reports the same all-rank values;
the per-rank series stay in Prometheus), each the moment it is written to the JSONL file (a
resent record is not written again), with the record's step as the x axis. The values are
the record's fields unchanged (no smoothing, no unit change), named ``train/<field>`` for
a ``StepCompleted`` (:data:`STEP_FIELDS`) and ``eval/<field>`` for an ``EvalCompleted``
(:data:`EVAL_FIELDS`); ``train/skipped`` is 1 for a skipped update. TensorBoard scalars are
written as float64 tensors (the scalars plugin's ``DT_DOUBLE`` form, as
``torch.utils.tensorboard``'s ``double_precision``), so a value read back equals the JSONL
value exactly; W&B keeps doubles too. Each TensorBoard write is flushed to the OS, as the
JSONL line is. A step replayed after a recovery is a new record: TensorBoard shows both
points at that step; W&B, whose step only moves forward, keeps the first (its own rule).

A sink that fails (cannot be created, a write raises) is closed for its job and reported
once, as ``LogWriteFailed`` (its ``failure`` typed from the error) through ``on_failure``;
the JSONL file and Prometheus go on, and the record is acknowledged: a sink is never why a
rank's records stop. W&B is offline only (no network is ever tried).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from google.protobuf.message import Message

from services.contract import Module, store_pb2
from services.contract.failures import failure_of, one_line

STEP_FIELDS = (
    "loss",
    "learning_rate",
    "grad_norm",
    "tokens",
    "tokens_per_second",
    "step_seconds",
    "data_wait_seconds",
    "forward_seconds",
    "backward_seconds",
    "reduction_seconds",
    "optimizer_seconds",
    "loss_scale",
    "mfu",
    "flops_per_token",
    "epoch",
    "skipped",
)
EVAL_FIELDS = ("loss", "tokens", "seconds")
CONFIG_FILE = "sinks.json"
SINK_RANK = 0  # whose records the sinks take
_CONFIG_OP = store_pb2.LogCollectionConfig.DESCRIPTOR.full_name


def scalars(kind: str, msg: Message) -> dict[str, float]:
    """The record's values as sink scalars: ``train/<field>`` or ``eval/<field>``, unchanged."""
    prefix, fields = ("train", STEP_FIELDS) if kind == "step" else ("eval", EVAL_FIELDS)
    return {f"{prefix}/{name}": float(getattr(msg, name)) for name in fields}


class Sink(Protocol):
    path: Path

    def write(self, step: int, wall_time: float, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files of one job (``tensorboard.summary.writer``: no TensorFlow, no torch)."""

    def __init__(self, path: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(path), flush_secs=60)

    def write(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2

        scalars_plugin = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
        )
        summary = summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(
                    tag=tag,
                    metadata=scalars_plugin,
                    tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[value]),
                )
                for tag, value in values.items()
            ]
        )
        self._writer.add_event(event_pb2.Event(wall_time=wall_time, step=step, summary=summary))
        self._writer.flush()  # to the OS, as the JSONL line (raises what the writer thread hit)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One offline W&B run of one job (``wandb sync <path>/wandb/offline-run-*`` uploads it)."""

    def __init__(self, path: Path, job_id: str, project: str, mode: str):
        import wandb

        if mode != "offline":
            raise ValueError(f'metrics.wandb.mode: "{mode}": only "offline" is supported')
        self.path = path  # wandb writes <dir>/wandb/offline-run-*
        path.parent.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=job_id,
            dir=str(path.parent),
            mode="offline",
            reinit="create_new",  # one run per job, several jobs in this process
            config={"job_id": job_id},
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False),
        )

    def write(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """The sinks of every job (thread-safe).

    Args:
        metrics_dir: the logger's directory (``<store root>/metrics``).
        on_failure: gets each ``LogWriteFailed`` (the module's failure event, typed).
    """

    def __init__(self, metrics_dir: Path, on_failure: Callable[[store_pb2.LogWriteFailed], None]):
        self._dir = metrics_dir
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._config: dict[str, dict[str, Any]] = {}  # job -> the config as pushed (its JSON form)
        self._open: dict[str, list[Sink]] = {}

    def configure(self, msg: store_pb2.LogCollectionConfig) -> None:
        """Keep the job's config (a different one replaces it: its sinks are reopened). A
        copy that cannot be written is reported (the config holds until the store restarts)."""
        job, config = msg.job_id, _config_of(msg)
        with self._lock:
            if self._config_locked(job) == config:
                return
            path = self._dir / job / CONFIG_FILE
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(config, sort_keys=True) + "\n")
                os.replace(tmp, path)
            except OSError as e:
                self._failed(job, path, e, "write")
            self._close_job(job)
            self._config[job] = config
            self._open[job] = self._start(job, config)

    def record(self, kind: str, msg: Message) -> None:
        """Write a record just written to the JSONL file (rank 0's only) to the job's sinks."""
        if msg.rank != SINK_RANK:
            return
        job = msg.job_id
        with self._lock:
            if job not in self._open:
                self._open[job] = self._start(job, self._config_locked(job))
            sinks = self._open[job]
            if not sinks:
                return
            values = scalars(kind, msg)
            wall = msg.unix_time if kind == "step" and msg.unix_time else time.time()
            for sink in list(sinks):
                try:
                    sink.write(msg.step, wall, values)
                except Exception as e:  # noqa: BLE001 - any sink error: reported, the sink closed
                    sinks.remove(sink)
                    self._failed(job, sink.path, e, "write", msg.DESCRIPTOR.full_name)
                    _close_quietly(sink)

    def stop(self, msg: store_pb2.StopLogCollection) -> None:
        """The sinks' rank ended its training: close the job's sinks (a later record opens
        them again: a resumed job gets a new event file and a new W&B run)."""
        if msg.rank != SINK_RANK:
            return
        with self._lock:
            self._close_job(msg.job_id)

    def close(self) -> None:
        """Close every sink (flushes event files, finishes W&B runs)."""
        with self._lock:
            for job in list(self._open):
                self._close_job(job)

    # ------------------------------------------------------------------ internals

    def _config_locked(self, job: str) -> dict[str, Any]:
        config = self._config.get(job)
        if config is None:  # not pushed since this process started: the kept copy, if any
            path = self._dir / job / CONFIG_FILE
            try:
                config = json.loads(path.read_text())
            except FileNotFoundError:
                config = {}
            except (OSError, ValueError) as e:
                self._failed(job, path, e, "read")
                config = {}
            self._config[job] = config
        return config

    def _start(self, job: str, config: dict[str, Any]) -> list[Sink]:
        sinks: list[Sink] = []
        base = self._dir / job
        wanted: list[tuple[Path, Callable[[], Sink]]] = []
        if config.get("tensorboard"):
            wanted.append((base / "tensorboard", lambda: TensorBoardSink(base / "tensorboard")))
        if config.get("wandb_project"):
            wanted.append(
                (
                    base / "wandb",
                    lambda: WandbSink(
                        base / "wandb", job, config["wandb_project"], config.get("wandb_mode", "offline")
                    ),
                )
            )
        for path, make in wanted:
            try:
                sinks.append(make())
            except Exception as e:  # noqa: BLE001 - a sink that cannot start: reported, the others go on
                self._failed(job, path, e, "open")
        return sinks

    def _close_job(self, job: str) -> None:
        for sink in self._open.pop(job, []):
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - reported; closing the others goes on
                self._failed(job, sink.path, e, "close")

    def _failed(self, job: str, path: Path, error: BaseException, what: str, operation: str = _CONFIG_OP) -> None:
        failure = failure_of(error, Module.L5_METRICS_LOGGER, operation)
        failure.job_id = job
        self._on_failure(store_pb2.LogWriteFailed(path=str(path), reason=f"{what}: {one_line(error)}", failure=failure))


def wanted(msg: store_pb2.LogCollectionConfig) -> bool:
    """Whether a job's sink choice names any sink (its records then go to the sink thread)."""
    return bool(msg.tensorboard or msg.wandb_project)


def kept_wanted(metrics_dir: Path, job: str) -> bool:
    """Whether the job's kept choice (``sinks.json``, from before a store restart) names any
    sink; True when it cannot be read (the sink thread reports that, on the job's record)."""
    try:
        config = json.loads((metrics_dir / job / CONFIG_FILE).read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    return bool(config.get("tensorboard") or config.get("wandb_project")) if isinstance(config, dict) else True


def _config_of(msg: store_pb2.LogCollectionConfig) -> dict[str, Any]:
    return {"tensorboard": msg.tensorboard, "wandb_project": msg.wandb_project, "wandb_mode": msg.wandb_mode}


def _close_quietly(sink: Sink) -> None:
    try:
        sink.close()
    except Exception:  # noqa: BLE001, S110 - already reported as failed
        pass
