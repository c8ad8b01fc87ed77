/* The attention kernel (attn_impl.h) on 16 floats a vector (AVX512F). */
#include <immintrin.h>
#include <math.h>

#define VLEN 16
typedef __m512 VF;
#define ATTN_FN dfk_attn_avx512

static inline VF vld(const float * p) { return _mm512_loadu_ps(p); }
static inline void vst(float * p, VF x) { _mm512_storeu_ps(p, x); }
static inline VF vset1(float x) { return _mm512_set1_ps(x); }
static inline VF vzero(void) { return _mm512_setzero_ps(); }
static inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
static inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VF vcvth(const unsigned short * p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p)); }
static inline float f16_to_f32(unsigned short h) { return _cvtsh_ss(h); }
static inline unsigned vnonzero(VF x) { return _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_OQ); }
static inline float vred_max(VF x) { return _mm512_reduce_max_ps(x); }
static inline float vred_add(VF x) { return _mm512_reduce_add_ps(x); }

static inline VF vmask_add(VF s, VF m) {  /* s + m, -inf where m is */
    return _mm512_mask_mov_ps(_mm512_add_ps(s, m), _mm512_cmp_ps_mask(m, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                              _mm512_set1_ps(-INFINITY));
}

/* r[i] = the sum of a[i]'s lanes, by one fixed tree: pairs within 128-bit lanes, then 64-bit
 * halves, then the four 128-bit lanes */
static inline VF vhsum(const VF * a) {
    VF b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const VF d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const VF d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

/* exp(x) for x <= 0 (-inf: 0): 2^n e^r with |r| <= ln2 / 2, a degree-7 polynomial; below -87, 0 */
static inline VF vexp(VF x) {
    const VF xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const VF n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    VF r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    VF p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const VF y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), y);
}

#include "attn_impl.h"
