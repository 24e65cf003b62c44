# the engine formats (engine.h): part of the kernels' module body (core.pxi), included by every variant
# ----------------------------------------------------------------------------
# engine formats (kvcx/codecs/cpu/engine.h): llama.cpp's KV block types and vLLM's fp8 KV cache, emulated
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
FP4_MX = KVCX_FP4_MX
FP4_NV = KVCX_FP4_NV
MX_QK = KVCX_MX_QK
NV_QK = KVCX_NV_QK


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




# FP4 (engine.h): mxfp4 rows are D / 32 blocks of 17 bytes (ggml's block_mxfp4); nvfp4 rows are D / 2 bytes of
# codes, all rows first, then D / 16 E4M3 scale bytes a row (torchao's qdata, then its scales)

cdef int _fp4_enc_rows(const uint8_t *src, int dt, int64_t r0, int64_t r1, int64_t rows, int64_t D, int fmt,
                       float p, uint8_t *codes, float *buf) noexcept nogil:
    cdef int64_t r, b
    cdef int status = KVCX_OK
    for r in range(r0, r1):
        _load(src, dt, r * D, D, buf)
        if kvcx_absmax_bits(buf, D) >= 0x7f800000:
            return KVCX_ST_NONFINITE
        if fmt == KVCX_FP4_MX:
            for b in range(D // KVCX_MX_QK):
                kvcx_mxfp4_quant_block(buf + b * KVCX_MX_QK, codes + (r * (D // KVCX_MX_QK) + b) * (KVCX_MX_QK // 2 + 1))
        else:
            for b in range(D // KVCX_NV_QK):
                status |= kvcx_nvfp4_quant_group(buf + b * KVCX_NV_QK, p, codes + r * (D // 2) + b * (KVCX_NV_QK // 2),
                                                 codes + rows * (D // 2) + r * (D // KVCX_NV_QK) + b)
    return status


def fp4_encode(const uint8_t[::1] src, int dt, int64_t rows, int64_t D, int fmt, float p, uint8_t[::1] codes,
               int nthreads):
    """Quantize ``rows`` rows of D values (a multiple of the format's group) into FP4 codes (layout above);
    p: nvfp4's per-tensor scale (> 0). Returns a kvcx_status (bits OR-ed)."""
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task
    cdef int status = KVCX_OK
    cdef float *buf
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                status |= _fp4_enc_rows(&src[0], dt, task * per, min(rows, task * per + per), rows, D, fmt, p,
                                        &codes[0], buf)
                free(buf)
    return status


cdef int _fp4_dec_rows(const uint8_t *codes, int64_t r0, int64_t r1, int64_t rows, int64_t S, int64_t D, int fmt,
                       float p, uint8_t *out, int64_t out_S, int64_t off, int dt, float *buf) noexcept nogil:
    cdef int64_t r, b
    cdef int status = KVCX_OK
    for r in range(r0, r1):
        if fmt == KVCX_FP4_MX:
            for b in range(D // KVCX_MX_QK):
                status |= kvcx_mxfp4_dequant_block(codes + (r * (D // KVCX_MX_QK) + b) * (KVCX_MX_QK // 2 + 1),
                                                   buf + b * KVCX_MX_QK)
        else:
            for b in range(D // KVCX_NV_QK):
                status |= kvcx_nvfp4_dequant_group(codes + r * (D // 2) + b * (KVCX_NV_QK // 2),
                                                   codes[rows * (D // 2) + r * (D // KVCX_NV_QK) + b], p,
                                                   buf + b * KVCX_NV_QK)
        _store(buf, dt, ((r // S) * out_S + off + r % S) * D, D, out)
    return status


def fp4_decode(const uint8_t[::1] codes, int64_t rows, int64_t S, int64_t D, int fmt, float p, uint8_t[::1] out,
               int64_t out_S, int64_t token_offset, int dt, int nthreads):
    """Dequantize FP4 codes (see fp4_encode) into ``out`` (dtype dt, rows placed as the section says)."""
    cdef int64_t per = max(<int64_t>1, KVCX_TASK_VALUES // D)
    cdef int64_t ntasks = (rows + per - 1) // per
    cdef int64_t task
    cdef float *buf
    cdef int status = KVCX_OK
    with nogil:
        for task in prange(ntasks, num_threads=nthreads, schedule="static"):
            buf = <float *>malloc(D * sizeof(float))
            if buf == NULL:
                status |= KVCX_ST_NOMEM
            else:
                status |= _fp4_dec_rows(&codes[0], task * per, min(rows, task * per + per), rows, S, D, fmt, p,
                                        &out[0], out_S, token_offset, dt, buf)
                free(buf)
    return status
