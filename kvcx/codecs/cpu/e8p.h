/* kvcx's lattice codec (``kvcx.e8p``, docs/FORMAT.md 2.8): QuIP#'s E8P codebook (Tseng et al., 2024) over the
 * Hadamard-rotated row, 2 bits a value, no calibration. Part of the kernels' module body (e8p.pxi).
 *
 * One row (a token of one head, D values, D a power of two from 8) is one record of D / 4 + 2 bytes:
 *
 *   y = x H / sqrt(D)          the Sylvester Hadamard rotation, orthonormal (kvcx_fwht_rows)
 *   s = fp16(rms(y) / KVCX_E8P_RMS)   the search's scale (0 for a row of zeros)
 *   D / 8 codes of 16 bits, little-endian, each the nearest point of E8P to 8 values of y / s
 *   then fp16(s KVCX_E8P_GAIN) as FP16, little-endian: the scale the row decodes with.
 *
 * The codebook: 2^16 points of the E8 lattice shifted by 1/4 (E8 + 1/4, the points of norm <= 10 around the
 * shift plus 29 of norm 12: QuIP#'s E8P12). A code is k | signs << 8 | shift << 15: the point is
 * kvcx_e8p_grid[k] / 2 with coordinate i negated where sign bit i is set (i < 7; bit 7 is the parity of bits 0-6,
 * so an even number of coordinates is negated), plus 1/4 (shift 0) or -1/4 (shift 1). Decode: the point times s,
 * rotated back by the same Hadamard matrix (its own inverse).
 *
 * Encode finds the exact nearest point: for each shift, each of the 256 patterns with every coordinate's sign
 * matched to y (its best sign), the one coordinate that costs least flipped back where the flips would be odd.
 */
#ifndef KVCX_E8P_H
#define KVCX_E8P_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define KVCX_E8P_RMS 1.03f         /* the codebook's rms per coordinate scaled by: E8P's MSE on N(0, 1) is least there */
/* The decode scale over the search's: the nearest point shrinks a Gaussian row (E<y, p s> = 0.918 E|y|^2 at the
 * scale of least MSE: the reconstruction is a biased estimate of y, 8 % short along it), and that bias does not
 * average out over the tokens an attention row sums, as the points' independent errors do. Times 1.09 the row
 * decodes unbiased along y (E<y, p s g> = E|y|^2 on N(0, 1) rows: g = 1.0895 at D = 64, 1.0933 at D = 128) at 8 %
 * more MSE (0.089 -> 0.097 of the variance). Derived from the Gaussian, not fitted to a model. */
#define KVCX_E8P_GAIN 1.09f
#define KVCX_E8P_PATTERNS 256

