/* qmm.h's kernels for AVX512 with VNNI (vpdpbusd: u8 x s8 -> s32, four values a lane): rows of a
 * multiple of 64 values, decoded 64 at a time in registers into qmm.h's canonical form. */
#include <immintrin.h>

#include "attn.h"
#include "qmm_common.h"

/* decoders: chunk i (values 64i .. 64i+63) of a weight row -> q (u8), s, o per 4-value lane */

static inline __m512 two_scales(float a, float b) {
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}

static inline float h2f_at(const uint8_t * p) { uint16_t h; memcpy(&h, p, 2); return h2f(h); }

static inline void dec_q4_0(const uint8_t * row, int rr, int64_t i, __m512 sbv, __m512i * q, __m512 * s, __m512 * o) {
    const uint8_t * b0 = row + (size_t) (2 * i) * 18, * b1 = b0 + 18;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *) (b1 + 2)), _mm_loadu_si128((const __m128i *) (b0 + 2)));
    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  /* lo0 lo1 hi0 hi1 */
    *q = _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(3, 1, 2, 0));                   /* lo0 hi0 lo1 hi1 */
    *s = two_scales(h2f_at(b0), h2f_at(b1));
    *o = _mm512_mul_ps(*s, _mm512_set1_ps(-8.0f));
}

static inline void dec_q8_0(const uint8_t * row, int rr, int64_t i, __m512 sbv, __m512i * q, __m512 * s, __m512 * o) {
    const uint8_t * b0 = row + (size_t) (2 * i) * 34, * b1 = b0 + 34;
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) (b0 + 2))),
                                         _mm256_loadu_si256((const __m256i *) (b1 + 2)), 1);
    *q = _mm512_xor_si512(v, _mm512_set1_epi8((char) 0x80));  /* w + 128 */
    *s = two_scales(h2f_at(b0), h2f_at(b1));
    *o = _mm512_mul_ps(*s, _mm512_set1_ps(-128.0f));
}

/* Q4_K / Q5_K: a superblock's 8 sub-block scales times d (lanes 0..7) and minima times -dmin (8..15),
 * once a superblock (sbv); chunk c takes sub-blocks 2c and 2c + 1 */
static inline __m512 sbs_k4(const uint8_t * blk) {
    uint64_t sc, m;
    scales_mins_k4(blk + 4, &sc, &m);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((long long) m, (long long) sc)));
    return _mm512_mul_ps(v, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(h2f_at(blk)), _mm512_set1_ps(-h2f_at(blk + 2))));
}

static inline void k4_scales(__m512 sbv, int c, __m512 * s, __m512 * o) {
    const __m512i pick = _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_set1_epi32(2 * c));
    *s = _mm512_permutexvar_ps(pick, sbv);
    *o = _mm512_permutexvar_ps(_mm512_add_epi32(pick, _mm512_set1_epi32(8)), sbv);
}

/* Q5_0: Q4_0's nibbles, the 5th bit of value j from bit j of the block's qh (zero point 16) */
static inline void dec_q5_0(const uint8_t * row, int rr, int64_t i, __m512 sbv, __m512i * q, __m512 * s, __m512 * o) {
    const uint8_t * b0 = row + (size_t) (2 * i) * 22, * b1 = b0 + 22;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *) (b1 + 6)), _mm_loadu_si128((const __m128i *) (b0 + 6)));
    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    uint32_t h0, h1;
    memcpy(&h0, b0 + 2, 4); memcpy(&h1, b1 + 2, 4);
    const __m512i q4 = _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(3, 1, 2, 0));
    *q = _mm512_mask_add_epi8(q4, _cvtu64_mask64((uint64_t) h0 | (uint64_t) h1 << 32), q4, _mm512_set1_epi8(16));
    *s = two_scales(h2f_at(b0), h2f_at(b1));
    *o = _mm512_setzero_ps();
}

