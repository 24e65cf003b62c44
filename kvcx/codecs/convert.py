"""Precision conversion between float32, float16 and bfloat16 (bit-exact with NumPy's astype, NaN kept)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from kvcx.codecs.cpu import core as _core
from kvcx.codecs.dtypes import check_float, dtype_name, kernel_dtype, raw
from kvcx.codecs.runtime import resolve_threads
from kvcx.errors import CodecError


def convert(arr: np.ndarray, dtype, out: Optional[np.ndarray] = None, n_threads: Optional[int] = None) -> np.ndarray:
    """Convert between float16, bfloat16 and float32 with the parallel kernels (round to nearest even)."""
    arr = check_float(arr, "input")
    target = np.dtype(dtype)
    if dtype_name(target) is None:
        raise CodecError(f"convert: target dtype {target} is not float16, bfloat16 or float32")
    if out is None:
        out = np.empty(arr.shape, dtype=target)
    elif not (isinstance(out, np.ndarray) and out.dtype == target and out.shape == arr.shape
              and out.flags.c_contiguous and out.flags.writeable):
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise CodecError(f"convert: out must be a writeable C-contiguous {target} array of shape {arr.shape}, "
                         f"got {got}")
    if arr.size:
        _core.convert(raw(arr), kernel_dtype(arr.dtype), raw(out), kernel_dtype(target), arr.size,
                      resolve_threads(n_threads))
    return out


def to_float32(arr, out=None, n_threads=None):
    return convert(arr, np.float32, out=out, n_threads=n_threads)


def to_float16(arr, out=None, n_threads=None):
    return convert(arr, np.float16, out=out, n_threads=n_threads)
