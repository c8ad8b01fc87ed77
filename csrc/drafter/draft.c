// One drafter graph run (inputs, compute, outputs to the host) and the public
// draft calls: single sequence (greedy, p_min / filter, sampled) and batched.
#include "drafter.h"

#include "common.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef DFLASH_CUDA
#include "cuda/dflash_cuda.h"

static bool on_cuda(const struct ggml_tensor * t) {
    if (!t->buffer || ggml_backend_buffer_is_host(t->buffer) || !ggml_is_contiguous(t)) return false;
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    return dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU &&
           strncmp(ggml_backend_dev_name(dev), "CUDA", 4) == 0;
}

// DFlash2 with the lattice in CUDA memory: walk it there (dflash_walk's twin); only the ids and,
// when sampling, q come back (run_graph has read the candidates).  A token filter (host callbacks)
// keeps the host walk.  Returns 1 when walked, 0 when the host must walk, -1 on error.
static int32_t walk_on_device(struct dflash_drafter * d, const struct dflash_graph * G, struct dflash_state ** sts,
                              int32_t n_seq, int32_t n, int32_t * out_tokens, struct dflash_sample_req * samp,
                              char * err, size_t err_len) {
    const int32_t K = d->hp.selector_top_k;
    if ((samp && samp->filter) || K > DFLASH_CUDA_MAX_K || !on_cuda(G->cand) || !on_cuda(G->scores)) return 0;
    const bool sampled = samp && samp->rng;
    double u[DFLASH_MAX_DRAFT];
    if (sampled) {
        for (int32_t k = 0; k < n; k++) u[k] = dflash_rng_uniform(samp->rng); // the host walk's draws, in order
    }
    struct dflash_cuda_walk_args a = {
        (const int32_t *) G->cand->data, (const float *) G->scores->data, n_seq, n, K,
        sampled ? samp->temperature : 0.0f, sampled ? u : NULL, samp && !sampled ? samp->p_min : 0.0f,
        samp && !sampled && samp->conf,
    };
    int32_t got[DFLASH_MAX_SEQ];
    if (dflash_cuda_walk(&d->cuda, &a, out_tokens, got, sampled ? samp->q : NULL, samp ? samp->conf : NULL,
                         err, err_len) != 0) {
        return -1;
    }
    for (int32_t s = 0; s < n_seq; s++) sts[s]->scores_on_device = true;
    if (samp) {
        if (sampled) memcpy(samp->cand, sts[0]->last_cand, sizeof(int32_t) * (size_t) n * K);
        samp->k = K;
        samp->n_out = got[0];
    }
    return 1;
}
#endif

