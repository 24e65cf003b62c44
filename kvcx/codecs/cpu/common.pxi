# the constants shared with Python, the tensor layout, the build, CRC-32C, threads, dtype conversion: part of the kernels' module body (core.pxi), included by every variant
# ----------------------------------------------------------------------------
# constants shared with the Python layer (defined once, in base.h)
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


