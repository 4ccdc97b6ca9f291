"""The node agent (service `worker`): a stable endpoint per node that supervises rank processes.

In the route table the node agent is ``EXT_HARDWARE``: it speaks for the devices and the
processes of its node. It takes no decisions (DESIGN.md, law 2): it executes what control
commands and states facts.

Facts it reports up the ``ControlService.WorkerSession`` stream (``WorkerEvent``):

* ``register``: the node's hardware, first message of every session (also after a
  reconnect, with the same ``worker_id``).
* ``rank_event``: every ``RankEvent`` a local rank sends on its ``RankSession``, in the
  order received, ``hello``, ``heartbeat`` and ``routed`` (any routed event by name) included (``audit`` stays
  here: it answers the agent's own question, see :meth:`NodeAgent.audit`), but the
  ``StepCompleted`` of ranks other than 0 after the first per control session
  (``step_summaries.py``: rank 0's is the job's step summary, the others' progress is in their beats).
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
* ``rank_launcher.py``: the launch, watch and reap of rank processes (a part of ``NodeAgent``);
* ``rank_process.py``: a rank process's record, argv, environment and signals;
* ``rank_session.py``: the ``RankSession`` servicer local ranks connect to;
* ``log_tail.py``: the rank log tails behind ``tail_rank_logs``;
* ``rank_logs.py``: each rank's log file, written here from its output pipe and rotated at a
  size, and ``RankLogFlood`` for a rank that logs too fast;
* ``memory_copies.py``: the in-memory copies of the local ranks' newest checkpoint, served
  to them and replicated to the job's peer agent (``MemoryCopyService``);
* ``rank_beats.py``: the local ranks' beats, sent up a job's at a time (one message per job
  and beat period: the ranks beat on this node's grid, services/common/beat_grid.py), with
  the agent's own beat riding in one of them (alone only when none carries it), and every
  other message after the beats it follows (one thread: the batch window's clock);
* ``step_summaries.py``: which of the local ranks' ``StepCompleted`` go up (rank 0's);
* ``link_probe.py``: the UDP probes of the data-plane links to the node agents this node
  shares a job with, behind ``routed`` ``LinkStateChanged`` (one thread);
* ``metric_stream.py``: the local ranks' metric records (``RankEvent{metrics}``, kept here,
  not sent up) on one Record stream per node to the store, each store ack back to its rank
  (``RankCommand{metrics_ack}``).

Threads, and why each exists:

* the control-session thread keeps the stream open, reconnects when it breaks, and
  executes commands one by one (so a ``release`` then ``launch`` of the same rank is
  ordered);
* one waiter per rank process, blocked in ``waitid``: a death, and a stop or continue by a
  signal, is reported within milliseconds without any polling;
* per rank session, one gRPC handler thread streams commands down and one reader thread
  relays events up;
* one timer per released rank, firing SIGKILL when the grace period ends;
* one log pump thread (``rank_logs.py``) reading every rank's output pipe (a selector, no
  thread per rank) into its rotated log file;
* one tail thread per TailRankLogs request, reading the job's rank log files (a followed
  file is re-read after a short wait when empty: appends to a file notify nobody);
* one clock thread (``rank_beats.py``) that sends a job's kept beats when their window ends
  (a rank late or gone holds the others' no longer than that), and the agent's own beat
  alone when no flush carried it (the control session's beat thread is not started);
* one metric stream thread per store address (``metric_stream.py``), which keeps the Record
  stream open and reconnects it;
* the memory sampler, which reads /proc/meminfo every few seconds: the kernel sends no
  event when memory runs low, so this is one of the two places the agent samples. It reads
  the OS, never another module;
* the link prober (``link_probe.py``), one for the node: it pings the job's peer agents every
  probe period and answers theirs; a cut link tells nobody (no packet arrives to say so), so
  probing is the only way to see one;
* the GPU health sampler (and, where the driver offers an event set, its Xid event waiter):
  NVML likewise tells nobody when a device's memory fills or an ECC error is counted.
"""

from __future__ import annotations

