/*
 * The kernels of qmm.h, written once for a vector width: qmm_avx512.c and qmm_avx2.c include this
 * file after defining the vector type and its operations (DFK_VW bytes a vector, DFK_LANES = DFK_VW/4
 * int32 / float lanes).  Decoding and activation quantization are plain C that the compiler
 * vectorizes under the same flags.
 */
#include "qmm_common.h"

/* lanes [l0, l0 + n) get scale s and offset o */
static inline void set_lanes(float * s, float * o, int64_t l0, int n, float sv, float ov) {
    for (int i = 0; i < n; i++) { s[l0 + i] = sv; o[l0 + i] = ov; }
}

/* One weight row of k values into q / s / o (value = s*q + o per 4-value lane). */
static void decode_row(enum dfk_wtype t, const void * row, int64_t k, uint8_t * q, float * s, float * o) {
    switch (t) {
    case DFK_Q4_0: {
        const blk_q4_0 * b = (const blk_q4_0 *) row;
        for (int64_t i = 0; i < k / QK4_0; i++) {
            const float d = h2f(b[i].d);
            uint8_t * qq = q + i * 32;
            for (int j = 0; j < 16; j++) { qq[j] = b[i].qs[j] & 15; qq[j + 16] = b[i].qs[j] >> 4; }
            set_lanes(s, o, i * 8, 8, d, -8.0f * d);
        }
    } break;
    case DFK_Q8_0: {
        const blk_q8_0 * b = (const blk_q8_0 *) row;
        for (int64_t i = 0; i < k / QK8_0; i++) {
            const float d = h2f(b[i].d);
            uint8_t * qq = q + i * 32;
#if DFK_SIGNED_Q8
            memcpy(qq, b[i].qs, 32);                 /* signed: the kernel's sign path */
            set_lanes(s, o, i * 8, 8, d, 0.0f);
#else
            for (int j = 0; j < 32; j++) qq[j] = (uint8_t) (b[i].qs[j] ^ 0x80);  /* w + 128 */
            set_lanes(s, o, i * 8, 8, d, -128.0f * d);
#endif
        }
    } break;
    case DFK_Q4_K: {
        const blk_q4_K * b = (const blk_q4_K *) row;
        for (int64_t i = 0; i < k / QK_K; i++) {
            const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
            uint8_t * qq = q + i * QK_K;
            for (int c = 0; c < 4; c++) {
                const uint8_t * qs = b[i].qs + 32 * c;
                for (int l = 0; l < 32; l++) { qq[64 * c + l] = qs[l] & 15; qq[64 * c + 32 + l] = qs[l] >> 4; }
                uint8_t sc, m;
                scale_min_k4(2 * c, b[i].scales, &sc, &m);
                set_lanes(s, o, i * 64 + 16 * c, 8, d * sc, -dmin * m);
                scale_min_k4(2 * c + 1, b[i].scales, &sc, &m);
                set_lanes(s, o, i * 64 + 16 * c + 8, 8, d * sc, -dmin * m);
            }
        }
    } break;
    case DFK_Q5_K: {
        const blk_q5_K * b = (const blk_q5_K *) row;
        for (int64_t i = 0; i < k / QK_K; i++) {
            const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
            uint8_t * qq = q + i * QK_K;
            for (int c = 0; c < 4; c++) {
                const uint8_t * qs = b[i].qs + 32 * c;
                const uint8_t u1 = (uint8_t) (1u << (2 * c)), u2 = (uint8_t) (2u << (2 * c));
                for (int l = 0; l < 32; l++) {
                    qq[64 * c + l]      = (qs[l] & 15) + ((b[i].qh[l] & u1) ? 16 : 0);
                    qq[64 * c + 32 + l] = (qs[l] >> 4) + ((b[i].qh[l] & u2) ? 16 : 0);
                }
                uint8_t sc, m;
                scale_min_k4(2 * c, b[i].scales, &sc, &m);
                set_lanes(s, o, i * 64 + 16 * c, 8, d * sc, -dmin * m);
                scale_min_k4(2 * c + 1, b[i].scales, &sc, &m);
                set_lanes(s, o, i * 64 + 16 * c + 8, 8, d * sc, -dmin * m);
            }
        }
    } break;
    case DFK_Q6_K: {
        const blk_q6_K * b = (const blk_q6_K *) row;
        for (int64_t i = 0; i < k / QK_K; i++) {
            const float d = h2f(b[i].d);
            for (int n = 0; n < 2; n++) {
                const uint8_t * ql = b[i].ql + 64 * n;
                const uint8_t * qh = b[i].qh + 32 * n;
                const int8_t * sc = b[i].scales + 8 * n;
                uint8_t * qq = q + i * QK_K + 128 * n;
                for (int l = 0; l < 32; l++) {
                    qq[l]      = (uint8_t) ((ql[l] & 15)      | (((qh[l] >> 0) & 3) << 4));
                    qq[l + 32] = (uint8_t) ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                    qq[l + 64] = (uint8_t) ((ql[l] >> 4)      | (((qh[l] >> 4) & 3) << 4));
                    qq[l + 96] = (uint8_t) ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
                const int64_t l0 = i * 64 + 32 * n;  /* value v of this half uses sc[v / 16]: 4 lanes */
                /* quarter j (32 values: j*32 .. j*32+31) uses sc[2j] for its first 16, sc[2j+1] for the rest */
                for (int j = 0; j < 4; j++) {
                    const float s0 = d * sc[2 * j], s1 = d * sc[2 * j + 1];
                    set_lanes(s, o, l0 + 8 * j, 4, s0, -32.0f * s0);
                    set_lanes(s, o, l0 + 8 * j + 4, 4, s1, -32.0f * s1);
                }
            }
        }
    } break;
    default: break;
    }
}

static void quantize_rows(enum dfk_wtype t, const float * x, size_t x_stride, const struct dfk_act * a, int r0, int r1) {
    (void) t;
    const int64_t k = a->k, kp = a->kp;
    for (int r = r0; r < r1; r++) {
        const float * xr = (const float *) ((const char *) x + (size_t) r * x_stride);
        int8_t * q = a->xq + (size_t) r * kp;
        float * dxl = a->dxl + (size_t) r * (kp / 4);
        float * xsl = a->xsl + (size_t) r * (kp / 4);
        for (int64_t b = 0; b < kp / 32; b++) {
            float amax = 0.0f;
            const int64_t n = b * 32 + 32 <= k ? 32 : (b * 32 < k ? k - b * 32 : 0);
            for (int64_t j = 0; j < n; j++) amax = fmaxf(amax, fabsf(xr[b * 32 + j]));
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int64_t j = 0; j < 32; j++) q[b * 32 + j] = j < n ? (int8_t) nearbyintf(xr[b * 32 + j] * id) : 0;
            for (int l = 0; l < 8; l++) {
                const int8_t * ql = q + b * 32 + 4 * l;
                dxl[b * 8 + l] = d;
                xsl[b * 8 + l] = d * (float) (ql[0] + ql[1] + ql[2] + ql[3]);
            }
        }
    }
}

