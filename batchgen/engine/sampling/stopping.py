"""When a sequence is finished, and the text it returns (cut before a stop string)."""
from __future__ import annotations

from batchgen.engine.core.sequence import Sequence

STOP_TAIL_TOKENS = 8  # extra tokens decoded around a stop string, for tokens that span it
CONTEXT_TOKENS = 4  # tokens decoded before a completion's text and then cut off it (see decode_after)


def finish_reason(seq: Sequence, eos_ids: frozenset[int], max_model_len: int, tokenizer) -> str | None:
    """Checks the token just appended to ``seq``; returns "stop", "length" or None."""
    params, token = seq.params, seq.token_ids[-1]
    if seq.grammar is not None and (seq.grammar.is_terminated or seq.grammar.rejected):
        return "stop"
    if not params.ignore_eos and token in eos_ids:
        return "stop"
    if token in params.stop_token_ids:
        return "stop"
    if params.stop and seq.num_completion_tokens >= params.min_tokens and _stop_string_end(seq, tokenizer) is not None:
        return "stop"
    if seq.reached_length(max_model_len):
        return "length"
    return None


def decode_after(tokenizer, ids: list[int], start: int) -> str:
    """The text of ``ids[start:]`` as it reads after ``ids[:start]``, as vLLM's incremental detokenizer gives it:
    decoded behind a few of the tokens before it, whose own text is then cut off. Decoded alone, a SentencePiece
    tokenizer would strip its leading space as the start of a text."""
    context = ids[max(0, start - CONTEXT_TOKENS):start]
    if context:
        before, text = tokenizer.decode(context), tokenizer.decode(context + ids[start:])
        if text.startswith(before):  # else the context ends inside a character
            return text[len(before):]
    return tokenizer.decode(ids[start:])


def _first_stop(text: str, stops: list[str], floor: int) -> int | None:
    """Where the first stop string in ``text`` that ends past ``floor`` starts, if any."""
    hits = [i for i in (text.find(s, max(0, floor - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stop_string_end(seq: Sequence, tokenizer) -> int | None:
    """Position in the decoded tail where a stop string starts, if one has appeared. Every token holds at least
    one of the text's UTF-8 bytes, so a window of the longest stop string's bytes (and a margin) holds it; no stop
    string that ends within the first ``min_tokens`` tokens' text counts."""
    longest = max(len(s.encode()) for s in seq.params.stop)
    start = max(seq.num_prompt_tokens, len(seq.token_ids) - (longest + STOP_TAIL_TOKENS))

    def text_to(end: int) -> str:  # the window's text up to token ``end``
        # Past the completion's start a window is decoded alone: a stop string that ends at its newest token
        # starts STOP_TAIL_TOKENS in, clear of the window's first token (whose leading space a decoder may strip).
        if start == seq.num_prompt_tokens:
            return decode_after(tokenizer, seq.token_ids[:end], start)
        return tokenizer.decode(seq.token_ids[start:end])

    floor_end = seq.num_prompt_tokens + seq.params.min_tokens
    floor = len(text_to(floor_end)) if start < floor_end else 0
    return _first_stop(text_to(len(seq.token_ids)), seq.params.stop, floor)


def output_text(seq: Sequence, tokenizer) -> tuple[str, bool]:
    """The decoded completion cut before the first stop string (one that ends past the first ``min_tokens``
    tokens' text), and whether a stop string cut it."""
    text = decode_after(tokenizer, seq.token_ids, seq.num_prompt_tokens)
    if seq.params.stop:
        floor_ids = seq.token_ids[:seq.num_prompt_tokens + seq.params.min_tokens]
        floor = len(decode_after(tokenizer, floor_ids, seq.num_prompt_tokens)) if seq.params.min_tokens else 0
        at = _first_stop(text, seq.params.stop, floor)
        if at is not None:
            return text[:at], True
    return text, False
