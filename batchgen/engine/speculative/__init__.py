"""Speculative decoding: draft proposers and their verification in the target's step."""