/* twice the 256 signed patterns (QuIP#'s abs grid with coordinate 7 negated where the pattern's sum is odd) */
static const int8_t kvcx_e8p_grid[KVCX_E8P_PATTERNS][8] = {
    {1,1,1,1,1,1,1,1}, {1,1,1,1,1,1,1,-3}, {1,1,1,1,1,1,1,5}, {1,1,1,1,1,1,3,-1}, {1,1,1,1,1,1,3,3}, {1,1,1,1,1,1,3,-5},
    {1,1,1,1,1,1,5,1}, {1,1,1,1,1,1,5,-3}, {1,1,1,1,1,3,1,-1}, {1,1,1,1,1,3,1,3}, {1,1,1,1,1,3,1,-5}, {1,1,1,1,1,3,3,1},
    {1,1,1,1,1,3,3,-3}, {1,1,1,1,1,3,5,-1}, {1,1,1,1,1,5,1,1}, {1,1,1,1,1,5,1,-3}, {1,1,1,1,1,5,3,-1}, {1,1,1,1,3,1,1,-1},
    {1,1,1,1,3,1,1,3}, {1,1,1,1,3,1,1,-5}, {1,1,1,1,3,1,3,1}, {1,1,1,1,3,1,3,-3}, {1,1,1,1,3,1,5,-1}, {1,1,1,1,3,3,1,1},
    {1,1,1,1,3,3,1,-3}, {1,1,1,1,3,3,3,-1}, {1,1,1,1,3,3,3,3}, {1,1,1,1,3,5,1,-1}, {1,1,1,1,5,1,1,1}, {1,1,1,1,5,1,1,-3},
    {1,1,1,1,5,1,3,-1}, {1,1,1,1,5,3,1,-1}, {1,1,1,3,1,1,1,-1}, {1,1,1,3,1,1,1,3}, {1,1,1,3,1,1,1,-5}, {1,1,1,3,1,1,3,1},
    {1,1,1,3,1,1,3,-3}, {1,1,1,3,1,1,5,-1}, {1,1,1,3,1,3,1,1}, {1,1,1,3,1,3,1,-3}, {1,1,1,3,1,3,3,-1}, {1,1,1,3,1,3,3,3},
    {1,1,1,3,1,5,1,-1}, {1,1,1,3,3,1,1,1}, {1,1,1,3,3,1,1,-3}, {1,1,1,3,3,1,3,-1}, {1,1,1,3,3,1,3,3}, {1,1,1,3,3,3,1,-1},
    {1,1,1,3,3,3,1,3}, {1,1,1,3,3,3,3,1}, {1,1,1,3,5,1,1,-1}, {1,1,1,5,1,1,1,1}, {1,1,1,5,1,1,1,-3}, {1,1,1,5,1,1,3,-1},
    {1,1,1,5,1,3,1,-1}, {1,1,1,5,3,1,1,-1}, {1,1,3,1,1,1,1,-1}, {1,1,3,1,1,1,1,3}, {1,1,3,1,1,1,1,-5}, {1,1,3,1,1,1,3,1},
    {1,1,3,1,1,1,3,-3}, {1,1,3,1,1,1,5,-1}, {1,1,3,1,1,3,1,1}, {1,1,3,1,1,3,1,-3}, {1,1,3,1,1,3,3,-1}, {1,1,3,1,1,3,3,3},
    {1,1,3,1,1,5,1,-1}, {1,1,3,1,3,1,1,1}, {1,1,3,1,3,1,1,-3}, {1,1,3,1,3,1,3,-1}, {1,1,3,1,3,1,3,3}, {1,1,3,1,3,3,1,-1},
    {1,1,3,1,3,3,1,3}, {1,1,3,1,3,3,3,1}, {1,1,3,1,5,1,1,-1}, {1,1,3,3,1,1,1,1}, {1,1,3,3,1,1,1,-3}, {1,1,3,3,1,1,3,-1},
    {1,1,3,3,1,1,3,3}, {1,1,3,3,1,3,1,-1}, {1,1,3,3,1,3,1,3}, {1,1,3,3,1,3,3,1}, {1,1,3,3,3,1,1,-1}, {1,1,3,3,3,1,1,3},
    {1,1,3,3,3,1,3,1}, {1,1,3,3,3,3,1,1}, {1,1,3,5,1,1,1,-1}, {1,1,5,1,1,1,1,1}, {1,1,5,1,1,1,1,-3}, {1,1,5,1,1,1,3,-1},
    {1,1,5,1,1,3,1,-1}, {1,1,5,1,3,1,1,-1}, {1,1,5,3,1,1,1,-1}, {1,3,1,1,1,1,1,-1}, {1,3,1,1,1,1,1,3}, {1,3,1,1,1,1,1,-5},
    {1,3,1,1,1,1,3,1}, {1,3,1,1,1,1,3,-3}, {1,3,1,1,1,1,5,-1}, {1,3,1,1,1,3,1,1}, {1,3,1,1,1,3,1,-3}, {1,3,1,1,1,3,3,-1},
    {1,3,1,1,1,3,3,3}, {1,3,1,1,1,5,1,-1}, {1,3,1,1,3,1,1,1}, {1,3,1,1,3,1,1,-3}, {1,3,1,1,3,1,3,-1}, {1,3,1,1,3,1,3,3},
    {1,3,1,1,3,3,1,-1}, {1,3,1,1,3,3,1,3}, {1,3,1,1,3,3,3,1}, {1,3,1,1,5,1,1,-1}, {1,3,1,3,1,1,1,1}, {1,3,1,3,1,1,1,-3},
    {1,3,1,3,1,1,3,-1}, {1,3,1,3,1,1,3,3}, {1,3,1,3,1,3,1,-1}, {1,3,1,3,1,3,1,3}, {1,3,1,3,1,3,3,1}, {1,3,1,3,3,1,1,-1},
    {1,3,1,3,3,1,1,3}, {1,3,1,3,3,1,3,1}, {1,3,1,3,3,3,1,1}, {1,3,1,5,1,1,1,-1}, {1,3,3,1,1,1,1,1}, {1,3,3,1,1,1,1,-3},
    {1,3,3,1,1,1,3,-1}, {1,3,3,1,1,1,3,3}, {1,3,3,1,1,3,1,-1}, {1,3,3,1,1,3,1,3}, {1,3,3,1,1,3,3,1}, {1,3,3,1,3,1,1,-1},
    {1,3,3,1,3,1,1,3}, {1,3,3,1,3,1,3,1}, {1,3,3,1,3,3,1,1}, {1,3,3,3,1,1,1,-1}, {1,3,3,3,1,1,1,3}, {1,3,3,3,1,1,3,1},
    {1,3,3,3,1,3,1,1}, {1,3,3,3,3,1,1,1}, {1,3,5,1,1,1,1,-1}, {1,5,1,1,1,1,1,1}, {1,5,1,1,1,1,1,-3}, {1,5,1,1,1,1,3,-1},
    {1,5,1,1,1,3,1,-1}, {1,5,1,1,3,1,1,-1}, {1,5,1,3,1,1,1,-1}, {1,5,3,1,1,1,1,-1}, {3,1,1,1,1,1,1,-1}, {3,1,1,1,1,1,1,3},
    {3,1,1,1,1,1,1,-5}, {3,1,1,1,1,1,3,1}, {3,1,1,1,1,1,3,-3}, {3,1,1,1,1,1,5,-1}, {3,1,1,1,1,3,1,1}, {3,1,1,1,1,3,1,-3},
    {3,1,1,1,1,3,3,-1}, {3,1,1,1,1,3,3,3}, {3,1,1,1,1,5,1,-1}, {3,1,1,1,3,1,1,1}, {3,1,1,1,3,1,1,-3}, {3,1,1,1,3,1,3,-1},
    {3,1,1,1,3,1,3,3}, {3,1,1,1,3,3,1,-1}, {3,1,1,1,3,3,1,3}, {3,1,1,1,3,3,3,1}, {3,1,1,1,5,1,1,-1}, {3,1,1,3,1,1,1,1},
    {3,1,1,3,1,1,1,-3}, {3,1,1,3,1,1,3,-1}, {3,1,1,3,1,1,3,3}, {3,1,1,3,1,3,1,-1}, {3,1,1,3,1,3,1,3}, {3,1,1,3,1,3,3,1},
    {3,1,1,3,3,1,1,-1}, {3,1,1,3,3,1,1,3}, {3,1,1,3,3,1,3,1}, {3,1,1,3,3,3,1,1}, {3,1,1,5,1,1,1,-1}, {3,1,3,1,1,1,1,1},
    {3,1,3,1,1,1,1,-3}, {3,1,3,1,1,1,3,-1}, {3,1,3,1,1,1,3,3}, {3,1,3,1,1,3,1,-1}, {3,1,3,1,1,3,1,3}, {3,1,3,1,1,3,3,1},
    {3,1,3,1,3,1,1,-1}, {3,1,3,1,3,1,1,3}, {3,1,3,1,3,1,3,1}, {3,1,3,1,3,3,1,1}, {3,1,3,3,1,1,1,-1}, {3,1,3,3,1,1,1,3},
    {3,1,3,3,1,1,3,1}, {3,1,3,3,1,3,1,1}, {3,1,3,3,3,1,1,1}, {3,1,5,1,1,1,1,-1}, {3,3,1,1,1,1,1,1}, {3,3,1,1,1,1,1,-3},
    {3,3,1,1,1,1,3,-1}, {3,3,1,1,1,1,3,3}, {3,3,1,1,1,3,1,-1}, {3,3,1,1,1,3,1,3}, {3,3,1,1,1,3,3,1}, {3,3,1,1,3,1,1,-1},
    {3,3,1,1,3,1,1,3}, {3,3,1,1,3,1,3,1}, {3,3,1,1,3,3,1,1}, {3,3,1,3,1,1,1,-1}, {3,3,1,3,1,1,1,3}, {3,3,1,3,1,1,3,1},
    {3,3,1,3,1,3,1,1}, {3,3,1,3,3,1,1,1}, {3,3,3,1,1,1,1,-1}, {3,3,3,1,1,1,1,3}, {3,3,3,1,1,1,3,1}, {3,3,3,1,1,3,1,1},
    {3,3,3,1,3,1,1,1}, {3,3,3,3,1,1,1,1}, {3,5,1,1,1,1,1,-1}, {5,1,1,1,1,1,1,1}, {5,1,1,1,1,1,1,-3}, {5,1,1,1,1,1,3,-1},
    {5,1,1,1,1,3,1,-1}, {5,1,1,1,3,1,1,-1}, {5,1,1,3,1,1,1,-1}, {5,1,3,1,1,1,1,-1}, {5,3,1,1,1,1,1,-1}, {3,1,1,1,3,3,3,-3},
    {1,3,1,1,3,3,3,-3}, {1,1,3,1,3,3,3,-3}, {1,1,1,3,3,3,3,-3}, {3,3,3,1,3,3,1,-1}, {3,3,3,1,3,1,3,-1}, {3,3,3,1,1,3,3,-1},
    {3,3,3,1,3,1,1,-3}, {3,3,3,1,1,3,1,-3}, {3,3,3,1,1,1,3,-3}, {3,3,1,3,3,3,1,-1}, {3,3,1,3,3,1,3,-1}, {3,3,1,3,1,3,3,-1},
    {3,3,1,3,3,1,1,-3}, {3,3,1,3,1,3,1,-3}, {3,3,1,3,1,1,3,-3}, {3,1,3,3,3,3,1,-1}, {3,1,3,3,3,1,3,-1}, {3,1,3,3,1,3,3,-1},
    {3,1,3,3,3,1,1,-3}, {3,1,3,3,1,3,1,-3}, {1,3,3,3,1,1,3,-3}, {1,3,3,3,3,3,1,-1}, {1,3,3,3,3,1,3,-1}, {1,3,3,3,1,3,3,-1},
    {1,3,3,3,3,1,1,-3}, {1,3,3,3,1,3,1,-3}, {1,1,3,3,1,3,3,-3}, {3,3,1,1,3,3,3,-1},};

