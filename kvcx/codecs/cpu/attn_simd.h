/* The fused attention's types, limits and instruction-set primitives (AVX-512, AVX2, plain C): exp, the
   4-bit unpacking, the register-blocked products over codes. Part of attn.h (which documents the kernel). */
#ifndef KVCX_ATTN_SIMD_H
#define KVCX_ATTN_SIMD_H


#include "kernels.h"
#include "widths.h"
#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

enum {
    KVCX_ATTN_TILE = 64,        /* tokens scored and accumulated per softmax update */
    KVCX_ATTN_MAX_GROUP = 64,   /* query heads per KV head, at most */
    KVCX_ATTN_MAX_D = 512,      /* head dim, at most (a multiple of 16) */
    KVCX_ATTN_MAX_ROWS = 4096,  /* rows per KV head (query heads x query tokens), at most */
    KVCX_ATTN_TILE_ROWS = 12,   /* rows per KV head from which tiles are unpacked to floats once */
    KVCX_ATTN_WROWS = 6         /* keys with widths: rows per KV head up to which scores come straight from
                                   the planes (codes rebuilt per 3 rows), past it through a float tile */
};

typedef struct {
    int64_t B, Hkv, R, D;       /* batch rows, KV heads, rows per KV head (query heads x nq), head dim */
    int64_t Tq, pos_q;          /* positions read from packed keys and values: [pos_q, pos_q + Tq) */
    int64_t k_tokens, v_tokens; /* packed tokens held per (row, KV head); position pos_q is key token
                                   k_tokens - Tq and value token v_tokens - Tq */
    int64_t ns, pos_s;          /* exact run 1 (sinks): tokens and first position */
    int64_t nr, pos_r;          /* exact run 2 (residual): tokens and first position */
    int64_t nsplit;             /* token ranges per (row, KV head): tasks = B * Hkv * nsplit */
    int64_t kv_len;             /* mask row length */
    float scaling;
    int k_axis, k_asym, k_rotate;
    int64_t k_group, k_nscale;  /* group size, scales per (row, KV head) */
    int v_asym, v_rotate;
    int64_t v_group, v_nscale;
    int k_bits, v_bits;         /* 2, 3 or 4 */
    int v_e8p;                  /* values in E8P records (kvcx.e8p: D / 4 + 2 bytes a token, the scale inside; rotated,
                                   v_group D, symmetric; v_bits unused) */
    int64_t nq;                 /* query tokens per row: row r is query head r / nq, token r % nq */
    int k_widths;               /* keys with a width per channel (k_bits unused, k_axis channel: blocks are
                                   the groups of k_group tokens) */
    int64_t k_chunks, k_groups; /* widths: chunks (width tables) and groups per (row, KV head) */
    int64_t mask_bs, mask_qs;   /* mask row of (batch row b, token i): b * mask_bs + i * mask_qs */
    int causal;                 /* token i sees positions up to kv_len - nq + i (exact runs only) */
    float softcap;              /* > 0: every score s becomes softcap tanh(s / softcap) before the mask (Gemma 2) */
} kvcx_attn_layout;

