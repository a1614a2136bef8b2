"""The real SmolLM2-135M-Instruct GGUF: greedy output equals HF transformers loading the same file."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Summarize in one sentence: The Gettysburg Address was delivered by Abraham Lincoln in 1863 at "
    "the dedication of a cemetery for soldiers who died in the Battle of Gettysburg.",
]


@pytest.fixture(scope="module")
def hf_gguf_model(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


def test_greedy_equals_transformers(smollm2_gguf, hf_gguf_model):
    llm = LLM(str(smollm2_gguf), dtype="float32", device="cpu", max_num_batched_tokens=64)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf_gguf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
        expected = ref[0, len(prompt):].tolist()
        eos = llm.engine.eos_ids
        if expected and expected[-1] in eos:
            assert out.finish_reason == "stop"
        assert out.token_ids == expected
    assert "Paris" in outs[0].text


def test_builtin_name_and_bf16_generation(smollm2_gguf):
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu")
    out = llm.generate([llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])],
                       SamplingParams(max_tokens=12, temperature=0))[0]
    assert "Paris" in out.text
