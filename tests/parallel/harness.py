"""Run Surge's real rank wiring (``services.rank.__main__.compose``) under any parallel config,
one OS process per rank over gloo, and collect what the parity tests compare.

Data: a relay that hands out rows of ONE global stream, so every config sees the same
global batch per optimizer step (the real data service's deal, services/data/batch_packer.py).
Micro-batch ``i`` of dp rank ``d`` (of ``W``) holds global rows ``(i * W + d) * B .. + B``
from the stream's start (``OpenStream.start.row``: a global row index here); with
``A`` micro-steps per step, step ``s`` covers rows ``s * A * W * B .. (s + 1) * A * W * B``
whatever the split (dp, accumulation), so a single process with ``B' = A * W * B`` sees
exactly the same tokens, and a checkpoint's position resumes at any split. Each row has a
random number of padded label positions (-100), so ranks and micro-steps hold different
token counts and only a globally normalised loss matches the single process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (str(REPO), str(REPO / "tests" / "engine")):
    if path not in sys.path:
        sys.path.insert(0, path)

from rank_fakes import FakeStore, FakeUp, corpus_bytes  # noqa: E402

from services.common.process_exit import exit_now  # noqa: E402
from services.contract import data_pb2, engine_pb2  # noqa: E402
from services.contract.bus import Emitter  # noqa: E402
from services.engine.training_loop import Batch  # noqa: E402

SEQ_LEN = 32
GLOBAL_ROWS = 8  # rows per optimizer step, in every config


class GlobalRowsData:
    """L4 relay: micro-batches cut from one global, padded row stream (module docstring)."""

    def __init__(self, versions: Emitter, packer: Emitter, *, batches: int, pad: bool = True):
        self._versions, self._packer = versions, packer
        self._data = np.frombuffer(corpus_bytes(), dtype=np.uint8).astype(np.int64)
        self._batches, self._pad = batches, pad

    def mount(self, msg: data_pb2.MountDataset, payload: Any = None):
        return data_pb2.DatasetReady(name=msg.name, version=msg.version, vocab_size=256, tokenizer="bytes")

    def open_stream(self, msg: data_pb2.OpenStream, payload: Any = None) -> None:
        threading.Thread(target=self._pump, args=(msg,), daemon=True).start()

    def row(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        T = SEQ_LEN
        rng = np.random.default_rng([7, g])
        s = int(rng.integers(0, len(self._data) - T - 1))
        x, y = self._data[s : s + T].copy(), self._data[s + 1 : s + T + 1].copy()
        if self._pad:
            n_pad = int(rng.integers(0, T // 2))
            if n_pad:
                y[T - n_pad :] = -100
        return x, y

    def _pump(self, msg: data_pb2.OpenStream) -> None:
        B, W, d = msg.packer.micro_batch_size, max(1, msg.packer.world_size), msg.packer.rank
        first = msg.start.row  # the global row the stream starts at (a step boundary)
        for i in range(self._batches):
            rows = [self.row(first + (i * W + d) * B + b) for b in range(B)]
            x = torch.from_numpy(np.stack([r[0] for r in rows]))
            y = torch.from_numpy(np.stack([r[1] for r in rows]))
            after = data_pb2.DataPosition(row=first + (i + 1) * W * B)  # after the round: every rank's
            mb = data_pb2.MicroBatch(batch_size=B, seq_len=SEQ_LEN, tokens=int((y != -100).sum()), next=after)
            self._packer(mb, Batch(msg.split, x, y))


def parity_spec(
    steps: int = 10,
    ckpt_every: int = 0,
    model: dict | None = None,
    precision: str = "fp32",
    optimizer: dict | None = None,
    **parallel: Any,
):
    """2 layers, d_model 64, 4 heads, seq 32, fp32, AdamW with warmup + cosine; ``parallel``
    overrides the parallel section; micro-batch rows are chosen so each step holds
    GLOBAL_ROWS rows. ``grad_accum`` may be passed among them. ``ckpt_every``: save every
    that many steps (0: never). ``model`` overrides model fields (e.g. untied embeddings
    for pipeline parallelism); ``precision``: "fp32" | "bf16" | "fp16"; ``optimizer``
    overrides optimizer fields (e.g. ``max_grad_norm``)."""
    from services.jobspec import JobSpec

    accum = parallel.pop("grad_accum", 1)
    dp = parallel.get("dp", 1)
    assert GLOBAL_ROWS % (dp * accum) == 0
    return JobSpec.model_validate({
        "name": "parity", "steps": steps, "seed": 3,
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "attention": "math", **(model or {})},
        "data": {"dataset": "corpus@v1", "seq_len": SEQ_LEN, "micro_batch_size": GLOBAL_ROWS // (dp * accum),
                 "grad_accum": accum},
        "parallel": parallel,
        "precision": precision,
        "optimizer": {"lr": 3e-3, "warmup_steps": 2, **(optimizer or {})},
        "checkpoint": {"every_steps": ckpt_every, "at_end": False, "keep_last": 0},
        "eval": {"every_steps": 0, "at_end": False},
    })  # fmt: skip


class Rank:
    """One rank wired by the real composition root, with the global-rows data relay."""

    def __init__(
        self, spec, ckpt_root: Path, *, rank: int, world_size: int, port: int, resume_version: str = "", guard=None
    ):
        from services.contract import Module
        from services.contract.bus import Bus
        from services.control.fault_decision import standing_orders
        from services.jobspec import spec_to_json
        from services.rank.__main__ import compose

        self.spec = spec
        self.bus = bus = Bus()
        self.data = GlobalRowsData(
            bus.emitter(Module.L4_DATASET_VERSIONS),
            bus.emitter(Module.L4_BATCH_PACKER),
            batches=spec.steps * spec.data.grad_accum + 4,
        )
        self.store = FakeStore(bus.emitter(Module.L5_CHECKPOINT_MANAGER), ckpt_root)
        self.up = FakeUp()
        # guard: a StepGuard with test-only injections on the backward port (as rank.py wires it).
        self.modules = compose(
            bus, spec, "cpu", data=self.data, store=self.store, metrics=self.store, up=self.up, guard=guard
        )
        # The standing orders L1-1 issues with the job (services/control/fault_decision.py):
        # an fp16 overflow is skipped with no round trip, as under control.
        self.init = engine_pb2.InitJob(
            job_id="job",
            spec_json=spec_to_json(spec),
            resume_version=resume_version,
            standing_orders=standing_orders(spec.fault_policy),
        )
        self.assignment = engine_pb2.RankAssignment(
            rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port,
            backend="gloo", device="cpu", num_threads=1,
        )  # fmt: skip

    def run(self, before_start=None) -> None:
        """Bring up, initialise, call ``before_start(self)`` (if given) once the loop has
        reported TrainingLoopStarted, then start and train to the end."""
        self.modules.orchestrator(self.init)
        self.modules.allocator(self.assignment)
        if before_start is None:
            self.modules.orchestrator(engine_pb2.StartTraining(job_id="job"))
            self.modules.loop.run()
        else:
            runner = threading.Thread(target=self._run_loop, daemon=True)
            runner.start()
            while not self.up.of(engine_pb2.TrainingLoopStarted) and not self.up.finished.is_set():
                time.sleep(0.01)
            if not self.up.finished.is_set():
                before_start(self)
                self.modules.orchestrator(engine_pb2.StartTraining(job_id="job"))
            runner.join()
        failed = self.up.of(engine_pb2.TrainingLoopFailed)
        if failed:
            raise RuntimeError(f"rank failed: {failed[0].fault_class}: {failed[0].detail}")

    def _run_loop(self) -> None:
        try:
            self.modules.loop.run()
        except BaseException as e:  # noqa: BLE001 - reported as the rank's failure, like rank.py
            self.modules.loop.fail(e)

    def load_model_and_optimizer(self, path: Path) -> None:
        """Through the rank's state manager (LoadCheckpoint from the loop's own port, with a
        template snapshot of the model and optimizer only), the model and optimizer of the
        checkpoint at ``path``, restored the loop's way (RestoreState to each owner); the loop
        keeps its own state."""
        from services.contract import Module, store_pb2
        from services.state.snapshot import Snapshot

        L, owners = Module.L2_TRAINING_LOOP, {"model": Module.L3_SHARD_LOADER, "optim": Module.L2_OPTIMIZER}
        ask = engine_pb2.ExportState(version="template")
        template = Snapshot.of([self.bus.port(L, m)(ask).payload for m in owners.values()])
        self.store._root = path.parent
        loaded = self.bus.port(L, Module.L5_CHECKPOINT_MANAGER)(store_pb2.LoadCheckpoint(version=path.name), template)
        for key, module in owners.items():
            slot = loaded.payload.slots[key]
            restore = engine_pb2.RestoreState(step=slot.step, version=slot.version, digest=slot.digest)
            self.bus.port(L, module)(restore, slot)

    def weight_digests(self) -> dict[str, str]:
        """The sha256 of every weight's whole tensor (float32 bytes), one tensor gathered at a
        time (collective, all ranks), so a rank never holds more than one whole weight."""
        from torch.distributed.tensor import DTensor

        from services.contract import Module

        port = self.bus.port(Module.L2_TRAINING_LOOP, Module.L3_SHARD_LOADER)
        state = port(engine_pb2.ExportState()).payload.state_dict()
        return {k: tensor_digest(v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sorted(state.items())}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every weight as a whole tensor (DTensor shards gathered: collective, all ranks)."""
        from torch.distributed.tensor import DTensor

        from services.contract import Module

        port = self.bus.port(Module.L2_TRAINING_LOOP, Module.L3_SHARD_LOADER)
        state = port(engine_pb2.ExportState()).payload.state_dict()
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sorted(state.items())
        }


