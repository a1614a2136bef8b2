"""CPU decode steps replayed from their C++ programs against the same recordings' Python loop, in one engine.

    python benchmarks/replay_ab.py [--model smollm2-135m-instruct] [--batch 8] [--prompt-len 128] [--rounds 20]

``--batch`` random prompts are prefilled and a few decode steps recorded; then blocks of 8 decode steps run with
the recordings' programs and with their loops in Python, taking turns, the order turning round by round, so a
shared machine's drift falls on both alike. Prints the median step of each and their ratio, with the CPU's
vector level and whether it has AMX.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.loading.hub import resolve_model_path
from decode_workload import amx_bf16_in_cpuinfo, random_prompts

BLOCK_STEPS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    llm = LLM(resolve_model_path(args.model), dtype=args.dtype, device="cpu", max_num_seqs=args.batch,
              max_num_batched_tokens=max(8192, args.batch * args.prompt_len), enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=8 + 2 * BLOCK_STEPS * args.rounds, temperature=0, ignore_eos=True)
    for prompt in random_prompts(llm.tokenizer.vocab_size, args.batch, args.prompt_len):
        engine.add_request(prompt, params)
    for _ in range(4):  # the prefill, then decode steps until this size is recorded
        engine.step()
    replays = engine.executor.runner.graphs
    recordings = getattr(replays, "recordings", {})
    if args.batch not in recordings or recordings[args.batch].program is None:
        raise SystemExit("no C++ program for this batch's recording (CPU kernels not built, or replays off)")
    programs = {size: r.program for size, r in recordings.items()}
    steps: dict[str, list[float]] = {"program": [], "python": []}
    for r in range(args.rounds):
        for mode in ("program", "python") if r % 2 == 0 else ("python", "program"):
            for size, recording in recordings.items():
                recording.program = programs[size] if mode == "program" else None
            start = time.perf_counter()
            for _ in range(BLOCK_STEPS):
                engine.step()
            steps[mode].append((time.perf_counter() - start) / BLOCK_STEPS)
    python, program = statistics.median(steps["python"]), statistics.median(steps["program"])
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, amx_bf16 {amx_bf16_in_cpuinfo()}, "
          f"threads {torch.get_num_threads()}, dtype {llm.config.dtype_choice.torch_dtype}; batch {args.batch}, "
          f"{args.rounds} rounds of {BLOCK_STEPS} steps each way")
    print(f"Python loop {python * 1e3:.2f} ms/step, program {program * 1e3:.2f} ms/step: {python / program:.3f}x")


if __name__ == "__main__":
    main()
