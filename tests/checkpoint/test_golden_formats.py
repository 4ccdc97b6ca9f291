"""HEAD reads the checkpoint formats of previous releases (issue 29 item 7): each golden
version under ``golden/format-<N>/`` (written by ``golden/make_golden.py`` with the release of
format N) is loaded by the real checkpoint manager and chunk reader, every tensor compared
with the digests recorded when it was written; a format outside what this build reads is
refused in one line naming both formats and releases."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from services.contract import store_pb2
from services.state.chunk_reader import ChunkReader
from services.state.chunk_store import DirectorySource
from services.store.checkpoint_manager import CheckpointFormatRefused, CheckpointManager, read_committed
from services.store.checkpoint_manager.formats import CHECKPOINT_FORMAT, READABLE, surge_version
from tests.checkpoint.golden.make_golden import JOB, STEP, golden_state, tensors

GOLDEN = Path(__file__).resolve().parent / "golden"
FORMATS = sorted(int(p.name.removeprefix("format-")) for p in GOLDEN.glob("format-*"))


def store_of(tmp_path: Path, fmt: int) -> Path:
    """A store root holding a copy of format ``fmt``'s golden checkpoints (the golden stays as it is)."""
    shutil.copytree(GOLDEN / f"format-{fmt}" / "checkpoints", tmp_path / "checkpoints")
    return tmp_path


def edit_catalog(root: Path, **fields) -> None:
    """Set (or, with None, drop) fields of every catalog entry: a version as another release recorded it."""
    path = root / "checkpoints" / "catalog.json"
    catalog = json.loads(path.read_text())
    for entry in catalog["versions"]:
        for k, v in fields.items():
            entry.pop(k, None) if v is None else entry.__setitem__(k, v)
    path.write_text(json.dumps(catalog))


def test_every_format_this_build_reads_has_a_golden_checkpoint():
    assert FORMATS and CHECKPOINT_FORMAT in FORMATS
    assert set(range(READABLE[0], READABLE[1] + 1)) <= set(FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_golden_checkpoint_loads_bit_for_bit(tmp_path, fmt):
    root = store_of(tmp_path, fmt)
    manager = CheckpointManager(root)
    info = manager.load_checkpoint(store_pb2.LoadCheckpoint(version=f"{JOB}:latest")).info
    assert (info.step, info.checkpoint_format) == (STEP, fmt)
    [verdict] = manager.verify_checkpoints(store_pb2.VerifyCheckpoints(job_id=JOB, rehash=True)).versions
    assert verdict.ok, verdict.reason
    template = golden_state()
    for t in tensors(template).values():
        t.detach().zero_()
    manifest = json.loads((Path(info.path) / "manifest.json").read_bytes())
    reader = ChunkReader(
        info.path, [DirectorySource(info.chunk_path)], digests={f["path"]: f for f in manifest["files"]}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=reader, no_dist=True)
    expected = json.loads((GOLDEN / f"format-{fmt}" / "expected.json").read_text())
    loaded = tensors(template)
    assert sorted(loaded) == sorted(expected)
    for key, want in expected.items():
        t = loaded[key].detach().contiguous().reshape(-1)
        got = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        assert (got, str(loaded[key].dtype), list(loaded[key].shape)) == (
            want["sha256"],
            want["dtype"],
            want["shape"],
        ), key


def test_every_new_version_records_the_format_and_the_release(tmp_path):
    root = store_of(tmp_path, CHECKPOINT_FORMAT)
    info = CheckpointManager(root).load_checkpoint(store_pb2.LoadCheckpoint(version=f"{JOB}:1")).info
    manifest = json.loads((Path(info.path) / "manifest.json").read_bytes())
    assert manifest["checkpoint_format"] == CHECKPOINT_FORMAT and manifest["surge_version"]
    assert info.surge_version == manifest["surge_version"]


def test_a_version_from_before_formats_were_recorded_is_read_as_format_1(tmp_path):
    root = store_of(tmp_path, 1)
    edit_catalog(root, checkpoint_format=None, surge_version=None)
    info = CheckpointManager(root).load_checkpoint(store_pb2.LoadCheckpoint(version=f"{JOB}:1")).info
    assert (info.checkpoint_format, info.surge_version) == (1, "unrecorded")


def test_a_newer_or_older_format_is_refused_in_one_line_naming_both_versions(tmp_path):
    root = store_of(tmp_path, CHECKPOINT_FORMAT)
    lo, hi = READABLE
    edit_catalog(root, checkpoint_format=hi + 1, surge_version="9.0.0")
    newer = (
        f"checkpoint {JOB}:1: format {hi + 1} (written by Surge 9.0.0) is newer than this Surge "
        f"({surge_version()}) reads (formats {lo} to {hi}); load it with Surge 9.0.0 or newer"
    )
    with pytest.raises(CheckpointFormatRefused) as refused:
        CheckpointManager(root).load_checkpoint(store_pb2.LoadCheckpoint(version=f"{JOB}:latest"))
    assert str(refused.value) == newer
    with pytest.raises(CheckpointFormatRefused, match=r"^checkpoint .* is newer than"):
        read_committed(root, f"{JOB}:1")  # (surgectl export, generate, eval: without the store)
    edit_catalog(root, checkpoint_format=lo - 1, surge_version="0.0.1")
    with pytest.raises(CheckpointFormatRefused) as refused:
        CheckpointManager(root).load_checkpoint(store_pb2.LoadCheckpoint(version=f"{JOB}:1"))
    line = str(refused.value)
    assert line.startswith(f"checkpoint {JOB}:1: format {lo - 1} (written by Surge 0.0.1) is older than this Surge")
    assert "load it with Surge 0.0.1" in line and "\n" not in line
