"""The node agent (service `worker`): a stable endpoint per node that supervises rank processes.

In the route table the node agent is ``EXT_HARDWARE``: it speaks for the devices and the
processes of its node. It takes no decisions (DESIGN.md, law 2): it executes what control
commands and states facts.

Facts it reports up the ``ControlService.WorkerSession`` stream (``WorkerEvent``):

* ``register``: the node's hardware, first message of every session (also after a
  reconnect, with the same ``worker_id``).
* ``rank_event``: every ``RankEvent`` a local rank sends on its ``RankSession``, in the
  order received, ``hello``, ``heartbeat`` and ``violation`` included (``audit`` stays
  here: it answers the agent's own question, see :meth:`NodeAgent.audit`).
* ``rank_exited``: a rank process ended (``exit_code`` < 0: killed by that signal), after
  the events that rank sent before it ended, with the time it was reaped and whether a
  ``release`` asked for it.
* ``memory_pressure``: the node's available memory fell below its pressure threshold
  (``under_pressure`` true), or rose back above it plus a hysteresis margin (false). Edge-
  triggered: one report per crossing, none while the state holds.

Commands it executes (``WorkerCommand``, in arrival order):

* ``launch``: start one process per ``RankAssignment``; when a rank says ``hello`` it is
  pushed ``RankCommand{init}`` then ``RankCommand{assignment}``, once, then whatever
  control relays to its job.
* ``rank_command``: relayed to every live rank of the job named inside the payload.
* ``tail_rank_logs`` / ``stop_tailing`` (operator log plumbing for ``StreamLogs``): send
  the job's rank log lines on this node up as ``rank_log_lines`` batches (then, with
  ``follow``, new lines until the ranks have exited), ending with ``rank_log_lines{done}``.
* ``release``: SIGTERM the job's rank process groups, SIGKILL after the grace period (or
  at once with ``kill``); each process is reaped by its own waiter.

Threads, and why each exists:

* the control-session thread keeps the stream open, reconnects when it breaks, and
  executes commands one by one (so a ``release`` then ``launch`` of the same rank is
  ordered);
* one waiter per rank process, blocked in ``proc.wait()``: a death is reported within
  milliseconds without any polling;
* per rank session, one gRPC handler thread streams commands down and one reader thread
  relays events up;
* one timer per released rank, firing SIGKILL when the grace period ends;
* one tail thread per TailRankLogs request, reading the job's rank log files (a followed
  file is re-read after a short wait when empty: appends to a file notify nobody);
* the memory sampler, which reads /proc/meminfo every few seconds: the kernel sends no
  event when memory runs low, so this is the one place the agent samples. It reads the
  OS, never another module.
"""

from __future__ import annotations

import collections
import math
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.common.grpc_server import channel
from services.contract import audit_pb2, control_pb2, control_pb2_grpc, engine_pb2, worker_pb2, worker_pb2_grpc
from services.contract.audit import merge_reports

RANK_MODULE_ENV = "SURGE_RANK_MODULE"
DEFAULT_RANK_MODULE = "services.worker.rank"
DEFAULT_GRACE_SECONDS = 5.0  # ReleaseRanks.grace_seconds when control leaves it at 0
SHUTDOWN_GRACE_SECONDS = 2.0  # agent stopping: SIGTERM its ranks, SIGKILL after this
# After a rank process dies, wait at most this long for its RankSession stream to end, so
# the events it sent just before dying go up before its RankExited (the kernel closes the
# socket at exit, so this normally takes a millisecond).
STREAM_SETTLE_SECONDS = 0.5
SPAWN_FAILED_EXIT_CODE = 127  # shell convention for "could not execute"
REPO_ROOT = Path(__file__).resolve().parents[2]
MEMINFO_ENV = "SURGE_WORKER_MEMINFO"  # tests point it at a file they write
DEFAULT_MEMINFO = "/proc/meminfo"
# Relieved only once available/total is this much above the threshold again, so memory
# hovering at the threshold reports one crossing, not one per sample.
MEMORY_PRESSURE_HYSTERESIS = 0.02
# How long an audit waits for the ranks' answers (a rank answers from its session reader,
# which starts once its modules are built; until then its last known counts are shown).
AUDIT_TIMEOUT_SECONDS = 2.0
# Rank log tails (TailRankLogs): the wait after an empty read of a followed log file, and
# the most lines in one RankLogLines.
TAIL_INTERVAL_SECONDS = 0.2
TAIL_BATCH_LINES = 500

Emit = Callable[[control_pb2.WorkerEvent], None]


# ---------------------------------------------------------------- hardware report


