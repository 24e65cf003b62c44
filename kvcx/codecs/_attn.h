/* Single-query attention straight from kvcx's packed 4-bit codes (the fused decode path).

   One decode step of one layer: every query head of a batch row attends to
     - the packed tokens of its KV head (4-bit codes + FP16 scales / zero points), read once for
       all R query heads that share the KV head (GQA), never dequantized into memory;
     - up to two runs of exact float32 tokens (the sinks and the full-precision residual),
   in one softmax (running max and sum, FP32 throughout).

   Keys' codes are read as stored, c in 0..15: the offsets are summed once per block or tile, not
   subtracted per code (a score is one dot product, nothing averages away). Keys, per group along tokens
   and channel (kvcx's default, KIVI's keys):
       q . k_t = sum_d (q_d s_d) c_td + sum_d q_d z_d                     (asymmetric: k = s c + z)
                 sum_d (q_d s_d) c_td - 8 sum_d q_d s_d                   (symmetric: k = s (c - 8))
   so each block of tokens scales the query once and the tokens cost a dot product over codes.
   Keys grouped per token (one scale per token or per few tokens): s_t (q . c_t) + z_t sum q (asymmetric),
   s_t (q . c_t - 8 sum q) (symmetric).
   Rotated keys (stored H k): q . k = (H q) . (stored), so the query is rotated once.
   Values grouped per token: sum_t p_t v_t accumulates sum_t (p_t s_t) (c_t - 8), centred (the mean of
   many tokens' values is small against their codes' offset: uncentred sums would cancel), plus
   sum_t p_t (z_t + 8 s_t) when asymmetric, once per task; with the Hadamard rotation the
   accumulator stays in the rotated domain and one inverse rotation per output row ends it
   (sum_t p_t H x_t = H sum_t p_t x_t).

   Codes hold element 2i in the low nibble of byte i. The dot products and accumulators run in a
   permuted channel order in which 8 bytes give 16 channels with no shuffle: per 16 channels, the 8
   even ones (low nibbles) then the 8 odd ones (high nibbles). A high nibble is read in place, as 16 c
   (no shift): the query's odd halves are scaled by 1/16 for the dot products, and the accumulators' odd
   halves hold 16x their sums until the task ends (powers of two: exact).

   Work is split into tasks of (batch row x KV head, token range): each writes a partial
   (max, sum, accumulators) into its workspace, and a second pass merges the partials of a row
   (flash-decoding). The caller (kvcx.cache.fused) checks every size and allocates the workspace.

   Several query tokens per row (a multi-token step: chunked prefill, speculative decoding's verification)
   are more rows per KV head: row r is query head r / nq, token r % nq; each row has its own mask row, and
   with no mask given the rows of a multi-token step are causal among the step's tokens (the last nq
   positions). With many rows per KV head (KVCX_ATTN_TILE_ROWS or more) a tile's codes are unpacked once
   into float tiles in the task's scratch (keys transposed), and the rows run register-blocked products
   over them (6 rows x 16 tokens or channels per block; with AVX-512 12 rows x 32, the same sums in the same
   order): the unpacking is shared by every row, and nothing larger than a tile is ever unpacked.

   2- and 3-bit codes (kvcx3, kvcx2) are widened tile by tile (64 tokens) into the 4-bit layout in the task's
   scratch, then read by the same dot products and accumulations. A value code c becomes c' = c + 8 - 2^(bits - 1)
   (centred, as 4-bit codes are): s (c' - 8) is its value when symmetric, s (c' - 8) + z + 2^(bits - 1) s when
   asymmetric. A key code becomes c + 8 - 2^(bits - 1) when symmetric (s (c' - 8)), stays c when asymmetric
   (s c + z). Nothing larger than a tile is ever unpacked. (With AVX-512 VBMI, 128 codes a round: one byte
   permute and one multishift put every pair of codes side by side in a byte.)

   Keys with a width per channel (kvcx.widths, kvcx2w; _widths.h): each group of gs tokens is a block whose
   channel d decodes as base_d + step_d c (c of w_d bits, stored as w_d bit planes), so
       q . k_t = sum_d q_d base_d + sum_{d: w_d > 0} (q_d step_d) c_td
   Per block the query is scaled once and compacted to the channels that have codes (a width-0 channel is
   its base alone: only the bias). Per tile of at most 32 tokens, each such channel's planes are turned into
   a float row of codes (a [channels][tokens] tile in the task's scratch, as the many-rows keys) and the rows
   run the same register-blocked products. Values are read as for the other presets. */
#ifndef KVCX_ATTN_H
#define KVCX_ATTN_H

#include "_kernels.h"
#include "_widths.h"
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
    int64_t nq;                 /* query tokens per row: row r is query head r / nq, token r % nq */
    int k_widths;               /* keys with a width per channel (k_bits unused, k_axis channel: blocks are
                                   the groups of k_group tokens) */
    int64_t k_chunks, k_groups; /* widths: chunks (width tables) and groups per (row, KV head) */
    int64_t mask_bs, mask_qs;   /* mask row of (batch row b, token i): b * mask_bs + i * mask_qs */
    int causal;                 /* token i sees positions up to kv_len - nq + i (exact runs only) */
} kvcx_attn_layout;

