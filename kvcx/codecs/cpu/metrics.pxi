# quality metrics: part of the kernels' module body (core.pxi), included by every variant
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