typedef struct {
    const float *q;                      /* [B, Hkv * R, D] */
    const uint8_t *kc;                   /* [B * Hkv, k_tokens * D * k_bits / 8]; widths: every plane (kgoff) */
    const uint16_t *ks, *kz;             /* [B * Hkv, k_nscale] (kz: asymmetric only); widths: the groups' range
                                            bytes, 2 per channel (k_nscale = k_groups * D) */
    const int64_t *kblk;                 /* channel axis: block b = key tokens [kblk[b], kblk[b + 1]) */
    const uint8_t *vc;                   /* [B * Hkv, v_tokens * D * v_bits / 8]; E8P: v_tokens records */
    const uint16_t *vs, *vz;
    const float *sk, *sv;                /* [B * Hkv, ns, D] */
    const float *rk, *rv;                /* [B * Hkv, nr, D] */
    const int64_t *kgoff;                /* widths: [B * Hkv, k_groups] byte offsets in kc of the groups' planes */
    const uint8_t *kw;                   /* widths: [B * Hkv, k_chunks, D] each chunk's channel widths */
    const uint16_t *krange;              /* widths: [B * Hkv, k_chunks, D, 2] each chunk's channel ranges (FP16) */
    const int64_t *kgchunk;              /* widths: [k_groups] the chunk of each group */
    const float *mask;                   /* [mask rows, kv_len] added to the scores, or NULL */
    const uint8_t *maskb;                /* [mask rows, kv_len]: 0 = masked (a boolean mask), or NULL */
    const float *sinks;                  /* [Hkv * R / nq] a query head's sink logit (GPT-OSS's s_aux: in the
                                            softmax's sum, attending to nothing), or NULL */
    float *work;                         /* [tasks, kvcx_attn_work_floats(R, D, k_widths, kvcx_attn_vtile(L))] */
    float *out;                          /* [B, Hkv * R, D] */
} kvcx_attn_args;

/* floats of workspace per task: the partial (m and l per head, then accv[R][D] in the permuted order,
   then accp[R][D]), then scratch (T D / 8 floats: a tile's 2- or 3-bit codes widened to nibbles; with
   KVCX_ATTN_TILE_ROWS rows or more, then the float tiles of keys [D][T] and values [T][D]; keys with widths:
   a chunk's channels (3 D int32), the key tile [D][T] when it is not there already, the chunk's compacted
   query terms [R][D] and biases [R], a group's compacted code steps [D], and through float tiles the chunk's
   channel ranges [3][D]); values through a float tile (kvcx_attn_vtile) with few rows: that tile [T][D] last) */
static inline int64_t kvcx_attn_part_floats(int64_t R, int64_t D) { return 2 * R + 2 * R * D; }
/* values read through a float tile [T][D]: in several groups a token, or E8P records */
static inline int kvcx_attn_vtile(const kvcx_attn_layout *L) { return L->v_group < L->D || L->v_e8p; }

static inline int64_t kvcx_attn_work_floats(int64_t R, int64_t D, int widths, int vtile) {
    const int many = R >= KVCX_ATTN_TILE_ROWS;
    return kvcx_attn_part_floats(R, D) + 3 * R * D + 4 * R + 2 * R * KVCX_ATTN_TILE + 2 * KVCX_ATTN_TILE + 2 * D
           + KVCX_ATTN_TILE * D / 8 + (many ? 2 * KVCX_ATTN_TILE * D : 0)
           + (widths ? 3 * D + (many ? 0 : KVCX_ATTN_TILE * D) + R * D + R + 4 * D : 0)
           + (vtile && !many ? KVCX_ATTN_TILE * D : 0);
}

/* channel index of position p in the permuted order */
static inline int64_t kvcx_attn_perm(int64_t p) {
    int64_t k = p >> 4, i = p & 15;
    return 16 * k + (i < 8 ? 2 * i : 2 * (i - 8) + 1);
}

/* ---- SIMD helpers ------------------------------------------------------------------------ */
#if defined(__AVX2__) && defined(__FMA__)
#define KVCX_ATTN_AVX2 1
/* AVX-512: 16 lanes a vector where it pays (the codes' products 32 channels at a time, the float tiles' 32 tokens
   or channels and 12 rows at a time) */
#if defined(__AVX512F__)
#define KVCX_ATTN_AVX512 1
#else
#define KVCX_ATTN_AVX512 0
#endif

/* the 8 horizontal sums of v[0..7], in order */
static inline __m256 kvcx_hsum8(const __m256 *v) {
    __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    __m256 e = _mm256_hadd_ps(a, b), f = _mm256_hadd_ps(c, d);
    return _mm256_add_ps(_mm256_permute2f128_ps(e, f, 0x20), _mm256_permute2f128_ps(e, f, 0x31));
}

