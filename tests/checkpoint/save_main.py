"""A rank's checkpoint writer alone: ``python save_main.py STORE JOB STEP MIB``.

Saves {"model": {"w": float32 tensor of MIB MiB}, "train": {"step": STEP}} through the
rank's real checkpoint relay (StoreClient: BeginSave, dcp.async_save, CommitSave after the
write, flush) and prints ``saving``, ``staged``, ``committed VERSION`` as it goes, so a test
can kill it at any moment of the save. The tensor is a pure function of STEP.
"""

import sys

import torch

from services.contract import store_pb2
from services.worker.store_client import StoreClient


def state_for(step: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(mib * 262144, generator=g)}, "train": {"step": torch.tensor(step)}}


def main() -> None:
    address, job, step, mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client = StoreClient(address, lambda msg, payload=None: 1)
    state = state_for(step, mib)
    print("saving", flush=True)
    client.save_checkpoint(store_pb2.SaveCheckpoint(job_id=job, step=step, rank=0, write_async=True), state)
    print("staged", flush=True)
    client.commit_checkpoint(store_pb2.CommitCheckpoint(job_id=job, step=step, world_size=1, spec_json="{}"))
    client.flush_checkpoint(store_pb2.FlushCheckpoint(job_id=job))
    print("committed", flush=True)
    client.close(timeout=2)


if __name__ == "__main__":
    main()
