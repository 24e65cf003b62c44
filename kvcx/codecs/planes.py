"""vLLM's CPU fused K/V plane <-> a key plane and a value plane, with the parallel kernels (``cpu/fused.h``).

The chunk is ``[layers, tokens, heads * 2 * head_dim]`` as LMCache copies vLLM's CPU cache; each (layer, engine
block, head) holds the block's keys then its values in vLLM's kernel order (``"vec"`` or ``"amx"``; see
:mod:`kvcx.formats.layouts`). The planes are ``[layers, tokens, heads * head_dim]``. Values are moved, never
computed on: the round trip is exact for every bit pattern.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kvcx.codecs.cpu import core as _core
from kvcx.codecs.dtypes import dtype_name, is_int, raw
from kvcx.codecs.runtime import resolve_threads
from kvcx.errors import CodecError

ORDERS = {"vec": _core.FUSED_VEC, "amx": _core.FUSED_AMX}
AMX_TILE = 16


def _geometry(chunk_shape, block_size: int, head_dim: int, order: str, where: str) -> tuple:
    if order not in ORDERS:
        raise CodecError(f"{where}: order must be one of {', '.join(ORDERS)}, got {order!r}")
    if not (is_int(block_size) and block_size >= 2 and block_size % 2 == 0):
        raise CodecError(f"{where}: block_size must be an even integer >= 2, got {block_size!r}")
    if not (is_int(head_dim) and head_dim >= 1):
        raise CodecError(f"{where}: head_dim must be a positive integer, got {head_dim!r}")
    if len(chunk_shape) != 3:
        raise CodecError(f"{where}: a fused plane is [layers, tokens, heads * 2 * head_dim], got {list(chunk_shape)}")
    L, T, W = (int(s) for s in chunk_shape)
    if W % (2 * head_dim) or T % block_size or min(L, T, W) < 1:
        raise CodecError(f"{where}: a fused plane of shape {list(chunk_shape)} is not whole {block_size}-token "
                         f"blocks of heads of 2 * {head_dim} values")
    if order == "amx" and (block_size % AMX_TILE or head_dim % AMX_TILE):
        raise CodecError(f"{where}: the amx order needs block_size and head_dim multiples of {AMX_TILE}, got "
                         f"{block_size} and {head_dim}")
    return L, T, W // (2 * head_dim)


def _check(a, shape, dtype, what: str, where: str, writeable: bool) -> None:
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape and a.flags.c_contiguous
            and (a.flags.writeable or not writeable)):
        got = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
        raise CodecError(f"{where}: {what} must be a{' writeable' if writeable else ''} C-contiguous {dtype} array "
                         f"of shape {list(shape)}, got {got}")


def fused_split(chunk: np.ndarray, block_size: int, head_dim: int, order: str, keys: Optional[np.ndarray] = None,
                values: Optional[np.ndarray] = None, n_threads: Optional[int] = None, where: str = "chunk"):
    """(keys, values): the planes of a fused chunk (into ``keys``/``values`` when given)."""
    if not isinstance(chunk, np.ndarray) or dtype_name(chunk.dtype) is None:
        raise CodecError(f"{where}: a fused plane must be a bfloat16, float16 or float32 array")
    L, T, H = _geometry(chunk.shape, block_size, head_dim, order, where)
    _check(chunk, chunk.shape, chunk.dtype, "the chunk", where, writeable=False)
    shape = (L, T, H * head_dim)
    keys = np.empty(shape, chunk.dtype) if keys is None else keys
    values = np.empty(shape, chunk.dtype) if values is None else values
    _check(keys, shape, chunk.dtype, "keys", where, writeable=True)
    _check(values, shape, chunk.dtype, "values", where, writeable=True)
    n = resolve_threads(n_threads)
    scratch = np.empty(n * 2 * block_size * head_dim * chunk.dtype.itemsize, np.uint8)
    _core.fused_split(raw(chunk), raw(keys), raw(values), chunk.dtype.itemsize, L, T, H, head_dim, block_size,
                      ORDERS[order], scratch, n)
    return keys, values


def fused_join(keys: np.ndarray, values: np.ndarray, out: np.ndarray, block_size: int, head_dim: int, order: str,
               n_threads: Optional[int] = None, where: str = "chunk") -> np.ndarray:
    """Write the key and value planes into the fused chunk ``out`` (the inverse of :func:`fused_split`)."""
    if not isinstance(out, np.ndarray) or dtype_name(out.dtype) is None:
        raise CodecError(f"{where}: a fused plane must be a bfloat16, float16 or float32 array")
    L, T, H = _geometry(out.shape, block_size, head_dim, order, where)
    _check(out, out.shape, out.dtype, "the chunk", where, writeable=True)
    shape = (L, T, H * head_dim)
    _check(keys, shape, out.dtype, "keys", where, writeable=False)
    _check(values, shape, out.dtype, "values", where, writeable=False)
    n = resolve_threads(n_threads)
    scratch = np.empty(n * 2 * block_size * head_dim * out.dtype.itemsize, np.uint8)
    _core.fused_join(raw(keys), raw(values), raw(out), out.dtype.itemsize, L, T, H, head_dim, block_size,
                     ORDERS[order], scratch, n)
    return out
