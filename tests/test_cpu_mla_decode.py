"""The fused CPU latent (MLA) decode against fp64 and the torch MLA backend; bit-identical across threads and
runs; a tiny DeepSeek decoding through it gives the torch backend's tokens and logprobs (test_engine_parity
compares the CPU backend's, the default on CPU, with HF)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu import ops
from batchgen.engine.backends.cpu.mla import CpuMLABackend
from batchgen.engine.backends.cpu.row_methods import SmallRowsProducts
from batchgen.engine.backends.torch.mla import TorchMLABackend
from tests.engine_helpers import mixed_prompts, model_runner
from tests.test_cpu_decode import BLOCK, CONTEXTS, assert_as_good_as_torch, kernels  # noqa: F401 - a fixture

F32, BF16 = torch.float32, torch.bfloat16
DEEPSEEK = (512, 64)  # DeepSeek-V2/V3's kv_lora_rank and rope dims
SMALL = (32, 8)  # the tiny test models'
ODD = (36, 6)  # no whole vector steps at the rows' or the values' ends
DOTS = (64, 32)  # rows and values in 32-dim steps of different counts: bf16 takes the dot tiles where the CPU has them
# DeepSeek's width on fewer keys (the torch path pads every row to the longest); bf16 (emulated here) tinier.
DEEPSEEK_CONTEXTS = [1, 15, 16, 17, 255, 256, 257, 1000, 4096]
BF16_CONTEXTS = [1, 17, 300]


@dataclass
class LatentStep:
    q: torch.Tensor  # (B, H, R + P), a strided view with unit last stride
    cache: torch.Tensor  # (blocks, BLOCK, R + P)
    tables: torch.Tensor  # int32 (B, widest), -1 past each row's blocks
    context_lens: torch.Tensor  # int32 (B,)
    value_dim: int

    @property
    def max_context(self) -> int:
        return int(self.context_lens.max())


def latent_step(dtype, heads: int, dims: tuple[int, int], contexts=CONTEXTS, seed: int = 0) -> LatentStep:
    """One decode query per context; the rows' blocks shuffled through the cache, with unused blocks (holes)
    between them. Values are bf16-representable, so the fp32 and bf16 steps hold the same numbers."""
    rank, rope = dims
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(len(contexts), heads, rank + rope + 8, generator=gen).bfloat16().to(dtype)
    per_row = [-(-c // BLOCK) for c in contexts]
    total = sum(per_row)
    ids = torch.randperm(2 * total, generator=gen)[:total].int()  # half the cache's blocks never used
    tables = torch.full((len(contexts), max(per_row) + 2), -1, dtype=torch.int32)
    for i, (start, n) in enumerate(zip(torch.tensor([0, *per_row]).cumsum(0).tolist(), per_row)):
        tables[i, :n] = ids[start:start + n]
    cache = 2 * torch.randn(2 * total, BLOCK, rank + rope, generator=gen).bfloat16().to(dtype)
    return LatentStep(wide[..., :rank + rope], cache, tables, torch.tensor(contexts, dtype=torch.int32), rank)


def fp64_latent(step: LatentStep, scale: float) -> torch.Tensor:
    """All heads over the row's cached latent rows in float64: keys the whole rows, values their prefix."""
    out = torch.empty(*step.q.shape[:2], step.value_dim, dtype=torch.float64)
    for i, ctx in enumerate(step.context_lens.tolist()):
        positions = torch.arange(ctx)
        rows = step.cache[step.tables[i, positions // BLOCK].long(), positions % BLOCK].double()  # (n, W)
        probs = (step.q[i].double() @ rows.T * scale).softmax(-1)
        out[i] = probs @ rows[:, :step.value_dim]
    return out


def fused(step: LatentStep, scale: float, split_keys: int = ops.SPLIT_KEYS) -> torch.Tensor:
    return ops.latent_decode_attention(step.q, step.cache, step.tables, step.context_lens, step.value_dim, scale,
                                       split_keys)


def torch_path(step: LatentStep, scale: float) -> torch.Tensor:
    return TorchMLABackend().decode(step.q, step.cache, step.tables, step.context_lens, step.max_context,
                                    step.value_dim, scale)


CASES = [(F32, heads, dims, contexts) for heads in (1, 16)
         for dims, contexts in ((DEEPSEEK, DEEPSEEK_CONTEXTS), (SMALL, CONTEXTS))]
CASES += [(BF16, heads, SMALL, BF16_CONTEXTS) for heads in (1, 16)]
CASES += [(BF16, 16, DEEPSEEK, BF16_CONTEXTS), (BF16, 5, DOTS, BF16_CONTEXTS)]
CASES.append((F32, 5, ODD, CONTEXTS))  # 5 heads: whole register tiles of heads and a partial one


@pytest.mark.parametrize("dtype, heads, dims, contexts", CASES,
                         ids=[f"{'fp32' if d == F32 else 'bf16'}-H{h}-R{r[0]}" for d, h, r, _ in CASES])
def test_latent_decode_against_fp64_and_torch(kernels, dtype, heads, dims, contexts):
    step = latent_step(dtype, heads, dims, contexts)
    scale = {DEEPSEEK: 192, SMALL: 24, ODD: 20, DOTS: 48}[dims] ** -0.5  # nope + rope head dims, not the latent width
    ours = fused(step, scale)
    assert ours.shape == (len(contexts), heads, dims[0]) and ours.dtype == dtype
    assert_as_good_as_torch(ours, torch_path(step, scale), fp64_latent(step, scale), dtype)


def test_split_size_changes_nothing_but_rounding(kernels):
    step = latent_step(F32, 16, SMALL, seed=2)
    exact, theirs = fp64_latent(step, 0.2), torch_path(step, 0.2)
    for split_keys in (7, 64, 1000):  # 7: splits shorter than a 16-row chunk and not a divisor of a block
        assert_as_good_as_torch(fused(step, 0.2, split_keys), theirs, exact, F32)


def test_latent_decode_rejects_bad_input(kernels):
    step = latent_step(F32, 4, SMALL, contexts=[5, 40])

    def call(**changes):
        args = dict(q=step.q, cache=step.cache, block_tables=step.tables, context_lens=step.context_lens,
                    value_dim=step.value_dim, scale=0.2) | changes
        return ops.latent_decode_attention(**args)

    with pytest.raises(RuntimeError, match="share one dtype"):
        call(cache=step.cache.bfloat16())
    with pytest.raises(RuntimeError, match="outside 1.."):
        call(context_lens=torch.tensor([5, 10_000], dtype=torch.int32))
    holed = step.tables.clone()
    holed[1, 1] = -1
    with pytest.raises(RuntimeError, match="reads block -1 outside the cache"):
        call(block_tables=holed)
    with pytest.raises(RuntimeError, match="value_dim 41 outside 1..40"):
        call(value_dim=41)
    with pytest.raises(RuntimeError, match="rows as wide as q's"):
        call(cache=step.cache[..., :32].contiguous())


def test_backend_sends_its_dtypes_to_the_op_and_others_to_torch(kernels, monkeypatch):
    step = latent_step(F32, 4, SMALL, contexts=[3, 70, 300], seed=3)
    backend, calls, expected = CpuMLABackend(), [], fused(step, 0.2)
    op = ops.latent_decode_attention
    monkeypatch.setattr(ops, "latent_decode_attention", lambda *a, **k: calls.append(a) or op(*a, **k))
    got = backend.decode(step.q, step.cache, step.tables, step.context_lens, step.max_context, step.value_dim, 0.2)
    assert len(calls) == 1 and torch.equal(got, expected)
    half = LatentStep(step.q.half(), step.cache.half(), step.tables, step.context_lens, step.value_dim)
    got = backend.decode(half.q, half.cache, half.tables, half.context_lens, half.max_context, half.value_dim, 0.2)
    assert len(calls) == 1 and torch.equal(got, torch_path(half, 0.2))


# Shapes for the determinism test: DeepSeek's widths over many splits, the small and odd ones, bf16.
STRESS = [(F32, 16, DEEPSEEK, DEEPSEEK_CONTEXTS), (F32, 1, SMALL, CONTEXTS), (F32, 16, SMALL, CONTEXTS),
          (F32, 5, ODD, CONTEXTS), (BF16, 16, SMALL, BF16_CONTEXTS), (BF16, 16, DEEPSEEK, BF16_CONTEXTS),
          (BF16, 5, DOTS, BF16_CONTEXTS)]


def stress_runs(threads: int, repeats: int) -> list[list[torch.Tensor]]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [[fused(latent_step(dtype, heads, dims, contexts, seed=seed), 0.1)
                 for seed, (dtype, heads, dims, contexts) in enumerate(STRESS)] for _ in range(repeats)]
    finally:
        torch.set_num_threads(previous)


def test_bit_identical_across_thread_counts_and_runs(kernels):
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to compare against")
    reference = stress_runs(1, 1)[0]
    for run in stress_runs(2, 2) + stress_runs(1, 1):
        for got, expected in zip(run, reference, strict=True):
            assert torch.equal(got, expected)


def test_deepseek_decodes_through_the_op_like_the_torch_backend(kernels, tiny_model_factory, monkeypatch):
    """Decode-only steps and the decode rows of mixed steps (a small token budget) all go through the op,
    a step's rows in one call per layer; tokens and logprobs are the torch backend's."""
    decode_rows, op = [], ops.latent_decode_attention
    monkeypatch.setattr(ops, "latent_decode_attention",
                        lambda q, *a, **k: decode_rows.append(len(q)) or op(q, *a, **k))
    path = str(tiny_model_factory("deepseek-v3"))
    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64, kv_cache_memory=4 << 20)
    fused_llm, plain = LLM(path, **kw), LLM(path, attention_backend="torch", **kw)
    assert model_runner(fused_llm).kernels.mla.name == "cpu" and model_runner(plain).kernels.mla.name == "torch"
    latent = [m for m in model_runner(fused_llm).model.modules() if hasattr(m, "absorbed")]
    assert latent and all(isinstance(m.absorbed, SmallRowsProducts) for m in latent)  # small_bmm's products
    prompts = mixed_prompts(fused_llm, repeats=(1, 9, 3))  # the longest past one 256-key split
    assert max(map(len, prompts)) > ops.SPLIT_KEYS
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    got, expected = fused_llm.generate(prompts, params), plain.generate(prompts, params)
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4
    assert decode_rows and max(decode_rows) > 1