/* the tables the search reads, filled once (kvcx_e8p_init): |pattern| by coordinate then pattern (so the inner loop
   runs over patterns and vectorises), each pattern's norm, and the parity of its negative coordinates */
static float kvcx_e8p_abs[8][KVCX_E8P_PATTERNS];
static float kvcx_e8p_norm2[KVCX_E8P_PATTERNS];
static int32_t kvcx_e8p_negpar[KVCX_E8P_PATTERNS];

/* the fused attention's value tiles (attn.h) read a code's point in the order its accumulators keep channels
   (kvcx_attn_perm: of every 16 channels the 8 even ones, then the 8 odd ones at 16x): a code's 4 even coordinates,
   then its 4 odd ones times 16. Each pattern halved in that order; for each of the 256 values of a code's high
   byte (7 sign bits and the shift bit), the sign mask (the float sign bit; the parity coordinate included) then
   the shift, both in that order: a code's point is (pattern ^ mask) + shift, two table rows found by its bytes. */
static float kvcx_e8p_tile_pat[KVCX_E8P_PATTERNS][8];
static union { uint32_t u[16]; float f[16]; } kvcx_e8p_tile_hi[256];

static inline int kvcx_e8p_tile_coord(int o) { return o < 4 ? 2 * o : 2 * (o - 4) + 1; }

