"""vLLM's TurboQuant KV cache as a codec: ``--kv-cache-dtype turboquant_4bit_nc`` and its siblings, emulated record
for record so ``kvcx validate --scheme turboquant_4bit_nc`` gates it beside kvcx's own formats.

vLLM (0.32, PR #38479; the ``turboquant-vllm`` plugin's KV path moved there) stores a token and head as one slot:
``[key record | value record]`` (padded to an even size). :class:`TurboQuantCodec` writes one of the two records a
row (``part="key"`` or ``"value"``), byte for byte what vLLM's store kernel (``triton_turboquant_store``) writes:

- keys (``bits`` 3 or 4): the row's FP16 norm after ``ceil(D * bits / 8)`` bytes of Lloyd-Max indices of the unit
  row rotated by the Sylvester Hadamard matrix / sqrt(D), against the centroids of N(0, 1/D) that vLLM solves
  (:func:`lloyd_max_centroids`, the same computation); ``norm_correction`` (the ``_nc`` presets) rescales the decoded
  centroid vector to unit norm before the norm multiplies it;
- values (``bits`` 3 or 4): uniform codes between the row's min and max, then the FP16 scale and minimum;
- ``turboquant_k8v4``'s keys are float8 e4m3 casts (:class:`~kvcx.codecs.engine.FP8Codec` at scale 1.0).

The rotation is summed in double here and in a float32 GEMM in vLLM: an index can differ from vLLM's only where the
rotated value lies within that GEMM's rounding of a midpoint (the tests count those coordinates). vLLM keeps the first
and last two layers of a dense model in the model's dtype (``get_boundary_skip_layers``, added to
``--kv-cache-dtype-skip-layers`` whenever a ``turboquant_*`` dtype is set; none on hybrids): where the model is known
(``kvcx validate``, ``KvcxCache``) the schemes keep those layers exact too (:func:`boundary_layers`,
``KVConfig.engine_layers``); a file compressed without a model compresses every layer.

Schemes (``--scheme``): ``turboquant_4bit_nc`` (K4 V4, 4.19 bits/value at a head dim of 128),
``turboquant_k3v4_nc`` (3.69), ``turboquant_3bit_nc`` (3.19), ``turboquant_k8v4`` (6.13).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np

from kvcx.codecs.backends import check_backend
from kvcx.codecs.base import (Codec, Layout, Packed, check_shape, decode_out, finish_packed, out_buffers,
                              register_codec, view3)
from kvcx.codecs.cpu import core as _core
from kvcx.codecs.dtypes import DTYPE_NAMES, check_float, dtype_name, kernel_dtype, raw
from kvcx.codecs.runtime import check_status, resolve_threads
from kvcx.errors import CodecError

TQ_FORMAT_VERSION = "6"   # an older reader refuses a file with TurboQuant records ("upgrade kvcx")
PARTS = ("key", "value")
BITS = (3, 4)
# vLLM's presets (vllm/model_executor/layers/quantization/turboquant/config.py TQ_PRESETS): key and value settings
PRESETS = {
    "turboquant_4bit_nc": (dict(id="vllm.turboquant", part="key", bits=4, norm_correction=True),
                           dict(id="vllm.turboquant", part="value", bits=4)),
    "turboquant_k3v4_nc": (dict(id="vllm.turboquant", part="key", bits=3, norm_correction=True),
                           dict(id="vllm.turboquant", part="value", bits=4)),
    "turboquant_3bit_nc": (dict(id="vllm.turboquant", part="key", bits=3, norm_correction=True),
                           dict(id="vllm.turboquant", part="value", bits=3)),
    "turboquant_k8v4": (dict(id="vllm.fp8", format="e4m3", scale=1.0),
                        dict(id="vllm.turboquant", part="value", bits=4)),
}


def boundary_layers(n_layers: int, n: int = 2) -> tuple:
    """The layers vLLM's TurboQuant leaves in the model's dtype on a dense model of ``n_layers`` layers: the first
    and last ``n`` (at most half of them), as ``TurboQuantConfig.get_boundary_skip_layers``."""
    n = min(n, n_layers // 2)
    return tuple(sorted(set(range(n)) | set(range(n_layers - n, n_layers)))) if n > 0 else ()


@functools.lru_cache(maxsize=32)
def lloyd_max_centroids(d: int, bits: int) -> np.ndarray:
    """The 2**bits Lloyd-Max centroids of N(0, 1/d), ascending, float32: vLLM's ``solve_lloyd_max`` (centroids.py,
    Apache-2.0), the same float64 steps in the same order (trapezoids of 200 steps over [-10.5, 10.5] sigma at the
    ends, 200 iterations at most, tolerance 1e-10), so the float32 table is the one vLLM's kernels read."""
    n_levels, sigma2 = 2 ** bits, 1.0 / d
    sigma = math.sqrt(sigma2)
    norm = 1.0 / math.sqrt(2 * math.pi * sigma2)

    def pdf(x):
        return norm * math.exp(-x * x / (2 * sigma2))

    def trapz(f, a, b, n=200):
        h = (b - a) / n
        total = 0.5 * (f(a) + f(b))
        for i in range(1, n):
            total += f(a + i * h)
        return total * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(200):
        edges = [lo * 3] + [(centroids[i] + centroids[i + 1]) / 2.0 for i in range(n_levels - 1)] + [hi * 3]
        new = []
        for i in range(n_levels):
            a, b = edges[i], edges[i + 1]
            num, den = trapz(lambda x: x * pdf(x), a, b), trapz(pdf, a, b)
            new.append(num / den if den > 1e-15 else centroids[i])
        if max(abs(new[i] - centroids[i]) for i in range(n_levels)) < 1e-10:
            break
        centroids = new
    return np.asarray(centroids, dtype=np.float32)


