/* kvcx kernel helpers in C (base.h: the shared constants, the layout, dtype conversions, CRC-32C): the constants shared with Python, the layout struct the
   kernels take, FP16/BF16 conversion (bit-exact with NumPy), and the Walsh-Hadamard
   transform. Included by kvcx/codecs/_core.pyx through _kernels.pxd; the Python side
   reads every constant from kvcx.codecs._core, never restates one. */
#ifndef KVCX_BASE_H
#define KVCX_BASE_H

#include <stdint.h>
#include <string.h>
#include <math.h>

/* element dtypes the kernels read and write */
enum kvcx_dtype { KVCX_DT_F32 = 0, KVCX_DT_F16 = 1, KVCX_DT_BF16 = 2 };

/* grouping axis: groups along each slab's values in C order, or along tokens per channel */
enum kvcx_axis { KVCX_AXIS_TOKEN = 0, KVCX_AXIS_CHANNEL = 1 };

/* kernel status bits (OR-ed across parallel tasks) */
enum kvcx_status {
    KVCX_OK = 0,
    KVCX_ST_NONFINITE = 1,       /* a NaN/Inf input value */
    KVCX_ST_SCALE_OVERFLOW = 2,  /* a scale or zero point that FP16 cannot hold */
    KVCX_ST_NOMEM = 4,           /* malloc failed */
    KVCX_ST_CORRUPT = 8          /* packed data that no encoder writes (decoding a damaged tensor) */
};

enum {
    KVCX_CONV_CHUNK = 65536,     /* elements converted per parallel task */
    KVCX_TASK_VALUES = 32768,    /* values per parallel encode/decode task (blocks grouped up to this) */
    KVCX_METRICS_CHUNK = 16384,  /* elements per metrics partial: sizes the caller's partials buffer */
    KVCX_METRICS_FIELDS = 6      /* sum x^2, sum e^2, sum y^2, sum xy, max |e|, non-finite flag */
};

/* the order key of -inf (0xff800000 ^ 0x7fffffff); -NaN keys are smaller */
#define KVCX_KEY_NEG_INF ((int32_t)-2139095041)

/* One tensor seen as (N, S, D): N slabs, S tokens, D values per token. Tokens [0, t0) are
   kept exact elsewhere; the kernels quantize tokens [t0, S). Checked by kvcx.codecs before
   any kernel sees it: N, S, D >= 1, 0 <= t0 < S, group_size >= 1, bits in {2, 3, 4, 8}. */
typedef struct {
    int64_t N, S, D, t0, group_size;
    int bits, asym, axis, rotate;
} kvcx_layout;

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define KVCX_F16C 1
#else
#define KVCX_F16C 0
#endif

static inline float kvcx_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, f;
    if (e == 0x1fu) f = sign | 0x7f800000u | (m << 13);
    else if (e == 0) {
        if (m == 0) f = sign;
        else {
            int k = -1;
            do { k++; m <<= 1; } while (!(m & 0x400u));
            f = sign | ((uint32_t)(112 - k) << 23) | ((m & 0x3ffu) << 13);
        }
    } else f = sign | ((e + 112u) << 23) | (m << 13);
    float r; memcpy(&r, &f, 4); return r;
}

/* Round to nearest even, NaN kept NaN: the same as NumPy's astype. */
static inline uint16_t kvcx_f2h(float x) {
    uint32_t f; memcpy(&f, &x, 4);
    uint16_t sign = (uint16_t)((f >> 16) & 0x8000u);
    uint32_t fe = f & 0x7f800000u, fm = f & 0x007fffffu;
    if (fe == 0x7f800000u) {
        if (fm == 0) return sign | 0x7c00u;
        uint16_t r = (uint16_t)(0x7c00u + (fm >> 13));
        if (r == 0x7c00u) r++;
        return sign | r;
    }
    if (fe >= 0x47800000u) return sign | 0x7c00u;
    if (fe <= 0x38000000u) {
        if (fe < 0x33000000u) return sign;
        uint32_t s = 126u - (fe >> 23);
        uint32_t man = fm | 0x00800000u;
        uint32_t h = man >> s, rem = man & ((1u << s) - 1u), half = 1u << (s - 1u);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return sign | (uint16_t)h;
    }
    uint32_t h = (((fe >> 23) - 112u) << 10) | (fm >> 13);
    uint32_t rem = fm & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return sign | (uint16_t)h;
}

static inline float kvcx_b2f(uint16_t b) {
    uint32_t f = (uint32_t)b << 16; float r; memcpy(&r, &f, 4); return r;
}

static inline uint16_t kvcx_f2b(float x) {
    uint32_t f; memcpy(&f, &x, 4);
    if ((f & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((f >> 16) | 0x0040u);
    return (uint16_t)((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}

static inline void kvcx_b2f_n(const uint16_t *s, float *d, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(d + i),
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i))), 16));
#endif
    for (; i < n; i++) d[i] = kvcx_b2f(s[i]);
}

/* float32 -> bfloat16, round to nearest even, NaN kept NaN (quiet): the same as kvcx_f2b */
static inline void kvcx_f2b_n(const float *s, uint16_t *d, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), q = _mm256_set1_epi32(0x0040);
    for (; i + 8 <= n; i += 8) {
        __m256i f = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(f, bias),
                                      _mm256_and_si256(_mm256_srli_epi32(f, 16), one)), 16);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(f, abs), inf);
        __m256i qn = _mm256_or_si256(_mm256_srli_epi32(f, 16), q);
        r = _mm256_blendv_epi8(r, qn, nan);
        /* 8 x u32 (each < 65536) -> 8 x u16 */
        __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
        _mm_storeu_si128((__m128i *)(d + i), _mm_packus_epi32(lo, hi));
    }
#endif
    for (; i < n; i++) d[i] = kvcx_f2b(s[i]);
}

static inline void kvcx_h2f_n(const uint16_t *s, float *d, int64_t n) {
    int64_t i = 0;
#if KVCX_F16C
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
    for (; i < n; i++) d[i] = kvcx_h2f(s[i]);
}

static inline void kvcx_f2h_n(const float *s, uint16_t *d, int64_t n) {
    int64_t i = 0;
#if KVCX_F16C
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
            _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) d[i] = kvcx_f2h(s[i]);
}

/* As kvcx_f2h_n, saturating at +-65504 first: decoded values never become +-inf (NaN never occurs there). */
static inline void kvcx_f2h_sat_n(const float *s, uint16_t *d, int64_t n) {
    int64_t i = 0;
#if KVCX_F16C
    const __m256 hi = _mm256_set1_ps(65504.0f), lo = _mm256_set1_ps(-65504.0f);
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
            _mm256_cvtps_ph(_mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(s + i), lo), hi),
                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) {
        float v = s[i] > 65504.0f ? 65504.0f : s[i];
        d[i] = kvcx_f2h(v < -65504.0f ? -65504.0f : v);
    }
}

/* CRC-32C (Castagnoli, the iSCSI polynomial), continuing from crc (0 to start): the SSE4.2 instruction
   where the build has it (about 8 bytes per 3 cycles), else bit by bit. */
#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif
static inline uint32_t kvcx_crc32c(uint32_t crc, const uint8_t *p, int64_t n) {
    crc = ~crc;
#if defined(__SSE4_2__)
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    crc = (uint32_t)c;
    for (; n > 0; n--)
        crc = _mm_crc32_u8(crc, *p++);
#else
    for (; n > 0; n--) {
        crc ^= *p++;
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
#endif
    return ~crc;
}

#endif /* KVCX_BASE_H */