/* rows [r0, r0 + N) against one decoded weight row: the fixed per-(r, c) order lives here */
#define DFK_DOT_N(N)                                                                                   \
    static inline void dot_##N(const uint8_t * q, const float * s, const float * o,                  \
                               const struct dfk_act * a, int r0, float * y, size_t y_stride) {        \
        dfk_vf acc[N];                                                                                 \
        for (int r = 0; r < N; r++) acc[r] = dfk_vf_zero();                                            \
        const int64_t kp = a->kp;                                                                      \
        for (int64_t i = 0; i < kp; i += DFK_VW) {                                                     \
            const dfk_vi qv = dfk_vi_load(q + i);                                                      \
            const dfk_vf sv = dfk_vf_load(s + i / 4), ov = dfk_vf_load(o + i / 4);                     \
            for (int r = 0; r < N; r++) {                                                              \
                const size_t ro = (size_t) (r0 + r);                                                   \
                const dfk_vi xv = dfk_vi_load(a->xq + ro * kp + i);                                    \
                const dfk_vf sd = dfk_vf_mul(sv, dfk_vf_load(a->dxl + ro * (kp / 4) + i / 4));         \
                acc[r] = dfk_vf_fma(dfk_vf_cvt(dfk_dot(qv, xv)), sd, acc[r]);                          \
                acc[r] = dfk_vf_fma(ov, dfk_vf_load(a->xsl + ro * (kp / 4) + i / 4), acc[r]);          \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < N; r++)                                                                    \
            *(float *) ((char *) y + (size_t) (r0 + r) * y_stride) = dfk_vf_sum(acc[r]);               \
    }
DFK_DOT_N(1)
DFK_DOT_N(2)
DFK_DOT_N(3)
DFK_DOT_N(4)
DFK_DOT_N(5)
DFK_DOT_N(6)
DFK_DOT_N(7)
DFK_DOT_N(8)

static void mul(enum dfk_wtype t, const void * w, size_t w_row, int64_t c0, int64_t c1,
                const struct dfk_act * a, float * y, size_t y_stride, void * scratch) {
    const int64_t kp = a->kp;
    uint8_t * q = (uint8_t *) scratch;
    float * s = (float *) (q + kp);
    float * o = s + kp / 4;
    memset(q + a->k, 0, (size_t) (kp - a->k));  /* the padding weighs nothing */
    for (int64_t l = a->k / 4; l < kp / 4; l++) { s[l] = 0.0f; o[l] = 0.0f; }
    uint8_t * std_row = (uint8_t *) (o + kp / 4);  /* an X8 row gathered into the standard layout */
    for (int64_t c = c0; c < c1; c++) {
        const uint8_t * row = (const uint8_t *) w + (size_t) c * w_row;
        enum dfk_wtype ts = t;
        if (t == DFK_Q4_0_X8 || t == DFK_Q4_K_X8) {
            const uint8_t * g = (const uint8_t *) w + (size_t) (c & ~(int64_t) 7) * w_row;
            for (int64_t b = 0; b < a->k / dfk_block_values(t); b++) {
                if (t == DFK_Q4_0_X8) x8_block_q4_0(g, b, (int) (c & 7), (blk_q4_0 *) std_row + b);
                else x8_block_q4_K(g, b, (int) (c & 7), (blk_q4_K *) std_row + b);
            }
            row = std_row;
            ts = t == DFK_Q4_0_X8 ? DFK_Q4_0 : DFK_Q4_K;
        }
        decode_row(ts, row, a->k, q, s, o);
        float * yc = y + c;
        for (int r0 = 0; r0 < a->n; r0 += 8) {
            switch (a->n - r0 >= 8 ? 8 : a->n - r0) {
            case 1: dot_1(q, s, o, a, r0, yc, y_stride); break;
            case 2: dot_2(q, s, o, a, r0, yc, y_stride); break;
            case 3: dot_3(q, s, o, a, r0, yc, y_stride); break;
            case 4: dot_4(q, s, o, a, r0, yc, y_stride); break;
            case 5: dot_5(q, s, o, a, r0, yc, y_stride); break;
            case 6: dot_6(q, s, o, a, r0, yc, y_stride); break;
            case 7: dot_7(q, s, o, a, r0, yc, y_stride); break;
            default: dot_8(q, s, o, a, r0, yc, y_stride); break;
            }
        }
    }
}

static bool takes(enum dfk_wtype t, int64_t k) { return k % dfk_block_values(t) == 0; }