def _tables(d: int, bits: int) -> tuple:
    """(centroids, midpoints, H's entry): float32 as vLLM derives them (midpoints of the sorted centroids in float32,
    ``H / sqrt(d)`` of a float32 tensor of +-1)."""
    c = lloyd_max_centroids(d, bits)
    s = np.sort(c)
    mid = ((s[:-1] + s[1:]) / np.float32(2)).astype(np.float32)
    return c, mid, float(np.float32(1.0) / np.float32(math.sqrt(d)))


@register_codec
class TurboQuantCodec(Codec):
    """One record of vLLM's TurboQuant KV slot a row: Lloyd-Max keys after a Hadamard rotation, or uniform values.

    Parameters
    ----------
    part: ``"key"`` (indices and an FP16 norm) or ``"value"`` (codes, FP16 scale and minimum).
    bits: 3 or 4.
    norm_correction: keys only: rescale the decoded centroid vector to unit norm (vLLM's ``_nc`` presets).
    n_threads: OpenMP threads (None = all).
    """

    codec_id = "vllm.turboquant"
    settings = ("part", "bits", "norm_correction")
    format_version = TQ_FORMAT_VERSION

    def __init__(self, part: str = "key", bits: int = 4, norm_correction: bool = False,
                 n_threads: Optional[int] = None, backend: Optional[str] = None):
        if part not in PARTS:
            raise CodecError(f"TurboQuant part {part!r} is not one vLLM writes; use 'key' or 'value'")
        if isinstance(bits, bool) or bits not in BITS:
            raise CodecError(f"TurboQuant {part}s take 3 or 4 bits (vLLM's presets; its 8-bit keys are fp8: scheme "
                             f"'turboquant_k8v4'), got {bits!r}")
        if not isinstance(norm_correction, (bool, np.bool_)) or (norm_correction and part == "value"):
            raise CodecError(f"norm_correction is true or false, and for keys only (values have none), got "
                             f"{norm_correction!r} for {part}s")
        self.part, self.bits, self.norm_correction = part, int(bits), bool(norm_correction)
        self.n_threads = resolve_threads(n_threads) if n_threads is not None else None
        self.backend = check_backend(backend)   # no backend but the CPU kernels is registered for it

    def record_bytes(self, D: int) -> int:
        """Bytes of one row's record: its codes, then 2 (a key's norm) or 4 (a value's scale and minimum)."""
        return (D * self.bits + 7) // 8 + (2 if self.part == "key" else 4)

    def bits_per_value(self, head_dim: int = 128) -> float:
        """Bits per value counted whole (codes, norm or scale and minimum) at ``head_dim`` (vLLM's 128 by default)."""
        return 8.0 * self.record_bytes(head_dim) / head_dim

    def describe(self) -> str:
        if self.part == "key":
            return f"vLLM TurboQuant keys: Hadamard + {self.bits}-bit Lloyd-Max, FP16 norm" + (
                ", norm correction" if self.norm_correction else "")
        return f"vLLM TurboQuant values: {self.bits}-bit min/max per token, FP16 scale and minimum"

    def layout(self, shape: tuple, name: str = "tensor") -> Layout:
        shape = tuple(shape)
        check_shape(shape, name)
        N, S, D = view3(shape)
        if self.part == "key" and (D < 8 or D & (D - 1)):
            raise CodecError(f"tensor {name!r}: vLLM's TurboQuant rotates keys by a Hadamard matrix of the head dim, "
                             f"a power of two from 8, and the last dim is {D}; use a kvcx scheme for this tensor")
        if D % 8:
            raise CodecError(f"tensor {name!r}: vLLM's TurboQuant packs a head's values in runs of 8, and the last dim "
                             f"is {D}; use a kvcx scheme for this tensor")
        return Layout(shape=tuple(int(s) for s in shape), N=N, S=S, D=D, t0=0,
                      codes_nbytes=N * S * self.record_bytes(D), scale_shape=(0,), partial_group=0)

    def encode(self, x, out: Optional[Packed] = None, *, name: str = "tensor",
               weights: Optional[np.ndarray] = None) -> Packed:
        if weights is not None:
            raise CodecError(f"tensor {name!r}: TurboQuant takes no key weights")
        x = check_float(x, name)
        lay = self.layout(x.shape, name)
        codes = out_buffers(out, {"codes": ((lay.codes_nbytes,), np.uint8)}, name, x.shape)["codes"]
        _, mid, h = _tables(lay.D, self.bits) if self.part == "key" else (None, np.zeros(1, np.float32), 1.0)
        status = _core.tq_encode(raw(x), kernel_dtype(x.dtype), lay.N * lay.S, lay.D, self.bits, self.part == "key",
                                 mid, h, self.record_bytes(lay.D), codes, resolve_threads(self.n_threads))
        if status == _core.STATUS_SCALE_OVERFLOW:
            top = float(np.max(np.abs(x.astype(np.float32))))
            raise CodecError(f"tensor {name!r}: a row's {'norm' if self.part == 'key' else 'range'} passes FP16, which "
                             f"TurboQuant records it in (|x| up to {top:.4g}); rescale the tensor or use scheme 'kvcx'")
        check_status(status, name, x)
        return finish_packed(out, dict(codes=codes, scales=np.empty(0, dtype=np.float16), zeros=None, sinks=None,
                                       shape=lay.shape, dtype=dtype_name(x.dtype), config=self.get_config(), meta={}))

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, *, name: str = "tensor",
               token_offset: int = 0) -> np.ndarray:
        lay = self.layout(tuple(packed.shape), name)
        out, out_S = decode_out(packed, out, token_offset, name)
        codes = np.ascontiguousarray(packed.codes, dtype=np.uint8).reshape(-1)
        if codes.size != lay.codes_nbytes:
            raise CodecError(f"tensor {name!r}: expected {lay.codes_nbytes} TurboQuant record bytes "
                             f"({self.record_bytes(lay.D)} a row), got {codes.size}")
        c, _, h = _tables(lay.D, self.bits) if self.part == "key" else (np.zeros(1, np.float32), None, 1.0)
        status = _core.tq_decode(codes, lay.N * lay.S, lay.S, lay.D, self.bits, self.part == "key", c,
                                 self.norm_correction, h, self.record_bytes(lay.D), raw(out), out_S, token_offset,
                                 DTYPE_NAMES[packed.dtype], resolve_threads(self.n_threads))
        if status & _core.STATUS_CORRUPT:
            raise CodecError(f"tensor {name!r}: its TurboQuant records hold a norm, scale or minimum the encoder never "
                             "writes (NaN/Inf or negative); the data is damaged: encode it again")
        check_status(status, name, what="decoding")
        return out
