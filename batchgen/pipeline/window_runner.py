"""Prepared requests through one engine into a part sink: the loop the local executor and Ray's replicas share."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from batchgen.crashpoints import crash_point
from batchgen.engine import LLM
from batchgen.pipeline.rows import Request, ResultRow, engine_row
from batchgen.pipeline.sink import PartSink
from batchgen.pipeline.stages import admit
from batchgen.pipeline.telemetry import Telemetry


def run_requests(llm: LLM, requests: Iterable[Request], stop: threading.Event, telemetry: Telemetry,
                 deliver: Callable[[ResultRow], None], cancel: threading.Event | None = None) -> None:
    """Streams ``requests`` through one ``generate_stream`` call (none admitted once ``stop`` is set; the running
    ones aborted once ``cancel`` is) and hands each finished row to ``deliver``; the engine's steps and its time
    go to ``telemetry``."""
    clock = telemetry.stages
    with telemetry.listening(llm.engine.step_listeners):
        for req, out in clock.timed(llm.generate_stream(admit(requests, stop), cancel=cancel), "engine"):
            crash_point("generate")
            deliver(engine_row(req, out, llm.tokenizer))


@contextmanager
def committing(sink: PartSink, telemetry: Telemetry) -> Iterator[None]:
    """Around the writes of a run (or a window) into ``sink``: when they fail, the rows that did finish are
    committed all the same (a rerun need not redo them); the sink's flusher stops either way, and after a clean
    end its last rows are committed, timed as ``write``."""
    try:
        yield
    except BaseException:
        sink.save_finished()
        raise
    finally:
        sink.close()
    with telemetry.stages.measure("write"):
        sink.flush()
