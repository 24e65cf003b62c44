"""The float dtypes the kernels handle: NumPy dtypes, safetensors names and kernel codes."""
from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from kvcx.codecs.cpu import core as _core
from kvcx.errors import CodecError


@functools.lru_cache(maxsize=None)
def bfloat16() -> Optional[np.dtype]:
    """bfloat16 as a NumPy dtype (ml_dtypes'), imported where a bfloat16 array is first made or read: ml_dtypes'
    import takes about half a second, which every ``kvcx`` command paid at start. None without ml_dtypes."""
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a dependency
        return None
    return np.dtype(ml_dtypes.bfloat16)


def __getattr__(name: str):
    if name == "BFLOAT16":   # the constant it was (``from kvcx.codecs.dtypes import BFLOAT16``), resolved on first use
        return bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# safetensors dtype name -> kernel dtype code (the codes are defined once, in kvcx/codecs/cpu/base.h)
DTYPE_NAMES = {"F32": _core.DT_F32, "F16": _core.DT_F16, "BF16": _core.DT_BF16}


def is_int(v) -> bool:
    """A true integer (Python or NumPy), not a bool and not a float that happens to be whole."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def dtype_name(dtype: np.dtype) -> Optional[str]:
    """'F16' / 'BF16' / 'F32' for the float dtypes the kernels handle, else None."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "F16"
    if dtype == np.float32:
        return "F32"
    if dtype.name == "bfloat16" and dtype == bfloat16():   # only a bfloat16 array imports ml_dtypes here
        return "BF16"
    return None


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of 'F16' / 'BF16' / 'F32'."""
    return bfloat16() if name == "BF16" else {"F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}[name]


def kernel_dtype(dtype: np.dtype) -> int:
    """The kernels' code for a float dtype (the caller checked it with :func:`dtype_name`)."""
    return DTYPE_NAMES[dtype_name(dtype)]


def raw(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (read-only arrays stay read-only)."""
    return arr.reshape(-1).view(np.uint8)


def check_float(arr: Any, name: str) -> np.ndarray:
    """``arr`` as a C-contiguous float16/bfloat16/float32 array (shape kept, 0-d included), or CodecError."""
    if not isinstance(arr, np.ndarray):
        try:
            arr = np.asarray(arr)
        except Exception as exc:  # noqa: BLE001 - anything that is not array-like
            raise CodecError(f"tensor {name!r}: expected a NumPy array, got {type(arr).__name__}") from exc
    if dtype_name(arr.dtype) is None:
        raise CodecError(
            f"tensor {name!r} has dtype {arr.dtype}; kvcx handles float16, bfloat16 and float32 "
            "(cast it with .astype(np.float32) first)"
        )
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr).reshape(arr.shape)  # ascontiguousarray turns 0-d into 1-d
    return arr
