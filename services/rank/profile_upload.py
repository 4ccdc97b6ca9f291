"""A rank's profile files to the store (StoreProfile, L2-1 -> L5-2; issue 31 item 3): streamed
on the store relay's channel (``PutProfile``), the StoreProfile first, then each file in
chunks; the store keeps them beside the job's metrics and answers where (ProfileStored). A
part of the rank's store relay (store_client.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from services.contract import store_pb2

CHUNK_BYTES = 1 << 20  # under gRPC's message limit, big enough that a 100 MB trace is 100 messages
UPLOAD_TIMEOUT_S = 600.0  # the whole stream (a trace of a large model can be hundreds of MB)


class ProfileUpload:
    """``store_profile``: the loop's StoreProfile with its payload, ``{file name: local path}``."""

    _stub: Any  # the store relay's StoreServiceStub (its channel speaks for L2_TRAINING_LOOP)

    def store_profile(self, msg: store_pb2.StoreProfile, payload: Mapping[str, str]) -> store_pb2.ProfileStored:
        """Stream the files; returns the store's ProfileStored. Raises grpc.RpcError as the
        store answered (the loop reports it in ProfileRecorded.error)."""
        return self._stub.PutProfile(_parts(msg, payload), timeout=UPLOAD_TIMEOUT_S)


def _parts(msg: store_pb2.StoreProfile, files: Mapping[str, str]) -> Iterator[store_pb2.ProfileUpload]:
    yield store_pb2.ProfileUpload(header=msg)
    for name, path in files.items():
        with Path(path).open("rb") as f:
            sent = False
            while chunk := f.read(CHUNK_BYTES):
                yield store_pb2.ProfileUpload(name=name, data=chunk)
                sent = True
            if not sent:  # (an empty file still arrives, by name)
                yield store_pb2.ProfileUpload(name=name)
