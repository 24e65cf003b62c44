"""The integer codec on torch tensors through Triton kernels (:mod:`kvcx.codecs.triton_kernels.codec`; the fused
attention's launches are :mod:`kvcx.codecs.gpu_attn`'s): checks, allocation, launches and errors, as
:mod:`kvcx.codecs.intcodec` does for the CPU kernels. A CUDA tensor reaches this backend by itself
(``IntCodec().encode(x_cuda)``); ``IntCodec(backend="triton")`` forces it for a tensor on any device (Triton's
interpreter, ``TRITON_INTERPRET=1``, runs it on CPU tensors). The record it returns holds torch tensors on the
input's device, with **the bytes the CPU kernels write** for the same input: :func:`to_host` and :func:`to_device`
move records between NumPy and a device unchanged. 4-bit codes, per-token or per-channel groups, zero points, sinks
and the Hadamard rotation (the default and reference schemes); other widths stay on the CPU backend. torch and
triton are imported when first used."""
from __future__ import annotations

import math
from importlib.util import find_spec
from typing import Optional


from kvcx.codecs.backends import is_tensor, register_backend
from kvcx.codecs.base import Packed
from kvcx.codecs.dtypes import is_int
from kvcx.codecs.runtime import check_status
from kvcx.codecs import tensors
from kvcx.codecs.tensors import float_mask, merge_writes, query_rows, to_device, to_host, triton_kernels  # noqa: F401
from kvcx.deps import import_torch as _torch
from kvcx.errors import CodecError

# values a program of the per-token Triton kernels quantizes at least (whole groups; whole tokens when rotating):
# 4,096 at 4 warps, 32 a thread, in under 100 registers (bench/sass_gpu.py: docs/results/gpu-sass.md)
PROGRAM_VALUES = 4096
CODEC_WARPS = 4              # warps a program of the encode and decode kernels (Triton's default)
# channels a program of the per-channel kernels (keys) holds, a power of two from 2, or None: a whole token row (the
# default; a rotated codec always). Fewer registers a program, but no faster on an H100 (docs/RESULTS.md, run 3)
CODEC_CHANNELS = None
# the encode's programs a multiprocessor when each loops over its slab's blocks (per channel) or groups (per token),
# the next one's values loaded while it works one (None: one each, the default); bench/profile_gpu.py --codecs times
CODEC_LOOP = None
_TORCH_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def codec_kernels():
    """The codec's Triton kernels (:mod:`kvcx.codecs.triton_kernels.codec`); a CodecError naming the extra without triton."""
    return triton_kernels("codec")


def dtype_name_of(x) -> Optional[str]:
    """'F16' / 'BF16' / 'F32' for a torch float tensor the kernels take, else None."""
    torch = _torch()
    return {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}.get(x.dtype)


def torch_dtype(dt: str):
    """The torch dtype of a record's dtype name ('F16', 'BF16', 'F32')."""
    return getattr(_torch(), _TORCH_DTYPES[dt])


def device_input(x, out, name: str) -> tuple:
    """(``x`` contiguous, its dtype's name) for a Triton encode; CodecError for a dtype the kernels do not take or
    an ``out=`` record (a device backend allocates its record on the tensor's device)."""
    dt = dtype_name_of(x)
    if dt is None:
        raise CodecError(f"tensor {name!r} has dtype {x.dtype}; kvcx handles float16, bfloat16 and float32 "
                         "(cast it with .float() first)")
    if out is not None:
        raise CodecError(f"tensor {name!r}: out= records are for NumPy arrays; the Triton backend allocates "
                         "its record on the tensor's device")
    return x.detach().contiguous(), dt


def device_output(lay, dt: str, out, token_offset: int, dev, name: str) -> tuple:
    """(out, out seen as [N, tokens, D]) for a Triton decode of ``lay`` in dtype ``dt``: a new tensor on ``dev``,
    or the caller's after every check (the same shape, or longer on axis -2 with ``token_offset``)."""
    torch = _torch()
    want = torch_dtype(dt)
    if out is None:
        if token_offset:
            raise CodecError("token_offset needs an out= tensor")
        out = torch.empty(lay.shape, dtype=want, device=dev)
    ok = is_tensor(out) and out.dtype == want and out.device == dev and out.is_contiguous() and \
        out.dim() == len(lay.shape) and tuple(out.shape[:-2]) == lay.shape[:-2] and out.shape[-1] == lay.D and \
        0 <= token_offset and token_offset + lay.S <= out.shape[-2]
    if not ok:
        raise CodecError(f"tensor {name!r}: out must be a contiguous {want} tensor on {dev} of shape "
                         f"{list(lay.shape)} (or longer on axis -2 with token_offset)")
    return out, out.view(lay.N, out.shape[-2] if len(lay.shape) >= 2 else 1, lay.D)


