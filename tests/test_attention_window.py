"""Sliding windows and soft-capped scores on both attention backends, against a float64 reference.

The Triton kernels run under the interpreter. Cache blocks wholly before a sequence's window are
overwritten with large values, as if freed and reused by another sequence: a backend that lets one
into its softmax returns something else.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from batchgen.engine.backends.torch.attention import TorchAttentionBackend, causal_attention  # noqa: E402
from batchgen.engine.backends.triton import decode_attention, kv_store  # noqa: E402
from batchgen.engine.backends.triton.backend import TritonAttentionBackend  # noqa: E402
from tests.flash_attn import flash_attn_varlen_func  # noqa: E402
from tests.test_kernels import BF16, BLOCK_SIZE, F32, PagedBatch, close, cu_lens, rand  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], query_lens: list[int],
              scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Each sequence's queries over its whole keys in float64: capped scores, a mask built from positions."""
    outs = []
    group = q.shape[1] // keys[0].shape[1]
    start = 0
    for k, v, q_len in zip(keys, values, query_lens):
        ctx = k.shape[0]
        kk, vv = (x.double().repeat_interleave(group, dim=1) for x in (k, v))  # (L, Hq, D)
        scores = torch.einsum("qhd,lhd->hql", q[start:start + q_len].double(), kk) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(ctx - q_len, ctx)[:, None]
        key_pos = torch.arange(ctx)[None, :]
        visible = (key_pos <= query_pos) & (key_pos > query_pos - (window or ctx))
        outs.append(torch.einsum("hql,lhd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vv))
        start += q_len
    return torch.cat(outs)


class WindowedBatch(PagedBatch):
    """A paged batch after the new K/V are stored, with the blocks no query's window reaches poisoned."""

    def __init__(self, prefix_lens, query_lens, num_kv_heads, head_dim, dtype, window):
        super().__init__(prefix_lens, query_lens, num_kv_heads, head_dim, dtype)
        self.window, self.query_lens = window, query_lens
        self.ctx = [p + n for p, n in zip(prefix_lens, query_lens)]

    def store(self, k, v) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Stores k/v, returns each sequence's whole keys and values, then poisons the unreachable blocks."""
        kv_store.store_kv(k, v, self.k_cache, self.v_cache, self.meta.slot_mapping)
        keys, values = [], []
        for i, ctx in enumerate(self.ctx):
            blocks = self.meta.block_tables[i, : -(-ctx // BLOCK_SIZE)].long()
            keys.append(self.k_cache[blocks].flatten(0, 1)[:ctx].clone())
            values.append(self.v_cache[blocks].flatten(0, 1)[:ctx].clone())
            if self.window is not None:
                first_needed = max(0, ctx - self.query_lens[i] - self.window + 1)
                for b in blocks[: first_needed // BLOCK_SIZE]:
                    self.k_cache[b] = 30.0
                    self.v_cache[b] = -50.0
        return keys, values

    def run(self, backend, q, k, v, scale, softcap=None):
        return backend.forward(q, k, v, self.k_cache, self.v_cache, self.meta, scale,
                               sliding_window=self.window, softcap=softcap)


# Prefix lengths and new tokens per sequence (prefill chunks, decodes mixed in), window, soft cap.
LONG = ([0, 40, 100, 7, 64], [70, 1, 30, 1, 200])
SHORT = ([33, 0, 200], [1, 150, 1])
CASES = [(*LONG, 24, None), (*LONG, None, 2.5), (*SHORT, 50, 4.0), (*SHORT, 1, None)]


@pytest.mark.parametrize("prefixes,queries,window,softcap", CASES)
@pytest.mark.parametrize("backend", [TorchAttentionBackend(), TritonAttentionBackend()], ids=["torch", "triton"])
def test_prefill_and_mixed_steps_match_float64(prefixes, queries, window, softcap, backend):
    heads, kv_heads, head_dim = 6, 2, 32
    batch = WindowedBatch(prefixes, queries, kv_heads, head_dim, F32, window)
    q, k, v = rand(sum(queries), heads, head_dim), rand(sum(queries), kv_heads, head_dim), \
        rand(sum(queries), kv_heads, head_dim)
    keys, values = batch.store(k, v)
    out = batch.run(backend, q, k, v, 0.3, softcap)
    close(out, reference(q, keys, values, queries, 0.3, window, softcap), F32)


@pytest.mark.parametrize("window,softcap,dtype", [(20, None, F32), (100, 3.0, BF16), (None, 1.5, F32)])
@pytest.mark.parametrize("backend", [TorchAttentionBackend(), TritonAttentionBackend()], ids=["torch", "triton"])
def test_decode_matches_float64(window, softcap, dtype, backend):
    ctx = [1, 17, 255, 700, 16, 33]
    heads, kv_heads, head_dim = 8, 2, 64
    batch = WindowedBatch([c - 1 for c in ctx], [1] * len(ctx), kv_heads, head_dim, dtype, window)
    q = rand(len(ctx), heads, head_dim, dtype=dtype)
    k, v = rand(len(ctx), kv_heads, head_dim, dtype=dtype), rand(len(ctx), kv_heads, head_dim, dtype=dtype)
    keys, values = batch.store(k, v)
    assert batch.meta.decode_only
    out = batch.run(backend, q, k, v, head_dim ** -0.5, softcap)
    close(out, reference(q, keys, values, [1] * len(ctx), head_dim ** -0.5, window, softcap), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_decode_splits_cover_only_the_window(num_splits):
    ctx, window = [300, 1000, 40], 130
    batch = WindowedBatch([c - 1 for c in ctx], [1, 1, 1], 1, 64, F32, window)
    q, k, v = rand(3, 4, 64), rand(3, 1, 64), rand(3, 1, 64)
    keys, values = batch.store(k, v)
    out = decode_attention.decode_attention(q, batch.k_cache, batch.v_cache, batch.meta.context_lens,
                                            batch.meta.block_tables, max(ctx), 0.125, num_splits=num_splits,
                                            sliding_window=window)
    close(out, reference(q, keys, values, [1, 1, 1], 0.125, window, None), F32)


def test_varlen_window_and_softcap_in_flash_attn_convention():
    lens = [5, 300, 129]
    q, k, v = rand(sum(lens), 4, 64), rand(sum(lens), 2, 64), rand(sum(lens), 2, 64)
    cu = cu_lens(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, softmax_scale=0.2, window_size=(63, 0), softcap=3.0)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expected = reference(q[s:e], [k[s:e]], [v[s:e]], [e - s], 0.2, 64, 3.0)
        close(out[s:e], expected, F32)
        close(causal_attention(q[s:e], k[s:e], v[s:e], 0.2, sliding_window=64, softcap=3.0), expected, F32)
