"""``surgectl export VERSION --format hf|torch --out DIR``: a committed checkpoint's model as
files other tools read, without a running stack.

The version is looked up in the store's catalog under ``$SURGE_HOME`` read-only
(services/store/checkpoint_manager/manager.py ``read_committed``: its recorded verdict and manifest),
and its weights are read with every file checked against the manifest as it is read
(services/compute/inference.py). Formats:

* ``hf``: ``model.safetensors`` + ``config.json`` (a ``LlamaForCausalLM``, a
  ``Qwen2ForCausalLM`` with ``model.qkv_bias``: names and config by
  services/compute/hf_format.py), loadable by ``transformers.AutoModelForCausalLM``; the
  dataset's tokenizer (``tokenizer.json``) travels with it when it has one.
* ``torch``: ``model.pt``, a plain ``state_dict`` with Surge's names, for
  ``build_model(spec).load_state_dict(torch.load(..., weights_only=True))``.

Both also hold ``surge_spec.json`` (the job spec the version was written with). Nothing is
half-done: the files are written into a temporary directory beside ``DIR`` and renamed into
place; an existing non-empty ``DIR`` is refused unless ``--force`` and it is an earlier export
(it holds ``surge_spec.json``; then replaced whole). Missing parent folders are created, as
``save_pretrained`` does (the README's ``--out exports/notes-hf`` in a fresh folder), once the
version was read, and removed again if the export fails; a path that cannot be created (a file
in the way) is refused before anything is read.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

from services.cli.errors import CliError
from services.cli.evaluation import Checkpoint, VersionRemoved, load_model, read_version

FORMATS = ("hf", "torch")
LATEST_TRIES = 3  # `JOB:latest` read again when a running job's keep_last removed it meanwhile
MARKER = "surge_spec.json"  # every export holds it: what `--force` checks before replacing a folder
# Every file an export writes (_write, _tokenizer, hf_format.save_hf): `--force` replaces a folder
# holding only these.
WRITTEN = frozenset({MARKER, "model.pt", "model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"})


def export_version(version: str, fmt: str, out: Path, force: bool = False) -> str:
    """Export ``version`` as ``fmt`` into ``out``; returns the line to print.

    Raises:
        CliError: code 2 for usage (an unknown format, a malformed version, no such
            version, a file where ``out``'s folders would be); code 1 for a refusal (``out`` a file or
            not empty without ``force``, or with ``force`` not an earlier export; a version
            not ok or failing its digests, a model with no Hugging Face form), one line
            naming the option, version or file. (An empty ``--out`` is refused by the
            command's parser: ``Path("")`` is ``.``.)
    """
    from services.common import paths

    if fmt not in FORMATS:
        raise CliError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}", code=2)
    try:
        here = Path.cwd()
    except FileNotFoundError:  # (the shell's folder was removed under it)
        raise CliError("export: the current directory no longer exists; cd to one that does", code=1) from None
    out = Path(os.path.normpath(here / out))  # (lexical: `..` too, a link kept as named)
    if out == here or out in here.parents:  # (replaced, it would leave the shell in a removed folder)
        raise CliError(f"--out: {out} is the current directory or holds it; name another directory", code=2)
    missing = _missing_parents(out)  # (created once the version was read: as save_pretrained)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out: {out} exists and is not a directory", code=1)
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise CliError(f"--out: {out} is not empty (use --force to replace an earlier export)", code=1)
        if not (out / MARKER).is_file():  # (--force once replaced any folder: `--out ""` was the current one)
            raise CliError(
                f"--out: {out} is not an earlier export (it has no {MARKER}): --force replaces only one; "
                "name a new or empty directory",
                code=1,
            )
        if added := sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.name not in WRITTEN):
            # (a user's notes or eval results put beside an export are theirs: never removed silently)
            raise CliError(
                f"--out: {out} holds files an export does not write ({', '.join(added[:5])}"
                f"{', ...' if len(added) > 5 else ''}): --force replaces only an export as written; "
                "move them or name another directory",
                code=1,
            )
    from services.compute import hf_format
    from services.jobspec import spec_from_json

    for attempt in range(LATEST_TRIES):
        info = _committed(paths.store_root(), version)
        spec = spec_from_json(info.spec_json)
        if fmt == "hf":
            try:
                hf_format.hf_config(spec)
            except hf_format.HfFormatError as e:
                raise CliError(f"export {info.version} --format hf: {e}; --format torch writes it", code=1) from None
        try:
            model = load_model(Checkpoint(info.version, info.step, info.path, spec))
            break
        except VersionRemoved:  # (a running job's keep_last: `latest` names a newer one now)
            if not version.endswith("latest") or attempt == LATEST_TRIES - 1:
                raise
    tmp = out.parent / f".{out.name}.export-{secrets.token_hex(4)}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:  # read-only, no permission, /proc: nothing written yet
        _remove_empty(missing)
        raise CliError(f"--out: cannot write {out}: {e.strerror or e}", code=1) from None
    try:
        notes = _write(tmp, fmt, model, spec, hf_format)
        (tmp / MARKER).write_text(info.spec_json + "\n")
        _into_place(tmp, out)
    except OSError as e:  # disk full, permissions changed under us: the temporary is removed
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(missing)
        raise CliError(f"--out: cannot write {out}: {e.strerror or e}", code=1) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(missing)
        raise
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    return f"exported {info.version} (step {info.step}) as {fmt} to {out}: {files}" + "".join(f"; {n}" for n in notes)


def _missing_parents(out: Path) -> list[Path]:
    """``out``'s parent folders that do not exist yet, deepest first (the export creates them).

    Raises:
        CliError (exit 2): the nearest one that exists is not a folder (it cannot be created)."""
    missing, parent = [], out.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise CliError(f"--out: {out}: {parent} is not a directory (its folders cannot be created)", code=2)
    return missing


def _remove_empty(created: list[Path]) -> None:
    """The folders an export that failed created, removed again while empty (deepest first)."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:  # (not empty, or never made: kept)
            return


def _committed(root: Path, version: str):
    from services.store.checkpoint_manager import CheckpointRejected

    # A version that is not there (none at all, or not this one) is the user's input: exit 2,
    # as `resume --from` and `rollback --version` answer it; one there but damaged: exit 1.
    if not (root / "checkpoints").is_dir():
        raise CliError(f"export: no checkpoints under {root} (SURGE_HOME's store)", code=2)
    try:
        return read_version(root, version, "export")
    except CheckpointRejected as e:
        raise CliError(f"export: {e}", code=1) from None
    except ValueError as e:
        raise CliError(str(e), code=2) from None


def _write(directory: Path, fmt: str, model, spec, hf_format) -> list[str]:
    import torch

    state = model.state_dict()
    if fmt == "torch":
        torch.save(state, directory / "model.pt")
        return []
    notes, end = _tokenizer(directory, spec)
    hf_format.save_hf(directory, state, spec, eos_token_id=end)
    return notes


def _tokenizer(directory: Path, spec) -> tuple[list[str], int | None]:
    """Copy the dataset's tokenizer (the HF ``tokenizers`` JSON it was prepared with) with its
    config (``hf_format.save_tokenizer``); returns a note when there is none to copy, and the
    end-of-text token's id (None without one)."""
    from services.common import paths
    from services.compute import hf_format

    label = spec.data.label
    manifest_path = paths.datasets_root() / spec.data.name / spec.data.version / "manifest.json"
    try:
        tokenizer = json.loads(manifest_path.read_text()).get("tokenizer", "bytes")
    except (OSError, ValueError):
        return [f"tokenizer not copied: dataset {label} not found under {paths.datasets_root()}"], None
    if tokenizer == "bytes":
        return [f"no tokenizer file: dataset {label} is byte-level (token id = UTF-8 byte)"], None
    source = manifest_path.parent / tokenizer
    if not source.is_file():
        return [f"tokenizer not copied: {source} is missing"], None
    return [], hf_format.save_tokenizer(directory, source, spec.data.seq_len)


def _into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (empty, or replaced with --force) is
    moved aside first and removed once the new one is in place."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        if old.is_symlink():  # (--out named a link to an earlier export: the link goes, not its target)
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