def detect_cuda_devices() -> list[control_pb2.Device]:
    """The node's CUDA devices (kind "cuda", physical index, name, memory in bytes).

    Reads ``nvidia-smi`` (fast). Only when it is missing but a driver is present
    (``/dev/nvidiactl``) does it import torch, which costs ~2 s of start-up. A numeric
    ``CUDA_VISIBLE_DEVICES`` restricts the list to those physical indices; rank processes
    get ``CUDA_VISIBLE_DEVICES=<index>`` from the same numbering.

    Returns [] when the node has no usable GPU; never raises (a broken driver reports no
    devices rather than stopping the agent).
    """
    devices = _cuda_from_nvidia_smi()
    if devices is None:
        devices = _cuda_from_torch() if os.path.exists("/dev/nvidiactl") else []
    visible = _visible_cuda_indices()
    if visible is not None:
        devices = [d for d in devices if d.index in visible]
    return devices


def _cuda_from_nvidia_smi() -> list[control_pb2.Device] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    devices = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            mib = int(parts[2]) if parts[2].isdigit() else 0
            devices.append(control_pb2.Device(kind="cuda", index=int(parts[0]), name=parts[1], memory_bytes=mib * 2**20))
    return devices


def _cuda_from_torch() -> list[control_pb2.Device]:
    try:
        import torch  # lazy: ~2 s, only on a GPU node without nvidia-smi
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [int(x) for x in visible.split(",")] if visible and _is_index_list(visible) else None
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        index = physical[i] if physical and i < len(physical) else i
        devices.append(control_pb2.Device(kind="cuda", index=index, name=props.name, memory_bytes=props.total_memory))
    return devices


def _is_index_list(text: str) -> bool:
    return all(x.strip().isdigit() for x in text.split(","))


