"""A rank's profile files through the real store relay (issue 31 item 3): PutProfile streams
them, L5-2 keeps them in metrics/<job>/profiles/cmd<seq>/ and answers where; the route table
decides who may send one; a bad name, a bad job id or an upload over the bound is refused and
leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.common.grpc_server import channel
from services.contract import Module, store_pb2, store_pb2_grpc
from services.rank.profile_upload import CHUNK_BYTES, ProfileUpload
from services.store.profile_files import MAX_BYTES_ENV
from tests.redlines.test_state_ownership import store_service

pytestmark = pytest.mark.timeout(60)


class Uploader(ProfileUpload):
    def __init__(self, address: str, module: int = Module.L2_TRAINING_LOOP):
        self._channel = channel(address, module=module)
        self._stub = store_pb2_grpc.StoreServiceStub(self._channel)


def files(tmp_path: Path, **contents: bytes) -> dict[str, str]:
    out = {}
    for name, data in contents.items():
        name = name.replace("_", ".")
        (tmp_path / name).write_bytes(data)
        out[name] = str(tmp_path / name)
    return out


def test_a_ranks_files_are_kept_beside_the_jobs_metrics(tmp_path):
    big = bytes(range(256)) * (CHUNK_BYTES // 256 * 2 + 7)  # more than two chunks
    sent = files(tmp_path, rank3_trace_json_gz=big, rank3_memory_pickle=b"")
    root = tmp_path / "store"
    with store_service(root) as address:
        up = Uploader(address)
        stored = up.store_profile(store_pb2.StoreProfile(job_id="job-1", rank=3, seq=7), sent)
    kept = root / "metrics" / "job-1" / "profiles" / "cmd7"
    assert sorted(stored.files) == [
        "metrics/job-1/profiles/cmd7/rank3.memory.pickle",
        "metrics/job-1/profiles/cmd7/rank3.trace.json.gz",
    ]
    assert (kept / "rank3.trace.json.gz").read_bytes() == big and (kept / "rank3.memory.pickle").read_bytes() == b""
    assert stored.bytes == len(big)
    assert not list((root / "metrics" / ".incoming").iterdir())


@pytest.mark.parametrize(
    "module, name, job, code, words",
    [
        (Module.L5_CHECKPOINT_MANAGER, "rank0.trace.json.gz", "job", grpc.StatusCode.PERMISSION_DENIED, "PutProfile"),
        (Module.L2_TRAINING_LOOP, "../rank0.trace.json.gz", "job", grpc.StatusCode.INVALID_ARGUMENT, "file name"),
        (Module.L2_TRAINING_LOOP, "rank0.exe", "job", grpc.StatusCode.INVALID_ARGUMENT, "file name"),
        (Module.L2_TRAINING_LOOP, "rank0.trace.json.gz", "../job", grpc.StatusCode.INVALID_ARGUMENT, "job_id"),
    ],
)
def test_a_wrong_sender_name_or_job_is_refused_and_nothing_is_kept(tmp_path, module, name, job, code, words):
    (tmp_path / "f").write_bytes(b"x" * 100)
    root = tmp_path / "store"
    with store_service(root) as address:
        with pytest.raises(grpc.RpcError) as e:
            Uploader(address, module).store_profile(
                store_pb2.StoreProfile(job_id=job, seq=1), {name: str(tmp_path / "f")}
            )
    assert e.value.code() == code and words in e.value.details(), e.value.details()
    assert not [p for p in (root / "metrics").rglob("*") if p.is_file() and "profiles" in p.parts]
    incoming = root / "metrics" / ".incoming"
    assert not incoming.exists() or not list(incoming.iterdir())


def test_an_upload_over_the_bound_is_refused_whole(tmp_path, monkeypatch):
    monkeypatch.setenv(MAX_BYTES_ENV, "1000")
    sent = files(tmp_path, rank0_trace_json_gz=b"a" * 600, rank0_memory_pickle=b"b" * 600)
    root = tmp_path / "store"
    with store_service(root) as address:
        with pytest.raises(grpc.RpcError) as e:
            Uploader(address).store_profile(store_pb2.StoreProfile(job_id="job", seq=1), sent)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and MAX_BYTES_ENV in e.value.details()
    assert not (root / "metrics" / "job" / "profiles").exists()
    assert not list((root / "metrics" / ".incoming").iterdir())


def test_a_bad_bound_is_one_line_naming_the_variable(monkeypatch, tmp_path):
    from services.store.profile_files import ProfileFiles

    for bad in ("lots", "0", "-5"):
        monkeypatch.setenv(MAX_BYTES_ENV, bad)
        with pytest.raises(ValueError, match=MAX_BYTES_ENV):
            ProfileFiles(tmp_path)
