"""A model's tokenizer: a wrapper over the `tokenizers` library with sandboxed Jinja2 chat templates."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

from tokenizers import AddedToken, processors
from tokenizers.models import BPE
from tokenizers import Tokenizer as _HFTokenizer

def _token_str(value: Any) -> str | None:
    """Special tokens appear in tokenizer_config.json as strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON text as json.dumps writes it: Jinja's own tojson escapes HTML characters (and every non-ASCII one), which
    prompts and chat templates must not do."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _decoder_steps(decoder: dict | None) -> set[str]:
    """The types of a tokenizer's decoder steps (a Sequence's and its own)."""
    if not decoder:
        return set()
    return {decoder["type"], *(step["type"] for step in decoder.get("decoders") or ())}


def _clean_up_spaces(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class ModelTokenizer:
    """Encodes, decodes and renders chat prompts; behaves like the equivalent HF fast tokenizer."""

    def __init__(self, tokenizer: _HFTokenizer, *, bos_token: str | None = None,
                 eos_tokens: Sequence[str] = (), pad_token: str | None = None, unk_token: str | None = None,
                 chat_template: str | None = None, add_bos_token: bool | None = None,
                 add_eos_token: bool | None = None, clean_up_tokenization_spaces: bool = False,
                 extra_special_tokens: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._piece_bytes: Callable[[str], bytes] | None = None  # built on first use by token_bytes
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        # transformers 5 ignores this flag for BPE models: the clean-up would delete real spaces.
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces and not isinstance(tokenizer.model, BPE)
        named = [t for t in (bos_token, *eos_tokens, unk_token, pad_token, *extra_special_tokens) if t]
        added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys(named) if t not in added]
        if missing:  # like HF: declared special tokens are always matched whole and skipped on decode
            tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self._eos_ids = [i for i in (tokenizer.token_to_id(t) for t in eos_tokens) if i is not None]
        # Like HF: explicit add_bos/add_eos flags (or no post-processor at all) replace the post-processor.
        if add_bos_token is not None or add_eos_token is not None or tokenizer.post_processor is None:
            self._set_post_processor(bool(add_bos_token) and self.bos_token_id is not None,
                                     bool(add_eos_token) and self.eos_token is not None)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.bos_token, self.eos_token
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        specials = ([(bos, self._tok.token_to_id(bos))] if add_bos else []) + \
                   ([(eos, self._tok.token_to_id(eos))] if add_eos else [])
        self._tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                                 special_tokens=specials)

    # ---- constructors -------------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelTokenizer":
        """Loads ``tokenizer.json`` plus ``tokenizer_config.json`` / ``chat_template.jinja`` from a folder.

        As in transformers 5, BOS/EOS insertion comes from tokenizer.json's post-processor; the config's
        ``add_bos_token`` / ``add_eos_token`` flags are ignored when tokenizer.json exists.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        tok = _HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
        if isinstance(extra, dict):
            extra = list(extra.values())
        extra = [s for s in (_token_str(t) for t in extra) if s]
        return cls(tok, bos_token=_token_str(cfg.get("bos_token")),
                   eos_tokens=[t for t in [_token_str(cfg.get("eos_token"))] if t],
                   pad_token=_token_str(cfg.get("pad_token")), unk_token=_token_str(cfg.get("unk_token")),
                   chat_template=template,
                   clean_up_tokenization_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)),
                   extra_special_tokens=extra)

    # ---- properties ---------------------------------------------------------------------------------
    @property
    def backend(self) -> _HFTokenizer:
        return self._tok

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_ids[0] if self._eos_ids else None

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def pad_token_id(self) -> int | None:
        return self._tok.token_to_id(self.pad_token) if self.pad_token else None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (HF's ``len(tokenizer)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ---- encode / decode ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes, which may be part of a character (OpenAI logprobs' ``bytes``): the decoded
        text of the tokens together is their bytes joined."""
        if self._piece_bytes is None:
            steps = _decoder_steps(json.loads(self._tok.to_str()).get("decoder"))
            chars = {c: b for b, c in byte_to_unicode().items()}
            added = {t.content for t in self._tok.get_added_tokens_decoder().values()}

            def piece_bytes(piece: str) -> bytes:
                if piece in added:
                    return piece.encode()
                if "ByteLevel" in steps:
                    return bytes(chars[c] for c in piece) if all(c in chars for c in piece) else piece.encode()
                if "ByteFallback" in steps and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    return bytes([int(piece[3:5], 16)])
                return piece.replace("\u2581", " ").encode()
            self._piece_bytes = piece_bytes
        return [self._piece_bytes(self._tok.id_to_token(i) or "") for i in ids]

    # ---- chat ---------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs: Any) -> list[int] | str:
        """Renders ``messages`` with the model's template; returns ids unless ``tokenize`` is False."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        context = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                     ("pad_token", self.pad_token)) if v is not None}
        context.update(kwargs)
        text = _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context)
        if not tokenize:
            return text
        # HF encodes the rendered prompt without adding special tokens: the template places them itself.
        return self.encode(text, add_special_tokens=False)
