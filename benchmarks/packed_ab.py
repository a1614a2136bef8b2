"""Decode steps of a model with some of its weights packed by the CPU kernel set against the same weights as they
were before, in one engine: the bf16 experts in ``dot_linear``'s blocks against stacked as loaded (``--what
experts``), the latent attention's absorbed products packed against bmm (``--what latent``), or SwiGLU MLPs' gate|up
and activation in one op against the packed projection and then the ``silu_and_mul`` op (``--what gated``).

    python benchmarks/packed_ab.py --model /tmp/deepseek-v3-small [--what experts] [--batch 8] [--prompt-len 1024]
    python benchmarks/packed_ab.py --model smollm2-135m-instruct --what gated --batch 64 --prompt-len 128

Runs on CPUs where the engine packs them (AVX512-BF16 without AMX, bf16). ``--batch`` random prompts are
prefilled, then decode steps run eagerly (recorded replays would keep whichever weights they recorded) in blocks
of 3 after one to settle, the two variants taking turns block by block, the order turning round by round, so a
shared machine's drift falls on both alike. Prints the median step of each and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu import prepack
from batchgen.engine.layers.mla import BMM_PRODUCTS, MLAAttention
from batchgen.engine.layers.mlp import PROJECT_THEN_ACTIVATE, GatedMLP
from batchgen.engine.layers.moe import UNQUANTIZED_MOE, FusedMoE
from batchgen.engine.loading.hub import resolve_model_path
from decode_workload import random_prompts

BLOCK_STEPS = 3


def unpack(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """``prepack.pack_dot_experts``' inverse: (E, N/48, K/2, 48, 2) -> (E, rows, K)."""
    e, blocks, pairs, width, two = packed.shape
    return packed.permute(0, 1, 3, 2, 4).reshape(e, blocks * width, pairs * two)[:, :rows].contiguous()


def unpack_gated(packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``prepack.pack_dot_gated``'s inverse for stacked experts: (E, 2 I/48, K/2, 48, 2) -> (E, 2I, K), gate|up."""
    e = packed.shape[0]
    halves = packed.view(e, -1, 2, *packed.shape[2:]).transpose(1, 2).flatten(0, 1)  # (2E, I/48, K/2, 48, 2)
    return unpack(halves, intermediate).view(e, 2 * intermediate, -1)


def variants(model: torch.nn.Module, what: str) -> dict[str, list[tuple[torch.nn.Module, dict]]]:
    """Per variant, each module and the attributes that make it so."""
    out: dict[str, list[tuple[torch.nn.Module, dict]]] = {"packed": [], "unpacked": []}
    for m in model.modules():
        if what == "experts" and isinstance(m, FusedMoE) and m.quant_method is prepack.DOT_EXPERTS_METHOD:
            out["packed"].append((m, dict(gate_up_proj=m.gate_up_proj, down_proj=m.down_proj,
                                          quant_method=m.quant_method)))
            stacked = (unpack_gated(m.gate_up_proj.data, m.local_size), unpack(m.down_proj.data, m.hidden_size))
            out["unpacked"].append((m, dict(gate_up_proj=torch.nn.Parameter(stacked[0], requires_grad=False),
                                            down_proj=torch.nn.Parameter(stacked[1], requires_grad=False),
                                            quant_method=UNQUANTIZED_MOE)))
        elif what == "latent" and isinstance(m, MLAAttention) and isinstance(m.absorbed, prepack.DotAbsorbedProducts):
            out["packed"].append((m, dict(absorbed=m.absorbed)))
            out["unpacked"].append((m, dict(absorbed=BMM_PRODUCTS)))
        elif what == "gated" and isinstance(m, GatedMLP) and m.gate_up_activation is prepack.DOT_GATE_UP:
            fused = m.gate_up_proj
            weight = unpack_gated(fused.packed.unsqueeze(0), fused.intermediate).squeeze(0)
            bias = None if fused.bias is None else \
                fused.bias.view(-1, 2, prepack.DOT_BLOCK).transpose(0, 1).flatten(1)[:, : fused.intermediate].flatten()
            out["packed"].append((m, dict(gate_up_proj=fused, gate_up_activation=prepack.DOT_GATE_UP)))
            out["unpacked"].append((m, dict(gate_up_proj=prepack.PrepackedLinear(weight, bias),
                                            gate_up_activation=PROJECT_THEN_ACTIVATE)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--what", choices=["experts", "latent", "gated"], default="experts")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    llm = LLM(resolve_model_path(args.model), dtype="bfloat16", device="cpu", max_num_seqs=args.batch,
              max_num_batched_tokens=max(8192, args.batch * args.prompt_len), enable_prefix_caching=False,
              cuda_graphs="off")
    both = variants(llm.engine.executor.runner.model, args.what)
    if not both["packed"]:
        raise SystemExit(f"nothing packed to compare ({args.what}): this CPU or model keeps its weights as loaded")
    engine = llm.engine
    steps = 2 + args.rounds * 2 * (BLOCK_STEPS + 1)
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for prompt in random_prompts(llm.tokenizer.vocab_size, args.batch, args.prompt_len):
        engine.add_request(prompt, params)
    engine.step()  # the prefill
    engine.step()
    times: dict[str, list[float]] = {name: [] for name in both}
    for r in range(args.rounds):
        for name in (("packed", "unpacked") if r % 2 == 0 else ("unpacked", "packed")):
            for module, attributes in both[name]:
                for key, value in attributes.items():
                    setattr(module, key, value)
            engine.step()
            for _ in range(BLOCK_STEPS):
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}, bf16; "
          f"{args.what}: {len(both['packed'])} layers; batch {args.batch}, {args.prompt_len}-token prompts, "
          f"{len(times['packed'])} steps each")
    print(f"packed {ms['packed']:.1f} ms a step, unpacked {ms['unpacked']:.1f}: "
          f"{ms['unpacked'] / ms['packed']:.3f}x")


if __name__ == "__main__":
    main()
