# vLLM's TurboQuant KV cache (turboquant.h): part of the kernels' module body (core.pxi), included by every variant.
# Rows are tokens of D values, each one record of `rec` bytes (a key record: indices then the FP16 norm; a value
# record: codes then the FP16 scale and minimum); row r of the packed tensor (slab r // S, token r % S) is row
# (r // S) * out_S + token_offset + r % S of a decode's output.

TQ_MAX_LEVELS = KVCX_TQ_MAX_LEVELS


cdef int _tq_enc_rows(const uint8_t *src, int dt, int64_t r0, int64_t r1, int64_t D, int bits, int is_key,
                      const float *mid, float h, int64_t rec, uint8_t *codes, float *buf, double *work,
                      uint8_t *q) noexcept nogil:
    cdef int64_t r
    cdef int status = KVCX_OK
    for r in range(r0, r1):
        _load(src, dt, r * D, D, buf)
        if kvcx_absmax_bits(buf, D) >= 0x7f800000:
            return KVCX_ST_NONFINITE
        if is_key:
            status |= kvcx_tq_key_encode(buf, D, bits, mid, h, work, q, codes + r * rec)
        else:
            status |= kvcx_tq_value_encode(buf, D, bits, q, codes + r * rec)
    return status


def tq_encode(const uint8_t[::1] src, int dt, int64_t rows, int64_t D, int bits, bint is_key,
              const float[::1] midpoints, float h, int64_t rec, uint8_t[::1] codes, int nthreads):
    """Quantize ``rows`` rows of D values into TurboQuant records of ``rec`` bytes (keys: Lloyd-Max indices of the
    rotated unit row against ``midpoints``, H's entry ``h``; values: uniform min/max codes). Returns a kvcx_status."""
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task
    cdef int status = KVCX_OK
    cdef float *buf
    cdef double *work
    cdef uint8_t *q
    cdef const float *mid = &midpoints[0]
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            work = <double *>malloc(D * sizeof(double))
            q = <uint8_t *>malloc(D)
            if buf == NULL or work == NULL or q == NULL:
                status |= KVCX_ST_NOMEM
            else:
                status |= _tq_enc_rows(&src[0], dt, task * per, min(rows, task * per + per), D, bits, is_key, mid,
                                       h, rec, &codes[0], buf, work, q)
            free(buf)
            free(work)
            free(q)
    return status


cdef int _tq_dec_rows(const uint8_t *codes, int64_t r0, int64_t r1, int64_t S, int64_t D, int bits, int is_key,
                      const float *cen, int nc, float h, int64_t rec, uint8_t *out, int64_t out_S, int64_t off,
                      int dt, float *buf, double *work) noexcept nogil:
    cdef int64_t r
    cdef int status = KVCX_OK
    for r in range(r0, r1):
        if is_key:
            status |= kvcx_tq_key_decode(codes + r * rec, D, bits, cen, nc, h, work, buf)
        else:
            status |= kvcx_tq_value_decode(codes + r * rec, D, bits, buf)
        _store(buf, dt, ((r // S) * out_S + off + r % S) * D, D, out)
    return status


def tq_decode(const uint8_t[::1] codes, int64_t rows, int64_t S, int64_t D, int bits, bint is_key,
              const float[::1] centroids, bint norm_correction, float h, int64_t rec, uint8_t[::1] out,
              int64_t out_S, int64_t token_offset, int dt, int nthreads):
    """Dequantize TurboQuant records (see tq_encode) into ``out`` (dtype dt, rows placed as the section says)."""
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task
    cdef float *buf
    cdef double *work
    cdef int status = KVCX_OK
    cdef const float *cen = &centroids[0]
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            work = <double *>malloc(D * sizeof(double))
            if buf == NULL or work == NULL:
                status |= KVCX_ST_NOMEM
            else:
                status |= _tq_dec_rows(&codes[0], task * per, min(rows, task * per + per), S, D, bits, is_key, cen,
                                       norm_correction, h, rec, &out[0], out_S, token_offset, dt, buf, work)
            free(buf)
            free(work)
    return status
