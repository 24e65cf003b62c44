/* The fused attention's building blocks: float-tile products (many rows per KV head), tiles of codes
   unpacked once, masks, the running softmax, the exact tokens. Part of attn.h; needs attn_simd.h first. */
#ifndef KVCX_ATTN_BLOCKS_H
#define KVCX_ATTN_BLOCKS_H

#include "attn_simd.h"

/* The float-tile products (many rows per KV head) are written once for a vector of KVCX_FV_LANES floats:
   AVX-512's 16 (12 rows per register block: 32 registers) or AVX2's 8 (6 rows: 16 registers). */
#if KVCX_ATTN_AVX512
typedef __m512 kvcx_fv;
#define KVCX_FV_LANES 16
#define KVCX_ATTN_FROWS 12
#define kvcx_fv_load _mm512_loadu_ps
#define kvcx_fv_store _mm512_storeu_ps
#define kvcx_fv_set1 _mm512_set1_ps
#define kvcx_fv_zero _mm512_setzero_ps
#define kvcx_fv_add _mm512_add_ps
#define kvcx_fv_fmadd _mm512_fmadd_ps
#elif KVCX_ATTN_AVX2
typedef __m256 kvcx_fv;
#define KVCX_FV_LANES 8
#define KVCX_ATTN_FROWS 6
#define kvcx_fv_load _mm256_loadu_ps
#define kvcx_fv_store _mm256_storeu_ps
#define kvcx_fv_set1 _mm256_set1_ps
#define kvcx_fv_zero _mm256_setzero_ps
#define kvcx_fv_add _mm256_add_ps
#define kvcx_fv_fmadd _mm256_fmadd_ps
#else
#define KVCX_FV_LANES 8
#endif
/* float key tiles are zero-padded to a multiple of this many tokens (one column block of the products) */
#define KVCX_ATTN_PAD (2 * KVCX_FV_LANES)

/* n rounded up to a multiple of KVCX_ATTN_PAD */
static inline int64_t kvcx_attn_pad(int64_t n) { return (n + KVCX_ATTN_PAD - 1) & ~(int64_t)(KVCX_ATTN_PAD - 1); }

/* Rows in register blocks: CALL(r0, MAX) for each whole block of MAX rows, then CALL(r0, k) once for the k < MAX
   rows left, with k a constant in every call so that each instance compiles for its own block size (MAX <= 12;
   the instances past MAX are dead code). */
#define KVCX_ROW_BLOCKS(R, MAX, CALL) do { \
    int64_t r0 = 0; \
    for (; r0 + (MAX) <= (R); r0 += (MAX)) CALL(r0, MAX); \
    switch ((R) - r0) { \
    case 11: if ((MAX) > 11) CALL(r0, 11); break; \
    case 10: if ((MAX) > 10) CALL(r0, 10); break; \
    case 9: if ((MAX) > 9) CALL(r0, 9); break; \
    case 8: if ((MAX) > 8) CALL(r0, 8); break; \
    case 7: if ((MAX) > 7) CALL(r0, 7); break; \
    case 6: if ((MAX) > 6) CALL(r0, 6); break; \
    case 5: if ((MAX) > 5) CALL(r0, 5); break; \
    case 4: if ((MAX) > 4) CALL(r0, 4); break; \
    case 3: CALL(r0, 3); break; \
    case 2: CALL(r0, 2); break; \
    case 1: CALL(r0, 1); break; \
    default: break; \
    } \
} while (0)

static inline void kvcx_q4_dots(const uint8_t *c, int64_t n, int64_t D, const float *qp, const float *bias, int64_t R,
                                float *dots, int64_t ds) {
#if KVCX_ATTN_AVX2
#define KVCX_Q4_DOTS_BLOCK(r0, k) kvcx_q4_dots_rb(c, n, D, qp + (r0) * D, bias + (r0), k, dots + (r0) * ds, ds)
    KVCX_ROW_BLOCKS(R, 4, KVCX_Q4_DOTS_BLOCK);
#undef KVCX_Q4_DOTS_BLOCK
#else
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *cj = c + j * (D / 2);
            float s = 0.0f;
            for (int64_t p = 0; p < D; p++) {
                int64_t k = p >> 4, i = p & 15;
                uint8_t byte = cj[8 * k + (i & 7)];
                s += qp[r * D + p] * (float)(i < 8 ? (byte & 0x0F) : (byte & 0xF0));
            }
            dots[r * ds + j] = s + bias[r];
        }
