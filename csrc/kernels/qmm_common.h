/* Weight block layouts of ggml's standard quantized types (the GGUF format) and their scale helpers,
 * shared by the kernels of every instruction set. */
#ifndef DFLASH_QMM_COMMON_H
#define DFLASH_QMM_COMMON_H

#include "qmm.h"

#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#define QK4_0 32
#define QK8_0 32
#define QK_K 256

typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;  /* value j: bit j of qh the 5th bit */
typedef struct { uint16_t d, m; uint8_t qs[16]; } blk_q4_1;                /* value d * q + m */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_K;

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (of 8) */
static inline void scale_min_k4(int j, const uint8_t * q, uint8_t * sc, uint8_t * m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}


/* Q4_K / Q5_K: all 8 sub-blocks' 6-bit scales (sc, bytes 0..7) and minima (m) of one 12-byte pack */
static inline void scales_mins_k4(const uint8_t * q, uint64_t * sc, uint64_t * m) {
    uint32_t u0, u1, u2;
    memcpy(&u0, q, 4); memcpy(&u1, q + 4, 4); memcpy(&u2, q + 8, 4);
    const uint32_t sh = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    const uint32_t mh = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
    *sc = (u0 & 0x3f3f3f3fu) | (uint64_t) sh << 32;
    *m = (u1 & 0x3f3f3f3fu) | (uint64_t) mh << 32;
}

/* Activations (struct dfk_act): xq int8 values, scaled as ggml scales them for the type: per 32
 * values for the 32-value block types, Q4_0 / Q8_0 / Q5_0 / Q4_1 (its Q8_0 activations; dxl holds the
 * scale per 4-value lane), per 256 for the K-quants (its Q8_K; dxl[b] per block of 256, multiplying a
 * block's sum once instead of every lane product).  xsl per lane: the lane's integer sum times minus
 * the type's zero point (Q4_0 8, Q5_0 16, Q6_K 32, Q8_0 128: the start of the lane's integer dot;
 * q8_biased: Q8_0 stored as w + 128, else signed), or for the types with float minima (Q4_K, Q5_K,
 * Q4_1) the lane sum as a float.  xzp (zero-point types): per 32 values, the sum of their even lanes'
 * xsl (low 32 bits) and of their odd lanes' (high): the start of an interleaved kernel's lane pair,
 * which takes a row's 8-value pieces as two 4-value lanes.  xbs: the integer sum of every 32 values
 * (|sum| <= 32 * 127). */
static inline int dfk_zero_point(enum dfk_wtype t, bool q8_biased) {
    switch (t) {
    case DFK_Q4_0: case DFK_Q4_0_X8: return 8;
    case DFK_Q5_0: return 16;
    case DFK_Q6_K: return 32;
    case DFK_Q8_0: return q8_biased ? 128 : 0;
    default: return 0;
    }
}

static inline bool dfk_fine_scales(enum dfk_wtype t) {
    return t == DFK_Q4_0 || t == DFK_Q4_0_X8 || t == DFK_Q8_0 || t == DFK_Q5_0 || t == DFK_Q4_1;
}

static void dfk_quantize(enum dfk_wtype t, bool q8_biased, const float * x, size_t x_stride, const struct dfk_act * a,
                         int r0, int r1) {
    const int64_t k = a->k, kp = a->kp, zp = dfk_zero_point(t, q8_biased), bs = dfk_fine_scales(t) ? 32 : 256;
    for (int r = r0; r < r1; r++) {
        const float * xr = (const float *) ((const char *) x + (size_t) r * x_stride);
        int8_t * q = a->xq + (size_t) r * kp;
        float * xf = a->xsl + (size_t) r * (kp / 4);
        int32_t * xc = (int32_t *) xf;
        float * dx = a->dxl + (size_t) r * (kp / 4);
        int16_t * xb = a->xbs + (size_t) r * (kp / 32);
        int64_t * zs = a->xzp + (size_t) r * (kp / 32);
        for (int64_t b = 0; b < (kp + bs - 1) / bs; b++) {
            const int64_t j0 = bs * b, j1 = j0 + bs < k ? j0 + bs : k, p1 = j0 + bs < kp ? j0 + bs : kp;
            float amax = 0.0f;
            int64_t j = j0;
            /* 8 values at a time where they are whole (the maximum and each rounding come out as the
             * scalar loop's: max is exact, and round-to-nearest-even is nearbyintf's mode) */
            __m256 m8 = _mm256_setzero_ps();
            const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            for (; j + 8 <= j1; j += 8) m8 = _mm256_max_ps(m8, _mm256_and_ps(_mm256_loadu_ps(xr + j), abs_mask));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            amax = _mm_cvtss_f32(m4);
            for (; j < j1; j++) amax = fabsf(xr[j]) > amax ? fabsf(xr[j]) : amax;
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m256 id8 = _mm256_set1_ps(id);
            for (j = j0; j + 8 <= j1; j += 8) {
                const __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), id8),
                                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                _mm_storel_epi64((__m128i *) (q + j), _mm_packs_epi16(h, h));
            }
            for (; j < p1; j++) q[j] = j < k ? (int8_t) nearbyintf(xr[j] * id) : 0;
            if (bs == 32) for (int64_t l = j0 / 4; l < p1 / 4; l++) dx[l] = d;
            else dx[b] = d;
            for (int64_t l = j0 / 4; l < p1 / 4; l++) {
                const int32_t sum = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
                if (zp) xc[l] = (int32_t) -zp * sum; else xf[l] = (float) sum;
            }
            for (int64_t s = j0 / 32; s < p1 / 32; s++) {
                int32_t sum = 0;
                for (int j = 0; j < 32; j++) sum += q[32 * s + j];
                xb[s] = (int16_t) sum;
                const int32_t * c = xc + 8 * s;
                zs[s] = zp ? (int64_t) ((uint64_t) (uint32_t) (c[0] + c[2] + c[4] + c[6]) |
                                        (uint64_t) (uint32_t) (c[1] + c[3] + c[5] + c[7]) << 32) : 0;
            }
        }
    }
}


