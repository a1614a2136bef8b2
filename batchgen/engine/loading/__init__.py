"""Loading a model: where it comes from (hub, cache), its config, weights and tokenizer (safetensors folders, GGUF)."""
