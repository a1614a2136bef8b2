"""Multi-head latent attention: the Triton kernels against the torch path (fp64), and the absorbed
decode against the expanded prefill on the same latent cache."""
from __future__ import annotations

import os

import pytest
import torch

from batchgen.engine.backends.interface import AttentionMetadata, LatentPrefill
from batchgen.engine.backends.select import make_kernel_set
from batchgen.engine.backends.torch.mla import TorchMLABackend
from batchgen.engine.config import ModelConfig
from batchgen.engine.layers.mla import MAX_ABSORBED_QUERIES, MLAAttention, MLAMetadata
from batchgen.engine.layers.rotary import cos_sin_cache
from batchgen.engine.models.registry import model_config

pytest.importorskip("triton")
# The kernels run on CPU tensors under the interpreter (tests/conftest.py's default), else on the GPU.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def paged(num_blocks: int, seed: int) -> torch.Tensor:
    """A shuffled block table: sequences' blocks are not in order in the cache."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_matches_torch(dtype, num_splits):
    from batchgen.engine.backends.triton.mla import mla_decode

    gen = torch.Generator().manual_seed(num_splits)
    rank, rope, heads, block = 48, 8, 20, 16  # a rank that is no power of two, heads over two head blocks
    ctx = torch.tensor([1, 37, 70], dtype=torch.int32)
    tables = paged(15, 0).view(3, 5)
    cache = torch.randn(15, block, rank + rope, generator=gen).to(dtype)
    q = torch.randn(3, heads, rank + rope, generator=gen).to(dtype)
    out = mla_decode(*(t.to(DEVICE) for t in (q, cache, ctx, tables)), 70, rank, 0.2, num_splits=num_splits).cpu()
    ref = TorchMLABackend().decode(q.double(), cache.double(), tables, ctx, 70, rank, 0.2)
    assert out.shape == (3, heads, rank) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_torch(dtype):
    from batchgen.engine.backends.triton.mla import mla_prefill
    from batchgen.engine.backends.triton.prefill_attention import prefill_work

    gen = torch.Generator().manual_seed(1)
    nope, rope, v_dim, heads = 16, 8, 24, 3  # v wider than nope: no shared head dim
    q_lens, ctx_lens = [5, 40, 130], [5, 70, 150]  # no prefix, a prefix, two query tiles
    kv = torch.randn(sum(ctx_lens), heads, nope + v_dim, generator=gen).to(dtype)
    latent = torch.randn(sum(ctx_lens), 32 + rope, generator=gen).to(dtype)
    k_nope, v, k_pe = kv[..., :nope], kv[..., nope:], latent[:, 32:]
    q = torch.randn(sum(q_lens), heads, nope + rope, generator=gen).to(dtype)
    cu_q, cu_k = (torch.tensor([0, *lens]).cumsum(0).to(torch.int32) for lens in (q_lens, ctx_lens))
    out = mla_prefill(*(t.to(DEVICE) for t in (q, k_nope, v, k_pe, cu_q, cu_k, prefill_work(q_lens, ctx_lens))),
                      0.3).cpu()
    plan = LatentPrefill(None, torch.empty(0), cu_q, cu_k, q_lens, ctx_lens)
    ref = TorchMLABackend().prefill(q.double(), k_nope.double(), v.double(), k_pe.double(), plan, 0.3)
    assert out.shape == (sum(q_lens), heads, v_dim)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


def test_store_latent_skips_padding_slots():
    from batchgen.engine.backends.triton.mla import store_latent

    rows = torch.randn(5, 40)
    cache = torch.zeros(3, 4, 40, device=DEVICE)
    slots = torch.tensor([9, -1, 0, 5, -1])
    store_latent(rows.to(DEVICE), cache, slots.to(DEVICE))
    flat = cache.view(-1, 40).cpu()
    assert torch.equal(flat[[9, 0, 5]], rows[[0, 2, 3]])
    assert flat.abs().sum(dim=1).nonzero().flatten().tolist() == [0, 5, 9]


# ---- the layer: absorbed decode and expanded prefill over the same cache ----------------------------------
def tiny_mla_config(q_lora_rank: int | None) -> ModelConfig:
    return model_config({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "q_lora_rank": q_lora_rank, "kv_lora_rank": 24,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 1, "topk_group": 1})


def step_metadata(query_lens: list[int], context_lens: list[int], tables: torch.Tensor,
                  slots: torch.Tensor) -> AttentionMetadata:
    cu_q, cu_k = (torch.tensor([0, *lens]).cumsum(0).to(torch.int32) for lens in (query_lens, context_lens))
    return AttentionMetadata(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             context_lens=torch.tensor(context_lens, dtype=torch.int32),
                             max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens), slot_mapping=slots,
                             block_tables=tables, query_lens=query_lens, context_lens_list=context_lens)


def slots_of(table: torch.Tensor, start: int, end: int, block: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    return table[pos // block].long() * block + pos % block


class RepackedLinear(torch.nn.Module):
    """A linear layer holding its weight in another form, as a kernel set may swap one in after loading."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.packed = linear.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.packed


def random_layer(q_lora_rank: int | None, backend: str) -> MLAAttention:
    torch.manual_seed(0)
    layer = MLAAttention(tiny_mla_config(q_lora_rank), make_kernel_set(backend), pairwise_rope=False)
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    return layer


