// The drafter's device-side pieces for targets on a CUDA device (built with -DDFLASH_CUDA=ON).
//
// The DFlash2 selector walk runs where the graph left its lattice: the scores (n x K x K per
// sequence) never cross to the host; only the drafted ids (and, when sampling, each slot's
// proposal q) come back.  Every function here has a CPU twin in drafter/select.c (dflash_walk)
// and a test comparing the two (tests/test_cuda.py, on a machine with a CUDA device).
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DFLASH_CUDA_MAX_K 32

// Scratch memory of one drafter on one device (grown on demand, freed with the drafter).
struct dflash_cuda_ctx;

// One walk over n_seq sequences' lattices, all on the device holding `cand`.
struct dflash_cuda_walk_args {
    const int32_t * cand;   // device: n_seq x n x K candidate ids (target vocabulary)
    const float * scores;   // device: n_seq x n x K x K, scores[k][a][b] as in dflash.h
    int32_t n_seq, n, K;    // K <= DFLASH_CUDA_MAX_K
    float temperature;      // > 0: sampled walk, one uniform per slot from `u`
    const double * u;       // host: n_seq x n uniforms in [0, 1) (sampled walk only)
    float p_min;            // greedy: cut at the first slot less confident than this
    bool want_conf;         // greedy: report each drafted slot's confidence
};

// Walk every lattice; out_tokens: n_seq x n ids, out_n: tokens per sequence, out_q (sampled,
// optional): n_seq x n x K proposal probabilities, out_conf (greedy, optional): n_seq x n.
// All outputs are host memory.  Returns 0, or -1 with a message.
int32_t dflash_cuda_walk(struct dflash_cuda_ctx ** ctx, const struct dflash_cuda_walk_args * a, int32_t * out_tokens,
                         int32_t * out_n, float * out_q, float * out_conf, char * err, size_t err_len);

// The same walk on host arrays (copied to the current device first): the twin tests' entry.
int32_t dflash_cuda_walk_host(const struct dflash_cuda_walk_args * a, int32_t * out_tokens, int32_t * out_n,
                              float * out_q, float * out_conf, char * err, size_t err_len);

void dflash_cuda_ctx_free(struct dflash_cuda_ctx * ctx);

// CUDA devices visible to this process (0 when the driver or a device is missing).
int32_t dflash_cuda_device_count(void);

#ifdef __cplusplus
}
#endif