/* Q4_1: Q4_0's nibbles, unsigned, with the block's minimum m as the offset */
static inline void dec_q4_1(const uint8_t * row, int rr, int64_t i, __m512 sbv, __m512i * q, __m512 * s, __m512 * o) {
    const uint8_t * b0 = row + (size_t) (2 * i) * 20, * b1 = b0 + 20;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *) (b1 + 4)), _mm_loadu_si128((const __m128i *) (b0 + 4)));
    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    *q = _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(3, 1, 2, 0));
    *s = two_scales(h2f_at(b0), h2f_at(b1));
    *o = two_scales(h2f_at(b0 + 2), h2f_at(b1 + 2));
}

static inline void dec_q4_K(const uint8_t * row, int rr, int64_t i, __m512 sbv, __m512i * q, __m512 * s, __m512 * o) {
    const uint8_t * blk = row + (size_t) (i / 4) * 144;
    const int c = (int) (i % 4);
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i v = _mm256_loadu_si256((const __m256i *) (blk + 16 + 32 * c));
    *q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m4)),
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
    k4_scales(sbv, c, s, o);
}

static inline void dec_q5_K(const uint8_t * row, int rr, int64_t i, __m512 sbv, __m512i * q, __m512 * s, __m512 * o) {
    const uint8_t * blk = row + (size_t) (i / 4) * 176;
    const int c = (int) (i % 4);
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i v = _mm256_loadu_si256((const __m256i *) (blk + 48 + 32 * c));
    const __m256i h = _mm256_loadu_si256((const __m256i *) (blk + 16));
    const __m256i hl = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * c), one), 4);
    const __m256i hh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * c + 1), one), 4);
    *q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_or_si256(_mm256_and_si256(v, m4), hl)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), hh), 1);
    k4_scales(sbv, c, s, o);
}

/* Q6_K: the 16 sub-block scales of superblock i0 / 4 times d, once a superblock (sbv) */
static inline __m512 sbs_q6_K(const uint8_t * row, int64_t i0) {
    const uint8_t * blk = row + (size_t) (i0 / 4) * 210;
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (blk + 192)))),
                         _mm512_set1_ps(h2f_at(blk + 208)));
}

/* chunk j of a superblock: the low 4 bits from half n = j / 2 of ql (its low nibbles for p = j % 2 = 0,
 * high ones for 1), the high 2 bits from qh's 32 bytes of that half, bits 4p + 2h of each byte for the
 * chunk's 32-value half h; its 4 sub-blocks' scales out of sbv */
static inline void dec_q6_K(const uint8_t * row, int rr, int64_t i, __m512 sbv, __m512i * q, __m512 * s, __m512 * o) {
    const uint8_t * blk = row + (size_t) (i / 4) * 210;
    const int j = (int) (i % 4), n = j / 2, p = j % 2;
    const __m512i L = _mm512_loadu_si512((const void *) (blk + 64 * n));
    const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (blk + 128 + 32 * n)));
    /* (H >> (4p + 2h)) & 3, at bits 4..5: 16-bit shifts by 4 - 4p - 2h, masked per byte */
    const __m512i hb = _mm512_and_si512(p ? _mm512_srlv_epi16(H, _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0) * 0x0001000100010001LL)
                                          : _mm512_sllv_epi16(H, _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4) * 0x0001000100010001LL),
                                        _mm512_set1_epi8(0x30));
    *q = _mm512_ternarylogic_epi32(p ? _mm512_srli_epi16(L, 4) : L, _mm512_set1_epi8(15), hb, 0xEA);  /* (a & b) | c */
    *s = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                                _mm512_set1_epi32(4 * j)), sbv);
    *o = _mm512_setzero_ps();
}

