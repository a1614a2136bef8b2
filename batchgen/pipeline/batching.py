"""Length bucketing: bounded look-ahead sorting, independent of the engine."""
from __future__ import annotations

import math
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")


def length_bucket(n: int, per_octave: int = 8) -> int:
    """Geometric bucket of a length: each doubling is split into ``per_octave`` buckets (~9% wide)."""
    return 0 if n <= 0 else int(math.log2(n) * per_octave)


def prompt_sort_key(ids: Sequence[int], prefix_tokens: int = 16) -> tuple[int, tuple[int, ...]]:
    """Sort key for a prompt: its length bucket, then its first tokens.

    Within a bucket, prompts sharing a prefix (same system prompt and instructions) end up adjacent, so they
    land in the same batches; bucketing rather than exact length keeps that grouping from being split by
    small length differences.
    """
    return length_bucket(len(ids)), tuple(ids[:prefix_tokens])


def sort_window(
    items: Iterable[T], key: Callable[[T], Any], window: int, descending: bool = True
) -> Iterator[T]:
    """Yields items in consecutive chunks of ``window``, each chunk stably sorted by ``key``.

    Descending (longest first) is the default: the most memory-hungry batches run first, so a budget that
    cannot fit fails at once rather than hours in, and the tail of each window is short prompts that pack
    densely and finish together instead of one long straggler. At most ``window`` items are held at once.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    it = iter(items)
    while chunk := list(islice(it, window)):
        chunk.sort(key=key, reverse=descending)  # list.sort stays stable with reverse=True
        yield from chunk
        del chunk  # drop it before reading the next window, or two windows would be held
