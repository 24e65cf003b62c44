"""Triton kernels of the lattice codec (``kvcx.e8p``, docs/FORMAT.md 2.8): the GPU twins of ``kvcx/codecs/cpu/e8p.h``.

They write **the same record bytes** and decode **the same values** as the CPU kernels, so an E8P record moves
between the host and a device unchanged. That needs e8p.h's arithmetic exactly, in its order (the launcher turns FP
fusion off, as for the integer codec's kernels: an FMA the compiler made would round once where the CPU rounds
twice; the C kernels are built ``-std=c11``, which contracts nothing):

- the rotation: the integer codec's Walsh-Hadamard butterflies (:func:`~kvcx.codecs.triton_kernels.codec._fwht_rows`,
  the CPU's order, then one product by ``1 / sqrt(D)``);
- the row's scale: the squares summed in FP64 **in the CPU's order** (coordinate 0 first: each step adds one
  coordinate's square, picked out of the row exactly), ``sqrt(ss / D) / 1.03`` in FP64 (correctly rounded), then
  FP32, then FP16 (round to nearest even): the search's scale; the values divided by it as the product with its
  correctly rounded reciprocal; the record's scale that FP16 scale times 1.09 in FP32, then FP16 (e8p.h's
  ``KVCX_E8P_GAIN``: an unbiased decode);
- the search: for each shift (+1/4 first) and each of the 256 patterns ``2 <|z|, |a|> - |a|^2``, less ``4 min |z_i
  a_i|`` where the signs would negate an odd count, summed coordinate by coordinate as the CPU does; the first
  pattern of the largest score (strictly larger replaces), shift -1/4 only where its score is strictly larger; the
  sign bits of the pattern's coordinates against the row's, the first coordinate of the least ``|z_i a_i|`` flipped
  back where odd;
- decode: each code's point ``+-pattern / 2 + shift`` times the scale, then the same rotation, then the output
  dtype (FP16 saturating, BF16 rounded on the bits: the integer codec's :func:`_store_out`).

Rows are the packed tokens in order: row ``r`` is slab ``r // (S - t0)``, token ``t0 + r % (S - t0)``; a record is
``D / 4 + 2`` bytes (``D / 8`` codes little-endian, then the FP16 scale). The exact sink tokens are copied by the
launcher (:mod:`kvcx.codecs.gpu_lattice`). Under ``TRITON_INTERPRET=1`` the interpreter runs them on CPU tensors.
"""
import triton
import triton.language as tl

from kvcx.codecs.triton_kernels.codec import _flag_if, _fwht_rows, _nonfinite, _store_out

PATTERNS: tl.constexpr = tl.constexpr(256)


