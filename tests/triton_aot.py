"""Compiles every Triton kernel launch of the GPU path to a CUDA binary, with no GPU present.

The interpreter accepts programs the real compiler rejects (dot shapes, dtype mixes, pointer
types), so this records the launches the kernel wrappers make on CPU tensors, without running
them, and compiles each one for real CUDA targets (ptxas ships with Triton).

    TRITON_INTERPRET=0 python -m tests.triton_aot [sm_90 sm_80 ...]
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                 torch.int32: "*i32", torch.int64: "*i64"}
LAUNCH_OPTIONS = ("num_warps", "num_stages")
# Shared memory one block may use (bytes), by compute capability: a launch over it fails on the device.
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def record_launches(calls) -> list[tuple[JITFunction, dict, dict, dict]]:
    """Runs ``calls()`` with kernel launches replaced by a recorder: (kernel, signature, constexprs, options)."""
    launches = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
        constexprs = {p.name: bound[p.name] for p in self.params if p.is_constexpr}
        signature = {p.name: "constexpr" if p.is_constexpr else _arg_type(bound[p.name]) for p in self.params}
        options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
        launches.append((self, signature, constexprs, options))

    JITFunction.run = record
    try:
        calls()
    finally:
        JITFunction.run = original
    return launches


def engine_kernel_calls() -> None:
    """One call of each wrapper in the shapes the engine uses: bf16/fp16/fp32, head dims 64 and 128."""
    from batchgen.engine.kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from batchgen.engine.kernels.decode_attention import decode_attention
    from batchgen.engine.kernels.kv_store import store_kv
    from batchgen.engine.kernels.norm import rms_norm
    from batchgen.engine.kernels.prefill_attention import flash_attn_varlen_func, prefill_attention, prefill_work
    from batchgen.engine.kernels.rotary import apply_rotary

    for dtype, head_dim in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 128),
                            (torch.float32, 64), (torch.float32, 128)):
        heads, kv_heads, tokens, block = 32, 8, 40, 16
        q = torch.zeros(tokens, heads, head_dim, dtype=dtype)
        k = torch.zeros(tokens, kv_heads, head_dim, dtype=dtype)
        cache = torch.zeros(8, block, kv_heads, head_dim, dtype=dtype)
        cu = torch.tensor([0, 15, tokens], dtype=torch.int32)
        ctx = torch.tensor([20, 30], dtype=torch.int32)
        tables = torch.zeros(2, 4, dtype=torch.int32)
        work = prefill_work([15, 25], [20, 30])
        store_kv(k, k, cache, cache, torch.arange(tokens))
        flash_attn_varlen_func(q, k, k, cu, cu, 25, 25)
        flash_attn_varlen_func(q, k, k, cu, cu, 25, 25, causal=False)
        paged = dict(k_cache=cache, v_cache=cache, context_lens=ctx, block_tables=tables)
        prefill_attention(q, k, k, cu, cu, work, 0.1, **paged)
        # Local layers (sliding window) and Gemma 2's soft-capped scores.
        prefill_attention(q, k, k, cu, cu, work, 0.1, sliding_window=8, softcap=50.0, **paged)
        prefill_attention(q, k, k, cu, cu, work, 0.1, sliding_window=8)
        for splits in (1, 4):
            decode_attention(q[:2], cache, cache, ctx, tables, 256, 0.1, num_splits=splits)
            decode_attention(q[:2], cache, cache, ctx, tables, 256, 0.1, num_splits=splits, sliding_window=8,
                             softcap=50.0)
        hidden = torch.zeros(tokens, 4096, dtype=dtype)
        weight = torch.ones(4096, dtype=dtype)
        rms_norm(hidden, weight, 1e-5)
        rms_norm(hidden, weight, 1e-5, residual=hidden)
        apply_rotary(q, k, torch.arange(tokens), torch.zeros(64, head_dim))
        silu_and_mul(torch.zeros(tokens, 2 * 1536, dtype=dtype))
        gelu_tanh_and_mul(torch.zeros(tokens, 2 * 1536, dtype=dtype))


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


def compile_all(targets: list[str]) -> int:
    """Compiles every recorded launch for each target (e.g. "sm_90"); returns the number compiled."""
    launches = record_launches(engine_kernel_calls)
    seen, compiled = set(), 0
    for fn, signature, constexprs, options in launches:
        key = (fn.__name__, tuple(signature.items()), tuple(constexprs.items()), tuple(options.items()))
        if key in seen:
            continue
        seen.add(key)
        for target in targets:
            try:
                kernel = triton.compile(ASTSource(fn, signature, constexprs), target=_target(target),
                                        options=options)
            except Exception as exc:
                raise RuntimeError(f"{fn.__name__} {constexprs} {options} for {target}: {exc}") from exc
            limit = SHARED_MEMORY_LIMIT[_target(target).arch]
            if kernel.metadata.shared > limit:
                raise RuntimeError(f"{fn.__name__} {constexprs} {options} needs {kernel.metadata.shared} bytes "
                                   f"of shared memory; {target} has {limit}")
            compiled += 1
    return compiled


if __name__ == "__main__":
    targets = sys.argv[1:] or ["sm_90"]
    if not compiler_rejects_bad_kernel(targets[0]):
        sys.exit("the compiler accepted a bad kernel: this check proves nothing")
    print(f"compiled {compile_all(targets)} kernel launches for {', '.join(targets)}")
