/* qmm.h's kernels for AVX2 (vpmaddubsw + vpmaddwd: four u8 x s8 products a lane): weight rows decoded
 * 32 values (one 32-value block or sub-block) at a time in registers into qmm.h's canonical form.
 * Q8_0 weights stay signed: |w| x sign(x, w) keeps vpmaddubsw's 16-bit pair sums from saturating
 * (the other types' values are at most 63). */
#include <immintrin.h>

#include "attn.h"
#include "qmm_common.h"

static inline float h2f_at(const uint8_t * p) { uint16_t h; memcpy(&h, p, 2); return h2f(h); }

/* what a type's decoder takes once a superblock (Q6_K's scales), else nothing */
struct sbs { __m256 lo, hi; };

static inline __m256i nibbles(__m128i v) {  /* 16 bytes -> their 16 low then 16 high nibbles */
    const __m128i m4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

static inline __m256i half_nibbles(__m256i v, int high) {
    const __m256i m4 = _mm256_set1_epi8(15);
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, m4);
}

/* decoders: chunk i (values 32i .. 32i+31) of a weight row -> q, scale s and offset o (8 lanes) */
static inline void dec_q4_0(const uint8_t * row, int rr, int64_t i, struct sbs sb, __m256i * q, __m256 * s, __m256 * o) {
    const uint8_t * b = row + (size_t) i * 18;
    *q = nibbles(_mm_loadu_si128((const __m128i *) (b + 2)));
    *s = _mm256_set1_ps(h2f_at(b));
}

static inline void dec_q5_0(const uint8_t * row, int rr, int64_t i, struct sbs sb, __m256i * q, __m256 * s, __m256 * o) {
    const uint8_t * b = row + (size_t) i * 22;
    uint32_t h;
    memcpy(&h, b + 2, 4);
    /* byte j of the vector: byte j / 8 of qh, tested against bit j % 8 */
    const __m256i hv = _mm256_shuffle_epi8(_mm256_set1_epi32((int) h), _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                                      0x0101010101010101LL, 0));
    const __m256i bit = _mm256_set1_epi64x((long long) 0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit);
    *q = _mm256_or_si256(nibbles(_mm_loadu_si128((const __m128i *) (b + 6))), _mm256_and_si256(set, _mm256_set1_epi8(16)));
    *s = _mm256_set1_ps(h2f_at(b));
}

/* Q4_1: Q4_0's nibbles, unsigned, with the block's minimum m as the offset */
static inline void dec_q4_1(const uint8_t * row, int rr, int64_t i, struct sbs sb, __m256i * q, __m256 * s, __m256 * o) {
    const uint8_t * b = row + (size_t) i * 20;
    *q = nibbles(_mm_loadu_si128((const __m128i *) (b + 4)));
    *s = _mm256_set1_ps(h2f_at(b));
    *o = _mm256_set1_ps(h2f_at(b + 2));
}

static inline void dec_q8_0(const uint8_t * row, int rr, int64_t i, struct sbs sb, __m256i * q, __m256 * s, __m256 * o) {
    const uint8_t * b = row + (size_t) i * 34;
    *q = _mm256_loadu_si256((const __m256i *) (b + 2));
    *s = _mm256_set1_ps(h2f_at(b));
}

/* Q4_K / Q5_K: a superblock's 8 sub-block scales times d (lo) and minima times -dmin (hi), once a
 * superblock; chunk j takes sub-block j */
static inline struct sbs sbs_k4(const uint8_t * blk) {
    uint64_t sc, m;
    scales_mins_k4(blk + 4, &sc, &m);
    struct sbs r = { _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long) sc))), _mm256_set1_ps(h2f_at(blk))),
                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long) m))), _mm256_set1_ps(-h2f_at(blk + 2))) };
    return r;
}

static inline void k4_scale(struct sbs sb, int j, __m256 * s, __m256 * o) {
    *s = _mm256_permutevar8x32_ps(sb.lo, _mm256_set1_epi32(j));
    *o = _mm256_permutevar8x32_ps(sb.hi, _mm256_set1_epi32(j));
}