// Run one graph over n_seq states: inject their pending rows (which become cached)
// and, if n_block > 0, draft a block of n_block rows after each anchor: n_block - 1 tokens
// (n_block with sample_from_anchor).  out_tokens / out_logits hold n_seq consecutive rows of
// them.  samp (one state only) requests sampling or a p_min cut-off.
int32_t dflash_run_graph(struct dflash_drafter * d, struct dflash_state ** sts, int32_t n_seq,
                         const int32_t * anchors, int32_t n_block, int32_t * out_tokens, float * out_logits,
                         struct dflash_sample_req * samp, char * err, size_t err_len) {
    const struct dflash_drafter_info * hp = &d->hp;
    struct dflash_graph G;
    const bool want_probs = samp && samp->conf && !samp->rng && hp->version == 2 && n_seq == 1;
    if (!dflash_build_graph(d, &G, sts, n_seq, n_block, out_logits != NULL, samp && hp->version == 1, want_probs)) {
        dflash_seterr(err, err_len, "failed to build the drafter graph");
        return -1;
    }
    ggml_backend_sched_reset(d->sched);
    if (!ggml_backend_sched_alloc_graph(d->sched, G.gf)) {
        ggml_free(G.ctx);
        dflash_seterr(err, err_len, "failed to allocate the drafter graph");
        return -1;
    }
    for (int32_t s = 0; s < n_seq; s++) {
        struct dflash_state * st = sts[s];
        if (!G.feat[s]) continue;
        ggml_backend_tensor_set(G.feat[s], st->pending, 0, sizeof(float) * (size_t) st->n_pending * d->n_embd_inp);
        int32_t * pos = malloc(sizeof(int32_t) * st->n_pending);
        for (int32_t i = 0; i < st->n_pending; i++) pos[i] = st->n_cached + i;
        ggml_backend_tensor_set(G.feat_pos[s], pos, 0, sizeof(int32_t) * st->n_pending);
        free(pos);
    }
    if (n_block > 0) {
        const size_t N = (size_t) n_block * n_seq;
        int32_t * buf = malloc(sizeof(int32_t) * N * 2);
        for (int32_t s = 0; s < n_seq; s++) {
            const int32_t a = sts[s]->n_cached + sts[s]->n_pending;
            for (int32_t i = 0; i < n_block; i++) {
                buf[s * n_block + i] = i == 0 ? anchors[s] : hp->mask_token_id;
                buf[N + s * n_block + i] = a + i;
            }
        }
        ggml_backend_tensor_set(G.tokens, buf, 0, sizeof(int32_t) * N);
        ggml_backend_tensor_set(G.block_pos, buf + N, 0, sizeof(int32_t) * N);
        free(buf);
        if (G.anchor) ggml_backend_tensor_set(G.anchor, anchors, 0, sizeof(int32_t) * n_seq);
        for (int32_t s = 0; s < n_seq; s++) {
            const int32_t a = sts[s]->n_cached + sts[s]->n_pending;
            float * m = NULL;
            for (int k = 0; k < DFLASH_MASK_KINDS; k++) {
                if (!G.mask[k][s]) continue;
                if (!m) m = malloc(sizeof(float) * (size_t) G.n_kv[s] * n_block);
                dflash_fill_mask(m, G.n_kv[s], G.n_kv_used[s], n_block, a, k & 1, k & 2 ? hp->n_swa : 0);
                ggml_backend_tensor_set(G.mask[k][s], m, 0, sizeof(float) * (size_t) G.n_kv[s] * n_block);
            }
            free(m);
        }
    }
    enum ggml_status status = ggml_backend_sched_graph_compute(d->sched, G.gf);
    if (status != GGML_STATUS_SUCCESS) {
        ggml_free(G.ctx);
        dflash_seterr(err, err_len, "drafter graph compute failed (status %d)", (int) status);
        return -1;
    }
    for (int32_t s = 0; s < n_seq; s++) {
        sts[s]->n_cached += sts[s]->n_pending;
        sts[s]->n_pending = 0;
    }
    const int32_t n = n_block - (hp->sample_from_anchor ? 0 : 1);
    if (n_block > 0 && hp->version == 2) {
        const int32_t K = hp->selector_top_k;
        const size_t nk = (size_t) n * K;
        for (int32_t s = 0; s < n_seq; s++) {
            ggml_backend_tensor_get(G.cand, sts[s]->last_cand, sizeof(int32_t) * nk * s, sizeof(int32_t) * nk);
            sts[s]->last_n = n;
        }
        int32_t walked = 0;
#ifdef DFLASH_CUDA
        walked = walk_on_device(d, &G, sts, n_seq, n, out_tokens, samp, err, err_len);
        if (walked < 0) {
            ggml_free(G.ctx);
            return -1;
        }
#endif
        for (int32_t s = 0; s < n_seq && !walked; s++) {
            struct dflash_state * st = sts[s];
            ggml_backend_tensor_get(G.scores, st->last_scores, sizeof(float) * nk * K * s, sizeof(float) * nk * K);
            st->scores_on_device = false;
            const int32_t got = dflash_walk(hp, st->last_cand, st->last_scores, n, out_tokens + (size_t) s * n, samp);
            if (samp) {
                samp->k = K;
                samp->n_out = got;
            }
        }
        if (want_probs && G.cand_p) {
            // each slot's confidence: no more than the unary head gives its token (whichever walk ran)
            float * p = malloc(sizeof(float) * nk);
            if (!p) {
                ggml_free(G.ctx);
                dflash_seterr(err, err_len, "out of memory");
                return -1;
            }
            ggml_backend_tensor_get(G.cand_p, p, 0, sizeof(float) * nk);
            for (int32_t k = 0; k < samp->n_out; k++) {
                for (int32_t b = 0; b < K; b++) {
                    if (sts[0]->last_cand[(size_t) k * K + b] != out_tokens[k]) continue;
                    samp->conf[k] = fminf(samp->conf[k], p[(size_t) k * K + b]);
                    break;
                }
            }
            free(p);
        }
    } else if (n_block > 0 && samp) {
        // v1: every slot sampled independently from its top candidates (or cut at p_min)
        const int32_t K = (int32_t) G.cand->ne[0];
        float * lg = malloc(sizeof(float) * (size_t) n * K);
        ggml_backend_tensor_get(G.cand, samp->cand, 0, sizeof(int32_t) * (size_t) n * K);
        ggml_backend_tensor_get(G.scores, lg, 0, sizeof(float) * (size_t) n * K);
        samp->n_out = dflash_choose_v1(lg, samp->cand, n, K, out_tokens, samp);
        free(lg);
        samp->k = K;
    } else if (n_block > 0) {
        ggml_backend_tensor_get(G.argmax, out_tokens, 0, sizeof(int32_t) * (size_t) n * n_seq);
        if (d->d2t_host) {
            for (int32_t i = 0; i < n * n_seq; i++) out_tokens[i] = d->d2t_host[out_tokens[i]];
        }
    }
    if (n_block > 0 && out_logits) {
        const size_t rows = (size_t) n * n_seq;
        if (!d->d2t_host) {
            ggml_backend_tensor_get(G.logits, out_logits, 0, sizeof(float) * rows * hp->n_vocab);
        } else {
            // target-vocabulary rows, -inf where the drafter cannot propose (as upstream scatters them)
            const size_t nd = (size_t) hp->n_vocab_draft;
            float * tmp = malloc(sizeof(float) * rows * nd);
            if (!tmp) {
                ggml_free(G.ctx);
                dflash_seterr(err, err_len, "out of memory scattering the draft logits");
                return -1;
            }
            ggml_backend_tensor_get(G.logits, tmp, 0, sizeof(float) * rows * nd);
            for (size_t r = 0; r < rows; r++) {
                float * o = out_logits + r * hp->n_vocab;
                for (int32_t v = 0; v < hp->n_vocab; v++) o[v] = -INFINITY;
                for (size_t j = 0; j < nd; j++) o[d->d2t_host[j]] = tmp[r * nd + j];
            }
            free(tmp);
        }
    }
    ggml_free(G.ctx);
    return 0;
}

