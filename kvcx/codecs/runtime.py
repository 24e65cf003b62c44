"""Threads, build facts and kernel statuses: what every caller of the kernels shares."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from kvcx.codecs.cpu import core as _core
from kvcx.codecs.dtypes import is_int
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
    """Which kernel variant runs (chosen for this CPU, or forced by ``$KVCX_KERNELS``), which the installation
    holds, and how it was built (for ``kvcx info``): OpenMP, threads, SIMD flags."""
    from kvcx.codecs import cpu

    info = {"kernels": cpu.variant, "kernels_built": ", ".join(cpu.built()),
            "kernels_forced": os.environ.get(cpu.ENV)}
    info.update(_core.build_info())
    info["threads_used"] = resolve_threads(None)
    info["omp_num_threads_env"] = os.environ.get("OMP_NUM_THREADS")
    return info


def check_status(status: int, name: str, x: Optional[np.ndarray] = None, what: str = "encoding") -> None:
    """Turn a kernel status (kvcx_status bits) into the exception it means; the one place that does."""
    if status == _core.STATUS_OK:
        return
    if status & _core.STATUS_NOMEM:
        raise MemoryError(f"kvcx: out of memory while {what} tensor {name!r}")
    if status & _core.STATUS_CORRUPT:
        raise CodecError(f"tensor {name!r}: its packed data holds values no kvcx encoder writes (e.g. a group range "
                         "that ends below its start); the data is damaged: encode it again")
    if status & _core.STATUS_NONFINITE:
        bad = int(np.count_nonzero(~np.isfinite(x.astype(np.float32, copy=False)))) if x is not None else "some"
        size = x.size if x is not None else "?"
        raise CodecError(f"tensor {name!r} contains {bad} NaN/Inf value(s) out of {size}; "
                         "kvcx cannot quantize non-finite values, clean the tensor first")
    if status & _core.STATUS_SCALE_OVERFLOW:
        top = f" (|x| up to {float(np.max(np.abs(x.astype(np.float32)))):.3g})" if x is not None else ""
        raise CodecError(f"tensor {name!r} has values too large for FP16 scales{top}; rescale the tensor first "
                         "(FP16 scales hold up to 65504)")
    raise CodecError(f"tensor {name!r}: the kernels returned an unknown status {status} while {what}")


def crc32c(data: np.ndarray, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of a C-contiguous uint8 array, continuing from ``crc``."""
    return _core.crc32c(data, crc)


def crc32c_blocks(data: np.ndarray, block: int, n_threads: Optional[int] = None) -> np.ndarray:
    """The CRC-32C of each ``block`` bytes of ``data`` (the last block may be short), computed in parallel:
    little-endian uint32, one per block (one zero for empty data)."""
    if not is_int(block) or block < 1:
        raise CodecError(f"crc32c_blocks: block must be a positive integer, got {block!r}")
    out = np.zeros(max(1, -(-data.size // block)), dtype="<u4")
    if data.size:
        _core.crc32c_blocks(data, block, out, resolve_threads(n_threads))
    return out
