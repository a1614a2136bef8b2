"""Keeps freed host memory in the heap, so each step's activations reuse pages instead of faulting in fresh ones."""
from __future__ import annotations

import ctypes
import logging
import platform
from functools import lru_cache

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2); blocks above it are always mapped afresh.
MMAP_THRESHOLD_MAX = 32 << 20


@lru_cache(maxsize=1)
def keep_freed_memory(trim_threshold: int = 1 << 30) -> bool:
    """Serve blocks up to 32 MiB from the heap and keep up to ``trim_threshold`` freed bytes at its top.

    By default glibc maps each large block afresh (from 128 KiB, raising that bound as such blocks are
    freed) and hands the heap's free top back to the OS, so a step's activations of a few MB fault their
    pages in again at every step: on 2 cores that was a sixth of a prefill's time. What stays in the heap
    is bounded by its peak, which the KV budget already reserves for activations. Returns whether it was
    set (glibc only).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    done = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1)
    if not done:
        log.warning("mallopt refused the heap settings: each step's activations are mapped afresh")
    return done
