"""Python entry points of the fused CPU kernels (``torch.ops.batchgen_cpu``), with torch's ops as fallback.

Each function has the signature of its torch reference in :mod:`batchgen.engine.backends.torch.ops` (or of the
torch attention backend) and falls back to it for dtypes the kernels do not run here.
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache

import torch

from batchgen.engine.backends.cpu.features import cpu_features
from batchgen.engine.backends.torch import ops as torch_ops
from batchgen.engine.dtype import FP8_DTYPES
from batchgen.engine.sampling.sampler import row_argmax as torch_row_argmax

log = logging.getLogger(__name__)

# The prefill op's keys per block (a multiple of 32) and GEMM rows per query block (all query heads of a KV head
# count), by the kernels' vector level. On a 2-core AVX2 CPU, blocks of 64 keys ran 1.1-1.3x blocks of 256 in fp32
# (rows 48-192 alike; 128 keys about as fast as 64, 160-192 between: `benchmarks/attention_cpu.py`); AVX-512 CPUs
# keep the blocks their figures were measured with.
VARLEN_BLOCKS = {"avx2": (64, 96), "avx512": (256, 192)}
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256


@lru_cache(maxsize=1)
def usable_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the loaded kernels compute correctly on this machine: each is tried once on a small
    step against torch, through brgemm and, for bf16 on AMX CPUs, the AMX tiles (bf16 needs oneDNN's AVX-512
    or AMX micro-kernels, which a CPU may lack)."""
    usable = set()
    gen = torch.Generator().manual_seed(0)
    for dtype in KERNEL_DTYPES:
        q, k, v = (torch.randn(40, h, 32, generator=gen).to(dtype) for h in (4, 2, 2))
        cache = torch.zeros(1, 16, 2, 32, dtype=dtype)
        seqs = torch.tensor([0, 7, 40], dtype=torch.int32)
        expected = torch.cat([_reference(q[a:b], k[a:b], v[a:b]) for a, b in ((0, 7), (7, 40))])
        try:
            outs = [varlen_causal_attention(q, k, v, cache, cache, seqs, seqs.diff(),
                                            torch.zeros(2, 1, dtype=torch.int32), 0.25, amx=amx)
                    for amx in (False, None)]
        except RuntimeError as e:
            log.info("fused CPU attention does not run %s here: %s", dtype, str(e).splitlines()[0])
            continue
        if all(torch.allclose(out.float(), expected, atol=3e-2 if dtype == torch.bfloat16 else 1e-4) for out in outs):
            usable.add(dtype)
        else:
            log.warning("fused CPU attention gives wrong results in %s here; using torch's", dtype)
    return frozenset(usable)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from batchgen.engine.backends.torch.attention import causal_attention

    return causal_attention(q.float(), k.float(), v.float(), 0.25)


def supports_attention(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in usable_dtypes() and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, kv_block: int | None = None,
                            q_rows: int | None = None, amx: bool | None = None) -> torch.Tensor:
    """Causal attention of a packed step: q (T, Hq, D); k, v (T, Hkv, D) the step's new keys and values.

    Sequence i owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and attends to ``context_lens[i]`` keys: the
    first ``context_lens[i] - query_len`` from the paged caches (blocks ``block_tables[i]``), then its own
    new rows. fp32 scores and accumulation; q, k, v, caches and the output share one dtype (fp32 or bf16).
    bf16 steps run in AMX tiles where the CPU has them (``amx`` None: :func:`amx_tiles`), unless ``amx`` is
    False: then, as everywhere else, in oneDNN's brgemm micro-kernels. ``kv_block`` and ``q_rows`` default to
    ``VARLEN_BLOCKS``' pair for this CPU.
    """
    amx = amx_tiles() if amx is None else amx
    blocks = VARLEN_BLOCKS[cpu_features().isa or "avx2"]
    kv_block, q_rows = kv_block or blocks[0], q_rows or blocks[1]
    out = torch.empty(q.shape, dtype=q.dtype)
    torch.ops.batchgen_cpu.varlen_causal_attention(q, k, v, k_cache, v_cache, cu_seqlens_q, context_lens,
                                                   block_tables, scale, kv_block, q_rows, amx, out)
    return out


@lru_cache(maxsize=1)
def amx_tiles() -> bool:
    """Whether the kernels' AMX paths run here (bf16 attention and small-row linears): they were built for a CPU
    with amx_bf16, the OS grants the tile state, and oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``, with which the
    tests simulate other CPUs) does not leave AMX out."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    return (cap == "ALL" or "AMX" in cap) and bool(torch.ops.batchgen_cpu.amx_tiles())


# Keys per decode work item (flash-decoding split): fixed, so results do not depend on the thread count.
SPLIT_KEYS = 256


def takes_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the store and decode ops take a cache of ``cache_dtype`` for k, v and q of ``dtype``: the same,
    fp8, or bf16 under fp32."""
    return cache_dtype in (dtype, *FP8_DTYPES) or (dtype, cache_dtype) == (torch.float32, torch.bfloat16)


def supports_decode(dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None) -> bool:
    """The decode op needs no oneDNN micro-kernel: fp32 and bf16 on any CPU the kernels were built for, over a
    cache it takes (:func:`takes_cache`; ``cache_dtype`` None: q's dtype)."""
    cached = cache_dtype is None or takes_cache(dtype, cache_dtype)
    return dtype in KERNEL_DTYPES and cached and 0 < head_dim <= MAX_HEAD_DIM


