"""The profiler's op names sorted into kinds of work, for profile_prefill.py and profile_decode.py."""
from __future__ import annotations

# The first kind whose pattern an op's name contains wins; unmatched ops are "other ops". The CPU expert ops (their
# matmuls inside) and the gated MLP's one op count as linear layers.
KINDS = (
    ("linear layers", ("small_linear", "amx_linear", "dot_linear", "dot_gated_linear", "dot_bmm", "_linear_pointwise",
                       "fused_moe", "aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear",
                       "_weight_int8pack_mm")),
    ("attention", ("decode_attention", "varlen_causal_attention", "scaled_dot_product", "flash_attention",
                   "aten::index_select", "aten::gather")),
    ("sampler", ("row_argmax", "aten::argmax", "aten::max", "aten::logsumexp", "aten::softmax", "aten::sort",
                 "aten::topk")),
    ("norm/rotary/activation/kv store", ("batchgen_cpu::", "rms_norm", "silu", "aten::mul", "aten::add",
                                         "aten::rsqrt", "aten::pow", "aten::mean", "aten::index_copy")),
)


def kind_of(name: str) -> str:
    for kind, patterns in KINDS:
        if any(p in name for p in patterns):
            return kind
    return "other ops"