static inline void dec_q4_K(const uint8_t * row, int rr, int64_t i, struct sbs sb, __m256i * q, __m256 * s, __m256 * o) {
    const uint8_t * blk = row + (size_t) (i / 8) * 144;
    const int j = (int) (i % 8);
    *q = half_nibbles(_mm256_loadu_si256((const __m256i *) (blk + 16 + 32 * (j / 2))), j & 1);
    k4_scale(sb, j, s, o);
}

static inline void dec_q5_K(const uint8_t * row, int rr, int64_t i, struct sbs sb, __m256i * q, __m256 * s, __m256 * o) {
    const uint8_t * blk = row + (size_t) (i / 8) * 176;
    const int j = (int) (i % 8);
    const __m256i low = half_nibbles(_mm256_loadu_si256((const __m256i *) (blk + 48 + 32 * (j / 2))), j & 1);
    const __m256i h = _mm256_loadu_si256((const __m256i *) (blk + 16));
    const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1)), 4);
    *q = _mm256_or_si256(low, hb);
    k4_scale(sb, j, s, o);
}

/* Q6_K, in integers within a superblock: its 16 int8 sub-block scales as int16 (lo, cast) and d (hi),
 * once a superblock */
static inline struct sbs sbs_q6_K(const uint8_t * row, int64_t i0) {
    const uint8_t * blk = row + (size_t) (i0 / 8) * 210;
    struct sbs r = { _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) (blk + 192)))),
                     _mm256_set1_ps(h2f_at(blk + 208)) };
    return r;
}

/* chunk j of a superblock as signed values (q - 32): the low 4 bits from ql's 32 bytes 64n + 32 (p & 1)
 * (n = j / 4, p = j % 4; high nibbles for p >= 2), the high 2 bits from qh's 32 bytes of half n, bits
 * 2p; sc: scale 2j in the 8 int16 lanes of the first 16 values, 2j + 1 in the others */
static inline void dec_q6_K(const uint8_t * row, int rr, int64_t i, struct sbs sb, __m256i * q, __m256i * sc) {
    const uint8_t * blk = row + (size_t) (i / 8) * 210;
    const int j = (int) (i % 8), n = j / 4, p = j % 4;
    const __m256i low = half_nibbles(_mm256_loadu_si256((const __m256i *) (blk + 64 * n + 32 * (p & 1))), p >= 2);
    const __m256i h = _mm256_loadu_si256((const __m256i *) (blk + 128 + 32 * n));
    /* (h >> 2p) & 3 at bits 4..5: 16-bit shifts, masked per byte */
    const __m256i hs = p == 3 ? _mm256_srli_epi16(h, 2) : p == 2 ? h : p == 1 ? _mm256_slli_epi16(h, 2) : _mm256_slli_epi16(h, 4);
    *q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_and_si256(hs, _mm256_set1_epi8(0x30))), _mm256_set1_epi8(32));
    const __m256i pr = _mm256_permutevar8x32_epi32(_mm256_castps_si256(sb.lo), _mm256_set1_epi32(j));
    *sc = _mm256_shuffle_epi8(pr, _mm256_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                                  1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
}

static inline struct sbs sbs_none(const uint8_t * row, int64_t i0) { struct sbs r = { _mm256_setzero_ps(), _mm256_setzero_ps() }; return r; }
static inline struct sbs sbs_q4_K(const uint8_t * row, int64_t i0) { return sbs_k4(row + (size_t) (i0 / 8) * 144); }
static inline struct sbs sbs_q5_K(const uint8_t * row, int64_t i0) { return sbs_k4(row + (size_t) (i0 / 8) * 176); }
#define sbs_q4_0 sbs_none
#define sbs_q8_0 sbs_none
#define sbs_q5_0 sbs_none
#define sbs_q4_1 sbs_none

static inline __m256i dot_u8(__m256i q, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
}