/* Cephes' expf: x clamped at KVCX_EXP_LO, n = floor(x log2 e + 1/2), r = x - n C1 - n C2, then
   exp(x) = 2^n (1 + r + r^2 P(r)) with P of degree 5 (coefficients from the highest power down) */
#define KVCX_EXP_LO (-87.3365f)
#define KVCX_EXP_LOG2E 1.44269504088896341f
#define KVCX_EXP_C1 0.693359375f
#define KVCX_EXP_C2 (-2.12194440e-4f)
#define KVCX_EXP_P0 1.9875691500E-4f
#define KVCX_EXP_P1 1.3981999507E-3f
#define KVCX_EXP_P2 8.3334519073E-3f
#define KVCX_EXP_P3 4.1665795894E-2f
#define KVCX_EXP_P4 1.6666665459E-1f
#define KVCX_EXP_P5 5.0000001201E-1f

/* exp(x) for x <= 0 or -inf (exactly 0 there), Cephes' expf polynomial (relative error ~1e-7), of two vectors
   at once: each is a chain of ~20 dependent steps, and side by side a core with a small scheduler overlaps
   them */
static inline void kvcx_exp8x2(__m256 x0, __m256 x1, __m256 *e0, __m256 *e1) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), lo = _mm256_set1_ps(KVCX_EXP_LO);
    const __m256 log2e = _mm256_set1_ps(KVCX_EXP_LOG2E), half = _mm256_set1_ps(0.5f);
    const __m256 c1 = _mm256_set1_ps(KVCX_EXP_C1), c2 = _mm256_set1_ps(KVCX_EXP_C2);
    const __m256 keep0 = _mm256_cmp_ps(x0, ninf, _CMP_NEQ_OQ), keep1 = _mm256_cmp_ps(x1, ninf, _CMP_NEQ_OQ);
    x0 = _mm256_max_ps(x0, lo);
    x1 = _mm256_max_ps(x1, lo);
    const __m256 f0 = _mm256_floor_ps(_mm256_fmadd_ps(x0, log2e, half));
    const __m256 f1 = _mm256_floor_ps(_mm256_fmadd_ps(x1, log2e, half));
    x0 = _mm256_fnmadd_ps(f0, c1, x0);
    x1 = _mm256_fnmadd_ps(f1, c1, x1);
    x0 = _mm256_fnmadd_ps(f0, c2, x0);
    x1 = _mm256_fnmadd_ps(f1, c2, x1);
    __m256 y0 = _mm256_set1_ps(KVCX_EXP_P0), y1 = y0;
#define KVCX_EXP_STEP(c) do { const __m256 cv = _mm256_set1_ps(c); \
        y0 = _mm256_fmadd_ps(y0, x0, cv); y1 = _mm256_fmadd_ps(y1, x1, cv); } while (0)
    KVCX_EXP_STEP(KVCX_EXP_P1);
    KVCX_EXP_STEP(KVCX_EXP_P2);
    KVCX_EXP_STEP(KVCX_EXP_P3);
    KVCX_EXP_STEP(KVCX_EXP_P4);
    KVCX_EXP_STEP(KVCX_EXP_P5);
#undef KVCX_EXP_STEP
    const __m256 one = _mm256_set1_ps(1.0f);
    y0 = _mm256_fmadd_ps(y0, _mm256_mul_ps(x0, x0), _mm256_add_ps(x0, one));
    y1 = _mm256_fmadd_ps(y1, _mm256_mul_ps(x1, x1), _mm256_add_ps(x1, one));
    const __m256i b = _mm256_set1_epi32(127);
    const __m256i n0 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(f0), b), 23);
    const __m256i n1 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(f1), b), 23);
    *e0 = _mm256_and_ps(_mm256_mul_ps(y0, _mm256_castsi256_ps(n0)), keep0);
    *e1 = _mm256_and_ps(_mm256_mul_ps(y1, _mm256_castsi256_ps(n1)), keep1);
}

/* exp(x) of one vector (the compiler merges the two identical computations) */
static inline __m256 kvcx_exp8(__m256 x) {
    __m256 e, same;
    kvcx_exp8x2(x, x, &e, &same);
    return e;
}

