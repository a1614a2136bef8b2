"""The torch kernel set: every field in plain torch (the other backends start from it and replace what they fuse)."""
from __future__ import annotations

from batchgen.engine.backends.interface import KernelSet
from batchgen.engine.backends.torch import ops
from batchgen.engine.backends.torch.attention import TorchAttentionBackend
from batchgen.engine.backends.torch.mla import TorchMLABackend
from batchgen.engine.sampling.sampler import row_argmax


def torch_kernels() -> KernelSet:
    return KernelSet(attention=TorchAttentionBackend(), rms_norm=ops.rms_norm, apply_rotary=ops.apply_rotary,
                     silu_and_mul=ops.silu_and_mul, gelu_tanh_and_mul=ops.gelu_tanh_and_mul,
                     fused_moe=ops.fused_moe, mla=TorchMLABackend(), accept_drafts=ops.accept_drafts,
                     reject_drafts=ops.reject_drafts, row_argmax=row_argmax)
