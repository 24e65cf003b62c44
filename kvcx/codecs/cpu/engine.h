/* Engine KV formats, emulated exactly: llama.cpp's KV block types and vLLM's fp8 KV cache.
 *
 * llama.cpp (ggml-quants.c, quantize_row_*_ref / dequantize_row_*): blocks of KVCX_QK = 32 consecutive
 * values along the head dimension, an FP16 scale d (and an FP16 minimum m for the _1 types) per block:
 *   q8_0   d = amax / 127,  q = roundf(x / d)                          int8 codes        (34 bytes / block)
 *   q4_0   d = max / -8 (max: the value of largest |x|), q = min(15, (int)(x / d + 8.5))   (18 bytes)
 *   q4_1   d = (max - min) / 15, m = min, q = min(15, (int)((x - min) / d + 0.5))          (20 bytes)
 *   q5_0   as q4_0 with -16 / 16.5 / 31, the fifth bits in a u32 qh                        (22 bytes)
 *   q5_1   as q4_1 with 31, the fifth bits in a u32 qh                                     (24 bytes)
 *   iq4_nl a 16-entry non-linear codebook (kvalues_iq4nl) times d: codes nearest x / d at d = max / -127,
 *          then d refitted by least squares (weights x^2), as quantize_row_iq4_nl_ref      (18 bytes)
 * where "/ d" is "* id" with id = 1.0f / d (0 when d is 0), in float32, as the reference does. Codes are
 * stored as ggml's block bodies (qh then qs for the 5-bit types; qs[j] holds elements j and j + 16), so a
 * block is the FP16 d, [the FP16 m], then these bytes. Compiled as ISO C (-std=c11), so no a*b+c is fused
 * into an FMA: every product is rounded as the reference's is.
 *
 * vLLM's fp8 KV cache: x / scale (float32), saturated to the format's largest finite value, rounded to
 * nearest even into e4m3fn (bias 7, max 448, no infinities) or e5m2 (bias 15, max 57344); decode is
 * fp8 * scale.
 *
 * FP4 (E2M1: values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, a nibble each):
 *   mxfp4  ggml's block_mxfp4 (the OCP MX format, llama.cpp's type since GPT-OSS; quantize_row_mxfp4_ref):
 *          32 values, an E8M0 exponent e = floor(log2(amax)) - 2 + 127, codes the nearest of
 *          kvalues_mxfp4 * 2^(e - 128) (the first on ties, as best_index_mxfp4); the block is e then
 *          16 bytes, qs[j] holding values j and j + 16                                   (17 bytes / block)
 *   nvfp4  TensorRT-LLM's NVFP4 KV cache, as torchao's reference (nvfp4_quantize with a per-tensor scale
 *          p): 16 values, an E4M3 scale s = e4m3(clamp(amax / 6 / p, 2^-6, 448)), codes
 *          e2m1(x * ((1 / p) / s)) rounded to nearest even, saturated, the sign kept; two codes a byte
 *          (element 2i in the low nibble); decode e2m1 * (p * s)                 (8 + 1 bytes / 16 values)
 */
#ifndef KVCX_ENGINE_H
#define KVCX_ENGINE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define KVCX_QK 32

/* llama.cpp block types (the values kvcx.codecs.engine maps names to) */
enum kvcx_ggml_type { KVCX_GGML_Q8_0 = 0, KVCX_GGML_Q4_0 = 1, KVCX_GGML_Q4_1 = 2, KVCX_GGML_Q5_0 = 3,
                      KVCX_GGML_Q5_1 = 4, KVCX_GGML_IQ4_NL = 5 };

/* iq4_nl's codebook (ggml-common.h kvalues_iq4nl) */
static const int8_t kvcx_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* fp8 formats */
enum kvcx_fp8_format { KVCX_FP8_E4M3 = 0, KVCX_FP8_E5M2 = 1 };