/* the hardware prefetcher alone falls behind once a row's products take more than a few cycles; a
 * kernel prefetches its own stream a fixed distance ahead (a whole next row or group at once, as
 * before, thrashed L1 on long rows) */
#ifndef DFK_PF_AHEAD
#define DFK_PF_AHEAD 2048  /* bytes ahead of the kernels that prefetch their own stream */
#endif
#define Q8_PF_GROUP 16384  /* bytes of a group of 8 Q8_0 rows up to which the group kernels prefetch the next */
/* bytes of 256 values of each standard type: the stream fdot_T prefetches, 256 values at a time */
#define dfk_sbb_q4_0 144
#define dfk_sbb_q8_0 272
#define dfk_sbb_q4_K 144
#define dfk_sbb_q5_K 176
#define dfk_sbb_q6_K 210
#define dfk_sbb_q5_0 176
#define dfk_sbb_q4_1 160
static inline void dfk_prefetch(const uint8_t * p, size_t n) {
    for (size_t i = 0; i < n; i += 64) _mm_prefetch((const char *) p + i, _MM_HINT_T0);
}

/* The Q8_0 group kernels (8 standard-layout rows read a block at a time, nb blocks a row of w_row
 * bytes): at block b, the next group's share of bytes, so that it arrives one group ahead -- where a
 * group is small (a SmolLM2 head's 4.9 KB); past Q8_PF_GROUP the hardware's prefetch alone did better
 * (a 1536 x 8960 matrix read cold: 0.70 against 0.86 ms at one row, 2 threads). */
static inline void dfk_prefetch_next_group(const uint8_t * g, size_t w_row, int64_t nb, int64_t b) {
    if (8 * w_row > Q8_PF_GROUP) return;
    const size_t pf = 8 * w_row / (size_t) nb;
    dfk_prefetch(g + 8 * w_row + (size_t) b * pf, pf);
}

/* A standard-layout type's kernel over weight rows [c0, c1): each row against every activation row,
 * GROUP rows at a time through fdot_T(m, ...) for m <= GROUP rows (fdot_T prefetches its own stream). */
#define DFK_FMUL(T, GROUP)                                                                             \
    static void fmul_##T(const void * w, size_t w_row, int64_t c0, int64_t c1, const struct dfk_act * a, \
                         float * y, size_t y_stride) {                                                 \
        for (int64_t c = c0; c < c1; c++) {                                                            \
            const uint8_t * row = (const uint8_t *) w + (size_t) c * w_row;                            \
            for (int r0 = 0; r0 < a->n; r0 += GROUP)                                                   \
                fdot_##T(a->n - r0 >= GROUP ? GROUP : a->n - r0, row, 0, a, r0, y + c, y_stride);      \
        }                                                                                              \
    }

/* the type switch of an instruction set's mul, over the fmul_T its FUSED_TYPEs define */
#define DFK_MUL(NAME)                                                                                  \
    static void NAME(enum dfk_wtype t, const void * w, size_t w_row, int64_t c0, int64_t c1,           \
                     const struct dfk_act * a, float * y, size_t y_stride) {                           \
        switch (t) {                                                                                   \
        case DFK_Q4_0: fmul_q4_0(w, w_row, c0, c1, a, y, y_stride); break;                             \
        case DFK_Q8_0: DFK_FMUL_Q8_0(w, w_row, c0, c1, a, y, y_stride); break;                         \
        case DFK_Q4_K: fmul_q4_K(w, w_row, c0, c1, a, y, y_stride); break;                             \
        case DFK_Q5_K: fmul_q5_K(w, w_row, c0, c1, a, y, y_stride); break;                             \
        case DFK_Q6_K: fmul_q6_K(w, w_row, c0, c1, a, y, y_stride); break;                             \
        case DFK_Q5_0: fmul_q5_0(w, w_row, c0, c1, a, y, y_stride); break;                             \
        case DFK_Q4_1: fmul_q4_1(w, w_row, c0, c1, a, y, y_stride); break;                             \
        case DFK_Q4_0_X8: DFK_FMUL_Q4_0_X8(w, w_row, c0, c1, a, y, y_stride); break;                   \
        case DFK_Q4_K_X8: DFK_FMUL_Q4_K_X8(w, w_row, c0, c1, a, y, y_stride); break;                   \
        default: break;                                                                                \
        }                                                                                              \
    }
#endif
