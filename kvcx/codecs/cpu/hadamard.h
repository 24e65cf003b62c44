/* The orthonormal Walsh-Hadamard rotation of rows (kvcx's value codec, rotated keys). Part of kernels.h. */
#ifndef KVCX_HADAMARD_H
#define KVCX_HADAMARD_H

#include "base.h"

/* Stages h = 1, 2, 4 of the Walsh-Hadamard butterfly on every 8-value chunk of p[0:n]. */
static inline void kvcx_wht8(float *p, int64_t n) {
    int64_t i = 0;
#if defined(__AVX__)
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(p + i);
        v = _mm256_add_ps(_mm256_mul_ps(v, s1), _mm256_permute_ps(v, 0xB1));
        v = _mm256_add_ps(_mm256_mul_ps(v, s2), _mm256_permute_ps(v, 0x4E));
        v = _mm256_add_ps(_mm256_mul_ps(v, s4), _mm256_permute2f128_ps(v, v, 1));
        _mm256_storeu_ps(p + i, v);
    }
#endif
    for (; i + 8 <= n; i += 8) {
        float *q = p + i, a[8], b[8];
        for (int j = 0; j < 8; j += 2) { a[j] = q[j] + q[j + 1]; a[j + 1] = q[j] - q[j + 1]; }
        for (int j = 0; j < 8; j += 4) {
            b[j] = a[j] + a[j + 2]; b[j + 1] = a[j + 1] + a[j + 3];
            b[j + 2] = a[j] - a[j + 2]; b[j + 3] = a[j + 1] - a[j + 3];
        }
        for (int j = 0; j < 4; j++) { q[j] = b[j] + b[j + 4]; q[j + 4] = b[j] - b[j + 4]; }
    }
}

/* Orthonormal fast Walsh-Hadamard transform of `rows` rows of length d (a power of two >= 8):
   stages h = 1, 2, 4 by kvcx_wht8, then h = 8 .. d/2, each row scaled by 1/sqrt(d) at the end. */
#if defined(__AVX__)
static inline __m256 kvcx_wht8_reg(__m256 v) {
    const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    v = _mm256_add_ps(_mm256_mul_ps(v, s1), _mm256_permute_ps(v, 0xB1));
    v = _mm256_add_ps(_mm256_mul_ps(v, s2), _mm256_permute_ps(v, 0x4E));
    return _mm256_add_ps(_mm256_mul_ps(v, s4), _mm256_permute2f128_ps(v, v, 1));
}
#if defined(__GNUC__) && !defined(__clang__)
#define KVCX_UNROLL _Pragma("GCC unroll 16")
#elif defined(__clang__)
#define KVCX_UNROLL _Pragma("unroll")
#else
#define KVCX_UNROLL
#endif
/* One row of D values entirely in registers: the same stages and roundings as the generic path. */
#define KVCX_FWHT_ROW(D) \
static inline void kvcx_fwht_row##D(float *p, float norm) { \
    __m256 v[D / 8]; \
    KVCX_UNROLL for (int k = 0; k < D / 8; k++) v[k] = kvcx_wht8_reg(_mm256_loadu_ps(p + 8 * k)); \
    KVCX_UNROLL for (int h = 1; h < D / 8; h *= 2) \
        KVCX_UNROLL for (int m = 0; m < D / 16; m++) { \
            const int j = (m / h) * 2 * h + m % h; /* the D/16 butterfly pairs (j, j + h) */ \
            __m256 a = v[j], b = v[j + h]; \
            v[j] = _mm256_add_ps(a, b); \
            v[j + h] = _mm256_sub_ps(a, b); \
        } \
    const __m256 n8 = _mm256_set1_ps(norm); \
    KVCX_UNROLL for (int k = 0; k < D / 8; k++) _mm256_storeu_ps(p + 8 * k, _mm256_mul_ps(v[k], n8)); \
}
KVCX_FWHT_ROW(32)
KVCX_FWHT_ROW(64)
KVCX_FWHT_ROW(128)
#endif

static inline void kvcx_fwht_rows(float *x, int64_t rows, int64_t d) {
    const float norm = 1.0 / sqrtf((float)d);
#if defined(__AVX__)
    if (d == 64) { for (int64_t r = 0; r < rows; r++) kvcx_fwht_row64(x + r * 64, norm); return; }
    if (d == 128) { for (int64_t r = 0; r < rows; r++) kvcx_fwht_row128(x + r * 128, norm); return; }
    if (d == 32) { for (int64_t r = 0; r < rows; r++) kvcx_fwht_row32(x + r * 32, norm); return; }
#endif
    kvcx_wht8(x, rows * d);
    for (int64_t r = 0; r < rows; r++) {
        float *p = x + r * d;
        for (int64_t h = 8; h < d; h *= 2) {
            for (int64_t i = 0; i < d; i += 2 * h) {
#if defined(__AVX__)
                for (int64_t j = i; j < i + h; j += 8) {
                    __m256 a = _mm256_loadu_ps(p + j), b = _mm256_loadu_ps(p + j + h);
                    _mm256_storeu_ps(p + j, _mm256_add_ps(a, b));
                    _mm256_storeu_ps(p + j + h, _mm256_sub_ps(a, b));
                }
#else
                for (int64_t j = i; j < i + h; j++) {
                    float a = p[j], b = p[j + h];
                    p[j] = a + b;
                    p[j + h] = a - b;
                }
#endif
            }
        }
        /* same width as the stores above (no store-forwarding stalls) */
        for (int64_t j = 0; j < d; j++) p[j] *= norm;
    }
}

static const char *kvcx_simd_flags(void) {
    return ""
#ifdef __SSE4_1__
    "sse4.1 "
#endif
#ifdef __AVX__
    "avx "
#endif
#ifdef __AVX2__
    "avx2 "
#endif
#ifdef __FMA__
    "fma "
#endif
#ifdef __F16C__
    "f16c "
#endif
#ifdef __AVX512F__
    "avx512f "
#endif
#ifdef __AVX512BW__
    "avx512bw "
#endif
#ifdef __AVX512VBMI__
    "avx512vbmi "
#endif
#ifdef __ARM_NEON
    "neon "
#endif
    ;
}

#endif /* KVCX_HADAMARD_H */