typedef struct {
    const float *q;                      /* [B, Hkv * R, D] */
    const uint8_t *kc;                   /* [B * Hkv, k_tokens * D * k_bits / 8]; widths: every plane (kgoff) */
    const uint16_t *ks, *kz;             /* [B * Hkv, k_nscale] (kz: asymmetric only); widths: the groups' range
                                            bytes, 2 per channel (k_nscale = k_groups * D) */
    const int64_t *kblk;                 /* channel axis: block b = key tokens [kblk[b], kblk[b + 1]) */
    const uint8_t *vc;                   /* [B * Hkv, v_tokens * D * v_bits / 8] */
    const uint16_t *vs, *vz;
    const float *sk, *sv;                /* [B * Hkv, ns, D] */
    const float *rk, *rv;                /* [B * Hkv, nr, D] */
    const int64_t *kgoff;                /* widths: [B * Hkv, k_groups] byte offsets in kc of the groups' planes */
    const uint8_t *kw;                   /* widths: [B * Hkv, k_chunks, D] each chunk's channel widths */
    const uint16_t *krange;              /* widths: [B * Hkv, k_chunks, D, 2] each chunk's channel ranges (FP16) */
    const int64_t *kgchunk;              /* widths: [k_groups] the chunk of each group */
    const float *mask;                   /* [mask rows, kv_len] added to the scores, or NULL */
    const uint8_t *maskb;                /* [mask rows, kv_len]: 0 = masked (a boolean mask), or NULL */
    float *work;                         /* [tasks, kvcx_attn_work_floats(R, D, k_widths)] */
    float *out;                          /* [B, Hkv * R, D] */
} kvcx_attn_args;

/* floats of workspace per task: the partial (m and l per head, then accv[R][D] in the permuted order,
   then accp[R][D]), then scratch (T D / 8 floats: a tile's 2- or 3-bit codes widened to nibbles; with
   KVCX_ATTN_TILE_ROWS rows or more, then the float tiles of keys [D][T] and values [T][D]; keys with widths:
   a chunk's channels (3 D int32), the key tile [D][T] when it is not there already, the chunk's compacted
   query terms [R][D] and biases [R], a group's compacted code steps [D], and through float tiles the chunk's
   channel ranges [3][D]) */
static inline int64_t kvcx_attn_part_floats(int64_t R, int64_t D) { return 2 * R + 2 * R * D; }
static inline int64_t kvcx_attn_work_floats(int64_t R, int64_t D, int widths) {
    const int many = R >= KVCX_ATTN_TILE_ROWS;
    return kvcx_attn_part_floats(R, D) + 3 * R * D + 4 * R + 2 * R * KVCX_ATTN_TILE + 2 * KVCX_ATTN_TILE + 2 * D
           + KVCX_ATTN_TILE * D / 8 + (many ? 2 * KVCX_ATTN_TILE * D : 0)
           + (widths ? 3 * D + (many ? 0 : KVCX_ATTN_TILE * D) + R * D + R + 4 * D : 0);
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

/* out = x with the odd half of every 16 (permuted order: the high nibbles' channels) divided by 16; n a
   multiple of 16, out may be x */
static inline void kvcx_attn_halve_odd(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = (i & 8) ? x[i] * 0.0625f : x[i];
}

/* out[d] = float(h[kvcx_attn_perm(d)]) for d < D (D a multiple of 16): FP16 per-channel parameters in the
   permuted channel order */
static inline void kvcx_h2f_perm(const uint16_t *h, int64_t D, float *out) {
    int64_t k = 0;
#if KVCX_ATTN_AVX2 && KVCX_F16C
    for (; k < D; k += 16) {
        __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + k)));
        __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + k + 8)));
        __m256 ev = _mm256_shuffle_ps(s0, s1, 0x88), od = _mm256_shuffle_ps(s0, s1, 0xDD);
        _mm256_storeu_ps(out + k, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xD8)));
        _mm256_storeu_ps(out + k + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xD8)));
    }
#endif
    for (int64_t d = k; d < D; d++) out[d] = kvcx_h2f_1(h[kvcx_attn_perm(d)]);
}

/* n codes (a multiple of 16) of `bits` (2 or 3) bits from p, each plus `add`, in the 4-bit layout at out
   (n / 2 bytes: code 2i in the low nibble of byte i). */
static inline void kvcx_attn_widen(const uint8_t *p, int64_t n, int bits, uint8_t add, uint8_t *out) {
    int64_t i = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    {   /* 128 codes a round: each 16 codes' 2 bits bytes into a 64-bit lane; output byte k of a lane is the 8 bits
           from bit 2 bits k (codes 2k and 2k + 1 side by side, one multishift), the second code moved up to bit 4 */
        const uint64_t rep = 0x0101010101010101ULL * (uint64_t)(2 * bits);   /* 2 bits source bytes per lane */
        const uint64_t pat = bits == 3 ? 0x0000050403020100ULL : 0x0000000003020100ULL;
        const __m512i idx = _mm512_set_epi64((long long)(pat + 7 * rep), (long long)(pat + 6 * rep),
                                             (long long)(pat + 5 * rep), (long long)(pat + 4 * rep),
                                             (long long)(pat + 3 * rep), (long long)(pat + 2 * rep),
                                             (long long)(pat + rep), (long long)pat);
        const __m512i ctl = _mm512_set1_epi64(bits == 3 ? 0x2A241E18120C0600LL : 0x1C1814100C080400LL);
        const __m512i lo = _mm512_set1_epi8((char)((1 << bits) - 1));
        const __m512i hi = _mm512_set1_epi8((char)(((1 << bits) - 1) << 4));
        const __m512i a16 = _mm512_set1_epi8((char)(add * 17));
        const __mmask64 m = (__mmask64)((1ULL << (16 * bits)) - 1);   /* the round's 16 bits bytes */
        for (; i + 128 <= n; i += 128) {
            const __m512i x = _mm512_multishift_epi64_epi8(
                ctl, _mm512_permutexvar_epi8(idx, _mm512_maskz_loadu_epi8(m, p + i * bits / 8)));
            const __m512i r = _mm512_or_si512(_mm512_and_si512(x, lo),
                                              _mm512_and_si512(_mm512_slli_epi16(x, 4 - bits), hi));
            _mm512_storeu_si512(out + i / 2, _mm512_add_epi8(r, a16));
        }
    }
#endif
#if KVCX_ATTN_AVX2
    if (bits == 3) {   /* 64 codes (24 bytes) per round: 3 bytes (8 codes) to each 32-bit lane, where code j moves
                          from bit 3j to bit 4j (nibble j: the 4-bit layout) */
        const int64_t nbytes = 3 * n / 8;
        const __m256i sh = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,
                                            0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
        const __m256i a8 = _mm256_set1_epi8((char)(add * 17));
#define KVCX_NIB3(x, j) _mm256_and_si256(_mm256_slli_epi32(x, j), _mm256_set1_epi32(7 << (4 * (j))))
        for (; i + 64 <= n && 3 * i / 8 + 28 <= nbytes; i += 64) {
            const uint8_t *b = p + 3 * i / 8;
            __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)b)),
                                                _mm_loadu_si128((const __m128i *)(b + 12)), 1);
            x = _mm256_shuffle_epi8(x, sh);
            __m256i r = _mm256_or_si256(_mm256_or_si256(_mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(7)),
                                                                         KVCX_NIB3(x, 1)),
                                                        _mm256_or_si256(KVCX_NIB3(x, 2), KVCX_NIB3(x, 3))),
                                        _mm256_or_si256(_mm256_or_si256(KVCX_NIB3(x, 4), KVCX_NIB3(x, 5)),
                                                        _mm256_or_si256(KVCX_NIB3(x, 6), KVCX_NIB3(x, 7))));
            _mm256_storeu_si256((__m256i *)(out + i / 2), _mm256_add_epi8(r, a8));
        }
