# cython: language_level=3, embedsignature=True, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""kvcx compute kernels (nogil, OpenMP).

Kernels only: every function here trusts its caller. Dtype, shape, contiguity
and size checks, output allocation and error messages live in the codecs (``kvcx.codecs``).

Tensors are seen as ``(N, S, D)``: N slabs (batch x heads), S tokens, D values
per token (the contiguous last axis). Tokens ``[0, t0)`` of every slab are kept
exact elsewhere; the kernels quantize tokens ``[t0, S)``.

Code stream: the codes of the quantized part in C order, each slab starting on
a byte boundary, bits packed LSB-first: with 4 bits, element 2i is the low
nibble of byte i and element 2i+1 the high nibble. Codes are unsigned:
symmetric ``q + 2**(bits-1)``, asymmetric ``q`` in ``[0, 2**bits - 1]``.

Groups: ``axis=0`` ("token") groups run along each slab's flattened
quantized part (``(S - t0) * D`` values, the last group of a slab may be
partial); ``axis=1`` ("channel") groups run along tokens, one group per
``(slab, token block, channel)``. Optionally each token's D values are rotated by
an orthonormal Walsh-Hadamard transform before quantization (the inverse is
applied on decode).
"""
from cython.parallel cimport prange, threadid
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int32_t, int64_t
from libc.string cimport memcpy
from libc.stdlib cimport malloc, free
from libc.math cimport rintf, sqrtf, fabsf, fabs, sqrt

from kvcx.codecs._openmp_helpers cimport omp_get_max_threads, KVCX_OPENMP_ENABLED

from kvcx.codecs._kernels cimport *


# ----------------------------------------------------------------------------
# constants shared with the Python layer (defined once, in _kernels.h)
# ----------------------------------------------------------------------------

DT_F32 = KVCX_DT_F32
DT_F16 = KVCX_DT_F16
DT_BF16 = KVCX_DT_BF16
AXIS_TOKEN = KVCX_AXIS_TOKEN
AXIS_CHANNEL = KVCX_AXIS_CHANNEL
STATUS_OK = KVCX_OK
STATUS_NONFINITE = KVCX_ST_NONFINITE
STATUS_SCALE_OVERFLOW = KVCX_ST_SCALE_OVERFLOW
STATUS_NOMEM = KVCX_ST_NOMEM
STATUS_CORRUPT = KVCX_ST_CORRUPT
METRICS_CHUNK = KVCX_METRICS_CHUNK
METRICS_FIELDS = KVCX_METRICS_FIELDS
FUSED_VEC = KVCX_FUSED_VEC
FUSED_AMX = KVCX_FUSED_AMX


cdef class Layout:
    """The geometry of one tensor as the encode/decode kernels see it (a ``kvcx_layout``).

    Built by ``kvcx.codecs.intcodec`` after its checks; the kernels trust every field.
    """
    cdef kvcx_layout c

    def __init__(self, *, int64_t N, int64_t S, int64_t D, int64_t t0, int64_t group_size, int bits,
                 bint asym, int axis, bint rotate):
        self.c.N = N
        self.c.S = S
        self.c.D = D
        self.c.t0 = t0
        self.c.group_size = group_size
        self.c.bits = bits
        self.c.asym = asym
        self.c.axis = axis
        self.c.rotate = rotate

    def __repr__(self):
        c = self.c
        return (f"Layout(N={c.N}, S={c.S}, D={c.D}, t0={c.t0}, group_size={c.group_size}, bits={c.bits}, "
                f"asym={bool(c.asym)}, axis={c.axis}, rotate={bool(c.rotate)})")


def build_info():
    """Facts about this build of the kernels (for ``kvcx info``)."""
    return {
        "openmp": bool(KVCX_OPENMP_ENABLED),
        "max_threads": int(omp_get_max_threads()),
        "simd": kvcx_simd_flags().decode().split(),
        "f16c_kernels": bool(KVCX_F16C),
    }


def crc32c(const uint8_t[::1] data, uint32_t crc=0):
    """CRC-32C (Castagnoli) of ``data``, continuing from ``crc`` (GIL released)."""
    cdef uint32_t r
    with nogil:
        r = kvcx_crc32c(crc, &data[0], data.shape[0]) if data.shape[0] else crc
    return r


def crc32c_blocks(const uint8_t[::1] data, int64_t block, uint32_t[::1] out, int nthreads):
    """out[i] = CRC-32C of data[i * block:(i + 1) * block] (the last block may be short), in parallel.
    The caller sized out to ceil(len(data) / block) and checked block >= 1."""
    cdef int64_t n = data.shape[0]
    cdef int64_t nb = (n + block - 1) // block
    cdef int64_t i
    with nogil:
        for i in prange(nb, num_threads=nthreads, schedule="static"):
            out[i] = kvcx_crc32c(0, &data[0] + i * block, min(block, n - i * block))


def max_threads():
    return int(omp_get_max_threads())


# ----------------------------------------------------------------------------
# element conversion
# ----------------------------------------------------------------------------

cdef inline void _load(const uint8_t *src, int dt, int64_t start, int64_t n, float *dst) noexcept nogil:
    """Convert n elements starting at element `start` of src (dtype dt) to float32."""
    cdef int64_t i
    cdef const float *pf
    if dt == KVCX_DT_F32:
        pf = <const float *>src + start
        for i in range(n):
            dst[i] = pf[i]
    elif dt == KVCX_DT_F16:
        kvcx_h2f_n(<const uint16_t *>src + start, dst, n)
    else:
        kvcx_b2f_n(<const uint16_t *>src + start, dst, n)


cdef inline void _store(const float *buf, int dt, int64_t start, int64_t n, uint8_t *dst) noexcept nogil:
    """Convert n float32 values to dtype dt at element `start` of dst."""
    cdef int64_t i
    cdef float *pf
    if dt == KVCX_DT_F32:
        pf = <float *>dst + start
        for i in range(n):
            pf[i] = buf[i]
    elif dt == KVCX_DT_F16:
        kvcx_f2h_n(buf, <uint16_t *>dst + start, n)
    else:
        kvcx_f2b_n(buf, <uint16_t *>dst + start, n)


def convert(const uint8_t[::1] src, int src_dt, uint8_t[::1] dst, int dst_dt, int64_t n, int nthreads):
    """Convert n elements between float32 / float16 / bfloat16 (RNE, NaN kept)."""
    cdef int64_t nchunks = (n + KVCX_CONV_CHUNK - 1) // KVCX_CONV_CHUNK
    cdef int64_t c
    with nogil:
        for c in prange(nchunks, num_threads=nthreads, schedule="static"):
            _convert_chunk(&src[0], src_dt, &dst[0], dst_dt, c * KVCX_CONV_CHUNK,
                           min(KVCX_CONV_CHUNK, n - c * KVCX_CONV_CHUNK))


cdef void _convert_chunk(const uint8_t *src, int sdt, uint8_t *dst, int ddt, int64_t start, int64_t n) noexcept nogil:
    cdef float buf[1024]
    cdef int64_t off = 0, m
    while off < n:
        m = min(<int64_t>1024, n - off)
        _load(src, sdt, start + off, m, buf)
        _store(buf, ddt, start + off, m, dst)
        off += m


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


# ----------------------------------------------------------------------------
# per-channel bit widths for keys (kvcx/_widths.h): groups of gs tokens per channel, one task per
# (slab, group); the Python layer (kvcx.codecs.widths.WidthCodec) turns ranges into parameters and widths
# ----------------------------------------------------------------------------

W_MAX = KVCX_W_MAX
W_SIMD = bool(KVCX_W_AVX2)


cdef inline int64_t _w_groups_per_task(int64_t gs, int64_t D) noexcept nogil:
    """Groups of gs x D values one parallel task takes (about KVCX_TASK_VALUES values)."""
    return max(<int64_t>1, KVCX_TASK_VALUES // (gs * D))


cdef inline void _load_rows(const uint8_t *src, int dt, int64_t S, int64_t D, int64_t slab, int64_t t,
                            int64_t rows, float *tile) noexcept nogil:
    _load(src, dt, (slab * S + t) * D, rows * D, tile)


def w_minmax(const uint8_t[::1] src, int dt, Layout layout, float[::1] mn, float[::1] mx, int nthreads):
    """Per (slab, group, channel) min and max of tokens [t0, S) in groups of group_size tokens ((N, G, D) each)."""
    cdef int64_t N = layout.c.N, S = layout.c.S, D = layout.c.D, t0 = layout.c.t0, gs = layout.c.group_size
    cdef int64_t G = (S - t0 + gs - 1) // gs
    cdef int64_t gpt = _w_groups_per_task(gs, D)
    cdef int64_t ntasks = (N * G + gpt - 1) // gpt
    cdef int64_t task, k, n, g, rows
    cdef float *tile
    cdef int status = KVCX_OK
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            tile = <float *>malloc(gs * D * sizeof(float))
            if tile == NULL:
                status |= KVCX_ST_NOMEM
            else:
                for k in range(task * gpt, min(N * G, task * gpt + gpt)):
                    n = k // G
                    g = k % G
                    rows = min(gs, S - t0 - g * gs)
                    _load_rows(&src[0], dt, S, D, n, t0 + g * gs, rows, tile)
                    kvcx_w_colminmax(tile, rows, D, &mn[k * D], &mx[k * D])
                free(tile)
    return status


def w_channels(const float[::1] mn, const float[::1] mx, Layout layout, float[::1] lo, float[::1] hi,
               double[::1] spread, int nthreads):
    """Per (slab, channel) min, max and spread (sum of rows x range^2) from w_minmax's (N, G, D) results."""
    cdef int64_t N = layout.c.N, D = layout.c.D, gs = layout.c.group_size
    cdef int64_t G = (layout.c.S - layout.c.t0 + gs - 1) // gs
    cdef int64_t last_rows = (layout.c.S - layout.c.t0) - (G - 1) * gs
    cdef int64_t n
    with nogil:
        for n in prange(N, num_threads=nthreads, schedule="static"):
            kvcx_w_channels(&mn[n * G * D], &mx[n * G * D], G, D, gs, last_rows, &lo[n * D], &hi[n * D],
                            &spread[n * D])


