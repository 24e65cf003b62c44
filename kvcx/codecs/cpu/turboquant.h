/* vLLM's TurboQuant KV cache (--kv-cache-dtype turboquant_4bit_nc, turboquant_k3v4_nc, turboquant_3bit_nc,
 * turboquant_k8v4; vllm/v1/attention/ops/triton_turboquant_store.py), one token and head (a row of D values) at
 * a time, each row one record of the engine's slot:
 *
 *   key record    ceil(D * bits / 8) bytes of Lloyd-Max indices, then the row's norm in FP16 (little-endian).
 *                 norm = ||x|| (float32), u = x / (norm + 1e-8), y = u H where H is the Sylvester Hadamard
 *                 matrix / sqrt(D) (symmetric, orthonormal), index = the number of midpoints m (between the
 *                 sorted centroids, float32) with y >= m, as the kernel's binary search finds it.
 *   value record  ceil(D * bits / 8) bytes of codes q = (int)((v - min) / scale + 0.5) clamped to
 *                 [0, 2^bits - 1], scale = max((max - min) / (2^bits - 1), 1e-8) in float32; then the scale and
 *                 the minimum, each in FP16 (little-endian).
 *
 * Codes are an LSB-first bit stream (element j at bit j * bits: two 4-bit codes a byte, the low nibble first;
 * eight 3-bit codes in three bytes), as the kernel packs them. Decode: keys c[index], with norm correction
 * (the _nc presets) c / sqrt(sum c^2 + 1e-16), times the FP16 norm, rotated back by H (vLLM rotates the query
 * instead: the same scores up to rounding); values q * scale + min with the FP16 scale and minimum.
 *
 * Rounding: the rotation here sums in double and rounds y once to float32; vLLM's is a float32 GEMM, whose
 * sums may differ from it in the last bits, so an index may differ from vLLM's where y lies within those bits
 * of a midpoint (the tests count such coordinates). Everything else is float32 as the kernel computes it.
 * Compiled as ISO C (-std=c11): no a*b+c is fused into an FMA.
 */
#ifndef KVCX_TURBOQUANT_H
#define KVCX_TURBOQUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define KVCX_TQ_MAX_LEVELS 16      /* 4-bit indices */
#define KVCX_TQ_NORM_EPS 1e-8f     /* norm + eps before dividing (the launcher's) */
#define KVCX_TQ_SCALE_MIN 1e-8f    /* the value scale's floor (the kernel's) */
#define KVCX_TQ_NC_EPS 1e-16f      /* norm correction: 1 / sqrt(sum c^2 + eps) */

/* bytes of one row's codes */
static inline int64_t kvcx_tq_code_bytes(int64_t D, int bits) { return (D * bits + 7) / 8; }

/* In-place Walsh-Hadamard butterfly (Sylvester order, unnormalised) of d doubles, d a power of two. */
static inline void kvcx_tq_wht(double *p, int64_t d) {
    for (int64_t h = 1; h < d; h *= 2)
        for (int64_t i = 0; i < d; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const double a = p[j], b = p[j + h];
                p[j] = a + b;
                p[j + h] = a - b;
            }
}

/* Append n codes of `bits` bits to an LSB-first stream at out (the bytes are written whole). */
static inline void kvcx_tq_pack(const uint8_t *q, int64_t n, int bits, uint8_t *out) {
    memset(out, 0, (size_t)kvcx_tq_code_bytes(n, bits));
    for (int64_t j = 0; j < n; j++) {
        const int64_t bit = j * bits;
        const uint32_t v = (uint32_t)q[j] << (bit % 8);
        out[bit / 8] |= (uint8_t)(v & 0xFF);
        if ((bit % 8) + bits > 8)
            out[bit / 8 + 1] |= (uint8_t)(v >> 8);
    }
}

static inline uint8_t kvcx_tq_unpack(const uint8_t *in, int64_t j, int bits) {
    const int64_t bit = j * bits;
    uint32_t raw = in[bit / 8];
    if ((bit % 8) + bits > 8)
        raw |= (uint32_t)in[bit / 8 + 1] << 8;
    return (uint8_t)((raw >> (bit % 8)) & ((1u << bits) - 1));
}

static inline void kvcx_tq_put_h(uint8_t *p, uint16_t h) { p[0] = (uint8_t)(h & 0xFF); p[1] = (uint8_t)(h >> 8); }
static inline uint16_t kvcx_tq_get_h(const uint8_t *p) { return (uint16_t)(p[0] | ((uint16_t)p[1] << 8)); }

/* One key row x[0:D] (finite) -> its record. mid: the 2^bits - 1 sorted midpoints; h: H's entry 1 / sqrt(D) in
   float32; work: D doubles; q: D bytes. Returns KVCX_ST_SCALE_OVERFLOW when the norm passes FP16. */
