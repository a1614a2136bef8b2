"""batchgen's inference engine: paged KV cache, continuous batching, packed prefill."""
from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.llm import LLM
from batchgen.engine.sampling.params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