#undef KVCX_NIB3
    } else {           /* 64 codes (16 bytes) per round: each byte's 4 codes -> 2 bytes of nibbles */
        const __m128i m3 = _mm_set1_epi8(0x03), m30 = _mm_set1_epi8(0x30), a8 = _mm_set1_epi8((char)(add * 17));
        for (; i + 64 <= n; i += 64) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(p + i / 4));
            const __m128i lo = _mm_or_si128(_mm_and_si128(b, m3), _mm_and_si128(_mm_slli_epi16(b, 2), m30));
            const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), m3),
                                            _mm_and_si128(_mm_srli_epi16(b, 2), m30));
            _mm_storeu_si128((__m128i *)(out + i / 2), _mm_add_epi8(_mm_unpacklo_epi8(lo, hi), a8));
            _mm_storeu_si128((__m128i *)(out + i / 2 + 16), _mm_add_epi8(_mm_unpackhi_epi8(lo, hi), a8));
        }
    }
#endif
    if (bits == 3)
        for (; i < n; i += 8) {
            const uint8_t *b = p + 3 * (i / 8);
            const uint32_t w = b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16);
            for (int j = 0; j < 8; j += 2)
                out[(i + j) / 2] = (uint8_t)((((w >> (3 * j)) & 7) + add) | ((((w >> (3 * j + 3)) & 7) + add) << 4));
        }
    else
        for (; i < n; i += 4) {
            const uint8_t b = p[i / 4];
            out[i / 2] = (uint8_t)(((b & 3) + add) | ((((b >> 2) & 3) + add) << 4));
            out[i / 2 + 1] = (uint8_t)((((b >> 4) & 3) + add) | (((b >> 6) + add) << 4));
        }
}

#if KVCX_ATTN_AVX2 && KVCX_W_AVX2
/* Keys with widths: the 32 codes (bytes) of one channel for tokens o .. o + 31 of a group, from its wid planes
   of gs8 bytes at p (the channel's planes, p already at byte o / 8) */
static inline __m256i kvcx_attn_wcodes32(const uint8_t *p, int wid, int64_t gs8, int64_t o) {
    __m256i c = _mm256_setzero_si256();
    for (int j = 0; j < wid; j++) {
        uint64_t m;
        memcpy(&m, p + j * gs8, 8);
        c = _mm256_or_si256(c, kvcx_w_bits32((uint32_t)(m >> (o & 7)), j));
    }
    return c;
}

/* code bytes i * 8 .. i * 8 + 7 of 32 as floats */
static inline __m256 kvcx_attn_wcodes_f8(__m256i c, int i) {
    const __m128i h = i < 2 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(i & 1 ? _mm_srli_si128(h, 8) : h));
}
#endif

/* Keys with widths: whether R rows take their scores straight from the planes (else through float tiles) */
static inline int kvcx_attn_wreg(int64_t R) {
#if KVCX_ATTN_AVX2 && KVCX_W_AVX2
    return R <= KVCX_ATTN_WROWS;
#else
    (void)R;
    return 0;
#endif
}

/* Keys with widths: tokens o .. o + 31 of a group (gs8 = gs / 8 bytes per plane; the planes of compacted
   channel k at grp + off[k], wid[k] of them) as float rows of codes times their channel's step,
   kT[k * T + j] = step[k] code for k < nz, j < 32 (past
   the group's end whatever its neighbours' bits say: those scores are not read). Reads up to 8 bytes from
   a plane's byte o / 8 on: the store keeps 8 bytes after its last plane. */
static inline void kvcx_attn_wtile(const uint8_t *grp, const int32_t *off, const int32_t *wid, int64_t nz,
                                   int64_t gs8, int64_t o, const float *step, float *kT) {
    const int64_t T = KVCX_ATTN_TILE;
    for (int64_t k = 0; k < nz; k++) {
        const uint8_t *p = grp + off[k] + (o >> 3);
        float *row = kT + k * T;
#if KVCX_ATTN_AVX2 && KVCX_W_AVX2
        const __m256i c = kvcx_attn_wcodes32(p, wid[k], gs8, o);
        const __m256 sv = _mm256_set1_ps(step[k]);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(row + 8 * i, _mm256_mul_ps(kvcx_attn_wcodes_f8(c, i), sv));
#else
        uint32_t c[32] = {0};
        for (int j = 0; j < wid[k]; j++) {
            uint64_t m;
            memcpy(&m, p + j * gs8, 8);
            m >>= (o & 7);
            for (int t = 0; t < 32; t++) c[t] |= (uint32_t)((m >> t) & 1) << j;
        }
        for (int t = 0; t < 32; t++) row[t] = (float)c[t] * step[k];
#endif
    }
}