static inline __m256i dot_s8(__m256i q, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), _mm256_set1_epi16(1));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one chunk i of a weight row against activation rows [r0, r0 + N), into blk[] (FUSED_DOT's step) */
#define FUSED_CHUNK(T, ZP, SIGNED, MINS, FINE, N)                                                      \
    {                                                                                                  \
        __m256i qv;                                                                                    \
        __m256 sv, ov = _mm256_setzero_ps();                                                           \
        dec_##T(row, rr, i, sb, &qv, &sv, &ov);                                                        \
        for (int r = 0; r < N; r++) {                                                                  \
            const size_t ro = (size_t) (r0 + r);                                                       \
            const __m256i xv = _mm256_loadu_si256((const __m256i *) (a->xq + ro * kp + 32 * i));       \
            const float * xl = a->xsl + ro * (kp / 4) + 8 * i;                                         \
            __m256i d = SIGNED ? dot_s8(qv, xv) : dot_u8(qv, xv);                                      \
            if (ZP) d = _mm256_add_epi32(d, _mm256_loadu_si256((const __m256i *) xl));                 \
            const __m256 sd = FINE ? _mm256_mul_ps(sv, _mm256_set1_ps(a->dxl[ro * (kp / 4) + 8 * i])) : sv;\
            blk[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sd, blk[r]);                               \
            if (MINS) blk[r] = _mm256_fmadd_ps(FINE ? _mm256_mul_ps(ov, _mm256_set1_ps(a->dxl[ro * (kp / 4) + 8 * i])) : ov,\
                                               _mm256_loadu_ps(xl), blk[r]);  /* Q4_1: FINE too */   \
        }                                                                                              \
    }

/* rows [r0, r0 + N) against weight row `row`: per (r, c) the same sequence whatever N.  ZP: the type's
 * zero point enters the integer dot from the activations' lane sums; SIGNED: Q8_0's sign trick;
 * MINS: float minima; FINE: a scale per 32 activations, else per 256 (a block's sum scaled once). */
#define FUSED_DOT(T, ZP, SIGNED, MINS, FINE, N)                                                          \
    static inline void fdot_##T##_##N(const uint8_t * row, int rr, const struct dfk_act * a, int r0,    \
                                      float * y, size_t y_stride) {                                    \
        __m256 acc[N], blk[N];                                                                         \
        for (int r = 0; r < N; r++) acc[r] = _mm256_setzero_ps();                                      \
        const int64_t kp = a->kp, nch = a->k / 32;                                                     \
        for (int64_t i0 = 0; i0 < nch; i0 += 8) {                                                      \
            for (int r = 0; r < N; r++) blk[r] = _mm256_setzero_ps();                                  \
            const struct sbs sb = sbs_##T(row, i0);                                                    \
            if (r0 == 0) dfk_prefetch(row + (size_t) (i0 / 8) * dfk_sbb_##T + DFK_PF_AHEAD, dfk_sbb_##T); \
            if (i0 + 8 <= nch) {  /* a whole block: unrolled, each chunk's place in it known */  \
                _Pragma("GCC unroll 8")                                                                \
                for (int64_t i = i0; i < i0 + 8; i++) FUSED_CHUNK(T, ZP, SIGNED, MINS, FINE, N)        \
            } else {                                                                                   \
                for (int64_t i = i0; i < nch; i++) FUSED_CHUNK(T, ZP, SIGNED, MINS, FINE, N)           \
            }                                                                                          \
            for (int r = 0; r < N; r++)                                                                \
                acc[r] = FINE ? _mm256_add_ps(acc[r], blk[r])                                          \
                              : _mm256_fmadd_ps(blk[r], _mm256_set1_ps(a->dxl[(size_t) (r0 + r) * (kp / 4) + i0 / 8]), acc[r]); \
        }                                                                                              \
        for (int r = 0; r < N; r++)                                                                    \
            *(float *) ((char *) y + (size_t) (r0 + r) * y_stride) = hsum(acc[r]);                     \
    }

/* rows [r0, r0 + N) against weight row `row` in integers within a superblock (Q6_K): each chunk's signed
 * values times the activations by the sign trick, pairs times their sub-block's scale into int32 lanes,
 * the superblock's int32 sum times d and the activation block's scale once; per (r, c) the same
 * sequence whatever N */
#define INT_DOT(T, N)                                                                                  \
    static inline void fdot_##T##_##N(const uint8_t * row, int rr, const struct dfk_act * a, int r0,    \
                                      float * y, size_t y_stride) {                                    \
        __m256 acc[N];                                                                                 \
        __m256i ib[N];                                                                                 \
        for (int r = 0; r < N; r++) acc[r] = _mm256_setzero_ps();                                      \
        const int64_t kp = a->kp, nch = a->k / 32;                                                     \
        for (int64_t i0 = 0; i0 < nch; i0 += 8) {                                                      \
            for (int r = 0; r < N; r++) ib[r] = _mm256_setzero_si256();                                \
            const struct sbs sb = sbs_##T(row, i0);                                                    \
            if (r0 == 0) dfk_prefetch(row + (size_t) (i0 / 8) * dfk_sbb_##T + DFK_PF_AHEAD, dfk_sbb_##T); \
            _Pragma("GCC unroll 8")                                                                   \
            for (int64_t i = i0; i < i0 + 8; i++) {                                                    \
                __m256i qv, sc;                                                                        \
                dec_##T(row, rr, i, sb, &qv, &sc);                                                     \
                const __m256i qa = _mm256_abs_epi8(qv);                                                \
                for (int r = 0; r < N; r++) {                                                          \
                    const __m256i xv = _mm256_loadu_si256((const __m256i *) (a->xq + (size_t) (r0 + r) * kp + 32 * i)); \
                    ib[r] = _mm256_add_epi32(ib[r], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(xv, qv)), sc)); \
                }                                                                                      \
            }                                                                                          \
            for (int r = 0; r < N; r++)                                                                \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib[r]),                                    \
                                         _mm256_mul_ps(sb.hi, _mm256_set1_ps(a->dxl[(size_t) (r0 + r) * (kp / 4) + i0 / 8])), acc[r]); \
        }                                                                                              \
        for (int r = 0; r < N; r++)                                                                    \
            *(float *) ((char *) y + (size_t) (r0 + r) * y_stride) = hsum(acc[r]);                     \
    }