def supports_latent_decode(dtype: torch.dtype) -> bool:
    """Like the decode op, the latent one needs no oneDNN micro-kernel, and takes any row width."""
    return dtype in KERNEL_DTYPES


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           split_keys: int = SPLIT_KEYS, amx: bool | None = None) -> torch.Tensor:
    """Attention of one query per sequence, q (B, Hq, D), over its ``context_lens[i]`` cached keys, read in
    place from the paged caches through ``block_tables``; the signature of the torch backend's
    ``paged_decode`` (less its max context). The caches hold q's dtype, fp8 (e4m3fn, e5m2) or, under fp32 q,
    bf16 (narrower rows widened as they are read). fp32 scores and accumulation, output in q's dtype. bf16 scores
    are multiplied in AMX tiles where the CPU has them (``amx`` as in :func:`varlen_causal_attention`), else
    over a bf16 cache by AVX512-BF16 dot products where it has those; both round the probabilities to bf16 for
    the values' products, as torch's bf16 attention does."""
    out = torch.empty(q.shape, dtype=q.dtype)
    amx = amx_tiles() if amx is None else amx
    torch.ops.batchgen_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                  sliding_window or 0, softcap or 0.0, split_keys, amx, out)
    return out


def latent_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, value_dim: int, scale: float,
                            split_keys: int = SPLIT_KEYS, amx: bool | None = None) -> torch.Tensor:
    """MLA's absorbed decode: q (B, H, R + P), all heads over one latent head, the rows of the paged latent
    cache (num_blocks, block_size, R + P) read in place; the values are the rows' first ``value_dim`` dims.
    Returns (B, H, value_dim) in q's dtype; fp32 scores and accumulation. bf16 steps multiply in AMX tiles
    where the CPU has them (``amx`` as in :func:`varlen_causal_attention`)."""
    out = q.new_empty(q.shape[0], q.shape[1], value_dim)
    amx = amx_tiles() if amx is None else amx
    torch.ops.batchgen_cpu.latent_decode_attention(q, cache, block_tables, context_lens, value_dim, scale,
                                                   split_keys, amx, out)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dtype not in usable_dtypes() or x.dim() not in (2, 3) or weight.dtype != x.dtype:
        return torch_ops.rms_norm(x, weight, eps, residual)
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    torch.ops.batchgen_cpu.rms_norm(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dtype not in usable_dtypes() or cos_sin_cache.dtype != torch.float32:
        return torch_ops.apply_rotary(q, k, positions, cos_sin_cache)
    torch.ops.batchgen_cpu.apply_rotary(q, k, positions, cos_sin_cache)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in usable_dtypes() or x.dim() != 2:
        return torch_ops.silu_and_mul(x)
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    torch.ops.batchgen_cpu.silu_and_mul(x, out)
    return out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest value's index (a row holding NaN: its first NaN), as ``x.max(-1).indices``."""
    if x.dtype not in usable_dtypes() or x.dim() != 2 or x.stride(1) != 1:
        return torch_row_argmax(x)
    out = torch.empty(x.shape[0], dtype=torch.long)
    torch.ops.batchgen_cpu.row_argmax(x, out)
    return out


def round_through_fp8(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor | None:
    """x as an fp8 cache gives it back (:func:`batchgen.engine.dtype.as_stored`, in one pass); None where the
    kernel does not take x (then nothing is computed)."""
    heads_contiguous = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    if x.dtype not in usable_dtypes() or cache_dtype not in FP8_DTYPES or not heads_contiguous:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.batchgen_cpu.round_through_fp8(x, cache_dtype == torch.float8_e5m2, out)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, skip_negative: bool = False) -> torch.Tensor:
    """The torch reference's mixture of SwiGLU experts in one op with its loop over experts in C++ (nothing read on
    the host in Python, so recorded decode steps take MoE layers too): bit for bit, except experts of few rows,
    whose matmuls read W once (fp32 sums in another order): fp32 ones of up to 256 rows in ``small_linear``'s
    tiles, each row's sums independent of the other rows; bf16 ones on CPUs with AVX512-BF16 in register tiles.
    torch's for other dtypes."""
    if x.dtype not in KERNEL_DTYPES or not w13.dtype == w2.dtype == x.dtype or topk_weights.dtype != torch.float32:
        return torch_ops.fused_moe(x, w13, w2, topk_weights, topk_ids, skip_negative)
    out = torch.empty(x.shape[0], w2.shape[1], dtype=x.dtype)
    torch.ops.batchgen_cpu.fused_moe(x, w13, w2, topk_weights, topk_ids, skip_negative, out)
    return out


def fused_moe_packed(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, intermediate: int,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, skip_negative: bool = False) -> torch.Tensor:
    """The mixture over bf16 experts packed in ``dot_linear``'s blocks (w13 by ``prepack.pack_dot_gated``, gate and
    up blocks in turn; w2 by ``prepack.pack_dot_experts``): every expert's projection in one parallel loop, the
    activation applied to gate|up's tiles as they come."""
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype)
    torch.ops.batchgen_cpu.fused_moe_packed(x, w13, w2, intermediate, topk_weights, topk_ids, skip_negative, out)
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Writes k, v into the caches (of a dtype :func:`takes_cache`; narrower ones rounded as
    :func:`batchgen.engine.dtype.to_cache_dtype` rounds); False (nothing written) where the kernel does not take
    these tensors."""
    heads_contiguous = k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2] == v.shape[2]
    if k.dtype not in usable_dtypes() or not takes_cache(k.dtype, k_cache.dtype) or not heads_contiguous:
        return False
    torch.ops.batchgen_cpu.store_kv(k, v, k_cache, v_cache, slot_mapping)
    return True
