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


class _Codec:
    """What the codecs share: their config round trip (``codec_id``, the settings ``_SETTINGS``) and what
    their ``_layout(shape, name)`` (checks and sizes) answers."""

    codec_id = ""
    _SETTINGS: tuple = ()

    @classmethod
    def from_config(cls, config: dict):
        if not isinstance(config, dict):
            raise CodecError(f"a codec config must be an object, got {type(config).__name__}")
        config = dict(config)
        codec_id = config.pop("id", cls.codec_id)
        if codec_id != cls.codec_id:
            raise CodecError(f"codec id {codec_id!r} is not {cls.codec_id!r}; this file was not written by kvcx")
        known = set(cls._SETTINGS) | {"n_threads"}
        unknown = set(config) - known
        if unknown:
            raise CodecError(f"unknown codec settings {sorted(unknown)}; known: {sorted(known)}")
        return cls(**config)

    def with_threads(self, n_threads: Optional[int]):
        """The same codec running on ``n_threads`` threads."""
        return type(self).from_config({**self.get_config(), "n_threads": n_threads})

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash(tuple(sorted(self.get_config().items())))

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


class IntCodec(_Codec):
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
    _SETTINGS = ("bits", "group_size", "scheme", "axis", "rotate", "sinks")

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

    def __repr__(self) -> str:
        return (f"IntCodec(group_size={self.group_size}, scheme={self.scheme!r}, bits={self.bits}, "
                f"axis={self.axis!r}, rotate={self.rotate}, sinks={self.sinks})")

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

    # -- encode / decode -----------------------------------------------------
    def encode(self, arr, name: str = "tensor", out: Optional[Packed] = None,
               weights: Optional[np.ndarray] = None) -> Packed:
        """Quantize ``arr`` (float16/bfloat16/float32) into a :class:`Packed`.

        ``out``: a Packed from an earlier encode of the same shape with this codec; its code,
        scale and zero-point buffers are reused (and returned, updated). ``weights``: None (channel
        weights choose widths, which only :class:`WidthCodec` has).
        """
        if weights is not None:
            raise CodecError(f"tensor {name!r}: key weights choose per-channel widths; this codec has one width "
                             "(use --scheme kvcx2w)")
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


# ----------------------------------------------------------------------------
# per-channel bit widths for keys
# ----------------------------------------------------------------------------

_F16_MAX = float(np.finfo(np.float16).max)
# the error of an endpoint quantizer of w bits relative to one of 0 bits (the range's middle): the range is
# cut into 2^w - 1 steps, so the error falls as 1 / (2^w - 1)^2; one bit buys nothing over the middle
_W_ERR = np.array([1.0] + [1.0 / ((1 << w) - 1) ** 2 for w in range(1, _core.W_MAX + 1)])
# what each channel's k-th bit buys: the first two bits only together (2 bits: 1/9 of the error)
_W_GAIN = np.array([(1.0 - _W_ERR[2]) / 2] * 2 + [_W_ERR[k] - _W_ERR[k + 1] for k in range(2, _core.W_MAX)])