#endif
}

static inline void kvcx_q4_axpy(const uint8_t *c, int64_t n, int64_t D, const float *w, int64_t ws, int64_t R,
                                float *acc) {
#if KVCX_ATTN_AVX2
#define KVCX_Q4_AXPY_BLOCK(r0, k) kvcx_q4_axpy_rb(c, n, D, w + (r0) * ws, ws, k, acc + (r0) * D)
    KVCX_ROW_BLOCKS(R, 4, KVCX_Q4_AXPY_BLOCK);
#undef KVCX_Q4_AXPY_BLOCK
#else
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *cj = c + j * (D / 2);
            const float wj = w[r * ws + j];
            for (int64_t p = 0; p < D; p++) {
                int64_t k = p >> 4, i = p & 15;
                uint8_t byte = cj[8 * k + (i & 7)];
                acc[r * D + p] += wj * (float)(i < 8 ? (byte & 0x0F) - 8 : (byte & 0xF0) - 128);
            }
        }
#endif
}

/* ---- float tiles (many rows per KV head) ----------------------------------------------------------- */
#if KVCX_ATTN_AVX2
/* the 8 x 8 floats r[0..7] transposed in place */
static inline void kvcx_tr8(__m256 *r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

/* kT[p * T + j] (p < D, j < n rounded up to KVCX_ATTN_PAD, zero past n) = the value at position p of token j: the codes
   of 4-bit layout tokens c (code bytes, D / 2 per token) as the dot products read them (permuted order, odd
   halves 16 c) when c is not NULL, else the float rows x ([n][D], as they are) */
static inline void kvcx_attn_tile_t(const uint8_t *c, const float *x, int64_t n, int64_t D, float *kT) {
    const int64_t T = KVCX_ATTN_TILE, np = kvcx_attn_pad(n);
#if KVCX_ATTN_AVX2
    for (int64_t j0 = 0; j0 < np; j0 += 8)
        for (int64_t k = 0; k < D / 16; k++) {
            __m256 lo[8], hi[8];
            for (int64_t j = 0; j < 8; j++) {
                if (j0 + j >= n) { lo[j] = hi[j] = _mm256_setzero_ps(); continue; }
                if (c) KVCX_Q4_UNPACK16(c + (j0 + j) * (D / 2) + 8 * k, lo[j], hi[j]);
                else { lo[j] = _mm256_loadu_ps(x + (j0 + j) * D + 16 * k); hi[j] = _mm256_loadu_ps(x + (j0 + j) * D + 16 * k + 8); }
            }
            kvcx_tr8(lo);
            kvcx_tr8(hi);
            for (int64_t i = 0; i < 8; i++) {
                _mm256_storeu_ps(kT + (16 * k + i) * T + j0, lo[i]);
                _mm256_storeu_ps(kT + (16 * k + 8 + i) * T + j0, hi[i]);
            }
        }
#else
    for (int64_t j = 0; j < np; j++)
        for (int64_t p = 0; p < D; p++) {
            float v = 0.0f;
            if (j < n && c) {
                const uint8_t byte = c[j * (D / 2) + 8 * (p >> 4) + (p & 7)];
                v = (float)((p & 8) ? (byte & 0xF0) : (byte & 0x0F));
            } else if (j < n)
                v = x[j * D + p];
            kT[p * T + j] = v;
        }
#endif
}

/* kT[p * T + j] = s[p] kT[p * T + j] + z[p] for p < D, j < n rounded up to KVCX_ATTN_PAD: a tile of codes to
   the keys */
static inline void kvcx_attn_tile_scale(float *kT, int64_t n, int64_t D, const float *s, const float *z) {
    const int64_t T = KVCX_ATTN_TILE, np = kvcx_attn_pad(n);
    for (int64_t p = 0; p < D; p++) {
        float *row = kT + p * T;
        int64_t j = 0;
#if KVCX_ATTN_AVX2
        const __m256 sv = _mm256_set1_ps(s[p]), zv = _mm256_set1_ps(z[p]);
        for (; j < np; j += 8) _mm256_storeu_ps(row + j, _mm256_fmadd_ps(_mm256_loadu_ps(row + j), sv, zv));
#endif
        for (; j < np; j++) row[j] = fmaf(row[j], s[p], z[p]);
    }
}

/* vf[j * D + p] = the centred codes (c - 8, odd halves 16 (c - 8), permuted order) of n 4-bit layout tokens */
static inline void kvcx_attn_tile_v(const uint8_t *c, int64_t n, int64_t D, float *vf) {
#if KVCX_ATTN_AVX2
    for (int64_t j = 0; j < n; j++)
        for (int64_t k = 0; k < D / 16; k++) {
            __m256 lo, hi;
            KVCX_Q4_UNPACK16_C(c + j * (D / 2) + 8 * k, lo, hi);
            _mm256_storeu_ps(vf + j * D + 16 * k, lo);
            _mm256_storeu_ps(vf + j * D + 16 * k + 8, hi);
        }
#else
    for (int64_t j = 0; j < n; j++)
        for (int64_t p = 0; p < D; p++) {
            const uint8_t byte = c[j * (D / 2) + 8 * (p >> 4) + (p & 7)];
            vf[j * D + p] = (float)((p & 8) ? (byte & 0xF0) - 128 : (byte & 0x0F) - 8);
        }
#endif
}

#if KVCX_ATTN_AVX2
/* sc[r * T + j] = q[r] . kT[:, j] (+ bias[r]) for RB <= KVCX_ATTN_FROWS rows and the tile's np tokens (a multiple
   of KVCX_ATTN_PAD: two vectors) */
static inline __attribute__((always_inline)) void kvcx_f_dots_rb(const float *kT, int64_t np, int64_t D,
                                                                 const float *q, const float *bias, const int RB,
                                                                 float *sc) {
    const int64_t T = KVCX_ATTN_TILE, L = KVCX_FV_LANES;
    for (int64_t j = 0; j < np; j += 2 * L) {
        kvcx_fv a[KVCX_ATTN_FROWS], c[KVCX_ATTN_FROWS];
        for (int r = 0; r < RB; r++) { a[r] = kvcx_fv_zero(); c[r] = kvcx_fv_zero(); }
        for (int64_t p = 0; p < D; p++) {
            const kvcx_fv k0 = kvcx_fv_load(kT + p * T + j), k1 = kvcx_fv_load(kT + p * T + j + L);
            for (int r = 0; r < RB; r++) {
                const kvcx_fv qv = kvcx_fv_set1(q[r * D + p]);
                a[r] = kvcx_fv_fmadd(qv, k0, a[r]);
                c[r] = kvcx_fv_fmadd(qv, k1, c[r]);
            }
        }
        for (int r = 0; r < RB; r++) {
            const kvcx_fv bv = kvcx_fv_set1(bias ? bias[r] : 0.0f);
            kvcx_fv_store(sc + r * T + j, kvcx_fv_add(a[r], bv));
            kvcx_fv_store(sc + r * T + j + L, kvcx_fv_add(c[r], bv));
        }
    }
}

/* acc[r][p0 .. p0 + NV lanes) += sum_j w[r * ws + j] x[j][p0 ..] for RB <= KVCX_ATTN_FROWS rows (NV 1 or 2 vectors
   a row, held in registers across the n rows x) */
static inline __attribute__((always_inline)) void kvcx_f_axpy_cols(const float *x, int64_t n, int64_t D,
                                                                   const float *w, int64_t ws, const int RB,
                                                                   const int NV, int64_t p0, float *acc) {
    const int64_t L = KVCX_FV_LANES;
    kvcx_fv a[KVCX_ATTN_FROWS][2];
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < NV; v++) a[r][v] = kvcx_fv_load(acc + r * D + p0 + L * v);
    for (int64_t j = 0; j < n; j++) {
        kvcx_fv xv[2];
        for (int v = 0; v < NV; v++) xv[v] = kvcx_fv_load(x + j * D + p0 + L * v);
        for (int r = 0; r < RB; r++) {
            const kvcx_fv wv = kvcx_fv_set1(w[r * ws + j]);
            for (int v = 0; v < NV; v++) a[r][v] = kvcx_fv_fmadd(wv, xv[v], a[r][v]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < NV; v++) kvcx_fv_store(acc + r * D + p0 + L * v, a[r][v]);
}

/* acc[r] += sum_j w[r * ws + j] x[j] for RB <= KVCX_ATTN_FROWS rows, n rows x of D floats (D a multiple of 16:
   two vectors at a time, one for the last 16 channels with AVX-512) */
static inline __attribute__((always_inline)) void kvcx_f_axpy_rb(const float *x, int64_t n, int64_t D, const float *w,
                                                                 int64_t ws, const int RB, float *acc) {
    int64_t p = 0;
    for (; p + 2 * KVCX_FV_LANES <= D; p += 2 * KVCX_FV_LANES) kvcx_f_axpy_cols(x, n, D, w, ws, RB, 2, p, acc);
    if (p < D) kvcx_f_axpy_cols(x, n, D, w, ws, RB, 1, p, acc);
}
#endif

/* the scores of R rows over a float tile: sc[r * T + j] = q[r] . kT[:, j] + (bias ? bias[r] : 0), j < n */
static inline void kvcx_f_dots(const float *kT, int64_t n, int64_t D, const float *q, const float *bias, int64_t R,
                               float *sc) {
    const int64_t np = kvcx_attn_pad(n);
#if KVCX_ATTN_AVX2
#define KVCX_F_DOTS_BLOCK(r0, k) \
    kvcx_f_dots_rb(kT, np, D, q + (r0) * D, bias ? bias + (r0) : NULL, k, sc + (r0) * KVCX_ATTN_TILE)
    KVCX_ROW_BLOCKS(R, KVCX_ATTN_FROWS, KVCX_F_DOTS_BLOCK);
#undef KVCX_F_DOTS_BLOCK
#else
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < np; j++) {
            float s = bias ? bias[r] : 0.0f;
            for (int64_t p = 0; p < D; p++) s += q[r * D + p] * kT[p * KVCX_ATTN_TILE + j];
            sc[r * KVCX_ATTN_TILE + j] = s;
        }
#endif
}

/* acc[r] (D floats each) += sum_{j < n} w[r * ws + j] x[j] for R rows */
static inline void kvcx_f_axpy(const float *x, int64_t n, int64_t D, const float *w, int64_t ws, int64_t R,
                               float *acc) {
#if KVCX_ATTN_AVX2
#define KVCX_F_AXPY_BLOCK(r0, k) kvcx_f_axpy_rb(x, n, D, w + (r0) * ws, ws, k, acc + (r0) * D)
    KVCX_ROW_BLOCKS(R, KVCX_ATTN_FROWS, KVCX_F_AXPY_BLOCK);
#undef KVCX_F_AXPY_BLOCK
#else
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t p = 0; p < D; p++) acc[r * D + p] += w[r * ws + j] * x[j * D + p];
#endif
}

