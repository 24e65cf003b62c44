/* Quantize, pack and unpack: groups' parameters, codes, 2/3/4-bit packing (the encode and decode kernels).
   Part of kernels.h; needs base.h first. */
#ifndef KVCX_QUANT_H
#define KVCX_QUANT_H

#include "base.h"

/* ---- 4-bit quantize + pack in one pass --------------------------------------------------
   code = clamp(rint((x - zero) / scale), qmin, qmax) + off (0 where scale == 0 before the offset),
   element 2i in the low nibble of byte i: the same arithmetic, in the same order, as the scalar
   quantize-then-pack path, so the codes are identical. The caller checked that x is finite. */

static inline uint8_t kvcx_code1(float x, float sdiv, float zero, int keep, float qmin, float qmax, float off) {
    float t = rintf((x - zero) / sdiv);
    t = t < qmin ? qmin : t;
    t = t > qmax ? qmax : t;
    t = keep ? t : 0.0f;
    return (uint8_t)(int32_t)(t + off);
}

#if defined(__AVX2__)
/* t = rint((x - zero) / sdiv) for 2 x 8 values, computed as rint((x - zero) * (1 / sdiv)): the product
   is within |t| x 2^-23 of the correctly rounded quotient (2 roundings of 2^-24 each, relative), which is
   3.1e-5 at |t| = 256 (8-bit codes; 1.9e-6 at 4 bits), so its rint is the quotient's unless the product
   lies within KVCX_TIE_MARGIN of a half-integer; those rare lanes take the division itself. Codes are
   therefore identical to the division's. (A margin of 1e-5 held only up to |t| = 84: an 8-bit code of 198.5
   by division, 198.50002 by the product, came out one level up; found by the property test.) */
#define KVCX_TIE_MARGIN 4e-5f
static inline void kvcx_rdiv16(__m256 d0, __m256 d1, __m256 s0, __m256 s1, __m256 i0, __m256 i1, __m256 *r0,
                               __m256 *r1) {
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256 lim = _mm256_set1_ps(0.5f - KVCX_TIE_MARGIN);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 t0 = _mm256_mul_ps(d0, i0), t1 = _mm256_mul_ps(d1, i1);
    __m256 q0 = _mm256_round_ps(t0, rnd), q1 = _mm256_round_ps(t1, rnd);
    __m256 n0 = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(t0, q0), absmask), lim, _CMP_GT_OQ);
    __m256 n1 = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(t1, q1), absmask), lim, _CMP_GT_OQ);
    if (_mm256_movemask_ps(_mm256_or_ps(n0, n1))) {
        q0 = _mm256_blendv_ps(q0, _mm256_round_ps(_mm256_div_ps(d0, s0), rnd), n0);
        q1 = _mm256_blendv_ps(q1, _mm256_round_ps(_mm256_div_ps(d1, s1), rnd), n1);
    }
    *r0 = q0;
    *r1 = q1;
}

/* 16 values -> their 16 codes as bytes, in order: clamp(rint((x - z) / s), lo, hi) (0 where keep16 is 0) + off;
   i0/i1 = 1 / s0, 1 / s1; keep16 = the keep mask of the 16 values as int16 lanes in _mm256_packs_epi32 order;
   clamping to [lo, hi] and the offset in int16 */
static inline __m128i kvcx_codes16(__m256 x0, __m256 x1, __m256 z0, __m256 z1, __m256 s0, __m256 s1, __m256 i0,
                                   __m256 i1, __m256i keep16, __m256i lo, __m256i hi, __m256i off) {
    __m256 r0, r1;
    kvcx_rdiv16(_mm256_sub_ps(x0, z0), _mm256_sub_ps(x1, z1), s0, s1, i0, i1, &r0, &r1);
    __m256i c = _mm256_packs_epi32(_mm256_cvttps_epi32(r0), _mm256_cvttps_epi32(r1));
    c = _mm256_add_epi16(_mm256_and_si256(_mm256_min_epi16(_mm256_max_epi16(c, lo), hi), keep16), off);
    c = _mm256_permute4x64_epi64(c, 0xD8);
    return _mm_packus_epi16(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
}

/* 16 code bytes (< 16) -> 8 packed bytes (in the low half): b[2i] + 16 * b[2i+1] */
static inline __m128i kvcx_nibbles16(__m128i c) {
    __m128i w = _mm_maddubs_epi16(c, _mm_set1_epi16(0x1001));
    return _mm_packus_epi16(w, w);
}

/* 16 values -> 16 code bytes in order (any width), arguments as for kvcx_codes16 */
static inline __m128i kvcx_codes16_at(const float *x, __m256 z0, __m256 z1, __m256 s0, __m256 s1, __m256 i0,
                                      __m256 i1, __m256i keep16, __m256i lo, __m256i hi, __m256i off) {
    return kvcx_codes16(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8), z0, z1, s0, s1, i0, i1, keep16, lo, hi, off);
}

