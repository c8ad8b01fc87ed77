// Sequence states: one context cache (per-layer K/V of committed positions) and
// the queue of features not yet projected into it.
#include "drafter.h"

#include "common.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---- states (one per sequence) ----------------------------------------------

dflash_state * dflash_state_new(dflash_drafter * d, char * err, size_t err_len) {
    const struct dflash_drafter_info * hp = &d->hp;
    const int64_t kvd = (int64_t) hp->head_dim * hp->n_head_kv;
    struct dflash_state * st = calloc(1, sizeof(*st));
    st->d = d;
    struct ggml_init_params ip = { (size_t) (2 * hp->n_layer + 1) * ggml_tensor_overhead(), NULL, true };
    st->ctx_kv = ggml_init(ip);
    // cells for n_ctx positions, rounded up so that attention can span a multiple of DFLASH_KV_PAD
    // keys up to the last position (graph.c)
    const int64_t cells = ((int64_t) hp->n_ctx + DFLASH_KV_PAD - 1) / DFLASH_KV_PAD * DFLASH_KV_PAD;
    for (int il = 0; il < hp->n_layer; il++) {
        st->k_cache[il] = ggml_new_tensor_2d(st->ctx_kv, GGML_TYPE_F32, kvd, cells);
        st->v_cache[il] = ggml_new_tensor_2d(st->ctx_kv, GGML_TYPE_F32, cells, kvd);
    }
    st->buf_kv = ggml_backend_alloc_ctx_tensors(st->ctx_kv, d->backends[0]);
    st->pending_cap = DFLASH_INJECT_CHUNK;
    st->pending = malloc(sizeof(float) * (size_t) st->pending_cap * d->n_embd_inp);
    if (hp->version == 2) {
        const size_t nk = (size_t) hp->block_size * hp->selector_top_k;
        st->last_cand = malloc(sizeof(int32_t) * nk);
        st->last_scores = malloc(sizeof(float) * nk * hp->selector_top_k);
    }
    if (!st->buf_kv || !st->pending || (hp->version == 2 && (!st->last_cand || !st->last_scores))) {
        dflash_state_free(st);
        dflash_seterr(err, err_len, "out of memory allocating a drafter context of %d positions", hp->n_ctx);
        return NULL;
    }
    ggml_backend_buffer_clear(st->buf_kv, 0);
    return st;
}

void dflash_state_free(dflash_state * st) {
    if (!st) return;
    if (st->buf_kv) ggml_backend_buffer_free(st->buf_kv);
    if (st->ctx_kv) ggml_free(st->ctx_kv);
    free(st->pending);
    free(st->last_cand);
    free(st->last_scores);
    free(st);
}

void dflash_state_reset(dflash_state * st) {
    st->n_cached = 0;
    st->n_pending = 0;
}

int32_t dflash_state_truncate(dflash_state * st, int32_t n) {
    if (n < 0) return -1;
    if (n < st->n_cached) {
        st->n_cached = n;
        st->n_pending = 0;
    } else if (n < st->n_cached + st->n_pending) {
        st->n_pending = n - st->n_cached;
    }
    return dflash_state_n_ctx_used(st);
}

int32_t dflash_state_n_ctx_used(const dflash_state * st) {
    return st->n_cached + st->n_pending;
}

int32_t dflash_state_n_pending(const dflash_state * st) { return st->n_pending; }

int32_t dflash_state_push(dflash_state * st, const float * rows, int32_t n_rows, char * err, size_t err_len) {
    struct dflash_drafter * d = st->d;
    if (n_rows < 0) return -1;
    if (st->n_cached + st->n_pending + n_rows > d->hp.n_ctx) {
        dflash_seterr(err, err_len, "drafter context overflow: %d + %d positions exceed n_ctx %d",
                      st->n_cached + st->n_pending, n_rows, d->hp.n_ctx);
        return -1;
    }
    while (n_rows > 0) {
        if (st->n_pending == st->pending_cap) {
            if (dflash_run_graph(d, &st, 1, NULL, 0, NULL, NULL, NULL, err, err_len) != 0) return -1;
        }
        int32_t take = st->pending_cap - st->n_pending;
        if (take > n_rows) take = n_rows;
        memcpy(st->pending + (size_t) st->n_pending * d->n_embd_inp, rows, sizeof(float) * (size_t) take * d->n_embd_inp);
        st->n_pending += take;
        rows += (size_t) take * d->n_embd_inp;
        n_rows -= take;
    }
    return 0;
}

int32_t dflash_state_last_lattice(const dflash_state * st, int32_t * cand, float * scores) {
    const struct dflash_drafter_info * hp = &st->d->hp;
    if (hp->version != 2) return -1;
    const size_t nk = (size_t) st->last_n * hp->selector_top_k;
    if (cand) memcpy(cand, st->last_cand, sizeof(int32_t) * nk);
    if (scores && st->scores_on_device) return -1; // the walk ran on the device: the scores stayed there
    if (scores) memcpy(scores, st->last_scores, sizeof(float) * nk * hp->selector_top_k);
    return st->last_n;
}

// ---- the single-sequence API: the drafter's own state ----------------------------

dflash_state * dflash_drafter_default_state(dflash_drafter * d) { return d->def; }

void dflash_drafter_reset(dflash_drafter * d) { dflash_state_reset(d->def); }

int32_t dflash_drafter_truncate(dflash_drafter * d, int32_t n) { return dflash_state_truncate(d->def, n); }

int32_t dflash_drafter_n_ctx_used(const dflash_drafter * d) { return dflash_state_n_ctx_used(d->def); }

int32_t dflash_drafter_push(dflash_drafter * d, const float * rows, int32_t n_rows, char * err, size_t err_len) {
    return dflash_state_push(d->def, rows, n_rows, err, err_len);
}

int32_t dflash_drafter_last_lattice(const dflash_drafter * d, int32_t * cand, float * scores) {
    return dflash_state_last_lattice(d->def, cand, scores);
}