/* Values grouped per token in D / G > 1 groups of G channels (G a multiple of 16): the tile's n tokens from
   token tt0 of the slab decoded into vf [n][D] (kvcx_attn_tile_v's permuted order, odd halves 16x), each group's
   code c' times its scale s plus, asymmetric, its offset z + off8 s (z the zero point; off8 = 2^(bits - 1) for the
   widened codes): the values themselves, which the softmax's probabilities weigh (no per-token scale left). */
static inline void kvcx_attn_tile_vg(const uint8_t *c, int64_t n, int64_t D, int64_t G, const uint16_t *s,
                                     const uint16_t *z, int64_t tt0, float off8, float *vf) {
    const int64_t NG = D / G;
    kvcx_attn_tile_v(c, n, D, vf);
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < NG; g++) {
            const int64_t k = (tt0 + j) * NG + g;
            const float sc = kvcx_h2f_1(s[k]), o = z ? kvcx_h2f_1(z[k]) + off8 * sc : 0.0f;
            float *x = vf + j * D + g * G;
            for (int64_t p = 0; p < G; p += 16) {
                for (int64_t i = 0; i < 8; i++) x[p + i] = x[p + i] * sc + o;
                for (int64_t i = 8; i < 16; i++) x[p + i] = x[p + i] * sc + 16.0f * o;
            }
        }
}

