"""Payloads that travel next to the L4 bus messages (the bus's in-process handles).

Messages on the bus say *that* something happened (``SamplesRead{count}``); these objects
carry what it is about, by reference: a catalog of the split's documents (their bounds in
the token file and the prefetcher's read handle), the epoch's document order, the filter's
verdicts. No token travels down the data path: the packer has the tokens of the rows its
rank trains read last, through the read handle (``prefetcher.TokenReader``). Arrays are made
read-only before they are handed on: what one module holds can never be altered by another
(law 5: reported data is read-only).

Legend: ``N`` documents in the split, ``K`` kept documents of an epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from services.contract import data_pb2


class TokenReader(Protocol):
    """The prefetcher's read handle on a split's token file (``prefetcher.TokenReader``):
    what a module downstream may do with tokens, short of holding the file."""

    def read(self, start: int, count: int) -> np.ndarray: ...

    def read_many(self, ranges: list[tuple[int, int]]) -> list[np.ndarray]: ...

    def chunks(self, chunk_tokens: int) -> Iterator[tuple[int, np.ndarray]]: ...


def _frozen(a: np.ndarray) -> np.ndarray:
    if a.flags.writeable:
        a.flags.writeable = False
    return a


@dataclass(frozen=True)
class TokenStore:
    """One split of a mounted dataset version: ``ActivateSource``'s payload (L4-1 -> L4-2).

    Attributes:
        dataset: ``name@version``, for messages.
        split: ``"train"`` or ``"val"``.
        tokens_path: flat token file (``<split>.bin``), little-endian ``dtype``.
        dtype: ``uint16`` (vocab <= 65536) or ``uint32``.
        bounds_n1: int64 [N + 1], document i is tokens[bounds[i]:bounds[i+1]].
        tokenizer: ``"bytes"`` or the path of the dataset's tokenizers JSON.
        manifest_sha256: the version's manifest hash (part of the sample index's key).
        index_root: where this version's sample indices live
            (``<data_root>/.index/<name>/<version>``, see ``sample_index.py``).
        remote: the token file in object storage, read through the block cache
            (``block_cache.py``) instead of ``tokens_path`` (None: a local version).
        tokens_sha256: the token file's SHA-256 in the manifest ("": not checked at read).
        verified: the token file's identity when its bytes were found to hash to it
            (``manifest.FileIdentity``); a read that finds another hashes it again.
    """

    dataset: str
    split: str
    tokens_path: Path
    dtype: np.dtype
    bounds_n1: np.ndarray
    tokenizer: str
    manifest_sha256: str = ""
    index_root: Path | None = None
    remote: object | None = None  # block_cache.CachedFile (not imported: documents stay dependency-free)
    tokens_sha256: str = ""
    verified: object | None = None  # manifest.FileIdentity (likewise)

    @property
    def num_documents(self) -> int:
        return len(self.bounds_n1) - 1

    @property
    def lengths_n(self) -> np.ndarray:
        """int64 [N]: tokens per document (from the bounds: no token read)."""
        return np.diff(self.bounds_n1)


@dataclass(frozen=True)
class Catalog:
    """``SamplesRead``'s payload (L4-2 -> L4-3): the split's documents, by reference.

    Attributes:
        store: the split (its document bounds).
        reader: the prefetcher's read handle on the split's token file: the only way any
            module downstream gets at tokens (the filter for banned tokens, the packer for
            the rows its rank trains).
    """

    store: TokenStore
    reader: TokenReader

    def __len__(self) -> int:
        return self.store.num_documents


@dataclass(frozen=True)
class EpochOrder:
    """``SamplesShuffled``'s payload (L4-3 -> L4-4): one epoch's document order.

    ``order()`` is the shuffler's pure function of (seed, epoch) (int64 [N], a permutation
    of the storage ids): computed only when something needs it (the sample index of the
    epoch is not built yet), and once. ``compute_next`` is the same function for the next
    epoch of the same plan (what a repeating stream is planned next): the packer has that
    epoch's index built ahead (``following``); None where there is none to offer.
    """

    catalog: Catalog
    epoch: int
    seed: int
    enabled: bool
    compute: Callable[[], np.ndarray]
    compute_next: Callable[[], np.ndarray] | None = None
    _memo: list = field(default_factory=list, repr=False, compare=False)

    def order(self) -> np.ndarray:
        if not self._memo:
            self._memo.append(_frozen(self.compute()))
        return self._memo[0]

    def following(self) -> EpochOrder | None:
        """The next epoch's order under the same plan (None: not offered)."""
        if self.compute_next is None:
            return None
        return EpochOrder(self.catalog, self.epoch + 1, self.seed, self.enabled, self.compute_next)


@dataclass(frozen=True)
class KeptDocuments:
    """``SamplesFiltered``'s payload (L4-4 -> L4-5): the epoch's order and the filter's
    verdict per document.

    Attributes:
        order: the shuffler's epoch order.
        keep_n: bool [N] by storage id: the document passes the filter.
        rules: the rules the verdicts follow (part of the sample index's key).
    """

    order: EpochOrder
    keep_n: np.ndarray
    rules: data_pb2.FilterRules

    def __post_init__(self) -> None:
        _frozen(self.keep_n)

    @property
    def catalog(self) -> Catalog:
        return self.order.catalog

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def following(self) -> KeptDocuments | None:
        """The next epoch's kept documents under the same plan and rules (the verdicts are
        per document, the same every epoch); None when the order offers no next epoch."""
        order = self.order.following()
        return None if order is None else KeptDocuments(order, self.keep_n, self.rules)

    def doc_idx(self) -> np.ndarray:
        """int64 [K]: the kept documents (storage ids) in the epoch's order."""
        order = self.order.order()
        return order[self.keep_n[order]]
