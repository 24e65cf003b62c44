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
   run the same register-blocked products. Values are read as for the other presets.

   Values in E8P records (kvcx.e8p, kvcx2v's values; e8p.h): each tile's records are decoded into the float value
   tile (a code's point from a 256-entry table of halved patterns in the accumulators' order, its sign field as a
   mask, its shift added: no search, no branch) and the records' scales become the value weights p s, as per-token
   integer scales do; the points are still rotated, and the one inverse rotation per output row ends them. */
#ifndef KVCX_ATTN_H
#define KVCX_ATTN_H

#include "attn_simd.h"
#include "attn_blocks.h"
#include "attn_widths.h"
#include "attn_e8p.h"

/* One task: (row x KV head) `slab`, token range `split`; writes the partial to the task's workspace. */
static inline void kvcx_attn_task_run(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t task) {
    const int64_t R = L->R, D = L->D, T = KVCX_ATTN_TILE;
    const int64_t slab = task / L->nsplit, split = task % L->nsplit;
    const int64_t b = slab / L->Hkv, h = slab % L->Hkv;
    const int vgroups = L->v_group < D;                /* values in several groups a token */
    const int vtile = kvcx_attn_vtile(L);              /* values through a float tile (groups, or E8P records) */
    float *part = A->work + task * kvcx_attn_work_floats(R, D, L->k_widths, vtile);
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
    if (vtile && !kT) vf = part + kvcx_attn_work_floats(R, D, L->k_widths, 0);   /* the values' tile */
    /* keys with widths: a block's channels (index, plane offset, width) and the key tile [channels][T] */
    int32_t *widx = (int32_t *)(zp + D + T * D / 8 + (kT ? 2 * T * D : 0)), *woff = widx + D, *wwid = woff + D;
    float *wT = L->k_widths ? (kT ? kT : (float *)(wwid + D)) : NULL;
    float *wqc = L->k_widths ? (float *)(wwid + D) + (kT ? 0 : T * D) : NULL;   /* R x D: a chunk's query terms */
    float *wlo = wqc ? wqc + R * D : NULL, *wdc = wlo ? wlo + R : NULL;        /* R biases, D differences */
    float *wcr = wdc ? wdc + D : NULL;                 /* tiles: the chunk's ranges (3 D) */
    const int wtiles = L->k_widths && !kvcx_attn_wreg(R);
    const uint8_t *wgrp = NULL;                        /* the block's planes */
    int64_t wnz = 0, wchunk = -1;
    const int64_t kbt = L->k_widths ? 0 : D * L->k_bits / 8;                        /* code bytes per token */
    const int64_t vbt = L->v_e8p ? kvcx_e8p_record_bytes(D) : D * L->v_bits / 8;
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
    const uint16_t *vsc = A->vs ? A->vs + slab * L->v_nscale : NULL;   /* (E8P: none, the records hold them) */
    const uint16_t *vzc = A->vz ? A->vz + slab * L->v_nscale : NULL;
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
        if (L->softcap > 0.0f) kvcx_attn_cap(L, sc, n);
        if (A->mask || A->maskb)   /* (causal rows see every packed token: the step's own are exact) */
            kvcx_attn_mask(L, A, b, sc, n, L->pos_q + t);
        if (vgroups)                             /* scales in the values' tile (below): weights are p */
            for (int64_t j = 0; j < n; j++) vs[j] = 1.0f;
        else if (L->v_e8p && kT)                 /* many rows: the records' points into the tile, scales to vs */
            kvcx_attn_tile_e8p(vt, n, D, vf, vs);
        else if (L->v_e8p)                       /* few rows: the scales; the points where they are added */
            kvcx_e8p_scales(vt, n, D, vs);
        else if (L->v_group == D) {              /* one scale per token: convert the tile's at once */
            kvcx_h2f_n(vsc + t + voff, vs, n);
            if (vzc) kvcx_h2f_n(vzc + t + voff, vz, n);
        } else
            for (int64_t j = 0; j < n; j++) {
                const int64_t g = ((t + j + voff) * D) / L->v_group;
                vs[j] = kvcx_h2f_1(vsc[g]);
                if (vzc) vz[j] = kvcx_h2f_1(vzc[g]);
            }
        /* the softmax, leaving value weights p s (and v = s (c - 8) + (z + 8 s): the sums of p s and p z) */
        kvcx_attn_softmax_v(part, R, D, sc, n, p, W, Z, vs, vzc && !vgroups ? vz : NULL);
        if (!L->v_e8p && L->v_bits != 4) {
            kvcx_attn_widen(vt, n * D, L->v_bits, vadd, wn);
            vt = wn;
        }
        if (L->v_e8p && kT)                      /* decoded above */
            kvcx_f_axpy(vf, n, D, p, T, R, part + 2 * R);
        else if (L->v_e8p)
            kvcx_e8p_axpy(vt, n, D, p, T, R, part + 2 * R, vf, vs);
        else if (vgroups) {                           /* each group's scale and offset on its own channels */
            kvcx_attn_tile_vg(vt, n, D, L->v_group, vsc, vzc, t + voff, (float)(8 - vadd), vf);
            kvcx_f_axpy(vf, n, D, p, T, R, part + 2 * R);
        } else if (vf) {
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
        if (L->v_asym && !vgroups) {
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

/* Merge the partials of (row x KV head) `slab`, row r: out = (H(accv) + accp) / l. With sinks, the row's query
   head's sink logit z joins the softmax's sum as a token with no value: m = max(m, z), l += exp(z - m). */
static inline void kvcx_attn_merge(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t i) {
    const int64_t R = L->R, D = L->D, slab = i / R, r = i % R;
    const int64_t wf = kvcx_attn_work_floats(R, D, L->k_widths, kvcx_attn_vtile(L));
    float *o = A->out + (slab * R + r) * D;   /* [B, Hkv * R, D]: (b * Hkv + h) * R + r */
    float m = -INFINITY, z = -INFINITY;
    if (A->sinks) {   /* row r of KV head h is query head h (R / nq) + r / nq */
        z = A->sinks[(slab % L->Hkv) * (L->R / L->nq) + r / L->nq];
        m = z;
    }
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
    if (z != -INFINITY) l += expf(z - m);
    for (int64_t d = 0; d < D; d++) o[kvcx_attn_perm(d)] = acc[d];
    if (L->v_rotate) kvcx_fwht_rows(o, 1, D);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int64_t d = 0; d < D; d++) o[d] = (o[d] + acc[D + d]) * inv;
}

#endif /* KVCX_ATTN_H */
