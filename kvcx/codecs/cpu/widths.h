/* Per-channel bit widths for keys (the kvcx.widths codec, docs/FORMAT.md 2.4).

   Keys are grouped per channel along tokens (groups of gs tokens, as KIVI). Every channel d of a
   slab has its own width w[d] in [0, KVCX_W_MAX] bits; the widths of a slab sum to a fixed budget
   chosen by the Python layer (kvcx.codecs.widths), which also turns each group's range into the float
   parameters these kernels take. Codes are unsigned, q = clamp(rint((x - lo) * inv), 0, 2^w - 1);
   decode is base + q * step (a width-0 channel decodes to base, the middle of its range).

   Bit planes: a group's codes of channel d are stored as w[d] planes of gs / 8 bytes; plane j holds
   bit j of the codes of the group's tokens, token t in bit (t % 8) of byte t / 8. A group's planes
   are channel after channel (channel d at byte off[d]); tokens past the end of the tensor are zero
   bits. Included by kvcx/codecs/_core.pyx through _kernels.pxd. */
#ifndef KVCX_WIDTHS_H
#define KVCX_WIDTHS_H

#include "kernels.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#define KVCX_W_AVX2 1
#else
#define KVCX_W_AVX2 0
#endif

enum { KVCX_W_MAX = 8 };  /* the widest channel, bits (codes are bytes) */
/* the floats of scratch kvcx_w_encode_tile takes for a head dim D (its row argument) */
static inline int64_t kvcx_w_encode_floats(int64_t D) { return 6 * D; }

/* Column min, max and mean of a rows x D tile (rows >= 1; the mean: the rows summed in float, in order, over
   their count). NaN is sticky (a NaN anywhere in a column makes its min NaN), so the caller finds non-finite
   input in the results. */
static inline void kvcx_w_colminmax(const float *restrict x, int64_t rows, int64_t D, float *restrict mn,
                                    float *restrict mx, float *restrict me) {
    int64_t r, d;
    for (d = 0; d < D; d++) { mn[d] = x[d]; mx[d] = x[d]; me[d] = x[d]; }
    for (r = 1; r < rows; r++) {
        const float *p = x + r * D;
        for (d = 0; d < D; d++) {
            float v = p[d];
            mn[d] = (v < mn[d] || v != v) ? v : mn[d];
            mx[d] = v > mx[d] ? v : mx[d];
            me[d] += v;
        }
    }
    for (d = 0; d < D; d++) me[d] /= (float)rows;
}

/* bit j of n code bytes -> n / 8 plane bytes (n a multiple of 8) */
static inline void kvcx_w_plane(const uint8_t *q, int64_t n, int j, uint8_t *out) {
    int64_t b = 0;
#if KVCX_W_AVX2
    for (; b + 32 <= n; b += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(q + b));
        uint32_t m = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(v, 7 - j));
        memcpy(out + b / 8, &m, 4);
    }
#endif
    for (; b < n; b += 8) {
        uint8_t byte = 0;
        int k;
        for (k = 0; k < 8; k++) byte |= (uint8_t)(((q[b + k] >> j) & 1) << k);
        out[b / 8] = byte;
    }
}

#if KVCX_W_AVX2
/* 32 bits of a plane (token t in bit t) -> 32 bytes, 1 << j where the token's bit is set, else 0 */
static inline __m256i kvcx_w_bits32(uint32_t m, int j) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)   /* one masked broadcast */
    return _mm256_maskz_set1_epi8((__mmask32)m, (char)(1 << j));
#else
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), idx);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8((char)(1 << j)));
#endif
}
#endif

/* n / 8 plane bytes -> bit j added to n code bytes */
static inline void kvcx_w_unplane(const uint8_t *p, int64_t n, int j, uint8_t *q) {
    int64_t b = 0;
#if KVCX_W_AVX2
    for (; b + 32 <= n; b += 32) {
        uint32_t m;
        memcpy(&m, p + b / 8, 4);
        __m256i acc = _mm256_loadu_si256((const __m256i *)(q + b));
        _mm256_storeu_si256((__m256i *)(q + b), _mm256_or_si256(acc, kvcx_w_bits32(m, j)));
    }
#endif
    for (; b < n; b++) q[b] |= (uint8_t)(((p[b >> 3] >> (b & 7)) & 1) << j);
}

/* dst (cols x rows bytes, row stride ds) = transpose of src (rows x cols, row stride ss); rows and
   cols multiples of 8 */