/* 32 values of one group (one scale s, reciprocal iv, zero point z; keep all ones, or zero where the scale is 0)
   -> 16 packed bytes. The same arithmetic and codes as kvcx_codes16 + kvcx_nibbles16 on each half, with
   half the shuffles: the four vectors are narrowed together and the nibbles of all 32 combined at once.
   asym = 0 skips the zero point (0 for symmetric groups). */
static inline __m128i kvcx_q4_32v(__m256 x0, __m256 x1, __m256 x2, __m256 x3, const int asym, __m256 z, __m256 s,
                                  __m256 iv, __m256i keep16, __m256i lo, __m256i hi, __m256i off) {
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    if (asym) {
        x0 = _mm256_sub_ps(x0, z);
        x1 = _mm256_sub_ps(x1, z);
        x2 = _mm256_sub_ps(x2, z);
        x3 = _mm256_sub_ps(x3, z);
    }
    __m256 t0 = _mm256_mul_ps(x0, iv), t1 = _mm256_mul_ps(x1, iv), t2 = _mm256_mul_ps(x2, iv), t3 = _mm256_mul_ps(x3, iv);
    __m256 q0 = _mm256_round_ps(t0, rnd), q1 = _mm256_round_ps(t1, rnd);
    __m256 q2 = _mm256_round_ps(t2, rnd), q3 = _mm256_round_ps(t3, rnd);
    /* near a half-integer the product may round the other way than the quotient: see kvcx_rdiv16 */
    __m256 d01 = _mm256_max_ps(_mm256_and_ps(_mm256_sub_ps(t0, q0), absmask), _mm256_and_ps(_mm256_sub_ps(t1, q1), absmask));
    __m256 d23 = _mm256_max_ps(_mm256_and_ps(_mm256_sub_ps(t2, q2), absmask), _mm256_and_ps(_mm256_sub_ps(t3, q3), absmask));
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_max_ps(d01, d23), _mm256_set1_ps(0.5f - KVCX_TIE_MARGIN), _CMP_GT_OQ))) {
        kvcx_rdiv16(x0, x1, s, s, iv, iv, &q0, &q1);
        kvcx_rdiv16(x2, x3, s, s, iv, iv, &q2, &q3);
    }
    /* int16 lanes: a = values 0-3, 8-11 | 4-7, 12-15; b = 16-19, 24-27 | 20-23, 28-31 */
    __m256i a = _mm256_packs_epi32(_mm256_cvttps_epi32(q0), _mm256_cvttps_epi32(q1));
    __m256i b = _mm256_packs_epi32(_mm256_cvttps_epi32(q2), _mm256_cvttps_epi32(q3));
    a = _mm256_add_epi16(_mm256_and_si256(_mm256_min_epi16(_mm256_max_epi16(a, lo), hi), keep16), off);
    b = _mm256_add_epi16(_mm256_and_si256(_mm256_min_epi16(_mm256_max_epi16(b, lo), hi), keep16), off);
    /* bytes: 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31: pairs (2i, 2i + 1) stay adjacent */
    __m256i c = _mm256_packus_epi16(a, b);
    /* packed byte j = value 2j + 16 * value 2j+1: lane 0 holds bytes 0,1,4,5,8,9,12,13, lane 1 bytes 2,3,6,7,... */
    __m256i w = _mm256_maddubs_epi16(c, _mm256_set1_epi16(0x1001));
    w = _mm256_packus_epi16(w, w);
    __m128i v = _mm256_castsi256_si128(_mm256_permute4x64_epi64(w, 0x08));   /* qwords 0 and 2 */
    return _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
}

#endif

/* max over i of (bits(x[i]) & 0x7fffffff): the bits of max|x|, >= 0x7f800000 when a NaN/Inf is present */
static inline int32_t kvcx_absmax_bits(const float *x, int64_t n) {
    const int32_t *xi = (const int32_t *)x;
    int32_t m = 0;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i mask = _mm256_set1_epi32(0x7fffffff);
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (; i + 16 <= n; i += 16) {
        a = _mm256_max_epi32(a, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(xi + i)), mask));
        b = _mm256_max_epi32(b, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(xi + i + 8)), mask));
    }
    a = _mm256_max_epi32(a, b);
    __m128i c = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    c = _mm_max_epi32(c, _mm_shuffle_epi32(c, 0x4E));
    c = _mm_max_epi32(c, _mm_shuffle_epi32(c, 0xB1));
    m = _mm_cvtsi128_si32(c);
