"""The simulated rank's train stream: ``DataService.Mount`` then ``DataService.Stream``.

What the real rank's loop asks (services/engine/training_loop/startup.py ``_initialise`` and
data_stream.py ``_open_stream``: the same MountDataset and OpenStream, built from the job spec's ``data:``
section and the rank's data-parallel coordinates), read the way its relay reads it
(services/rank/data_client.py, which imports torch for the decoding): a background thread
takes the micro-batches off the stream into a bounded queue (the loop's read-ahead, so a
full queue stops the reading and gRPC's flow control holds the service back). The batches
are checked (``4 x batch_size x seq_len`` bytes of token ids) and not decoded: nothing
computes on them.

Measured here, for the test bed: the stream's start latency (OpenStream to its first
micro-batch) and, per micro-batch taken, how long the rank waited for it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from services.common.grpc_server import channel
from services.contract import Module, data_pb2, data_pb2_grpc

MOUNT_TIMEOUT_S = 120.0  # as the real relay's (data_client.py)
_END = object()


class DataUnavailable(RuntimeError):
    """The dataset could not be mounted or the stream failed or ended (one line)."""

    fault_class = "data_unavailable"


class TrainStream:
    """Mount the job's dataset and open its train stream for data-parallel rank
    ``dp_rank`` of ``dp_size`` (``data``: the spec's ``data:`` section, as JSON).
    ``on_start(seconds)`` is called from the reading thread when the first micro-batch came.

    Raises:
        DataUnavailable: the mount failed (the service's one-line reason).
    """

    def __init__(
        self,
        address: str,
        data: dict[str, Any],
        dp_rank: int,
        dp_size: int,
        read_ahead: int,
        on_start: Callable[[float], None] = lambda seconds: None,
    ):
        self._address, self._on_start = address, on_start
        self._channel = channel(address, module=Module.L2_TRAINING_LOOP)  # the loop's commands, as the relay sends them
        stub = data_pb2_grpc.DataServiceStub(self._channel)
        name, version = data["dataset"].split("@", 1)
        mount = data_pb2.MountDataset(name=name, version=version, verify=False)
        try:
            stub.Mount(mount, timeout=MOUNT_TIMEOUT_S)
        except grpc.RpcError as e:
            raise DataUnavailable(f"data service at {address}: Mount: {e.code().name}: {e.details()}") from None
        pack = data.get("pack", "pack") == "pack"
        prefetch, rules = data.get("prefetch", {}), data.get("filter", {})
        msg = data_pb2.OpenStream(
            mount=mount,
            prefetch=data_pb2.SetPrefetch(watermark=prefetch.get("watermark", 256), threads=prefetch.get("threads", 2)),
            shuffle=data_pb2.ShufflePlan(
                seed=data.get("shuffle_seed", 1234), epoch=0, enabled=data.get("shuffle", True)
            ),
            filter=data_pb2.FilterRules(
                min_tokens=rules.get("min_tokens", 1),
                max_tokens=rules.get("max_tokens", 0),
                banned_bytes=rules.get("banned_bytes", "").encode("utf-8"),
                banned_tokens=rules.get("banned_tokens", []),
            ),
            packer=data_pb2.PackerConfig(
                seq_len=data["seq_len"],
                micro_batch_size=data["micro_batch_size"],
                pad_id=data.get("pad_id", 0),
                mode=data_pb2.PACK if pack else data_pb2.PAD,
                separator_id=0 if pack else -1,
                rank=dp_rank,
                world_size=dp_size,
            ),
            split="train",
            start=data_pb2.DataPosition(),  # a fresh start (simulated ranks never resume)
            repeat=True,
            max_batches=0,
        )
        self._batches: queue.Queue = queue.Queue(maxsize=read_ahead)
        self.start_s: float | None = None  # OpenStream -> first micro-batch, seconds
        self._t_open = time.perf_counter()
        self._call = stub.Stream(msg)  # no deadline: a training stream lives as long as the job
        self._closing = False
        threading.Thread(target=self._pump, name="data-train", daemon=True).start()

    def next(self, timeout_s: float) -> tuple[data_pb2.MicroBatch, float]:
        """The next micro-batch and the seconds waited for it.

        Raises:
            DataUnavailable: the stream failed or ended, or nothing came within ``timeout_s``.
        """
        t0 = time.perf_counter()
        try:
            item = self._batches.get(timeout=timeout_s)
        except queue.Empty:
            raise DataUnavailable(
                f"data service at {self._address}: no micro-batch within {timeout_s:g} s"
                + ("" if self.start_s is not None else " (the stream never started)")
            ) from None
        if isinstance(item, DataUnavailable):
            raise item
        return item, time.perf_counter() - t0

    def close(self) -> None:
        self._closing = True
        self._call.cancel()
        self._channel.close()

    def _pump(self) -> None:
        try:
            for mb in self._call:
                if self.start_s is None:
                    self.start_s = time.perf_counter() - self._t_open
                    self._on_start(self.start_s)
                if len(mb.input_ids) != 4 * mb.batch_size * mb.seq_len:
                    raise DataUnavailable(
                        f"malformed micro-batch: {len(mb.input_ids)} bytes for [{mb.batch_size}, {mb.seq_len}] int32"
                    )
                mb.ClearField("input_ids")  # consumed: nothing computes on them
                mb.ClearField("labels")
                self._batches.put(mb)
            self._batches.put(DataUnavailable("the training stream ended although it repeats epochs"))
        except grpc.RpcError as e:
            if not self._closing:
                self._batches.put(
                    DataUnavailable(f"data service at {self._address}: Stream: {e.code().name}: {e.details()}")
                )
        except DataUnavailable as e:
            self._batches.put(e)
