"""One rank of the pipeline tests: ``python pipeline_rank_main.py RANK WORLD PORT OUT CONFIG_JSON``.

Builds the (pp, dp) device mesh (pp outermost, as the planner's ("pp", "dp", "tp") axes),
checks the schedule, runs ``steps`` optimizer steps of the small test model on the
deterministic global batches of ``pipeline_common``, and writes what the test compares to
``OUT/rank<R>.pt``: per-step global losses (last stage), step wall times, this stage's
final weights, and the p2p/compute actions torch actually issued in the first step.
Optionally saves (DCP) after step ``save_at`` and/or starts from a DCP checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.pipelining.schedules as torch_schedules
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_common import ROWS, SEED, SEQ, SPEC, global_batch, layer_ranges, make_optimizer  # noqa: E402

from services.common.process_exit import exit_now  # noqa: E402
from services.compute.model import build_model  # noqa: E402
from services.compute.pipeline_stage import PipelineRunner, StageModule  # noqa: E402
from services.engine.schedule_check import Action, check_pipeline  # noqa: E402

# Optimizer state keyed by parameter FQN (as torchtitan does): with PP each rank holds other
# parameters, and the nested default layout ("param_groups.0.params") would collide across
# ranks in the checkpoint (DCP keeps one rank's copy of a duplicated key).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def record_actions(runner: PipelineRunner, trace: list) -> None:
    """Log, in order, every compute call and every p2p batch torch issues for this stage."""
    stage, tags = runner.stage, {}
    for name, kind in (
        ("get_fwd_recv_ops", "RECV_F"),
        ("get_fwd_send_ops", "SEND_F"),
        ("get_bwd_recv_ops", "RECV_B"),
        ("get_bwd_send_ops", "SEND_B"),
    ):

        def wrapped(i, _orig=getattr(stage, name), _kind=kind):  # noqa: B008 (binds this iteration's method)
            ops = _orig(i)
            for op in ops:
                tags[id(op)] = Action(_kind, stage.stage_index, i)
            return ops

        setattr(stage, name, wrapped)
    for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):

        def wrapped(i, *a, _orig=getattr(stage, name), _kind=kind, **k):  # noqa: B008 (binds this iteration's method)
            trace.append(Action(_kind, stage.stage_index, i))
            return _orig(i, *a, **k)

        setattr(stage, name, wrapped)
    batch = torch_schedules._batch_p2p

    def traced_batch(ops, desc=None):
        if ops:
            acts = tuple(tags[id(op)] for op in ops)
            trace.append(acts[0] if len(acts) == 1 else acts)
        return batch(ops, desc)

    torch_schedules._batch_p2p = traced_batch


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    cfg = json.loads(sys.argv[5])
    pp, dp, schedule, n_mb = cfg["pp"], cfg["dp"], cfg["schedule"], cfg["microbatches"]
    accum = cfg.get("grad_accum", 1)
    torch.set_num_threads(1)
    torch.manual_seed(1234 + rank)  # nothing may depend on it: init and data are seeded explicitly
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    dp_group = mesh["dp"].get_group()

    check_pipeline(schedule, pp, n_mb)  # the engine's deadlock check, before any stage exists
    model = build_model(SPEC, seed=SEED)
    stage = StageModule(model, layer_ranges(pp, dp)[pp_rank], stage_index=pp_rank, num_stages=pp)
    stage.group = mesh["pp"].get_group()
    del model  # the stage shares the modules it keeps; the rest goes
    run_module = stage
    if dp > 1 and cfg.get("data_parallel") == "ddp":
        run_module = DistributedDataParallel(stage, process_group=dp_group)
    elif dp > 1:  # fsdp2, torchtitan's layout: every block, then the root
        for block in stage.blocks:
            fully_shard(block, mesh=mesh["dp"])
        run_module = fully_shard(stage, mesh=mesh["dp"])
    runner = PipelineRunner(
        stage,
        schedule=schedule,
        microbatches=n_mb,
        run_module=run_module,
        microbatch_shape=(ROWS // dp // accum // n_mb, SEQ),
    )
    optim = make_optimizer(runner.module)
    trace: list = []
    record_actions(runner, trace)

    start = 0
    if cfg.get("load_from"):
        state = {
            "model": get_model_state_dict(runner.module),
            "optim": get_optimizer_state_dict(runner.module, optim, options=FLAT),
            "step": torch.tensor(0),
        }
        dcp.load(state, checkpoint_id=cfg["load_from"])
        set_model_state_dict(runner.module, state["model"])
        set_optimizer_state_dict(runner.module, optim, state["optim"], options=FLAT)
        start = int(state["step"])

    losses, times, traces, evals = [], [], [], []
    for step in range(start + 1, cfg["steps"] + 1):
        ids_BT, labels_BT = global_batch(step)
        rows = ids_BT.shape[0] // dp
        ids_BT, labels_BT = (
            ids_BT[dp_rank * rows : (dp_rank + 1) * rows],
            labels_BT[dp_rank * rows : (dp_rank + 1) * rows],
        )
        t0 = time.perf_counter()
        tokens = torch.tensor([float((labels_BT != -100).sum())], dtype=torch.float64)
        dist.all_reduce(tokens, group=dp_group)  # global non-padding tokens of the step
        trace.clear()
        # DDP/FSDP average gradients over dp: normalise by tokens / dp so the result is the
        # sum. With accumulation, each micro-step runs the pipeline on its share of the rows.
        ce_sum, rows = 0.0, ids_BT.shape[0] // accum
        for i in range(accum):
            part = slice(i * rows, (i + 1) * rows)
            ce_sum += (
                runner.forward_backward(ids_BT[part], labels_BT[part], normalizer=float(tokens) / dp, zero_grad=i == 0)
                or 0.0
            )
        optim.step()
        stats = torch.tensor([ce_sum], dtype=torch.float64)
        dist.all_reduce(stats)  # only the last stage's dp replicas contribute
        times.append(time.perf_counter() - t0)
        losses.append(float(stats) / float(tokens))
        traces.append([tuple(map(str, a)) if isinstance(a, tuple) else str(a) for a in trace])
        if cfg.get("eval_every") and step % cfg["eval_every"] == 0:  # eval between training steps
            evals.append(runner.forward_only(*global_batch(1000)))
        if cfg.get("save_at") == step:
            state = {
                "model": get_model_state_dict(runner.module),
                "optim": get_optimizer_state_dict(runner.module, optim, options=FLAT),
                "step": torch.tensor(step),
            }
            dcp.save(state, checkpoint_id=cfg["save_dir"])
    val = runner.forward_only(*global_batch(1000)) if dp == accum == 1 else None
    torch.save(
        {
            "losses": losses,
            "times": times,
            "trace": traces[0] if traces else [],
            "val_ce_sum": val,
            "evals": evals,
            "state": {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                for k, v in runner.module.state_dict().items()
            },
            "pp_rank": pp_rank,
            "dp_rank": dp_rank,
        },
        out / f"rank{rank}.pt",
    )
    dist.destroy_process_group()
    exit_now(0)  # no interpreter finalization under gloo's threads (see exit_now)


if __name__ == "__main__":
    main()