static inline void kvcx_w_transpose(const uint8_t *src, int64_t ss, int64_t rows, int64_t cols, uint8_t *dst,
                                    int64_t ds) {
    int64_t r, c;
    for (r = 0; r < rows; r += 8)
        for (c = 0; c < cols; c += 8) {
            const uint8_t *s0 = src + r * ss + c;
            uint8_t *d0 = dst + c * ds + r;
#if defined(__SSE2__)
            __m128i t0 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)s0),
                                           _mm_loadl_epi64((const __m128i *)(s0 + ss)));
            __m128i t1 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(s0 + 2 * ss)),
                                           _mm_loadl_epi64((const __m128i *)(s0 + 3 * ss)));
            __m128i t2 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(s0 + 4 * ss)),
                                           _mm_loadl_epi64((const __m128i *)(s0 + 5 * ss)));
            __m128i t3 = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(s0 + 6 * ss)),
                                           _mm_loadl_epi64((const __m128i *)(s0 + 7 * ss)));
            __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1);
            __m128i u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
            __m128i v[4] = {_mm_unpacklo_epi32(u0, u2), _mm_unpackhi_epi32(u0, u2),
                            _mm_unpacklo_epi32(u1, u3), _mm_unpackhi_epi32(u1, u3)};
            int k;
            for (k = 0; k < 4; k++) {
                _mm_storel_epi64((__m128i *)(d0 + (2 * k) * ds), v[k]);
                _mm_storel_epi64((__m128i *)(d0 + (2 * k + 1) * ds), _mm_srli_si128(v[k], 8));
            }
#else
            int i, j;
            for (i = 0; i < 8; i++)
                for (j = 0; j < 8; j++) d0[j * ds + i] = s0[i * ss + j];
#endif
        }
}

/* One slab's channel ranges and error model from its groups' min / max (G x D each, the last group
   last_rows tokens, the others gs): lo / hi the channel's min and max over the groups (NaN sticky), spread
   the sum over groups of rows * (max - min)^2: the error of a channel decoded to its groups' middles. */
static inline void kvcx_w_channels(const float *mn, const float *mx, int64_t G, int64_t D, int64_t gs,
                                   int64_t last_rows, float *lo, float *hi, double *spread) {
    int64_t g, d;
    for (d = 0; d < D; d++) { lo[d] = mn[d]; hi[d] = mx[d]; spread[d] = 0.0; }
    for (g = 0; g < G; g++) {
        const float *a = mn + g * D, *b = mx + g * D;
        double rows = (double)(g == G - 1 ? last_rows : gs);
        for (d = 0; d < D; d++) {
            double r = (double)b[d] - (double)a[d];
            lo[d] = (a[d] < lo[d] || a[d] != a[d]) ? a[d] : lo[d];
            hi[d] = b[d] > hi[d] ? b[d] : hi[d];
            spread[d] += rows * r * r;
        }
    }
}

/* A group's parameters per channel (D x float each; restrict: vectorised): its range bytes a / b (the step
   of the channel's 255-step grid at or below its min mn, at or above its max mx), its low end glo and
   the inverse of its code step (0 where the channel has no codes or no range). top = 2^w - 1. */
static inline void kvcx_w_group_params(const float *restrict mn, const float *restrict mx,
                                       const float *restrict lo, const float *restrict hi,
                                       const float *restrict top, int64_t D, float *restrict glo,
                                       float *restrict inv, float *restrict fa, float *restrict fb) {
    int64_t d;
    for (d = 0; d < D; d++) {
        float span = (hi[d] - lo[d]) / 255.0f;
        int has = span > 0.0f;
        float ok = has ? span : 1.0f;
        float a = floorf((mn[d] - lo[d]) / ok), b = ceilf((mx[d] - lo[d]) / ok), t = top[d], step;
        a = has ? a : 0.0f;
        b = has ? b : 0.0f;
        a = a < 0.0f ? 0.0f : a;
        a = a > 255.0f ? 255.0f : a;
        b = b < a ? a : b;
        b = b > 255.0f ? 255.0f : b;
        glo[d] = lo[d] + a * span;
        step = (lo[d] + b * span - glo[d]) / (t > 1.0f ? t : 1.0f);
        inv[d] = ((step > 0.0f) & (t > 0.0f)) ? 1.0f / (step > 0.0f ? step : 1.0f) : 0.0f;
        fa[d] = a;
        fb[d] = b;
    }
}

