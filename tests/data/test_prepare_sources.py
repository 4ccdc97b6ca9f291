"""``dataset prepare`` from corpora as users keep them: JSONL (plain, gzip, zstd), Parquet, a
directory tree of mixed files, an S3-compatible prefix; streamed over worker processes with
the same bytes whatever their number; bad input as one line naming file and line."""

from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest

from services.data.errors import InvalidConfig
from services.data.prepare import prepare_dataset, sources
from tests.checkpoint.test_no_shared_fs import s3  # noqa: F401 (the local S3-compatible server, moto)
from tests.cli.test_housekeeping import assert_one_line, run_cli

# content_sha256 of versions prepared by the single-process implementation this replaced
# (services/data/prepare.py at e087882, which read every file into memory), from the corpora
# built below: a text corpus must prepare to the same version as before.
BEFORE = {
    "py_bytes": "e226cf3a3b7d3560cfce573ef0db495b317bbf32e1d9140bc250ffdd0e95b702",
    "py_bpe400": "92bb69f6719d97ce52180dca4b0aeb6ae074b293b913725cd9d95ca2dbb4cb90",
    "txt_bytes": "0c522f35614ba719227808f0358e7376b75f9d5c302edf90b4a55730297cf8b2",
    "txt_bpe300": "283279edd57bbad61c9c0462ef37ff0818a69ad30096378f4a6145373f8ccd34",
    "two_fallback": "94cc467b0d6cc04b8de3eb2f28175a2085b05a86fc5930ee9b2c139026ad1867",
    "two_fallback_bpe": "678a2ab3d89f7819dc9bb54d139e8c59379e0bd5c919980563216885f4e75343",
}


