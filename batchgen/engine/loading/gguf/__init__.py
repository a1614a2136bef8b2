"""GGUF files: metadata, the mapping onto Hugging Face config and weight names, weights, the tokenizer rebuild."""
