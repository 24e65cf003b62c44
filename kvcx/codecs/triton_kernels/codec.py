"""Triton kernels of the integer codec at 4 bits: the GPU twins of the CPU kernels in ``kvcx/codecs/cpu``.

Every kernel writes **the same bytes** as its CPU twin for the same input (codes, FP16 scales and zero
points, decoded values), so a packed record moves between the CPU and the GPU unchanged. That needs the CPU
kernels' arithmetic exactly, in the same order:

- group statistics on the float bits as integers (max of ``bits & 0x7fffffff``; min and max of the order keys
  ``bits ^ ((bits >> 31) & 0x7fffffff)``), so ``-0.0`` and ``+0.0`` are told apart as on the CPU;
- ``scale = fp16(max|x| / 7)`` or ``fp16((max - min) / 15)``, ``zero = fp16(min)``, round to nearest even;
- ``code = clamp(rint((x - zero) / scale), qmin, qmax) + off`` with the division correctly rounded (from the
  group's correctly rounded reciprocal and two FMA corrections: :func:`_div`), 0 where the scale is 0; ``rint``
  (half to even) as ``(t + 1.5 * 2**23) - 1.5 * 2**23`` on the clamped value, exact for |t| < 2**22 (the clamp
  bounds are integers, so clamping first is the same);
- decode ``(q - off) * scale + zero`` as a product then a sum, then the inverse rotation, then the output dtype
  (FP16 saturating at 65504); the launcher turns FP fusion off for encode and decode, since an FMA the compiler
  made would round once where the CPU rounds twice (the FMAs of :func:`_div` are written out);
- the Walsh-Hadamard butterflies in the CPU's order (stages h = 1, 2, 4, ... D/2, a + b and a - b, then one
  product by ``1 / sqrt(D)``).

This module holds the codec's kernels only (the fused attention's are in :mod:`kvcx.codecs.triton_kernels.attention`);
:mod:`kvcx.codecs.gpu` checks, allocates and launches them. It is imported
only when a tensor goes to the Triton backend (``triton`` is the ``kvcx[gpu]`` extra). Under
``TRITON_INTERPRET=1`` Triton's interpreter runs the same kernels on CPU tensors (the tests do).
"""
import triton
import triton.language as tl