/* Logit softcapping (L->softcap > 0): each of the task's R rows' n scores s becomes softcap tanh(s / softcap),
   as Gemma 2 caps the scaled scores before the mask is added. */
static inline void kvcx_attn_cap(const kvcx_attn_layout *L, float *sc, int64_t n) {
    const float cap = L->softcap, inv = 1.0f / L->softcap;
    for (int64_t r = 0; r < L->R; r++) {
        float *s = sc + r * KVCX_ATTN_TILE;
        for (int64_t j = 0; j < n; j++) s[j] = cap * tanhf(s[j] * inv);
    }
}

/* The mask of n tokens at positions pos.. joins the scores of the task's R rows (batch row b): the float
   mask added, the boolean mask's zeros and (causal) positions past a row's own token set to -inf. */
static inline void kvcx_attn_mask(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t b, float *sc,
                                  int64_t n, int64_t pos) {
    const int64_t T = KVCX_ATTN_TILE, nq = L->nq;
    for (int64_t r = 0; r < L->R; r++) {
        float *s = sc + r * T;
        const int64_t i = r % nq, row = b * L->mask_bs + i * L->mask_qs;
        if (A->mask) {
            const float *m = A->mask + row * L->kv_len + pos;
            for (int64_t j = 0; j < n; j++) s[j] += m[j];
        } else if (A->maskb) {
            const uint8_t *m = A->maskb + row * L->kv_len + pos;
            for (int64_t j = 0; j < n; j++) s[j] = m[j] ? s[j] : -INFINITY;
        }
        if (L->causal) {
            const int64_t j0 = L->kv_len - nq + i + 1 - pos;
            for (int64_t j = j0 > 0 ? j0 : 0; j < n; j++) s[j] = -INFINITY;
        }
    }
}

