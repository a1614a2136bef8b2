"""The "suffix" draft proposer against a brute-force matcher over plain token lists."""

import math
import random
from collections import Counter, deque

import numpy as np
import pytest

from batchgen.engine.speculative.suffix import SuffixProposer, SuffixStats


class ReferenceSuffix:
    """SuffixDecoding spelled out by scanning every text: counts of what follows a substring, the longest
    suffix match with a continuation, a greedy most-frequent path, and the better of the two sources."""

    def __init__(self, num_speculative_tokens, max_tree_depth=24, max_spec_factor=1.0, max_spec_offset=0.0,
                 min_token_prob=0.1, max_cached_tokens=1_000_000, cache_prompts=False):
        self.k_max, self.depth = num_speculative_tokens, max_tree_depth
        self.factor, self.offset, self.min_prob = max_spec_factor, max_spec_offset, min_token_prob
        self.budget, self.cache_prompts = max_cached_tokens, cache_prompts
        self.cached = deque()

    @staticmethod
    def followers(texts, s):
        counts = Counter()
        for text in texts:
            for i in range(len(text) - len(s)):
                if text[i:i + len(s)] == s:
                    counts[text[i + len(s)]] += 1
        return counts

    def draft(self, texts, tokens, k):
        cap = min(self.depth - self.k_max, len(tokens))
        match = max((m for m in range(1, cap + 1) if self.followers(texts, tokens[len(tokens) - m:])), default=0)
        budget = min(k, math.floor(self.factor * match + self.offset)) if match else 0
        s, out, prob, score = list(tokens[len(tokens) - match:]), [], 1.0, 0.0
        while len(out) < budget:
            counts = self.followers(texts, s)
            if not counts:
                break
            token = min(counts, key=lambda t: (-counts[t], t))
            step = prob * counts[token] / sum(counts.values())
            if step < self.min_prob:
                break
            prob = step
            out.append(token)
            s.append(token)
            score += prob
        return out, score

    def propose(self, tokens, k):
        k = min(k, self.k_max)
        local = self.draft([list(tokens)], list(tokens), k)
        cached = self.draft(list(self.cached), list(tokens), k)
        return cached[0] if (cached[1], len(cached[0])) > (local[1], len(local[0])) else local[0]

    def finish(self, tokens, num_prompt_tokens):
        if num_prompt_tokens == len(tokens):
            return
        start = 0 if self.cache_prompts else max(0, num_prompt_tokens - self.depth)
        self.cached.append(list(tokens[start:]))
        while self.cached and sum(map(len, self.cached)) > self.budget:
            self.cached.popleft()


def test_proposes_the_continuation_of_a_span_repeated_from_the_prompt():
    document = [500 + i for i in range(40)]
    prompt = [1, 2, 3] + document + [7, 8]
    proposer = SuffixProposer(5)
    proposer.add_request(0, prompt)
    # The output starts copying the document: the draft is the document's next tokens.
    tokens = prompt + document[:6]
    assert proposer.propose(0, tokens, 5) == document[6:11]
    tokens += document[6:9]
    assert proposer.propose(0, np.array(tokens), 4) == document[9:13]


def test_learns_boilerplate_output_from_finished_requests():
    boilerplate = [900, 901, 902, 903, 904, 905, 906, 907]
    proposer = SuffixProposer(6)
    rng = random.Random(0)
    for seq_id in range(3):
        prompt = [rng.randrange(1000, 5000) for _ in range(30)] + [42, 43]
        proposer.add_request(seq_id, prompt)
        output = boilerplate + [rng.randrange(6000, 7000) for _ in range(5)]
        proposer.finish(seq_id, prompt + output, len(prompt))
    prompt = [rng.randrange(10_000, 20_000) for _ in range(30)] + [42, 43]
    proposer.add_request(7, prompt)
    # Before the first output token: the prompt's tail matches the tail the earlier rows ended with.
    assert proposer.propose(7, prompt, 2) == boilerplate[:2]
    # The prompt's own tokens never contain the boilerplate; only earlier rows' outputs do.
    assert proposer.propose(7, prompt + boilerplate[:3], 6) == boilerplate[3:8]


