"""The merge kernel of the fused decode attention: a query row's flash-decoding splits
(:func:`kvcx.codecs.triton_kernels.attention.attend_packed_kernel`) merged with the exact tokens (sinks, residual)
in one softmax. Launched by :func:`kvcx.codecs.gpu_attn.attend_spans` and :func:`kvcx.codecs.paged.attend`.
"""
import triton
import triton.language as tl
try:   # programmatic dependent launch (Triton 3.4 on; kvcx.codecs.gpu_attn.dependent_merge: off without it)
    from triton.language.extra.cuda import gdc_wait
except ImportError:
    gdc_wait = None

from kvcx.codecs.triton_kernels.codec import _fwht_rows, _store_out
from kvcx.codecs.triton_kernels.products import _softcap

# integer arguments that change from one decode step to the next: not specialized on (see attention._STEP_ARGS)
_MERGE_STEP_ARGS = ("SPT", "n_sinks", "n_res", "add_stride", "res_off")


@triton.jit
def _exact_rows(e_ptr, n, rows, ne, D: tl.constexpr, EB: tl.constexpr):
    """Slab n's first ``ne`` exact keys or values ([N, rows, D], any float dtype) as float32 [EB], 0 past ``ne``."""
    e = tl.arange(0, EB)
    return tl.load(e_ptr + (n.to(tl.int64) * rows + e[:, None]) * D + tl.arange(0, D)[None, :],
                   mask=(e < ne)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _exact_scores(q, k, n, ne, add_ptr, add_stride, add_off, Hkv, EB: tl.constexpr, HAS_MASK: tl.constexpr,
                  SOFTCAP: tl.constexpr = 0.0):
    """Scores [rows, EB] of the query rows ``q`` over slab n's exact keys ``k`` (:func:`_exact_rows`), capped where
    ``SOFTCAP`` > 0, their mask columns from ``add_off``; -inf past ``ne``."""
    e = tl.arange(0, EB)
    em = e < ne
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    if SOFTCAP > 0:
        s = _softcap(s, SOFTCAP, False)
    if HAS_MASK:
        s += tl.load(add_ptr + (n // Hkv).to(tl.int64) * add_stride + add_off + e, mask=em, other=0.0)[None, :]
    return tl.where(em[None, :], s, float("-inf"))


@triton.jit(do_not_specialize=_MERGE_STEP_ARGS)
def merge_kernel(q_ptr, q_scale, m_ptr, l_ptr, acc_ptr, SPT, sk_ptr, sv_ptr, n_sinks, rk_ptr, rv_ptr, n_res, add_ptr,
                 add_stride, res_off, Hkv, out_ptr, norm, res_lens_ptr, sl_ptr, R: tl.constexpr, D: tl.constexpr,
                 SB: tl.constexpr, RB: tl.constexpr, HAS_MASK: tl.constexpr, ROTATE: tl.constexpr, CH: tl.constexpr,
                 PDL: tl.constexpr = False, RES_LENS: tl.constexpr = False, OUT_BF16: tl.constexpr = False,
                 HAS_SINKS: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0):
    """One program per (slab, query row): the softmax merge of the row's ``SPT`` splits
    (:func:`attend_packed_kernel`; their accumulators rotated back where the values are) with its slab's exact
    tokens, the sinks (``n_sinks`` at mask column 0) and the residual (``n_res`` at column ``res_off``), read as
    they are held; the query row as the model holds it, times ``q_scale``; writes the row's [D] in out's dtype
    (FP32, FP16, or with ``OUT_BF16`` BF16 bits in an int16 view).
    ``RES_LENS``: the residual holds ``n_res`` rows a slab of which batch row b's first ``res_lens_ptr[b]`` are
    tokens (read on the device: a step replayed from a CUDA graph, :mod:`kvcx.cache.static_cache`).
    ``HAS_SINKS``: ``sl_ptr`` [Hkv R] holds each query head's sink logit (GPT-OSS's s_aux), a term of the softmax's
    sum that attends to nothing; ``SOFTCAP`` > 0: the exact tokens' scores capped as the splits' are.

    Written for latency (docs/results/gpu.md has the measurements): the exact tokens come first, their softmax (maximum, sum,
    weighted values; rotated as the splits' accumulators are, where the values are) the start of the running merge;
    then the splits, read CH at a time in one pass with a running maximum,
    so that every load is in flight at once; the rotation back last. ``PDL`` (a GPU, launched as a programmatic
    dependent launch): everything up to the splits runs while the attention kernel still does (the query, the
    exact tokens and their softmax: reductions across the program's warps that are then off the step's critical
    path), the splits after its grid is done (``griddepcontrol.wait``)."""
    n = tl.program_id(0)
    row = tl.program_id(1)
    r = row + tl.arange(0, 1)                 # the row as a block of one: the exact tokens' helpers take [rows, D]
    d = tl.arange(0, D)
    c = tl.arange(0, CH)
    q = tl.load(q_ptr + (n.to(tl.int64) * R + r[:, None]) * D + d[None, :]).to(tl.float32) * q_scale
    if RES_LENS:
        live = tl.load(res_lens_ptr + n // Hkv)
    else:
        live = n_res
    sk, sv = _exact_rows(sk_ptr, n, n_sinks, n_sinks, D, SB), _exact_rows(sv_ptr, n, n_sinks, n_sinks, D, SB)
    rk, rv = _exact_rows(rk_ptr, n, n_res, live, D, RB), _exact_rows(rv_ptr, n, n_res, live, D, RB)
    s_sink = _exact_scores(q, sk, n, n_sinks, add_ptr, add_stride, 0, Hkv, SB, HAS_MASK, SOFTCAP)
    s_res = _exact_scores(q, rk, n, live, add_ptr, add_stride, res_off, Hkv, RB, HAS_MASK, SOFTCAP)
    top = tl.maximum(tl.max(s_sink, axis=1), tl.max(s_res, axis=1))            # [1]; -inf: no exact token
    z = tl.full([1], float("-inf"), tl.float32)
    if HAS_SINKS:   # the row's query head's sink logit: in the sum, no value
        z = tl.load(sl_ptr + (n % Hkv) * R + r).to(tl.float32)
        top = tl.maximum(top, z)
    use = tl.where(top == float("-inf"), 0.0, top)
    p_sink = tl.exp(s_sink - use[:, None])
    p_res = tl.exp(s_res - use[:, None])
    den = tl.sum(p_sink, axis=1) + tl.sum(p_res, axis=1)
    if HAS_SINKS:
        den += tl.exp(z - use)
    acc = tl.sum(p_sink[:, :, None] * sv[None, :, :], axis=1) + tl.sum(p_res[:, :, None] * rv[None, :, :], axis=1)
    if ROTATE:   # into the splits' rotated space (the transform is its own inverse): one rotation back at the end
        acc = _fwht_rows(acc, 1, D, norm)
    if PDL:
        gdc_wait()
    base = n.to(tl.int64) * SPT
    for s0 in range(0, SPT, CH):
        cm = s0 + c < SPT
        o = (base + s0 + c) * R + row
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
    if ROTATE:
        acc = _fwht_rows(acc, 1, D, norm)
    # out_ptr's dtype (FP32, FP16; BF16 as int16 bits: round to nearest even on them, as torch's .to rounds)
    _store_out(out_ptr + (n.to(tl.int64) * R + r[:, None]) * D + d[None, :], acc / den[:, None], None, False,
               OUT_BF16)