# a dtype's bits as the kernels copy them (the exact sink tokens), and its exponent's bits (all ones: NaN or Inf)
_BITS = {"F16": ("int16", 0x7C00), "BF16": ("int16", 0x7F80), "F32": ("int32", 0x7F800000)}


def as_bits(t, dt: str):
    """``t`` (dtype ``dt``) seen as the integers of its bits."""
    return t.view(getattr(_torch(), _BITS[dt][0]))


def _programs(codec, lay, dtype: str = "BF16") -> tuple:
    """(the encode and decode kernels of ``codec``'s grouping, kernel arguments common to both, grid, their
    constexprs of the layout and of the values' dtype) for a layout: what the launchers pass, and what the offline
    compile test and bench/sass_gpu.py compile."""
    G, D, S, t0, N = codec.group_size, lay.D, lay.S, lay.t0, lay.N
    k = codec_kernels()
    row_bytes = ((S - t0) * D * 4 + 7) // 8
    flags = dict(ASYM=codec.asym, ROTATE=codec.rotate, SB=min(tensors.pow2(t0 * D), 1024) if t0 else 0, EXP=_BITS[dtype][1])
    if codec.axis == "token":
        L = (S - t0) * D
        ngroups = -(-L // G)
        R = max(PROGRAM_VALUES, D if codec.rotate else 1) // G
        R = 1 << max(0, (R - 1).bit_length())
        return (k.encode_token_kernel, k.decode_token_kernel), \
            dict(S=S, t0=t0, L=L, row_bytes=row_bytes, ngroups=ngroups), (N, -(-ngroups // R)), \
            dict(D=D, G=G, R=R, **flags)
    nblk = -(-(S - t0) // G)
    dp = 1 << (D - 1).bit_length()
    cb = CODEC_CHANNELS
    if cb is not None and not (is_int(cb) and cb >= 2 and cb & (cb - 1) == 0):
        raise CodecError(f"channels a program {cb!r} (kvcx.codecs.gpu.CODEC_CHANNELS) is not a power of two from 2; "
                         "set one (16, 32, 64, ...) or None (whole token rows)")
    cb = dp if cb is None or codec.rotate else min(dp, int(cb))
    return (k.encode_channel_kernel, k.decode_channel_kernel), \
        dict(S=S, t0=t0, D=D, row_bytes=row_bytes, nblk=nblk), (N, nblk, dp // cb), \
        dict(DP=dp, CB=cb, G=G, **flags)


class TritonBackend:
    """What every codec's Triton backend answers (:mod:`kvcx.codecs.backends`): its name, whether it runs a codec's
    settings (every one, unless a backend says otherwise) and whether triton is installed (the kvcx[gpu] extra)."""

    name = "triton"

    @staticmethod
    def takes(codec) -> bool:
        return True

    @staticmethod
    def available() -> bool:
        return find_spec("triton") is not None


@register_backend("kvcx.int", "triton")
class TritonIntBackend(TritonBackend):
    """:class:`~kvcx.codecs.intcodec.IntCodec`'s encode and decode in Triton (4 bits)."""

    @staticmethod
    def takes(codec) -> bool:
        """Whether this backend runs ``codec``'s settings (4-bit codes)."""
        return getattr(codec, "bits", None) == 4

    def check(self, codec, name: str) -> None:
        if not self.takes(codec):
            raise CodecError(f"tensor {name!r}: the Triton backend runs 4-bit codecs; {codec.bits}-bit codes run on "
                             "the CPU (pass backend='cpu' and a CPU tensor)")

    def encode(self, codec, lay, x, out: Optional[Packed], name: str) -> Packed:
        self.check(codec, name)
        torch = _torch()
        codec_kernels()   # triton is installed, or a CodecError before any work
        x, dt = device_input(x, out, name)
        dev = x.device
        codes = torch.empty(lay.codes_nbytes, dtype=torch.uint8, device=dev)
        scales = torch.empty(lay.scale_shape, dtype=torch.float16, device=dev)
        zeros = torch.empty(lay.scale_shape, dtype=torch.float16, device=dev) if codec.asym else None
        N, S, D, t0 = lay.N, lay.S, lay.D, lay.t0
        x3 = x.view(N, S, D)
        sinks = torch.empty((*lay.shape[:-2], t0, D), dtype=x.dtype, device=dev) if t0 else None
        # the kernel's checks (non-finite scales or zero points; non-finite sinks), read in one copy to the host
        flag = torch.zeros(2, dtype=torch.int32, device=dev)
        if S > t0:   # the kernel also copies the sinks and checks them
            launch_encode(codec, lay, x3, dt, codes, scales, zeros, flag, sinks)
        elif t0:     # sinks alone: no kernel
            sinks.view(N, t0, D).copy_(x3)
            flag[1] = (~torch.isfinite(sinks)).any()
        if any(flag.tolist()):   # the tensor is copied to the host only to say what is wrong with it
            from kvcx.codecs.cpu import core as _core

            status = _core.STATUS_NONFINITE if not bool(torch.isfinite(x).all()) else _core.STATUS_SCALE_OVERFLOW
            check_status(status, name, x.float().cpu().numpy())
        cfg = codec.get_config()
        cfg["sinks"] = t0
        return Packed(codes=codes, scales=scales, zeros=zeros, sinks=sinks, shape=lay.shape, dtype=dt, config=cfg,
                      meta={"partial_group": lay.partial_group})

    def _checked(self, codec, lay, packed: Packed, name: str) -> tuple:
        """(codes, scales, zero points, sinks in the record's dtype or None) of a record, after the checks that need
        no kernel (buffers, sizes, dtypes)."""
        self.check(codec, name)
        torch = _torch()
        codec_kernels()   # triton is installed, or a CodecError before any work
        codes, scales, zeros = packed.codes, packed.scales, packed.zeros
        dev = codes.device
        if not all(is_tensor(a) and a.device == dev for a in (scales, zeros if codec.asym else scales)):
            raise CodecError(f"tensor {name!r}: its codes, scales and zero points must be torch tensors on one device "
                             "(move the record with kvcx.codecs.gpu.to_device)")
        N, D, t0 = lay.N, lay.D, lay.t0
        if codes.dtype != torch.uint8 or codes.numel() != lay.codes_nbytes:
            raise CodecError(f"tensor {name!r}: expected {lay.codes_nbytes} bytes of packed codes (uint8), got "
                             f"{codes.numel()} {codes.dtype}")
        if scales.dtype != torch.float16 or scales.numel() != math.prod(lay.scale_shape):
            raise CodecError(f"tensor {name!r}: expected {math.prod(lay.scale_shape)} FP16 scales, got "
                             f"{scales.numel()} {scales.dtype}")
        if codec.asym and (zeros is None or zeros.dtype != torch.float16 or zeros.numel() != scales.numel()):
            raise CodecError(f"tensor {name!r}: the asymmetric scheme needs {scales.numel()} FP16 zero points")
        sinks = packed.sinks if t0 else None
        if t0 and (sinks is None or not is_tensor(sinks) or sinks.numel() != N * t0 * D):
            raise CodecError(f"tensor {name!r}: {t0} exact sink tokens are recorded but their values are missing")
        return codes, scales, zeros, None if sinks is None else sinks.to(dev, torch_dtype(packed.dtype)).contiguous()

    def _launch(self, codec, lay, packed: Packed, parts: tuple, out, token_offset: int, flag, name: str):
        """The decode kernel (or the sinks' copy alone) into ``out`` (:func:`device_output`'s checks); its checks
        into ``flag`` [damaged parameters, non-finite sinks], read by the caller or not. Returns ``out``."""
        torch = _torch()
        codes, scales, zeros, sinks = parts
        N, S, D, t0 = lay.N, lay.S, lay.D, lay.t0
        out, out3 = device_output(lay, packed.dtype, out, token_offset, codes.device, name)
        if S > t0:   # the kernel also copies the sinks and checks them
            (_, decode), args, grid, const = _programs(codec, lay, packed.dtype)
            zp = zeros if codec.asym else scales
            ob = as_bits(out3, packed.dtype)
            dst = ob if packed.dtype == "BF16" else out3
            decode[grid](codes, scales, zp, dst, flag, ob if sinks is None else as_bits(sinks, packed.dtype), ob,
                         **args, out_S=out3.shape[1], out_off=token_offset, norm=tensors.norm_of(D),
                         SAT=packed.dtype == "F16", BF16=packed.dtype == "BF16", **const, enable_fp_fusion=False,
                         num_warps=CODEC_WARPS)
        elif t0:     # sinks alone: no kernel
            out3[:, token_offset:token_offset + t0, :] = sinks.view(N, t0, D)
            flag[1] = (~torch.isfinite(sinks)).any()
        return out

    @staticmethod
    def _refuse(name: str, params_bad: bool, sinks_bad: bool) -> None:
        if params_bad:
            raise CodecError(f"tensor {name!r}: its scales or zero points hold NaN/Inf or negative scales, which "
                             "no kvcx encoder writes; the data is damaged: encode it again")
        if sinks_bad:
            raise CodecError(f"tensor {name!r}: its exact sink tokens hold NaN/Inf, which no kvcx encoder writes; "
                             "the data is damaged: encode it again")

    def decode(self, codec, lay, packed: Packed, out, token_offset: int, name: str):
        parts = self._checked(codec, lay, packed, name)
        # the kernel's checks (scales negative or not finite, zero points not finite; sinks not finite), read in
        # one copy to the host after it: ``out`` holds what was decoded even when the record is refused
        flag = _torch().zeros(2, dtype=_torch().int32, device=packed.codes.device)
        out = self._launch(codec, lay, packed, parts, out, token_offset, flag, name)
        self._refuse(name, *flag.tolist())
        return out

    def decoder(self, codec, lay, packed: Packed, name: str):
        """``run(out, token_offset=0)`` decoding the record each call with no read back to the host: its checks
        (the kernel's, in torch) made once, now."""
        torch = _torch()
        codes, scales, zeros, sinks = parts = self._checked(codec, lay, packed, name)
        s = scales.float()
        params_bad = bool((~(s >= 0) | (s == float("inf"))).any()) or \
            (codec.asym and not bool(torch.isfinite(zeros).all()))
        self._refuse(name, params_bad, sinks is not None and not bool(torch.isfinite(sinks).all()))
        flag = torch.zeros(2, dtype=torch.int32, device=codes.device)   # written by no valid record, never read

        def run(out=None, token_offset: int = 0):
            return self._launch(codec, lay, packed, parts, out, token_offset, flag, name)
        return run


def encode_launch(codec, lay, dt: str = "BF16", paged: bool = False) -> tuple:
    """(encode kernel, arguments, grid, constexprs) of ``codec``'s encode of layout ``lay`` (:func:`_programs`; a
    program's blocks or groups in a loop where :data:`CODEC_LOOP` is set and leaves fewer programs; ``paged``: a
    decode step's, :func:`kvcx.codecs.paged.encode_step`'s, never in a loop)."""
    (encode, _), args, grid, const = _programs(codec, lay, dt)
    if paged:
        return encode, args, grid, {**const, "STEP": 0, "PAGED": True}
    if CODEC_LOOP is not None and not (is_int(CODEC_LOOP) and CODEC_LOOP >= 1):
        raise CodecError(f"encode programs a multiprocessor {CODEC_LOOP!r} (kvcx.codecs.gpu.CODEC_LOOP) is not a "
                         "count; set a whole number from 1, or None (a program a block)")
    # at most the programs that run at once (a second, partial wave of looping programs would double the time)
    step = max(1, tensors.multiprocessors() * CODEC_LOOP // (grid[0] * math.prod(grid[2:]))) if CODEC_LOOP else 0
    step = step if step < grid[1] else 0
    return encode, args, (grid[0], step, *grid[2:]) if step else grid, {**const, "STEP": step, "PAGED": False}


def launch_encode(codec, lay, x3, dt: str, codes, scales, zeros, flag, sinks=None, step=None) -> None:
    """The encode kernel over ``x3`` [N, S, D] into ``lay``'s buffers; ``flag`` gets its checks (non-finite);
    ``step``: (where, pages, new) of a decode step (:func:`kvcx.codecs.paged.encode_step` checks them)."""
    encode, args, grid, const = encode_launch(codec, lay, dt, paged=step is not None)
    xb = as_bits(x3, dt)
    where, pages, new = step if step is not None else (flag, 1, x3)
    encode[grid](x3, codes, scales, zeros if zeros is not None else scales, flag, xb, xb if sinks is None else
                 as_bits(sinks, dt), **args, norm=tensors.norm_of(lay.D), where_ptr=where, pages=pages, new_ptr=new, **const,
                 enable_fp_fusion=False, num_warps=CODEC_WARPS)
