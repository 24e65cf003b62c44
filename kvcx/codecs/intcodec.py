"""The integer group codec (2, 3, 4 and 8 bits): checks, allocation, and calls into the kernels.

>>> codec = IntCodec(group_size=64, scheme="symmetric")
>>> packed = codec.encode(x)              # x: float16 / bfloat16 / float32 ndarray
>>> y = codec.decode(packed)              # same shape and dtype as x

The reference design is ``IntCodec(bits=4, group_size=64, scheme="symmetric")``:
per group of 64 consecutive values ``scale = fp16(max|x| / 7)``,
``q = clamp(round(x / scale), -8, 7)`` (round half to even), codes packed two per
byte (element 2i in the low nibble). See docs/FORMAT.md for every option.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from kvcx.codecs.cpu import core as _core
from kvcx.codecs.backends import backend_for, check_backend
from kvcx.codecs.base import (
    Codec,
    Layout,
    Packed,
    check_shape,
    check_sinks,
    check_recorded_sinks,
    check_sinks_finite,
    decode_out,
    register_codec,
    restore_sinks,
    view3,
    write_sinks,
)
from kvcx.codecs.dtypes import DTYPE_NAMES, check_float, dtype_name, is_int, kernel_dtype, raw
from kvcx.codecs.runtime import check_status, resolve_threads
from kvcx.errors import CodecError

SCHEMES = ("symmetric", "asymmetric")
AXES = ("token", "channel")
GROUP_SIZES = (16, 32, 64, 128, 256)
BITS = (2, 3, 4, 8)
MAX_ROTATE_DIM = 1024
_AXIS_CODES = {"token": _core.AXIS_TOKEN, "channel": _core.AXIS_CHANNEL}
_NO_ZEROS = np.empty(0, dtype=np.float16)


def check_group_size(group_size) -> int:
    if not is_int(group_size) or group_size not in GROUP_SIZES:
        raise CodecError(f"group size {group_size!r} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}")
    return int(group_size)


def _writeable(a, shape, dtype) -> bool:
    return (isinstance(a, np.ndarray) and a.shape == tuple(shape) and a.dtype == dtype and a.flags.c_contiguous
            and a.flags.writeable)


@register_codec
class IntCodec(Codec):
    """Per-group integer quantization with packed codes and FP16 scales.

    Parameters
    ----------
    group_size: values per group (16, 32, 64, 128 or 256).
    scheme: ``"symmetric"`` (``scale = max|x| / (2**(bits-1) - 1)``, no zero point) or
        ``"asymmetric"`` (``scale = (max - min) / (2**bits - 1)``, FP16 zero point = min).
    bits: 4 (two codes per byte), 3 or 2 (densely packed), 8 (reference).
    axis: ``"token"`` groups run along each slab's values in C order (a KV head's
        tokens one after another, ``head_dim`` values each); ``"channel"`` groups run
        along tokens, one group per channel (KIVI's key quantization).
    rotate: apply an orthonormal Walsh-Hadamard rotation to each token's values
        (last axis, a power of two) before quantizing; decode applies the inverse.
    sinks: keep the first ``sinks`` tokens (axis -2) of tensors with 2+ dims exact.
    n_threads: OpenMP threads (None = all).
    backend: where torch tensors are worked on: ``"triton"`` (4 bits; the same bytes as the CPU kernels),
        ``"cpu"``, or None (by the tensor's device: CUDA tensors go to Triton). NumPy arrays always run on the
        CPU kernels. Not part of the config.
    """

    codec_id = "kvcx.int"
    settings = ("bits", "group_size", "scheme", "axis", "rotate", "sinks")

    def __init__(self, group_size: int = 64, scheme: str = "symmetric", bits: int = 4, axis: str = "token",
                 rotate: bool = False, sinks: int = 0, n_threads: Optional[int] = None,
                 backend: Optional[str] = None):
        group_size = check_group_size(group_size)
        if not isinstance(scheme, str) or scheme not in SCHEMES:
            raise CodecError(f"scheme {scheme!r} is not supported; use one of {', '.join(SCHEMES)}")
        if not is_int(bits) or bits not in BITS:
            raise CodecError(f"bits {bits!r} is not supported; use one of {', '.join(map(str, BITS))}")
        if not isinstance(axis, str) or axis not in AXES:
            raise CodecError(f"axis {axis!r} is not supported; use one of {', '.join(AXES)}")
        if not isinstance(rotate, (bool, np.bool_)):
            raise CodecError(f"rotate must be true or false, got {rotate!r}")
        self.group_size = group_size
        self.scheme = scheme
        self.bits = int(bits)
        self.axis = axis
        self.rotate = bool(rotate)
        self.sinks = check_sinks(sinks)
        self.n_threads = resolve_threads(n_threads) if n_threads is not None else None
        self.backend = check_backend(backend)

    def __repr__(self) -> str:
        return (f"IntCodec(group_size={self.group_size}, scheme={self.scheme!r}, bits={self.bits}, "
                f"axis={self.axis!r}, rotate={self.rotate}, sinks={self.sinks})")

    @property
    def asym(self) -> bool:
        return self.scheme == "asymmetric"

    @property
    def has_zeros(self) -> bool:
        return self.asym

    def bits_per_value(self) -> float:
        """Nominal bits per value (codes + FP16 scale/zero per group), without sinks or partial groups."""
        return self.bits + (32 if self.asym else 16) / self.group_size

    def describe(self) -> str:
        """A short description, e.g. ``4-bit asym g64 per-channel +1 sink``."""
        return (f"{self.bits}-bit {self.scheme[:4]} g{self.group_size} per-{self.axis}"
                + (" +hadamard" if self.rotate else "") + (f" +{self.sinks} sink" if self.sinks else ""))

    @property
    def token_block(self) -> int:
        return self.group_size if self.axis == "channel" else 1

    def fallback(self) -> "IntCodec":
        """These scheme, bits and group size grouped per token, without rotation or sinks: any shape fits."""
        return IntCodec(group_size=self.group_size, scheme=self.scheme, bits=self.bits, axis="token", rotate=False,
                        sinks=0, n_threads=self.n_threads, backend=self.backend)

    # -- layout ------------------------------------------------------------
    def layout(self, shape: tuple, name: str = "tensor") -> Layout:
        """The geometry the kernels get, after every check they rely on (sizes, divisors, overflow)."""
        shape = tuple(shape)
        check_shape(shape, name)
        N, S, D = view3(shape)
        t0 = min(self.sinks, S) if len(shape) >= 2 else 0
        G, bits = self.group_size, self.bits
        if self.axis == "channel" and len(shape) < 2:
            raise CodecError(f"tensor {name!r} of shape {list(shape)}: channel grouping needs at least 2 dims "
                             "(tokens x channels); use axis='token' for it")
        if self.axis == "channel" and (D * bits) % 8:
            raise CodecError(f"tensor {name!r}: channel grouping at {bits} bits needs the last dim ({D}) to fill "
                             f"whole bytes (a multiple of {8 // math.gcd(8, bits)}); use axis='token'")
        if self.rotate and (D < 8 or D > MAX_ROTATE_DIM or D & (D - 1)):
            raise CodecError(f"tensor {name!r}: the Hadamard rotation needs the last dim to be a power of two "
                             f"between 8 and {MAX_ROTATE_DIM}, got {D}; pass rotate=False")
        L = (S - t0) * D
        if self.axis == "token":
            scale_shape = (N, -(-L // G))
            partial = L % G
        else:
            scale_shape = (N, -(-(S - t0) // G), D)
            partial = (S - t0) % G
        return Layout(shape=tuple(int(s) for s in shape), N=N, S=S, D=D, t0=t0,
                      codes_nbytes=N * ((L * bits + 7) // 8), scale_shape=scale_shape, partial_group=partial)

    def _kernel_layout(self, lay: Layout) -> "_core.Layout":
        return _core.Layout(N=lay.N, S=lay.S, D=lay.D, t0=lay.t0, group_size=self.group_size, bits=self.bits,
                            asym=self.asym, axis=_AXIS_CODES[self.axis], rotate=self.rotate)

    # -- encode / decode -----------------------------------------------------
    def encode(self, x, out: Optional[Packed] = None, *, name: str = "tensor",
               weights: Optional[np.ndarray] = None) -> Packed:
        """Quantize ``x`` (float16/bfloat16/float32) into a :class:`Packed`.

        ``out``: a Packed of this codec and shape (from an earlier encode, or views of a buffer's sections);
        its code, scale and zero-point buffers are written, and its sinks buffer when it has one of the right
        shape (else a new one is set), and it is returned. ``weights``: None (this codec has one width).
        """
        if weights is not None:
            raise CodecError(f"tensor {name!r}: key weights choose per-channel widths; this codec has one width "
                             "(use --scheme kvcx2w)")
        backend = backend_for(self, x, name)
        if backend is not None:
            return backend.encode(self, self.layout(tuple(x.shape), name), x, out, name)
        x = check_float(x, name)
        lay = self.layout(x.shape, name)
        N, S, D, t0 = lay.N, lay.S, lay.D, lay.t0
        if out is None:
            codes = np.empty(lay.codes_nbytes, dtype=np.uint8)
            scales = np.empty(lay.scale_shape, dtype=np.float16)
            zeros = np.empty(lay.scale_shape, dtype=np.float16) if self.asym else _NO_ZEROS
        else:
            if not (isinstance(out, Packed) and _writeable(out.codes, (lay.codes_nbytes,), np.uint8)
                    and _writeable(out.scales, lay.scale_shape, np.float16)
                    and (not self.asym or _writeable(out.zeros, lay.scale_shape, np.float16))):
                raise CodecError(f"tensor {name!r}: out must be a Packed from encoding a tensor of shape "
                                 f"{list(x.shape)} with this codec (writeable buffers: {lay.codes_nbytes} code "
                                 f"bytes, scales {list(lay.scale_shape)})")
            codes, scales = out.codes, out.scales
            zeros = out.zeros if self.asym else _NO_ZEROS
        status = _core.STATUS_OK
        if S > t0:
            status = _core.encode(raw(x), kernel_dtype(x.dtype), self._kernel_layout(lay), codes,
                                  scales.reshape(-1).view(np.uint16), zeros.reshape(-1).view(np.uint16),
                                  resolve_threads(self.n_threads))
        x3 = x.reshape(N, S, D)
        if t0 and not status and not np.isfinite(x3[:, :t0, :].astype(np.float32)).all():
            status = _core.STATUS_NONFINITE  # the exact sink tokens must be finite too
        check_status(status, name, x)
        cfg = self.get_config()
        cfg["sinks"] = t0
        fields = dict(codes=codes, scales=scales, zeros=zeros if self.asym else None,
                      sinks=write_sinks(x3, t0, lay.shape, out), shape=lay.shape, dtype=dtype_name(x.dtype),
                      config=cfg, meta={"partial_group": lay.partial_group})
        if out is None:
            return Packed(**fields)
        out.__dict__.update(fields)
        return out

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, *, name: str = "tensor",
               token_offset: int = 0) -> np.ndarray:
        """Unpack and dequantize; ``out`` (optional) matches the packed shape and dtype, or is longer on axis
        -2 (written at ``token_offset``)."""
        lay = self.layout(tuple(packed.shape), name)
        N, S, D, t0 = lay.N, lay.S, lay.D, lay.t0
        check_recorded_sinks(packed, t0, lay.shape, name)
        backend = backend_for(self, packed.codes, name)
        if backend is not None:
            return backend.decode(self, lay, packed, out, token_offset, name)
        out, out_S = decode_out(packed, out, token_offset, name)
        codes = np.ascontiguousarray(packed.codes, dtype=np.uint8).reshape(-1)
        scales = np.ascontiguousarray(packed.scales, dtype=np.float16)
        if codes.size != lay.codes_nbytes:
            raise CodecError(f"tensor {name!r}: expected {lay.codes_nbytes} bytes of packed codes, got {codes.size}")
        if scales.size != int(np.prod(lay.scale_shape)):
            raise CodecError(f"tensor {name!r}: expected {int(np.prod(lay.scale_shape))} scales, got {scales.size}")
        if self.asym:
            if packed.zeros is None or packed.zeros.size != scales.size:
                raise CodecError(f"tensor {name!r}: the asymmetric scheme needs {scales.size} zero points")
            zeros = np.ascontiguousarray(packed.zeros, dtype=np.float16)
        else:
            zeros = _NO_ZEROS
        # parameters no encoder writes (a crafted record that passed its checksum): never decoded to inf/NaN
        if not (np.isfinite(scales).all() and (scales >= 0).all() and np.isfinite(zeros).all()):
            raise CodecError(f"tensor {name!r}: its scales or zero points hold NaN/Inf or negative scales, which no "
                             "kvcx encoder writes; the data is damaged: encode it again")
        check_sinks_finite(packed, t0, name)
        if S > t0:
            status = _core.decode(codes, scales.reshape(-1).view(np.uint16), zeros.reshape(-1).view(np.uint16),
                                  self._kernel_layout(lay), raw(out), out_S, token_offset, DTYPE_NAMES[packed.dtype],
                                  resolve_threads(self.n_threads))
            check_status(status, name, what="decoding")
        restore_sinks(packed, out, out_S, token_offset, N, t0, D, name)
        return out
