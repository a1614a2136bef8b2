"""Speculative decoding: proposers draft tokens, the target verifies them in its own step, a cost model decides
how many each sequence drafts."""
from __future__ import annotations

from batchgen.engine.speculative.config import SpeculativeConfig
from batchgen.engine.speculative.proposer import Proposer

__all__ = ["Proposer", "SpeculativeConfig"]
