"""`make bench-goodput`: effective training time under a fault schedule, Surge against
`torchrun --max-restarts` with a checkpoint every N steps, on the same model and data
(issue 16 part 4).

    .venv/bin/python bench/goodput.py [--minutes 10] [--interval 120] [--policy rebuild|restart_ranks]
        [--only surge|torchrun] [--faults kill,node,stop] [--quick]

Each system trains ``bench/jobs/throughput.yaml`` (dp=2, gloo, CPU) for a fixed wall
time (``--minutes``, default 10; ``--quick``: 4 minutes, a fault every 55 s) while a fault
hits it every ``--interval`` seconds (default 120), rotating through ``--faults``:

- ``kill``: SIGKILL of rank 1's process;
- ``stop``: SIGSTOP of rank 1's process (alive, silent). Surge finds it by its liveness
  deadlines (heartbeat timeout ``--heartbeat-timeout``, default 3 s, Surge's own); torchrun by the gloo
  collective timeout (``--collective-timeout``, default 30 s), after which its agent sends
  the stopped worker SIGTERM and waits (30 s, torch's default) before SIGKILL;
- ``node``: loss of the node agent holding rank 1. Surge: SIGKILL of the worker service
  process (its ranks end when their session to it does); the stack runs three node agents
  of one slot each (rank 0, rank 1, a spare), so the replacement has a place, and the lost
  agent comes back ``--agent-return`` seconds later (same id and port) so that the next
  node fault has a spare again. torchrun (``--standalone``, one agent for both ranks, as
  on one machine): SIGKILL of the agent's process group and its workers (a worker would
  otherwise train on, orphaned, with nobody left to restart it), and the harness launches
  torchrun again at once, as a scheduler requeueing the job would (no delay: generous).
  Two torchrun agents (``--nnodes=2``, c10d rendezvous) with a replacement agent joining
  was tried first: with torch 2.13 the re-rendezvous deadlocked (both agents timed out
  after 60 s waiting for each other's keys in the round's store) and torchrun gave up.

Surge's job is submitted once the three node agents' rank fork servers
(``SURGE_WORKER_RANK_FORKSERVER=eager``) have finished their imports, as on a cluster whose agents
have been up a while (the wait after ``surgectl up`` is reported, not counted); its ranks
are then forked from them. torchrun's workers start as fresh interpreters: that is
how torchrun starts them.

The last fault leaves at least one interval before the end. Surge runs the job with
``fault_policy.actions`` set to ``--policy`` for rank_exit, rank_silent, rank_stalled and
worker_lost (``rebuild``: survivors keep their processes; ``restart_ranks``: every rank is
relaunched from the newest checkpoint); both systems checkpoint every ``--ckpt-every``
steps (default 10). The systems run one after the other on the same machine.

Reported per system, from rank 0's per-step records (Surge: the store's metrics JSONL;
torchrun: the baseline script's step log) and, for Surge, the job's events:

- ETTR (ByteRobust): the step_seconds of the steps that count toward the final progress
  (a step completed and later redone after a rollback counts once: its last completion),
  divided by the wall time from launch (submit / torchrun start) to the end of the window;
- steps lost per fault: steps completed before the fault and done again after it
  (the newest step completed before the recovery began minus the step the run resumed at);
- time from the fault (the signal) to the first step completed after the recovery began
  (Surge: after the job's first ``fault`` event; torchrun: after it started new workers);
- when the ranks were ready again (Surge: the last rank's "ready" event after the fault,
  rebuilt or relaunched, restored or healed; torchrun: the new rank 0 process's start);
- whether the survivors' process ids changed (rank 0, and for a node loss every rank
  not on the lost node), read from /proc before the fault and before the next one.

Results: ``bench/results/goodput.json`` (``goodput-quick.json`` for ``--quick``; a run of
one system (``--only``) or one policy keeps the other entries of the same configuration)
and a markdown table. Everything the harness starts lives under its own SURGE_HOME in /tmp
and is stopped by pid or process group on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as c  # noqa: E402
from bench.faults import _proc_env, alive  # noqa: E402

SPEC = c.REPO / "bench" / "jobs" / "throughput.yaml"
WORLD = 2
KINDS = ("kill", "stop", "node")
LOST_RANK = 1  # the rank every fault hits (rank 0 holds the rendezvous in both systems)
SURGE_POLICY_CLASSES = ("rank_exit", "rank_silent", "rank_stalled", "worker_lost")


# ------------------------------------------------------------------ analysis (pure)


def schedule(total_s: float, interval_s: float, kinds: list[str]) -> list[tuple[float, str]]:
    """Fault times (seconds after launch) and kinds: every ``interval_s``, rotating through
    ``kinds``, the last one at least ``interval_s`` before the end (time to recover)."""
    out, k = [], 1
    while k * interval_s <= total_s - interval_s + 1e-9:
        out.append((k * interval_s, kinds[(k - 1) % len(kinds)]))
        k += 1
    return out


def lineage(records: list[dict]) -> list[dict]:
    """The step records that make the final progress, in time order: a record of step s
    replaces every record of a step >= s before it (a rollback: those were redone or lost)."""
    final: list[dict] = []
    for r in sorted(records, key=lambda r: r["unix_time"]):
        while final and final[-1]["step"] >= r["step"]:
            final.pop()
        final.append(r)
    return final


def analyze(records: list[dict], faults: list[dict], t_start: float, t_end: float) -> dict:
    """ETTR and the per-fault figures of one run.

    ``records``: rank 0's step records (``step``, ``unix_time`` of its completion,
    ``step_seconds``, optional ``skipped``); those outside [t_start, t_end] are ignored.
    ``faults``: in time order, each with ``t_fault`` (the signal) and ``t_split`` (when the
    recovery began: records after it are the new run's; None: never detected); each
    fault's dict gets ``steps_lost``, ``first_new_step``, ``first_new_step_s`` (None when no
    step completed before the next fault or the end: ``recovered`` False) added.
    """
    recs = sorted((r for r in records if t_start <= r["unix_time"] <= t_end), key=lambda r: r["unix_time"])
    final = lineage(recs)
    wall = t_end - t_start
    productive = sum(r["step_seconds"] for r in final if not r.get("skipped"))
    out_faults = []
    for i, f in enumerate(faults):
        f = dict(f)
        until = faults[i + 1]["t_fault"] if i + 1 < len(faults) else t_end
        split = f.get("t_split")
        new = next((r for r in recs if split is not None and split < r["unix_time"] <= until), None)
        # The newest step of the run as it stood when the recovery began (an earlier
        # rollback's abandoned steps are not counted again).
        before = lineage([r for r in recs if r["unix_time"] <= (split if split is not None else until)])
        f["step_at_fault"] = before[-1]["step"] if before else 0
        f["recovered"] = new is not None
        f["first_new_step"] = new["step"] if new else None
        f["first_new_step_s"] = new["unix_time"] - f["t_fault"] if new else None
        f["not_recovered_within_s"] = None if new else until - f["t_fault"]
        f["steps_lost"] = max(0, f["step_at_fault"] - (new["step"] - 1)) if new else None
        # Survivors' processes, read before the next fault (or at the end): only a recovered
        # fault's are compared (an unrecovered one's survivors may not have been touched yet).
        f["survivors_kept_pids"] = (
            survivors_kept(f.get("pids_before", {}), f.get("pids_after", {}), set(f.get("lost_ranks", ())))
            if new
            else None
        )
        out_faults.append(f)
    first_fault = faults[0]["t_fault"] if faults else t_end
    pre = [r for r in final if r["unix_time"] <= first_fault]
    steady = (
        sum(r["step_seconds"] for r in pre[1:]) / (pre[-1]["unix_time"] - pre[0]["unix_time"]) if len(pre) > 2 else None
    )
    recovered = [f for f in out_faults if f["recovered"]]
    return {
        "wall_s": wall,
        "ettr": productive / wall if wall > 0 else None,
        "productive_step_s": productive,
        "productive_steps": len(final),
        "final_step": final[-1]["step"] if final else 0,
        "steps_completed": len(recs),
        "steps_redone_or_lost": len(recs) - len(final),
        "first_step_s": recs[0]["unix_time"] - t_start if recs else None,
        # Before any fault: step time / time between the first and last step (what the
        # system costs between steps, with no fault at all).
        "steady_step_share_before_faults": steady,
        "faults_injected": len([f for f in faults if not f.get("skipped")]),
        "faults_recovered": len(recovered),
        "steps_lost": c.summary([f["steps_lost"] for f in recovered]),
        "first_new_step_s": c.summary([f["first_new_step_s"] for f in recovered]),
        "survivors_kept_pids": sum(1 for f in out_faults if f["survivors_kept_pids"]),
        "faults_with_survivors": sum(1 for f in out_faults if f["survivors_kept_pids"] is not None),
        "faults": out_faults,
    }


def survivors_kept(before: dict[int, int], after: dict[int, int], lost: set[int]) -> bool | None:
    """Every rank not lost runs in the process it ran in before the fault (None: no survivor
    known)."""
    survivors = [r for r in before if r not in lost]
    if not survivors:
        return None
    return all(after.get(r) == before[r] for r in survivors)


# ------------------------------------------------------------------ processes


def _argv(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    argv = [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")] if raw else []
    # A rank forked by the fork server shows its command line as one string (setproctitle).
    return argv[0].split(" ") if len(argv) == 1 else argv


def _start_ticks(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _procs() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _newest(found: dict[int, list[int]]) -> dict[int, int]:
    return {r: max(pids, key=_start_ticks) for r, pids in found.items()}


def surge_rank_pids(job: str) -> dict[int, int]:
    """rank -> pid of the live rank processes of ``job`` (the newest if two)."""
    found: dict[int, list[int]] = {}
    for pid in _procs():
        a = _argv(pid)
        if "services.rank" in a and "--job" in a and a[a.index("--job") + 1 : a.index("--job") + 2] == [job]:
            if "--rank" in a and alive(pid):
                found.setdefault(int(a[a.index("--rank") + 1]), []).append(pid)
    return _newest(found)


def torchrun_worker_pids(marker: str) -> dict[int, int]:
    """RANK -> pid of the live baseline workers whose command line holds ``marker`` (the
    run's own step-log path: other people's torchrun jobs are never touched)."""
    found: dict[int, list[int]] = {}
    for pid in _procs():
        if marker in " ".join(_argv(pid)) and alive(pid):
            rank = _proc_env(pid).get("RANK")
            if rank is not None:
                found.setdefault(int(rank), []).append(pid)
    return _newest(found)


def _kill_or_stop(pid: int, kind: str) -> None:
    """The "kill" or "stop" fault on ``pid``; a stopped process is remembered, to be killed
    at clean-up (by its start time: never a recycled pid)."""
    _signal(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    if kind == "stop":
        CLEANUP.stopped[pid] = _start_ticks(pid)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Cleanup:
    """What this process started or stopped, to end by pid on exit or Ctrl-C."""

    stopped: dict[int, int] = field(default_factory=dict)  # SIGSTOPped pid -> its start time: killed at the end
    groups: list = field(default_factory=list)  # Popen of the process groups we started (torchrun agents)
    finders: list = field(default_factory=list)  # () -> pids to SIGKILL (ranks, workers)
    stack_up: bool = False
    home: Path | None = None  # this run's SURGE_HOME (kept after an interruption: logs)

    def run(self, graceful: bool) -> None:
        for pid, ticks in list(self.stopped.items()):
            if _start_ticks(pid) == ticks and alive(pid):  # still that process, not a reused pid
                _signal(pid, signal.SIGKILL)
                _signal(pid, signal.SIGCONT)
        for p in list(self.groups):
            if p.poll() is None:  # not reaped: its pid is still its own
                _killpg(p.pid)
                p.wait()
        if self.stack_up:
            from services.cli import stack

            try:
                stack.down(timeout_s=10.0 if graceful else 3.0)
            except Exception as e:  # noqa: BLE001 - keep cleaning up
                print(f"  cleanup: surgectl down failed: {e}", file=sys.stderr)
        for find in self.finders:
            for pid in find():
                _signal(pid, signal.SIGKILL)
        self.stopped.clear()
        self.groups.clear()


CLEANUP = Cleanup()


def _on_signal(signum, frame) -> None:
    """Ctrl-C / SIGTERM: stop everything started here, at once, by pid; exit 130. (No
    KeyboardInterrupt: raised inside a gRPC call it can leave the channel locked.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stderr.write("\ninterrupted: stopping what the benchmark started\n")
        CLEANUP.run(graceful=False)
        sys.stderr.write(f"SURGE_HOME kept: {CLEANUP.home}\n")
    finally:
        os._exit(130)


def _sleep_until(t: float, tick=None) -> None:
    while (left := t - time.time()) > 0:
        time.sleep(min(0.1, left))
        if tick:
            tick()


# ------------------------------------------------------------------ Surge


def run_surge(args, plan: list[tuple[float, str]]) -> dict:
    from services.cli import clients, stack
    from services.contract import control_pb2

    name = f"goodput{int(time.time()) % 100000}"
    spec = c.write_spec(
        SPEC,
        name,
        steps=1_000_000,
        checkpoint={"every_steps": args.ckpt_every, "keep_last": 2, "at_end": False},
        liveness={
            "heartbeat_interval_seconds": 1.0,
            "heartbeat_timeout_seconds": args.heartbeat_timeout,
            "stall_min_seconds": args.stall_min,
        },
        fault_policy={"actions": {k: args.policy for k in SURGE_POLICY_CLASSES}, "max_restarts": 1000},
    )
    os.environ.pop("SURGE_WORKER_SLOTS", None)  # one slot per node agent (CPU default)
    # Every node agent starts its rank fork server at once (services/worker/rank_forkserver.py):
    # the spare node's too, where a lost node's rank is replaced.
    os.environ["SURGE_WORKER_RANK_FORKSERVER"] = "eager"
    faults: list[dict] = []
    returns: list[tuple[float, str]] = []  # (when, worker name): a lost agent comes back
    CLEANUP.stack_up = True
    with c.Stack(workers=3):
        # Submitted to agents that have been up a while, as on a cluster: their fork servers warm.
        spares_wait_s = c.wait_forkservers_warm(3)
        job, t0 = c.submit(spec)
        CLEANUP.finders.append(lambda: list(surge_rank_pids(job).values()))
        print(f"  surge ({args.policy}): job {job}, {len(plan)} faults over {args.minutes:g} min", flush=True)
        pending: list[dict] = []

        def tick() -> None:
            now = time.time()
            for f in list(pending):  # a survivor's process ending (torchrun-style detection)
                gone = [r for r, p in f["pids_before"].items() if r not in f["lost_ranks"] and not alive(p)]
                if gone:
                    f["survivor_exit_s"] = now - f["t_fault"]
                    pending.remove(f)
            for item in list(returns):
                if now >= item[0]:
                    returns.remove(item)
                    try:
                        stack.restart(item[1], grace_s=1.0)
                        print(f"    {item[1]} back ({time.time() - t0:.0f} s)", flush=True)
                    except Exception as e:  # noqa: BLE001 - reported, the run goes on
                        print(f"    {item[1]} did not come back: {e}", flush=True)

        for when, kind in plan:
            _sleep_until(t0 + when, tick)
            pids = surge_rank_pids(job)
            if faults:
                _after(faults[-1], pids)
            f = {"kind": kind, "at_s": when, "pids_before": pids, "lost_ranks": [LOST_RANK]}
            target = pids.get(LOST_RANK)
            if target is None:  # mid-recovery: no rank 1 to hit
                f.update(skipped="no rank 1 process", t_fault=time.time())
                faults.append(f)
                continue
            f["target_pid"] = target
            if kind == "node":
                workers = {p.pid: n for n, p in (stack.read_stack() or {}).items() if n.startswith("worker")}
                agent = ppid(target)
                if agent not in workers:
                    f.update(skipped=f"rank 1's parent {agent} is not a node agent", t_fault=time.time())
                    faults.append(f)
                    continue
                f["agent"], f["agent_pid"] = workers[agent], agent
                f["lost_ranks"] = sorted(r for r, p in pids.items() if ppid(p) == agent)
                f["t_fault"] = time.time()
                _signal(agent, signal.SIGKILL)
                returns.append((f["t_fault"] + args.agent_return, workers[agent]))
            else:
                f["t_fault"] = time.time()
                _kill_or_stop(target, kind)
            faults.append(f)
            pending.append(f)
            print(f"    {when:5.0f} s {kind:4s} rank pids {pids}", flush=True)
        _sleep_until(t0 + args.minutes * 60, tick)
        t_end = time.time()
        if faults:
            _after(faults[-1], surge_rank_pids(job))
        try:
            clients.call("control", lambda s: s.StopJob(control_pb2.StopJobRequest(job_id=job), timeout=10))
            c.wait_job(job, 60)
        except Exception as e:  # noqa: BLE001 - the cleanup kills its ranks
            print(f"  surge: the job did not stop cleanly ({e}); killing its ranks", flush=True)
        evs = c.job_events(job)
        records = c.surge_steps(job).get(0, [])
    CLEANUP.run(graceful=True)
    CLEANUP.stack_up = False
    CLEANUP.finders.clear()
    # The recovery begins at the job's first fault event after the signal.
    fault_events = [e for e in evs if e.type == "fault"]
    injected = [f for f in faults if not f.get("skipped")]
    for i, f in enumerate(injected):
        until = injected[i + 1]["t_fault"] if i + 1 < len(injected) else t_end
        # Every rank reported ready again (rebuilt or relaunched, restored or healed).
        ready = [
            e.unix_time
            for e in evs
            if e.type == "rank" and "ready at step" in e.message and f["t_fault"] <= e.unix_time < until
        ]
        f["all_ready_s"] = max(ready) - f["t_fault"] if ready else None
        ev = next((e for e in fault_events if e.unix_time >= f["t_fault"]), None)
        f["t_split"] = ev.unix_time if ev else None
        f["detect_s"] = ev.unix_time - f["t_fault"] if ev else None
        f["fault_event"] = ev.message if ev else None
        rec = next(
            (
                e
                for e in evs
                if e.type == "recovery" and e.message.startswith("first step") and e.unix_time >= f["t_fault"]
            ),
            None,
        )
        f["recovery_event"] = rec.message if rec else None
    result = analyze(records, injected, t0, t_end)
    result["skipped_faults"] = [f for f in faults if f.get("skipped")]
    result["job"] = job
    result["forkservers_warm_after_up_s"] = spares_wait_s
    result["fault_events"] = [{"t_s": e.unix_time - t0, "message": e.message} for e in fault_events]
    result["decisions"] = [{"t_s": e.unix_time - t0, "message": e.message} for e in evs if e.type == "decision"]
    return result


def _after(f: dict, pids: dict[int, int]) -> None:
    f["pids_after"] = pids


# ------------------------------------------------------------------ torchrun


def run_torchrun(args, plan: list[tuple[float, str]], home: Path) -> dict:
    ckpt = home / "torchrun-ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    log = home / f"torchrun-steps-{os.getpid()}.jsonl"
    log.unlink(missing_ok=True)
    err = open(str(log) + ".err", "a")
    cmd = [
        c.TORCHRUN,
        "--standalone",
        f"--nproc-per-node={WORLD}",
        f"--max-restarts={args.max_restarts}",
        "--monitor-interval=0.1",
        str(c.REPO / "bench/torchrun_ddp.py"),
        "--spec",
        str(SPEC),
        "--data-root",
        str(c.DATA_ROOT),
        "--step-log",
        str(log),
        "--device",
        "cpu",
        "--steps",
        "1000000",
        "--ckpt-dir",
        str(ckpt),
        "--ckpt-every",
        str(args.ckpt_every),
        "--collective-timeout",
        str(args.collective_timeout),
    ]

    def launch() -> subprocess.Popen:
        p = subprocess.Popen(cmd, cwd=c.REPO, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        CLEANUP.groups.append(p)
        return p

    CLEANUP.finders.append(lambda: list(torchrun_worker_pids(str(log)).values()))
    t0 = time.time()
    agent = launch()
    launches = 1
    print(f"  torchrun: {len(plan)} faults over {args.minutes:g} min", flush=True)
    faults: list[dict] = []
    pending: list[dict] = []

    def tick() -> None:
        now = time.time()
        for f in list(pending):  # detection: the survivor's process ends (its agent acted)
            gone = [r for r, p in f["pids_before"].items() if r not in f["lost_ranks"] and not alive(p)]
            if gone:
                f["detect_s"] = now - f["t_fault"]
                pending.remove(f)

    try:
        for when, kind in plan:
            _sleep_until(t0 + when, tick)
            pids = torchrun_worker_pids(str(log))
            if faults:
                _after(faults[-1], pids)
            f = {"kind": kind, "at_s": when, "pids_before": pids, "lost_ranks": [LOST_RANK]}
            target = pids.get(LOST_RANK)
            if kind == "node":
                # One machine, one torchrun agent: losing it loses the node, agent and
                # workers (which would otherwise train on, orphaned, with nobody to restart
                # them). The job's scheduler requeues it at once (no delay: generous).
                f["lost_ranks"] = sorted(pids)
                f["agent_pid"] = agent.pid
                f["t_fault"] = time.time()
                _killpg(agent.pid)
                for pid in pids.values():
                    _signal(pid, signal.SIGKILL)
                agent.wait()
                agent = launch()
                launches += 1
            elif target is None:
                f.update(skipped="no rank 1 process", t_fault=time.time())
                faults.append(f)
                continue
            else:
                f["target_pid"] = target
                f["t_fault"] = time.time()
                _kill_or_stop(target, kind)
            faults.append(f)
            pending.append(f)
            print(f"    {when:5.0f} s {kind:4s} worker pids {pids}", flush=True)
        _sleep_until(t0 + args.minutes * 60, tick)
        t_end = time.time()
        if faults:
            _after(faults[-1], torchrun_worker_pids(str(log)))
        gave_up = agent.poll()
    finally:
        CLEANUP.run(graceful=True)
        CLEANUP.finders.clear()
        err.close()
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    starts = [r for r in lines if r.get("event") == "start"]
    for f in faults:
        if f.get("skipped"):
            continue
        # The recovery began when new workers started (rank 0's start line).
        s = next((r for r in starts if r["unix_time"] >= f["t_fault"]), None)
        f["t_split"] = s["unix_time"] if s else None
        f["restart_s"] = s["unix_time"] - f["t_fault"] if s else None
    result = analyze([r for r in lines if "step" in r], [f for f in faults if not f.get("skipped")], t0, t_end)
    result["skipped_faults"] = [f for f in faults if f.get("skipped")]
    result["worker_starts"] = len(starts)
    result["torchrun_launches"] = launches
    result["torchrun_exit"] = gave_up  # None: still running at the end of the window
    errs = Path(str(log) + ".err")
    result["stderr_tail"] = errs.read_text()[-1500:] if errs.exists() else ""
    return result


# ------------------------------------------------------------------ report


def _cell(s: dict, digits: int = 1) -> str:
    return "n/a" if not s.get("n") else f"{s['median']:.{digits}f} / {s['max']:.{digits}f}"


def report(result: dict) -> str:
    rows, detail = [], []
    for label, r in result["systems"].items():
        n = r["faults_injected"]
        rows.append(
            (
                label,
                f"{r['ettr'] * 100:.1f} %",
                f"{r['wall_s']:.0f}",
                r["final_step"],
                f"{r['faults_recovered']}/{n}",
                _cell(r["steps_lost"], 0),
                _cell(r["first_new_step_s"]),
                f"{r['survivors_kept_pids']}/{r.get('faults_with_survivors', n)}",
                f"{r['steady_step_share_before_faults'] * 100:.0f} %"
                if r.get("steady_step_share_before_faults")
                else "n/a",
            )
        )
        for f in r["faults"]:
            fn = f.get("first_new_step_s")
            detail.append(
                (
                    label,
                    f"{f['at_s']:.0f}",
                    f["kind"],
                    f"{f['detect_s']:.1f}" if f.get("detect_s") is not None else "-",
                    f"{ready:.1f}" if (ready := f.get("all_ready_s", f.get("restart_s"))) is not None else "-",
                    f"{fn:.1f}" if fn is not None else f">= {f['not_recovered_within_s']:.0f} (none)",
                    f["steps_lost"] if f.get("steps_lost") is not None else "-",
                    {True: "kept", False: "changed", None: "-"}[f.get("survivors_kept_pids")],
                )
            )
    cfg = result["config"]
    head = (
        f"{cfg['minutes']:g} min per system, a fault every {cfg['interval_s']:g} s ({', '.join(cfg['faults'])}), "
        f"checkpoint every {cfg['ckpt_every']} steps; Surge heartbeat timeout {cfg['heartbeat_timeout_s']:g} s, "
        f"torchrun gloo timeout {cfg['collective_timeout_s']:g} s, --max-restarts={cfg['max_restarts']}"
    )
    return "\n\n".join(
        [
            head,
            c.table(
                rows,
                (
                    "system",
                    "ETTR",
                    "wall s",
                    "final step",
                    "recovered",
                    "steps lost / fault (median / max)",
                    "fault -> first new step s (median / max)",
                    "survivors kept pids",
                    "step share before faults",
                ),
            ),
            c.table(
                detail,
                (
                    "system",
                    "at s",
                    "fault",
                    "detected s",
                    "ready s",
                    "first new step s",
                    "steps lost",
                    "survivor pids",
                ),
            ),
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=None, help="wall time per system (default 10; --quick 4)")
    ap.add_argument("--interval", type=float, default=None, help="seconds between faults (default 120; --quick 55)")
    ap.add_argument("--quick", action="store_true", default=c.QUICK, help="a 4-minute pass per system (BENCH_QUICK=1)")
    ap.add_argument("--policy", choices=("rebuild", "restart_ranks"), default="rebuild", help="Surge's fault action")
    ap.add_argument("--only", choices=("surge", "torchrun"), default=None, help="run one system")
    ap.add_argument("--faults", default="kill,node,stop", help=f"rotation, from {','.join(KINDS)}")
    ap.add_argument("--ckpt-every", type=int, default=10, help="checkpoint interval in steps, both systems")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0, help="Surge liveness, seconds (its default)")
    ap.add_argument("--stall-min", type=float, default=30.0, help="Surge liveness.stall_min_seconds")
    ap.add_argument("--collective-timeout", type=float, default=30.0, help="torchrun side: gloo timeout, seconds")
    ap.add_argument("--max-restarts", type=int, default=100, help="torchrun --max-restarts")
    ap.add_argument("--agent-return", type=float, default=30.0, help="seconds until a lost Surge node agent returns")
    ap.add_argument("--keep-home", action="store_true", help="keep the /tmp SURGE_HOME (logs, metrics)")
    args = ap.parse_args()
    args.minutes = args.minutes or (4.0 if args.quick else 10.0)
    args.interval = args.interval or (55.0 if args.quick else 120.0)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--faults: a comma-separated list of {', '.join(KINDS)}")
    plan = schedule(args.minutes * 60, args.interval, kinds)

    home = Path(tempfile.mkdtemp(prefix="surge-goodput-"))
    c.BENCH_HOME = CLEANUP.home = home  # every bench.common helper reads it at call time
    c.setup_env()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    config = {
        "minutes": args.minutes,
        "interval_s": args.interval,
        "faults": kinds,
        "ckpt_every": args.ckpt_every,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "stall_min_s": args.stall_min,
        "collective_timeout_s": args.collective_timeout,
        "max_restarts": args.max_restarts,
        "agent_return_s": args.agent_return,
        "schedule": plan,
        "spec": str(SPEC.relative_to(c.REPO)),
        "world_size": WORLD,
    }
    name = "goodput-quick" if args.quick else "goodput"
    path = c.RESULTS / f"{name}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    systems = old.get("systems", {}) if old.get("config") == json.loads(json.dumps(config)) else {}
    result = {
        "machine": {**c.machine(), "quick": args.quick},
        "command": " ".join(["bench/goodput.py", *sys.argv[1:]]),
        "config": config,
    }
    ok = False
    try:
        if args.only in (None, "surge"):
            machine = c.machine()  # each system's own: a later --only run keeps the others'
            systems[f"surge {args.policy}"] = {"policy": args.policy, "machine": machine, **run_surge(args, plan)}
            c.save(name, {**result, "systems": systems})
        if args.only in (None, "torchrun"):
            machine = c.machine()
            systems["torchrun"] = {"machine": machine, **run_torchrun(args, plan, home)}
            c.save(name, {**result, "systems": systems})
        ok = True
    finally:
        CLEANUP.run(graceful=True)
        if ok and not args.keep_home:
            shutil.rmtree(home, ignore_errors=True)
        else:
            print(f"SURGE_HOME kept: {home}", file=sys.stderr)
    result["systems"] = systems
    print(report(result))
    print(f"\n{path.relative_to(c.REPO)}")


if __name__ == "__main__":
    main()