/* bytes of codes per block (the block without its FP16 d and m) */
static inline int64_t kvcx_ggml_qbytes(int type) {
    switch (type) {
        case KVCX_GGML_Q8_0: return 32;
        case KVCX_GGML_Q4_0: case KVCX_GGML_Q4_1: case KVCX_GGML_IQ4_NL: return 16;
        default: return 20;
    }
}

/* (int)v for v in [0, 128), as the reference's (int8_t) cast; 0 outside, as that cast gives on x86 (and NumPy's
 * in gguf): only a block whose scale underflows (id infinite, x * id inf or NaN) gets there, and its FP16 d of 0
 * decodes to 0 whatever its codes */
static inline int kvcx_trunc_q(float v) { return v >= 0.0f && v < 128.0f ? (int)v : 0; }

static inline int kvcx_ggml_has_min(int type) { return type == KVCX_GGML_Q4_1 || type == KVCX_GGML_Q5_1; }

/* The 4- and 5-bit block body: q = min(top, (int)((x - sub) * id + off)) for the 32 values, qs[j] holding values
 * j and j + 16, the fifth bits (5-bit types) in a little-endian u32 qh before qs. sub = 0 for the _0 types
 * (x - 0.0f is x, exactly), the block minimum for the _1 types. */
static inline void kvcx_ggml_pack_block(const float *x, float sub, float id, float off, int five, uint8_t *q) {
    const int top = five ? 31 : 15;
    uint32_t qh = 0;
    uint8_t *qs = five ? q + 4 : q;
    for (int j = 0; j < KVCX_QK / 2; j++) {
        const float x0 = (x[j] - sub) * id, x1 = (x[KVCX_QK / 2 + j] - sub) * id;
        int a = kvcx_trunc_q(x0 + off), b = kvcx_trunc_q(x1 + off);
        a = a < top ? a : top;
        b = b < top ? b : top;
        qs[j] = (uint8_t)((a & 0x0F) | ((b & 0x0F) << 4));
        qh |= ((uint32_t)(a & 0x10) >> 4) << j;
        qh |= ((uint32_t)(b & 0x10) >> 4) << (j + KVCX_QK / 2);
    }
    if (five) memcpy(q, &qh, 4);
}

/* ggml-quants.c best_index_int8: the codebook entry nearest x (ties to the upper one only when strictly nearer) */
static inline int kvcx_iq4nl_index(float x) {
    const int8_t *val = kvcx_iq4nl_values;
    if (x <= val[0]) return 0;
    if (x >= val[15]) return 15;
    int ml = 0, mu = 15;
    while (mu - ml > 1) {
        const int mav = (ml + mu) / 2;
        if (x < val[mav]) mu = mav; else ml = mav;
    }
    return x - val[mu - 1] < val[mu] - x ? mu - 1 : mu;
}

/* llama.cpp's KV write of iq4_nl: quantize_row_iq4_nl_ref, i.e. quantize_row_iq4_nl_impl for one block of 32
 * with no importance weights and ntry = -1 (what the CPU backend's from_float and CUDA's set_rows run):
 * codes nearest x / d at d = max / -127 (max: the value of largest |x|), then the least-squares d for those
 * codes with weights x^2; no trial scales (ntry = 7, llama-quantize's weight path, is not used for caches).
 * Float operations in its order. A block with amax < 1e-15 gets d = 0; llama.cpp leaves its codes
 * uninitialised (they decode to zeros whatever they are): kvcx writes code 8 (the entry nearest 0). */
static inline void kvcx_iq4nl_quant_block(const float *x, uint16_t *d_out, uint8_t *q) {
    const int8_t *values = kvcx_iq4nl_values;
    uint8_t L[KVCX_QK];
    float amax = 0.0f, max = 0.0f, d = 0.0f;
    for (int j = 0; j < KVCX_QK; j++) {
        const float ax = fabsf(x[j]);
        if (ax > amax) { amax = ax; max = x[j]; }
    }
    if (amax < 1e-15f) {   /* GROUP_MAX_EPS */
        memset(L, 8, sizeof L);
    } else {
        d = max / values[0];
        const float id = 1 / d;
        float sumqx = 0, sumq2 = 0;
        for (int j = 0; j < KVCX_QK; j++) {
            const int l = kvcx_iq4nl_index(id * x[j]);
            L[j] = (uint8_t)l;
            const float qv = values[l];
            const float w = x[j] * x[j];
            sumqx += w * qv * x[j];
            sumq2 += w * qv * qv;
        }
        d = sumqx / sumq2;
    }
    *d_out = kvcx_f2h_1(d);
    for (int j = 0; j < KVCX_QK / 2; j++) q[j] = (uint8_t)(L[j] | (L[KVCX_QK / 2 + j] << 4));
}

