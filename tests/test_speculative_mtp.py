"""The ``mtp`` method on tiny random DeepSeek-V3 checkpoints with a multi-token-prediction layer: it loads, drafts
what a reference of the MTP formulas (transformers' decoder layer inside) drafts, is lossless against spec off
(greedy and seeded sampling), counts its acceptance, and refuses what it cannot run."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.speculative import speculator as speculator_module
from tests.engine_helpers import TEXT, mixed_prompts, model_runner
from tests.test_deepseek import folder_config
from tests.test_speculative import Toggle, same_outputs
from tests.tiny_models import build_tiny_model

MTP = {"method": "mtp", "num_speculative_tokens": 3}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)


def with_mtp_layer(folder: Path, out: Path, layer: dict[str, torch.Tensor], main: dict | None = None,
                   nextn: int = 1) -> Path:
    """A copy of the checkpoint ``folder`` whose config says ``num_nextn_predict_layers`` = ``nextn`` and whose
    weights add ``layer`` under ``model.layers.{num_hidden_layers}.`` (``main`` replaces main-model tensors)."""
    shutil.copytree(folder, out)
    config = folder_config(folder)
    config["num_nextn_predict_layers"] = nextn
    (out / "config.json").write_text(json.dumps(config))
    weights = {**load_file(str(folder / "model.safetensors")), **(main or {})}
    prefix = f"model.layers.{config['num_hidden_layers']}."
    save_file({**weights, **{prefix + name: w.clone() for name, w in layer.items()}},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def random_mtp_layer(folder: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """The format above with random weights: the decoder layer a noisy copy of the last (MoE) layer."""
    weights, cfg = load_file(str(folder / "model.safetensors")), folder_config(folder)
    last, hidden = f"model.layers.{cfg['num_hidden_layers'] - 1}.", cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    layer = {name.removeprefix(last): w + 0.3 * w.std() * torch.randn(w.shape, generator=g)
             for name, w in weights.items() if name.startswith(last)}
    layer["mlp.gate.e_score_correction_bias"] = weights[last + "mlp.gate.e_score_correction_bias"]
    return {**layer, "enorm.weight": 0.5 + torch.rand(hidden, generator=g),
            "hnorm.weight": 0.5 + torch.rand(hidden, generator=g),
            "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
            "shared_head.norm.weight": 0.5 + torch.rand(hidden, generator=g),
            "shared_head.head.weight": 0.1 * torch.randn(cfg["vocab_size"], hidden, generator=g),
            "embed_tokens.weight": weights["model.embed_tokens.weight"] * (0.5 + torch.rand(cfg["vocab_size"], 1))}


@pytest.fixture(scope="module")
def random_mtp(tiny_model_factory, tmp_path_factory) -> Path:
    folder = tiny_model_factory("deepseek-v3")
    return with_mtp_layer(folder, tmp_path_factory.mktemp("mtp") / "random", random_mtp_layer(folder))


def make_llm(path: Path, spec: dict | None = MTP, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 4 << 20)
    kw.setdefault("max_num_batched_tokens", 48)  # chunked prefill: steps mix prompt chunks and decodes
    return LLM(str(path), dtype="float32", device="cpu", speculative_config=spec or {}, **kw)


@pytest.fixture(scope="module")
def random_llm(random_mtp):
    llm = make_llm(random_mtp)
    yield Toggle(llm)
    llm.close()


@pytest.fixture
def always_draft(monkeypatch):
    """The cost model out of the way: every decoding sequence drafts as many tokens as it may."""
    monkeypatch.setattr(speculator_module, "choose_draft_lengths", lambda rates, caps, *costs: list(caps))


def run(toggle: Toggle, spec_on: bool, prompts, params):
    """Spec off or on (the engine's own MTP speculator), every target and MTP cache block back afterwards."""
    outs = toggle.on(prompts, params) if spec_on else toggle.off(prompts, params)
    proposer = toggle.ngram.proposer  # Toggle's name for the speculator the engine built: here the MTP one
    assert not proposer.states and len(proposer.pool.free) == len(proposer.cache[0])
    return outs


# ---- (a) the MTP layer against a reference of its formulas ----------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ReferenceMtp:
    """The MTP formulas in torch around transformers' DeepSeek-V3 decoder layer (a one-layer model holding the MTP
    layer's decoder weights, ``shared_head.norm`` as its norm and ``shared_head.head`` as its LM head)."""

    def __init__(self, folder: Path):
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = folder_config(folder)
        n, self.eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
        weights = load_file(str(folder / "model.safetensors"))
        self.target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                            experts_implementation="eager").eval()
        prefix = f"model.layers.{n}."
        mtp = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
        state = {f"model.layers.0.{k}": v for k, v in mtp.items()
                 if k.startswith(("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm."))}
        state.update({"model.norm.weight": mtp["shared_head.norm.weight"],
                      "lm_head.weight": mtp.get("shared_head.head.weight", weights["lm_head.weight"]),
                      "model.embed_tokens.weight": weights["model.embed_tokens.weight"]})
        with tempfile.TemporaryDirectory() as one:  # saved and loaded: transformers fuses the experts itself
            AutoConfig.from_pretrained(folder, num_hidden_layers=1, first_k_dense_replace=0).save_pretrained(one)
            save_file(state, f"{one}/model.safetensors", metadata={"format": "pt"})
            self.layer = AutoModelForCausalLM.from_pretrained(one, dtype=torch.float32, attn_implementation="eager",
                                                              experts_implementation="eager").eval()
        self.mtp, self.embed = mtp, mtp.get("embed_tokens.weight", weights["model.embed_tokens.weight"])

    @torch.inference_mode()
    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """h_i: the target's last decoder layer's output (before the final norm)."""
        kept = []
        hook = self.target.model.layers[-1].register_forward_hook(
            lambda module, args, out: kept.append(out[0] if isinstance(out, tuple) else out))
        self.target(torch.tensor([tokens]))
        hook.remove()
        return kept[0][0]

    @torch.inference_mode()
    def draft_logits(self, tokens: list[int], k: int, start: int = 0) -> list[torch.Tensor]:
        """The MTP logits at the last position (its input: the last token with h of the one before), then those
        of k - 1 chained positions (the previous draft with the previous MTP output hidden state); the MTP layer
        sees the positions from ``start`` on (rope is relative: they may start at 0 here)."""
        m, h = self.mtp, self.target_hidden(tokens[:-1])
        nexts, previous, logits, outputs = list(tokens[start + 1:]), list(h[start:]), [], []
        hook = self.layer.model.layers[0].register_forward_hook(
            lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        for _ in range(k):
            e = rms_norm(self.embed[torch.tensor(nexts)], m["enorm.weight"], self.eps)
            x = torch.cat((e, rms_norm(torch.stack(previous), m["hnorm.weight"], self.eps)), -1) @ m["eh_proj.weight"].T
            logits.append(self.layer(inputs_embeds=x[None]).logits[0, -1])
            previous.append(outputs[-1][0, -1])
            nexts.append(int(logits[-1].argmax()))
        hook.remove()
        return logits


def test_drafts_match_a_reference_of_the_mtp_formulas(random_mtp, random_llm, always_draft, monkeypatch):
    llm, k = random_llm, MTP["num_speculative_tokens"]
    prompt = llm.tokenizer.encode("5: " + TEXT)[:40]
    model = model_runner(llm.llm).model
    recorded: list[torch.Tensor] = []
    logits = model.mtp_logits
    monkeypatch.setattr(model, "mtp_logits", lambda hidden: recorded.append(out := logits(hidden)) or out)
    reference = ReferenceMtp(random_mtp)
    cached = []
    for _ in range(2):  # the second time the prompt's first blocks come from the prefix cache
        recorded.clear()
        out = run(llm, True, [prompt], SamplingParams(max_tokens=k + 2, temperature=0, ignore_eos=True))[0]
        cached.append(out.num_cached_tokens)
        # The prompt's catch-up (its one step: max_num_batched_tokens 48) ends with the first sampled token;
        # the first proposal then chains k - 1 positions.
        ours = [recorded[0][0]] + [r[0] for r in recorded[1:k]]
        expected = reference.draft_logits(prompt + out.token_ids[:1], k, start=out.num_cached_tokens)
        for mine, ref in zip(ours, expected, strict=True):
            torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4)
    assert cached[0] == 0 and cached[1] >= 16


