"""The chunk store under sharded state (FSDP2 over two gloo ranks): DCP's planners reshard
through it as through its own FileSystemWriter/Reader.

* dp 2 (FSDP2, each rank writing its row shards as chunks) -> one process: the full
  weights and AdamW moments, bit-identical to what the ranks gathered.
* one process -> dp 2 (FSDP2): each rank reads only the chunks that cover its rows.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

from services.compute.model import build_model
from services.jobspec import ModelSpec
from services.state.chunk_reader import ChunkReader
from services.state.chunk_store import ChunkWriter, DirectorySource, iter_chunk_files
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SPEC = ModelSpec(n_layers=2, d_model=64, n_heads=2)
CHUNK = 2048  # several chunks per weight: a shard's rows are a part of them


def _sharded(rank: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = build_model(SPEC, 0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ranks(rank: int, port: int, root: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    root_p = Path(root)
    # dp 2 -> files: one AdamW step on FSDP2, then a save of the sharded state.
    model = _sharded(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(x).float().pow(2).mean().backward()
    opt.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, storage_writer=ChunkWriter(root_p / "dp2", root_p / "chunks", chunk_bytes=CHUNK))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gathered = {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, opt, options=full),
    }
    if rank == 0:
        torch.save(gathered, root_p / "gathered.pt")
    # files -> dp 2: the single process's save, read shard by shard.
    fresh = _sharded(rank)
    into = {"model": get_model_state_dict(fresh)}
    reader = ChunkReader(root_p / "dp1", [DirectorySource(root_p / "chunks1")])
    dcp.load(into, storage_reader=reader)
    set_model_state_dict(fresh, into["model"])
    torch.save(
        {  # (every rank gathers the full weights: cpu_offload would give them to rank 0 only)
            "model": get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True)),
            "served": sum(reader.served.values()),
        },
        root_p / f"loaded{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def test_dcp_reshards_through_the_chunk_store_fsdp2_dp2_to_one_process_and_back(tmp_path):
    warnings.simplefilter("ignore")
    # The single process's version, read by the ranks (another seed: not what they start from).
    single = build_model(SPEC, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"model": single.state_dict()},
            storage_writer=ChunkWriter(tmp_path / "dp1", tmp_path / "chunks1", chunk_bytes=CHUNK, sync_files=False),
            no_dist=True,
        )
    env = {"OMP_NUM_THREADS": "1"}
    os.environ.update(env)
    mp.spawn(_ranks, args=(free_port(), str(tmp_path)), nprocs=2, join=True)

    # dp 2 -> one process: every weight and moment, as the ranks gathered them.
    gathered = _flat(torch.load(tmp_path / "gathered.pt", weights_only=True))
    into = {
        "model": {k.removeprefix("model."): torch.zeros_like(v) for k, v in gathered.items() if k.startswith("model.")},
        "optim": {
            "state": {
                k.removeprefix("optim.state.").rsplit(".", 1)[0]: {} for k in gathered if k.startswith("optim.state.")
            }
        },
    }
    for k, v in gathered.items():
        if k.startswith("optim.state."):
            fqn, field = k.removeprefix("optim.state.").rsplit(".", 1)
            into["optim"]["state"][fqn][field] = torch.zeros_like(v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            into, storage_reader=ChunkReader(tmp_path / "dp2", [DirectorySource(tmp_path / "chunks")]), no_dist=True
        )
    loaded = _flat(into)
    assert [k for k, v in loaded.items() if k in gathered and not torch.equal(v, gathered[k])] == []
    assert sum(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in loaded) == len(
        list(single.parameters())
    )

    # One process -> dp 2: each rank holds the single process's weights, having read a part.
    want = single.state_dict()
    total = len(list(iter_chunk_files(tmp_path / "chunks1")))
    for r in (0, 1):
        got = torch.load(tmp_path / f"loaded{r}.pt", weights_only=True)
        assert all(torch.equal(got["model"][k], want[k]) for k in want), r
        assert got["served"] < total  # its rows' chunks, not every chunk
