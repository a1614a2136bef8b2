"""The decode benchmarks' shared workload and roofline: random prompts, and the M-row rate of the model's own matmuls.

Used by profile_decode.py and compare_hf_decode.py (scripts in this folder import it by name).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from batchgen.engine import LLM
from batchgen.engine.backends.cpu.build import load_kernels
from batchgen.engine.backends.cpu.memory import mapped_zeros
from batchgen.engine.backends.cpu.ops import amx_tiles
from batchgen.engine.backends.cpu.prepack import PrepackedLinear, prepacking_works
from batchgen.engine.backends.cpu.row_methods import AMX_ROWS, SMALL_ROWS, amx_rows_fit
from batchgen.engine.layers.linear import LinearBase, ParallelLMHead
from batchgen.engine.layers.moe import SparseMoeBlock


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn uniformly (ids 3.. skip the usual special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, length), generator=gen).tolist()


def linear_layers(llm: LLM) -> list[tuple[torch.nn.Module, tuple[int, int]]]:
    """The model's linear layers and its lm_head (a tied lm_head once) in the model's order, also where the CPU
    kernel set replaced them by prepacked bf16 layers, each with its (out, in)."""
    model = llm.engine.executor.runner.model
    ours = (LinearBase, ParallelLMHead, PrepackedLinear)
    return [(m, (m.out_features, m.in_features) if not hasattr(m, "weight") else tuple(m.weight.shape))
            for m in model.modules() if isinstance(m, ours) and (not hasattr(m, "weight") or m.weight.dim() == 2)]


def linear_shapes(llm: LLM) -> list[tuple[int, int]]:
    """(out, in) of :func:`linear_layers`."""
    return [shape for _, shape in linear_layers(llm)]


@dataclass(frozen=True)
class RoutedExperts:
    """A mixture-of-experts layer's routed experts, which :func:`linear_layers` leaves out: a token multiplies
    by ``top_k`` of the ``experts``, each of ``params`` parameters (gate, up and down)."""

    experts: int
    top_k: int
    params: int

    def distinct(self, batch: int) -> float:
        """Experts a step of ``batch`` tokens reads, expected under uniform routing."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** batch)


def routed_experts(llm: LLM) -> list[RoutedExperts]:
    model = llm.engine.executor.runner.model
    return [RoutedExperts(len(b.experts.slots), b.gate.top_k, 3 * b.experts.hidden_size * b.experts.local_size)
            for b in model.modules() if isinstance(b, SparseMoeBlock)]


def rows_matmul_rate(shapes: list[tuple[int, int]], rows: int, dtype: torch.dtype, windows: int = 7,
                     seconds: float = 0.15) -> float:
    """FLOP/s of ``x @ W^T`` with ``rows`` rows over the model's distinct linear shapes, weighted as the
    model runs them (each layer once): the rate a decode step of ``rows`` sequences could reach, by the faster
    of ``F.linear`` and, where the engine would use it, the fused small-row op (fp32), the AMX one (bf16) or
    the prepacked bf16 linear (bf16 without AMX: ``dot_linear`` where it runs, else oneDNN's). A bound is the best the machine reaches, so each path's rate
    is its best of ``windows`` timed windows (a shared machine's slow spells, which move a 1-second average by
    30-60 % here, would otherwise lower the bound)."""
    mats = {s: torch.randn(*s).to(dtype) for s in set(shapes)}
    inputs = {s: torch.randn(rows, s[1]).to(dtype) for s in set(shapes)}
    flops = sum(2 * rows * n * k for n, k in shapes)
    paths = [lambda s: torch.nn.functional.linear(inputs[s], mats[s])]
    if load_kernels():
        outs = {s: torch.empty(rows, s[0], dtype=dtype) for s in set(shapes)}
        if dtype == torch.float32 and rows <= SMALL_ROWS:
            paths.append(lambda s: torch.ops.batchgen_cpu.small_linear(inputs[s], mats[s], None, outs[s]))
        elif (dtype == torch.bfloat16 and rows <= AMX_ROWS and amx_tiles()
              and all(amx_rows_fit(w, None) for w in mats.values())):
            paths.append(lambda s: torch.ops.batchgen_cpu.amx_linear(inputs[s], mats[s], None, outs[s]))
        elif dtype == torch.bfloat16 and prepacking_works():
            packed = {s: PrepackedLinear(w, None) for s, w in mats.items()}
            paths.append(lambda s: packed[s](inputs[s]))

    def window(path) -> float:
        passes, start = 0, time.perf_counter()
        while passes < 1 or time.perf_counter() - start < seconds:
            for s in shapes:
                path(s)
            passes += 1
        return flops * passes / (time.perf_counter() - start)

    def rate(path) -> float:
        path(shapes[0])
        return max(window(path) for _ in range(windows))

    return max(rate(path) for path in paths)


