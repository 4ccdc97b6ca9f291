"""Meeting points per training step: collectives by op and by module, bus messages by
route, and the cross-process (gRPC) messages they become, for DP, FSDP2, TP and PP.

    .venv/bin/python bench/step_meetings.py [--label before|after] [--configs ddp_dp2,tp2] [--steps 8]

Each config runs Surge's real rank wiring (``services.rank.__main__.compose``, the
tests/parallel harness: one OS process per rank over gloo, in-process relays standing in for
the services) under ``torch.profiler``. What is counted, per steady step (steps 3.. of the
run, rank 0, and for PP the first and last stage):

* collectives: every ``c10d::*`` operator the profiler records (what a gloo or NCCL process
  group is asked to do: DDP's bucket all-reduces, FSDP2's all-gathers and reduce-scatters,
  DTensor redistributions, pipeline send/recv, the loop's small all-reduces), by op and by
  the module on whose behalf it ran: the bench wraps the bus's ``acting(module)`` (set
  around every handler) in a ``record_function``, so a collective is charged to the
  innermost module handler it ran in. A collective issued by L2-4 (the precision manager)
  is a red-line crossing (seed L2-4 red line 4: it may not communicate).
* bus messages: the bus's Traffic ledger (every delivery, per route) over the same steps.
* relay (gRPC) messages: the bus deliveries to a relay receiver, each of which is one
  message on its stream in a real rank (L1_ORCHESTRATOR: RankEvent to the node agent, which
  forwards it as one WorkerEvent to control; L5_METRICS_LOGGER: MetricRecord to the store,
  answered by one MetricsAck; MicroBatch from the data service: one message each).

Writes ``bench/results/step_meetings_<label>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CONFIGS = {
    "ddp_dp2": {"dp": 2},
    "ddp_dp2_accum2": {"dp": 2, "grad_accum": 2},
    "fsdp2_dp2": {"dp": 2, "data_parallel": "fsdp2"},
    "tp2": {"tp": 2},
    "fsdp2_dp2_x_tp2": {"dp": 2, "tp": 2, "data_parallel": "fsdp2"},
    "pp2_1f1b": {"pp": 2, "pipeline_schedule": "1f1b", "microbatches": 4, "model": {"tie_embeddings": False}},
}
WARM = 2  # steps not counted (first-step allocations, DDP's bucket rebuild after step 1)
# A relay receiver inside the rank -> (what one delivery becomes on the wire, messages).
RELAYED = {
    "L1_ORCHESTRATOR": ("RankEvent rank->agent + WorkerEvent agent->control", 2),
    "L5_METRICS_LOGGER": ("MetricRecord rank->store + MetricsAck store->rank", 2),
}


def rank_main(argv: list[str]) -> None:
    """One rank: CONFIG_JSON RANK WORLD PORT OUT (tests/parallel/harness.py's Rank)."""
    config, rank, world, port, out = json.loads(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "parallel"), str(REPO / "tests" / "engine")]
    import torch
    from harness import Rank, parity_spec
    from torch.profiler import ProfilerActivity, profile, record_function

    import services.contract.bus as bus_mod
    import services.engine.training_loop as tl
    from services.contract.bus import TRAFFIC
    from services.contract.route_table import module_name

    torch.set_num_threads(1)
    plain_acting = bus_mod.acting

    @contextlib.contextmanager
    def acting_recorded(module: int):
        with record_function(f"surge.module.{module_name(module)}"), plain_acting(module):
            yield

    bus_mod.acting = acting_recorded  # the bus calls acting(receiver) around every handler
    import services.compute.gradient_reduction as l3_5

    l3_5.acting = acting_recorded  # and L3-5 around its Partial-gradient settle (inside backward)
    ledger: dict[int, dict] = {}
    plain_step = tl.TrainingLoop._run_step

    def run_step(self, step: int) -> None:
        before = TRAFFIC.snapshot().sent
        with record_function(f"surge.step.{step}"):
            plain_step(self, step)
        after = TRAFFIC.snapshot().sent
        ledger[step] = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}

    tl.TrainingLoop._run_step = run_step
    spec = parity_spec(**config)
    r = Rank(spec, out / "ckpt", rank=rank, world_size=world, port=port)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        r.run()
    steps = sorted(ledger)
    counted = [s for s in steps if s > WARM]
    collectives: Counter = Counter()
    for e in prof.events():
        if not e.name.startswith("c10d::"):
            continue
        module, step, p = "(no module)", None, e.cpu_parent
        while p is not None:
            if p.name.startswith("surge.module.") and module == "(no module)":
                module = p.name.removeprefix("surge.module.")
            if p.name.startswith("surge.step."):
                step = int(p.name.removeprefix("surge.step."))
            p = p.cpu_parent
        if step in counted:
            collectives[(e.name.removeprefix("c10d::"), module)] += 1
    bus: Counter = Counter()
    for s in counted:
        for (sender, message, receiver), n in ledger[s].items():
            bus[(module_name(sender), message.rsplit(".", 1)[-1], module_name(receiver))] += n
    # MicroBatch is published on the data relay's own thread, ahead of the step that uses it
    # (read-ahead), so the window catches it at random: count the one per micro-step exactly.
    for key in [k for k in bus if k[1] == "MicroBatch"]:
        del bus[key]
    bus[("L4_BATCH_PACKER", "MicroBatch", "L2_TRAINING_LOOP")] = spec.data.grad_accum * len(counted)
    n = len(counted)
    result = {
        "rank": rank, "steps_counted": n,
        "collectives_per_step": {f"{op} @ {mod}": c / n for (op, mod), c in sorted(collectives.items())},
        "bus_per_step": {f"{s} -> {m} -> {rcv}": c / n for (s, m, rcv), c in sorted(bus.items())},
        "micro_batches_per_step": spec.data.grad_accum,
    }  # fmt: skip
    r.modules.parallel.shutdown()
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def run_config(name: str, config: dict, steps: int, timeout: float = 300.0) -> list[dict]:
    sys.path.insert(0, str(REPO))
    from tests.conftest import free_ports

    cfg = {**config, "steps": steps}
    world = cfg.get("dp", 1) * cfg.get("tp", 1) * cfg.get("pp", 1)
    out = Path(tempfile.mkdtemp(prefix=f"meetings-{name}-"))
    (port,) = free_ports(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", json.dumps(cfg), str(r), str(world), str(port), str(out)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: exit codes {[p.returncode for p in procs]}\n" + "\n".join(x[-2000:] for x in logs))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def summarise(ranks: list[dict]) -> dict:
    """Rank 0's counts (and the last rank's, which differ under PP), with totals."""
    out = {}
    for res in (ranks[0], ranks[-1]) if len(ranks) > 1 and ranks[-1] != ranks[0] else (ranks[0],):
        coll = res["collectives_per_step"]
        small = {k: v for k, v in coll.items() if "GRADIENT_REDUCTION" in k and "BACKWARD" not in k}
        relay = {}
        for route, c in res["bus_per_step"].items():
            receiver = route.rsplit(" -> ", 1)[-1]
            if receiver in RELAYED:
                relay[f"{route} ({RELAYED[receiver][0]})"] = c * RELAYED[receiver][1]
        relay["MicroBatch data->rank (one stream message each)"] = res["micro_batches_per_step"]
        out[f"rank{res['rank']}"] = {
            "collectives_total": sum(coll.values()),
            "collectives_outside_backward_forward": sum(
                v for k, v in coll.items() if not any(m in k for m in ("L3_BACKWARD_UNIT", "L3_FORWARD_UNIT"))),
            "collectives_by_module": _by_module(coll),
            "collectives": coll,
            "small_collectives_L3_5": small,
            "bus_messages_total": sum(res["bus_per_step"].values()),
            "bus": res["bus_per_step"],
            "relay_messages_total": sum(relay.values()),
            "relay": relay,
        }  # fmt: skip
    return out


