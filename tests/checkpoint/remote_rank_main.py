"""One rank of a save or load without a shared filesystem, through the rank's real relay.

    python remote_rank_main.py STORE JOB - MIB RANK WORLD MASTER_PORT ACTIONS FORBIDDEN [DIE]

Every rank joins a gloo group of WORLD ranks and runs ACTIONS in order, e.g.
``save:1,load:1,save:2`` (one launch: the rank processes start once). ``save:S``: each rank saves
{"model": {"w<rank>": MIB MiB, "shared": 1 MiB}, "train": {"step": STEP}} (a pure function
of STEP and the rank) with StoreClient (BeginSave, DCP from the relay's thread, rank 0's
CommitSave after the write, flush) and prints ``committed`` (rank 0) or ``written``, or
``save failed`` (and stops) when its write or commit failed.
``load:S``: reads the job's latest version back into zeros and prints ``loaded ok VERSION``
when it is step S's and every tensor is bit-exact, else ``load failed`` with the typed error.

FORBIDDEN is the store's root: an audit hook refuses (and counts) every file operation of
this process on a path under it, so the rank provably never opens, lists, creates, renames
or removes anything there; the count is printed as ``forbidden N`` at the end. With
DIE (``STEP:N``), the rank SIGKILLs itself once N chunks of its save of STEP were handed to
the transfer (mid-stream, before the index and the commit).
"""

import os
import signal
import sys

FORBIDDEN = os.path.realpath(sys.argv[9])
_touched: list[str] = []
_WATCHED = {
    "open",
    "os.listdir",
    "os.scandir",
    "os.mkdir",
    "os.rename",
    "os.replace",
    "os.remove",
    "os.rmdir",
    "os.unlink",
    "shutil.rmtree",
    "os.chmod",
    "os.truncate",
}


def _hook(event: str, args: tuple) -> None:
    if event not in _WATCHED or not args:
        return
    for arg in args[:2]:
        if isinstance(arg, (str, bytes, os.PathLike)):
            try:
                path = os.fsdecode(arg)
            except TypeError:
                continue
            full = os.path.realpath(path) if path else path
            if full == FORBIDDEN or full.startswith(FORBIDDEN + os.sep):
                _touched.append(f"{event} {path}")
                raise PermissionError(f"rank touched the store's root: {event} {path}")


sys.addaudithook(_hook)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from services.contract import store_pb2  # noqa: E402
from services.rank.store_client import StoreClient  # noqa: E402


def state_for(step: int, rank: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return {
        "model": {f"w{rank}": torch.randn(mib * 262144, generator=g), "shared": torch.arange(262144.0) + step},
        "train": {"step": torch.tensor(step)},
    }


class _Dies:
    """Stands in for the memory copies: its sink (called once per chunk handed to the
    transfer) kills the process at the ``n``-th chunk of the save of ``step``."""

    def __init__(self, step: int, n: int):
        self.step, self.n = step, n

    def begin(self, step: int, expected_bytes: int = 0):
        left = [self.n]

        def sink(sha: str, data) -> None:
            left[0] -= 1
            if step == self.step and left[0] <= 0:
                os.kill(os.getpid(), signal.SIGKILL)

        return sink

    def end(self, ok: bool) -> None:
        pass

    def sources(self) -> list:
        return []


def main() -> None:
    address, job, mib = sys.argv[1], sys.argv[2], int(sys.argv[4])
    rank, world, port, actions = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
    die_step, die_after = (int(x) for x in sys.argv[10].split(":")) if len(sys.argv) > 10 else (0, 0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    events: list = []
    client = StoreClient(
        address, lambda msg, payload=None: events.append(msg), copies=_Dies(die_step, die_after) if die_after else None
    )
    broken = False
    try:
        for action in actions.split(","):
            mode, step = action.split(":")[0], int(action.split(":")[1])
            if mode == "save":
                events.clear()
                ask = store_pb2.SaveCheckpoint(job_id=job, step=step, rank=rank, write_async=True)
                try:
                    staged = client.save_checkpoint(ask, state_for(step, rank, mib))
                    print(f"staged transfer={store_pb2.TransferMode.Name(staged.transfer)}", flush=True)
                    if rank == 0:
                        commit = store_pb2.CommitCheckpoint(job_id=job, step=step, world_size=world, spec_json="{}")
                        client.commit_checkpoint(commit)
                    client.flush_checkpoint(store_pb2.FlushCheckpoint(job_id=job))
                except Exception as e:  # noqa: BLE001 - a peer killed mid-save: the test reads this line
                    print(f"save failed {type(e).__name__}", flush=True)
                    broken = True
                    return
                done = [e for e in events if isinstance(e, store_pb2.SaveCompleted)]
                print(f"committed {done[0].version}" if done else "written", flush=True)
                dist.barrier()  # rank 0's flush returned after its commit: every rank may load it now
            else:
                want = state_for(step, rank, mib)
                back = {
                    "model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
                    "train": {"step": torch.tensor(0)},
                }
                try:
                    info = client.load_checkpoint(store_pb2.LoadCheckpoint(version=f"{job}:latest"), back).info
                except Exception as e:  # noqa: BLE001 - the test reads the typed failure
                    print(f"load failed {type(e).__name__} cause={getattr(e, 'failure_cause', 0)}: {e}", flush=True)
                    return
                same = all(torch.equal(back["model"][k], want["model"][k]) for k in want["model"])
                same = same and int(back["train"]["step"]) == step == info.step
                print(f"loaded {'ok' if same else 'DIFFERENT'} {info.version}", flush=True)
    finally:
        print(f"forbidden {len(_touched)}", flush=True)
        for t in _touched[:5]:
            print(f"touched {t}", flush=True)
        client.close(timeout=2)
        if not broken:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