def w_encode(const uint8_t[::1] src, int dt, Layout layout, const float[::1] mn, const float[::1] mx, const float[::1] lo, const float[::1] hi,
             const uint8_t[::1] widths, const float[::1] top, const int64_t[::1] off, const int64_t[::1] slab_off,
             const int64_t[::1] group_bytes, uint8_t[::1] stats, uint8_t[::1] planes, int nthreads):
    """Range bytes (N, G, D, 2) and bit planes of tokens [t0, S): mn / mx (N, G, D) from w_minmax, lo / hi
    (N, D) the channels' FP16 ranges, widths / top (2^w - 1) / off (N, D); slab n's groups start at
    slab_off[n], group_bytes[n] apart."""
    cdef int64_t N = layout.c.N, S = layout.c.S, D = layout.c.D, t0 = layout.c.t0, gs = layout.c.group_size
    cdef int64_t G = (S - t0 + gs - 1) // gs
    cdef int64_t gpt = _w_groups_per_task(gs, D)
    cdef int64_t ntasks = (N * G + gpt - 1) // gpt
    cdef int64_t task, k, n, g, rows
    cdef float *tile
    cdef int status = KVCX_OK
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            tile = <float *>malloc((gs * D + 4 * D) * sizeof(float) + 2 * gs * D)
            if tile == NULL:
                status |= KVCX_ST_NOMEM
            else:
                for k in range(task * gpt, min(N * G, task * gpt + gpt)):
                    n = k // G
                    g = k % G
                    rows = min(gs, S - t0 - g * gs)
                    _load_rows(&src[0], dt, S, D, n, t0 + g * gs, rows, tile)
                    kvcx_w_encode_tile(tile, rows, gs, D, &mn[k * D], &mx[k * D], &lo[n * D], &hi[n * D],
                                       &widths[n * D], &top[n * D], &off[n * D],
                                       <uint8_t *>(tile + gs * D + 4 * D), tile + gs * D, &stats[k * D * 2],
                                       &planes[0] + slab_off[n] + g * group_bytes[n])
                free(tile)
    return status


