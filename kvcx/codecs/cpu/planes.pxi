# vLLM's CPU fused K/V planes (fused.h): part of the kernels' module body (core.pxi), included by every variant
# ----------------------------------------------------------------------------
# vLLM's CPU fused K/V plane <-> key and value planes (fused.h); a slab a task, a scratch slab a thread
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