def _visible_cuda_indices() -> set[int] | None:
    """Physical indices allowed by CUDA_VISIBLE_DEVICES; None when unset or not numeric
    (GPU UUIDs: the agent cannot map them without the driver, so it filters nothing)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    if visible.strip() == "":
        return set()
    return {int(x) for x in visible.split(",")} if _is_index_list(visible) else None


def host_memory_bytes(meminfo: str = DEFAULT_MEMINFO) -> int:
    """Total host RAM in bytes (``MemTotal`` of /proc/meminfo, falling back to sysconf)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def usable_cpu_count() -> int:
    """CPUs this process may run on (affinity mask; honours taskset/cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def hardware_report(
    worker_id: str,
    address: str,
    slots: int,
    cuda_devices: list[control_pb2.Device],
    meminfo: str = DEFAULT_MEMINFO,
) -> control_pb2.WorkerRegistration:
    """The registration this node sends first on every session.

    Args:
        worker_id: stable id of this node agent (kept across reconnects).
        address: host:port where this agent's gRPC server is reachable from other nodes.
        slots: rank processes this node may run (one per device).
        cuda_devices: from :func:`detect_cuda_devices`; empty means one "cpu" device
            (named after the CPU model, with the host's RAM as its memory).
        meminfo: where the host's RAM is read (the same file :class:`MemorySampler` reads).

    Raises:
        ValueError: ``slots`` < 1.
    """
    if slots < 1:
        raise ValueError(f"worker: slots: must be >= 1, got {slots}")
    memory = host_memory_bytes(meminfo)
    devices = list(cuda_devices) or [control_pb2.Device(kind="cpu", index=0, name=cpu_model_name(), memory_bytes=memory)]
    return control_pb2.WorkerRegistration(
        worker_id=worker_id,
        host=socket.gethostname(),
        address=address,
        devices=devices,
        memory_bytes=memory,
        cpu_count=usable_cpu_count(),
        slots=slots,
    )


# ---------------------------------------------------------------- memory pressure


def read_meminfo(meminfo: str = DEFAULT_MEMINFO) -> tuple[int, int] | None:
    """(available, total) host memory in bytes from ``MemAvailable`` and ``MemTotal``.

    Returns None when the file cannot be read or lacks either field (kernels before 3.14
    have no ``MemAvailable``); never raises.
    """
    fields: dict[str, int] = {}
    try:
        with open(meminfo) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemTotal"):
                    fields[name] = int(rest.split()[0]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in fields or not fields.get("MemTotal"):
        return None
    return fields["MemAvailable"], fields["MemTotal"]


class MemorySampler:
    """Reports the node entering and leaving memory pressure (``WorkerEvent{memory_pressure}``).

    Every ``interval_seconds`` it reads ``meminfo``. Under pressure means
    ``MemAvailable / MemTotal < fraction``; relieved means the ratio is back at or above
    ``fraction + MEMORY_PRESSURE_HYSTERESIS``. Only the crossings are reported (the first
    sample counts as one when it is already under pressure); a sample that cannot be read
    changes nothing.

    Args:
        worker_id: stamped on every report.
        emit: queues one ``WorkerEvent`` for control; must not block.
        log: a structlog logger.
        meminfo: the file read (``/proc/meminfo``; tests pass a file they write).
        interval_seconds: seconds between samples, > 0.
        fraction: threshold on available/total, in (0, 1). Default 0.10 of the node's
            memory: below it the kernel is close to reclaiming page cache hard or to
            the OOM killer on a node running large ranks.

    Raises:
        ValueError: ``interval_seconds`` <= 0 or ``fraction`` outside (0, 1).
    """

    def __init__(
        self,
        worker_id: str,
        emit: Emit,
        log: Any,
        meminfo: str = DEFAULT_MEMINFO,
        interval_seconds: float = 2.0,
        fraction: float = 0.10,
    ):
        if not interval_seconds > 0:
            raise ValueError(f"worker: memory check interval: must be > 0 seconds, got {interval_seconds}")
        if not 0 < fraction < 1:
            raise ValueError(f"worker: memory pressure fraction: must be in (0, 1), got {fraction}")
        self._worker_id = worker_id
        self._emit = emit
        self._log = log
        self._meminfo = meminfo
        self._interval = interval_seconds
        self._fraction = fraction
        self._under = False
        self._unreadable_logged = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _sample(self) -> None:
        """Read the file once and report a crossing if there is one."""
        reading = read_meminfo(self._meminfo)
        if reading is None:
            if not self._unreadable_logged:
                self._log.warning("cannot read MemAvailable/MemTotal; memory pressure not reported", meminfo=self._meminfo)
                self._unreadable_logged = True
            return
        available, total = reading
        ratio = available / total
        if not self._under and ratio < self._fraction:
            self._under = True
        elif self._under and ratio >= self._fraction + MEMORY_PRESSURE_HYSTERESIS:
            self._under = False
        else:
            return
        self._log.warning(
            "memory pressure" if self._under else "memory pressure relieved",
            available_bytes=available, total_bytes=total, threshold=self._fraction,
        )
        self._emit(
            control_pb2.WorkerEvent(
                memory_pressure=control_pb2.MemoryPressure(
                    worker_id=self._worker_id, available_bytes=available, total_bytes=total, under_pressure=self._under
                )
            )
        )

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self._interval):
                return


# ---------------------------------------------------------------- outbox (events going up)


class Outbox:
    """Events going up to control, in the order they happened, kept until control
    acknowledges them.

    Every event put here gets the next sequence number of this agent incarnation
    (``WorkerEvent.seq``: 1, 2, 3, ...). A session sends them in order from the first one
    control has not acknowledged (:meth:`resume`, with the last seq control says it
    applied); :meth:`ack` forgets those control has applied and persisted. So an event
    that was in flight, or queued, when control went away is sent again after the agent
    re-registers, and control drops any it had applied already: none lost, none applied
    twice. Bounded, dropping the oldest, so a long control outage cannot exhaust the
    node's memory (``dropped`` counts what was lost; control sees the gap).
    """

    def __init__(self, max_events: int = 100_000):
        self._items: collections.deque[control_pb2.WorkerEvent] = collections.deque()  # seq ascending
        self._max = max_events
        self._cond = threading.Condition()
        self._seq = 0        # last seq given
        self._next = 0       # index in _items of the next event to send in this session
        self._sent = 0       # highest seq ever handed to a session
        self._open = False   # a session resumed and may take events
        self._acked = True   # the session's control acknowledges (else: sent = delivered)
        self.dropped = 0
        self.resent = 0      # events sent again after a reconnect (sent before, never acknowledged)

    def put(self, event: control_pb2.WorkerEvent) -> None:
        """Give ``event`` the next seq and queue it; never blocks."""
        with self._cond:
            self._seq += 1
            event.seq = self._seq
            if len(self._items) >= self._max:
                self._items.popleft()
                self._next = max(0, self._next - 1)
                self.dropped += 1
            self._items.append(event)
            self._cond.notify_all()

    def get(self, cancelled: threading.Event) -> control_pb2.WorkerEvent | None:
        """Block until the session may send the next event (returned; it stays queued
        until acknowledged) or ``cancelled`` is set and :meth:`interrupt` called (None)."""
        with self._cond:
            while (not self._open or self._next >= len(self._items)) and not cancelled.is_set():
                self._cond.wait()
            if cancelled.is_set():
                return None
            event = self._items[self._next]
            self._next += 1
            self._sent = max(self._sent, event.seq)
            if not self._acked:  # a control that acknowledges nothing: forget it once sent
                self._drop_through(event.seq)
            return event

    def resume(self, applied: int | None) -> tuple[int, int]:
        """A session opened and control has applied every event up to seq ``applied``:
        forget those, send the rest from the first. Returns (events to send, of which
        resent: sent before and never acknowledged). ``applied`` None: this control does not
        track sequences (no ``surge-last-seq`` header): what was sent counts as delivered,
        as it would never be deduplicated, and events are forgotten once sent."""
        with self._cond:
            self._acked = applied is not None
            self._drop_through(self._sent if applied is None else applied)
            self._next = 0
            self._open = True
            resend = sum(1 for e in self._items if e.seq <= self._sent)
            self.resent += resend
            self._cond.notify_all()
            return len(self._items), resend

    def pause(self) -> None:
        """The session ended: nothing is taken until the next :meth:`resume`."""
        with self._cond:
            self._open = False
            self._cond.notify_all()

    def ack(self, seq: int) -> None:
        """Control applied and persisted every event up to ``seq``: forget them."""
        with self._cond:
            self._drop_through(seq)
            self._cond.notify_all()

    def last_seq(self) -> int:
        with self._cond:
            return self._seq

    def interrupt(self) -> None:
        """Wake every :meth:`get` so it re-checks its cancel flag."""
        with self._cond:
            self._cond.notify_all()

    def wait_empty(self, timeout: float) -> bool:
        """Block until every queued event was acknowledged (or ``timeout`` s)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items, timeout)

    def _drop_through(self, seq: int) -> None:
        while self._items and self._items[0].seq <= seq:
            self._items.popleft()
            self._next = max(0, self._next - 1)


