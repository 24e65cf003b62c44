# the fused attention over packed codes (attn.h): part of the kernels' module body (core.pxi), included by every variant
# ----------------------------------------------------------------------------
# fused attention over packed 2/3/4-bit keys and values (kvcx/codecs/cpu/attn.h)
# ----------------------------------------------------------------------------

ATTN_TILE = KVCX_ATTN_TILE
ATTN_MAX_GROUP = KVCX_ATTN_MAX_GROUP
ATTN_MAX_D = KVCX_ATTN_MAX_D
ATTN_MAX_ROWS = KVCX_ATTN_MAX_ROWS
ATTN_TILE_ROWS = KVCX_ATTN_TILE_ROWS
ATTN_SIMD = bool(KVCX_ATTN_AVX2)


def attn_work_floats(int64_t R, int64_t D, bint widths=False, bint vtile=False):
    """Floats of workspace one attention task needs (the caller allocates tasks x this); ``widths``: keys with
    a width per channel; ``vtile``: values read through a float tile (several groups a token, or E8P records)."""
    return int(kvcx_attn_work_floats(R, D, widths, vtile))


cdef class AttnKernel:
    """One layer's fused attention: the settings, the packed stores bound once per change of the
    stores, then one :meth:`run` per decode step (a ``kvcx_attn_layout`` + ``kvcx_attn_args``).

    Built and bound by ``kvcx.cache.fused`` after its checks; the kernel trusts every field. It
    keeps the bound arrays alive."""
    cdef kvcx_attn_layout c
    cdef kvcx_attn_args a
    cdef object _keep

    def __init__(self, *, int64_t B, int64_t Hkv, int64_t R, int64_t D, int k_axis, bint k_asym, bint k_rotate,
                 int64_t k_group, bint v_asym, bint v_rotate, int64_t v_group, int k_bits=4, int v_bits=4,
                 int64_t nq=1, bint k_widths=False, bint v_e8p=False):
        self.c.B = B
        self.c.nq = nq
        self.c.Hkv = Hkv
        self.c.R = R
        self.c.D = D
        self.c.k_axis = k_axis
        self.c.k_asym = k_asym
        self.c.k_rotate = k_rotate
        self.c.k_group = k_group
        self.c.v_asym = v_asym
        self.c.v_rotate = v_rotate
        self.c.v_group = v_group
        self.c.k_bits = k_bits
        self.c.v_bits = v_bits
        self.c.k_widths = k_widths
        self.c.v_e8p = v_e8p
        self.c.nsplit = 1
        self.c.softcap = 0.0
        self.a.sinks = NULL
        self._keep = ()

    def bind(self, kc, ks, kz, kblk, vc, vs, vz, hk, hv, int64_t Tq, work, int64_t nsplit, kgoff=None, kw=None,
             krange=None, kgchunk=None):
        """Bind the stores: codes [B * Hkv, tokens * D * bits / 8] (uint8), scales / zero points [B * Hkv, n]
        (FP16 bits; zero points empty when symmetric), key block starts (int64; empty unless keys are
        grouped per channel), head rows hk/hv [B * Hkv, nh, D] (float32), Tq packed positions after
        them, the workspace [B * Hkv * nsplit, attn_work_floats(R, D, k_widths, vtile)] (float32). Values
        in E8P records (``v_e8p``): vc [B * Hkv, tokens * (D / 4 + 2)], vs and vz empty.

        Keys with widths: kc [1, bytes] every group's planes (8 bytes after the last), ks [B * Hkv, groups * D]
        the groups' range bytes (2 per channel, as uint16), kblk the groups' first key tokens (and the end),
        kgoff [B * Hkv, groups] (int64) where each group's planes begin in kc, kw [B * Hkv, chunks * D] (uint8)
        each chunk's channel widths, krange [B * Hkv, chunks * 2 D] (FP16 bits) each chunk's channel ranges,
        kgchunk [groups] (int64) the chunk of each group."""
        cdef const uint8_t[:, ::1] kc_ = kc
        cdef const uint16_t[:, ::1] ks_ = ks
        cdef const uint16_t[:, ::1] kz_ = kz
        cdef const int64_t[::1] kblk_ = kblk
        cdef const uint8_t[:, ::1] vc_ = vc
        cdef const uint16_t[:, ::1] vs_ = vs
        cdef const uint16_t[:, ::1] vz_ = vz
        cdef const float[:, :, ::1] hk_ = hk
        cdef const float[:, :, ::1] hv_ = hv
        cdef float[:, ::1] work_ = work
        D = self.c.D
        self.c.Tq = Tq
        self.c.pos_q = hk_.shape[1]
        self.c.ns = hk_.shape[1]
        self.c.pos_s = 0
        if self.c.k_widths:
            self._bind_widths(kgoff, kw, krange, kgchunk, kblk_)
        else:
            self.c.k_tokens = kc_.shape[1] // (D * self.c.k_bits // 8) if D else 0
        self.c.v_tokens = vc_.shape[1] // (kvcx_e8p_record_bytes(D) if self.c.v_e8p else D * self.c.v_bits // 8) \
            if D else 0
        self.c.k_nscale = ks_.shape[1]
        self.c.v_nscale = vs_.shape[1]
        self.c.nsplit = nsplit
        self.a.kc = &kc_[0, 0] if kc_.shape[1] > 0 else NULL
        self.a.ks = &ks_[0, 0] if ks_.shape[1] > 0 else NULL
        self.a.kz = &kz_[0, 0] if kz_.shape[0] > 0 and kz_.shape[1] > 0 else NULL
        self.a.kblk = &kblk_[0] if kblk_.shape[0] > 0 else NULL
        self.a.vc = &vc_[0, 0] if vc_.shape[1] > 0 else NULL
        self.a.vs = &vs_[0, 0] if vs_.shape[1] > 0 else NULL
        self.a.vz = &vz_[0, 0] if vz_.shape[0] > 0 and vz_.shape[1] > 0 else NULL
        self.a.sk = &hk_[0, 0, 0] if hk_.shape[1] > 0 else NULL
        self.a.sv = &hv_[0, 0, 0] if hv_.shape[1] > 0 else NULL
        self.a.work = &work_[0, 0]
        self._keep = (kc, ks, kz, kblk, vc, vs, vz, hk, hv, work, kgoff, kw, krange, kgchunk)

    cdef _bind_widths(self, kgoff, kw, krange, kgchunk, const int64_t[::1] kblk):
        cdef const int64_t[:, ::1] kgoff_ = kgoff
        cdef const uint8_t[:, ::1] kw_ = kw
        cdef const uint16_t[:, ::1] krange_ = krange
        cdef const int64_t[::1] kgchunk_ = kgchunk
        self.c.k_groups = kgchunk_.shape[0]
        self.c.k_chunks = kw_.shape[1] // self.c.D
        self.c.k_tokens = kblk[kblk.shape[0] - 1]
        self.a.kgoff = &kgoff_[0, 0] if kgoff_.shape[1] > 0 else NULL
        self.a.kw = &kw_[0, 0] if kw_.shape[1] > 0 else NULL
        self.a.krange = &krange_[0, 0] if krange_.shape[1] > 0 else NULL
        self.a.kgchunk = &kgchunk_[0] if kgchunk_.shape[0] > 0 else NULL

    @property
    def tasks(self):
        return int(self.c.B * self.c.Hkv * self.c.nsplit)

    def run(self, const float[:, :, ::1] q, const float[:, :, ::1] rk, const float[:, :, ::1] rv,
            const float[:, ::1] mask, const uint8_t[:, ::1] maskb, int64_t mask_bs, int64_t mask_qs, bint causal,
            float[:, :, ::1] out, float scaling, int nthreads, const float[::1] sinks=None, float softcap=0.0,
            int64_t tq=-1):
        """One step: q, out [B, Hkv * R, D] (row r of a KV head: query head r // nq, token r % nq); rk/rv
        [B * Hkv, nr, D] the residual after the bound tokens (nr may be 0); mask [rows, kv_len] added to the
        scores or maskb [rows, kv_len] (0: masked), one of them empty or both: the row of batch row b and
        token i is b * mask_bs + i * mask_qs; causal: token i sees positions up to kv_len - nq + i.
        ``sinks``: [Hkv * R // nq] each query head's sink logit (in the softmax's sum, attending to nothing) or
        None; ``softcap`` > 0: scores capped to softcap tanh(s / softcap) before the mask; ``tq`` >= 0: read only
        the last ``tq`` of the bound packed positions (a window's first token on; at most those bound), -1: all."""
        cdef kvcx_attn_layout L = self.c
        cdef kvcx_attn_args A = self.a
        cdef int64_t ntasks = L.B * L.Hkv * L.nsplit
        cdef int64_t nrows = L.B * L.Hkv * L.R
        cdef int64_t i
        if 0 <= tq < L.Tq:
            L.Tq = tq
        L.softcap = softcap if softcap > 0 else 0.0
        A.sinks = &sinks[0] if sinks is not None and sinks.shape[0] > 0 else NULL
        L.nr = rk.shape[1]
        L.pos_r = L.ns + L.Tq
        L.kv_len = L.pos_r + L.nr
        L.scaling = scaling
        L.mask_bs = mask_bs
        L.mask_qs = mask_qs
        L.causal = causal
        A.q = &q[0, 0, 0]
        A.rk = &rk[0, 0, 0] if L.nr > 0 else NULL
        A.rv = &rv[0, 0, 0] if L.nr > 0 else NULL
        A.mask = &mask[0, 0] if mask.shape[0] > 0 else NULL
        A.maskb = &maskb[0, 0] if maskb.shape[0] > 0 and A.mask == NULL else NULL
        A.out = &out[0, 0, 0]
        with nogil:
            for i in prange(ntasks, num_threads=nthreads, schedule="static"):
                kvcx_attn_task(&L, &A, i)
            for i in prange(nrows, num_threads=nthreads, schedule="static"):
                kvcx_attn_merge(&L, &A, i)


