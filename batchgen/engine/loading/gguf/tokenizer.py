"""Rebuilds a `tokenizers` tokenizer from GGUF metadata, matching transformers' GGUF tokenizer."""
from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from batchgen.engine.loading.gguf.metadata import field_value, gguf_fields
from batchgen.engine.tokenizer import ModelTokenizer, byte_to_unicode

# GGUF token types (gguf.TokenType): only these two change how the tokenizer is built.
_CONTROL, _USER_DEFINED = 3, 4

# Split patterns by `tokenizer.ggml.pre`, for vocabularies whose merges were learned on a split other
# than GPT-2's. Names absent here get GPT-2's byte-level split, as transformers does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    table = byte_to_unicode()
    # Some converters store a few tokens as raw text; respell those in the byte alphabet.
    return {tok if set(tok) <= alphabet else "".join(table[b] for b in tok.encode("utf-8")): i
            for i, tok in enumerate(tokens)}


def _merges(raw: list[str] | None) -> list[tuple[str, str]] | None:
    return None if raw is None else [tuple(m.split(" ", 1)) for m in raw]  # type: ignore[misc]


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece-BPE merges implied by the vocabulary: every split of a token into two tokens,
    best token score first (ties: longer left piece, then longer right piece, then vocabulary order)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    token_scores = dict(zip(tokens, scores))
    found: list[tuple[str, str, float]] = []
    for tok, score in token_scores.items():
        pairs = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((left, right, score) for left, right in pairs)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _build_bpe(fields: Mapping[str, Any], tokens: list[str]) -> _HFTokenizer:
    merges = _merges(field_value(fields, "tokenizer.ggml.merges"))
    if merges is None:
        raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    tok = _HFTokenizer(models.BPE(vocab=_byte_level_vocab(tokens), merges=merges, dropout=None,
                                  fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(field_value(fields, "tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(fields: Mapping[str, Any], tokens: list[str], unk: str | None,
                       scores: list[float] | None = None) -> _HFTokenizer:
    """A SentencePiece-style BPE model with byte fallback: the file's merges, else the ones its
    vocabulary implies, best ``scores`` (default: the file's token scores) first."""
    merges = _merges(field_value(fields, "tokenizer.ggml.merges"))
    if merges is None:
        scores = scores if scores is not None else field_value(fields, "tokenizer.ggml.scores")
        if scores is None:
            raise ValueError("GGUF llama tokenizer has neither merges nor scores")
        merges = merges_from_scores(tokens, scores)
    vocab = {t: i for i, t in enumerate(tokens)}
    return _HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                   byte_fallback=True, dropout=None))


def _sentencepiece_decoder(strip_prefix_space: bool) -> decoders.Decoder:
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] if strip_prefix_space else steps)


def _build_llama(fields: Mapping[str, Any], tokens: list[str], unk: str | None) -> _HFTokenizer:
    """Llama 2 style: a space before the first word (Metaspace), dropped again when decoding."""
    tok = _sentencepiece_bpe(fields, tokens, unk)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = _sentencepiece_decoder(strip_prefix_space=True)
    return tok


def _build_phi3(fields: Mapping[str, Any], tokens: list[str], unk: str | None) -> _HFTokenizer:
    """Phi-3: the prefix space comes from a normalizer, so text that starts with spaces keeps all of them."""
    tok = _build_llama(fields, tokens, unk)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    return tok


def _build_gemma(fields: Mapping[str, Any], tokens: list[str], unk: str | None) -> _HFTokenizer:
    """Gemma: no prefix space; runs of spaces stored as real spaces are spelled with \u2581; with no merges
    in the file, the vocabulary's order (not its scores) ranks the implied ones."""
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    tok = _sentencepiece_bpe(fields, tokens, unk, scores=[-float(i) for i in range(len(tokens))])
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = _sentencepiece_decoder(strip_prefix_space=False)
    return tok


# SentencePiece vocabularies (tokenizer.ggml.model "llama") by general.architecture; others are Llama's.
_SENTENCEPIECE_BUILDERS = {"gemma": _build_gemma, "gemma2": _build_gemma, "gemma3": _build_gemma,
                           "phi3": _build_phi3}


def tokenizer_from_gguf(source: Any) -> ModelTokenizer:
    """Rebuilds the tokenizer from GGUF metadata; ``source`` is a path, a GGUFReader or its fields."""
    fields = gguf_fields(source)
    kind = field_value(fields, "tokenizer.ggml.model")
    tokens = field_value(fields, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    arch = field_value(fields, "general.architecture", "")

    def token_at(key: str) -> str | None:
        index = field_value(fields, f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    add_bos = field_value(fields, "tokenizer.ggml.add_bos_token")
    if kind == "gpt2":
        backend = _build_bpe(fields, tokens)
        byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    elif kind == "llama":
        backend = _SENTENCEPIECE_BUILDERS.get(arch, _build_llama)(fields, tokens, token_at("unknown_token_id"))
        byte_alphabet = None
        add_bos = True if add_bos is None else add_bos  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise NotImplementedError(f"GGUF tokenizer model {kind!r} (architecture {arch!r}) is not supported; "
                                  "supported: 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)")

    types = field_value(fields, "tokenizer.ggml.token_type") or []
    # A control token spelled outside the byte alphabet is a mislabelled entry; adding it would grow the vocabulary.
    control = [t for t, ty in zip(tokens, types)
               if ty == _CONTROL and (byte_alphabet is None or set(t) <= byte_alphabet)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    vocab = backend.get_vocab()
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    eos = [t for t in (token_at("eos_token_id"), token_at("eot_token_id")) if t]
    return ModelTokenizer(backend, bos_token=token_at("bos_token_id"), eos_tokens=list(dict.fromkeys(eos)),
                     pad_token=token_at("padding_token_id"), unk_token=token_at("unknown_token_id"),
                     chat_template=field_value(fields, "tokenizer.chat_template"),
                     add_bos_token=add_bos, add_eos_token=field_value(fields, "tokenizer.ggml.add_eos_token"))
