"""How a node agent launches, watches and reaps its rank processes (a part of ``NodeAgent``,
services/worker/node_agent.py, which holds the state these methods share: ``_ranks``, ``_lock``,
the log pump, the fork server).

A launch opens the rank's bounded log, binds it to its device, reads the OOM-kill counter of
its cgroup and spawns it (forked by the fork server, or a new interpreter); one waiter thread
per rank process reports it RUNNING, every stop and continue by a signal, and its exit with
the cause read from evidence (services/worker/exit_cause.py), after the events it sent just
before dying.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any

from services.common.beat_grid import PHASE_ENV, node_phase
from services.contract import Module, control_pb2, engine_pb2
from services.contract.relay import pack
from services.worker.device_binding import CPU_AFFINITY_ENV, bind_rank
from services.worker.exit_cause import ExitEvidence, OomCounter, classify
from services.worker.launch_check import evaluation_command_missing, spawn_not_started
from services.worker.rank_logs import RankLog
from services.worker.rank_process import (
    END_OF_COMMANDS,
    RankProcess,
    describe_stop,
    rank_command_line,
    rank_environment,
    rank_module_for,
    safe_file_name,
    signal_group,
    told_assignment,
    wait_reporting_stops,
)

# After a rank process dies, wait at most this long for its RankSession stream to end, so
# the events it sent just before dying go up before its RankExited (the kernel closes the
# socket at exit, so this normally takes a millisecond).
STREAM_SETTLE_SECONDS = 0.5
# The same for a rank that exited 0 before its loop's end was read off its stream: that end (its
# TrainingLoopFinished) is what makes the exit a normal one; a RankExited ahead of it is graded a
# rank lost early (orchestrator/triage.py) and recovered. A loaded agent's stream reader can lag
# the exit by more than the half second; a clean exit's report waiting costs no recovery time.
CLEAN_EXIT_SETTLE_SECONDS = 10.0
# A rank ended: how long the pump may take to read the rest of its output (a helper that left
# its process group and still holds the pipe is not waited for longer).
LOG_DRAIN_SECONDS = 2.0
SPAWN_FAILED_EXIT_CODE = 127  # shell convention for "could not execute"


class RankLauncher:
    """Rank processes' launch, watch and reap (a part of ``NodeAgent``)."""

    def _launch_one(self, job_id: str, init: engine_pb2.InitJob, assignment: engine_pb2.RankAssignment) -> None:
        key = (job_id, assignment.rank)
        with self._lock:
            if self._stopping:
                self._log.warning("launch refused: the agent is stopping", job_id=job_id, rank=assignment.rank)
                return
            old = self._ranks.get(key)
            for k in [k for k, r in self._ranks.items() if r.exited.is_set()]:
                del self._ranks[k]  # ended and reported: nothing will address them again
        if old is not None and not old.exited.is_set():
            # Two processes of one rank would share its log and fight for its session.
            # A process already reaped whose exit is being reported (it died on its own just
            # before control's release, which therefore skipped it) ends within the settle
            # time: wait for it like for a released one.
            if not old.released and not old.dead:
                self._log.error(
                    "launch refused: rank already running here", job_id=job_id, rank=assignment.rank, pid=old.proc.pid
                )
                return
            if not old.exited.wait(old.grace_seconds + CLEAN_EXIT_SETTLE_SECONDS + 2.0):
                self._log.error(
                    "launch refused: released rank has not ended", job_id=job_id, rank=assignment.rank, pid=old.proc.pid
                )
                return
        log_path = self._logs_dir / f"{safe_file_name(job_id)}.rank{assignment.rank}.log"
        try:
            rank_log = RankLog(
                log_path, self._log_settings, lambda rate: self._log_flood(key, rank_log, rate), log=self._log
            )
        except OSError as e:  # (the logs directory cannot be written: the rank's output would be lost)
            rank_log = None
            self._log.error("rank log cannot be opened", job_id=job_id, rank=assignment.rank, error=str(e))
        module = rank_module_for(init, self._rank_module)  # a `simulate:` job runs the simulated rank
        argv = rank_command_line(module, self._session_address, job_id, assignment.rank)
        binding = bind_rank(assignment, self._devices)
        env = rank_environment(os.environ, binding)
        env[PHASE_ENV] = f"{node_phase(self._worker_id):.6f}"  # this node's place on the beat grid
        # The OOM-kill counter of the cgroup the rank will share with this agent, read before
        # it starts: a rise by its reap is the evidence of an OOM kill (exit_cause.py).
        oom = OomCounter.of_process()
        oom_at_launch = oom.read()
        if why := evaluation_command_missing(init.spec_json, env):  # (found now, not after the load)
            if rank_log is not None:
                rank_log.close()
            self._not_started(job_id, assignment, f"launch refused: {why}", control_pb2.EXIT_NOT_STARTED)
            return
        spawned = threading.Event()  # set once the rank is recorded: its hello may come first
        with self._lock:
            self._spawning[key] = spawned
        try:
            if rank_log is None:
                raise OSError(f"cannot open {log_path}")
            proc = self._spawn(argv, rank_log, env, forked=module == self._rank_module)
        except OSError as e:
            self._spawned(key, spawned)
            if rank_log is not None:
                rank_log.close()
            # A missing or non-executable program is permanent; anything else (the host out of
            # processes or memory, the log unwritable) a relaunch may cure: typed by errno.
            cause = control_pb2.EXIT_NOT_STARTED if spawn_not_started(e) else control_pb2.EXIT_ERROR
            self._not_started(job_id, assignment, f"spawn failed: {e}", cause)
            return
        r = RankProcess(
            job_id=job_id, rank=assignment.rank, init=init, assignment=assignment, proc=proc, log_path=log_path,
            log=rank_log,
            told=told_assignment(assignment, binding), oom=oom, oom_at_launch=oom_at_launch,
        )  # fmt: skip
        with self._lock:
            self._ranks[key] = r
            self._launched[job_id].setdefault(assignment.rank, []).append(rank_log)
            if self._stopping:  # shutdown began while it was spawning and did not see it
                r.agent_signal = signal.SIGKILL
                signal_group(proc.pid, signal.SIGKILL)
        self._spawned(key, spawned)
        threading.Thread(target=self._watch, args=(r,), name=f"wait-{job_id}-{r.rank}", daemon=True).start()
        self._log.info(
            "rank launched", job_id=job_id, rank=r.rank, pid=proc.pid, device=assignment.device,
            sees=binding.device, cpus=binding.env.get(CPU_AFFINITY_ENV, ""), log=str(log_path),
        )  # fmt: skip

    def _not_started(
        self, job_id: str, assignment: engine_pb2.RankAssignment, detail: str, cause: control_pb2.ExitCause
    ) -> None:
        """The rank was not started: stated as its exit (code 127, ``cause``) for L1-3 to grade."""
        self._log.error("rank not started", job_id=job_id, rank=assignment.rank, error=detail)
        failed = self._exited_event(job_id, assignment.rank, SPAWN_FAILED_EXIT_CODE, detail)
        failed.rank_exited.cause = cause
        failed.rank_exited.generation = assignment.generation  # (a launch's deaths count once: sick_nodes.py)
        self._emit(failed)

    def _log_spans(self, job_id: str) -> dict[int, list[tuple[int, int, int | None]]]:
        """rank -> the spans ``(inode, start, end)`` of its log files this agent's launches
        of it wrote, in order."""
        with self._lock:
            logs = {rank: list(launches) for rank, launches in self._launched.get(job_id, {}).items()}
        return {rank: [span for lg in launches for span in lg.spans()] for rank, launches in logs.items()}

    def _end_log_span(self, r: RankProcess) -> None:
        """``r`` ended (its process group killed): its output is written once the pump has
        read its pipe to the end; a helper that escaped the group and holds the pipe open is
        not waited for past ``LOG_DRAIN_SECONDS``: the pump then writes what the pipe holds
        and ends it. Its span of the log file ends there."""
        if r.log is not None:
            if not r.log.closed.wait(LOG_DRAIN_SECONDS):
                self._pump.finish(r.log)  # what the pipe holds is written, then the end
                r.log.closed.wait(LOG_DRAIN_SECONDS)
            r.log.close()

    def _log_flood(self, key: tuple[str, int], rank_log: RankLog, rate: float) -> None:
        """(The pump's thread.) A rank's output came faster than the bound: stated once per
        process (RankLogFlood, graded by L1-3); its file stays bounded by the rotation."""
        with self._lock:
            r = self._ranks.get(key)
            pid = r.proc.pid if r is not None and r.log is rank_log else 0
        s = self._log_settings
        self._log.warning(
            "rank logs too fast", job_id=key[0], rank=key[1], pid=pid, bytes_per_second=round(rate),
            threshold=s.flood_bytes_per_s, log=str(rank_log.path),
        )  # fmt: skip
        fact = control_pb2.RankLogFlood(
            job_id=key[0], rank=key[1], worker_id=self._worker_id, pid=pid, bytes_per_second=rate,
            threshold_bytes_per_second=s.flood_bytes_per_s, window_seconds=s.flood_window_s,
            max_file_bytes=s.max_bytes, backups=s.backups, unix_time=time.time(),
        )  # fmt: skip
        self._emit(control_pb2.WorkerEvent(routed=pack(fact, Module.EXT_HARDWARE)))

    def _rank_alive(self, job_id: str, rank: int) -> bool:
        with self._lock:
            r = self._ranks.get((job_id, rank))
            return r is not None and not r.exited.is_set()

    def _spawned(self, key: tuple[str, int], spawned: threading.Event) -> None:
        with self._lock:
            if self._spawning.get(key) is spawned:
                del self._spawning[key]
        spawned.set()

    def _spawn(self, argv: list[str], rank_log: RankLog, env: dict[str, str], forked: bool) -> Any:
        """The rank's process: forked by the fork server when it runs the agent's rank module
        and a server is there (a ``ForkedRank``), else a new interpreter (a ``Popen``)."""
        read, write = self._pump.pipe()  # its output: stdout and stderr, written by the pump
        proc: Any = None
        try:
            if forked and self._forkserver is not None:
                try:
                    proc = self._forkserver.spawn(argv, env, write)
                except OSError as e:  # (its next launch starts the server again)
                    self._log.warning("rank fork server failed: a new interpreter instead", error=str(e))
            if proc is None:
                proc = subprocess.Popen(
                    argv,
                    cwd=self._cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=write,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own process group: killed cleanly with its children
                )
        except OSError:
            os.close(read)
            raise
        finally:
            os.close(write)  # the child keeps its own copy: the pipe ends when it (and its helpers) end
        self._pump.attach(read, rank_log)
        return proc

    def _watch(self, r: RankProcess) -> None:
        """Waiter thread of one rank: report it watched (RUNNING), every stop and continue by a
        signal as it happens, and reap it the moment it ends and report that."""
        self._emit_process_state(r, control_pb2.RankProcessState.RUNNING)
        code = wait_reporting_stops(
            r.proc,
            stopped=lambda sig: self._emit_process_state(r, control_pb2.RankProcessState.STOPPED, sig),
            continued=lambda: self._emit_process_state(r, control_pb2.RankProcessState.RUNNING),
        )
        reaped = time.time()
        oom_at_reap = r.oom.read()
        with self._lock:
            r.dead = True  # from now on no session can attach to it
            had_session = r.session == "open"
            sent = r.agent_signal
        if had_session:
            early = code == 0 and not r.loop_ended and not r.released  # (a released rank's exit is graded so)
            r.stream_closed.wait(CLEAN_EXIT_SETTLE_SECONDS if early else STREAM_SETTLE_SECONDS)
        signal_group(r.proc.pid, signal.SIGKILL)  # helpers the rank left behind die with it
        if r.kill_timer is not None:
            r.kill_timer.cancel()
        r.commands.put(END_OF_COMMANDS)  # a stream still held open by a stray helper ends now
        # The agent sent the signal that ended it only if that is the signal it died of.
        sender = os.getpid() if code < 0 and -code == sent else 0
        exit_cause = classify(ExitEvidence(code, r.oom_at_launch, oom_at_reap, sender))
        detail = exit_cause.detail + (" after release" if r.released else "") + f"; log {r.log_path}"
        self._log.info(
            "rank exited", job_id=r.job_id, rank=r.rank, pid=r.proc.pid, exit_code=code, released=r.released,
            cause=control_pb2.ExitCause.Name(exit_cause.cause),
        )  # fmt: skip
        event = self._exited_event(r.job_id, r.rank, code, detail, reaped=reaped, released=r.released, pid=r.proc.pid)
        event.rank_exited.cause = exit_cause.cause
        event.rank_exited.signal_sender_pid = sender
        event.rank_exited.oom_counter_read = r.oom_at_launch is not None and oom_at_reap is not None
        # Which launch it was: a node's sick count takes a launch's deaths there once, and a
        # relaunched rank's death again (services/control/sick_nodes.py).
        event.rank_exited.generation = r.assignment.generation
        self._emit(event)
        self._end_log_span(r)  # before `exited`: a log tail that sees it gone finds the span's end
        r.exited.set()

    def restate_processes(self) -> None:
        """State again what is known of every live rank process (RUNNING or STOPPED): for a
        new control session, whose fault detector has not heard it (a control restart)."""
        with self._lock:
            live = [r for r in self._ranks.values() if not r.dead]
        for r in live:
            self._emit_process_state(r, r.process_state, r.stop_signal)

    def _emit_process_state(self, r: RankProcess, state: int, stop_signal: int = 0) -> None:
        was = r.process_state
        r.process_state, r.stop_signal = state, stop_signal
        if state == control_pb2.RankProcessState.STOPPED:
            self._log.warning("rank stopped", job_id=r.job_id, rank=r.rank, pid=r.proc.pid, signal=stop_signal)
        elif was == control_pb2.RankProcessState.STOPPED:
            self._log.info("rank continued", job_id=r.job_id, rank=r.rank, pid=r.proc.pid)
        fact = control_pb2.RankProcessState(
            job_id=r.job_id,
            rank=r.rank,
            worker_id=self._worker_id,
            pid=r.proc.pid,
            state=state,
            signal=stop_signal,
            unix_time=time.time(),
            detail=describe_stop(stop_signal) if state == control_pb2.RankProcessState.STOPPED else "running",
        )
        self._emit(control_pb2.WorkerEvent(routed=pack(fact, Module.EXT_HARDWARE)))

    def _kill_if_alive(self, r: RankProcess) -> None:
        with self._lock:
            if not r.dead:
                r.agent_signal = signal.SIGKILL
                signal_group(r.proc.pid, signal.SIGKILL)

    def _exited_event(
        self,
        job_id: str,
        rank: int,
        code: int,
        detail: str,
        *,
        reaped: float | None = None,
        released: bool = False,
        pid: int = 0,
    ) -> control_pb2.WorkerEvent:
        return control_pb2.WorkerEvent(
            rank_exited=control_pb2.RankExited(
                job_id=job_id,
                rank=rank,
                exit_code=code,
                worker_id=self._worker_id,
                detail=detail,
                unix_time=reaped or time.time(),
                released=released,
                pid=pid,
                # Ended by this agent's own shutdown (it is leaving): a departure, not a crash.
                departing=self._stopping and not released,
            )
        )
