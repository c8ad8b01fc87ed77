/* The attention kernel (attn_impl.h) on 8 floats a vector (AVX2, FMA, F16C). */
#include <immintrin.h>
#include <math.h>

#define VLEN 8
typedef __m256 VF;
#define ATTN_FN dfk_attn_avx2

static inline VF vld(const float * p) { return _mm256_loadu_ps(p); }
static inline void vst(float * p, VF x) { _mm256_storeu_ps(p, x); }
static inline VF vset1(float x) { return _mm256_set1_ps(x); }
static inline VF vzero(void) { return _mm256_setzero_ps(); }
static inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
static inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VF vcvth(const unsigned short * p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p)); }
static inline float f16_to_f32(unsigned short h) { return _cvtsh_ss(h); }
static inline unsigned vnonzero(VF x) { return (unsigned) _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NEQ_OQ)); }

static inline float vred_max(VF x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float vred_add(VF x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline VF vmask_add(VF s, VF m) {  /* s + m, -inf where m is */
    const VF ninf = _mm256_set1_ps(-INFINITY);
    return _mm256_blendv_ps(_mm256_add_ps(s, m), ninf, _mm256_cmp_ps(m, ninf, _CMP_EQ_OQ));
}

/* r[i] = the sum of a[i]'s lanes, by one fixed tree: pairs within 128-bit lanes, then 64-bit
 * halves, then the two 128-bit lanes */
static inline VF vhsum(const VF * a) {
    VF b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
        c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}

/* exp(x) for x <= 0 (-inf: 0): 2^n e^r with |r| <= ln2 / 2, a degree-7 polynomial; below -87, 0 */
static inline VF vexp(VF x) {
    const VF xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const VF n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    VF r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    VF p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const VF y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

#include "attn_impl.h"
