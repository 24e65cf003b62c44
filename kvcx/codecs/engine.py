"""Engine KV formats as codecs: the caches people deploy, emulated exactly, so ``kvcx validate`` gates them
beside kvcx's own on the same tokens.

- :class:`GGMLCodec` (``id: "llama.cpp"``): llama.cpp's KV block types ``q8_0``, ``q4_0``, ``q4_1``,
  ``q5_0``, ``q5_1`` (``-ctk`` / ``-ctv``): blocks of 32 values along the head dimension, an FP16 scale
  (and FP16 minimum for the ``_1`` types) per block, quantized as ggml's reference quantizers do (byte for
  byte the blocks of ``gguf.quants.quantize``), and ``iq4_nl``: a 16-entry non-linear codebook times an FP16
  scale per block of 32, written as llama.cpp's KV write does (``quantize_row_iq4_nl_ref``: nearest codes at
  d = max / -127, then the least-squares d; gguf has no quantizer for it, its blocks decode through
  ``gguf.quants.dequantize``). ``rotate=True`` adds the attention rotation llama.cpp applies
  to quantized K/V since PR #21038 (merged 2026-04-01; on by default for quantized cache types, off with
  ``LLAMA_ATTN_ROT_DISABLE=1``, absent from earlier releases): an orthonormal Hadamard transform of each run
  of 64 values of a head for V, and of the largest power of two dividing the head dim for K
  (llama-kv-cache.cpp, build_input_k_rot / build_input_v_rot), undone after attention. Scores and outputs
  are the same as rotating the decoded
  vectors back, which is what this codec does.
- :class:`FP8Codec` (``id: "vllm.fp8"``): vLLM's ``--kv-cache-dtype fp8`` / ``fp8_e5m2``: ``x / scale``
  saturated and rounded to nearest even into float8 e4m3fn or e5m2 (bit for bit torch's float8 casts of
  the clamped values); ``scale=1.0`` as vLLM uses without calibration, or ``scale="amax"``: a calibrated
  per-tensor scale ``amax / fp8_max`` (rounded to FP16, recorded in the record's scales, once per slab).

- :class:`FP4Codec` (``id: "fp4"``): FP4 (E2M1) KV caches. ``mxfp4``: ggml's MXFP4 block (the OCP MX format,
  llama.cpp's type since GPT-OSS): 32 values, an E8M0 exponent, byte for byte the blocks of
  ``gguf.quants.quantize(x, MXFP4)`` (ggml's nearest code, the first on ties; torchao's MX cast rounds ties to
  even instead). ``nvfp4``: TensorRT-LLM's NVFP4 KV cache: 16 values, an E4M3 scale per group, a per-tensor
  scale (``scale=1.0``, or ``"amax"``: ``amax / (448 * 6)`` rounded up to FP16, recorded per slab), byte for
  byte torchao's reference (``nvfp4_quantize`` given the same per-tensor scale). TensorRT-LLM's CUDA kernel
  takes reciprocals with ``rcp.approx``, which a CPU cannot reproduce bit for bit; kvcx follows the
  reference, which divides.

Schemes (``--scheme``): ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``iq4_nl`` (the type alone, as llama.cpp
before the rotation or with it disabled), the same with ``-rot`` (current llama.cpp's default), and
``fp8_e4m3``, ``fp8_e5m2``, ``fp8_e4m3-amax``, ``fp8_e5m2-amax``, ``mxfp4``, ``nvfp4``, ``nvfp4-amax``.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np

from kvcx.codecs.cpu import core as _core
from kvcx.codecs.backends import check_backend
from kvcx.codecs.base import (Codec, Layout, Packed, check_shape, decode_out, finish_packed, out_buffers,
                              register_codec, view3)
from kvcx.codecs.dtypes import DTYPE_NAMES, check_float, dtype_name, kernel_dtype, raw
from kvcx.codecs.runtime import check_status, resolve_threads
from kvcx.errors import CodecError

GGML_TYPES = {"q8_0": _core.GGML_Q8_0, "q4_0": _core.GGML_Q4_0, "q4_1": _core.GGML_Q4_1,
              "q5_0": _core.GGML_Q5_0, "q5_1": _core.GGML_Q5_1, "iq4_nl": _core.GGML_IQ4_NL}
_WITH_MIN = ("q4_1", "q5_1")
FP8_FORMATS = {"e4m3": (_core.FP8_E4M3, 448.0), "e5m2": (_core.FP8_E5M2, 57344.0)}
FP4_FORMATS = {"mxfp4": (_core.FP4_MX, int(_core.MX_QK)), "nvfp4": (_core.FP4_NV, int(_core.NV_QK))}
NV_FP_MAX = 448.0 * 6.0    # E4M3's largest scale times E2M1's largest value
_NO_ZEROS = np.empty(0, dtype=np.float16)
QK = int(_core.QK)
ROTATE_BLOCK = int(_core.ENGINE_ROTATE_BLOCK)
ENGINE_FORMAT_VERSION = "4"
FP4_FORMAT_VERSION = "5"    # an older reader refuses a file with FP4 records ("upgrade kvcx"), never misreads it


def _tensor_scale_setting(scale, what: str):
    """A per-tensor scale setting checked: ``"amax"``, or a positive number exact in FP16 (as a float)."""
    if scale != "amax" and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                and np.isfinite(scale) and scale > 0 and float(np.float16(scale)) == float(scale)):
        raise CodecError(f"{what} scale must be 'amax' or a positive number exact in FP16 (e.g. 1.0), got {scale!r}")
    return scale if scale == "amax" else float(scale)


@register_codec
class GGMLCodec(Codec):
    """llama.cpp's KV cache block types, bit-exact with ggml's reference quantizers.

    Parameters
    ----------
    type: ``"q8_0"``, ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"`` or ``"iq4_nl"``.
    rotate: the Hadamard rotation current llama.cpp applies to quantized K/V (the last dim must be a multiple
        of 64; llama.cpp turns it off otherwise, see :meth:`fallback`): ``True`` rotates each run of 64 values
        (llama.cpp's rule for V), ``"key"`` each run of the largest power of two that divides the last dim
        (llama.cpp's rule for K: 64 for heads of 64, 128 for heads of 128). ``False``: none.
    n_threads: OpenMP threads (None = all).
    """

    codec_id = "llama.cpp"
    settings = ("type", "rotate")
    format_version = ENGINE_FORMAT_VERSION

    def __init__(self, type: str = "q4_0", rotate: Union[bool, str] = False, n_threads: Optional[int] = None,
                 backend: Optional[str] = None):
        if type not in GGML_TYPES:
            raise CodecError(f"llama.cpp KV type {type!r} is not one kvcx emulates; use one of "
                             f"{', '.join(GGML_TYPES)}")
        if not (isinstance(rotate, (bool, np.bool_)) or rotate == "key"):
            raise CodecError(f"rotate must be false, true (runs of 64: llama.cpp's V) or 'key' (runs of the largest "
                             f"power of two dividing the head dim: llama.cpp's K), got {rotate!r}")
        self.type, self.rotate = type, (rotate if rotate == "key" else bool(rotate))
        self.n_threads = resolve_threads(n_threads) if n_threads is not None else None
        self.backend = check_backend(backend)   # no backend but the CPU kernels is registered for it

    @property
    def has_zeros(self) -> bool:
        return self.type in _WITH_MIN      # the FP16 block minimum m travels as the record's zeros

    def bits_per_value(self) -> float:
        """Bits per value of llama.cpp's block: codes, FP16 d, FP16 m for the _1 types (q4_0: 4.5)."""
        return 8.0 * (int(_core.ggml_qbytes(GGML_TYPES[self.type])) + (4 if self.has_zeros else 2)) / QK

    def describe(self) -> str:
        return f"llama.cpp {self.type}" + (" +rotation" if self.rotate else "") + (" (K rule)" if self.rotate == "key"
                                                                                  else "")

    def rotation_size(self, D: int) -> int:
        """Values per Hadamard run for a last dim of D (0: no rotation)."""
        if not self.rotate:
            return 0
        n = ROTATE_BLOCK
        while self.rotate == "key" and D % (2 * n) == 0:
            n *= 2
        return n

    def fallback(self) -> "GGMLCodec":
        """Without the rotation (llama.cpp runs unrotated where the head does not fit its blocks of 64)."""
        return GGMLCodec(self.type, False, self.n_threads) if self.rotate else self

    def layout(self, shape: tuple, name: str = "tensor") -> Layout:
        shape = tuple(shape)
        check_shape(shape, name)
        N, S, D = view3(shape)
        if D % QK:
            raise CodecError(f"tensor {name!r}: llama.cpp's {self.type} blocks hold {QK} values of the last dim, "
                             f"which is {D}; use a kvcx scheme for this tensor")
        if self.rotate and D % ROTATE_BLOCK:
            raise CodecError(f"tensor {name!r}: llama.cpp's rotation runs over {ROTATE_BLOCK} values of the last "
                             f"dim, which is {D}; use scheme {self.type!r} (llama.cpp runs unrotated here)")
        blocks = N * S * D // QK
        return Layout(shape=tuple(int(s) for s in shape), N=N, S=S, D=D, t0=0,
                      codes_nbytes=blocks * int(_core.ggml_qbytes(GGML_TYPES[self.type])), scale_shape=(blocks,),
                      partial_group=0)

    def encode(self, x, out: Optional[Packed] = None, *, name: str = "tensor",
               weights: Optional[np.ndarray] = None) -> Packed:
        if weights is not None:
            raise CodecError(f"tensor {name!r}: llama.cpp's types take no key weights")
        x = check_float(x, name)
        lay = self.layout(x.shape, name)
        shapes = {"codes": ((lay.codes_nbytes,), np.uint8), "scales": (lay.scale_shape, np.float16)}
        if self.has_zeros:
            shapes["zeros"] = (lay.scale_shape, np.float16)
        buf = out_buffers(out, shapes, name, x.shape)
        zeros = buf.get("zeros", _NO_ZEROS)
        status = _core.ggml_encode(raw(x), kernel_dtype(x.dtype), lay.N * lay.S, lay.D, GGML_TYPES[self.type],
                                   self.rotation_size(lay.D), buf["codes"], buf["scales"].view(np.uint16),
                                   zeros.view(np.uint16), resolve_threads(self.n_threads))
        check_status(status, name, x)
        return finish_packed(out, dict(codes=buf["codes"], scales=buf["scales"], zeros=buf.get("zeros"), sinks=None,
                                       shape=lay.shape, dtype=dtype_name(x.dtype), config=self.get_config(), meta={}))

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, *, name: str = "tensor",
               token_offset: int = 0) -> np.ndarray:
        lay = self.layout(tuple(packed.shape), name)
        out, out_S = decode_out(packed, out, token_offset, name)
        codes = np.ascontiguousarray(packed.codes, dtype=np.uint8).reshape(-1)
        scales = np.ascontiguousarray(packed.scales, dtype=np.float16).reshape(-1)
        if codes.size != lay.codes_nbytes or scales.size != lay.scale_shape[0]:
            raise CodecError(f"tensor {name!r}: expected {lay.codes_nbytes} code bytes and {lay.scale_shape[0]} "
                             f"scales, got {codes.size} and {scales.size}")
        zeros = _NO_ZEROS
        if self.has_zeros:
            if packed.zeros is None or packed.zeros.size != scales.size:
                raise CodecError(f"tensor {name!r}: {self.type} needs {scales.size} block minimums")
            zeros = np.ascontiguousarray(packed.zeros, dtype=np.float16).reshape(-1)
        if not (np.isfinite(scales).all() and np.isfinite(zeros).all()):
            raise CodecError(f"tensor {name!r}: its block scales hold NaN/Inf, which the quantizer never writes; "
                             "the data is damaged: encode it again")
        status = _core.ggml_decode(codes, scales.view(np.uint16), zeros.view(np.uint16), lay.N * lay.S, lay.S,
                                   lay.D, GGML_TYPES[self.type], self.rotation_size(lay.D), raw(out), out_S,
                                   token_offset, DTYPE_NAMES[packed.dtype], resolve_threads(self.n_threads))
        check_status(status, name, what="decoding")
        return out


@register_codec
class FP8Codec(Codec):
    """vLLM's fp8 KV cache: one scale per tensor, values cast to float8 e4m3fn or e5m2 with saturation.

    Parameters
    ----------
    format: ``"e4m3"`` (vLLM ``--kv-cache-dtype fp8`` / ``fp8_e4m3``) or ``"e5m2"``.
    scale: ``1.0`` (vLLM without calibrated scales) or another positive number, or ``"amax"``: per tensor
        ``fp16(amax / fp8_max)`` (a calibrated scale, recorded with the tensor).
    n_threads: OpenMP threads (None = all).
    """

    codec_id = "vllm.fp8"
    settings = ("format", "scale")
    format_version = ENGINE_FORMAT_VERSION

    def __init__(self, format: str = "e4m3", scale: Union[float, str] = 1.0, n_threads: Optional[int] = None,
                 backend: Optional[str] = None):
        if format not in FP8_FORMATS:
            raise CodecError(f"fp8 format {format!r} is not one vLLM uses; use 'e4m3' or 'e5m2'")
        self.format = format
        self.scale = _tensor_scale_setting(scale, "fp8")
        self.n_threads = resolve_threads(n_threads) if n_threads is not None else None
        self.backend = check_backend(backend)   # no backend but the CPU kernels is registered for it

    def bits_per_value(self) -> float:
        return 8.0

    def describe(self) -> str:
        return f"vLLM fp8 {self.format}" + (" calibrated scale" if self.scale == "amax" else
                                           f" scale {self.scale:g}")

    def layout(self, shape: tuple, name: str = "tensor") -> Layout:
        shape = tuple(shape)
        check_shape(shape, name)
        N, S, D = view3(shape)
        # one scale per tensor, repeated per slab (N: batch x heads) so a record splits by slab like the others
        return Layout(shape=tuple(int(s) for s in shape), N=N, S=S, D=D, t0=0, codes_nbytes=N * S * D,
                      scale_shape=(N,), partial_group=0)

    def encode(self, x, out: Optional[Packed] = None, *, name: str = "tensor",
               weights: Optional[np.ndarray] = None) -> Packed:
        if weights is not None:
            raise CodecError(f"tensor {name!r}: fp8 takes no key weights")
        x = check_float(x, name)
        lay = self.layout(x.shape, name)
        buf = out_buffers(out, {"codes": ((lay.codes_nbytes,), np.uint8), "scales": (lay.scale_shape, np.float16)},
                          name, x.shape)
        fmt, top = FP8_FORMATS[self.format]
        if self.scale == "amax":
            amax = float(np.max(np.abs(x.astype(np.float32, copy=False)))) if x.size else 0.0
            if not np.isfinite(amax):
                check_status(_core.STATUS_NONFINITE, name, x)
            s = np.float16(max(amax / top, 2.0 ** -14)) if amax > 0 else np.float16(1.0)
            if not np.isfinite(s):
                check_status(_core.STATUS_SCALE_OVERFLOW, name, x)
        else:
            s = np.float16(self.scale)
        buf["scales"][...] = s
        status = _core.fp8_encode(raw(x), kernel_dtype(x.dtype), lay.N * lay.S, lay.D, fmt, float(s), buf["codes"],
                                  resolve_threads(self.n_threads))
        check_status(status, name, x)
        return finish_packed(out, dict(codes=buf["codes"], scales=buf["scales"], zeros=None, sinks=None,
                                       shape=lay.shape, dtype=dtype_name(x.dtype), config=self.get_config(), meta={}))

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, *, name: str = "tensor",
               token_offset: int = 0) -> np.ndarray:
        lay = self.layout(tuple(packed.shape), name)
        out, out_S = decode_out(packed, out, token_offset, name)
        codes = np.ascontiguousarray(packed.codes, dtype=np.uint8).reshape(-1)
        scales = np.asarray(packed.scales, dtype=np.float16).reshape(-1)
        if codes.size != lay.codes_nbytes or scales.size != lay.N:
            raise CodecError(f"tensor {name!r}: expected {lay.codes_nbytes} fp8 codes and {lay.N} scales, got "
                             f"{codes.size} and {scales.size}")
        s = float(scales[0])
        if not (scales == scales[0]).all():
            raise CodecError(f"tensor {name!r}: its fp8 scales differ between slabs, which the encoder never writes "
                             "(one scale per tensor); the data is damaged: encode it again")
        fmt, _ = FP8_FORMATS[self.format]
        # codes a saturating cast never writes: e4m3fn NaN (S.1111.111), e5m2 Inf/NaN (exponent all ones)
        never = (codes & 0x7F) == 0x7F if self.format == "e4m3" else (codes & 0x7C) == 0x7C
        if not (np.isfinite(s) and s > 0) or never.any():
            raise CodecError(f"tensor {name!r}: its fp8 codes or scale hold NaN/Inf, which vLLM's saturating cast "
                             "never writes; the data is damaged: encode it again")
        status = _core.fp8_decode(codes, lay.N * lay.S, lay.S, lay.D, fmt, s, raw(out), out_S, token_offset,
                                  DTYPE_NAMES[packed.dtype], resolve_threads(self.n_threads))
        check_status(status, name, what="decoding")
        return out