static inline __m512 sbs_none(const uint8_t * row, int64_t i0) { return _mm512_setzero_ps(); }
static inline __m512 sbs_q4_K(const uint8_t * row, int64_t i0) { return sbs_k4(row + (size_t) (i0 / 4) * 144); }
static inline __m512 sbs_q5_K(const uint8_t * row, int64_t i0) { return sbs_k4(row + (size_t) (i0 / 4) * 176); }
#define sbs_q4_0 sbs_none
#define sbs_q8_0 sbs_none
#define sbs_q5_0 sbs_none
#define sbs_q4_1 sbs_none


static void quantize512(enum dfk_wtype t, const float * x, size_t x_stride, const struct dfk_act * a, int r0, int r1) {
    dfk_quantize(t, true, x, x_stride, a, r0, r1);
}

/* one chunk i of a weight row against activation rows [r0, r0 + N), into blk[] (FUSED_DOT's step) */
#define FUSED_CHUNK(T, MINS, FINE, N)                                                                  \
    {                                                                                                  \
        __m512i qv;                                                                                    \
        __m512 sv, ov;                                                                                 \
        dec_##T(row, rr, i, sbv, &qv, &sv, &ov);                                                       \
        for (int r = 0; r < N; r++) {                                                                  \
            const size_t ro = (size_t) (r0 + r);                                                       \
            const __m512i xv = _mm512_loadu_si512((const void *) (a->xq + ro * kp + 64 * i));          \
            const float * xl = a->xsl + ro * (kp / 4) + 16 * i;                                        \
            if (MINS) {  /* FINE too (Q4_1): scale and minimum times the block's activation scale */   \
                const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qv, xv);               \
                const __m512 dxv = FINE ? _mm512_loadu_ps(a->dxl + ro * (kp / 4) + 16 * i) : _mm512_set1_ps(1.0f);\
                blk[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), FINE ? _mm512_mul_ps(sv, dxv) : sv, blk[r]);\
                blk[r] = _mm512_fmadd_ps(FINE ? _mm512_mul_ps(ov, dxv) : ov, _mm512_loadu_ps(xl), blk[r]);\
            } else {                                                                                   \
                const __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *) xl), qv, xv);  \
                const __m512 sd = FINE ? _mm512_mul_ps(sv, _mm512_loadu_ps(a->dxl + ro * (kp / 4) + 16 * i)) : sv;\
                blk[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sd, blk[r]);                           \
            }                                                                                          \
        }                                                                                              \
    }

/* rows [r0, r0 + N) against weight row `row`: per (r, c) the same sequence whatever N.  FINE: a scale
 * per 32 activations (one multiply more a lane); MINS: float minima (one multiply-add more). */
