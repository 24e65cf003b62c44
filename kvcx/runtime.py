"""Threads and build facts of the kernels."""
from __future__ import annotations

import os
from typing import Optional

from kvcx import _core
from kvcx.dtypes import is_int
from kvcx.errors import CodecError

# more threads than this is a typo, not a machine (OpenMP would try to start them all)
MAX_THREADS = 1024


def resolve_threads(n_threads: Optional[int]) -> int:
    """Effective thread count: None = all (OMP_NUM_THREADS honoured), 1..MAX_THREADS as given."""
    if n_threads is None:
        return max(1, min(MAX_THREADS, _core.max_threads()))
    if not is_int(n_threads) or not 1 <= n_threads <= MAX_THREADS:
        raise CodecError(f"n_threads must be a positive integer up to {MAX_THREADS}, or None (all cores); "
                         f"got {n_threads!r}")
    return int(n_threads)


def build_info() -> dict:
    """How the kernels were built (for ``kvcx info``): OpenMP, threads, SIMD flags."""
    info = dict(_core.build_info())
    info["threads_used"] = resolve_threads(None)
    info["omp_num_threads_env"] = os.environ.get("OMP_NUM_THREADS")
    return info
