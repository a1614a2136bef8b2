"""Builds tiny random-weight Hugging Face model folders (config, safetensors, tokenizer) for tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Summarize the following article in three sentences.",
    "Batch inference reads prompts, sorts them by length and writes outputs.",
    "Numbers like 12345 and 2026 appear in documents, as do names such as Ada and Alan.",
    "Prefill dominates when prompts are long and outputs are short.",
] * 20

ARCH_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-tied": dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True),
    # Windows shorter than the test prompts and not a multiple of the block size.
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=24),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    # LongRoPE on half of each head; every test prompt is longer than the original context, so
    # transformers uses the long factors, as the engine does for a context beyond it.
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=40,
                 partial_rotary_factor=0.5, original_max_position_embeddings=16,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.1],
                               "long_factor": [1.1, 2.0, 3.5, 6.0]}),
    # Local and global layers; head_dim != hidden / heads and query_pre_attn_scalar != head_dim.
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", num_hidden_layers=3, head_dim=24,
                   sliding_window=24, query_pre_attn_scalar=32, attn_logit_softcapping=1.5,
                   final_logit_softcapping=6.0),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=6,
                   head_dim=24, sliding_window=24, query_pre_attn_scalar=32,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # The language model of a vision checkpoint (a one-layer vision tower the engine skips).
    "gemma3-vlm": dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
                       text_config=dict(num_hidden_layers=2, sliding_window=24, layer_types=[
                           "sliding_attention", "full_attention"]),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=28, patch_size=14),
                       mm_tokens_per_image=4),
    # Mixture of experts; the Qwen ones keep layer 0 dense so both kinds of layer occur.
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=96,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2-moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_hidden_layers=3,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, mlp_only_layers=[0]),
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=3,
                      head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      mlp_only_layers=[0], norm_topk_prob=True),
    # Multi-head latent attention; layer 0 dense (first_k_dense_replace), layers 1-2 routed + shared experts.
    "deepseek-v2": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", num_hidden_layers=3,
                        num_key_value_heads=4,
                        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
                        v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                        moe_intermediate_size=32, first_k_dense_replace=1, topk_method="group_limited_greedy",
                        n_group=4, topk_group=2, routed_scaling_factor=1.5),
    "deepseek-v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=3,
                        num_key_value_heads=4,
                        q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
                        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 512, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}),
}
MOE_ARCHS = ("mixtral", "qwen2-moe", "qwen3-moe")
VISION_ARCHS = ("gemma3-vlm",)  # the language model of a vision checkpoint: its own, shorter parity test
MLA_ARCHS = ("deepseek-v2", "deepseek-v3")


def build_tokenizer(out_dir: Path) -> int:
    """Trains a small byte-level BPE tokenizer with ChatML specials; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(out_dir))
    return tok.get_vocab_size()


def build_tiny_model(out_dir: Path | str, arch: str = "llama", seed: int = 0, num_layers: int = 2,
                     hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
                     init_std: float = 0.1, max_position_embeddings: int = 2048, **config: object) -> Path:
    """Writes config.json, model.safetensors, tokenizer files and generation_config.json to ``out_dir``;
    ``config`` overrides config.json keys (sizes of the architecture's spec, ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out_dir)
    spec = {**ARCH_CONFIGS[arch], **config, **({"head_dim": head_dim} if head_dim else {})}
    model_type = spec.pop("model_type")
    im_end = SPECIAL_TOKENS.index("<|im_end|>")
    shape = dict(vocab_size=vocab + 16, hidden_size=hidden, intermediate_size=2 * hidden,
                 num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 head_dim=head_dim or hidden // heads, max_position_embeddings=max_position_embeddings)
    common = dict(initializer_range=init_std, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=im_end,
                  pad_token_id=0)
    if "text_config" in spec:  # a multimodal config: the language model's settings are nested
        spec["text_config"] = {**shape, **common, **spec["text_config"]}
        config = AutoConfig.for_model(model_type, **spec, initializer_range=init_std)
    else:
        config = AutoConfig.for_model(model_type, **{**shape, **spec}, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms and biases so that every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, init_std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 expert choice bias
                b.uniform_(-0.2, 0.2)
    model.save_pretrained(str(out_dir))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end]}))
    return out_dir