static bool check_draft_args(const dflash_state * st, int32_t anchor, int32_t n, char * err, size_t err_len) {
    const struct dflash_drafter_info * hp = &st->d->hp;
    const int32_t n_max = dflash_max_draft(hp);
    if (n < 1 || n > n_max) {
        dflash_seterr(err, err_len, "draft length %d is outside 1..%d (block size %d)", n, n_max, hp->block_size);
        return false;
    }
    if (anchor < 0 || anchor >= hp->n_vocab) {
        dflash_seterr(err, err_len, "anchor token %d is outside the vocabulary", anchor);
        return false;
    }
    if (st->n_cached + st->n_pending + dflash_block_rows(hp, n) > hp->n_ctx) {
        dflash_seterr(err, err_len, "drafter context overflow: %d positions + block %d exceed n_ctx %d",
                      st->n_cached + st->n_pending, dflash_block_rows(hp, n), hp->n_ctx);
        return false;
    }
    return true;
}

int32_t dflash_drafter_draft_batch(dflash_drafter * d, dflash_state ** states, int32_t n_seq, const int32_t * anchors,
                                   int32_t n, int32_t * out_tokens, float * out_logits, char * err, size_t err_len) {
    if (n_seq < 1 || n_seq > DFLASH_MAX_SEQ) {
        dflash_seterr(err, err_len, "a batched draft takes 1..%d sequences (got %d)", DFLASH_MAX_SEQ, n_seq);
        return -1;
    }
    for (int32_t s = 0; s < n_seq; s++) {
        if (!states[s] || states[s]->d != d) {
            dflash_seterr(err, err_len, "state %d does not belong to this drafter", s);
            return -1;
        }
        for (int32_t r = 0; r < s; r++) {
            if (states[r] == states[s]) {
                dflash_seterr(err, err_len, "state %d appears twice in the batch", s);
                return -1;
            }
        }
        if (!check_draft_args(states[s], anchors[s], n, err, err_len)) return -1;
    }
    const int32_t rows = dflash_block_rows(&d->hp, n);
    return dflash_run_graph(d, states, n_seq, anchors, rows, out_tokens, out_logits, NULL, err, err_len) ? -1 : n;
}

