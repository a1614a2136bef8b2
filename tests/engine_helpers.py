"""Reference computations with HF transformers for engine tests."""
from __future__ import annotations

import functools

import torch

from batchgen.engine import LLM
from batchgen.engine.executor.model_runner import ModelRunner

TEXT = ("Batch inference reads prompts, sorts them by length and writes outputs. "
        "The quick brown fox jumps over the lazy dog. Numbers like 12345 appear too. ")


def mixed_prompts(llm: LLM, repeats=(1, 5, 2, 9, 3)) -> list[list[int]]:
    """Prompts of very different lengths, as token ids."""
    return [llm.tokenizer.encode(f"{i}: " + TEXT * r) for i, r in enumerate(repeats)]


def model_runner(llm: LLM) -> ModelRunner:
    """The model runner of an engine whose model runs in this process (a single device)."""
    runner = getattr(llm.engine.executor, "runner", None)
    if runner is None:
        raise AttributeError("the model runs in worker processes: this process has no model runner")
    return runner


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                experts_implementation="eager").eval()


@torch.inference_mode()
def hf_logprobs(path: str, prompt: list[int], completion: list[int]) -> list[float]:
    """Log-probabilities HF assigns to ``completion`` after ``prompt``."""
    ids = torch.tensor([prompt + completion])
    logits = hf_model(path)(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model(path).generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_like_hf(path: str, prompts: list[list[int]], outs: list, tol: float = 1e-3) -> None:
    """Every output's greedy tokens are HF's, and its logprobs within ``tol`` of HF's for those tokens."""
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, len(out.token_ids))
        ref = hf_logprobs(path, prompt, out.token_ids)
        assert len(ref) == len(out.logprobs) and max(abs(a - b) for a, b in zip(out.logprobs, ref)) <= tol
