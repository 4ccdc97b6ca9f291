"""`surgectl dataset push / pull` (in this process) against a local S3-compatible server: a
version goes up and comes back byte for byte; a corrupted object is refused in one line and
nothing is left; versions stay immutable on both sides."""

from __future__ import annotations

import json

from services.data.prepare import prepare_dataset
from tests.checkpoint.test_no_shared_fs import s3  # noqa: F401 (the local S3-compatible server, moto)
from tests.cli.test_housekeeping import assert_one_line, run_cli


def _version(root, tmp_path, version="v1", extra=""):
    src = tmp_path / f"src-{version}{extra}"
    src.mkdir()
    for i in range(8):
        (src / f"part{i}.jsonl").write_text(
            "".join(json.dumps({"text": f"document {i}.{j} {extra}" * (j + 1)}) + "\n" for j in range(20))
        )
    return prepare_dataset(src, "web", version, root, val_fraction=0.2, include_glob=None)


def test_a_pushed_version_pulls_back_byte_identical_and_again_is_a_no_op(
    s3,  # noqa: F811  (the fixture imported above)
    surge_home,
    tmp_path,
    monkeypatch,
    capsys,
):
    import s3fs

    info = _version(surge_home / "datasets", tmp_path)
    code, out, err = run_cli(
        ["dataset", "push", "web@v1", "s3://surge-ckpt/corpora", "--s3-endpoint", s3], monkeypatch, capsys
    )
    assert code == 0 and out.startswith("pushed web@v1 to s3://surge-ckpt/corpora/web/v1 (7 files, "), out + err
    keys = s3fs.S3FileSystem(endpoint_url=s3).find("surge-ckpt/corpora/web/v1")
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == sorted(p.name for p in info.path.iterdir())
    code, out, _ = run_cli(
        ["dataset", "push", "web@v1", "s3://surge-ckpt/corpora", "--s3-endpoint", s3], monkeypatch, capsys
    )
    assert code == 0 and "already at s3://surge-ckpt/corpora/web/v1, unchanged" in out

    other = tmp_path / "other-home"  # another machine's datasets
    monkeypatch.setenv("SURGE_HOME", str(other))
    code, out, err = run_cli(
        ["dataset", "pull", "web@v1", "s3://surge-ckpt/corpora", "--s3-endpoint", s3], monkeypatch, capsys
    )
    assert code == 0 and out.startswith("pulled web@v1 from s3://surge-ckpt/corpora/web/v1"), out + err
    pulled = other / "datasets" / "web" / "v1"
    assert {p.name: p.read_bytes() for p in pulled.iterdir()} == {p.name: p.read_bytes() for p in info.path.iterdir()}
    code, out, _ = run_cli(
        ["dataset", "pull", "web@v1", "s3://surge-ckpt/corpora", "--s3-endpoint", s3], monkeypatch, capsys
    )
    assert code == 0 and "unchanged" in out


def test_a_corrupted_object_is_refused_at_pull_and_another_version_at_push(
    s3,  # noqa: F811  (the fixture imported above)
    surge_home,
    tmp_path,
    monkeypatch,
    capsys,
):
    import s3fs

    _version(surge_home / "datasets", tmp_path)
    url = ["s3://surge-ckpt/c", "--s3-endpoint", s3]
    assert run_cli(["dataset", "push", "web@v1", *url], monkeypatch, capsys)[0] == 0
    fs = s3fs.S3FileSystem(endpoint_url=s3)
    data = bytearray(fs.cat_file("surge-ckpt/c/web/v1/train.bin"))
    data[10] ^= 1  # same size, one bit off
    fs.pipe_file("surge-ckpt/c/web/v1/train.bin", bytes(data))
    monkeypatch.setenv("SURGE_HOME", str(tmp_path / "other-home"))
    code, out, err = run_cli(["dataset", "pull", "web@v1", *url], monkeypatch, capsys)
    assert_one_line(code, err, 1, "web@v1 at s3://surge-ckpt/c/web/v1: train.bin: sha256 mismatch")
    assert not (tmp_path / "other-home" / "datasets" / "web").exists()
    code, out, err = run_cli(["dataset", "pull", "web@v9", *url], monkeypatch, capsys)
    assert_one_line(code, err, 2, "s3://surge-ckpt/c/web/v9: no manifest.json")

    # Another web@v1 (different content) is not pushed over the first.
    monkeypatch.setenv("SURGE_HOME", str(tmp_path / "third-home"))
    _version(tmp_path / "third-home" / "datasets", tmp_path, extra="changed")
    code, out, err = run_cli(["dataset", "push", "web@v1", *url], monkeypatch, capsys)
    assert_one_line(code, err, 1, "s3://surge-ckpt/c/web/v1 already holds another web@v1", "immutable")