#define FUSED_DOT(T, MINS, FINE, N)                                                                    \
    static inline void fdot_##T##_##N(const uint8_t * row, int rr, const struct dfk_act * a, int r0,    \
                                      float * y, size_t y_stride) {                                    \
        __m512 acc[N], blk[N];                                                                         \
        for (int r = 0; r < N; r++) acc[r] = _mm512_setzero_ps();                                      \
        const int64_t kp = a->kp, nch = a->k / 64;                                                     \
        for (int64_t i0 = 0; i0 < nch; i0 += 4) {                                                      \
            for (int r = 0; r < N; r++) blk[r] = _mm512_setzero_ps();                                  \
            const __m512 sbv = sbs_##T(row, i0);                                                       \
            if (r0 == 0) dfk_prefetch(row + (size_t) (i0 / 4) * dfk_sbb_##T + DFK_PF_AHEAD, dfk_sbb_##T); \
            if (i0 + 4 <= nch) {  /* a whole block: unrolled, each chunk's place in it known */        \
                _Pragma("GCC unroll 4")                                                                \
                for (int64_t i = i0; i < i0 + 4; i++) FUSED_CHUNK(T, MINS, FINE, N)                    \
            } else {                                                                                   \
                for (int64_t i = i0; i < nch; i++) FUSED_CHUNK(T, MINS, FINE, N)                       \
            }                                                                                          \
            for (int r = 0; r < N; r++)                                                                \
                acc[r] = FINE ? _mm512_add_ps(acc[r], blk[r])                                          \
                              : _mm512_fmadd_ps(blk[r], _mm512_set1_ps(a->dxl[(size_t) (r0 + r) * (kp / 4) + i0 / 4]), acc[r]); \
        }                                                                                              \
        for (int r = 0; r < N; r++)                                                                    \
            *(float *) ((char *) y + (size_t) (r0 + r) * y_stride) = _mm512_reduce_add_ps(acc[r]);     \
    }

#define FUSED_TYPE(T, MINS, FINE)                                                                      \
    FUSED_DOT(T, MINS, FINE, 1) FUSED_DOT(T, MINS, FINE, 2) FUSED_DOT(T, MINS, FINE, 3)                \
    FUSED_DOT(T, MINS, FINE, 4) FUSED_DOT(T, MINS, FINE, 5) FUSED_DOT(T, MINS, FINE, 6)                \
    FUSED_DOT(T, MINS, FINE, 7) FUSED_DOT(T, MINS, FINE, 8)                                            \
    static inline void fdot_##T(int m, const uint8_t * row, int rr, const struct dfk_act * a, int r0,  \
                                float * y, size_t y_stride) {                                          \
        switch (m) {                                                                                   \
        case 1: fdot_##T##_1(row, rr, a, r0, y, y_stride); break;                                      \
        case 2: fdot_##T##_2(row, rr, a, r0, y, y_stride); break;                                      \
        case 3: fdot_##T##_3(row, rr, a, r0, y, y_stride); break;                                      \
        case 4: fdot_##T##_4(row, rr, a, r0, y, y_stride); break;                                      \
        case 5: fdot_##T##_5(row, rr, a, r0, y, y_stride); break;                                      \
        case 6: fdot_##T##_6(row, rr, a, r0, y, y_stride); break;                                      \
        case 7: fdot_##T##_7(row, rr, a, r0, y, y_stride); break;                                      \
        default: fdot_##T##_8(row, rr, a, r0, y, y_stride); break;                                     \
        }                                                                                              \
    }                                                                                                  \
    DFK_FMUL(T, 8)

FUSED_TYPE(q4_0, 0, 1)
FUSED_TYPE(q8_0, 0, 1)
FUSED_TYPE(q4_K, 1, 0)
FUSED_TYPE(q5_K, 1, 0)
FUSED_TYPE(q6_K, 0, 0)
FUSED_TYPE(q5_0, 0, 1)
FUSED_TYPE(q4_1, 1, 1)

/* a group's 8 outputs per activation row: lane 2k + lane 2k+1 */
static inline void x8_store(const __m512 * acc, int n, int r0, float * y, size_t y_stride) {
    const __m512i evens = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    for (int r = 0; r < n; r++) {
        const __m512 s = _mm512_add_ps(acc[r], _mm512_permute_ps(acc[r], 0xB1));
        _mm256_storeu_ps((float *) ((char *) y + (size_t) (r0 + r) * y_stride),
                         _mm512_castps512_ps256(_mm512_permutexvar_ps(evens, s)));
    }
}

/* One 32-value block b of a group's 8 weight rows in the X8 form -- piece vectors p0..p3 hold values
 * 0-7, 8-15, 16-23 and 24-31 of every row (8 bytes a row, unsigned), dw the rows' scales in lane pairs
 * -- against activation rows [r0, r0 + n): the zero point's start (xzp), four dots with the pieces'
 * activations broadcast to every row, times the row's scale and the activation block's. */
