"""A simulated rank: the scale test bed's torch-free rank process (issue 27 item 7).

    python -m services.rank.simulated --session HOST:PORT --job JOB_ID --rank R

Started by the node agent instead of ``python -m services.rank`` for a job whose spec has a
``simulate:`` section (services/jobspec/training.py ``SimulateSpec``; services/worker/rank_process.py
``rank_module_for``). It speaks the real rank's protocols with the model's compute replaced
by a sleep, so control, data and store see what they see from real ranks:

* control, through the node agent (``WorkerService.RankSession``, session.py): hello, init
  and assignment, ``TrainingLoopStarted``, then on ``StartTraining`` one ``StepCompleted``
  per step, ``SaveCompleted`` per committed checkpoint (rank 0), ``SnapshotFailed`` per
  skipped save, heartbeats with the phase, and ``TrainingLoopFinished`` (or
  ``TrainingLoopFailed``); ``StopTraining`` and ``PauseTraining`` / ``ResumeTraining`` at a
  step boundary;
* data (data_stream.py): ``Mount`` and the train ``Stream`` at this rank's data-parallel
  coordinates; each step takes ``data.grad_accum`` micro-batches from it;
* store: a metric record per step through the node agent (the real rank's metrics_client.py) and,
  at every checkpoint interval (and at the end), a real shard of ``simulate.shard_bytes``
  per rank through ``BeginSave`` / the chunk files / ``CommitSave`` (shard_save.py).

A step is: wait for the micro-batches (timed: the test bed's batch latency), sleep
``simulate.step_time_s`` (the forward, backward and optimizer a real rank would run), then
one round of the ranks' collective (collective.py; the gradient all-reduce's place: every
rank's step ends together, and the ranks agree there on the boundary of an operator's stop
or pause: the same slots of held command numbers as a real rank's all-reduce carries,
services/common/boundary_commands.py). The
loss is not computed (0 in every StepCompleted): nothing here trains.

Not simulated: resuming from a checkpoint (a launch whose InitJob names one fails with
config_error), rebuilds and resizes in place, evaluation, tp/pp peers (refused at submit).

At its end the rank logs one ``sim_report`` line (JSON with ``SURGE_LOG_FORMAT=json``): its
stream start latency, the wait for every micro-batch, and (rank 0) every save's outcome and
BeginSave -> commit time. bench/scale.py reads these from the rank logs.
"""

from __future__ import annotations

import argparse
import json
import queue
import signal
import sys
import time
from typing import Any, NoReturn

from services.common import boundary_commands, fencing
from services.common import phase as ph
from services.common.boundary_commands import HeldCommands
from services.common.logs import configure
from services.common.process_exit import exit_now
from services.contract import Module, engine_pb2, route_pb2, store_pb2
from services.rank.metrics_client import MetricsClient
from services.rank.simulated.collective import Collective
from services.rank.simulated.data_stream import TrainStream
from services.rank.simulated.session import SessionLost, SimSession
from services.rank.simulated.shard_save import ShardSaver
from services.rank.store_liveness import STAGING_BUDGET_S

EXIT_FAILED = 1
MIN_COLLECTIVE_TIMEOUT_S = 60.0  # as a real rank's process group (parallel_strategy.collective_timeout_s)


class ConfigError(ValueError):
    fault_class = "config_error"


