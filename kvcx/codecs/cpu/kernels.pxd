# cython: language_level=3
# Declarations of the kernels' C headers (kernels.h and the ones it names): base.h is the one place the
# constants shared by the kernels and the Python layer are defined (each variant re-exports them as Python names).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int32_t, int64_t

cdef extern from "kernels.h" nogil:
    enum kvcx_dtype:
        KVCX_DT_F32
        KVCX_DT_F16
        KVCX_DT_BF16
    enum kvcx_axis:
        KVCX_AXIS_TOKEN
        KVCX_AXIS_CHANNEL
    enum kvcx_status:
        KVCX_OK
        KVCX_ST_NONFINITE
        KVCX_ST_SCALE_OVERFLOW
        KVCX_ST_NOMEM
        KVCX_ST_CORRUPT
    enum:
        KVCX_CONV_CHUNK
        KVCX_TASK_VALUES
        KVCX_METRICS_CHUNK
        KVCX_METRICS_FIELDS
    const int32_t KVCX_KEY_NEG_INF
    const bint KVCX_F16C

    ctypedef struct kvcx_layout:
        int64_t N, S, D, t0, group_size
        int bits, asym, axis, rotate

    float kvcx_h2f(uint16_t h) noexcept
    uint16_t kvcx_f2h(float x) noexcept
    float kvcx_b2f(uint16_t b) noexcept
    uint16_t kvcx_f2b(float x) noexcept
    void kvcx_h2f_n(const uint16_t *s, float *d, int64_t n) noexcept
    void kvcx_b2f_n(const uint16_t *s, float *d, int64_t n) noexcept
    void kvcx_f2b_n(const float *s, uint16_t *d, int64_t n) noexcept
    void kvcx_f2h_n(const float *s, uint16_t *d, int64_t n) noexcept
    void kvcx_f2h_sat_n(const float *s, uint16_t *d, int64_t n) noexcept
    uint16_t kvcx_f2h_1(float x) noexcept
    float kvcx_h2f_1(uint16_t h) noexcept
    const char *kvcx_simd_flags() noexcept
    void kvcx_wht8(float *p, int64_t n) noexcept
    uint32_t kvcx_crc32c(uint32_t crc, const uint8_t *p, int64_t n) noexcept
    int32_t kvcx_absmax_bits(const float *x, int64_t n) noexcept
    void kvcx_minmax_keys(const float *x, int64_t n, int32_t *kmin, int32_t *kmax) noexcept
    void kvcx_quant_cols(const float *x, int64_t rows, int64_t D, const float *sdiv, const float *zero,
                         const float *keep, float qmin, float qmax, float off, int pack4, uint8_t *out) noexcept
    void kvcx_quant_contig(const float *x, int64_t n, float scale, float zero, float qmin, float qmax, float off,
                           int pack4, uint8_t *out) noexcept
    int64_t kvcx_pack3_blocks(const uint8_t *q, int64_t n, uint8_t *out) noexcept
    int64_t kvcx_pack2_blocks(const uint8_t *q, int64_t n, uint8_t *out) noexcept
    int64_t kvcx_unpack3_blocks(const uint8_t *p, int64_t n, uint8_t *q) noexcept
    void kvcx_fwht_rows(float *x, int64_t rows, int64_t d) noexcept
    int kvcx_cols_params_quant(const float *x, int64_t rows, int64_t D, const int32_t *kmin,
                               const int32_t *kmax, int bits, int asym, uint16_t *s_out, uint16_t *z_out,
                               float *sdiv, float *zero, uint32_t *keep, uint8_t *out) noexcept
    int64_t kvcx_q4_groups_f16(const uint16_t *x, int64_t ng, int64_t G, int asym, uint16_t *s_out,
                               uint16_t *z_out, uint8_t *out, int *status) noexcept
    int64_t kvcx_groups(const float *x, int64_t ng, int64_t G, int bits, int asym, uint16_t *s_out, uint16_t *z_out,
                        uint8_t *out, int *status) noexcept

cdef extern from "attn.h" nogil:
    enum:
        KVCX_ATTN_TILE
        KVCX_ATTN_MAX_GROUP
        KVCX_ATTN_MAX_D
        KVCX_ATTN_MAX_ROWS
        KVCX_ATTN_TILE_ROWS
    const bint KVCX_ATTN_AVX2

    ctypedef struct kvcx_attn_layout:
        int64_t B, Hkv, R, D, Tq, pos_q, k_tokens, v_tokens, ns, pos_s, nr, pos_r, nsplit, kv_len
        float scaling
        int k_axis, k_asym, k_rotate
        int64_t k_group, k_nscale
        int v_asym, v_rotate
        int64_t v_group, v_nscale
        int k_bits, v_bits
        int v_e8p
        int64_t nq, mask_bs, mask_qs
        int causal
        float softcap
        int k_widths
        int64_t k_chunks, k_groups

    ctypedef struct kvcx_attn_args:
        const float *q
        const uint8_t *kc
        const uint16_t *ks
        const uint16_t *kz
        const int64_t *kblk
        const uint8_t *vc
        const uint16_t *vs
        const uint16_t *vz
        const float *sk
        const float *sv
        const float *rk
        const float *rv
        const int64_t *kgoff
        const uint8_t *kw
        const uint16_t *krange
        const int64_t *kgchunk
        const float *mask
        const uint8_t *maskb
        const float *sinks
        float *work
        float *out

    int64_t kvcx_attn_work_floats(int64_t R, int64_t D, int widths, int vgroups) noexcept
    void kvcx_attn_task(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t task) noexcept
    void kvcx_attn_merge(const kvcx_attn_layout *L, const kvcx_attn_args *A, int64_t i) noexcept

