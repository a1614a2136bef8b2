"""Draft-model speculation (``"draft_model"``): a small model with the target's tokenizer, run by batchgen's own
engine, drafts each sequence's next tokens.

How a row with temperature > 0 (and no grammar) drafts is ``draft_sampling``'s:
- ``"coupled"`` (the default): the draft samples at the request's temperature, top-k and top-p with the noise
  the target's own sampler draws at each position (the request's seed and that output index: exponential race),
  and the target keeps a draft while it equals the token it samples there. The tokens are spec off's, whatever
  drafts a step makes, so a seeded row gets its tokens again in any batch and any run; a draft is kept where the
  two races pick the same token, which the shared noise makes likely wherever q is close to p.
- ``"probabilistic"``: the draft samples from its own distribution q with noise of its own (the request's seed and
  the first draft's output index, salted) and hands q back with the drafts (the draft engine's ``keep_probs``
  requests); the target verifies them by Leviathan et al.'s rejection sampling, which keeps the target's
  distribution and accepts min(p, q) summed over the vocabulary per draft. Its tokens depend on where each step's
  drafts start, which the cost model picks from measured step times: a seed does not give them again.
- ``"greedy"``: the argmax continuation, as greedy rows and rows with a grammar draft under every setting: a
  deterministic function of the context, for which the target's rule (d kept with probability p(d), on rejection
  p with d removed) is exactly lossless, and a seeded row gives spec off's very tokens (acceptance p(argmax)).

The draft runs as its own engine on the target's device and dtype, with a modest KV cache and prefix caching: each
call queues one request of ``k`` tokens per drafting sequence (its whole context) and steps them together,
so a call is one step computing every sequence's new tokens and k - 1 decode steps for the batch. The prefix cache
still holds each context's KV from the previous call: only the tokens since then (and the last, partial block)
are computed again. The first call for a sequence computes its whole prompt, a cost paid once per request, so a
call's ``steady_seconds`` (what the cost model charges) counts its first step as one more decode step.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.outputs import RequestOutput
from batchgen.engine.sampling.params import SamplingParams
from batchgen.engine.speculative.config import DRAFT_SAMPLING, SpeculativeConfig
from batchgen.engine.speculative.proposer import DraftRequest, DraftSampling

DRAFT_KV_CACHE_BYTES = 1 << 30  # the draft's KV cache, unless the target's own is smaller
VOCAB_SAMPLE = 64  # token ids compared between the two tokenizers, spread over the vocabulary


def draft_seed(seed: int, output_index: int) -> int:
    """The draft's seed for drafts starting at ``output_index`` of a request seeded ``seed``: a salted hash of
    both, so that its noise is the target's at no position and a rerun drafts the same tokens."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8, person=b"batchgen-draft").digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits, as the engine's own seeds


def draft_params(k: int, sampling: DraftSampling | None, coupled: bool = False) -> SamplingParams:
    """The draft request's settings: ``k`` tokens, greedy or sampled as the request samples (``coupled``: with the
    request's own seed, its noise then shifted to the first draft's output index by the engine request)."""
    if sampling is None:
        return SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)
    seed = sampling.seed if coupled else draft_seed(sampling.seed, sampling.output_index)
    return SamplingParams(max_tokens=k, temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p, seed=seed, ignore_eos=True)


def draft_engine_config(target: EngineConfig, draft_model: str) -> EngineConfig:
    """The draft's engine: the target's device, dtypes, batch limits and kernels, one device, prefix caching on."""
    kv = min(DRAFT_KV_CACHE_BYTES, target.kv_cache_memory or DRAFT_KV_CACHE_BYTES)
    return EngineConfig(
        model=draft_model, dtype=target.dtype_choice.name, kv_cache_dtype=target.kv_cache_dtype,
        device=target.torch_device().type,
        storage_options=target.storage_options, max_num_batched_tokens=target.max_num_batched_tokens,
        max_num_seqs=target.max_num_seqs, block_size=target.block_size, kv_cache_memory=kv,
        enable_prefix_caching=True, attention_backend=target.attention_backend, cuda_graphs=target.cuda_graphs,
        overlap_schedule="off")


