"""The simulated rank's checkpoint: a small real shard per rank, saved through the store.

The same store protocol and order as the real rank's checkpoint relay
(services/rank/store_client.py, ``save_checkpoint`` / ``commit_checkpoint``, which imports
torch for DCP), with its agreements done on :class:`~services.rank.simulated.collective.Collective`:

1. rank 0 waits for its previous commit while the store answers (services/rank/
   store_liveness.py: a busy store is waited for, up to a bound derived from the job's
   checkpoint-staging budget; one that stops answering is found within
   ``SURGE_STORE_RPC_TIMEOUT_S``); the ranks agree that every previous save settled (the
   largest failure cause over the world);
2. at the first save the ranks agree on this launch's ``attempt`` (rank 0's random token);
3. every rank asks ``BeginSave``, waited for the same way; the ranks agree every one got
   its staging; a store that could not be asked (UNAVAILABLE: cause UNREACHABLE,
   DEADLINE_EXCEEDED: TIMEOUT), stopped answering (TIMEOUT, UNREACHABLE) or refused
   (REJECTED) skips the save on every rank, and rank 0 reports ``SnapshotFailed{operation
   "save", cause, step}`` up its session;
4. every rank writes its shard, ``shard_bytes`` of bytes that change with the step, as one
   content-addressed chunk of the save's epoch (services/state/chunk_store.py's layout):
   into the store's directory (TRANSFER_PATH: temp name, fsync, rename) or streamed
   (TRANSFER_STREAM: ``PutCheckpointFiles``); TRANSFER_FSSPEC is not simulated (the rank
   fails with checkpoint_error);
5. rank 0 gathers every shard's digest and size, writes the version's ``chunks.json`` (the
   index the store checks at commit) and sends ``CommitSave`` from a background thread
   (the real relay's asynchronous commit: training goes on); its ``SaveCompleted`` goes up
   the session as L5-1's event. The next save, and the end of the run, wait for it.

The save's agreements wait ``agree_timeout_s`` for a peer (the real rank's side groups:
services/rank/comm_settings.side_timeout_s), not the step collective's timeout: a peer may
wait that long for a busy store.

A write that fails fails the rank (``CheckpointError``, fault class checkpoint_error), as a
failed DCP write does. Measured for the test bed: per save, rank 0's time from its
BeginSave to the commit's reply, and whether the save committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from services.common.grpc_server import channel
from services.contract import Module, route_pb2, store_pb2, store_pb2_grpc
from services.rank.simulated.collective import Collective
from services.rank.store_liveness import STAGING_BUDGET_S, StoreLiveness, StoreSilent, wait_bound_s

RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
COMMIT_TIMEOUT_S = 600.0
PART_BYTES = 1 << 20  # one CheckpointFileData at most
CHUNK_INDEX = "chunks.json"
CHUNK_INDEX_FORMAT = "surge.checkpoint.chunks/1"
OUTAGE_CAUSES = {
    grpc.StatusCode.UNAVAILABLE: store_pb2.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: store_pb2.TIMEOUT,
}
_FAILURE_OF = {
    store_pb2.UNREACHABLE: route_pb2.FAILURE_UNAVAILABLE,
    store_pb2.TIMEOUT: route_pb2.FAILURE_TIMEOUT,
    store_pb2.REJECTED: route_pb2.FAILURE_INVALID_INPUT,
}


class CheckpointError(RuntimeError):
    fault_class = "checkpoint_error"


class ShardSaver:
    """One rank's saves (module docstring). ``checkpoint``: the spec's ``checkpoint:``
    section (JSON); ``send_up(msg, sender)``: the session's way up."""

    def __init__(
        self,
        address: str,
        job_id: str,
        rank: int,
        world_size: int,
        collective: Collective,
        shard_bytes: int,
        checkpoint: dict[str, Any],
        spec_json: str,
        send_up: Callable[..., None],
        log: Any,
        staging_budget_s: float = STAGING_BUDGET_S,
        agree_timeout_s: float | None = None,
    ):
        """``staging_budget_s``: the job's ``liveness.phase_seconds.checkpoint_staging``
        (the bound of a wait for a store that answers is derived from it);
        ``agree_timeout_s``: the save's agreements' limit per round (None: the collective's)."""
        self._address, self._job, self._rank, self._world = address, job_id, rank, world_size
        self._collective, self._shard_bytes = collective, shard_bytes
        self._checkpoint, self._spec_json, self._send_up, self._log = checkpoint, spec_json, send_up, log
        # BeginSave and CommitSave as the loop's commands (the relay's channel), the files
        # on the data plane as L5-1's rank side, as the real relay does.
        self._channel = channel(address, options=RECONNECT_OPTIONS, module=Module.L2_TRAINING_LOOP)
        self._stub = store_pb2_grpc.StoreServiceStub(self._channel)
        self._data_channel = channel(address, options=RECONNECT_OPTIONS, module=Module.L5_CHECKPOINT_MANAGER)
        self._data = store_pb2_grpc.StoreServiceStub(self._data_channel)
        # Connected now, not at the first save (as store_client.py: a burst of handshakes).
        self._connecting = [grpc.channel_ready_future(c) for c in (self._channel, self._data_channel)]
        self._liveness = StoreLiveness(self._channel, address, world_size=world_size)
        self._bound_s = wait_bound_s(staging_budget_s, self._liveness.silent_s)
        self._agree_s = agree_timeout_s
        self._attempt = ""
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commit")
        self._commit: Future | None = None
        self.saves: list[dict[str, Any]] = []  # rank 0: one record per save (the test bed's figures)

    def save(self, step: int) -> None:
        """Save ``step`` (collective: every rank, the same step).

        Raises:
            CheckpointError: this rank's write failed, or a commit was refused.
            CollectiveBroken: a peer left.
        """
        t0 = time.perf_counter()
        settled = self._commit_settled(self._bound_s)
        cause = self._collective.exchange(settled[0] if settled else 0, max, self._agree_s)
        if not self._attempt:  # this launch's generation: rank 0's draw, agreed at the first save
            self._attempt = self._collective.exchange(secrets.token_hex(16), lambda drawn: drawn[0], self._agree_s)
        staged, reason = None, settled[1] if settled else ""
        if not cause:
            ask = store_pb2.SaveCheckpoint(
                job_id=self._job, step=step, rank=self._rank, write_async=True, attempt=self._attempt,
                baseline_every=self._checkpoint.get("baseline_every", 10),
            )  # fmt: skip
            try:
                staged = self._liveness.call("BeginSave", self._stub.BeginSave, ask, self._bound_s)
                failed = 0
            except StoreSilent as e:  # the store stopped answering while this save waited for it
                failed, reason = e.cause, str(e)
                self._log.warning("sim_begin_save_failed", step=step, reason=reason)
            except grpc.RpcError as e:
                failed = OUTAGE_CAUSES.get(e.code(), store_pb2.REJECTED)
                reason = (
                    f"store at {self._address}: BeginSave: {e.code().name}: {' '.join((e.details() or '').split())}"
                )
                self._log.warning("sim_begin_save_failed", step=step, reason=reason)  # rank 0 names only the cause
            cause = self._collective.exchange(failed, max, self._agree_s)  # every rank has its staging
        if cause:
            if self._rank == 0:
                self._report(step, cause, reason or f"another rank could not stage step {step}")
                self._saved({"step": step, "committed": False, "cause": store_pb2.StoreFailureCause.Name(cause)})
            return
        try:
            shard = self._write(staged, step)
        except (OSError, grpc.RpcError, CheckpointError) as e:
            shard = {"error": f"rank {self._rank}: {type(e).__name__}: {e}"}
        shards = self._collective.exchange(shard, lambda every: every, self._agree_s)  # (rank 0 gathers)
        errors = [s["error"] for s in shards if "error" in s]
        if errors:
            raise CheckpointError(f"checkpoint step {step}: write failed: {errors[0]}")
        if self._rank == 0:
            self._write_index(staged, step, shards)
            commit = store_pb2.CommitCheckpoint(
                job_id=self._job, step=step, world_size=self._world, spec_json=self._spec_json,
                keep_last=self._checkpoint.get("keep_last", 3), keep_every=self._checkpoint.get("keep_every", 0),
                attempt=self._attempt,
            )  # fmt: skip
            self._commit = self._committer.submit(self._commit_now, commit, t0)

    def flush(self) -> None:
        """Wait for the last commit (the run's end) while the store answers, up to the
        bound. Raises CheckpointError if it was refused."""
        pending = self._commit_settled(self._bound_s, breaker=False)  # (the run's end: no next interval)
        if pending is not None:
            self._report(self.saves[-1]["step"] if self.saves else 0, *pending)

    def close(self) -> None:
        self._committer.shutdown(wait=False, cancel_futures=True)
        for connecting in self._connecting:
            connecting.cancel()
        self._liveness.close()
        self._channel.close()
        self._data_channel.close()

    # ------------------------------------------------------------------ private

    def _shard(self, step: int) -> bytes:
        """``shard_bytes`` that differ per (job, rank, step): a delta writes a new chunk."""
        seed = hashlib.sha256(f"{self._job}/{self._rank}/{step}".encode()).digest()
        return (seed * (self._shard_bytes // len(seed) + 1))[: self._shard_bytes]

    def _write(self, staged: store_pb2.SaveStaged, step: int) -> dict[str, Any]:
        data = self._shard(step)
        sha = hashlib.sha256(data).hexdigest()
        if staged.transfer == store_pb2.TRANSFER_PATH:
            final = Path(staged.chunk_path) / sha[:2] / sha
            if not final.exists():  # (a chunk is never written twice)
                _durable(final, data)
        elif staged.transfer == store_pb2.TRANSFER_STREAM:
            self._upload(staged, step, sha, data, store_pb2.CHECKPOINT_FILE_CHUNK)
        else:
            raise CheckpointError(
                f"checkpoint step {step}: the store asked for {store_pb2.TransferMode.Name(staged.transfer)}; "
                "simulated ranks write TRANSFER_PATH or TRANSFER_STREAM"
            )
        return {"sha": sha, "bytes": len(data)}

    def _write_index(self, staged: store_pb2.SaveStaged, step: int, shards: list[dict[str, Any]]) -> None:
        sizes = {s["sha"]: s["bytes"] for s in shards}
        index = {
            "format": CHUNK_INDEX_FORMAT,
            "epoch": str(staged.epoch),
            "chunk_bytes": self._shard_bytes,
            "chunks": [{"sha": sha, "bytes": n} for sha, n in sorted(sizes.items())],
            "bytes": sum(sizes.values()),
            "written_bytes": sum(sizes.values()),
            "written_chunks": len(sizes),
            "items": len(shards),
            "slots": {},
        }
        data = json.dumps(index, indent=1, sort_keys=True).encode()
        if staged.transfer == store_pb2.TRANSFER_PATH:
            _durable(Path(staged.staging_path) / CHUNK_INDEX, data)
        else:
            self._upload(staged, step, CHUNK_INDEX, data, store_pb2.CHECKPOINT_FILE_INDEX)

    def _upload(self, staged: store_pb2.SaveStaged, step: int, name: str, data: bytes, kind: int) -> None:
        header = store_pb2.CheckpointUploadHeader(
            job_id=self._job, step=step, attempt=self._attempt, rank=self._rank, epoch=staged.epoch
        )

        def parts():
            yield store_pb2.CheckpointUpload(header=header)
            sha = hashlib.sha256(data).hexdigest()
            for i in range(0, max(len(data), 1), PART_BYTES):
                first = {"name": name, "kind": kind, "size": len(data), "sha256": sha} if i == 0 else {}
                yield store_pb2.CheckpointUpload(
                    file=store_pb2.CheckpointFileData(data=data[i : i + PART_BYTES], **first)
                )

        self._data.PutCheckpointFiles(parts(), timeout=COMMIT_TIMEOUT_S)

    def _commit_now(self, commit: store_pb2.CommitCheckpoint, t0: float) -> None:
        record: dict[str, Any] = {"step": commit.step, "committed": False}
        try:
            done = self._stub.CommitSave(commit, timeout=COMMIT_TIMEOUT_S)
        except grpc.RpcError as e:
            cause = OUTAGE_CAUSES.get(e.code())
            text = f"store at {self._address}: CommitSave: {e.code().name}: {' '.join((e.details() or '').split())}"
            self._saved({**record, "cause": store_pb2.StoreFailureCause.Name(cause or store_pb2.REJECTED)})
            if cause is None:
                raise CheckpointError(f"checkpoint step {commit.step}: {text}") from None
            self._report(commit.step, cause, f"{text}; training continues, saved again at the next interval")
            return
        self._saved(
            {**record, "committed": True, "commit_s": round(time.perf_counter() - t0, 4), "version": done.version}
        )
        self._send_up(done, Module.L5_CHECKPOINT_MANAGER)

    def _saved(self, record: dict[str, Any]) -> None:
        """Rank 0: one save's outcome, kept and logged (the test bed reads ``sim_save`` lines)."""
        self.saves.append(record)
        self._log.info("sim_save", **record)

    def _commit_settled(self, bound_s: float, breaker: bool = True) -> tuple[int, str] | None:
        """(cause, reason) if rank 0's commit still waits for a store that stopped answering,
        or for one that answered but not this commit within ``bound_s``; else None."""
        commit = self._commit
        if commit is None:
            return None
        try:
            self._liveness.wait(commit, bound_s, "the previous save's CommitSave", breaker)
        except StoreSilent as e:
            return e.cause, f"the previous save's commit is still waiting: {e}"
        self._commit = None
        commit.result()  # (a refused commit raised CheckpointError on its thread: raised here)
        return None

    def _report(self, step: int, cause: int, reason: str) -> None:
        failed = store_pb2.SnapshotFailed(
            job_id=self._job, operation="save", reason=" ".join(reason.split())[:400], cause=cause, step=step,
            rank=self._rank,
            failure=route_pb2.Failure(
                cause=_FAILURE_OF.get(cause, route_pb2.FAILURE_INTERNAL), detail=reason[:400],
                operation="surge.v1.SaveCheckpoint", module=Module.L5_CHECKPOINT_MANAGER, job_id=self._job,
                rank=self._rank,
            ),
        )  # fmt: skip
        self._send_up(failed, Module.L5_CHECKPOINT_MANAGER)


def _durable(path: Path, data: bytes) -> None:
    """Temp name, fsync, rename: a reader never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
