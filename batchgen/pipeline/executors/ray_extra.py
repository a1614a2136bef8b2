"""Whether the optional Ray extra is installed, and the hint that names it (a leaf: the spec checks it too)."""
from __future__ import annotations

import importlib.util

RAY_EXTRA_HINT = "executor kind ray needs Ray Data: pip install 'batchgen[ray]'"


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None