static inline void kvcx_e8p_init(void) {
    for (int o = 0; o < 8; o++) {
        const int i = kvcx_e8p_tile_coord(o);
        const float f = o < 4 ? 1.0f : 16.0f;
        for (int k = 0; k < KVCX_E8P_PATTERNS; k++) kvcx_e8p_tile_pat[k][o] = 0.5f * f * (float)kvcx_e8p_grid[k][i];
        for (int hi = 0; hi < 256; hi++) {
            const int sg = hi & 0x7F, flips = sg | ((__builtin_popcount((unsigned)sg) & 1) << 7);
            kvcx_e8p_tile_hi[hi].u[o] = ((flips >> i) & 1) ? 0x80000000u : 0u;
            kvcx_e8p_tile_hi[hi].f[8 + o] = (hi >> 7) ? -0.25f * f : 0.25f * f;
        }
    }
    for (int k = 0; k < KVCX_E8P_PATTERNS; k++) {
        float n2 = 0.0f;
        int neg = 0;
        for (int i = 0; i < 8; i++) {
            const float a = 0.5f * (float)kvcx_e8p_grid[k][i];
            kvcx_e8p_abs[i][k] = fabsf(a);
            n2 += a * a;
            neg ^= a < 0.0f;
        }
        kvcx_e8p_norm2[k] = n2;
        kvcx_e8p_negpar[k] = neg;
    }
}