def _by_module(coll: dict) -> dict:
    per: Counter = Counter()
    for k, v in coll.items():
        per[k.split(" @ ", 1)[1]] += v
    return dict(sorted(per.items()))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2:])
        sys.stdout.flush()
        os._exit(0)  # no interpreter finalization under gloo's threads (services/common/process_exit.py)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="now", help="results file suffix (before / after)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    results = {"label": args.label, "steps": args.steps, "warm_steps_not_counted": WARM,
               "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "configs": {}}  # fmt: skip
    try:
        results["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True).stdout.strip()  # fmt: skip
    except OSError:
        pass
    for name in args.configs.split(","):
        t0 = time.time()
        try:
            results["configs"][name] = {
                "parallel": CONFIGS[name],
                **summarise(run_config(name, CONFIGS[name], args.steps)),
            }
        except Exception as e:  # one config failing must not lose the others
            results["configs"][name] = {"parallel": CONFIGS[name], "error": str(e)[-3000:]}
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"step_meetings_{args.label}.json"
    path.write_text(json.dumps(results, indent=1))
    print(render(results))
    print(path.relative_to(REPO))


def render(results: dict) -> str:
    lines = ["| config | rank | collectives / step (outside fwd/bwd) | by module | bus messages / step | relay messages / step |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, res in results["configs"].items():
        if "error" in res:
            lines.append(f"| {name} | | error: {res['error'].splitlines()[-1][:80]} | | | |")
            continue
        for rank, r in res.items():
            if not rank.startswith("rank"):
                continue
            mods = ", ".join(f"{m} {v:g}" for m, v in r["collectives_by_module"].items())
            lines.append(f"| {name} | {rank} | {r['collectives_total']:g} ({r['collectives_outside_backward_forward']:g}) | "
                         f"{mods} | {r['bus_messages_total']:g} | {r['relay_messages_total']:g} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
