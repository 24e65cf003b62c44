"""torch tensors <-> NumPy arrays without copies where possible (bfloat16 as ml_dtypes.bfloat16); records to and
from a device; the decode attention's query rows and float mask as its kernels read them.

torch is imported when a function runs, so importing this module costs nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import numpy as np

from kvcx.codecs.backends import is_tensor
from kvcx.codecs.dtypes import bfloat16
from kvcx.deps import import_torch
from kvcx.errors import CodecError

# what the Triton launchers (kvcx.codecs.gpu, kvcx.codecs.gpu_attn) say where triton is not installed
NEEDS_TRITON = "the Triton backend needs triton: pip install 'kvcx[gpu]' (or pass backend='cpu')"


def triton_kernels(module: str):
    """The Triton kernels of ``kvcx.codecs.triton_kernels.<module>`` (codec, attention, lattice), imported when first
    asked for; a CodecError naming the extra where triton is not installed."""
    try:
        return importlib.import_module(f"kvcx.codecs.triton_kernels.{module}")
    except ImportError as exc:  # triton is the kvcx[gpu] extra
        raise CodecError(NEEDS_TRITON) from exc


def torch_to_numpy(t) -> np.ndarray:
    """A CPU NumPy array of a tensor; bfloat16 becomes ml_dtypes.bfloat16 (no copy on CPU)."""
    torch = import_torch()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16())
    return t.numpy()


def numpy_to_torch(a: np.ndarray, device=None):
    """A tensor of an array (bfloat16 kept), on ``device`` if given."""
    torch = import_torch()
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:  # torch tensors must own writable memory
        a = a.copy()
    if a.dtype.name == "bfloat16" and a.dtype == bfloat16():
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t.to(device) if device is not None else t


def to_device(packed, device):
    """A :class:`~kvcx.codecs.base.Packed` record: the same record with its arrays as torch tensors on ``device``
    (bytes unchanged; arrays already there are shared, not copied)."""
    def move(a):
        return None if a is None else a.to(device) if is_tensor(a) else numpy_to_torch(a, device)

    fields = {f: move(getattr(packed, f)) for f in ("codes", "scales", "zeros", "sinks")}
    return _copied(packed, fields)


def to_host(packed):
    """A :class:`~kvcx.codecs.base.Packed` record: the same record with its arrays as NumPy arrays (what the formats
    write; bytes unchanged; CPU tensors are shared, not copied)."""
    fields = {f: torch_to_numpy(getattr(packed, f)) if is_tensor(getattr(packed, f)) else getattr(packed, f)
              for f in ("codes", "scales", "zeros", "sinks")}
    return _copied(packed, fields)


def _copied(packed, arrays: dict):
    """A :class:`~kvcx.codecs.base.Packed` record like ``packed`` with these arrays (its dicts copied)."""
    return dataclasses.replace(packed, **arrays, shape=tuple(packed.shape), config=dict(packed.config),
                               meta=dict(packed.meta))


def query_rows(q, N: int):
    """[B, Hq, D] queries (one token a row, any float dtype, as the model holds them) as the kernels read them:
    [N, R, D], the R query rows of each slab (batch row x KV head) together; a view where ``q`` is contiguous."""
    B, Hq, D = q.shape
    return q.reshape(N, Hq * B // N, D).contiguous()


def float_mask(mask, B: int, kv_len: int):
    """A [B, kv_len] mask as float32 added to the scores (a boolean one: True attends), or CodecError."""
    torch = import_torch()
    if tuple(mask.shape) != (B, kv_len):
        raise CodecError(f"attention: mask must be [B={B}, kv_len={kv_len}], got {list(mask.shape)}")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.float().contiguous()


def merge_writes(dtype) -> bool:
    """Whether the attention's merge writes its output in ``dtype`` itself (``out=`` of
    :func:`kvcx.codecs.gpu_attn.merge_splits`): float32, float16 and bfloat16."""
    return str(dtype) in ("torch.float32", "torch.float16", "torch.bfloat16")


@functools.lru_cache(maxsize=None)
def norm_of(D: int) -> float:
    """1 / sqrt(D) as the CPU kernels compute it (a float division in double of 1 by the float sqrtf(D))."""
    return float(np.float32(1.0 / float(np.sqrt(np.float32(D)))))


def pow2(n: int) -> int:
    """n rounded up to a power of two, at least 2 (a Triton block's extent)."""
    return max(2, 1 << (max(1, n) - 1).bit_length())



@functools.lru_cache(maxsize=None)
def multiprocessors() -> int:
    """The current GPU's multiprocessors (8 without one: the interpreter's splits), read once."""
    torch = import_torch()
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
        if torch.cuda.is_available() else 8
