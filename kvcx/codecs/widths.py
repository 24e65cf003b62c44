"""Per-channel bit widths for keys: the ``kvcx.widths`` codec (``--scheme kvcx2w``, docs/FORMAT.md 2.4)."""
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
from kvcx.codecs.dtypes import DTYPE_NAMES, check_float, dtype_name, kernel_dtype, raw
from kvcx.codecs.intcodec import check_group_size
from kvcx.codecs.runtime import check_status, resolve_threads
from kvcx.errors import CodecError

_F16_MAX = float(np.finfo(np.float16).max)
# the error of an endpoint quantizer of w bits relative to one of 0 bits (the range's middle): the range is
# cut into 2^w - 1 steps, so the error falls as 1 / (2^w - 1)^2; one bit buys nothing over the middle
_W_ERR = np.array([1.0] + [1.0 / ((1 << w) - 1) ** 2 for w in range(1, _core.W_MAX + 1)])
# what each channel's k-th bit buys: the first two bits only together (2 bits: 1/9 of the error)
_W_GAIN = np.array([(1.0 - _W_ERR[2]) / 2] * 2 + [_W_ERR[k] - _W_ERR[k + 1] for k in range(2, _core.W_MAX)])


@register_codec
class WidthCodec(Codec):
    """Keys grouped per channel along tokens (as ``IntCodec(axis="channel", scheme="asymmetric")``), each
    channel with its own bit width, chosen per tensor from the data.

    A tensor's widths sum to ``bits * head_dim`` per slab (a KV head), spent where they cut the error most:
    a channel whose values spread widely (or that the queries weigh heavily, with ``weights``) gets more
    bits, a flat one fewer, down to none (it decodes to its group's mean). Groups of ``group_size``
    tokens keep their channel's range as two bytes on a 255-step grid between the channel's FP16 minimum
    and maximum over the tensor, so the ranges cost 16 / group_size bits per value instead of 32 (a channel
    without bits: its range bytes about the group's mean). Codes are stored as bit planes. See docs/FORMAT.md 2.4.

    Parameters
    ----------
    bits: mean bits per code over a slab's channels (``bits * head_dim`` rounded down to whole bits: a multiple of 1/64
        for head_dim 64), more than 0 and at most 8.
    group_size: tokens per group (16, 32, 64, 128 or 256); 32 by default (kvcx2w's: on the embedded model
        groups of 32 at 2 bits beat groups of 64 at 2.25, which cost the same).
    sinks: keep the first ``sinks`` tokens exact.
    n_threads: OpenMP threads (None = all).
    backend: where torch tensors are worked on: None (by the tensor's device: CUDA with the Triton kernels of
        :mod:`kvcx.codecs.gpu_widths`, the same bytes), ``"triton"`` or ``"cpu"``.
    """

    codec_id = "kvcx.widths"
    settings = ("bits", "group_size", "sinks")
    format_version = "3"
    takes_weights = True

    def __init__(self, bits: float = 2.0, group_size: int = 32, sinks: int = 0, n_threads: Optional[int] = None,
                 backend: Optional[str] = None):
        if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, float, np.integer, np.floating)) \
                or not (0 < float(bits) <= _core.W_MAX):
            raise CodecError(f"widths codec: mean bits {bits!r} must be a number in (0, {_core.W_MAX}]")
        self.bits = float(bits)
        self.group_size = check_group_size(group_size)
        self.sinks = check_sinks(sinks)
        self.n_threads = resolve_threads(n_threads) if n_threads is not None else None
        self.backend = check_backend(backend)   # None: by the tensor's device (CUDA: the Triton kernels)

    def bits_per_value(self) -> float:
        """Nominal bits per value: codes + two range bytes per channel group (without sinks, the width table and
        the channels' FP16 ranges, which do not grow with the tokens)."""
        return self.bits + 16 / self.group_size

    def describe(self) -> str:
        return f"{self.bits:g}-bit mean, a width per channel, g{self.group_size} per-channel" + \
            (f" +{self.sinks} sink" if self.sinks else "")

    @property
    def token_block(self) -> int:
        return self.group_size

    def fallback(self):
        """Shapes this codec cannot take (1-D, a last dim not a multiple of 8) get 2-bit asymmetric per-token
        groups of 64 values, without sinks."""
        from kvcx.codecs.intcodec import IntCodec

        return IntCodec(group_size=64, scheme="asymmetric", bits=2, n_threads=self.n_threads)

    # -- layout ------------------------------------------------------------
    def layout(self, shape: tuple, name: str = "tensor") -> Layout:
        shape = tuple(shape)
        check_shape(shape, name)
        if len(shape) < 2:
            raise CodecError(f"tensor {name!r} of shape {list(shape)}: per-channel widths need at least 2 dims "
                             "(tokens x channels)")
        N, S, D = view3(shape)
        if D % 8:
            raise CodecError(f"tensor {name!r}: per-channel widths need the last dim ({D}) to be a multiple of 8; "
                             "use --scheme kvcx2")
        budget = math.floor(self.bits * D + 1e-9)   # whole bits a slab: rounded down (kvcx2v's 2.71875 at D = 80)
        if budget < 1:
            raise CodecError(f"tensor {name!r}: {self.bits} mean bits x {D} channels is less than one bit a slab; "
                             f"use a mean of at least 1/{D}")
        t0 = min(self.sinks, S)
        gs = self.group_size
        G = -(-(S - t0) // gs)
        B = int(round(budget))
        planes = N * G * (gs // 8) * B
        return Layout(shape=tuple(int(s) for s in shape), N=N, S=S, D=D, t0=t0,
                      codes_nbytes=N * D + N * G * D * 2 + planes, scale_shape=(N, D, 2),
                      partial_group=(S - t0) % gs, groups=G, budget=B)

    def _kernel_layout(self, lay: Layout) -> "_core.Layout":
        return _core.Layout(N=lay.N, S=lay.S, D=lay.D, t0=lay.t0, group_size=self.group_size, bits=_core.W_MAX,
                            asym=True, axis=_core.AXIS_CHANNEL, rotate=False)

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
    def encode(self, x, out: Optional[Packed] = None, *, name: str = "tensor",
               weights: Optional[np.ndarray] = None) -> Packed:
        """Quantize ``x``; ``weights`` (heads x head_dim, e.g. the queries' mean square per channel from
        ``kvcx calibrate``) weigh each channel's error when the widths are chosen. ``out``: a Packed from an
        earlier encode of the same shape with this codec; its buffers are reused (and returned, updated). A torch
        tensor on a CUDA device (or with ``backend="triton"``) is encoded by the Triton kernels
        (:mod:`kvcx.codecs.gpu_widths`), to the same bytes."""
        backend = backend_for(self, x, name)
        if backend is not None:
            lay = self.layout(tuple(x.shape), name)
            return backend.encode(self, lay, x, out, name, weights=self.check_weights(weights, lay, name))
        x = check_float(x, name)
        lay = self.layout(x.shape, name)
        N, S, D, t0, G = lay.N, lay.S, lay.D, lay.t0, lay.groups
        threads = resolve_threads(self.n_threads)
        weights = self.check_weights(weights, lay, name)
        if out is None:
            codes = np.empty(lay.codes_nbytes, dtype=np.uint8)
            scales = np.empty(lay.scale_shape, dtype=np.float16)
        else:
            ok = (isinstance(out, Packed) and out.config.get("id") == self.codec_id
                  and all(isinstance(a, np.ndarray) and a.shape == shape and a.dtype == dt and a.flags.c_contiguous
                          and a.flags.writeable for a, shape, dt in ((out.codes, (lay.codes_nbytes,), np.uint8),
                                                                     (out.scales, lay.scale_shape, np.float16))))
            if not ok:
                raise CodecError(f"tensor {name!r}: out must be a Packed from encoding a tensor of shape "
                                 f"{list(x.shape)} with this codec ({lay.codes_nbytes} writeable code bytes, "
                                 f"ranges {list(lay.scale_shape)})")
            codes, scales = out.codes, out.scales
        if t0 and not np.isfinite(x.reshape(N, S, D)[:, :t0, :].astype(np.float32)).all():
            check_status(_core.STATUS_NONFINITE, name, x)
        if G:
            klay = self._kernel_layout(lay)
            mn = np.empty((N, G, D), dtype=np.float32)
            mx = np.empty((N, G, D), dtype=np.float32)
            me = np.empty((N, G, D), dtype=np.float32)
            dt = kernel_dtype(x.dtype)
            status = _core.w_minmax(raw(x), dt, klay, mn.reshape(-1), mx.reshape(-1), me.reshape(-1), threads)
            check_status(status, name, x)
            lo, hi = np.empty((N, D), dtype=np.float32), np.empty((N, D), dtype=np.float32)
            spread = np.empty((N, D), dtype=np.float64)
            _core.w_channels(mn.reshape(-1), mx.reshape(-1), klay, lo.reshape(-1), hi.reshape(-1), spread.reshape(-1),
                             threads)
            lo16, hi16, widths = self.choose(lo, hi, spread, weights, lay, name, lambda: x)
            scales[..., 0], scales[..., 1] = lo16, hi16
            codes[:N * D] = widths.reshape(-1)
            off, slab_off, gbytes = self.plane_offsets(widths, G)
            status = _core.w_encode(raw(x), dt, klay, mn.reshape(-1), mx.reshape(-1), me.reshape(-1),
                                    lo16.astype(np.float32).reshape(-1), hi16.astype(np.float32).reshape(-1),
                                    widths.reshape(-1), self.tops(widths), off.reshape(-1), slab_off, gbytes,
                                    codes[N * D:N * D + N * G * D * 2], codes[N * D + N * G * D * 2:], threads)
            check_status(status, name, x)
        else:
            codes[:], scales[:] = self.no_codes(lay)
        cfg = self.get_config()
        cfg["sinks"] = t0
        fields = dict(codes=codes, scales=scales, zeros=None, sinks=write_sinks(x.reshape(N, S, D), t0, lay.shape, out),
                      shape=lay.shape, dtype=dtype_name(x.dtype), config=cfg,
                      meta={"partial_group": lay.partial_group})
        if out is None:
            return Packed(**fields)
        out.__dict__.update(fields)
        return out

    @staticmethod
    def check_weights(weights, lay: Layout, name: str) -> Optional[np.ndarray]:
        """``weights`` as float64 (heads, D), or None; CodecError unless finite, non-negative and fitting the
        tensor's slabs."""
        if weights is None:
            return None
        weights = np.asarray(weights, dtype=np.float64)
        if weights.ndim != 2 or weights.shape[1] != lay.D or lay.N % weights.shape[0] or \
                not np.isfinite(weights).all() or (weights < 0).any():
            raise CodecError(f"tensor {name!r}: key weights must be finite, non-negative, (heads, {lay.D}) with the "
                             f"tensor's {lay.N} slabs a multiple of heads; got shape {list(weights.shape)}")
        return weights

    def choose(self, lo: np.ndarray, hi: np.ndarray, spread: np.ndarray, weights: Optional[np.ndarray],
               lay: Layout, name: str, host) -> tuple:
        """(the channels' FP16 ranges lo16 / hi16 (N, D), their widths (N, D) uint8) from each channel's min, max
        and spread over its groups (N, D; the kernels' ``w_channels``), on the host for either backend (the same
        widths from the same spreads). ``host()``: the tensor as a NumPy array, asked for only to say what is
        wrong with it."""
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()):   # NaN is sticky in the minima
            check_status(_core.STATUS_NONFINITE, name, host())
        if max(-float(lo.min()), float(hi.max())) > _F16_MAX:
            check_status(_core.STATUS_SCALE_OVERFLOW, name, host())
        lo16, hi16 = lo.astype(np.float16), hi.astype(np.float16)   # rounded outwards: the range covers all
        lo16 = np.where(lo16.astype(np.float32) > lo, np.nextafter(lo16, np.float16(-np.inf)), lo16)
        hi16 = np.where(hi16.astype(np.float32) < hi, np.nextafter(hi16, np.float16(np.inf)), hi16)
        if weights is not None:
            spread = spread * np.tile(weights, (lay.N // weights.shape[0], 1))
        return lo16, hi16, self.allocate(spread, lay.budget)

    @staticmethod
    def no_codes(lay: Layout) -> tuple:
        """(codes, ranges) of a tensor with no quantized tokens (all are sinks): the widths alone, spread evenly so
        that they add up to the budget as the decoder checks (they describe no codes), and zero ranges."""
        even = np.full(lay.D, lay.budget // lay.D, dtype=np.uint8)
        even[:lay.budget % lay.D] += 1
        codes = np.zeros(lay.codes_nbytes, dtype=np.uint8)
        codes[:lay.N * lay.D] = np.tile(even, lay.N)
        return codes, np.zeros(lay.scale_shape, dtype=np.float16)

    @staticmethod
    def tops(widths: np.ndarray) -> np.ndarray:
        """The largest code of each channel, 2^w - 1, as the kernels take it (float32, flat)."""
        return ((1 << widths.astype(np.int32)) - 1).astype(np.float32).reshape(-1)

    def plane_offsets(self, widths: np.ndarray, G: int) -> tuple:
        """(each channel's byte offset inside its group's block (N, D), where each slab's planes start (N),
        each slab's bytes per group (N)), int64."""
        w = widths.astype(np.int64)
        per = self.group_size // 8
        gbytes = w.sum(axis=1) * per
        return (np.cumsum(w, axis=1) - w) * per, np.concatenate([[0], np.cumsum(gbytes * G)[:-1]]), gbytes

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, *, name: str = "tensor",
               token_offset: int = 0) -> np.ndarray:
        lay = self.layout(tuple(packed.shape), name)
        N, D, t0, G = lay.N, lay.D, lay.t0, lay.groups
        check_recorded_sinks(packed, t0, lay.shape, name)
        backend = backend_for(self, packed.codes, name)
        if backend is not None:   # a record of torch tensors on a device (kvcx.codecs.gpu_widths)
            return backend.decode(self, lay, packed, out, token_offset, name)
        out, out_S = decode_out(packed, out, token_offset, name)
        codes = np.ascontiguousarray(packed.codes, dtype=np.uint8).reshape(-1)
        self.check_codes_size(codes.size, lay, name)
        check_sinks_finite(packed, t0, name)
        scales = self.check_header(codes[:N * D], np.ascontiguousarray(packed.scales, dtype=np.float16), lay, name)
        widths = codes[:N * D].reshape(N, D)
        if G:
            off, slab_off, gbytes = self.plane_offsets(widths, G)
            ch = scales.astype(np.float32)
            status = _core.w_decode(codes[N * D + N * G * D * 2:], codes[N * D:N * D + N * G * D * 2],
                                    self._kernel_layout(lay), np.ascontiguousarray(ch[..., 0]).reshape(-1),
                                    np.ascontiguousarray(ch[..., 1]).reshape(-1), widths.reshape(-1),
                                    self.tops(widths), off.reshape(-1), slab_off, gbytes, raw(out), out_S,
                                    token_offset, DTYPE_NAMES[packed.dtype], resolve_threads(self.n_threads))
            check_status(status, name, what="decoding")
        restore_sinks(packed, out, out_S, token_offset, N, t0, D, name)
        return out

    @staticmethod
    def check_codes_size(size: int, lay: Layout, name: str) -> None:
        if size != lay.codes_nbytes:
            raise CodecError(f"tensor {name!r}: expected {lay.codes_nbytes} bytes of widths, ranges and codes, "
                             f"got {size}")

    @staticmethod
    def check_header(widths: np.ndarray, scales: np.ndarray, lay: Layout, name: str) -> np.ndarray:
        """The record's channel ranges (N, D, 2) FP16, after checking them and its widths (N * D bytes) as an
        encoder writes them (finite ranges in order; widths of at most 8 bits summing to the budget); CodecError
        saying the data is damaged otherwise. Both backends check a record here, on the host."""
        if scales.size == int(np.prod(lay.scale_shape)):
            scales = scales.reshape(lay.scale_shape)
        if scales.shape != lay.scale_shape or not np.isfinite(scales).all() \
                or (scales[..., 0] > scales[..., 1]).any():
            raise CodecError(f"tensor {name!r}: the channel ranges must be finite F16 pairs (lo <= hi) of shape "
                             f"{list(lay.scale_shape)}; the data is damaged")
        if (widths > _core.W_MAX).any() or widths.sum(dtype=np.int64) != lay.budget * lay.N:
            raise CodecError(f"tensor {name!r}: the channel widths must be at most {_core.W_MAX} bits and sum to "
                             f"{lay.budget * lay.N} over its {lay.N} slabs; the data is damaged")
        return scales
