"""Triton kernels against the torch path, run on CPU under the Triton interpreter."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from batchgen.engine.backends.triton import activation, decode_attention, kv_store, norm, rotary  # noqa: E402
from batchgen.engine.backends.triton.backend import TritonAttentionBackend  # noqa: E402
from batchgen.engine.backends.triton.common import INTERPRET  # noqa: E402
from batchgen.engine.backends.triton.prefill_attention import (  # noqa: E402
    prefill_attention, prefill_tile_capacity, prefill_work,
)
from batchgen.engine.backends.interface import AttentionMetadata  # noqa: E402
from batchgen.engine.backends.select import make_kernel_set  # noqa: E402
from batchgen.engine.backends.torch import ops  # noqa: E402
from batchgen.engine.backends.torch.attention import TorchAttentionBackend, causal_attention  # noqa: E402
from batchgen.engine.layers.attention import Attention  # noqa: E402
from tests.flash_attn import flash_attn_varlen_func  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
BLOCK_SIZE = 16
F32, BF16 = torch.float32, torch.bfloat16
ATOL = {F32: 2e-4, BF16: 3e-2}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


def rand(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def cu_lens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)


class PagedBatch:
    """Sequences with cached prefixes in a shuffled paged cache that is full of noise elsewhere."""

    def __init__(self, prefix_lens: list[int], query_lens: list[int], num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, spare_blocks: int = 3):
        ctx = [p + q for p, q in zip(prefix_lens, query_lens)]
        blocks_per_seq = [math.ceil(c / BLOCK_SIZE) for c in ctx]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        order = torch.randperm(num_blocks).tolist()
        width = max(blocks_per_seq)
        tables, slots = [], []
        for n, c, q in zip(blocks_per_seq, ctx, query_lens):
            blocks, order = order[:n], order[n:]
            tables.append(blocks + [-1] * (width - n))
            slots += [blocks[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(c - q, c)]
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.k_cache, self.v_cache = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
        self.meta = AttentionMetadata(
            cu_seqlens_q=cu_lens(query_lens), cu_seqlens_k=cu_lens(ctx),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
            max_seqlen_q=max(query_lens), max_seqlen_k=max(ctx),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
            query_lens=list(query_lens), context_lens_list=ctx)

    def run(self, backend, q, k, v, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        backend.store_kv(k, v, k_cache, v_cache, self.meta.slot_mapping)
        return backend.forward(q, k, v, k_cache, v_cache, self.meta, scale)


def check_paged(prefix_lens, query_lens, head_dim, group, dtype, num_kv_heads=1):
    batch = PagedBatch(prefix_lens, query_lens, num_kv_heads, head_dim, dtype)
    tokens = sum(query_lens)
    q = rand(tokens, num_kv_heads * group, head_dim, dtype=dtype)
    k = rand(tokens, num_kv_heads, head_dim, dtype=dtype)
    v = rand(tokens, num_kv_heads, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    close(batch.run(TritonAttentionBackend(), q, k, v, scale),
          batch.run(TorchAttentionBackend(), q, k, v, scale), dtype)


# --- KV store -------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim,dtype", [(64, F32), (128, BF16)])
def test_store_kv_scatters_and_skips_negative_slots(head_dim, dtype):
    tokens, kv_heads, num_blocks = 37, 3, 5
    # k and v as strided views into a fused projection, as the model produces them.
    qkv = rand(tokens, 7 * head_dim, dtype=dtype)
    k = qkv[:, head_dim:4 * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 4 * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:tokens]
    slots[::5] = -1
    k_cache = rand(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype)
    v_cache = rand(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    TorchAttentionBackend().store_kv(k[keep], v[keep], k_ref, v_ref, slots[keep])
    kv_store.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# --- prefill attention ----------------------------------------------------------------------

MIXED_LENS = [1, 17, 255, 1000]


@pytest.mark.parametrize("head_dim,group,dtype", [
    (64, 1, F32), (128, 3, BF16),
    pytest.param(64, 8, BF16, marks=pytest.mark.slow),
    pytest.param(128, 1, F32, marks=pytest.mark.slow),
])
def test_varlen_causal_matches_torch(head_dim, group, dtype):
    tokens, cu = sum(MIXED_LENS), cu_lens(MIXED_LENS)
    q = rand(tokens, group, head_dim, dtype=dtype)
    k, v = rand(tokens, 1, head_dim, dtype=dtype), rand(tokens, 1, head_dim, dtype=dtype)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(MIXED_LENS), max(MIXED_LENS))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        close(out[s:e], causal_attention(q[s:e], k[s:e], v[s:e], head_dim ** -0.5), dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_longer_keys_and_non_causal(causal):
    q_lens, k_lens, head_dim = [3, 70, 1], [3, 130, 20], 64
    q = rand(sum(q_lens), 4, head_dim)
    k, v = rand(sum(k_lens), 2, head_dim), rand(sum(k_lens), 2, head_dim)
    out = flash_attn_varlen_func(q, k, v, cu_lens(q_lens), cu_lens(k_lens), max(q_lens),
                                 max(k_lens), softmax_scale=0.1, causal=causal)
    qs, ks = 0, 0
    for ql, kl in zip(q_lens, k_lens):
        qi, ki, vi = q[qs:qs + ql], k[ks:ks + kl], v[ks:ks + kl]
        if causal:
            ref = causal_attention(qi, ki, vi, 0.1)
        else:
            ref = torch.nn.functional.scaled_dot_product_attention(
                qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1), scale=0.1,
                enable_gqa=True).transpose(0, 1)
        close(out[qs:qs + ql], ref, F32)
        qs, ks = qs + ql, ks + kl


@pytest.mark.parametrize("head_dim,group,dtype,kv_heads", [
    (64, 3, F32, 2), (128, 8, BF16, 1), (128, 1, BF16, 1), (64, 8, F32, 1),
])
def test_prefill_with_cached_prefix(head_dim, group, dtype, kv_heads):
    # Prefixes off and on block boundaries, a fresh sequence and single-token chunks mixed in.
    check_paged([5, 0, 16, 33, 100], [1, 17, 40, 255, 1], head_dim, group, dtype, kv_heads)


@pytest.mark.slow
def test_prefill_long_chunk_after_long_prefix():
    check_paged([250, 7], [1000, 64], 64, 3, BF16)


# --- decode attention -----------------------------------------------------------------------

DECODE_CTX = [1, 17, 255, 1000, 16, 33]


@pytest.mark.parametrize("head_dim,group,dtype,num_splits", [
    (64, 1, F32, 1), (64, 3, BF16, 4), (128, 8, BF16, None), (128, 3, F32, 16),
])
def test_decode_matches_torch(head_dim, group, dtype, num_splits):
    batch = PagedBatch([c - 1 for c in DECODE_CTX], [1] * len(DECODE_CTX), 2, head_dim, dtype)
    q = rand(len(DECODE_CTX), 2 * group, head_dim, dtype=dtype)
    k, v = rand(len(DECODE_CTX), 2, head_dim, dtype=dtype), rand(len(DECODE_CTX), 2, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    expected = batch.run(TorchAttentionBackend(), q, k, v, scale)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    kv_store.store_kv(k, v, k_cache, v_cache, batch.meta.slot_mapping)
    out = decode_attention.decode_attention(q, k_cache, v_cache, batch.meta.context_lens,
                                            batch.meta.block_tables, batch.meta.max_seqlen_k,
                                            scale, num_splits=num_splits)
    close(out, expected, dtype)


def test_decode_splits_are_sized_per_sequence(monkeypatch):
    """Under CUDA graphs the launch is planned for the model's limit (here 128K keys); a 1,000-key context
    must still spread over ceil(1000 / 256) splits, not fill one split sized for 128K keys."""
    written = {}

    def nan_buffers(out, num_splits, slots):
        part_out, part_lse, *strides = real_split_buffers(out, num_splits, slots)
        written["lse"] = part_lse.fill_(float("nan"))
        return (part_out, part_lse, *strides)

    real_split_buffers = decode_attention.split_buffers
    monkeypatch.setattr(decode_attention, "split_buffers", nan_buffers)
    ctx = [1000]
    batch = PagedBatch([c - 1 for c in ctx], [1], 2, 64, F32)
    q, k, v = rand(1, 4, 64), rand(1, 2, 64), rand(1, 2, 64)
    expected = batch.run(TorchAttentionBackend(), q, k, v, 0.125)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    kv_store.store_kv(k, v, k_cache, v_cache, batch.meta.slot_mapping)
    out = decode_attention.decode_attention(q, k_cache, v_cache, batch.meta.context_lens, batch.meta.block_tables,
                                            128 * 1024, 0.125)
    close(out, expected, F32)
    active = (~written["lse"][0].isnan()).sum(-1)  # per head: the splits that held keys
    assert active.tolist() == [math.ceil(1000 / 256)] * 4


def test_mixed_step_runs_its_decode_rows_in_the_decode_kernel():
    # Two prefill chunks and three decodes (one of them the final 1-token chunk of a prompt).
    prefix_lens, query_lens = [40, 0, 300, 16, 2], [1, 60, 1, 33, 1]
    batch = PagedBatch(prefix_lens, query_lens, 2, 64, F32)
    q, k, v = rand(sum(query_lens), 6, 64), rand(sum(query_lens), 2, 64), rand(sum(query_lens), 2, 64)
    expected = batch.run(TorchAttentionBackend(), q, k, v, 0.125)
    close(batch.run(TritonAttentionBackend(), q, k, v, 0.125), expected, F32)
    assert batch.meta.decode_rows.tolist() == [[0, 0], [2, 61], [4, 95]]
    assert sorted(seq for seq, _ in batch.meta.prefill_work.tolist()) == [1, 3]
    # As a CUDA graph runs it: padded tile and slot lists, the launch planned for the model's limit.
    batch.meta.max_seqlen_k = 32 * 1024
    batch.meta.prefill_work = prefill_work(query_lens, batch.meta.context_lens_list, skip_decodes=True,
                                           capacity=prefill_tile_capacity(128, 8)).to(DEVICE)
    batch.meta.decode_rows = decode_attention.decode_rows(query_lens, capacity=8).to(DEVICE)
    close(batch.run(TritonAttentionBackend(), q, k, v, 0.125), expected, F32)


def test_prefill_work_lists_tiles_longest_first_and_pads():
    # Sequence 1 (300 new tokens after a 100-token prefix) has three tiles of 128 rows.
    work = prefill_work([5, 300, 0], [5, 400, 0]).tolist()
    assert work == [[1, 256], [1, 128], [1, 0], [0, 0]]
    capacity = prefill_tile_capacity(305, 3)
    padded = prefill_work([5, 300, 0], [5, 400, 0], capacity=capacity).tolist()
    assert padded[:4] == work and padded[4:] == [[-1, 0]] * (capacity - 4)
    with pytest.raises(ValueError, match="do not fit"):
        prefill_work([300], [300], capacity=2)


def test_prefill_skips_padding_tiles_and_empty_sequences():
    q_lens = [17, 0, 40]
    q, k, v = rand(57, 4, 64), rand(57, 2, 64), rand(57, 2, 64)
    cu = cu_lens(q_lens)
    expected = flash_attn_varlen_func(q, k, v, cu, cu, 40, 40)
    work = prefill_work(q_lens, q_lens, capacity=prefill_tile_capacity(64, 6)).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k, v, cu, cu, work, 64 ** -0.5, out=out)
    close(out, expected, torch.float32)


def test_decode_split_heuristic_bounds():
    cpu = torch.device("cpu")
    assert decode_attention.num_decode_splits(256, 8, 100, cpu) == 1
    assert decode_attention.num_decode_splits(1, 1, 8192, cpu) == 32
    assert 1 < decode_attention.num_decode_splits(4, 2, 4096, cpu) <= 16


# --- elementwise ops ------------------------------------------------------------------------

@pytest.mark.parametrize("hidden", [576, 128])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(hidden, dtype, with_residual):
    x, weight = rand(2, 7, hidden, dtype=dtype), 1 + 0.1 * rand(hidden, dtype=dtype)
    residual = rand(2, 7, hidden, dtype=dtype) if with_residual else None
    out, new_res = norm.rms_norm(x, weight, 1e-5, residual)
    ref, ref_res = ops.rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    close(out, ref, dtype)
    if with_residual:
        # The interpreter truncates fp32 -> bf16 where the GPU rounds, so bf16 is one ulp off there.
        close(new_res, ref_res, dtype) if dtype == BF16 else torch.testing.assert_close(new_res, ref_res)
    else:
        assert new_res is None


def llama3_cos_sin_cache(head_dim: int, max_pos: int, base: float = 500000.0) -> torch.Tensor:
    """[cos | sin] rows with Llama-3 frequency scaling (factor 8, original context 8192)."""
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float().to(DEVICE)


@pytest.mark.parametrize("head_dim,dtype", [(64, BF16), (128, F32)])
def test_rotary_in_place_with_llama3_cache(head_dim, dtype):
    tokens, q_heads, kv_heads = 11, 9, 3
    cache = llama3_cos_sin_cache(head_dim, 20000)
    positions = torch.randint(0, 20000, (tokens,), device=DEVICE)
    qkv = rand(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (q_heads + kv_heads) * head_dim:].clone()
    # The reference rotates in fp32: the kernel also computes in fp32 and rounds once.
    q_ref, k_ref = ops.apply_rotary(q.float(), k.float(), positions, cache)
    q_out, k_out = rotary.apply_rotary(q, k, positions, cache)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    tol = {F32: 1e-5, BF16: 1e-2}[dtype]
    torch.testing.assert_close(q.float(), q_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k.float(), k_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim:], v_before)


@pytest.mark.parametrize("shape", [(5, 2 * 1536), (2, 3, 2 * 100)])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_gated_activations(shape, dtype, name):
    x = 3 * rand(*shape, dtype=dtype)
    out = getattr(activation, name)(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    expected = getattr(ops, name)(x)
    if dtype == F32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        close(out, expected, dtype)


# --- the kernel set through the attention layer ---------------------------------------------

def test_triton_kernel_set_runs_chunked_prefill_then_decode():
    kernels = make_kernel_set("triton")
    assert isinstance(kernels.attention, TritonAttentionBackend)
    assert kernels.rms_norm is norm.rms_norm and kernels.apply_rotary is rotary.apply_rotary
    assert kernels.silu_and_mul is activation.silu_and_mul
    assert kernels.gelu_tanh_and_mul is activation.gelu_tanh_and_mul
    heads, kv_heads, head_dim, num_blocks = 4, 2, 64, 8
    layers = {name: Attention(heads, kv_heads, head_dim, backend)
              for name, backend in (("triton", kernels.attention), ("torch", TorchAttentionBackend()))}
    for layer in layers.values():
        layer.k_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=DEVICE)
        layer.v_cache = torch.zeros_like(layer.k_cache)
    table = torch.tensor([[3, 0, 6, -1], [5, 1, -1, -1]], dtype=torch.int32, device=DEVICE)
    done = [0, 0]
    # Two prefill chunks (the second reads a prefix of 20 / 9 tokens), then two decode steps.
    for chunk in ([20, 9], [13, 5], [1, 1], [1, 1]):
        ctx = [d + c for d, c in zip(done, chunk)]
        slots = [table[i, t // BLOCK_SIZE].item() * BLOCK_SIZE + t % BLOCK_SIZE
                 for i in range(2) for t in range(done[i], ctx[i])]
        meta = AttentionMetadata(
            cu_seqlens_q=cu_lens(chunk), cu_seqlens_k=cu_lens(ctx),
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
            max_seqlen_q=max(chunk), max_seqlen_k=max(ctx),
            slot_mapping=torch.tensor(slots, device=DEVICE), block_tables=table,
            query_lens=chunk, context_lens_list=ctx)
        q, k, v = rand(sum(chunk), heads, head_dim), rand(sum(chunk), kv_heads, head_dim), \
            rand(sum(chunk), kv_heads, head_dim)
        close(layers["triton"](q, k, v, meta), layers["torch"](q, k, v, meta), F32)
        done = ctx
    assert torch.equal(layers["triton"].k_cache, layers["torch"].k_cache)


def spelled_out_acceptance(sampled: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Each row's kept tokens: the tokens sampled at its positions while its drafts equal them, then one more."""
    kept, at = [], 0
    for d in drafts:
        row = sampled[at:at + len(d) + 1]
        n = 0
        while n < len(d) and d[n] == row[n]:
            n += 1
        kept.append(row[:n + 1])
        at += len(d) + 1
    return kept


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_accept_drafts_kernel_matches_the_rule(with_logprobs):
    from batchgen.engine.backends.triton.accept import accept_drafts
    from batchgen.engine.speculative.verify import accept

    gen = torch.Generator().manual_seed(3)
    lens = [0, 1, 4, 4, 2, 7, 3, 4]
    drafts, sampled = [], []
    for i, n in enumerate(lens):
        row = torch.randint(0, 5, (n + 1,), generator=gen).tolist()  # a small vocabulary: drafts often match
        draft = row[:n] if i % 3 == 0 else torch.randint(0, 5, (n,), generator=gen).tolist()
        drafts.append(draft)
        sampled += row
    tokens = torch.tensor(sampled, device=DEVICE)
    logprobs = -torch.rand(len(sampled), generator=gen).to(DEVICE) if with_logprobs else None
    want = spelled_out_acceptance(sampled, drafts)
    assert len(want) == len(lens) and any(len(w) > 1 for w in want) and any(len(w) == 1 for w in want)
    for kernel in (ops.accept_drafts, accept_drafts):
        got, got_logprobs = accept(tokens, logprobs, drafts, kernel).to_lists()
        assert got == want
        if with_logprobs:
            starts = [sum(n + 1 for n in lens[:i]) for i in range(len(lens))]
            assert got_logprobs == [logprobs[s:s + len(w)].tolist() for s, w in zip(starts, want, strict=True)]
        else:
            assert got_logprobs is None


