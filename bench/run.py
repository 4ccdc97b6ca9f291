"""`make bench`: Surge against plain torchrun, its per-step overhead, the data path,
checkpoints, start-up and the control plane, on this machine. A benchmark, not a test.

    .venv/bin/python bench/run.py            # ~20 min on 2 cores
    BENCH_QUICK=1 .venv/bin/python bench/run.py   # ~3 min: fewer steps and repetitions

Writes ``bench/results/bench.json`` (every raw figure) and prints a markdown table. Each
comparison runs both sides in this one invocation, alternating (Surge, torchrun, Surge,
...), and reports the median and min-max over the repetitions, so drift in the machine's
load hits both sides alike. Sections (issue 7):

0. meetings: per-step collectives (by op and module) and bus / relay messages, now and
   before issue 13 part 9 (bench/step_meetings.py; DDP, FSDP2, TP, PP through the real rank
   wiring);
1. throughput: tokens/s of a Surge job (full stack: control, store, data, 2 node agents;
   DP=2 gloo) and of ``bench/torchrun_ddp.py`` (torchrun, 2 processes) on the same model,
   data, batch and optimizer (``bench/jobs/throughput.yaml``), over the steps after warm-up;
2. spans: where a Surge step's time goes, from the StepCompleted fields every rank sends
   (data wait, forward, backward, reduction, optimizer; the rest of ``step_seconds`` is the
   loop's own work: bus dispatch and message building) and the gap between steps (event
   emission to the node agent and the store); bus cost per send from bench/bus_dispatch.py;
3. data path: data wait as a fraction of step time; batches the data service packed per
   stream against batches consumed; a standalone client draining a stream (bench/data_drain.py);
4. checkpoints: bench/checkpoint_save.py (demo model, and a ~100 M-parameter one);
   incremental saves, full against baseline + deltas, dense and 90 % / 97 % frozen
   (bench/incremental_save.py; BENCH_ONLY=incremental);
   restore time from the in-memory copies against the store (bench/memory_restore.py; BENCH_ONLY=memory);
   resume of a dp 2 checkpoint at dp 1, 2 and 4 (bench/reshard_resume.py; BENCH_ONLY=reshard);
5. control plane: bench/control_scale.py (simulated node agents against a real control);
6. start-up: submit -> first completed step, against torchrun launch -> first step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402
from bench.rank_sched import RankSampler  # noqa: E402

SPEC = c.REPO / "bench" / "jobs" / "throughput.yaml"
STEPS, WARMUP, REPS = (60, 15, 2) if c.QUICK else (150, 20, 5)
PHASES = ("data_wait_seconds", "forward_seconds", "backward_seconds", "reduction_seconds", "optimizer_seconds")


def throughput(results: dict) -> None:
    """Sections 1, 2, 3 (data wait, packed vs consumed) and 6, alternating Surge/torchrun."""
    surge_tps, torch_tps, surge_start, torch_start = [], [], [], []
    spans: dict[str, list[float]] = {}
    packed_vs_consumed = []
    services_cpu: dict[str, list[float]] = {}
    sched: dict[str, dict[str, list[float]]] = {"surge": {}, "torchrun": {}}
    sampler = RankSampler(("services.rank", "bench/torchrun_ddp.py"), exclude=("--standalone",))
    sampler.start()
    with c.Stack(workers=2) as stack:
        for rep in range(REPS):
            spec = c.write_spec(SPEC, f"bench{rep}", steps=STEPS)
            # Surge: submit through surgectl's code path, wait for the end.
            cpu0 = {name: _cpu(p.pid) for name, p in stack.procs.items()}
            job, t_submit = c.submit(spec)
            status = c.wait_job(job, timeout_s=60 + STEPS * 3)
            wall_job = time.time() - t_submit
            for name, p in stack.procs.items():  # the services' CPU while the job ran
                key = "worker" if name.startswith("worker") else name
                services_cpu.setdefault(key, []).append(100 * (_cpu(p.pid) - cpu0[name]) / wall_job)
            recs = c.surge_steps(job)
            if len(recs) < 2 or any(len(v) < STEPS for v in recs.values()):
                raise RuntimeError(
                    f"Surge job {job} ended {status.outcome} with {[len(v) for v in recs.values()]} steps"
                )
            r0 = recs[0]
            surge_tps.append(c.steady_tokens_per_s(r0, WARMUP))
            surge_start.append(r0[0]["unix_time"] - t_submit)
            _add_sched(sched["surge"], sampler, r0)
            for rr in recs.values():
                steady = [r for r in rr if r["step"] > WARMUP]
                step_s = sum(r["step_seconds"] for r in steady)
                wall = steady[-1]["unix_time"] - next(r for r in rr if r["step"] == WARMUP)["unix_time"]
                for ph in PHASES:
                    spans.setdefault(f"{ph[:-8]}", []).append(sum(r.get(ph, 0.0) for r in steady) / wall)
                inside = sum(sum(r.get(ph, 0.0) for ph in PHASES) for r in steady)
                spans.setdefault("rest of step (grad-norm/inf check, unscale, bus)", []).append(
                    (step_s - inside) / wall
                )
                spans.setdefault("between steps (emit)", []).append((wall - step_s) / wall)
            packed_vs_consumed.append(_packed(stack.log("data"), job, STEPS))
            # torchrun, same spec, right after.
            run = c.torchrun(spec, steps=STEPS)
            torch_tps.append(c.steady_tokens_per_s(run.steps, WARMUP))
            torch_start.append(run.steps[0]["unix_time"] - run.t_launch)
            _add_sched(sched["torchrun"], sampler, run.steps)
            print(
                f"  rep {rep + 1}/{REPS}: Surge {surge_tps[-1]:,.0f} tok/s, torchrun {torch_tps[-1]:,.0f} tok/s, "
                f"start-up {surge_start[-1]:.1f} s / {torch_start[-1]:.1f} s",
                flush=True,
            )
    sampler.stop()
    ratios = [s / t for s, t in zip(surge_tps, torch_tps)]
    results["rank_time_per_step_ms"] = {side: {k: c.summary(v) for k, v in d.items()} for side, d in sched.items()}
    results["throughput"] = {
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "repetitions": REPS,
        "surge_tokens_per_s": c.summary(surge_tps),
        "torchrun_tokens_per_s": c.summary(torch_tps),
        "ratio": c.summary(ratios),
    }
    results["spans_fraction_of_wall"] = {k: c.summary(v) for k, v in spans.items()}
    results["startup_seconds"] = {
        "surge_submit_to_first_step": c.summary(surge_start),
        "torchrun_launch_to_first_step": c.summary(torch_start),
    }
    results["data_packed_vs_consumed"] = packed_vs_consumed
    # % of one core over submit..end; "worker" is each node agent (the ranks are its
    # children, not counted here).
    results["services_cpu_percent"] = {k: c.summary(v) for k, v in services_cpu.items()}


def _add_sched(into: dict[str, list[float]], sampler: RankSampler, records: list[dict]) -> None:
    """The ranks' per-step scheduler figures over the steady steps of one run."""
    recs = sorted(records, key=lambda r: r["step"])
    t0 = next(r for r in recs if r["step"] == WARMUP)["unix_time"]
    w = sampler.window(t0, recs[-1]["unix_time"], recs[-1]["step"] - WARMUP)
    for k, v in (w or {}).items():
        if k != "ranks":
            into.setdefault(k, []).append(v)


