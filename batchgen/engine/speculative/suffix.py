"""SuffixDecoding drafts: depth-bounded suffix tries over each request's tokens and the job's finished outputs."""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# A trie of depth D holds every substring of length <= D of its texts, each node counting its occurrences.
# Substrings seen once are not spelled out node by node: a leaf points at the one text position where that
# occurrence continues, and is split one level when a second occurrence walks into it. Unique text therefore
# costs one leaf per position, and explicit nodes exist only for substrings seen at least twice.
# Nodes are ids into flat lists and leaves are negative ints, so that the garbage collector, which would
# otherwise walk millions of node objects on every full collection, sees only a handful of lists.

_ROOT = 0
_NONE = -1  # no best child, or one to recompute
_POS_BITS = 32


def _leaf(text_id: int, pos: int) -> int:
    """A leaf whose occurrence continues at texts[text_id][pos]; the leaf one token further on is leaf - 1."""
    return ~(text_id << _POS_BITS | pos)


def _leaf_place(leaf: int) -> tuple[int, int]:
    place = ~leaf
    return place >> _POS_BITS, place & ((1 << _POS_BITS) - 1)


@dataclass
class _Location:
    """Where a matched substring ends: at an explicit node, or (node == _NONE) inside a leaf whose next token
    is text[pos]."""

    node: int
    text: Sequence[int] = ()
    pos: int = 0


