// Choosing the drafted tokens on the host, from each slot's few candidates that the
// graph returns: greedy, greedy with a p_min cut-off, under a token filter (grammar),
// or sampled (the proposal q of rejection sampling); DFlash2 walks its lattice.
#include "drafter.h"

#include "common.h"
#include "walk_math.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef DFLASH_CUDA
#include "cuda/dflash_cuda.h"
#endif


// The slot's choice among its k candidates x[0..k) (ids c) under the filter: greedy takes
// the best allowed one, sampling draws from softmax(x / T) over the allowed ones (q of the
// rest is 0).  Returns the index, or -1 when nothing is allowed; the choice is accepted
// into the filter.
int32_t dflash_choose(const float * x, const int32_t * c, int32_t k, struct dflash_sample_req * samp, float * q) {
    struct dflash_token_filter * f = samp ? samp->filter : NULL;
    float masked[DFLASH_V1_SAMPLE_K > DFLASH_MAX_TOP_K ? DFLASH_V1_SAMPLE_K : DFLASH_MAX_TOP_K];
    const float * row = x;
    if (f) {
        int32_t best = -1, n_ok = 0, top = 0;
        for (int32_t j = 0; j < k; j++) {
            top = x[j] > x[top] ? j : top;
            const bool ok = f->allowed(f->ud, c[j]);
            masked[j] = ok ? x[j] : -INFINITY;
            if (ok) {
                n_ok++;
                if (best < 0 || x[j] > x[best]) best = j;
            }
        }
        if (n_ok == 0) {
            f->cut = true;
            return -1;
        }
        if (best != top) f->n_skipped++;
        row = masked;
    }
    const int32_t pick = samp && samp->rng ? dflash_sample_k(row, k, samp->temperature, dflash_rng_uniform(samp->rng), q)
                                           : dflash_argmax_k(row, k);
    if (f) f->accept(f->ud, c[pick]);
    return pick;
}

// DFlash2: walk one block's lattice from its anchor (greedy, sampled, or greedy with
// a p_min cut-off); returns the tokens produced.
int32_t dflash_walk(const struct dflash_drafter_info * hp, const int32_t * cand, const float * scores, int32_t n,
                    int32_t * out_tokens, struct dflash_sample_req * samp) {
    const int32_t K = hp->selector_top_k;
    int32_t prev = 0;
    for (int32_t k = 0; k < n; k++) {
        const float * row = scores + ((size_t) k * K + prev) * K;
        // sampled walk: q conditioned on the drafted predecessor
        const int32_t best = dflash_choose(row, cand + (size_t) k * K, K, samp, samp ? samp->q + (size_t) k * K : NULL);
        if (best < 0) return k;
        if (samp && samp->rng) {
            memcpy(samp->cand + (size_t) k * K, cand + (size_t) k * K, sizeof(int32_t) * K);
        } else if (samp && (samp->p_min > 0.0f || samp->conf)) {
            const float c = dflash_softmax_at_k(row, K, best);
            if (c < samp->p_min) return k;
            if (samp->conf) samp->conf[k] = c;
        }
        out_tokens[k] = cand[k * K + best];
        prev = best;
    }
    return n;
}

// DFlash v1: every slot chosen independently among its K best (logits x, ids cand), or the
// draft cut at the first slot below p_min; returns the tokens produced.
int32_t dflash_choose_v1(const float * logits, int32_t * cand, int32_t n, int32_t K, int32_t * out_tokens,
                         struct dflash_sample_req * samp) {
    for (int32_t k = 0; k < n; k++) {
        const float * x = logits + (size_t) k * K;
        const int32_t j = dflash_choose(x, cand + (size_t) k * K, K, samp, samp->q + (size_t) k * K);
        if (j < 0) return k;
        if (!samp->rng && (samp->p_min > 0.0f || samp->conf)) {
            const float c = dflash_softmax_at_k(x, K, j);
            if (c < samp->p_min) return k;
            if (samp->conf) samp->conf[k] = c;
        }
        out_tokens[k] = cand[(size_t) k * K + j];
    }
    return n;
}

int32_t dflash_cuda_devices(void) {
#ifdef DFLASH_CUDA
    return dflash_cuda_device_count();
#else
    return 0;
#endif
}

int32_t dflash_walk_lattice(int32_t on_cuda, const int32_t * cand, const float * scores, int32_t n, int32_t K,
                            float temperature, uint64_t seed, float p_min, int32_t * out_tokens, float * out_q,
                            float * out_conf, char * err, size_t err_len) {
    if (n < 1 || n > DFLASH_MAX_DRAFT || K < 1 || K > DFLASH_MAX_TOP_K) {
        dflash_seterr(err, err_len, "walk_lattice: n %d must be in 1..%d and K %d in 1..%d", n, DFLASH_MAX_DRAFT, K,
                      DFLASH_MAX_TOP_K);
        return -1;
    }
    struct dflash_rng rng;
    dflash_rng_seed(&rng, seed);
    const bool sampled = temperature > 0.0f;
    if (on_cuda) {
#ifdef DFLASH_CUDA
        double u[DFLASH_MAX_DRAFT];
        for (int32_t k = 0; k < n && sampled; k++) u[k] = dflash_rng_uniform(&rng);
        struct dflash_cuda_walk_args a = { cand, scores, 1, n, K, sampled ? temperature : 0.0f, sampled ? u : NULL,
                                           sampled ? 0.0f : p_min, !sampled && out_conf != NULL };
        int32_t got = 0;
        if (dflash_cuda_walk_host(&a, out_tokens, &got, out_q, out_conf, err, err_len) != 0) return -1;
        return got;
#else
        dflash_seterr(err, err_len, "this build of llama-dflash has no CUDA (scripts/setup.sh --cuda)");
        return -1;
#endif
    }
    struct dflash_drafter_info hp;
    memset(&hp, 0, sizeof(hp));
    hp.selector_top_k = K;
    int32_t * c = malloc(sizeof(int32_t) * (size_t) n * K);
    float * q = out_q ? out_q : malloc(sizeof(float) * (size_t) n * K);
    struct dflash_sample_req req = { sampled ? temperature : 1.0f, sampled ? &rng : NULL, c, q, K,
                                     sampled ? 0.0f : p_min, sampled ? NULL : out_conf, 0, NULL };
    const int32_t got = dflash_walk(&hp, cand, scores, n, out_tokens, &req);
    free(c);
    if (q != out_q) free(q);
    return got;
}