#define FDOT_SWITCH(T)                                                                                 \
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
    }

/* up to eight rows at a time, each chunk decoded once for all of them (past four rows the sixteen
 * registers no longer hold every accumulator: the superblocks' sums spill, each row's arithmetic
 * unchanged) */
#define FUSED_TYPE(T, ZP, SIGNED, MINS, FINE)                                                          \
    FUSED_DOT(T, ZP, SIGNED, MINS, FINE, 1) FUSED_DOT(T, ZP, SIGNED, MINS, FINE, 2)                    \
    FUSED_DOT(T, ZP, SIGNED, MINS, FINE, 3) FUSED_DOT(T, ZP, SIGNED, MINS, FINE, 4)                    \
    FUSED_DOT(T, ZP, SIGNED, MINS, FINE, 5) FUSED_DOT(T, ZP, SIGNED, MINS, FINE, 6)                    \
    FUSED_DOT(T, ZP, SIGNED, MINS, FINE, 7) FUSED_DOT(T, ZP, SIGNED, MINS, FINE, 8)                    \
    FDOT_SWITCH(T)                                                                                     \
    DFK_FMUL(T, 8)

/*         type    ZP SIGNED MINS FINE */
FUSED_TYPE(q4_0,   1, 0,     0,   1)
FUSED_TYPE(q8_0,   0, 1,     0,   1)
FUSED_TYPE(q4_K,   0, 0,     1,   0)
FUSED_TYPE(q5_K,   0, 0,     1,   0)
FUSED_TYPE(q5_0,   1, 0,     0,   1)
FUSED_TYPE(q4_1,   0, 0,     1,   1)

INT_DOT(q6_K, 1) INT_DOT(q6_K, 2) INT_DOT(q6_K, 3) INT_DOT(q6_K, 4)
INT_DOT(q6_K, 5) INT_DOT(q6_K, 6) INT_DOT(q6_K, 7) INT_DOT(q6_K, 8)
FDOT_SWITCH(q6_K)
DFK_FMUL(q6_K, 8)

/* activation rows a repacked kernel takes in one pass over a group's blocks: the blocks' decoding is
 * shared by them (16 registers do not hold 8 rows' accumulators: those go through L1, each row's
 * arithmetic unchanged) */