def _fp16_at_least(v: float) -> np.float16:
    """The smallest FP16 number not below v (v positive and below 65504)."""
    h = np.float16(v)
    return h if float(h) >= v else np.nextafter(h, np.float16(np.inf))


@register_codec
class FP4Codec(Codec):
    """FP4 (E2M1) KV caches: ggml's MXFP4 blocks and TensorRT-LLM's NVFP4, byte for byte their references.

    Parameters
    ----------
    format: ``"mxfp4"`` (32 values and an E8M0 exponent a block: 4.25 bits/value) or ``"nvfp4"`` (16 values
        and an E4M3 scale a group, and a per-tensor scale: 4.5 bits/value).
    scale: nvfp4's per-tensor scale: ``1.0`` (an engine without a calibrated scale) or another positive number
        exact in FP16, or ``"amax"``: per tensor ``amax / (448 * 6)`` rounded up to FP16 (calibrated: the
        groups' scales then use E4M3's whole range). mxfp4 takes none (1.0).
    n_threads: OpenMP threads (None = all).
    """

    codec_id = "fp4"
    settings = ("format", "scale")
    format_version = FP4_FORMAT_VERSION

    def __init__(self, format: str = "nvfp4", scale: Union[float, str] = 1.0, n_threads: Optional[int] = None,
                 backend: Optional[str] = None):
        if format not in FP4_FORMATS:
            raise CodecError(f"fp4 format {format!r} is not one kvcx emulates; use 'mxfp4' or 'nvfp4'")
        scale = _tensor_scale_setting(scale, "fp4")
        if format == "mxfp4" and scale != 1.0:
            raise CodecError(f"mxfp4 has no per-tensor scale (its E8M0 block exponents cover any range); "
                             f"leave scale at 1.0, got {scale!r}")
        self.format, self.scale = format, scale
        self.n_threads = resolve_threads(n_threads) if n_threads is not None else None
        self.backend = check_backend(backend)   # no backend but the CPU kernels is registered for it

    @property
    def group(self) -> int:
        return FP4_FORMATS[self.format][1]

    def bits_per_value(self) -> float:
        """4 bits a code and 8 a group's scale (the per-tensor scale, two bytes a slab, not counted)."""
        return 4.0 + 8.0 / self.group

    def describe(self) -> str:
        if self.format == "mxfp4":
            return "MXFP4 (ggml): E2M1, an E8M0 exponent per 32"
        return "NVFP4: E2M1, an E4M3 scale per 16, " + ("a calibrated per-tensor scale" if self.scale == "amax"
                                                        else f"per-tensor scale {self.scale:g}")

    def layout(self, shape: tuple, name: str = "tensor") -> Layout:
        shape = tuple(shape)
        check_shape(shape, name)
        N, S, D = view3(shape)
        if D % self.group:
            raise CodecError(f"tensor {name!r}: {self.format} groups hold {self.group} values of the last dim, which "
                             f"is {D}; use a kvcx scheme for this tensor")
        n = N * S * D
        nbytes = n // self.group * (self.group // 2 + 1)
        return Layout(shape=tuple(int(s) for s in shape), N=N, S=S, D=D, t0=0, codes_nbytes=nbytes,
                      scale_shape=(N,) if self.format == "nvfp4" else (0,), partial_group=0)

    def _tensor_scale(self, x: np.ndarray, name: str) -> np.float16:
        if self.scale != "amax":
            return np.float16(self.scale)
        amax = float(np.max(np.abs(x.astype(np.float32, copy=False))))
        if not np.isfinite(amax):
            check_status(_core.STATUS_NONFINITE, name, x)
        if amax == 0:
            return np.float16(1.0)
        if amax / NV_FP_MAX > 65504.0:      # the per-tensor scale is recorded in FP16
            check_status(_core.STATUS_SCALE_OVERFLOW, name, x)
        return _fp16_at_least(max(amax / NV_FP_MAX, 2.0 ** -14))

    def encode(self, x, out: Optional[Packed] = None, *, name: str = "tensor",
               weights: Optional[np.ndarray] = None) -> Packed:
        if weights is not None:
            raise CodecError(f"tensor {name!r}: {self.format} takes no key weights")
        x = check_float(x, name)
        lay = self.layout(x.shape, name)
        buf = out_buffers(out, {"codes": ((lay.codes_nbytes,), np.uint8), "scales": (lay.scale_shape, np.float16)},
                          name, x.shape)
        p = self._tensor_scale(x, name) if self.format == "nvfp4" else np.float16(1.0)
        buf["scales"][...] = p
        status = _core.fp4_encode(raw(x), kernel_dtype(x.dtype), lay.N * lay.S, lay.D, FP4_FORMATS[self.format][0],
                                  float(p), buf["codes"], resolve_threads(self.n_threads))
        if status == _core.STATUS_SCALE_OVERFLOW:
            amax = float(np.max(np.abs(x.astype(np.float32, copy=False))))
            raise CodecError(f"tensor {name!r}: a group's NVFP4 scale (its |x| max / 6 / the per-tensor scale "
                             f"{float(p):g}) passes E4M3's 448 (|x| up to {amax:.4g}, the most this scale holds is "
                             f"{NV_FP_MAX * float(p):g}); use scheme 'nvfp4-amax' (a per-tensor scale from the "
                             "tensor's amax) or a larger scale")
        check_status(status, name, x)
        return finish_packed(out, dict(codes=buf["codes"], scales=buf["scales"], zeros=None, sinks=None,
                                       shape=lay.shape, dtype=dtype_name(x.dtype), config=self.get_config(), meta={}))

    def decode(self, packed: Packed, out: Optional[np.ndarray] = None, *, name: str = "tensor",
               token_offset: int = 0) -> np.ndarray:
        lay = self.layout(tuple(packed.shape), name)
        out, out_S = decode_out(packed, out, token_offset, name)
        codes = np.ascontiguousarray(packed.codes, dtype=np.uint8).reshape(-1)
        scales = np.asarray(packed.scales, dtype=np.float16).reshape(-1)
        if codes.size != lay.codes_nbytes or scales.size != lay.scale_shape[0]:
            raise CodecError(f"tensor {name!r}: expected {lay.codes_nbytes} {self.format} code bytes and "
                             f"{lay.scale_shape[0]} per-tensor scales, got {codes.size} and {scales.size}")
        p = float(scales[0]) if scales.size else 1.0
        if scales.size and not ((scales == scales[0]).all() and np.isfinite(p) and p > 0):
            raise CodecError(f"tensor {name!r}: its NVFP4 per-tensor scales are not one positive finite number, "
                             "which the encoder always writes; the data is damaged: encode it again")
        status = _core.fp4_decode(codes, lay.N * lay.S, lay.S, lay.D, FP4_FORMATS[self.format][0], p, raw(out), out_S,
                                  token_offset, DTYPE_NAMES[packed.dtype], resolve_threads(self.n_threads))
        if status & _core.STATUS_CORRUPT:
            raise CodecError(f"tensor {name!r}: its {self.format} scales hold bytes the encoder never writes (a NaN, "
                             "negative or below-range scale); the data is damaged: encode it again")
        check_status(status, name, what="decoding")
        return out
