"""The merge kernel of the fused decode attention: a query row's flash-decoding splits
(:func:`kvcx.codecs.triton_kernels.attention.attend_packed_kernel`) merged with the exact tokens (sinks, residual)
in one softmax. Launched by :func:`kvcx.codecs.gpu.attend_spans` and :func:`kvcx.codecs.paged.attend`.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kvcx.codecs.triton_kernels.codec import _fwht_rows

# integer arguments that change from one decode step to the next: not specialized on (see attention._STEP_ARGS)
_MERGE_STEP_ARGS = ("SPT", "n_sinks", "n_res", "add_stride", "res_off")


@triton.jit
def _exact_rows(e_ptr, n, ne, D: tl.constexpr, EB: tl.constexpr):
    """Slab n's ``ne`` exact keys or values ([N, ne, D], any float dtype) as float32 [EB], 0 past ``ne``."""
    e = tl.arange(0, EB)
    return tl.load(e_ptr + (n.to(tl.int64) * ne + e[:, None]) * D + tl.arange(0, D)[None, :], mask=(e < ne)[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def _exact_scores(q, k, n, ne, add_ptr, add_stride, add_off, Hkv, EB: tl.constexpr, HAS_MASK: tl.constexpr):
    """Scores [rows, EB] of the query rows ``q`` over slab n's exact keys ``k`` (:func:`_exact_rows`), their mask
    columns from ``add_off``; -inf past ``ne``."""
    e = tl.arange(0, EB)
    em = e < ne
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    if HAS_MASK:
        s += tl.load(add_ptr + (n // Hkv).to(tl.int64) * add_stride + add_off + e, mask=em, other=0.0)[None, :]
    return tl.where(em[None, :], s, float("-inf"))


@triton.jit(do_not_specialize=_MERGE_STEP_ARGS)
def merge_kernel(q_ptr, q_scale, m_ptr, l_ptr, acc_ptr, SPT, sk_ptr, sv_ptr, n_sinks, rk_ptr, rv_ptr, n_res, add_ptr,
                 add_stride, res_off, Hkv, out_ptr, norm, R: tl.constexpr, D: tl.constexpr, SB: tl.constexpr,
                 RB: tl.constexpr, HAS_MASK: tl.constexpr, ROTATE: tl.constexpr, CH: tl.constexpr,
                 PDL: tl.constexpr = False):
    """One program per (slab, query row): the softmax merge of the row's ``SPT`` splits
    (:func:`attend_packed_kernel`; their accumulators rotated back where the values are) with its slab's exact
    tokens, the sinks (``n_sinks`` at mask column 0) and the residual (``n_res`` at column ``res_off``), read as
    they are held; the query row as the model holds it, times ``q_scale``; writes the row's [D] float32.

    Written for latency (an earlier merge, a program a slab that read the splits twice and the exact tokens after
    them, took 36 us of an H200 step at 32k tokens): the exact tokens' loads are issued first, the splits are read
    CH at a time in one pass with a running maximum (one chunk holds a batch-1 step's splits), so that every load
    is in flight at once; the exact tokens' scores join the maximum at the end. ``PDL`` (a GPU, launched as a
    programmatic dependent launch): the query and the exact tokens are read while the attention kernel still runs,
    the splits after its grid is done (``griddepcontrol.wait``)."""
    n = tl.program_id(0)
    row = tl.program_id(1)
    q, sk, sv, rk, rv = _row_inputs(q_ptr, q_scale, sk_ptr, sv_ptr, n_sinks, rk_ptr, rv_ptr, n_res, n, row, R, D, SB,
                                    RB)
    if PDL:
        gdc_wait()
    top, den, acc = _combine(m_ptr, l_ptr, acc_ptr, n.to(tl.int64) * SPT, 0, SPT, 1, row, R, D, CH, False)
    _finish(q, sk, sv, rk, rv, top, den, acc, n, row, n_sinks, n_res, add_ptr, add_stride, res_off, Hkv, out_ptr,
            norm, R, D, SB, RB, HAS_MASK, ROTATE)


@triton.jit
def _row_inputs(q_ptr, q_scale, sk_ptr, sv_ptr, n_sinks, rk_ptr, rv_ptr, n_res, n, row, R: tl.constexpr,
                D: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr):
    """Query row ``row`` of slab n ([1, D], times ``q_scale``) and the slab's exact keys and values (sinks,
    residual: :func:`_exact_rows`), loaded first (their loads in flight while the splits are read)."""
    r = row + tl.arange(0, 1)                 # the row as a block of one: the exact tokens' helpers take [rows, D]
    q = tl.load(q_ptr + (n.to(tl.int64) * R + r[:, None]) * D + tl.arange(0, D)[None, :]).to(tl.float32) * q_scale
    sk, sv = _exact_rows(sk_ptr, n, n_sinks, D, SB), _exact_rows(sv_ptr, n, n_sinks, D, SB)
    rk, rv = _exact_rows(rk_ptr, n, n_res, D, RB), _exact_rows(rv_ptr, n, n_res, D, RB)
    return q, sk, sv, rk, rv


@triton.jit
def _combine(m_ptr, l_ptr, acc_ptr, base, first, count, step, row, R: tl.constexpr, D: tl.constexpr,
             CH: tl.constexpr, CG: tl.constexpr):
    """(running max [1], sum [1], accumulator [1, D]) of query row ``row`` over ``count`` splits, split ``base +
    first + i step`` the i-th, read CH at a time in one pass with a running maximum. ``CG``: read past the SM's L1
    (splits other programs of the same grid wrote)."""
    d = tl.arange(0, D)
    c = tl.arange(0, CH)
    top = tl.full([1], float("-inf"), tl.float32)
    acc = tl.zeros([1, D], tl.float32)
    den = tl.zeros([1], tl.float32)
    for s0 in range(0, count, CH):
        cm = s0 + c < count
        o = (base + first + (s0 + c) * step) * R + row
        if CG:
            mm = tl.load(m_ptr + o, mask=cm, other=float("-inf"), cache_modifier=".cg")
            ll = tl.load(l_ptr + o, mask=cm, other=0.0, cache_modifier=".cg")
            a = tl.load(acc_ptr + o[:, None] * D + d[None, :], mask=cm[:, None], other=0.0, cache_modifier=".cg")
        else:
            mm = tl.load(m_ptr + o, mask=cm, other=float("-inf"))
            ll = tl.load(l_ptr + o, mask=cm, other=0.0)
            a = tl.load(acc_ptr + o[:, None] * D + d[None, :], mask=cm[:, None], other=0.0)
        new = tl.maximum(top, tl.max(mm, axis=0))
        use = tl.where(new == float("-inf"), 0.0, new)          # nothing to attend to yet: weights of 0
        alpha = tl.exp(top - use)
        w = tl.exp(mm - use)
        den = den * alpha + tl.sum(w * ll, axis=0)
        acc = acc * alpha[:, None] + tl.sum(w[:, None] * a, axis=0)[None, :]
        top = new
    return top, den, acc


@triton.jit
def _join(top, den, acc, s_sink, s_res):
    """The splits' merged (max, sum, accumulator) and the exact tokens' scores in one softmax: (the sum, the
    accumulator at the new maximum, the sinks' and the residual's weights)."""
    new = tl.maximum(top, tl.maximum(tl.max(s_sink, axis=1), tl.max(s_res, axis=1)))
    use = tl.where(new == float("-inf"), 0.0, new)              # a row with nothing to attend to
    alpha = tl.exp(top - use)
    p_sink = tl.exp(s_sink - use[:, None])
    p_res = tl.exp(s_res - use[:, None])
    return den * alpha + tl.sum(p_sink, axis=1) + tl.sum(p_res, axis=1), acc * alpha[:, None], p_sink, p_res


@triton.jit
def _finish(q, sk, sv, rk, rv, top, den, acc, n, row, n_sinks, n_res, add_ptr, add_stride, res_off, Hkv, out_ptr,
            norm, R: tl.constexpr, D: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr, HAS_MASK: tl.constexpr,
            ROTATE: tl.constexpr):
    """The splits' merged (max, sum, accumulator) of row ``row`` (rotated back where ``ROTATE``) with the exact
    tokens (loaded: ``sk``, ``sv``, ``rk``, ``rv``) in one softmax: writes the row's [D] float32 output."""
    if ROTATE:
        acc = _fwht_rows(acc, 1, D, norm)
    den, acc, p_sink, p_res = _join(top, den, acc, _exact_scores(q, sk, n, n_sinks, add_ptr, add_stride, 0, Hkv, SB,
                                                                 HAS_MASK),
                                    _exact_scores(q, rk, n, n_res, add_ptr, add_stride, res_off, Hkv, RB, HAS_MASK))
    acc += tl.sum(p_sink[:, :, None] * sv[None, :, :], axis=1) + tl.sum(p_res[:, :, None] * rv[None, :, :], axis=1)
    r = row + tl.arange(0, 1)
    tl.store(out_ptr + (n.to(tl.int64) * R + r[:, None]) * D + tl.arange(0, D)[None, :], acc / den[:, None])


@triton.jit
def _finish_loading(q, sk_ptr, sv_ptr, rk_ptr, rv_ptr, top, den, acc, n, row, n_sinks, n_res, add_ptr, add_stride,
                    res_off, Hkv, out_ptr, norm, R: tl.constexpr, D: tl.constexpr, SB: tl.constexpr,
                    RB: tl.constexpr, HAS_MASK: tl.constexpr, ROTATE: tl.constexpr):
    """:func:`_finish` with the exact tokens loaded where they are used, the keys for the scores, then the values
    (one program's registers hold one of them at a time: :func:`merge_in_kernel`'s one warp)."""
    if ROTATE:
        acc = _fwht_rows(acc, 1, D, norm)
    den, acc, p_sink, p_res = _join(
        top, den, acc, _exact_scores(q, _exact_rows(sk_ptr, n, n_sinks, D, SB), n, n_sinks, add_ptr, add_stride, 0,
                                     Hkv, SB, HAS_MASK),
        _exact_scores(q, _exact_rows(rk_ptr, n, n_res, D, RB), n, n_res, add_ptr, add_stride, res_off, Hkv, RB,
                      HAS_MASK))
    acc += tl.sum(p_sink[:, :, None] * _exact_rows(sv_ptr, n, n_sinks, D, SB)[None, :, :], axis=1)
    acc += tl.sum(p_res[:, :, None] * _exact_rows(rv_ptr, n, n_res, D, RB)[None, :, :], axis=1)
    r = row + tl.arange(0, 1)
    tl.store(out_ptr + (n.to(tl.int64) * R + r[:, None]) * D + tl.arange(0, D)[None, :], acc / den[:, None])


@triton.jit
def merge_in_kernel(n, g_sp, SPT, GS, cnt_ptr, cnt_stride, q_ptr, q_scale, m_ptr, l_ptr, acc_ptr, sk_ptr, sv_ptr,
                    n_sinks, rk_ptr, rv_ptr, n_res, add_ptr, add_stride, res_off, Hkv, out_ptr, norm, R: tl.constexpr,
                    D: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr, HAS_MASK: tl.constexpr,
                    ROTATE: tl.constexpr, CH: tl.constexpr):
    """The merge inside the attention kernel (no launch of its own), called by every program after it wrote its
    split ``g_sp`` of slab n: the splits counted in groups of ``GS`` (``cnt_ptr``: an int32 count a group and one a
    slab, ``cnt_stride`` a slab, zero between steps: each count's last program sets it back), the last program of
    a group merges the group's splits into its first split, the last group's merges the groups with the exact
    tokens into the output, as :func:`merge_kernel` (two levels: each program reads GS or SPT / GS splits, not all).
    The counts are acquire-release atomics after a barrier (the program's stores before them, its loads of the
    others' after), the splits read past L1."""
    cnt = cnt_ptr + n.to(tl.int64) * cnt_stride
    ngrp = (SPT + GS - 1) // GS
    grp = g_sp // GS
    first = grp * GS
    size = tl.minimum(GS, SPT - first)
    base = n.to(tl.int64) * SPT
    tl.debug_barrier()
    if tl.atomic_add(cnt + grp, 1, sem="acq_rel") == size - 1:     # the group's last program
        tl.store(cnt + grp, 0)
        tl.debug_barrier()
        for row in tl.static_range(R):
            top, den, acc = _combine(m_ptr, l_ptr, acc_ptr, base, first, size, 1, row, R, D, CH, True)
            o = (base + first) * R + row
            tl.store(m_ptr + o + tl.arange(0, 1), top)
            tl.store(l_ptr + o + tl.arange(0, 1), den)
            tl.store(acc_ptr + o * D + tl.arange(0, D)[None, :], acc)
        tl.debug_barrier()
        if tl.atomic_add(cnt + ngrp, 1, sem="acq_rel") == ngrp - 1:   # the slab's last group
            tl.store(cnt + ngrp, 0)
            tl.debug_barrier()
            for row in tl.static_range(R):
                r = row + tl.arange(0, 1)
                q = tl.load(q_ptr + (n.to(tl.int64) * R + r[:, None]) * D + tl.arange(0, D)[None, :]).to(tl.float32)
                top, den, acc = _combine(m_ptr, l_ptr, acc_ptr, base, 0, ngrp, GS, row, R, D, CH, True)
                _finish_loading(q * q_scale, sk_ptr, sv_ptr, rk_ptr, rv_ptr, top, den, acc, n, row, n_sinks, n_res,
                                add_ptr, add_stride, res_off, Hkv, out_ptr, norm, R, D, SB, RB, HAS_MASK, ROTATE)
