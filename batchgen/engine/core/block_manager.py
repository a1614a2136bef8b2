"""Paged KV-cache block allocation with prefix caching by chained block hashes."""
from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice

from batchgen.engine.core.sequence import Sequence


EVICTION_WINDOW = 8  # evictions pick runs of blocks among this many times as many of the oldest cached ones


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its KV is (being) computed
    token_ids: tuple[int, ...] = field(default_factory=tuple)
    reused: bool = False  # a later sequence found it by hash: a shared prefix, which eviction keeps in LRU order


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the block before it, so equal hashes mean equal prefixes.

    A 64-bit BLAKE2b digest, the same in every process: the persistent prefix store keys blocks by it.
    """
    h = hashlib.blake2b(b"" if prev_hash is None else prev_hash.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def fewest_runs(candidates: list[int], count: int) -> list[int]:
    """``count`` of ``candidates`` (block ids, oldest first) in few runs of consecutive ids, ascending: the run with
    the oldest block among those that cover what is still wanted (from that block's end), else the longest run (of
    equal ones, the one with the older block), and on."""
    age = {block_id: i for i, block_id in enumerate(candidates)}
    groups: list[list[int]] = []
    for block_id in sorted(candidates):
        if groups and block_id == groups[-1][-1] + 1:
            groups[-1].append(block_id)
        else:
            groups.append([block_id])
    # (length, minus the age of its oldest block, ids): shortest first, of equal length the older last
    runs = sorted((len(ids), -min(age[b] for b in ids), ids) for ids in groups)
    taken: list[int] = []
    while len(taken) < count:
        wanted = count - len(taken)
        covering = bisect_left(runs, (wanted,))
        i = max(range(covering, len(runs)), key=lambda j: runs[j][1]) if covering < len(runs) else len(runs) - 1
        ids = runs.pop(i)[2]
        taken += ids[:wanted] if age[ids[0]] <= age[ids[-1]] else ids[-wanted:]
    return sorted(taken)


class BlockManager:
    """Hands out fixed-size KV blocks; full, computed blocks stay findable by hash until reused.

    With prefix caching, a freed block that held tokens goes to the back of a least-recently-freed list, keeping
    its hash where it has one, so a later request with the same prefix can reclaim it; blocks are only wiped when
    handed out for new tokens. New tokens take a blank block first (one that holds no tokens: never used, an
    unused earmark, or any freed block without prefix caching), the most recently freed of them: its memory is
    still mapped and likely cached, where a never-used block of a lazily mapped cache costs page faults on its
    first write (a tenth of a decode step on a small VM). Only when no blank block is left are cached ones evicted,
    in runs of consecutive blocks picked among the oldest (:meth:`_evict`); blocks a later sequence found by hash
    (shared prefixes) are evicted only in their turn.
    With a ``window`` (every attention layer reads only its latest ``window`` keys), a sequence's blocks that
    fall wholly before the window of its next token are freed as it runs; its block table keeps -1 in their
    place.

    An admitted sequence also earmarks free blocks, right after its prompt's, for the tokens it may still
    generate (up to ``max_earmark``, and an eighth of the cache in all): its decode steps then extend one run of
    blocks. Taken as each row crosses a block boundary, a batch's new blocks interleave its rows, and once freed
    they scatter later prompts' blocks too (a steady batch of 64 then decoded 1.05-1.12x slower on CPU).
    Earmarks are taken as new tokens' blocks are (blank first, then evicting the oldest cached) and stay free:
    other sequences take them, newest earmarks first, only once no other free block is left. A sequence frees
    its unused earmarks with its blocks, as one run.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, record_completed: bool = False, max_model_len: int | None = None,
                 max_earmark: int = 64):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_earmark = max_earmark
        self.eviction_window = EVICTION_WINDOW
        self.max_earmarked = num_blocks // 8  # in all: earmarks never crowd out much of the prefix cache
        self.earmarks: dict[int, list[int]] = {}  # seq_id -> its earmarked blocks (holding nothing), descending
        self.num_earmarked = 0
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blank: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 first
        self.cached: OrderedDict[int, None] = OrderedDict()  # free blocks findable by hash, oldest first
        self.hash_to_block: dict[int, int] = {}
        # With lower prefix tiers: (block id, hash, tokens) of blocks registered since take_completed.
        self.record_completed = record_completed
        self.completed: list[tuple[int, int, tuple[int, ...]]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.blank) + self.num_earmarked + len(self.cached)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _full_block(self, seq: Sequence, i: int) -> tuple[int, tuple[int, ...]]:
        """Chained hash and tokens of the sequence's i-th full block, computed once per sequence."""
        blocks = seq.full_blocks
        while len(blocks) <= i:
            j = len(blocks)
            tokens = tuple(seq.token_ids[j * self.block_size:(j + 1) * self.block_size])
            blocks.append((chain_hash(blocks[-1][0] if blocks else None, tokens), tokens))
        return blocks[i]

    def prefix_blocks(self, seq: Sequence) -> list[tuple[int, tuple[int, ...]]]:
        """(hash, tokens) of the full blocks a cached prefix of ``seq`` may cover (all but its last token)."""
        return [self._full_block(seq, i) for i in range((seq.num_tokens - 1) // self.block_size)]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that already hold the KV of the sequence's leading full blocks."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        # Leave at least one token to compute: its logits are needed for the next token.
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_hash, tokens = self._full_block(seq, i)
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def num_cached_blocks(self, seq: Sequence) -> int:
        """Leading full blocks of ``seq`` the device cache holds now."""
        return len(self._cached_prefix(seq))

    def can_admit(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = -(-seq.num_tokens // self.block_size) - len(hits)
        return fresh + reclaimed <= self.num_free_blocks

    def admit(self, seq: Sequence) -> int:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks; returns the
        number of tokens the cache already held."""
        assert not seq.block_table
        hits = self._cached_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached[block_id]
            block.ref_count += 1
            block.reused = True
        seq.block_table = list(hits)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.allocate(seq, seq.num_tokens, earmark=True)
        return seq.num_computed_tokens

    def _earmark_count(self, seq: Sequence, num_blocks: int, reserved: int) -> int:
        """How many blocks to earmark for what ``seq`` may still generate past its first ``num_blocks`` blocks,
        with ``reserved`` of the blank and cached blocks already promised to it."""
        final = seq.num_prompt_tokens + seq.params.max_tokens
        if self.max_model_len is not None:
            final = min(final, self.max_model_len)
        wanted = -(-final // self.block_size) - num_blocks
        return max(0, min(wanted, self.max_earmark, self.max_earmarked - self.num_earmarked,
                          len(self.blank) + len(self.cached) - reserved))

    def _take_earmarked(self, seq_id: int, lowest: bool) -> int:
        """One of ``seq_id``'s earmarked blocks: the lowest (its own next block) or the highest (taken by another)."""
        ids = self.earmarks[seq_id]
        block_id = ids.pop() if lowest else ids.pop(0)
        if not ids:
            del self.earmarks[seq_id]
        self.num_earmarked -= 1
        return block_id

    def _take_unmarked(self, count: int) -> list[int]:
        """``count`` blank blocks, the latest freed first, then cached ones evicted (:meth:`_evict`)."""
        taken = [self.blank.pop() for _ in range(min(count, len(self.blank)))]
        return taken + self._evict(count - len(taken)) if count > len(taken) else taken

    def _evict(self, count: int) -> list[int]:
        """``count`` cached blocks, forgotten by the prefix cache: whole runs of consecutive blocks among the oldest
        ``eviction_window`` times ``count`` (:func:`fewest_runs`).

        Taking just the oldest, a new sequence got the tail of one freed sequence's run and the head of the next,
        and the pieces split up further with every turn of the cache: a stream of 200-700-token prompts read 2-6
        runs a row (0.94 of its block pairs in order), and the CPU decode op took 1.16-1.18x its time over
        consecutive blocks; picking runs, 1.00 in order and 1.02-1.06x (``benchmarks/turned_over_tables.py``). Over
        eight such streams through one cache the old rule's share fell to 0.51 and decode ran 1.07x slower
        (``benchmarks/block_runs_ab.py --stream``).
        Only blocks no sequence has found by hash are taken ahead of their turn, and at most ``eviction_window``
        times the request's size ahead: jobs of 24 and 40 shared prefixes then found 2-3 % more prompt tokens in
        the cache, the never-found blocks of unique prompts going first."""
        oldest = list(islice(self.cached, count * self.eviction_window))
        oldest = oldest[:count] + [b for b in oldest[count:] if not self.blocks[b].reused]
        taken = fewest_runs(oldest, count)
        for block_id in taken:
            del self.cached[block_id]
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.reused = None, (), False
        return taken

    def allocate(self, seq: Sequence, num_tokens: int, earmark: bool = False) -> None:
        """Append fresh blocks so the first ``num_tokens`` tokens of ``seq`` have slots, in ascending order (with
        ``earmark``, also the sequence's earmarks, above them). They come from the sequence's own earmarks, then
        blank or cached blocks (:meth:`_take_unmarked`), then, when no other block is free, others' earmarks.

        The blocks taken are the same whatever their order; ascending, a run of blocks freed together (a finished
        sequence releases its own tail first, so eviction hands them out descending) is read as one stream again:
        once a job's cache has turned over, the CPU decode op (reading a row's blocks in table order) took 1.73x its
        time over contiguous tables at prompts of 1,500-3,000 tokens, 1.18-1.27x at 200-700; in ascending order
        1.00-1.02x and 1.16-1.23x (``benchmarks/turned_over_tables.py``)."""
        needed = self.blocks_needed(seq, num_tokens)
        if not needed and not earmark:  # most decode steps
            return
        own = min(needed, len(self.earmarks.get(seq.seq_id, ())))
        taken = [self._take_earmarked(seq.seq_id, lowest=True) for _ in range(own)]
        unmarked = min(needed - own, len(self.blank) + len(self.cached))
        spare = self._earmark_count(seq, len(seq.block_table) + needed, unmarked) if earmark else 0
        taken += self._take_unmarked(unmarked + spare)
        taken += [self._take_earmarked(next(reversed(self.earmarks)), lowest=False)
                  for _ in range(needed - own - unmarked)]
        taken.sort()  # the earmarks continue the run: the lowest of all the blocks taken go to the tokens
        taken, spare_ids = taken[:needed], taken[needed:]
        if spare_ids:
            self.earmarks[seq.seq_id] = spare_ids[::-1]
            self.num_earmarked += len(spare_ids)
        for block_id in taken:
            block = self.blocks[block_id]
            block.hash, block.token_ids, block.ref_count = None, (), 1
        seq.block_table += taken

    def mark_scheduled(self, seq: Sequence, num_tokens: int) -> None:
        """Register hashes of blocks completed by computing the first ``num_tokens`` tokens.

        Called at scheduling time: every layer stores a step's K/V before any attention reads the
        cache, so later sequences in the same step may already share these blocks.
        """
        if not self.enable_prefix_caching:
            return
        for i in range(seq.num_hashed_blocks, num_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = self._full_block(seq, i)
                if self.hash_to_block.setdefault(block.hash, block.block_id) == block.block_id \
                        and self.record_completed:
                    self.completed.append((block.block_id, block.hash, block.token_ids))
            seq.num_hashed_blocks = i + 1

    def mark_restored(self, seq: Sequence, i: int) -> None:
        """The sequence's i-th block (its next uncomputed one) got its KV from a lower tier: register it. It was
        found by hash there, so eviction treats it as a shared prefix (``Block.reused``)."""
        assert i == seq.num_hashed_blocks == seq.num_computed_tokens // self.block_size
        block = self.blocks[seq.block_table[i]]
        block.hash, block.token_ids = self._full_block(seq, i)
        block.reused = True
        self.hash_to_block.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = i + 1
        seq.num_computed_tokens += self.block_size

    def take_completed(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Blocks registered by computing them since the last call (what goes down to the lower tiers)."""
        done, self.completed = self.completed, []
        return done

    def release_out_of_window(self, seq: Sequence) -> None:
        """Frees the leading blocks no query from the sequence's next token on can read."""
        if self.window is None:
            return
        first_needed = seq.num_computed_tokens - self.window + 1
        for i in range(seq.num_released_blocks, max(0, first_needed // self.block_size)):
            self._release(seq.block_table[i])
            seq.block_table[i] = -1
            seq.num_released_blocks = i + 1

    def _release(self, block_id: int) -> None:
        """One holder fewer; at none the block is free. With prefix caching it joins the cached blocks in the
        order blocks are freed, findable by hash where it has one: a sequence's blocks, freed together, are then
        evicted together and come back as one run (a partial last block on the blank stack would go to the next
        prompt, splitting its blocks: after the cache turned over, a batch of 64 then decoded 1.02-1.03x slower)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count:
            return
        if block.hash is None or self.hash_to_block.get(block.hash) != block_id:
            block.hash, block.token_ids, block.reused = None, (), False
        if self.enable_prefix_caching:
            self.cached[block_id] = None
        else:
            self.blank.append(block_id)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Frees the sequence's trailing blocks past its first ``num_tokens`` tokens (rejected draft tokens)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            if block.ref_count == 1 and block.hash is None:  # back to the sequence's earmarks, next in its run
                block.ref_count = 0
                self.earmarks.setdefault(seq.seq_id, []).append(block_id)
                self.num_earmarked += 1
            else:
                self._release(block_id)

    def free_seq(self, seq: Sequence) -> None:
        earmarked = self.earmarks.pop(seq.seq_id, [])
        self.num_earmarked -= len(earmarked)
        self.blank += earmarked  # below the sequence's own blocks on the stack: the run comes back in order
        for block_id in reversed(seq.block_table[seq.num_released_blocks:]):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.num_released_blocks = 0
