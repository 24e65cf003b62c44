"""The INT4 (and 2/3/8-bit) group codec: checks, allocation, and calls into ``kvcx._core``.

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
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvcx import _core
# re-exported: these lived here before kvcx.dtypes / convert / metrics / runtime existed
from kvcx.convert import convert, to_float16, to_float32  # noqa: F401
from kvcx.dtypes import (BFLOAT16, DTYPE_NAMES, check_float, dtype_name, is_int, kernel_dtype,  # noqa: F401
                         numpy_dtype, raw)
from kvcx.errors import CodecError
from kvcx.metrics import ErrorStats, error_stats, quality_metrics  # noqa: F401
from kvcx.runtime import build_info, resolve_threads  # noqa: F401

SCHEMES = ("symmetric", "asymmetric")
AXES = ("token", "channel")
GROUP_SIZES = (16, 32, 64, 128, 256)
BITS = (2, 3, 4, 8)
MAX_ROTATE_DIM = 1024
# elements of one tensor at most: byte offsets of a float32 copy must fit an int64 with room to spare
MAX_ELEMENTS = 1 << 56
MAX_SINKS = 2 ** 31 - 1
_AXIS_CODES = {"token": _core.AXIS_TOKEN, "channel": _core.AXIS_CHANNEL}


def check_status(status: int, name: str, x: Optional[np.ndarray] = None, what: str = "encoding") -> None:
    """Turn a kernel status (kvcx_status bits) into the exception it means; the one place that does."""
    if status == _core.STATUS_OK:
        return
    if status & _core.STATUS_NOMEM:
        raise MemoryError(f"kvcx: out of memory while {what} tensor {name!r}")
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


# ----------------------------------------------------------------------------
# packed representation
# ----------------------------------------------------------------------------

@dataclass
class Packed:
    """One encoded tensor: packed codes, FP16 scales (+ zero points), exact sink tokens."""

    codes: np.ndarray                 # uint8, 1-D
    scales: np.ndarray                # float16
    zeros: Optional[np.ndarray]       # float16 (asymmetric) or None
    sinks: Optional[np.ndarray]       # original dtype, [..., sinks, D] or None
    shape: tuple
    dtype: str                        # 'F16' | 'BF16' | 'F32'
    config: dict                      # codec config actually used for this tensor
    meta: dict = field(default_factory=dict)  # layout facts (view, partial group)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        n = self.codes.nbytes + self.scales.nbytes
        n += self.zeros.nbytes if self.zeros is not None else 0
        n += self.sinks.nbytes if self.sinks is not None else 0
        return int(n)

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.nbytes / max(1, self.numel)


def _view3(shape: tuple) -> tuple:
    """(N, S, D): slabs, tokens, values per token (the last axis); Python ints, no overflow."""
    if len(shape) == 0:
        return 1, 1, 1
    if len(shape) == 1:
        return 1, 1, int(shape[0])
    return math.prod(int(s) for s in shape[:-2]), int(shape[-2]), int(shape[-1])


class IntCodec:
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
    """

    codec_id = "kvcx.int"

    def __init__(self, group_size: int = 64, scheme: str = "symmetric", bits: int = 4, axis: str = "token",
                 rotate: bool = False, sinks: int = 0, n_threads: Optional[int] = None):
        if not is_int(group_size) or group_size not in GROUP_SIZES:
            raise CodecError(f"group size {group_size!r} is not supported; use one of {', '.join(map(str, GROUP_SIZES))}")
        if not isinstance(scheme, str) or scheme not in SCHEMES:
            raise CodecError(f"scheme {scheme!r} is not supported; use one of {', '.join(SCHEMES)}")
        if not is_int(bits) or bits not in BITS:
            raise CodecError(f"bits {bits!r} is not supported; use one of {', '.join(map(str, BITS))}")
        if not isinstance(axis, str) or axis not in AXES:
            raise CodecError(f"axis {axis!r} is not supported; use one of {', '.join(AXES)}")
        if not isinstance(rotate, (bool, np.bool_)):
            raise CodecError(f"rotate must be true or false, got {rotate!r}")
        if not is_int(sinks) or not 0 <= sinks <= MAX_SINKS:
            raise CodecError(f"sinks must be a non-negative integer up to {MAX_SINKS} (tokens kept exact), "
                             f"got {sinks!r}")
        self.group_size = int(group_size)
        self.scheme = scheme
        self.bits = int(bits)
        self.axis = axis
        self.rotate = bool(rotate)
        self.sinks = int(sinks)
        self.n_threads = resolve_threads(n_threads) if n_threads is not None else None

    # -- config ------------------------------------------------------------
    def get_config(self) -> dict:
        return {
            "id": self.codec_id,
            "bits": self.bits,
            "group_size": self.group_size,
            "scheme": self.scheme,
            "axis": self.axis,
            "rotate": self.rotate,
            "sinks": self.sinks,
        }

    @classmethod
    def from_config(cls, config: dict) -> "IntCodec":
        if not isinstance(config, dict):
            raise CodecError(f"a codec config must be an object, got {type(config).__name__}")
        config = dict(config)
        codec_id = config.pop("id", cls.codec_id)
        if codec_id != cls.codec_id:
            raise CodecError(f"codec id {codec_id!r} is not {cls.codec_id!r}; this file was not written by kvcx")
        known = {"bits", "group_size", "scheme", "axis", "rotate", "sinks", "n_threads"}
        unknown = set(config) - known
        if unknown:
            raise CodecError(f"unknown codec settings {sorted(unknown)}; known: {sorted(known)}")
        return cls(**config)

    def with_threads(self, n_threads: Optional[int]) -> "IntCodec":
        """The same codec running on ``n_threads`` threads."""
        return IntCodec.from_config({**self.get_config(), "n_threads": n_threads})

    def __repr__(self) -> str:
        return (f"IntCodec(group_size={self.group_size}, scheme={self.scheme!r}, bits={self.bits}, "
                f"axis={self.axis!r}, rotate={self.rotate}, sinks={self.sinks})")

    def __eq__(self, other) -> bool:
        return isinstance(other, IntCodec) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash(tuple(sorted(self.get_config().items())))

    @property
    def asym(self) -> bool:
        return self.scheme == "asymmetric"

    def bits_per_value(self) -> float:
        """Nominal bits per value (codes + FP16 scale/zero per group), without sinks or partial groups."""
        return self.bits + (32 if self.asym else 16) / self.group_size

    # -- layout ------------------------------------------------------------
    def _layout(self, shape: tuple, name: str) -> dict:
        """The geometry the kernels get, after every check they rely on (sizes, divisors, overflow)."""
        if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
            raise CodecError(f"tensor {name!r}: shape {list(shape)} must be a list of non-negative integers")
        if any(s == 0 for s in shape):
            raise CodecError(f"tensor {name!r} is empty (shape {list(shape)}); there is nothing to compress")
        if math.prod(int(s) for s in shape) > MAX_ELEMENTS:
            raise CodecError(f"tensor {name!r}: shape {list(shape)} has more than 2**56 elements; split it")
        N, S, D = _view3(shape)
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
                             f"between 8 and {MAX_ROTATE_DIM}, got {D}; pass rotate=False (--no-rotate)")
        L = (S - t0) * D
        if self.axis == "token":
            scale_shape = (N, -(-L // G))
            partial = L % G
        else:
            scale_shape = (N, -(-(S - t0) // G), D)
            partial = (S - t0) % G
        row_bytes = (L * bits + 7) // 8
        return {"N": N, "S": S, "D": D, "t0": t0, "scale_shape": scale_shape, "codes_nbytes": N * row_bytes,
                "partial_group": partial}

    def _kernel_layout(self, lay: dict) -> "_core.Layout":
        return _core.Layout(N=lay["N"], S=lay["S"], D=lay["D"], t0=lay["t0"], group_size=self.group_size,
                            bits=self.bits, asym=self.asym, axis=_AXIS_CODES[self.axis], rotate=self.rotate)

    def supports(self, shape: tuple) -> bool:
        """Whether this codec can encode a tensor of this shape (see the layout rules)."""
        try:
            self._layout(tuple(shape), "tensor")
        except CodecError:
            return False
        return True

    def codes_nbytes(self, shape: tuple, name: str = "tensor") -> int:
        """Bytes of packed codes for a tensor of this shape."""
        return self._layout(tuple(shape), name)["codes_nbytes"]

    def packed_config(self, shape: tuple, name: str = "tensor") -> dict:
        """The config recorded for a tensor of this shape (sinks capped to its token count)."""
        cfg = self.get_config()
        cfg["sinks"] = self._layout(tuple(shape), name)["t0"]
        return cfg

    # -- encode / decode -----------------------------------------------------
    def encode(self, arr, name: str = "tensor", out: Optional[Packed] = None) -> Packed:
        """Quantize ``arr`` (float16/bfloat16/float32) into a :class:`Packed`.

        ``out``: a Packed from an earlier encode of the same shape with this codec; its code,
        scale and zero-point buffers are reused (and returned, updated).
        """
        x = check_float(arr, name)
        lay = self._layout(x.shape, name)
        N, S, D, t0 = lay["N"], lay["S"], lay["D"], lay["t0"]
        if out is None:
            codes = np.empty(lay["codes_nbytes"], dtype=np.uint8)
            scales = np.empty(lay["scale_shape"], dtype=np.float16)
            zeros = np.empty(lay["scale_shape"], dtype=np.float16) if self.asym else np.empty(0, dtype=np.float16)
        else:
            def ok(a, shape, dtype):
                return (isinstance(a, np.ndarray) and a.shape == tuple(shape) and a.dtype == dtype
                        and a.flags.c_contiguous and a.flags.writeable)
            if not (isinstance(out, Packed) and ok(out.codes, (lay["codes_nbytes"],), np.uint8)
                    and ok(out.scales, lay["scale_shape"], np.float16)
                    and (not self.asym or ok(out.zeros, lay["scale_shape"], np.float16))):
                raise CodecError(f"tensor {name!r}: out must be a Packed from encoding a tensor of shape "
                                 f"{list(x.shape)} with this codec (writeable buffers: {lay['codes_nbytes']} code "
                                 f"bytes, scales {list(lay['scale_shape'])})")
            codes, scales = out.codes, out.scales
            zeros = out.zeros if self.asym else np.empty(0, dtype=np.float16)
        status = _core.STATUS_OK
        if S > t0:
            status = _core.encode(raw(x), kernel_dtype(x.dtype), self._kernel_layout(lay), codes,
                                  scales.reshape(-1).view(np.uint16), zeros.reshape(-1).view(np.uint16),
                                  resolve_threads(self.n_threads))
        if t0 and not status and not np.isfinite(x.reshape(N, S, D)[:, :t0, :].astype(np.float32)).all():
            status = _core.STATUS_NONFINITE  # the exact sink tokens must be finite too
        check_status(status, name, x)
        sinks = None
        if t0:
            sinks = np.ascontiguousarray(x.reshape(N, S, D)[:, :t0, :]).reshape(*x.shape[:-2], t0, D)
        cfg = self.get_config()
        cfg["sinks"] = t0
        fields = dict(codes=codes, scales=scales, zeros=zeros if self.asym else None, sinks=sinks,
                      shape=tuple(int(s) for s in x.shape), dtype=dtype_name(x.dtype), config=cfg,
                      meta={"partial_group": lay["partial_group"]})
        if out is None:
            return Packed(**fields)
        out.__dict__.update(fields)
        return out

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, name: str = "tensor") -> np.ndarray:
        """Unpack and dequantize; ``out`` (optional) must match the packed shape and dtype."""
        return decode_packed(packed, out=out, name=name, n_threads=self.n_threads)


# a readable alias for the 4-bit use
Int4Codec = IntCodec


def decode_packed(packed: Packed, out: Optional[np.ndarray] = None, name: str = "tensor",
                  n_threads: Optional[int] = None, token_offset: int = 0) -> np.ndarray:
    """Decode with the settings recorded in the packed tensor itself.

    ``out`` may be larger along the token axis (-2): the tensor is then written at
    ``out[..., token_offset:token_offset + S, :]`` (used to assemble a KV cache from chunks).
    """
    codec = IntCodec.from_config(packed.config)
    shape = tuple(packed.shape)
    lay = codec._layout(shape, name)
    N, S, D, t0 = lay["N"], lay["S"], lay["D"], lay["t0"]
    if t0 != packed.config.get("sinks", 0):
        raise CodecError(f"tensor {name!r}: recorded sinks {packed.config.get('sinks')} do not fit shape {list(shape)}")
    dtype = numpy_dtype(packed.dtype)
    if out is None:
        if token_offset:
            raise CodecError("token_offset needs an out= array")
        out = np.empty(shape, dtype=dtype)
        out_S = S
    else:
        ok = (isinstance(out, np.ndarray) and out.dtype == dtype and out.ndim == len(shape)
              and out.flags.c_contiguous and out.flags.writeable)
        if ok and token_offset == 0 and tuple(out.shape) == shape:
            out_S = S
        elif ok and len(shape) >= 2 and out.shape[:-2] == shape[:-2] and out.shape[-1] == D \
                and 0 <= token_offset and token_offset + S <= out.shape[-2]:
            out_S = int(out.shape[-2])
        else:
            got = f"{out.dtype} {list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
            raise CodecError(f"tensor {name!r}: out must be a writeable C-contiguous {dtype} array of shape "
                             f"{list(shape)} (or longer on axis -2 with token_offset), got {got}")
    codes = np.ascontiguousarray(packed.codes, dtype=np.uint8).reshape(-1)
    scales = np.ascontiguousarray(packed.scales, dtype=np.float16)
    if codes.size != lay["codes_nbytes"]:
        raise CodecError(f"tensor {name!r}: expected {lay['codes_nbytes']} bytes of packed codes, got {codes.size}")
    if scales.size != int(np.prod(lay["scale_shape"])):
        raise CodecError(f"tensor {name!r}: expected {int(np.prod(lay['scale_shape']))} scales, got {scales.size}")
    if codec.asym:
        if packed.zeros is None or packed.zeros.size != scales.size:
            raise CodecError(f"tensor {name!r}: the asymmetric scheme needs {scales.size} zero points")
        zeros = np.ascontiguousarray(packed.zeros, dtype=np.float16)
    else:
        zeros = np.empty(0, dtype=np.float16)
    if S > t0:
        status = _core.decode(codes, scales.reshape(-1).view(np.uint16), zeros.reshape(-1).view(np.uint16),
                              codec._kernel_layout(lay), raw(out), out_S, token_offset, DTYPE_NAMES[packed.dtype],
                              resolve_threads(n_threads))
        check_status(status, name, what="decoding")
    if t0:
        if packed.sinks is None or packed.sinks.size != N * t0 * D:
            raise CodecError(f"tensor {name!r}: {t0} exact sink tokens are recorded but their values are missing")
        out.reshape(N, out_S, D)[:, token_offset:token_offset + t0, :] = \
            np.asarray(packed.sinks).astype(dtype, copy=False).reshape(N, t0, D)
    return out
