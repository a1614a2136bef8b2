"""The multi-process executor: one spawned worker per rank (NCCL on CUDA, gloo on CPU), driven over pipes.

The engine process schedules and samples-by-proxy; it never holds weights. Each step it sends every
replica's StepInput to that replica's ranks and waits for the sampling ranks' StepOutputs while
watching every worker: a worker that dies or raises fails the step at once with an error naming its
rank and cause, and a step that takes longer than ``distributed_timeout_s`` fails naming the ranks
that did not answer. After a failure the workers are killed; nothing is left behind.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - registers its exit handler before ours (handlers run last in, first out)
import os
import pickle
import signal
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Sequence

import torch

from batchgen.engine.backends.select import backend_for, make_kernel_set
from batchgen.engine.config import EngineConfig, ModelConfig
from batchgen.engine.executor.step import FinishedStep, StepInput, StepOutput
from batchgen.engine.executor.worker import WorkerSpec, receive, worker_main
from batchgen.engine.kv_store.block_io import join_shards, rank_shard
from batchgen.engine.models.registry import build_model
from batchgen.engine.parallel.balancer import with_load_balancing
from batchgen.engine.parallel.context import ParallelContext
from batchgen.engine.parallel.distributed import free_port
from batchgen.engine.parallel.group import CommGroup
from batchgen.engine.quantization import choose_weight_methods

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 10.0
LOADING = "loading the model"


class WorkerError(RuntimeError):
    """A worker process died, raised, or did not answer in time; the executor is unusable afterwards."""


def exit_cause(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (" (the kernel's out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else "")
    return f"exited with code {code}"


class MultiprocExecutor:
    """``data_parallel_size`` replicas of ``tensor_parallel_size`` ranks; rank = replica * tp + tp rank."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_path: str, max_model_len: int):
        self.tp, self.dp = config.tensor_parallel_size, config.data_parallel_size
        self.world = self.tp * self.dp
        self.timeout_s = config.distributed_timeout_s
        self.failure: str | None = None
        device = config.torch_device()
        if device.type == "cuda" and self.world > torch.cuda.device_count():
            raise ValueError(f"{self.world} ranks (tensor_parallel_size {self.tp} x data_parallel_size "
                             f"{self.dp}) need as many GPUs; {torch.cuda.device_count()} visible")
        # Profile and layout of the whole model (all ranks together), built without allocating anything; then
        # the first rank's share, so that a model that cannot be split fails here, before any process starts.
        # (torch's ops stand in for the CPU kernels, which need not be built here; FP8 checkpoints: the
        # workers' choice between FP8 and dequantized weights.)
        backend = backend_for(config.attention_backend, device)
        kernels = make_kernel_set("torch" if backend == "cpu" else backend)
        methods = choose_weight_methods(model_cfg.quantization, kernels, device, config.torch_dtype,
                                        config.fp8_weights)
        whole = build_model(model_cfg, kernels, max_model_len, config.torch_dtype, "meta", methods=methods)
        self.profile, self.kv_layout = whole.profile(), whole.kv_layout()
        shape_only = with_load_balancing(  # the workers' context, redundant expert slots included
            ParallelContext(tp=CommGroup(0, self.tp), dp=CommGroup(0, self.dp),
                            expert_parallel=config.expert_parallel(model_cfg)), config.enable_eplb, config.eplb_config)
        rank0 = build_model(model_cfg, kernels, max_model_len, config.torch_dtype, "meta", shape_only, methods)
        self.rank_kv_layout = rank0.kv_layout()  # every rank's cache holds this shape
        # Shards of a block's KV in the prefix tiers: one per rank, unless every rank holds the whole cache
        # (latent rows, a single KV head): then rank 0's is every rank's.
        self.kv_shards = 1 if self.rank_kv_layout == self.kv_layout else self.tp
        self.procs, self.conns = self._spawn(config, model_path, max_model_len)
        # Stopped when the executor is collected or shut down, or at exit before multiprocessing's own exit
        # handler (which would wait for them forever: workers ignore SIGTERM).
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        atexit.register(self._finalizer)
        ready = self._collect(range(self.world), LOADING)
        self.num_blocks = min(ready.values())  # every replica's ranks must fit the same blocks
        self._broadcast(range(self.world), ("allocate", self.num_blocks))
        self._collect(range(self.world), "allocating the KV cache")

    def _spawn(self, config: EngineConfig, model_path: str, max_model_len: int
               ) -> tuple[list[mp.Process], list[Connection]]:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, (os.cpu_count() or 1) // self.world)
        procs, conns = [], []
        for rank in range(self.world):
            ours, theirs = ctx.Pipe()
            spec = WorkerSpec(rank, config, model_path, max_model_len, init_method, threads)
            proc = ctx.Process(target=worker_main, args=(spec, theirs), name=f"batchgen-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        log.info("started %d workers (tensor_parallel_size %d, data_parallel_size %d): pids %s",
                 self.world, self.tp, self.dp, [p.pid for p in procs])
        return procs, conns

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def ranks_of(self, replica: int) -> range:
        return range(replica * self.tp, (replica + 1) * self.tp)

    def submit(self, steps: Sequence[StepInput | None]) -> FinishedStep:
        """Runs the step before returning: the ranks learn sampled tokens only through the engine, so steps
        never overlap here (the engine then never defers a token)."""
        return FinishedStep(self.execute(steps))

    def execute(self, steps: Sequence[StepInput | None]) -> list[StepOutput | None]:
        """Runs each replica's step (None: that replica sits this step out); returns their outputs."""
        if len(steps) != self.dp:
            raise ValueError(f"expected {self.dp} replica steps, got {len(steps)}")
        answering = []
        for replica, step in enumerate(steps):
            if step is not None:
                ranks = self.ranks_of(replica)
                self._send_step(ranks, step)
                answering += ranks if step.save_blocks and self.kv_shards > 1 else ranks[:1]
        replies = self._collect(answering, "running a step")
        return [self._replica_output(self.ranks_of(r), step, replies) if step is not None else None
                for r, step in enumerate(steps)]

    def _send_step(self, ranks: range, step: StepInput) -> None:
        """The step to each of a replica's ranks. Prefix-tier blocks: with a shard per rank, each rank restores
        its own shard (and saves its own, answering with it); with one shard for all, every rank restores the
        same rows and rank 0 alone saves."""
        if self.kv_shards == 1 and step.save_blocks and len(ranks) > 1:
            self._broadcast(ranks[:1], ("step", step))
            self._broadcast(ranks[1:], ("step", dataclasses.replace(step, save_blocks=[])))
        elif self.kv_shards > 1 and step.restore_kv is not None:
            for tp_rank, rank in enumerate(ranks):
                shard = rank_shard(step.restore_kv, tp_rank, len(ranks))
                self._broadcast([rank], ("step", dataclasses.replace(step, restore_kv=shard)))
        else:
            self._broadcast(ranks, ("step", step))

    def _replica_output(self, ranks: range, step: StepInput, replies: dict[int, object]) -> StepOutput:
        """The sampling rank's output, with the saved blocks' KV of all its ranks (shards in rank order)."""
        out = replies[ranks[0]]
        if step.save_blocks and self.kv_shards > 1:
            out.saved_kv = join_shards([replies[rank].saved_kv for rank in ranks])
        return out

    def _broadcast(self, ranks: Sequence[int], message: tuple) -> None:
        self._check_usable()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in ranks:
            try:
                self.conns[rank].send_bytes(payload)
            except OSError:  # a dead worker's pipe: its exit says why
                self._fail(f"worker rank {rank} {self._death(rank)}")

    def _collect(self, ranks: Sequence[int], doing: str) -> dict[int, object]:
        """Waits for one reply from each of ``ranks``; any worker's error or death fails at once."""
        pending, replies = set(ranks), {}
        by_object = {c: r for r, c in enumerate(self.conns)} | {p.sentinel: r for r, p in enumerate(self.procs)}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready = wait(list(by_object), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(f"no answer from worker rank(s) {sorted(pending)} after {self.timeout_s:g} s "
                           f"while {doing}")
            # Pipes before sentinels: a worker that raised sends its error before it exits.
            for obj in sorted(ready, key=lambda o: not isinstance(o, Connection)):
                rank = by_object[obj]
                if isinstance(obj, Connection):
                    kind, value = self._receive(rank, doing)
                    if kind == "error":
                        self._fail(f"worker rank {rank} failed while {doing}: {value}")
                    if rank not in pending:
                        self._fail(f"worker rank {rank} answered out of turn while {doing}")
                    replies[rank] = value
                    pending.discard(rank)
                else:
                    self._fail(f"worker rank {rank} {self._death(rank)} while {doing}{_hint(doing)}")
        return replies

    def _receive(self, rank: int, doing: str) -> tuple:
        try:
            return receive(self.conns[rank])
        except (EOFError, OSError):
            self._fail(f"worker rank {rank} {self._death(rank)} while {doing}{_hint(doing)}")

    def _death(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=5.0)
        return f"died ({exit_cause(proc.exitcode)})"

    def _fail(self, message: str) -> None:
        self.failure = message
        self._finalizer.detach()
        _stop_workers(self.procs, self.conns, graceful=False)
        raise WorkerError(message)

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise WorkerError(f"the engine's workers were stopped after an earlier failure: {self.failure}")
        if not self._finalizer.alive:
            raise WorkerError("the engine's workers were shut down")

    def shutdown(self) -> None:
        """Stops every worker (asks first, kills any that do not exit within a grace period)."""
        self._finalizer()


def _hint(doing: str) -> str:
    if doing != LOADING:
        return ""
    return ("; its traceback is on stderr (a script that uses several devices must guard its top level with "
            "`if __name__ == '__main__':`, as worker processes are spawned and import the main module)")


def _stop_workers(procs: list[mp.Process], conns: list[Connection], graceful: bool = True) -> None:
    """Ends the workers and reaps them, so that no process outlives the engine."""
    if graceful:
        payload = pickle.dumps(("shutdown",))
        for proc, conn in zip(procs, conns):
            if proc.is_alive():
                try:
                    conn.send_bytes(payload)
                except OSError:
                    pass
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
    for conn in conns:
        conn.close()