import collections
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from services.common.fencing import FENCE, FENCED_CALLS
from services.common.rank_nodes import expand, node_runs
from services.contract import Module, audit_pb2, control_pb2, worker_pb2
from services.contract.audit import merge_reports
from services.contract.bus import Bus
from services.contract.relay import L1, RANK, Link
from services.worker.control_link import Emit
from services.worker.link_probe import LinkProber
from services.worker.log_tail import LogTailer
from services.worker.memory_copies import MemoryCopies
from services.worker.metric_acks import MetricAcks
from services.worker.metric_stream import MetricStreams
from services.worker.rank_beats import RankBeats
from services.worker.rank_forkserver import RankForkServer
from services.worker.rank_launcher import RankLauncher
from services.worker.rank_logs import LogPump, LogSettings, RankLog
from services.worker.rank_process import (
    END_OF_COMMANDS,
    RankProcess,
    signal_group,
)
from services.worker.rank_session import RankAlreadyAttached, RankNotLaunched
from services.worker.step_summaries import StepSummaries

RANK_MODULE_ENV = "SURGE_RANK_MODULE"
DEFAULT_RANK_MODULE = "services.rank"
DEFAULT_GRACE_SECONDS = 5.0  # ReleaseRanks.grace_seconds when control leaves it at 0
SHUTDOWN_GRACE_SECONDS = 2.0  # agent stopping: SIGTERM its ranks, SIGKILL after this
# How long a rank's hello waits for its own launch to be recorded: a forked rank connects
# within milliseconds, before the spawn that forked it has returned (its fork server answers).
SPAWN_SETTLE_SECONDS = 10.0
# How long an audit waits for the ranks' answers (a rank answers from its session reader,
# which starts once its modules are built; until then its last known counts are shown).
AUDIT_TIMEOUT_SECONDS = 2.0


# A rank's loop ended: its metric records held here go without lingering (metric_stream.py).
_LOOP_ENDS = frozenset({"surge.v1.TrainingLoopFinished", "surge.v1.TrainingLoopFailed"})
# The one routed event of a rank that is no boundary: every other (a save committed, a pause,
# a step fault, an eval, the loop's end) sends the records held here at once (metric_stream.py).
_STEP_COMPLETED = "surge.v1.StepCompleted"


def _key(r: RankProcess) -> tuple[str, int, int]:
    """A rank process's key for its metric records and their acks."""
    return (r.job_id, r.rank, r.proc.pid)