# rint by the round-to-nearest-even of an FP32 sum at 2**23 (libdevice's rint does not run in the interpreter)
_RINT_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _fwht_rows(x, T: tl.constexpr, D: tl.constexpr, norm):
    """The orthonormal Walsh-Hadamard transform of each of the T rows of D values of ``x`` ([T, D])."""
    for s in tl.static_range(0, D.bit_length() - 1):
        # stage s pairs values 2**s apart (written inline: a name assigned in the loop would become a tensor)
        y = tl.permute(tl.reshape(x, (T, D // (2 * 2 ** s), 2, 2 ** s)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (T, D))
    return x * norm


@triton.jit
def _group_params(x, valid, axis: tl.constexpr, ASYM: tl.constexpr, PAD: tl.constexpr):
    """(FP16 scales, FP16 zero points, scales as divisors, their correctly rounded reciprocals, keep, zeros as
    floats) of the groups of ``x`` along ``axis``. With ``PAD``, values where ``valid`` is false are padding, not
    part of any group; without it every value counts (the caller pads with copies of a group's own values).
    Padding loads as 0.0, which leaves any max |x| as it is (rotated too), so only the asymmetric min and max
    need the mask."""
    bits = x.to(tl.int32, bitcast=True)
    if ASYM:
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        if PAD:
            kmin = tl.min(tl.where(valid, key, 0x7FFFFFFF), axis=axis)
            kmax = tl.max(tl.where(valid, key, -0x7FFFFFFF - 1), axis=axis)
        else:
            kmin = tl.min(key, axis=axis)
            kmax = tl.max(key, axis=axis)
        lo = (kmin ^ ((kmin >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        hi = (kmax ^ ((kmax >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        s16 = tl.math.div_rn(hi - lo, 15.0).to(tl.float16)
        z16 = lo.to(tl.float16)
    else:
        amax = tl.max(bits & 0x7FFFFFFF, axis=axis).to(tl.float32, bitcast=True)
        s16 = tl.math.div_rn(amax, 7.0).to(tl.float16)
        z16 = tl.zeros_like(s16)
    scale = s16.to(tl.float32)
    keep = scale != 0.0
    sdiv = tl.where(keep, scale, 1.0)
    return s16, z16, sdiv, tl.math.div_rn(1.0, sdiv), keep, z16.to(tl.float32)


@triton.jit
def _div(a, b, y):
    """``a / b`` correctly rounded (what ``div_rn`` gives), from ``y`` = the correctly rounded ``1 / b``, in five
    FP32 operations (``div_rn`` takes a reciprocal, its refinement and a range check per element): q = a y is
    within 2 ulp of a / b; one correction with the residual a - b q makes it faithful (within 1 ulp); with a
    faithful q the residual is exact and one more correction rounds correctly (Markstein's theorem; b > 0 and
    normal, as an FP16 scale is in FP32; no overflow: |a / b| stays within a few times 2**4)."""
    q = a * y
    q = tl.fma(tl.fma(-b, q, a), y, q)
    return tl.fma(tl.fma(-b, q, a), y, q)


@triton.jit
def _codes(x, zero, sdiv, rcp, keep, valid, ASYM: tl.constexpr, PAD: tl.constexpr):
    """4-bit codes (int32) of ``x`` with broadcast group parameters; with ``PAD``, 0 where ``valid`` is false (a
    byte's unused nibble is 0, as the CPU writes it)."""
    if ASYM:
        t = _div(x - zero, sdiv, rcp)
        t = tl.minimum(tl.maximum(t, 0.0), 15.0)
        off = 0
    else:
        t = _div(x, sdiv, rcp)
        t = tl.minimum(tl.maximum(t, -8.0), 7.0)
        off = 8
    t = (t + _RINT_MAGIC) - _RINT_MAGIC
    t = tl.where(keep, t, 0.0)
    code = t.to(tl.int32) + off
    if PAD:
        code = tl.where(valid, code, 0)
    return code


@triton.jit
def _pack(code, R: tl.constexpr, C: tl.constexpr):
    """[R, C] codes (< 16) -> [R, C // 2] bytes, element 2i in the low nibble of byte i."""
    lo, hi = tl.split(tl.reshape(code, (R, C // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _unpack(byte, R: tl.constexpr, C: tl.constexpr):
    """[R, C // 2] bytes -> [R, C] codes as float32."""
    b = byte.to(tl.int32)
    return tl.reshape(tl.join(b & 15, b >> 4), (R, C)).to(tl.float32)


@triton.jit
def _dequant(q, scale, zero, ASYM: tl.constexpr):
    if ASYM:
        return q * scale + zero
    return (q - 8.0) * scale


@triton.jit
def _store_out(ptr, y, mask, SAT: tl.constexpr, BF16: tl.constexpr):
    """Decoded values to the output dtype. FP16: saturating, as the CPU decoder (a finite input never decodes
    to +-inf). BF16 (``ptr`` an int16 view): round to nearest even on the bits, as kvcx_f2b (the values are
    finite), so the result does not hang on how a backend converts."""
    if SAT:
        y = tl.minimum(tl.maximum(y, -65504.0), 65504.0)
    if BF16:
        f = y.to(tl.int32, bitcast=True)
        tl.store(ptr, (((f + 0x7FFF + ((f >> 16) & 1)) >> 16) & 0xFFFF).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flag_if(flag_ptr, bad):
    """Sets the flag at ``flag_ptr`` (an int32 the launcher zeroed) where any of ``bad`` is true: a damaged or
    non-finite input, told to the host in the one copy it makes after the launch. Each element that finds one
    stores the same 1 (no reduction across the program's threads: it would wait on them all, a program's time in
    the common case of nothing to flag)."""
    one = bad.to(tl.int32)
    tl.store(flag_ptr + one * 0, one, mask=bad)


@triton.jit
def _nonfinite(x):
    """Whether each float of ``x`` is NaN or +-Inf."""
    return ~(tl.abs(x) < float("inf"))


@triton.jit
def _copy_sinks(src_ptr, dst_ptr, flag_ptr, slab, n, src_stride, dst_stride, dst_off, SB: tl.constexpr,
                EXP: tl.constexpr):
    """A slab's exact sink tokens, its first ``n`` values, copied as they are (their bits: integer pointers) from
    ``src`` (``src_stride`` values a slab) to ``dst`` (``dst_stride`` a slab, from ``dst_off``), and the flag at
    ``flag_ptr`` set where one is NaN or Inf (its exponent bits ``EXP`` all ones); ``SB`` values at a time."""
    for e0 in range(0, n, SB):
        e = e0 + tl.arange(0, SB)
        m = e < n
        v = tl.load(src_ptr + slab.to(tl.int64) * src_stride + e, mask=m, other=0)
        tl.store(dst_ptr + slab.to(tl.int64) * dst_stride + dst_off + e, v, mask=m)
        _flag_if(flag_ptr, m & ((v & EXP) == EXP))


@triton.jit
def encode_token_kernel(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, xb_ptr, sinks_ptr, S, t0, L, row_bytes,
                        ngroups, norm, where_ptr, pages, new_ptr, D: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
                        ASYM: tl.constexpr, ROTATE: tl.constexpr, SB: tl.constexpr, EXP: tl.constexpr,
                        STEP: tl.constexpr = 0, PAGED: tl.constexpr = False):
    """Groups of G consecutive values of each slab's tokens [t0, S) (C order): R groups per program.
    Grid (slabs, cdiv(groups per slab, R)); with ROTATE, R * G is a multiple of D (whole tokens). The checks:
    ``flag_ptr[0]`` set where a scale or zero point is not finite (a NaN or Inf in the group, or a scale past
    FP16); with sinks (``SB`` > 0) each slab's first program copies them (``xb_ptr``: x's bits) to ``sinks_ptr``
    and sets ``flag_ptr[1]`` where one is not finite. ``STEP`` > 0: a program per (slab, every STEP-th whole
    program's groups from its own) in a loop, the next one's values loaded before this one is worked (in flight
    meanwhile: Triton pipelines only the loads that feed products), a slab's partial last one by its first
    program after its loop; the same bytes. ``PAGED``: a decode step (:func:`_token_step`)."""
    slab = tl.program_id(0)
    p = tl.program_id(1)
    if SB > 0:
        if p == 0:
            _copy_sinks(xb_ptr, sinks_ptr, flag_ptr + 1, slab, t0 * D, S * D, t0 * D, 0, SB, EXP)
    if PAGED:
        _token_step(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, where_ptr, pages, new_ptr, slab, p, S, L,
                    row_bytes, ngroups, norm, D, G, R, ASYM, ROTATE)
    elif STEP > 0:   # whole programs' groups in a loop, the next one's values loaded while this one is worked
        whole = L // (R * G)
        base = slab.to(tl.int64) * S * D + t0 * D
        vv = tl.arange(0, R)[:, None] * G + tl.arange(0, G)[None, :]
        if p < whole:
            nxt = tl.load(x_ptr + base + p * (R * G) + vv)
            for q in range(p, whole, STEP):
                x = nxt
                nxt = tl.load(x_ptr + base + tl.minimum(q + STEP, whole - 1) * (R * G) + vv)   # the last's again
                _encode_groups(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab, q, x, S, t0, L, row_bytes,
                               ngroups, norm, D, G, R, ASYM, ROTATE, False, True)
        if (p == 0) & (whole * R * G < L):   # the slab's partial last program's groups, masked
            _encode_groups(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab, whole, 0.0, S, t0, L, row_bytes,
                           ngroups, norm, D, G, R, ASYM, ROTATE, True, False)
    elif (p + 1) * R * G <= L:   # a whole program's groups: no masks (all but a slab's last)
        _encode_groups(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab, p, 0.0, S, t0, L, row_bytes, ngroups,
                       norm, D, G, R, ASYM, ROTATE, False, False)
    else:
        _encode_groups(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab, p, 0.0, S, t0, L, row_bytes, ngroups,
                       norm, D, G, R, ASYM, ROTATE, True, False)


@triton.jit
def _token_step(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, where_ptr, pages, new_ptr, slab, p, S, L,
                row_bytes, ngroups, norm, D: tl.constexpr, G: tl.constexpr, R: tl.constexpr, ASYM: tl.constexpr,
                ROTATE: tl.constexpr):
    """A decode step of a paged store (no sinks): the step's token ``new`` [slabs, D] written into the residual
    ``x`` [slabs, S, D] at token ``where[0]`` (the flag set where one of its values is NaN or Inf), and, if that
    fills the residual (``where[0]`` = S - 1), program ``p``'s groups encoded into page ``where[1]`` of the
    buffers, which hold ``pages`` pages a slab (with the token's values, not those read before the write). The
    encode is the masked one for every program (the same bytes for a whole one; it runs once a page)."""
    slot = tl.load(where_ptr)
    g = p * R + tl.arange(0, R)
    v = g[:, None] * G + tl.arange(0, G)[None, :]
    row = slab.to(tl.int64) * S * D
    fresh = (v // D) == slot
    nv = tl.load(new_ptr + slab.to(tl.int64) * D + (v - slot * D), mask=fresh, other=0.0)
    tl.store(x_ptr + row + v, nv, mask=fresh)
    _flag_if(flag_ptr, fresh & _nonfinite(nv.to(tl.float32)))
    if slot == S - 1:
        x = tl.where(fresh, nv, tl.load(x_ptr + row + v, mask=v < L, other=0.0))
        _encode_groups(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab * pages + tl.load(where_ptr + 1), p, x,
                       S, 0, L, row_bytes, ngroups, norm, D, G, R, ASYM, ROTATE, True, True)


@triton.jit
def _encode_groups(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab, p, xin, S, t0, L, row_bytes, ngroups, norm,
                   D: tl.constexpr, G: tl.constexpr, R: tl.constexpr, ASYM: tl.constexpr, ROTATE: tl.constexpr,
                   PAD: tl.constexpr, GIVEN: tl.constexpr):
    """encode_token_kernel's groups of program ``p``; with ``PAD`` the slab's last program, whose groups may end
    past the values (masked loads and stores, padding outside the statistics), else none of that; ``GIVEN``: its
    values are ``xin`` [R, G] (loaded ahead, as x holds them), else loaded here."""
    g = p * R + tl.arange(0, R)
    v = g[:, None] * G + tl.arange(0, G)[None, :]
    valid = v < L
    base = slab.to(tl.int64) * S * D + t0 * D
    # without PAD no masks at all (None: Triton's own default), with it the loads and stores of a partial program
    if GIVEN:
        x = xin.to(tl.float32)
    else:
        x = tl.load(x_ptr + base + v, mask=valid if PAD else None, other=0.0 if PAD else None).to(tl.float32)
    if ROTATE:
        x = tl.reshape(_fwht_rows(tl.reshape(x, (R * G // D, D)), R * G // D, D, norm), (R, G))
    s16, z16, sdiv, rcp, keep, zero = _group_params(x, valid, 1, ASYM, PAD)
    code = _codes(x, zero[:, None], sdiv[:, None], rcp[:, None], keep[:, None], valid, ASYM, PAD)
    gm = g < ngroups
    bad = _nonfinite(s16.to(tl.float32))
    if ASYM:
        bad = bad | _nonfinite(zero)
    _flag_if(flag_ptr, gm & bad)
    j = g[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :]
    row = slab.to(tl.int64) * row_bytes
    tl.store(scales_ptr + slab.to(tl.int64) * ngroups + g, s16, mask=gm if PAD else None)
    if ASYM:
        tl.store(zeros_ptr + slab.to(tl.int64) * ngroups + g, z16, mask=gm if PAD else None)
    tl.store(codes_ptr + row + j, _pack(code, R, G), mask=(j < row_bytes) if PAD else None)


@triton.jit
def decode_token_kernel(codes_ptr, scales_ptr, zeros_ptr, out_ptr, flag_ptr, sb_ptr, ob_ptr, S, t0, L, row_bytes,
                        ngroups, out_S, out_off, norm, D: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
                        ASYM: tl.constexpr, ROTATE: tl.constexpr, SAT: tl.constexpr, BF16: tl.constexpr,
                        SB: tl.constexpr, EXP: tl.constexpr):
    """The inverse of encode_token_kernel, into ``out`` seen as (slabs, out_S, D) at token out_off. The checks:
    ``flag_ptr[0]`` set where a scale is negative or not finite or a zero point not finite (no encoder writes
    one); with sinks (``SB`` > 0) each slab's first program copies the record's (``sb_ptr``, as bits) into
    ``out`` (``ob_ptr``: its bits) and sets ``flag_ptr[1]`` where one is not finite."""
    slab = tl.program_id(0)
    if SB > 0:
        if tl.program_id(1) == 0:
            _copy_sinks(sb_ptr, ob_ptr, flag_ptr + 1, slab, t0 * D, t0 * D, out_S * D, out_off * D, SB, EXP)
    g = tl.program_id(1) * R + tl.arange(0, R)
    gm = g < ngroups
    j = g[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :]
    byte = tl.load(codes_ptr + slab.to(tl.int64) * row_bytes + j, mask=j < row_bytes, other=0)
    scale = tl.load(scales_ptr + slab.to(tl.int64) * ngroups + g, mask=gm, other=0.0).to(tl.float32)
    bad = ~(scale >= 0.0) | (scale == float("inf"))
    zero = tl.zeros_like(scale)
    if ASYM:
        zero = tl.load(zeros_ptr + slab.to(tl.int64) * ngroups + g, mask=gm, other=0.0).to(tl.float32)
        bad = bad | _nonfinite(zero)
    _flag_if(flag_ptr, gm & bad)
    y = _dequant(_unpack(byte, R, G), scale[:, None], zero[:, None], ASYM)
    if ROTATE:
        y = tl.reshape(_fwht_rows(tl.reshape(y, (R * G // D, D)), R * G // D, D, norm), (R, G))
    v = g[:, None] * G + tl.arange(0, G)[None, :]
    _store_out(out_ptr + slab.to(tl.int64) * out_S * D + (out_off + t0) * D + v, y, v < L, SAT, BF16)


@triton.jit
def encode_channel_kernel(x_ptr, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, xb_ptr, sinks_ptr, S, t0, D, row_bytes,
                          nblk, norm, where_ptr, pages, new_ptr, DP: tl.constexpr, CB: tl.constexpr, G: tl.constexpr,
                          ASYM: tl.constexpr, ROTATE: tl.constexpr, SB: tl.constexpr, EXP: tl.constexpr,
                          STEP: tl.constexpr = 0, PAGED: tl.constexpr = False):
    """Groups of G tokens per channel: one program per (slab, token block, CB channels), the block's [G, CB] values
    (DP: D rounded up to a power of two; D = DP when ROTATE, and CB = DP: the rotation mixes a whole row). The
    checks and the sinks as in encode_token_kernel. ``STEP`` > 0: a program per (slab, every STEP-th block from
    its own, CB channels), its blocks in a loop, the next block's values loaded before this one is worked (in
    flight meanwhile: Triton pipelines only the loads that feed products); the same bytes. ``PAGED``: a decode
    step, as :func:`_token_step`'s (the block's channels of the step's token written, the block encoded if the
    step fills the residual)."""
    slab = tl.program_id(0)
    blk = tl.program_id(1)
    c0 = tl.program_id(2) * CB
    if SB > 0:
        if (blk == 0) & (tl.program_id(2) == 0):
            _copy_sinks(xb_ptr, sinks_ptr, flag_ptr + 1, slab, t0 * D, S * D, t0 * D, 0, SB, EXP)
    ii = tl.arange(0, G)[:, None]                    # a block's tokens
    d = c0 + tl.arange(0, CB)[None, :]
    base = slab.to(tl.int64) * S * D + t0 * D
    # a partial last block reads its last token again in place of the missing ones (no group changes; they are
    # not stored), and columns past D read 0 (their groups are not stored): no mask in the statistics or codes
    if PAGED:
        slot = tl.load(where_ptr)
        rel = slot - blk * G + 0 * d         # [1, CB], not a scalar: the interpreter mis-types a scalar & a tensor
        mine = (rel >= 0) & (rel < G) & (d < D)                             # the token is in this block
        nv = tl.load(new_ptr + slab.to(tl.int64) * D + d, mask=mine, other=0.0)
        tl.store(x_ptr + base + slot * D + d, nv, mask=mine)
        _flag_if(flag_ptr, mine & _nonfinite(nv.to(tl.float32)))
        if slot == S - 1:
            x = _block_values(x_ptr + base, blk, ii, d, S, D, G)
            x = tl.where(tl.minimum(blk * G + ii, S - 1) == slot, nv, x).to(tl.float32)
            _encode_block(x, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab * pages + tl.load(where_ptr + 1), blk,
                          c0, ii, S, 0, D, row_bytes, nblk, norm, DP, CB, G, ASYM, ROTATE)
    elif STEP > 0:
        nxt = _block_values(x_ptr + base, blk, ii, d, S - t0, D, G)
        for b in range(blk, nblk, STEP):
            x = nxt.to(tl.float32)
            # the last block's own again at the end: in bounds
            nxt = _block_values(x_ptr + base, tl.minimum(b + STEP, nblk - 1), ii, d, S - t0, D, G)
            _encode_block(x, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab, b, c0, ii, S, t0, D, row_bytes, nblk,
                          norm, DP, CB, G, ASYM, ROTATE)
    else:
        x = _block_values(x_ptr + base, blk, ii, d, S - t0, D, G).to(tl.float32)
        _encode_block(x, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab, blk, c0, ii, S, t0, D, row_bytes, nblk,
                      norm, DP, CB, G, ASYM, ROTATE)


@triton.jit
def _block_values(row, blk, ii, d, n, D, G: tl.constexpr):
    """Block ``blk``'s values [G, CB] of a slab's ``n`` packed tokens from ``row``, as x holds them."""
    return tl.load(row + tl.minimum(blk * G + ii, n - 1) * D + d, mask=d < D, other=0.0)


@triton.jit
def _encode_block(x, codes_ptr, scales_ptr, zeros_ptr, flag_ptr, slab, blk, c0, ii, S, t0, D, row_bytes, nblk, norm,
                  DP: tl.constexpr, CB: tl.constexpr, G: tl.constexpr, ASYM: tl.constexpr, ROTATE: tl.constexpr):
    """encode_channel_kernel's work on one block's values ``x`` [G, CB] (FP32): statistics, codes, their stores."""
    i = blk * G + ii                                 # token - t0
    if ROTATE:
        x = _fwht_rows(x, G, DP, norm)
    s16, z16, sdiv, rcp, keep, zero = _group_params(x, None, 0, ASYM, False)
    code = _codes(x, zero[None, :], sdiv[None, :], rcp[None, :], keep[None, :], None, ASYM, False)
    dd = c0 + tl.arange(0, CB)
    k = (slab.to(tl.int64) * nblk + blk) * D + dd
    tl.store(scales_ptr + k, s16, mask=dd < D)
    bad = _nonfinite(s16.to(tl.float32))
    if ASYM:
        tl.store(zeros_ptr + k, z16, mask=dd < D)
        bad = bad | _nonfinite(zero)
    _flag_if(flag_ptr, (dd < D) & bad)
    jb = c0 // 2 + tl.arange(0, CB // 2)[None, :]
    tl.store(codes_ptr + slab.to(tl.int64) * row_bytes + (i * D) // 2 + jb, _pack(code, G, CB),
             mask=(i < S - t0) & (jb < D // 2))


@triton.jit
def decode_channel_kernel(codes_ptr, scales_ptr, zeros_ptr, out_ptr, flag_ptr, sb_ptr, ob_ptr, S, t0, D, row_bytes,
                          nblk, out_S, out_off, norm, DP: tl.constexpr, CB: tl.constexpr, G: tl.constexpr,
                          ASYM: tl.constexpr, ROTATE: tl.constexpr, SAT: tl.constexpr, BF16: tl.constexpr,
                          SB: tl.constexpr, EXP: tl.constexpr):
    """The inverse of encode_channel_kernel (CB channels a program), into ``out`` seen as (slabs, out_S, D) at token
    out_off. The checks and the sinks as in decode_token_kernel."""
    slab = tl.program_id(0)
    blk = tl.program_id(1)
    c0 = tl.program_id(2) * CB
    if SB > 0:
        if (blk == 0) & (tl.program_id(2) == 0):
            _copy_sinks(sb_ptr, ob_ptr, flag_ptr + 1, slab, t0 * D, t0 * D, out_S * D, out_off * D, SB, EXP)
    i = blk * G + tl.arange(0, G)[:, None]
    jb = c0 // 2 + tl.arange(0, CB // 2)[None, :]
    byte = tl.load(codes_ptr + slab.to(tl.int64) * row_bytes + (i * D) // 2 + jb,
                   mask=(i < S - t0) & (jb < D // 2), other=0)
    dd = c0 + tl.arange(0, CB)
    k = (slab.to(tl.int64) * nblk + blk) * D + dd
    scale = tl.load(scales_ptr + k, mask=dd < D, other=0.0).to(tl.float32)
    bad = ~(scale >= 0.0) | (scale == float("inf"))
    zero = tl.zeros_like(scale)
    if ASYM:
        zero = tl.load(zeros_ptr + k, mask=dd < D, other=0.0).to(tl.float32)
        bad = bad | _nonfinite(zero)
    _flag_if(flag_ptr, (dd < D) & bad)
    y = _dequant(_unpack(byte, G, CB), scale[None, :], zero[None, :], ASYM)
    if ROTATE:
        y = _fwht_rows(y, G, DP, norm)
    d = dd[None, :]
    _store_out(out_ptr + slab.to(tl.int64) * out_S * D + (out_off + t0) * D + i * D + d, y,
               (i < S - t0) & (d < D), SAT, BF16)
