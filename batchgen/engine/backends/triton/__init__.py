"""Triton kernels for the GPU path."""