def streamed_linears_rate(llm: LLM, rows: int, repeats: int = 5) -> float:
    """FLOP/s of the model's own linear layers (lm_head included), each called once in the model's order on
    ``rows`` random rows with nothing between them, as a decode step calls them: their weights stream from memory
    (a step reads all of them once), where ``rows_matmul_rate``'s stay in the caches. The best of ``repeats``
    passes, as that rate is the best of its windows."""
    layers = linear_layers(llm)
    dtype = llm.config.dtype_choice.torch_dtype
    inputs = [torch.randn(rows, k).to(dtype) for _, (_, k) in layers]
    flops = sum(2 * rows * n * k for _, (n, k) in layers)
    best = math.inf
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first pass warms up
            start = time.perf_counter()
            for (layer, _), x in zip(layers, inputs, strict=True):
                layer(x)
            best = min(best, time.perf_counter() - start)
    return flops / best


def kv_bytes_per_token(llm: LLM) -> int:
    """Bytes one token's K/V rows take in the paged cache, over all layers (MLA's latent row where it has one)."""
    model = llm.engine.executor.runner.model
    itemsize = llm.config.dtype_choice.torch_dtype.itemsize
    return sum(math.prod(shape) * itemsize for m in model.modules() if hasattr(m, "cache_token_shapes")
               for shape in m.cache_token_shapes())


def decode_flops_per_token(shapes: list[tuple[int, int]]) -> int:
    """Linear-layer FLOPs of one decoded token (lm_head included: every decode row samples)."""
    return sum(2 * n * k for n, k in shapes)


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s at which this machine's threads read a buffer far larger than its caches (a sum over it):
    the rate a decode step streams weights that do not stay cached from one step to the next. The buffer lies on
    transparent huge pages where the OS gives them, as a CPU engine's weights do (on 4 KiB pages a sum read
    24-29 GB/s where it read 30-32 on huge pages, on a 2-core AVX512-BF16 machine)."""
    raw, _ = mapped_zeros(megabytes << 20, huge_pages=True)
    x = raw.view(torch.float32).fill_(1.0)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / sorted(times)[repeats // 2]


@dataclass
class Roofline:
    """The fastest decode the linear layers allow with ``batch`` rows: a step takes at least their FLOPs at the
    M-row matmul rate and at least the time to read their weights from memory; tok/s is the lower bound.
    ``with_cache_tok_s`` also reads each row's cached K/V once a step (``cache_bytes_per_row``: its mean context's
    rows, all of them: a sliding window reads fewer): what a step must stream from memory besides the weights,
    which this roofline leaves out."""

    batch: int
    matmul_rate: float  # FLOP/s
    bandwidth: float  # bytes/s
    flops_per_token: int
    weight_bytes: int  # a step's: the linear layers', and the routed experts' it reads (expected)
    cache_bytes_per_row: int = 0

    @property
    def compute_tok_s(self) -> float:
        return self.matmul_rate / self.flops_per_token

    @property
    def memory_tok_s(self) -> float:
        return self.batch * self.bandwidth / self.weight_bytes

    @property
    def tok_s(self) -> float:
        return min(self.compute_tok_s, self.memory_tok_s)

    @property
    def with_cache_tok_s(self) -> float:
        step_bytes = self.weight_bytes + self.batch * self.cache_bytes_per_row
        return min(self.compute_tok_s, self.batch * self.bandwidth / step_bytes)


def roofline(shapes: list[tuple[int, int]], batch: int, dtype: torch.dtype, bandwidth: float,
             cache_bytes_per_row: int = 0, experts: list[RoutedExperts] = ()) -> Roofline:
    """The roofline of the linear layers ``shapes`` and the routed ``experts`` (their FLOPs at the same M-row rate,
    a bound; the experts a step reads by :meth:`RoutedExperts.distinct`)."""
    flops = decode_flops_per_token(shapes) + sum(2 * e.top_k * e.params for e in experts)
    weight_bytes = sum(n * k for n, k in shapes) + sum(e.distinct(batch) * e.params for e in experts)
    return Roofline(batch, rows_matmul_rate(shapes, batch, dtype), bandwidth, flops,
                    round(weight_bytes * dtype.itemsize), cache_bytes_per_row)


def mean_context(first: int, steps: int) -> float:
    """The mean number of cached tokens a row's decode steps read: ``first`` at the first step, one more each step."""
    return first + (steps - 1) / 2


def adjacent_share(tables: list[list[int]]) -> float:
    """The share of consecutive block pairs in ``tables`` whose second block directly follows the first."""
    pairs = [(a, b) for t in tables for a, b in zip(t, t[1:])]
    return sum(b == a + 1 for a, b in pairs) / max(1, len(pairs))


def amx_bf16_in_cpuinfo() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False