/* The code of the point of E8P nearest to y[0:8]. */
static inline uint16_t kvcx_e8p_nearest(const float *y) {
    float best = -INFINITY;
    uint16_t code = 0;
    for (int shift = 0; shift < 2; shift++) {
        const float t = shift ? -0.25f : 0.25f;
        float z[8], za[8], zz = 0.0f;
        int zneg = 0;
        for (int i = 0; i < 8; i++) {
            z[i] = y[i] - t;
            za[i] = fabsf(z[i]);
            zz += z[i] * z[i];
            zneg ^= z[i] < 0.0f;
        }
        float dot[KVCX_E8P_PATTERNS], lo[KVCX_E8P_PATTERNS];
        for (int k = 0; k < KVCX_E8P_PATTERNS; k++) { dot[k] = 0.0f; lo[k] = INFINITY; }
        for (int i = 0; i < 8; i++) {
            const float zi = za[i];
            const float *a = kvcx_e8p_abs[i];
            for (int k = 0; k < KVCX_E8P_PATTERNS; k++) {
                const float p = zi * a[k];
                dot[k] += p;
                lo[k] = p < lo[k] ? p : lo[k];
            }
        }
        int kb = 0;
        float sb = -INFINITY;
        for (int k = 0; k < KVCX_E8P_PATTERNS; k++) {
            /* -|z - point|^2 + |z|^2: 2 <|z|, |a|> - |a|^2, less 4 |z_j a_j| where a sign must go back */
            const float s = 2.0f * dot[k] - kvcx_e8p_norm2[k] - ((zneg ^ kvcx_e8p_negpar[k]) ? 4.0f * lo[k] : 0.0f);
            if (s > sb) { sb = s; kb = k; }
        }
        if (sb - zz > best) {
            best = sb - zz;
            int flips = 0, odd = zneg ^ kvcx_e8p_negpar[kb], jmin = 0;
            float pmin = INFINITY;
            for (int i = 0; i < 8; i++) {
                const float a = 0.5f * (float)kvcx_e8p_grid[kb][i];
                if (z[i] * a < 0.0f) flips |= 1 << i;
                const float p = za[i] * fabsf(a);
                if (p < pmin) { pmin = p; jmin = i; }
            }
            if (odd) flips ^= 1 << jmin;
            code = (uint16_t)(kb | ((flips & 0x7F) << 8) | (shift << 15));
        }
    }
    return code;
}

/* The point of a code (unscaled) into out[0:8]. */
static inline void kvcx_e8p_point(uint16_t code, float *out) {
    const int k = code & 0xFF;
    int flips = (code >> 8) & 0x7F;
    flips |= (__builtin_popcount((unsigned)flips) & 1) << 7;
    const float t = (code >> 15) ? -0.25f : 0.25f;
    for (int i = 0; i < 8; i++)
        out[i] = ((flips >> i) & 1 ? -0.5f : 0.5f) * (float)kvcx_e8p_grid[k][i] + t;
}

static inline int64_t kvcx_e8p_record_bytes(int64_t D) { return D / 4 + 2; }

/* Encode one row x[0:D] (float32, finite; overwritten by its rotation) into rec. Returns a kvcx_status. */
static inline int kvcx_e8p_encode_row(float *x, int64_t D, uint8_t *rec) {
    kvcx_fwht_rows(x, 1, D);
    double ss = 0.0;
    for (int64_t i = 0; i < D; i++) ss += (double)x[i] * x[i];
    const float s = (float)(sqrt(ss / (double)D) / KVCX_E8P_RMS);
    if (!(s * KVCX_E8P_GAIN <= 65504.0f)) return KVCX_ST_SCALE_OVERFLOW;
    const float sq = kvcx_h2f(kvcx_f2h(s));
    const uint16_t sh = kvcx_f2h(sq * KVCX_E8P_GAIN);
    const float inv = sq > 0.0f ? 1.0f / sq : 0.0f;
    float y[8];
    for (int64_t b = 0; b < D / 8; b++) {
        for (int i = 0; i < 8; i++) y[i] = x[8 * b + i] * inv;
        const uint16_t c = kvcx_e8p_nearest(y);
        rec[2 * b] = (uint8_t)(c & 0xFF);
        rec[2 * b + 1] = (uint8_t)(c >> 8);
    }
    rec[D / 4] = (uint8_t)(sh & 0xFF);
    rec[D / 4 + 1] = (uint8_t)(sh >> 8);
    return KVCX_OK;
}

/* Decode one record into out[0:D] (float32). Returns a kvcx_status (a scale the encoder never writes: corrupt). */
static inline int kvcx_e8p_decode_row(const uint8_t *rec, int64_t D, float *out) {
    const uint16_t sh = (uint16_t)(rec[D / 4] | (rec[D / 4 + 1] << 8));
    const float s = kvcx_h2f(sh);
    if (!(s >= 0.0f) || isinf(s)) return KVCX_ST_CORRUPT;
    for (int64_t b = 0; b < D / 8; b++) {
        kvcx_e8p_point((uint16_t)(rec[2 * b] | (rec[2 * b + 1] << 8)), out + 8 * b);
        for (int i = 0; i < 8; i++) out[8 * b + i] *= s;
    }
    kvcx_fwht_rows(out, 1, D);
    return KVCX_OK;
}

#endif /* KVCX_E8P_H */
