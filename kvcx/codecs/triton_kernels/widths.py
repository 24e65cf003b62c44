"""Triton kernels of the widths codec (``kvcx.widths``, docs/FORMAT.md 2.4): the GPU twins of
``kvcx/codecs/cpu/widths.h``.

They write **the same record bytes** and decode **the same values** as the CPU kernels, so a widths record moves
between the host and a device unchanged. That needs widths.h's arithmetic exactly, in its order (the launcher turns
FP fusion off, as for the other codecs' kernels; the C kernels are built ``-std=c11``, which contracts nothing):

- a group's column minimum, maximum and mean over its tokens **in token order** (the minimum NaN-sticky, each taking
  the first of equal values as the CPU's comparisons do, so that -0.0 and +0.0 come out as there); the mean summed
  in FP32 token by token, then divided (correctly rounded) by the count;
- a slab's channel ranges over its groups in group order, and the spread (``rows * range * range`` summed in FP64);
- a group's parameters as ``kvcx_w_group_params``: every division correctly rounded (``div_rn``), floor and ceil of
  the range's 255-step grid, each clamp a comparison as in C (not a min/max, which may pick either zero);
- codes ``clamp(rint((x - low) * inv), 0, 2^w - 1)``, rint as the integer codec's (an FP32 sum at 1.5 * 2**23);
  decode ``base + step * code`` as a product then a sum, to the output dtype as the integer codec stores.

The widths of a tensor (which channels get how many bits) are chosen on the host from the spreads these kernels
compute (:meth:`kvcx.codecs.widths.WidthCodec.choose`: the same NumPy code for both backends), so both backends pick
the same widths. Under ``TRITON_INTERPRET=1`` the interpreter runs the kernels on CPU tensors.
"""
import triton
import triton.language as tl

from kvcx.codecs.triton_kernels.codec import _RINT_MAGIC, _store_out