/* Quantize one block of 32 finite floats. Returns KVCX_ST_SCALE_OVERFLOW when d or m is not finite in FP16. */
static inline int kvcx_ggml_quant_block(int type, const float *x, uint16_t *d_out, uint16_t *m_out, uint8_t *q) {
    float d, id;
    if (type == KVCX_GGML_IQ4_NL) {
        kvcx_iq4nl_quant_block(x, d_out, q);
    } else if (type == KVCX_GGML_Q8_0) {
        float amax = 0.0f;
        for (int j = 0; j < KVCX_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        d = amax / 127.0f;
        id = d != 0.0f ? 1.0f / d : 0.0f;
        *d_out = kvcx_f2h_1(d);
        for (int j = 0; j < KVCX_QK; j++) {
            const float r = roundf(x[j] * id);
            q[j] = (uint8_t)(int8_t)(r >= -127.0f && r <= 127.0f ? (int)r : 0);
        }
    } else if (type == KVCX_GGML_Q4_0 || type == KVCX_GGML_Q5_0) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < KVCX_QK; j++) {
            const float v = x[j];
            if (amax < fabsf(v)) { amax = fabsf(v); max = v; }
        }
        const int five = type == KVCX_GGML_Q5_0;
        d = max / (five ? -16.0f : -8.0f);
        id = d != 0.0f ? 1.0f / d : 0.0f;
        *d_out = kvcx_f2h_1(d);
        kvcx_ggml_pack_block(x, 0.0f, id, five ? 16.5f : 8.5f, five, q);
    } else {
        float min = x[0], max = x[0];
        for (int j = 1; j < KVCX_QK; j++) {
            min = x[j] < min ? x[j] : min;
            max = x[j] > max ? x[j] : max;
        }
        const int five = type == KVCX_GGML_Q5_1;
        d = (max - min) / (five ? 31.0f : 15.0f);
        id = d != 0.0f ? 1.0f / d : 0.0f;
        *d_out = kvcx_f2h_1(d);
        *m_out = kvcx_f2h_1(min);
        kvcx_ggml_pack_block(x, min, id, 0.5f, five, q);
        if (!isfinite(kvcx_h2f_1(*m_out))) return KVCX_ST_SCALE_OVERFLOW;
    }
    return isfinite(kvcx_h2f_1(*d_out)) ? KVCX_OK : KVCX_ST_SCALE_OVERFLOW;
}

/* Dequantize one block into 32 floats (ggml's dequantize_row_*: d * q, d * q + m). */
static inline void kvcx_ggml_dequant_block(int type, uint16_t hd, uint16_t hm, const uint8_t *q, float *y) {
    const float d = kvcx_h2f_1(hd);
    if (type == KVCX_GGML_Q8_0) {
        for (int j = 0; j < KVCX_QK; j++) y[j] = (float)(int8_t)q[j] * d;
        return;
    }
    if (type == KVCX_GGML_IQ4_NL) {   /* dequantize_row_iq4_nl: d * kvalues_iq4nl[code] */
        for (int j = 0; j < KVCX_QK / 2; j++) {
            y[j] = d * kvcx_iq4nl_values[q[j] & 0x0F];
            y[j + KVCX_QK / 2] = d * kvcx_iq4nl_values[q[j] >> 4];
        }
        return;
    }
    const int five = type == KVCX_GGML_Q5_0 || type == KVCX_GGML_Q5_1;
    const int has_min = kvcx_ggml_has_min(type);
    const float m = has_min ? kvcx_h2f_1(hm) : 0.0f;
    const int off = has_min ? 0 : (five ? 16 : 8);
    uint32_t qh = 0;
    if (five) memcpy(&qh, q, 4);
    const uint8_t *qs = five ? q + 4 : q;
    for (int j = 0; j < KVCX_QK / 2; j++) {
        int a = qs[j] & 0x0F, b = qs[j] >> 4;
        if (five) {
            a |= (int)((qh >> j) & 1) << 4;
            b |= (int)((qh >> (j + KVCX_QK / 2)) & 1) << 4;
        }
        if (has_min) {
            y[j] = (float)a * d + m;
            y[j + KVCX_QK / 2] = (float)b * d + m;
        } else {
            y[j] = (float)(a - off) * d;
            y[j + KVCX_QK / 2] = (float)(b - off) * d;
        }
    }
}