def _cpu(pid: int) -> float:
    """utime + stime of ``pid`` (seconds, /proc); 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _packed(log: Path, job: str, steps: int) -> dict:
    """Batches the data service sent per train stream (its "stream closed" log lines, the
    relay's own count) against the batches the ranks consumed (steps x grad_accum)."""
    sent = []
    for line in log.read_text(errors="replace").splitlines():
        if '"stream closed"' in line and '"train"' in line:
            try:
                sent.append(int(json.loads(line).get("batches", 0)))
            except json.JSONDecodeError:
                continue
    return {"job": job, "consumed_per_rank": steps, "sent_per_stream_last2": sent[-2:]}


def bus_cost(results: dict) -> None:
    out = subprocess.run([c.PY, "bench/bus_dispatch.py"], cwd=c.REPO, capture_output=True, text=True, timeout=600)
    per = {}
    for line in out.stdout.splitlines():
        m = re.match(r"(command, no reply|command \+ routed reply|publish to 2 receivers)\s+([\d.]+)", line)
        if m:
            per[m.group(1)] = float(m.group(2))
    # Sends per step of the training loop (training_loop._run_step, grad_accum 1; counted by
    # bench/step_meetings.py): commands with a routed reply: RunForward, RunBackward,
    # ReduceGradients, UnscaleAndCheck, ScaleLoss, ApplyUpdate (6), without: ArmReduction
    # (1, counted as one with a reply); events: StepCompleted (1 publish, 2 receivers),
    # MicroBatch (1 publish, on the data relay's thread).
    us = 7 * per.get("command + routed reply", float("nan")) + 2 * per.get("publish to 2 receivers", float("nan"))
    results["bus"] = {"us_per_send": per, "sends_per_step": 9, "us_per_step": us, "raw": out.stdout}


def meetings(results: dict) -> None:
    """Per-step collectives (by op and module) and bus / relay messages, now (this tree)
    against bench/results/step_meetings_before.json (the tree before issue 13 part 9):
    bench/step_meetings.py on the DDP configs the throughput job uses (dp=2, accumulation 1
    and 2), real rank wiring, gloo."""
    configs = "ddp_dp2,ddp_dp2_accum2,fsdp2_dp2,tp2,pp2_1f1b"
    out = subprocess.run([c.PY, "bench/step_meetings.py", "--label", "now", "--configs", configs], cwd=c.REPO,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-1500:])
    now = json.loads((c.RESULTS / "step_meetings_now.json").read_text())
    before_path = c.RESULTS / "step_meetings_before.json"
    before = json.loads(before_path.read_text()) if before_path.exists() else {"configs": {}}
    res = {}
    for name in configs.split(","):
        row = {}
        for label, data in (("before", before), ("now", now)):
            r0 = data["configs"].get(name, {}).get("rank0")
            if r0:
                row[label] = {
                    k: r0[k]
                    for k in (
                        "collectives_total",
                        "collectives_outside_backward_forward",
                        "collectives_by_module",
                        "bus_messages_total",
                        "relay_messages_total",
                    )
                }
        res[name] = row
    results["meetings_per_step"] = res