def peak_rss() -> int:
    """This process's peak resident set size so far (``VmHWM`` of /proc/self/status), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def rank_main(argv: list[str]) -> None:
    """``python harness.py CONFIG_JSON RANK WORLD PORT OUT``: run one rank, save results.

    Besides the parallel section, CONFIG may hold ``steps``, ``ckpt_every``, ``ckpt_root``
    (where checkpoints go; default OUT/ckpt), ``resume`` (a version under ckpt_root: the
    loop resumes it), ``load_weights_from`` (a checkpoint directory whose model and
    optimizer are loaded before training starts, from step 0), ``inject`` (a list of
    ``[kind, step, rank]``: services.rank.faults injections, e.g. ``["inf_grad", 3, 1]``),
    ``start_digests`` (true: the sha256 of every whole weight once the loop has started,
    before the first step, in ``started_digests``, also written at once to
    OUT/started<rank>.json, which outlives a rank killed later; the gathering is collective) and
    ``final_state`` (false: no gathered copy of the weights at the end, whose whole tensors
    would cost a memory-limited rank the full model), ``end_digests`` (true: their sha256
    instead, in ``end_digests``). Every result holds the rank's peak
    RSS (``peak_rss``; and ``started_rss`` where a hook ran before the first step)."""
    config, rank, world, port, out = json.loads(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    ckpt_root = Path(config.pop("ckpt_root", out / "ckpt"))
    resume, load_from = config.pop("resume", ""), config.pop("load_weights_from", "")
    start_digests, final_state = config.pop("start_digests", False), config.pop("final_state", True)
    end_digests = config.pop("end_digests", False)
    guard = _guard(config.pop("inject", []), rank, out, lambda: r)
    spec = parity_spec(**config)
    r = Rank(spec, ckpt_root, rank=rank, world_size=world, port=port, resume_version=resume, guard=guard)
    loaded: dict[str, Any] = {}
    started: dict[str, Any] = {}

    def before_start(rank_: Rank) -> None:
        started["rss"] = peak_rss()  # the load's peak: model built, laid out, resumed
        if load_from:
            rank_.load_model_and_optimizer(Path(load_from))
            loaded["state"] = rank_.full_state()
            loaded["optim"] = full_optimizer_state(rank_)
        if start_digests:
            started["digests"] = rank_.weight_digests()
        # Written now: a rank killed later in the run (a memory limit) still tells how it started.
        (out / f"started{rank}.json").write_text(json.dumps(started))

    try:
        r.run(before_start=before_start if load_from or start_digests else None)
    except RuntimeError as e:
        torch.save({"error": f"{getattr(e, 'fault_class', 'error')}: {e}"}, out / f"rank{rank}.pt")
        raise
    steps = r.up.of(engine_pb2.StepCompleted)
    state = r.full_state() if final_state else {}
    digests = r.weight_digests() if end_digests else {}
    r.modules.parallel.shutdown()
    torch.save({"losses": [s.loss for s in steps], "tokens": [s.tokens for s in steps], "steps": [s.step for s in steps],
                "grad_norms": [s.grad_norm for s in steps], "step_seconds": [s.step_seconds for s in steps],
                "loss_scales": [s.loss_scale for s in steps], "skipped": [s.skipped for s in steps],
                "state": state, "loaded": loaded, "committed": [c.step for c in r.store.committed],
                "started_digests": started.get("digests", {}), "started_rss": started.get("rss", 0), "end_digests": digests,
                "peak_rss": peak_rss()},
               out / f"rank{rank}.pt")  # fmt: skip


def _guard(inject: list, rank: int, out: Path, current: Any):
    """A StepGuard firing ``inject`` (``[kind, step, rank]`` triples) at the step the loop is
    running now (``current()``: the Rank, once built); None when there is nothing to inject."""
    if not inject:
        return None
    from services.rank.faults import FaultInjector, Injection, StepGuard

    def step() -> int:
        up = current().up
        done, started = up.of(engine_pb2.StepCompleted), up.of(engine_pb2.TrainingLoopStarted)
        return (done[-1].step if done else started[-1].start_step if started else 0) + 1

    injector = FaultInjector(
        [Injection(k, int(s), int(r)) for k, s, r in inject], "job", rank, marker_dir=out / "faults"
    )
    return StepGuard(step, injector=injector)


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of ``t``'s float32 bytes (row-major): equal digests, bit-identical tensors."""
    import hashlib

    return hashlib.sha256(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()).hexdigest()


