"""SuffixDecoding drafts: depth-bounded suffix tries over each request's tokens and the job's finished outputs."""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# A trie of depth D holds every substring of length <= D of its texts, each node counting its occurrences.
# Substrings seen once are not spelled out node by node: a _Leaf points at the one text position where that
# occurrence continues, and is split one level when a second occurrence walks into it. Unique text therefore
# costs one leaf per position, and explicit nodes exist only for substrings seen at least twice.


class _Node:
    __slots__ = ("count", "cont", "best", "children")

    def __init__(self, count: int) -> None:
        self.count = count  # occurrences of this node's substring
        self.cont = 0  # of those, how many continue to a child (the sum of the children's counts)
        self.best: int | None = None  # most frequent child (ties: lowest token); None = none, or to recompute
        self.children: dict[int, _Node | _Leaf] | None = None


class _Leaf:
    """A substring seen once; that occurrence continues as text[pos], text[pos + 1], ..."""

    __slots__ = ("text", "pos")
    count = 1

    def __init__(self, text: Sequence[int], pos: int) -> None:
        self.text = text
        self.pos = pos


@dataclass(frozen=True)
class _Location:
    """Where a matched substring ends: at an explicit node, or inside a leaf whose next token is text[pos]."""

    node: _Node | None
    text: Sequence[int] | None = None
    pos: int = 0

    def continues(self) -> bool:
        return self.node.cont > 0 if self.node is not None else self.pos < len(self.text)