/* p[j] = exp(s[j] - m) for n <= KVCX_ATTN_TILE scores (0 where s[j] = -inf); returns sum p */
static inline float kvcx_attn_exp(const float *s, int64_t n, float m, float *p) {
    float sum = 0.0f;
    int64_t j = 0;
#if KVCX_ATTN_AVX2
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
        __m256 e = kvcx_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(p + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float t[8];
    _mm256_storeu_ps(t, acc);
    for (int i = 0; i < 8; i++) sum += t[i];
#endif
    for (; j < n; j++) {
        p[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - m);
        sum += p[j];
    }
    return sum;
}

/* Head r's running max meets a tile's max mt: where it grows, the partial (sum, accumulators, W, Z) is
   rescaled to it. Returns the new max (-inf while the head has seen nothing). */
static inline float kvcx_attn_newmax(float *part, int64_t R, int64_t D, int64_t r, float mt, float *W, float *Z) {
    float *pr = part + 2 * r;
    const float m = pr[0], mnew = mt > m ? mt : m;
    if (mnew != -INFINITY && mnew > m) {
        const float alpha = m == -INFINITY ? 0.0f : expf(m - mnew);
        pr[1] *= alpha;
        W[r] *= alpha;
        Z[r] *= alpha;
        float *accv = part + 2 * R + r * D, *accp = part + 2 * R + (R + r) * D;
        for (int64_t d = 0; d < D; d++) { accv[d] *= alpha; accp[d] *= alpha; }
        pr[0] = mnew;
    }
    return mnew;
}

/* One tile of n scores per head (sc, row stride KVCX_ATTN_TILE) joins the running softmax:
   rescales the partial where the max grows and leaves the probabilities in p (same layout).
   Returns 0 for the heads that see nothing yet (their p row is zero). */
static inline void kvcx_attn_softmax(float *part, int64_t R, int64_t D, const float *sc, int64_t n,
                                     float *p, float *W, float *Z) {
    for (int64_t r = 0; r < R; r++) {
        float *pr = part + 2 * r;
        const float *s = sc + r * KVCX_ATTN_TILE;
        float *pj = p + r * KVCX_ATTN_TILE;
        const float mnew = kvcx_attn_newmax(part, R, D, r, kvcx_max_f32(s, n), W, Z);
        if (mnew == -INFINITY) {
            for (int64_t j = 0; j < n; j++) pj[j] = 0.0f;
            continue;
        }
        pr[1] += kvcx_attn_exp(s, n, mnew, pj);
    }
}

/* kvcx_attn_softmax for a tile of packed tokens, in one pass per head: the probabilities e times the tile's
   value scales vs left in p, sum e added to l, and (vz, asymmetric values) sum e vs to W and sum e vz to Z. */
static inline void kvcx_attn_softmax_v(float *part, int64_t R, int64_t D, const float *sc, int64_t n, float *p,
                                       float *W, float *Z, const float *vs, const float *vz) {
    for (int64_t r = 0; r < R; r++) {
        float *pr = part + 2 * r;
        const float *s = sc + r * KVCX_ATTN_TILE;
        float *pj = p + r * KVCX_ATTN_TILE;
        const float mnew = kvcx_attn_newmax(part, R, D, r, kvcx_max_f32(s, n), W, Z);
        if (mnew == -INFINITY) {
            for (int64_t j = 0; j < n; j++) pj[j] = 0.0f;
            continue;
        }
        float l = 0.0f, w = 0.0f, z = 0.0f;
        int64_t j = 0;
#if KVCX_ATTN_AVX2
        __m256 la = _mm256_setzero_ps(), wa = _mm256_setzero_ps(), za = _mm256_setzero_ps();
        const __m256 mv = _mm256_set1_ps(mnew);
#if KVCX_ATTN_AVX512
        {
            __m512 l16 = _mm512_setzero_ps(), w16 = _mm512_setzero_ps(), z16 = _mm512_setzero_ps();
            const __m512 m16 = _mm512_set1_ps(mnew);
            for (; j + 16 <= n; j += 16) {
                const __m512 e = kvcx_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m16));
                const __m512 ps = _mm512_mul_ps(e, _mm512_loadu_ps(vs + j));
                _mm512_storeu_ps(pj + j, ps);
                l16 = _mm512_add_ps(l16, e);
                w16 = _mm512_add_ps(w16, ps);
                if (vz) z16 = _mm512_fmadd_ps(e, _mm512_loadu_ps(vz + j), z16);
            }
            la = kvcx_fold16(l16);
            wa = kvcx_fold16(w16);
            za = kvcx_fold16(z16);
        }
#endif
        for (; j + 16 <= n; j += 16) {
            __m256 e0, e1;
            kvcx_exp8x2(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv), _mm256_sub_ps(_mm256_loadu_ps(s + j + 8), mv),
                        &e0, &e1);
            const __m256 p0 = _mm256_mul_ps(e0, _mm256_loadu_ps(vs + j));
            const __m256 p1 = _mm256_mul_ps(e1, _mm256_loadu_ps(vs + j + 8));
            _mm256_storeu_ps(pj + j, p0);
            _mm256_storeu_ps(pj + j + 8, p1);
            la = _mm256_add_ps(la, _mm256_add_ps(e0, e1));
            wa = _mm256_add_ps(wa, _mm256_add_ps(p0, p1));
            if (vz)
                za = _mm256_fmadd_ps(e1, _mm256_loadu_ps(vz + j + 8), _mm256_fmadd_ps(e0, _mm256_loadu_ps(vz + j), za));
        }
        for (; j + 8 <= n; j += 8) {
            const __m256 e = kvcx_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
            const __m256 ps = _mm256_mul_ps(e, _mm256_loadu_ps(vs + j));
            _mm256_storeu_ps(pj + j, ps);
            la = _mm256_add_ps(la, e);
            wa = _mm256_add_ps(wa, ps);
            if (vz) za = _mm256_fmadd_ps(e, _mm256_loadu_ps(vz + j), za);
        }
        float t8[8];
        _mm256_storeu_ps(t8, la);
        for (int i = 0; i < 8; i++) l += t8[i];
        if (vz) {
            _mm256_storeu_ps(t8, wa);
            for (int i = 0; i < 8; i++) w += t8[i];
            _mm256_storeu_ps(t8, za);
            for (int i = 0; i < 8; i++) z += t8[i];
        }
