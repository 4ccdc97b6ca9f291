"""Offline preparation: one document per file, split by file, immutable content-hashed versions."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import numpy as np
import pytest

from services.data import manifest as mf
from services.data.errors import InvalidConfig, VersionConflict
from services.data.prepare import default_stdlib_source, prepare_dataset

from .helpers import NUM_FILES, file_text


def _split(directory, split):
    tokens = np.fromfile(directory / f"{split}.bin", dtype="<u2")
    bounds = np.load(directory / f"{split}.idx.npy")
    paths = (directory / f"{split}.docs.txt").read_text().splitlines()
    return tokens, bounds, paths


def test_each_file_is_one_document_and_the_split_is_by_file(dataset, source):
    d = dataset.path
    assert d == source.parent / "datasets" / "tiny" / "v1"
    train, val = _split(d, "train"), _split(d, "val")
    # Every non-empty .py file outside site-packages is exactly one document of one split.
    expected = sorted([f"pkg{i % 2}/mod_{i:02d}.py" for i in range(NUM_FILES)] + ["pkg0/has_nul.py"])
    assert sorted(train[2] + val[2]) == expected
    assert not set(train[2]) & set(val[2])
    for tokens, bounds, paths in (train, val):
        assert len(bounds) == len(paths) + 1 and bounds[-1] == len(tokens)
        for k, rel in enumerate(paths):  # a token is a byte of the file, in file order
            assert tokens[bounds[k] : bounds[k + 1]].astype(np.uint8).tobytes() == (source / rel).read_bytes()
    assert dataset.val_documents == len(val[2]) >= 1
    assert dataset.train_tokens == len(train[0]) and dataset.vocab_size == 256


def test_the_held_out_files_are_those_whose_path_hash_falls_below_the_fraction(dataset):
    _, _, val_paths = _split(dataset.path, "val")
    for rel in val_paths:
        assert int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") < 0.1 * 2**64


def test_manifest_lists_every_file_with_its_sha256_and_hashes_itself(dataset):
    d = dataset.path
    manifest = json.loads((d / "manifest.json").read_text())
    on_disk = sorted(p.name for p in d.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        data = (d / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"] == "bytes"
    assert manifest["skipped"] == {"empty_files": 1}
    assert mf.read(d, "tiny@v1")["manifest_sha256"] == dataset.manifest_sha256
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_preparing_identical_content_again_is_a_no_op(dataset, source, root, tmp_path):
    before = (dataset.path / "manifest.json").read_bytes()
    copy = tmp_path / "elsewhere"
    shutil.copytree(source, copy)  # same files, another source path: same content
    again = prepare_dataset(copy, "tiny", "v1", root, val_fraction=0.1)
    assert not again.created and again.manifest_sha256 == dataset.manifest_sha256
    assert (dataset.path / "manifest.json").read_bytes() == before


def test_a_version_is_immutable_different_content_is_refused(dataset, source, root):
    before = (dataset.path / "train.bin").read_bytes()
    (source / "pkg0" / "mod_00.py").write_bytes(b"changed = True\n")
    with pytest.raises(VersionConflict, match=r"dataset tiny@v1 already exists with different content"):
        prepare_dataset(source, "tiny", "v1", root, val_fraction=0.1)
    assert (dataset.path / "train.bin").read_bytes() == before
    assert prepare_dataset(source, "tiny", "v2", root, val_fraction=0.1).created
    assert sorted(p.name for p in (root / "tiny").iterdir()) == ["v1", "v2"]


def test_bad_arguments_are_one_line_errors(source, root):
    with pytest.raises(InvalidConfig, match=r"prepare: version: '\.\./x' must match"):
        prepare_dataset(source, "tiny", "../x", root)
    with pytest.raises(InvalidConfig, match=r"prepare: val_fraction: must be in \[0, 1\), got 1.5"):
        prepare_dataset(source, "tiny", "v1", root, val_fraction=1.5)
    with pytest.raises(InvalidConfig, match=r"no non-empty file matches '\*\*/\*\.rs'"):
        prepare_dataset(source, "tiny", "v1", root, include_glob="**/*.rs")


def test_a_tokenizers_json_sets_the_vocab_and_is_copied_into_the_version(source, root, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        [file_text(i).decode() for i in range(NUM_FILES)],
        trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"], show_progress=False),
    )
    path = tmp_path / "tok.json"
    tok.save(str(path))
    info = prepare_dataset(source, "bpe", "v1", root, tokenizer=str(path), val_fraction=0.1)
    assert info.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    assert info.tokenizer == "tokenizer.json"
    assert (info.path / "tokenizer.json").read_bytes() == path.read_bytes()
    tokens, bounds, paths = _split(info.path, "train")
    first = (source / paths[0]).read_bytes().decode()
    assert tokens[bounds[0] : bounds[1]].tolist() == tok.encode(first, add_special_tokens=False).ids
    assert info.train_tokens < sum(len((source / p).read_bytes()) for p in paths)  # BPE merges bytes


def test_bpe_n_trains_a_byte_level_bpe_on_the_train_split_and_stores_it_in_the_version(source, root):
    from tokenizers import Tokenizer

    info = prepare_dataset(source, "bpe", "v1", root, tokenizer="bpe:400", val_fraction=0.1)
    manifest = json.loads((info.path / "manifest.json").read_text())
    tok = Tokenizer.from_file(str(info.path / "tokenizer.json"))
    # (This small corpus has fewer pairs seen twice than 400 - 257 merges.)
    assert info.tokenizer == "tokenizer.json" and 300 < info.vocab_size == tok.get_vocab_size() <= 400
    assert tok.token_to_id("<|endoftext|>") == 0  # the packer's document separator
    assert (
        manifest["tokenizer_source"]
        == f"bpe:400: byte-level BPE trained on the train split ({info.train_documents} documents)"
    )
    for split in ("train", "val"):  # every document's tokens decode back to its bytes
        tokens, bounds, paths = _split(info.path, split)
        for k, rel in enumerate(paths):
            ids = tokens[bounds[k] : bounds[k + 1]].tolist()
            assert 0 not in ids and tok.decode(ids).encode() == (source / rel).read_bytes()
    assert info.train_tokens < sum(len((source / p).read_bytes()) for p in _split(info.path, "train")[2])
    # Training is deterministic: preparing the same content again is a no-op, not a conflict.
    again = prepare_dataset(source, "bpe", "v1", root, tokenizer="bpe:400", val_fraction=0.1)
    assert not again.created and again.content_sha256 == info.content_sha256


@pytest.mark.parametrize("spec", ["bpe:257", "bpe:0", "bpe:x", "bpe:", f"bpe:{2**20 + 1}"])
def test_a_bpe_vocabulary_out_of_range_is_one_line_and_nothing_is_written(source, root, spec):
    with pytest.raises(
        InvalidConfig, match=rf"^prepare: tokenizer {re.escape(spec)}: bpe:N needs a vocabulary size N from 258"
    ):
        prepare_dataset(source, "bpe", "v1", root, tokenizer=spec)
    assert not root.exists()


def test_the_default_source_is_this_pythons_standard_library():
    src = default_stdlib_source()
    assert (src / "os.py").is_file() and (src / "json" / "__init__.py").is_file()
