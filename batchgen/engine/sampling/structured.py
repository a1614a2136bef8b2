"""Constrained decoding with xgrammar: grammars compiled off the step loop, one matcher per request, token bitmasks.

Grammar state lives with the scheduler (rank 0); the model runner only receives the bitmask tensor of the
rows that have a grammar. ``import xgrammar`` is deferred to the compile thread: it imports transformers.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import torch

from batchgen.engine.sampling.params import SamplingParams
from batchgen.engine.sampling.sampler import TokenBitmask

log = logging.getLogger(__name__)

EXTRA_HINT = "constrained decoding (json_schema, regex, choice) needs xgrammar: pip install 'batchgen[structured]'"
GrammarKey = tuple[str, str]
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept for reuse (least recently asked for go first)


def structured_available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    """A hashable description of the request's constraint, the key of the compiled-grammar cache."""
    if params.json_schema is not None:
        schema = params.json_schema  # keys keep their order: it is the order of the output's fields
        return "json", schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(params.choice, ensure_ascii=False)
    return None


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass
class CompiledConstraint:
    """A compiled grammar, and for JSON the tokens it may ever use (None: no filter)."""

    grammar: Any
    token_filter: torch.Tensor | None = None  # int32 bitmask words, ANDed into every step's mask


class GrammarCompiler:
    """Compiles grammars in a background thread, at most once per key.

    ``submit`` returns at once with a future, so a slow schema never stalls the engine's step loop; the
    tokenizer's vocabulary is indexed for xgrammar on the first compile, in the same thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], max_workers: int = 1):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._no_control_bytes: torch.Tensor | None = None

    def submit(self, key: GrammarKey) -> Future:
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, key)
                if len(self._cache) > MAX_CACHED_GRAMMARS:  # requests hold their own futures
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return future

    def _xgr_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            vocab = [""] * self.vocab_size
            for token, index in self.tokenizer.backend.get_vocab(with_added_tokens=True).items():
                if index < self.vocab_size:
                    vocab[index] = token
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(self.tokenizer.backend.to_str())
            info = xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=self.vocab_size,
                                     stop_token_ids=self.stop_token_ids, add_prefix_space=meta["add_prefix_space"])
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            self._no_control_bytes = _tokens_without_control_bytes(info.decoded_vocab, self.vocab_size,
                                                                   info.special_token_ids + self.stop_token_ids)
        return self._compiler

    def _compile(self, key: GrammarKey):
        kind, text = key
        compiler = self._xgr_compiler()
        try:
            if kind == "json":
                # Compact separators and no free whitespace: otherwise a model can emit whitespace forever.
                # Compact JSON has no raw control character anywhere, yet xgrammar lets length-bounded
                # strings contain them: the filter keeps them out so that every output parses.
                grammar = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
                return CompiledConstraint(grammar, self._no_control_bytes)
            if kind == "regex":
                return CompiledConstraint(compiler.compile_regex(text))
            return CompiledConstraint(compiler.compile_grammar(choice_grammar(json.loads(text))))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and friends for bad grammars
            raise GrammarError(f"cannot compile the {kind} constraint: {xgrammar_message(e)}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def xgrammar_message(e: BaseException) -> str:
    """An xgrammar error's message on one line, without its "[time] file.cc:line:" prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", " ".join(str(e).split()))


def regex_problem(regex: str) -> str | None:
    """Why xgrammar cannot take ``regex`` as a constraint (its parser's message), or None."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_regex(regex)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for a regex it cannot parse
        return xgrammar_message(e)
    return None


@lru_cache(maxsize=256)
def json_schema_problem(schema_json: str) -> str | None:
    """Why xgrammar cannot compile the JSON Schema ``schema_json`` as a constraint (as the engine compiles it), or
    None. A valid JSON Schema may still be one it refuses: an empty range, an empty enum, a reference it cannot
    follow."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(schema_json, any_whitespace=False, separators=(",", ":"))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and friends
        return xgrammar_message(e)
    return None


class GrammarError(ValueError):
    """A constraint that cannot be compiled (an unsupported schema, a bad regex)."""


# A surrogate code point in UTF-8 (ED A0..BF ..): xgrammar takes it as one character, Python decodes it as three
# U+FFFD, and a maxLength the grammar kept then fails.
_SURROGATE_UTF8 = re.compile(rb"\xed[\xa0-\xbf]")


