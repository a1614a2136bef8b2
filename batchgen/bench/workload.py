"""Benchmark prompts: synthetic lengths (fixed or uniform) or a real file's documents, optional shared prefix."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    prompts: list[list[int]]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


def parse_length(spec: str) -> tuple[int, int]:
    """"1024" -> (1024, 1024); "100:2000" -> (100, 2000)."""
    lo, _, hi = spec.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise ValueError(f"bad length {spec!r}: expected N or LOW:HIGH with 1 <= LOW <= HIGH")
    return low, high


def synthetic(num_prompts: int, length: str, vocab_size: int, seed: int = 0,
              prefix_len: int = 0) -> Workload:
    """Random token prompts with lengths drawn uniformly from ``length``, after a shared prefix."""
    rng = random.Random(seed)
    low, high = parse_length(length)
    prefix = [rng.randrange(100, vocab_size) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(100, vocab_size) for _ in range(rng.randint(low, high))]
               for _ in range(num_prompts)]
    return Workload(prompts)


def from_documents(texts: list[str], tokenizer, num_prompts: int, length: str | None, seed: int = 0,
                   prefix_len: int = 0) -> Workload:
    """Prompts cut from real documents (cycled and concatenated as needed).

    Without ``length`` each prompt is one whole document; with it, lengths are drawn log-uniformly from
    the range, which skews them short like real document collections.
    """
    rng = random.Random(seed)
    stream = [t for text in texts for t in tokenizer.encode(text)]
    if not stream:
        raise ValueError("the document file has no text")
    prefix = stream[:prefix_len]
    prompts = []
    for i in range(num_prompts):
        if length is None:
            body = tokenizer.encode(texts[i % len(texts)])
        else:
            low, high = parse_length(length)
            n = int(round(low * (high / low) ** rng.random()))
            start = rng.randrange(len(stream))
            body = (stream[start:] + stream * (n // len(stream) + 1))[:n]
        prompts.append(prefix + body)
    return Workload(prompts)
