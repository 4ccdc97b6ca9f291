"""A small evaluation command for `surgectl evaluate` (README, "Evaluation hooks"): the
perplexity of a text file under the Hugging Face export of a checkpoint, loaded with
``transformers``. The evaluation job runs it with SURGE_EVAL_HF_DIR (the export) and
SURGE_EVAL_OUTPUT (where the scores go) in its environment:

    surgectl evaluate demo --command "python examples/eval/perplexity.py /path/to/text.txt"

The text is tokenized with the export's ``tokenizer.json`` when it has one, else as UTF-8
bytes (a byte-level dataset); it is scored in windows of the model's context length.
Writes ``{"perplexity": ..., "loss": ..., "tokens": ...}`` (loss in nats per token)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def main(text_path: str) -> None:
    hf = Path(os.environ["SURGE_EVAL_HF_DIR"])
    text = Path(text_path).read_text(encoding="utf-8", errors="replace")
    if (hf / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(hf / "tokenizer.json")).encode(text).ids
    else:
        ids = list(text.encode("utf-8"))
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    window = int(model.config.max_position_embeddings)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, max(len(ids) - 1, 1), window):
            chunk = torch.tensor([ids[start : start + window + 1]])
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
            loss_sum, tokens = loss_sum + float(loss), tokens + chunk.shape[1] - 1
    mean = loss_sum / max(tokens, 1)
    scores = {"perplexity": math.exp(mean), "loss": mean, "tokens": tokens}
    Path(os.environ["SURGE_EVAL_OUTPUT"]).write_text(json.dumps(scores))
    print(json.dumps(scores))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: perplexity.py TEXT_FILE")
    main(sys.argv[1])
