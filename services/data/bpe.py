"""A byte-level BPE tokenizer trained on a dataset's own text, for ``dataset prepare
--tokenizer bpe:N``.

Byte-level BPE (GPT-2's, Radford et al. 2019; Sennrich et al. 2016's merges over bytes):
the text is split by GPT-2's pre-tokenizer regex, each piece is mapped to bytes, and the
256 byte symbols are the initial alphabet, so every input (any language, any byte) encodes
and decodes back unchanged; merges are learned up to ``vocab_size`` tokens (fewer when the
text has no more pairs seen at least twice). One special token, ``<|endoftext|>`` (GPT-2's),
is id 0: the separator the packer puts after every document (``data.pack: pack`` packs with
separator id 0, which for the bytes tokenizer is the NUL byte); decoding skips it.

Trained with the Hugging Face ``tokenizers`` library (its JSON is what ``prepare``,
``generate`` and an exported model read). Training is deterministic: the same texts give
the same file, so re-preparing identical content is still a no-op.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sized

from services.data.errors import InvalidConfig

END_OF_TEXT = "<|endoftext|>"
# <|endoftext|>, the 256 byte symbols and at least one merge; at most 2**20 tokens (a
# vocabulary the u32 token files hold, and a trainer that finishes).
MIN_VOCAB = 258
MAX_VOCAB = 1 << 20
_SPEC = re.compile(r"^bpe:(\d+)$")


def bpe_vocab_size(spec: str) -> int | None:
    """The vocabulary size of a ``bpe:N`` tokenizer spec; None for any other spec.

    Raises:
        InvalidConfig: ``bpe:N`` with N out of [MIN_VOCAB, MAX_VOCAB] (one line naming it).
    """
    if not spec.startswith("bpe:"):
        return None
    if problem := bpe_problem(spec):
        raise InvalidConfig(f"prepare: tokenizer {spec}: {problem}")
    return int(_SPEC.match(spec).group(1))


def bpe_problem(spec: str) -> str:
    """What is wrong with a ``bpe:N`` tokenizer spec ("" when nothing, or when it is not one):
    the one rule, said by `surgectl dataset prepare --tokenizer` before anything is read."""
    if not spec.startswith("bpe:"):
        return ""
    m = _SPEC.match(spec)
    n = int(m.group(1)) if m else -1
    if not MIN_VOCAB <= n <= MAX_VOCAB:
        return (
            f"bpe:N needs a vocabulary size N from {MIN_VOCAB} "
            f"(<|endoftext|>, 256 bytes and 1 merge) to {MAX_VOCAB}, e.g. bpe:4096"
        )
    return ""


def train_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens trained on ``texts`` (a
    sequence, or an iterable streamed once: ``prepare`` streams a corpus); its ``tokenizers``
    JSON (``Tokenizer.from_str`` reads it back)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[END_OF_TEXT],  # id 0
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if isinstance(texts, Sized) else None)
    return tok.to_str()
