"""Mixture-of-experts models: routing and expert compute against references, loading, parity with HF, a job."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from batchgen.cli import main
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.select import make_kernel_set
from batchgen.engine.backends.torch.ops import fused_moe
from batchgen.engine.layers.moe import FusedMoE, TopKRouter
from batchgen.engine.models.qwen_moe import QwenMoeRouter
from batchgen.engine.models.registry import build_model, model_config
from batchgen.engine.parallel import CommGroup, ParallelContext
from tests.job_helpers import check_output, records, spec_dict, write_jsonl
from tests.tiny_models import MLA_ARCHS, MOE_ARCHS


def naive_moe(x, w13, w2, weights, ids) -> torch.Tensor:
    """One token and one chosen expert at a time, in float64."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += w * (w2[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (4, 2), (16, 4)])
@pytest.mark.parametrize("routing", ["random", "one_expert", "every_expert"])
def test_fused_moe_matches_a_per_token_reference(dtype, num_experts, top_k, routing):
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    tokens, hidden, size = 19, 32, 24
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * size, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(num_experts, hidden, size, generator=gen) * 0.2).to(dtype)
    if routing == "random":
        ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    elif routing == "one_expert":  # every token's first choice is the last expert; the others get few or none
        ids = (torch.arange(top_k).expand(tokens, top_k) + num_experts - 1) % num_experts
    else:
        ids = (torch.arange(tokens)[:, None] + torch.arange(top_k)) % num_experts
    weights = torch.rand(tokens, top_k, generator=gen)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids), **tol)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, hidden)
    # Pairs marked -1 belong to another expert-parallel rank: they add nothing.
    elsewhere = torch.rand(tokens, top_k, generator=gen) < 0.5
    kept = weights.masked_fill(elsewhere, 0.0)
    skipped = fused_moe(x, w13, w2, weights, ids.masked_fill(elsewhere, -1), skip_negative=True)
    torch.testing.assert_close(skipped.double(), naive_moe(x, w13, w2, kept, ids), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routers_match_transformers(dtype):
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=dtype)
    cases = [(MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)),
              TopKRouter(32, 8, 2, renormalize=True))]
    for norm in (False, True):
        hf_cfg = Qwen2MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
        cases.append((Qwen2MoeTopKRouter(hf_cfg), QwenMoeRouter(32, 8, 3, renormalize=norm)))
    for hf, ours in cases:
        hf.weight.data = torch.randn(8, 32).to(dtype)
        ours.weight.data = hf.weight.data.clone()
        _, hf_weights, hf_ids = hf(x)
        weights, ids = ours(x)
        assert weights.dtype == torch.float32 and torch.equal(ids, hf_ids)
        assert torch.equal(weights, hf_weights.float())


def test_expert_loaders_stack_slice_and_take_stacked_checkpoints():
    kernels = make_kernel_set("torch")
    gate, up, down = torch.randn(3, 8, 4), torch.randn(3, 8, 4), torch.randn(3, 4, 8)
    whole = FusedMoE(3, 4, 8, kernels)
    for e in range(3):
        whole.weight_loader(whole.gate_up_proj, gate[e], (e, "gate"))
        whole.weight_loader(whole.gate_up_proj, up[e], (e, "up"))
        whole.weight_loader(whole.down_proj, down[e], (e, "down"))
    assert torch.equal(whole.gate_up_proj, torch.cat([gate, up], dim=1)) and torch.equal(whole.down_proj, down)
    stacked = FusedMoE(3, 4, 8, kernels)  # transformers >= 5 layout: one tensor per projection
    stacked.weight_loader(stacked.gate_up_proj, torch.cat([gate, up], dim=1))
    stacked.weight_loader(stacked.down_proj, down)
    assert torch.equal(stacked.gate_up_proj, whole.gate_up_proj) and torch.equal(stacked.down_proj, down)
    x, weights, ids = torch.randn(5, 4), torch.rand(5, 2), torch.randint(0, 3, (5, 2))
    partial = torch.zeros(5, 4)
    for rank in range(2):  # each rank holds half of every expert's intermediate; the outputs add up
        shard = FusedMoE(3, 4, 8, kernels, ParallelContext(tp=CommGroup(rank, 2)))
        for e in range(3):
            for kind, t in (("gate", gate), ("up", up), ("down", down)):
                shard.weight_loader(shard.gate_up_proj if kind != "down" else shard.down_proj, t[e], (e, kind))
        assert torch.equal(shard.down_proj, down[:, :, 4 * rank:4 * rank + 4])
        partial += fused_moe(x, shard.gate_up_proj, shard.down_proj, weights, ids)  # before the all-reduce
    torch.testing.assert_close(partial, whole(x, weights, ids))
    with pytest.raises(ValueError, match="no expert shard"):
        whole.weight_loader(whole.down_proj, down[0], (3, "down"))
    with pytest.raises(ValueError, match=r"shape \(8, 4\) does not fit"):
        whole.weight_loader(whole.down_proj, gate[0], (0, "down"))


