"""The prompts a benchmark sends, as `vllm bench` builds them: `random` (token ids drawn uniformly,
special tokens excluded, lengths in len * (1 +- range_ratio)) and `sharegpt` (a ShareGPT-format
JSON file's first turns, the replies' lengths as output lengths)."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path

import numpy as np

DATASETS = ("random", "sharegpt")


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions only: exact prompt lengths)
    prompt_len: int
    output_len: int


def load_tokenizer(path: str | Path):
    from jaxinfer.model.tokenizer import Tokenizer
    return Tokenizer.from_dir(str(path))


def _length(rng: np.random.Generator, n: int, range_ratio: float) -> int:
    lo, hi = max(1, int(n * (1 - range_ratio))), int(n * (1 + range_ratio))
    return int(rng.integers(lo, max(lo, hi) + 1))


def random_requests(tokenizer, n: int, input_len: int, output_len: int, range_ratio: float,
                    rng: np.random.Generator, as_text: bool) -> list[BenchRequest]:
    """`n` prompts of random token ids. `as_text`: decoded to text (chat messages), whose length
    is then what the tokenizer reads back."""
    special = set(tokenizer.eos_token_ids) | ({tokenizer.bos_token_id} - {None})
    vocab = np.array([t for t in range(tokenizer.vocab_size) if t not in special])
    out = []
    for _ in range(n):
        plen, olen = _length(rng, input_len, range_ratio), _length(rng, output_len, range_ratio)
        ids = rng.choice(vocab, size=plen).tolist()
        if as_text:
            text = tokenizer.decode(ids)
            out.append(BenchRequest(text, len(tokenizer.encode(text)), olen))
        else:
            out.append(BenchRequest(ids, plen, olen))
    return out


def sharegpt_requests(tokenizer, path: str, n: int, max_model_len: int, fixed_output_len: int | None,
                      rng: random.Random) -> list[BenchRequest]:
    """ShareGPT JSON: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}].
    The first turn is the prompt, the reply's length the output length; pairs that are too short or do
    not fit the context are skipped, as in vLLM."""
    data = json.loads(Path(path).read_text())
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    rng.shuffle(convs)
    out = []
    for conv in convs:
        prompt, reply = conv[0]["value"], conv[1]["value"]
        plen = len(tokenizer.encode(prompt))
        olen = fixed_output_len or len(tokenizer.encode(reply))
        if plen < 4 or olen < 4 or plen + olen > max_model_len:
            continue
        out.append(BenchRequest(prompt, plen, olen))
        if len(out) == n:
            break
    if len(out) < n:
        print(f"warning: only {len(out)} usable conversations in {path} (asked for {n})", file=sys.stderr)
    return out