@triton.jit
def e8p_scale_kernel(x_ptr, y_ptr, rec_ptr, flag_ptr, S, t0, rows, norm, rms, gain, D: tl.constexpr,
                     R: tl.constexpr):
    """Rows [p R, p R + R): each rotated, its FP16 scale written as its record's last two bytes and the rotated row
    over the scale into ``y`` (FP32, rows x D) for :func:`e8p_search_kernel`. ``flag_ptr[0]`` set where a value is
    NaN or Inf, ``flag_ptr[1]`` where a scale passes FP16."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    d = tl.arange(0, D)
    valid = r < rows
    Sq = S - t0
    src = ((r // Sq).to(tl.int64) * S + t0 + r % Sq) * D
    x = tl.load(x_ptr + src[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    _flag_if(flag_ptr, valid[:, None] & _nonfinite(x))
    x = _fwht_rows(x, R, D, norm)
    sq = x.to(tl.float64) * x.to(tl.float64)
    ss = tl.zeros((R,), dtype=tl.float64)
    for i in range(D):   # coordinate by coordinate, as the CPU sums (a row with one term left is summed exactly)
        ss += tl.sum(tl.where(d[None, :] == i, sq, 0.0), axis=1)
    s = (tl.sqrt(ss / D) / rms).to(tl.float32)   # FP64: sqrt.rn.f64 and div.rn.f64 (the PTX test)
    _flag_if(flag_ptr + 1, valid & ~(s * gain <= 65504.0))
    sq16 = s.to(tl.float16).to(tl.float32)
    s16 = (sq16 * gain).to(tl.float16)   # the scale the record decodes with (unbiased: e8p.h's KVCX_E8P_GAIN)
    inv = tl.where(sq16 > 0.0, tl.math.div_rn(1.0, tl.where(sq16 > 0.0, sq16, 1.0)), 0.0)
    y = x * inv[:, None]
    y = tl.where(_nonfinite(y), 0.0, y)   # a row the launcher refuses (flagged): searched as zeros, never NaN
    tl.store(y_ptr + r.to(tl.int64)[:, None] * D + d[None, :], y, mask=valid[:, None])
    bits = s16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    rec = r.to(tl.int64) * (D // 4 + 2) + D // 4
    tl.store(rec_ptr + rec, (bits & 0xFF).to(tl.uint8), mask=valid)
    tl.store(rec_ptr + rec + 1, (bits >> 8).to(tl.uint8), mask=valid)


@triton.jit
def _shift_search(y_ptr, v, valid, abs_ptr, norm2_ptr, negpar_ptr, grid_ptr, SHIFT: tl.constexpr,
                  V: tl.constexpr):
    """(score, code) of the nearest point of E8 + ``SHIFT`` (0: +1/4, 1: -1/4) to each of the V vectors ``v``."""
    t = -0.25 if SHIFT else 0.25
    k = tl.arange(0, PATTERNS)
    dot = tl.zeros((V, PATTERNS), dtype=tl.float32)
    lo = tl.full((V, PATTERNS), float("inf"), dtype=tl.float32)
    zz = tl.zeros((V,), dtype=tl.float32)
    zneg = tl.zeros((V,), dtype=tl.int32)
    for i in tl.static_range(8):
        z = tl.load(y_ptr + v * 8 + i, mask=valid, other=0.0) - t
        za = tl.abs(z)
        zz += z * z
        zneg = zneg ^ (z < 0.0).to(tl.int32)
        pr = za[:, None] * tl.load(abs_ptr + i * PATTERNS + k)[None, :]
        dot += pr
        lo = tl.minimum(lo, pr)
    odd = zneg[:, None] ^ tl.load(negpar_ptr + k)[None, :]
    score = 2.0 * dot - tl.load(norm2_ptr + k)[None, :]
    score = score - tl.where(odd != 0, 4.0 * lo, 0.0)
    kb = tl.argmax(score, axis=1, tie_break_left=True)
    best = tl.max(score, axis=1) - zz
    flips = tl.zeros((V,), dtype=tl.int32)
    pmin = tl.full((V,), float("inf"), dtype=tl.float32)
    jmin = tl.zeros((V,), dtype=tl.int32)
    for i in tl.static_range(8):
        z = tl.load(y_ptr + v * 8 + i, mask=valid, other=0.0) - t
        a = 0.5 * tl.load(grid_ptr + kb * 8 + i).to(tl.float32)
        flips = flips | ((z * a < 0.0).to(tl.int32) << i)
        p = tl.abs(z) * tl.abs(a)
        jmin = tl.where(p < pmin, i, jmin)
        pmin = tl.where(p < pmin, p, pmin)
    flips = tl.where((zneg ^ tl.load(negpar_ptr + kb)) != 0, flips ^ (1 << jmin), flips)
    return best, kb | ((flips & 0x7F) << 8) | (SHIFT << 15)


@triton.jit
def e8p_search_kernel(y_ptr, rec_ptr, abs_ptr, norm2_ptr, negpar_ptr, grid_ptr, nvec, D: tl.constexpr,
                      V: tl.constexpr):
    """Vectors [p V, p V + V) of 8 values of ``y`` (row ``v // (D / 8)``, code ``v % (D / 8)``): each one's nearest
    point of E8P, its 16-bit code written little-endian into the row's record. The tables: the patterns' absolute
    values by coordinate (``abs``, 8 x 256), their norms, the parity of their negative coordinates, the patterns
    twice (int8, 256 x 8)."""
    v = (tl.program_id(0) * V + tl.arange(0, V)).to(tl.int64)
    valid = v < nvec
    best0, code0 = _shift_search(y_ptr, v, valid, abs_ptr, norm2_ptr, negpar_ptr, grid_ptr, 0, V)
    best1, code1 = _shift_search(y_ptr, v, valid, abs_ptr, norm2_ptr, negpar_ptr, grid_ptr, 1, V)
    code = tl.where(best1 > best0, code1, code0)
    at = (v // (D // 8)) * (D // 4 + 2) + (v % (D // 8)) * 2
    tl.store(rec_ptr + at, (code & 0xFF).to(tl.uint8), mask=valid)
    tl.store(rec_ptr + at + 1, ((code >> 8) & 0xFF).to(tl.uint8), mask=valid)


@triton.jit
def e8p_decode_kernel(rec_ptr, out_ptr, flag_ptr, grid_ptr, rows, Sq, out_S, out_off, norm, D: tl.constexpr,
                      R: tl.constexpr, SAT: tl.constexpr, BF16: tl.constexpr):
    """Rows [p R, p R + R) decoded into ``out`` seen as (slabs, out_S, D), row r at token ``out_off + r % Sq`` of
    slab ``r // Sq`` (``out_off``: the tensor's token ``t0`` there). ``flag_ptr[0]`` set where a scale is negative,
    NaN or Inf (no encoder writes one)."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    valid = r < rows
    rec = r.to(tl.int64) * (D // 4 + 2)
    lo = tl.load(rec_ptr + rec + D // 4, mask=valid, other=0).to(tl.int32)
    hi = tl.load(rec_ptr + rec + D // 4 + 1, mask=valid, other=0).to(tl.int32)
    s = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    _flag_if(flag_ptr, valid & (~(s >= 0.0) | (s == float("inf"))))
    j = tl.arange(0, D // 8)
    c = tl.load(rec_ptr + rec[:, None] + 2 * j[None, :], mask=valid[:, None], other=0).to(tl.int32) | \
        (tl.load(rec_ptr + rec[:, None] + 2 * j[None, :] + 1, mask=valid[:, None], other=0).to(tl.int32) << 8)
    sg = (c >> 8) & 0x7F
    par = sg ^ (sg >> 4)
    par = par ^ (par >> 2)
    par = (par ^ (par >> 1)) & 1
    flips = sg | (par << 7)
    ii = tl.arange(0, 8)
    g = tl.load(grid_ptr + (c & 0xFF)[:, :, None] * 8 + ii[None, None, :]).to(tl.float32)
    sign = tl.where(((flips[:, :, None] >> ii[None, None, :]) & 1) != 0, -0.5, 0.5)
    shift = tl.where(((c >> 15) & 1) != 0, -0.25, 0.25)
    y = (sign * g + shift[:, :, None]) * s[:, None, None]
    y = _fwht_rows(tl.reshape(y, (R, D)), R, D, norm)
    d = tl.arange(0, D)
    at = ((r // Sq).to(tl.int64) * out_S + out_off + r % Sq) * D
    _store_out(out_ptr + at[:, None] + d[None, :], y, valid[:, None], SAT, BF16)