# ---------------------------------------------------------------- rank processes


_END = object()  # closes a rank's command stream


@dataclass(eq=False)
class _Rank:
    """One launched rank process. Mutable fields are guarded by ``NodeAgent._lock``."""

    job_id: str
    rank: int
    init: engine_pb2.InitJob
    assignment: engine_pb2.RankAssignment
    proc: subprocess.Popen
    log_path: Path
    commands: queue.Queue = field(default_factory=queue.Queue)  # RankCommand | _END
    session: str = "none"  # "none" -> "open" -> "closed": one session per process
    dead: bool = False  # proc.wait() returned
    released: bool = False
    grace_seconds: float = 0.0
    kill_timer: threading.Timer | None = None
    stream_closed: threading.Event = field(default_factory=threading.Event)
    exited: threading.Event = field(default_factory=threading.Event)  # RankExited emitted


class RankNotLaunched(LookupError):
    """A hello names a (job, rank) that this node did not launch, or that already died."""


class RankAlreadyAttached(RuntimeError):
    """A second session for a rank process that already had one."""


def rank_command_line(module: str, session_address: str, job_id: str, rank: int) -> list[str]:
    """argv of one rank process (``python -m <module> --session ... --job ... --rank ...``)."""
    return [sys.executable, "-m", module, "--session", session_address, "--job", job_id, "--rank", str(rank)]


def cuda_index(device: str) -> int | None:
    """Physical CUDA index of an assignment's device ("cuda:3" -> 3); None for "cpu" or a
    bare "cuda" (then the rank sees every device)."""
    m = re.fullmatch(r"cuda:(\d+)", device.strip())
    return int(m.group(1)) if m else None


def rank_environment(base: Mapping[str, str], assignment: engine_pb2.RankAssignment) -> dict[str, str]:
    """Environment of a rank process: the agent's, plus its thread count and device.

    ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = ``num_threads`` (when > 0) so ranks sharing a
    node do not oversubscribe its cores; ``CUDA_VISIBLE_DEVICES`` = the physical index only
    for a ``cuda:N`` device (the rank then sees it as ``cuda:0``).
    """
    env = dict(base)
    if assignment.num_threads > 0:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(assignment.num_threads)
    index = cuda_index(assignment.device)
    if index is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    env["PYTHONUNBUFFERED"] = "1"  # its log is read while it runs
    # `-m services.worker.rank` must resolve even when the agent was started elsewhere.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), base.get("PYTHONPATH", "")) if p)
    return env


