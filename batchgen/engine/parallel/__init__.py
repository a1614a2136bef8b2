"""Tensor, data and expert parallelism: process groups, the collectives layers call, the expert exchange."""
from batchgen.engine.parallel.context import SINGLE_PROCESS, ParallelContext
from batchgen.engine.parallel.group import SINGLE, CommClock, CommGroup

__all__ = ["SINGLE", "SINGLE_PROCESS", "CommClock", "CommGroup", "ParallelContext"]
