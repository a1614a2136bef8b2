"""Parameter-owned weight loaders: fused shards, tensor-parallel slices (read lazily), and the checks around them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from batchgen.engine.layers.linear import (
    ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, ReplicatedLinear,
    RowParallelLinear, VocabParallelEmbedding,
)
from batchgen.engine.loading.model_source import LazyTensor
from batchgen.engine.parallel import CommGroup


def load(layer, name: str, tensor: torch.Tensor, shard=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard)


@pytest.fixture
def lazy(tmp_path):
    """Saves tensors to safetensors and hands them back as LazyTensors that count the values read."""
    reads = []

    def make(**tensors: torch.Tensor) -> dict[str, LazyTensor]:
        path = tmp_path / f"w{len(reads)}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        handle = safe_open(str(path), framework="pt", device="cpu")

        class Counted(LazyTensor):
            def load(self):
                out = super().load()
                reads.append(out.numel())
                return out

        return {k: Counted(handle.get_slice(k)) for k in tensors}

    make.reads = reads
    return make


def test_column_and_row_parallel_shards_rebuild_the_full_layer(lazy):
    torch.manual_seed(0)
    w1, b1, w2 = torch.randn(8, 6), torch.randn(8), torch.randn(6, 8)
    x = torch.randn(3, 6)
    stored = lazy(w1=w1, b1=b1, w2=w2)
    parts, partial_sums = [], torch.zeros(3, 6)
    for rank in range(2):
        col = ColumnParallelLinear(6, 8, bias=True, tp=CommGroup(rank, 2))
        row = RowParallelLinear(8, 6, tp=CommGroup(rank, 2))
        load(col, "weight", stored["w1"])
        load(col, "bias", stored["b1"])
        load(row, "weight", stored["w2"])
        assert col.weight.shape == (4, 6) and row.weight.shape == (6, 4)
        h = col(x)  # this rank's 4 output features
        parts.append(h)
        partial_sums += F.linear(h, row.weight)  # what the all-reduce sums over ranks
    full = F.linear(x, w1, b1)
    torch.testing.assert_close(torch.cat(parts, dim=1), full)
    torch.testing.assert_close(partial_sums, F.linear(full, w2))
    assert sum(lazy.reads) == w1.numel() + b1.numel() + w2.numel()  # each rank read only its slice


def test_merged_gate_up_from_separate_and_from_fused_checkpoints():
    gate, up = torch.randn(5, 4), torch.randn(5, 4)
    sep = MergedColumnParallelLinear(4, [5, 5])
    load(sep, "weight", gate, 0)
    load(sep, "weight", up, 1)
    assert torch.equal(sep.weight, torch.cat([gate, up]))
    for rank in range(2):  # a fused checkpoint tensor, split per rank shard by shard
        fused = MergedColumnParallelLinear(4, [6, 6], tp=CommGroup(rank, 2))
        g, u = torch.randn(6, 4), torch.randn(6, 4)
        load(fused, "weight", torch.cat([g, u]))
        assert torch.equal(fused.weight, torch.cat([g[3 * rank:3 * rank + 3], u[3 * rank:3 * rank + 3]]))
    assert sep.weight.shard_ids == (0, 1)
    with pytest.raises(ValueError, match="no shard 2"):
        load(sep, "weight", gate, 2)
    with pytest.raises(ValueError, match=r"\(4, 4\) does not fit .*\(5, 4\)"):
        load(sep, "weight", torch.randn(4, 4), 0)
    with pytest.raises(ValueError, match=r"\(9, 4\) does not fit .*\(8, 4\)"):  # never silently truncated
        load(ColumnParallelLinear(4, 8, tp=CommGroup(0, 2)), "weight", torch.randn(9, 4))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_shards_heads_and_replicates_kv_heads(tp_size):
    heads, kv_heads, d, hidden = 4, 2, 3, 5
    q, k, v = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, bias=True, tp=CommGroup(rank, tp_size))
        for shard, w in zip("qkv", (q, k, v)):
            load(layer, "weight", w, shard)
            load(layer, "bias", w[:, 0], shard)
        local_kv = max(1, kv_heads // tp_size)
        kv_head = rank * kv_heads // tp_size  # with 4 ranks, ranks 0-1 share KV head 0
        qs, ks = slice(rank * heads // tp_size * d, (rank + 1) * heads // tp_size * d), \
            slice(kv_head * d, (kv_head + local_kv) * d)
        assert (layer.num_heads, layer.num_kv_heads) == (heads // tp_size, local_kv)
        assert torch.equal(layer.weight, torch.cat([q[qs], k[ks], v[ks]]))
        assert torch.equal(layer.bias, torch.cat([q[qs], k[ks], v[ks]])[:, 0])


def test_vocab_parallel_embedding_and_lm_head_pad_the_last_rank():
    vocab, dim = 7, 3
    table = torch.randn(vocab, dim)
    ids = torch.tensor([0, 3, 4, 6])
    x = torch.randn(2, dim)
    rows, logits = torch.zeros(4, dim), []
    for rank in range(2):
        emb = VocabParallelEmbedding(vocab, dim, tp=CommGroup(rank, 2))
        head = ParallelLMHead(vocab, dim, tp=CommGroup(rank, 2))
        load(emb, "weight", table)
        load(head, "weight", table)
        assert emb.weight.shape == (4, dim)  # ceil(7 / 2) rows, the last one padding on rank 1
        mine = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        rows += F.embedding((ids - emb.vocab_start) * mine, emb.weight) * mine[:, None]
        logits.append(F.linear(x, head.weight))
    torch.testing.assert_close(rows, table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=1)[:, :vocab], x @ table.T)
    whole = ParallelLMHead(vocab, dim)
    load(whole, "weight", table)
    torch.testing.assert_close(whole(x), x @ table.T)
    with pytest.raises(ValueError, match="does not fit the embedding"):
        load(whole, "weight", table[:5])


def test_replicated_linear_keeps_its_own_dtype():
    router = ReplicatedLinear(4, 3, params_dtype=torch.float32)
    load(router, "weight", torch.randn(3, 4))
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert router(x).dtype == torch.float32
    torch.testing.assert_close(router(x), F.linear(x.float(), router.weight))
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 2"):
        ColumnParallelLinear(4, 3, tp=CommGroup(0, 2))