def w_decode(const uint8_t[::1] planes, const uint8_t[::1] stats, Layout layout, const float[::1] lo, const float[::1] hi, const uint8_t[::1] widths,
             const float[::1] top, const int64_t[::1] off, const int64_t[::1] slab_off, const int64_t[::1] group_bytes, uint8_t[::1] out,
             int64_t out_S, int64_t out_off, int dt, int nthreads):
    """The inverse of w_encode, into out seen as (N, out_S, D) at token offset out_off."""
    cdef int64_t N = layout.c.N, S = layout.c.S, D = layout.c.D, t0 = layout.c.t0, gs = layout.c.group_size
    cdef int64_t G = (S - t0 + gs - 1) // gs
    cdef int64_t gpt = _w_groups_per_task(gs, D)
    cdef int64_t ntasks = (N * G + gpt - 1) // gpt
    cdef int64_t task, k, n, g, rows
    cdef float *tile
    cdef int status = KVCX_OK
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            tile = <float *>malloc((gs * D + 2 * D) * sizeof(float) + 2 * gs * D)
            if tile == NULL:
                status |= KVCX_ST_NOMEM
            else:
                for k in range(task * gpt, min(N * G, task * gpt + gpt)):
                    n = k // G
                    g = k % G
                    rows = min(gs, S - t0 - g * gs)
                    if kvcx_w_decode_tile(&planes[0] + slab_off[n] + g * group_bytes[n], &stats[k * D * 2], rows,
                                          gs, D, &lo[n * D], &hi[n * D], &widths[n * D], &top[n * D], &off[n * D],
                                          <uint8_t *>(tile + gs * D + 2 * D), tile + gs * D, tile):
                        status |= KVCX_ST_CORRUPT
                    if dt == KVCX_DT_F16:
                        kvcx_f2h_sat_n(tile, <uint16_t *>&out[0] + (n * out_S + out_off + t0 + g * gs) * D, rows * D)
                    else:
                        _store(tile, dt, (n * out_S + out_off + t0 + g * gs) * D, rows * D, &out[0])
                free(tile)
    return status