#define X8_ROWS 8

/* the int8 activations' 8 values at p broadcast to every 64-bit element (a broadcast load: copying a
 * block into an int64 array first cost the Q8_0 group kernel 15-20 % at 8 rows) */
static inline __m256i bcast8(const int8_t * p) { int64_t v; memcpy(&v, p, 8); return _mm256_set1_epi64x(v); }

/* the lane order of a group's results once the two halves' lane pairs are summed (_mm256_hadd_epi32 or
 * _ps of rows 0..3 and 4..7): rows 0, 1, 4, 5 | 2, 3, 6, 7 (a permutation its own inverse) */
static inline __m256i x8_pair_order(void) { return _mm256_set_epi32(7, 6, 3, 2, 5, 4, 1, 0); }

/* a group's 8 results per activation row, from the pair order into row order */
static inline void x8_store_pairs(const __m256 * acc, int n, int r0, float * y, size_t y_stride) {
    for (int r = 0; r < n; r++)
        _mm256_storeu_ps((float *) ((char *) y + (size_t) (r0 + r) * y_stride), _mm256_permutevar8x32_ps(acc[r], x8_pair_order()));
}

/* Q4_0 repacked (X8): the 8 rows of a group at once, as on AVX512 (qmm_avx512.c), in 256-bit halves
 * (rows 0..3 and 4..7 of each 64-byte piece vector).  Per (activation row, weight row) in a fixed
 * order: a block's four piece dots summed as int16 pairs (at most 4 * 2 * 15 * 127), the pair of
 * int32 lanes summed, plus the zero point's term (the block's activation sum times -8), times the
 * row's d and the activation block's scale into one float lane. */
static inline void x8dot_q4_0(const uint8_t * g, int64_t nb, const struct dfk_act * a, int r0, int n, float * y,
                              size_t y_stride) {
    __m256 acc[X8_ROWS];
    for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
    const int64_t kp = a->kp;
    const __m256i m4 = _mm256_set1_epi8(15), x88 = _mm256_set1_epi8((char) 0x88), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t * p = g + (size_t) b * 144;
        if (r0 == 0) dfk_prefetch(p + DFK_PF_AHEAD, 144);  /* the groups follow each other: one stream */
        const __m256 dw = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p)), x8_pair_order());
        __m256i lo[2][2], hi[2][2];  /* [half][piece] */
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 2; j++) {
                const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) (p + 16 + 64 * j + 32 * h)), x88);
                lo[h][j] = _mm256_and_si256(v, m4);
                hi[h][j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
        for (int r = 0; r < n; r++) {
            const size_t ro = (size_t) (r0 + r);
            const int8_t * x = a->xq + ro * kp + 32 * b;
            const int64_t z = a->xzp[ro * (kp / 32) + b];
            const __m256i x0 = bcast8(x), x1 = bcast8(x + 8), x2 = bcast8(x + 16), x3 = bcast8(x + 24);
            __m256i d[2];
            for (int h = 0; h < 2; h++) {
                const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[h][0], x0), _mm256_maddubs_epi16(lo[h][1], x1)),
                                                   _mm256_add_epi16(_mm256_maddubs_epi16(hi[h][0], x2), _mm256_maddubs_epi16(hi[h][1], x3)));
                d[h] = _mm256_madd_epi16(s, ones);
            }
            const __m256i di = _mm256_add_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_set1_epi32((int32_t) z + (int32_t) (z >> 32)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(di), _mm256_mul_ps(dw, _mm256_set1_ps(a->dxl[ro * (kp / 4) + 8 * b])), acc[r]);
        }
    }
    x8_store_pairs(acc, n, r0, y, y_stride);
}

/* Q4_K repacked (X8): the 8 rows of a group at once, as on AVX512 (qmm_avx512.c), in 256-bit halves
 * (rows 0..3 and 4..7 of each 64-byte piece vector).  Per superblock the 8 x 8 sub-block scales and
 * minima are unpacked once for every activation row; per (activation row, weight row) in a fixed
 * order: a sub-block's four piece dots summed as int16 pairs (at most 4 * 2 * 15 * 127), times its
 * scale into int32 lanes (madd), the superblock's int32 sum times d and the activation block's scale;
 * the minima's integer sum against the activations' 32-value sums times -dmin and that scale, kept
 * apart; the lane pairs and that sum added at the end. */