def describe_exit(code: int) -> str:
    """'exited with code 1' / 'killed by SIGKILL' (Popen: negative code = signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _signal_group(pgid: int, sig: int) -> None:
    """Signal a rank's whole process group (the rank leads its own session), so helpers it
    started die with it. A group already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _safe_name(text: str) -> str:
    # job ids come from control, but they become file names here: no path tricks.
    return re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".") or "_"


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
    ):
        self._worker_id = worker_id
        self._session_address = session_address
        self._logs_dir = Path(run_dir) / "logs"
        self._emit = emit
        self._log = log
        self._rank_module = rank_module
        self._cwd = Path(cwd) if cwd is not None else Path.cwd()
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], _Rank] = {}
        self._stopping = False
        # Route counts of every rank process this agent launched, by (job, rank, pid): the
        # last each one reported (a rank sends its final counts when it ends).
        self._audits: dict[tuple[str, int, int], audit_pb2.AuditReport] = {}
        self._audit_seq = 0
        self._audit_answered = threading.Condition(self._lock)
        self._tails: dict[str, threading.Event] = {}  # request id -> stop flag of a log tail
        # job -> ranks this agent launched: the log files it wrote (agents sharing one run
        # dir must not each send every file).
        self._launched: dict[str, set[int]] = collections.defaultdict(set)

    # ------------------------------------------------------------ commands from control

    def execute(self, cmd: control_pb2.WorkerCommand) -> None:
        """Execute one command from control (launch, release or relay)."""
        kind = cmd.WhichOneof("command")
        if kind == "launch":
            self.launch_ranks(cmd.launch)
        elif kind == "release":
            self.release_ranks(cmd.release)
        elif kind == "rank_command":
            self.relay_rank_command(cmd.rank_command)
        elif kind == "tail_rank_logs":
            self.tail_rank_logs(cmd.tail_rank_logs)
        elif kind == "stop_tailing":
            self.stop_tailing(cmd.stop_tailing)
        else:
            self._log.warning("empty or unknown worker command ignored", kind=kind)

    def launch_ranks(self, msg: control_pb2.LaunchRanks) -> None:
        """Start one rank process per assignment, each in its own process group.

        A rank of this job still alive here is not started twice: if it was released, the
        launch waits for it to end (its grace period at most); otherwise the launch of
        that rank is refused and logged. A process that cannot be spawned is reported as
        ``RankExited`` with exit code 127.
        """
        for assignment in msg.ranks:
            self._launch_one(msg.job_id, msg.init, assignment)

    def release_ranks(self, msg: control_pb2.ReleaseRanks) -> None:
        """SIGTERM the job's live rank process groups, SIGKILL them after ``grace_seconds``
        (default 5 s), or SIGKILL at once with ``kill``. Does not block: each process's
        waiter reaps it and reports ``RankExited``."""
        grace = msg.grace_seconds if msg.grace_seconds > 0 else DEFAULT_GRACE_SECONDS
        with self._lock:
            for key in [k for k, r in self._ranks.items() if k[0] == msg.job_id and r.exited.is_set()]:
                del self._ranks[key]  # ended earlier: nothing left to release
            targets = [r for r in self._ranks.values() if r.job_id == msg.job_id and not r.dead]
            for r in targets:
                r.released = True
                r.grace_seconds = grace
                _signal_group(r.proc.pid, signal.SIGKILL if msg.kill else signal.SIGTERM)
                if not msg.kill:
                    r.kill_timer = threading.Timer(grace, self._kill_if_alive, args=(r,))
                    r.kill_timer.daemon = True
                    r.kill_timer.start()
        self._log.info("release", job_id=msg.job_id, ranks=[r.rank for r in targets], kill=msg.kill, grace_seconds=grace)

    def relay_rank_command(self, cmd: worker_pb2.RankCommand) -> None:
        """Deliver ``cmd`` to every live rank of the job named inside its payload (queued
        for a rank that has not said hello yet, delivered after its init and assignment).
        A payload without a ``job_id`` (``assignment``) cannot be routed and is dropped."""
        kind = cmd.WhichOneof("command")
        payload = getattr(cmd, kind) if kind else None
        job_id = getattr(payload, "job_id", "") if payload is not None else ""
        if not job_id:
            self._log.error("rank command names no job; cannot route it", kind=kind)
            return
        with self._lock:
            targets = [r for r in self._ranks.values() if r.job_id == job_id and not r.dead and r.session != "closed"]
            for r in targets:
                r.commands.put(cmd)
        if not targets:
            self._log.warning("rank command for a job with no live rank here", kind=kind, job_id=job_id)

    def tail_rank_logs(self, msg: control_pb2.TailRankLogs) -> None:
        """Operator log plumbing (StreamLogs): send up the lines of this job's rank log
        files on this node (``msg.rank`` only, unless -1) as ``RankLogLines`` batches, then
        with ``follow`` the lines appended later, until each rank process has exited and its
        file is drained (or :meth:`stop_tailing`); a final ``RankLogLines{done}`` ends it.
        Does not block: one thread per request reads the files."""
        stop = threading.Event()
        with self._lock:
            self._tails[msg.request_id] = stop
        threading.Thread(
            target=self._tail, args=(msg, stop), name=f"tail-{msg.job_id}-{msg.request_id[:8]}", daemon=True
        ).start()

    def stop_tailing(self, msg: control_pb2.StopTailing) -> None:
        """The StreamLogs caller went away: end that tail (its ``done`` still goes up)."""
        with self._lock:
            stop = self._tails.get(msg.request_id)
        if stop is not None:
            stop.set()

    # ------------------------------------------------------------ from rank sessions

    def attach(self, hello: worker_pb2.RankHello) -> _Rank:
        """A rank said hello: bind its session to the process launched for it.

        Raises:
            RankNotLaunched: no live process of (job_id, rank) was launched here.
            RankAlreadyAttached: that process already had a session.
        """
        with self._lock:
            r = self._ranks.get((hello.job_id, hello.rank))
            if r is None or r.dead:
                raise RankNotLaunched(f"worker {self._worker_id}: no live rank {hello.rank} of job {hello.job_id!r} here")
            if r.session != "none":
                raise RankAlreadyAttached(f"worker {self._worker_id}: rank {hello.rank} of job {hello.job_id!r} already has a session")
            r.session = "open"
        if hello.pid and hello.pid != r.proc.pid:
            self._log.warning("hello pid differs from the launched pid", job_id=r.job_id, rank=r.rank, hello_pid=hello.pid, pid=r.proc.pid)
        self._log.info("rank connected", job_id=r.job_id, rank=r.rank, pid=r.proc.pid)
        return r

    def relay_event(self, r: _Rank, event: worker_pb2.RankEvent) -> None:
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
                self._log.warning("rank event envelope names another rank; corrected", job_id=r.job_id, rank=r.rank, said_job=event.job_id, said_rank=event.rank)
            event.job_id, event.rank = r.job_id, r.rank
        self._emit(control_pb2.WorkerEvent(rank_event=event))

    def commands_for(self, r: _Rank) -> Iterator[worker_pb2.RankCommand]:
        """The command stream of one rank session: init, assignment, then what control
        relays, until the session or the process ends."""
        yield worker_pb2.RankCommand(init=r.init)
        yield worker_pb2.RankCommand(assignment=r.assignment)
        while (cmd := r.commands.get()) is not _END:
            yield cmd

    def detach(self, r: _Rank) -> None:
        """The rank's session ended (its process closed it or died)."""
        with self._lock:
            r.session = "closed"
        r.commands.put(_END)
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

            def answered(r: _Rank) -> bool:
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
        with self._lock:
            self._stopping = True
            live = [r for r in self._ranks.values() if not r.dead]
            for r in live:
                _signal_group(r.proc.pid, signal.SIGTERM)
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
                self._log.error("launch refused: rank already running here", job_id=job_id, rank=assignment.rank, pid=old.proc.pid)
                return
            if not old.exited.wait(old.grace_seconds + STREAM_SETTLE_SECONDS + 2.0):
                self._log.error("launch refused: released rank has not ended", job_id=job_id, rank=assignment.rank, pid=old.proc.pid)
                return
        log_path = self._logs_dir / f"{_safe_name(job_id)}.rank{assignment.rank}.log"
        argv = rank_command_line(self._rank_module, self._session_address, job_id, assignment.rank)
        try:
            proc = self._spawn(argv, log_path, rank_environment(os.environ, assignment))
        except OSError as e:
            self._log.error("rank spawn failed", job_id=job_id, rank=assignment.rank, error=str(e))
            self._emit(self._exited_event(job_id, assignment.rank, SPAWN_FAILED_EXIT_CODE, f"spawn failed: {e}"))
            return
        r = _Rank(job_id=job_id, rank=assignment.rank, init=init, assignment=assignment, proc=proc, log_path=log_path)
        with self._lock:
            self._ranks[key] = r
            self._launched[job_id].add(assignment.rank)
            if self._stopping:  # shutdown began while it was spawning and did not see it
                _signal_group(proc.pid, signal.SIGKILL)
        threading.Thread(target=self._watch, args=(r,), name=f"wait-{job_id}-{r.rank}", daemon=True).start()
        self._log.info("rank launched", job_id=job_id, rank=r.rank, pid=proc.pid, device=assignment.device, log=str(log_path))

    def rank_log_files(self, job_id: str, rank: int = -1) -> dict[int, Path]:
        """rank -> ``<run_dir>/logs/<job>.rank<R>.log`` of the ranks of ``job_id`` this
        agent launched (one rank unless ``rank`` is -1)."""
        prefix = f"{_safe_name(job_id)}.rank"
        with self._lock:
            ours = set(self._launched.get(job_id, ()))
        found: dict[int, Path] = {}
        if self._logs_dir.is_dir():
            for f in self._logs_dir.iterdir():
                digits = f.name[len(prefix):-len(".log")] if f.name.startswith(prefix) and f.name.endswith(".log") else ""
                if digits.isdigit() and int(digits) in ours and (rank < 0 or int(digits) == rank):
                    found[int(digits)] = f
        return dict(sorted(found.items()))

    def _rank_alive(self, job_id: str, rank: int) -> bool:
        with self._lock:
            r = self._ranks.get((job_id, rank))
            return r is not None and not r.exited.is_set()

    def _tail(self, msg: control_pb2.TailRankLogs, stop: threading.Event) -> None:
        """Tail thread of one TailRankLogs request."""
        files: dict[int, tuple[Any, bytearray]] = {}
        try:
            for rank, path in self.rank_log_files(msg.job_id, msg.rank).items():
                try:
                    files[rank] = (open(path, "rb"), bytearray())
                except OSError as e:
                    self._log.warning("rank log unreadable", job_id=msg.job_id, rank=rank, error=str(e))
            while files and not stop.is_set():
                grew = False
                for rank in list(files):
                    fh, partial = files[rank]
                    # Asked before reading: a line written before the exit is not missed.
                    alive = msg.follow and self._rank_alive(msg.job_id, rank)
                    chunk = fh.read()
                    if chunk:
                        grew = True
                        partial += chunk
                        *complete, rest = bytes(partial).split(b"\n")
                        partial[:] = rest
                        self._send_lines(msg, rank, [c.decode(errors="replace") for c in complete])
                    elif not alive:  # exited (or no follow) and drained
                        if partial:
                            self._send_lines(msg, rank, [bytes(partial).decode(errors="replace")])
                        fh.close()
                        del files[rank]
                if not grew and files:
                    # This tails a file, it does not poll a module: the kernel offers no
                    # portable append notification, so an empty read waits a moment.
                    stop.wait(TAIL_INTERVAL_SECONDS)
        except Exception:
            self._log.exception("rank log tail failed", job_id=msg.job_id, request_id=msg.request_id)
        finally:
            for fh, _ in files.values():
                fh.close()
            with self._lock:
                self._tails.pop(msg.request_id, None)
            self._emit(control_pb2.WorkerEvent(rank_log_lines=control_pb2.RankLogLines(
                request_id=msg.request_id, job_id=msg.job_id, done=True)))

    def _send_lines(self, msg: control_pb2.TailRankLogs, rank: int, lines: list[str]) -> None:
        lines = [line for line in lines if line.strip()]
        for i in range(0, len(lines), TAIL_BATCH_LINES):
            self._emit(control_pb2.WorkerEvent(rank_log_lines=control_pb2.RankLogLines(
                request_id=msg.request_id, job_id=msg.job_id, rank=rank, lines=lines[i:i + TAIL_BATCH_LINES])))

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

    def _watch(self, r: _Rank) -> None:
        """Waiter thread of one rank: reap it the moment it ends and report the fact."""
        code = r.proc.wait()
        reaped = time.time()
        with self._lock:
            r.dead = True  # from now on no session can attach to it
            had_session = r.session == "open"
        if had_session:
            r.stream_closed.wait(STREAM_SETTLE_SECONDS)
        _signal_group(r.proc.pid, signal.SIGKILL)  # helpers the rank left behind die with it
        if r.kill_timer is not None:
            r.kill_timer.cancel()
        r.commands.put(_END)  # a stream still held open by a stray helper ends now
        detail = describe_exit(code) + (" after release" if r.released else "") + f"; log {r.log_path}"
        self._log.info("rank exited", job_id=r.job_id, rank=r.rank, pid=r.proc.pid, exit_code=code, released=r.released)
        self._emit(self._exited_event(r.job_id, r.rank, code, detail, reaped=reaped, released=r.released))
        r.exited.set()

    def _kill_if_alive(self, r: _Rank) -> None:
        with self._lock:
            if not r.dead:
                _signal_group(r.proc.pid, signal.SIGKILL)

    def _exited_event(
        self, job_id: str, rank: int, code: int, detail: str, *, reaped: float | None = None, released: bool = False
    ) -> control_pb2.WorkerEvent:
        return control_pb2.WorkerEvent(
            rank_exited=control_pb2.RankExited(
                job_id=job_id, rank=rank, exit_code=code, worker_id=self._worker_id, detail=detail,
                unix_time=reaped or time.time(), released=released,
                # Ended by this agent's own shutdown (it is leaving): a departure, not a crash.
                departing=self._stopping and not released,
            )
        )