/* 8 code bytes -> the 8 even channels' codes c (low nibbles) and the 8 odd channels' 16 c (high nibbles
   in place), as floats */
#define KVCX_Q4_UNPACK16(ptr, lo, hi) do { \
    __m256i x_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ptr))); \
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(x_, _mm256_set1_epi32(0x0F))); \
    hi = _mm256_cvtepi32_ps(_mm256_and_si256(x_, _mm256_set1_epi32(0xF0))); \
} while (0)
/* the same, centred: c - 8 and 16 (c - 8) */
#define KVCX_Q4_UNPACK16_C(ptr, lo, hi) do { \
    __m256i x_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ptr))); \
    lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(x_, _mm256_set1_epi32(0x0F)), _mm256_set1_epi32(8))); \
    hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(x_, _mm256_set1_epi32(0xF0)), _mm256_set1_epi32(128))); \
} while (0)

#if KVCX_ATTN_AVX512
/* AVX-512, 32 channels (two 16-channel groups k, k + 1 of the permuted order) at a time: 16 code bytes widen to
   16 lanes whose low nibbles are [even channels of k, even of k + 1] and high nibbles the odd ones;
   a 16-float table turns a nibble into its float in one permute (lo: the low 4 bits index it; hi: shifted down).
   Floats kept as [even k, odd k, even k + 1, odd k + 1] (the permuted order) become [even k, even k + 1] and
   [odd k, odd k + 1] with KVCX_Q4_EVEN / KVCX_Q4_ODD as two-source permutes, and back with the same two. */
#define KVCX_Q4_EVEN _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#define KVCX_Q4_ODD _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)
/* the table of f(i) for nibbles i = 0 .. 15: f(i) = m (i + a) */
static inline __m512 kvcx_q4_table(float a, float m) {
    return _mm512_mul_ps(_mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_ps(a)), _mm512_set1_ps(m));
}
/* the 16 code bytes at ptr: lo = table tl at the low nibbles, hi = table th at the high ones */
#define KVCX_Q4_UNPACK32(ptr, tl, th, lo, hi) do { \
    const __m512i x_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ptr))); \
    lo = _mm512_permutexvar_ps(x_, tl); \
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(x_, 4), th); \
} while (0)
/* the 8 lanes of a vector's two halves added */
static inline __m256 kvcx_fold16(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
/* the 16 horizontal sums of v[0..15], in order (a transposing tree: 15 pairs of shuffles and adds) */
static inline __m512 kvcx_hsum16(const __m512 *v) {
    __m512 u[8], w[4];
    for (int i = 0; i < 8; i++)   /* per 128-bit chunk: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] */
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)   /* per chunk: tokens 4 i .. 4 i + 3 over the chunk's lanes */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

/* kvcx_exp8x2's exp(x) (x <= 0 or -inf: exactly 0 there), the same steps on 16 lanes */
static inline __m512 kvcx_exp16(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(KVCX_EXP_LO));
    const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(KVCX_EXP_LOG2E), _mm512_set1_ps(0.5f));
    const __m512 f = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(f, _mm512_set1_ps(KVCX_EXP_C1), x);
    x = _mm512_fnmadd_ps(f, _mm512_set1_ps(KVCX_EXP_C2), x);
    __m512 y = _mm512_set1_ps(KVCX_EXP_P0);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(KVCX_EXP_P1));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(KVCX_EXP_P2));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(KVCX_EXP_P3));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(KVCX_EXP_P4));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(KVCX_EXP_P5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(f), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}
#endif

/* dots[r * ds + j] = qh[r] . codes of token j (permuted order, odd halves read as 16 c) + bias[r],
   RB <= 4 heads, n tokens */
