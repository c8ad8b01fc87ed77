// Verification's sampling math: the greedy token, the request's sampler chain row by row, and
// speculative rejection sampling against the drafter's proposal q.
#include "engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// Greedy choice over one row of logits, with the top-1 minus top-2 margin.
int32_t engine_argmax_margin(const float * row, int32_t n, float * margin) {
    int32_t best = 0;
    float b1 = -INFINITY, b2 = -INFINITY;
    for (int32_t i = 0; i < n; i++) {
        const float v = row[i];
        if (v > b1) {
            b2 = b1;
            b1 = v;
            best = i;
        } else if (v > b2) {
            b2 = v;
        }
    }
    if (margin) *margin = b1 - b2;
    return best;
}

// The target's sampling distribution for one verify row: the request's transforms
// (penalties, grammar, top-k/p, min-p, temperature, ...) applied to the row's logits,
// then the softmax of what survives -- exactly what the chain's dist sampler draws from.
static void target_probs(struct dflash_engine * e, int32_t row, struct llama_sampler * transforms) {
    const float * lg = llama_get_logits_ith(e->ctx, engine_row_of(e, row));
    for (int32_t v = 0; v < e->n_vocab; v++) {
        e->cur[v].id = v;
        e->cur[v].logit = lg[v];
        e->cur[v].p = 0.0f;
    }
    llama_token_data_array arr = { e->cur, (size_t) e->n_vocab, -1, false };
    if (transforms) llama_sampler_apply(transforms, &arr);
    memset(e->p, 0, sizeof(float) * (size_t) e->n_vocab);
    float mx = -INFINITY;
    for (size_t i = 0; i < arr.size; i++) mx = arr.data[i].logit > mx ? arr.data[i].logit : mx;
    if (!isfinite(mx)) return; // everything masked: sample_dense falls back to the argmax
    double sum = 0.0;
    for (size_t i = 0; i < arr.size; i++) {
        const float l = arr.data[i].logit;
        if (isfinite(l)) sum += exp((double) l - mx);
    }
    for (size_t i = 0; i < arr.size; i++) {
        const float l = arr.data[i].logit;
        if (isfinite(l)) e->p[arr.data[i].id] = (float) (exp((double) l - mx) / sum);
    }
}

// Inverse-CDF draw from a dense non-negative vector (not necessarily normalised).
static int32_t sample_dense(const float * w, int32_t n, double total, struct dflash_rng * rng) {
    const double u = dflash_rng_uniform(rng) * total;
    double c = 0.0;
    int32_t last = -1;
    for (int32_t v = 0; v < n; v++) {
        if (w[v] <= 0.0f) continue;
        c += w[v];
        last = v;
        if (u < c) return v;
    }
    return last >= 0 ? last : 0;
}

// May `token` follow what the grammar has accepted?  (A one-candidate apply: no state change.)
bool engine_grammar_allowed(void * grammar, int32_t token) {
    llama_token_data one = { token, 0.0f, 0.0f };
    llama_token_data_array arr = { &one, 1, -1, false };
    llama_sampler_apply((struct llama_sampler *) grammar, &arr);
    return isfinite(one.logit);
}

void engine_grammar_accept(void * grammar, int32_t token) {
    llama_sampler_accept((struct llama_sampler *) grammar, token);
}

// One committed token of row `row` (match: the chain samples it and accepts it into
// its own state).  margin (optional): the row's raw top-1 minus top-2 logit.
int32_t engine_pick_token(struct dflash_engine * e, const struct dflash_engine_params * prm, int32_t row,
                          float * margin) {
    const float * lg = llama_get_logits_ith(e->ctx, engine_row_of(e, row));
    if (prm->mode != DFLASH_VERIFY_GREEDY && margin) engine_argmax_margin(lg, e->n_vocab, margin);
    if (prm->mode == DFLASH_VERIFY_MATCH) {
        if (prm->grammar_argmax && prm->grammar) {
            const int32_t best = engine_argmax_margin(lg, e->n_vocab, NULL);
            if (engine_grammar_allowed(prm->grammar, best)) {
                e->stats.grammar_argmax++;
                llama_sampler_accept(prm->sampler, best);
                return best;
            }
        }
        return llama_sampler_sample(prm->sampler, e->ctx, engine_row_of(e, row));
    }
    if (prm->mode == DFLASH_VERIFY_REJECTION) {
        target_probs(e, row, prm->sampler);
        const int32_t tok = sample_dense(e->p, e->n_vocab, 1.0, &e->rng);
        if (prm->sampler) llama_sampler_accept(prm->sampler, tok);
        return tok;
    }
    return engine_argmax_margin(lg, e->n_vocab, margin);
}


// Speculative sampling: keep d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection draw
// from the residual max(0, p - q) (or p when it is empty).  The chain accepts the committed token.
bool engine_rejection_accept(struct dflash_engine * e, int32_t i, const int32_t * drafts, int32_t * tok) {
    const struct dflash_engine_params * params = &e->prm;
    const int32_t q_k = e->plan.q_k;
    target_probs(e, i, params->sampler);
    const int32_t * c = e->q_cand + (size_t) i * q_k;
    const float * q = e->q_prob + (size_t) i * q_k;
    float qd = 0.0f;
    for (int32_t j = 0; j < q_k; j++) qd += c[j] == drafts[i] ? q[j] : 0.0f;
    bool kept;
    if (dflash_rng_uniform(&e->rng) * qd < e->p[drafts[i]]) {
        *tok = drafts[i];
        kept = true;
    } else {
        for (int32_t j = 0; j < q_k; j++) {
            const float r = e->p[c[j]] - q[j];
            e->p[c[j]] = r > 0.0f ? r : 0.0f;
        }
        double total = 0.0;
        for (int32_t v = 0; v < e->n_vocab; v++) total += e->p[v];
        if (total <= 0.0) {
            target_probs(e, i, params->sampler);
            total = 1.0;
        }
        *tok = sample_dense(e->p, e->n_vocab, total, &e->rng);
        kept = false;
    }
    if (params->sampler) llama_sampler_accept(params->sampler, *tok);
    return kept;
}