static inline void x8_block(const struct dfk_act * a, int r0, int n, int64_t b, __m512i p0, __m512i p1, __m512i p2,
                            __m512i p3, __m512 dw, __m512 * acc) {
    const int64_t kp = a->kp;
    for (int r = 0; r < n; r++) {
        const size_t ro = (size_t) (r0 + r);
        int64_t q[4];
        memcpy(q, a->xq + ro * kp + 32 * b, 32);
        __m512i d = _mm512_set1_epi64(a->xzp[ro * (kp / 32) + b]);
        d = _mm512_dpbusd_epi32(d, p0, _mm512_set1_epi64(q[0]));
        d = _mm512_dpbusd_epi32(d, p1, _mm512_set1_epi64(q[1]));
        d = _mm512_dpbusd_epi32(d, p2, _mm512_set1_epi64(q[2]));
        d = _mm512_dpbusd_epi32(d, p3, _mm512_set1_epi64(q[3]));
        const __m512 sd = _mm512_mul_ps(dw, _mm512_set1_ps(a->dxl[ro * (kp / 4) + 8 * b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sd, acc[r]);
    }
}

/* Q4_0 repacked (X8): the 8 rows of a group at once, in the order ggml-cpu interleaved them.  A
 * block's 8-byte pieces j = 0, 1 of the 8 rows fill one vector each; a row's int32 lanes 2r, 2r+1
 * take the activations' 8 values of that piece broadcast to every row, so one vpdpbusd serves 8
 * rows.  The zero point (8) enters through the lanes' activation sums; the scale is the row's d
 * times the activation block's.  Per (activation row, weight row) the order is fixed: the blocks
 * in turn, four dots into one int32 pair, a pair sum at the end. */
static inline void x8dot_q4_0(const uint8_t * g, int64_t nb, const struct dfk_act * a, int r0, int n, float * y,
                              size_t y_stride) {
    __m512 acc[8];
    for (int r = 0; r < n; r++) acc[r] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(15), x88 = _mm512_set1_epi8((char) 0x88);
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t * p = g + (size_t) b * 144;
        if (r0 == 0) dfk_prefetch(p + DFK_PF_AHEAD, 144);  /* the groups follow each other: one stream */
        const __m512 dw = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p))));
        const __m512i A = _mm512_xor_si512(_mm512_loadu_si512((const void *) (p + 16)), x88);
        const __m512i B = _mm512_xor_si512(_mm512_loadu_si512((const void *) (p + 80)), x88);
        const __m512i alo = _mm512_and_si512(A, m4), ahi = _mm512_and_si512(_mm512_srli_epi16(A, 4), m4);
        const __m512i blo = _mm512_and_si512(B, m4), bhi = _mm512_and_si512(_mm512_srli_epi16(B, 4), m4);
        x8_block(a, r0, n, b, alo, blo, ahi, bhi, dw, acc);
    }
    x8_store(acc, n, r0, y, y_stride);
}

/* a repacked type's kernel over groups [c0, c1) (multiples of 8: run() splits columns so), 8
 * activation rows at a time through x8dot_T over the row's BV-value blocks; PF: the next group
 * prefetched whole (0: x8dot_T prefetches its own stream) */
#define X8_FMUL(T, BV, PF)                                                                             \
    static void fmul_##T##x8_rows(const void * w, size_t w_row, int64_t c0, int64_t c1,                \
                                  const struct dfk_act * a, float * y, size_t y_stride) {              \
        for (int64_t c = c0; c < c1; c += 8) {                                                         \
            const uint8_t * g = (const uint8_t *) w + (size_t) c * w_row;                              \
            if (PF && c + 8 < c1) dfk_prefetch(g + 8 * w_row, 8 * w_row);                              \
            for (int r0 = 0; r0 < a->n; r0 += 8)                                                       \
                x8dot_##T(g, a->k / BV, a, r0, a->n - r0 >= 8 ? 8 : a->n - r0, y + c, y_stride);       \
        }                                                                                              \
    }

X8_FMUL(q4_0, 32, 0)

