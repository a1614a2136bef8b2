"""What a prefix store already holds of planned prompts (``batchgen plan``): each prompt's block chain, looked
up by existence in the store, without loading weights."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from batchgen.engine.backends.select import make_kernel_set
from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.core.block_manager import chain_hash
from batchgen.engine.core.kv_cache import KVLayout
from batchgen.engine.kv_store import kv_identity
from batchgen.engine.kv_store.store import KVStore
from batchgen.engine.loading.hub import WEIGHT_SUFFIXES
from batchgen.engine.loading.model_source import ModelSource
from batchgen.engine.models.registry import build_model
from batchgen.engine.parallel.context import ParallelContext
from batchgen.engine.parallel.group import CommGroup
from batchgen.engine.quantization import choose_weight_methods

SAMPLE_PROMPTS = 256  # prompts looked up at most (a uniform sample of a larger job)
LOOKUP_THREADS = 8  # existence checks in flight (object stores answer each in a round trip)


@dataclass
class StoreEstimate:
    """Of ``sampled`` prompts (of ``prompts``), the ``prompt_tokens`` they hold and the ``store_tokens`` the
    store would serve: each prompt's full blocks up to the first one the store lacks."""

    namespace: str
    dtype: str
    prompts: int
    sampled: int
    prompt_tokens: int
    store_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.store_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PromptSample:
    """A uniform sample of at most ``size`` prompts from a stream of unknown length (reservoir sampling,
    seeded: the same job samples the same prompts)."""

    def __init__(self, size: int = SAMPLE_PROMPTS, seed: int = 0):
        self.size, self.seen, self.prompts = size, 0, []
        self._rng = random.Random(seed)

    def add(self, prompt: list[int]) -> None:
        self.seen += 1
        if len(self.prompts) < self.size:
            self.prompts.append(prompt)
            return
        slot = self._rng.randrange(self.seen)
        if slot < self.size:
            self.prompts[slot] = prompt


def rank_kv_layout(config: EngineConfig, model: ModelConfig, max_model_len: int) -> KVLayout:
    """What one tensor-parallel rank's cache holds per token, from the model's shape alone (built on meta)."""
    kernels = make_kernel_set("torch")
    # The cache's shapes do not depend on how the weights multiply: dequantized weights build anywhere.
    methods = choose_weight_methods(model.quantization, kernels, config.torch_device(), config.torch_dtype,
                                    "dequantize")
    rank0 = ParallelContext(tp=CommGroup(0, config.tensor_parallel_size), dp=CommGroup(0, config.data_parallel_size),
                            expert_parallel=config.expert_parallel(model))
    return build_model(model, kernels, max_model_len, config.torch_dtype, "meta", rank0, methods).kv_layout()


def has_local_weights(source: ModelSource) -> bool:
    path = Path(source.path)
    return path.is_file() or any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir())


def prompt_chain(prompt: list[int], block_size: int) -> list[int]:
    """Chain hashes of the full blocks a cached prefix of the prompt may cover (all but its last token)."""
    hashes: list[int] = []
    for start in range(0, (len(prompt) - 1) // block_size * block_size, block_size):
        hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(prompt[start:start + block_size])))
    return hashes


def estimate_store_hits(config: EngineConfig, source: ModelSource, model: ModelConfig, max_model_len: int,
                        sample: PromptSample) -> StoreEstimate:
    """Looks the sampled prompts' blocks up in ``config.prefix_cache_store`` (tensor-parallel rank 0's
    namespace: every rank writes its shard of a block together)."""
    identity = kv_identity(config, source, model, rank_kv_layout(config, model, max_model_len), max_model_len)
    store = KVStore(config.prefix_cache_store, identity.namespace(), config.storage_options)
    known: dict[int, bool] = {}  # prompts sharing a prefix look its blocks up once

    def stored_blocks(prompt: list[int]) -> int:
        n = 0
        for block_hash in prompt_chain(prompt, config.block_size):
            if block_hash not in known:
                known[block_hash] = store.exists(block_hash)
            if not known[block_hash]:
                break
            n += 1
        return n

    with ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kv-lookup") as pool:
        hits = list(pool.map(stored_blocks, sample.prompts))
    return StoreEstimate(identity.namespace(), identity.dtype, sample.seen, len(sample.prompts),
                         sum(map(len, sample.prompts)), sum(hits) * config.block_size)


