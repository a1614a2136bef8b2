"""Where a job's rows are computed: ``local`` (this process) or ``ray`` (engine replicas on a Ray cluster).

Both take a :class:`~batchgen.pipeline.job.RunPlan` and commit parts through the output's manifest; the runner
writes the stats and ``_SUCCESS`` after them. This module stays light: the executors import on demand.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.executors.ray_extra import RAY_EXTRA_HINT, ray_available

if TYPE_CHECKING:
    from batchgen.engine import LLM
    from batchgen.pipeline.job import Executor
    from batchgen.pipeline.spec import JobSpec

log = logging.getLogger(__name__)

def executor_for(spec: JobSpec, llm: LLM | None = None) -> Executor:
    """The executor the spec asks for; ``llm`` (a loaded model) serves a local run only."""
    if spec.executor.kind == "ray":
        if not ray_available():  # a spec built without load_spec's check
            raise JobError(RAY_EXTRA_HINT)
        from batchgen.pipeline.executors.ray import RayExecutor

        if llm is not None:
            log.warning("executor ray: the replicas load their own model; the one given is not used")
        return RayExecutor()
    from batchgen.pipeline.executors.local import LocalExecutor

    return LocalExecutor(llm)
