"""L4-4 sample filter (样本过滤模块): drops documents that break the rules, and counts them.

It never edits, truncates, repairs or adds a document, and never changes its rules: they
are pushed once by L2-1 (``FilterRules``). A document is dropped for the first rule it
breaks, in this order: shorter than ``min_tokens``; longer than ``max_tokens`` (0 = no
bound); contains a banned byte or a banned token. Banned *bytes* are bytes, so they can
only be checked under the bytes tokenizer (a token is a byte); with another tokenizer a
non-empty ``banned_bytes`` is refused (use ``banned_tokens``).

Verdicts are per document of the split, whatever the epoch's order (the rules never look at
it): lengths come from the document bounds (no read); a banned token needs the tokens, so
with banned ids the split is scanned through the prefetcher's read handle, in chunks
(bounded memory). The verdicts (int8 per document) are kept next to the version's sample
indices (``<index root>/filter-<hash of manifest, split, rules>/verdicts.npy``, written
atomically under a lock): streams with the same rules judge (and scan) once and map them. The filter hands on references: the
epoch's order and its keep mask (``KeptDocuments``); the packer builds the epoch's rows from
them (``sample_index.py``).

Commands it takes: ``filter_rules`` (L2-1), ``on_samples_shuffled`` (data from L4-3). It
publishes ``FilterReport`` (cumulative for the stream: every epoch judges every document, to
L2-1) and then ``SamplesFiltered`` (payload :class:`KeptDocuments`, to the packer), once per
epoch.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from services.contract import data_pb2
from services.contract.bus import Emitter
from services.contract.frozen import FrozenConfig
from services.data.documents import Catalog, EpochOrder, KeptDocuments
from services.data.errors import ConfigAlreadyPushed, InvalidConfig
from services.data.sample_index import cached_array

# A document's verdict (the first rule it breaks).
KEPT, TOO_SHORT, TOO_LONG, BANNED = 0, 1, 2, 3
SCAN_CHUNK_TOKENS = 4 << 20  # tokens per read of the banned-token scan (8-16 MiB)
CHUNK = 1 << 20  # documents judged by length at a time


class SampleFilter:
    """Applies fixed rules to batches of documents; keeps a tally of what it dropped."""

    def __init__(self, emit: Emitter):
        self._emit = emit
        # Pushed once per stream (seed L4-4 s2: 上层一次性下发后固化); the composition root
        # builds a fresh filter for every stream, so "once" is once per stream.
        self._rules = FrozenConfig[data_pb2.FilterRules]("L4_FILTER", "filter rules", error=ConfigAlreadyPushed)
        self._banned = np.zeros(0, np.int64)  # token ids; banned bytes count as ids under "bytes"
        self._report = data_pb2.FilterReport()
        self._verdicts: np.ndarray | None = None
        # "idle" | "filtering" | "interrupted"
        self._state = "idle"

    # ---- commands -------------------------------------------------------------------

    def filter_rules(self, msg: data_pb2.FilterRules, payload: object = None) -> None:
        """Fix the rules for this stream (pushed once).

        Raises:
            InvalidConfig: ``max_tokens`` below ``min_tokens``.
            ConfigAlreadyPushed: rules were already set (an InvalidConfig and a ConfigFrozen).
        """
        self._rules.require_unset()
        if msg.max_tokens and msg.max_tokens < msg.min_tokens:
            raise InvalidConfig(f"filter.max_tokens: {msg.max_tokens} is below min_tokens {msg.min_tokens}")
        self._rules.set(msg)
        self._banned = np.unique(np.asarray([*msg.banned_bytes, *msg.banned_tokens], dtype=np.int64))

    def on_samples_shuffled(self, msg: data_pb2.SamplesShuffled, order: EpochOrder) -> None:
        """Judge the split's documents; publish the tally, then the epoch's kept documents.

        Raises:
            InvalidConfig: banned bytes with a tokenizer other than bytes.
            RuntimeError: samples before rules (wiring fault).
            DataReadError: the banned-token scan could not read the split.
        """
        if not self._rules.is_set:
            raise RuntimeError("filter: samples before FilterRules")
        rules = self._rules.get()
        store = order.catalog.store
        if rules.banned_bytes and store.tokenizer != "bytes":
            self._state = "interrupted"
            raise InvalidConfig(
                f"filter.banned_bytes: needs the bytes tokenizer, the dataset uses {store.tokenizer} (use banned_tokens)"
            )
        self._state = "filtering"
        verdicts = self._verdicts_for(order)
        r = self._report
        counts = [np.count_nonzero(verdicts == v) for v in range(4)]  # (np.bincount copies to int64)
        r.kept += int(counts[KEPT])
        r.dropped_too_short += int(counts[TOO_SHORT])
        r.dropped_too_long += int(counts[TOO_LONG])
        r.dropped_banned += int(counts[BANNED])
        self._emit(r)
        keep = np.asarray(verdicts) == KEPT
        self._emit(data_pb2.SamplesFiltered(count=int(counts[KEPT])), KeptDocuments(order, keep, rules))

    # ---- private ----------------------------------------------------------------------

    def _verdicts_for(self, order: EpochOrder) -> np.ndarray:
        """int8 [N] by storage id (KEPT, TOO_SHORT, TOO_LONG, BANNED): the same for every
        epoch, so judged once per rule set and version (kept next to its sample indices)."""
        if self._verdicts is not None:
            return self._verdicts
        catalog = order.catalog
        store = catalog.store
        if store.index_root is None:  # a store outside a data root (tests)
            verdicts = self._judge(catalog)
        else:  # kept on disk: every stream with these rules maps the same verdicts
            rules = self._rules.get()
            key = json.dumps(
                [store.manifest_sha256, store.split, rules.min_tokens, rules.max_tokens, self._banned.tolist()]
            )
            name = "filter-" + hashlib.sha256(key.encode()).hexdigest()[:24]
            verdicts = cached_array(store.index_root / name / "verdicts.npy", lambda: self._judge(catalog))
        self._verdicts = verdicts
        return verdicts

    def _judge(self, catalog: Catalog) -> np.ndarray:
        """A document is dropped for the first rule it breaks (see the module docstring).
        Lengths come from the bounds, ``CHUNK`` documents at a time (bounded memory)."""
        rules = self._rules.get()
        bounds = catalog.store.bounds_n1
        verdicts = np.full(len(bounds) - 1, KEPT, np.int8)
        for lo in range(0, len(verdicts), CHUNK):
            lengths = np.diff(bounds[lo : lo + CHUNK + 1])
            part = verdicts[lo : lo + len(lengths)]
            too_short = lengths < rules.min_tokens
            part[too_short] = TOO_SHORT
            if rules.max_tokens:
                part[~too_short & (lengths > rules.max_tokens)] = TOO_LONG
        if len(self._banned):
            verdicts[(verdicts == KEPT) & self._has_banned(catalog)] = BANNED
        return verdicts

    def _has_banned(self, catalog: Catalog) -> np.ndarray:
        """bool [N]: the document holds at least one banned id. One pass over the split in
        chunks (a lookup per token, no loop over documents)."""
        bounds = catalog.store.bounds_n1
        banned_n = np.zeros(len(bounds) - 1, bool)
        top = int(self._banned.max())
        small = catalog.store.dtype.itemsize <= 2  # every id fits a 65,536-entry table
        table = np.zeros(max(top + 2, 1 << 16) if small else top + 2, bool)  # far faster than np.isin
        table[self._banned] = True
        for first, tokens in catalog.reader.chunks(SCAN_CHUNK_TOKENS):
            hits = np.flatnonzero(table[tokens] if small else table[np.minimum(tokens, top + 1)])
            if len(hits):  # the documents holding them: the last whose start is <= the hit
                banned_n[np.searchsorted(bounds, hits + first, side="right") - 1] = True
        return banned_n
