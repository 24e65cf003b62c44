"""Triton kernels of the fused decode attention over packed 4-bit codes (flash-decoding along the context, then a
merge of the splits with the exact tokens, :mod:`kvcx.codecs.triton_kernels.merge`): :mod:`kvcx.codecs.gpu` checks,
allocates and launches them
(:func:`~kvcx.codecs.gpu_attn.attend_spans`). The codes and scales are read as the codec kernels of
:mod:`kvcx.codecs.triton_kernels.codec` write them. Imported only when a tensor goes to the Triton backend; under
``TRITON_INTERPRET=1`` Triton's interpreter runs the same kernels on CPU tensors (the tests do).
"""
import triton
import triton.language as tl
try:   # programmatic dependent launch (Triton 3.4 on): without it the merge is launched after the attention
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # pragma: no cover
    gdc_launch_dependents = None

from kvcx.codecs.triton_kernels.merge import merge_kernel  # noqa: F401  (the launchers take both from here)
from kvcx.codecs.triton_kernels.products import _absmax, _codes16, _dot3, _fixed, _max_nan, _mm, _mmc, _softcap, _unit


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tile_bytes(row, tb, c_off, tt, t_end, D: tl.constexpr):
    """The packed bytes [BT, D // 2] of the tile from token ``tb`` of a slab's row (0 past ``t_end``)."""
    return tl.load(row + tb * (D // 2) + c_off, mask=(tb + tt < t_end)[:, None], other=0)


@triton.jit
def _streams(b, DOT: tl.constexpr):
    """A tile of packed bytes -> (even, odd) channel codes minus 8 (centred: -8..7), the low and the high nibbles,
    as :func:`_mmc` takes them for ``DOT``: for "int8x3" 16 (c - 8) as int8 (the nibble's top bit flipped, put in
    the byte's top half: an operation or two a word of four codes); else as float32, each put in the low mantissa
    bits of 2**23 and 2**23 + 8 subtracted (exact; no integer-to-float conversions). Centred codes keep the
    products' terms from cancelling: sum(p s c) - 8 sum(p s) would lose the bits that a product in TF32 or BF16
    rounds away, more with every token."""
    if DOT == "int8x3":   # a nibble's top bit flipped is c - 8 as 4-bit two's complement: in a byte's top half
        lo = ((b ^ 8) << 4).to(tl.int8)     # 16 (c - 8), with byte-wise operations that work on words
        hi = ((b ^ 128) & 240).to(tl.int8)
    else:
        b = b.to(tl.int32)
        lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return lo, hi


@triton.jit
def _channel_params(s_ptr, z_ptr, j, ASYM: tl.constexpr):
    """A per-channel block's scales and offsets (FP32), even and odd channels: (se, so, ze, zo), so that a value is
    ``(code - 8) * s + z`` (z: the zero point + 8 s; 0 without zero points)."""
    se = tl.load(s_ptr + 2 * j).to(tl.float32)
    so = tl.load(s_ptr + 2 * j + 1).to(tl.float32)
    ze = tl.zeros_like(se)
    zo = tl.zeros_like(so)
    if ASYM:
        ze = tl.load(z_ptr + 2 * j).to(tl.float32) + 8.0 * se
        zo = tl.load(z_ptr + 2 * j + 1).to(tl.float32) + 8.0 * so
    return se, so, ze, zo


@triton.jit
def _token_params(s_ptr, z_ptr, off, mask, ASYM: tl.constexpr, MASKED: tl.constexpr):
    """Per-token groups' scales and offsets at offsets ``off`` (FP32), a value being ``(code - 8) * s + z`` (z: the
    zero point + 8 s; 0 without zero points); ``mask``-ed where ``MASKED`` (a partial tile)."""
    if MASKED:
        sc = tl.load(s_ptr + off, mask=mask, other=0.0).to(tl.float32)
    else:
        sc = tl.load(s_ptr + off).to(tl.float32)
    zc = tl.zeros_like(sc)
    if ASYM:
        if MASKED:
            zc = tl.load(z_ptr + off, mask=mask, other=0.0).to(tl.float32) + 8.0 * sc
        else:
            zc = tl.load(z_ptr + off).to(tl.float32) + 8.0 * sc
    return sc, zc


@triton.jit
def _tile(kb, vb, tb, tm, tt, j, g, he, ho, qe, qo, q_unit, ksr, kzr, vsr, vzr, kg_off, vg_off, mask_row,
          m_i, l_i, a_e, a_o, cz, u_acc, v_top, RP: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
          KG: tl.constexpr, K_CHANNEL: tl.constexpr, K_ASYM: tl.constexpr, VG: tl.constexpr, V_CHANNEL: tl.constexpr,
          V_ASYM: tl.constexpr, HAS_MASK: tl.constexpr, DOT: tl.constexpr, NG: tl.constexpr, ASM: tl.constexpr,
          MASKED: tl.constexpr, SOFTCAP: tl.constexpr = 0.0):
    """One tile of :func:`attend_packed_kernel`'s loop: the tile's packed bytes ``kb``, ``vb`` (from token ``tb``)
    into the running max ``m_i`` and sum ``l_i``, the accumulators and their units; returns them. ``MASKED``: the
    split's last tile, partial (``tm``: its tokens before the end; the others are whole: no masks, no selects)."""
    if DOT == "fp16":
        klo, khi = _codes16(kb, ASM)
    else:
        klo, khi = _streams(kb, DOT if K_CHANNEL else "")   # per-token keys: dequantized here
    if K_CHANNEL:
        se, so, ze, zo = _channel_params(ksr + (tb // KG) * D, kzr + (tb // KG) * D, j, K_ASYM)
        if DOT == "fp16":     # the scaled query rounded to FP16 once, both streams' products in one sum; the zero
            # points' term from the same normalised rows (the raw query's rows are not kept: registers)
            s = tl.dot((ho * so[None, :]).to(tl.float16), tl.trans(khi),
                       tl.dot((he * se[None, :]).to(tl.float16), tl.trans(klo),
                              tl.zeros([RP * NG, BT], tl.float32)))
            s = s * q_unit[:, None] + (tl.sum(he * ze[None, :] + ho * zo[None, :], axis=1) * q_unit)[:, None]
        else:
            bias = tl.broadcast_to(tl.sum(qe * ze[None, :] + qo * zo[None, :], axis=1)[:, None], (RP * NG, BT))
            if DOT == "int8x3":   # both streams in one fixed point (:func:`_fixed`), one conversion to FP32
                ae, ao = qe * se[None, :], qo * so[None, :]
                inv, unit = _unit(_max_nan(_absmax(ae), _absmax(ao)))
                e0, e1, e2 = _fixed(ae, inv)
                o0, o1, o2 = _fixed(ao, inv)
                s = (_dot3(e0, e1, e2, tl.trans(klo)) + _dot3(o0, o1, o2, tl.trans(khi))).to(tl.float32) * \
                    unit[:, None] + bias
            else:
                s = _mmc(qo * so[None, :], tl.trans(khi), _mmc(qe * se[None, :], tl.trans(klo), bias, DOT), DOT)
    else:
        sc, zc = _token_params(ksr, kzr, tb * D // KG + kg_off, tm[:, None], K_ASYM, MASKED)
        s = _mm(qe, tl.trans(klo * sc + zc), tl.zeros([RP * NG, BT], tl.float32), DOT)
        s = _mm(qo, tl.trans(khi * sc + zc), s, DOT)
    if SOFTCAP > 0:
        s = _softcap(s, SOFTCAP, DOT == "fp16")
    if HAS_MASK:
        if MASKED:
            add = tl.load(mask_row + tb + tt, mask=tm, other=0.0)
        else:
            add = tl.load(mask_row + tb + tt)
        s += (add * LOG2E if DOT == "fp16" else add)[None, :]
    if MASKED:
        s = tl.where(tm[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)      # a row with nothing to attend to yet
    if DOT == "fp16":
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
    else:
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT == "fp16":
        vlo, vhi = _codes16(vb, ASM)
    else:
        vlo, vhi = _streams(vb, DOT)
    if V_CHANNEL:
        se, so, ze, zo = _channel_params(vsr + (tb // VG) * D, vzr + (tb // VG) * D, j, V_ASYM)
        psum = tl.sum(p, axis=1)[:, None]
        zero = tl.zeros([RP * NG, D // 2], tl.float32)
        if DOT == "fp16":   # p <= 1: FP16 keeps 11 bits of every weight that counts (those over 2**-14)
            ph = p.to(tl.float16)
            a_e = a_e * alpha[:, None] + tl.dot(ph, vlo, zero) * se[None, :] + psum * ze[None, :]
            a_o = a_o * alpha[:, None] + tl.dot(ph, vhi, zero) * so[None, :] + psum * zo[None, :]
        else:
            a_e = a_e * alpha[:, None] + _mmc(p, vlo, zero, DOT) * se[None, :] + psum * ze[None, :]
            a_o = a_o * alpha[:, None] + _mmc(p, vhi, zero, DOT) * so[None, :] + psum * zo[None, :]
    elif DOT == "fp16":
        sc, zc = _token_params(vsr, vzr, tb * D // VG + vg_off, tm[None, :], V_ASYM, MASKED)   # [NG, BT]
        if V_ASYM:
            zr = tl.reshape(tl.broadcast_to(zc[:, None, :], (NG, RP, BT)), (RP * NG, BT))
            cz = cz * alpha + tl.sum(p * zr, axis=1)
        # the scales after one power of two (the largest read so far at most 2**15, so that the weights p s
        # fit FP16); the accumulators move to a new unit (a power of two, never smaller: exact, no overflow)
        # with the softmax's own rescaling. tl.max skips a NaN scale: its tokens' weights p s are NaN, and so is
        # the output (a reduction that kept NaN would take a combine function of its own, which Triton's
        # interpreter runs element by element)
        v_top = _max_nan(v_top, tl.max(tl.reshape(sc, (NG * BT,)), 0))
        inv, unit = _unit(v_top, 15)
        w = p * tl.reshape(tl.broadcast_to((sc * inv)[:, None, :], (NG, RP, BT)), (RP * NG, BT))
        f = (alpha * (u_acc / unit))[:, None]
        wh = w.to(tl.float16)
        a_e = tl.dot(wh, vlo, a_e * f)
        a_o = tl.dot(wh, vhi, a_o * f)
        u_acc = unit
    else:
        sc, zc = _token_params(vsr, vzr, tb * D // VG + vg_off, tm[None, :], V_ASYM, MASKED)   # [NG, BT]
        w = p * tl.reshape(tl.broadcast_to(sc[:, None, :], (NG, RP, BT)), (RP * NG, BT))   # (g, r): p[r] s[g]
        if V_ASYM:
            zr = tl.reshape(tl.broadcast_to(zc[:, None, :], (NG, RP, BT)), (RP * NG, BT))
            cz = cz * alpha + tl.sum(p * zr, axis=1)
        a_e = _mmc(w, vlo, a_e * alpha[:, None], DOT)
        a_o = _mmc(w, vhi, a_o * alpha[:, None], DOT)
    return m_new, l_i, a_e, a_o, cz, u_acc, v_top


@triton.jit
def _tile_scales(ksr, kzr, vsr, vzr, tb, tm, j, vcol_off, D: tl.constexpr, KG: tl.constexpr, K_ASYM: tl.constexpr,
                 VG: tl.constexpr, V_ASYM: tl.constexpr, MASKED: tl.constexpr):
    """The scales and offsets :func:`_tile_t` takes for the tile from token ``tb``: the keys' block's per channel
    (even, odd: :func:`_channel_params`) and the values' per token and group ([BT, NG]: :func:`_token_params`,
    ``tm``-masked where ``MASKED``), all issued together (each load's wait then overlaps the others')."""
    se, so, ze, zo = _channel_params(ksr + (tb // KG) * D, kzr + (tb // KG) * D, j, K_ASYM)
    sc, zc = _token_params(vsr, vzr, tb * D // VG + vcol_off, tm[:, None], V_ASYM, MASKED)
    return se, so, ze, zo, sc, zc


@triton.jit
def _tile_t(kb, vb, tb, tm, tt, j, heT, hoT, q_unit, ksr, kzr, vsr, vzr, vcol_off, se, so, ze, zo, sc, zc, mask_row,
            m_i, l_i, oe, oo, cz, u_acc, v_top, RP: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, KG: tl.constexpr,
            K_ASYM: tl.constexpr, VG: tl.constexpr, V_ASYM: tl.constexpr, HAS_MASK: tl.constexpr, NG: tl.constexpr,
            ASM: tl.constexpr, MASKED: tl.constexpr, GIVEN: tl.constexpr, SOFTCAP: tl.constexpr = 0.0):
    """One tile of the fast mode transposed (``TRANS``: per-channel keys, per-token values): the tokens are the
    products' long side (M) and the RP x NG product columns (g, r) their short one (N, 8 or more), so that the
    softmax, the weights and the accumulators hold no padding rows to fill tl.dot's 16: scores^T [BT, NT] =
    codes [BT, D / 2] @ (query times the block's scales)^T, accumulators^T [D / 2, NT] += codes^T @ weights^T.
    The block's and the tokens' scales and offsets (:func:`_tile_scales`) are ``se`` .. ``zc`` where ``GIVEN``
    (loaded ahead), else loaded here from ``ksr`` .. ``vcol_off``, each where it is first used."""
    NT: tl.constexpr = RP * NG
    klo, khi = _codes16(kb, ASM)
    if not GIVEN:
        se, so, ze, zo = _channel_params(ksr + (tb // KG) * D, kzr + (tb // KG) * D, j, K_ASYM)
    s = tl.dot(khi, (hoT * so[:, None]).to(tl.float16),
               tl.dot(klo, (heT * se[:, None]).to(tl.float16), tl.zeros([BT, NT], tl.float32)))
    b = tl.sum(heT * ze[:, None] + hoT * zo[:, None], axis=0)
    s = s * q_unit[None, :] + (b * q_unit)[None, :]
    if SOFTCAP > 0:
        s = _softcap(s, SOFTCAP, True)
    if HAS_MASK:
        if MASKED:
            add = tl.load(mask_row + tb + tt, mask=tm, other=0.0)
        else:
            add = tl.load(mask_row + tb + tt)
        s += (add * LOG2E)[:, None]
    if MASKED:
        s = tl.where(tm[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)      # a column with nothing to attend to yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    vlo, vhi = _codes16(vb, ASM)
    if not GIVEN:
        sc, zc = _token_params(vsr, vzr, tb * D // VG + vcol_off, tm[:, None], V_ASYM, MASKED)   # [BT, NG]
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BT, NG, RP)), (BT, NT))      # column (g, r): group g's
    if V_ASYM:
        zc = tl.reshape(tl.broadcast_to(zc[:, :, None], (BT, NG, RP)), (BT, NT))
        cz = cz * alpha + tl.sum(p * zc, axis=0)
    v_top = _max_nan(v_top, tl.max(tl.reshape(sc, (BT * NT,)), 0))
    inv, unit = _unit(v_top, 15)
    w = (p * (sc * inv)).to(tl.float16)
    f = (alpha * (u_acc / unit))[None, :]
    oe = tl.dot(tl.trans(vlo), w, oe * f)
    oo = tl.dot(tl.trans(vhi), w, oo * f)
    return m_new, l_i, oe, oo, cz, unit, v_top


@triton.jit
def _rows(kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, page_row,
          tb, n, Hkv, PAGE: tl.constexpr, D: tl.constexpr, KG: tl.constexpr, K_CHANNEL: tl.constexpr,
          VG: tl.constexpr, V_CHANNEL: tl.constexpr):
    """The row pointers of the tile from token ``tb``: the slab's own (``PAGE`` 0), or for a paged store its page's
    (from the block table's row ``page_row``), such that token tb's offsets land at its place in the page."""
    if PAGE:
        slot = tl.load(page_row + tb // PAGE).to(tl.int64) * Hkv + n % Hkv
        first = tb - tb % PAGE
        ksr, kzr = _page_params(ks_ptr, kz_ptr, slot, first, PAGE, D, KG, K_CHANNEL)
        vsr, vzr = _page_params(vs_ptr, vz_ptr, slot, first, PAGE, D, VG, V_CHANNEL)
        return (kc_ptr + slot * (PAGE * D // 2) - first * (D // 2), vc_ptr + slot * (PAGE * D // 2) - first * (D // 2),
                ksr, kzr, vsr, vzr)
    else:
        return kc_row, vc_row, ks_row, kz_row, vs_row, vz_row


# integer arguments that change from one decode step to the next (the mask's width, the residual's length) or at a
# flush (the tokens, the splits): Triton specializes a kernel on whether an integer is 1 or a multiple of 16 and
# compiles it again for each new combination, a second or more in the middle of a generation; these are passed as
# they are (the row strides that set the loads' alignment keep their specialization: they change in whole units)
_STEP_ARGS = ("T", "T2", "k_nsc", "k_nsc2", "mask_stride", "mask_off", "mask_off2", "n_first", "sp_off", "SPT",
              "pages_stride")


@triton.jit(do_not_specialize=_STEP_ARGS)
def attend_packed_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kc2_ptr, ks2_ptr, kz2_ptr, vc2_ptr,
                         vs2_ptr, vz2_ptr, q_scale, mask_ptr, m_ptr, l_ptr, acc_ptr, Hkv, mask_stride, T, T2,
                         k_row_bytes, k_row_bytes2, v_row_bytes, v_row_bytes2, k_nsc, k_nsc2, v_nsc, v_nsc2, mask_off,
                         mask_off2, per_split, n_first, sp_off, SPT, pages_ptr, lens_ptr, pages_stride,
                         R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                         KG: tl.constexpr, K_CHANNEL: tl.constexpr, K_ASYM: tl.constexpr,
                         VG: tl.constexpr, V_CHANNEL: tl.constexpr, V_ASYM: tl.constexpr, HAS_MASK: tl.constexpr,
                         DOT: tl.constexpr, NG: tl.constexpr, PREFETCH: tl.constexpr, ASM: tl.constexpr,
                         PAGE: tl.constexpr, TRANS: tl.constexpr, EARLY: tl.constexpr = False,
                         PDL: tl.constexpr = False, AHEAD: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0):
    """Flash-decoding over packed codes: program (slab n = batch row x KV head, split sp) reads its KV head's
    packed tokens [sp * per_split, (sp + 1) * per_split) once for the R query rows that share it (q times
    ``q_scale``, in any float dtype; rotated already where the keys are), BT tokens a tile (within one per-channel
    block: BT divides KG), and writes the split's running max, sum and (rotated where the values are) FP32
    accumulator at split ``sp_off + sp`` of ``SPT`` per slab (the spans of a store share the buffers);
    :func:`merge_kernel` merges the splits with the exact tokens (sinks, residual). ``NG``: value groups per
    token (1 for per-channel values). One launch reads two spans of the same layout (a store's segments, one
    after the other): splits from ``n_first`` on read the second (the arguments named ``2``; its ``T2`` tokens at
    mask column ``mask_off2``), so that the spans' programs run side by side, not one launch after another.
    Few instructions per code (what was tried, measured: docs/RESULTS.md):

    - the packed bytes are two streams, even channels (low nibbles) and odd channels (high nibbles): nothing is
      interleaved; the query and the accumulator are split alike;
    - codes become centred floats c = code - 8 by their bits (:func:`_streams`) and go into the products as they
      are: per-channel blocks' scales fold into the query (``q . (c s + z) = (q s) . c + q . z``; a tile of BT
      tokens lies in one block), per-token groups' value scales into the weights: row (g, r) of the weights is
      ``p[r] * s[:, g]`` and multiplies every code; the accumulator's row (g, r) is kept for the channels of
      group g at the end, with the zero points' term (``sum(p z)``) accumulated beside it;
    - so every product has RP x NG rows, query row r once per value group g (its scores computed NG times over):
      the launcher pads the R query rows to RP only as far as tl.dot's 16 rows need, RP x NG >= 16, so that
      value groups fill rows that would be padding (the default's 4 query rows and 2 groups: 16 rows, not 32);
    - per-token key groups (the reference scheme) dequantize in the tile.

    ``DOT`` "fp16" (the fast mode): the codes as FP16 (:func:`_codes16`; ``ASM``: in PTX) on the FP16 tensor
    cores with FP32 sums, the other side rounded to FP16 after a power of two of its own: the keys' scaled query
    a row's (11 bits of each term, as a BF16 model's query times the scale would need 16), the values' weights p s
    a tile's (the scales' largest; p <= 1): the products round where FlashAttention's P V rounds, no more; per-token
    keys take "tf32x2" (:func:`~kvcx.codecs.gpu_attn.attention_constexprs`). "tf32x2": products of codes in two TF32
    passes (FP32's accuracy); "tf32": one; "": FP32 sums; "int8x3" (the exact mode): the codes as int8 on the
    integer tensor cores, the other side a 21-bit fixed point of its row (:func:`_mm_int8x3`; the keys' two
    streams share one fixed point and one conversion to FP32).
    ``PREFETCH`` (not ``TRANS``): the next tile's codes are loaded before this tile is worked (in flight meanwhile).

    ``PAGE`` (a paged store, :mod:`kvcx.codecs.paged`; 0: rows as above): the buffers hold pages of ``PAGE`` tokens,
    page p's KV head h at slot p x Hkv + h (codes [slots, PAGE D / 2], scales and zero points a slot's groups), and
    slab n = b x Hkv + h reads its tokens through the block table row b (``pages_ptr``, ``pages_stride`` a row) up
    to ``lens_ptr[b]``: a tile lies within a page (BT divides PAGE); one span, no ``PREFETCH``.

    ``TRANS`` (the fast mode with per-channel keys and per-token values: :func:`_tile_t`): the products
    transposed, the tile's tokens their long side and the RP x NG columns (value group, query row) their short one,
    so that nothing but the products holds padding rows; otherwise :func:`_rows_path` runs the split as above.
    ``EARLY`` (``TRANS``): the first tile loaded before the query (a masked tile), in flight while the query's loads
    are awaited. ``AHEAD`` (``TRANS``): each tile's scales and offsets loaded with the tile before it (their loads
    in flight while that tile is worked: Triton pipelines the codes' loads, not these). ``PDL``: the merge may
    launch at once (a dependent launch; it waits for this grid's splits). ``SOFTCAP`` > 0: each score s becomes
    SOFTCAP tanh(s / SOFTCAP) before the mask (Gemma 2's logit softcapping; :func:`_softcap`)."""
    n = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    g_sp = tl.program_id(1)                  # the split among the launch's, and among the span's
    second = g_sp >= n_first
    sp = tl.where(second, g_sp - n_first, g_sp)
    T = tl.where(second, T2, T)
    k_row_bytes = tl.where(second, k_row_bytes2, k_row_bytes)
    v_row_bytes = tl.where(second, v_row_bytes2, v_row_bytes)
    k_nsc, v_nsc = tl.where(second, k_nsc2, k_nsc), tl.where(second, v_nsc2, v_nsc)
    mask_off = tl.where(second, mask_off2, mask_off)
    kc_ptr, vc_ptr = tl.where(second, kc2_ptr, kc_ptr), tl.where(second, vc2_ptr, vc_ptr)
    ks_ptr, kz_ptr = tl.where(second, ks2_ptr, ks_ptr), tl.where(second, kz2_ptr, kz_ptr)
    vs_ptr, vz_ptr = tl.where(second, vs2_ptr, vs_ptr), tl.where(second, vz2_ptr, vz_ptr)
    page_row = pages_ptr + (n // Hkv).to(tl.int64) * pages_stride     # a paged store's row of the block table
    if PAGE:   # the slab's batch row: its tokens
        T = tl.load(lens_ptr + n // Hkv)
    r = tl.arange(0, RP)
    rm = r < R
    j = tl.arange(0, D // 2)
    tt = tl.arange(0, BT)
    g = tl.arange(0, NG)
    t_begin = sp * per_split
    t_end = tl.minimum(T, t_begin + per_split)
    mask_row = mask_ptr + (n // Hkv).to(tl.int64) * mask_stride + mask_off
    kc_row = kc_ptr + n.to(tl.int64) * k_row_bytes
    vc_row = vc_ptr + n.to(tl.int64) * v_row_bytes
    ks_row = ks_ptr + n.to(tl.int64) * k_nsc * (D if K_CHANNEL else 1)
    kz_row = kz_ptr + n.to(tl.int64) * k_nsc * (D if K_CHANNEL else 1)
    vs_row = vs_ptr + n.to(tl.int64) * v_nsc * (D if V_CHANNEL else 1)
    vz_row = vz_ptr + n.to(tl.int64) * v_nsc * (D if V_CHANNEL else 1)
    c_off = tt[:, None] * (D // 2) + j[None, :]
    if TRANS:   # the fast mode transposed (:func:`_tile_t`): columns (g, r) of the query rows, r fastest
        if EARLY:   # the first tile's loads issued first
            kcr, vcr, ksr0, kzr0, vsr0, vzr0 = _rows(kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, kc_ptr, vc_ptr,
                                                     ks_ptr, kz_ptr, vs_ptr, vz_ptr, page_row, t_begin, n, Hkv, PAGE,
                                                     D, KG, K_CHANNEL, VG, V_CHANNEL)
            kb0, vb0 = _tile_bytes(kcr, t_begin, c_off, tt, t_end, D), _tile_bytes(vcr, t_begin, c_off, tt, t_end, D)
        cn = tl.arange(0, RP * NG)
        q_col = q_ptr + (n.to(tl.int64) * R + (cn % RP)[None, :]) * D + 2 * j[:, None]
        qe = tl.load(q_col, mask=(cn % RP < R)[None, :], other=0.0).to(tl.float32) * q_scale
        qo = tl.load(q_col + 1, mask=(cn % RP < R)[None, :], other=0.0).to(tl.float32) * q_scale
        q_inv, q_unit = _unit(_max_nan(_absmax(qe, 0), _absmax(qo, 0)), -1)
        heT, hoT = qe * q_inv[None, :], qo * q_inv[None, :]
        q_unit = q_unit * LOG2E
        m_i = tl.full([RP * NG], float("-inf"), tl.float32)
        l_i = tl.zeros([RP * NG], tl.float32)
        oe = tl.zeros([D // 2, RP * NG], tl.float32)
        oo = tl.zeros([D // 2, RP * NG], tl.float32)
        cz = tl.zeros([RP * NG], tl.float32)
        u_acc = tl.full((), 1.0, tl.float32)
        v_top = tl.zeros((), tl.float32)
        vcol_off = (tt[:, None] * D) // VG + g[None, :]
        t_first = t_begin
        if EARLY:
            if t_begin < t_end:   # (a paged store's split past its row's length reads nothing: no scales either)
                m_i, l_i, oe, oo, cz, u_acc, v_top = _tile_t(
                    kb0, vb0, t_begin, t_begin + tt < t_end, tt, j, heT, hoT, q_unit, ksr0, kzr0, vsr0, vzr0,
                    vcol_off, 0, 0, 0, 0, 0, 0, mask_row, m_i, l_i, oe, oo, cz, u_acc, v_top, RP, D, BT, KG, K_ASYM,
                    VG, V_ASYM, HAS_MASK, NG, ASM, True, False, SOFTCAP)
            t_first = tl.minimum(t_begin + BT, t_end)
        t_whole = t_first + (t_end - t_first) // BT * BT
        nse = tl.zeros([D // 2], tl.float32)     # AHEAD: the next tile's scales (placeholders without it)
        nso, nze, nzo = nse, nse, nse
        nsc = tl.zeros([BT, NG], tl.float32)
        nzc = nsc
        if AHEAD:   # the scales of the loop's first tile, before it: each tile then loads its next tile's
            if t_first < t_whole:
                _, _, ksr, kzr, vsr, vzr = _rows(kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, kc_ptr, vc_ptr,
                                                 ks_ptr, kz_ptr, vs_ptr, vz_ptr, page_row, t_first, n, Hkv, PAGE, D,
                                                 KG, K_CHANNEL, VG, V_CHANNEL)
                nse, nso, nze, nzo, nsc, nzc = _tile_scales(ksr, kzr, vsr, vzr, t_first, tt < BT, j, vcol_off, D,
                                                            KG, K_ASYM, VG, V_ASYM, False)
        for tb in range(t_first, t_whole, BT):
            kcr, vcr, ksr, kzr, vsr, vzr = _rows(kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, kc_ptr, vc_ptr,
                                                 ks_ptr, kz_ptr, vs_ptr, vz_ptr, page_row, tb, n, Hkv, PAGE, D, KG,
                                                 K_CHANNEL, VG, V_CHANNEL)
            se, so, ze, zo, sc, zc = nse, nso, nze, nzo, nsc, nzc   # this tile's, loaded with the last (AHEAD)
            if AHEAD:   # the next whole tile's issued now (the last tile's own again at the end: always a tile of
                # the loop, no mask), in flight while this one is worked
                tn = tl.minimum(tb + BT, t_whole - BT)
                _, _, nks, nkz, nvs, nvz = _rows(kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, kc_ptr, vc_ptr,
                                                 ks_ptr, kz_ptr, vs_ptr, vz_ptr, page_row, tn, n, Hkv, PAGE, D, KG,
                                                 K_CHANNEL, VG, V_CHANNEL)
                nse, nso, nze, nzo, nsc, nzc = _tile_scales(nks, nkz, nvs, nvz, tn, tt < BT, j, vcol_off, D, KG,
                                                            K_ASYM, VG, V_ASYM, False)
            m_i, l_i, oe, oo, cz, u_acc, v_top = _tile_t(
                tl.load(kcr + tb * (D // 2) + c_off), tl.load(vcr + tb * (D // 2) + c_off), tb, tt < BT, tt, j, heT,
                hoT, q_unit, ksr, kzr, vsr, vzr, vcol_off, se, so, ze, zo, sc, zc, mask_row, m_i, l_i, oe, oo, cz,
                u_acc, v_top, RP, D, BT, KG, K_ASYM, VG, V_ASYM, HAS_MASK, NG, ASM, False, AHEAD, SOFTCAP)
        if t_whole < t_end:
            kcr, vcr, ksr, kzr, vsr, vzr = _rows(kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, kc_ptr, vc_ptr,
                                                 ks_ptr, kz_ptr, vs_ptr, vz_ptr, page_row, t_whole, n, Hkv, PAGE, D,
                                                 KG, K_CHANNEL, VG, V_CHANNEL)
            m_i, l_i, oe, oo, cz, u_acc, v_top = _tile_t(
                _tile_bytes(kcr, t_whole, c_off, tt, t_end, D), _tile_bytes(vcr, t_whole, c_off, tt, t_end, D),
                t_whole, t_whole + tt < t_end, tt, j, heT, hoT, q_unit, ksr, kzr, vsr, vzr, vcol_off, 0, 0, 0, 0, 0,
                0, mask_row, m_i, l_i, oe, oo, cz, u_acc, v_top, RP, D, BT, KG, K_ASYM, VG, V_ASYM, HAS_MASK, NG, ASM,
                True, False, SOFTCAP)
        # column (g, r) of the sums holds group g's channels; then the zero points' term
        oe, oo = oe * u_acc, oo * u_acc
        sel = ((2 * j) // VG)[:, None, None] == g[None, :, None]
        off = tl.sum(tl.where(sel, tl.reshape(cz, (NG, RP))[None, :, :], 0.0), axis=1)
        acc_e = tl.trans(tl.sum(tl.where(sel, tl.reshape(oe, (D // 2, NG, RP)), 0.0), axis=1) + off)
        acc_o = tl.trans(tl.sum(tl.where(sel, tl.reshape(oo, (D // 2, NG, RP)), 0.0), axis=1) + off)
    else:
        m_i, l_i, acc_e, acc_o = _rows_path(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, q_scale, n, R, Hkv,
                                            kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, page_row, mask_row,
                                            t_begin, t_end, c_off, j, tt, g, RP, D, BT, KG, K_CHANNEL, K_ASYM, VG,
                                            V_CHANNEL, V_ASYM, HAS_MASK, DOT, NG, PREFETCH, ASM, PAGE, SOFTCAP)
    o = (n.to(tl.int64) * SPT + sp_off + g_sp) * R + r
    # the rows of every group saw the same scores: their running max and sum are equal, any of them will do
    if DOT == "fp16":   # the merge takes natural units
        m_i = m_i * LN2
    tl.store(m_ptr + o, tl.max(tl.reshape(m_i, (NG, RP)), axis=0), mask=rm)
    tl.store(l_ptr + o, tl.max(tl.reshape(l_i, (NG, RP)), axis=0), mask=rm)
    tl.store(acc_ptr + o[:, None] * D + 2 * j[None, :], acc_e, mask=rm[:, None])
    tl.store(acc_ptr + o[:, None] * D + 2 * j[None, :] + 1, acc_o, mask=rm[:, None])


@triton.jit
def _rows_path(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, q_scale, n, R, Hkv, kc_row, vc_row, ks_row,
               kz_row, vs_row, vz_row, page_row, mask_row, t_begin, t_end, c_off, j, tt, g, RP: tl.constexpr,
               D: tl.constexpr, BT: tl.constexpr, KG: tl.constexpr, K_CHANNEL: tl.constexpr, K_ASYM: tl.constexpr,
               VG: tl.constexpr, V_CHANNEL: tl.constexpr, V_ASYM: tl.constexpr, HAS_MASK: tl.constexpr,
               DOT: tl.constexpr, NG: tl.constexpr, PREFETCH: tl.constexpr, ASM: tl.constexpr, PAGE: tl.constexpr,
               SOFTCAP: tl.constexpr = 0.0):
    """:func:`attend_packed_kernel`'s split with the query rows as the products' rows (every mode but the fast
    mode's transposed one): (running max, sum, accumulators of even and odd channels [RP, D / 2])."""
    ri = tl.arange(0, RP * NG) % RP          # the query row of each product row (g, r), r fastest
    if DOT == "int8x3" or DOT == "fp16":   # the rows whole and split in registers: a layout whose fixed points
        # (whose FP16 halves) pack into words
        q_row = q_ptr + (n.to(tl.int64) * R + ri[:, None]) * D + tl.arange(0, D)[None, :]
        qf = tl.load(q_row, mask=(ri < R)[:, None], other=0.0).to(tl.float32) * q_scale
        qe, qo = tl.split(tl.reshape(qf, (RP * NG, D // 2, 2)))
    else:
        q_row = q_ptr + (n.to(tl.int64) * R + ri[:, None]) * D + 2 * j[None, :]
        qe = tl.load(q_row, mask=(ri < R)[:, None], other=0.0).to(tl.float32) * q_scale
        qo = tl.load(q_row + 1, mask=(ri < R)[:, None], other=0.0).to(tl.float32) * q_scale
    if DOT == "fp16":   # the query rows after a power of two each, to at most 1/2: times any FP16 scale they fit FP16
        q_inv, q_unit = _unit(_max_nan(_absmax(qe), _absmax(qo)), -1)
        he, ho = qe * q_inv[:, None], qo * q_inv[:, None]
        q_unit = q_unit * LOG2E   # scores in units of log 2 (the exponentials are exp2: no multiply a score)
    else:
        he, ho, q_unit = qe, qo, tl.zeros([RP * NG], tl.float32)    # not read
    m_i = tl.full([RP * NG], float("-inf"), tl.float32)
    l_i = tl.zeros([RP * NG], tl.float32)
    a_e = tl.zeros([RP * NG, D // 2], tl.float32)
    a_o = tl.zeros([RP * NG, D // 2], tl.float32)
    cz = tl.zeros([RP * NG], tl.float32)     # per product row: sum of p x its group's offset (zero points)
    u_acc = tl.full((), 1.0, tl.float32)     # "fp16", per-token values: the accumulators in units of u_acc, a power
    v_top = tl.zeros((), tl.float32)         # of two from v_top, the largest value scale read so far
    # offsets from a tile's first token, computed once: per-token key groups' scales, value scales [NG, BT]
    kg_off = (tt[:, None] * D + 2 * j[None, :]) // KG
    vg_off = (tt[None, :] * D) // VG + g[:, None]
    if PREFETCH:   # every tile masked (the next one's loads issued before this one is worked)
        kb, vb = _tile_bytes(kc_row, t_begin, c_off, tt, t_end, D), _tile_bytes(vc_row, t_begin, c_off, tt, t_end, D)
        for tb in range(t_begin, t_end, BT):
            kn = _tile_bytes(kc_row, tb + BT, c_off, tt, t_end, D)
            vn = _tile_bytes(vc_row, tb + BT, c_off, tt, t_end, D)
            m_i, l_i, a_e, a_o, cz, u_acc, v_top = _tile(
                kb, vb, tb, tb + tt < t_end, tt, j, g, he, ho, qe, qo, q_unit, ks_row, kz_row, vs_row, vz_row, kg_off,
                vg_off, mask_row, m_i, l_i, a_e, a_o, cz, u_acc, v_top, RP, D, BT, KG, K_CHANNEL, K_ASYM, VG,
                V_CHANNEL, V_ASYM, HAS_MASK, DOT, NG, ASM, True, SOFTCAP)
            kb, vb = kn, vn
    else:   # the whole tiles, then the partial last one (if any) on its own: masks and selects only there
        t_whole = t_begin + (t_end - t_begin) // BT * BT
        for tb in range(t_begin, t_whole, BT):
            kcr, vcr, ksr, kzr, vsr, vzr = _rows(kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, kc_ptr, vc_ptr,
                                                 ks_ptr, kz_ptr, vs_ptr, vz_ptr, page_row, tb, n, Hkv, PAGE, D, KG,
                                                 K_CHANNEL, VG, V_CHANNEL)
            m_i, l_i, a_e, a_o, cz, u_acc, v_top = _tile(
                tl.load(kcr + tb * (D // 2) + c_off), tl.load(vcr + tb * (D // 2) + c_off), tb, tt < BT, tt, j, g,
                he, ho, qe, qo, q_unit, ksr, kzr, vsr, vzr, kg_off, vg_off, mask_row, m_i, l_i, a_e, a_o, cz, u_acc,
                v_top, RP, D, BT, KG, K_CHANNEL, K_ASYM, VG, V_CHANNEL, V_ASYM, HAS_MASK, DOT, NG, ASM, False,
                SOFTCAP)
        if t_whole < t_end:
            kcr, vcr, ksr, kzr, vsr, vzr = _rows(kc_row, vc_row, ks_row, kz_row, vs_row, vz_row, kc_ptr, vc_ptr,
                                                 ks_ptr, kz_ptr, vs_ptr, vz_ptr, page_row, t_whole, n, Hkv, PAGE, D,
                                                 KG, K_CHANNEL, VG, V_CHANNEL)
            m_i, l_i, a_e, a_o, cz, u_acc, v_top = _tile(
                _tile_bytes(kcr, t_whole, c_off, tt, t_end, D), _tile_bytes(vcr, t_whole, c_off, tt, t_end, D),
                t_whole, t_whole + tt < t_end, tt, j, g, he, ho, qe, qo, q_unit, ksr, kzr, vsr, vzr, kg_off, vg_off,
                mask_row, m_i, l_i, a_e, a_o, cz, u_acc, v_top, RP, D, BT, KG, K_CHANNEL, K_ASYM, VG, V_CHANNEL,
                V_ASYM, HAS_MASK, DOT, NG, ASM, True, SOFTCAP)
    if V_CHANNEL:
        acc_e, acc_o = a_e, a_o
    else:
        # row (g, r) of the sums holds group g's channels; then the zero points' term
        a_e, a_o = a_e * u_acc, a_o * u_acc
        sel = ((2 * j) // VG)[None, None, :] == g[:, None, None]
        off = tl.sum(tl.where(sel, tl.reshape(cz, (NG, RP))[:, :, None], 0.0), axis=0)
        acc_e = tl.sum(tl.where(sel, tl.reshape(a_e, (NG, RP, D // 2)), 0.0), axis=0) + off
        acc_o = tl.sum(tl.where(sel, tl.reshape(a_o, (NG, RP, D // 2)), 0.0), axis=0) + off
    return m_i, l_i, acc_e, acc_o


@triton.jit
def _page_params(s_ptr, z_ptr, slot, first, PAGE: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                 CHANNEL: tl.constexpr):
    """Scale and zero-point row pointers of a paged store's slot (a page's KV head) such that the kernel's offsets
    of token ``first`` + i (the page's first token and on) land at group i's place in the slot: per-channel
    blocks of G tokens ([slots, PAGE / G, D]) or per-token groups of G values ([slots, PAGE D / G])."""
    if CHANNEL:
        off = (slot * (PAGE // G) - first // G) * D
    else:
        off = slot * (PAGE * D // G) - first * D // G
    return s_ptr + off, z_ptr + off