#endif
        for (; j < n; j++) {
            const float e = s[j] == -INFINITY ? 0.0f : expf(s[j] - mnew);
            pj[j] = e * vs[j];
            l += e;
            w += pj[j];
            if (vz) z += e * vz[j];
        }
        pr[1] += l;
        if (vz) { W[r] += w; Z[r] += z; }
    }
}

/* Exact float32 tokens [n, D] at positions pos.. (one run of sinks or residual) join the softmax. kT: the
   float key tile's scratch with many rows (register-blocked products), else NULL. With the products,
   masked tokens (weight 0) add 0 times their value; else they are skipped, whatever they hold. */
static inline void kvcx_attn_exact(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t slab,
                                   const float *ek, const float *ev, int64_t n, int64_t pos, const float *qn,
                                   float *part, float *sc, float *p, float *W, float *Z, float *kT) {
    const int64_t R = L->R, D = L->D, b = slab / L->Hkv, T = KVCX_ATTN_TILE;
    for (int64_t t = 0; t < n; t += T) {
        const int64_t m = n - t < T ? n - t : T;
        if (kT) {   /* many rows: the tile's keys transposed once, the rows' products register-blocked */
            kvcx_attn_tile_t(NULL, ek + t * D, m, D, kT);
            kvcx_f_dots(kT, m, D, qn, NULL, R, sc);
            if (L->softcap > 0.0f) kvcx_attn_cap(L, sc, m);
            kvcx_attn_mask(L, A, b, sc, m, pos + t);
            kvcx_attn_softmax(part, R, D, sc, m, p, W, Z);
            kvcx_f_axpy(ev + t * D, m, D, p, T, R, part + 2 * R + R * D);
            continue;
        }
        for (int64_t r = 0; r < R; r++) {
            float *s = sc + r * T;
#if KVCX_ATTN_AVX2
            for (int64_t j0 = 0; j0 < m; j0 += 8) {   /* 8 tokens' dot products, then one horizontal sum */
                const int64_t nj = m - j0 < 8 ? m - j0 : 8;
                __m256 part8[8];
                for (int64_t j = 0; j < 8; j++) {
                    __m256 a = _mm256_setzero_ps(), c = _mm256_setzero_ps();
                    if (j < nj) {
                        const float *k = ek + (t + j0 + j) * D, *qr = qn + r * D;
                        for (int64_t d = 0; d < D; d += 16) {
                            a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(k + d), a);
                            c = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d + 8), _mm256_loadu_ps(k + d + 8), c);
                        }
                    }
                    part8[j] = _mm256_add_ps(a, c);
                }
                float tmp[8];
                _mm256_storeu_ps(tmp, kvcx_hsum8(part8));
                for (int64_t j = 0; j < nj; j++) s[j0 + j] = tmp[j];
            }
