/* The fused attention over 2- and 3-bit codes (widened tile by tile) and over keys with a width per channel
   (kvcx2w: bit planes turned into float tiles). Part of attn.h; needs attn_blocks.h first. */
#ifndef KVCX_ATTN_WIDTHS_H
#define KVCX_ATTN_WIDTHS_H

#include "attn_blocks.h"

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

#endif /* KVCX_ATTN_WIDTHS_H */
