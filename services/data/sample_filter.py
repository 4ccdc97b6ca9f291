"""L4-4 sample filter (样本过滤模块): drops documents that break the rules, and counts them.

It never edits, truncates, repairs or adds a document, and never changes its rules: they
are pushed once by L2-1 (``FilterRules``). A document is dropped for the first rule it
breaks, in this order: shorter than ``min_tokens``; longer than ``max_tokens`` (0 = no
bound); contains a banned byte or a banned token. Banned *bytes* are bytes, so they can
only be checked under the bytes tokenizer (a token is a byte); with another tokenizer a
non-empty ``banned_bytes`` is refused (use ``banned_tokens``).

Commands it takes: ``filter_rules`` (L2-1), ``on_samples_shuffled`` (data from L4-3). It
publishes ``FilterReport`` (cumulative for the stream, to L2-1) and then
``SamplesFiltered`` (payload :class:`Documents`, to the packer) for every batch it gets,
also for an empty one (an epoch's ``last`` marker must travel on).
"""

from __future__ import annotations

import numpy as np

from services.contract import data_pb2
from services.contract.bus import Emitter
from services.contract.frozen import FrozenConfig
from services.data.documents import Documents
from services.data.errors import ConfigAlreadyPushed, InvalidConfig


class SampleFilter:
    """Applies fixed rules to batches of documents; keeps a tally of what it dropped."""

    def __init__(self, emit: Emitter):
        self._emit = emit
        # Pushed once per stream (seed L4-4 s2: 上层一次性下发后固化); the composition root
        # builds a fresh filter for every stream, so "once" is once per stream.
        self._rules = FrozenConfig[data_pb2.FilterRules]("L4_FILTER", "filter rules", error=ConfigAlreadyPushed)
        self._banned = np.zeros(0, np.int64)  # token ids; banned bytes count as ids under "bytes"
        self._report = data_pb2.FilterReport()
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

    def on_samples_shuffled(self, msg: data_pb2.SamplesShuffled, docs: Documents) -> None:
        """Drop what breaks the rules; publish the tally, then the kept documents.

        Raises:
            InvalidConfig: banned bytes with a tokenizer other than bytes.
            RuntimeError: samples before rules (wiring fault).
        """
        if not self._rules.is_set:
            raise RuntimeError("filter: samples before FilterRules")
        rules = self._rules.get()
        if rules.banned_bytes and docs.tokenizer != "bytes":
            self._state = "interrupted"
            raise InvalidConfig(
                f"filter.banned_bytes: needs the bytes tokenizer, the dataset uses {docs.tokenizer} (use banned_tokens)"
            )
        self._state = "filtering"
        lengths = docs.lengths_n
        too_short = lengths < rules.min_tokens
        too_long = ~too_short & (lengths > rules.max_tokens) if rules.max_tokens else np.zeros_like(too_short)
        banned = ~too_short & ~too_long & self._has_banned(docs)
        keep = ~(too_short | too_long | banned)
        r = self._report
        r.kept += int(keep.sum())
        r.dropped_too_short += int(too_short.sum())
        r.dropped_too_long += int(too_long.sum())
        r.dropped_banned += int(banned.sum())
        self._emit(r)
        kept = docs.select(keep)
        self._emit(data_pb2.SamplesFiltered(count=len(kept)), kept)

    # ---- private ----------------------------------------------------------------------

    def _has_banned(self, docs: Documents) -> np.ndarray:
        """bool [n]: the document holds at least one banned id (prefix sums, no loop)."""
        if not len(self._banned) or not len(docs):
            return np.zeros(len(docs), dtype=bool)
        hits = np.isin(docs.tokens_T, self._banned)
        prefix = np.zeros(len(hits) + 1, dtype=np.int64)
        np.cumsum(hits, out=prefix[1:])
        return (prefix[docs.bounds_n1[1:]] - prefix[docs.bounds_n1[:-1]]) > 0