# The layer test builds CPU tensors: the Triton backend joins it where the kernels run on them.
@pytest.mark.parametrize("backend", ["torch", "cpu"] + ["triton"] * (DEVICE == "cpu"))
@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_absorbed_decode_matches_expanded_prefill(backend, q_lora_rank):
    check_both_forms(random_layer(q_lora_rank, backend))


def test_absorbed_decode_outlives_a_repacked_kv_b_proj():
    layer = random_layer(None, "torch")
    layer.kv_b_proj = RepackedLinear(layer.kv_b_proj)
    check_both_forms(layer)


def check_both_forms(layer: MLAAttention) -> None:
    """The expanded prefill of two sequences, then their last tokens absorbed, alone and in a mixed step."""
    cfg, block = tiny_mla_config(layer.q_lora_rank), 4
    cache = torch.zeros(12, block, cfg.mla.latent_dim)
    layer.bind_cache([cache])
    cos_sin = cos_sin_cache(cfg.mla.qk_rope_head_dim, cfg.rope_theta, None, 64)
    tables = torch.stack([paged(12, 1)[:6], paged(12, 1)[6:]])
    a, b = torch.randn(13, 32), torch.randn(9, 32)  # two sequences, in step order: a's 13 tokens, then b's
    rows = layer.project(torch.cat((a, b)), torch.cat((torch.arange(13), torch.arange(9))), cos_sin)
    with torch.inference_mode():
        slots = torch.cat((slots_of(tables[0], 0, 13, block), slots_of(tables[1], 0, 9, block)))
        meta = step_metadata([13, 9], [13, 9], tables, slots)
        expanded = layer.attend(rows, MLAMetadata.for_step(meta, block))
        # Each sequence's last token again, alone, over the rows now cached: the absorbed form.
        last = torch.tensor([12, 21])
        meta = step_metadata([1, 1], [13, 9], tables, slots[last])
        absorbed = layer.attend(rows[last], meta)
        torch.testing.assert_close(absorbed, expanded[last], rtol=1e-5, atol=1e-5)
        # A mixed step: a decodes its last token while b prefills its 9 (more than the absorbed path takes).
        assert 9 > MAX_ABSORBED_QUERIES
        meta = step_metadata([1, 9], [13, 9], tables, torch.cat((slots[12:13], slots[13:])))
        planned = MLAMetadata.for_step(meta, block)
        assert planned.decode is not None and planned.prefill is not None
        assert planned.prefill.context_slots.tolist() == slots[13:].tolist()
        mixed = layer.attend(torch.cat((rows[12:13], rows[13:])), planned)
        torch.testing.assert_close(mixed, torch.cat((expanded[12:13], expanded[13:])), rtol=1e-5, atol=1e-5)
        # A verification-shaped step: a's last token, b's last 4 over a cached prefix of 5, all absorbed, each
        # row over its context up to itself.
        meta = step_metadata([1, 4], [13, 9], tables, torch.cat((slots[12:13], slots[13 + 5:])))
        planned = MLAMetadata.for_step(meta, block)
        assert planned.prefill is None and planned.decode.context_lens.tolist() == [13, 6, 7, 8, 9]
        few = layer.attend(torch.cat((rows[12:13], rows[13 + 5:])), planned)
        torch.testing.assert_close(few, torch.cat((expanded[12:13], expanded[13 + 5:])), rtol=1e-5, atol=1e-5)


def test_prefill_kernel_key_offsets_past_int32():
    """A 128-head rank's expanded keys (row stride 32,768) pass 2**31 elements at 65,536 keys; the same
    overflow at test size: rows 2**23 elements apart, 300 keys. The buffer is virtual memory: only the rows
    written are ever touched."""
    from batchgen.engine.backends.triton.mla import mla_prefill
    from batchgen.engine.backends.triton.prefill_attention import prefill_work

    gen = torch.Generator().manual_seed(5)
    nope, rope, v_dim, keys, queries, row_stride = 16, 8, 16, 300, 3, 1 << 23
    assert (keys - 1) * row_stride >= 2**31
    rows = torch.empty(keys * row_stride, dtype=torch.bfloat16, device=DEVICE).as_strided((keys, 1, nope + v_dim), (row_stride, 1, 1))
    rows.copy_(torch.randn(keys, 1, nope + v_dim, generator=gen))
    k_nope, v = rows[..., :nope], rows[..., nope:]
    k_pe = torch.randn(keys, rope, generator=gen).to(torch.bfloat16)
    q = torch.randn(queries, 1, nope + rope, generator=gen).to(torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, queries], dtype=torch.int32), torch.tensor([0, keys], dtype=torch.int32)
    out = mla_prefill(*(t.to(DEVICE) for t in (q, k_nope, v, k_pe, cu_q, cu_k, prefill_work([queries], [keys]))),
                      0.3).cpu()
    plan = LatentPrefill(None, torch.empty(0), cu_q, cu_k, [queries], [keys])
    k_nope, v = k_nope.cpu(), v.cpu()
    ref = TorchMLABackend().prefill(q.double(), k_nope.double(), v.double(), k_pe.double(), plan, 0.3)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.bfloat16])
