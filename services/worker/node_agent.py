"""The node agent (service `worker`): a stable endpoint per node that supervises rank processes.

In the route table the node agent is ``EXT_HARDWARE``: it speaks for the devices and the
processes of its node. It takes no decisions (DESIGN.md, law 2): it executes what control
commands and states facts.

Facts it reports up the ``ControlService.WorkerSession`` stream (``WorkerEvent``):

* ``register``: the node's hardware, first message of every session (also after a
  reconnect, with the same ``worker_id``).
* ``rank_event``: every ``RankEvent`` a local rank sends on its ``RankSession``, in the
  order received, ``hello``, ``heartbeat`` and ``routed`` (any routed event by name) included (``audit`` stays
  here: it answers the agent's own question, see :meth:`NodeAgent.audit`).
* ``rank_exited``: a rank process ended (``exit_code`` < 0: killed by that signal), after
  the events that rank sent before it ended, with the time it was reaped and whether a
  ``release`` asked for it.
* ``routed`` ``RankProcessState``: a rank process is watched (RUNNING, when its waiter
  starts), was stopped by a signal (STOPPED: SIGSTOP, SIGTSTP, a debugger) or continued
  (RUNNING), as the kernel tells its parent; stated again for every live rank when a new
  control session registers (a restarted control has not heard it).
* ``memory_pressure``: the node's available memory fell below its pressure threshold
  (``under_pressure`` true), or rose back above it plus a hysteresis margin (false). Edge-
  triggered: one report per crossing, none while the state holds.
* ``routed`` ``DeviceMemoryUsage`` and ``HardwareError``: a GPU's memory crossed its pressure
  threshold, or the GPU reported an error (ECC, Xid) or throttled clocks, sampled through NVML;
  each once per change.

Commands it executes (``WorkerCommand``, in arrival order):

* ``launch``: start one process per ``RankAssignment``; when a rank says ``hello`` it is
  pushed ``RankCommand{init}`` then ``RankCommand{assignment}``, once, then whatever
  control relays to its job.
* ``routed`` (any routed message by its full name, :mod:`services.contract.relay`): with
  ``job_id``, a command for that job's ranks, relayed to each live one as
  ``RankCommand{routed}`` once the route table lets its sender command its receiver (a rank
  module); without, a command for this agent (EXT_HARDWARE: ``LaunchRanks``,
  ``ReleaseRanks``), put on the agent's own bus, whose handlers are the methods below.
* ``launch``, ``release``: LaunchRanks / ReleaseRanks, addressed to this node by field.
* ``tail_rank_logs`` / ``stop_tailing`` (operator log plumbing for ``StreamLogs``): send
  the job's rank log lines on this node up as ``rank_log_lines`` batches (then, with
  ``follow``, new lines until the ranks have exited), ending with ``rank_log_lines{done}``.
* ``release``: SIGTERM the job's rank process groups, SIGKILL after the grace period (or
  at once with ``kill``); each process is reaped by its own waiter.

Where each part lives (this file keeps :class:`NodeAgent`, which launches, releases and
relays, and wires the parts below; ``__main__.py`` builds them):

* ``hardware.py``: the hardware probe behind ``register``;
* ``memory_pressure.py``: the memory sampler behind ``memory_pressure``;
* ``gpu_health.py``: the NVML sampler behind ``DeviceMemoryUsage`` and ``HardwareError`` (off
  without NVML);
* ``control_link.py``: the session with control and its outbox (sequence numbers, resend
  after a reconnect, acknowledgements);
* ``rank_process.py``: a rank process's record, argv, environment and signals;
* ``rank_session.py``: the ``RankSession`` servicer local ranks connect to;
* ``log_tail.py``: the rank log tails behind ``tail_rank_logs``;
* ``memory_copies.py``: the in-memory copies of the local ranks' newest checkpoint, served
  to them and replicated to the job's peer agent (``MemoryCopyService``).

Threads, and why each exists:

* the control-session thread keeps the stream open, reconnects when it breaks, and
  executes commands one by one (so a ``release`` then ``launch`` of the same rank is
  ordered);
* one waiter per rank process, blocked in ``waitid``: a death, and a stop or continue by a
  signal, is reported within milliseconds without any polling;
* per rank session, one gRPC handler thread streams commands down and one reader thread
  relays events up;
* one timer per released rank, firing SIGKILL when the grace period ends;
* one tail thread per TailRankLogs request, reading the job's rank log files (a followed
  file is re-read after a short wait when empty: appends to a file notify nobody);
* the memory sampler, which reads /proc/meminfo every few seconds: the kernel sends no
  event when memory runs low, so this is one of the two places the agent samples. It reads
  the OS, never another module;
* the GPU health sampler (and, where the driver offers an event set, its Xid event waiter):
  NVML likewise tells nobody when a device's memory fills or an ECC error is counted.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from services.contract import Module, audit_pb2, control_pb2, engine_pb2, worker_pb2
from services.contract.audit import merge_reports
from services.contract.bus import Bus
from services.contract.relay import L1, RANK, Link, pack
from services.worker.control_link import Emit
from services.worker.device_binding import CPU_AFFINITY_ENV, bind_rank
from services.worker.log_tail import LogTailer
from services.worker.memory_copies import MemoryCopies
from services.worker.rank_process import (
    END_OF_COMMANDS,
    RankProcess,
    describe_exit,
    describe_stop,
    rank_command_line,
    rank_environment,
    safe_file_name,
    signal_group,
    told_assignment,
    wait_reporting_stops,
)
from services.worker.rank_session import RankAlreadyAttached, RankNotLaunched
from services.worker.warm_spares import REFILL_DELAY_SECONDS, WarmSpares

RANK_MODULE_ENV = "SURGE_RANK_MODULE"
DEFAULT_RANK_MODULE = "services.rank"
DEFAULT_GRACE_SECONDS = 5.0  # ReleaseRanks.grace_seconds when control leaves it at 0
SHUTDOWN_GRACE_SECONDS = 2.0  # agent stopping: SIGTERM its ranks, SIGKILL after this
# After a rank process dies, wait at most this long for its RankSession stream to end, so
# the events it sent just before dying go up before its RankExited (the kernel closes the
# socket at exit, so this normally takes a millisecond).
STREAM_SETTLE_SECONDS = 0.5
SPAWN_FAILED_EXIT_CODE = 127  # shell convention for "could not execute"
# How long an audit waits for the ranks' answers (a rank answers from its session reader,
# which starts once its modules are built; until then its last known counts are shown).
AUDIT_TIMEOUT_SECONDS = 2.0


class NodeAgent:
    """Supervises this node's rank processes and relays between them and control.

    Public methods are exactly the commands the agent receives: from control
    (:meth:`execute` and the three it dispatches to), from its own rank sessions
    (:meth:`attach`, :meth:`relay_event`, :meth:`commands_for`, :meth:`detach`), from
    its composition root (:meth:`shutdown`) and from the operator's audit (:meth:`audit`).

    Args:
        worker_id: this agent's id, stamped on every ``RankExited``.
        session_address: host:port where local ranks reach this agent's ``RankSession``.
        run_dir: rank logs go to ``<run_dir>/logs/<job_id>.rank<R>.log`` (appended).
        emit: sends one ``WorkerEvent`` up to control; must not block.
        log: a structlog logger.
        rank_module: Python module a rank process runs (``python -m``).
        cwd: working directory of rank processes (the repository root).
        bus: where control's commands to EXT_HARDWARE are delivered (default: a bus of
            its own); its refusals are the agent's boundary violations.
        memory: the in-memory checkpoint copies of this node (``memory_copies.py``): told
            each job's peer node agent from its LaunchRanks. None: no such tier here.
        spares: warm spare rank processes (``warm_spares.py``), kept while a job here
            rebuilds in place (InitJob.rebuild_in_place); a launch takes one when it is
            ready. None: every rank is a new interpreter.
    """

    def __init__(
        self,
        worker_id: str,
        session_address: str,
        run_dir: Path,
        emit: Emit,
        log: Any,
        rank_module: str = DEFAULT_RANK_MODULE,
        cwd: Path | None = None,
        bus: Bus | None = None,
        memory: MemoryCopies | None = None,
        spares: WarmSpares | None = None,
        devices: Sequence[control_pb2.Device] = (),
    ):
        self._worker_id = worker_id
        self._devices = list(devices)  # as registered: where each rank is bound (device_binding.py)
        self._spares = spares
        self._memory = memory
        self._session_address = session_address
        self._logs_dir = Path(run_dir) / "logs"
        self._emit = emit
        self._log = log
        self._rank_module = rank_module
        self._cwd = Path(cwd) if cwd is not None else Path.cwd()
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankProcess] = {}
        self._stopping = False
        # Route counts of every rank process this agent launched, by (job, rank, pid): the
        # last each one reported (a rank sends its final counts when it ends).
        self._audits: dict[tuple[str, int, int], audit_pb2.AuditReport] = {}
        self._audit_seq = 0
        self._audit_answered = threading.Condition(self._lock)
        # job -> rank -> the byte spans [start, end] of the rank's log file that this agent's
        # launches of it wrote (end None while running): agents sharing one run dir send
        # only their own spans (services/worker/log_tail.py), each line once.
        self._launched: dict[str, dict[int, list[list]]] = collections.defaultdict(dict)
        self._tailer = LogTailer(self._logs_dir, emit, log, self._log_spans, self._rank_alive)
        # Control's side of this node: its commands to the agent (EXT_HARDWARE) run here, on
        # this bus; those to a job's ranks pass through, checked, to be run on the rank's bus.
        self._bus = bus or Bus()
        self._bus.subscribe(Module.EXT_HARDWARE, control_pb2.LaunchRanks, self.launch_ranks)
        self._bus.subscribe(Module.EXT_HARDWARE, control_pb2.ReleaseRanks, self.release_ranks)
        self._control = Link(self._bus, name=f"node agent {worker_id}", near={Module.EXT_HARDWARE}, beyond=L1)

    # ------------------------------------------------------------ commands from control

    def execute(self, cmd: control_pb2.WorkerCommand) -> None:
        """Execute one command from control (launch, release or relay)."""
        kind = cmd.WhichOneof("command")
        if kind == "routed" and cmd.job_id:
            self._relay_routed(cmd.job_id, cmd.routed)
        elif kind == "routed":
            self._control.deliver(cmd.routed)
        elif kind == "launch":
            self.launch_ranks(cmd.launch)
        elif kind == "release":
            self.release_ranks(cmd.release)
        elif kind == "tail_rank_logs":
            self.tail_rank_logs(cmd.tail_rank_logs)
        elif kind == "stop_tailing":
            self.stop_tailing(cmd.stop_tailing)
        else:
            self._log.warning("empty or unknown worker command ignored", kind=kind)

    def launch_ranks(self, msg: control_pb2.LaunchRanks, payload: Any = None) -> None:
        """Start one rank process per assignment, each in its own process group.

        A rank of this job still alive here is not started twice: if it was released, the
        launch waits for it to end (its grace period at most); otherwise the launch of
        that rank is refused and logged. A process that cannot be spawned is reported as
        ``RankExited`` with exit code 127. The job's peer for the in-memory checkpoint
        copies (``memory_peer``) is noted first.
        """
        if self._memory is not None:
            self._memory.set_peer(msg.job_id, msg.memory_peer)
        for assignment in msg.ranks:
            self._launch_one(msg.job_id, msg.init, assignment)
        self._warm_spares(after=REFILL_DELAY_SECONDS)  # not while these ranks start (warm_spares.py)

    def release_ranks(self, msg: control_pb2.ReleaseRanks, payload: Any = None) -> None:
        """SIGTERM the job's live rank process groups (only ``ranks`` when it names some),
        SIGKILL them after ``grace_seconds`` (default 5 s), or SIGKILL at once with ``kill``. Does not block: each process's
        waiter reaps it and reports ``RankExited``."""
        grace = msg.grace_seconds if msg.grace_seconds > 0 else DEFAULT_GRACE_SECONDS
        with self._lock:
            for key in [k for k, r in self._ranks.items() if k[0] == msg.job_id and r.exited.is_set()]:
                del self._ranks[key]  # ended earlier: nothing left to release
            only = set(msg.ranks)  # a rebuild in place replaces these; empty: every rank of the job
            targets = [
                r
                for r in self._ranks.values()
                if r.job_id == msg.job_id and not r.dead and (not only or r.rank in only)
            ]
            for r in targets:
                r.released = True
                r.grace_seconds = grace
                signal_group(r.proc.pid, signal.SIGKILL if msg.kill else signal.SIGTERM)
                if not msg.kill:
                    r.kill_timer = threading.Timer(grace, self._kill_if_alive, args=(r,))
                    r.kill_timer.daemon = True
                    r.kill_timer.start()
        self._log.info(
            "release", job_id=msg.job_id, ranks=[r.rank for r in targets], kill=msg.kill, grace_seconds=grace
        )
        if not only:  # the job is gone from here: its spare with it, unless another job wants one
            self._warm_spares(leaving=msg.job_id)

    def _relay_routed(self, job_id: str, routed: Any) -> None:
        """A routed command for the job's ranks: checked (control may send it, a rank module
        receives it) and relayed as it came; the rank unpacks it and checks it again."""
        if routed.receiver not in RANK:
            self._bus.refuse(routed.sender, routed.type, routed.receiver or None)
        self._control.accept(routed)
        self._to_ranks(job_id, worker_pb2.RankCommand(routed=routed), routed.type)

    def _to_ranks(self, job_id: str, cmd: worker_pb2.RankCommand, kind: str | None) -> None:
        with self._lock:
            targets = [r for r in self._ranks.values() if r.job_id == job_id and not r.dead and r.session != "closed"]
            for r in targets:
                r.commands.put(cmd)
        if not targets:
            self._log.warning("rank command for a job with no live rank here", kind=kind, job_id=job_id)

    def tail_rank_logs(self, msg: control_pb2.TailRankLogs) -> None:
        """Operator log plumbing (StreamLogs): send up this job's rank log lines on this
        node (see :class:`LogTailer`). Does not block."""
        self._tailer.tail(msg)

    def stop_tailing(self, msg: control_pb2.StopTailing) -> None:
        """The StreamLogs caller went away: end that tail (its ``done`` still goes up)."""
        self._tailer.stop(msg)

    # ------------------------------------------------------------ from rank sessions

    def attach(self, hello: worker_pb2.RankHello) -> RankProcess:
        """A rank said hello: bind its session to the process launched for it.

        Raises:
            RankNotLaunched: no live process of (job_id, rank) was launched here.
            RankAlreadyAttached: that process already had a session.
        """
        with self._lock:
            r = self._ranks.get((hello.job_id, hello.rank))
            if r is None or r.dead:
                raise RankNotLaunched(
                    f"worker {self._worker_id}: no live rank {hello.rank} of job {hello.job_id!r} here"
                )
            if r.session != "none":
                raise RankAlreadyAttached(
                    f"worker {self._worker_id}: rank {hello.rank} of job {hello.job_id!r} already has a session"
                )
            r.session = "open"
        if hello.pid and hello.pid != r.proc.pid:
            self._log.warning(
                "hello pid differs from the launched pid",
                job_id=r.job_id,
                rank=r.rank,
                hello_pid=hello.pid,
                pid=r.proc.pid,
            )
        self._log.info("rank connected", job_id=r.job_id, rank=r.rank, pid=r.proc.pid)
        return r

    def relay_event(self, r: RankProcess, event: worker_pb2.RankEvent) -> None:
        """Send a rank's event up unchanged, except that its envelope names the session's
        rank (the identity the hello established), even if the rank left it empty. An
        ``audit`` (the rank's route counts) is kept here, for :meth:`audit`."""
        if event.WhichOneof("event") == "audit":
            with self._audit_answered:
                self._audits[(r.job_id, r.rank, r.proc.pid)] = event.audit
                self._audit_answered.notify_all()
            return
        if (event.job_id, event.rank) != (r.job_id, r.rank):
            if event.job_id or event.rank:
                self._log.warning(
                    "rank event envelope names another rank; corrected",
                    job_id=r.job_id,
                    rank=r.rank,
                    said_job=event.job_id,
                    said_rank=event.rank,
                )
            event.job_id, event.rank = r.job_id, r.rank
        self._emit(control_pb2.WorkerEvent(rank_event=event))

    def commands_for(self, r: RankProcess) -> Iterator[worker_pb2.RankCommand]:
        """The command stream of one rank session: init, assignment, then what control
        relays, until the session or the process ends."""
        yield worker_pb2.RankCommand(init=r.init)
        yield worker_pb2.RankCommand(assignment=r.told or r.assignment)
        while (cmd := r.commands.get()) is not END_OF_COMMANDS:
            yield cmd

    def detach(self, r: RankProcess) -> None:
        """The rank's session ended (its process closed it or died)."""
        with self._lock:
            r.session = "closed"
        r.commands.put(END_OF_COMMANDS)
        r.stream_closed.set()

    def running(self) -> list[control_pb2.LaunchRanks]:
        """The rank processes alive here and not released, one LaunchRanks per job (its
        job config and assignments as launched): declared in every registration, so a
        restarted control re-attaches them."""
        out: dict[str, control_pb2.LaunchRanks] = {}
        with self._lock:
            for r in self._ranks.values():
                if r.dead or r.released:
                    continue
                launch = out.setdefault(r.job_id, control_pb2.LaunchRanks(job_id=r.job_id, init=r.init))
                launch.ranks.append(r.assignment)
        for launch in out.values():
            launch.ranks.sort(key=lambda a: a.rank)
        return list(out.values())

    # ------------------------------------------------------------ from the operator (audit)

    def audit(self, timeout_seconds: float = AUDIT_TIMEOUT_SECONDS) -> audit_pb2.AuditReport:
        """The route counts of this node's rank processes, summed: each live rank is asked
        (``RankCommand{audit}``) and waited for up to ``timeout_seconds``; ranks that ended
        count with the final report they sent. A rank that does not answer in time counts
        with its last known report, and a note says so."""
        with self._audit_answered:
            self._audit_seq += 1
            request_id = self._audit_seq
            asked = [r for r in self._ranks.values() if not r.dead and r.session == "open"]
            for r in asked:
                r.commands.put(worker_pb2.RankCommand(audit=audit_pb2.AuditRequest(id=request_id)))

            def answered(r: RankProcess) -> bool:
                report = self._audits.get((r.job_id, r.rank, r.proc.pid))
                return r.dead or r.session == "closed" or (report is not None and report.id >= request_id)

            self._audit_answered.wait_for(lambda: all(answered(r) for r in asked), timeout_seconds)
            late = [r for r in asked if not answered(r)]
            reports = list(self._audits.values())
        notes = [
            f"{self._worker_id}: rank {r.rank} of job {r.job_id} did not answer within {timeout_seconds:g} s "
            "(still starting?); its last known counts are included"
            for r in late
        ]
        return merge_reports(self._worker_id, reports, notes)

    # ------------------------------------------------------------ from the composition root

    def shutdown(self, grace_seconds: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Stop every rank (SIGTERM, SIGKILL after ``grace_seconds``) and wait until each is
        reaped; refuse launches from now on. Blocks at most ``grace_seconds`` + ~6 s."""
        if self._spares is not None:
            self._spares.close()
        with self._lock:
            self._stopping = True
            live = [r for r in self._ranks.values() if not r.dead]
            for r in live:
                signal_group(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for r in live:
            r.exited.wait(max(0.0, deadline - time.monotonic()))
        for r in live:
            self._kill_if_alive(r)
        for r in live:
            if not r.exited.wait(5.0):
                self._log.error("rank did not end after SIGKILL", job_id=r.job_id, rank=r.rank, pid=r.proc.pid)

    # ------------------------------------------------------------ private

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
            if not old.exited.wait(old.grace_seconds + STREAM_SETTLE_SECONDS + 2.0):
                self._log.error(
                    "launch refused: released rank has not ended", job_id=job_id, rank=assignment.rank, pid=old.proc.pid
                )
                return
        log_path = self._logs_dir / f"{safe_file_name(job_id)}.rank{assignment.rank}.log"
        try:
            span_start = log_path.stat().st_size  # the file is appended: this process's lines start here
        except OSError:
            span_start = 0
        argv = rank_command_line(self._rank_module, self._session_address, job_id, assignment.rank)
        binding = bind_rank(assignment, self._devices)
        env = rank_environment(os.environ, binding)
        try:
            # A warm spare becomes this rank when one is ready (its interpreter and imports
            # are paid for); else a new process.
            proc = (self._spares.take(argv[3:], env, log_path) if self._spares is not None else None) or self._spawn(
                argv, log_path, env
            )
        except OSError as e:
            self._log.error("rank spawn failed", job_id=job_id, rank=assignment.rank, error=str(e))
            self._emit(self._exited_event(job_id, assignment.rank, SPAWN_FAILED_EXIT_CODE, f"spawn failed: {e}"))
            return
        r = RankProcess(
            job_id=job_id, rank=assignment.rank, init=init, assignment=assignment, proc=proc, log_path=log_path,
            told=told_assignment(assignment, binding),
        )  # fmt: skip
        with self._lock:
            self._ranks[key] = r
            self._launched[job_id].setdefault(assignment.rank, []).append([span_start, None])
            if self._stopping:  # shutdown began while it was spawning and did not see it
                signal_group(proc.pid, signal.SIGKILL)
        threading.Thread(target=self._watch, args=(r,), name=f"wait-{job_id}-{r.rank}", daemon=True).start()
        self._log.info(
            "rank launched", job_id=job_id, rank=r.rank, pid=proc.pid, device=assignment.device,
            sees=binding.device, cpus=binding.env.get(CPU_AFFINITY_ENV, ""), log=str(log_path),
        )  # fmt: skip

    def _warm_spares(self, leaving: str = "", after: float = 0.0) -> None:
        """Keep a spare ready while a rank here belongs to a job that rebuilds in place (or
        always, on a spare node); retire it otherwise. ``leaving``: a job being released.
        ``after``: start missing spares that many seconds from now."""
        if self._spares is None:
            return
        with self._lock:
            wanted = not self._stopping and (
                self._spares.always
                or any(r.init.rebuild_in_place for r in self._ranks.values() if r.job_id != leaving and not r.released)
            )
        if wanted:
            self._spares.keep_warm(after=after)
        else:
            self._spares.retire()

    def _log_spans(self, job_id: str) -> dict[int, list[tuple[int, int | None]]]:
        """rank -> the spans of its log file this agent's launches of it wrote."""
        with self._lock:
            return {rank: [tuple(span) for span in spans] for rank, spans in self._launched.get(job_id, {}).items()}

    def _end_log_span(self, r: RankProcess) -> None:
        """``r`` ended (its process group killed): its span of the log file ends here."""
        try:
            end = r.log_path.stat().st_size
        except OSError:
            end = None
        with self._lock:
            spans = self._launched.get(r.job_id, {}).get(r.rank, [])
            if spans and spans[-1][1] is None:
                spans[-1][1] = end if end is not None else spans[-1][0]

    def _rank_alive(self, job_id: str, rank: int) -> bool:
        with self._lock:
            r = self._ranks.get((job_id, rank))
            return r is not None and not r.exited.is_set()

    def _spawn(self, argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                argv,
                cwd=self._cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: killed cleanly with its children
            )

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
        with self._lock:
            r.dead = True  # from now on no session can attach to it
            had_session = r.session == "open"
        if had_session:
            r.stream_closed.wait(STREAM_SETTLE_SECONDS)
        signal_group(r.proc.pid, signal.SIGKILL)  # helpers the rank left behind die with it
        if r.kill_timer is not None:
            r.kill_timer.cancel()
        r.commands.put(END_OF_COMMANDS)  # a stream still held open by a stray helper ends now
        detail = describe_exit(code) + (" after release" if r.released else "") + f"; log {r.log_path}"
        self._log.info("rank exited", job_id=r.job_id, rank=r.rank, pid=r.proc.pid, exit_code=code, released=r.released)
        self._emit(
            self._exited_event(r.job_id, r.rank, code, detail, reaped=reaped, released=r.released, pid=r.proc.pid)
        )
        self._end_log_span(r)  # before `exited`: a log tail that sees it gone finds the span's end
        r.exited.set()
        # (Its spare stays: a replacement of this very rank may be on its way. The job's
        # release, or the next launch, decides whether spares are still wanted.)

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