#endif
    for (; i < n; i++) {
        int32_t v = xi[i] & 0x7fffffff;
        m = v > m ? v : m;
    }
    return m;
}

/* min and max over i of the order keys bits ^ ((bits >> 31) & 0x7fffffff) (signed order of floats) */
static inline void kvcx_minmax_keys(const float *x, int64_t n, int32_t *kmin, int32_t *kmax) {
    const int32_t *xi = (const int32_t *)x;
    int32_t lo = 0x7fffffff, hi = -0x7fffffff - 1;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i mask = _mm256_set1_epi32(0x7fffffff);
    __m256i vlo = _mm256_set1_epi32(lo), vhi = _mm256_set1_epi32(hi);
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(xi + i));
        __m256i k = _mm256_xor_si256(v, _mm256_and_si256(_mm256_srai_epi32(v, 31), mask));
        vlo = _mm256_min_epi32(vlo, k);
        vhi = _mm256_max_epi32(vhi, k);
    }
    __m128i a = _mm_min_epi32(_mm256_castsi256_si128(vlo), _mm256_extracti128_si256(vlo, 1));
    a = _mm_min_epi32(a, _mm_shuffle_epi32(a, 0x4E));
    a = _mm_min_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    __m128i b = _mm_max_epi32(_mm256_castsi256_si128(vhi), _mm256_extracti128_si256(vhi, 1));
    b = _mm_max_epi32(b, _mm_shuffle_epi32(b, 0x4E));
    b = _mm_max_epi32(b, _mm_shuffle_epi32(b, 0xB1));
    lo = _mm_cvtsi128_si32(a);
    hi = _mm_cvtsi128_si32(b);
#endif
    for (; i < n; i++) {
        int32_t k = xi[i] ^ ((xi[i] >> 31) & 0x7fffffff);
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
    }
    *kmin = lo;
    *kmax = hi;
}

/* Quantize with one scale per column or one per run, codes identical to the scalar loops of kvcx.codecs._core
   (clamp(rint((x - zero) / sdiv), qmin, qmax), 0 where keep is 0, + off), 16 values per step with AVX2.
   pack4: 4-bit codes, two per byte (element 2i in the low nibble of byte i) into out; otherwise one code
   per byte (other widths: the caller packs them).
   kvcx_quant_cols: rows x D values (D even), one scale/zero per column; sdiv = scale or 1 where scale == 0,
   keep[d] all ones where scale != 0 (zero bits elsewhere). Row r lands at out + r * D / 2 (packed) or
   out + r * D. */
static inline void kvcx_quant_cols(const float *x, int64_t rows, int64_t D, const float *sdiv,
                                   const float *zero, const float *keep, float qmin, float qmax, float off,
                                   int pack4, uint8_t *out) {
    const uint32_t *kb = (const uint32_t *)keep;
    int64_t d0 = 0;
#if defined(__AVX2__)
    const __m256i lo = _mm256_set1_epi16((int16_t)qmin), hi = _mm256_set1_epi16((int16_t)qmax);
    const __m256i of = _mm256_set1_epi16((int16_t)off);
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; d0 + 16 <= D; d0 += 16) {   /* 16 columns at a time: their reciprocals once, then every row */
        const __m256 z0 = _mm256_loadu_ps(zero + d0), z1 = _mm256_loadu_ps(zero + d0 + 8);
        const __m256 s0 = _mm256_loadu_ps(sdiv + d0), s1 = _mm256_loadu_ps(sdiv + d0 + 8);
        const __m256 i0 = _mm256_div_ps(one, s0), i1 = _mm256_div_ps(one, s1);
        const __m256i k16 = _mm256_packs_epi32(_mm256_loadu_si256((const __m256i *)(keep + d0)),
                                               _mm256_loadu_si256((const __m256i *)(keep + d0 + 8)));
        for (int64_t r = 0; r < rows; r++) {
            const __m128i c = kvcx_codes16_at(x + r * D + d0, z0, z1, s0, s1, i0, i1, k16, lo, hi, of);
            if (pack4) _mm_storel_epi64((__m128i *)(out + r * (D / 2) + d0 / 2), kvcx_nibbles16(c));
            else _mm_storeu_si128((__m128i *)(out + r * D + d0), c);
        }
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        for (int64_t d = d0; d < D; d += 2) {
            const uint8_t a = kvcx_code1(xr[d], sdiv[d], zero[d], kb[d] != 0, qmin, qmax, off);
            const uint8_t b = kvcx_code1(xr[d + 1], sdiv[d + 1], zero[d + 1], kb[d + 1] != 0, qmin, qmax, off);
            if (pack4) out[r * (D / 2) + d / 2] = a | (uint8_t)(b << 4);
            else { out[r * D + d] = a; out[r * D + d + 1] = b; }
        }
    }
}