@dataclass(frozen=True)
class Vocabulary:
    """What two models must share for one to draft for the other: embedding rows and tokenizer."""

    model_rows: int
    tokenizer: Any  # batchgen.engine.tokenizer.ModelTokenizer

    def mismatch(self, draft: "Vocabulary") -> str | None:
        """Why ``draft`` cannot draft for this model, or None when the two vocabularies agree."""
        if draft.model_rows != self.model_rows:
            return f"the draft's vocabulary has {draft.model_rows} token ids, the target's {self.model_rows}"
        mine, theirs = self.tokenizer, draft.tokenizer
        if len(theirs) != len(mine):
            return f"the draft's tokenizer has {len(theirs)} tokens, the target's {len(mine)}"
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if getattr(theirs, name) != getattr(mine, name):
                return f"the draft's {name} is {getattr(theirs, name)}, the target's {getattr(mine, name)}"
        step = max(1, len(mine) // VOCAB_SAMPLE)
        for token_id in [*range(0, len(mine), step), len(mine) - 1]:
            a, b = (t.decode([token_id], skip_special_tokens=False) for t in (mine, theirs))
            if a != b:
                return f"token id {token_id} is {b!r} to the draft's tokenizer, {a!r} to the target's"
        return None


class DraftModelProposer:
    """Drafts from a small model's engine (an LLMEngine: ``add_request``, ``step``, ``has_unfinished``) as
    ``sampling`` (one of ``DRAFT_SAMPLING``) says: see the module's docstring."""

    def __init__(self, engine: Any, num_speculative_tokens: int, sampling: str = DRAFT_SAMPLING[0]):
        if sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {sampling!r}")
        self.engine, self.num_speculative_tokens, self.sampling = engine, num_speculative_tokens, sampling
        self.steady_seconds: float | None = None  # the latest call's time, its prompt catch-up left out
        self.draft_probs: dict[int, torch.Tensor] = {}  # the latest call's sampled drafts' distributions, by seq_id

    def add_request(self, seq_id: int, prompt: Sequence[int]) -> None:
        pass  # nothing kept per request: the draft's prefix cache holds the contexts' KV

    def propose(self, seq_id: int, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_batch([DraftRequest(seq_id, tokens, k)])[0]

    def propose_batch(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's ``k`` draft tokens, all requests run as one batch; [] for a context longer than the
        draft's. The sampled ones' distributions go to ``draft_probs``."""
        drafts: list[list[int]] = [[] for _ in requests]
        rows: dict[int, int] = {}
        self.draft_probs = {}
        for row, (_, tokens, k, sampling) in enumerate(requests):
            k = min(k, self.num_speculative_tokens)
            if k <= 0 or len(tokens) + k > self.engine.max_model_len:
                continue
            sampling = None if self.sampling == "greedy" else sampling
            if sampling is not None and self.sampling == "coupled":
                queued = self.engine.add_request(list(tokens), draft_params(k, sampling, coupled=True),
                                                 noise_offset=sampling.output_index)
            else:
                queued = self.engine.add_request(list(tokens), draft_params(k, sampling),
                                                 keep_probs=sampling is not None)
            if not isinstance(queued, RequestOutput):  # an error output: no draft for that one
                rows[queued.seq_id] = row
        start, first_s, steps = time.perf_counter(), 0.0, 0
        while rows and self.engine.has_unfinished():
            for out in self.engine.step():
                row = rows.pop(out.request_id, None)  # None: a request a failed call left behind
                if row is not None:
                    drafts[row] = list(out.token_ids)
                    if out.probs:
                        self.draft_probs[requests[row].seq_id] = torch.stack(out.probs)
            steps += 1
            if steps == 1:
                first_s = time.perf_counter() - start
        total_s = time.perf_counter() - start
        self.steady_seconds = total_s if steps <= 1 else (total_s - first_s) * steps / (steps - 1)
        return drafts

    def finish(self, seq_id: int, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        pass

    def close(self) -> None:
        self.engine.shutdown()


def build_draft_proposer(spec: SpeculativeConfig, target: Any,
                         engine_factory: Callable[[EngineConfig], Any]) -> DraftModelProposer:
    """The draft's engine, built by ``engine_factory`` (LLMEngine) beside the ``target`` engine, and refused
    with a clear error unless it shares the target's vocabulary."""
    name = spec.options["model"]
    try:
        engine = engine_factory(draft_engine_config(target.config, name))
    except Exception as e:  # the target's own load errors name the target: say this one is the draft's
        message = f"speculative_config draft model {name!r}: {e}"
        try:
            error = type(e)(message)
        except Exception:  # noqa: BLE001 - an error type that takes other arguments
            error = RuntimeError(message)
        raise error from None
    why = Vocabulary(target.model_config.vocab_size, target.tokenizer).mismatch(
        Vocabulary(engine.model_config.vocab_size, engine.tokenizer))
    if why is not None:
        engine.shutdown()
        raise ValueError(f"speculative_config draft model {name!r} cannot draft for {target.config.model!r}: {why}; "
                         f"'draft_model' needs a model with the same tokenizer")
    return DraftModelProposer(engine, spec.num_speculative_tokens,
                              sampling=spec.options.get("draft_sampling", DRAFT_SAMPLING[0]))
