/* vLLM's CPU fused K/V plane <-> a key plane and a value plane (kvcx.formats.layouts, "vllm_cpu").
 *
 * A chunk is [L, T, H * 2D]: token row t of layer l holds, for each head h, the 2D values of row (t % bs) of
 * engine block t / bs of vLLM's cache [blocks, H, bs, 2D]. The bs rows of one (layer, block, head) are a slab
 * of 2 * bs * D values: the block's keys (bs * D values), then its values, each in the order of vLLM's CPU
 * attention kernel:
 *   KVCX_FUSED_VEC  keys [D, bs] (dim-major), values [bs, D]
 *   KVCX_FUSED_AMX  keys [bs/16, D/2, 16, 2] (16-token tiles of dimension pairs),
 *                   values [D/16, bs/2, 16, 2] (16-dimension tiles of token pairs)
 * The planes are [L, T, H * D], keys or values of token t, head h, dimension d at (l * T + t) * H * D + h * D + d.
 *
 * One call moves one slab; the caller runs slabs in parallel, each thread with its own scratch of 2 * bs * D
 * values (the slab's rows copied out of, or into, the chunk in one pass). Values are moved as they are
 * (16- or 32-bit words): no arithmetic. The caller checked every size.
 */
#ifndef KVCX_FUSED_H
#define KVCX_FUSED_H

#include <stdint.h>
#include <string.h>

enum { KVCX_FUSED_VEC = 0, KVCX_FUSED_AMX = 1 };
#define KVCX_AMX_TILE 16

#define KVCX_DEFINE_FUSED(TY, SUF)                                                                            \
static inline void kvcx_fused_split_##SUF(const TY *chunk, TY *keys, TY *values, int64_t T, int64_t H,          \
                                          int64_t D, int64_t bs, int order, int64_t slab, TY *scr) {          \
    const int64_t nb = T / bs, h = slab % H, b = (slab / H) % nb, l = slab / (H * nb);                         \
    const int64_t W = H * 2 * D, HD = H * D;                                                                   \
    const TY *src = chunk + (l * T + b * bs) * W + h * 2 * D;                                                  \
    for (int64_t r = 0; r < bs; r++) memcpy(scr + r * 2 * D, src + r * W, (size_t)(2 * D) * sizeof(TY));       \
    TY *kd = keys + (l * T + b * bs) * HD + h * D, *vd = values + (l * T + b * bs) * HD + h * D;               \
    const TY *p = scr;                                                                                         \
    if (order == KVCX_FUSED_VEC) {                                                                             \
        for (int64_t d = 0; d < D; d++)                                                                        \
            for (int64_t t = 0; t < bs; t++) kd[t * HD + d] = *p++;                                            \
        for (int64_t t = 0; t < bs; t++, p += D) memcpy(vd + t * HD, p, (size_t)D * sizeof(TY));               \
    } else {                                                                                                   \
        for (int64_t tb = 0; tb < bs / KVCX_AMX_TILE; tb++)                                                    \
            for (int64_t dp = 0; dp < D / 2; dp++)                                                             \
                for (int64_t ti = 0; ti < KVCX_AMX_TILE; ti++, p += 2) {                                       \
                    TY *o = kd + (tb * KVCX_AMX_TILE + ti) * HD + dp * 2;                                      \
                    o[0] = p[0]; o[1] = p[1];                                                                  \
                }                                                                                              \
        for (int64_t dg = 0; dg < D / KVCX_AMX_TILE; dg++)                                                     \
            for (int64_t tp = 0; tp < bs / 2; tp++)                                                            \
                for (int64_t dd = 0; dd < KVCX_AMX_TILE; dd++, p += 2) {                                       \
                    TY *o = vd + tp * 2 * HD + dg * KVCX_AMX_TILE + dd;                                        \
                    o[0] = p[0]; o[HD] = p[1];                                                                 \
                }                                                                                              \
    }                                                                                                          \
}                                                                                                              \
static inline void kvcx_fused_join_##SUF(const TY *keys, const TY *values, TY *chunk, int64_t T, int64_t H,     \
                                         int64_t D, int64_t bs, int order, int64_t slab, TY *scr) {           \
    const int64_t nb = T / bs, h = slab % H, b = (slab / H) % nb, l = slab / (H * nb);                         \
    const int64_t W = H * 2 * D, HD = H * D;                                                                   \
    const TY *kd = keys + (l * T + b * bs) * HD + h * D, *vd = values + (l * T + b * bs) * HD + h * D;         \
    TY *p = scr;                                                                                               \
    if (order == KVCX_FUSED_VEC) {                                                                             \
        for (int64_t d = 0; d < D; d++)                                                                        \
            for (int64_t t = 0; t < bs; t++) *p++ = kd[t * HD + d];                                            \
        for (int64_t t = 0; t < bs; t++, p += D) memcpy(p, vd + t * HD, (size_t)D * sizeof(TY));               \
    } else {                                                                                                   \
        for (int64_t tb = 0; tb < bs / KVCX_AMX_TILE; tb++)                                                    \
            for (int64_t dp = 0; dp < D / 2; dp++)                                                             \
                for (int64_t ti = 0; ti < KVCX_AMX_TILE; ti++, p += 2) {                                       \
                    const TY *o = kd + (tb * KVCX_AMX_TILE + ti) * HD + dp * 2;                                \
                    p[0] = o[0]; p[1] = o[1];                                                                  \
                }                                                                                              \
        for (int64_t dg = 0; dg < D / KVCX_AMX_TILE; dg++)                                                     \
            for (int64_t tp = 0; tp < bs / 2; tp++)                                                            \
                for (int64_t dd = 0; dd < KVCX_AMX_TILE; dd++, p += 2) {                                       \
                    const TY *o = vd + tp * 2 * HD + dg * KVCX_AMX_TILE + dd;                                  \
                    p[0] = o[0]; p[1] = o[HD];                                                                 \
                }                                                                                              \
    }                                                                                                          \
    TY *dst = chunk + (l * T + b * bs) * W + h * 2 * D;                                                        \
    for (int64_t r = 0; r < bs; r++) memcpy(dst + r * W, scr + r * 2 * D, (size_t)(2 * D) * sizeof(TY));       \
}

KVCX_DEFINE_FUSED(uint16_t, u16)
KVCX_DEFINE_FUSED(uint32_t, u32)

#endif /* KVCX_FUSED_H */
