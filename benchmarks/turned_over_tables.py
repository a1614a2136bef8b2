"""The CPU decode op over the block tables of a cache that has turned over, against the same rows laid out in order.

    python benchmarks/turned_over_tables.py [--model smollm2-135m-instruct] [--requests 120] [--batch 16]
                                            [--prompt-lens 200 700] [--kv-cache-mib 400] [--layers 30] [--rounds 5]
                                            [--eviction-window N]

A fresh engine hands each sequence blocks in order; a job that has run through its KV budget hands out blocks its
finished sequences freed, wherever they lie. This runs a job-like stream (prompts of 200-700 random tokens by default,
16-48 out, prefix caching on) through a cache small enough to turn over, keeps the block tables and contexts of its
last full decode steps, and times the decode op over random caches of SmolLM2's shape through those tables and
through tables giving each row consecutive blocks (rounds alternating). Prints how often a row's next block
follows its last, the median time ratio, and the CPU's vector level and whether it has AMX. ``--eviction-window 1``
evicts the oldest cached blocks wherever they lie (the block manager picks runs among more of the oldest).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu import ops
from batchgen.engine.backends.cpu.build import load_kernels
from batchgen.engine.executor.model_runner import padded_block_tables
from batchgen.engine.loading.hub import resolve_model_path
from decode_workload import adjacent_share, amx_bf16_in_cpuinfo

Tables = list[list[int]]


def turned_over_steps(args: argparse.Namespace) -> tuple[LLM, list[tuple[Tables, list[int]]]]:
    """The (block tables, context lengths) of the stream's full decode steps, in order."""
    llm = LLM(resolve_model_path(args.model), dtype="auto", device="cpu", max_num_seqs=args.batch,
              max_num_batched_tokens=4096, enable_prefix_caching=True, kv_cache_memory=args.kv_cache_mib << 20)
    if args.eviction_window is not None:
        llm.engine.block_manager.eviction_window = args.eviction_window
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    engine = llm.engine
    for _ in range(args.requests):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(*args.prompt_lens))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(16, 48), temperature=0, ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        if len(running) == args.batch and all(s.num_computed_tokens >= s.num_prompt_tokens for s in running):
            steps.append(([list(s.block_table) for s in running], [s.num_computed_tokens for s in running]))
    return llm, steps


def in_order(tables: Tables) -> Tables:
    out, start = [], 0
    for t in tables:
        out.append(list(range(start, start + len(t))))
        start += len(t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=(200, 700), help="shortest and longest prompt")
    parser.add_argument("--kv-cache-mib", type=int, default=400)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--eviction-window", type=int, help="the block manager's (default: its own)")
    args = parser.parse_args()
    if not load_kernels():
        raise SystemExit("the CPU kernels are not built here")
    llm, steps = turned_over_steps(args)
    if len(steps) < 15:
        raise SystemExit(f"only {len(steps)} full decode steps: raise --requests")
    config = llm.engine.model_config
    kv_heads, head_dim = config.num_kv_heads, config.head_dim
    block_size = llm.engine.block_manager.block_size
    first, last = steps[: len(steps) // 3], steps[-(len(steps) // 3):]
    cases = [(padded_block_tables(t), padded_block_tables(in_order(t)), torch.tensor(c, dtype=torch.int32))
             for t, c in last[-5:]]
    blocks = 1 + max(int(torch.cat([t.flatten(), o.flatten()]).max()) for t, o, _ in cases)
    shape = (blocks, block_size, kv_heads, head_dim)
    caches = [(torch.randn(shape).to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16))
              for _ in range(args.layers)]
    q = torch.randn(args.batch, config.num_heads, head_dim).to(torch.bfloat16)

    def per_layer(tables: torch.Tensor, contexts: torch.Tensor) -> float:
        start = time.perf_counter()
        for k, v in caches:
            ops.paged_decode_attention(q, k, v, tables, contexts, head_dim ** -0.5)
        return (time.perf_counter() - start) / len(caches)

    ratios, engine_ms = [], []
    for r in range(args.rounds):
        for tables, ordered, contexts in cases:
            pair = [("engine", tables), ("in order", ordered)]
            times = dict((name, per_layer(t, contexts)) for name, t in (pair if r % 2 == 0 else pair[::-1]))
            ratios.append(times["engine"] / times["in order"])
            engine_ms.append(times["engine"] * 1e3)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, amx_bf16 {amx_bf16_in_cpuinfo()}, "
          f"threads {torch.get_num_threads()}; {len(steps)} full decode steps of {args.batch} rows, "
          f"{llm.engine.block_manager.num_free_blocks} blocks free at the end")
    early, late = (statistics.mean(adjacent_share(t) for t, _ in part) for part in (first, last))
    print(f"a row's next block follows its last: first third of the steps {early:.2f}, last third {late:.2f}")
    print(f"decode op over the last steps' tables: {statistics.median(engine_ms):.3f} ms a layer, "
          f"{statistics.median(ratios):.3f}x the time over tables in order (median of {len(ratios)})")


if __name__ == "__main__":
    main()