/* Q8_0 in ggml's standard layout (ggml-cpu repacks it on ARM only), 8 rows at a time as the repacked
 * types: each block of the 8 rows is transposed in registers into the X8 form (8 bytes of each row a
 * 64-bit element) and stored biased (w + 128), so one vpdpbusd serves 8 weight rows for each activation
 * row, against 8 (and a float multiply-add each) one row at a time; the zero point enters through the
 * activations' lane sums.  Per (activation row, weight row) the order is fixed as in x8dot_q4_0. */
static inline void x8dot_q8_0(const uint8_t * g, size_t w_row, int64_t nb, const struct dfk_act * a, int r0, int n,
                              float * y, size_t y_stride) {
    __m512 acc[8];
    for (int r = 0; r < n; r++) acc[r] = _mm512_setzero_ps();
    const __m512i bias = _mm512_set1_epi8((char) 0x80);
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i even = _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0), odd = _mm512_set_epi64(15, 11, 7, 3, 14, 10, 6, 2);
    const __m256i offs = _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32((int) w_row));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t * p = g + (size_t) b * 34;
        if (r0 == 0) dfk_prefetch_next_group(g, w_row, nb, b);
        __m512i z[4];  /* rows 2i, 2i + 1: their 32 bytes each */
        for (int i = 0; i < 4; i++)
            z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) (p + 2 * i * w_row + 2))),
                                      _mm256_loadu_si256((const __m256i *) (p + (2 * i + 1) * w_row + 2)), 1);
        /* rows 0..3 (t) and 4..7 (u): bytes 0..7 then 8..15 (ta, ua), 16..23 then 24..31 (tb, ub) of each */
        const __m512i ta = _mm512_permutex2var_epi64(z[0], even, z[1]), tb = _mm512_permutex2var_epi64(z[0], odd, z[1]);
        const __m512i ua = _mm512_permutex2var_epi64(z[2], even, z[3]), ub = _mm512_permutex2var_epi64(z[2], odd, z[3]);
        const __m512i v0 = _mm512_xor_si512(_mm512_shuffle_i64x2(ta, ua, _MM_SHUFFLE(1, 0, 1, 0)), bias);
        const __m512i v1 = _mm512_xor_si512(_mm512_shuffle_i64x2(ta, ua, _MM_SHUFFLE(3, 2, 3, 2)), bias);
        const __m512i v2 = _mm512_xor_si512(_mm512_shuffle_i64x2(tb, ub, _MM_SHUFFLE(1, 0, 1, 0)), bias);
        const __m512i v3 = _mm512_xor_si512(_mm512_shuffle_i64x2(tb, ub, _MM_SHUFFLE(3, 2, 3, 2)), bias);
        /* the 8 rows' scales: 32 bits from each block's start, the low half */
        const __m128i dh = _mm256_cvtepi32_epi16(_mm256_i32gather_epi32((const int *) p, offs, 1));
        const __m512 dw = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(dh)));
        x8_block(a, r0, n, b, v0, v1, v2, v3, dw, acc);
    }
    x8_store(acc, n, r0, y, y_stride);
}

/* whole groups of 8 rows by x8dot_q8_0, the last ne1 % 8 rows one at a time (c0 is a multiple of 8
 * and c1 one or the matrix's end: col_range), so a row's kernel never depends on the split */
static void fmul_q8_0x8(const void * w, size_t w_row, int64_t c0, int64_t c1, const struct dfk_act * a, float * y,
                        size_t y_stride) {
    int64_t c = c0;
    for (; c + 8 <= c1 && w_row <= INT32_MAX / 8; c += 8) {  /* (the scales' gather takes 32-bit offsets) */
        const uint8_t * g = (const uint8_t *) w + (size_t) c * w_row;
        for (int r0 = 0; r0 < a->n; r0 += 8)
            x8dot_q8_0(g, w_row, a->k / 32, a, r0, a->n - r0 >= 8 ? 8 : a->n - r0, y + c, y_stride);
    }
    if (c < c1) fmul_q8_0(w, w_row, c, c1, a, y, y_stride);
}