class _SuffixTrie:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.count = [0]  # per node: occurrences of its substring
        self.cont = [0]  # per node: of those, how many continue to a child (the sum of the children's counts)
        self.best = [_NONE]  # per node: the most frequent child token (ties: the lowest token)
        self.children: list[dict[int, int] | None] = [None]  # per node: token -> node id, or a leaf (< 0)
        self.texts: dict[int, Sequence[int]] = {}
        self.num_nodes = 0  # explicit nodes below the root
        self._free: list[int] = []

    def child_count(self, child: int) -> int:
        return self.count[child] if child >= 0 else 1

    def extend(self, text_id: int, start: int, active: list[int]) -> list[int]:
        """Insert the substrings of texts[text_id] ending at start or later. active[L] is the node of the length-L
        suffix of text[:start] (a contiguous run from the root: a suffix seen twice has all its own suffixes
        seen twice); returns the same list for the whole text."""
        text = self.texts[text_id]
        count, cont, best, children_of = self.count, self.cont, self.best, self.children
        depth_limit = self.max_depth
        for n in range(start, len(text)):
            token = text[n]
            advanced = [_ROOT]
            for depth, node in enumerate(active):
                cont[node] += 1
                children = children_of[node]
                if children is None:
                    children = children_of[node] = {}
                child = children.get(token)
                if child is None:
                    children[token] = _leaf(text_id, n)
                    seen = 1
                elif child < 0:
                    child = children[token] = self._split(child, depth + 1)
                    seen = 2
                else:
                    count[child] += 1
                    seen = count[child]
                incumbent = best[node]
                if incumbent == _NONE:
                    if len(children) == 1:
                        best[node] = token
                elif incumbent != token:
                    incumbent_seen = self.child_count(children[incumbent])
                    if seen > incumbent_seen or (seen == incumbent_seen and token < incumbent):
                        best[node] = token
                if seen > 1 and depth + 1 < depth_limit:
                    advanced.append(child)
            active = advanced
        return active

    def _split(self, leaf: int, depth: int) -> int:
        """A second occurrence enters `leaf` (at `depth`): its first token becomes a node seen twice."""
        node = self._new_node(2)
        text_id, pos = _leaf_place(leaf)
        text = self.texts[text_id]
        if depth < self.max_depth and pos + 1 < len(text):
            self.children[node] = {text[pos + 1]: leaf - 1}
            self.cont[node] = 1
            self.best[node] = text[pos + 1]
        return node

    def _new_node(self, count: int) -> int:
        self.num_nodes += 1
        if self._free:
            node = self._free.pop()
            self.count[node], self.cont[node], self.best[node], self.children[node] = count, 0, _NONE, None
            return node
        for column, value in ((self.count, count), (self.cont, 0), (self.best, _NONE), (self.children, None)):
            column.append(value)
        return len(self.count) - 1

    def remove(self, text_id: int) -> None:
        """Take back every substring occurrence that extend(text_id, 0, [root]) inserted, and the text."""
        text = self.texts.pop(text_id)
        count, cont, best, children_of = self.count, self.cont, self.best, self.children
        for start in range(len(text)):
            node = _ROOT
            for i in range(start, min(start + self.max_depth, len(text))):
                token = text[i]
                children = children_of[node]
                child = children[token]
                cont[node] -= 1
                if best[node] == token:
                    best[node] = _NONE  # its count falls: recomputed when a draft needs it
                if child >= 0:
                    count[child] -= 1
                if child < 0 or count[child] == 0:
                    del children[token]
                    if not children:
                        children_of[node] = None
                    if child >= 0:
                        self._free_subtree(child)
                    break
                node = child

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            current = stack.pop()
            children = self.children[current]
            if children:
                stack.extend(c for c in children.values() if c >= 0)
            self.children[current] = None
            self._free.append(current)
            self.num_nodes -= 1

    def locate(self, tokens: Sequence[int], start: int, end: int) -> _Location | None:
        """Where tokens[start:end] ends in the trie, or None if it never occurred."""
        node = _ROOT
        i = start
        while i < end:
            children = self.children[node]
            child = children.get(tokens[i]) if children is not None else None
            if child is None:
                return None
            i += 1
            if child < 0:
                text_id, pos = _leaf_place(child)
                text, pos = self.texts[text_id], pos + 1
                if pos + end - i > len(text):
                    return None
                for j in range(end - i):
                    if text[pos + j] != tokens[i + j]:
                        return None
                return _Location(_NONE, text, pos + end - i)
            node = child
        return _Location(node)

    def continues(self, location: _Location) -> bool:
        return self.cont[location.node] > 0 if location.node != _NONE else location.pos < len(location.text)

    def longest_match(self, tokens: Sequence[int], max_len: int) -> tuple[int, _Location | None]:
        """The longest suffix of tokens (at most max_len) that occurred with a continuation, by bisection
        (if a suffix occurred with a continuation, so did each shorter one)."""
        lo, hi, found = 0, min(max_len, len(tokens)), None
        end = len(tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            location = self.locate(tokens, end - mid, end)
            if location is not None and self.continues(location):
                lo, found = mid, location
            else:
                hi = mid - 1
        return lo, found

    def best_child(self, node: int) -> int:
        if self.best[node] == _NONE:
            children = self.children[node]
            self.best[node] = max(children, key=lambda token: (self.child_count(children[token]), -token))
        return self.best[node]

    def follow(self, location: _Location, budget: int, min_token_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent continuation while the path's estimated probability stays >= min_token_prob;
        returns the tokens and the expected number accepted (the sum of the path's prefix probabilities)."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        node, text, pos = location.node, location.text, location.pos
        while len(out) < budget:
            if node != _NONE:
                if self.cont[node] == 0:
                    break
                token = self.best_child(node)
                child = self.children[node][token]
                step = prob * self.child_count(child) / self.cont[node]
                if step < min_token_prob:
                    break
                prob = step
                out.append(token)
                if child < 0:
                    text_id, pos = _leaf_place(child)
                    node, text, pos = _NONE, self.texts[text_id], pos + 1
                else:
                    node = child
            else:
                if pos >= len(text):
                    break
                out.append(text[pos])
                pos += 1
            score += prob
        return out, score


@dataclass(frozen=True)
class SuffixOptions:
    """Tuning knobs of the "suffix" method."""

    max_tree_depth: int = 24  # longest substring counted: match length + draft length <= this
    max_spec_factor: float = 1.0  # draft at most factor * match length + offset tokens
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # stop when the draft path's estimated probability falls below this
    # Job-wide trie budgets (0: no job-wide trie); the oldest finished requests are evicted first. It takes about
    # 150-200 bytes per cached token (the text, one leaf per position, nodes for repeats).
    max_cached_tokens: int = 500_000
    max_cached_nodes: int = 500_000
    cache_prompts: bool = False  # job-wide trie learns whole prompts too (else only their last max_tree_depth tokens)

    @classmethod
    def parse(cls, options: dict[str, object]) -> SuffixOptions:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(f"unknown suffix option(s) {', '.join(unknown)}; valid options: {', '.join(names)}")
        parsed = cls(**options)
        parsed._check()
        return parsed

    def _check(self) -> None:
        for name in ("max_tree_depth", "max_cached_tokens", "max_cached_nodes"):
            _require_int(name, getattr(self, name), minimum=1 if name == "max_tree_depth" else 0)
        for name in ("max_spec_factor", "max_spec_offset", "min_token_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"suffix option {name} must be a finite number, got {value!r}")
        if self.max_spec_factor < 0:
            raise ValueError(f"suffix option max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"suffix option min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if not isinstance(self.cache_prompts, bool):
            raise ValueError(f"suffix option cache_prompts must be true or false, got {self.cache_prompts!r}")


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"suffix option {name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SuffixStats:
    active_requests: int
    cached_requests: int
    cached_tokens: int
    cached_nodes: int


class _RequestState:
    """One running request: its tokens so far and a trie over them, extended as the tokens grow."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.reset()

    def reset(self) -> None:
        self.trie = _SuffixTrie(self.max_depth)
        self.text: list[int] = []
        self.trie.texts[0] = self.text
        self.active = [_ROOT]

    def update(self, tokens: Sequence[int]) -> None:
        """Extend by the tokens past those seen (checked by the last one seen); anything else starts over."""
        known = len(self.text)
        if len(tokens) < known or (known and tokens[known - 1] != self.text[-1]):
            self.reset()
            known = 0
        if len(tokens) > known:
            self.text.extend(map(int, tokens[known:]))
            self.active = self.trie.extend(0, known, self.active)

    def longest_match(self, max_len: int) -> int:
        """The longest suffix seen before (so with a continuation): the deepest active node."""
        return min(len(self.active) - 1, max_len)


class SuffixProposer:
    """Drafts each request's continuation from its own prompt and output, and from the outputs of the job's
    finished requests, taking whichever source expects more accepted tokens (SuffixDecoding, arXiv 2411.04975)."""

    def __init__(self, num_speculative_tokens: int, **options: object) -> None:
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
        self.options = SuffixOptions.parse(options)
        if self.options.max_tree_depth <= num_speculative_tokens:
            raise ValueError(f"suffix option max_tree_depth ({self.options.max_tree_depth}) must exceed "
                             f"num_speculative_tokens ({num_speculative_tokens})")
        self.num_speculative_tokens = num_speculative_tokens
        self._max_match = self.options.max_tree_depth - num_speculative_tokens
        self._requests: dict[int, _RequestState] = {}
        self._global = _SuffixTrie(self.options.max_tree_depth)
        self._cached: deque[int] = deque()  # text ids in the job-wide trie, oldest first
        self._cached_tokens = 0
        self._next_text_id = 0

    def add_request(self, seq_id: int, prompt: Sequence[int]) -> None:
        if seq_id in self._requests:
            raise ValueError(f"suffix proposer: seq_id {seq_id} is already running")
        state = self._requests[seq_id] = _RequestState(self.options.max_tree_depth)
        state.update(prompt)

    def propose(self, seq_id: int, tokens: Sequence[int], k: int) -> list[int]:
        if k < 0:
            raise ValueError(f"suffix proposer: k must be >= 0, got {k}")
        k = min(k, self.num_speculative_tokens)
        state = self._state(seq_id)
        state.update(tokens)
        if k == 0:
            return []
        match_len = state.longest_match(self._max_match)
        best, best_score = self._draft(state.trie, match_len, _Location(state.active[match_len]), k)
        if self._global.cont[_ROOT]:
            match_len, location = self._global.longest_match(state.text, self._max_match)
            out, score = self._draft(self._global, match_len, location, k)
            if (score, len(out)) > (best_score, len(best)):
                best = out
        return best

    def finish(self, seq_id: int, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        if not 0 <= num_prompt_tokens <= len(tokens):
            raise ValueError(f"suffix proposer: num_prompt_tokens {num_prompt_tokens} is outside 0..{len(tokens)}")
        self._state(seq_id)  # an unknown id is an error
        del self._requests[seq_id]
        if num_prompt_tokens == len(tokens) or not (self.options.max_cached_tokens and self.options.max_cached_nodes):
            return
        start = 0 if self.options.cache_prompts else max(0, num_prompt_tokens - self.options.max_tree_depth)
        text_id, self._next_text_id = self._next_text_id, self._next_text_id + 1
        self._global.texts[text_id] = text = array("i", map(int, tokens[start:]))
        self._global.extend(text_id, 0, [_ROOT])
        self._cached.append(text_id)
        self._cached_tokens += len(text)
        self._evict()

    def stats(self) -> SuffixStats:
        return SuffixStats(len(self._requests), len(self._cached), self._cached_tokens, self._global.num_nodes)

    def _state(self, seq_id: int) -> _RequestState:
        state = self._requests.get(seq_id)
        if state is None:
            raise KeyError(f"suffix proposer: unknown seq_id {seq_id} (add_request first; finish drops it)")
        return state

    def _draft(self, trie: _SuffixTrie, match_len: int, location: _Location | None,
               k: int) -> tuple[list[int], float]:
        budget = min(k, math.floor(self.options.max_spec_factor * match_len + self.options.max_spec_offset))
        if match_len == 0 or budget <= 0:
            return [], 0.0
        return trie.follow(location, budget, self.options.min_token_prob)

    def _evict(self) -> None:
        """Forget the oldest finished requests until the job-wide trie fits its budgets."""
        while self._cached and (self._cached_tokens > self.options.max_cached_tokens
                                or self._global.num_nodes > self.options.max_cached_nodes):
            text_id = self._cached.popleft()
            self._cached_tokens -= len(self._global.texts[text_id])
            self._global.remove(text_id)