# ---------------------------------------------------------------- RankSession server


class RankSessionServicer(worker_pb2_grpc.WorkerServiceServicer):
    """``WorkerService.RankSession``: the stream each local rank keeps with the agent.

    The first ``RankEvent`` must be ``hello``; a hello for a rank this node did not launch
    is refused with NOT_FOUND, a second session for one process with ALREADY_EXISTS, any
    other first event with INVALID_ARGUMENT.
    """

    def __init__(self, agent: NodeAgent, log: Any):
        self._agent = agent
        self._log = log

    def RankSession(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        try:
            first = next(request_iterator, None)
        except grpc.RpcError:
            return  # the rank went away before saying anything
        if first is None:
            return
        if first.WhichOneof("event") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "RankSession: the first RankEvent must be hello")
        try:
            r = self._agent.attach(first.hello)
        except RankNotLaunched as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except RankAlreadyAttached as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        self._agent.relay_event(r, first)
        threading.Thread(target=self._read, args=(r, request_iterator), name=f"rank-{r.job_id}-{r.rank}", daemon=True).start()
        yield from self._agent.commands_for(r)

    def _read(self, r: _Rank, request_iterator: Iterator[worker_pb2.RankEvent]) -> None:
        try:
            for event in request_iterator:
                self._agent.relay_event(r, event)
        except grpc.RpcError:
            pass  # the rank's side is gone (process ended or cancelled): the waiter reports it
        finally:
            self._agent.detach(r)


