# bit packing, the rotation, group parameters, quantization, encode and decode: part of the kernels' module body (core.pxi), included by every variant
# ----------------------------------------------------------------------------
# bit packing
# ----------------------------------------------------------------------------

cdef inline void _pack(const uint8_t *q, int64_t n, int bits, uint8_t *out) noexcept nogil:
    """Pack n codes (n a multiple of 8 or the slab's end; q padded with zeros to 8)."""
    cdef int64_t i, j
    cdef uint32_t w
    if bits == 4:
        for i in range((n + 1) // 2):
            out[i] = q[2 * i] | (q[2 * i + 1] << 4)
    elif bits == 8:
        for i in range(n):
            out[i] = q[i]
    elif bits == 2:
        for i in range(kvcx_pack2_blocks(q, n, out) // 4, (n + 3) // 4):
            out[i] = q[4 * i] | (q[4 * i + 1] << 2) | (q[4 * i + 2] << 4) | (q[4 * i + 3] << 6)
    else:  # 3 bits: 8 codes in 3 bytes
        for i in range(kvcx_pack3_blocks(q, n, out) // 8, (n + 7) // 8):
            w = 0
            for j in range(8):
                w = w | (<uint32_t>q[8 * i + j] << (3 * j))
            j = 3 * i
            out[j] = w & 0xff
            if (3 * n + 7) // 8 > j + 1:
                out[j + 1] = (w >> 8) & 0xff
            if (3 * n + 7) // 8 > j + 2:
                out[j + 2] = (w >> 16) & 0xff


cdef inline void _unpack(const uint8_t *p, int64_t n, int bits, uint8_t *q) noexcept nogil:
    """Unpack n codes into q (q has room for n rounded up to a multiple of 8)."""
    cdef int64_t i, j, nb, full
    cdef uint32_t w
    cdef uint8_t b
    if bits == 4:
        for i in range(n // 2):
            q[2 * i] = p[i] & 0x0f
            q[2 * i + 1] = p[i] >> 4
        if n & 1:
            q[n - 1] = p[n // 2] & 0x0f
    elif bits == 8:
        for i in range(n):
            q[i] = p[i]
    elif bits == 2:
        for i in range(n // 4):
            b = p[i]
            q[4 * i] = b & 3
            q[4 * i + 1] = (b >> 2) & 3
            q[4 * i + 2] = (b >> 4) & 3
            q[4 * i + 3] = b >> 6
        for i in range((n // 4) * 4, n):
            q[i] = (p[i >> 2] >> (2 * (i & 3))) & 3
    else:
        full = n // 8                      # whole 3-byte groups
        for i in range(kvcx_unpack3_blocks(p, n, q) // 8, full):
            w = p[3 * i] | (<uint32_t>p[3 * i + 1] << 8) | (<uint32_t>p[3 * i + 2] << 16)
            q[8 * i] = w & 7
            q[8 * i + 1] = (w >> 3) & 7
            q[8 * i + 2] = (w >> 6) & 7
            q[8 * i + 3] = (w >> 9) & 7
            q[8 * i + 4] = (w >> 12) & 7
            q[8 * i + 5] = (w >> 15) & 7
            q[8 * i + 6] = (w >> 18) & 7
            q[8 * i + 7] = w >> 21
        if n > 8 * full:                   # a partial last group: only its bytes exist
            nb = (3 * n + 7) // 8
            j = 3 * full
            w = p[j]
            if j + 1 < nb:
                w = w | (<uint32_t>p[j + 1] << 8)
            if j + 2 < nb:
                w = w | (<uint32_t>p[j + 2] << 16)
            for i in range(8):
                q[8 * full + i] = (w >> (3 * i)) & 7


# ----------------------------------------------------------------------------
# Walsh-Hadamard rotation (orthonormal, its own inverse)
# ----------------------------------------------------------------------------

cdef inline void _fwht_rows(float *x, int64_t rows, int64_t d) noexcept nogil:
    """In-place orthonormal fast Walsh-Hadamard transform of `rows` rows of length d (a power of two >= 8)."""
    kvcx_fwht_rows(x, rows, d)


# ----------------------------------------------------------------------------
# group parameters and (de)quantization
#
# Min / max / max|x| run on the float bits as integers: for finite floats the
# order of (bits & 0x7fffffff) is the order of |x|, and the key
# bits ^ ((bits >> 31) & 0x7fffffff) orders signed values; both reductions
# vectorize without -ffast-math, and max(bits & 0x7fffffff) >= 0x7f800000
# flags NaN/Inf in the same pass.
# ----------------------------------------------------------------------------

cdef inline float _f_from_bits(int32_t b) noexcept nogil:
    cdef float f
    memcpy(&f, &b, 4)
    return f


cdef inline int32_t _key_to_bits(int32_t k) noexcept nogil:
    return k ^ ((k >> 31) & 0x7fffffff)


cdef inline int _params(float lo, float hi, int bits, bint asym, uint16_t *s_out, uint16_t *z_out,
                        float *scale, float *zero) noexcept nogil:
    """FP16 scale (and zero point) of a group from its min/max (or 0/max|x| when symmetric)."""
    cdef uint16_t hs, hz
    if asym:
        hs = kvcx_f2h_1((hi - lo) / <float>((1 << bits) - 1))
        hz = kvcx_f2h_1(lo)
        z_out[0] = hz
        zero[0] = kvcx_h2f_1(hz)
        if (hz & 0x7c00u) == 0x7c00u:
            s_out[0] = hs
            return KVCX_ST_SCALE_OVERFLOW
    else:
        hs = kvcx_f2h_1(hi / <float>((1 << (bits - 1)) - 1))
        zero[0] = 0.0
    s_out[0] = hs
    scale[0] = kvcx_h2f_1(hs)
    return KVCX_ST_SCALE_OVERFLOW if (hs & 0x7c00u) == 0x7c00u else KVCX_OK


cdef inline int _quant_contig(const float *x, int64_t n, int bits, bint asym,
                              uint8_t *q, uint16_t *s_out, uint16_t *z_out, uint8_t *packed) noexcept nogil:
    """Quantize one contiguous group; returns a kvcx_status. With ``packed`` (4 bits only) the codes go
    straight to their packed bytes there and q is not written."""
    cdef const int32_t *xi = <const int32_t *>x
    cdef int64_t i
    cdef int32_t a, k, amax = 0, kmin = 0x7fffffff, kmax = -0x7fffffff - 1
    cdef float scale, zero, qmax, qmin, off
    cdef int st
    if asym:
        kvcx_minmax_keys(x, n, &kmin, &kmax)
        # +inf/+NaN have keys >= 0x7f800000, -inf/-NaN keys <= key(-inf)
        if kmax >= 0x7f800000 or kmin <= KVCX_KEY_NEG_INF:
            return KVCX_ST_NONFINITE
        st = _params(_f_from_bits(_key_to_bits(kmin)), _f_from_bits(_key_to_bits(kmax)), bits, 1,
                     s_out, z_out, &scale, &zero)
        qmin = 0.0
        qmax = <float>((1 << bits) - 1)
        off = 0.0
    else:
        amax = kvcx_absmax_bits(x, n)
        if amax >= 0x7f800000:
            return KVCX_ST_NONFINITE
        st = _params(0.0, _f_from_bits(amax), bits, 0, s_out, z_out, &scale, &zero)
        qmax = <float>((1 << (bits - 1)) - 1)
        qmin = -qmax - 1.0
        off = qmax + 1.0
    if st:
        return st
    if packed != NULL:
        if scale == 0.0:
            for i in range(n // 2):
                packed[i] = <uint8_t>(<int32_t>off | (<int32_t>off << 4))
            if n & 1:
                packed[n // 2] = <uint8_t>off
        else:
            kvcx_quant_contig(x, n, scale, zero, qmin, qmax, off, 1, packed)
        return KVCX_OK
    if scale == 0.0:
        for i in range(n):
            q[i] = <uint8_t>off
        return KVCX_OK
    kvcx_quant_contig(x, n, scale, zero, qmin, qmax, off, 0, q)
    return KVCX_OK


cdef int _quant_cols(const float *x, int64_t rows, int64_t D, int bits, bint asym, uint8_t *q,
                     uint16_t *s_out, uint16_t *z_out, float *tmp, uint8_t *packed) noexcept nogil:
    """Quantize a [rows, D] block with one group per column (tmp: 5*D floats of scratch). With
    ``packed`` (4 bits only) the codes go straight to their packed bytes there and q is not written."""
    cdef const int32_t *xi = <const int32_t *>x
    cdef int32_t *amax = <int32_t *>tmp
    cdef int32_t *kmin = <int32_t *>(tmp + D)
    cdef int32_t *kmax = <int32_t *>(tmp + 2 * D)
    cdef float *scale = tmp + 3 * D
    cdef float *zero = tmp + 4 * D
    cdef int64_t r, d
    cdef int32_t a, k
    cdef float qmax, qmin, off, sc = 0.0, zr = 0.0
    cdef int st = 0
    cdef int64_t d0, w, j
    cdef int32_t lo[64]
    cdef int32_t hi[64]
    # column statistics in chunks of 64 columns held in local arrays (which the compiler knows
    # do not alias the input, so the loops vectorize)
    for d0 in range(0, D, 64):
        w = min(<int64_t>64, D - d0)
        for j in range(64):
            lo[j] = 0x7fffffff
            hi[j] = -0x7fffffff - 1
        if asym and w == 64:
            for r in range(rows):
                for j in range(64):
                    k = xi[r * D + d0 + j] ^ ((xi[r * D + d0 + j] >> 31) & 0x7fffffff)
                    lo[j] = k if k < lo[j] else lo[j]
                    hi[j] = k if k > hi[j] else hi[j]
        elif asym:
            for r in range(rows):
                for j in range(w):
                    k = xi[r * D + d0 + j] ^ ((xi[r * D + d0 + j] >> 31) & 0x7fffffff)
                    lo[j] = k if k < lo[j] else lo[j]
                    hi[j] = k if k > hi[j] else hi[j]
        elif w == 64:
            for r in range(rows):
                for j in range(64):
                    a = xi[r * D + d0 + j] & 0x7fffffff
                    hi[j] = a if a > hi[j] else hi[j]
        else:
            for r in range(rows):
                for j in range(w):
                    a = xi[r * D + d0 + j] & 0x7fffffff
                    hi[j] = a if a > hi[j] else hi[j]
        for j in range(w):
            kmin[d0 + j] = lo[j]
            kmax[d0 + j] = hi[j]
            amax[d0 + j] = hi[j]
    for d in range(D):
        if asym and (kmax[d] >= 0x7f800000 or kmin[d] <= KVCX_KEY_NEG_INF):
            return KVCX_ST_NONFINITE
        if not asym and amax[d] >= 0x7f800000:
            return KVCX_ST_NONFINITE
    # the parameters of all columns at once (vectorized), then the codes: packed (4 bits) or as bytes
    st = kvcx_cols_params_quant(x, rows, D, kmin, kmax, bits, asym, s_out, z_out, tmp + 3 * D, tmp + 4 * D,
                                <uint32_t *>(tmp + D), packed if packed != NULL else q)
    if st >= 0:
        return st
    st = 0
    if asym:
        qmin = 0.0
        qmax = <float>((1 << bits) - 1)
        off = 0.0
    else:
        qmax = <float>((1 << (bits - 1)) - 1)
        qmin = -qmax - 1.0
        off = qmax + 1.0
    for d in range(D):
        if asym:
            st = st | _params(_f_from_bits(_key_to_bits(kmin[d])), _f_from_bits(_key_to_bits(kmax[d])), bits, 1,
                              s_out + d, z_out + d, &sc, &zr)
        else:
            st = st | _params(0.0, _f_from_bits(amax[d]), bits, 0, s_out + d, z_out + d, &sc, &zr)
        scale[d] = sc
        zero[d] = zr
    if st:
        return st
    for d in range(D):  # the statistics are done: tmp[0:2D] becomes the divisors and the keep mask
        (<uint32_t *>tmp)[D + d] = 0xffffffffu if scale[d] != 0.0 else 0u
        tmp[d] = scale[d] if scale[d] != 0.0 else 1.0
    kvcx_quant_cols(x, rows, D, tmp, zero, tmp + D, qmin, qmax, off, packed != NULL,
                    packed if packed != NULL else q)
    return KVCX_OK


cdef inline void _dequant_contig(const uint8_t *q, int64_t n, int bits, bint asym, uint16_t hs, uint16_t hz,
                                 float *x) noexcept nogil:
    cdef int64_t i
    cdef float scale = kvcx_h2f_1(hs), zero, off
    if asym:
        zero = kvcx_h2f_1(hz)
        for i in range(n):
            x[i] = <float>q[i] * scale + zero
    else:
        off = <float>(1 << (bits - 1))
        for i in range(n):
            x[i] = (<float>q[i] - off) * scale


cdef inline void _dequant_cols(const uint8_t *q, int64_t rows, int64_t D, int bits, bint asym,
                               const uint16_t *hs, const uint16_t *hz, float *x, float *tmp) noexcept nogil:
    cdef int64_t r, d
    cdef float off = 0.0 if asym else <float>(1 << (bits - 1))
    cdef float *scale = tmp
    cdef float *zero = tmp + D
    for d in range(D):
        scale[d] = kvcx_h2f_1(hs[d])
        zero[d] = kvcx_h2f_1(hz[d]) if asym else 0.0
    for r in range(rows):
        for d in range(D):
            x[r * D + d] = (<float>q[r * D + d] - off) * scale[d] + zero[d]


# ----------------------------------------------------------------------------
# encode / decode
# ----------------------------------------------------------------------------

cdef int _enc_block(const uint8_t *src, int dt, const kvcx_layout *L, int64_t blk_tokens, int64_t slab,
                    int64_t blk, int64_t row_bytes, uint8_t *codes, uint16_t *scales, uint16_t *zeros,
                    float *buf, uint8_t *q, float *tmp) noexcept nogil:
    """Encode one block: a group (token mode) or whole tokens [t_a, t_b) of one slab."""
    cdef int64_t S = L.S, D = L.D, t0 = L.t0, G = L.group_size
    cdef int64_t Lq = (S - t0) * D
    cdef int64_t t_a = t0 + blk * blk_tokens
    cdef int64_t t_b = min(S, t_a + blk_tokens)
    cdef int64_t n = (t_b - t_a) * D
    cdef int64_t g, g0, start, m, k, ngroups, nblk
    cdef int status = KVCX_OK
    cdef uint8_t *dest
    if L.axis == KVCX_AXIS_TOKEN and not L.rotate and L.bits == 4 and dt == KVCX_DT_F16 and G % 16 == 0:
        # FP16 input, 4 bits: whole groups straight from the input, no FP32 copy (0 done without AVX2)
        start = blk * blk_tokens
        n = min(blk_tokens, Lq - start)
        dest = codes + slab * row_bytes + start // 2
        ngroups = (Lq + G - 1) // G
        k = slab * ngroups + start // G
        g = kvcx_q4_groups_f16(<const uint16_t *>src + slab * S * D + t0 * D + start, n // G, G, L.asym,
                               scales + k, zeros + k, dest, &status)
        if status:
            return status
        if g * G < n:  # the rest (a partial last group; every group without AVX2) through the FP32 path
            g0 = g
            _load(src, dt, slab * S * D + t0 * D + start + g0 * G, n - g0 * G, buf)
            while g * G < n:
                m = min(G, n - g * G)
                status = status | _quant_contig(buf + (g - g0) * G, m, L.bits, L.asym, q, scales + k + g,
                                                zeros + k + g, dest + (g * G) // 2)
                g += 1
        return status
    if L.axis == KVCX_AXIS_TOKEN and not L.rotate:
        start = blk * blk_tokens
        n = min(blk_tokens, Lq - start)
        _load(src, dt, slab * S * D + t0 * D + start, n, buf)
    else:
        start = (t_a - t0) * D
        _load(src, dt, slab * S * D + t_a * D, n, buf)
        if L.rotate:
            _fwht_rows(buf, t_b - t_a, D)
    dest = codes + slab * row_bytes + (start * L.bits) // 8
    cdef bint fused = L.bits == 4   # quantize + pack in one pass
    if not fused:
        for k in range(n, ((n + 7) // 8) * 8):
            q[k] = 0
    if L.axis == KVCX_AXIS_TOKEN:
        ngroups = (Lq + G - 1) // G
        g = 0
        if G % 16 == 0:  # whole groups in a batch (start is a multiple of G here)
            k = slab * ngroups + start // G
            g = kvcx_groups(buf, n // G, G, L.bits, L.asym, scales + k, zeros + k, dest if fused else q, &status)
            if status:
                return status
        while g * G < n:
            m = min(G, n - g * G)
            k = slab * ngroups + (start + g * G) // G
            status = status | _quant_contig(buf + g * G, m, L.bits, L.asym, q + g * G, scales + k, zeros + k,
                                            dest + (g * G) // 2 if fused else NULL)
            g += 1
    else:
        nblk = (S - t0 + G - 1) // G
        k = (slab * nblk + blk) * D
        status = _quant_cols(buf, t_b - t_a, D, L.bits, L.asym, q, scales + k, zeros + k, tmp,
                             dest if fused else NULL)
    if not fused:
        _pack(q, n, L.bits, dest)
    return status


cdef int64_t _blocking(const kvcx_layout *L, int64_t *blk_tokens, int64_t *bufn) noexcept nogil:
    """Block geometry; returns the number of blocks per slab (the caller checked G, D >= 1 and t0 < S)."""
    cdef int64_t S = L.S, D = L.D, t0 = L.t0, G = L.group_size
    cdef int64_t Lq = (S - t0) * D
    if L.axis == KVCX_AXIS_TOKEN and not L.rotate:
        blk_tokens[0] = G * max(<int64_t>1, 4096 // G)   # element blocks of whole groups
        bufn[0] = blk_tokens[0]
        return (Lq + blk_tokens[0] - 1) // blk_tokens[0]
    if L.axis == KVCX_AXIS_TOKEN:
        blk_tokens[0] = (max(G, D) // D) * max(<int64_t>1, 4096 // max(G, D))   # whole tokens, whole groups
        bufn[0] = blk_tokens[0] * D
        return (S - t0 + blk_tokens[0] - 1) // blk_tokens[0]
    blk_tokens[0] = G
    bufn[0] = G * D
    return (S - t0 + G - 1) // G


def encode(const uint8_t[::1] src, int dt, Layout layout, uint8_t[::1] codes, uint16_t[::1] scales,
           uint16_t[::1] zeros, int nthreads):
    """Quantize tokens [t0, S) of every slab and pack them. Returns a kvcx_status (bits OR-ed).

    zeros may be empty (symmetric scheme)."""
    cdef const kvcx_layout *L = &layout.c
    cdef int64_t row_bytes = ((L.S - L.t0) * L.D * L.bits + 7) // 8
    cdef int64_t blk_tokens, bufn, nblk, nall, bpt, task, ntasks, b
    cdef int status = KVCX_OK
    cdef float *buf
    cdef uint16_t *zp = &zeros[0] if zeros.shape[0] > 0 else &scales[0]
    nblk = _blocking(L, &blk_tokens, &bufn)
    nall = L.N * nblk
    bpt = max(<int64_t>1, KVCX_TASK_VALUES // bufn)
    ntasks = (nall + bpt - 1) // bpt
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc((bufn + 5 * L.D) * sizeof(float) + bufn + 8)
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                for b in range(task * bpt, min(nall, task * bpt + bpt)):
                    status |= _enc_block(&src[0], dt, L, blk_tokens, b // nblk, b % nblk, row_bytes,
                                         &codes[0], &scales[0], zp,
                                         buf, <uint8_t *>(buf + bufn + 5 * L.D), buf + bufn)
                free(buf)
    return status


cdef void _dec_block(const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros, const kvcx_layout *L,
                     int64_t blk_tokens, int64_t slab, int64_t blk, int64_t row_bytes,
                     uint8_t *out, int64_t out_S, int64_t out_off, int dt, float *buf, uint8_t *q,
                     float *tmp) noexcept nogil:
    cdef int64_t S = L.S, D = L.D, t0 = L.t0, G = L.group_size
    cdef int64_t Lq = (S - t0) * D
    cdef int64_t t_a = t0 + blk * blk_tokens
    cdef int64_t t_b = min(S, t_a + blk_tokens)
    cdef int64_t n = (t_b - t_a) * D
    cdef int64_t g, start, m, k, ngroups, nblk
    if L.axis == KVCX_AXIS_TOKEN and not L.rotate:
        start = blk * blk_tokens
        n = min(blk_tokens, Lq - start)
    else:
        start = (t_a - t0) * D
    _unpack(codes + slab * row_bytes + (start * L.bits) // 8, n, L.bits, q)
    if L.axis == KVCX_AXIS_TOKEN:
        ngroups = (Lq + G - 1) // G
        g = 0
        while g * G < n:
            m = min(G, n - g * G)
            k = slab * ngroups + (start + g * G) // G
            _dequant_contig(q + g * G, m, L.bits, L.asym, scales[k], zeros[k], buf + g * G)
            g += 1
    else:
        nblk = (S - t0 + G - 1) // G
        k = (slab * nblk + blk) * D
        _dequant_cols(q, t_b - t_a, D, L.bits, L.asym, scales + k, zeros + k, buf, tmp)
    if L.rotate:
        _fwht_rows(buf, t_b - t_a, D)
    if dt == KVCX_DT_F16:  # saturating: a finite input never decodes to +-inf (7 * fp16(65504 / 7) = 65520)
        kvcx_f2h_sat_n(buf, <uint16_t *>out + slab * out_S * D + (out_off + t0) * D + start, n)
    else:
        _store(buf, dt, slab * out_S * D + (out_off + t0) * D + start, n, out)


def decode(const uint8_t[::1] codes, const uint16_t[::1] scales, const uint16_t[::1] zeros, Layout layout,
           uint8_t[::1] out, int64_t out_S, int64_t out_off, int dt, int nthreads):
    """Unpack and dequantize tokens [t0, S) of every slab into out, seen as (N, out_S, D), at token
    offset out_off (out_S = S, out_off = 0 for a tensor of its own). Returns a kvcx_status."""
    cdef const kvcx_layout *L = &layout.c
    cdef int64_t row_bytes = ((L.S - L.t0) * L.D * L.bits + 7) // 8
    cdef int64_t blk_tokens, bufn, nblk, nall, bpt, task, ntasks, b
    cdef int status = KVCX_OK
    cdef float *buf
    cdef const uint16_t *zp = &zeros[0] if zeros.shape[0] > 0 else &scales[0]
    nblk = _blocking(L, &blk_tokens, &bufn)
    nall = L.N * nblk
    bpt = max(<int64_t>1, KVCX_TASK_VALUES // bufn)
    ntasks = (nall + bpt - 1) // bpt
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc((bufn + 5 * L.D) * sizeof(float) + bufn + 8)
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                for b in range(task * bpt, min(nall, task * bpt + bpt)):
                    _dec_block(&codes[0], &scales[0], zp, L, blk_tokens, b // nblk, b % nblk, row_bytes,
                               &out[0], out_S, out_off, dt, buf, <uint8_t *>(buf + bufn + 5 * L.D), buf + bufn)
                free(buf)
    return status


