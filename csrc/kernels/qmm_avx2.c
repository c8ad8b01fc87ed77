/* qmm.h's kernels for AVX2 (vpmaddubsw + vpmaddwd: four u8 x s8 products a lane).  Q8_0 weights stay
 * signed: |w| x sign(x, w) keeps vpmaddubsw's 16-bit pair sums from saturating. */
#include <immintrin.h>

typedef __m256i dfk_vi;
typedef __m256 dfk_vf;
#define DFK_VW 32
#define DFK_SIGNED_Q8 1
#define dfk_vi_load(p) _mm256_loadu_si256((const __m256i *) (p))
#define dfk_vf_load(p) _mm256_loadu_ps(p)
#define dfk_vf_zero() _mm256_setzero_ps()
#define dfk_vf_mul(a, b) _mm256_mul_ps(a, b)
#define dfk_vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define dfk_vf_cvt(a) _mm256_cvtepi32_ps(a)
/* |q| x sign(x, q): right for the signed Q8_0 values and for the other types' 0..63 alike */
#define dfk_dot(q, x) \
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), _mm256_set1_epi16(1))

static inline float dfk_vf_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#include "qmm_impl.h"

/* eight independent chains of the kernel's own dot (vpmaddubsw + vpmaddwd + add): 32 multiply-adds each */
static int64_t mac_loop2(int64_t n) {
    __m256i acc[8], a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_si256();
    for (int64_t i = 0; i < n; i += 256)
        for (int j = 0; j < 8; j++) acc[j] = _mm256_add_epi32(acc[j], dfk_dot(a, b));
    __m256i t = acc[0];
    for (int j = 1; j < 8; j++) t = _mm256_add_epi32(t, acc[j]);
    int32_t v[8];
    _mm256_storeu_si256((__m256i *) v, t);
    return (int64_t) v[0] + v[7];
}

static const struct dfk_isa isa = { "avx2", takes, quantize_rows, mul, mac_loop2 };

const struct dfk_isa * dfk_isa_avx2(void) { return &isa; }
