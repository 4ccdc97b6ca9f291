"""Read back what the metrics logger's sinks wrote (tests only): TensorBoard event files and
an offline W&B run's history."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under ``logdir`` (all its event files), by tag: (step, value) in order.
    ``tensorboard --logdir`` reads the same files; the acceptance test reads the loss so."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    return {
        tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }


def wandb_history(run_root: Path) -> list[dict]:
    """The history rows of the one offline run under ``run_root``, read from its ``.wandb``
    file with wandb's own record schema (wandb 0.31 ships no Python reader of the file: its
    framing is LevelDB's log format, 32 KiB blocks of CRC-length-type records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_root.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, rows = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer: zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def tensorboard_points(logdir: Path, tag: str, n: int, timeout: float = 15.0) -> list[tuple[int, float]]:
    """``tag``'s points under ``logdir`` once there are ``n`` of them (the store writes its
    sinks on a thread of their own, after it acknowledged the records); what is there after
    ``timeout`` seconds otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        points = tensorboard_scalars(logdir).get(tag, []) if logdir.is_dir() else []
        if len(points) >= n or time.monotonic() > deadline:
            return points
        time.sleep(0.1)