// ---- drafts of one state (the drafter's own: the single-sequence API) -----------

int32_t dflash_state_draft(dflash_state * st, int32_t anchor, int32_t n, float p_min,
                           struct dflash_token_filter * filter, int32_t * out_tokens, float * out_conf,
                           float * out_logits, char * err, size_t err_len) {
    struct dflash_drafter * d = st->d;
    if (!check_draft_args(st, anchor, n, err, err_len)) return -1;
    const int32_t rows = dflash_block_rows(&d->hp, n);
    if (!(p_min > 0.0f) && !filter && !out_conf) {
        return dflash_run_graph(d, &st, 1, &anchor, rows, out_tokens, out_logits, NULL, err, err_len) ? -1 : n;
    }
    // the cut-off needs each slot's candidates: v1 runs its top-K path, v2 its lattice
    const int32_t K = d->hp.version == 2 ? d->hp.selector_top_k : DFLASH_V1_SAMPLE_K;
    int32_t * cand = malloc(sizeof(int32_t) * (size_t) n * K);
    float * q = malloc(sizeof(float) * (size_t) n * K);
    struct dflash_sample_req req = { 1.0f, NULL, cand, q, 0, p_min, out_conf, 0, filter };
    const int32_t rc = dflash_run_graph(d, &st, 1, &anchor, rows, out_tokens, out_logits, &req, err, err_len);
    free(cand);
    free(q);
    return rc ? -1 : req.n_out;
}

int32_t dflash_drafter_draft(dflash_drafter * d, int32_t anchor, int32_t n, float p_min,
                             struct dflash_token_filter * filter, int32_t * out_tokens, float * out_conf,
                             float * out_logits, char * err, size_t err_len) {
    return dflash_state_draft(d->def, anchor, n, p_min, filter, out_tokens, out_conf, out_logits, err, err_len);
}

int32_t dflash_state_draft_sample(dflash_state * st, int32_t anchor, int32_t n, float temperature,
                                  struct dflash_rng * rng, struct dflash_token_filter * filter,
                                  int32_t * out_tokens, int32_t * out_cand, float * out_q, int32_t * out_k,
                                  char * err, size_t err_len) {
    struct dflash_drafter * d = st->d;
    if (!(temperature > 0.0f)) {
        dflash_seterr(err, err_len, "sampled drafting needs a temperature > 0 (got %g)", (double) temperature);
        return -1;
    }
    if (!check_draft_args(st, anchor, n, err, err_len)) return -1;
    struct dflash_sample_req req = { temperature, rng, out_cand, out_q, 0, 0.0f, NULL, 0, filter };
    const int32_t rows = dflash_block_rows(&d->hp, n);
    if (dflash_run_graph(d, &st, 1, &anchor, rows, out_tokens, NULL, &req, err, err_len) != 0) return -1;
    *out_k = req.k;
    return req.n_out;
}

int32_t dflash_drafter_draft_sample(dflash_drafter * d, int32_t anchor, int32_t n, float temperature,
                                    struct dflash_rng * rng, struct dflash_token_filter * filter,
                                    int32_t * out_tokens, int32_t * out_cand, float * out_q, int32_t * out_k,
                                    char * err, size_t err_len) {
    return dflash_state_draft_sample(d->def, anchor, n, temperature, rng, filter, out_tokens, out_cand, out_q, out_k,
                                     err, err_len);
}