class NodeAgent(RankLauncher):
    """Supervises this node's rank processes and relays between them and control.

    Public methods are exactly the commands the agent receives: from control
    (:meth:`execute` and the three it dispatches to), from its own rank sessions
    (:meth:`attach`, :meth:`relay_event`, :meth:`commands_for`, :meth:`detach`), from
    its composition root (:meth:`shutdown`) and from the operator's audit (:meth:`audit`).

    Args:
        worker_id: this agent's id, stamped on every ``RankExited``.
        session_address: host:port where local ranks reach this agent's ``RankSession``.
        run_dir: rank logs go to ``<run_dir>/logs/<job_id>.rank<R>.log`` (appended; written by
            this agent from each rank's output pipe and rotated at ``log_settings``' size:
            ``rank_logs.py``).
        emit: sends one ``WorkerEvent`` up to control; must not block.
        log: a structlog logger.
        rank_module: Python module a rank process runs (``python -m``).
        cwd: working directory of rank processes (the repository root).
        bus: where control's commands to EXT_HARDWARE are delivered (default: a bus of
            its own); its refusals are the agent's boundary violations.
        memory: the in-memory checkpoint copies of this node (``memory_copies.py``): told
            each job's peer node agent from its LaunchRanks. None: no such tier here.
        forkserver: the rank fork server (``rank_forkserver.py``): a launch of the agent's rank
            module is forked from it, its imports paid once. None, or a launch it cannot
            serve: every rank is a new interpreter.
        metrics: the node's metric streams to the store (``metric_stream.py``; default: its
            own).
        log_settings: the rank logs' rotation and flood bound (default: ``LogSettings()``).
        pump: reads the ranks' (and the fork server's) output pipes (default: its own).
        links: the data-plane link probes (``link_probe.py``): told each job's peers from its
            LaunchRanks, and to forget them when the job is released here. None: no probes.
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
        forkserver: RankForkServer | None = None,
        devices: Sequence[control_pb2.Device] = (),
        metrics: MetricStreams | None = None,
        log_settings: LogSettings | None = None,
        pump: LogPump | None = None,
        links: LinkProber | None = None,
        together: Callable[[], AbstractContextManager] | None = None,
    ):
        self._worker_id = worker_id
        self._metrics = metrics or MetricStreams(log)
        self._metric_acks = MetricAcks()  # each rank's acks: at once when it waits, else with its beat
        self._devices = list(devices)  # as registered: where each rank is bound (device_binding.py)
        self._forkserver = forkserver
        self._memory = memory
        self._links = links
        self._session_address = session_address
        self._logs_dir = Path(run_dir) / "logs"
        # Every message up goes through the beats' keeper: its ranks' beats leave a job's at a
        # time, and nothing overtakes a beat it follows (rank_beats.py).
        self.beats = RankBeats(emit)
        self._emit = self.beats.emit
        # What a rank's one message puts up goes as one message to control (Outbox.together).
        self._together = together or contextlib.nullcontext
        self._log = log
        self._rank_module = rank_module
        self._cwd = Path(cwd) if cwd is not None else Path.cwd()
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankProcess] = {}
        # (job, rank) -> set once its launch is recorded in _ranks (its hello waits for that)
        self._spawning: dict[tuple[str, int], threading.Event] = {}
        self._stopping = False
        # Route counts of every rank process this agent launched, by (job, rank, pid): the
        # last each one reported (a rank sends its final counts when it ends).
        self._audits: dict[tuple[str, int, int], audit_pb2.AuditReport] = {}
        self._audit_seq = 0
        self._audit_answered = threading.Condition(self._lock)
        # job -> rank -> the logs of this agent's launches of it, in order: their byte spans
        # (inode, start, end) are what agents sharing one run dir send (services/worker/
        # log_tail.py), each line once, across rotations.
        self._log_settings = log_settings or LogSettings()
        self._pump = pump or LogPump(log)
        self._launched: dict[str, dict[int, list[RankLog]]] = collections.defaultdict(dict)
        self._tailer = LogTailer(self._logs_dir, emit, log, self._log_spans, self._rank_alive)
        # Which ranks' StepCompleted go up: rank 0's, and each other rank's first per control
        # session (step_summaries.py); the rest would cost control a message per rank per step.
        self.steps = StepSummaries()
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
        copies (``memory_peer``) is noted first. A current L1-2 sends no node list (each rank
        learns the world's nodes at its rendezvous: services/engine/node_map.py); an older one's
        ``node_runs`` fill each assignment's ``rank_nodes`` (services/common/rank_nodes.py), as
        that rank expects. A launch with no ranks only restates the job's link
        probe peers (a rebuild in place changed its layout: the memory peer stays).
        """
        if self._memory is not None and msg.ranks:
            self._memory.set_peer(msg.job_id, msg.memory_peer)
        if self._links is not None:
            self._links.set_peers(msg.job_id, msg.link_probe)
        for assignment in msg.ranks:  # the newest incarnation: an older one's calls are refused here
            FENCE.tell(msg.job_id, assignment.rank, assignment.generation)
        rank_nodes = expand(msg.node_runs)  # (legacy: an older L1-2's; empty from a current one)
        for assignment in msg.ranks:
            if rank_nodes and not assignment.rank_nodes:
                assignment.rank_nodes.extend(rank_nodes)
            self._launch_one(msg.job_id, msg.init, assignment)

    def release_ranks(self, msg: control_pb2.ReleaseRanks, payload: Any = None) -> None:
        """SIGTERM the job's live rank process groups (only ``ranks`` when it names some),
        SIGKILL them after ``grace_seconds`` (default 5 s), or SIGKILL at once with ``kill``. Does not block: each process's
        waiter reaps it and reports ``RankExited``.

        With ``below_generation`` (fencing): only processes launched as an older generation
        end, and the agent keeps the fence for those ranks: an older incarnation that speaks
        later (a stopped process continued) is ended then (:meth:`relay_event`), and its
        calls to this agent's services are refused (services/common/fencing.py)."""
        grace = msg.grace_seconds if msg.grace_seconds > 0 else DEFAULT_GRACE_SECONDS
        with self._lock:
            fenced = set(msg.ranks) or {r.rank for r in self._ranks.values() if r.job_id == msg.job_id}
        for rank in fenced if msg.below_generation else ():  # (no ranks named: every rank of the job here)
            FENCE.tell(msg.job_id, rank, msg.below_generation)
        with self._lock:
            for key in [k for k, r in self._ranks.items() if k[0] == msg.job_id and r.exited.is_set()]:
                del self._ranks[key]  # ended earlier: nothing left to release
            only = set(msg.ranks)  # a rebuild in place replaces these; empty: every rank of the job
            targets = [
                r
                for r in self._ranks.values()
                if r.job_id == msg.job_id
                and not r.dead
                and (not only or r.rank in only)
                and (not msg.below_generation or r.assignment.generation < msg.below_generation)
            ]
            for r in targets:
                r.released = True
                r.grace_seconds = grace
                r.agent_signal = signal.SIGKILL if msg.kill else signal.SIGTERM
                signal_group(r.proc.pid, r.agent_signal)
                if not msg.kill:
                    r.kill_timer = threading.Timer(grace, self._kill_if_alive, args=(r,))
                    r.kill_timer.daemon = True
                    r.kill_timer.start()
        for address in {r.init.store_address for r in targets}:
            self._metrics.flush(address)  # the job stops here: its records go now, not after the linger
        if self._links is not None and not msg.ranks:
            self._links.forget(msg.job_id)  # (the job left this node: its links are not probed)
        self._log.info(
            "release", job_id=msg.job_id, ranks=[r.rank for r in targets], kill=msg.kill, grace_seconds=grace
        )

    def _relay_routed(self, job_id: str, routed: Any) -> None:
        """A routed command for the job's ranks: checked (control may send it, a rank module
        receives it) and relayed as it came; the rank unpacks it and checks it again."""
        if routed.receiver not in RANK:
            self._bus.refuse(routed.sender, routed.type, routed.receiver or None)
        self._control.accept(routed)
        self._to_ranks(job_id, worker_pb2.RankCommand(routed=routed), routed.type)

    def _to_ranks(self, job_id: str, cmd: worker_pb2.RankCommand, kind: str | None) -> None:
        with self._lock:
            targets = [
                r
                for r in self._ranks.values()
                if r.job_id == job_id
                and not r.dead
                and r.session != "closed"
                # (never a replaced incarnation: it would join the new group's rendezvous)
                and r.assignment.generation >= FENCE.newest(job_id, r.rank)
            ]
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
        key = (hello.job_id, hello.rank)
        with self._lock:
            spawning = self._spawning.get(key)
        if spawning is not None:  # a forked rank can say hello before its spawn has returned
            spawning.wait(SPAWN_SETTLE_SECONDS)
        with self._lock:
            r = self._ranks.get(key)
            if r is None or r.dead:
                raise RankNotLaunched(
                    f"worker {self._worker_id}: no live rank {hello.rank} of job {hello.job_id!r} here"
                )
            if r.session != "none":
                raise RankAlreadyAttached(
                    f"worker {self._worker_id}: rank {hello.rank} of job {hello.job_id!r} already has a session"
                )
            r.session = "open"
        self._end_if_stale(r)  # (outside the lock: it takes it)
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

    def relaying(self) -> AbstractContextManager:
        """Around the relay of one RankSession message's events: what they put up goes to
        control as one stream message (its beat period's steps and the node's beats after them)."""
        return self._together()

    def relay_event(self, r: RankProcess, event: worker_pb2.RankEvent) -> None:
        """Send a rank's event up unchanged, except that its envelope names the session's
        rank (the identity the hello established), even if the rank left it empty; of a rank
        other than 0, only the first StepCompleted per control session (``StepSummaries``). An
        ``audit`` (the rank's route counts) is kept here, for :meth:`audit`; a ``metrics``
        record goes to the store on this node's stream, its ack back to the rank."""
        if self._end_if_stale(r):
            return  # a replaced incarnation: nothing it says goes anywhere
        event.generation = r.assignment.generation  # control drops an older one's (session_hub.py)
        kind = event.WhichOneof("event")
        if kind == "metrics":
            self._metric_acks.submitted(_key(r), event.metrics)
            self._metrics.submit(  # (one ack per batch to the rank: its acks count cumulatively)
                r.init.store_address,
                event.metrics,
                lambda ack: self._ack_metrics(r, self._metric_acks.acked(_key(r), ack)),
                key=_key(r),
            )
            return
        if kind == "audit":
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
        if kind == "routed" and event.routed.type != _STEP_COMPLETED:
            # A boundary (a save, a pause, a fault, the end): what lingers goes now, so a
            # record of a step up to a committed save or a fault is not left to the linger
            # (a node that dies after it would take it along: metric_stream.py).
            self._metrics.flush(r.init.store_address)
            if event.routed.type in _LOOP_ENDS:  # the rank waits for their acks to exit
                r.loop_ended = True
                self._ack_metrics(r, self._metric_acks.loop_ended(_key(r)))
        if kind == "routed" and not self.steps.send_up(r.job_id, r.rank, event.routed):
            return  # another rank's step: its beats carry its progress (step_summaries.py)
        if kind == "heartbeat":
            self.beats.beat(event, self._live_ranks_of(r.job_id))
            self._ack_metrics(r, self._metric_acks.beat(_key(r)))  # what was held for it
            return
        self._emit(control_pb2.WorkerEvent(rank_event=event))

    def _live_ranks_of(self, job_id: str) -> int:
        """How many ranks of ``job_id`` run on this node (the beats a period brings)."""
        with self._lock:
            return sum(1 for r in self._ranks.values() if r.job_id == job_id and not r.dead)

    def _end_if_stale(self, r: RankProcess) -> bool:
        """Whether ``r`` is an older incarnation of its (job, rank) than the newest control
        told this agent of (LaunchRanks, ReleaseRanks.below_generation); such a process (one
        stopped past its heartbeat timeout, replaced, then continued) is ended at once (SIGKILL
        of its process group, as a release), once."""
        newest = FENCE.newest(r.job_id, r.rank)
        if not r.assignment.generation or r.assignment.generation >= newest:
            return False
        with self._lock:
            first = not r.released and not r.dead
            r.released = True
            if first:
                signal_group(r.proc.pid, signal.SIGKILL)
        if first:
            FENCED_CALLS.labels("node_agent").inc()
            self._log.warning(
                "replaced incarnation ended",
                job_id=r.job_id,
                rank=r.rank,
                pid=r.proc.pid,
                generation=r.assignment.generation,
                newest=newest,
            )
        return True

    def _ack_metrics(self, r: RankProcess, ack: Any) -> None:
        if ack is None:
            return  # held for the rank's next beat (metric_acks.py)
        with self._lock:
            if r.dead or r.session == "closed":
                return  # the rank is gone: nobody waits for it
            r.commands.put(worker_pb2.RankCommand(metrics_ack=ack))

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
        self._metric_acks.forget(_key(r))
        self._metrics.flush(r.init.store_address)  # (its records need not wait out the linger)
        r.commands.put(END_OF_COMMANDS)
        r.stream_closed.set()

    def has_ranks(self) -> bool:
        """A rank process still lives here (released or not): a departing agent waits for none."""
        with self._lock:
            return any(not r.dead for r in self._ranks.values())

    def running(self) -> list[control_pb2.LaunchRanks]:
        """The rank processes alive here and not released, one LaunchRanks per job (its
        job config and assignments as launched; the world's node list in ``node_runs`` only
        where an older L1-2 sent one):
        declared in every registration, so a restarted control re-attaches them."""
        out: dict[str, control_pb2.LaunchRanks] = {}
        with self._lock:
            for r in self._ranks.values():
                if r.dead or r.released:
                    continue
                launch = out.setdefault(r.job_id, control_pb2.LaunchRanks(job_id=r.job_id, init=r.init))
                launch.ranks.append(r.assignment)
        for launch in out.values():
            launch.ranks.sort(key=lambda a: a.rank)
            # (the world's node list once, as runs, not in each assignment: rank_nodes.py)
            launch.node_runs.extend(node_runs(launch.ranks[0].rank_nodes))
            for a in launch.ranks:
                a.ClearField("rank_nodes")
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
        if self._forkserver is not None:
            self._forkserver.close()
        with self._lock:
            self._stopping = True
            live = [r for r in self._ranks.values() if not r.dead]
            for r in live:
                r.agent_signal = signal.SIGTERM
                signal_group(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for r in live:
            r.exited.wait(max(0.0, deadline - time.monotonic()))
        for r in live:
            self._kill_if_alive(r)
        for r in live:
            if not r.exited.wait(5.0):
                self._log.error("rank did not end after SIGKILL", job_id=r.job_id, rank=r.rank, pid=r.proc.pid)
        self._metrics.close(timeout=2.0)  # what the ranks handed on before they ended
        self._pump.close()