# ---- (b) greedy, (c) seeded sampling: lossless against spec off ------------------------------------------------
def test_greedy_equals_spec_off_through_chunked_prefill(random_llm, always_draft):
    llm = random_llm
    prompts = mixed_prompts(llm, repeats=(1, 3, 2))  # the second prompt prefills in several 48-token chunks
    assert max(map(len, prompts)) > 2 * 48
    off = run(llm, False, prompts, GREEDY)
    on = run(llm, True, prompts, GREEDY)
    same_outputs(off, on)
    assert list(llm.llm.metrics()["speculative"]) == ["mtp"]  # the stats are the method's
    f = llm.figures()
    assert f["proposed_tokens"] > 0 and f["accepted_tokens"] <= f["proposed_tokens"]


def copy_of_the_target(out: Path) -> Path:
    """A one-layer target whose attention output is zero (o_proj 0), so that its next token is a function of the
    current one alone, and an MTP layer that is that layer again fed only the next token's embedding (eh_proj
    [I | 0]; embeddings of unit RMS, so enorm changes nothing) with the target's norm and LM head (shared): it
    predicts the token after next exactly as the target will."""
    folder = build_tiny_model(out / "target", "deepseek-v3", num_hidden_layers=1, first_k_dense_replace=0)
    weights, hidden = load_file(str(folder / "model.safetensors")), folder_config(folder)["hidden_size"]
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True))
    weights["model.layers.0.self_attn.o_proj.weight"].zero_()
    layer = {name.removeprefix("model.layers.0."): w for name, w in weights.items()
             if name.startswith("model.layers.0.")}
    layer.update({"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
                  "eh_proj.weight": torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1),
                  "shared_head.norm.weight": weights["model.norm.weight"]})
    return with_mtp_layer(folder, out / "mtp", layer, main=weights)