static inline __attribute__((always_inline)) void kvcx_q4_dots_rb(const uint8_t *c, int64_t n, int64_t D,
                                                                  const float *qp, const float *bias, const int RB,
                                                                  float *dots,
                                                                  int64_t ds) {
    __m256 part[4][8];
    float tmp[8];
#if KVCX_ATTN_AVX512
    if (D % 32 == 0) {   /* 32-channel blocks, 16 tokens' sums at a time, one tree per row (a head dim of 16: the
                            8-lane products below) */
        float qq[4 * KVCX_ATTN_MAX_D];   /* the query's 32-channel blocks as [even k, even k + 1, odd k, odd k + 1] */
        for (int r = 0; r < RB; r++)
            for (int64_t i = 0; i < D / 32; i++) {
                const __m512 x0 = _mm512_loadu_ps(qp + r * D + 32 * i);
                const __m512 x1 = _mm512_loadu_ps(qp + r * D + 32 * i + 16);
                _mm512_storeu_ps(qq + r * D + 32 * i, _mm512_permutex2var_ps(x0, KVCX_Q4_EVEN, x1));
                _mm512_storeu_ps(qq + r * D + 32 * i + 16, _mm512_permutex2var_ps(x0, KVCX_Q4_ODD, x1));
            }
        const __m512 tl = kvcx_q4_table(0.0f, 1.0f), th = kvcx_q4_table(0.0f, 16.0f);   /* c, 16 c */
        __m512 sum[4][16];
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t nj = n - j0 < 16 ? n - j0 : 16;
            for (int64_t j = 0; j < 16; j++) {
                __m512 az[4], bz[4];
                for (int r = 0; r < RB; r++) { az[r] = _mm512_setzero_ps(); bz[r] = _mm512_setzero_ps(); }
                if (j < nj)
                    for (int64_t i = 0; i < D / 32; i++) {
                        __m512 lo, hi;
                        KVCX_Q4_UNPACK32(c + (j0 + j) * (D / 2) + 16 * i, tl, th, lo, hi);
                        for (int r = 0; r < RB; r++) {
                            az[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qq + r * D + 32 * i), lo, az[r]);
                            bz[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qq + r * D + 32 * i + 16), hi, bz[r]);
                        }
                    }
                for (int r = 0; r < RB; r++) sum[r][j] = _mm512_add_ps(az[r], bz[r]);
            }
            for (int r = 0; r < RB; r++)
                _mm512_mask_storeu_ps(dots + r * ds + j0, (__mmask16)((1u << nj) - 1),
                                      _mm512_add_ps(kvcx_hsum16(sum[r]), _mm512_set1_ps(bias[r])));
        }
        return;
    }
#endif
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        const int64_t nj = n - j0 < 8 ? n - j0 : 8;
        for (int64_t j = 0; j < 8; j++) {
            __m256 a[4], b[4];
            for (int r = 0; r < RB; r++) { a[r] = _mm256_setzero_ps(); b[r] = _mm256_setzero_ps(); }
            if (j < nj) {
                const uint8_t *cj = c + (j0 + j) * (D / 2);
                for (int64_t k = 0; k < D / 16; k++) {
                    __m256 lo, hi;
                    KVCX_Q4_UNPACK16(cj + 8 * k, lo, hi);
                    for (int r = 0; r < RB; r++) {
                        a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + r * D + 16 * k), lo, a[r]);
                        b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + r * D + 16 * k + 8), hi, b[r]);
                    }
                }
            }
            for (int r = 0; r < RB; r++) part[r][j] = _mm256_add_ps(a[r], b[r]);
        }
        if (nj == 8)   /* (a copy through tmp of a variable count compiles to a slow rep movs) */
            for (int r = 0; r < RB; r++)
                _mm256_storeu_ps(dots + r * ds + j0, _mm256_add_ps(kvcx_hsum8(part[r]), _mm256_set1_ps(bias[r])));
        else
            for (int r = 0; r < RB; r++) {
                _mm256_storeu_ps(tmp, _mm256_add_ps(kvcx_hsum8(part[r]), _mm256_set1_ps(bias[r])));
                for (int64_t j = 0; j < nj; j++) dots[r * ds + j0 + j] = tmp[j];
            }
    }
}

