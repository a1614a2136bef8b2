"""CPU decode with the block manager's rules for runs of blocks against a rule before them, two engines in one
process.

    python benchmarks/block_runs_ab.py [--model smollm2-135m-instruct] [--batches 8 64] [--prompt-len 128]
                                       [--new-tokens 128] [--rounds 10] [--prefix-caching] [--kv-cache-blocks N]
                                       [--against no-earmarks|blank-partial-blocks|oldest-first]
                                       [--stream REQUESTS]

An admitted sequence earmarks free blocks after its prompt's for the tokens it may still generate
(``BlockManager.max_earmark``), so its decode steps extend one run of blocks. With ``--against no-earmarks``
(``max_earmark = 0``) the other engine's rows take the next free block as they cross a block boundary; a batch's
rows cross together, so their new blocks interleave (row r's at 512 + r, 576 + r, ...), and once freed they
scatter later prompts' blocks too. With ``--against blank-partial-blocks`` the other engine keeps the earmarks but
puts a freed block with no hash (a sequence's partial last block) on the blank stack, where the next prompt takes
it, as the block manager did before; with prefix caching it now waits with the cached blocks, in the order blocks
were freed, and comes back with its sequence's run. With ``--against oldest-first`` the other engine evicts the
oldest cached blocks, wherever they lie (``eviction_window = 1``), where the block manager now picks whole runs
among more of the oldest.

The two engines decode the same ``--batch`` new random prompts each round, ``--new-tokens`` each, taking turns
(the order alternating between rounds: this machine's speed moves by a quarter between minutes, so only ratios
taken in turns count); each engine keeps its own cache's history, as an engine running a job does. The first round
starts from fresh caches. With ``--prefix-caching`` (the engine's default) freed blocks stay cached until evicted;
``--kv-cache-blocks`` sizes the caches so that they turn over within the rounds. Prints decode tok/s (the engines'
decode-only steps) for each, the median of the rounds' ratios and every round's, the share of the rows' block
pairs that lie next to each other at the last round's last full step, and whether both decoded the same tokens,
with ``get_cpu_capability()`` and whether ``amx_bf16`` is in /proc/cpuinfo. With ``--stream N`` each round is N
requests of 200-700 random tokens and 16-48 out, as a job's rows come, at most the batch's rows at once (the
adjacent share then counts every step of the last round).
"""
from __future__ import annotations

import argparse
import random
import statistics

import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.core.block_manager import BlockManager
from decode_workload import adjacent_share, amx_bf16_in_cpuinfo, kv_bytes_per_token, random_prompts


def blank_partial_blocks(bm: BlockManager) -> None:
    """The rule before: a freed block that is not findable by hash goes on the blank stack, taken first."""
    def release(block_id: int) -> None:
        block = bm.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None and bm.hash_to_block.get(block.hash) == block_id:
                bm.cached[block_id] = None
            else:
                block.hash, block.token_ids = None, ()
                bm.blank.append(block_id)
    bm._release = release


Requests = list[tuple[list[int], int]]  # (prompt, tokens out)


def decode(llm: LLM, requests: Requests) -> tuple[float, float, list[list[int]]]:
    """(decode tok/s; the share of adjacent block pairs in the running rows' tables: over every step with a
    stream, else at the last step with every row running; tokens out)."""
    engine = llm.engine
    engine.reset_metrics()
    seqs = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p, n in requests]
    share, pairs = 0.0, [0, 0]
    while engine.has_unfinished():
        engine.step()
        tables = [s.block_table for s in engine.scheduler.running]
        if len(tables) == len(requests):
            share = adjacent_share(tables)
        pairs[0] += sum(b == a + 1 for t in tables for a, b in zip(t, t[1:]))
        pairs[1] += sum(max(0, len(t) - 1) for t in tables)
    m = engine.metrics
    adjacent = share or pairs[0] / max(1, pairs[1])
    return m.decode_tokens / m.decode_time_s, adjacent, [s.completion_token_ids for s in seqs]


def stream(vocab: int, count: int, seed: int) -> Requests:
    """``count`` requests of 200-700 random tokens, 16-48 out, as a job's rows come."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(200, 700))], rng.randint(16, 48))
            for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--kv-cache-blocks", type=int, help="KV cache size in blocks (default: the engine's budget)")
    ap.add_argument("--stream", type=int, metavar="REQUESTS",
                    help="each round, this many requests of 200-700 tokens, 16-48 out, at most --batches rows at once")
    ap.add_argument("--against", choices=["no-earmarks", "blank-partial-blocks", "oldest-first"], default="no-earmarks",
                    help="the other engine's rule")
    args = ap.parse_args()

    for batch in args.batches:
        settings = dict(dtype=args.dtype, device="cpu", max_num_seqs=batch, enable_prefix_caching=args.prefix_caching,
                        max_num_batched_tokens=max(4096 if args.stream else 2048, batch * args.prompt_len))
        if args.kv_cache_blocks:
            probe = LLM(args.model, **settings, kv_cache_memory=64 << 20)
            settings["kv_cache_memory"] = args.kv_cache_blocks * kv_bytes_per_token(probe) * probe.config.block_size
            del probe
        llms = {name: LLM(args.model, **settings) for name in ("runs", "before")}
        if args.against == "no-earmarks":
            llms["before"].engine.block_manager.max_earmark = 0
        elif args.against == "oldest-first":
            llms["before"].engine.block_manager.eviction_window = 1
        else:
            blank_partial_blocks(llms["before"].engine.block_manager)
        if batch == args.batches[0]:
            workload = (f"a stream of {args.stream} requests of 200-700 tokens, 16-48 out" if args.stream else
                        f"prompts of {args.prompt_len} tokens, {args.new_tokens} out")
            print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, amx_bf16 in /proc/cpuinfo: "
                  f"{amx_bf16_in_cpuinfo()}, threads {torch.get_num_threads()}, "
                  f"dtype {llms['runs'].engine.config.dtype_choice.name}; {workload}; "
                  f"prefix caching {args.prefix_caching}; "
                  f"{len(llms['runs'].engine.block_manager.blocks)} blocks a cache")
        vocab = llms["runs"].tokenizer.vocab_size
        for llm in llms.values():
            decode(llm, [(p, 4) for p in random_prompts(vocab, batch, args.prompt_len, seed=0)])  # records steps
        rates: dict[str, list[float]] = {name: [] for name in llms}
        shares, tokens = {}, {}
        for r in range(args.rounds):
            # new prompts each round: no prefix hits
            requests = (stream(vocab, args.stream, seed=1 + r) if args.stream else
                        [(p, args.new_tokens) for p in random_prompts(vocab, batch, args.prompt_len, seed=1 + r)])
            for name in list(llms) if r % 2 == 0 else list(llms)[::-1]:
                rate, shares[name], tokens[name] = decode(llms[name], requests)
                rates[name].append(rate)
            if tokens["runs"] != tokens["before"]:
                raise SystemExit("the two engines decoded different tokens")
        ratios = [a / b for a, b in zip(rates["runs"], rates["before"], strict=True)]
        print(f"batch={batch} against={args.against} runs_tok_s={statistics.median(rates['runs']):.1f} "
              f"before_tok_s={statistics.median(rates['before']):.1f} "
              f"ratio={statistics.median(ratios):.3f}x rounds=[{', '.join(f'{x:.3f}' for x in ratios)}] "
              f"adjacent_blocks={shares['runs']:.2f}/{shares['before']:.2f} same_tokens=yes")
        del llms


if __name__ == "__main__":
    main()
