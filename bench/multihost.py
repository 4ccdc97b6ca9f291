"""Tokens/s of the same job on one host and across hosts (issue 17): the local stack
(`surgectl up --workers 2`) against the README's many-machine recipe on the namespace test
bed (tests/multihost/cluster.py: a network namespace per host, traffic over veth pairs and a
bridge, checkpoints streamed to the store).

    sudo .venv/bin/python bench/multihost.py [--steps 300] [--rounds 2]

The job is bench/jobs/throughput.yaml (dp 2, gloo, one thread per rank) on a dataset
prepared from three packages of the standard library (json, email, logging), the same on
both; checkpoints every 100 steps (path on one host, stream across hosts). The rounds
alternate (one host, namespaces, one host, ...) so that a change in the machine's load
touches both alike. Reported: the median of rank 0's tokens/s over each run's steps after
the 20th, per run and per deployment. Results: bench/results/multihost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402
from tests.multihost.cluster import recipe_cluster  # noqa: E402
from tests.multihost.netns import available  # noqa: E402

SPEC = c.REPO / "bench" / "jobs" / "throughput.yaml"
WARMUP = 20


def spec_text(name: str, steps: int) -> str:
    from services.jobspec import read_spec_mapping

    spec = read_spec_mapping(SPEC.read_text(), str(SPEC))  # (as jobspec reads a job file: 5.0e5 a float)
    spec.update(name=name, steps=steps)
    spec["checkpoint"] = {"every_steps": 100, "keep_last": 2, "at_end": False}
    return yaml.safe_dump(spec, sort_keys=False)


def tokens_per_second(metrics: Path) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if r.get("type") == "step" and r.get("rank") == 0 and r["step"] > WARMUP]
    return statistics.median(r["tokens_per_second"] for r in steps)


def one_host(root: Path, steps: int, n: int) -> float:
    """The local stack under its own SURGE_HOME (dataset from the same packages)."""
    from services.data.prepare import prepare_dataset

    home = root / f"local-{n}"
    c.BENCH_HOME = home
    os.environ["SURGE_HOME"] = str(home)
    os.environ["SURGE_DATA_ROOT"] = str(home / "datasets")
    prepare_dataset(_corpus(root), "stdlib", "v1", home / "datasets", val_fraction=0.2, include_glob="**/*.py")
    spec = home / "job.yaml"
    spec.write_text(spec_text(f"onehost{n}", steps))
    with c.Stack(workers=2):
        job, _ = c.submit(spec)
        c.wait_job(job, timeout_s=600)
    return tokens_per_second(home / "store" / "metrics" / f"{job}.jsonl")


def namespaces(root: Path, steps: int, n: int) -> float:
    with recipe_cluster(root / f"netns-{n}", ("node-1", "node-2")) as cluster:
        job = cluster.submit(spec_text(f"netns{n}", steps), f"netns{n}")
        final = cluster.events(job, follow=True, timeout=600)[-1].status
        if final.step != steps:
            raise RuntimeError(f"{job} ended at step {final.step}: {cluster.events_text(job)}")
        return tokens_per_second(cluster.bed.hosts["head"].home / "store" / "metrics" / f"{job}.jsonl")


def _corpus(root: Path) -> Path:
    src = root / "corpus"
    if not src.exists():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for pkg in ("json", "email", "logging"):
            shutil.copytree(stdlib / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    why = available()
    if why:
        sys.exit(f"bench/multihost.py: the namespace test bed cannot run here: {why}")
    # A TERM (timeout, kill) unwinds like Ctrl-C: the bed's namespaces, bridge and processes go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="surge-multihost-"))
    runs: dict[str, list[float]] = {"one host": [], "namespaces": []}
    t0 = time.time()
    try:
        for n in range(args.rounds):
            runs["one host"].append(one_host(root, args.steps, n))
            runs["namespaces"].append(namespaces(root, args.steps, n))
            print(f"round {n + 1}: one host {runs['one host'][-1]:.0f}, namespaces {runs['namespaces'][-1]:.0f} tok/s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "machine": c.machine(),
        "command": "bench/multihost.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "tokens_per_second": {k: {"runs": v, "median": statistics.median(v)} for k, v in runs.items()},
        "ratio_namespaces_to_one_host": statistics.median(runs["namespaces"]) / statistics.median(runs["one host"]),
        "wall_s": time.time() - t0,
    }
    out = c.RESULTS / "multihost.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("| deployment | tokens/s (median of runs) | runs |\n| --- | --- | --- |")
    for k, v in result["tokens_per_second"].items():
        print(f"| {k} | {v['median']:.0f} | {', '.join(f'{x:.0f}' for x in v['runs'])} |")
    print(out.relative_to(c.REPO))


if __name__ == "__main__":
    main()
