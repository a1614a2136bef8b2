"""FP8 (e4m3) weights and activations: the block-scaled format in torch, Triton quantization and GEMM."""
