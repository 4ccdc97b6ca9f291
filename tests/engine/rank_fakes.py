"""In-process stand-ins for the relays of other layers (L1 session, L4 data, L5 store), so
the real rank wiring (``services.rank.__main__.compose``) runs without any service."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from services.compute.inference import safe_load
from services.contract import data_pb2, engine_pb2, route_pb2, store_pb2
from services.contract.bus import Emitter, Reply
from services.engine.training_loop import Batch


def corpus_bytes(limit: int = 400_000) -> bytes:
    """Real text: a few stdlib modules, concatenated."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = b""
    for name in ("argparse.py", "textwrap.py", "string.py", "shlex.py", "fractions.py", "difflib.py"):
        out += (stdlib / name).read_bytes() + b"\0"
    return out[:limit]


def free_port() -> int:
    from tests.ports import free_port as below_the_ephemeral_range  # only the test process calls this

    return below_the_ephemeral_range()


class FakeData:
    """L4 relay: windows of a byte corpus. Train: random windows from the first 90%, micro-
    batch i of dp rank d (of W) seeded by (shuffle seed, epoch, round i, d): a global cursor
    counting rounds, as the real deal does (services/data/batch_packer.py); val: consecutive
    windows of the last 10%, rank d's share."""

    def __init__(self, versions: Emitter, packer: Emitter, corpus: bytes, *, train_batches: int):
        self._versions, self._packer = versions, packer
        self._data = np.frombuffer(corpus, dtype=np.uint8).astype(np.int64)
        self._split_at = int(len(self._data) * 0.9)
        self._train_batches = train_batches
        self.opened: list[data_pb2.OpenStream] = []
        self._current: dict[str, object] = {}  # split -> the token of its open stream
        self.first_train_batch: torch.Tensor | None = None

    def mount(self, msg: data_pb2.MountDataset, payload: Any = None):
        if msg.name == "missing":
            return data_pb2.DatasetUnavailable(
                name=msg.name, version=msg.version, reason=f"dataset {msg.name}@{msg.version} not found"
            )
        if msg.name == "changed":  # a shard whose bytes are no longer the manifest's (typed cause)
            reason = f"dataset {msg.name}@{msg.version}: shard train.bin changed since it was prepared"
            failure = route_pb2.Failure(cause=route_pb2.FAILURE_DATA_CORRUPT, detail=reason)
            return data_pb2.DatasetUnavailable(name=msg.name, version=msg.version, reason=reason, failure=failure)
        return data_pb2.DatasetReady(name=msg.name, version=msg.version, vocab_size=256, tokenizer="bytes")

    def open_stream(self, msg: data_pb2.OpenStream, payload: Any = None) -> Reply:
        """As the real relay: a stream of a split replaces the split's previous one (which
        stops), and the reply's payload is the stream's token, carried by its batches."""
        self.opened.append(msg)
        token = object()
        self._current[msg.split] = token
        threading.Thread(target=self._pump, args=(msg, token), daemon=True).start()
        return Reply(None, token)

    def _pump(self, msg: data_pb2.OpenStream, token: object) -> None:
        B, T = msg.packer.micro_batch_size, msg.packer.seq_len
        if msg.split == "train":
            first = msg.start.row  # batch i is a pure function of (seed, epoch, i, rank)
            for i in range(first, first + self._train_batches):
                rng = np.random.default_rng([msg.shuffle.seed, msg.shuffle.epoch, i, msg.packer.rank])
                starts = rng.integers(0, self._split_at - T - 1, size=B)
                if self._current.get("train") is not token:
                    return
                self._emit("train", np.stack([self._data[s : s + T + 1] for s in starts]), i + 1, token)
            return
        val = self._data[self._split_at :]
        rows_per_rank = (len(val) - 1) // T // max(1, msg.packer.world_size)
        base = msg.packer.rank * rows_per_rank
        for i in range(min(msg.max_batches, rows_per_rank // B)):
            rows = [val[(base + i * B + b) * T : (base + i * B + b) * T + T + 1] for b in range(B)]
            self._emit("val", np.stack(rows), i + 1, token)
        if self._current.get("val") is token:
            self._packer(data_pb2.DataExhausted(split="val"))

    def _emit(self, split: str, rows: np.ndarray, document: int, token: object = None) -> None:
        x = torch.from_numpy(rows[:, :-1].copy())
        y = torch.from_numpy(rows[:, 1:].copy())
        mb = data_pb2.MicroBatch(
            batch_size=x.shape[0],
            seq_len=x.shape[1],
            tokens=int(y.numel()),
            next=data_pb2.DataPosition(row=document),
        )
        if split == "train" and self.first_train_batch is None:
            self.first_train_batch = x
        self._packer(mb, Batch(split, x, y, token))


class GlobalRowData(FakeData):
    """FakeData whose train stream is dealt as the real packer deals it
    (services/data/batch_packer.py): one global order of rows (row r: seq_len + 1 tokens at a
    start drawn from (shuffle seed, epoch, r)); from the stream's start row P, slot m (rows
    P + m*B .. P + m*B + B - 1) goes to dp rank m % W, and a micro-batch's ``next`` is the
    position after its round, P + (round + 1) * W * B. So the global batches depend only on
    A*W*B: a run resized in place reads the same rows as one that never was."""

    def row(self, seed: int, epoch: int, r: int, seq_len: int) -> np.ndarray:
        """Row ``r`` of the global order (input ids and the label: ``seq_len + 1`` tokens)."""
        start = int(np.random.default_rng([seed, epoch, r]).integers(0, self._split_at - seq_len - 1))
        return self._data[start : start + seq_len + 1]

    def _pump(self, msg: data_pb2.OpenStream, token: object) -> None:
        if msg.split != "train":
            return super()._pump(msg, token)
        B, T = msg.packer.micro_batch_size, msg.packer.seq_len
        W, d = max(1, msg.packer.world_size), msg.packer.rank
        for i in range(self._train_batches):
            first = msg.start.row + i * W * B + d * B
            rows = np.stack([self.row(msg.shuffle.seed, msg.shuffle.epoch, first + b, T) for b in range(B)])
            if self._current.get("train") is not token:
                return
            self._emit("train", rows, msg.start.row + (i + 1) * W * B, token)


class FakeStore:
    """L5 relay: collects metric events; checkpoints into ``root/<step>`` with DCP
    (synchronously, whatever ``write_async`` says)."""

    def __init__(self, events: Emitter, root: Path):
        self._events, self._root = events, root
        self.metrics: list[Any] = []
        self.configs: list[store_pb2.LogCollectionConfig] = []
        self.committed: list[store_pb2.SaveCompleted] = []
        self.flushed = 0
        self.profiles: list[store_pb2.StoreProfile] = []

    def on_step_completed(self, msg, payload=None):
        self.metrics.append(msg)

    def on_eval_completed(self, msg, payload=None):
        self.metrics.append(msg)

    def on_sample_generated(self, msg, payload=None):
        self.metrics.append(msg)

    def on_evaluation_scores(self, msg, payload=None):
        self.metrics.append(msg)

    def log_collection_config(self, msg, payload=None):
        self.configs.append(msg)

    def stop_log_collection(self, msg, payload=None):
        self.configs.append(msg)

    def store_profile(self, msg: store_pb2.StoreProfile, payload):
        """Keeps a profile's files as the store does (``profiles/cmd<seq>/``, under this root)."""
        out = self._root / "profiles" / f"cmd{msg.seq}"
        out.mkdir(parents=True, exist_ok=True)
        stored = store_pb2.ProfileStored()
        for name, path in payload.items():
            shutil.copyfile(path, out / name)
            stored.files.append(str(out / name))
            stored.bytes += (out / name).stat().st_size
        self.profiles.append(msg)
        return stored

    def save_checkpoint(self, msg: store_pb2.SaveCheckpoint, payload):
        path = self._root / f"step{msg.step}"
        dcp.save(payload, checkpoint_id=str(path))
        if dist.is_initialized():
            dist.barrier()
        return store_pb2.SaveStaged(job_id=msg.job_id, step=msg.step, staging_path=str(path))

    def flush_checkpoint(self, msg: store_pb2.FlushCheckpoint, payload=None):
        self.flushed += 1

    def commit_checkpoint(self, msg: store_pb2.CommitCheckpoint, payload=None):
        done = store_pb2.SaveCompleted(
            job_id=msg.job_id,
            version=f"{msg.job_id}:{len(self.committed) + 1}",
            step=msg.step,
            path=str(self._root / f"step{msg.step}"),
        )
        self.committed.append(done)
        self._events(done)
        return done

    def load_checkpoint(self, msg: store_pb2.LoadCheckpoint, payload):
        if msg.hf_directory:  # (the real relay's reader: no store is asked)
            from services.rank.store_client import load_hf_weights

            return load_hf_weights(msg, payload)
        version = msg.version
        if ":" in version:  # "<job>:<n>" (init_from.checkpoint): this fake's directory of step n
            version = f"step{version.rpartition(':')[2]}"
        path = self._root / version
        safe_load(payload, str(path))
        step = int(version.removeprefix("step")) if version.startswith("step") else 0  # as a catalog would
        return store_pb2.CheckpointLoaded(info=store_pb2.CheckpointInfo(version=msg.version, path=str(path), step=step))


class FakeUp:
    """L1 relay: records the events the rank sends up."""

    def __init__(self):
        self.events: list[Any] = []
        self.finished = threading.Event()

    def send_up(self, routed, msg, payload=None):
        """The session link's way out (services/contract/relay.py): what would go up."""
        self.on_event(msg, payload)

    def on_event(self, msg, payload=None):
        self.events.append(msg)
        if isinstance(msg, (engine_pb2.TrainingLoopFinished, engine_pb2.TrainingLoopFailed)):
            self.finished.set()

    def of(self, kind) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def tiny_spec(**overrides: Any):
    """A job spec for a ~40k-parameter model on 64-byte rows (fast on one CPU thread)."""
    from services.jobspec import JobSpec

    raw: dict[str, Any] = {
        "name": "tiny",
        "steps": 30,
        "seed": 0,
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 4},
        "data": {"dataset": "corpus@v1", "seq_len": 64, "micro_batch_size": 8},
        "optimizer": {"lr": 3e-3, "warmup_steps": 5},
        "checkpoint": {"every_steps": 0, "at_end": False},
        "eval": {"every_steps": 0, "batches": 4, "at_end": False},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            raw[key] = {**raw.get(key, {}), **value}
        else:
            raw[key] = value
    if "warmup_steps" not in overrides.get("optimizer", {}):  # a short run warms up for less
        raw["optimizer"]["warmup_steps"] = min(raw["optimizer"]["warmup_steps"], raw["steps"] - 1)
    return JobSpec.model_validate(raw)


class LocalRank:
    """One rank wired by the real composition root, with fake relays, in this process."""

    def __init__(
        self,
        spec,
        ckpt_root: Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        port: int | None = None,
        resume_version: str = "",
        job_id: str = "job",
        data: type[FakeData] = FakeData,
        store: type[FakeStore] = FakeStore,
    ):
        """``data``: the L4 relay's fake (:class:`GlobalRowData`: the real deal's global rows);
        ``store``: the L5 relay's."""
        from services.contract import Module
        from services.contract.bus import Bus
        from services.jobspec import spec_to_json
        from services.rank.__main__ import compose

        self.spec = spec
        self.bus = bus = Bus()
        self.data = data(
            bus.emitter(Module.L4_DATASET_VERSIONS),
            bus.emitter(Module.L4_BATCH_PACKER),
            corpus_bytes(),
            train_batches=spec.steps * spec.data.grad_accum + 4,
        )
        self.store = store(bus.emitter(Module.L5_CHECKPOINT_MANAGER), ckpt_root)
        self.up = FakeUp()
        self.modules = compose(bus, spec, "cpu", data=self.data, store=self.store, metrics=self.store, up=self.up)
        from services.control.fault_decision import standing_orders

        # The standing orders L1-1 would issue with this job (e.g. skip fp16 overflow steps).
        self.init = engine_pb2.InitJob(
            job_id=job_id,
            spec_json=spec_to_json(spec),
            resume_version=resume_version,
            standing_orders=standing_orders(spec.fault_policy),
        )
        self.assignment = engine_pb2.RankAssignment(
            rank=rank,
            world_size=world_size,
            master_addr="127.0.0.1",
            master_port=port or free_port(),
            backend="gloo",
            device="cpu",
            num_threads=1,
        )
        self.error: BaseException | None = None

    def bring_up(self) -> None:
        self.modules.orchestrator(self.init)
        self.modules.allocator(self.assignment)

    def run(self) -> None:
        """Bring up and run the loop on this thread; failures are reported like rank.py does."""
        try:
            self.bring_up()
            self.modules.loop.run()
        except BaseException as e:  # noqa: BLE001
            self.error = e
            self.modules.loop.fail(e)
        finally:
            self.modules.parallel.shutdown()

    def command(self, msg) -> None:
        self.modules.orchestrator(msg)

    def steps(self) -> list[Any]:
        return self.up.of(engine_pb2.StepCompleted)

    def model_state(self) -> dict[str, torch.Tensor]:
        """The weights, read the way the loop reads them (ExportState -> a copy)."""
        from services.contract import Module

        port = self.bus.port(Module.L2_TRAINING_LOOP, Module.L3_SHARD_LOADER)
        return {k: v.detach().clone() for k, v in port(engine_pb2.ExportState()).payload.state_dict().items()}


def answer_step_faults(rank: LocalRank, verdict: Callable[[engine_pb2.StepFaultReported], int | None]) -> list:
    """Stand in for L1-1 on the rank's session: each StepFaultReported is recorded and answered
    with ``verdict(report)`` (a StepVerdictAction; None: no answer), as control would send it
    down. Returns the reports, in order."""
    reports, record = [], rank.up.on_event

    def on_event(msg, payload=None):
        record(msg, payload)
        if isinstance(msg, engine_pb2.StepFaultReported):
            reports.append(msg)
            action = verdict(msg)
            if action is not None:
                rank.command(engine_pb2.StepVerdict(job_id=msg.job_id, step=msg.step, kind=msg.kind, action=action))

    rank.up.on_event = on_event
    return reports


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def started(rank: LocalRank) -> threading.Thread:
    """``rank.run`` on a daemon thread, started."""
    t = threading.Thread(target=rank.run, daemon=True)
    t.start()
    return t


def wait_for(rank: LocalRank, t: threading.Thread, kind) -> list:
    """The events of type ``kind`` the rank sent up, once there is one (at most 30 s)."""
    for _ in range(300):
        if rank.up.of(kind):
            break
        t.join(0.1)
    return rank.up.of(kind)


def finish_processes(procs: list, timeout: float) -> list[str]:
    """Wait for every rank process (``timeout`` in all), SIGKILL what is left (by its PID);
    return each one's output (``p.log``: the file its stdout and stderr went to)."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.log.close()
    return [Path(p.log.name).read_text() for p in procs]