cdef extern from "widths.h" nogil:
    enum:
        KVCX_W_MAX
    const bint KVCX_W_AVX2
    int64_t kvcx_w_encode_floats(int64_t D) noexcept

    void kvcx_w_colminmax(const float *x, int64_t rows, int64_t D, float *mn, float *mx, float *me) noexcept
    void kvcx_w_channels(const float *mn, const float *mx, int64_t G, int64_t D, int64_t gs, int64_t last_rows,
                         float *lo, float *hi, double *spread) noexcept
    void kvcx_w_encode_tile(const float *x, int64_t rows, int64_t gs, int64_t D, const float *mn,
                            const float *mx, const float *me, const float *lo, const float *hi, const uint8_t *w, const float *top,
                            const int64_t *off, uint8_t *qt, float *row, uint8_t *stats, uint8_t *out) noexcept
    int kvcx_w_decode_tile(const uint8_t *planes, const uint8_t *stats, int64_t rows, int64_t gs, int64_t D,
                           const float *lo, const float *hi, const uint8_t *w, const float *top,
                           const int64_t *off, uint8_t *qt, float *row, float *x) noexcept

cdef extern from "engine.h" nogil:
    enum:
        KVCX_QK
        KVCX_GGML_Q8_0
        KVCX_GGML_Q4_0
        KVCX_GGML_Q4_1
        KVCX_GGML_Q5_0
        KVCX_GGML_Q5_1
        KVCX_GGML_IQ4_NL
        KVCX_FP8_E4M3
        KVCX_FP8_E5M2
        KVCX_FP4_MX
        KVCX_FP4_NV
        KVCX_MX_QK
        KVCX_NV_QK
    int64_t kvcx_ggml_qbytes(int type) noexcept
    int kvcx_ggml_has_min(int type) noexcept
    int kvcx_ggml_quant_block(int type, const float *x, uint16_t *d_out, uint16_t *m_out, uint8_t *q) noexcept
    void kvcx_ggml_dequant_block(int type, uint16_t hd, uint16_t hm, const uint8_t *q, float *y) noexcept
    uint8_t kvcx_f2fp8(float x, int format) noexcept
    float kvcx_fp82f(uint8_t c, int format) noexcept
    void kvcx_mxfp4_quant_block(const float *x, uint8_t *blk) noexcept
    int kvcx_mxfp4_dequant_block(const uint8_t *blk, float *y) noexcept
    int kvcx_nvfp4_quant_group(const float *x, float p, uint8_t *q, uint8_t *s) noexcept
    int kvcx_nvfp4_dequant_group(const uint8_t *q, uint8_t s, float p, float *y) noexcept

cdef extern from "turboquant.h" nogil:
    enum:
        KVCX_TQ_MAX_LEVELS
    int kvcx_tq_key_encode(const float *x, int64_t D, int bits, const float *mid, float h, double *work, uint8_t *q,
                           uint8_t *rec) noexcept
    int kvcx_tq_key_decode(const uint8_t *rec, int64_t D, int bits, const float *c, int nc, float h, double *work,
                           float *y) noexcept
    int kvcx_tq_value_encode(const float *v, int64_t D, int bits, uint8_t *q, uint8_t *rec) noexcept
    int kvcx_tq_value_decode(const uint8_t *rec, int64_t D, int bits, float *y) noexcept

cdef extern from "fused.h" nogil:
    enum:
        KVCX_FUSED_VEC
        KVCX_FUSED_AMX
    void kvcx_fused_split_u16(const uint16_t *chunk, uint16_t *keys, uint16_t *values, int64_t T, int64_t H,
                              int64_t D, int64_t bs, int order, int64_t slab, uint16_t *scr) noexcept
    void kvcx_fused_split_u32(const uint32_t *chunk, uint32_t *keys, uint32_t *values, int64_t T, int64_t H,
                              int64_t D, int64_t bs, int order, int64_t slab, uint32_t *scr) noexcept
    void kvcx_fused_join_u16(const uint16_t *keys, const uint16_t *values, uint16_t *chunk, int64_t T, int64_t H,
                             int64_t D, int64_t bs, int order, int64_t slab, uint16_t *scr) noexcept
    void kvcx_fused_join_u32(const uint32_t *keys, const uint32_t *values, uint32_t *chunk, int64_t T, int64_t H,
                             int64_t D, int64_t bs, int order, int64_t slab, uint32_t *scr) noexcept

cdef extern from "e8p.h" nogil:
    enum:
        KVCX_E8P_PATTERNS
    const float KVCX_E8P_RMS
    const float KVCX_E8P_GAIN
    const signed char kvcx_e8p_grid[256][8]
    void kvcx_e8p_init() noexcept
    int64_t kvcx_e8p_record_bytes(int64_t D) noexcept
    int kvcx_e8p_encode_row(float *x, int64_t D, uint8_t *rec) noexcept
    int kvcx_e8p_decode_row(const uint8_t *rec, int64_t D, float *out) noexcept