/* n contiguous values with one scale (!= 0) and zero; packed: an odd last value leaves its high nibble 0 */
static inline void kvcx_quant_contig(const float *x, int64_t n, float scale, float zero, float qmin, float qmax,
                                     float off, int pack4, uint8_t *out) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 z = _mm256_set1_ps(zero), s = _mm256_set1_ps(scale);
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), s);
    const __m256i lo = _mm256_set1_epi16((int16_t)qmin), hi = _mm256_set1_epi16((int16_t)qmax);
    const __m256i of = _mm256_set1_epi16((int16_t)off), m = _mm256_set1_epi32(-1);
    for (; i + 16 <= n; i += 16) {
        const __m128i c = kvcx_codes16_at(x + i, z, z, s, s, inv, inv, m, lo, hi, of);
        if (pack4) _mm_storel_epi64((__m128i *)(out + i / 2), kvcx_nibbles16(c));
        else _mm_storeu_si128((__m128i *)(out + i), c);
    }
#endif
    for (; i < n; i++) {
        const uint8_t c = kvcx_code1(x[i], scale, zero, 1, qmin, qmax, off);
        if (!pack4) out[i] = c;
        else if (i & 1) out[i / 2] |= (uint8_t)(c << 4);
        else out[i / 2] = c;
    }
}

/* Pack codes of 3 bits (8 codes in 3 bytes, code j of each 8 at bits 3j, little-endian) or 2 bits (code j
   of each 4 at bits 2j) from whole blocks of 32 codes; returns the codes packed (a multiple of 32, at most
   n); the caller packs the rest. Codes must be below 8 (below 4). */
static inline int64_t kvcx_pack3_blocks(const uint8_t *q, int64_t n, uint8_t *out) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i m1 = _mm256_set1_epi16(0x0801), m2 = _mm256_set1_epi32(0x00400001);
    const __m256i low12 = _mm256_set1_epi64x(0xfff);
    /* per 128-bit lane: the 3 low bytes of each qword to bytes 0-5 */
    const __m256i sh = _mm256_setr_epi8(0, 1, 2, 8, 9, 10, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 1, 2, 8, 9, 10, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    for (; i + 32 <= n; i += 32) {
        __m256i a = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(q + i)), m1); /* 2 codes, 6 bits */
        __m256i b = _mm256_madd_epi16(a, m2);                                             /* 4 codes, 12 bits */
        __m256i c = _mm256_or_si256(_mm256_and_si256(b, low12), _mm256_srli_epi64(b, 20)); /* 8 codes, 24 bits */
        c = _mm256_shuffle_epi8(c, sh);
        uint8_t t[16];
        _mm_storel_epi64((__m128i *)t, _mm256_castsi256_si128(c));
        _mm_storel_epi64((__m128i *)(t + 6), _mm256_extracti128_si256(c, 1));
        memcpy(out + (i / 8) * 3, t, 12);
    }
#endif
    (void)q; (void)n; (void)out;
    return i;
}
static inline int64_t kvcx_pack2_blocks(const uint8_t *q, int64_t n, uint8_t *out) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i m1 = _mm256_set1_epi16(0x0401), m2 = _mm256_set1_epi32(0x00100001);
    const __m256i sh = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    for (; i + 32 <= n; i += 32) {
        __m256i a = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(q + i)), m1); /* 2 codes, 4 bits */
        __m256i c = _mm256_shuffle_epi8(_mm256_madd_epi16(a, m2), sh);                     /* 4 codes, a byte */
        uint32_t lo = (uint32_t)_mm256_extract_epi32(c, 0), hi = (uint32_t)_mm256_extract_epi32(c, 4);
        uint64_t w = (uint64_t)lo | ((uint64_t)hi << 32);
        memcpy(out + i / 4, &w, 8);
    }
#endif
    (void)q; (void)n; (void)out;
    return i;
}

/* Unpack 3-bit codes (the layout of kvcx_pack3_blocks) in whole blocks of 32 codes (12 bytes) while 16 bytes
   can be read; returns the codes unpacked (a multiple of 32, at most n); the caller unpacks the rest. Each
   code gets a 16-bit lane holding the two bytes around it, shifted into place by a multiply (AVX2 has no
   per-lane 16-bit shift): code j of a group sits at bit 3j, in byte 3j / 8 at offset 3j % 8. */
