"""Vector quantization on a lattice, without calibration: the ``kvcx.e8p`` codec (docs/FORMAT.md 2.8).

Each token of a head (a row of D values) is rotated by the orthonormal Walsh-Hadamard transform (which spreads an
outlier channel over all of them, so the rotated row is close to Gaussian whatever the model), scaled by its RMS and
quantized 8 values at a time to the nearest point of QuIP#'s E8P codebook (Tseng et al., 2024): 2^16 points of the
E8 lattice shifted by 1/4, a 16-bit code per 8 values. A row is ``D / 8`` codes and an FP16 scale: 2 + 16 / D bits a
value (2.25 at a head dim of 64), every byte counted. At the same bits a lattice packs more points into the ball
the rotated rows fill than a per-value grid does: E8P's error on Gaussian data is about 0.09 of the variance against
about 0.12 for the best 2-bit scalar quantizer (Lloyd-Max) and 0.19 for a min/max grid.

The record's scale is the search's times 1.09 (``KVCX_E8P_GAIN``): the nearest point at the scale of least error is
8 % short along the row, and an attention row sums many tokens' values, whose independent errors average out but
whose common shrinkage does not; unbiased along the row, the error is 0.097 of the variance and kvcx2v's KLD on the
held-out windows falls by a sixth (docs/results/low-bits.md).

The search is exact (kernels: e8p.h): for each of the two shifts and each of the 256 sign-free patterns, every
coordinate's sign is matched to the row's, and where that would negate an odd number of coordinates (the codebook
holds only even ones) the coordinate that costs least goes back.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kvcx.codecs.backends import backend_for, check_backend
from kvcx.codecs.base import (Codec, Layout, Packed, check_recorded_sinks, check_shape, check_sinks,
                              check_sinks_finite, decode_out, finish_packed, out_buffers, register_codec,
                              restore_sinks, view3, write_sinks)
from kvcx.codecs.cpu import core as _core
from kvcx.codecs.dtypes import DTYPE_NAMES, check_float, dtype_name, kernel_dtype, raw
from kvcx.codecs.runtime import check_status, resolve_threads
from kvcx.errors import CodecError

E8P_FORMAT_VERSION = "7"   # an older reader refuses a file with E8P records ("upgrade kvcx")


def e8p_grid() -> np.ndarray:
    """The codebook's 256 signed patterns, twice their values (int8, 256 x 8), as the kernels hold them."""
    return _core.e8p_grid()


def scale_overflow(name: str, top: float) -> CodecError:
    """The error for a row whose scale passes FP16 (the record holds it in FP16); ``top``: the tensor's max |x|."""
    return CodecError(f"tensor {name!r}: a row's scale passes FP16, which the E8P record holds it in (|x| up to "
                      f"{top:.4g}); rescale the tensor or use scheme 'kvcx'")


def damaged(name: str) -> CodecError:
    """The error for a record whose scale no encoder writes (NaN/Inf or negative)."""
    return CodecError(f"tensor {name!r}: its E8P records hold a scale the encoder never writes (NaN/Inf or "
                      "negative); the data is damaged: encode it again")


def e8p_points(codes: np.ndarray) -> np.ndarray:
    """The codebook points (float32, [..., 8]) of 16-bit codes, decoded in numpy from the format's definition
    (docs/FORMAT.md 2.8): pattern ``code & 0xFF`` halved, coordinate i < 7 negated where bit 8 + i is set, coordinate 7
    where bits 8-14 hold an odd count, then +1/4 (bit 15 clear) or -1/4."""
    codes = np.asarray(codes, dtype=np.uint16)
    pattern = e8p_grid()[codes & 0xFF].astype(np.float32) / 2
    signs = (codes[..., None] >> (8 + np.arange(7, dtype=np.uint16))) & 1
    signs = np.concatenate([signs, signs.sum(-1, keepdims=True) & 1], -1)
    shift = np.where((codes >> 15) & 1, -0.25, 0.25).astype(np.float32)
    return np.where(signs == 1, -pattern, pattern) + shift[..., None]