/* Q4_K repacked (X8), 8 rows at once likewise: a superblock's pieces j = 0..15 (8 bytes of each row)
 * hold sub-block 2(j/4) in their low nibbles and 2(j/4)+1 in their high ones.  Per superblock the
 * 8 x 8 sub-block scales and minima are unpacked from their 96 bytes with vector ops, once for every
 * activation row: the scales as floats (lanes 2r, 2r+1), the minima as int16 pairs of sub-blocks
 * (lane r).  Per (activation row, weight row), in a fixed order: each sub-block's int32 dots times
 * its scale summed in float, times d and the activation block's scale once a superblock; the
 * minima's integer sum over the superblock (against the activations' 32-value sums) times -dmin
 * and the activation scale, kept apart; the two lanes and that sum added at the end. */

/* the 6-bit scales (sc) and minima (m) of sub-blocks s = 0..7 for rows 0..3 (lo) and 4..7 (hi): lane s
 * of each holds 4 bytes (a row a byte), from the sub-blocks' 12-byte packs at p */
static inline void q4_Kx8_scales(const uint8_t * p, __m256i * sc_lo, __m256i * sc_hi, __m256i * m_lo, __m256i * m_hi) {
    const __m512i A = _mm512_loadu_si512((const void *) p), B = _mm512_loadu_si512((const void *) (p + 64));
    const __m512i i01 = _mm512_set_epi32(22, 19, 16, 13, 10, 7, 4, 1, 21, 18, 15, 12, 9, 6, 3, 0);
    const __m512i i2 = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 23, 20, 17, 14, 11, 8, 5, 2);
    const __m512i u01 = _mm512_permutex2var_epi32(A, i01, B);
    const __m256i u0 = _mm512_castsi512_si256(u01), u1 = _mm512_extracti64x4_epi64(u01, 1);
    const __m256i u2 = _mm512_castsi512_si256(_mm512_permutex2var_epi32(A, i2, B));
    const __m256i k63 = _mm256_set1_epi8(63), k15 = _mm256_set1_epi8(15), k3 = _mm256_set1_epi8(3);
    *sc_lo = _mm256_and_si256(u0, k63);
    *m_lo = _mm256_and_si256(u1, k63);
    *sc_hi = _mm256_or_si256(_mm256_and_si256(u2, k15), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), k3), 4));
    *m_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), k15),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), k3), 4));
}

