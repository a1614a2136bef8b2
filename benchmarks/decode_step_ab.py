"""Decode steps of the engine with the CPU decode op of the working tree against the op of a git revision.

    python benchmarks/decode_step_ab.py --baseline REV [--batch 64] [--prompt-len 128] [--rounds 3]

One engine, eager steps (recorded replays would keep whichever op they recorded): ``--batch`` random prompts of
``--prompt-len`` tokens are prefilled, then decode steps run in blocks of 8, the two ops taking turns block by
block (the order turns round by round), so a shared machine's drift falls on both alike. Prints the median step
of each and their ratio. The baseline's op is built as decode_cpu.py's ``--baseline`` builds it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu import ops
from batchgen.engine.loading.hub import resolve_model_path
from decode_cpu import load_baseline
from decode_workload import random_prompts

BLOCK_STEPS = 8


def baseline_op(namespace: str):
    """ops.paged_decode_attention's signature, calling the baseline revision's op (its portable path)."""
    def call(q, k_cache, v_cache, tables, lens, scale, sliding_window=None, softcap=None,
             split_keys=ops.SPLIT_KEYS, amx=None):
        out = torch.empty(q.shape, dtype=q.dtype)
        getattr(torch.ops, namespace).paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                                                             sliding_window or 0, softcap or 0.0, split_keys,
                                                             False, out)
        return out
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision whose decode op is the baseline")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=12, help="blocks of 8 steps a round, half for each op")
    args = ap.parse_args()
    ops_by_name = {"tree": ops.paged_decode_attention, "baseline": baseline_op(load_baseline(args.baseline))}
    llm = LLM(resolve_model_path(args.model), dtype="auto", device="cpu", max_num_seqs=args.batch,
              max_num_batched_tokens=max(8192, args.batch * args.prompt_len), enable_prefix_caching=False,
              cuda_graphs="off")
    prompts = random_prompts(llm.tokenizer.vocab_size, args.batch, args.prompt_len)
    engine, names = llm.engine, list(ops_by_name)
    steps: dict[str, list[float]] = {name: [] for name in names}
    params = SamplingParams(max_tokens=args.blocks * BLOCK_STEPS + 8, temperature=0, ignore_eos=True)
    try:
        for r in range(args.rounds):
            for prompt in prompts:
                engine.add_request(prompt, params)
            for _ in range(4):  # the prefill, then decode steps out of the timing
                engine.step()
            for block in range(args.blocks):
                name = names[(block + r) % 2]
                ops.paged_decode_attention = ops_by_name[name]
                for _ in range(BLOCK_STEPS):
                    start = time.perf_counter()
                    engine.step()
                    steps[name].append(time.perf_counter() - start)
            ops.paged_decode_attention = ops_by_name["tree"]
            while engine.has_unfinished():
                engine.step()
    finally:
        ops.paged_decode_attention = ops_by_name["tree"]
    median = {name: statistics.median(t) for name, t in steps.items()}
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}, "
          f"dtype {llm.config.dtype_choice.name}; batch {args.batch}, prompts of {args.prompt_len} tokens, "
          f"{len(steps['tree'])} steps each")
    for name in names:
        print(f"{name:>9}: {median[name] * 1e3:7.2f} ms/step  {args.batch / median[name]:7.0f} tok/s")
    print(f"tree over baseline: {median['baseline'] / median['tree']:.3f}x")


if __name__ == "__main__":
    main()