static inline int64_t kvcx_unpack3_blocks(const uint8_t *p, int64_t n, uint8_t *q) {
    int64_t i = 0;
#if defined(__AVX2__)
    const int64_t nbytes = (3 * n + 7) / 8;
    /* per lane: the 8 codes of one group of 3 bytes (lane 0: bytes 0-2, lane 1: bytes 3-5) */
    const __m256i sh = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 2, 3, 2, 3,
                                        3, 4, 3, 4, 3, 4, 4, 5, 4, 5, 4, 5, 5, 6, 5, 6);
    /* code j's offset in its 16-bit window is 3j % 8 (0, 3, 6, 1, 4, 7, 2, 5): multiply by 2^(8 - offset) */
    const __m256i mul = _mm256_setr_epi16(256, 32, 4, 128, 16, 2, 64, 8, 256, 32, 4, 128, 16, 2, 64, 8);
    const __m256i seven = _mm256_set1_epi16(7);
    for (; i + 32 <= n && (i / 8) * 3 + 16 <= nbytes; i += 32) {
        const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + (i / 8) * 3)));
        __m256i a = _mm256_shuffle_epi8(b, sh);                                          /* groups 0, 1 */
        __m256i c = _mm256_shuffle_epi8(b, _mm256_add_epi8(sh, _mm256_set1_epi8(6)));    /* groups 2, 3 */
        a = _mm256_and_si256(_mm256_srli_epi16(_mm256_mullo_epi16(a, mul), 8), seven);
        c = _mm256_and_si256(_mm256_srli_epi16(_mm256_mullo_epi16(c, mul), 8), seven);
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(_mm256_packus_epi16(a, c), 0xD8));
    }
#endif
    (void)p; (void)q; (void)n;
    return i;
}

/* Group parameters of n groups from their statistics (asym: min/max order keys, see kvcx_minmax_keys;
   sym: lo ignored, hi = bits of max |x|), 8 groups at a time: FP16 scale (and zero point) bits into
   s_out / z_out, and for quantizing: sdiv = scale (1 where the scale is 0), inv = 1 / sdiv, zero (as
   float), keep = all ones where the scale is not 0. The same arithmetic as the per-group scalar path
   (_params in kvcx/codecs/_core.pyx: scale = max|x| / 7 or (max - min) / 15, then FP16, round to nearest even).
   inv may be NULL (not wanted). Returns kvcx_status bits (NaN/Inf statistics, a scale or zero point FP16 cannot hold). */
#if defined(__AVX2__) && KVCX_F16C
#define KVCX_Q4_PARAMS 1
static inline int kvcx_q4_params(const int32_t *lo, const int32_t *hi, int64_t n, int bits, int asym,
                                 uint16_t *s_out, uint16_t *z_out, float *sdiv, float *inv, float *zero,
                                 uint32_t *keep) {
    const __m256 qdiv = _mm256_set1_ps((float)(asym ? (1 << bits) - 1 : (1 << (bits - 1)) - 1));
    const __m256i mask = _mm256_set1_epi32(0x7fffffff), infm1 = _mm256_set1_epi32(0x7f800000 - 1);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m128i e16 = _mm_set1_epi16(0x7c00);
    int st = 0;
    for (int64_t g = 0; g < n; g += 8) {
        const int64_t m = n - g < 8 ? n - g : 8;
        int32_t l8[8] = {0, 0, 0, 0, 0, 0, 0, 0}, h8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(h8, hi + g, (size_t)m * 4);
        if (asym) memcpy(l8, lo + g, (size_t)m * 4);
        __m256i l = _mm256_loadu_si256((const __m256i *)l8), h = _mm256_loadu_si256((const __m256i *)h8);
        __m128i hs, hz = _mm_setzero_si128();
        __m256 z = _mm256_setzero_ps();
        if (asym) {  /* keys back to float bits; NaN/Inf where max key >= +inf or min key <= key(-inf) */
            __m256i bad = _mm256_or_si256(_mm256_cmpgt_epi32(h, infm1),
                                          _mm256_cmpgt_epi32(_mm256_set1_epi32(KVCX_KEY_NEG_INF + 1), l));
            if (_mm256_movemask_epi8(bad)) st |= KVCX_ST_NONFINITE;
            __m256 fl = _mm256_castsi256_ps(_mm256_xor_si256(l, _mm256_and_si256(_mm256_srai_epi32(l, 31), mask)));
            __m256 fh = _mm256_castsi256_ps(_mm256_xor_si256(h, _mm256_and_si256(_mm256_srai_epi32(h, 31), mask)));
            hs = _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(fh, fl), qdiv), rnd);
            hz = _mm256_cvtps_ph(fl, rnd);
            z = _mm256_cvtph_ps(hz);
            if (_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(hz, e16), e16)) & ((1 << (2 * m)) - 1))
                st |= KVCX_ST_SCALE_OVERFLOW;
        } else {
            if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(h, infm1))) st |= KVCX_ST_NONFINITE;
            hs = _mm256_cvtps_ph(_mm256_div_ps(_mm256_castsi256_ps(h), qdiv), rnd);
        }
        if (_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(hs, e16), e16)) & ((1 << (2 * m)) - 1))
            st |= KVCX_ST_SCALE_OVERFLOW;
        __m256 scale = _mm256_cvtph_ps(hs);
        __m256 isz = _mm256_cmp_ps(scale, _mm256_setzero_ps(), _CMP_EQ_OQ);
        __m256 sd = _mm256_blendv_ps(scale, one, isz);
        float f8[8];
        uint32_t k8[8];
        uint16_t t16[8];
        _mm256_storeu_ps(f8, sd);
        memcpy(sdiv + g, f8, (size_t)m * 4);
        if (inv) {
            _mm256_storeu_ps(f8, _mm256_div_ps(one, sd));
            memcpy(inv + g, f8, (size_t)m * 4);
        }
        _mm256_storeu_ps(f8, z);
        memcpy(zero + g, f8, (size_t)m * 4);
        _mm256_storeu_si256((__m256i *)k8, _mm256_xor_si256(_mm256_castps_si256(isz), _mm256_set1_epi32(-1)));
        memcpy(keep + g, k8, (size_t)m * 4);
        _mm_storeu_si128((__m128i *)t16, hs);
        memcpy(s_out + g, t16, (size_t)m * 2);
        if (asym) {
            _mm_storeu_si128((__m128i *)t16, hz);
            memcpy(z_out + g, t16, (size_t)m * 2);
        }
    }
    return st;
}
#else
#define KVCX_Q4_PARAMS 0
#endif

