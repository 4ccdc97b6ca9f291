"""L4-3 shuffler (数据混洗器): changes the order of documents, nothing else.

It holds the split's catalog (``Catalog``: document bounds and the read handle, handed on
by the prefetcher; no token) and, on each ``ShufflePlan`` from L2-1, hands on that epoch's
order: :func:`epoch_order`, a pure function of ``(seed, epoch)``, as a reference
(``EpochOrder``) computed when first needed (the sample index of an epoch already built
does not need it). The shuffler never picks a seed, never advances the epoch by itself (the
next epoch is a new plan from L2-1), and never reads training state. A round's seed and
scope are fixed once issued (seed L4-3 s2: 本轮随机种子, 上层下发后本地固化): a plan that
names an epoch already planned with other settings, or arrives while a round is being handed
on, is refused (``ConfigAlreadyPushed``); a new epoch may bring a new plan (本轮混洗启动指令).

No sharding: every stream's order is the whole (global) epoch order, whatever the job's
data-parallel size; the batch packer cuts the epoch's rows, orders them (its own
``row_order``, on a stream of the same seed) and deals them to the ranks
(``PackerConfig.rank``). So the data position is one global cursor (epoch, row), and a job
resumes at another dp on the same global sample sequence. A resume is a row of the epoch
(the packer skips rows): ``start_document`` must be 0.

Commands it takes: ``shuffle_plan`` (L2-1), ``on_samples_read`` (data from L4-2). It
publishes ``SamplesShuffled`` (payload :class:`EpochOrder`, to the filter), one per plan.
"""

from __future__ import annotations

import numpy as np

from services.contract import data_pb2
from services.contract.bus import Emitter
from services.data.documents import Catalog, EpochOrder
from services.data.errors import ConfigAlreadyPushed, InvalidConfig
from services.data.permutation import argsort_keys


def epoch_order(seed: int, epoch: int, num_documents: int, enabled: bool = True) -> np.ndarray:
    """The document order of one epoch: int64 [num_documents], a permutation of
    ``range(num_documents)`` (storage order when not ``enabled``).

    Pure function of its arguments, and stable across NumPy releases: it sorts the raw
    64-bit outputs of PCG64 seeded by ``SeedSequence([seed, epoch])``, both of which NumPy
    keeps stream-compatible (NEP 19), whereas ``Generator.permutation``'s algorithm may change.
    (The stable argsort of those outputs, computed faster: ``permutation.py``.)
    """
    if not enabled:
        return np.arange(num_documents, dtype=np.int64)
    keys = np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])).random_raw(num_documents)
    return argsort_keys(keys)


class Shuffler:
    """Holds the split's catalog; hands on one epoch's order per plan."""

    def __init__(self, emit: Emitter):
        self._emit = emit
        self._catalog: Catalog | None = None
        # Each round's settings as issued: epoch -> (seed, enabled).
        self._rounds: dict[int, tuple[int, bool]] = {}
        # "idle" | "holding" (catalog received) | "shuffling" (an order being handed on) |
        # "done" (a plan's order handed on) | "aborted"
        self._state = "idle"

    # ---- commands -------------------------------------------------------------------

    def on_samples_read(self, msg: data_pb2.SamplesRead, catalog: Catalog) -> None:
        """Hold the split's catalog (once per stream)."""
        if self._catalog is not None:
            raise RuntimeError("shuffler: samples read after the split was complete")
        self._catalog = catalog
        self._state = "holding"

    def shuffle_plan(self, msg: data_pb2.ShufflePlan, payload: object = None) -> None:
        """Hand on the order of epoch ``msg.epoch``, then return.

        Raises:
            ConfigAlreadyPushed: a round is being handed on, or ``msg.epoch`` was already
                planned with another seed or scope (a round's seed never changes).
            InvalidConfig: ``start_document`` is not 0 (a resume is a row, see above).
            RuntimeError: the split's catalog has not arrived (wiring fault).
        """
        if self._state == "shuffling":
            raise ConfigAlreadyPushed(
                f"L4_SHUFFLER: a plan for epoch {msg.epoch} arrived while a round is being emitted; "
                "a round's seed and scope are fixed until it ends"
            )
        settings = (msg.seed, msg.enabled)
        issued = self._rounds.get(msg.epoch)
        if issued is not None and issued != settings:
            raise ConfigAlreadyPushed(
                f"L4_SHUFFLER: epoch {msg.epoch} was planned with seed {issued[0]}, enabled {issued[1]}; "
                "a round's seed and scope never change"
            )
        if msg.start_document:
            raise InvalidConfig(
                f"shuffle.start_document: {msg.start_document}: a stream resumes at a row (DataPosition.row), "
                "the order is always the whole epoch's"
            )
        if self._catalog is None:
            raise RuntimeError("shuffler: shuffle plan before the split was read")
        self._rounds[msg.epoch] = settings
        n = len(self._catalog)
        order = EpochOrder(
            self._catalog,
            msg.epoch,
            msg.seed,
            msg.enabled,
            lambda: epoch_order(msg.seed, msg.epoch, n, msg.enabled),
            # The same plan's next epoch (a repeating stream's next plan): its index is built ahead.
            lambda: epoch_order(msg.seed, msg.epoch + 1, n, msg.enabled),
        )
        self._state = "shuffling"
        try:
            self._emit(data_pb2.SamplesShuffled(count=n), order)
        except BaseException:
            self._state = "aborted"  # a receiver failed; the stream ends with its error
            raise
        self._state = "done"