def text_tree(src: Path) -> Path:
    """Markdown notes in three directories, a Latin-1 file, a binary, a hidden and an empty one."""
    rng = random.Random(1)
    for i in range(30):
        (src / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        lines = "".join(f"line {j} of note {i}: {rng.random():.6f} ünï\n" for j in range(i * 3 + 1))
        (src / f"d{i % 3}" / f"note{i}.md").write_text(lines)
    (src / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    (src / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 20)
    (src / ".hidden").mkdir()
    (src / ".hidden" / "x.txt").write_text("hidden\n")
    (src / "empty.txt").write_bytes(b"")
    return src


def two_files(src: Path) -> Path:
    """Two files, neither held out by the hash at 2 %: the smallest key's file is moved to val."""
    src.mkdir()
    (src / "a.py").write_bytes(b"x = 1\n" * 20)
    (src / "b.py").write_bytes(b"y = 2\n" * 30)
    return src


TEXTS = [
    f"Document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(i % 23 + 1)) + " ünïcödé" for i in range(60)
]


def records_tree(src: Path) -> Path:
    """The 60 TEXTS as JSONL (plain, gzip, zstd, with an empty record and a blank line),
    Parquet (string and binary columns) and two plain text files, in nested directories."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (src / "a" / "deep").mkdir(parents=True)
    (src / "b").mkdir()

    def lines(texts):
        return "".join(json.dumps({"id": k, "text": t}) + "\n" for k, t in enumerate(texts)).encode()

    (src / "a" / "one.jsonl").write_bytes(lines(TEXTS[0:10]) + b"\n" + json.dumps({"text": ""}).encode() + b"\n")
    (src / "a" / "deep" / "two.jsonl.gz").write_bytes(gzip.compress(lines(TEXTS[10:20])))
    (src / "a" / "three.ndjson.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(TEXTS[20:30])))
    pq.write_table(pa.table({"text": TEXTS[30:45], "n": list(range(15))}), src / "b" / "four.parquet", row_group_size=4)
    pq.write_table(
        pa.table({"text": pa.array([t.encode() for t in TEXTS[45:58]], pa.binary())}), src / "b" / "five.parquet"
    )
    (src / "b" / "six.txt").write_text(TEXTS[58])
    (src / "seven.md").write_text(TEXTS[59])
    return src


RECORD_IDS = (
    [f"a/deep/two.jsonl.gz:{n}" for n in range(1, 11)]
    + [f"a/one.jsonl:{n}" for n in range(1, 11)]
    + [f"a/three.ndjson.zst:{n}" for n in range(1, 11)]
    + [f"b/five.parquet:{n}" for n in range(13)]
    + [f"b/four.parquet:{n}" for n in range(15)]
    + ["b/six.txt", "seven.md"]
)
RECORD_TEXTS = TEXTS[10:20] + TEXTS[0:10] + TEXTS[20:30] + TEXTS[45:58] + TEXTS[30:45] + TEXTS[58:60]


def documents(path: Path) -> dict[str, bytes]:
    """``{document id: its tokens as bytes}`` of both splits of a bytes-tokenizer version."""
    out = {}
    for split in ("train", "val"):
        tokens = np.fromfile(path / f"{split}.bin", dtype="<u2").astype(np.uint8)
        bounds = np.load(path / f"{split}.idx.npy")
        for k, doc_id in enumerate((path / f"{split}.docs.txt").read_text().splitlines()):
            out[doc_id] = tokens[bounds[k] : bounds[k + 1]].tobytes()
    return out


def version_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "manifest.json"}


# ------------------------------------------------------------------ same version as before


@pytest.mark.parametrize(
    "case, build, kw",
    [
        ("py_bytes", None, {"val_fraction": 0.1}),
        ("py_bpe400", None, {"val_fraction": 0.1, "tokenizer": "bpe:400"}),
        ("txt_bytes", text_tree, {"val_fraction": 0.2, "include_glob": None}),
        ("txt_bpe300", text_tree, {"val_fraction": 0.2, "include_glob": None, "tokenizer": "bpe:300"}),
        ("two_fallback", two_files, {"val_fraction": 0.02}),
        ("two_fallback_bpe", two_files, {"val_fraction": 0.02, "tokenizer": "bpe:260"}),
    ],
)
def test_a_text_corpus_prepares_to_the_same_version_as_the_single_process_implementation(
    case, build, kw, source, root, tmp_path
):
    src = source if build is None else build(tmp_path / "corpus")
    info = prepare_dataset(src, case.replace("_", "-"), "v1", root, **kw)
    assert info.content_sha256 == BEFORE[case]
    if case.startswith("two_fallback"):  # b.py has the smaller key: it is the held-out file
        assert (info.path / "val.docs.txt").read_text() == "b.py\n"
        assert (info.path / "train.docs.txt").read_text() == "a.py\n"


# ------------------------------------------------------------------ sources


def test_a_directory_tree_of_jsonl_compressed_jsonl_parquet_and_text_is_read_by_extension(tmp_path, root):
    src = records_tree(tmp_path / "corpus")
    info = prepare_dataset(src, "mixed", "v1", root, val_fraction=0.2, include_glob=None)
    docs = documents(info.path)
    # Every record is one document with its text's UTF-8 bytes as tokens; files in sorted order.
    assert sorted(docs) == sorted(RECORD_IDS)
    assert {docs[i] for i in RECORD_IDS} == {t.encode() for t in RECORD_TEXTS}
    assert all(docs[i] == t.encode() for i, t in zip(RECORD_IDS, RECORD_TEXTS))
    for split in ("train", "val"):  # each split keeps the corpus order
        ids = (info.path / f"{split}.docs.txt").read_text().splitlines()
        assert ids == [i for i in RECORD_IDS if i in set(ids)]
    assert 0 < info.val_documents < 60 and info.train_documents + info.val_documents == 60
    manifest = json.loads((info.path / "manifest.json").read_text())
    # One empty record skipped (a/one.jsonl line 12; line 11 is blank and holds none).
    assert manifest["skipped"] == {"empty_files": 0, "binary_files": 0, "hidden_files": 0, "empty_documents": 1}
    assert manifest["text_field"] == "text"


def test_a_named_text_field_and_a_single_file_source(tmp_path, root):
    path = tmp_path / "web.jsonl"
    path.write_text("".join(json.dumps({"url": f"u{i}", "content": TEXTS[i]}) + "\n" for i in range(20)))
    info = prepare_dataset(path, "web", "v1", root, val_fraction=0.2, text_field="content")
    docs = documents(info.path)
    assert docs == {f"web.jsonl:{i + 1}": TEXTS[i].encode() for i in range(20)}
    with pytest.raises(
        InvalidConfig, match=r"^prepare: source web.jsonl: line 1: no field 'text' \(fields: url, content;"
    ):
        prepare_dataset(path, "web", "v2", root, val_fraction=0.2)


def test_parquet_with_a_tokenizers_json_encodes_each_row(tmp_path, root):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    src = tmp_path / "pq"
    src.mkdir()
    pq.write_table(pa.table({"body": TEXTS}), src / "rows.parquet", row_group_size=7)
    bpe = prepare_dataset(
        src, "bpe", "v1", root, tokenizer="bpe:300", val_fraction=0.1, include_glob=None, text_field="body"
    )
    tok = Tokenizer.from_file(str(bpe.path / "tokenizer.json"))
    for split in ("train", "val"):
        tokens = np.fromfile(bpe.path / f"{split}.bin", dtype="<u2")
        bounds = np.load(bpe.path / f"{split}.idx.npy")
        for k, doc_id in enumerate((bpe.path / f"{split}.docs.txt").read_text().splitlines()):
            row = int(doc_id.rsplit(":", 1)[1])
            assert tokens[bounds[k] : bounds[k + 1]].tolist() == tok.encode(TEXTS[row], add_special_tokens=False).ids
    assert bpe.train_documents + bpe.val_documents == 60 and bpe.val_documents > 0


def test_an_s3_prefix_prepares_to_the_same_version_as_the_same_files_on_disk(
    s3,  # noqa: F811  (the fixture imported above)
    tmp_path,
    root,
    monkeypatch,
    capsys,
):
    import s3fs

    local = records_tree(tmp_path / "corpus")
    fs = s3fs.S3FileSystem(endpoint_url=s3)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.pipe_file(f"surge-ckpt/corpora/web/{path.relative_to(local).as_posix()}", path.read_bytes())
    fs.pipe_file("surge-ckpt/corpora/web/.hidden/skip.txt", b"hidden\n")
    on_disk = prepare_dataset(local, "web", "v1", root, val_fraction=0.2, include_glob=None)
    remote = prepare_dataset(
        "s3://surge-ckpt/corpora/web/", "web", "v2", root, val_fraction=0.2, include_glob=None,
        storage_options={"endpoint_url": s3},
    )  # fmt: skip
    assert remote.content_sha256 == on_disk.content_sha256 and remote.train_documents + remote.val_documents == 60
    assert json.loads((remote.path / "manifest.json").read_text())["skipped"]["hidden_files"] == 1
    # The CLI takes the URL and the endpoint; a glob over the keys picks the Parquet files.
    monkeypatch.setenv("SURGE_HOME", str(tmp_path / "home"))
    argv = [
        "dataset",
        "prepare",
        "--name",
        "pq",
        "--source",
        "s3://surge-ckpt/corpora/web",
        "--s3-endpoint",
        s3,
    ]
    code, out, err = run_cli([*argv, "--include", "**/*.parquet", "--workers", "1"], monkeypatch, capsys)
    assert code == 0 and out.startswith("prepared pq@v1: "), out + err
    ids = (tmp_path / "home" / "datasets" / "pq" / "v1" / "train.docs.txt").read_text().splitlines()
    assert ids and {i.split(":")[0] for i in ids} == {"b/five.parquet", "b/four.parquet"}


# ------------------------------------------------------------------ workers


def test_the_version_is_byte_identical_whatever_the_number_of_workers(tmp_path, root, monkeypatch):
    src = records_tree(tmp_path / "corpus")
    text_tree(src / "notes")
    monkeypatch.setattr(sources, "UNIT_BYTES", 512)  # many small units, so order across processes matters
    one = prepare_dataset(src, "one", "v1", root, val_fraction=0.2, include_glob=None, workers=1)
    two = prepare_dataset(src, "two", "v1", root, val_fraction=0.2, include_glob=None, workers=2)
    assert (one.workers, two.workers) == (1, 2)
    assert version_files(one.path) == version_files(two.path) and one.content_sha256 == two.content_sha256
    assert one.train_documents + one.val_documents == 60 + 31
    for split in ("train", "val"):  # the index the data service reads: np.save's bytes, describing the .bin
        bounds = np.load(one.path / f"{split}.idx.npy", allow_pickle=False)
        saved = io.BytesIO()
        np.save(saved, bounds, allow_pickle=False)
        assert saved.getvalue() == (one.path / f"{split}.idx.npy").read_bytes()
        assert bounds.dtype == np.int64 and bounds[0] == 0 and np.all(np.diff(bounds) > 0)
        assert bounds[-1] * 2 == (one.path / f"{split}.bin").stat().st_size


# ------------------------------------------------------------------ bad input


def _gz_truncated(path: Path) -> None:
    path.write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-40])


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("c.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', r"c\.jsonl: line 2: no field 'text' \(fields: body;"),
        ("c.jsonl", b'{"text": "ok"}\n\n{"text": "cut\n', r"c\.jsonl: line 3: not JSON \(Unterminated string"),
        ("c.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"c\.jsonl: line 2: not UTF-8 \(byte 14\)"),
        ("c.jsonl", b'{"text": "ok"}\n["text"]\n', r"c\.jsonl: line 2: not a JSON object \(a list\)"),
        ("c.jsonl", b'{"text": 3}\n', r"c\.jsonl: line 1: field 'text' is a number, not a string"),
        ("c.jsonl", b'{"text": "\\ud800"}\n', r"c\.jsonl: line 1: 'text' is not valid Unicode"),
        ("c.jsonl.gz", _gz_truncated, r"c\.jsonl\.gz: cannot read \(Compressed file ended before"),
        ("c.parquet", b"PAR1 not really", r"c\.parquet: cannot read as Parquet"),
    ],
)
def test_bad_input_is_one_line_naming_file_and_line_and_leaves_nothing(tmp_path, root, name, content, expected):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("a good document before the bad one\n")
    content(src / name) if callable(content) else (src / name).write_bytes(content)
    with pytest.raises(InvalidConfig, match=rf"^prepare: source {expected}") as bad:
        prepare_dataset(src, "bad", "v1", root, include_glob=None)
    assert "\n" not in str(bad.value)
    assert not root.exists()  # no temp dir, and not even the directories prepare created


def test_a_parquet_column_that_is_missing_or_null_is_named(tmp_path, root):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(InvalidConfig, match=r"^prepare: source a\.parquet: no column 'text' \(columns: body;"):
        prepare_dataset(tmp_path / "a.parquet", "bad", "v1", root)
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "b.parquet")
    with pytest.raises(InvalidConfig, match=r"^prepare: source b\.parquet: row 1: column 'text' is null$"):
        prepare_dataset(tmp_path / "b.parquet", "bad", "v1", root)
    assert not root.exists()


def test_with_workers_the_first_bad_line_in_corpus_order_is_named_and_the_cli_says_it_in_one_line(
    surge_home, tmp_path, monkeypatch, capsys
):
    src = tmp_path / "corpus"
    src.mkdir()
    for k in range(6):  # bad lines in the 2nd and the 5th file: the 2nd is named, whichever worker ends first
        good = "".join(json.dumps({"text": TEXTS[i]}) + "\n" for i in range(40))
        (src / f"part{k}.jsonl").write_text(good + ('{"txt": "x"}\n' if k in (1, 4) else ""))
    monkeypatch.setattr(sources, "UNIT_BYTES", 700)
    argv = ["dataset", "prepare", "--name", "web", "--source", str(src), "--workers", "2"]
    code, out, err = run_cli(argv, monkeypatch, capsys)
    assert_one_line(code, err, 2, "prepare: source part1.jsonl: line 41: no field 'text' (fields: txt;")
    assert not (surge_home / "datasets" / "web").exists()