/* groups per kvcx_groups / kvcx_q4_groups_f16 call, at most */
enum { KVCX_Q4_MAX_GROUPS = 256 };
#if KVCX_Q4_PARAMS
/* The second half of kvcx_groups / kvcx_q4_groups_f16: the parameters of the ng groups from their
   statistics, then the codes (packed at 4 bits, else one byte each for the caller to pack), reading the
   values as float32 (xf) or as FP16 converted on the fly (xh). */
static inline __m256 kvcx_load8(const float *xf, const uint16_t *xh, int64_t i) {
    return xh ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(xh + i))) : _mm256_loadu_ps(xf + i);
}
static inline int64_t kvcx_groups_codes(const float *xf, const uint16_t *xh, int64_t ng, int64_t G, int bits,
                                        int asym, const int32_t *lo, const int32_t *hi, uint16_t *s_out,
                                        uint16_t *z_out, uint8_t *out, int *status) {
    float sc[KVCX_Q4_MAX_GROUPS], inv[KVCX_Q4_MAX_GROUPS], zr[KVCX_Q4_MAX_GROUPS];
    uint32_t keep[KVCX_Q4_MAX_GROUPS];
    const int st = kvcx_q4_params(lo, hi, ng, bits, asym, s_out, z_out, sc, inv, zr, keep);
    *status |= st;
    if (st) return ng;
    const int qmax = asym ? (1 << bits) - 1 : (1 << (bits - 1)) - 1;
    const __m256i vlo = _mm256_set1_epi16((int16_t)(asym ? 0 : -qmax - 1)), vhi = _mm256_set1_epi16((int16_t)qmax);
    const __m256i vof = _mm256_set1_epi16((int16_t)(asym ? 0 : qmax + 1));
    if (bits != 4) {
        for (int64_t g = 0; g < ng; g++) {
            const __m256 z = _mm256_set1_ps(zr[g]), s = _mm256_set1_ps(sc[g]), iv = _mm256_set1_ps(inv[g]);
            const __m256i k = _mm256_set1_epi32((int32_t)keep[g]);
            for (int64_t i = g * G; i < (g + 1) * G; i += 16)
                _mm_storeu_si128((__m128i *)(out + i), kvcx_codes16(kvcx_load8(xf, xh, i), kvcx_load8(xf, xh, i + 8),
                                                                    z, z, s, s, iv, iv, k, vlo, vhi, vof));
        }
        return ng;
    }
    for (int64_t g = 0; g < ng; g++) {
        const __m256 z = _mm256_set1_ps(zr[g]), s = _mm256_set1_ps(sc[g]), iv = _mm256_set1_ps(inv[g]);
        const __m256i k = _mm256_set1_epi32((int32_t)keep[g]);
        uint8_t *o = out + g * (G / 2);
        int64_t i = 0;
        for (; i + 32 <= G; i += 32) {
            __m256 x0, x1, x2, x3;
            if (xh) {
                __m256i h0 = _mm256_loadu_si256((const __m256i *)(xh + g * G + i));
                __m256i h1 = _mm256_loadu_si256((const __m256i *)(xh + g * G + i + 16));
                x0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h0));
                x1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1));
                x2 = _mm256_cvtph_ps(_mm256_castsi256_si128(h1));
                x3 = _mm256_cvtph_ps(_mm256_extracti128_si256(h1, 1));
            } else {
                x0 = _mm256_loadu_ps(xf + g * G + i);
                x1 = _mm256_loadu_ps(xf + g * G + i + 8);
                x2 = _mm256_loadu_ps(xf + g * G + i + 16);
                x3 = _mm256_loadu_ps(xf + g * G + i + 24);
            }
            const __m128i c = asym ? kvcx_q4_32v(x0, x1, x2, x3, 1, z, s, iv, k, vlo, vhi, vof)
                                   : kvcx_q4_32v(x0, x1, x2, x3, 0, z, s, iv, k, vlo, vhi, vof);
            _mm_storeu_si128((__m128i *)(o + i / 2), c);
        }
        for (; i < G; i += 16)
            _mm_storel_epi64((__m128i *)(o + i / 2),
                             kvcx_nibbles16(kvcx_codes16(kvcx_load8(xf, xh, g * G + i), kvcx_load8(xf, xh, g * G + i + 8),
                                                         z, z, s, s, iv, iv, k, vlo, vhi, vof)));
    }
    return ng;
}
#endif
/* Quantize `ng` whole groups of G contiguous values (G a multiple of 16) at `bits` bits, one FP16 scale (and
   zero point) per group: at 4 bits group i's packed codes go to out + i * G / 2, at other widths its codes
   (one byte each) to out + i * G for the caller to pack. Statistics of every group first, then the scales 8
   groups at a time (kvcx_q4_params), then the codes, so the groups' serial chains (max -> scale -> FP16 ->
   reciprocal) overlap instead of following one another. Same codes and scales as quantizing group by group
   (kvcx.codecs._core._quant_contig). Returns the groups done (0 without AVX2 + F16C: the caller then quantizes them
   one by one); ORs kvcx_status bits into *status. At most KVCX_Q4_MAX_GROUPS groups per call. */
