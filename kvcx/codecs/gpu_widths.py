"""The widths codec (``kvcx.widths``: kvcx2w's, kvcx2v's and kvcx4w's keys) on torch tensors through Triton kernels
(:mod:`kvcx.codecs.triton_kernels.widths`): checks, allocation, launches and errors, as :mod:`kvcx.codecs.widths` does
for the CPU kernels. A CUDA tensor reaches this backend by itself (``WidthCodec().encode(x_cuda)``);
``WidthCodec(backend="triton")`` forces it for a tensor on any device (Triton's interpreter, ``TRITON_INTERPRET=1``,
runs it on CPU tensors). Its records hold torch tensors on the input's device with **the bytes the CPU kernels write**
for the same input, and it decodes a record to the CPU's values bit for bit: records move between NumPy and a device
unchanged (:func:`kvcx.codecs.gpu.to_host`, :func:`kvcx.codecs.gpu.to_device`).

The group statistics, channel ranges, codes and planes are the device's work; the widths are chosen on the host by
the CPU backend's own code (:meth:`~kvcx.codecs.widths.WidthCodec.choose`) from the channels' spreads, which the
device sends back (a slab's D ranges and spreads: 16 bytes a channel, not the tensor): one copy each way an encode,
not a graph-capturable step. A decode checks the record's widths and ranges there too (N x D bytes and its FP16
ranges) and turns them into the kernel's plane offsets; :meth:`~kvcx.codecs.base.Codec.decoder` does that once a
record, and each of its calls is one launch that reads nothing back (what a cache's device store decodes every step).

The fused attention on the GPU does not read widths records (:func:`kvcx.codecs.gpu_attn.reads`): a ``KvcxCache``
with widths keys keeps its records on the device and decodes them there each step
(:class:`kvcx.cache.device_store.DeviceChunkKV`; ``memory_report()`` says so). torch and triton are imported when
first used.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kvcx.codecs import tensors
from kvcx.codecs.backends import is_tensor, register_backend
from kvcx.codecs.base import Packed, check_sinks_finite
from kvcx.codecs.cpu import core as _core
from kvcx.codecs.gpu import CODEC_WARPS, TritonBackend, as_bits, device_input, device_output, torch_dtype
from kvcx.codecs.gpu_attn import interpreting
from kvcx.codecs.runtime import check_status
from kvcx.codecs.tensors import triton_kernels
from kvcx.deps import import_torch as _torch
from kvcx.errors import CodecError

ROW_VALUES = 1024           # values a program of the statistics and channel kernels holds a row (groups or slabs)
INTERPRETER_ROW_VALUES = 8192    # ... in Triton's interpreter (each operation a NumPy call: fewer, larger programs)
# how the kernels are compiled: no FP fusion (the CPU rounds a product and a sum apart), and floor / ceil without
# flushing subnormals to zero (libdevice's default in Triton: cvt.rmi.ftz), as C's floorf / ceilf
EXACT = dict(enable_fp_fusion=False, enable_reflect_ftz=False, num_warps=CODEC_WARPS)


def widths_kernels():
    """The widths codec's Triton kernels; a CodecError naming the extra without triton."""
    return triton_kernels("widths")


def row_programs(D: int) -> int:
    """Groups (or slabs) a program of the statistics (channel) kernel holds: a power of two, about
    :data:`ROW_VALUES` values a row (:data:`INTERPRETER_ROW_VALUES` in the interpreter)."""
    rows = (INTERPRETER_ROW_VALUES if interpreting() else ROW_VALUES) // tensors.pow2(D)
    return 1 << max(0, rows.bit_length() - 1)


def _on_device(device, *arrays) -> tuple:
    """Copies of host arrays on ``device`` (copies also on the CPU: a kernel's arguments own their storage)."""
    torch = _torch()
    return tuple(torch.from_numpy(np.array(a, order="C")).to(device) for a in arrays)


