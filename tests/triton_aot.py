"""Compiles every Triton kernel launch of the GPU path to a CUDA binary, with no GPU present.

The interpreter accepts programs the real compiler rejects (dot shapes, dtype mixes, pointer
types), so this records the launches the kernel wrappers make on CPU tensors, without running
them, and compiles each one for real CUDA targets (ptxas ships with Triton).

    TRITON_INTERPRET=0 python -m tests.triton_aot [--spills] [--wide | --first-per-kernel | --shard=I/N] [sm_90 ...]

FP8 launches are compiled only for targets with FP8 tensor cores (sm_89 and newer). --spills runs
ptxas -v on each binary and lists the launches that spill registers; --wide compiles only the
launches at head dims 80/96/192/256 and those with int64 key offsets; --first-per-kernel the first
launch of each kernel; --shard=I/N every N-th distinct launch from the I-th (processes split the work).
"""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

WIDE_HEAD_DIMS = (80, 96, 192, 256)  # padded to a power of two in the kernels (80, 96, 192); Gemma's 256
FP8_MIN_ARCH = 89  # FP8 tensor cores: Ada, Hopper, Blackwell
LAUNCH_OPTIONS = ("num_warps", "num_stages")
# Shared memory one block may use (bytes), by compute capability: a launch over it fails on the device.
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the JIT would compile it: argument types, constants and the
    specialization it derives from the values (16-byte aligned pointers, ints divisible by 16,
    ints equal to 1 turned constant)."""

    fn: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def key(self) -> tuple:
        return (self.fn.__name__, *(tuple((k, str(v)) for k, v in d.items())
                                    for d in (self.signature, self.constexprs, self.attrs, self.options)))

    def describe(self) -> str:
        names = self.fn.arg_names
        constants = {names[path[0]]: v for path, v in self.constexprs.items() if names[path[0]].isupper()}
        return f"{self.fn.__name__} {constants} {self.options}"


def record_launches(calls) -> list[Launch]:
    """Runs ``calls()`` with kernel launches replaced by a recorder that specializes them as the JIT does."""
    launches = []
    original = JITFunction.run
    backend = make_backend(GPUTarget("cuda", 90, 32))  # the arguments specialize alike on every NVIDIA target

    def record(self, *args, grid, warmup, **kwargs):
        options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, binder_options = binder(*args, **kwargs)
        _, signature, constexprs, attrs = self._pack_args(backend, options, bound, specialization, binder_options)
        launches.append(Launch(self, signature, constexprs, attrs, options))

    JITFunction.run = record
    try:
        calls()
    finally:
        JITFunction.run = original
    return launches


def engine_kernel_calls() -> None:
    """One call of each wrapper in the shapes the engine uses: bf16/fp16/fp32, head dims 64 and 128, and in
    bf16 the head dims padded to a power of two (80, 96, 192) and Gemma's 256; KV caches of each dtype and,
    in bf16, of fp8 (e4m3, e5m2)."""
    from batchgen.engine.backends.triton.accept import accept_drafts
    from batchgen.engine.backends.triton.rejection import reject_drafts
    from batchgen.engine.backends.triton.activation import gelu_tanh_and_mul, silu_and_mul
    from batchgen.engine.backends.triton.decode_attention import decode_attention, decode_rows
    from batchgen.engine.backends.triton.kv_store import store_kv
    from batchgen.engine.backends.triton.norm import rms_norm
    from batchgen.engine.backends.triton.prefill_attention import prefill_attention, prefill_work
    from tests.flash_attn import flash_attn_varlen_func
    from batchgen.engine.backends.triton.rotary import apply_rotary
    from batchgen.engine.dtype import FP8_DTYPES

    for dtype, head_dim in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 128),
                            (torch.float32, 64), (torch.float32, 128), *((torch.bfloat16, d) for d in WIDE_HEAD_DIMS)):
        heads, kv_heads, tokens, block = 32, 8, 40, 16
        q = torch.zeros(tokens, heads, head_dim, dtype=dtype)
        k = torch.zeros(tokens, kv_heads, head_dim, dtype=dtype)
        cu = torch.tensor([0, 15, tokens], dtype=torch.int32)
        ctx = torch.tensor([20, 30], dtype=torch.int32)
        tables = torch.zeros(2, 4, dtype=torch.int32)
        work = prefill_work([15, 25], [20, 30])
        flash_attn_varlen_func(q, k, k, cu, cu, 25, 25)
        flash_attn_varlen_func(q, k, k, cu, cu, 25, 25, causal=False)
        prefill_attention(q, k, k, cu, cu, work, 0.1, sliding_window=8)
        # Caches of the model's dtype and, in bf16, of fp8 (stored as bytes, widened to q's dtype as they are read).
        cache_dtypes = (dtype, *(FP8_DTYPES if dtype == torch.bfloat16 else ()))
        for cache in (torch.zeros(8, block, kv_heads, head_dim, dtype=d) for d in cache_dtypes):
            store_kv(k, k, cache, cache, torch.arange(tokens))
            paged = dict(k_cache=cache, v_cache=cache, context_lens=ctx, block_tables=tables)
            prefill_attention(q, k, k, cu, cu, work, 0.1, **paged)
            # Local layers (sliding window) and Gemma 2's soft-capped scores.
            prefill_attention(q, k, k, cu, cu, work, 0.1, sliding_window=8, softcap=50.0, **paged)
            for splits in (1, 4):
                decode_attention(q[:2], cache, cache, ctx, tables, 256, 0.1, num_splits=splits)
                decode_attention(q[:2], cache, cache, ctx, tables, 256, 0.1, num_splits=splits, sliding_window=8,
                                 softcap=50.0)
                # The decode rows of a mixed step (gathered from the packed step's queries).
                decode_attention(q, cache, cache, ctx, tables, 256, 0.1, num_splits=splits, out=q,
                                 rows=decode_rows([1, 39]))
        hidden = torch.zeros(tokens, 4096, dtype=dtype)
        weight = torch.ones(4096, dtype=dtype)
        rms_norm(hidden, weight, 1e-5)
        rms_norm(hidden, weight, 1e-5, residual=hidden)
        apply_rotary(q, k, torch.arange(tokens), torch.zeros(64, head_dim))
        silu_and_mul(torch.zeros(tokens, 2 * 1536, dtype=dtype))
        gelu_tanh_and_mul(torch.zeros(tokens, 2 * 1536, dtype=dtype))
    # Speculative verification's acceptance (int64 tokens, fp32 logprobs), with and without logprobs.
    sampled, drafts = torch.zeros(10, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64)
    spans = torch.tensor([0, 5]), torch.tensor([4, 4])
    accept_drafts(sampled, None, *spans, drafts)
    accept_drafts(sampled, torch.zeros(10), *spans, drafts)
    # Rejection sampling of sampled drafts: fp32 target and draft distributions over a 49,152-token vocabulary.
    probs, draft_probs = torch.zeros(10, 49152), torch.zeros(8, 49152)
    reject_drafts(sampled, probs, draft_probs, torch.tensor([0, 4]), torch.zeros(10), sampled, sampled, *spans, drafts)


def moe_and_fp8_kernel_calls() -> None:
    """Fused MoE with float and FP8 experts, FP8 activation quantization and the w8a8 GEMM: every
    row tile size, scale layout and dtype the wrappers pick, in DeepSeek-V3-like shapes."""
    from batchgen.engine.backends.triton.fp8.format import FP8_DTYPE
    from batchgen.engine.backends.triton.fp8.gemm import w8a8_matmul
    from batchgen.engine.backends.triton.fp8.quant import quantize_fp8_activation
    from batchgen.engine.backends.triton.fused_moe import fused_moe

    hidden, inter, experts, top_k = 1024, 256, 16, 4

    def moe(tokens: int, dtype: torch.dtype, fp8_scales: str | None = None) -> None:
        x = torch.zeros(tokens, hidden, dtype=dtype)
        ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
        weights = torch.zeros(tokens, top_k)
        if fp8_scales is None:
            fused_moe(x, torch.zeros(experts, 2 * inter, hidden, dtype=dtype),
                      torch.zeros(experts, hidden, inter, dtype=dtype), weights, ids)
            return
        w13 = torch.zeros(experts, 2 * inter, hidden, dtype=FP8_DTYPE)
        w2 = torch.zeros(experts, hidden, inter, dtype=FP8_DTYPE)
        if fp8_scales == "row":
            scales = torch.ones(experts, 2 * inter, 1), torch.ones(experts, hidden, 1)
        else:  # 128x128 blocks
            scales = torch.ones(experts, 2 * inter // 128, hidden // 128), torch.ones(experts, hidden // 128, inter // 128)
        fused_moe(x, w13, w2, weights, ids, *scales)

    # 16, 32 and 64-row tiles (4, 24 and 100 rows per expert).
    for tokens in (16, 96, 400):
        moe(tokens, torch.bfloat16)
        moe(tokens, torch.bfloat16, fp8_scales="block")
    moe(400, torch.float16)
    for tokens in (16, 400):
        moe(tokens, torch.float32)
    moe(400, torch.bfloat16, fp8_scales="row")
    for dtype in (torch.float16, torch.float32):
        quantize_fp8_activation(torch.zeros(4, hidden, dtype=dtype))
    # 16, 32 and 64-row tiles; per-row weight scales; bias; each output dtype.
    n, k = 1536, 7168
    w, block_scale = torch.zeros(n, k, dtype=FP8_DTYPE), torch.ones(n // 128, k // 128)
    for m, out_dtype in ((1, torch.bfloat16), (20, torch.bfloat16), (512, torch.bfloat16), (512, torch.float16),
                         (512, torch.float32)):
        w8a8_matmul(torch.zeros(m, k, dtype=FP8_DTYPE), torch.ones(m, k // 128), w, block_scale, out_dtype)
    a, a_scale = torch.zeros(512, k, dtype=FP8_DTYPE), torch.ones(512, k // 128)
    w8a8_matmul(a, a_scale, w, torch.ones(n, 1), torch.bfloat16)
    w8a8_matmul(a, a_scale, w, block_scale, torch.bfloat16, bias=torch.zeros(n, dtype=torch.bfloat16))


# FP8 checkpoints in real shapes: Llama-3.1-8B with 128x128 blocks and per channel, Qwen2-7B (q/k/v biases),
# Qwen3-30B-A3B (128 experts, top-8). Sizes follow the models' config.json.
FP8_MODELS = (
    (dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
          num_key_value_heads=8), ("block", "channel")),
    (dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
          num_key_value_heads=4), ("block",)),
    (dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
          norm_topk_prob=True), ("block", "channel")),
)


def fp8_model_kernel_calls() -> None:
    """The FP8 launches of the model path: each FP8 linear and expert layer of one decoder layer of
    ``FP8_MODELS``, in bf16, at decode (1, 8, 24 rows) and prefill (512, 2048 rows) sizes. The layers
    are built on the meta device: shapes, dtypes and strides as on the GPU, no memory."""
    from batchgen.engine.backends.select import make_kernel_set
    from batchgen.engine.layers.linear import LinearBase
    from batchgen.engine.layers.moe import FusedMoE, TopKRouter
    from batchgen.engine.models.registry import build_model, model_config
    from batchgen.engine.quantization import choose_weight_methods
    from batchgen.engine.quantization.checkpoint import quantization_config

    kernels = make_kernel_set("triton")
    for shape, schemes in FP8_MODELS:
        for scheme in schemes:
            cfg = model_config(dict(shape, vocab_size=1024, num_hidden_layers=1,
                                           quantization_config=quantization_config(scheme)))
            methods = choose_weight_methods(cfg.quantization, kernels, torch.device("meta"), torch.bfloat16, "fp8")
            model = build_model(cfg, kernels, 16, torch.bfloat16, "meta", methods=methods)
            for module in model.modules():
                if isinstance(module, LinearBase) and not isinstance(module, TopKRouter):  # routers stay bf16
                    for rows in (1, 8, 24, 512):
                        module(torch.zeros(rows, module.input_size, dtype=torch.bfloat16, device="meta"))
                elif isinstance(module, FusedMoE):
                    for rows in (1, 512, 2048):
                        x = torch.zeros(rows, module.hidden_size, dtype=torch.bfloat16, device="meta")
                        ids = torch.zeros(rows, 8, dtype=torch.int64, device="meta")
                        module(x, torch.zeros(rows, 8, device="meta"), ids)
def mla_kernel_calls() -> None:
    """Latent attention in DeepSeek-V3's shapes (latent 512 + 64, heads of nope 128 + rope 64, v 128), over
    latent caches of each dtype and, in bf16, of fp8 (e4m3, e5m2)."""
    from batchgen.engine.backends.triton.mla import mla_decode, mla_prefill, store_latent
    from batchgen.engine.backends.triton.prefill_attention import prefill_work
    from batchgen.engine.dtype import FP8_DTYPES

    rank, rope, nope, v_dim, heads, tokens = 512, 64, 128, 128, 16, 40
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tables, ctx = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([20, 30], dtype=torch.int32)
        cache_dtypes = (dtype, *(FP8_DTYPES if dtype == torch.bfloat16 else ()))
        for cache in (torch.zeros(8, 16, rank + rope, dtype=d) for d in cache_dtypes):
            store_latent(torch.zeros(tokens, rank + rope, dtype=dtype), cache, torch.arange(tokens))
            for splits in (1, 4):
                mla_decode(torch.zeros(2, heads, rank + rope, dtype=dtype), cache, ctx, tables, 256, rank, 0.1,
                           num_splits=splits)
        kv = torch.zeros(50, heads, nope + v_dim, dtype=dtype)
        latent = torch.zeros(50, rank + rope, dtype=dtype)
        mla_prefill(torch.zeros(tokens, heads, nope + rope, dtype=dtype), kv[..., :nope], kv[..., nope:],
                    latent[:, rank:], torch.tensor([0, 15, tokens], dtype=torch.int32),
                    torch.tensor([0, 20, 50], dtype=torch.int32), prefill_work([15, 25], [20, 30]), 0.1)
    # A 128-head rank's keys past 2**31 elements (int64 key offsets), as meta tensors: recorded, never run.
    keys, heads = 140_000, 128
    kv = torch.zeros(keys, heads, nope + v_dim, dtype=torch.bfloat16, device="meta")
    latent = torch.zeros(keys, rank + rope, dtype=torch.bfloat16, device="meta")
    mla_prefill(torch.zeros(tokens, heads, nope + rope, dtype=torch.bfloat16, device="meta"), kv[..., :nope],
                kv[..., nope:], latent[:, rank:], torch.tensor([0, tokens], dtype=torch.int32),
                torch.tensor([0, keys], dtype=torch.int32), prefill_work([tokens], [keys]), 0.1)


def all_kernel_calls() -> None:
    engine_kernel_calls()
    moe_and_fp8_kernel_calls()
    fp8_model_kernel_calls()
    mla_kernel_calls()


@triton.jit
def _mixed_dtype_dot(A, B, C):
    # bf16 x fp32 operands: the compiler must refuse this; it proves the check can fail.
    offs = tl.arange(0, 16)
    a = tl.load(A + offs[:, None] * 16 + offs[None, :])
    b = tl.load(B + offs[:, None] * 16 + offs[None, :])
    tl.store(C + offs[:, None] * 16 + offs[None, :], tl.dot(a, b))


def compiler_rejects_bad_kernel(target: str) -> bool:
    signature = {"A": "*bf16", "B": "*fp32", "C": "*fp32"}
    try:
        triton.compile(ASTSource(_mixed_dtype_dot, signature), target=_target(target))
    except Exception:
        return True
    return False


def _target(name: str) -> GPUTarget:
    return GPUTarget("cuda", int(name.removeprefix("sm_")), 32)


def ptxas_spills(kernel, target: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of a compiled kernel, from ptxas -v."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    arch = _target(target).arch
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}",
                              ptx.name, "-o", os.devnull], capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    return registers, stores, loads


def is_wide(launch: Launch) -> bool:
    """A launch at a head dim of WIDE_HEAD_DIMS, or with int64 key offsets: the likeliest to spill."""
    names = launch.fn.arg_names
    constants = {names[path[0]]: v for path, v in launch.constexprs.items()}
    return constants.get("HEAD_DIM") in WIDE_HEAD_DIMS or constants.get("LONG") is True


def compile_all(targets: list[str], report_spills: bool = False,
                keep: Callable[[Launch], bool] = lambda launch: True) -> tuple[int, int, list[str]]:
    """Compiles every recorded launch that ``keep`` selects for each target (e.g. "sm_90").

    Returns (launches compiled, FP8 launches skipped on targets without FP8, a line per launch
    that spills registers when ``report_spills``).
    """
    seen, compiled, skipped, spills = set(), 0, 0, []
    for launch in record_launches(all_kernel_calls):
        if launch.key() in seen:
            continue
        seen.add(launch.key())
        if not keep(launch):
            continue
        for target in targets:
            if "*fp8e4nv" in launch.signature.values() and _target(target).arch < FP8_MIN_ARCH:
                skipped += 1
                continue
            try:
                kernel = triton.compile(ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs),
                                        target=_target(target), options=launch.options)
            except Exception as exc:
                raise RuntimeError(f"{launch.describe()} for {target}: {exc}") from exc
            limit = SHARED_MEMORY_LIMIT[_target(target).arch]
            if kernel.metadata.shared > limit:
                raise RuntimeError(f"{launch.describe()} needs {kernel.metadata.shared} bytes "
                                   f"of shared memory; {target} has {limit}")
            if report_spills:
                registers, stores, loads = ptxas_spills(kernel, target)
                if stores or loads:
                    spills.append(f"{target} {launch.describe()}: {registers} registers, "
                                  f"{stores} bytes spill stores, {loads} bytes spill loads")
                print(f"{target} {launch.describe()}: {registers} registers, {stores + loads} bytes spilled",
                      flush=True)
            compiled += 1
    return compiled, skipped, spills


def shard(index: int, count: int) -> Callable[[Launch], bool]:
    """Keeps every ``count``-th distinct launch from the ``index``-th: processes split the launches."""
    order = itertools.count()
    return lambda launch: next(order) % count == index


def first_per_kernel() -> Callable[[Launch], bool]:
    """Keeps the first launch of each kernel function."""
    names: set[str] = set()

    def keep(launch: Launch) -> bool:
        name = launch.fn.__name__
        new = name not in names
        names.add(name)
        return new
    return keep


def selection(args: list[str]) -> Callable[[Launch], bool]:
    if "--wide" in args:
        return is_wide
    if "--first-per-kernel" in args:
        return first_per_kernel()
    part = next((a.split("=", 1)[1] for a in args if a.startswith("--shard=")), None)
    if part is not None:
        index, count = map(int, part.split("/"))
        return shard(index, count)
    return lambda launch: True


if __name__ == "__main__":
    args = sys.argv[1:]
    report_spills = "--spills" in args
    targets = [a for a in args if not a.startswith("--")] or ["sm_90"]
    if not compiler_rejects_bad_kernel(targets[0]):
        sys.exit("the compiler accepted a bad kernel: this check proves nothing")
    compiled, skipped, spills = compile_all(targets, report_spills, selection(args))
    print(f"compiled {compiled} kernel launches for {', '.join(targets)}")
    if skipped:
        print(f"skipped {skipped} FP8 launches on targets older than sm_{FP8_MIN_ARCH}")
    if report_spills:
        print("\n".join(spills) if spills else "no launch spills registers")
