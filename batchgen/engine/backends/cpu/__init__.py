"""CPU specifics: the CPU's features, and fused C++ kernels compiled on first use (torch SDPA where they cannot be)."""