def test_expert_parallel_ranks_read_only_their_experts(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from batchgen.engine.loading.model_source import LazyTensor

    kernels = make_kernel_set("torch")
    gate_up, down = torch.randn(4, 16, 4), torch.randn(4, 4, 8)
    save_file({"gate_up": gate_up, "down": down}, str(tmp_path / "w.safetensors"))
    handle = safe_open(str(tmp_path / "w.safetensors"), framework="pt", device="cpu")
    reads = []

    class Counted(LazyTensor):
        def load(self):
            reads.append(self.shape.numel())
            return super().load()

    whole = FusedMoE(4, 4, 8, kernels)
    whole.weight_loader(whole.gate_up_proj, gate_up)
    whole.weight_loader(whole.down_proj, down)
    x, weights, ids = torch.randn(6, 4), torch.rand(6, 2), torch.randint(0, 4, (6, 2))
    total = torch.zeros(6, 4)
    for rank in range(2):  # experts 0-1 on rank 0, 2-3 on rank 1, from the stacked tensors
        shard = FusedMoE(4, 4, 8, kernels, ParallelContext(dp=CommGroup(rank, 2), expert_parallel=True))
        shard.weight_loader(shard.gate_up_proj, Counted(handle.get_slice("gate_up")))
        shard.weight_loader(shard.down_proj, Counted(handle.get_slice("down")))
        assert shard.experts == range(2 * rank, 2 * rank + 2) and shard.gate_up_proj.shape == (2, 16, 4)
        assert torch.equal(shard.down_proj, down[2 * rank:2 * rank + 2])
        shard.weight_loader(shard.down_proj, Counted(handle.get_slice("down")).select(0, 3 - 2 * rank),
                            (3 - 2 * rank, "down"))  # another rank's expert: skipped, not read
        total += shard(x, weights, ids)
    assert sum(reads) == gate_up.numel() + down.numel()
    torch.testing.assert_close(total, whole(x, weights, ids))
    with pytest.raises(ValueError, match="cannot be split evenly over 2"):
        FusedMoE(3, 4, 8, kernels, ParallelContext(dp=CommGroup(0, 2), expert_parallel=True))


def test_missing_expert_is_named(tiny_model_factory):
    folder = tiny_model_factory("qwen2-moe")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    cfg = model_config(json.loads((folder / "config.json").read_text()))
    model = build_model(cfg, make_kernel_set("torch"), 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"missing weights: layers\.2\.mlp\.experts\.gate_up_proj\[expert 5 up\]$"):
        model.load_weights(weights.items())


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_profile_counts_active_experts_like_transformers(tiny_model_factory, arch):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_factory(arch)
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    named = dict(hf.named_parameters())
    dense = sum(p.numel() for n, p in named.items() if n.endswith(("proj.weight", "gate.weight"))
                and ".experts." not in n)
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    moe = llm.engine.model_config.moe
    profile = llm.profile()
    assert profile.active_params == dense + experts * moe.top_k // moe.num_experts
    assert profile.total_params == sum(p.numel() for p in hf.parameters())
    assert profile.active_params < profile.total_params - hf.lm_head.weight.numel() - experts // 2


@pytest.mark.parametrize("arch", ["qwen2-moe", "deepseek-v3"])
def test_job_runs_end_to_end_on_a_moe_folder(tiny_model_factory, tmp_path, arch):
    folder = tiny_model_factory(arch)
    spec = spec_dict(folder, write_jsonl(tmp_path / "in.jsonl", records(6)), tmp_path / "out")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    res = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    stats = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    rows = check_output(tmp_path / "out", stats, [f"r{i}" for i in range(6)])
    assert stats["ok_rows"] == 6 and all(r["completion_tokens"] > 0 for r in rows)