#if KVCX_ATTN_AVX2 && KVCX_W_AVX2
/* Keys with widths, few rows: the scores of RB <= 3 rows over tokens o .. o + 31 of a group straight from the
   planes (as kvcx_attn_wtile reads them, each channel's codes converted in registers, not stored):
   sc[r * T + j] = qs[r] . codes[:, j] + bias[r] */
static inline __attribute__((always_inline)) void kvcx_attn_wdots_rb(const uint8_t *grp, const int32_t *off,
                                                                     const int32_t *wid, int64_t nz, int64_t gs8,
                                                                     int64_t o, const float *qs, const float *bias,
                                                                     const int RB, float *sc) {
#if KVCX_ATTN_AVX512   /* the 32 tokens in two vectors of 16 (each token's sum in the same order) */
    __m512 az[3][2];
    for (int r = 0; r < RB; r++) az[r][0] = az[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < nz; k++) {
        const __m256i c = kvcx_attn_wcodes32(grp + off[k] + (o >> 3), wid[k], gs8, o);
        const __m512 x0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(c)));
        const __m512 x1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(c, 1)));
        for (int r = 0; r < RB; r++) {
            const __m512 b = _mm512_set1_ps(qs[r * nz + k]);
            az[r][0] = _mm512_fmadd_ps(b, x0, az[r][0]);
            az[r][1] = _mm512_fmadd_ps(b, x1, az[r][1]);
        }
    }
    for (int r = 0; r < RB; r++) {
        const __m512 bv = _mm512_set1_ps(bias[r]);
        _mm512_storeu_ps(sc + r * KVCX_ATTN_TILE, _mm512_add_ps(az[r][0], bv));
        _mm512_storeu_ps(sc + r * KVCX_ATTN_TILE + 16, _mm512_add_ps(az[r][1], bv));
    }
#else
    __m256 acc[3][4];
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < nz; k++) {
        const __m256i c = kvcx_attn_wcodes32(grp + off[k] + (o >> 3), wid[k], gs8, o);
        __m256 b[3];
        for (int r = 0; r < RB; r++) b[r] = _mm256_broadcast_ss(qs + r * nz + k);
        for (int i = 0; i < 4; i++) {
            const __m256 x = kvcx_attn_wcodes_f8(c, i);
            for (int r = 0; r < RB; r++) acc[r][i] = _mm256_fmadd_ps(b[r], x, acc[r][i]);
        }
    }
    for (int r = 0; r < RB; r++) {
        const __m256 bv = _mm256_set1_ps(bias[r]);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(sc + r * KVCX_ATTN_TILE + 8 * i, _mm256_add_ps(acc[r][i], bv));
    }
#endif
}
#endif

/* Keys with widths: the scores of R rows over tokens o .. o + 31 of a group (n <= 32 of them read): from the
   planes for a few rows (kvcx_attn_wreg: qs the group's scaled query, kvcx_attn_wblock), else through a float
   tile of codes times steps (kT: [nz][T]) and the float-tile products (qs the chunk's query over its channels,
   kvcx_attn_wchunk_t; step the group's, kvcx_attn_wblock_t). */
static inline void kvcx_attn_wdots(const uint8_t *grp, const int32_t *off, const int32_t *wid, int64_t nz,
                                   int64_t gs8, int64_t o, int64_t n, const float *qs, const float *bias, int64_t R,
                                   const float *step, float *kT, float *sc) {
#if KVCX_ATTN_AVX2 && KVCX_W_AVX2
    if (kvcx_attn_wreg(R)) {
#define KVCX_WDOTS_BLOCK(r0, k) \
        kvcx_attn_wdots_rb(grp, off, wid, nz, gs8, o, qs + (r0) * nz, bias + (r0), k, sc + (r0) * KVCX_ATTN_TILE)
        KVCX_ROW_BLOCKS(R, 3, KVCX_WDOTS_BLOCK);
#undef KVCX_WDOTS_BLOCK
        return;
    }
#endif
    kvcx_attn_wtile(grp, off, wid, nz, gs8, o, step, kT);
    kvcx_f_dots(kT, n, nz, qs, bias, R, sc);
}

/* Keys with widths: chunk c's channels with codes (index, plane offset inside a group, width) to idx / off /
   wid; returns how many (nz) */
static inline int64_t kvcx_attn_wchannels(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t slab,
                                          int64_t c, int32_t *idx, int32_t *off, int32_t *wid) {
    const int64_t D = L->D, gs8 = L->k_group / 8;
    const uint8_t *w = A->kw + (slab * L->k_chunks + c) * D;
    int64_t nz = 0, o = 0;
    for (int64_t d = 0; d < D; d++)
        if (w[d]) {
            idx[nz] = (int32_t)d;
            off[nz] = (int32_t)o;
            wid[nz] = w[d];
            o += w[d] * gs8;
            nz++;
        }
    return nz;
}

/* Keys with widths, a chunk (its widths and channel ranges) c of the task's slab begins: the channels with
   codes (their index, plane offset inside a group and width) to idx / off / wid; per row r the terms that
   stay for every group of the chunk: qspan[r][d] = q_d span_d (the range bytes' unit), the compacted
   qc[r][k] = q_d span_d / (2^w_d - 1) (d = idx[k], a code step per range byte) and lo_r = q . lo. Returns nz.
   A group's channel d decodes as base_d + code step_d (kvcx_w_decode_tile): with the group's range bytes
   a_d, b_d, base_d = lo_d + e_d span_d (e_d = a_d, or (a_d + b_d) / 2 for a width-0 channel, the middle)
   and step_d = (b_d - a_d) span_d / (2^w_d - 1), so a group costs the bytes' differences and one dot. */