#else
            for (int64_t j = 0; j < m; j++) s[j] = kvcx_dot_f32(qn + r * D, ek + (t + j) * D, D);
#endif
        }
        if (L->softcap > 0.0f) kvcx_attn_cap(L, sc, m);
        kvcx_attn_mask(L, A, b, sc, m, pos + t);
        kvcx_attn_softmax(part, R, D, sc, m, p, W, Z);
        for (int64_t r = 0; r < R; r++) {   /* masked tokens (weight 0) are skipped, whatever they hold */
            float *accp = part + 2 * R + (R + r) * D;
            const float *pr = p + r * T;
            const float *v = ev + t * D;
#if KVCX_ATTN_AVX2
            for (int64_t d = 0; d < D; d += 16) {   /* two accumulators in registers across the tokens */
                __m256 a = _mm256_loadu_ps(accp + d), c = _mm256_loadu_ps(accp + d + 8);
                for (int64_t j = 0; j < m; j++)
                    if (pr[j] != 0.0f) {
                        const __m256 w = _mm256_set1_ps(pr[j]);
                        a = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + j * D + d), a);
                        c = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + j * D + d + 8), c);
                    }
                _mm256_storeu_ps(accp + d, a);
                _mm256_storeu_ps(accp + d + 8, c);
            }
#else
            for (int64_t j = 0; j < m; j++)
                if (pr[j] != 0.0f)
                    for (int64_t d = 0; d < D; d++) accp[d] += pr[j] * v[j * D + d];
#endif
        }
    }
}

#endif /* KVCX_ATTN_BLOCKS_H */
