"""How a rank's checkpoint relay waits for the store: as long as the store answers, never
past the moment it stops answering.

A save's store calls (``BeginSave``, and the next save's wait for the previous
``CommitSave``) are slow for two different reasons, which a fixed deadline confuses: a
store that is alive but busy (hundreds of ranks asking at once, a loaded machine: the
answer comes, late) and a store that is gone or stopped (SIGSTOP, a hung host: no answer
comes). Slowness is not an outage (issue 27: 256 simulated ranks on a loaded 2-core machine
skipped saves as "store timeouts" while the store's own commit took 0.06 s). So a call
carries no short deadline of its own; once it has waited ``silent_s / 2`` the relay asks
the store's standard health service (``grpc.health.v1.Health/Check``, answered on the
store's asyncio loop, not by the save's control-call threads) on the same channel, one
probe at a time, ``silent_s / 2`` apart, each given ``silent_s`` to answer (a call a quiet
store answers sooner costs no probe, and hundreds of ranks waiting add at most two probes a
window each: the probes must not load the store they wait for):

* a probe answered: the store is alive; the call is waited for, up to ``bound_s`` (derived
  by the caller from what it waits for: the rank's checkpoint-staging budget, past which
  L1-3 would judge the rank stalled);
* a probe unanswered for ``silent_s`` (DEADLINE_EXCEEDED; the window grows with the world
  size, ``PER_RANK_S`` a rank: its ranks all ask at once): the store does not answer, cause
  TIMEOUT, found at most 1.5 x ``silent_s`` after the call began (the old fixed deadline:
  ``silent_s``, a busy store's save skipped with it);
* a probe refused (UNAVAILABLE: nothing listens): cause UNREACHABLE (a call to a store that
  is gone fails so by itself, at once);
* the bound passed while the store answered probes: cause TIMEOUT (alive, but this call
  made no progress in all that time).

Once a wait found the store silent (a probe unanswered or refused), the relay remembers it
(a circuit breaker, as the field does): while the store stays silent, the next saves' waits
and calls fail at once with the same typed cause ("store silent since ..."), instead of
waiting a window again at every save (an 89 s outage under a job saving every 50 steps cost
15-18 s of training at each save: session 35). One background probe at a time
(:meth:`StoreLiveness._reprobe`, never a thread per save) asks the store again, a probe
after another, and closes the breaker as soon as the store answers: the next save goes
through. The first detection keeps its window (slowness is not an outage); a bound passed
while the store answered opens nothing (alive); the run's end (a flush: its last commit has
no next interval) waits for the store as before, breaker or not.

The wait raises :class:`StoreSilent` with the typed cause; what becomes of the save is the
caller's report (``SnapshotFailed``) and L1-1's decision, as before. Torch-free: the real
rank's relay (``store_client.py``) and the simulated rank's (``simulated/shard_save.py``)
both wait through it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.contract import route_pb2, store_pb2


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


# How long the store may leave a liveness probe unanswered before it counts as not
# answering (the outage's detection time; the old fixed deadline of BeginSave, same variable).
STORE_SILENT_S = _env_seconds("SURGE_STORE_RPC_TIMEOUT_S", 10.0)
PROBE_SHARE = 0.5  # the first probe after, and between probes, this share of silent_s
# After a refused probe (UNAVAILABLE: nothing listens, or the channel's reconnect backoff) the
# breaker's prober asks again this soon, not PROBE_SHARE x silent_s later: a refusal costs the
# store nothing, and a store started again was refused saves for up to 5 s (a window of 10 s;
# more with the world size) after `surgectl restart store` said it served.
REFUSED_RETRY_S = 1.0
# What a probe's answer waits for at a save besides the store: every rank of the job asks at
# once, and those processes share the store's machine (256 simulated ranks on 2 cores: the
# store's health answer came after more than 10 s, its CPU idle, at a load average of 250).
# The window grows by this much per rank of the world (256 ranks: 10 + 25.6 s).
PER_RANK_S = 0.1
# The bound of a wait while the store answers, when the caller has no budget of its own:
# the default liveness.phase_seconds.checkpoint_staging (600 s), less a margin, so the
# relay reports first and L1-3 never takes a slow store for a stalled rank.
STAGING_BUDGET_S = 600.0
BOUND_SHARE = 0.8


def wait_bound_s(staging_budget_s: float = STAGING_BUDGET_S, silent_s: float = STORE_SILENT_S) -> float:
    """How long a save waits for a store that answers probes (seconds): ``BOUND_SHARE`` of
    the rank's checkpoint-staging budget (the phase it beats meanwhile), never below ``silent_s``."""
    return max(silent_s, BOUND_SHARE * staging_budget_s)