class WidthCodec(_Codec):
    """Keys grouped per channel along tokens (as ``IntCodec(axis="channel", scheme="asymmetric")``), each
    channel with its own bit width, chosen per tensor from the data.

    A tensor's widths sum to ``bits * head_dim`` per slab (a KV head), spent where they cut the error most:
    a channel whose values spread widely (or that the queries weigh heavily, with ``weights``) gets more
    bits, a flat one fewer, down to none (it decodes to the middle of its range). Groups of ``group_size``
    tokens keep their channel's range as two bytes on a 255-step grid between the channel's FP16 minimum
    and maximum over the tensor, so the ranges cost 16 / group_size bits per value instead of 32. Codes are
    stored as bit planes. See docs/FORMAT.md 2.4.

    Parameters
    ----------
    bits: mean bits per code over a slab's channels (``bits * head_dim`` must be whole: a multiple of 1/64
        for head_dim 64), more than 0 and at most 8.
    group_size: tokens per group (16, 32, 64, 128 or 256); 32 by default (kvcx2w's: on the embedded model
        groups of 32 at 2 bits beat groups of 64 at 2.25, which cost the same).
    sinks: keep the first ``sinks`` tokens exact.
    n_threads: OpenMP threads (None = all).
    """

    codec_id = "kvcx.widths"
    _SETTINGS = ("bits", "group_size", "sinks")
    scheme = "asymmetric"
    axis = "channel"
    rotate = False
    asym = False  # no zero-point tensor: the ranges live in the scales and the code bytes

    def __init__(self, bits: float = 2.0, group_size: int = 32, sinks: int = 0, n_threads: Optional[int] = None):
        if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, float, np.integer, np.floating)) \
                or not (0 < float(bits) <= _core.W_MAX):
            raise CodecError(f"widths codec: mean bits {bits!r} must be a number in (0, {_core.W_MAX}]")
        if not is_int(group_size) or group_size not in GROUP_SIZES:
            raise CodecError(f"group size {group_size!r} is not supported; use one of "
                             f"{', '.join(map(str, GROUP_SIZES))}")
        if not is_int(sinks) or not 0 <= sinks <= MAX_SINKS:
            raise CodecError(f"sinks must be a non-negative integer up to {MAX_SINKS} (tokens kept exact), "
                             f"got {sinks!r}")
        self.bits = float(bits)
        self.group_size = int(group_size)
        self.sinks = int(sinks)
        self.n_threads = resolve_threads(n_threads) if n_threads is not None else None

    def get_config(self) -> dict:
        return {"id": self.codec_id, "bits": self.bits, "group_size": self.group_size, "sinks": self.sinks}

    def __repr__(self) -> str:
        return f"WidthCodec(bits={self.bits}, group_size={self.group_size}, sinks={self.sinks})"

    def bits_per_value(self) -> float:
        """Nominal bits per value: codes + two range bytes per channel group (without sinks, the width table and
        the channels' FP16 ranges, which do not grow with the tokens)."""
        return self.bits + 16 / self.group_size

    # -- layout ------------------------------------------------------------
    def _layout(self, shape: tuple, name: str) -> dict:
        if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
            raise CodecError(f"tensor {name!r}: shape {list(shape)} must be a list of non-negative integers")
        if any(s == 0 for s in shape):
            raise CodecError(f"tensor {name!r} is empty (shape {list(shape)}); there is nothing to compress")
        if len(shape) < 2:
            raise CodecError(f"tensor {name!r} of shape {list(shape)}: per-channel widths need at least 2 dims "
                             "(tokens x channels)")
        if math.prod(int(s) for s in shape) > MAX_ELEMENTS:
            raise CodecError(f"tensor {name!r}: shape {list(shape)} has more than 2**56 elements; split it")
        N, S, D = _view3(shape)
        if D % 8:
            raise CodecError(f"tensor {name!r}: per-channel widths need the last dim ({D}) to be a multiple of 8; "
                             "use --scheme kvcx2")
        budget = self.bits * D
        if abs(budget - round(budget)) > 1e-9 or round(budget) < 1:
            raise CodecError(f"tensor {name!r}: {self.bits} mean bits x {D} channels is not a whole number of "
                             f"bits; use a mean that is a multiple of 1/{D}")
        t0 = min(self.sinks, S)
        gs = self.group_size
        G = -(-(S - t0) // gs)
        B = int(round(budget))
        planes = N * G * (gs // 8) * B
        return {"N": N, "S": S, "D": D, "t0": t0, "G": G, "B": B,
                "codes_nbytes": N * D + N * G * D * 2 + planes, "scale_shape": (N, D, 2),
                "partial_group": (S - t0) % gs}

    def allocate(self, spread: np.ndarray, budget: int) -> np.ndarray:
        """Widths (N, D) uint8 from each channel's error at 0 bits (N, D): the ``budget * N`` bits that cut
        the modelled error most over all the tensor's channels (each channel's error falls as
        1 / (2^w - 1)^2), so a head whose keys spread (or whose queries weigh) more gets more bits."""
        N, D = spread.shape
        gain = (spread[:, :, None] * _W_GAIN[None, None, :]).reshape(-1)
        total = budget * N
        if total >= gain.size:
            return np.full((N, D), _core.W_MAX, dtype=np.uint8)
        pick = np.argpartition(-gain, total - 1)[:total] // _core.W_MAX
        return np.bincount(pick, minlength=N * D).reshape(N, D).astype(np.uint8)

    # -- encode / decode -----------------------------------------------------
    def encode(self, arr, name: str = "tensor", out: Optional[Packed] = None,
               weights: Optional[np.ndarray] = None) -> Packed:
        """Quantize ``arr``; ``weights`` (heads x head_dim, e.g. the queries' mean square per channel from
        ``kvcx calibrate``) weigh each channel's error when the widths are chosen. ``out``: a Packed from an
        earlier encode of the same shape with this codec; its buffers are reused (and returned, updated)."""
        x = check_float(arr, name)
        lay = self._layout(x.shape, name)
        N, S, D, t0, G, gs = lay["N"], lay["S"], lay["D"], lay["t0"], lay["G"], self.group_size
        threads = resolve_threads(self.n_threads)
        if weights is not None:
            weights = np.asarray(weights, dtype=np.float64)
            if weights.ndim != 2 or weights.shape[1] != D or N % weights.shape[0] or not np.isfinite(weights).all() \
                    or (weights < 0).any():
                raise CodecError(f"tensor {name!r}: key weights must be finite, non-negative, (heads, {D}) with the "
                                 f"tensor's {N} slabs a multiple of heads; got shape {list(weights.shape)}")
        if out is None:
            codes = np.empty(lay["codes_nbytes"], dtype=np.uint8)
            scales = np.empty(lay["scale_shape"], dtype=np.float16)
        else:
            ok = (isinstance(out, Packed) and out.config.get("id") == self.codec_id
                  and all(isinstance(a, np.ndarray) and a.shape == shape and a.dtype == dt and a.flags.c_contiguous
                          and a.flags.writeable for a, shape, dt in ((out.codes, (lay["codes_nbytes"],), np.uint8),
                                                                     (out.scales, lay["scale_shape"], np.float16))))
            if not ok:
                raise CodecError(f"tensor {name!r}: out must be a Packed from encoding a tensor of shape "
                                 f"{list(x.shape)} with this codec ({lay['codes_nbytes']} writeable code bytes, "
                                 f"ranges {list(lay['scale_shape'])})")
            codes, scales = out.codes, out.scales
        if t0 and not np.isfinite(x.reshape(N, S, D)[:, :t0, :].astype(np.float32)).all():
            check_status(_core.STATUS_NONFINITE, name, x)
        if G:
            mn = np.empty((N, G, D), dtype=np.float32)
            mx = np.empty((N, G, D), dtype=np.float32)
            dt = kernel_dtype(x.dtype)
            status = _core.w_minmax(raw(x), dt, N, S, D, t0, gs, mn.reshape(-1), mx.reshape(-1), threads)
            check_status(status, name, x)
            lo, hi = np.empty((N, D), dtype=np.float32), np.empty((N, D), dtype=np.float32)
            spread = np.empty((N, D), dtype=np.float64)
            _core.w_channels(mn.reshape(-1), mx.reshape(-1), N, G, D, gs, (S - t0) - (G - 1) * gs,
                             lo.reshape(-1), hi.reshape(-1), spread.reshape(-1), threads)
            if not (np.isfinite(lo).all() and np.isfinite(hi).all()):   # NaN is sticky in the minima
                check_status(_core.STATUS_NONFINITE, name, x)
            if max(-float(lo.min()), float(hi.max())) > _F16_MAX:
                check_status(_core.STATUS_SCALE_OVERFLOW, name, x)
            lo16, hi16 = lo.astype(np.float16), hi.astype(np.float16)   # rounded outwards: the range covers all
            lo16 = np.where(lo16.astype(np.float32) > lo, np.nextafter(lo16, np.float16(-np.inf)), lo16)
            hi16 = np.where(hi16.astype(np.float32) < hi, np.nextafter(hi16, np.float16(np.inf)), hi16)
            scales[..., 0], scales[..., 1] = lo16, hi16
            if weights is not None:
                spread = spread * np.tile(weights, (N // weights.shape[0], 1))
            widths = self.allocate(spread, lay["B"])
            codes[:N * D] = widths.reshape(-1)
            off, slab_off, gbytes = self._offsets(widths, G)
            status = _core.w_encode(raw(x), dt, N, S, D, t0, gs, mn.reshape(-1), mx.reshape(-1),
                                    lo16.astype(np.float32).reshape(-1), hi16.astype(np.float32).reshape(-1),
                                    widths.reshape(-1), self._tops(widths), off.reshape(-1), slab_off, gbytes,
                                    codes[N * D:N * D + N * G * D * 2], codes[N * D + N * G * D * 2:], threads)
            check_status(status, name, x)
        else:
            codes[:] = 0   # no quantized tokens: widths (and nothing else) are stored
            scales[:] = 0
        sinks = np.ascontiguousarray(x.reshape(N, S, D)[:, :t0, :]).reshape(*x.shape[:-2], t0, D) if t0 else None
        cfg = self.get_config()
        cfg["sinks"] = t0
        fields = dict(codes=codes, scales=scales, zeros=None, sinks=sinks, shape=tuple(int(s) for s in x.shape),
                      dtype=dtype_name(x.dtype), config=cfg, meta={"partial_group": lay["partial_group"]})
        if out is None:
            return Packed(**fields)
        out.__dict__.update(fields)
        return out

    @staticmethod
    def _tops(widths: np.ndarray) -> np.ndarray:
        """The largest code of each channel, 2^w - 1, as the kernels take it (float32, flat)."""
        return ((1 << widths.astype(np.int32)) - 1).astype(np.float32).reshape(-1)

    def _offsets(self, widths: np.ndarray, G: int) -> tuple:
        """(each channel's byte offset inside its group's block (N, D), where each slab's planes start (N),
        each slab's bytes per group (N)), int64."""
        w = widths.astype(np.int64)
        per = self.group_size // 8
        gbytes = w.sum(axis=1) * per
        return (np.cumsum(w, axis=1) - w) * per, np.concatenate([[0], np.cumsum(gbytes * G)[:-1]]), gbytes

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, name: str = "tensor") -> np.ndarray:
        return self._decode(packed, out, name, self.n_threads, 0)

    def _decode(self, packed: Packed, out, name: str, n_threads, token_offset: int) -> np.ndarray:
        shape = tuple(packed.shape)
        lay = self._layout(shape, name)
        N, S, D, t0, G, gs = lay["N"], lay["S"], lay["D"], lay["t0"], lay["G"], self.group_size
        if t0 != packed.config.get("sinks", 0):
            raise CodecError(f"tensor {name!r}: recorded sinks {packed.config.get('sinks')} do not fit shape "
                             f"{list(shape)}")
        out, out_S = _decode_out(packed, out, token_offset, name)
        codes = np.ascontiguousarray(packed.codes, dtype=np.uint8).reshape(-1)
        scales = np.ascontiguousarray(packed.scales, dtype=np.float16)
        if codes.size != lay["codes_nbytes"]:
            raise CodecError(f"tensor {name!r}: expected {lay['codes_nbytes']} bytes of widths, ranges and codes, "
                             f"got {codes.size}")
        if scales.size == int(np.prod(lay["scale_shape"])):
            scales = scales.reshape(lay["scale_shape"])
        if scales.shape != lay["scale_shape"] or not np.isfinite(scales).all() \
                or (scales[..., 0] > scales[..., 1]).any():
            raise CodecError(f"tensor {name!r}: the channel ranges must be finite F16 pairs (lo <= hi) of shape "
                             f"{list(lay['scale_shape'])}; the data is damaged")
        widths = codes[:N * D].reshape(N, D)
        if (widths > _core.W_MAX).any() or widths.sum(dtype=np.int64) != lay["B"] * N:
            raise CodecError(f"tensor {name!r}: the channel widths must be at most {_core.W_MAX} bits and sum to "
                             f"{lay['B'] * N} over its {N} slabs; the data is damaged")
        if G:
            off, slab_off, gbytes = self._offsets(widths, G)
            ch = scales.astype(np.float32)
            status = _core.w_decode(codes[N * D + N * G * D * 2:], codes[N * D:N * D + N * G * D * 2], N, S, D, t0,
                                    gs, np.ascontiguousarray(ch[..., 0]).reshape(-1),
                                    np.ascontiguousarray(ch[..., 1]).reshape(-1), widths.reshape(-1),
                                    self._tops(widths), off.reshape(-1), slab_off, gbytes, raw(out), out_S,
                                    token_offset, DTYPE_NAMES[packed.dtype], resolve_threads(n_threads))
            check_status(status, name, what="decoding")
        if t0:
            if packed.sinks is None or packed.sinks.size != N * t0 * D:
                raise CodecError(f"tensor {name!r}: {t0} exact sink tokens are recorded but their values are missing")
            out.reshape(N, out_S, D)[:, token_offset:token_offset + t0, :] = \
                np.asarray(packed.sinks).astype(out.dtype, copy=False).reshape(N, t0, D)
        return out


def codec_from_config(config: dict):
    """The codec a config describes: :class:`WidthCodec` for ``id`` ``kvcx.widths``, else :class:`IntCodec`."""
    if isinstance(config, dict) and config.get("id") == WidthCodec.codec_id:
        return WidthCodec.from_config(config)
    return IntCodec.from_config(config)


# a readable alias for the 4-bit use
Int4Codec = IntCodec


def decode_packed(packed: Packed, out: Optional[np.ndarray] = None, name: str = "tensor",
                  n_threads: Optional[int] = None, token_offset: int = 0) -> np.ndarray:
    """Decode with the settings recorded in the packed tensor itself.

    ``out`` may be larger along the token axis (-2): the tensor is then written at
    ``out[..., token_offset:token_offset + S, :]`` (used to assemble a KV cache from chunks).
    """
    if isinstance(packed.config, dict) and packed.config.get("id") == WidthCodec.codec_id:
        return WidthCodec.from_config(packed.config)._decode(packed, out, name, n_threads, token_offset)
    codec = IntCodec.from_config(packed.config)
    shape = tuple(packed.shape)
    lay = codec._layout(shape, name)
    N, S, D, t0 = lay["N"], lay["S"], lay["D"], lay["t0"]
    if t0 != packed.config.get("sinks", 0):
        raise CodecError(f"tensor {name!r}: recorded sinks {packed.config.get('sinks')} do not fit shape {list(shape)}")
    out, out_S = _decode_out(packed, out, token_offset, name)
    dtype = out.dtype
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


def _decode_out(packed: Packed, out: Optional[np.ndarray], token_offset: int, name: str) -> tuple:
    """(out, its token count): a new array, or the caller's ``out`` after every check (same shape and
    dtype, or longer on axis -2 with ``token_offset``)."""
    shape = tuple(packed.shape)
    dtype = numpy_dtype(packed.dtype)
    if out is None:
        if token_offset:
            raise CodecError("token_offset needs an out= array")
        return np.empty(shape, dtype=dtype), (shape[-2] if len(shape) >= 2 else 1)
    ok = (isinstance(out, np.ndarray) and out.dtype == dtype and out.ndim == len(shape)
          and out.flags.c_contiguous and out.flags.writeable)
    if ok and token_offset == 0 and tuple(out.shape) == shape:
        return out, (shape[-2] if len(shape) >= 2 else 1)
    if ok and len(shape) >= 2 and out.shape[:-2] == shape[:-2] and out.shape[-1] == shape[-1] \
            and 0 <= token_offset and token_offset + shape[-2] <= out.shape[-2]:
        return out, int(out.shape[-2])
    got = f"{out.dtype} {list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
    raise CodecError(f"tensor {name!r}: out must be a writeable C-contiguous {dtype} array of shape "
                     f"{list(shape)} (or longer on axis -2 with token_offset), got {got}")
