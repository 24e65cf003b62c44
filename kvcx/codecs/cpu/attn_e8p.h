/* The fused attention's reading of values in E8P records (kvcx.e8p, kvcx2v's values; the codebook and its tables:
   e8p.h): a tile decoded into floats for many rows, or each point decoded in registers where few rows add it. Part
   of attn.h; needs attn_blocks.h first. */
#ifndef KVCX_ATTN_E8P_H
#define KVCX_ATTN_E8P_H

#include <string.h>

#include "attn_blocks.h"
#include "e8p.h"

/* Values in E8P records (kvcx.e8p, docs/FORMAT.md 2.8; e8p.h): the tile's n records (D / 4 + 2 bytes each) decoded
   into vf [n][D] in kvcx_attn_tile_v's order (odd halves 16x), each point unscaled and still rotated, and the
   records' FP16 scales into vs [n] (the softmax's value weights p s, as per-token scales are; the Hadamard rotation
   is undone once per output row, as for rotated integer values). Code b covers channels 8b .. 8b + 7: its even
   coordinates go to positions 16 (b / 2) + 4 (b & 1) .. + 3 and its odd ones 8 further on. */
#if KVCX_ATTN_AVX2
/* the point of 16-bit code c, in the tiles' order (kvcx_e8p_tile_pat) */
static inline __m256 kvcx_e8p_vec(unsigned c) {
    const float *hi = kvcx_e8p_tile_hi[c >> 8].f;
    return _mm256_add_ps(_mm256_xor_ps(_mm256_loadu_ps(kvcx_e8p_tile_pat[c & 0xFF]), _mm256_loadu_ps(hi)),
                         _mm256_loadu_ps(hi + 8));
}
#endif

static inline void kvcx_attn_tile_e8p(const uint8_t *rec, int64_t n, int64_t D, float *vf, float *vs) {
    const int64_t rb = kvcx_e8p_record_bytes(D), nc = D / 8;
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *r = rec + j * rb;
        float *x = vf + j * D;
        vs[j] = kvcx_h2f_1((uint16_t)(r[2 * nc] | (r[2 * nc + 1] << 8)));
        for (int64_t b = 0; b < nc; b++) {
            const unsigned c = (unsigned)r[2 * b] | ((unsigned)r[2 * b + 1] << 8);
            float *o = x + 16 * (b >> 1) + 4 * (b & 1);
#if KVCX_ATTN_AVX2
            const __m256 v = kvcx_e8p_vec(c);
            _mm_storeu_ps(o, _mm256_castps256_ps128(v));
            _mm_storeu_ps(o + 8, _mm256_extractf128_ps(v, 1));
#else
            const float *pat = kvcx_e8p_tile_pat[c & 0xFF], *sh = kvcx_e8p_tile_hi[c >> 8].f + 8;
            const uint32_t *sg = kvcx_e8p_tile_hi[c >> 8].u;
            for (int i = 0; i < 8; i++) o[i < 4 ? i : i + 4] = (sg[i] ? -pat[i] : pat[i]) + sh[i];
#endif
        }
    }
}

/* Values in E8P records with few rows (below KVCX_ATTN_TILE_ROWS): acc[r] += sum_{j < n} w[r * ws + j] point_j (the
   order of kvcx_attn_tile_e8p), each point decoded in registers where it is added, never stored: per 16 channels
   (two codes), the rows' accumulators stay in registers over the tile's tokens. The records' scales are in w. */
#if KVCX_ATTN_AVX2
/* one pass over NG (1 or 2, a constant) blocks of 16 channels from channel 16 g: RB x 2 NG accumulators */
static inline __attribute__((always_inline)) void kvcx_e8p_axpy_pass(const uint8_t *rec, int64_t n, int64_t D,
                                                                     const float *w, int64_t ws, const int RB,
                                                                     float *acc, int64_t g, const int NG) {
    const int64_t rb = kvcx_e8p_record_bytes(D);
    __m256 a[3][4];
    for (int r = 0; r < RB; r++)
        for (int k = 0; k < 2 * NG; k++) a[r][k] = _mm256_loadu_ps(acc + r * D + 16 * g + 8 * k);
    const uint8_t *c = rec + 4 * g;
    for (int64_t j = 0; j < n; j++, c += rb) {
        __m256 x[4];
        for (int h = 0; h < NG; h++) {
            uint32_t two;
            memcpy(&two, c + 4 * h, 4);
            const __m256 v0 = kvcx_e8p_vec(two & 0xFFFF), v1 = kvcx_e8p_vec(two >> 16);
            x[2 * h] = _mm256_permute2f128_ps(v0, v1, 0x20);       /* even channels */
            x[2 * h + 1] = _mm256_permute2f128_ps(v0, v1, 0x31);   /* odd channels (16x) */
        }
        for (int r = 0; r < RB; r++) {
            const __m256 wv = _mm256_set1_ps(w[r * ws + j]);
            for (int k = 0; k < 2 * NG; k++) a[r][k] = _mm256_fmadd_ps(wv, x[k], a[r][k]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int k = 0; k < 2 * NG; k++) _mm256_storeu_ps(acc + r * D + 16 * g + 8 * k, a[r][k]);
}

/* RB <= 3 rows: 32 channels (4 codes) a pass where D allows (RB x 4 accumulators: chains enough to hide the
   FMAs' latency), the last 16 on their own */
static inline __attribute__((always_inline)) void kvcx_e8p_axpy_rb(const uint8_t *rec, int64_t n, int64_t D,
                                                                   const float *w, int64_t ws, const int RB,
                                                                   float *acc) {
    int64_t g = 0;
    for (; g + 2 <= D / 16; g += 2) kvcx_e8p_axpy_pass(rec, n, D, w, ws, RB, acc, g, 2);
    if (g < D / 16) kvcx_e8p_axpy_pass(rec, n, D, w, ws, RB, acc, g, 1);
}
#endif

/* the scales of n E8P records into vs, and with few rows (vf NULL) nothing else: kvcx_e8p_axpy reads the codes */
static inline void kvcx_e8p_scales(const uint8_t *rec, int64_t n, int64_t D, float *vs) {
    const int64_t rb = kvcx_e8p_record_bytes(D);
    for (int64_t j = 0; j < n; j++) vs[j] = kvcx_h2f_1((uint16_t)(rec[j * rb + D / 4] | (rec[j * rb + D / 4 + 1] << 8)));
}

static inline void kvcx_e8p_axpy(const uint8_t *rec, int64_t n, int64_t D, const float *w, int64_t ws, int64_t R,
                                 float *acc, float *vf, float *vs) {
#if KVCX_ATTN_AVX2
    (void)vf; (void)vs;
#define KVCX_E8P_AXPY_BLOCK(r0, k) kvcx_e8p_axpy_rb(rec, n, D, w + (r0) * ws, ws, k, acc + (r0) * D)
    KVCX_ROW_BLOCKS(R, 3, KVCX_E8P_AXPY_BLOCK);
#undef KVCX_E8P_AXPY_BLOCK
#else
    kvcx_attn_tile_e8p(rec, n, D, vf, vs);
    kvcx_f_axpy(vf, n, D, w, ws, R, acc);
#endif
}

#endif /* KVCX_ATTN_E8P_H */