def test_never_proposes_more_than_k():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 4
    proposer = SuffixProposer(4, max_spec_factor=10.0)
    proposer.add_request(0, tokens)
    for k in range(0, 8):
        draft = proposer.propose(0, tokens, k)
        assert draft == [1, 2, 3, 4][:min(k, 4)]
    with pytest.raises(ValueError, match="k must be >= 0"):
        proposer.propose(0, tokens, -1)


def test_returns_nothing_without_a_match():
    proposer = SuffixProposer(4)
    proposer.add_request(0, list(range(100)))
    assert proposer.propose(0, list(range(100)) + [1000], 4) == []
    assert proposer.propose(0, list(range(100)) + [1000, 1001], 4) == []
    proposer.finish(0, list(range(100)) + [1000, 1001], 100)
    proposer.add_request(1, [5000, 5001])
    assert proposer.propose(1, [5000, 5001], 4) == []


def test_speculation_stops_on_a_low_frequency_branch():
    # Ten earlier rows all wrote "10 11 12 13" and then each a different token.
    proposer = SuffixProposer(8, max_spec_factor=4.0, min_token_prob=0.3)
    for seq_id in range(10):
        proposer.add_request(seq_id, [1])
        proposer.finish(seq_id, [1, 10, 11, 12, 13, 100 + seq_id, 14, 15], 1)
    proposer.add_request(99, [2, 3])
    assert proposer.propose(99, [2, 3, 10, 11], 8) == [12, 13]
    # A threshold below one in ten follows the (tie-broken) branch, and the draft grows with the match length.
    loose = SuffixProposer(8, max_spec_factor=4.0, min_token_prob=0.05)
    for seq_id in range(10):
        loose.add_request(seq_id, [1])
        loose.finish(seq_id, [1, 10, 11, 12, 13, 100 + seq_id, 14, 15], 1)
    loose.add_request(99, [2, 3])
    assert loose.propose(99, [2, 3, 10, 11], 8) == [12, 13, 100, 14, 15]
    assert loose.propose(99, [2, 3, 10], 8) == [11, 12, 13, 100]  # 4 x a 1-token match


def test_eviction_keeps_the_cache_under_budget_and_forgets_the_oldest():
    rng = random.Random(1)
    proposer = SuffixProposer(4, max_cached_tokens=300, max_cached_nodes=10_000)
    outputs = []
    for seq_id in range(20):
        output = [rng.randrange(1000, 1100) for _ in range(40)]
        outputs.append(output)
        proposer.add_request(seq_id, [7])
        proposer.finish(seq_id, [7] + output, 1)
        stats = proposer.stats()
        assert stats.cached_tokens <= 300
    assert proposer.stats().cached_requests == 300 // 41
    newest, oldest = outputs[-1], outputs[0]
    proposer.add_request(50, [3, 4])
    assert proposer.propose(50, [3, 4] + newest[:8], 4) == newest[8:12]
    assert proposer.propose(50, [3, 4] + oldest[:8], 4) != oldest[8:12]

    by_nodes = SuffixProposer(4, max_cached_nodes=50)
    for seq_id, output in enumerate(outputs):
        by_nodes.add_request(seq_id, [7])
        by_nodes.finish(seq_id, [7] + output + output, 1)  # repeats: explicit nodes
        assert by_nodes.stats().cached_nodes <= 50


def test_evicting_everything_leaves_an_empty_cache():
    rng = random.Random(2)
    proposer = SuffixProposer(3, max_tree_depth=6, max_cached_tokens=10_000)
    for seq_id in range(30):
        output = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        proposer.add_request(seq_id, [9])
        proposer.finish(seq_id, [9] + output, 1)
    assert proposer.stats().cached_nodes > 0
    # One output over the whole budget pushes out every earlier one, and then itself.
    proposer.add_request(99, [9])
    proposer.finish(99, [9] + [rng.randrange(4) for _ in range(10_000)], 1)
    assert proposer.stats() == SuffixStats(0, 0, 0, 0)
    trie = proposer._global
    assert trie.children[0] is None and trie.cont[0] == 0 and not trie.texts
    assert len(trie._free) == len(trie.count) - 1  # every node below the root is free for reuse


