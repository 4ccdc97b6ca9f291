"""The data section: the dataset version (or mixture), packing, filters and read-ahead."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    model_validator,
)

from services.jobspec.base import MICRO_BATCH_TOKENS_MAX, U32_MAX, _Strict


class PrefetchSpec(_Strict):
    watermark: int = Field(256, gt=0, le=U32_MAX)  # documents read ahead
    threads: int = Field(2, gt=0, le=256)  # reader threads the data service starts


class FilterSpec(_Strict):
    min_tokens: int = Field(1, ge=0, le=U32_MAX)
    max_tokens: int = Field(0, ge=0, le=U32_MAX)  # 0: no upper bound
    banned_bytes: str = ""  # documents containing any of these characters are dropped
    banned_tokens: list[Annotated[int, Field(ge=0, le=U32_MAX)]] = []  # token ids (< model.vocab_size)


DATASET_PATTERN = r"^[A-Za-z0-9_.-]+@[A-Za-z0-9_.-]+$"  # name@version


class MixtureItem(_Strict):
    """One dataset of ``data.mixture`` and its weight (the weights are normalised)."""

    dataset: str = Field(..., pattern=DATASET_PATTERN)
    weight: float = Field(..., gt=0, allow_inf_nan=False)


class DataSpec(_Strict):
    """The training data: one ``dataset`` (name@version), or a weighted ``mixture`` of
    several, blended row by row (services/data/blend.py), each with its own position."""

    dataset: str | None = Field(None, pattern=DATASET_PATTERN)
    mixture: list[MixtureItem] | None = None
    seq_len: int = Field(256, gt=0, le=U32_MAX)
    micro_batch_size: int = Field(8, gt=0, le=U32_MAX)  # rows per rank per micro-step
    grad_accum: int = Field(1, gt=0, le=U32_MAX)  # micro-steps per optimizer step
    shuffle: bool = True
    shuffle_seed: int = Field(1234, ge=0)
    pack: Literal["pack", "pad"] = "pack"
    pad_id: int = Field(0, ge=0, le=U32_MAX)  # a token id (< model.vocab_size)
    prefetch: PrefetchSpec = PrefetchSpec()
    filter: FilterSpec = FilterSpec()

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if self.dataset is not None and self.mixture is not None:
            raise ValueError("dataset and mixture both given: one or the other")
        if self.dataset is None and self.mixture is None:
            raise ValueError("dataset (name@version) or mixture (a list of {dataset, weight}) is required")
        if self.mixture is not None and not self.mixture:
            raise ValueError("mixture: empty; list at least one {dataset: NAME@VERSION, weight: W}")
        return self

    @model_validator(mode="after")
    def _micro_batch_fits_a_message(self) -> DataSpec:
        tokens = self.seq_len * self.micro_batch_size
        if tokens > MICRO_BATCH_TOKENS_MAX:
            raise ValueError(
                f"seq_len x micro_batch_size: {self.seq_len} x {self.micro_batch_size} = {tokens} tokens per "
                f"micro-batch; the data service sends at most {MICRO_BATCH_TOKENS_MAX} in one message"
            )
        return self

    @property
    def datasets(self) -> list[tuple[str, str, float]]:
        """(name, version, weight) of each dataset read: the mixture's, or the one at weight 1."""
        items = self.mixture if self.mixture is not None else [MixtureItem(dataset=self.dataset, weight=1.0)]
        return [(*i.dataset.split("@", 1), i.weight) for i in items]

    @property
    def name(self) -> str:
        """The dataset's name (a mixture's first component's: its tokenizer and vocabulary
        stand for the mixture's, whose components are checked against the model alike)."""
        return self.datasets[0][0]

    @property
    def version(self) -> str:
        return self.datasets[0][1]

    @property
    def label(self) -> str:
        """``name@version``, or the mixture's ``name@version*weight`` joined by ``+``."""
        if self.mixture is None:
            return self.dataset
        return "+".join(f"{i.dataset}*{i.weight:g}" for i in self.mixture)
