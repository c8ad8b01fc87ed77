// Timing verify batches and drafts on this machine: the cost model's curves.
#include "engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// The sizes timed (the rest interpolated): every size up to 6, then every other one.
static bool timed_size(int32_t k, int32_t last) { return k <= 6 || k % 2 == 0 || k == last; }

static void interpolate(double * t, int32_t n, const bool * have) {
    for (int32_t k = 1; k <= n; k++) {
        if (have[k - 1]) continue;
        int32_t lo = k - 1, hi = k + 1;
        while (!have[lo - 1]) lo--;
        while (!have[hi - 1]) hi++;
        t[k - 1] = t[lo - 1] + (t[hi - 1] - t[lo - 1]) * (k - lo) / (double) (hi - lo);
    }
}

int32_t dflash_engine_measure_costs(dflash_engine * e, int32_t n_rows, int32_t n_draft, struct dflash_costs * out,
                                    char * err, size_t err_len) {
    enum { REPS = 2, ROUNDS = 6 };
    if (n_rows < 1 || n_rows > DFLASH_MAX_DRAFT + 1) {
        dflash_seterr(err, err_len, "cost rows must be in 1..%d (got %d)", DFLASH_MAX_DRAFT + 1, n_rows);
        return -1;
    }
    if (n_draft < 0 || n_draft > DFLASH_MAX_DRAFT) {
        dflash_seterr(err, err_len, "cost draft length must be in 0..%d (got %d)", DFLASH_MAX_DRAFT, n_draft);
        return -1;
    }
    if (!e->drafter) n_draft = 0;
    if (e->drafter) {
        struct dflash_drafter_info info;
        dflash_drafter_get_info(e->drafter, &info);
        if (n_draft > dflash_max_draft(&info)) n_draft = dflash_max_draft(&info);
    }
    // a small context or batch times what fits (the model extrapolates the rest)
    if (n_rows > e->n_batch) n_rows = e->n_batch;
    if (n_rows > e->n_ctx / 2) n_rows = e->n_ctx / 2;
    if (n_draft > n_rows - 1) n_draft = n_rows - 1 > 0 ? n_rows - 1 : 0;
    int32_t prefix = 32 < e->n_batch ? 32 : e->n_batch;
    if (prefix > e->n_ctx - n_rows - 2) prefix = e->n_ctx - n_rows - 2;
    if (n_rows < 1 || prefix < 1) {
        dflash_seterr(err, err_len, "the context (%d) is too small to time verify batches", e->n_ctx);
        return -1;
    }
    int32_t toks[32 + DFLASH_MAX_DRAFT + 1];
    for (int32_t i = 0; i < prefix + n_rows; i++) toks[i] = (int32_t) ((1000 + 31 * i) % e->n_vocab);
    llama_memory_t mem = llama_get_memory(e->ctx);
    dflash_engine_forget(e);
    engine_clear_target(e);
    if (e->drafter) dflash_state_reset(e->st);
    struct dflash_costs c;
    memset(&c, 0, sizeof(c));
    c.n_rows = n_rows;
    c.n_draft = n_draft;
    double bv[DFLASH_MAX_DRAFT + 1], bd[DFLASH_MAX_DRAFT];  // each size's least time so far
    bool have[DFLASH_MAX_DRAFT + 1] = { false }, have_d[DFLASH_MAX_DRAFT] = { false };
    for (int32_t k = 0; k < DFLASH_MAX_DRAFT + 1; k++) bv[k] = INFINITY;
    for (int32_t n = 0; n < DFLASH_MAX_DRAFT; n++) bd[n] = INFINITY;
    const float * feats = NULL;
    float conf[DFLASH_MAX_DRAFT];
    int32_t dtok[DFLASH_MAX_DRAFT];
    int32_t rc = engine_decode(e, toks, prefix, 0, prefix, &feats, err, err_len);
    if (rc == 0 && e->drafter) rc = dflash_state_push(e->st, feats, prefix, err, err_len);
    // A recurrent state cannot drop a whole batch (its snapshots reach back to the batch's first row
    // only): after each timed batch the sequence's saved state after the prefix is restored instead.
    uint8_t * saved = NULL;
    size_t n_saved = 0;
    if (rc == 0 && e->rs_memory) {
        n_saved = llama_state_seq_get_size(e->ctx, e->seq);
        saved = malloc(n_saved ? n_saved : 1);
        if (!saved || llama_state_seq_get_data(e->ctx, saved, n_saved, e->seq) != n_saved) {
            dflash_seterr(err, err_len, "cannot save the target's state to time verify batches");
            rc = -1;
        }
    }
    // Rounds until the curves have a shape a machine can have: a size timed while something else
    // held the cores is timed again (its least time kept), not cached for good.
    for (int32_t round = 0; rc == 0 && round < ROUNDS; round++) {
        const int32_t reps = round == 0 ? REPS : 1;
        // (round 0: a warm-up batch first) each size as a verify step decodes it: every row's logits
        for (int32_t k = round == 0 ? 0 : 1; rc == 0 && k <= n_rows; k++) {
            if (k > 0 && !timed_size(k, n_rows)) continue;
            for (int32_t r = 0; rc == 0 && r < reps; r++) {
                const double t0 = dflash_now();
                rc = engine_decode(e, toks + prefix, k > 0 ? k : 1, prefix, 0, &feats, err, err_len);
                const double t = dflash_now() - t0;
                if (k > 0 && t < bv[k - 1]) bv[k - 1] = t;
                const bool back = saved ? llama_state_seq_set_data(e->ctx, saved, n_saved, e->seq) == n_saved
                                        : llama_memory_seq_rm(mem, e->seq, prefix, -1);
                if (rc == 0 && !back) {
                    dflash_seterr(err, err_len, "the target's memory cannot roll back a timed batch");
                    rc = -1;
                }
            }
            if (k > 0) have[k - 1] = true;
        }
        // drafts as an adaptive step makes them (with each slot's confidence); round 0's first one
        // also injects the prefix's features and is not timed
        for (int32_t n = round == 0 ? 0 : 1; rc == 0 && e->drafter && n <= n_draft; n++) {
            if (n > 0 && !timed_size(n, n_draft)) continue;
            for (int32_t r = 0; rc == 0 && r < reps; r++) {
                const double t0 = dflash_now();
                if (dflash_state_draft(e->st, toks[prefix], n > 0 ? n : 1, 0.0f, NULL, dtok, conf, NULL, err,
                                       err_len) < 0) {
                    rc = -1;
                }
                const double t = dflash_now() - t0;
                if (n > 0 && t < bd[n - 1]) bd[n - 1] = t;
            }
            if (n > 0) have_d[n - 1] = true;
        }
        memcpy(c.t_verify, bv, sizeof(double) * (size_t) n_rows);
        memcpy(c.t_draft, bd, sizeof(double) * (size_t) n_draft);
        interpolate(c.t_verify, n_rows, have);
        interpolate(c.t_draft, n_draft, have_d);
        if (dflash_costs_plausible(&c)) break;
    }
    free(saved);
    engine_clear_target(e);
    if (e->drafter) dflash_state_reset(e->st);
    if (rc != 0) return -1;
    dflash_engine_set_costs(e, &c);
    if (out) *out = c;
    return 0;
}