static inline int64_t kvcx_groups(const float *x, int64_t ng, int64_t G, int bits, int asym, uint16_t *s_out,
                                  uint16_t *z_out, uint8_t *out, int *status) {
#if KVCX_Q4_PARAMS
    int32_t lo[KVCX_Q4_MAX_GROUPS], hi[KVCX_Q4_MAX_GROUPS];
    if (ng > KVCX_Q4_MAX_GROUPS) ng = KVCX_Q4_MAX_GROUPS;
    for (int64_t g = 0; g < ng; g++) {
        if (asym) kvcx_minmax_keys(x + g * G, G, lo + g, hi + g);
        else { lo[g] = 0; hi[g] = kvcx_absmax_bits(x + g * G, G); }
    }
    return kvcx_groups_codes(x, NULL, ng, G, bits, asym, lo, hi, s_out, z_out, out, status);
#else
    (void)x; (void)ng; (void)G; (void)bits; (void)asym; (void)s_out; (void)z_out; (void)out; (void)status;
    return 0;
#endif
}

/* kvcx_groups at 4 bits straight from FP16 input, without the FP32 copy: the statistics run on the FP16 bits
   (16 lanes per instruction; their integer order is the values' order, as for float32 bits), the
   extremes are converted exactly, and the values are converted on the fly for the codes. Same codes
   and scales as converting first. */
