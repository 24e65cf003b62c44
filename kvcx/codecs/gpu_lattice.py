"""The lattice codec (``kvcx.e8p``) on torch tensors through Triton kernels
(:mod:`kvcx.codecs.triton_kernels.lattice`): checks, allocation, launches and errors, as :mod:`kvcx.codecs.lattice`
does for the CPU kernels. A CUDA tensor reaches this backend by itself (``E8PCodec().encode(x_cuda)``);
``E8PCodec(backend="triton")`` forces it for a tensor on any device (Triton's interpreter, ``TRITON_INTERPRET=1``,
runs it on CPU tensors). Its records hold torch tensors on the input's device with **the bytes the CPU kernels
write** for the same input, and it decodes a record to the CPU's values bit for bit: records move between NumPy and a
device unchanged (:func:`kvcx.codecs.gpu.to_host`, :func:`kvcx.codecs.gpu.to_device`).

The fused attention on the GPU does not read E8P records (:func:`kvcx.codecs.gpu_attn.reads`): a ``KvcxCache`` with
E8P values keeps its records on the device and decodes them there each step
(:class:`kvcx.cache.device_store.DeviceChunkKV`; ``memory_report()`` says so). torch and triton are imported when
first used.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from kvcx.codecs import tensors
from kvcx.codecs.backends import is_tensor, register_backend
from kvcx.codecs.base import Packed, check_sinks_finite
from kvcx.codecs.cpu import core as _core
from kvcx.codecs.gpu import CODEC_WARPS, TritonBackend, as_bits, device_input, device_output
from kvcx.codecs.gpu_attn import interpreting
from kvcx.codecs.lattice import damaged, e8p_grid, scale_overflow
from kvcx.codecs.runtime import check_status
from kvcx.codecs.tensors import triton_kernels
from kvcx.deps import import_torch as _torch
from kvcx.errors import CodecError

PROGRAM_VALUES = 2048   # values a program of the scale and decode kernels holds (whole rows)
SEARCH_VECTORS = 16     # 8-value vectors a program of the search holds: 16 x 256 scores, two FP32 tiles of them
# ... and in Triton's interpreter (no registers to spare; its time is a NumPy call an operation, so fewer, larger
# programs: a test's encode 8x faster). Each vector is searched alone: the bytes do not depend on it
INTERPRETER_SEARCH_VECTORS = 256


def lattice_kernels():
    """The E8P Triton kernels; a CodecError naming the extra without triton."""
    return triton_kernels("lattice")


@functools.lru_cache(maxsize=None)
def _host_tables() -> tuple:
    """The search's tables as e8p.h fills them (kvcx_e8p_init), from the codebook the kernels hold: each pattern's
    absolute values by coordinate (8 x 256), its norm, the parity of its negative coordinates; and the patterns
    twice (int8, 256 x 8), which the decode reads."""
    grid = e8p_grid()
    half = grid.astype(np.float32) / 2
    norm2 = np.zeros(grid.shape[0], dtype=np.float32)
    for i in range(8):   # in the kernel's order (exact: quarters)
        norm2 += half[:, i] * half[:, i]
    negpar = ((half < 0).sum(1) & 1).astype(np.int32)
    return np.ascontiguousarray(np.abs(half).T), norm2, negpar, np.ascontiguousarray(grid.reshape(-1))


def _tables(device) -> tuple:
    return _device_tables(str(device))


@functools.lru_cache(maxsize=None)
def _device_tables(device: str) -> tuple:
    torch = _torch()
    return tuple(torch.from_numpy(a).to(device) for a in _host_tables())


def program_rows(D: int) -> int:
    """Rows a program of the scale and decode kernels: whole rows, about :data:`PROGRAM_VALUES` values."""
    return max(1, PROGRAM_VALUES // D)


@register_backend("kvcx.e8p", "triton")
class TritonE8PBackend(TritonBackend):
    """:class:`~kvcx.codecs.lattice.E8PCodec`'s encode and decode in Triton."""

    def encode(self, codec, lay, x, out: Optional[Packed], name: str) -> Packed:
        torch = _torch()
        k = lattice_kernels()   # triton is installed, or a CodecError before any work
        x, dt = device_input(x, out, name)
        N, S, D, t0 = lay.N, lay.S, lay.D, lay.t0
        dev, rows = x.device, N * (S - t0)
        x3 = x.view(N, S, D)
        codes = torch.empty(lay.codes_nbytes, dtype=torch.uint8, device=dev)
        sinks = x3[:, :t0, :].reshape(*lay.shape[:-2], t0, D).clone() if t0 else None
        flag = torch.zeros(2, dtype=torch.int32, device=dev)   # [non-finite values, a scale past FP16]
        if rows:
            y = torch.empty((rows, D), dtype=torch.float32, device=dev)
            R = program_rows(D)
            k.e8p_scale_kernel[(-(-rows // R),)](x3, y, codes, flag, S, t0, rows, tensors.norm_of(D),
                                                 float(_core.E8P_RMS), float(_core.E8P_GAIN), D=D, R=R,
                                                 enable_fp_fusion=False,
                                                 num_warps=CODEC_WARPS)
            nvec, V = rows * (D // 8), INTERPRETER_SEARCH_VECTORS if interpreting() else SEARCH_VECTORS
            k.e8p_search_kernel[(-(-nvec // V),)](y, codes, *_tables(dev), nvec, D=D, V=V, enable_fp_fusion=False,
                                                  num_warps=CODEC_WARPS)
        nonfinite, overflow = flag.tolist()
        if nonfinite or (t0 and not bool(sinks.isfinite().all())):   # copied to the host only to say where
            check_status(_core.STATUS_NONFINITE, name, x.float().cpu().numpy())
        if overflow:
            raise scale_overflow(name, float(x.abs().max()))
        cfg = codec.get_config()
        cfg["sinks"] = t0
        return Packed(codes=codes, scales=torch.empty(0, dtype=torch.float16, device=dev), zeros=None, sinks=sinks,
                      shape=lay.shape, dtype=dt, config=cfg, meta={})

    @staticmethod
    def _checked(codec, lay, packed: Packed, name: str):
        """The record's codes, after the checks that need no kernel."""
        torch = _torch()
        lattice_kernels()
        N, D, t0 = lay.N, lay.D, lay.t0
        codes = packed.codes
        if codes.dtype != torch.uint8 or codes.numel() != lay.codes_nbytes:
            raise CodecError(f"tensor {name!r}: expected {lay.codes_nbytes} E8P record bytes "
                             f"({codec.record_bytes(D)} a token and head), got {codes.numel()} {codes.dtype}")
        if t0 and (packed.sinks is None or not is_tensor(packed.sinks) or packed.sinks.numel() != N * t0 * D):
            raise CodecError(f"tensor {name!r}: {t0} exact sink tokens are recorded but their values are missing")
        check_sinks_finite(packed, t0, name)
        return codes.contiguous()

    @staticmethod
    def _launch(lay, packed: Packed, codes, out, token_offset: int, flag, name: str):
        """The decode kernel into ``out`` (:func:`device_output`'s checks), its check into ``flag``; the sinks
        copied. Returns ``out``."""
        k = lattice_kernels()
        N, S, D, t0 = lay.N, lay.S, lay.D, lay.t0
        dev = codes.device
        out, out3 = device_output(lay, packed.dtype, out, token_offset, dev, name)
        rows = N * (S - t0)
        if rows:
            R = program_rows(D)
            dst = as_bits(out3, packed.dtype) if packed.dtype == "BF16" else out3
            k.e8p_decode_kernel[(-(-rows // R),)](codes, dst, flag, _tables(dev)[3], rows, S - t0, out3.shape[1],
                                                  token_offset + t0, tensors.norm_of(D), D=D, R=R,
                                                  SAT=packed.dtype == "F16", BF16=packed.dtype == "BF16",
                                                  enable_fp_fusion=False, num_warps=CODEC_WARPS)
        if t0:
            out3[:, token_offset:token_offset + t0, :] = packed.sinks.to(dev, out.dtype).reshape(N, t0, D)
        return out

    def decode(self, codec, lay, packed: Packed, out, token_offset: int, name: str):
        torch = _torch()
        codes = self._checked(codec, lay, packed, name)
        flag = torch.zeros(1, dtype=torch.int32, device=codes.device)
        out = self._launch(lay, packed, codes, out, token_offset, flag, name)
        if flag.item():
            raise damaged(name)
        return out

    def decoder(self, codec, lay, packed: Packed, name: str):
        """``run(out, token_offset=0)`` decoding the record each call with no read back to the host: the kernel's
        check of the scales (in torch) made once, now."""
        torch = _torch()
        codes = self._checked(codec, lay, packed, name)
        D, rows = lay.D, lay.N * (lay.S - lay.t0)
        s = codes.view(rows, D // 4 + 2)[:, D // 4:].contiguous().view(torch.float16).float()
        if rows and bool((~(s >= 0) | (s == float("inf"))).any()):
            raise damaged(name)
        flag = torch.zeros(1, dtype=torch.int32, device=codes.device)   # written by no valid record, never read

        def run(out=None, token_offset: int = 0):
            return self._launch(lay, packed, codes, out, token_offset, flag, name)
        return run
