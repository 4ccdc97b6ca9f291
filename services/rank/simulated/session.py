"""The simulated rank's ``WorkerService.RankSession`` with its node agent (worker.proto).

The same protocol as the real rank's session (``services/rank/__main__.py`` ``Session``,
which this cannot import: that module imports torch): hello first; ``init`` and
``assignment`` come down; routed events go up by name (``RankEvent{routed}``, checked
against the route table by :func:`services.contract.relay.pack`), a heartbeat every
``liveness.heartbeat_interval_seconds`` from a side thread stating the last step and the
phase, the final ``audit`` before the terminal event; routed commands come down and are
handed to the caller's queue. A session that ends before the terminal event was sent means
the agent is gone: the process exits at once (code 3), as a real rank does.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import grpc

from services.common.beat_grid import phase_from, seconds_to_next_beat
from services.common.grpc_server import channel
from services.common.phase import IDLE
from services.common.process_exit import exit_now, last_words
from services.contract import Module, engine_pb2, worker_pb2, worker_pb2_grpc
from services.contract.audit import report_of
from services.contract.relay import pack, unpack
from services.rank.command_delay import CommandDelay

EXIT_SESSION_LOST = 3
_TERMINAL = (engine_pb2.TrainingLoopFinished, engine_pb2.TrainingLoopFailed)


class SessionLost(RuntimeError):
    fault_class = "session_lost"


class SimSession:
    """Events up (a queue drained by gRPC's request iterator: never blocks a step), commands
    down (a reader thread puts each routed command, unpacked, on :attr:`commands`)."""

    def __init__(self, address: str, job_id: str, rank: int):
        self._job_id, self._rank = job_id, rank
        self.process = f"simulated rank {rank} of job {job_id}"
        self.commands: queue.Queue = queue.Queue()
        self._delay = CommandDelay.from_env(rank, job_id)  # test-only (SURGE_COMMAND_DELAY); none by default
        self._out: queue.Queue = queue.Queue()
        self._channel = channel(address, module=Module.L2_TRAINING_LOOP)  # a rank speaks as its loop
        self._call = worker_pb2_grpc.WorkerServiceStub(self._channel).RankSession(self._requests())
        self._lock = threading.Lock()
        self._step, self._step_seconds, self._stepping = 0, 0.0, False
        self._phase, self._phase_since = IDLE, time.monotonic()
        self._interval = 1.0
        self._beat_phase = phase_from()  # the node's place on the beat grid (its agent's)
        self._closing = threading.Event()
        self._terminal_sent = threading.Event()
        self._ended = threading.Event()  # the agent ended the call
        self.on_metrics_ack: Any = None  # the metrics client's ``acked`` (reader thread)
        self._send(hello=worker_pb2.RankHello(job_id=job_id, rank=rank, pid=os.getpid()))
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

    def receive_setup(self) -> tuple[engine_pb2.InitJob, engine_pb2.RankAssignment]:
        """The first two commands, InitJob and RankAssignment, in either order.
        Raises SessionLost if the stream ends first, RuntimeError on any other command."""
        got: dict[str, Any] = {}
        try:
            while len(got) < 2:
                cmd = next(self._call)
                kind = cmd.WhichOneof("command")
                if kind not in ("init", "assignment") or kind in got:
                    raise RuntimeError(f"rank session: expected init and assignment first, got {kind!r}")
                got[kind] = getattr(cmd, kind)
        except (StopIteration, grpc.RpcError) as e:
            raise SessionLost(f"rank session ended before init and assignment arrived: {e}") from None
        threading.Thread(target=self._read, name="session", daemon=True).start()
        return got["init"], got["assignment"]

    def set_heartbeat_interval(self, seconds: float) -> None:
        self._interval = seconds

    def mark(
        self, phase: int, *, step: int | None = None, step_seconds: float = 0.0, stepping: bool | None = None
    ) -> None:
        """What the next beats state: the phase the main thread entered (worker.proto
        RankPhase), the last completed step, whether steps are expected."""
        with self._lock:
            if phase != self._phase:
                self._phase, self._phase_since = phase, time.monotonic()
            if step is not None:
                self._step, self._step_seconds = step, step_seconds
            if stepping is not None:
                self._stepping = stepping

    def send_up(self, msg: Any, sender: int = Module.L2_TRAINING_LOOP) -> None:
        """One routed event up, from ``sender`` (route-checked). Before a terminal event goes
        the final audit: once control hears of the end it may release this process."""
        routed = pack(msg, sender)
        if isinstance(msg, _TERMINAL):
            with self._lock:
                self._stepping = False
            self._send(audit=report_of(self.process))
            self._terminal_sent.set()
        self._send(routed=routed)

    def send_metrics(self, record: Any) -> None:
        """One metric record to the node agent, which carries it to the store on its node's
        one Record stream (``RankEvent{metrics}``, as the real rank; queued, never blocks)."""
        self._send(metrics=record)

    def wait_released(self) -> None:
        """Block until the node agent ends the session (control released this rank)."""
        self._ended.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Half-close after the queued events; wait (bounded) for the agent to end the call."""
        self._closing.set()
        self._out.put(None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._ended.is_set():
            self._ended.wait(0.1)
        self._call.cancel()
        self._channel.close()

    # ------------------------------------------------------------------ private

    def _send(self, **event: Any) -> None:
        self._out.put(worker_pb2.RankEvent(job_id=self._job_id, rank=self._rank, **event))

    def _requests(self):
        while (event := self._out.get()) is not None:
            yield event

    def _beat(self) -> None:
        """The first beat right after the hello (the deadline covers the set-up), then one
        every interval until the session closes."""
        while True:
            with self._lock:
                beat = worker_pb2.RankHeartbeat(
                    job_id=self._job_id,
                    rank=self._rank,
                    step=self._step,
                    stepping=self._stepping,
                    step_seconds=self._step_seconds,
                    unix_time=time.time(),
                    interval_seconds=self._interval,
                    phase=self._phase if self._stepping else IDLE,
                    phase_seconds=time.monotonic() - self._phase_since if self._stepping else 0.0,
                )
            self._send(heartbeat=beat)
            # On the node's grid: its ranks' beats reach the agent together (beat_grid.py).
            if self._closing.wait(seconds_to_next_beat(time.time(), self._interval, self._beat_phase)):
                return

    def _read(self) -> None:
        try:
            for cmd in self._call:
                kind = cmd.WhichOneof("command")
                if kind == "metrics_ack":
                    if self.on_metrics_ack is not None:
                        self.on_metrics_ack(cmd.metrics_ack)
                elif kind == "audit":
                    self._send(audit=report_of(self.process, request_id=cmd.audit.id))
                elif kind == "routed":
                    self._delay.hold(cmd.routed.type)  # (test-only; in line: the commands behind it wait too)
                    try:
                        self.commands.put(unpack(cmd.routed))
                    except Exception as e:  # noqa: BLE001 - an unreadable command is logged, the session goes on
                        last_words(f"simulated rank: command {cmd.routed.type} not read: {e}\n")
        except grpc.RpcError:
            pass
        self._ended.set()
        if not self._terminal_sent.is_set():
            last_words("simulated rank: session to the node agent ended; exiting\n")
            exit_now(EXIT_SESSION_LOST)
