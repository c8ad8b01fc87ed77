// The selection arithmetic of one slot, shared by the host walk (select.c) and its CUDA twin
// (cuda/walk.cu): one definition, so that the two choose alike by construction.
#pragma once

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define DFLASH_HD __host__ __device__
#else
#define DFLASH_HD
#endif

// Index of the first maximum of x[0..k).
static inline DFLASH_HD int32_t dflash_argmax_k(const float * x, int32_t k) {
    int32_t pick = 0;
    for (int32_t j = 1; j < k; j++) pick = x[j] > x[pick] ? j : pick;
    return pick;
}

// Softmax probability of x[j] among x[0..k) at temperature 1 (in double: the p_min cut-off).
static inline DFLASH_HD float dflash_softmax_at_k(const float * x, int32_t k, int32_t j) {
    float mx = x[0];
    for (int32_t i = 1; i < k; i++) mx = x[i] > mx ? x[i] : mx;
    double sum = 0.0;
    for (int32_t i = 0; i < k; i++) sum += exp((double) x[i] - mx);
    return (float) (exp((double) x[j] - mx) / sum);
}

// Index j ~ softmax(x / T) over x[0..k) for the uniform u in [0, 1); q receives the probabilities.
static inline DFLASH_HD int32_t dflash_sample_k(const float * x, int32_t k, float T, double u, float * q) {
    float mx = x[0];
    for (int32_t j = 1; j < k; j++) mx = x[j] > mx ? x[j] : mx;
    double sum = 0.0;
    for (int32_t j = 0; j < k; j++) {
        q[j] = expf((x[j] - mx) / T);
        sum += q[j];
    }
    const double target = u * sum;
    double c = 0.0;
    int32_t pick = k - 1;
    for (int32_t j = 0; j < k; j++) {
        c += q[j];
        if (target < c && pick == k - 1) pick = j;
        q[j] = (float) (q[j] / sum);
    }
    return pick;
}