# ---------------------------------------------------------------- session with control

_UNREACHABLE = "unreachable"
# Initial-metadata key with which control acknowledges a registration (its value: the
# worker id). Mirrors services/control/server.py REGISTERED_HEADER; the agent does not
# import control's code.
REGISTERED_HEADER = "surge-registered"
LAST_SEQ_HEADER = "surge-last-seq"  # mirrors services/control/server.py LAST_SEQ_HEADER


class ControlSession:
    """Keeps the ``ControlService.WorkerSession`` stream open and executes what comes down.

    Every session starts with ``WorkerEvent{register}`` (the node's hardware and the ranks
    it runs now) and then carries the outbox from the first event control has not applied
    (the ``surge-last-seq`` header control answers the registration with). When control is
    unreachable or the stream breaks (control killed: its calls fail), it reconnects (the
    channel's own backoff, 200 ms doubling to ``max_backoff_seconds``) and registers again,
    declaring the ranks it still runs; rank processes are not touched, they keep training.
    ``WorkerCommand{ack}`` forgets acknowledged events. Failed attempts are logged at most
    once every ``log_every_seconds``.

    Args:
        address: host:port of the control service.
        registration: sent first on every session (a callable: built anew for each).
        outbox: events to send up.
        execute: runs one ``WorkerCommand`` (called on this session's thread, in order).
        log: a structlog logger.
    """

    HEALTHY_SESSION_SECONDS = 10.0  # a session that lived this long resets the backoff

    def __init__(
        self,
        address: str,
        registration: control_pb2.WorkerRegistration | Callable[[], control_pb2.WorkerRegistration],
        outbox: Outbox,
        execute: Callable[[control_pb2.WorkerCommand], None],
        log: Any,
        max_backoff_seconds: float = 2.0,
        log_every_seconds: float = 5.0,
    ):
        self._address = address
        self._registration = registration
        self._outbox = outbox
        self._execute = execute
        self._log = log
        self._max_backoff = max_backoff_seconds
        self._log_every = log_every_seconds
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._ready: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name="control-session", daemon=True)
        self._channel = channel(  # TLS and the bearer token when SURGE_TLS_* / SURGE_AUTH_TOKEN are set
            address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", int(max_backoff_seconds * 1000)),
            ],
        )

    def start(self) -> None:
        self._thread.start()

    def close(self, drain_seconds: float = 1.0) -> None:
        """Give queued events ``drain_seconds`` to go up, then end the session for good."""
        self._outbox.wait_empty(drain_seconds)
        self._stop.set()
        with self._lock:
            if self._ready is not None:
                self._ready.cancel()
            if self._call is not None:
                self._call.cancel()
        self._outbox.interrupt()
        self._thread.join(timeout=5.0)
        self._channel.close()

    # ------------------------------------------------------------ private

    def _run(self) -> None:
        attempts, last_log, delay = 0, -math.inf, 0.2
        while not self._stop.is_set():
            opened = time.monotonic()
            problem = self._session_once()
            if self._stop.is_set():
                return
            if time.monotonic() - opened > self.HEALTHY_SESSION_SECONDS:
                attempts, delay = 0, 0.2
            attempts += 1
            now = time.monotonic()
            if now - last_log >= self._log_every:
                self._log.warning("control session down; retrying", control=self._address, attempts=attempts, problem=problem)
                last_log = now
            if problem != _UNREACHABLE:
                # Control answered and ended the session at once: back off here, as the
                # channel's own reconnect backoff only paces connection attempts.
                self._stop.wait(delay)
                delay = min(delay * 2, self._max_backoff)

    def _session_once(self) -> str:
        """One session: wait for the channel, register, relay until it ends. Returns why
        it ended (for the log)."""
        ready = grpc.channel_ready_future(self._channel)
        with self._lock:
            if self._stop.is_set():
                return "stopping"
            self._ready = ready
        try:
            ready.result(timeout=self._max_backoff)
        except grpc.FutureTimeoutError:
            return _UNREACHABLE
        except grpc.FutureCancelledError:
            return "stopping"
        finally:
            with self._lock:
                self._ready = None
        ended = threading.Event()
        stub = control_pb2_grpc.ControlServiceStub(self._channel)
        try:
            with self._lock:
                if self._stop.is_set():
                    return "stopping"
                self._call = stub.WorkerSession(self._requests(ended))
            # Control acknowledges the registration with an initial-metadata header; a
            # control that sends none answers with its first command or when it closes.
            header = dict(self._call.initial_metadata() or ())
            applied = int(header[LAST_SEQ_HEADER]) if header.get(LAST_SEQ_HEADER, "").isdigit() else None
            pending, resent = self._outbox.resume(applied)
            if REGISTERED_HEADER in header:
                self._log.info("registered with control", control=self._address, acknowledged=header[REGISTERED_HEADER],
                               last_applied_seq=applied, events_to_send=pending, events_resent=resent,
                               events_resent_total=self._outbox.resent, last_seq=self._outbox.last_seq())
            else:
                self._log.info("session open; no registration acknowledgement", control=self._address)
            for cmd in self._call:
                if cmd.WhichOneof("command") == "ack":
                    self._outbox.ack(cmd.ack.seq)
                    continue
                self._run_command(cmd)
            return "stream closed by control"
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            return f"{getattr(code, 'name', 'error')}: {e.details() if hasattr(e, 'details') else e}"
        finally:
            ended.set()
            self._outbox.pause()
            with self._lock:
                self._call = None

    def _requests(self, ended: threading.Event) -> Iterator[control_pb2.WorkerEvent]:
        reg = self._registration() if callable(self._registration) else self._registration
        yield control_pb2.WorkerEvent(register=reg)
        while (event := self._outbox.get(ended)) is not None:
            yield event

    def _run_command(self, cmd: control_pb2.WorkerCommand) -> None:
        try:
            self._execute(cmd)
        except Exception:  # a command that fails must not drop the node's session
            self._log.exception("worker command failed", kind=cmd.WhichOneof("command"))
