# kvcx's lattice codec (e8p.h): part of the kernels' module body (core.pxi), included by every variant. Rows are
# tokens of D values, each one record of D / 4 + 2 bytes (D / 8 16-bit E8P codes, then the FP16 scale); row r of the
# packed tensor (slab r // S, token t0 + r % S) is row (r // S) * out_S + token_offset + t0 + r % S of a decode's
# output (tokens [0, t0) of each slab are the exact sinks, written by the codec).

E8P_PATTERNS = KVCX_E8P_PATTERNS
E8P_RMS = KVCX_E8P_RMS     # the search's scale is a row's RMS over this (FP32; the Triton kernels read it here)
E8P_GAIN = KVCX_E8P_GAIN   # the record's scale is the search's times this (FP32, unbiased decode: e8p.h)
kvcx_e8p_init()   # the search's tables, once, before any thread reads them


def e8p_grid():
    """The 256 signed patterns of the codebook, twice their values (int8, 256 x 8): what a code's low byte picks."""
    import numpy as np
    out = np.empty((KVCX_E8P_PATTERNS, 8), dtype=np.int8)
    cdef int k, i
    for k in range(KVCX_E8P_PATTERNS):
        for i in range(8):
            out[k, i] = kvcx_e8p_grid[k][i]
    return out


cdef int _e8p_enc_rows(const uint8_t *src, int dt, int64_t r0, int64_t r1, int64_t S, int64_t t0, int64_t D,
                       uint8_t *codes, float *buf) noexcept nogil:
    cdef int64_t r
    cdef int64_t rec = kvcx_e8p_record_bytes(D)
    cdef int64_t Sq = S - t0
    cdef int status = KVCX_OK
    for r in range(r0, r1):
        _load(src, dt, ((r // Sq) * S + t0 + r % Sq) * D, D, buf)
        if kvcx_absmax_bits(buf, D) >= 0x7f800000:
            return KVCX_ST_NONFINITE
        status |= kvcx_e8p_encode_row(buf, D, codes + r * rec)
    return status


def e8p_encode(const uint8_t[::1] src, int dt, int64_t N, int64_t S, int64_t t0, int64_t D, uint8_t[::1] codes,
               int nthreads):
    """Encode tokens [t0, S) of N slabs of S tokens of D values (dtype dt) into E8P records. Returns a kvcx_status."""
    cdef int64_t rows = N * (S - t0)
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task
    cdef int status = KVCX_OK
    cdef float *buf
    if rows == 0:
        return status
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                status |= _e8p_enc_rows(&src[0], dt, task * per, min(rows, task * per + per), S, t0, D, &codes[0],
                                        buf)
            free(buf)
    return status


cdef int _e8p_dec_rows(const uint8_t *codes, int64_t r0, int64_t r1, int64_t Sq, int64_t D, uint8_t *out,
                       int64_t out_S, int64_t off, int dt, float *buf) noexcept nogil:
    cdef int64_t r
    cdef int64_t rec = kvcx_e8p_record_bytes(D)
    cdef int status = KVCX_OK
    for r in range(r0, r1):
        status |= kvcx_e8p_decode_row(codes + r * rec, D, buf)
        _store(buf, dt, ((r // Sq) * out_S + off + r % Sq) * D, D, out)
    return status


def e8p_decode(const uint8_t[::1] codes, int64_t N, int64_t S, int64_t t0, int64_t D, uint8_t[::1] out,
               int64_t out_S, int64_t token_offset, int dt, int nthreads):
    """Decode the E8P records of tokens [t0, S) of N slabs (see e8p_encode) into ``out`` (dtype dt, out_S tokens a
    slab, the tensor's token 0 at ``token_offset``). Returns a kvcx_status."""
    cdef int64_t rows = N * (S - t0)
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task
    cdef float *buf
    cdef int status = KVCX_OK
    if rows == 0:
        return status
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                status |= _e8p_dec_rows(&codes[0], task * per, min(rows, task * per + per), S - t0, D, &out[0],
                                        out_S, token_offset + t0, dt, buf)
            free(buf)
    return status