# ----------------------------------------------------------------------------
# quality metrics: fixed chunks, float64 partials, combined in a fixed order so
# the result does not depend on the number of threads
# ----------------------------------------------------------------------------

cdef void _metrics_chunk(const uint8_t *a, int adt, const uint8_t *b, int bdt, int64_t start, int64_t n,
                         double *res) noexcept nogil:
    cdef float xa[512]
    cdef float xb[512]
    cdef int64_t off = 0, m, i
    cdef double sxx = 0, see = 0, syy = 0, sxy = 0, mx = 0, d, x, y, bad = 0
    while off < n:
        m = min(<int64_t>512, n - off)
        _load(a, adt, start + off, m, xa)
        _load(b, bdt, start + off, m, xb)
        for i in range(m):
            x = xa[i]
            y = xb[i]
            bad = bad + (x - x) + (y - y)
            d = x - y
            sxx = sxx + x * x
            syy = syy + y * y
            sxy = sxy + x * y
            see = see + d * d
            d = fabs(d)
            mx = d if d > mx else mx
        off += m
    res[0] = sxx
    res[1] = see
    res[2] = syy
    res[3] = sxy
    res[4] = mx
    res[5] = 0.0 if bad == 0.0 else 1.0


def metrics(const uint8_t[::1] a, int adt, const uint8_t[::1] b, int bdt, int64_t n,
            double[:, ::1] partials, double[::1] out, int nthreads):
    """out = [sum x^2, sum (x-y)^2, sum y^2, sum x*y, max |x-y|, nonfinite flag].

    partials: (ceil(n / METRICS_CHUNK), METRICS_FIELDS) float64, sized by the caller."""
    cdef int64_t nchunks = (n + KVCX_METRICS_CHUNK - 1) // KVCX_METRICS_CHUNK
    cdef int64_t c
    cdef int k
    with nogil:
        for c in prange(nchunks, num_threads=nthreads, schedule="static"):
            _metrics_chunk(&a[0], adt, &b[0], bdt, c * KVCX_METRICS_CHUNK, min(<int64_t>KVCX_METRICS_CHUNK, n - c * KVCX_METRICS_CHUNK),
                           &partials[c, 0])
        for k in range(KVCX_METRICS_FIELDS):
            out[k] = 0.0
        for c in range(nchunks):
            out[0] += partials[c, 0]
            out[1] += partials[c, 1]
            out[2] += partials[c, 2]
            out[3] += partials[c, 3]
            out[4] = partials[c, 4] if partials[c, 4] > out[4] else out[4]
            out[5] = out[5] + partials[c, 5]