def _tokens_without_control_bytes(decoded_vocab: Sequence[bytes], vocab_size: int,
                                  keep: Sequence[int]) -> torch.Tensor:
    """Bitmask words allowing every token whose bytes hold no control character (0x00-0x1f) and no encoded
    surrogate, and ``keep``."""
    allowed = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.bool)
    control = bytes(range(32))
    for token, raw in enumerate(decoded_vocab[:vocab_size]):
        allowed[token] = bool(raw) and not any(b in control for b in raw) and not _SURROGATE_UTF8.search(raw)
    allowed[list(keep)] = True
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words = (allowed.view(-1, 32).long() * weights).sum(1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@dataclass
class GrammarState:
    """One request's grammar: its compile future, then its matcher and how many tokens it has accepted.

    The matcher advances only over completion tokens it has not seen, so recomputing a preempted
    sequence's KV never advances it twice.
    """

    future: Future
    matcher: Any = None
    token_filter: torch.Tensor | None = None
    num_accepted: int = 0
    rejected: bool = False
    error: str | None = None

    @property
    def is_ready(self) -> bool:
        return self.future.done()

    def start(self) -> bool:
        """Builds the matcher once the grammar is compiled; False (with ``error`` set) if compiling failed."""
        exc = self.future.exception()
        if exc is not None:
            self.error = str(exc) if isinstance(exc, GrammarError) else f"{type(exc).__name__}: {exc}"
            return False
        import xgrammar as xgr

        compiled: CompiledConstraint = self.future.result()
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.token_filter = compiled.token_filter
        return True

    def advance(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Accepts the sequence's completion tokens that the matcher has not seen yet."""
        for token in token_ids[num_prompt_tokens + self.num_accepted:]:
            if self.rejected or not self.matcher.accept_token(token):
                self.rejected = True
                return
            self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def is_complete(self) -> bool:
        """Whether the text so far is a whole match (a stop token accepted or not)."""
        return not self.rejected and (self.matcher.is_terminated() or self.matcher.is_completed())


def token_bitmask(grammars: Sequence[GrammarState], rows: list[int], vocab_size: int) -> TokenBitmask:
    """The allowed next tokens of each grammar, for the sampling rows ``rows``."""
    words = (vocab_size + 31) // 32
    bits = torch.full((len(grammars), words), -1, dtype=torch.int32)
    for i, grammar in enumerate(grammars):
        grammar.matcher.fill_next_token_bitmask(bits, i)
        if grammar.token_filter is not None:
            bits[i] &= grammar.token_filter
    return TokenBitmask(bits, rows)


def draft_bitmask_rows(grammar: GrammarState, drafts: Sequence[int], vocab_size: int) -> tuple[torch.Tensor, int]:
    """Walks the grammar along draft tokens: the allowed tokens at each position (the next token's, then after
    each kept draft) and how many leading drafts it keeps. A draft is kept while its position's mask allows it;
    a draft that would terminate the grammar is not (the model samples the stop token itself). The matcher is
    left where it was."""
    words = (vocab_size + 31) // 32
    bits = torch.full((len(drafts) + 1, words), -1, dtype=torch.int32)
    matcher, kept = grammar.matcher, 0
    for j in range(len(drafts) + 1):
        matcher.fill_next_token_bitmask(bits, j)
        if grammar.token_filter is not None:
            bits[j] &= grammar.token_filter
        if j == len(drafts):
            break
        token = drafts[j]
        if not 0 <= token < vocab_size or not (int(bits[j, token >> 5]) >> (token & 31)) & 1 \
                or not matcher.accept_token(token):
            break
        if matcher.is_terminated():
            matcher.rollback(1)
            break
        kept += 1
    if kept:
        matcher.rollback(kept)
    return bits[:kept + 1], kept


def draft_token_bitmask(grammars: Sequence[GrammarState], drafts: Sequence[Sequence[int]], first_rows: list[int],
                        vocab_size: int, known: Sequence[torch.Tensor | None] | None = None) -> TokenBitmask:
    """The allowed tokens of every verified position of the grammar rows: row ``first_rows[i] + j`` is the
    i-th grammar's position after its first ``j`` drafts (drafts the grammar allows: see draft_bitmask_rows).
    ``known[i]``, where given, holds those rows already: draft_bitmask_rows' masks for these drafts or longer
    ones (the proposer's check, reused instead of walking the grammar again)."""
    blocks, rows = [], []
    for i, (grammar, row_drafts, first) in enumerate(zip(grammars, drafts, first_rows, strict=True)):
        bits = known[i] if known is not None else None
        if bits is None or len(bits) <= len(row_drafts):
            bits, kept = draft_bitmask_rows(grammar, row_drafts, vocab_size)
            if kept != len(row_drafts):
                raise RuntimeError("a grammar row verifies draft tokens its grammar does not allow")
        blocks.append(bits[:len(row_drafts) + 1])
        rows += range(first, first + len(row_drafts) + 1)
    return TokenBitmask(torch.cat(blocks), rows)


def step_token_bitmask(grammars: Sequence[GrammarState | None], drafts: Sequence[Sequence[int]],
                       known: Sequence[torch.Tensor | None], vocab_size: int) -> TokenBitmask | None:
    """A step's masks over its sampling rows (each with its grammar or None, its drafts and the masks the
    proposer computed for them): rows follow the verified positions, one per row and draft; None when no row
    has a grammar."""
    rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return None
    if not any(drafts):
        return token_bitmask([grammars[i] for i in rows], rows, vocab_size)
    starts = [0, *itertools.accumulate(len(d) + 1 for d in drafts)]
    return draft_token_bitmask([grammars[i] for i in rows], [drafts[i] for i in rows], [starts[i] for i in rows],
                               vocab_size, [known[i] if drafts[i] else None for i in rows])