def full_optimizer_state(r: Rank) -> dict[str, torch.Tensor]:
    """The optimizer's moments, whole tensors keyed ``<param FQN>.<exp_avg|exp_avg_sq|step>``."""
    from torch.distributed.tensor import DTensor

    from services.contract import Module

    state = r.bus.port(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER)(engine_pb2.ExportState()).payload.state_dict()[
        "state"
    ]
    return {f"{fqn}.{k}": (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for fqn, per in sorted(state.items()) for k, v in sorted(per.items())}  # fmt: skip


class MemoryLimit:
    """A memory cgroup per rank process: the kernel charges it every page the process
    touches (its heap, the tensors' storage, the page cache it brings in) and OOM-kills it
    (SIGKILL) when the charge would pass ``limit_bytes``; its peak charge is read back.

    Why a cgroup and not RLIMIT_AS: RLIMIT_AS caps virtual address space, and a torch +
    gloo process reserves far more of it than it ever touches (each thread's 8 MiB stack,
    glibc's 64 MiB malloc arena per thread, every shared library's whole mapping, the
    allocator's unreturned reservations), by amounts that vary with the thread count; a cap
    set at a budget of resident memory then fails the process at start-up or at a thread
    spawn, not where the model's memory grows, and one set above those reservations does not
    bound the resident memory. The memory controller charges resident pages only, which is
    what a device's memory is to FSDP. (Pages of the shared libraries already cached by
    another process are not charged: the same for every configuration compared.)

    cgroup v1 (``/sys/fs/cgroup/memory``) or v2 (a child of ``/sys/fs/cgroup`` with the
    memory controller): both need root; :meth:`unavailable` says why not otherwise.
    """

    V1, V2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")

    def __init__(self, limit_bytes: int, tag: str, ranks: int):
        self.limit = limit_bytes
        v1 = (self.V1 / "memory.limit_in_bytes").exists()
        root = self.V1 if v1 else self.V2
        # (limit, peak, OOM events, swap cap) files: v1's names, v2's names.
        self._files = (
            ("memory.limit_in_bytes", "memory.max_usage_in_bytes", "memory.oom_control", "memory.memsw.limit_in_bytes")
            if v1
            else ("memory.max", "memory.peak", "memory.events", "memory.swap.max")
        )
        self.dirs = [root / f"surge-test-{tag}-{os.getpid()}-rank{r}" for r in range(ranks)]
        try:
            for d in self.dirs:
                d.mkdir()
                limit, _, _, swap = self._files
                (d / limit).write_text(str(limit_bytes))
                if (d / swap).exists():  # no swapping out instead of failing (v2: a swap cap of 0)
                    (d / swap).write_text(str(limit_bytes) if v1 else "0")
        except OSError:
            self.close()
            raise

    @classmethod
    def unavailable(cls) -> str:
        """Why memory cgroups cannot be made here ("" when they can)."""
        try:
            probe = cls(1 << 30, "probe", 1)
        except OSError as e:
            return f"no writable memory cgroup (v1 {cls.V1} or v2 {cls.V2}, root needed): {e}"
        probe.close()
        return ""

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s cgroup: a shell puts its own pid in the cgroup,
        then execs ``argv`` (same pid), so everything the rank touches from exec on is charged
        (no preexec_fn: it is not safe in a parent with threads)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.dirs[rank] / "cgroup.procs"), *argv]

    def peak(self, rank: int) -> int:
        """The most memory rank ``rank``'s cgroup was ever charged, bytes."""
        return int((self.dirs[rank] / self._files[1]).read_text())

    def oom_killed(self, rank: int) -> bool:
        """Whether the kernel's OOM killer killed a process of rank ``rank``'s cgroup."""
        for line in (self.dirs[rank] / self._files[2]).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value) > 0
        return False

    def close(self) -> None:
        for d in self.dirs:
            if d.exists():
                d.rmdir()  # (empty once its processes have exited)


