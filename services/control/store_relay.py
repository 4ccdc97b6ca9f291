"""The relay to the `store` service (``StoreRelay``): VerifyCheckpoints and the scrub for
L5-1, forwarded without blocking, the answer coming back as L5-1's event; L1-1's
RetireMetricSeries for L5-2 and RetireCheckpointSeries for L5-1, forwarded without blocking
(nothing waits for their answers); and the store's
``CheckpointCorrupt`` events, watched for as long as control runs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from services.common.grpc_server import channel
from services.contract import Module, store_pb2, store_pb2_grpc
from services.contract.bus import Emitter
from services.contract.relay import Link

_log = structlog.get_logger("store_relay")


class StoreRelay:
    """VerifyCheckpoints (and the scrub) for L5-1, forwarded to the `store` service at
    ``address`` without blocking: the command returns at once and the store's answer comes
    back as L5-1's event, ``CheckpointVerification``, or ``SnapshotFailed`` with a typed
    cause when the store could not be asked (``UNREACHABLE``: gRPC UNAVAILABLE;
    ``TIMEOUT``: DEADLINE_EXCEEDED; ``REJECTED``: any other status). Why: the recovery's
    verification ran as a blocking call on control's one event-applier thread, inside the
    orchestrator's lock, and a stopped store froze every job's heartbeats behind it.

    ``post`` runs the delivery of an answer (the composition root passes the event
    applier's ``call``, so answers are applied in order with the node agents' events;
    default: on the gRPC callback thread). ``on_error`` sees every failed call first (the
    composition root reports a boundary violation the store returned)."""

    def __init__(
        self,
        address: str,
        events: Emitter,
        timeout_s: float = 10.0,
        on_error: Callable[[grpc.RpcError], None] | None = None,
        post: Callable[[Callable[[], None]], None] | None = None,
        back: Link | None = None,
    ):
        self._address, self._timeout_s = address, timeout_s
        self._events = events
        self._on_error = on_error
        self._back = back
        self.post = post or (lambda fn: fn())
        self._stub: store_pb2_grpc.StoreServiceStub | None = None
        self._channel: grpc.Channel | None = None  # (the calls' one channel, closed by ``close``)
        self._closed = threading.Event()
        self._watching: Any = None

    def verify_checkpoints(self, msg: store_pb2.VerifyCheckpoints, payload: Any = None) -> None:
        """Which committed versions of the job are intact, from the store's recorded
        verdicts; answered later as an event (see the class)."""
        self._ask("Verify", msg, "verify", msg.job_id)

    def scrub_checkpoints(self, msg: store_pb2.ScrubCheckpoints, payload: Any = None) -> None:
        """Have the store re-hash the job's versions now; answered later as
        ``CheckpointScrubbed`` (or a typed ``SnapshotFailed``, operation ``scrub``)."""
        self._ask("Scrub", msg, "scrub", msg.job_id)

    def retire_metric_series(self, msg: store_pb2.RetireMetricSeries, payload: Any = None) -> None:
        """L1-1's word to L5-2 that the job's series are retired (its end, a relaunch),
        forwarded without blocking; nothing waits for the answer. A call that fails is logged
        (a boundary violation it carries reported, ``on_error``) and not retried: the series
        then stay until the store restarts (an unreachable store's restart drops them anyway),
        nothing else is lost."""
        future = self._call("RetireSeries", msg)
        if future is not None:
            future.add_done_callback(lambda f: self._retired(f, msg.job_id))

    def retire_checkpoint_series(self, msg: store_pb2.RetireCheckpointSeries, payload: Any = None) -> None:
        """L1-1's word to L5-1 that the job ended (its checkpoint series go), forwarded without
        blocking like ``retire_metric_series``; nothing waits for the answer."""
        future = self._call("RetireJobCheckpointSeries", msg)
        if future is not None:
            future.add_done_callback(lambda f: self._retired(f, msg.job_id))

    def _retired(self, future: grpc.Future, job_id: str) -> None:
        try:
            future.result()
        except grpc.RpcError as e:
            if self._on_error is not None:
                self._on_error(e)
            _log.warning("metric_series_not_retired", job_id=job_id, code=e.code().name, details=e.details())

    def watch(self) -> None:
        """Relay the store's ``CheckpointCorrupt`` events (its scrub found a committed
        version's bytes wrong) for as long as control runs: one server stream
        (``WatchCheckpoints``), opened again with backoff while the store is away."""
        threading.Thread(target=self._watch, name="store-watch", daemon=True).start()

    def close(self) -> None:
        """End the watch and close the calls' channel (once; later calls are dropped). Closed
        here, at a known point, not by the garbage collector wherever it runs: a channel
        collected unclosed is closed in its ``__del__``, and one such close hung a test
        process's main thread in it (grpc #42247's kind; session 43)."""
        self._closed.set()
        watching = self._watching  # (read after the set: the watch re-checks after it assigns)
        if watching is not None:
            watching.cancel()
        ch, self._channel = self._channel, None
        if ch is not None:
            ch.close()

    def _call(self, method: str, msg: Any) -> grpc.Future | None:
        """``method`` of the store, not waited for, on the relay's one channel (made at the
        first call); None once the relay is closed (control is stopping: nothing is asked)."""
        if self._closed.is_set():
            return None
        if self._stub is None:
            self._channel = channel(self._address, module=Module.L1_ORCHESTRATOR)
            self._stub = store_pb2_grpc.StoreServiceStub(self._channel)
        try:
            return getattr(self._stub, method).future(msg, timeout=self._timeout_s)
        except ValueError:  # the channel closed under it (``close``, from another thread)
            return None

    def _watch(self) -> None:
        # One channel for the watch's life, owned by this thread: gRPC reconnects it (its
        # backoff capped at the watch's own), and it is closed here, once, at the end. A channel
        # a try, closed after each, was a hazard: the close of the process's last channel,
        # with the store's server gone, destroys gRPC's event engine holding the GIL (grpc
        # #42247), and one such close froze a test process whole (ci5).
        watch = channel(
            self._address,
            options=[("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 5000)],
            module=Module.L1_ORCHESTRATOR,
        )
        stub = store_pb2_grpc.StoreServiceStub(watch)
        backoff = 0.5
        try:
            while not self._closed.is_set():
                # (not SINGLE_THREADED_STREAM: this thread would wait in gRPC all the time, waking
                # as often as the spin thread does -- 7.9 wake-ups a second against 7.2 + 0.5, session 37)
                self._watching = call = stub.WatchCheckpoints(store_pb2.WatchCheckpointsRequest())
                if self._closed.is_set():
                    call.cancel()  # (close ran between the loop's check and the assignment)
                try:
                    for corrupt in call:
                        backoff = 0.5
                        self.post(lambda c=corrupt: self._events(c))
                except grpc.RpcError:
                    pass  # the store went away (or control is closing): watch again once it is back
                self._closed.wait(backoff)  # (the relay's own reconnect backoff, not a module's poll)
                backoff = min(backoff * 2, 5.0)
        finally:
            watch.close()

    def _ask(self, method: str, msg: Any, operation: str, job_id: str) -> None:
        future = self._call(method, msg)
        if future is None:
            return
        future.add_done_callback(lambda f: self.post(lambda: self._answer(f, operation, job_id)))

    def _answer(self, future: grpc.Future, operation: str, job_id: str) -> None:
        if self._closed.is_set():
            return  # control is stopping: its journal may be closed; a restarted control asks again
        try:
            reply = future.result()
        except grpc.RpcError as e:
            if self._on_error is not None:
                self._on_error(e)
            cause = _STORE_CAUSES.get(e.code(), store_pb2.REJECTED)

            def the_call(msg: Any) -> None:
                # L5-1's failure event as its bus built it names the message it handled
                # (failure.operation), not which store operation that was: this call's.
                if isinstance(msg, store_pb2.SnapshotFailed):
                    msg.operation = msg.operation or operation
                    msg.job_id = msg.job_id or job_id
                    msg.cause = msg.cause or cause

            # The failure events the store's modules sent control's side, by name (``back``:
            # control's link checks them); L5-1's own SnapshotFailed replaces the one below.
            returned = self._back.deliver_returned(e, stamp=the_call) if self._back is not None else []
            if store_pb2.SnapshotFailed.DESCRIPTOR.full_name in returned:
                return
            reply = store_pb2.SnapshotFailed(
                job_id=job_id,
                operation=operation,
                cause=cause,
                reason=f"store {self._address}: {e.code().name}: {e.details()}",
            )
        self._events(reply)


# gRPC status -> the typed cause of a store call that failed (the status code, never its text).
_STORE_CAUSES = {
    grpc.StatusCode.UNAVAILABLE: store_pb2.UNREACHABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: store_pb2.TIMEOUT,
    grpc.StatusCode.CANCELLED: store_pb2.UNREACHABLE,
}
