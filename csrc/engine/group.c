// Several sequences' steps verified in one joint batch of a shared context.
#include "engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int32_t dflash_engine_step_group(dflash_engine ** engines, int32_t n, int32_t max_rows, int32_t * out_tokens,
                                 int32_t * out_counts, char * err, size_t err_len) {
    if (n < 1) return 0;
    if (n > DFLASH_MAX_SEQ_GROUP) {
        dflash_seterr(err, err_len, "a group steps at most %d engines (got %d)", DFLASH_MAX_SEQ_GROUP, n);
        return -1;
    }
    struct dflash_engine * e0 = engines[0];
    for (int32_t i = 0; i < n; i++) {
        out_counts[i] = 0;
        const struct dflash_engine * e = engines[i];
        if (!e || !e->shared || e->ctx != e0->ctx || e->capture != e0->capture || e->drafter != e0->drafter) {
            dflash_seterr(err, err_len, "engine %d is not a sequence engine of this group's context", i);
            return -1;
        }
        for (int32_t j = 0; j < i; j++) {
            if (engines[j]->seq == e->seq) {
                dflash_seterr(err, err_len, "engines %d and %d drive the same sequence %d", j, i, e->seq);
                return -1;
            }
        }
    }
    // each engine plans against the others' anchors (a lower bound of their rows), within its share of
    // the batch
    int32_t live = 0;
    for (int32_t i = 0; i < n; i++) live += engines[i]->active;
    if (max_rows <= 0 || max_rows > e0->n_batch) max_rows = e0->n_batch;
    // With a KV stream per sequence llama.cpp orders a joint batch's rows by sequence and splits it into
    // ubatches of equal rows per sequence; the logits come back in batch order but the captured features
    // in ubatch order.  Rows in ascending sequence order, equally many per sequence, in one ubatch, keep
    // the two orders the same.
    const bool split = e0->policy.split_ubatches;
    const int32_t n_ubatch = (int32_t) llama_n_ubatch(e0->ctx);
    if (split && max_rows > n_ubatch) max_rows = n_ubatch;
    if (live > max_rows) {
        dflash_seterr(err, err_len, "%d sequences do not fit a joint batch of %d rows", live, max_rows);
        return -1;
    }
    const int32_t share = live > 0 ? max_rows / live : max_rows;
    bool go[DFLASH_MAX_SEQ_GROUP];
    int32_t order[DFLASH_MAX_SEQ_GROUP];  // engines by sequence id
    for (int32_t i = 0; i < n; i++) {
        int32_t j = i;
        while (j > 0 && engines[order[j - 1]]->seq > engines[i]->seq) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    int32_t n_go = 0, min_drafted = DFLASH_MAX_DRAFT;
    for (int32_t i = 0; i < n; i++) {
        struct dflash_engine * e = engines[i];
        // the others' rows: at least their anchors, likely what they put in the last joint decode
        int32_t base = live > 0 ? live - 1 : 0;
        const int32_t last = e->joint_rows - e->own_rows;
        if (last > base) base = last < (live - 1) * share ? last : (live - 1) * share;
        const int32_t rc = engine_step_prepare(e, share, base, err, err_len);
        go[i] = rc == 1;
        if (rc < 0) out_counts[i] = -1;
        if (go[i]) {
            n_go++;
            if (e->plan.n_drafted < min_drafted) min_drafted = e->plan.n_drafted;
        }
    }
    int32_t rows = 0;
    for (int32_t o = 0; o < n; o++) {
        struct dflash_engine * e = engines[order[o]];
        if (!go[order[o]]) continue;
        // (verifying fewer of its drafts is always right: the rest are simply not proposed)
        if (split && n_go > 1 && e->plan.n_drafted > min_drafted) e->plan.n_drafted = min_drafted;
        e->row0 = rows;
        rows += e->plan.n_drafted + 1;
    }
    if (rows == 0) return 0;
    struct llama_batch b = llama_batch_init(rows, 0, 1);
    b.n_tokens = rows;
    for (int32_t i = 0; i < n; i++) {
        const struct dflash_engine * e = engines[i];
        for (int32_t j = 0; go[i] && j <= e->plan.n_drafted; j++) {
            const int32_t r = e->row0 + j;
            b.token[r] = e->plan.verify[j];
            b.pos[r] = e->n_past + j;
            b.n_seq_id[r] = 1;
            b.seq_id[r][0] = e->seq;
            b.logits[r] = 1;
        }
    }
    if (e0->capture) dflash_capture_begin(e0->capture);
    const double t0 = dflash_now();
    const int32_t rc = llama_decode(e0->ctx, b);
    const double t_dec = dflash_now() - t0;
    llama_batch_free(b);
    if (rc != 0) {
        dflash_seterr(err, err_len, "llama_decode failed (code %d) on a joint batch of %d rows", rc, rows);
        return -1;
    }
    const float * feats = NULL;
    size_t width = 0;
    if (e0->capture) {
        feats = dflash_capture_rows(e0->capture, rows);
        width = (size_t) dflash_capture_row_width(e0->capture);
        if (!feats) {
            dflash_seterr(err, err_len, "feature capture returned incomplete rows");
            return -1;
        }
    }
    for (int32_t i = 0; i < n; i++) {
        if (!go[i]) continue;
        struct dflash_engine * e = engines[i];
        out_counts[i] = engine_step_finish(e, feats ? feats + (size_t) e->row0 * width : NULL, t_dec, rows,
                                    out_tokens + (size_t) i * DFLASH_MAX_ROWS, NULL, err, err_len);
    }
    return 0;
}
