"""Recorded forwards (op_replay) against eager calls on new inputs, and CPU decode replays in the engine against
eager decode steps."""
from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.backends.cpu.build import load_kernels
from batchgen.engine.backends.cpu.program import compile_steps
from batchgen.engine.executor.op_replay import HostOnly, NotReplayable, record

# How a replay runs its steps: the loop in Python, and (where the CPU kernels are built) the steps as one C++ program.
RUNNERS = [pytest.param(None, id="python")] + [
    pytest.param(compile_steps, id="program", marks=pytest.mark.skipif(not load_kernels(), reason="no CPU kernels"))]


def bind(recording, arena, compile) -> None:
    recording.bind(arena, compile)
    assert (recording.program is not None) == (compile is not None)


@torch.library.custom_op("batchgen_test::scaled", mutates_args=())
def scaled(x: torch.Tensor) -> torch.Tensor:
    """An op with no out= overload: a replay copies its result into the recorded output."""
    return x * 3


@scaled.register_fake
def _(x):
    return torch.empty_like(x)


class Block(torch.nn.Module):
    """Linear, norm, activation, a tuple-returning op, an in-place write into a cache, a table made on first use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)
        self.norm = torch.nn.RMSNorm(16)
        self.cache = torch.zeros(8, 16)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is None:
            self.table = torch.linspace(0.5, 1.5, 16)  # outlives the call: must not be reused as scratch
        h = torch.nn.functional.silu(self.up(self.norm(x)))
        y = scaled(self.down(h) * self.table) + x
        self.cache.index_copy_(0, slots, y)
        values, indices = y.max(dim=-1)
        return y.softmax(-1), values + indices


def fresh_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 16, generator=gen), torch.randperm(8, generator=gen)[:4]


@pytest.mark.parametrize("compile", RUNNERS)
def test_replay_matches_eager_calls_on_new_inputs(compile):
    block, reference = Block(), Block()
    x, slots = torch.zeros(4, 16), torch.zeros(4, dtype=torch.int64)  # the buffers a replay reads
    x[:], slots[:] = fresh_inputs(0)
    eager, recording = record(lambda: block(x, slots))
    assert block.table is not None and torch.equal(block.table, torch.linspace(0.5, 1.5, 16))
    torch.testing.assert_close(eager, reference(*fresh_inputs(0)), rtol=0, atol=0)
    arena = torch.UntypedStorage(recording.arena_bytes)
    bind(recording, arena, compile)
    for seed in (1, 2, 3):
        x[:], slots[:] = fresh_inputs(seed)
        replayed = recording.replay()
        expected = reference(*fresh_inputs(seed))
        assert len(replayed) == len(expected)
        for got, want in zip(replayed, expected):
            assert torch.equal(got, want)
        assert torch.equal(block.cache, reference.cache)  # the in-place write reached the cache
        assert torch.equal(block.table, torch.linspace(0.5, 1.5, 16))
        assert replayed[0].untyped_storage().data_ptr() == arena.data_ptr() or \
            replayed[1].untyped_storage().data_ptr() == arena.data_ptr()


@pytest.mark.parametrize("compile", RUNNERS)
def test_timed_replays_compute_the_same_and_time_every_op(compile):
    block, reference = Block(), Block()
    x, slots = torch.zeros(4, 16), torch.zeros(4, dtype=torch.int64)
    x[:], slots[:] = fresh_inputs(0)
    _, recording = record(lambda: block(x, slots))
    bind(recording, torch.UntypedStorage(recording.arena_bytes), compile)
    recording.op_seconds = seconds = {}
    for seed in (1, 2):
        x[:], slots[:] = fresh_inputs(seed)
        replayed, expected = recording.replay(), reference(*fresh_inputs(seed))
        assert len(replayed) == len(expected)
        for got, want in zip(replayed, expected):
            assert torch.equal(got, want)
    assert set(seconds) == {str(step[0]) for step in recording.steps}
    assert "batchgen_test.scaled.default" in seconds and all(t > 0 for t in seconds.values())
    recording.op_seconds = None
    before = dict(seconds)
    recording.replay()
    assert seconds == before  # timing off: nothing more is added


@pytest.mark.parametrize("compile", RUNNERS)
def test_intermediates_share_the_arena(compile):
    weights = [torch.randn(256, 256) for _ in range(6)]
    x = torch.randn(8, 256)

    def chain():
        h = x
        for w in weights:
            h = torch.relu(h @ w)
        return h

    eager, recording = record(chain)
    one = 8 * 256 * 4
    assert recording.arena_bytes < 6 * one  # six intermediates of which at most two are alive at once
    bind(recording, torch.UntypedStorage(recording.arena_bytes), compile)
    x.copy_(torch.randn(8, 256))
    assert torch.equal(recording.replay(), chain())


@pytest.mark.parametrize("compile", RUNNERS)
def test_ops_that_may_return_their_input_replay_when_they_copied(compile):
    """to(dtype), contiguous and reshape return their input or a copy: a copy is recomputed at each replay."""
    x = torch.zeros(4, 6, dtype=torch.bfloat16)
    w = torch.randn(6, 6)

    def forward():
        wide = x.float()  # a copy: bf16 -> fp32
        same = wide.to(torch.float32)  # returns its input
        flipped = same.t().contiguous()  # a copy of a transposed view
        return (flipped.reshape(-1) @ torch.ones(24)) + (same @ w).sum()

    eager, recording = record(forward)
    bind(recording, torch.UntypedStorage(recording.arena_bytes), compile)
    for seed in (1, 2):
        x.copy_(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)))
        assert torch.equal(recording.replay(), forward())


@pytest.mark.skipif(not load_kernels(), reason="no CPU kernels")
def test_a_program_takes_defaults_and_keyword_arguments_and_checks_what_it_copies():
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    out, values, indices = torch.empty(5, 7), torch.empty(5), torch.empty(5, dtype=torch.int64)
    narrow, scaled = torch.empty(5, 7, dtype=torch.bfloat16), torch.empty(5, 7)
    steps = [(torch.ops.aten.add.out, (x, y), {"out": out}, ()),  # alpha from its default
             (torch.ops.aten.max.dim, (out, 1), {}, (values, indices)),  # no out= here: both returns copied
             (torch.ops.aten._to_copy.default, (x,), {"dtype": torch.bfloat16}, (narrow,)),  # a dtype
             (torch.ops.aten.div.Scalar, (x, 4), {}, (scaled,))]  # an int for a Scalar
    with torch.inference_mode():
        compile_steps(steps)()
    assert torch.equal(out, x + y) and torch.equal(narrow, x.bfloat16()) and torch.equal(scaled, x / 4)
    assert torch.equal(values, (x + y).max(1).values) and torch.equal(indices, (x + y).max(1).indices)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="more tensors than recorded"):
        compile_steps([(torch.ops.aten.max.dim, (out, 1), {}, (values,))])()


@pytest.mark.skipif(not load_kernels(), reason="no CPU kernels")
def test_steps_a_program_cannot_hold_keep_the_python_loop():
    x, y = torch.randn(3), torch.empty(3)
    assert compile_steps([(torch.ops.aten.mul.Tensor, (x, 2.0), {}, (y,))]) is None  # a float for a tensor
    assert compile_steps([(torch.ops.aten.mul.Tensor, (x, x, x), {}, (y,))]) is None  # an argument too many
    assert compile_steps([(torch.ops.aten.mul.Tensor, (x,), {}, (y,))]) is None  # one missing


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
def test_prepacked_weights_pass_through_and_packing_in_the_forward_is_refused():
    """oneDNN's prepacked weights (opaque tensors, no storage) are loaded state: a replay passes them as they are.
    A forward that packs one itself would hand the replay a tensor it cannot place, so it is refused."""
    weight, x = torch.randn(48, 64), torch.zeros(5, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def forward():
        return torch.relu(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")) * 2

    eager, recording = record(forward)
    recording.bind(torch.UntypedStorage(recording.arena_bytes))
    for seed in (1, 2):
        x.copy_(torch.randn(5, 64, generator=torch.Generator().manual_seed(seed)))
        assert torch.equal(recording.replay(), forward())
    with pytest.raises(NotReplayable, match="without storage"):
        record(lambda: torch.ops.mkldnn._reorder_linear_weight(weight * 2, None))


def test_host_reads_are_refused():
    x = torch.randn(4)
    with pytest.raises(NotReplayable):
        record(lambda: x * x.sum().item())
    with pytest.raises(NotReplayable):
        record(lambda: x[: int(torch.tensor(x.tolist()).argmax())])
    lens = HostOnly(3)
    assert len(lens) == 3
    with pytest.raises(NotReplayable):
        record(lambda: x * max(lens))
    with pytest.raises(NotReplayable):
        record(lambda: x * lens[0])


def run(path, mode: str, prompts, params):
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, cuda_graphs=mode, attention_backend="cpu")
    outs = llm.generate(prompts, params)
    return outs, llm.engine.executor.runner.graphs


def test_decode_replays_match_eager_steps(tiny_model):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (5 + 3 * i,), generator=gen).tolist() for i in range(7)]
    # Different lengths: the batch shrinks as sequences finish, and a later request joins a running batch.
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0, logprobs=True, ignore_eos=True) for i in range(7)]
    eager, none = run(tiny_model, "off", prompts, params)
    replayed, replays = run(tiny_model, "auto", prompts, params)
    assert none is None and replays.refused is None
    assert sum(replays.replays.values()) >= 20 and len(replays.recordings) >= 3
    assert set(replays.recordings) == {size for size, steps in replays.seen.items() if steps >= 2}
    if load_kernels():  # every replay ran from its C++ program
        assert all(r.program is not None for r in replays.recordings.values())
    assert len(eager) == len(replayed) == len(prompts)
    for a, b in zip(eager, replayed):
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs) and a.logprobs == b.logprobs  # the same kernels, bit for bit


def test_a_forward_that_reads_the_host_runs_eagerly(tiny_model, monkeypatch):
    from batchgen.engine.executor import cpu_replays

    real = cpu_replays.DecodeReplays._forward

    def reads_the_host(self, size):
        forward = real(self, size)
        return lambda: (forward()[0] + 0 * self.positions[:size].max().item(), None)

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 100, (6,), generator=gen).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eager, _ = run(tiny_model, "off", prompts, params)
    monkeypatch.setattr(cpu_replays.DecodeReplays, "_forward", reads_the_host)
    refused_run, replays = run(tiny_model, "auto", prompts, params)
    assert replays.refused and "host" in replays.refused and not replays.replays
    assert [o.token_ids for o in refused_run] == [o.token_ids for o in eager]
