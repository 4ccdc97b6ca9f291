"""A rank's checkpoint writer alone: ``python save_main.py STORE JOB STEP MIB [EVERY FROZEN_MIB [DIE_AFTER]]``.

Saves {"model": {"w": float32 tensor of MIB MiB}, "train": {"step": STEP}} through the
rank's real checkpoint relay (StoreClient: BeginSave, dcp.save from its thread, CommitSave after the
write, flush) and prints ``saving``, ``staged``, ``committed VERSION`` as it goes, so a test
can kill it at any moment of the save. The tensor is a pure function of STEP. With
FROZEN_MIB, the model also holds "frozen", the same FROZEN_MIB MiB at every step (what an
incremental save never writes again); EVERY is SaveCheckpoint.baseline_every. With
DIE_AFTER, the writer SIGKILLs itself once that many chunks of its save are on disk (in the
middle of the write, before the index and the commit).
"""

import os
import signal
import sys

import torch

from services.contract import store_pb2
from services.rank.store_client import StoreClient


def state_for(step: int, mib: int, frozen_mib: int = 0) -> dict:
    g = torch.Generator().manual_seed(step)
    state = {"model": {"w": torch.randn(mib * 262144, generator=g)}, "train": {"step": torch.tensor(step)}}
    if frozen_mib:
        state["model"]["frozen"] = torch.randn(frozen_mib * 262144, generator=torch.Generator().manual_seed(99_999))
    return state


def main() -> None:
    address, job, step, mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    every, frozen_mib = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (0, 0)
    die_after = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    client = StoreClient(address, lambda msg, payload=None: 1, copies=_Dies(die_after) if die_after else None)
    state = state_for(step, mib, frozen_mib)
    print("saving", flush=True)
    ask = store_pb2.SaveCheckpoint(job_id=job, step=step, rank=0, write_async=True, baseline_every=every)
    client.save_checkpoint(ask, state)
    print("staged", flush=True)
    client.commit_checkpoint(store_pb2.CommitCheckpoint(job_id=job, step=step, world_size=1, spec_json="{}"))
    client.flush_checkpoint(store_pb2.FlushCheckpoint(job_id=job))
    print("committed", flush=True)
    client.close(timeout=2)


class _Dies:
    """Stands in for the memory copies: its sink (called once per chunk on disk) kills the
    process at the ``n``-th chunk."""

    def __init__(self, n: int):
        self.n = n

    def begin(self, step: int, expected_bytes: int = 0):
        def sink(sha: str, data) -> None:
            self.n -= 1
            if self.n <= 0:
                os.kill(os.getpid(), signal.SIGKILL)

        return sink

    def end(self, ok: bool) -> None:
        pass

    def sources(self) -> list:
        return []


if __name__ == "__main__":
    main()
