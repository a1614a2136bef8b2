"""Stop strings and a completion's text: found while generating, and decoded as the text after the prompt."""
from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.loading.gguf.tokenizer import tokenizer_from_gguf
from batchgen.engine.sampling.stopping import finish_reason, output_text
from batchgen.engine.tokenizer import ModelTokenizer
from tests.test_tokenizer import _sentencepiece_vocab, _write_sentencepiece_gguf


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> ModelTokenizer:
    tokens, types = _sentencepiece_vocab(["<unk>", "<s>", "</s>"])
    path = tmp_path_factory.mktemp("sp") / "llama.gguf"
    return tokenizer_from_gguf(str(_write_sentencepiece_gguf(path, "llama", tokens, types, bos_token_id=1,
                                                             eos_token_id=2, unk_token_id=0)))


def _generate(tokenizer, prompt: list[int], completion: list[int], params: SamplingParams) -> tuple[Sequence, int]:
    """Appends the completion's tokens one at a time as the engine does; returns the sequence and how many
    tokens it took to finish (len(completion) where it never did)."""
    seq = Sequence(0, list(prompt), params, seed=0)
    for n, token in enumerate(completion, 1):
        seq.token_ids.append(token)
        if finish_reason(seq, frozenset(), 10_000, tokenizer) == "stop":
            return seq, n
    return seq, len(completion)


def test_a_sentencepiece_completion_keeps_its_leading_space(sentencepiece):
    """A completion reads as the text after its prompt (as vLLM detokenizes it): decoded alone, SentencePiece's
    decoder strips the first token's word mark as the start of a text."""
    prompt = sentencepiece.encode("The quick brown")
    completion = sentencepiece.encode("fox jumps over the fox", add_special_tokens=False)
    whole = sentencepiece.decode(prompt + completion)
    expected = whole[len(sentencepiece.decode(prompt)):]
    assert expected.startswith(" fox")  # the reference: the completion's text within the whole text
    seq, _ = _generate(sentencepiece, prompt, completion, SamplingParams())
    assert output_text(seq, sentencepiece) == (expected, False)
    # A stop string that starts with a space fires at its first occurrence, not at the second.
    seq, n = _generate(sentencepiece, prompt, completion, SamplingParams(stop=[" fox"]))
    assert (n, output_text(seq, sentencepiece)) == (1, ("", True))


def test_a_stop_string_of_many_byte_tokens_is_found_while_generating(tiny_model):
    """Each character of a rare emoji is several byte tokens: the window decoded for stop strings counts the
    stop string's bytes, not its characters."""
    tokenizer = ModelTokenizer.from_hf_dir(tiny_model)
    stop = "\U0001F9EA" * 3 + "\u0f04" * 2
    prompt = tokenizer.encode("The quick brown")
    head = tokenizer.encode(" fox " * 3, add_special_tokens=False)
    stop_ids = tokenizer.encode(stop, add_special_tokens=False)
    assert len(stop_ids) > len(stop) + 8  # more tokens than the old window of characters held
    tail = tokenizer.encode(" after the stop", add_special_tokens=False)
    seq, n = _generate(tokenizer, prompt, head + stop_ids + tail, SamplingParams(stop=[stop]))
    assert n == len(head) + len(stop_ids)
    assert output_text(seq, tokenizer) == (tokenizer.decode(head), True)