/* one row of codes: o[d] = clamp(rint((x[d] - glo[d]) * inv[d]), 0, top[d]) */
static inline void kvcx_w_quant_row(const float *restrict x, const float *restrict glo,
                                    const float *restrict inv, const float *restrict top, int64_t D,
                                    uint8_t *restrict o) {
    int64_t d;
    for (d = 0; d < D; d++) {
        float v = rintf((x[d] - glo[d]) * inv[d]);
        v = v < 0.0f ? 0.0f : v;
        v = v > top[d] ? top[d] : v;
        o[d] = (uint8_t)(int32_t)v;
    }
}

/* Encode one group: x is its rows x D tile (rows <= gs), mn / mx / me its column min, max and mean, lo / hi the
   slab's channel ranges (FP16 values), w / top / off the slab's widths, 2^w - 1 and plane offsets.
   Writes the group's range bytes (D x 2) and its plane block: a and b the grid steps at or below its min and at
   or above its max, but for a width-0 channel about its mean (it decodes to the middle of its range bytes:
   within half a step of the mean, the constant of least squared error). D a multiple of 8.
   qt: 2 * gs * D scratch bytes; row: kvcx_w_encode_floats(D) scratch floats. */
static inline void kvcx_w_encode_tile(const float *x, int64_t rows, int64_t gs, int64_t D, const float *mn,
                                      const float *mx, const float *me, const float *lo, const float *hi, const uint8_t *w,
                                      const float *top, const int64_t *off, uint8_t *qt, float *row,
                                      uint8_t *stats, uint8_t *out) {
    float *glo = row, *inv = row + D, *fa = row + 2 * D, *fb = row + 3 * D, *gmn = row + 4 * D,
          *gmx = row + 5 * D;
    uint8_t *qr = qt + gs * D;   /* codes row-major (gs x D), then transposed into qt (D x gs) */
    int64_t r, d;
    int j;
    for (d = 0; d < D; d++) {
        gmn[d] = top[d] == 0.0f ? me[d] : mn[d];
        gmx[d] = top[d] == 0.0f ? me[d] : mx[d];
    }
    kvcx_w_group_params(gmn, gmx, lo, hi, top, D, glo, inv, fa, fb);
    for (d = 0; d < D; d++) {
        stats[2 * d] = (uint8_t)(int32_t)fa[d];
        stats[2 * d + 1] = (uint8_t)(int32_t)fb[d];
    }
    for (r = 0; r < rows; r++) kvcx_w_quant_row(x + r * D, glo, inv, top, D, qr + r * D);
    if (rows < gs) memset(qr + rows * D, 0, (size_t)((gs - rows) * D));
    kvcx_w_transpose(qr, D, gs, D, qt, gs);
    for (d = 0; d < D; d++)
        for (j = 0; j < w[d]; j++) kvcx_w_plane(qt + d * gs, gs, j, out + off[d] + j * (gs / 8));
}

/* Decode one group into its rows x D float tile x (the inverse of kvcx_w_encode_tile). Returns nonzero
   when a range byte pair is out of order (damaged data). qt: 2 * gs * D scratch bytes; row: 2 * D floats. */
static inline int kvcx_w_decode_tile(const uint8_t *planes, const uint8_t *stats, int64_t rows, int64_t gs,
                                     int64_t D, const float *lo, const float *hi, const uint8_t *w,
                                     const float *top, const int64_t *off, uint8_t *qt, float *row, float *x) {
    float *base = row, *step = row + D;
    uint8_t *qr = qt + gs * D;
    int64_t r, d;
    int j, bad = 0;
    for (d = 0; d < D; d++) {
        float span = (hi[d] - lo[d]) / 255.0f, t = top[d];
        float glo = lo[d] + (float)stats[2 * d] * span, ghi = lo[d] + (float)stats[2 * d + 1] * span;
        bad |= stats[2 * d] > stats[2 * d + 1];
        step[d] = t > 0.0f ? (ghi - glo) / (t > 0.0f ? t : 1.0f) : 0.0f;
        base[d] = t > 0.0f ? glo : (glo + ghi) / 2.0f;
    }
    memset(qt, 0, (size_t)(gs * D));
    for (d = 0; d < D; d++)
        for (j = 0; j < w[d]; j++) kvcx_w_unplane(planes + off[d] + j * (gs / 8), gs, j, qt + d * gs);
    kvcx_w_transpose(qt, gs, D, gs, qr, D);
    for (r = 0; r < rows; r++) {
        float *restrict p = x + r * D;
        const uint8_t *restrict c = qr + r * D;
        const float *restrict b = base, *restrict st = step;
        for (d = 0; d < D; d++) p[d] = b[d] + st[d] * (float)c[d];
    }
    return bad;
}

#endif
