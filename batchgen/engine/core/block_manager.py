"""Paged KV-cache block allocation with prefix caching by chained block hashes."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from batchgen.engine.core.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its KV is (being) computed
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the block before it, so equal hashes mean equal prefixes.

    A 64-bit BLAKE2b digest, the same in every process: the persistent prefix store keys blocks by it.
    """
    h = hashlib.blake2b(b"" if prev_hash is None else prev_hash.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    """Hands out fixed-size KV blocks; full, computed blocks stay findable by hash until reused.

    With prefix caching, a freed block that held tokens goes to the back of a least-recently-freed list, keeping
    its hash where it has one, so a later request with the same prefix can reclaim it; blocks are only wiped when
    handed out for new tokens. New tokens take a blank block first (one that holds no tokens: never used, an
    unused earmark, or any freed block without prefix caching), the most recently freed of them: its memory is
    still mapped and likely cached, where a never-used block of a lazily mapped cache costs page faults on its
    first write (a tenth of a decode step on a small VM). Only when no blank block is left is the oldest freed
    one evicted.
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
        seq.block_table = list(hits)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.allocate(seq, seq.num_tokens, earmark=True)
        return seq.num_computed_tokens

    def _earmark_count(self, seq: Sequence, num_blocks: int) -> int:
        """How many blocks to earmark for what ``seq`` may still generate past its first ``num_blocks`` blocks."""
        final = seq.num_prompt_tokens + seq.params.max_tokens
        if self.max_model_len is not None:
            final = min(final, self.max_model_len)
        wanted = -(-final // self.block_size) - num_blocks
        return max(0, min(wanted, self.max_earmark, self.max_earmarked - self.num_earmarked,
                          len(self.blank) + len(self.cached)))

    def _take_earmarked(self, seq_id: int, lowest: bool) -> int:
        """One of ``seq_id``'s earmarked blocks: the lowest (its own next block) or the highest (taken by another)."""
        ids = self.earmarks[seq_id]
        block_id = ids.pop() if lowest else ids.pop(0)
        if not ids:
            del self.earmarks[seq_id]
        self.num_earmarked -= 1
        return block_id

    def _take_unmarked(self) -> int:
        """A blank block, else the oldest cached one, forgotten by the prefix cache."""
        if self.blank:
            return self.blank.pop()
        block_id = self.cached.popitem(last=False)[0]
        block = self.blocks[block_id]
        if self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = None, ()
        return block_id

    def _take_free(self, seq: Sequence) -> int:
        """A free block for ``seq``: its own earmarked one, else blank, else the oldest cached one, else another's
        earmarked one."""
        if seq.seq_id in self.earmarks:
            return self._take_earmarked(seq.seq_id, lowest=True)
        if self.blank or self.cached:
            return self._take_unmarked()
        return self._take_earmarked(next(reversed(self.earmarks)), lowest=False)

    def allocate(self, seq: Sequence, num_tokens: int, earmark: bool = False) -> None:
        """Append fresh blocks so the first ``num_tokens`` tokens of ``seq`` have slots, in ascending order (with
        ``earmark``, also the sequence's earmarks, above them).

        The blocks taken are the same whatever their order; ascending, a run of blocks freed together (a finished
        sequence releases its own tail first, so eviction hands them out descending) is read as one stream again:
        once a job's cache has turned over, the CPU decode op (reading a row's blocks in table order) took 1.73x its
        time over contiguous tables at prompts of 1,500-3,000 tokens, 1.18-1.27x at 200-700; in ascending order
        1.00-1.02x and 1.16-1.23x (``benchmarks/turned_over_tables.py``)."""
        needed = self.blocks_needed(seq, num_tokens)
        taken = [self._take_free(seq) for _ in range(needed)]
        if earmark:  # the earmarks continue the run: the lowest of all the blocks taken go to the tokens
            spare = [self._take_unmarked() for _ in range(self._earmark_count(seq, len(seq.block_table) + needed))]
            run = sorted(taken + spare)
            taken, spare = run[:needed], run[needed:]
            if spare:
                self.earmarks[seq.seq_id] = spare[::-1]
                self.num_earmarked += len(spare)
        for block_id in taken:
            block = self.blocks[block_id]
            block.hash, block.token_ids, block.ref_count = None, (), 1
        seq.block_table += sorted(taken)

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
        """The sequence's i-th block (its next uncomputed one) got its KV from a lower tier: register it."""
        assert i == seq.num_hashed_blocks == seq.num_computed_tokens // self.block_size
        block = self.blocks[seq.block_table[i]]
        block.hash, block.token_ids = self._full_block(seq, i)
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
            block.hash, block.token_ids = None, ()
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