/* float32 -> fp8 (RNE, saturated to the largest finite value); x finite. */
static inline uint8_t kvcx_f2fp8(float x, int format) {
    const int m = format == KVCX_FP8_E4M3 ? 3 : 2;
    const int bias = format == KVCX_FP8_E4M3 ? 7 : 15;
    const float maxv = format == KVCX_FP8_E4M3 ? 448.0f : 57344.0f;
    uint32_t bits;
    memcpy(&bits, &x, 4);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    float a = fabsf(x);
    a = a < maxv ? a : maxv;
    const float min_normal = ldexpf(1.0f, 1 - bias);
    uint32_t code;
    if (a < min_normal) {   /* subnormal (or zero): multiples of 2^(1 - bias - m), exact scaling then RNE */
        code = (uint32_t)rintf(ldexpf(a, bias - 1 + m));
    } else {
        memcpy(&bits, &a, 4);
        const int shift = 23 - m;
        bits += ((1u << (shift - 1)) - 1) + ((bits >> shift) & 1);   /* round to nearest, ties to even */
        code = (bits >> shift) - ((uint32_t)(127 - bias) << m);
    }
    return (uint8_t)(sign | code);
}

/* fp8 -> float32 (exact). */
static inline float kvcx_fp82f(uint8_t c, int format) {
    const int m = format == KVCX_FP8_E4M3 ? 3 : 2;
    const int bias = format == KVCX_FP8_E4M3 ? 7 : 15;
    const int e = (c & 0x7F) >> m, f = c & ((1 << m) - 1);
    float v = e ? ldexpf(1.0f + (float)f / (float)(1 << m), e - bias) : ldexpf((float)f, 1 - bias - m);
    return (c & 0x80) ? -v : v;
}

/* FP4 formats (the values kvcx.codecs.engine maps names to) and their group sizes */
enum kvcx_fp4_format { KVCX_FP4_MX = 0, KVCX_FP4_NV = 1 };
#define KVCX_MX_QK 32
#define KVCX_NV_QK 16
/* an NVFP4 group scale at or above this rounds past E4M3's largest finite value (448) */
#define KVCX_NV_SCALE_LIMIT 464.0f

/* ggml-common.h kvalues_mxfp4: E2M1 values doubled */
static const int8_t kvcx_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ggml_e8m0_to_fp32_half: 2^(e - 128), the half that goes with the doubled values */
static inline float kvcx_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int kvcx_mxfp4_index(float x, float d) {
    int best = 0;
    float best_err = fabsf((float)kvcx_mxfp4_values[0] * d - x);
    for (int i = 1; i < 16; i++) {
        const float err = fabsf((float)kvcx_mxfp4_values[i] * d - x);
        if (err < best_err) {
            best = i;
            best_err = err;
        }
    }
    return best;
}

/* One MXFP4 block: 32 finite values -> e, then 16 bytes of codes. An amax below 2^-125 (its exponent under
 * E8M0's range: the reference's cast is undefined there) takes e = 0. */