def test_accept_sampled_drafts_kernel_matches_the_torch_rejection_sampling():
    """Rows of 0..4 drafts, sampled (some with q == p and rejected anyway: the residual is all zero) or
    deterministic, over a vocabulary of several kernel blocks: the same tokens and counts as ``ops.reject_drafts``."""
    from batchgen.engine.backends.triton.rejection import reject_drafts

    gen = torch.Generator().manual_seed(5)
    vocab, lens = 2500, [0, 1, 4, 4, 2, 3, 4, 1, 4, 2, 3, 4]
    starts = torch.tensor([sum(n + 1 for n in lens[:i]) for i in range(len(lens))])
    positions = sum(n + 1 for n in lens)
    probs = (torch.randn(positions, vocab, generator=gen) * 3).softmax(-1)
    sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
    q_starts, q_rows, drafts = [], [], torch.full((len(lens), 4), -1)
    for r, n in enumerate(lens):
        rows = probs[starts[r]:starts[r] + n]
        if r % 4 == 3:  # deterministic: the sampled tokens, then one that is not
            q_starts.append(-1)
            drafts[r, :n] = sampled[starts[r]:starts[r] + n]
            drafts[r, n - 1:n] = (drafts[r, n - 1:n] + 1) % vocab
            continue
        q = rows.clone() if r % 4 == 2 else (torch.randn(n, vocab, generator=gen) * 3).softmax(-1)
        q_starts.append(sum(len(x) for x in q_rows))
        q_rows.append(q)
        if n:
            drafts[r, :n] = torch.multinomial(q, 1, generator=gen)[:, 0]
    uniforms = torch.rand(positions, generator=gen)
    for r in range(2, len(lens), 4):  # u = 1 rejects even q == p: the guard for a residual rounded to zero
        uniforms[starts[r]:starts[r] + lens[r]] = 1.0
    inputs = [sampled, probs, torch.cat(q_rows), torch.tensor(q_starts), uniforms,
              torch.randint(0, 2 ** 62, (positions,), generator=gen), torch.arange(positions) % 7, starts,
              torch.tensor(lens), drafts]
    want_tokens, want_counts = ops.reject_drafts(*inputs)
    got_tokens, got_counts = reject_drafts(*[x.to(DEVICE) for x in inputs])
    assert got_counts.tolist() == want_counts.tolist()
    counts = want_counts.tolist()
    assert any(c - 1 < n and q >= 0 for c, n, q in zip(counts, lens, q_starts)) and any(c > 2 for c in counts)
    for got, want, c in zip(got_tokens.tolist(), want_tokens.tolist(), want_counts.tolist(), strict=True):
        assert got[:c] == want[:c]


@pytest.mark.parametrize("hidden", [64, 576])
def test_row_wise_kernels_give_a_row_the_same_bits_in_any_batch(hidden):
    """Narrow rows share a program; a row's result must not depend on which rows share it."""
    x, weight = rand(19, hidden, dtype=F32), 1 + 0.1 * rand(hidden, dtype=F32)
    gate_up = rand(19, 2 * hidden, dtype=F32)
    whole, _ = norm.rms_norm(x, weight, 1e-5)
    active = activation.silu_and_mul(gate_up)
    for rows in (slice(3, 4), slice(5, 17)):
        assert torch.equal(norm.rms_norm(x[rows], weight, 1e-5)[0], whole[rows])
        assert torch.equal(activation.silu_and_mul(gate_up[rows]), active[rows])
