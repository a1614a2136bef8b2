"""The CPU kernel set: fused C++ attention (MLA's latent decode too), elementwise and expert ops, prepacked weights."""
from __future__ import annotations

from batchgen.engine.backends.cpu import ops
from batchgen.engine.backends.cpu.attention import CpuAttentionBackend
from batchgen.engine.backends.cpu.build import load_kernels
from batchgen.engine.backends.cpu.mla import CpuMLABackend
from batchgen.engine.backends.cpu.prepack import prepack_weights


def cpu_kernels() -> dict[str, object] | None:
    """The fused implementations of the kernel set's fields (the torch ones fill the rest), or None where
    the kernels cannot be built (load_kernels warned once)."""
    if not load_kernels() or not ops.usable_dtypes():
        return None
    return dict(attention=CpuAttentionBackend(), rms_norm=ops.rms_norm, apply_rotary=ops.apply_rotary,
                silu_and_mul=ops.silu_and_mul, fused_moe=ops.fused_moe, mla=CpuMLABackend(),
                row_argmax=ops.row_argmax,
                prepare_model=prepack_weights)