class SimulatedRank:
    """One simulated rank's run: set-up, steps, saves and its end (module docstring)."""

    def __init__(self, session: SimSession, init: engine_pb2.InitJob, assignment: engine_pb2.RankAssignment, log: Any):
        self._session, self._init, self._log = session, init, log
        self._job, self._rank, self._world = init.job_id, assignment.rank, assignment.world_size
        self._spec = spec = json.loads(init.spec_json)
        if spec.get("simulate") is None:
            raise ConfigError("InitJob.spec_json: no simulate section (this program runs simulated ranks only)")
        if init.resume_version or init.heal_from_peer:
            raise ConfigError(
                f"simulated ranks do not resume (InitJob names {init.resume_version or 'a heal from a peer'})"
            )
        self._sim, self._data_spec, self._checkpoint = spec["simulate"], spec["data"], spec.get("checkpoint", {})
        liveness = spec.get("liveness", {})
        session.set_heartbeat_interval(liveness.get("heartbeat_interval_seconds", 1.0))
        self._timeout_s = max(MIN_COLLECTIVE_TIMEOUT_S, liveness.get("collective_timeout_seconds", 0.0))
        # The checkpoint-staging phase's budget (the spec's default when it names none): how long
        # a save may wait for a busy store, and its agreements for a peer that waits so.
        self._staging_s = float((liveness.get("phase_seconds") or {}).get("checkpoint_staging", STAGING_BUDGET_S))
        self._step, self._durable = 0, 0
        self._waits: list[float] = []  # seconds waited for each micro-batch
        self._collective: Collective | None = None
        self._stream: TrainStream | None = None
        self._metrics: MetricsClient | None = None
        self._saver: ShardSaver | None = None
        # Boundary commands held until every rank holds them (agreed in the step's collective
        # round, as a real rank's all-reduce agrees: services/common/boundary_commands.py).
        self._commands = HeldCommands()
        self._stop: engine_pb2.StopTraining | None = None  # the stop in force at this boundary
        self._pause_cmd: engine_pb2.PauseTraining | None = None
        self._assignment = assignment

    def run(self) -> bool:
        """Set up, report started, train to the end or a stop. Returns whether it stopped."""
        t0 = time.perf_counter()
        a = self._assignment
        self._collective = Collective(self._rank, self._world, (a.master_addr, a.master_port), self._timeout_s)
        # Metric records go through the node agent (one Record stream per node), as the real
        # rank's metrics_client.py sends them: the same client, fed by hand.
        self._metrics = MetricsClient(self._session.send_metrics)
        self._session.on_metrics_ack = self._metrics.acked
        accum = self._data_spec.get("grad_accum", 1)
        self._stream = TrainStream(
            self._init.data_address, self._data_spec, self._rank, self._world, read_ahead=2 * accum + 2,
            on_start=lambda seconds: self._log.info("sim_stream_started", stream_start_s=round(seconds, 4)),
        )  # fmt: skip
        metrics = self._spec.get("metrics", {})
        wandb = metrics.get("wandb") or {}
        self._metrics.log_collection_config(store_pb2.LogCollectionConfig(
            job_id=self._job, tensorboard=metrics.get("tensorboard", False),
            wandb_project=wandb.get("project", ""), wandb_mode=wandb.get("mode", ""),
            team=self._spec.get("team", ""),
        ))  # fmt: skip
        self._saver = ShardSaver(
            self._init.store_address, self._job, self._rank, self._world, self._collective,
            self._sim["shard_bytes"], self._checkpoint, self._init.spec_json, self._session.send_up, self._log,
            staging_budget_s=self._staging_s, agree_timeout_s=max(self._timeout_s, self._staging_s),
        )  # fmt: skip
        self._session.send_up(engine_pb2.TrainingLoopStarted(
            job_id=self._job, rank=self._rank, start_step=0, startup_seconds=time.perf_counter() - t0,
        ))  # fmt: skip
        if not self._await_start():
            return self._finish(stopped=True)
        steps = self._spec["steps"]
        while self._step < steps:
            step = self._step + 1
            stop, pause = self._run_step(step)
            self._step = step
            last = step == steps
            every = self._checkpoint.get("every_steps", 100)
            if (every and step % every == 0) or (last and self._checkpoint.get("at_end", True)):
                self._save(step)
            if last:
                break
            if stop:
                if self._stop.checkpoint:
                    self._save(step)
                return self._finish(stopped=True)
            if pause and not self._pause(step):
                return self._finish(stopped=True)
        return self._finish(stopped=False)

    def report(self, outcome: str) -> None:
        """The test bed's figures of this rank, one log line (module docstring)."""
        self._log.info(
            "sim_report",
            outcome=outcome,
            world_size=self._world,
            steps=self._step,
            stream_start_s=self._stream.start_s if self._stream is not None else None,
            saves=self._saver.saves if self._saver is not None else [],
            metrics_unacknowledged=self._metrics.held_records if self._metrics is not None else 0,
        )

    def close(self) -> None:
        for part in (self._saver, self._metrics, self._stream, self._collective):
            if part is not None:
                part.close()

    # ------------------------------------------------------------------ private

    def _run_step(self, step: int) -> tuple[bool, bool]:
        """One step; returns the world's (stop, pause) at its boundary."""
        t0 = time.perf_counter()
        s = self._session
        s.mark(ph.DATA_WAIT)
        tokens, wait = 0, 0.0
        waits = []
        for _ in range(self._data_spec.get("grad_accum", 1)):
            mb, waited = self._stream.next(self._timeout_s)
            tokens, wait = tokens + mb.tokens, wait + waited
            waits.append(waited)
        self._waits += waits
        s.mark(ph.FORWARD)
        time.sleep(self._sim["step_time_s"])  # the model's forward, backward and update
        s.mark(ph.COLLECTIVE)
        self._take_commands()
        held = self._commands.window()
        agreed = self._collective.exchange(
            [tokens, *boundary_commands.slots(held)],
            lambda every: [sum(column) for column in zip(*every, strict=True)],
        )
        self._commands.agree(boundary_commands.agreed(held, agreed[1:], self._world))
        due = self._commands.due(step)
        self._stop = next((m for m in due if isinstance(m, engine_pb2.StopTraining)), None)
        self._pause_cmd = next((m for m in due if isinstance(m, engine_pb2.PauseTraining)), None)
        for m in due:
            if isinstance(m, engine_pb2.ProfileSteps):  # (held for its number: the numbers have no gap)
                s.send_up(engine_pb2.ProfileRecorded(
                    job_id=self._job, rank=self._rank, seq=m.seq, first_step=step + 1, last_step=step,
                    error="a simulated rank has no compute to profile",
                ))  # fmt: skip
        step_s = time.perf_counter() - t0
        done = engine_pb2.StepCompleted(
            job_id=self._job, rank=self._rank, step=step, loss=0.0, tokens=round(agreed[0]),
            tokens_per_second=agreed[0] / step_s, step_seconds=step_s, data_wait_seconds=wait,
            forward_seconds=self._sim["step_time_s"], unix_time=time.time(), world_size=self._world,
            commands_agreed=self._commands.agreed_seq,
        )  # fmt: skip
        s.mark(ph.FORWARD, step=step, step_seconds=step_s)
        s.send_up(done)
        self._log.info("sim_step", step=step, batch_waits_s=[round(w, 6) for w in waits], step_s=round(step_s, 4))
        self._metrics.on_step_completed(done)
        return self._stop is not None, self._pause_cmd is not None

    def _save(self, step: int) -> None:
        if self._durable == step:
            return
        self._session.mark(ph.CHECKPOINT_STAGING)
        self._saver.save(step)
        self._durable = step

    def _take_commands(self) -> None:
        """Hold an operator's stop or pause that came down (agreed on in the step's round)."""
        while True:
            try:
                msg = self._session.commands.get_nowait()
            except queue.Empty:
                return
            self._command(msg)

    def _command(self, msg: Any) -> None:
        if isinstance(
            msg,
            (
                engine_pb2.StopTraining,
                engine_pb2.PauseTraining,
                engine_pb2.RevokeStandingOrder,
                engine_pb2.ProfileSteps,
            ),
        ):
            self._commands.receive(msg)  # (a revoke: simulated ranks have no standing orders)
        else:
            self._log.info("sim_command_ignored", type=msg.DESCRIPTOR.full_name)

    def _await_start(self) -> bool:
        """Block until StartTraining (True) or StopTraining (False)."""
        while True:
            msg = self._session.commands.get()
            if isinstance(msg, engine_pb2.StartTraining):
                self._commands.start(msg.command_seq)
                self._session.mark(ph.DATA_WAIT, stepping=True)
                return True
            if isinstance(msg, engine_pb2.StopTraining):
                return False
            self._command(msg)

    def _pause(self, step: int) -> bool:
        """Paused at ``step``'s boundary until ResumeTraining (True) or StopTraining (False)."""
        if self._pause_cmd.checkpoint:
            self._save(step)
            self._session.mark(ph.CHECKPOINT_STAGING)  # (the commit's wait has the staging budget)
            self._saver.flush()
        self._session.mark(ph.IDLE, stepping=False)
        self._session.send_up(engine_pb2.TrainingLoopPaused(job_id=self._job, rank=self._rank, step=step))
        # A stop held, agreed or not, ends the pause (every rank paused at this boundary).
        while (stop := self._commands.take(engine_pb2.StopTraining, step)) is None:
            msg = self._session.commands.get()
            if isinstance(msg, engine_pb2.ResumeTraining):
                if msg.rebuild:
                    raise ConfigError("simulated ranks do not resize in place (ResumeTraining.rebuild)")
                self._session.mark(ph.DATA_WAIT, stepping=True)
                return True
            self._command(msg)
        if stop.checkpoint:
            self._save(step)
        return False

    def _finish(self, stopped: bool) -> bool:
        self._session.mark(ph.CHECKPOINT_STAGING)  # the last commit's wait has the staging budget
        self._saver.flush()  # the last commit, before anyone hears of the end
        # Waits (bounded: METRICS_FLUSH_S) for the store's ack of every record before it.
        self._metrics.stop_log_collection(store_pb2.StopLogCollection(job_id=self._job, rank=self._rank))
        self.report("stopped" if stopped else "finished")
        self._session.send_up(
            engine_pb2.TrainingLoopFinished(job_id=self._job, rank=self._rank, step=self._step, stopped=stopped)
        )
        return stopped


