"""Where the services are and stubs to call them.

Addresses come from flags/env (SURGE_CONTROL_ADDRESS, SURGE_DATA_ADDRESS,
SURGE_STORE_ADDRESS: the compose / multi-node case) or else from the local stack's
``stack.json``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import grpc

from services.cli import render, stack, up_lock
from services.cli.errors import CliError, from_rpc
from services.common import paths
from services.common.grpc_server import TlsConfigError, channel
from services.contract import Module, control_pb2_grpc, data_pb2_grpc, store_pb2_grpc

_STUBS = {
    "control": control_pb2_grpc.ControlServiceStub,
    "data": data_pb2_grpc.DataServiceStub,
    "store": store_pb2_grpc.StoreServiceStub,
}

T = TypeVar("T")

# Failures of a call whose command may or may not have been carried out: the service was
# unreachable or going away (UNAVAILABLE: control restarting), or its answer did not come
# back in time (DEADLINE_EXCEEDED: a lost reply). Only a call that is safe to repeat (the
# service answers a repeat as the first: a submit with its request id) is tried again.
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def address(service: str) -> str:
    env = os.environ.get(f"SURGE_{service.upper()}_ADDRESS")
    if env:
        return env
    procs = stack.read_stack()
    if procs and service in procs:
        return procs[service].address
    raise CliError(
        f"{service} address unknown: no local stack is running under {paths.surge_home()} "
        f"(run `surgectl up`, or set SURGE_HOME to the stack's home) and SURGE_{service.upper()}_ADDRESS is not set",
        unreachable=True,  # as a stack that is down: the callers that fall back to local files do
    )


def open_channel(addr: str) -> grpc.Channel:
    """A channel to ``addr`` (TLS per the environment), speaking as the operator
    (EXT_USER); a bad TLS setting is a CliError."""
    try:
        return channel(addr, module=Module.EXT_USER)
    except TlsConfigError as e:
        raise CliError(str(e)) from None


def new_stub(service: str, ch: grpc.Channel) -> object:
    return _STUBS[service](ch)


def rpc_error(error: grpc.RpcError, service: str, addr: str) -> CliError:
    """``from_rpc``, with the local stack's advice for an unreachable service, named by the
    state the stack is really in (which recorded processes are gone: ``unreachable_hint``).
    It never says `down`: that would stop the ranks of running jobs."""
    mapped = from_rpc(error, service, addr)
    if mapped.unreachable and not os.environ.get(f"SURGE_{service.upper()}_ADDRESS"):
        procs = stack.read_stack()
        if procs:
            hint = unreachable_hint(
                service, addr, list(procs), stack.down_services(procs), stopped=stack.stopped_pid(service, procs)
            )
            return CliError(hint, unreachable=True)
    return mapped


def start_again_hint(service: str) -> str:
    """The command that brings ``service`` of the local stack back, as the stack is now: its
    process gone, `surgectl up` (which starts what stopped and leaves the rest running);
    still there, `surgectl restart SERVICE`."""
    procs = stack.read_stack()
    if procs and service in stack.down_services(procs):
        return f"`surgectl up` starts {service} again on its port, with whatever else stopped"
    return f"`surgectl restart {service}` starts {service} again on its port"


def unreachable_hint(service: str, addr: str, services: list[str], down: list[str], stopped: int = 0) -> str:
    """What to do about ``service`` not answering at ``addr``, given the recorded stack's
    ``services`` and those of them whose process is gone (``down``): its process still
    runs (hung, or still starting): `surgectl restart SERVICE`; gone: `surgectl up`, which
    starts again what is down and leaves the rest running (was: always `restart SERVICE`,
    also after a kill of every service, which left the others down). ``stopped``: the pid of
    ``service``'s process, stopped (``stack.stopped_pid``): `kill -CONT PID` resumes it.
    Another process's `up` or `down` of this stack running now: that, first (a `restart`
    would race it)."""
    if (running := up_lock.other_command()) is not None:
        pid, command = running
        doing = "stopping" if command == "down" else "starting"
        return (
            f"{service} unreachable at {addr}: a `surgectl {command}` (pid {pid}) is {doing} this stack now; "
            "run this again once it has finished"
        )
    if stopped and service not in down:
        return (
            f"{service} unreachable at {addr}: its process {stopped} is stopped (state T in /proc/{stopped}/status: "
            f"SIGSTOP or a debugger); `kill -CONT {stopped}` resumes it where it was "
            f"(or `surgectl restart {service}` starts it again on the same port)"
        )
    if service not in down:
        keep = " (running jobs keep running)" if service == "control" else ""
        return (
            f"{service} unreachable at {addr} although its process runs; "
            f"`surgectl restart {service}` starts it again on the same port{keep}"
        )
    if len(down) == 1:
        return (
            f"{service} at {addr} is down (its process is gone; the rest of the stack runs); "
            "`surgectl up` starts it again on the same port"
        )
    gone = "every service of the local stack is down" if set(down) >= set(services) else f"{', '.join(down)} are down"
    return (
        f"{service} unreachable at {addr}: {gone} (their processes are gone); "
        "`surgectl up` starts again what is down, on the same ports"
    )


@contextmanager
def stub(service: str) -> Iterator[object]:
    """A stub for ``service``; gRPC failures inside the block become one-line CliErrors."""
    addr = address(service)
    with open_channel(addr) as ch:
        try:
            yield _STUBS[service](ch)
        except grpc.RpcError as e:
            raise rpc_error(e, service, addr) from None


def call(
    service: str,
    fn: Callable[[object], T],
    retry_delays: Sequence[float] = (),
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn(stub)`` for ``service``; a gRPC failure becomes a one-line CliError.

    ``retry_delays``: for a call that is safe to repeat only: after a failure in ``RETRIED``
    it is made again, on a fresh channel, after each of these delays in turn (seconds; a
    line on stderr says so), the last failure raised once they are spent. Default: none."""
    addr = address(service)
    delays = list(retry_delays)
    while True:
        with open_channel(addr) as ch:
            try:
                return fn(_STUBS[service](ch))
            except grpc.RpcError as e:
                if not delays or not (hasattr(e, "code") and e.code() in RETRIED):
                    raise rpc_error(e, service, addr) from None
                what = e.code().name
        delay = delays.pop(0)
        render.err_console.print(
            f"{service} at {addr}: {what}; trying again in {delay:g} s (the call is safe to repeat)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sleep(delay)


def team_view(timeout: float = 10.0) -> tuple[str, list] | None:
    """(the team whose jobs alone this caller sees, "" for every job; the jobs it sees), as
    control's ListJobs says (``JobList.team_view``); None when control is unreachable (the
    stack down or broken). A refusal other than unreachability is raised (CliError)."""
    from services.contract import control_pb2

    try:
        listed = call("control", lambda s: s.ListJobs(control_pb2.JobQuery(), timeout=timeout))
    except CliError as e:
        if e.unreachable:
            return None
        raise
    return listed.team_view, list(listed.jobs)


# What a job loses while the store (the data service) is away, said after the command that
# brings it back.
STORE_OUTAGE_EFFECT = "checkpoints are not saved and metrics wait in the ranks' buffers meanwhile"
DATA_OUTAGE_EFFECT = (
    "running jobs train on from their ranks' read-ahead, then wait for it; "
    "they go on with the next batch once it is back"
)


STORE_PROBE_SECONDS = 2.0  # (status: the store's health check, before anything is read from it)


def store_outage(timeout_s: float = STORE_PROBE_SECONDS) -> str:
    """One line when the store does not answer its health check (within ``timeout_s``),
    naming the command that brings it back as the local stack is (``unreachable_hint``); ""
    when it answers or no store address is known. `surgectl status` shows it (control's
    outage is its refusal)."""
    return _outage("store", STORE_OUTAGE_EFFECT, timeout_s)


def data_outage(timeout_s: float = STORE_PROBE_SECONDS) -> str:
    """``store_outage`` for the data service: `surgectl status` says so at once (before: not
    until a rank's read-ahead ran dry, ~30 s later, in the jobs' messages)."""
    return _outage("data", DATA_OUTAGE_EFFECT, timeout_s)


def _outage(service: str, effect: str, timeout_s: float) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        addr = address(service)
    except CliError:
        return ""
    procs = stack.read_stack() or {}
    down = stack.down_services(procs)
    if service not in down:
        with open_channel(addr) as ch:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
                return ""
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return ""  # it answers (a refusal of the check is no outage)
    if service in procs and not os.environ.get(f"SURGE_{service.upper()}_ADDRESS"):
        hint = unreachable_hint(service, addr, list(procs), down, stopped=stack.stopped_pid(service, procs))
    else:
        hint = f"{service} unreachable at {addr}"
    return f"{hint}; {effect}"


def store_answers(what: str) -> None:
    """Before a command reads from the store: its health check (``store_outage``, status's one
    check). A store that does not answer within ``STORE_PROBE_SECONDS`` (SIGSTOPped, hung, down)
    is not asked: the command ends in about that time, in one line saying so (was: `surgectl
    checkpoints` waited 19.5 s for gRPC's handshake timeout against a stopped store).

    Raises:
        CliError: the store did not answer its health check (``unreachable``), exit 1.
    """
    outage = store_outage()
    if outage:
        raise CliError(
            f"{what}: the store did not answer its health check in {STORE_PROBE_SECONDS:g} s: {outage}",
            unreachable=True,
        )
