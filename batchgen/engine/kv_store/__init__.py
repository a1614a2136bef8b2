"""A prefix KV cache that outlives the run: host memory, then any fsspec store (see ``tiers``)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from batchgen.engine.backends.select import default_backend, make_kernel_set
from batchgen.engine.kv_store.format import KVIdentity, dtype_name, rope_description, weights_digest
from batchgen.engine.kv_store.store import KVStore, RankStores
from batchgen.engine.kv_store.tiers import PrefixTiers
from batchgen.engine.layers.rotary import rope_context
from batchgen.engine.quantization import keeps_fp8_weights
from batchgen.io.redaction import redact

if TYPE_CHECKING:
    from batchgen.engine.config import EngineConfig, ModelConfig
    from batchgen.engine.core.kv_cache import KVLayout
    from batchgen.engine.loading.model_source import ModelSource

log = logging.getLogger(__name__)


def kv_identity(config: "EngineConfig", source: "ModelSource", model: "ModelConfig", layout: "KVLayout",
                max_positions: int, tp_rank: int = 0) -> KVIdentity:
    """What makes the blocks of an engine whose model was built for ``max_positions`` tokens."""
    # A cache narrower than the model holds different bytes under each model dtype: both name the blocks.
    dtype = dtype_name(config.kv_torch_dtype)
    if config.kv_torch_dtype != config.torch_dtype:
        dtype += f" under {dtype_name(config.torch_dtype)}"
    if model.quantization is not None:  # FP8 weights kept multiply FP8 activations: other keys and values
        backend = config.attention_backend or default_backend(config.torch_device())
        fp8_gemm = make_kernel_set(backend).fp8_linear is not None
        if keeps_fp8_weights(config.fp8_weights, fp8_gemm, config.torch_device()):
            dtype += ", fp8 weights and activations"
    rope = rope_description(model.rope_theta, model.rope_scaling, rope_context(model.rope_scaling, max_positions))
    return KVIdentity(weights=weights_digest(source.path, source.config), dtype=dtype,
                      layout=layout.layers, block_size=config.block_size, tp_rank=tp_rank,
                      tp_size=config.tensor_parallel_size, rope=rope)


def build_prefix_tiers(config: "EngineConfig", source: "ModelSource", model: "ModelConfig",
                       rank_layout: "KVLayout", max_positions: int, shards: int = 1) -> PrefixTiers | None:
    """The engine's lower prefix tiers, or None when neither is configured (or the layout frees blocks as
    sequences run: a sliding window everywhere). ``rank_layout``: what one tensor-parallel rank's cache
    holds; a block in the tiers is the first ``shards`` ranks' shards of it, in rank order (1 where every
    rank holds the same bytes). Data-parallel replicas share the tiers (one host tier and one store)."""
    if not (config.prefix_cache_host_bytes or config.prefix_cache_store):
        return None
    if rank_layout.window is not None:
        log.info("prefix tiers off: every layer slides a window, so whole prefixes are not kept")
        return None
    store = None
    if config.prefix_cache_store:
        namespaces = [kv_identity(config, source, model, rank_layout, max_positions, rank).namespace()
                      for rank in range(shards)]
        store = RankStores([KVStore(config.prefix_cache_store, ns, config.storage_options) for ns in namespaces])
        log.info("prefix store %s, namespace %s", redact(config.prefix_cache_store), ", ".join(namespaces))
    nbytes = rank_layout.bytes_per_block(config.block_size, config.kv_torch_dtype) * shards
    return PrefixTiers(config.block_size, nbytes, config.prefix_cache_host_bytes, store)


__all__ = ["KVIdentity", "KVStore", "PrefixTiers", "RankStores", "build_prefix_tiers", "kv_identity"]
