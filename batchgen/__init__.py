"""batchgen: offline batch LLM pipeline with its own prefill-optimized engine."""