static inline void x8dot_q4_K(const uint8_t * g, int64_t nsb, const struct dfk_act * a, int r0, int n, float * y,
                              size_t y_stride) {
    __m256 acc[X8_ROWS][2], accm[X8_ROWS];
    for (int r = 0; r < n; r++) acc[r][0] = acc[r][1] = accm[r] = _mm256_setzero_ps();
    const int64_t kp = a->kp;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m128i rep_lo = _mm_set_epi8(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m128i rep_hi = _mm_set_epi8(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t * p = g + (size_t) sb * 1152;
        if (r0 == 0) dfk_prefetch(p + DFK_PF_AHEAD, 1152);  /* the groups follow each other: one stream */
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p));
        const __m256 dm8 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p + 16))));
        /* d of rows 0..3 and 4..7 in lane pairs */
        const __m256 dlo = _mm256_permutevar8x32_ps(d8, _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0));
        const __m256 dhi = _mm256_permutevar8x32_ps(d8, _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4));
        /* sub-block s's 6-bit scales and minima, a row a byte (rows 0..7) */
        uint64_t sc8[8], m8[8];
        for (int s = 0; s < 8; s++) scales_mins_k4(p + 32 + 12 * s, &sc8[s], &m8[s]);  /* a row a byte */
        __m256i sc16[8][2];  /* a row's scale in its 4 int16 lanes, rows 0..3 / 4..7 */
        for (int s = 0; s < 8; s++) {
            const __m128i v = _mm_cvtsi64_si128((long long) sc8[s]);
            sc16[s][0] = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, rep_lo));
            sc16[s][1] = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, rep_hi));
        }
        __m256i mpair[4];  /* int16 pairs (m[2t][r], m[2t+1][r]) in lane r */
        for (int t = 0; t < 4; t++)
            mpair[t] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128((long long) m8[2 * t]),
                                                              _mm_cvtsi64_si128((long long) m8[2 * t + 1])));
        __m256i is[X8_ROWS][2];
        for (int r = 0; r < n; r++) is[r][0] = is[r][1] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const uint8_t * q = p + 128 + 256 * c;  /* pieces 4c .. 4c + 3, 64 bytes each */
            for (int r = 0; r < n; r++) {
                const int8_t * x = a->xq + (size_t) (r0 + r) * kp + 256 * sb + 64 * c;
                for (int h = 0; h < 2; h++) {
                    __m256i slo = _mm256_setzero_si256(), shi = _mm256_setzero_si256();
                    for (int j = 0; j < 4; j++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *) (q + 64 * j + 32 * h));
                        slo = _mm256_add_epi16(slo, _mm256_maddubs_epi16(_mm256_and_si256(v, m4), bcast8(x + 8 * j)));
                        shi = _mm256_add_epi16(shi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                                                         bcast8(x + 32 + 8 * j)));
                    }
                    is[r][h] = _mm256_add_epi32(is[r][h], _mm256_add_epi32(_mm256_madd_epi16(slo, sc16[2 * c][h]),
                                                                           _mm256_madd_epi16(shi, sc16[2 * c + 1][h])));
                }
            }
        }
        for (int r = 0; r < n; r++) {
            const size_t ro = (size_t) (r0 + r);
            const __m256 dx = _mm256_set1_ps(a->dxl[ro * (kp / 4) + sb]);
            const int32_t * bs = (const int32_t *) (a->xbs + ro * (kp / 32) + 8 * sb);  /* sub-block sum pairs */
            __m256i mi = _mm256_madd_epi16(mpair[0], _mm256_set1_epi32(bs[0]));
            for (int t = 1; t < 4; t++) mi = _mm256_add_epi32(mi, _mm256_madd_epi16(mpair[t], _mm256_set1_epi32(bs[t])));
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r][0]), _mm256_mul_ps(dlo, dx), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r][1]), _mm256_mul_ps(dhi, dx), acc[r][1]);
            accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mi), _mm256_mul_ps(dm8, dx), accm[r]);
        }
    }
    for (int r = 0; r < n; r++) {
        const __m256 s = _mm256_permutevar8x32_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), x8_pair_order());
        _mm256_storeu_ps((float *) ((char *) y + (size_t) (r0 + r) * y_stride), _mm256_add_ps(s, accm[r]));
    }
}