static inline int64_t kvcx_attn_wchunk(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t slab, int64_t c,
                                       const float *qn, float *qspan, float *qc, float *lo_r, int32_t *idx,
                                       int32_t *off, int32_t *wid) {
    const int64_t D = L->D, R = L->R;
    const uint16_t *rg = A->krange + (slab * L->k_chunks + c) * 2 * D;
    const int64_t nz = kvcx_attn_wchannels(L, A, slab, c, idx, off, wid);
    for (int64_t r = 0; r < R; r++) lo_r[r] = 0.0f;
    for (int64_t d = 0; d < D; d++) {
        const float lo = kvcx_h2f_1(rg[2 * d]), span = (kvcx_h2f_1(rg[2 * d + 1]) - lo) / 255.0f;
        for (int64_t r = 0; r < R; r++) {
            lo_r[r] += qn[r * D + d] * lo;
            qspan[r * D + d] = qn[r * D + d] * span;
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < nz; k++)
            qc[r * nz + k] = qspan[r * D + idx[k]] / (float)((1 << wid[k]) - 1);
    return nz;
}

/* Keys with widths: group blk of the task's slab begins (its chunk's terms from kvcx_attn_wchunk). The rows'
   scaled queries over the nz channels with codes go to qs [R][nz], their biases q . base to bias (e and dc:
   D floats of scratch each). */
static inline void kvcx_attn_wblock(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t slab, int64_t blk,
                                    int64_t nz, const float *qspan, const float *qc, const float *lo_r,
                                    const int32_t *idx, float *qs, float *bias, float *e, float *dc) {
    const int64_t D = L->D, R = L->R;
    const uint8_t *w = A->kw + (slab * L->k_chunks + A->kgchunk[blk]) * D;
    const uint8_t *st = (const uint8_t *)(A->ks + (slab * L->k_groups + blk) * D);   /* 2 bytes per channel */
    int64_t d = 0;
#if KVCX_ATTN_AVX2
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (; d + 8 <= D; d += 8) {   /* 8 channels: their range bytes apart, e, and the byte differences */
        const __m128i ab = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(st + 2 * d)), split);
        const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ab));
        const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(ab, 8)));
        const __m256 zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + d))), _mm256_setzero_si256()));
        _mm256_storeu_ps(e + d, _mm256_blendv_ps(a, _mm256_mul_ps(_mm256_add_ps(a, b), _mm256_set1_ps(0.5f)), zero));
        _mm256_storeu_ps(dc + d, _mm256_sub_ps(b, a));
    }
#endif
    for (; d < D; d++) {
        const float a = (float)st[2 * d], b = (float)st[2 * d + 1];
        e[d] = w[d] ? a : (a + b) * 0.5f;
        dc[d] = b - a;
    }
    for (int64_t r = 0; r < R; r++) bias[r] = lo_r[r] + kvcx_dot_f32(qspan + r * D, e, D);
    for (int64_t k = 0; k < nz; k++) e[k] = dc[idx[k]];   /* the differences, compacted (e is free again) */
    for (int64_t r = 0; r < R; r++) {
        const float *qr = qc + r * nz;
        float *o = qs + r * nz;
        int64_t k = 0;
#if KVCX_ATTN_AVX2
        for (; k + 8 <= nz; k += 8) _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_loadu_ps(qr + k),
                                                                           _mm256_loadu_ps(e + k)));
#endif
        for (; k < nz; k++) o[k] = qr[k] * e[k];
    }
}

/* out[r] = sum_d qT[d * R + r] x[d] for r < R: the rows' dot products with x from the query transposed */
static inline void kvcx_attn_gemv_t(const float *qT, int64_t R, int64_t D, const float *x, float *out) {
    int64_t r = 0;
#if KVCX_ATTN_AVX2
    for (; r + 32 <= R; r += 32) {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t d = 0; d < D; d++) {
            const __m256 xv = _mm256_broadcast_ss(x + d);
            for (int i = 0; i < 4; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qT + d * R + r + 8 * i), xv, a[i]);
        }
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + r + 8 * i, a[i]);
    }
    for (; r + 8 <= R; r += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qT + d * R + r), _mm256_broadcast_ss(x + d), a);
        _mm256_storeu_ps(out + r, a);
    }
#endif
    for (; r < R; r++) {
        float a = 0.0f;
        for (int64_t d = 0; d < D; d++) a += qT[d * R + r] * x[d];
        out[r] = a;
    }
}

/* Keys with widths through float tiles (more than KVCX_ATTN_WROWS rows): the tiles hold each channel's codes
   times its step and the bias the query's dot product with the bases, as kvcx_w_decode_tile decodes
   (k_d = base_d + step_d code). Chunk c begins: its channels (kvcx_attn_wchannels), the query over them
   qc[r][k] = qn[r][idx[k]], and each channel's range lo, unit (span / 255) and top code (2^w - 1) to cr. */
static inline int64_t kvcx_attn_wchunk_t(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t slab,
                                         int64_t c, const float *qn, float *qc, float *cr, int32_t *idx,
                                         int32_t *off, int32_t *wid) {
    const int64_t D = L->D, R = L->R;
    const uint8_t *w = A->kw + (slab * L->k_chunks + c) * D;
    const uint16_t *rg = A->krange + (slab * L->k_chunks + c) * 2 * D;
    const int64_t nz = kvcx_attn_wchannels(L, A, slab, c, idx, off, wid);
    for (int64_t d = 0; d < D; d++) {
        cr[d] = kvcx_h2f_1(rg[2 * d]);
        cr[D + d] = (kvcx_h2f_1(rg[2 * d + 1]) - cr[d]) / 255.0f;
        cr[2 * D + d] = (float)((1 << w[d]) - 1);
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < nz; k++) qc[r * nz + k] = qn[r * D + idx[k]];
    return nz;
}

/* ... group blk begins: the biases bias[r] = q_r . base from the query transposed (qT [D][R]) and the
   compacted channels' steps to step (base: D floats of scratch) */
