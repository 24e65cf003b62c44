# per-channel bit widths for keys (widths.h): part of the kernels' module body (core.pxi), included by every variant
# ----------------------------------------------------------------------------
# per-channel bit widths for keys (kvcx/codecs/cpu/widths.h): groups of gs tokens per channel, one task per
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


def w_minmax(const uint8_t[::1] src, int dt, Layout layout, float[::1] mn, float[::1] mx, float[::1] me, int nthreads):
    """Per (slab, group, channel) min, max and mean of tokens [t0, S) in groups of group_size tokens ((N, G, D)
    each)."""
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
                    kvcx_w_colminmax(tile, rows, D, &mn[k * D], &mx[k * D], &me[k * D])
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


def w_encode(const uint8_t[::1] src, int dt, Layout layout, const float[::1] mn, const float[::1] mx, const float[::1] me,
             const float[::1] lo, const float[::1] hi,
             const uint8_t[::1] widths, const float[::1] top, const int64_t[::1] off, const int64_t[::1] slab_off,
             const int64_t[::1] group_bytes, uint8_t[::1] stats, uint8_t[::1] planes, int nthreads):
    """Range bytes (N, G, D, 2) and bit planes of tokens [t0, S): mn / mx / me (N, G, D) from w_minmax, lo / hi
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
            tile = <float *>malloc((gs * D + kvcx_w_encode_floats(D)) * sizeof(float) + 2 * gs * D)
            if tile == NULL:
                status |= KVCX_ST_NOMEM
            else:
                for k in range(task * gpt, min(N * G, task * gpt + gpt)):
                    n = k // G
                    g = k % G
                    rows = min(gs, S - t0 - g * gs)
                    _load_rows(&src[0], dt, S, D, n, t0 + g * gs, rows, tile)
                    kvcx_w_encode_tile(tile, rows, gs, D, &mn[k * D], &mx[k * D], &me[k * D], &lo[n * D], &hi[n * D],
                                       &widths[n * D], &top[n * D], &off[n * D],
                                       <uint8_t *>(tile + gs * D + kvcx_w_encode_floats(D)), tile + gs * D, &stats[k * D * 2],
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


