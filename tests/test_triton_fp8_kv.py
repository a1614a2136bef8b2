"""The Triton kernels over fp8 KV caches (e4m3, e5m2), and bf16 under fp32, against the torch backend, on the same
caches."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from batchgen.engine import LLM, SamplingParams  # noqa: E402
from batchgen.engine.backends.interface import AttentionMetadata  # noqa: E402
from batchgen.engine.backends.torch.attention import TorchAttentionBackend, paged_decode  # noqa: E402
from batchgen.engine.backends.torch.mla import TorchMLABackend  # noqa: E402
from batchgen.engine.backends.triton.backend import TritonAttentionBackend  # noqa: E402
from batchgen.engine.backends.triton.common import INTERPRET  # noqa: E402
from batchgen.engine.backends.triton.decode_attention import decode_attention  # noqa: E402
from batchgen.engine.backends.triton.kv_store import store_kv  # noqa: E402
from batchgen.engine.backends.triton.mla import mla_decode, store_latent  # noqa: E402
from batchgen.engine.dtype import to_cache_dtype  # noqa: E402
from batchgen.engine.layers.attention import Attention  # noqa: E402
from tests.engine_helpers import mixed_prompts, model_runner  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
BLOCK = 16
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Past e4m3's largest value (448), past e5m2's (57344), and below the smallest normal of either.
EDGE_VALUES = [500.0, -1e5, 6e4, 464.0, 100.0, -0.3, 1e-3, -3e-3, 2e-5, 1e-7, 0.0]


def rand(gen: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * std).to(DEVICE)


def fp8_noise(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A cache of random bytes (NaN patterns included): what a store must leave alone where it does not write."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype).to(DEVICE)


def fp8_cache(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return to_cache_dtype(rand(gen, *shape, std=2.0), dtype)


def shuffled_tables(gen: torch.Generator, num_seqs: int, width: int, num_blocks: int) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=gen)[:num_seqs * width].view(num_seqs, width).to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("dtype", FP8)
def test_stores_write_the_bytes_of_to_cache_dtype(dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, kv_heads, head_dim, num_blocks, width = 11, 2, 16, 3, 40
    # k, v and latent rows as strided views of one projection, magnitudes from 1e-7 to 1e5.
    values = torch.randn(tokens, 2 * kv_heads * head_dim, generator=gen)
    values *= 10 ** (torch.rand(values.shape, generator=gen) * 12 - 7)
    values[0, :len(EDGE_VALUES)] = values[1, -len(EDGE_VALUES):] = torch.tensor(EDGE_VALUES)
    values = values.to(DEVICE)
    k = values[:, :kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = values[:, kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    latent = values[:, 5:5 + width]
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens].to(DEVICE)
    slots[2::4] = -1
    keep = slots >= 0

    def expected(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        flat = cache.clone().view(torch.uint8).view(-1, *rows.shape[1:])
        flat[slots[keep]] = to_cache_dtype(rows[keep], dtype).view(torch.uint8)
        return flat.view(cache.shape)

    k_cache, v_cache = (fp8_noise(gen, (num_blocks, BLOCK, kv_heads, head_dim), dtype) for _ in range(2))
    latent_cache = fp8_noise(gen, (num_blocks, BLOCK, width), dtype)
    want = expected(k_cache, k), expected(v_cache, v), expected(latent_cache, latent)
    store_kv(k, v, k_cache, v_cache, slots)
    store_latent(latent, latent_cache, slots)
    for cache, bytes_ in zip((k_cache, v_cache, latent_cache), want):
        assert cache.dtype == dtype and torch.equal(cache.view(torch.uint8), bytes_)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("group,window,num_splits", [(1, None, 1), (3, 50, 4), (2, None, None)])
def test_decode_over_fp8_cache_matches_torch(dtype, group, window, num_splits):
    gen = torch.Generator().manual_seed(1)
    kv_heads, head_dim, width = 2, 32, 19  # 19 blocks hold the longest context
    ctx = torch.tensor([1, 17, 130, 300], dtype=torch.int32, device=DEVICE)
    tables = shuffled_tables(gen, 4, width, 4 * width + 3)
    k_cache, v_cache = (fp8_cache(gen, (4 * width + 3, BLOCK, kv_heads, head_dim), dtype) for _ in range(2))
    q = rand(gen, 4, kv_heads * group, head_dim)
    out = decode_attention(q, k_cache, v_cache, ctx, tables, 300, 0.2, num_splits=num_splits,
                           sliding_window=window)
    ref = paged_decode(q, k_cache, v_cache, tables, ctx, 300, 0.2, sliding_window=window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def step_metadata(chunk: list[int], ctx: list[int], table: torch.Tensor) -> AttentionMetadata:
    def cumulative(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lens], device=DEVICE).cumsum(0).to(torch.int32)

    slots = [table[i, t // BLOCK].item() * BLOCK + t % BLOCK for i in range(len(chunk))
             for t in range(ctx[i] - chunk[i], ctx[i])]
    return AttentionMetadata(cu_seqlens_q=cumulative(chunk), cu_seqlens_k=cumulative(ctx),
                             context_lens=torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
                             max_seqlen_q=max(chunk), max_seqlen_k=max(ctx),
                             slot_mapping=torch.tensor(slots, device=DEVICE), block_tables=table,
                             query_lens=chunk, context_lens_list=ctx)


@pytest.mark.parametrize("dtype", [*FP8, torch.bfloat16])  # bf16: narrower than the fp32 model too
@pytest.mark.parametrize("window", [None, 20])
def test_attention_layer_over_a_narrow_cache_matches_torch(dtype, window):
    """Through the attention layer, GQA 2:1: a prefill, a chunk over a cached prefix, a mixed step, a decode
    step. The Triton backend gives the torch backend's outputs and leaves the same bytes in its caches."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, num_blocks = 4, 2, 32, 8
    layers = {}
    for name, backend in (("triton", TritonAttentionBackend()), ("torch", TorchAttentionBackend())):
        layers[name] = Attention(heads, kv_heads, head_dim, backend, sliding_window=window)
        layers[name].bind_cache([torch.zeros(num_blocks, BLOCK, kv_heads, head_dim, device=DEVICE).to(dtype)
                                 for _ in range(2)])
    table = torch.tensor([[3, 0, 6, -1], [5, 1, 7, 2]], dtype=torch.int32, device=DEVICE)
    done = [0, 0]
    for chunk in ([20, 9], [13, 30], [1, 5], [1, 1]):
        ctx = [d + c for d, c in zip(done, chunk)]
        meta = step_metadata(chunk, ctx, table)
        q = rand(gen, sum(chunk), heads, head_dim)
        k, v = (rand(gen, sum(chunk), kv_heads, head_dim, std=2.0) for _ in range(2))
        torch.testing.assert_close(layers["triton"](q, k, v, meta), layers["torch"](q, k, v, meta),
                                   rtol=1e-5, atol=1e-5)
        done = ctx
    for triton_cache, torch_cache in zip((layers["triton"].k_cache, layers["triton"].v_cache),
                                         (layers["torch"].k_cache, layers["torch"].v_cache)):
        assert torch.equal(triton_cache.view(torch.uint8), torch_cache.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_over_fp8_cache_matches_torch(dtype, num_splits):
    gen = torch.Generator().manual_seed(3)
    rank, rope, heads = 48, 8, 20  # a rank that is no power of two, heads over two head blocks
    ctx = torch.tensor([1, 37, 70], dtype=torch.int32, device=DEVICE)
    tables = shuffled_tables(gen, 3, 5, 15)
    cache = fp8_cache(gen, (15, BLOCK, rank + rope), dtype)
    q = rand(gen, 3, heads, rank + rope)
    out = mla_decode(q, cache, ctx, tables, 70, rank, 0.2, num_splits=num_splits)
    ref = TorchMLABackend().decode(q, cache, tables, ctx, 70, rank, 0.2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["mistral", "deepseek-v3"])  # GQA and a sliding window; latent attention
def test_engine_with_fp8_cache_on_triton_matches_torch(tiny_model_factory, arch):
    path = str(tiny_model_factory(arch))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(dtype="float32", device=DEVICE, max_num_batched_tokens=40, kv_cache_memory=8 << 20)
    outputs = {}
    for backend, kv_dtype in (("triton", "fp8"), ("torch", "fp8"), ("torch", "auto")):
        llm = LLM(path, attention_backend=backend, kv_cache_dtype=kv_dtype, **kw)
        assert model_runner(llm).kv_cache[0][0].dtype == (torch.float32 if kv_dtype == "auto" else torch.float8_e4m3fn)
        prompts = mixed_prompts(llm, repeats=(1, 2))  # 89 tokens: chunks that read a cached prefix
        outputs[backend, kv_dtype] = llm.generate(prompts, params)

    def gap(a: list, b: list) -> float:
        assert len(a) == len(b) == 2
        return max(abs(x - y) for p, r in zip(a, b) for x, y in zip(p.logprobs, r.logprobs, strict=True))

    got, expected = outputs["triton", "fp8"], outputs["torch", "fp8"]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert gap(got, expected) <= 1e-4
    unquantized = outputs["torch", "auto"]
    assert [o.token_ids for o in got] != [o.token_ids for o in unquantized] or gap(got, unquantized) > 1e-3