class _SuffixTrie:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0)
        self.num_nodes = 0  # explicit nodes below the root

    def extend(self, text: Sequence[int], start: int, active: list[_Node]) -> list[_Node]:
        """Insert the substrings ending at text[start:]. active[L] is the explicit node of the length-L suffix of
        text[:start] (a contiguous run from the root: a suffix seen twice has all its own suffixes seen twice);
        returns the same list for the whole text."""
        depth_limit = self.max_depth
        root = self.root
        for n in range(start, len(text)):
            token = text[n]
            advanced = [root]
            for depth, node in enumerate(active):
                node.cont += 1
                children = node.children
                if children is None:
                    children = node.children = {}
                child = children.get(token)
                if child is None:
                    children[token] = _Leaf(text, n)
                    count = 1
                elif type(child) is _Leaf:
                    child = children[token] = self._split(child, depth + 1)
                    count = 2
                else:
                    child.count += 1
                    count = child.count
                best = node.best
                if best is None:
                    if len(children) == 1:
                        node.best = token
                elif best != token:
                    best_count = children[best].count
                    if count > best_count or (count == best_count and token < best):
                        node.best = token
                if count > 1 and depth + 1 < depth_limit:
                    advanced.append(child)
            active = advanced
        return active

    def _split(self, leaf: _Leaf, depth: int) -> _Node:
        """A second occurrence enters `leaf` (at `depth`): its first token becomes a node seen twice."""
        node = _Node(2)
        self.num_nodes += 1
        nxt = leaf.pos + 1
        if nxt < len(leaf.text):
            leaf.pos = nxt
            token = leaf.text[nxt]
            node.children = {token: leaf}
            node.cont = 1
            node.best = token
        return node

    def remove(self, text: Sequence[int]) -> None:
        """Take back every substring occurrence that extend(text, 0, [root]) inserted."""
        for start in range(len(text)):
            node = self.root
            for i in range(start, min(start + self.max_depth, len(text))):
                token = text[i]
                children = node.children
                child = children[token]
                node.cont -= 1
                if type(child) is _Node:
                    child.count -= 1
                if child.count == 0 or type(child) is _Leaf:
                    del children[token]
                    if type(child) is _Node:
                        self.num_nodes -= _count_nodes(child)
                    if not children:
                        node.children = None
                    if node.best == token:
                        node.best = None
                    break
                if node.best == token:
                    node.best = None  # its count fell: recomputed when a draft needs it
                node = child

    def locate(self, tokens: Sequence[int], start: int, end: int) -> _Location | None:
        """Where tokens[start:end] ends in the trie, or None if it never occurred."""
        node = self.root
        i = start
        while i < end:
            children = node.children
            child = children.get(tokens[i]) if children is not None else None
            if child is None:
                return None
            i += 1
            if type(child) is _Leaf:
                text, pos = child.text, child.pos + 1
                if pos + end - i > len(text):
                    return None
                for j in range(end - i):
                    if text[pos + j] != tokens[i + j]:
                        return None
                return _Location(None, text, pos + end - i)
            node = child
        return _Location(node)

    def longest_match(self, tokens: Sequence[int], max_len: int) -> tuple[int, _Location | None]:
        """The longest suffix of tokens (at most max_len) that occurred with a continuation, by bisection
        (if a suffix occurred with a continuation, so did each shorter one)."""
        lo, hi, found = 0, min(max_len, len(tokens)), None
        end = len(tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            location = self.locate(tokens, end - mid, end)
            if location is not None and location.continues():
                lo, found = mid, location
            else:
                hi = mid - 1
        return lo, found


def _count_nodes(node: _Node) -> int:
    total, stack = 0, [node]
    while stack:
        current = stack.pop()
        total += 1
        if current.children:
            stack.extend(c for c in current.children.values() if type(c) is _Node)
    return total


def _best_child(node: _Node) -> int:
    if node.best is None:
        children = node.children
        node.best = max(children, key=lambda token: (children[token].count, -token))
    return node.best


def _follow(location: _Location, budget: int, min_token_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent continuation while the path's estimated probability stays >= min_token_prob;
    returns the tokens and the expected number accepted (the sum of the path's prefix probabilities)."""
    out: list[int] = []
    prob, score = 1.0, 0.0
    node, text, pos = location.node, location.text, location.pos
    while len(out) < budget:
        if node is not None:
            if node.cont == 0:
                break
            token = _best_child(node)
            child = node.children[token]
            step = prob * child.count / node.cont
            if step < min_token_prob:
                break
            prob = step
            out.append(token)
            if type(child) is _Leaf:
                node, text, pos = None, child.text, child.pos + 1
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
    # Job-wide trie budgets; the oldest finished requests are evicted first. It takes about 150-200 bytes per
    # cached token (the text, one leaf per position, nodes for repeats).
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
        self.trie = _SuffixTrie(max_depth)
        self.text: list[int] = []
        self.active = [self.trie.root]

    def update(self, tokens: Sequence[int]) -> None:
        known = len(self.text)
        if len(tokens) < known or (known and tokens[known - 1] != self.text[-1]):
            self.__init__(self.trie.max_depth)  # not a continuation of what we saw: start over
            known = 0
        if len(tokens) > known:
            self.text.extend(map(int, tokens[known:]))
            self.active = self.trie.extend(self.text, known, self.active)


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
        self._cached: deque[array] = deque()
        self._cached_tokens = 0

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
        match_len = min(len(state.active) - 1, self._max_match)
        best, best_score = self._draft(match_len, _Location(state.active[match_len]), k) if match_len else ([], 0.0)
        if self._global.root.cont:
            match_len, location = self._global.longest_match(state.text, self._max_match)
            if match_len:
                out, score = self._draft(match_len, location, k)
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
        text = array("i", map(int, tokens[start:]))
        self._global.extend(text, 0, [self._global.root])
        self._cached.append(text)
        self._cached_tokens += len(text)
        self._evict()

    def stats(self) -> SuffixStats:
        return SuffixStats(len(self._requests), len(self._cached), self._cached_tokens, self._global.num_nodes)

    def _state(self, seq_id: int) -> _RequestState:
        state = self._requests.get(seq_id)
        if state is None:
            raise KeyError(f"suffix proposer: unknown seq_id {seq_id} (add_request first; finish drops it)")
        return state

    def _draft(self, match_len: int, location: _Location, k: int) -> tuple[list[int], float]:
        budget = min(k, math.floor(self.options.max_spec_factor * match_len + self.options.max_spec_offset))
        return _follow(location, budget, self.options.min_token_prob) if budget > 0 else ([], 0.0)

    def _evict(self) -> None:
        """Forget the oldest finished requests until the job-wide trie fits its budgets."""
        while self._cached and (self._cached_tokens > self.options.max_cached_tokens
                                or self._global.num_nodes > self.options.max_cached_nodes):
            text = self._cached.popleft()
            self._global.remove(text)
            self._cached_tokens -= len(text)
