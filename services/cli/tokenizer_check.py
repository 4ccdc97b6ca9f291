"""The tokenizer a model's weights were trained with against the one of the dataset they are
about to read (a fine-tune's ``init_from``, ``surgectl eval --dataset``): a token id means a
piece of text only under its tokenizer, so two tokenizers of the same vocabulary size still
make a model read the wrong text, and nothing downstream notices.

A tokenizer is identified by :func:`tokenizer_id`: ``bytes``, or the SHA-256 of its
``tokenizers`` JSON in canonical form (parsed, then written with sorted keys and no spaces,
services/data/manifest.py ``canonical``), so the same tokenizer written with other
whitespace or key order (an HF export's copy, a re-save) is the same one.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.cli import clients
from services.cli.errors import CliError
from services.contract import data_pb2


def tokenizer_id(tokenizer: str) -> str:
    """``"bytes"``, or ``sha256:<hex>`` of the canonical JSON of the tokenizers file at path
    ``tokenizer`` (a dataset's ``DatasetReady.tokenizer``, or an HF directory's file).

    Raises:
        OSError, ValueError: the file cannot be read or is not JSON.
    """
    from services.data.manifest import canonical, sha256_bytes

    if tokenizer == "bytes":
        return "bytes"
    return "sha256:" + sha256_bytes(canonical(json.loads(Path(tokenizer).read_bytes())))


def short(tid: str) -> str:
    """``tid`` as a message shows it: ``bytes`` or ``sha256:`` and 12 hex digits."""
    return tid if tid == "bytes" else tid[:19]


def dataset_tokenizer(dataset: str, ask_service: bool = True) -> data_pb2.DatasetReady:
    """Dataset version ``dataset`` (``name@version``) as the data service mounts it (not
    re-hashed: only its tokenizer is wanted), or, with no data service known or reachable,
    as the catalog under the data root gives it, read directly (always, without
    ``ask_service``: ``surgectl eval`` reads everything under SURGE_HOME).

    Raises:
        CliError: the version cannot be read (deleted, corrupt); the message, unprefixed.
    """
    name, _, version = dataset.partition("@")
    mount = data_pb2.MountDataset(name=name, version=version, verify=False)
    try:
        addr = clients.address("data") if ask_service else None
    except CliError:
        addr = None  # no stack here, no address given
    if addr is not None:
        try:
            return clients.call("data", lambda s: s.Mount(mount, timeout=60))
        except CliError as e:
            if not e.unreachable:
                raise
    from services.common import paths
    from services.data.dataset_versions import DatasetVersions
    from services.data.errors import DataError

    catalog = DatasetVersions(paths.datasets_root(), emit=lambda *_: None, activate_source=lambda *_: None)
    try:
        return catalog.mount_dataset(mount)
    except (DataError, OSError) as e:
        raise CliError(" ".join(str(e).split())) from None


def trained_with_mismatch(field: str, trained_on: str, dataset: data_pb2.DatasetReady, ask_service: bool = True) -> str:
    """Why weights trained on dataset version ``trained_on`` cannot read ``dataset`` ("" if
    they can): its tokenizer differs, or ``trained_on`` cannot be read (then the tokenizer
    cannot be checked: refused too). ``field`` names what chose ``dataset`` in the message
    ("" when the caller's prefix does); ``ask_service`` as in :func:`dataset_tokenizer`."""
    label = f"{dataset.name}@{dataset.version}"
    if trained_on == label:
        return ""
    try:
        source = dataset_tokenizer(trained_on, ask_service)
    except CliError as e:
        return (
            f"trained on dataset {trained_on}, which cannot be read ({e}), so its tokenizer cannot be checked "
            f"against {label}'s; restore {trained_on} (prepare it again from the same source) to use these weights"
        )
    try:
        have = tokenizer_id(source.tokenizer)
    except (OSError, ValueError) as e:
        return f"trained on dataset {trained_on}, whose tokenizer {source.tokenizer} cannot be read ({e})"
    want, problem = _dataset_id(dataset)
    if problem or have == want:
        return problem
    hint = "bytes" if have == "bytes" else source.tokenizer
    return (
        f"trained on {trained_on} (tokenizer {short(have)}), but {field + ' ' if field else ''}{label} was prepared with another "
        f"tokenizer ({short(want)}) of vocabulary {dataset.vocab_size}: its token ids would be read as other "
        f"text; use a version prepared with `dataset prepare --tokenizer {hint}`"
    )


def hf_mismatch(directory: str, dataset: data_pb2.DatasetReady) -> str:
    """Why a Hugging Face directory's weights cannot read ``dataset`` ("" if they can): its
    ``tokenizer.json`` differs from the dataset's tokenizer. A directory without one is not
    checked (nothing says what it was trained with)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return ""
    label = f"{dataset.name}@{dataset.version}"
    try:
        have = tokenizer_id(str(path))
    except (OSError, ValueError) as e:
        return f"{path}: cannot be read as a tokenizers JSON ({type(e).__name__}: {' '.join(str(e).split())})"
    want, problem = _dataset_id(dataset)
    if problem or have == want:
        return problem
    return (
        f"{path} (tokenizer {short(have)}) differs from the tokenizer of data.dataset {label} "
        f"({short(want)}): its token ids would be read as other text; use a version prepared with "
        f"`dataset prepare --tokenizer {path}`"
    )


def _dataset_id(dataset: data_pb2.DatasetReady) -> tuple[str, str]:
    """(its tokenizer's id, "") or ("", why it cannot be read)."""
    try:
        return tokenizer_id(dataset.tokenizer), ""
    except (OSError, ValueError) as e:
        label = f"{dataset.name}@{dataset.version}"
        return (
            "",
            f"the tokenizer of {label}, {dataset.tokenizer}, cannot be read ({type(e).__name__}), so it cannot be checked",
        )
