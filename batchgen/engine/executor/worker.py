"""A worker process: one rank's model runner, driven step by step by the engine over a pipe.

Messages are pickled tuples between batchgen's own processes (never weights): ``("allocate", blocks)``,
``("step", StepInput)``, ``("shutdown",)`` in; ``("ready", blocks)``, ``("ok", StepOutput | None)``,
``("error", message)`` out. Only the sampling rank of each replica answers a step, unless the step saves
KV blocks for the prefix tiers: then every rank answers with its shard.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.executor.model_runner import ModelRunner
from batchgen.engine.loading.loader import load_model_source
from batchgen.engine.models.registry import model_config
from batchgen.engine.parallel.distributed import init_distributed, shutdown_distributed
from batchgen.engine.parallel.group import CommClock


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a spawned rank needs to build its share of the model."""

    rank: int
    config: EngineConfig
    model_path: str  # already resolved to a local folder or file by the engine
    max_model_len: int
    init_method: str
    threads: int  # CPU threads for this rank's torch ops

    @property
    def device(self) -> torch.device:
        device = self.config.torch_device()
        return torch.device("cuda", self.rank) if device.type == "cuda" else device


def send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


def _watch_parent(interval_s: float = 0.5) -> None:
    """Ends this process once the engine's process is gone, even while a collective blocks the main thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a spawned rank; exits when told to, when the engine goes away, or on an error."""
    # Ctrl-C, and a SIGTERM sent to the whole process group, reach the workers too: the engine decides when
    # they stop (it finishes the running requests first), and it stops them on its way out.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent()
    logging.basicConfig(level=logging.WARNING, format=f"rank {spec.rank} %(levelname)s %(message)s")
    try:
        runner = _build_runner(spec)
        send(conn, ("ready", runner.kv_blocks_available()))
        _serve(runner, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the engine is gone: nobody to report to
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the engine, named
        traceback.print_exc(file=sys.stderr)
        try:
            send(conn, ("error", f"{type(e).__name__}: {e}"))
        finally:
            os._exit(1)  # peers may be stuck in a collective with this rank: no orderly shutdown
    shutdown_distributed()
    sys.stderr.flush()
    os._exit(0)  # skips the interpreter's teardown, which takes seconds with torch loaded and keeps nothing


def _build_runner(spec: WorkerSpec) -> ModelRunner:
    cfg, device = spec.config, spec.device
    if device.type == "cpu":
        torch.set_num_threads(spec.threads)
    else:
        torch.cuda.set_device(device)
    clock = CommClock(enabled=device.type == "cpu" or cfg.measure_communication,
                      sync=device.type == "cuda" and cfg.measure_communication)
    source = load_model_source(spec.model_path, cfg.storage_options)
    model_cfg = model_config(source.config)
    parallel = init_distributed(spec.rank, cfg.tensor_parallel_size, cfg.data_parallel_size,
                                cfg.expert_parallel(model_cfg), device, spec.init_method,
                                cfg.distributed_timeout_s, clock, cfg.expert_capacity_factor)
    return ModelRunner(cfg, model_cfg, source, spec.max_model_len, parallel, device)


def _serve(runner: ModelRunner, conn: Connection) -> None:
    while True:
        kind, *args = receive(conn)
        if kind == "shutdown":
            return
        if kind == "allocate":
            runner.allocate_kv_cache(args[0])
            send(conn, ("ok", None))
        elif kind == "step":
            out = runner.execute(args[0])
            if runner.samples or args[0].save_blocks:  # every rank sends its shard of the saved KV
                send(conn, ("ok", out))
        else:
            raise ValueError(f"unknown message {kind!r}")