@register_codec
class E8PCodec(Codec):
    """Each row (a token of one head) rotated by the Hadamard transform and quantized to QuIP#'s E8P lattice
    codebook, 8 values a 16-bit code, with the row's FP16 scale: 2 + 16 / head_dim bits a value.

    Parameters
    ----------
    sinks: keep the first ``sinks`` tokens of each slab exact (the attention sink).
    n_threads: OpenMP threads (None = all).
    """

    codec_id = "kvcx.e8p"
    bits = 2   # code bits a value (a 16-bit code per 8 values), as an integer codec's bits: a plan's selection of it
    settings = ("sinks",)
    format_version = E8P_FORMAT_VERSION

    def __init__(self, sinks: int = 0, n_threads: Optional[int] = None, backend: Optional[str] = None):
        self.sinks = check_sinks(sinks)
        self.n_threads = resolve_threads(n_threads) if n_threads is not None else None
        self.backend = check_backend(backend)   # None: by the tensor's device (CUDA: the Triton kernels)

    @staticmethod
    def record_bytes(D: int) -> int:
        """Bytes of one row: D / 8 codes of two bytes, then the FP16 scale."""
        return D // 4 + 2

    def bits_per_value(self, head_dim: int = 64) -> float:
        """Bits per value counted whole (codes and scale) at ``head_dim``, without the exact sink tokens."""
        return 8.0 * self.record_bytes(head_dim) / head_dim

    def describe(self) -> str:
        return "Hadamard + E8P lattice (2 bits, 16-bit codes per 8 values), FP16 scale per token" + (
            f" +{self.sinks} sink" if self.sinks else "")

    def fallback(self):
        """Shapes this codec cannot take (a last dim that is not a power of two from 8) get 2-bit asymmetric
        per-token groups of 64 values, without sinks."""
        from kvcx.codecs.intcodec import IntCodec

        return IntCodec(group_size=64, scheme="asymmetric", bits=2, n_threads=self.n_threads)

    def layout(self, shape: tuple, name: str = "tensor") -> Layout:
        shape = tuple(shape)
        check_shape(shape, name)
        N, S, D = view3(shape)
        if D < 8 or D & (D - 1):
            raise CodecError(f"tensor {name!r}: the E8P codec rotates each row by a Hadamard matrix of its last dim, "
                             f"a power of two from 8, and the last dim is {D}; use scheme 'kvcx' for this tensor")
        t0 = min(self.sinks, S)
        return Layout(shape=tuple(int(s) for s in shape), N=N, S=S, D=D, t0=t0,
                      codes_nbytes=N * (S - t0) * self.record_bytes(D), scale_shape=(0,), partial_group=0)

    def encode(self, x, out: Optional[Packed] = None, *, name: str = "tensor",
               weights: Optional[np.ndarray] = None) -> Packed:
        if weights is not None:
            raise CodecError(f"tensor {name!r}: the E8P codec takes no key weights (they choose per-channel widths: "
                             "scheme 'kvcx2w')")
        backend = backend_for(self, x, name)
        if backend is not None:   # a torch tensor to a device backend (kvcx.codecs.gpu_lattice)
            return backend.encode(self, self.layout(tuple(x.shape), name), x, out, name)
        x = check_float(x, name)
        lay = self.layout(x.shape, name)
        N, S, D, t0 = lay.N, lay.S, lay.D, lay.t0
        codes = out_buffers(out, {"codes": ((lay.codes_nbytes,), np.uint8)}, name, x.shape)["codes"]
        if t0 and not np.isfinite(x.reshape(N, S, D)[:, :t0, :].astype(np.float32)).all():
            check_status(_core.STATUS_NONFINITE, name, x)
        status = _core.e8p_encode(raw(x), kernel_dtype(x.dtype), N, S, t0, D, codes, resolve_threads(self.n_threads))
        if status == _core.STATUS_SCALE_OVERFLOW:
            raise scale_overflow(name, float(np.max(np.abs(x.astype(np.float32)))))
        check_status(status, name, x)
        cfg = self.get_config()
        cfg["sinks"] = t0
        return finish_packed(out, dict(codes=codes, scales=np.empty(0, dtype=np.float16), zeros=None,
                                       sinks=write_sinks(x.reshape(N, S, D), t0, lay.shape, out), shape=lay.shape,
                                       dtype=dtype_name(x.dtype), config=cfg, meta={}))

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, *, name: str = "tensor",
               token_offset: int = 0) -> np.ndarray:
        lay = self.layout(tuple(packed.shape), name)
        N, S, D, t0 = lay.N, lay.S, lay.D, lay.t0
        check_recorded_sinks(packed, t0, lay.shape, name)
        backend = backend_for(self, packed.codes, name)
        if backend is not None:
            return backend.decode(self, lay, packed, out, token_offset, name)
        out, out_S = decode_out(packed, out, token_offset, name)
        codes = np.ascontiguousarray(packed.codes, dtype=np.uint8).reshape(-1)
        if codes.size != lay.codes_nbytes:
            raise CodecError(f"tensor {name!r}: expected {lay.codes_nbytes} E8P record bytes "
                             f"({self.record_bytes(D)} a token and head), got {codes.size}")
        check_sinks_finite(packed, t0, name)
        status = _core.e8p_decode(codes, N, S, t0, D, raw(out), out_S, token_offset, DTYPE_NAMES[packed.dtype],
                                  resolve_threads(self.n_threads))
        if status & _core.STATUS_CORRUPT:
            raise damaged(name)
        check_status(status, name, what="decoding")
        restore_sinks(packed, out, out_S, token_offset, N, t0, D, name)
        return out
