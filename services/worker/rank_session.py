"""``WorkerService.RankSession``: the stream each local rank process keeps with its node
agent (events up, commands down), and the two ways a hello is refused."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from services.contract import worker_pb2, worker_pb2_grpc
from services.worker.rank_process import RankProcess

if TYPE_CHECKING:
    from services.worker.node_agent import NodeAgent


def unbatched(message: worker_pb2.RankEvent) -> list[worker_pb2.RankEvent]:
    """The events one RankSession message carries, in order: itself and those the rank's
    session queued behind it (``RankEvent.more``), each without ``more`` (the agent relays
    a rank's event up as it is: nothing rides along twice)."""
    if not message.more:
        return [message]
    behind = list(message.more)
    message.ClearField("more")
    return [message, *behind]


class RankNotLaunched(LookupError):
    """A hello names a (job, rank) that this node did not launch, or that already died."""


class RankAlreadyAttached(RuntimeError):
    """A second session for a rank process that already had one."""


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
        for event in unbatched(first):
            self._agent.relay_event(r, event)
        threading.Thread(
            target=self._read, args=(r, request_iterator), name=f"rank-{r.job_id}-{r.rank}", daemon=True
        ).start()
        yield from self._agent.commands_for(r)

    def _read(self, r: RankProcess, request_iterator: Iterator[worker_pb2.RankEvent]) -> None:
        try:
            for message in request_iterator:
                with self._agent.relaying():  # (what goes up of it: one message to control)
                    for event in unbatched(message):
                        self._agent.relay_event(r, event)
        except grpc.RpcError:
            pass  # the rank's side is gone (process ended or cancelled): the waiter reports it
        finally:
            self._agent.detach(r)
