"""The gRPC face of a node agent's in-memory checkpoint copies (MemoryCopyService): its
local ranks and its peer agent call it; the work is services/worker/memory_copies.py's.
"""

from __future__ import annotations

from services.contract import Module, worker_pb2, worker_pb2_grpc
from services.worker.memory_copies import MODULE_METADATA, MemoryCopies


class MemoryCopyServicer(worker_pb2_grpc.MemoryCopyServiceServicer):
    """``MemoryCopyService`` on the node agent's gRPC server. A peer agent (EXT_HARDWARE)
    is answered from this agent's memory only: ``via_peer`` is a local rank's request."""

    def __init__(self, copies: MemoryCopies):
        self._copies = copies

    def PutChunks(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        return self._copies.put(request_iterator)

    def HeldChunks(self, request, context):  # noqa: N802
        if request.job_files:
            if _caller(context) == Module.Name(Module.EXT_HARDWARE):
                return worker_pb2.HeldReply()  # files are for this node's ranks
            files = self._copies.job_files(request.job_id)
            if files is None:
                return worker_pb2.HeldReply()
            return worker_pb2.HeldReply(sha256=files[0], path=files[1], files=True)
        reply = worker_pb2.HeldReply(sha256=self._copies.held(request.job_id, request.rank, request.replica))
        if not request.replica and _caller(context) != Module.Name(Module.EXT_HARDWARE):
            reply.staging = self._copies.staging(request.job_id, request.rank)  # (a rank of this node)
        return reply

    def GetChunk(self, request, context):  # noqa: N802
        local_rank = _caller(context) != Module.Name(Module.EXT_HARDWARE)
        return self._copies.get(request.job_id, request.sha256, request.via_peer and local_rank, request.local_path)

    def GetChunks(self, request, context):  # noqa: N802
        local_rank = _caller(context) != Module.Name(Module.EXT_HARDWARE)
        return self._copies.get_many(
            request.job_id,
            list(request.sha256),
            request.via_peer and local_rank,
            request.local_path and local_rank,
            request.lanes and local_rank,
        )

    def OpenBulkRead(self, request, context):  # noqa: N802
        return self._copies.open_lane(request.job_id, list(request.sha256))  # (a peer agent only: identity.py)


def _caller(context) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == MODULE_METADATA:
            return value if isinstance(value, str) else value.decode()
    return ""