static inline int kvcx_tq_key_encode(const float *x, int64_t D, int bits, const float *mid, float h, double *work,
                                     uint8_t *q, uint8_t *rec) {
    double ss = 0.0;
    for (int64_t i = 0; i < D; i++) ss += (double)x[i] * (double)x[i];
    const float norm = (float)sqrt(ss);
    const float den = norm + KVCX_TQ_NORM_EPS;
    for (int64_t i = 0; i < D; i++) work[i] = (double)(x[i] / den);
    kvcx_tq_wht(work, D);
    const int nmid = (1 << bits) - 1;
    for (int64_t j = 0; j < D; j++) {
        const float y = (float)(work[j] * (double)h);
        int k = 0;
        while (k < nmid && y >= mid[k]) k++;
        q[j] = (uint8_t)k;
    }
    const int64_t nb = kvcx_tq_code_bytes(D, bits);
    kvcx_tq_pack(q, D, bits, rec);
    const uint16_t hn = kvcx_f2h(norm);
    kvcx_tq_put_h(rec + nb, hn);
    return (hn & 0x7C00) == 0x7C00 ? KVCX_ST_SCALE_OVERFLOW : KVCX_OK;
}

/* A key record -> the row (rotated back). c: the 2^bits centroids; nc: norm correction; h as above. */
static inline int kvcx_tq_key_decode(const uint8_t *rec, int64_t D, int bits, const float *c, int nc, float h,
                                     double *work, float *y) {
    const int64_t nb = kvcx_tq_code_bytes(D, bits);
    const uint16_t hn = kvcx_tq_get_h(rec + nb);
    if ((hn & 0x7C00) == 0x7C00 || (hn & 0x8000))
        return KVCX_ST_CORRUPT;     /* a norm is finite and not negative */
    float inv = 1.0f;
    if (nc) {
        float s = 0.0f;
        for (int64_t j = 0; j < D; j++) { const float v = c[kvcx_tq_unpack(rec, j, bits)]; s += v * v; }
        inv = 1.0f / sqrtf(s + KVCX_TQ_NC_EPS);
    }
    const float norm = kvcx_h2f(hn);
    for (int64_t j = 0; j < D; j++) work[j] = (double)(norm * (c[kvcx_tq_unpack(rec, j, bits)] * inv));
    kvcx_tq_wht(work, D);
    for (int64_t i = 0; i < D; i++) y[i] = (float)(work[i] * (double)h);
    return KVCX_OK;
}

/* One value row v[0:D] (finite) -> its record. q: D bytes. KVCX_ST_SCALE_OVERFLOW when the scale or the minimum
   passes FP16. */
static inline int kvcx_tq_value_encode(const float *v, int64_t D, int bits, uint8_t *q, uint8_t *rec) {
    const int top = (1 << bits) - 1;
    float lo = v[0], hi = v[0];
    for (int64_t i = 1; i < D; i++) { lo = v[i] < lo ? v[i] : lo; hi = v[i] > hi ? v[i] : hi; }
    float scale = (hi - lo) / (float)top;
    scale = scale > KVCX_TQ_SCALE_MIN ? scale : KVCX_TQ_SCALE_MIN;
    for (int64_t i = 0; i < D; i++) {
        int k = (int)((v[i] - lo) / scale + 0.5f);
        q[i] = (uint8_t)(k < 0 ? 0 : (k > top ? top : k));
    }
    const int64_t nb = kvcx_tq_code_bytes(D, bits);
    kvcx_tq_pack(q, D, bits, rec);
    const uint16_t hs = kvcx_f2h(scale), hz = kvcx_f2h(lo);
    kvcx_tq_put_h(rec + nb, hs);
    kvcx_tq_put_h(rec + nb + 2, hz);
    return ((hs & 0x7C00) == 0x7C00 || (hz & 0x7C00) == 0x7C00) ? KVCX_ST_SCALE_OVERFLOW : KVCX_OK;
}

static inline int kvcx_tq_value_decode(const uint8_t *rec, int64_t D, int bits, float *y) {
    const int64_t nb = kvcx_tq_code_bytes(D, bits);
    const uint16_t hs = kvcx_tq_get_h(rec + nb), hz = kvcx_tq_get_h(rec + nb + 2);
    if ((hs & 0x7C00) == 0x7C00 || (hz & 0x7C00) == 0x7C00 || (hs & 0x8000))
        return KVCX_ST_CORRUPT;     /* the encoder writes a finite scale >= 0 and a finite minimum */
    const float s = kvcx_h2f(hs), z = kvcx_h2f(hz);
    for (int64_t j = 0; j < D; j++) y[j] = (float)kvcx_tq_unpack(rec, j, bits) * s + z;
    return KVCX_OK;
}

#endif /* KVCX_TURBOQUANT_H */