/* acc[r] (permuted order, odd halves 16x) += sum_j w[r * ws + j] * centred codes (c - 8) of token j, RB <= 4
   heads */
static inline __attribute__((always_inline)) void kvcx_q4_axpy_rb(const uint8_t *c, int64_t n, int64_t D,
                                                                  const float *w, int64_t ws, const int RB,
                                                                  float *acc) {
    int64_t k0 = 0;   /* the first 16-channel group the 8-lane accumulations write */
#if KVCX_ATTN_AVX512
    const __m512 tl = kvcx_q4_table(-8.0f, 1.0f), th = kvcx_q4_table(-8.0f, 16.0f);   /* c - 8, 16 (c - 8) */
    for (int64_t i = 0; i < D / 32; i++) {
        __m512 e[4], o[4];   /* the rows' accumulators as [even k, even k + 1] and [odd k, odd k + 1] */
        for (int r = 0; r < RB; r++) {
            const __m512 x0 = _mm512_loadu_ps(acc + r * D + 32 * i), x1 = _mm512_loadu_ps(acc + r * D + 32 * i + 16);
            e[r] = _mm512_permutex2var_ps(x0, KVCX_Q4_EVEN, x1);
            o[r] = _mm512_permutex2var_ps(x0, KVCX_Q4_ODD, x1);
        }
        for (int64_t j = 0; j < n; j++) {
            __m512 lo, hi;
            KVCX_Q4_UNPACK32(c + j * (D / 2) + 16 * i, tl, th, lo, hi);
            for (int r = 0; r < RB; r++) {
                const __m512 wv = _mm512_set1_ps(w[r * ws + j]);
                e[r] = _mm512_fmadd_ps(wv, lo, e[r]);
                o[r] = _mm512_fmadd_ps(wv, hi, o[r]);
            }
        }
        for (int r = 0; r < RB; r++) {
            _mm512_storeu_ps(acc + r * D + 32 * i, _mm512_permutex2var_ps(e[r], KVCX_Q4_EVEN, o[r]));
            _mm512_storeu_ps(acc + r * D + 32 * i + 16, _mm512_permutex2var_ps(e[r], KVCX_Q4_ODD, o[r]));
        }
    }
    k0 = (D / 32) * 2;
#endif
    for (int64_t k = k0; k < D / 16; k++) {
        __m256 a[4], b[4];
        for (int r = 0; r < RB; r++) {
            a[r] = _mm256_loadu_ps(acc + r * D + 16 * k);
            b[r] = _mm256_loadu_ps(acc + r * D + 16 * k + 8);
        }
        for (int64_t j = 0; j < n; j++) {
            __m256 lo, hi;
            KVCX_Q4_UNPACK16_C(c + j * (D / 2) + 8 * k, lo, hi);
            for (int r = 0; r < RB; r++) {
                __m256 wv = _mm256_broadcast_ss(w + r * ws + j);
                a[r] = _mm256_fmadd_ps(wv, lo, a[r]);
                b[r] = _mm256_fmadd_ps(wv, hi, b[r]);
            }
        }
        for (int r = 0; r < RB; r++) {
            _mm256_storeu_ps(acc + r * D + 16 * k, a[r]);
            _mm256_storeu_ps(acc + r * D + 16 * k + 8, b[r]);
        }
    }
}

static inline float kvcx_max_f32(const float *a, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(a);
        for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(a + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm_cvtss_f32(h);
    }
    for (; i < n; i++) m = a[i] > m ? a[i] : m;
    return m;
}

static inline float kvcx_dot_f32(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    s0 = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float s = _mm_cvtss_f32(h);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}
#else
#define KVCX_ATTN_AVX2 0
#define KVCX_ATTN_AVX512 0
static inline float kvcx_max_f32(const float *a, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = a[i] > m ? a[i] : m;
    return m;
}
static inline float kvcx_dot_f32(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
#endif

#endif /* KVCX_ATTN_SIMD_H */