def run_config(
    config: dict[str, Any],
    out: Path,
    *,
    timeout: float = 240.0,
    expect_failure: bool = False,
    memory_limit: int = 0,
) -> list[dict[str, Any]]:
    """Start ``dp * tp * pp`` rank processes for ``config``, wait, return each rank's results.
    ``memory_limit`` (bytes): each rank runs in a memory cgroup of that limit
    (:class:`MemoryLimit`); each result then holds ``charged_peak`` (bytes) and
    ``oom_killed``. Every result holds ``exit_code``; a rank that died before writing its
    results (killed) has only those.

    Raises AssertionError with the ranks' output tails when any rank fails (with
    ``expect_failure``: when any rank succeeds; the results then hold each rank's error)."""
    sys.path.insert(0, str(REPO))
    from tests.conftest import free_ports
    from tests.rank_forks import RankProcess

    world = config.get("dp", 1) * config.get("tp", 1) * config.get("pp", 1)
    out.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    limit = MemoryLimit(memory_limit, out.name, world) if memory_limit else None
    if limit is not None:
        # glibc keeps freed heap memory for reuse, and a freed tensor of a few MiB raises its
        # mmap threshold so the next ones come from that heap too; at 64 KiB every tensor
        # beyond it is a mapping of its own, returned when freed, so the cgroup is charged
        # the tensors alive, not what the allocator happened to keep (as services/memory_estimate.py measures).
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    argv = [[sys.executable, str(HERE / "harness.py"), json.dumps(config), str(r), str(world), str(port), str(out)]
            for r in range(world)]  # fmt: skip
    try:
        if limit is not None:  # each rank a new interpreter inside its own memory cgroup
            procs = [
                subprocess.Popen(limit.command(r, argv[r]), cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for r in range(world)
            ]  # fmt: skip
        else:  # forked with torch and the rank's modules imported (tests/rank_forks.py)
            extra = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            procs = [
                RankProcess(HERE / "harness.py", a[2:], out / f"rank{r}.log", REPO, extra) for r, a in enumerate(argv)
            ]
        outputs = []
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                if limit is not None:
                    outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
                else:  # (its output is in its log, read below)
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if limit is None:
                for p in procs:
                    p.log.close()
                outputs = [Path(p.log.name).read_text() for p in procs]
        codes = [p.returncode for p in procs]
        if expect_failure:
            assert all(codes), f"config {config}: exit codes {codes}, expected every rank to fail"
        else:
            tails = "\n".join(o[-3000:] for o in outputs)
            assert codes == [0] * world, f"config {config}: exit codes {codes}\n{tails}"
        results = []
        for r, code in enumerate(codes):
            path = out / f"rank{r}.pt"
            result = torch.load(path) if path.exists() else {}
            started = out / f"started{r}.json"
            if started.exists() and not result:  # killed after it started: what it wrote then
                begun = json.loads(started.read_text())
                result = {"started_digests": begun.get("digests", {}), "started_rss": begun["rss"]}
            result["exit_code"] = code
            if limit is not None:
                result["charged_peak"], result["oom_killed"] = limit.peak(r), limit.oom_killed(r)
            results.append(result)
        return results
    finally:
        if limit is not None:
            limit.close()


if __name__ == "__main__":
    rank_main(sys.argv[1:])
    exit_now(0)  # no interpreter finalization under gloo's threads (see exit_now)