@triton.jit
def w_stats_kernel(x_ptr, mn_ptr, mx_ptr, me_ptr, S, t0, G, ngroups, D: tl.constexpr, DP: tl.constexpr,
                   GS: tl.constexpr, P: tl.constexpr):
    """Groups [p P, p P + P) of the (slab, group) pairs (``k = slab * G + group``): the column min, max and mean of
    the group's tokens ``t0 + group * GS ...`` (``GS`` or the last group's fewer), into ``mn``/``mx``/``me`` at
    ``k * D`` (FP32). Token by token, as ``kvcx_w_colminmax``."""
    k = (tl.program_id(0) * P + tl.arange(0, P)).to(tl.int64)
    d = tl.arange(0, DP)
    valid = k < ngroups
    dm = d < D
    slab = k // G
    g = k % G
    rows = tl.minimum(GS, S - t0 - g * GS)
    base = (slab * S + t0 + g * GS) * D
    m2 = valid[:, None] & dm[None, :]
    v = tl.load(x_ptr + base[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
    mn = v
    mx = v
    me = v
    for r in range(1, GS):
        m = (valid & (r < rows))[:, None] & dm[None, :]
        v = tl.load(x_ptr + base[:, None] + r * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        mn = tl.where(m & ((v < mn) | (v != v)), v, mn)
        mx = tl.where(m & (v > mx), v, mx)
        me = tl.where(m, me + v, me)
    me = tl.math.div_rn(me, tl.where(valid, rows, 1).to(tl.float32)[:, None])
    at = k[:, None] * D + d[None, :]
    tl.store(mn_ptr + at, mn, mask=m2)
    tl.store(mx_ptr + at, mx, mask=m2)
    tl.store(me_ptr + at, me, mask=m2)


@triton.jit
def w_channels_kernel(mn_ptr, mx_ptr, lo_ptr, hi_ptr, spread_ptr, N, G, last_rows, D: tl.constexpr,
                      DP: tl.constexpr, GS: tl.constexpr, P: tl.constexpr):
    """Slabs [p P, p P + P): each channel's min and max over its groups (the minimum NaN-sticky) and its spread,
    ``rows * (max - min)^2`` summed over the groups in FP64, as ``kvcx_w_channels`` (group by group)."""
    n = (tl.program_id(0) * P + tl.arange(0, P)).to(tl.int64)
    d = tl.arange(0, DP)
    m2 = (n < N)[:, None] & (d < D)[None, :]
    first = n[:, None] * G * D + d[None, :]
    lo = tl.load(mn_ptr + first, mask=m2, other=0.0)
    hi = tl.load(mx_ptr + first, mask=m2, other=0.0)
    spread = tl.zeros((P, DP), dtype=tl.float64)
    for g in range(0, G):
        a = tl.load(mn_ptr + first + g * D, mask=m2, other=0.0)
        b = tl.load(mx_ptr + first + g * D, mask=m2, other=0.0)
        rows = tl.where(g == G - 1, last_rows, GS).to(tl.float64)
        r = b.to(tl.float64) - a.to(tl.float64)
        lo = tl.where((a < lo) | (a != a), a, lo)
        hi = tl.where(b > hi, b, hi)
        spread = spread + rows * r * r
    at = n[:, None] * D + d[None, :]
    tl.store(lo_ptr + at, lo, mask=m2)
    tl.store(hi_ptr + at, hi, mask=m2)
    tl.store(spread_ptr + at, spread, mask=m2)


@triton.jit
def _group(lo_ptr, hi_ptr, w_ptr, top_ptr, off_ptr, S, t0, G, D: tl.constexpr, DP: tl.constexpr, GS: tl.constexpr):
    """This program's group ``k = slab * G + group``: (k, slab, group, its tokens, the channels 0..DP and which are
    real, its slab's channel ranges lo / hi (FP16 values as FP32), largest codes, widths and plane offsets)."""
    k = tl.program_id(0).to(tl.int64)
    slab = k // G
    g = k % G
    rows = tl.minimum(GS, S - t0 - g * GS)
    d = tl.arange(0, DP)
    dm = d < D
    ch = slab * D + d
    lo = tl.load(lo_ptr + ch, mask=dm, other=0.0)
    hi = tl.load(hi_ptr + ch, mask=dm, other=0.0)
    top = tl.load(top_ptr + ch, mask=dm, other=0.0)
    w = tl.load(w_ptr + ch, mask=dm, other=0).to(tl.int32)
    off = tl.load(off_ptr + ch, mask=dm, other=0)
    return k, slab, g, rows, d, dm, lo, hi, top, w, off


@triton.jit
def w_encode_kernel(x_ptr, mn_ptr, mx_ptr, me_ptr, lo_ptr, hi_ptr, w_ptr, top_ptr, off_ptr, slab_off_ptr,
                    gbytes_ptr, codes_ptr, stats_at, planes_at, S, t0, G, D: tl.constexpr, DP: tl.constexpr,
                    GS: tl.constexpr):
    """Group ``k = slab * G + group`` (one a program): its range bytes (D x 2 at ``stats_at + k * D * 2``) and its
    block of bit planes (``planes_at + slab_off[slab] + group * gbytes[slab]``: channel d's ``w[d]`` planes of
    ``GS / 8`` bytes at ``off[d]``, bit j of the codes of the group's tokens, token t in bit t % 8 of byte t / 8),
    as ``kvcx_w_encode_tile``; lo / hi / w / top / off the slab's channel ranges (FP16 values as FP32), widths,
    largest codes and plane offsets."""
    k, slab, g, rows, d, dm, lo, hi, top, w, off = _group(lo_ptr, hi_ptr, w_ptr, top_ptr, off_ptr, S, t0, G, D, DP, GS)
    mean = tl.load(me_ptr + k * D + d, mask=dm, other=0.0)
    gmn = tl.where(top == 0.0, mean, tl.load(mn_ptr + k * D + d, mask=dm, other=0.0))
    gmx = tl.where(top == 0.0, mean, tl.load(mx_ptr + k * D + d, mask=dm, other=0.0))
    # kvcx_w_group_params
    span = tl.math.div_rn(hi - lo, 255.0)
    has = span > 0.0
    ok = tl.where(has, span, 1.0)
    a = tl.floor(tl.math.div_rn(gmn - lo, ok))
    b = tl.ceil(tl.math.div_rn(gmx - lo, ok))
    a = tl.where(has, a, 0.0)
    b = tl.where(has, b, 0.0)
    a = tl.where(a < 0.0, 0.0, a)
    a = tl.where(a > 255.0, 255.0, a)
    b = tl.where(b < a, a, b)
    b = tl.where(b > 255.0, 255.0, b)
    glo = lo + a * span
    step = tl.math.div_rn(lo + b * span - glo, tl.where(top > 1.0, top, 1.0))
    inv = tl.where((step > 0.0) & (top > 0.0), tl.math.div_rn(1.0, tl.where(step > 0.0, step, 1.0)), 0.0)
    st = codes_ptr + stats_at + k * D * 2 + 2 * d
    tl.store(st, a.to(tl.int32).to(tl.uint8), mask=dm)
    tl.store(st + 1, b.to(tl.int32).to(tl.uint8), mask=dm)
    # codes, token by channel
    t = tl.arange(0, GS)
    live = (t < rows)[:, None] & dm[None, :]
    x = tl.load(x_ptr + (slab * S + t0 + g * GS) * D + t[:, None] * D + d[None, :], mask=live,
                other=0.0).to(tl.float32)
    v = (x - glo[None, :]) * inv[None, :]
    v = (v + _RINT_MAGIC) - _RINT_MAGIC
    v = tl.where(v < 0.0, 0.0, v)
    v = tl.where(v > top[None, :], top[None, :], v)
    q = tl.where(live, v.to(tl.int32), 0)
    # bit planes: 8 tokens a byte
    q3 = tl.reshape(q, (GS // 8, 8, DP))
    shift = tl.arange(0, 8)[None, :, None]
    tb = tl.arange(0, GS // 8)
    block = codes_ptr + planes_at + tl.load(slab_off_ptr + slab) + g * tl.load(gbytes_ptr + slab)
    for j in tl.static_range(8):
        byte = tl.sum(((q3 >> j) & 1) << shift, axis=1)
        tl.store(block + off[None, :] + j * (GS // 8) + tb[:, None], byte.to(tl.uint8),
                 mask=(dm & (j < w))[None, :])


@triton.jit
def w_decode_kernel(codes_ptr, lo_ptr, hi_ptr, w_ptr, top_ptr, off_ptr, slab_off_ptr, gbytes_ptr, out_ptr,
                    stats_at, planes_at, S, t0, G, out_S, out_off, D: tl.constexpr, DP: tl.constexpr,
                    GS: tl.constexpr, SAT: tl.constexpr, BF16: tl.constexpr):
    """Group ``k = slab * G + group`` (one a program) decoded into ``out`` seen as (slabs, out_S, D) at token
    ``out_off + t0 + group * GS`` of its slab, as ``kvcx_w_decode_tile`` (the launcher checked once that every
    range byte pair is in order, as the encoder writes them: a decode step reads nothing back)."""
    k, slab, g, rows, d, dm, lo, hi, top, w, off = _group(lo_ptr, hi_ptr, w_ptr, top_ptr, off_ptr, S, t0, G, D, DP, GS)
    st = codes_ptr + stats_at + k * D * 2 + 2 * d
    sa = tl.load(st, mask=dm, other=0).to(tl.int32)
    sb = tl.load(st + 1, mask=dm, other=0).to(tl.int32)
    span = tl.math.div_rn(hi - lo, 255.0)
    glo = lo + sa.to(tl.float32) * span
    ghi = lo + sb.to(tl.float32) * span
    step = tl.where(top > 0.0, tl.math.div_rn(ghi - glo, tl.where(top > 0.0, top, 1.0)), 0.0)
    base = tl.where(top > 0.0, glo, (glo + ghi) * 0.5)
    t = tl.arange(0, GS)
    live = (t < rows)[:, None] & dm[None, :]
    block = codes_ptr + planes_at + tl.load(slab_off_ptr + slab) + g * tl.load(gbytes_ptr + slab)
    q = tl.zeros((GS, DP), dtype=tl.int32)
    for j in tl.static_range(8):
        byte = tl.load(block + off[None, :] + j * (GS // 8) + (t // 8)[:, None], mask=live & (j < w)[None, :],
                       other=0).to(tl.int32)
        q = q | (((byte >> (t % 8)[:, None]) & 1) << j)
    y = base[None, :] + step[None, :] * q.to(tl.float32)
    at = (slab * out_S + out_off + t0 + g * GS + t.to(tl.int64)) * D
    _store_out(out_ptr + at[:, None] + d[None, :], y, live, SAT, BF16)