class StoreSilent(Exception):
    """The store stopped answering (``cause`` TIMEOUT: a probe went unanswered; UNREACHABLE:
    refused), or answered probes but not this call within its bound (TIMEOUT).
    ``failure_cause``: the matching ``route_pb2.FailureCause``; ``code``: the gRPC status that
    stands for it (DEADLINE_EXCEEDED or UNAVAILABLE)."""

    def __init__(self, message: str, cause: int, detail: str = ""):
        super().__init__(message)
        self.cause = cause
        self.detail = detail or message  # (what was found, without the store and the call)
        self.code = grpc.StatusCode.UNAVAILABLE if cause == store_pb2.UNREACHABLE else grpc.StatusCode.DEADLINE_EXCEEDED
        self.failure_cause = (
            route_pb2.FAILURE_UNAVAILABLE if cause == store_pb2.UNREACHABLE else route_pb2.FAILURE_TIMEOUT
        )


class StoreLiveness:
    """Waits for a store call or a future that depends on the store (module docstring).

    Args:
        channel: the channel the calls go on (the probes share its connection).
        address: the store's address, for messages.
        silent_s: how long a probe may go unanswered, for a world of one rank (default
            ``SURGE_STORE_RPC_TIMEOUT_S``, 10 s); ``PER_RANK_S`` more per rank of the world
            (:meth:`set_world_size`).
    """

    def __init__(
        self,
        channel: grpc.Channel,
        address: str,
        silent_s: float | None = None,
        world_size: int = 1,
    ):
        self._health = health_pb2_grpc.HealthStub(channel)
        self._address = address
        self._base_s = STORE_SILENT_S if silent_s is None else silent_s
        self.set_world_size(world_size)
        # The breaker (module docstring): (wall time, cause, why) of the detection while the
        # store stays silent, else None; its prober (one thread at a time) closes it.
        self._lock = threading.Lock()
        self._silent: tuple[float, int, str] | None = None
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop the background prober (its channel is being closed)."""
        self._closed.set()

    @property
    def silent_since(self) -> float | None:
        """Wall time at which the store was found silent, while the breaker is open; else None."""
        silent = self._silent
        return None if silent is None else silent[0]

    def set_world_size(self, world_size: int) -> None:
        """The ranks that save together (each asks the store at the same time): the window
        a probe gets is ``silent_s + PER_RANK_S x (world_size - 1)``."""
        self.silent_s = self._base_s + PER_RANK_S * max(0, world_size - 1)
        self._interval = PROBE_SHARE * self.silent_s

    def call(self, name: str, method: Any, msg: Any, bound_s: float, breaker: bool = True) -> Any:
        """``method(msg)`` (a unary-unary multicallable) waited for while the store answers.
        ``breaker`` False: sent and waited for even while the breaker is open (a load: what a
        save skips, a load must try, the store may be back before the breaker's next probe).

        Raises:
            grpc.RpcError: the call's own failure (as a plain call raises it).
            StoreSilent: the store stopped answering, or the bound passed (the call is cancelled);
                at once while the breaker is open (the call is not sent) when ``breaker``.
        """
        if breaker:
            self._fail_fast(name)
        future = method.future(msg, timeout=bound_s + self.silent_s)  # (the wait below ends it first)
        try:
            self.wait(future, bound_s, name, breaker=breaker)
        except StoreSilent:
            future.cancel()
            raise
        return future.result()

    def wait(self, future: Any, bound_s: float, what: str, breaker: bool = True) -> None:
        """Return once ``future`` (a ``grpc.Future`` or ``concurrent.futures.Future`` whose
        end depends on the store) is done, whatever its outcome; the caller reads it.
        ``breaker`` False: waited for even while the breaker is open (the run's end: its
        last commit has no next interval, the store gets its window once more).

        Raises:
            StoreSilent: the store stopped answering before it was done, or ``bound_s``
                passed while it answered; at once while the breaker is open and ``future``
                is not done.
        """
        if future.done():
            return
        if breaker:
            self._fail_fast(what)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        start = time.monotonic()
        if done.wait(min(self._interval, bound_s)):
            return
        probe, next_probe = None, time.monotonic()
        while True:
            now = time.monotonic()
            if probe is None and now >= next_probe:
                probe = self._health.Check.future(health_pb2.HealthCheckRequest(), timeout=self.silent_s)
            if probe is not None and probe.done():
                try:
                    self._judge(probe, what, now - start)  # raises when the store did not answer
                except StoreSilent as e:
                    self._open(e.cause, f"{what}: {e.detail}")
                    raise
                probe, next_probe = None, now + self._interval
            if now - start >= bound_s:
                raise StoreSilent(
                    f"store at {self._address}: {what}: no reply in {bound_s:g} s although the store answers "
                    "(alive, no progress on this call)",
                    store_pb2.TIMEOUT,
                )
            if done.wait(0.1):
                return

    def _judge(self, probe: Any, what: str, waited_s: float) -> None:
        """An ended probe: nothing if the store answered, else StoreSilent with its cause."""
        try:
            probe.result()
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                cause, why = store_pb2.TIMEOUT, f"no answer to a health probe in {self.silent_s:g} s"
            elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                cause, why = store_pb2.UNREACHABLE, "unreachable"
            else:  # the store answered (UNIMPLEMENTED, PERMISSION_DENIED...): it is alive
                return
            found = f"{why} (waited {waited_s:.1f} s): {code.name}"
            raise StoreSilent(f"store at {self._address}: {what}: {found}", cause, found) from None

    # ------------------------------------------------------------------ the breaker

    def _fail_fast(self, what: str) -> None:
        """Raise StoreSilent at once while the breaker is open (the store found silent)."""
        silent = self._silent
        if silent is None:
            return
        since, cause, why = silent
        stamp = time.strftime("%H:%M:%S", time.gmtime(since))
        raise StoreSilent(
            f"store at {self._address}: {what}: store silent since {stamp} UTC "
            f"({time.time() - since:.0f} s ago, at {why}; not asked again until it answers a probe)",
            cause,
        )

    def _open(self, cause: int, why: str) -> None:
        """The store was found silent: later waits fail at once until a probe is answered."""
        with self._lock:
            if self._silent is None:
                self._silent = (time.time(), cause, why)
            if self._prober is None and not self._closed.is_set():
                self._prober = threading.Thread(target=self._reprobe, name="store-reprobe", daemon=True)
                self._prober.start()

    def _reprobe(self) -> None:
        """The breaker's prober: one health probe at a time until the store answers one
        (the breaker closes), or the relay closes. A probe a stopped store leaves unanswered
        takes ``silent_s``; a refused one returns at once and is asked again ``REFUSED_RETRY_S``
        later (at most ``silent_s / 2``)."""
        answered = False
        while not answered and not self._closed.is_set():
            begun, every = time.monotonic(), self._interval
            try:
                self._health.Check(health_pb2.HealthCheckRequest(), timeout=self.silent_s)
                answered = True
            except grpc.RpcError as e:
                answered = e.code() not in (
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.CANCELLED,
                )  # (UNIMPLEMENTED, PERMISSION_DENIED...: it answered, it is alive)
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    every = min(every, REFUSED_RETRY_S)
            except ValueError:  # the channel was closed under it (the relay's close)
                break
            if not answered:
                self._closed.wait(max(0.0, every - (time.monotonic() - begun)))
        with self._lock:  # (one step: a detection meanwhile starts a new prober)
            if answered:
                self._silent = None
            self._prober = None
