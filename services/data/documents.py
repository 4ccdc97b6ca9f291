"""Payloads that travel next to the L4 bus messages (the bus's in-process handles).

Messages on the bus say *that* something happened (``SamplesRead{count}``); these objects
carry the documents themselves, by reference. Their arrays are made read-only before they
are handed on: a receiver that wants to change something builds a new object, so what one
module holds can never be altered by another (law 5: reported data is read-only).

Legend: ``T`` tokens in a batch of documents, ``n`` documents in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _frozen(a: np.ndarray) -> np.ndarray:
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
        bounds_n1: int64 [num_documents + 1], document i is tokens[bounds[i]:bounds[i+1]].
        tokenizer: ``"bytes"`` or the path of the dataset's tokenizers JSON.
    """

    dataset: str
    split: str
    tokens_path: Path
    dtype: np.dtype
    bounds_n1: np.ndarray
    tokenizer: str

    @property
    def num_documents(self) -> int:
        return len(self.bounds_n1) - 1


@dataclass(frozen=True)
class Documents:
    """A batch of whole documents, concatenated: the payload of SamplesRead, SamplesShuffled
    and SamplesFiltered.

    Attributes:
        tokens_T: uint16 | uint32 [T], the documents back to back.
        bounds_n1: int64 [n + 1], ``bounds_n1[0] == 0``; document i is
            ``tokens_T[bounds_n1[i]:bounds_n1[i + 1]]``.
        index_n: int64 [n]. Before the shuffler: the document's position in the split's
            storage order. After it: the position in the epoch's (global) order.
        epoch: the epoch these documents belong to; -1 before the shuffler.
        last: the last documents of the split (SamplesRead) or of the epoch's order (after
            the shuffler). A batch with ``last`` may hold no document at all.
        split: ``"train"`` | ``"val"``.
        tokenizer: as in :class:`TokenStore` (the filter needs it to interpret banned bytes).
    """

    tokens_T: np.ndarray
    bounds_n1: np.ndarray
    index_n: np.ndarray
    epoch: int
    last: bool
    split: str
    tokenizer: str

    def __post_init__(self) -> None:
        assert len(self.bounds_n1) == len(self.index_n) + 1 and self.bounds_n1[0] == 0
        assert self.bounds_n1[-1] == len(self.tokens_T)
        for a in (self.tokens_T, self.bounds_n1, self.index_n):
            _frozen(a)

    def __len__(self) -> int:
        return len(self.index_n)

    @property
    def lengths_n(self) -> np.ndarray:
        """int64 [n]: tokens per document."""
        return np.diff(self.bounds_n1)

    def select(self, keep_n: np.ndarray) -> Documents:
        """The documents where ``keep_n`` (bool [n]) is true, in the same order, unchanged."""
        if keep_n.all():
            return self
        lengths = self.lengths_n
        tokens = self.tokens_T[np.repeat(keep_n, lengths)]
        bounds = np.zeros(int(keep_n.sum()) + 1, dtype=np.int64)
        np.cumsum(lengths[keep_n], out=bounds[1:])
        return Documents(tokens, bounds, self.index_n[keep_n].copy(), self.epoch, self.last, self.split, self.tokenizer)

    @staticmethod
    def join(
        parts: list[np.ndarray],
        index_n: np.ndarray,
        epoch: int,
        last: bool,
        split: str,
        tokenizer: str,
        dtype: np.dtype,
    ) -> Documents:
        """Concatenate whole documents (``parts``, one array each) into one batch."""
        lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        bounds = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
        return Documents(tokens.astype(dtype, copy=False), bounds, index_n, epoch, last, split, tokenizer)