/* a repacked type's kernel over groups [c0, c1) (multiples of 8: run() splits columns so), X8_ROWS
 * activation rows at a time through x8dot_T over the row's BV-value blocks */
#define X8_FMUL(T, BV)                                                                                 \
    static void fmul_##T##x8_rows(const void * w, size_t w_row, int64_t c0, int64_t c1,                \
                                  const struct dfk_act * a, float * y, size_t y_stride) {              \
        for (int64_t c = c0; c < c1; c += 8)                                                           \
            for (int r0 = 0; r0 < a->n; r0 += X8_ROWS)                                                 \
                x8dot_##T((const uint8_t *) w + (size_t) c * w_row, a->k / BV, a, r0,                  \
                          a->n - r0 >= X8_ROWS ? X8_ROWS : a->n - r0, y + c, y_stride);                \
    }

X8_FMUL(q4_0, 32)
X8_FMUL(q4_K, 256)

/* Q8_0 in ggml's standard layout, 8 rows at a time as on AVX512 (qmm_avx512.c): each block of the 8
 * rows transposed in registers into two halves of 4 rows (8 bytes of each row a 64-bit element), kept
 * signed (vpmaddubsw's 16-bit pairs of |w| times x with w's sign stay below 2 * 128 * 127), its
 * absolute values and the 8 scales taken once for every activation row.  Per (activation row, weight
 * row) in a fixed order: each piece's pairs into int32 (madd), the four pieces summed, times the row's
 * d and the activation block's scale into a float lane pair; the pair summed at the end. */
static inline int ld16(const uint8_t * p) { uint16_t h; memcpy(&h, p, 2); return h; }

static inline void x8dot_q8_0(const uint8_t * g, size_t w_row, int64_t nb, const struct dfk_act * a, int r0, int n,
                              float * y, size_t y_stride) {
    __m256 acc[X8_ROWS][2];
    for (int r = 0; r < n; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t kp = a->kp;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t * p = g + (size_t) b * 34;
        if (r0 == 0) dfk_prefetch_next_group(g, w_row, nb, b);
        /* the 8 rows' scales (word inserts: a gather is microcoded and slow on AMD's AVX2 cores) */
        __m128i dh = _mm_cvtsi32_si128(ld16(p));
        dh = _mm_insert_epi16(dh, ld16(p + w_row), 1);
        dh = _mm_insert_epi16(dh, ld16(p + 2 * w_row), 2);
        dh = _mm_insert_epi16(dh, ld16(p + 3 * w_row), 3);
        dh = _mm_insert_epi16(dh, ld16(p + 4 * w_row), 4);
        dh = _mm_insert_epi16(dh, ld16(p + 5 * w_row), 5);
        dh = _mm_insert_epi16(dh, ld16(p + 6 * w_row), 6);
        dh = _mm_insert_epi16(dh, ld16(p + 7 * w_row), 7);
        const __m256 d8 = _mm256_cvtph_ps(dh);
        for (int h = 0; h < 2; h++) {
            const __m256 dw = _mm256_permutevar8x32_ps(d8, _mm256_add_epi32(_mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0),
                                                                              _mm256_set1_epi32(4 * h)));
            __m256i R[4], v[4], av[4];
            for (int i = 0; i < 4; i++) R[i] = _mm256_loadu_si256((const __m256i *) (p + (4 * h + i) * w_row + 2));
            const __m256i t0 = _mm256_unpacklo_epi64(R[0], R[1]), t1 = _mm256_unpackhi_epi64(R[0], R[1]);
            const __m256i t2 = _mm256_unpacklo_epi64(R[2], R[3]), t3 = _mm256_unpackhi_epi64(R[2], R[3]);
            v[0] = _mm256_permute2x128_si256(t0, t2, 0x20);  /* bytes 0..7 of rows 0..3 of the half */
            v[1] = _mm256_permute2x128_si256(t1, t3, 0x20);
            v[2] = _mm256_permute2x128_si256(t0, t2, 0x31);
            v[3] = _mm256_permute2x128_si256(t1, t3, 0x31);
            for (int j = 0; j < 4; j++) av[j] = _mm256_abs_epi8(v[j]);
            for (int r = 0; r < n; r++) {
                const size_t ro = (size_t) (r0 + r);
                const int8_t * x = a->xq + ro * kp + 32 * b;
                __m256i d = _mm256_setzero_si256();
                for (int j = 0; j < 4; j++)
                    d = _mm256_add_epi32(d, _mm256_madd_epi16(_mm256_maddubs_epi16(av[j], _mm256_sign_epi8(bcast8(x + 8 * j), v[j])), ones));
                const __m256 dx = _mm256_set1_ps(a->dxl[ro * (kp / 4) + 8 * b]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(dw, dx), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < n; r++) {
        const __m256 s = _mm256_permutevar8x32_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), x8_pair_order());
        _mm256_storeu_ps((float *) ((char *) y + (size_t) (r0 + r) * y_stride), s);
    }
}