static inline void kvcx_attn_wblock_t(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t slab,
                                      int64_t blk, int64_t nz, const float *cr, const int32_t *idx,
                                      const float *qT, float *bias, float *base, float *step) {
    const int64_t D = L->D;
    const uint8_t *st = (const uint8_t *)(A->ks + (slab * L->k_groups + blk) * D);   /* 2 bytes per channel */
    const float *lo = cr, *unit = cr + D, *top = cr + 2 * D;
    for (int64_t d = 0; d < D; d++) {
        const float glo = lo[d] + (float)st[2 * d] * unit[d], ghi = lo[d] + (float)st[2 * d + 1] * unit[d];
        base[d] = top[d] > 0.0f ? glo : (glo + ghi) / 2.0f;
    }
    for (int64_t k = 0; k < nz; k++) {
        const int64_t d = idx[k];
        const float glo = lo[d] + (float)st[2 * d] * unit[d], ghi = lo[d] + (float)st[2 * d + 1] * unit[d];
        step[k] = (ghi - glo) / top[d];
    }
    kvcx_attn_gemv_t(qT, L->R, D, base, bias);
}

/* One task: (row x KV head) `slab`, token range `split`; writes the partial to the task's workspace. */
static inline void kvcx_attn_task_run(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t task) {
    const int64_t R = L->R, D = L->D, T = KVCX_ATTN_TILE;
    const int64_t slab = task / L->nsplit, split = task % L->nsplit;
    const int64_t b = slab / L->Hkv, h = slab % L->Hkv;
    float *part = A->work + task * kvcx_attn_work_floats(R, D, L->k_widths);
    float *qn = part + kvcx_attn_part_floats(R, D);   /* R x D: q * scaling */
    float *qp = qn + R * D;                            /* R x D: keys' rotation applied, permuted */
    float *qs = qp + R * D;                            /* R x D: what the dot products read: qp (times a
                                                          block's key scales), odd halves / 16 */
    float *W = qs + R * D, *Z = W + R, *bias = Z + R, *sumq = bias + R;
    float *sc = sumq + R;                              /* R x T scores */
    float *p = sc + R * T;                             /* R x T probabilities, then value weights */
    float *vs = p + R * T, *vz = vs + T;               /* T value scales / zero points */
    float *sp = vz + T, *zp = sp + D;                  /* a block's key scales / zeros, permuted */
    uint8_t *wn = (uint8_t *)(zp + D);                 /* 2/3-bit codes: a tile's, widened to nibbles */
    float *kT = R >= KVCX_ATTN_TILE_ROWS ? zp + D + T * D / 8 : NULL;   /* many rows: keys [D][T] */
    float *vf = kT ? kT + T * D : NULL;                                  /* and values [T][D], floats */
    /* keys with widths: a block's channels (index, plane offset, width) and the key tile [channels][T] */
    int32_t *widx = (int32_t *)(zp + D + T * D / 8 + (kT ? 2 * T * D : 0)), *woff = widx + D, *wwid = woff + D;
    float *wT = L->k_widths ? (kT ? kT : (float *)(wwid + D)) : NULL;
    float *wqc = L->k_widths ? (float *)(wwid + D) + (kT ? 0 : T * D) : NULL;   /* R x D: a chunk's query terms */
    float *wlo = wqc ? wqc + R * D : NULL, *wdc = wlo ? wlo + R : NULL;        /* R biases, D differences */
    float *wcr = wdc ? wdc + D : NULL;                 /* tiles: the chunk's ranges (3 D) */
    const int wtiles = L->k_widths && !kvcx_attn_wreg(R);
    const uint8_t *wgrp = NULL;                        /* the block's planes */
    int64_t wnz = 0, wchunk = -1;
    const int64_t kbt = L->k_widths ? 0 : D * L->k_bits / 8, vbt = D * L->v_bits / 8;   /* code bytes per token */
    const uint8_t kadd = (L->k_asym || L->k_widths) ? 0 : (uint8_t)(8 - (1 << (L->k_bits - 1)));
    const uint8_t vadd = (uint8_t)(8 - (1 << (L->v_bits - 1)));   /* values centred either way (see the end) */

    for (int64_t i = 0; i < kvcx_attn_part_floats(R, D); i++) part[i] = 0.0f;
    for (int64_t r = 0; r < R; r++) {
        part[2 * r] = -INFINITY;
        W[r] = Z[r] = 0.0f;
        const float *qr = A->q + ((b * L->Hkv + h) * R + r) * D;
        for (int64_t d = 0; d < D; d++) qn[r * D + d] = qr[d] * L->scaling;
    }
    /* the query in the keys' stored domain, permuted */
    for (int64_t i = 0; i < R * D; i++) qs[i] = qn[i];
    if (L->k_rotate) kvcx_fwht_rows(qs, R, D);
    for (int64_t r = 0; r < R; r++) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            qp[r * D + d] = qs[r * D + kvcx_attn_perm(d)];
            s += qp[r * D + d];
        }
        sumq[r] = s;
    }
    if (L->k_axis != KVCX_AXIS_CHANNEL) {  /* keys per token: the dot products read the query itself */
        kvcx_attn_halve_odd(qp, qs, R * D);
        for (int64_t r = 0; r < R; r++) bias[r] = 0.0f;
    }
    if (wtiles)                                        /* keys with widths through tiles: qs the query transposed */
        for (int64_t r = 0; r < R; r++)
            for (int64_t d = 0; d < D; d++) qs[d * R + r] = qn[r * D + d];

    /* this task's packed tokens: splits share the work, an exact token counting as 4 packed ones */
    const int64_t ne = L->ns + L->nr;
    const int64_t total = L->Tq + 4 * ne;
    int64_t ta = split * total / L->nsplit, tb = (split + 1) * total / L->nsplit;
    ta = ta < L->Tq ? ta : L->Tq;
    tb = tb < L->Tq ? tb : L->Tq;
    const int64_t koff = L->k_tokens - L->Tq, voff = L->v_tokens - L->Tq;   /* store token = t + off */
    const uint8_t *kc = A->kc + (slab * L->k_tokens + koff) * kbt;
    const uint8_t *vc = A->vc + (slab * L->v_tokens + voff) * vbt;
    const uint16_t *ks = A->ks + slab * L->k_nscale, *kz = A->kz ? A->kz + slab * L->k_nscale : NULL;
    const uint16_t *vsc = A->vs + slab * L->v_nscale, *vzc = A->vz ? A->vz + slab * L->v_nscale : NULL;
    int64_t blk = 0, blk_end = 0;
    if (L->k_axis == KVCX_AXIS_CHANNEL && ta < tb) {   /* the block holding ta: blocks are few, bisect */
        int64_t lo = 0, hi = L->k_nscale / D;            /* kblk has k_nscale / D + 1 entries */
        while (hi - lo > 1) {
            int64_t mid = (lo + hi) / 2;
            if (A->kblk[mid] <= ta + koff) lo = mid; else hi = mid;
        }
        blk = lo - 1;                                    /* loaded below */
    }
    for (int64_t t = ta; t < tb;) {
        int64_t end = t + T < tb ? t + T : tb;
        if (L->k_widths) {   /* keys with widths: the tile's scores in two pieces of at most 32 tokens, each
                                inside one group (a piece starts at most 32 tokens in: its scores fit the tile) */
            int64_t u = t;
            for (int piece = 0; piece < 2 && u < tb; piece++) {
                if (u >= blk_end) {                      /* next group (and chunk): its query terms */
                    blk++;
                    blk_end = A->kblk[blk + 1] - koff;
                    if (A->kgchunk[blk] != wchunk && wtiles) {
                        wchunk = A->kgchunk[blk];
                        wnz = kvcx_attn_wchunk_t(L, A, slab, wchunk, qn, wqc, wcr, widx, woff, wwid);
                    } else if (A->kgchunk[blk] != wchunk) {   /* qp holds the chunk's q span (no use for it here) */
                        wchunk = A->kgchunk[blk];
                        wnz = kvcx_attn_wchunk(L, A, slab, wchunk, qn, qp, wqc, wlo, widx, woff, wwid);
                    }
                    if (wtiles) kvcx_attn_wblock_t(L, A, slab, blk, wnz, wcr, widx, qs, bias, zp, wdc);
                    else kvcx_attn_wblock(L, A, slab, blk, wnz, qp, wqc, wlo, widx, qs, bias, zp, wdc);
                    wgrp = A->kc + A->kgoff[slab * L->k_groups + blk];
                }
                int64_t e2 = u + 32 < blk_end ? u + 32 : blk_end;
                e2 = e2 < tb ? e2 : tb;
                kvcx_attn_wdots(wgrp, woff, wwid, wnz, L->k_group / 8, u + koff - A->kblk[blk], e2 - u,
                                wtiles ? wqc : qs, bias, R, wdc, wT, sc + (u - t));
                u = e2;
            }
            end = u;
        } else if (L->k_axis == KVCX_AXIS_CHANNEL) {
            if (t >= blk_end) {                          /* next block: scale the query once */
                blk++;
                blk_end = A->kblk[blk + 1] - koff;
                kvcx_h2f_perm(ks + blk * D, D, sp);
                if (kz) kvcx_h2f_perm(kz + blk * D, D, zp);
                else for (int64_t d = 0; d < D; d++) zp[d] = 0.0f;
                if (kT)                          /* many rows: the tiles hold the keys (kvcx_attn_tile_scale) */
                    for (int64_t d = 0; d < D; d++) {
                        if (!kz) zp[d] = -8.0f * sp[d];
                        if (d & 8) sp[d] *= 0.0625f;   /* odd halves: codes 16 c */
                    }
                else for (int64_t r = 0; r < R; r++) {   /* k = s c + z, or s (c - 8): the bias is q . z or -8 q . s */
                    bias[r] = kz ? kvcx_dot_f32(qp + r * D, zp, D) : -8.0f * kvcx_dot_f32(qp + r * D, sp, D);
                    for (int64_t d = 0; d < D; d++) qs[r * D + d] = qp[r * D + d] * sp[d];
                    kvcx_attn_halve_odd(qs + r * D, qs + r * D, D);
                }
            }
            end = end < blk_end ? end : blk_end;
        }
        const int64_t n = end - t;
#if KVCX_ATTN_AVX2
        {   /* the codes come from memory: fetch this tile's values (read after the scores) and the next
               tile's keys while the scores are computed */
            const int64_t nn = (tb - end < T ? tb - end : T) * kbt;
            for (int64_t o = 0; o < n * vbt; o += 64) _mm_prefetch((const char *)(vc + t * vbt + o), _MM_HINT_T0);
            for (int64_t o = 0; o < nn; o += 64) _mm_prefetch((const char *)(kc + end * kbt + o), _MM_HINT_T0);
        }
#endif
        const uint8_t *kt = kc + t * kbt, *vt = vc + t * vbt;
        if (!L->k_widths) {                      /* (keys with widths: scored above) */
            if (L->k_bits != 4) {
                kvcx_attn_widen(kt, n * D, L->k_bits, kadd, wn);
                kt = wn;
            }
            if (kT && L->k_axis == KVCX_AXIS_CHANNEL) {   /* the keys themselves: the query as it is */
                kvcx_attn_tile_t(kt, NULL, n, D, kT);
                kvcx_attn_tile_scale(kT, n, D, sp, zp);
                kvcx_f_dots(kT, n, D, qp, NULL, R, sc);
            } else if (kT) {
                kvcx_attn_tile_t(kt, NULL, n, D, kT);
                kvcx_f_dots(kT, n, D, qs, bias, R, sc);
            } else
                kvcx_q4_dots(kt, n, D, qs, bias, R, sc, T);
        }
        if (L->k_axis != KVCX_AXIS_CHANNEL) {
            if (L->k_group == D) {               /* one scale per token: convert the tile's at once */
                kvcx_h2f_n(ks + t + koff, vs, n);
                if (kz) kvcx_h2f_n(kz + t + koff, vz, n);
            } else
                for (int64_t j = 0; j < n; j++) {
                    const int64_t g = ((t + j + koff) * D) / L->k_group;
                    vs[j] = kvcx_h2f_1(ks[g]);
                    if (kz) vz[j] = kvcx_h2f_1(kz[g]);
                }
            if (kz)                              /* k = s c + z */
                for (int64_t r = 0; r < R; r++)
                    for (int64_t j = 0; j < n; j++) sc[r * T + j] = vs[j] * sc[r * T + j] + vz[j] * sumq[r];
            else                                 /* k = s (c - 8) */
                for (int64_t r = 0; r < R; r++)
                    for (int64_t j = 0; j < n; j++) sc[r * T + j] = vs[j] * (sc[r * T + j] - 8.0f * sumq[r]);
        }
        if (A->mask || A->maskb)   /* (causal rows see every packed token: the step's own are exact) */
            kvcx_attn_mask(L, A, b, sc, n, L->pos_q + t);
        if (L->v_group == D) {                   /* one scale per token: convert the tile's at once */
            kvcx_h2f_n(vsc + t + voff, vs, n);
            if (vzc) kvcx_h2f_n(vzc + t + voff, vz, n);
        } else
            for (int64_t j = 0; j < n; j++) {
                const int64_t g = ((t + j + voff) * D) / L->v_group;
                vs[j] = kvcx_h2f_1(vsc[g]);
                if (vzc) vz[j] = kvcx_h2f_1(vzc[g]);
            }
        /* the softmax, leaving value weights p s (and v = s (c - 8) + (z + 8 s): the sums of p s and p z) */
        kvcx_attn_softmax_v(part, R, D, sc, n, p, W, Z, vs, vzc ? vz : NULL);
        if (L->v_bits != 4) {
            kvcx_attn_widen(vt, n * D, L->v_bits, vadd, wn);
            vt = wn;
        }
        if (vf) {
            kvcx_attn_tile_v(vt, n, D, vf);
            kvcx_f_axpy(vf, n, D, p, T, R, part + 2 * R);
        } else
            kvcx_q4_axpy(vt, n, D, p, T, R, part + 2 * R);   /* every head from one read */
        t = end;
    }
    if (split == L->nsplit - 1) {
        if (L->ns) kvcx_attn_exact(L, A, slab, A->sk + slab * L->ns * D, A->sv + slab * L->ns * D, L->ns,
                                   L->pos_s, qn, part, sc, p, W, Z, kT);
        if (L->nr) kvcx_attn_exact(L, A, slab, A->rk + slab * L->nr * D, A->rv + slab * L->nr * D, L->nr,
                                   L->pos_r, qn, part, sc, p, W, Z, kT);
    }
    for (int64_t r = 0; r < R; r++) {        /* odd halves back from 16x; asymmetric: the values' sum p (z + 8 s) */
        float *accv = part + 2 * R + r * D;
        kvcx_attn_halve_odd(accv, accv, D);
        if (L->v_asym) {
            const float c = Z[r] + (float)(8 - vadd) * W[r];
            for (int64_t d = 0; d < D; d++) accv[d] += c;
        }
    }
}

