"""When a sequence is finished, and the text it returns (cut before a stop string)."""
from __future__ import annotations

from batchgen.engine.core.sequence import Sequence

STOP_TAIL_TOKENS = 8  # extra tokens decoded around a stop string, for tokens that span it


def finish_reason(seq: Sequence, eos_ids: frozenset[int], max_model_len: int, tokenizer) -> str | None:
    """Checks the token just appended to ``seq``; returns "stop", "length" or None."""
    params, token = seq.params, seq.token_ids[-1]
    if seq.grammar is not None and (seq.grammar.is_terminated or seq.grammar.rejected):
        return "stop"
    if not params.ignore_eos and token in eos_ids:
        return "stop"
    if token in params.stop_token_ids:
        return "stop"
    if params.stop and _stop_string_end(seq, tokenizer) is not None:
        return "stop"
    if seq.reached_length(max_model_len):
        return "length"
    return None


def _stop_string_end(seq: Sequence, tokenizer) -> int | None:
    """Position in the decoded tail where a stop string starts, if one has appeared."""
    longest = max(len(s) for s in seq.params.stop)
    tail = seq.completion_token_ids[-(longest + STOP_TAIL_TOKENS):]
    text = tokenizer.decode(tail)
    hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
    return min(hits) if hits else None


def output_text(seq: Sequence, tokenizer) -> tuple[str, bool]:
    """The decoded completion cut before the first stop string, and whether a stop string cut it."""
    text = tokenizer.decode(seq.completion_token_ids)
    if seq.params.stop:
        hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        if hits:
            return text[:min(hits)], True
    return text, False