def main(argv: list[str] | None = None) -> NoReturn:
    ap = argparse.ArgumentParser(prog="python -m services.rank.simulated", description=__doc__.split("\n")[0])
    ap.add_argument("--session", required=True, help="HOST:PORT of the node agent's WorkerService")
    ap.add_argument("--job", required=True, help="job id")
    ap.add_argument("--rank", type=int, required=True, help="global rank")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log = configure("rank", job=args.job, rank=args.rank)
    session = SimSession(args.session, args.job, args.rank)
    rank: SimulatedRank | None = None
    code = 0
    try:
        init, assignment = session.receive_setup()
        fencing.set_identity(args.job, args.rank, assignment.generation)  # (a replaced one is refused)
        rank = SimulatedRank(session, init, assignment, log)
        rank.run()
        log.info("rank_finished")
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the exit code says it
        code = EXIT_FAILED
        detail = f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]
        log.error("rank_failed", error=detail)
        if rank is not None:
            rank.report("failed")
        fault_class = getattr(e, "fault_class", "internal")
        session.send_up(engine_pb2.TrainingLoopFailed(
            job_id=args.job, rank=args.rank, step=rank._step if rank is not None else 0,
            fault_class=fault_class, detail=detail,
            failure=route_pb2.Failure(cause=_CAUSES.get(fault_class, route_pb2.FAILURE_INTERNAL), detail=detail,
                                      exception=type(e).__qualname__, module=Module.L2_TRAINING_LOOP,
                                      job_id=args.job, rank=args.rank),
        ))  # fmt: skip
        if not isinstance(e, (SessionLost, KeyboardInterrupt, SystemExit)):
            # L1 decides what becomes of this rank, as for a real one; a broken collective too:
            # a survivor that exited at once raced its release and its exit read as a cause.
            session.wait_released()
    finally:
        if rank is not None:
            rank.close()
        session.close(timeout=5.0)
    sys.stdout.flush()
    exit_now(code)


_CAUSES = {
    "comm_error": route_pb2.FAILURE_COMMUNICATION,
    "config_error": route_pb2.FAILURE_INVALID_INPUT,
    "data_unavailable": route_pb2.FAILURE_UNAVAILABLE,
    "checkpoint_error": route_pb2.FAILURE_IO,
    "session_lost": route_pb2.FAILURE_UNAVAILABLE,
}


if __name__ == "__main__":
    main()