# ----------------------------------------------------------------------------
# fused attention over packed 2/3/4-bit keys and values (kvcx/codecs/_attn.h)
# ----------------------------------------------------------------------------

ATTN_TILE = KVCX_ATTN_TILE
ATTN_MAX_GROUP = KVCX_ATTN_MAX_GROUP
ATTN_MAX_D = KVCX_ATTN_MAX_D
ATTN_MAX_ROWS = KVCX_ATTN_MAX_ROWS
ATTN_TILE_ROWS = KVCX_ATTN_TILE_ROWS
ATTN_SIMD = bool(KVCX_ATTN_AVX2)


def attn_work_floats(int64_t R, int64_t D, bint widths=False):
    """Floats of workspace one attention task needs (the caller allocates tasks x this); ``widths``: keys with
    a width per channel."""
    return int(kvcx_attn_work_floats(R, D, widths))


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
                 int64_t nq=1, bint k_widths=False):
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
        self.c.nsplit = 1
        self._keep = ()

    def bind(self, kc, ks, kz, kblk, vc, vs, vz, hk, hv, int64_t Tq, work, int64_t nsplit, kgoff=None, kw=None,
             krange=None, kgchunk=None):
        """Bind the stores: codes [B * Hkv, tokens * D * bits / 8] (uint8), scales / zero points [B * Hkv, n]
        (FP16 bits; zero points empty when symmetric), key block starts (int64; empty unless keys are
        grouped per channel), head rows hk/hv [B * Hkv, nh, D] (float32), Tq packed positions after
        them, the workspace [B * Hkv * nsplit, attn_work_floats(R, D, k_widths)] (float32).

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
        self.c.v_tokens = vc_.shape[1] // (D * self.c.v_bits // 8) if D else 0
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
            float[:, :, ::1] out, float scaling, int nthreads):
        """One step: q, out [B, Hkv * R, D] (row r of a KV head: query head r // nq, token r % nq); rk/rv
        [B * Hkv, nr, D] the residual after the bound tokens (nr may be 0); mask [rows, kv_len] added to the
        scores or maskb [rows, kv_len] (0: masked), one of them empty or both: the row of batch row b and
        token i is b * mask_bs + i * mask_qs; causal: token i sees positions up to kv_len - nq + i."""
        cdef kvcx_attn_layout L = self.c
        cdef kvcx_attn_args A = self.a
        cdef int64_t ntasks = L.B * L.Hkv * L.nsplit
        cdef int64_t nrows = L.B * L.Hkv * L.R
        cdef int64_t i
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


# ----------------------------------------------------------------------------
# engine formats (kvcx/codecs/_engine.h): llama.cpp's KV block types and vLLM's fp8 KV cache, emulated
# exactly. Rows are tokens of D values; row r of the packed tensor (slab r // S, token r % S) is row
# (r // S) * out_S + token_offset + r % S of a decode's output. Rotation: an orthonormal Walsh-Hadamard
# transform of each run of 64 values (llama.cpp's attention rotation), undone on decode.
# ----------------------------------------------------------------------------

QK = KVCX_QK
GGML_Q8_0 = KVCX_GGML_Q8_0
GGML_Q4_0 = KVCX_GGML_Q4_0
GGML_Q4_1 = KVCX_GGML_Q4_1
GGML_Q5_0 = KVCX_GGML_Q5_0
GGML_Q5_1 = KVCX_GGML_Q5_1
GGML_IQ4_NL = KVCX_GGML_IQ4_NL
FP8_E4M3 = KVCX_FP8_E4M3
FP8_E5M2 = KVCX_FP8_E5M2
ENGINE_ROTATE_BLOCK = 64


def ggml_qbytes(int type):
    """Bytes of codes per block of 32 values (without its FP16 d and m)."""
    return int(kvcx_ggml_qbytes(type))


cdef int _ggml_enc_rows(const uint8_t *src, int dt, int64_t r0, int64_t r1, int64_t D, int type, int64_t rot_n,
                        uint8_t *codes, uint16_t *d, uint16_t *m, float *buf) noexcept nogil:
    cdef int64_t r, b, nb = D // KVCX_QK
    cdef int64_t qb = kvcx_ggml_qbytes(type)
    cdef int status = KVCX_OK
    cdef uint16_t dummy = 0
    cdef bint has_min = kvcx_ggml_has_min(type)
    for r in range(r0, r1):
        _load(src, dt, r * D, D, buf)
        if kvcx_absmax_bits(buf, D) >= 0x7f800000:
            return KVCX_ST_NONFINITE
        if rot_n:
            kvcx_fwht_rows(buf, D // rot_n, rot_n)
        for b in range(nb):
            status |= kvcx_ggml_quant_block(type, buf + b * KVCX_QK, d + r * nb + b,
                                            m + r * nb + b if has_min else &dummy, codes + (r * nb + b) * qb)
    return status


def ggml_encode(const uint8_t[::1] src, int dt, int64_t rows, int64_t D, int type, int64_t rot_n,
                uint8_t[::1] codes, uint16_t[::1] d, uint16_t[::1] m, int nthreads):
    """Quantize ``rows`` rows of D values (D a multiple of 32; of rot_n, a power of two, when rot_n is not 0: each
    run of rot_n values Hadamard-rotated first) into llama.cpp blocks:
    codes (block bodies), d (FP16 bits, one per block), m (FP16 minimum per block for q4_1/q5_1, else empty).
    Returns a kvcx_status (bits OR-ed)."""
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task
    cdef int status = KVCX_OK
    cdef float *buf
    cdef uint16_t *mp = &m[0] if m.shape[0] > 0 else &d[0]
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                status |= _ggml_enc_rows(&src[0], dt, task * per, min(rows, task * per + per), D, type, rot_n,
                                         &codes[0], &d[0], mp, buf)
                free(buf)
    return status


cdef void _ggml_dec_rows(const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t r0, int64_t r1,
                         int64_t S, int64_t D, int type, int64_t rot_n, uint8_t *out, int64_t out_S, int64_t off,
                         int dt, float *buf) noexcept nogil:
    cdef int64_t r, b, nb = D // KVCX_QK
    cdef int64_t qb = kvcx_ggml_qbytes(type)
    cdef bint has_min = kvcx_ggml_has_min(type)
    for r in range(r0, r1):
        for b in range(nb):
            kvcx_ggml_dequant_block(type, d[r * nb + b], m[r * nb + b] if has_min else 0,
                                    codes + (r * nb + b) * qb, buf + b * KVCX_QK)
        if rot_n:
            kvcx_fwht_rows(buf, D // rot_n, rot_n)
        _store(buf, dt, ((r // S) * out_S + off + r % S) * D, D, out)


def ggml_decode(const uint8_t[::1] codes, const uint16_t[::1] d, const uint16_t[::1] m, int64_t rows, int64_t S,
                int64_t D, int type, int64_t rot_n, uint8_t[::1] out, int64_t out_S, int64_t token_offset, int dt,
                int nthreads):
    """Dequantize llama.cpp blocks (see ggml_encode) into ``out`` (dtype dt, rows placed as the section says)."""
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task
    cdef float *buf
    cdef const uint16_t *mp = &m[0] if m.shape[0] > 0 else &d[0]
    cdef int status = KVCX_OK
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                _ggml_dec_rows(&codes[0], &d[0], mp, task * per, min(rows, task * per + per), S, D, type, rot_n,
                               &out[0], out_S, token_offset, dt, buf)
                free(buf)
    return status


def fp8_encode(const uint8_t[::1] src, int dt, int64_t rows, int64_t D, int fmt, float scale, uint8_t[::1] codes,
               int nthreads):
    """vLLM's fp8 KV write: code = fp8(saturate(x / scale)), round to nearest even. Returns a kvcx_status."""
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task, r, j
    cdef int status = KVCX_OK
    cdef float *buf
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                for r in range(task * per, min(rows, task * per + per)):
                    _load(&src[0], dt, r * D, D, buf)
                    if kvcx_absmax_bits(buf, D) >= 0x7f800000:
                        status |= KVCX_ST_NONFINITE
                    else:
                        for j in range(D):
                            codes[r * D + j] = kvcx_f2fp8(buf[j] / scale, fmt)
                free(buf)
    return status


def fp8_decode(const uint8_t[::1] codes, int64_t rows, int64_t S, int64_t D, int fmt, float scale,
               uint8_t[::1] out, int64_t out_S, int64_t token_offset, int dt, int nthreads):
    """vLLM's fp8 KV read: x = float(code) * scale, stored in dtype dt."""
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task, r, j
    cdef float lut[256]
    cdef float *buf
    cdef int status = KVCX_OK
    for j in range(256):
        lut[j] = kvcx_fp82f(<uint8_t>j, fmt)
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                for r in range(task * per, min(rows, task * per + per)):
                    for j in range(D):
                        buf[j] = lut[codes[r * D + j]] * scale
                    _store(buf, dt, ((r // S) * out_S + token_offset + r % S) * D, D, &out[0])
                free(buf)
    return status


# ----------------------------------------------------------------------------
# vLLM's CPU fused K/V plane <-> key and value planes (_fused.h); a slab a task, a scratch slab a thread
# ----------------------------------------------------------------------------

def fused_split(const uint8_t[::1] chunk, uint8_t[::1] keys, uint8_t[::1] values, int itemsize, int64_t L,
                int64_t T, int64_t H, int64_t D, int64_t bs, int order, uint8_t[::1] scratch, int nthreads):
    cdef int64_t nslabs = L * (T // bs) * H, s, slab_bytes = 2 * bs * D * itemsize
    cdef const uint8_t *c = &chunk[0]
    cdef uint8_t *k = &keys[0]
    cdef uint8_t *v = &values[0]
    cdef uint8_t *scr = &scratch[0]
    with nogil:
        for s in prange(nslabs, num_threads=nthreads, schedule="static"):
            if itemsize == 2:
                kvcx_fused_split_u16(<const uint16_t *>c, <uint16_t *>k, <uint16_t *>v, T, H, D, bs, order, s,
                                     <uint16_t *>(scr + threadid() * slab_bytes))
            else:
                kvcx_fused_split_u32(<const uint32_t *>c, <uint32_t *>k, <uint32_t *>v, T, H, D, bs, order, s,
                                     <uint32_t *>(scr + threadid() * slab_bytes))


def fused_join(const uint8_t[::1] keys, const uint8_t[::1] values, uint8_t[::1] chunk, int itemsize, int64_t L,
               int64_t T, int64_t H, int64_t D, int64_t bs, int order, uint8_t[::1] scratch, int nthreads):
    cdef int64_t nslabs = L * (T // bs) * H, s, slab_bytes = 2 * bs * D * itemsize
    cdef const uint8_t *k = &keys[0]
    cdef const uint8_t *v = &values[0]
    cdef uint8_t *c = &chunk[0]
    cdef uint8_t *scr = &scratch[0]
    with nogil:
        for s in prange(nslabs, num_threads=nthreads, schedule="static"):
            if itemsize == 2:
                kvcx_fused_join_u16(<const uint16_t *>k, <const uint16_t *>v, <uint16_t *>c, T, H, D, bs, order, s,
                                    <uint16_t *>(scr + threadid() * slab_bytes))
            else:
                kvcx_fused_join_u32(<const uint32_t *>k, <const uint32_t *>v, <uint32_t *>c, T, H, D, bs, order, s,
                                    <uint32_t *>(scr + threadid() * slab_bytes))