@register_backend("kvcx.widths", "triton")
class TritonWidthsBackend(TritonBackend):
    """:class:`~kvcx.codecs.widths.WidthCodec`'s encode and decode in Triton."""

    def encode(self, codec, lay, x, out: Optional[Packed], name: str, weights: Optional[np.ndarray] = None) -> Packed:
        torch = _torch()
        k = widths_kernels()   # triton is installed, or a CodecError before any work
        x, dt = device_input(x, out, name)
        N, S, D, t0, G, gs = lay.N, lay.S, lay.D, lay.t0, lay.groups, codec.group_size
        dev = x.device
        x3 = x.view(N, S, D)

        def host():   # the tensor on the host, only to say what is wrong with it
            return x.float().cpu().numpy()

        sinks = x3[:, :t0, :].reshape(*lay.shape[:-2], t0, D).clone() if t0 else None
        if t0 and not bool(sinks.isfinite().all()):
            check_status(_core.STATUS_NONFINITE, name, host())
        codes = torch.empty(lay.codes_nbytes, dtype=torch.uint8, device=dev)
        scales = torch.empty(lay.scale_shape, dtype=torch.float16, device=dev)
        if G:
            DP = tensors.pow2(D)
            mn, mx, me = (torch.empty((N * G, D), dtype=torch.float32, device=dev) for _ in range(3))
            P = row_programs(D)
            k.w_stats_kernel[(-(-N * G // P),)](x3, mn, mx, me, S, t0, G, N * G, D=D, DP=DP, GS=gs, P=P, **EXACT)
            lo, hi = (torch.empty((N, D), dtype=torch.float32, device=dev) for _ in range(2))
            spread = torch.empty((N, D), dtype=torch.float64, device=dev)
            k.w_channels_kernel[(-(-N // P),)](mn, mx, lo, hi, spread, N, G, (S - t0) - (G - 1) * gs, D=D, DP=DP,
                                               GS=gs, P=P, **EXACT)
            lo16, hi16, widths = codec.choose(lo.cpu().numpy(), hi.cpu().numpy(), spread.cpu().numpy(), weights,
                                              lay, name, host)
            off, slab_off, gbytes = codec.plane_offsets(widths, G)
            lo32, hi32, w, top, off, slab_off, gbytes = _on_device(
                dev, lo16.astype(np.float32), hi16.astype(np.float32), widths, codec.tops(widths).reshape(N, D),
                off, slab_off, gbytes)
            codes[:N * D] = w.reshape(-1)
            scales[..., 0], scales[..., 1] = lo32, hi32   # FP16 values: exact
            k.w_encode_kernel[(N * G,)](x3, mn, mx, me, lo32, hi32, w, top, off, slab_off, gbytes, codes, N * D,
                                        N * D + N * G * D * 2, S, t0, G, D=D, DP=DP, GS=gs, **EXACT)
        else:
            host_codes, host_scales = codec.no_codes(lay)
            codes.copy_(torch.from_numpy(host_codes))
            scales.copy_(torch.from_numpy(host_scales))
        cfg = codec.get_config()
        cfg["sinks"] = t0
        return Packed(codes=codes, scales=scales, zeros=None, sinks=sinks, shape=lay.shape, dtype=dt, config=cfg,
                      meta={"partial_group": lay.partial_group})

    def decode(self, codec, lay, packed: Packed, out, token_offset: int, name: str):
        return self.decoder(codec, lay, packed, name)(out, token_offset)

    def decoder(self, codec, lay, packed: Packed, name: str):
        """``run(out, token_offset=0)`` decoding the record each call with no read back to the host: its checks
        (widths, ranges, range bytes in order, sinks) and its plane offsets made once, now."""
        torch = _torch()
        k = widths_kernels()
        N, D, t0, G = lay.N, lay.D, lay.t0, lay.groups
        codes, scales = packed.codes, packed.scales
        dev = codes.device
        if codes.dtype != torch.uint8 or not is_tensor(scales) or scales.device != dev:
            raise CodecError(f"tensor {name!r}: its codes (uint8) and channel ranges must be torch tensors on one "
                             "device (move the record with kvcx.codecs.gpu.to_device)")
        codec.check_codes_size(codes.numel(), lay, name)
        if t0 and (packed.sinks is None or not is_tensor(packed.sinks) or packed.sinks.numel() != N * t0 * D):
            raise CodecError(f"tensor {name!r}: {t0} exact sink tokens are recorded but their values are missing")
        check_sinks_finite(packed, t0, name)
        widths = np.array(codes[:N * D].cpu().numpy())
        ranges = codec.check_header(widths, scales.cpu().numpy().astype(np.float16), lay, name)
        stats = codes[N * D:N * D + N * G * D * 2].view(-1, 2)
        if G and bool((stats[:, 0] > stats[:, 1]).any()):   # a group's range bytes out of order
            check_status(_core.STATUS_CORRUPT, name, what="decoding")
        codes = codes.contiguous()
        if G:
            widths = widths.reshape(N, D)
            off, slab_off, gbytes = codec.plane_offsets(widths, G)
            ch = ranges.astype(np.float32)
            args = _on_device(dev, ch[..., 0], ch[..., 1], widths, codec.tops(widths).reshape(N, D), off, slab_off,
                              gbytes)
        sinks = packed.sinks.to(dev, torch_dtype(packed.dtype)).reshape(N, t0, D) if t0 else None

        def run(out=None, token_offset: int = 0):
            out, out3 = device_output(lay, packed.dtype, out, token_offset, dev, name)
            if G:
                dst = as_bits(out3, packed.dtype) if packed.dtype == "BF16" else out3
                k.w_decode_kernel[(N * G,)](codes, *args, dst, N * D, N * D + N * G * D * 2, lay.S, t0, G,
                                            out3.shape[1], token_offset, D=D, DP=tensors.pow2(D),
                                            GS=codec.group_size, SAT=packed.dtype == "F16",
                                            BF16=packed.dtype == "BF16", **EXACT)
            if t0:
                out3[:, token_offset:token_offset + t0, :] = sinks
            return out
        return run