static inline void kvcx_mxfp4_quant_block(const float *x, uint8_t *blk) {
    float amax = 0.0f;
    for (int j = 0; j < KVCX_MX_QK; j++)
        if (amax < fabsf(x[j])) amax = fabsf(x[j]);
    const float ef = amax > 0.0f ? floorf(log2f(amax)) - 2 + 127 : 0.0f;
    const uint8_t e = ef > 0.0f ? (uint8_t)ef : 0;
    const float d = kvcx_e8m0_half(e);
    blk[0] = e;
    for (int j = 0; j < KVCX_MX_QK / 2; j++)
        blk[1 + j] = (uint8_t)(kvcx_mxfp4_index(x[j], d) | kvcx_mxfp4_index(x[j + KVCX_MX_QK / 2], d) << 4);
}

/* KVCX_ST_CORRUPT for an exponent of 255 (E8M0's NaN, never written) */
static inline int kvcx_mxfp4_dequant_block(const uint8_t *blk, float *y) {
    if (blk[0] == 0xFF) return KVCX_ST_CORRUPT;
    const float d = kvcx_e8m0_half(blk[0]);
    for (int j = 0; j < KVCX_MX_QK / 2; j++) {
        y[j] = (float)kvcx_mxfp4_values[blk[1 + j] & 0x0F] * d;
        y[j + KVCX_MX_QK / 2] = (float)kvcx_mxfp4_values[blk[1 + j] >> 4] * d;
    }
    return KVCX_OK;
}

/* float32 -> E2M1 nibble: round to nearest, ties to the even code, saturated at 6, the sign bit kept (-0 too) */
static inline uint8_t kvcx_e2m1(float v) {
    const float a = fabsf(v);
    const uint8_t c = (uint8_t)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                                (a > 5.0f));
    return signbit(v) ? (uint8_t)(c | 8) : c;
}

static inline float kvcx_e2m1_value(uint8_t c) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return (c & 8) ? -mag[c & 7] : mag[c & 7];
}

/* One NVFP4 group: 16 finite values, per-tensor scale p (> 0) -> 8 bytes of codes and the E4M3 scale byte.
 * KVCX_ST_SCALE_OVERFLOW when amax / 6 / p rounds past E4M3's 448 (the reference would clip the group). */
static inline int kvcx_nvfp4_quant_group(const float *x, float p, uint8_t *q, uint8_t *s) {
    float amax = 0.0f;
    for (int j = 0; j < KVCX_NV_QK; j++)
        if (amax < fabsf(x[j])) amax = fabsf(x[j]);
    float g = (amax / 6.0f) / p;
    if (!(g < KVCX_NV_SCALE_LIMIT)) return KVCX_ST_SCALE_OVERFLOW;
    g = g < 0.015625f ? 0.015625f : (g > 448.0f ? 448.0f : g);
    const uint8_t sc = kvcx_f2fp8(g, KVCX_FP8_E4M3);
    const float r = (1.0f / p) / kvcx_fp82f(sc, KVCX_FP8_E4M3);
    for (int j = 0; j < KVCX_NV_QK / 2; j++)
        q[j] = (uint8_t)(kvcx_e2m1(x[2 * j] * r) | kvcx_e2m1(x[2 * j + 1] * r) << 4);
    *s = sc;
    return KVCX_OK;
}

/* KVCX_ST_CORRUPT for a scale byte the encoder never writes (negative, NaN, below 2^-6) */
static inline int kvcx_nvfp4_dequant_group(const uint8_t *q, uint8_t s, float p, float *y) {
    if ((s & 0x80) || s == 0x7F || s < 0x08) return KVCX_ST_CORRUPT;
    const float sc = p * kvcx_fp82f(s, KVCX_FP8_E4M3);
    for (int j = 0; j < KVCX_NV_QK / 2; j++) {
        y[2 * j] = kvcx_e2m1_value(q[j] & 0x0F) * sc;
        y[2 * j + 1] = kvcx_e2m1_value(q[j] >> 4) * sc;
    }
    return KVCX_OK;
}

#endif