def test_finish_drops_the_request_state():
    proposer = SuffixProposer(4)
    proposer.add_request(3, [1, 2, 3, 1, 2])
    assert proposer.stats().active_requests == 1
    proposer.finish(3, [1, 2, 3, 1, 2, 3], 5)
    assert proposer.stats().active_requests == 0
    with pytest.raises(KeyError, match="unknown seq_id 3"):
        proposer.propose(3, [1, 2, 3, 1, 2, 3], 4)
    with pytest.raises(KeyError, match="unknown seq_id 3"):
        proposer.finish(3, [1, 2, 3, 1, 2, 3], 5)
    proposer.add_request(3, [8, 9])  # the id can be reused
    with pytest.raises(ValueError, match="already running"):
        proposer.add_request(3, [8, 9])
    with pytest.raises(ValueError, match="num_prompt_tokens 5 is outside 0..2"):
        proposer.finish(3, [8, 9], 5)


@pytest.mark.parametrize("options, message", [
    ({"max_tree_dpeth": 8}, "unknown suffix option.*max_tree_dpeth.*valid options: max_tree_depth"),
    ({"max_tree_depth": 0}, "max_tree_depth must be an integer >= 1"),
    ({"max_tree_depth": 4}, r"max_tree_depth \(4\) must exceed num_speculative_tokens \(4\)"),
    ({"max_tree_depth": 8.5}, "max_tree_depth must be an integer"),
    ({"max_cached_tokens": -1}, "max_cached_tokens must be an integer >= 0"),
    ({"max_cached_nodes": True}, "max_cached_nodes must be an integer"),
    ({"min_token_prob": 1.5}, r"min_token_prob must be in \[0, 1\]"),
    ({"min_token_prob": "high"}, "min_token_prob must be a finite number"),
    ({"max_spec_factor": -1.0}, "max_spec_factor must be >= 0"),
    ({"max_spec_offset": float("nan")}, "max_spec_offset must be a finite number"),
    ({"cache_prompts": "yes"}, "cache_prompts must be true or false"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        SuffixProposer(4, **options)


@pytest.mark.parametrize("num_speculative_tokens", [0, -2, 2.0, True])
def test_bad_num_speculative_tokens(num_speculative_tokens):
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        SuffixProposer(num_speculative_tokens)


def test_tokens_that_do_not_extend_the_request_start_it_over():
    proposer = SuffixProposer(3, max_spec_factor=2.0)
    proposer.add_request(0, [1, 2, 3, 4, 1, 2])
    assert proposer.propose(0, [1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert proposer.propose(0, [5, 6, 7, 8, 5, 6, 7], 3) == [8, 5, 6]  # longer, but not a continuation
    assert proposer.propose(0, [5, 6], 3) == []  # shorter than before


@pytest.mark.parametrize("seed", range(10))
def test_incremental_tries_match_a_rebuild_and_the_brute_force_reference(seed):
    rng = random.Random(seed)
    options = {
        "max_tree_depth": rng.choice([5, 7, 10]),
        "max_spec_factor": rng.choice([1.0, 1.5, 3.0]),
        "max_spec_offset": rng.choice([0.0, 1.0]),
        "min_token_prob": rng.choice([0.0, 0.1, 0.4]),
        "max_cached_tokens": rng.choice([40, 150, 10_000]),
        "cache_prompts": rng.random() < 0.5,
    }
    k_max = rng.randrange(1, options["max_tree_depth"] - 1)
    proposer = SuffixProposer(k_max, **options)
    reference = ReferenceSuffix(k_max, **options)
    vocab = rng.choice([2, 3, 5])
    checked = 0
    for seq_id in range(8):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 25))]
        proposer.add_request(seq_id, prompt)
        tokens = list(prompt)
        while len(tokens) < len(prompt) + 30:
            tokens += [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5]))]
            k = rng.randrange(0, k_max + 2)
            draft = proposer.propose(seq_id, tokens, k)
            assert draft == reference.propose(tokens, k), (seq_id, tokens, k)
            rebuilt = SuffixProposer(k_max, **options)
            rebuilt._global, rebuilt._cached = proposer._global, proposer._cached
            rebuilt.add_request(seq_id, tokens)
            assert rebuilt.propose(seq_id, tokens, k) == draft
            checked += bool(draft)
        proposer.finish(seq_id, tokens, len(prompt))
        reference.finish(tokens, len(prompt))
        assert proposer.stats().cached_tokens == sum(map(len, reference.cached))
    assert checked > 20