/* whole groups of 8 rows by x8dot_q8_0, the last ne1 % 8 rows one at a time (as on AVX512) */
static void fmul_q8_0x8(const void * w, size_t w_row, int64_t c0, int64_t c1, const struct dfk_act * a, float * y,
                        size_t y_stride) {
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8)
        for (int r0 = 0; r0 < a->n; r0 += X8_ROWS)
            x8dot_q8_0((const uint8_t *) w + (size_t) c * w_row, w_row, a->k / 32, a, r0,
                       a->n - r0 >= X8_ROWS ? X8_ROWS : a->n - r0, y + c, y_stride);
    if (c < c1) fmul_q8_0(w, w_row, c, c1, a, y, y_stride);
}

#define DFK_FMUL_Q8_0 fmul_q8_0x8
#define DFK_FMUL_Q4_0_X8 fmul_q4_0x8_rows
#define DFK_FMUL_Q4_K_X8 fmul_q4_Kx8_rows
DFK_MUL(mul2)

static void quantize2(enum dfk_wtype t, const float * x, size_t x_stride, const struct dfk_act * a, int r0, int r1) {
    dfk_quantize(t, false, x, x_stride, a, r0, r1);
}

static bool takes2(enum dfk_wtype t, int64_t k) { return k > 0 && k % 32 == 0; }

/* six independent chains of the kernel's own dot: 32 multiply-adds each.  Each chain's input is
 * opaque to the compiler every pass (an empty asm; named variables, so they stay in registers): with
 * constant inputs it hoisted the dot out of the loop, which then timed additions only (the AVX2 peak
 * read 297 G MAC/s a thread). */
static int64_t mac_loop2(int64_t n) {
    const __m256i b = _mm256_set1_epi8(-2);
    __m256i a0 = _mm256_set1_epi8(3), a1 = _mm256_set1_epi8(4), a2 = _mm256_set1_epi8(5);
    __m256i a3 = _mm256_set1_epi8(6), a4 = _mm256_set1_epi8(7), a5 = _mm256_set1_epi8(8);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    for (int64_t i = 0; i < n; i += 192) {
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
        c0 = _mm256_add_epi32(c0, dot_u8(a0, b));
        c1 = _mm256_add_epi32(c1, dot_u8(a1, b));
        c2 = _mm256_add_epi32(c2, dot_u8(a2, b));
        c3 = _mm256_add_epi32(c3, dot_u8(a3, b));
        c4 = _mm256_add_epi32(c4, dot_u8(a4, b));
        c5 = _mm256_add_epi32(c5, dot_u8(a5, b));
    }
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                       _mm256_add_epi32(c4, c5));
    int32_t v[8];
    _mm256_storeu_si256((__m256i *) v, t);
    return (int64_t) v[0] + v[7];
}

static const struct dfk_isa isa = { "avx2", takes2, quantize2, mul2, mac_loop2, dfk_attn_avx2 };

const struct dfk_isa * dfk_isa_avx2(void) { return &isa; }
