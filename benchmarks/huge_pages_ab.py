"""CPU decode with the model's weights on 4 KiB pages against transparent huge pages, in one process.

    python benchmarks/huge_pages_ab.py [--model smollm2-135m-instruct] [--batches 1 8 64] [--rounds 8] [--steps 24]

A CPU engine moves its weights (the kernels' prepacked copies included) into one mapping on transparent huge pages
once they are loaded (``weights_on_huge_pages``). Here one engine's weights go back and forth between that and a
mapping advised never to use huge pages (``MADV_NOHUGEPAGE``: 4 KiB pages whatever the system's THP setting),
the recorded decode steps recorded afresh after each move, and ``--steps`` decode steps of ``--batch`` random
prompts are timed each turn, the order alternating between rounds (this machine's speed moves by a quarter
between minutes: only ratios taken in turns count). Prints ms per step on each, the median of the rounds' ratios
and every round's, with ``get_cpu_capability()``, whether ``amx_bf16`` is in /proc/cpuinfo, the THP setting and
how much of the process's memory sits in huge pages after each move.
"""
from __future__ import annotations

import argparse
import mmap
import re
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu.memory import THP_SETTING, _movable_storages, weights_on_huge_pages
from decode_workload import amx_bf16_in_cpuinfo, random_prompts


def huge_page_mib() -> int:
    """This process's anonymous memory in transparent huge pages, MiB."""
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+)", rollup).group(1)) // 1024


@torch.inference_mode()
def weights_on_small_pages(model: nn.Module) -> int:
    """Moves the storages ``weights_on_huge_pages`` would move into mappings advised never to use huge pages;
    returns the bytes moved."""
    moved = 0
    for tensors in _movable_storages(model, 1 << 16):
        old = tensors[0].untyped_storage()
        region = mmap.mmap(-1, old.nbytes(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_NOHUGEPAGE)
        fresh = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping
        fresh.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
        for t in tensors:
            t.set_(fresh.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        moved += old.nbytes()
    return moved


def decode_ms(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """ms per decode step over ``steps`` steps, after the prefill and two decode steps."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(3):
        engine.step()
    start, done = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        done += 1
    return (time.perf_counter() - start) / done * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=max(args.batches),
              max_model_len=args.prompt_len + args.steps + 8)
    runner = llm.engine.executor.runner
    setting = THP_SETTING.read_text().strip() if THP_SETTING.exists() else "absent"
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, amx_bf16 in /proc/cpuinfo: "
          f"{amx_bf16_in_cpuinfo()}, threads {torch.get_num_threads()}, dtype {llm.engine.config.dtype_choice.name}; "
          f"THP {setting}; {huge_page_mib()} MiB in huge pages after the engine's build")

    def move(huge: bool) -> None:
        (weights_on_huge_pages if huge else weights_on_small_pages)(runner.model)
        runner.graphs = runner._graph_runner()  # recorded steps may hold views of the old memory: record afresh

    for batch in args.batches:
        prompts = random_prompts(llm.tokenizer.vocab_size, batch, args.prompt_len, seed=batch)
        times: dict[bool, list[float]] = {False: [], True: []}
        pages: dict[bool, int] = {}
        for r in range(args.rounds):
            for huge in (False, True) if r % 2 == 0 else (True, False):
                move(huge)
                pages[huge] = huge_page_mib()
                decode_ms(llm, prompts, 2)  # records this batch's step
                times[huge].append(decode_ms(llm, prompts, args.steps))
        ratios = [small / huge for small, huge in zip(times[False], times[True], strict=True)]
        print(f"batch={batch} small_pages_ms={statistics.median(times[False]):.2f} "
              f"huge_pages_ms={statistics.median(times[True]):.2f} ratio={statistics.median(ratios):.3f}x "
              f"rounds=[{', '.join(f'{x:.3f}' for x in ratios)}] huge_page_mib={pages[False]}/{pages[True]}")


if __name__ == "__main__":
    main()