/* kvcx_attn_task_run with subnormal floats flushed to zero (x86: MXCSR FTZ and DAZ, restored after): the
   weights of scores far below a row's max (under ~1e-38 of the max's) would be subnormal, and every
   product with them slow on some cores; as zeros they change no sum beyond its rounding. */
static inline void kvcx_attn_task(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t task) {
#if defined(__SSE2__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    kvcx_attn_task_run(L, A, task);
    _mm_setcsr(csr);
#else
    kvcx_attn_task_run(L, A, task);
#endif
}

/* Merge the partials of (row x KV head) `slab`, query head r: out = (H(accv) + accp) / l. */
static inline void kvcx_attn_merge(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t i) {
    const int64_t R = L->R, D = L->D, slab = i / R, r = i % R;
    const int64_t wf = kvcx_attn_work_floats(R, D, L->k_widths);
    float *o = A->out + (slab * R + r) * D;   /* [B, Hkv * R, D]: (b * Hkv + h) * R + r */
    float m = -INFINITY;
    for (int64_t s = 0; s < L->nsplit; s++) {
        const float ms = A->work[(slab * L->nsplit + s) * wf + 2 * r];
        m = ms > m ? ms : m;
    }
    float *acc = A->work + (slab * L->nsplit) * wf + kvcx_attn_part_floats(R, D) + r * 2 * D;  /* its scratch */
    for (int64_t d = 0; d < 2 * D; d++) acc[d] = 0.0f;
    float l = 0.0f;
    if (m != -INFINITY)
        for (int64_t s = 0; s < L->nsplit; s++) {
            const float *pr = A->work + (slab * L->nsplit + s) * wf;
            if (pr[2 * r] == -INFINITY) continue;
            const float e = expf(pr[2 * r] - m);
            const float *accv = pr + 2 * R + r * D, *accp = pr + 2 * R + (R + r) * D;
            l += e * pr[2 * r + 1];
            for (int64_t d = 0; d < D; d++) { acc[d] += e * accv[d]; acc[D + d] += e * accp[d]; }
        }
    for (int64_t d = 0; d < D; d++) o[kvcx_attn_perm(d)] = acc[d];
    if (L->v_rotate) kvcx_fwht_rows(o, 1, D);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < D; d++) o[d] = (o[d] + acc[D + d]) * inv;
}

#endif /* KVCX_ATTN_H */