#if KVCX_Q4_PARAMS
static inline uint16_t kvcx_hmax_epu16(__m256i v) {
    __m128i m = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_minpos_epu16(_mm_xor_si128(m, _mm_set1_epi16(-1)));
    return (uint16_t)~_mm_extract_epi16(m, 0);
}
static inline uint16_t kvcx_hmin_epu16(__m256i v) {
    __m128i m = _mm_min_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint16_t)_mm_extract_epi16(_mm_minpos_epu16(m), 0);
}
/* FP16 bits -> the float32 order key of the same value (NaN/Inf stay beyond the finite keys) */
static inline int32_t kvcx_h_key32(uint16_t h) {
    float f = _cvtsh_ss(h);
    int32_t b;
    memcpy(&b, &f, 4);
    return b ^ ((b >> 31) & 0x7fffffff);
}
#endif
#ifndef KVCX_PREFETCH
#define KVCX_PREFETCH 1024
#endif
static inline int64_t kvcx_q4_groups_f16(const uint16_t *x, int64_t ng, int64_t G, int asym, uint16_t *s_out,
                                         uint16_t *z_out, uint8_t *out, int *status) {
#if KVCX_Q4_PARAMS
    int32_t lo[KVCX_Q4_MAX_GROUPS], hi[KVCX_Q4_MAX_GROUPS];
    if (ng > KVCX_Q4_MAX_GROUPS) ng = KVCX_Q4_MAX_GROUPS;
    const __m256i m7fff = _mm256_set1_epi16(0x7fff), sgn = _mm256_set1_epi16((short)0x8000);
    for (int64_t g = 0; g < ng; g++) {
        const uint16_t *xg = x + g * G;
        if (asym) {  /* order keys k = h ^ ((h >> 15) & 0x7fff) as int16, compared unsigned after ^ 0x8000 */
            __m256i kmin = _mm256_set1_epi16(-1), kmax = _mm256_setzero_si256();
            for (int64_t i = 0; i < G; i += 16) {
                __m256i h = _mm256_loadu_si256((const __m256i *)(xg + i));
                __m256i k = _mm256_xor_si256(h, _mm256_and_si256(_mm256_srai_epi16(h, 15), m7fff));
                k = _mm256_xor_si256(k, sgn);
                kmin = _mm256_min_epu16(kmin, k);
                kmax = _mm256_max_epu16(kmax, k);
            }
            int16_t a = (int16_t)(kvcx_hmin_epu16(kmin) ^ 0x8000), b = (int16_t)(kvcx_hmax_epu16(kmax) ^ 0x8000);
            lo[g] = kvcx_h_key32((uint16_t)(a ^ ((a >> 15) & 0x7fff)));
            hi[g] = kvcx_h_key32((uint16_t)(b ^ ((b >> 15) & 0x7fff)));
        } else {
            __m256i m = _mm256_setzero_si256();
            for (int64_t i = 0; i < G; i += 16) {
                _mm_prefetch((const char *)(xg + i + KVCX_PREFETCH), _MM_HINT_T0);
                m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(xg + i)), m7fff));
            }
            lo[g] = 0;
            hi[g] = kvcx_h_key32(kvcx_hmax_epu16(m));  /* non-negative: the key is the bits */
        }
    }
    return kvcx_groups_codes(NULL, x, ng, G, 4, asym, lo, hi, s_out, z_out, out, status);
#else
    (void)x; (void)ng; (void)G; (void)asym; (void)s_out; (void)z_out; (void)out; (void)status;
    return 0;
#endif
}

/* rows x D values with one group per column (4 bits), the column statistics done (kmin / kmax as in
   kvcx_q4_params): the parameters of all columns 8 at a time, then the codes. The outputs may alias the
   statistics index for index (each 8 are read before they are written). Returns kvcx_status bits; -1
   without AVX2 + F16C (nothing done: the caller takes the scalar path). */
static inline int kvcx_cols_params_quant(const float *x, int64_t rows, int64_t D, const int32_t *kmin,
                                         const int32_t *kmax, int bits, int asym, uint16_t *s_out, uint16_t *z_out,
                                         float *sdiv, float *zero, uint32_t *keep, uint8_t *out) {
#if KVCX_Q4_PARAMS  /* the quantizers take the reciprocals of 16 columns at a time themselves */
    const int st = kvcx_q4_params(kmin, kmax, D, bits, asym, s_out, z_out, sdiv, NULL, zero, keep);
    if (st) return st;
    const float qmax = (float)(asym ? (1 << bits) - 1 : (1 << (bits - 1)) - 1);
    const float qmin = asym ? 0.0f : -qmax - 1.0f, off = asym ? 0.0f : qmax + 1.0f;
    kvcx_quant_cols(x, rows, D, sdiv, zero, (const float *)keep, qmin, qmax, off, bits == 4, out);
    return KVCX_OK;
#else
    (void)x; (void)rows; (void)D; (void)kmin; (void)kmax; (void)bits; (void)asym; (void)s_out; (void)z_out;
    (void)sdiv; (void)zero; (void)keep; (void)out;
    return -1;
#endif
}

static inline uint16_t kvcx_f2h_1(float x) {
#if KVCX_F16C
    return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
    return kvcx_f2h(x);
#endif
}

static inline float kvcx_h2f_1(uint16_t h) {
#if KVCX_F16C
    return _cvtsh_ss(h);
#else
    return kvcx_h2f(h);
#endif
}

#endif /* KVCX_QUANT_H */
