"""Choosing tokens: per-request sampling parameters, the sampler, stop conditions, structured-output grammars."""
