"""The engine loop and its bookkeeping: scheduler, sequences, block manager, KV cache layout, outputs, metrics."""