def data_drain(results: dict) -> None:
    secs = 8 if c.QUICK else 20
    out = subprocess.run(
        [c.PY, "bench/data_drain.py", "--seconds", str(secs)], cwd=c.REPO, capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        results["data_drain"] = {"error": out.stderr[-1500:]}
        return
    results["data_drain"] = json.loads(out.stdout.strip().splitlines()[-1])


def checkpoints(results: dict) -> None:
    res = {}
    runs = [("demo", ["--rounds", "3" if c.QUICK else "5"])]
    if not c.QUICK:
        runs.append(("100M", ["--rounds", "3", "--model", "100m"]))
    for name, args in runs:
        out = subprocess.run(
            [c.PY, "bench/checkpoint_save.py", *args, "--json"], cwd=c.REPO, capture_output=True, text=True, timeout=900
        )
        if out.returncode != 0:
            res[name] = {"error": out.stderr[-1500:]}
            continue
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
    results["checkpoints"] = res


def incremental(results: dict) -> None:
    """bench/incremental_save.py: bytes and seconds per save, full versions against a baseline
    then deltas, dense and with 90 % / 97 % of the parameters frozen."""
    models = ["demo"] if c.QUICK else ["demo", "100m"]
    out = subprocess.run(
        [c.PY, "bench/incremental_save.py", "--models", *models, "--saves", "4" if c.QUICK else "6", "--json"],
        cwd=c.REPO, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if out.returncode != 0:
        results["incremental_save"] = {"error": out.stderr[-1500:]}
        return
    results["incremental_save"] = json.loads(out.stdout.strip().splitlines()[-1])


def reshard(results: dict) -> None:
    """bench/reshard_resume.py: resume time of a dp 2 checkpoint at dp 1, 2 and 4."""
    models = ["demo"] if c.QUICK else ["demo", "100m"]
    out = subprocess.run(
        [c.PY, "bench/reshard_resume.py", "--models", *models],
        cwd=c.REPO, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if out.returncode != 0:
        results["reshard_resume"] = {"error": out.stderr[-1500:]}
        return
    results["reshard_resume"] = json.loads((c.RESULTS / "reshard_resume.json").read_text())["models"]


def memory_restore(results: dict) -> None:
    """bench/memory_restore.py: time to restored state from the node agents' memory copies
    (own node, peer) against from the store's files (page cache, cold)."""
    res = {}
    for model in ["demo"] if c.QUICK else ["demo", "100m"]:
        args = ["--model", model, "--rounds", "3" if c.QUICK or model == "100m" else "5", "--json"]
        out = subprocess.run(
            [c.PY, "bench/memory_restore.py", *args], cwd=c.REPO, capture_output=True, text=True, timeout=1200
        )
        if out.returncode != 0:
            res[model] = {"error": out.stderr[-1500:]}
            continue
        res[model] = json.loads(out.stdout.strip().splitlines()[-1])
    results["memory_restore"] = res


def control_scale(results: dict) -> None:
    # A sweep, to say where control saturates on this machine (the simulated agents share
    # its cores), then the 1,000 and 5,000.
    sizes = [250, 1000] if c.QUICK else [250, 500, 1000, 5000]
    secs, reg_timeout = (15, 20) if c.QUICK else (45, 60)
    res = {}
    for n in sizes:
        out = subprocess.run(
            [
                c.PY,
                "bench/control_scale.py",
                "--workers",
                str(n),
                "--seconds",
                str(secs),
                "--register-timeout",
                str(reg_timeout),
                "--json",
            ],
            cwd=c.REPO,
            capture_output=True,
            text=True,
            timeout=secs + reg_timeout + 240,
        )
        if out.returncode != 0:
            res[str(n)] = {"error": out.stderr[-1500:]}
            continue
        res[str(n)] = json.loads(out.stdout.strip().splitlines()[-1])
    results["control_scale"] = res


_SCHED_LABEL = {  # bench/rank_sched.py
    "main_cpu_ms": "training thread on CPU",
    "runqueue_ms": "training thread runnable, core taken (contention)",
    "sleep_ms": "training thread blocked (collectives, data, locks)",
    "other_threads_cpu_ms": "CPU of the rank's other threads",
}


def render(r: dict) -> str:
    rows = []
    t = r.get("throughput")
    if t:
        rows += [
            ("1 throughput", "Surge tokens/s (DP=2 gloo, full stack)", c.fmt(t["surge_tokens_per_s"], "", 0)),
            ("1 throughput", "torchrun + DDP tokens/s", c.fmt(t["torchrun_tokens_per_s"], "", 0)),
            ("1 throughput", "ratio Surge / torchrun (goal >= 0.99)", c.fmt(t["ratio"], "", 3)),
        ]
    for name, row in r.get("meetings_per_step", {}).items():
        if "before" in row and "now" in row:
            b, n = row["before"], row["now"]
            what = (
                f"{name}: collectives / small ones outside forward+backward / bus / relay msgs per step, before -> now"
            )
            rows.append(("1 meetings", what,
                         f"{b['collectives_total']:g} / {b['collectives_outside_backward_forward']:g} / {b['bus_messages_total']:g} / "
                         f"{b['relay_messages_total']:g} -> {n['collectives_total']:g} / {n['collectives_outside_backward_forward']:g} / "
                         f"{n['bus_messages_total']:g} / {n['relay_messages_total']:g}"))  # fmt: skip
    for k, v in r.get("spans_fraction_of_wall", {}).items():
        percent = {**v, **{x: 100 * v[x] for x in ("median", "min", "max")}}
        rows.append(("2 spans", f"{k}, % of wall time (rank median)", c.fmt(percent, " %", 2)))
    sched = r.get("rank_time_per_step_ms", {})
    for k in ("main_cpu_ms", "runqueue_ms", "sleep_ms", "other_threads_cpu_ms"):
        if k in sched.get("surge", {}) and k in sched.get("torchrun", {}):
            rows.append(
                (
                    "2 spans",
                    f"rank {_SCHED_LABEL[k]}, ms per step: Surge / torchrun",
                    f"{c.fmt(sched['surge'][k], '', 1)} / {c.fmt(sched['torchrun'][k], '', 1)}",
                )
            )
    for k, v in r.get("services_cpu_percent", {}).items():
        rows.append(("2 spans", f"CPU of {k} during the job, % of one core", c.fmt(v, " %", 1)))
    b = r.get("bus")
    if b:
        per_send = b["us_per_send"]
        rows.append(
            (
                "2 spans",
                "bus: us per command+reply / per publish",
                f"{per_send.get('command + routed reply', 0):.2f} / {per_send.get('publish to 2 receivers', 0):.2f}",
            )
        )
        rows.append(("2 spans", f"bus: us per step ({b['sends_per_step']} sends)", f"{b['us_per_step']:.1f}"))
    dw = r.get("spans_fraction_of_wall", {}).get("data_wait")
    if dw:
        percent = {**dw, **{x: 100 * dw[x] for x in ("median", "min", "max")}}
        rows.append(("3 data", "data wait % of wall (goal < 1 %)", c.fmt(percent, " %", 3)))
    for p in r.get("data_packed_vs_consumed", [])[-1:]:
        rows.append(
            (
                "3 data",
                "batches sent per train stream vs consumed per rank",
                f"{p['sent_per_stream_last2']} vs {p['consumed_per_rank']}",
            )
        )
    d = r.get("data_drain")
    if d and "error" not in d:
        rows.append(
            (
                "3 data",
                "data service alone: batches/s, MB/s (1 stream drained)",
                f"{d['batches_per_s']:.0f}, {d['mb_per_s']:.1f}",
            )
        )
        if t:
            need = t["surge_tokens_per_s"]["median"] / (d["tokens_per_batch"])
            rows.append(("3 data", "ranks consume batches/s (both ranks)", f"{need:.1f}"))
    for name, cp in r.get("checkpoints", {}).items():
        if "error" in cp:
            rows.append(("4 checkpoint", name, "error: " + cp["error"].splitlines()[-1][:80]))
            continue
        med = cp["median_ms_rank0"]
        rows.append(
            (
                "4 checkpoint",
                f"{name} ({cp['params'] / 1e6:.1f} M params): loop blocked, sync vs async (ms)",
                f"{med['sync: blocked']:.0f} vs {med['async: blocked']:.0f}",
            )
        )
        rows.append(("4 checkpoint", f"{name}: load (ms)", f"{med['load']:.0f}"))
    inc = r.get("incremental_save", {})
    if "error" in inc:
        rows.append(("4 incremental saves", "error", inc["error"].splitlines()[-1][:80]))
        inc = {}
    for model, cases in inc.items():
        for label, case in cases.items():
            s = case["summary"]
            rows.append((
                "4 incremental saves",
                f"{model} {label} ({100 * case['frozen_share']:.0f} %): delta / full bytes; save s full, delta",
                f"{s['delta_over_full']:.3f} (1/{1 / max(s['delta_over_full'], 1e-9):.1f}); "
                f"{s['full_save_s_median']:.2f}, {s['delta_save_s_median']:.2f}",
            ))  # fmt: skip
    reshard_runs = r.get("reshard_resume", {})
    if "error" in reshard_runs:
        rows.append(("4 resume at a new dp", "error", reshard_runs["error"].splitlines()[-1][:80]))
        reshard_runs = {}
    for model, rr in reshard_runs.items():
        for label, s in rr["resumes"].items():
            rows.append((
                "4 resume at a new dp",
                f"{model}: dp 2 checkpoint at {label}: launch -> first step / load (s)",
                f"{s['first_step_s']['median']:.1f} / {s['load_s']['median']:.2f}",
            ))  # fmt: skip
    for model, mr in r.get("memory_restore", {}).items():
        if "error" in mr:
            rows.append(("4 memory copies", model, "error: " + mr["error"].splitlines()[-1][:80]))
            continue
        med = mr["median_s"]
        rows.append((
            "4 memory copies",
            f"{model}: restore (s): store page cache / store cold / own agent's memory / peer's memory",
            " / ".join(f"{med[k]:.3f}" for k in ("store (page cache)", "store (cold)", "memory (own agent)",
                                                 "memory (peer via own agent)")),
        ))  # fmt: skip
    for n, cs in r.get("control_scale", {}).items():
        if "error" in cs:
            rows.append(("5 control", f"{n} workers", "error: " + cs["error"].splitlines()[-1][:80]))
            continue
        rows.append(
            (
                "5 control",
                f"{n} workers: registered / register ack p50, p99 (ms)",
                f"{cs['registered']} / {cs['register_latency_ms']['p50']:.0f}, {cs['register_latency_ms']['p99']:.0f}",
            )
        )
        if cs["registered"] < int(n):
            rows.append(("5 control", f"{n} workers", f"saturated: {cs['registered']} sessions held, the rest wait"))
            continue
        rows.append(
            (
                "5 control",
                f"{n} workers: event latency p50, p99 (ms; {cs['latency_source']})",
                f"{cs['latency_ms']['p50']:.1f}, {cs['latency_ms']['p99']:.1f} (n={cs['latency_ms']['n']})",
            )
        )
        declared = cs.get("silenced_declared_after_last_beat_s", cs["silenced_declared_s"])
        rows.append(
            (
                "5 control",
                f"{n} workers: control CPU % of one core / silenced rank declared after (s)",
                f"{cs['control_cpu_percent']:.0f} / {declared}",
            )
        )
        if declared is not None and declared < 0:  # a rank declared silent before the planted silence
            rows.append(
                (
                    "5 control",
                    f"{n} workers",
                    f"saturated: a live rank was declared silent first ({cs['fault_event'][:70]})",
                )
            )
    s = r.get("startup_seconds")
    if s:
        rows.append(("6 start-up", "Surge submit -> first step (s)", c.fmt(s["surge_submit_to_first_step"], "", 2)))
        rows.append(
            ("6 start-up", "torchrun launch -> first step (s)", c.fmt(s["torchrun_launch_to_first_step"], "", 2))
        )
    return c.table(rows, ("section", "what", "median (min-max)"))


def main() -> None:
    c.setup_env()
    results = {"machine": c.machine(), "command": ("BENCH_QUICK=1 " if c.QUICK else "") + "make bench"}
    t0 = time.time()
    only = [x.strip() for x in os.environ.get("BENCH_ONLY", "").split(",") if x.strip()]  # e.g. "throughput,bus"
    out = c.RESULTS / f"bench{'-quick' if c.QUICK else ''}.json"
    if only and out.exists():  # re-run some sections: keep the others' figures
        results = {**json.loads(out.read_text()), **results, "sections_rerun": only}
        results.pop("errors", None)
    for name, fn in (
        ("meetings", meetings),
        ("throughput", throughput),
        ("bus", bus_cost),
        ("data drain", data_drain),
        ("checkpoints", checkpoints),
        ("incremental", incremental),
        ("reshard", reshard),
        ("control plane", control_scale),
        ("memory", memory_restore),
    ):
        if only and name not in only:
            continue
        print(f"[{time.time() - t0:6.0f} s] {name} ...", flush=True)
        try:
            fn(results)
        except Exception as e:  # one failing section must not lose the others' figures
            results.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            print(f"  {name} failed: {e}", flush=True)
        c.save("bench" + ("-quick" if c.QUICK else ""), results)
    results["total_seconds"] = time.time() - t0
    path = c.save("bench" + ("-quick" if c.QUICK else ""), results)
    print(render(results))
    print(
        f"\n{path.relative_to(c.REPO)}; {results['total_seconds']:.0f} s; load average at start "
        f"{results['machine']['loadavg_at_start']}"
    )


if __name__ == "__main__":
    main()
