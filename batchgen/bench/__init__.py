"""Throughput benchmarks: prompt workloads, FLOP accounting and the `batchgen bench` command."""
