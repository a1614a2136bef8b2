"""The same fp32 greedy run in fresh processes: is batchgen's output the same in each, and how far from HF?

    python benchmarks/parity_runs.py [--runs 5] [--model smollm2-135m-instruct] [--threads 2]

Twelve chat prompts, 24 tokens out each (greedy, no early stop, logprobs), fp32. HF transformers scores the
first run's tokens once (teacher-forced, one forward per prompt); each run, a fresh process whose allocations
land elsewhere, prints whether its tokens equal the first run's, the largest difference of its logprobs to the
first run's (0 when the run is bit-identical) and to HF's. A run that differs from the first with the same
inputs shows a race or an input-dependent path (memory alignment, thread timing) in the engine's kernels.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
             "Explain gravity briefly.", "Translate 'good morning' to Spanish.", "What is 17 times 3?",
             "Give a synonym for happy.", "Who wrote Hamlet?", "Describe a cat in five words.",
             "What color is the sky at noon?", "List two fruits.", "Why do leaves fall in autumn?"]
MAX_TOKENS = 24


def child(model: str, threads: int, pad: int) -> None:
    """One run: prints {"prompts", "tokens", "logprobs"} as JSON on its last line."""
    torch.set_num_threads(threads)
    _shift = [torch.empty(1 + 997 * i % 4093) for i in range(pad)]  # noqa: F841 - moves the later allocations
    from batchgen.engine import LLM, SamplingParams

    llm = LLM(model, dtype="float32", device="cpu")
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                                ignore_eos=True))
    print(json.dumps({"prompts": prompts, "tokens": [o.token_ids for o in outs],
                      "logprobs": [o.logprobs for o in outs]}))


def hf_logprobs(model: str, prompts: list[list[int]], tokens: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from batchgen.engine.loading.hub import resolve_model_path

    path = Path(resolve_model_path(model))
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent if kwargs else path), dtype=torch.float32,
                                              **kwargs).eval()
    out = []
    with torch.inference_mode():
        for prompt, toks in zip(prompts, tokens, strict=True):
            logits = hf(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            out.append(logits.gather(1, torch.tensor(toks)[:, None]).squeeze(1))
    return out


def where_different(got: dict, first: dict) -> str:
    """Where a run first parts from the first one: each differing prompt's first differing token position
    (a step of prefill is position 0), so that a difference can be traced to the step that made it."""
    parts = []
    for i, (a, b) in enumerate(zip(got["logprobs"], first["logprobs"], strict=True)):
        if len(a) != len(b):
            parts.append(f"prompt {i}: {len(a)} vs {len(b)} tokens")
            continue
        position = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if position is not None:
            parts.append(f"prompt {i} from token {position}")
    return f"; differs at {', '.join(parts)}" if parts else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.model, args.threads, args.child)
        return
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, amx_bf16 "
          f"{'amx_bf16' in Path('/proc/cpuinfo').read_text()}, threads {args.threads}, fp32, "
          f"{len(QUESTIONS)} prompts x {MAX_TOKENS} tokens")
    first, reference = None, None
    for run in range(args.runs):
        result = subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                                 "--child", str(run * 7)], capture_output=True, text=True, check=True)
        got = json.loads(result.stdout.strip().splitlines()[-1])
        if first is None:
            first = got
            reference = hf_logprobs(args.model, got["prompts"], got["tokens"])
        logprobs = [torch.tensor(lp) for lp in got["logprobs"]]
        same_tokens = got["tokens"] == first["tokens"]
        to_first = max((a - torch.tensor(b)).abs().max().item()
                       for a, b in zip(logprobs, first["logprobs"], strict=True)) if same_tokens else float("nan")
        to_hf = max((a - b).abs().max().item() for a, b in zip(logprobs, reference, strict=True)) \
            if same_tokens else float("nan")
        print(f"run {run + 1}: tokens {'same as' if same_tokens else 'DIFFER from'} run 1; max |logprob diff| "
              f"to run 1 {to_first:.2e}, to HF {to_hf:.2e}{where_different(got, first)}", flush=True)


if __name__ == "__main__":
    main()