@pytest.fixture(scope="module")
def copy_llm(tmp_path_factory):
    llm = make_llm(copy_of_the_target(tmp_path_factory.mktemp("copy")))
    yield Toggle(llm)
    llm.close()


def test_an_mtp_layer_that_predicts_like_the_target_gets_its_drafts_accepted(copy_llm, always_draft):
    llm = copy_llm
    prompts = [llm.tokenizer.encode(f"{i}: " + TEXT * 2) for i in range(3)]
    off = run(llm, False, prompts, GREEDY)
    on = run(llm, True, prompts, GREEDY)
    same_outputs(off, on)
    f = llm.figures()
    assert 0 < f["accepted_tokens"] <= f["proposed_tokens"] and f["acceptance_rate"] > 0.9, f


def test_seeded_sampling_gives_spec_offs_tokens(copy_llm, always_draft):
    llm = copy_llm
    prompt = llm.tokenizer.encode("3: " + TEXT)
    params = [SamplingParams(max_tokens=6, temperature=1.0, top_k=3, seed=seed, ignore_eos=True) for seed in range(24)]
    off = run(llm, False, [prompt] * len(params), params)
    on = run(llm, True, [prompt] * len(params), params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert len({tuple(o.token_ids) for o in off}) > 4  # the seeds sample different continuations
    assert llm.figures()["accepted_tokens"] > 0


# ---- (e) what it loads without the method, and what it refuses ------------------------------------------------
def test_without_the_method_the_mtp_layer_is_ignored(random_mtp, random_llm):
    prompts = mixed_prompts(random_llm, repeats=(1,))
    with make_llm(random_mtp, spec=None) as plain:
        assert model_runner(plain).model.mtp is None
        # The KV budget counts the MTP layer's cache: one more latent layer beside the three of the target.
        blocks, plain_blocks = model_runner(random_llm.llm).num_blocks, model_runner(plain).num_blocks
        assert abs(blocks - plain_blocks * 3 / 4) <= 1
        assert len(random_llm.ngram.proposer.cache[0]) >= blocks
        assert plain.generate(prompts, GREEDY)[0].token_ids == run(random_llm, False, prompts, GREEDY)[0].token_ids


def drop(layer: dict, *names: str) -> dict:
    return {k: v for k, v in layer.items() if k not in names}


@pytest.mark.parametrize("case, message", [
    ("no nextn", r"num_nextn_predict_layers = 0, not >= 1"),
    ("no layer", r"no weights of its multi-token-prediction layer \(model\.layers\.3\.enorm"),
    ("no eh_proj", r"missing weights: mtp\.eh_proj\.weight$"),
    ("llama", r"needs a DeepSeek-V3-style checkpoint with multi-token-prediction layers; LlamaForCausalLM"),
])
def test_checkpoints_it_cannot_draft_with_are_refused(tiny_model_factory, tmp_path, case, message):
    folder = tiny_model_factory("deepseek-v3")
    layer = random_mtp_layer(folder)
    path = {"no nextn": lambda: with_mtp_layer(folder, tmp_path / "m", layer, nextn=0),
            "no layer": lambda: with_mtp_layer(folder, tmp_path / "m", {}),
            "no eh_proj": lambda: with_mtp_layer(folder, tmp_path / "m", drop(layer, "eh_proj.weight")),
            "llama": lambda: tiny_model_factory("llama")}[case]()
    with pytest.raises(ValueError, match=message):
        make_llm(path)


@pytest.mark.parametrize("settings, message", [
    ({"tensor_parallel_size": 2}, "'mtp' runs on one device for now"),
    ({"data_parallel_size": 2}, "'mtp' runs on one device for now"),
    ({"speculative_config": {**MTP, "model": "x"}}, r"unknown speculative_config key\(s\) for method 'mtp'"),
])
def test_settings_it_cannot_run_are_refused(settings, message):
    from batchgen.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", **{"speculative_config": MTP, **settings})


def test_aborted_requests_give_their_mtp_blocks_back(random_llm, always_draft):
    engine, proposer = random_llm.llm.engine, random_llm.ngram.proposer
    engine.speculator = random_llm.ngram
    for prompt in mixed_prompts(random_llm, repeats=(1, 2)):
        engine.add_request(prompt, GREEDY)
    for _ in range(4):
        engine.step()
    assert proposer.states and len(proposer.pool.free) < len(proposer.cache[0])
    assert engine.abort_all() == 2
    assert not proposer.states and len(proposer.pool.free) == len(proposer.cache[0])


@pytest.mark.slow
def test_preemption_under_a_small_kv_budget(random_mtp, random_llm, always_draft):
    prompts = [random_llm.tokenizer.encode(f"{i} " + TEXT * 2)[:60] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True)
    off = run(random_llm, False, prompts, params)
    runner = model_runner(random_llm.llm)
    per_block = sum(layout.bytes_per_block(16, torch.float32)
                    for layout in (runner.kv_layout, runner.model.proposer_kv_layout()))
    small = Toggle(make_llm(random_mtp, max_num_batched_tokens=256, kv_cache_memory=per_block * 12))
    on = run(small, True, prompts, params)
    same_outputs(off, on)
    assert small.llm.metrics()["preemptions"] > 0 and small.figures()["proposed_tokens"] > 0
    small.llm.close()


# ---- (f) CUDA graphs: the hidden states are outputs of the replayed decode steps --------------------------------
def drafting_every_other_step(monkeypatch) -> None:
    """The cost model out of the way: all decoding sequences draft all they may on odd steps, none on even ones."""
    calls = iter(range(10**6))
    monkeypatch.setattr(speculator_module, "choose_draft_lengths",
                        lambda rates, caps, *costs: list(caps) if next(calls) % 2 else [0] * len(caps))


def drafts_and_outputs(llm: LLM, prompts) -> tuple[list[list[int]], list]:
    """The MTP layer's argmax tokens, call by call, and the outputs."""
    model, drafts = model_runner(llm).model, []
    logits = model.mtp_logits
    model.mtp_logits = lambda hidden: drafts.append((out := logits(hidden)).argmax(-1).tolist()) or out
    return drafts, llm.generate(prompts, GREEDY)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered")  # padded rows hold uninitialized values
def test_decode_steps_replay_their_graphs_and_feed_the_mtp_layer(random_mtp, monkeypatch):
    """With CUDA graphs (emulated: the padded fixed-shape steps, run here without capture on the Triton kernel
    set), steps without drafts replay the decode graphs, and the hidden states the MTP layer catches up on come
    out of them: every other step drafts, and the drafts and outputs are those of the eager engine."""
    pytest.importorskip("triton")
    kw = dict(attention_backend="triton", max_num_seqs=4)
    runs = []
    for graphs in ("off", "emulate"):
        drafting_every_other_step(monkeypatch)
        with make_llm(random_mtp, cuda_graphs=graphs, **kw) as llm:
            runs.append(drafts_and_outputs(llm, mixed_prompts(llm, repeats=(1, 2))))
            replays = model_runner(llm).graphs.replays if graphs == "emulate" else None
    (eager_drafts, eager_outs), (graphed_drafts, graphed_outs) = runs
    same_outputs(eager_outs, graphed_outs)
    assert len(eager_drafts) > 4 and graphed_drafts == eager_drafts
    assert sum(n for (kind, _), n in replays.items() if kind == "decode") > 0, replays