static inline void x8dot_q4_K(const uint8_t * g, int64_t nsb, const struct dfk_act * a, int r0, int n, float * y,
                              size_t y_stride) {
    __m512 acc[8];
    __m256 accm[8];
    for (int r = 0; r < n; r++) { acc[r] = _mm512_setzero_ps(); accm[r] = _mm256_setzero_ps(); }
    const int64_t kp = a->kp;
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t * p = g + (size_t) sb * 1152;
        if (r0 == 0) dfk_prefetch(p + DFK_PF_AHEAD, 1152);  /* the groups follow each other: one stream */
        const __m512 dw = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p))));
        const __m256 dmw = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + 16))));
        __m256i sc_lo, sc_hi, m_lo, m_hi;
        q4_Kx8_scales(p + 32, &sc_lo, &sc_hi, &m_lo, &m_hi);
        /* sub-block s's 8 row bytes: the 64-bit element of these (s = 0, 1, 4, 5 | 2, 3, 6, 7) */
        const __m256i scA = _mm256_unpacklo_epi32(sc_lo, sc_hi), scB = _mm256_unpackhi_epi32(sc_lo, sc_hi);
        const __m256i mA = _mm256_unpacklo_epi32(m_lo, m_hi), mB = _mm256_unpackhi_epi32(m_lo, m_hi);
        const __m128i sc01 = _mm256_castsi256_si128(scA), sc45 = _mm256_extracti128_si256(scA, 1);
        const __m128i sc23 = _mm256_castsi256_si128(scB), sc67 = _mm256_extracti128_si256(scB, 1);
        const __m128i sc2[4] = { sc01, sc23, sc45, sc67 };  /* sub-blocks 2t (low 8 bytes), 2t + 1 */
        const __m128i mm2[4] = { _mm256_castsi256_si128(mA), _mm256_castsi256_si128(mB), _mm256_extracti128_si256(mA, 1),
                                 _mm256_extracti128_si256(mB, 1) };
        __m256i mpair[4];  /* int16 pairs (m[2t][r], m[2t+1][r]) in lane r */
        for (int t = 0; t < 4; t++)
            mpair[t] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mm2[t], _mm_srli_si128(mm2[t], 8)));
        __m512 blk[8];
        for (int r = 0; r < n; r++) blk[r] = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            __m512i lo[4], hi[4];
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *) (p + 128 + 64 * (4 * c + j)));
                lo[j] = _mm512_and_si512(v, m4);
                hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            const __m512 sc0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc2[c], sc2[c])));
            const __m512 sc1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(sc2[c], sc2[c])));
            for (int r = 0; r < n; r++) {
                const int64_t * x = (const int64_t *) (a->xq + (size_t) (r0 + r) * kp + 256 * sb + 64 * c);
                __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                for (int j = 0; j < 4; j++) {
                    d0 = _mm512_dpbusd_epi32(d0, lo[j], _mm512_set1_epi64(x[j]));
                    d1 = _mm512_dpbusd_epi32(d1, hi[j], _mm512_set1_epi64(x[4 + j]));
                }
                blk[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), sc0, blk[r]);
                blk[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), sc1, blk[r]);
            }
        }
        for (int r = 0; r < n; r++) {
            const size_t ro = (size_t) (r0 + r);
            const float dx = a->dxl[ro * (kp / 4) + sb];
            const int32_t * bs = (const int32_t *) (a->xbs + ro * (kp / 32) + 8 * sb);  /* sub-block sum pairs */
            __m256i mi = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++) mi = _mm256_dpwssd_epi32(mi, mpair[t], _mm256_set1_epi32(bs[t]));
            acc[r] = _mm512_fmadd_ps(blk[r], _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[r]);
            accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mi), _mm256_mul_ps(dmw, _mm256_set1_ps(dx)), accm[r]);
        }
    }
    const __m512i evens = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    for (int r = 0; r < n; r++) {
        const __m512 s = _mm512_add_ps(acc[r], _mm512_permute_ps(acc[r], 0xB1));
        _mm256_storeu_ps((float *) ((char *) y + (size_t) (r0 + r) * y_stride),
                         _mm256_add_ps(_mm512_castps512_ps256(_mm512_permutexvar_ps(evens, s)), accm[r]));
    }
}

X8_FMUL(q4_K, 256, 0)

#define DFK_FMUL_Q8_0 fmul_q8_0x8
#define DFK_FMUL_Q4_0_X8 fmul_q4_0x8_rows
#define DFK_FMUL_Q4_K_X8 fmul_q4_Kx8_rows
DFK_MUL(mul512)

static bool takes512(enum dfk_wtype t, int64_t k) { return k > 0 && k % 64 == 0; }

/* eight independent vpdpbusd chains: 64 multiply-adds an instruction */
static int64_t mac_loop512(int64_t n) {
    __m512i acc[8], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 512)
        for (int j = 0; j < 8; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
    __m512i t = acc[0];
    for (int j = 1; j < 8; j++) t = _mm512_add_epi32(t, acc[j]);
    return _mm512_reduce_add_epi32(t);
}

static const struct dfk_isa isa = { "avx512vnni", takes512, quantize512, mul512, mac_loop512, dfk_attn_avx512 };

const struct dfk_isa * dfk_isa_avx512(void) { return &isa; }
