"""Bounded look-ahead sorting and token-budget batching, checked over many random inputs."""
from __future__ import annotations

import random

import pytest

from batchgen.pipeline.batching import length_bucket, prompt_sort_key, sort_window


class Counted:
    """An iterator that records how many items were pulled from it."""

    def __init__(self, items):
        self.it = iter(items)
        self.pulled = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.it)
        self.pulled += 1
        return item


def random_lengths(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(i, rng.choice([0, 1, rng.randint(1, 50), rng.randint(1, 5000)])) for i in range(n)]


@pytest.mark.parametrize("seed", range(30))
def test_sort_window_permutation_bound_and_order(seed):
    rng = random.Random(seed)
    items = random_lengths(rng, rng.randint(0, 300))
    window = rng.randint(1, 64)
    src = Counted(items)
    out = []
    for item in sort_window(src, key=lambda x: x[1], window=window):
        assert src.pulled - len(out) <= window  # items read but not yet handed out
        out.append(item)
    assert sorted(out) == sorted(items)
    for start in range(0, len(items), window):
        chunk = out[start:start + window]
        assert sorted(chunk) == sorted(items[start:start + window])  # no item crosses its window
        assert chunk == sorted(chunk, key=lambda x: x[1], reverse=True)


def test_sort_window_is_stable_and_can_ascend():
    items = [("a", 2), ("b", 1), ("c", 2), ("d", 1)]
    assert [x for x, _ in sort_window(items, key=lambda x: x[1], window=4)] == ["a", "c", "b", "d"]
    assert [x for x, _ in sort_window(items, key=lambda x: x[1], window=4, descending=False)] == ["b", "d", "a", "c"]
    with pytest.raises(ValueError):
        list(sort_window(items, key=len, window=0))


def test_sort_window_is_lazy():
    def endless():
        n = 0
        while True:
            n += 1
            yield n

    gen = sort_window(endless(), key=lambda x: x, window=5)
    assert [next(gen) for _ in range(7)] == [5, 4, 3, 2, 1, 10, 9]


def test_prompt_sort_key_groups_shared_prefixes():
    system = [7, 7, 7, 7]
    prompts = [system + [i] * n for i, n in enumerate([100, 103, 98, 101])]
    other = [[5, 5, 5, 5] + [9] * n for n in (99, 102)]
    mixed = [prompts[0], other[0], prompts[1], other[1], prompts[2], prompts[3]]
    out = list(sort_window(mixed, key=lambda p: prompt_sort_key(p, prefix_tokens=4), window=10))
    prefixes = [tuple(p[:4]) for p in out]
    assert prefixes == sorted(prefixes, reverse=True)  # all in one bucket: each prefix group is contiguous
    assert length_bucket(200) > length_bucket(100) > length_bucket(1) == 0 == length_bucket(0)


def test_windows_hold_at_most_a_window_of_error_rows_and_keep_every_row():
    from batchgen.engine import SamplingParams
    from batchgen.pipeline.rows import Request, error_row
    from batchgen.pipeline.stages import windows

    items = [error_row(f"e{i}", {}, "invalid_input", "bad") for i in range(10)]
    items += [Request("a", {}, [1, 2], SamplingParams()), error_row("e10", {}, "invalid_input", "bad")]
    got = list(windows(items, 4, sort=True))
    assert all(len(w.errors) <= 4 and len(w.requests) <= 4 for w in got)
    assert sorted(r.row_id for w in got for r in w.errors) == sorted(f"e{i}" for i in range(11))
    assert [r.row_id for w in got for r in w.requests] == ["a"]
