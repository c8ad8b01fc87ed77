// The speculative loop: prefill -> draft -> verify -> accept -> rollback, greedy (token-identical to
// plain greedy decoding) or sampled (match: the request's llama.cpp sampler chain row by row;
// rejection: speculative rejection sampling with the drafter's q).
#include "engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(DFLASH_MAX_ROWS == DFLASH_MAX_DRAFT + 1, "dflash.h: DFLASH_MAX_ROWS");

static dflash_engine * engine_new(struct llama_context * tctx, dflash_drafter * d, dflash_capture * c, int32_t seq,
                                  bool shared, char * err, size_t err_len) {
    if (!tctx) {
        dflash_seterr(err, err_len, "a target context is required");
        return NULL;
    }
    if (d && !c) {
        dflash_seterr(err, err_len, "a drafter needs a feature capture on the target");
        return NULL;
    }
    if (d && c) {
        struct dflash_drafter_info info;
        dflash_drafter_get_info(d, &info);
        if (dflash_capture_row_width(c) != info.n_taps * info.n_embd) {
            dflash_seterr(err, err_len, "capture width %d does not match the drafter's %d taps x %d",
                          dflash_capture_row_width(c), info.n_taps, info.n_embd);
            return NULL;
        }
    }
    struct dflash_engine * e = calloc(1, sizeof(*e));
    e->ctx = tctx;
    e->model = llama_get_model(tctx);
    e->vocab = llama_model_get_vocab(e->model);
    e->n_vocab = llama_vocab_n_tokens(e->vocab);
    // llama.cpp may round n_ctx up; the usable context is what both caches hold.
    e->n_ctx = (int32_t) llama_n_ctx(tctx);
    if (shared) e->n_ctx /= (int32_t) llama_n_seq_max(tctx);  // each sequence its share of the cells
                                                                // (its stream, or of the unified cache)
    if (d) {
        struct dflash_drafter_info info;
        dflash_drafter_get_info(d, &info);
        if (info.n_ctx < e->n_ctx) e->n_ctx = info.n_ctx;
    }
    e->n_batch = (int32_t) llama_n_batch(tctx);
    e->rs_memory = llama_model_is_recurrent(e->model) || llama_model_is_hybrid(e->model);
    e->rollback_max = e->rs_memory ? (int32_t) llama_n_rs_seq(tctx) : DFLASH_MAX_DRAFT;
    if (e->rollback_max > DFLASH_MAX_DRAFT) e->rollback_max = DFLASH_MAX_DRAFT;
    e->drafter = d;
    e->capture = c;
    e->seq = seq;
    e->shared = shared;
    e->st = d ? (shared ? dflash_state_new(d, err, err_len) : dflash_drafter_default_state(d)) : NULL;
    if (d && !e->st) {
        free(e);
        return NULL;
    }
    dflash_policy_init(&e->policy);
    // a KV stream per sequence (each holds n_ctx / n_seq_max cells) splits joint batches into ubatches
    e->policy.split_ubatches = shared && llama_n_seq_max(tctx) > 1 && llama_n_ctx_seq(tctx) < llama_n_ctx(tctx);
    e->batch = llama_batch_init(e->n_batch > DFLASH_MAX_DRAFT + 1 ? e->n_batch : DFLASH_MAX_DRAFT + 1, 0, 1);
    e->p = malloc(sizeof(float) * (size_t) e->n_vocab);
    e->cur = malloc(sizeof(llama_token_data) * (size_t) e->n_vocab);
    if (!e->p || !e->cur) {
        dflash_engine_free(e);
        dflash_seterr(err, err_len, "out of memory");
        return NULL;
    }
    return e;
}

dflash_engine * dflash_engine_new(struct llama_context * tctx, dflash_drafter * d, dflash_capture * c,
                                  char * err, size_t err_len) {
    return engine_new(tctx, d, c, 0, false, err, err_len);
}

dflash_engine * dflash_engine_new_seq(struct llama_context * tctx, dflash_drafter * d, dflash_capture * c,
                                      int32_t seq_id, char * err, size_t err_len) {
    if (tctx && (seq_id < 0 || seq_id >= (int32_t) llama_n_seq_max(tctx))) {
        dflash_seterr(err, err_len, "sequence %d is outside the context's 0..%d", seq_id,
                      (int32_t) llama_n_seq_max(tctx) - 1);
        return NULL;
    }
    return engine_new(tctx, d, c, seq_id, true, err, err_len);
}

void dflash_engine_free(dflash_engine * e) {
    if (!e) return;
    if (e->shared) dflash_state_free(e->st);
    llama_batch_free(e->batch);
    free(e->history);
    free(e->p);
    free(e->cur);
    free(e);
}

void dflash_engine_set_draft_fn(dflash_engine * e, dflash_draft_fn fn, void * user_data) {
    e->draft_fn = fn;
    e->draft_ud = user_data;
}

void dflash_engine_set_step_fn(dflash_engine * e, dflash_step_fn fn, void * user_data) {
    e->step_fn = fn;
    e->step_ud = user_data;
}

// Decode tokens[0..n) at positions pos0.. with logits on rows [first_logit, n).
// Captured features (if any) go to the drafter for rows [0, n_feat).
int32_t engine_decode(struct dflash_engine * e, const int32_t * tokens, int32_t n, int32_t pos0, int32_t first_logit,
                      const float ** feats, char * err, size_t err_len) {
    struct llama_batch * b = &e->batch;
    b->n_tokens = n;
    for (int32_t i = 0; i < n; i++) {
        b->token[i] = tokens[i];
        b->pos[i] = pos0 + i;
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = e->seq;
        b->logits[i] = i >= first_logit;
    }
    if (e->capture) dflash_capture_begin(e->capture);
    const int32_t rc = llama_decode(e->ctx, *b);
    if (rc != 0) {
        dflash_seterr(err, err_len, "llama_decode failed (code %d) at position %d", rc, pos0);
        return -1;
    }
    if (feats) {
        *feats = NULL;
        if (e->capture) {
            *feats = dflash_capture_rows(e->capture, n);
            if (!*feats) {
                dflash_seterr(err, err_len, "feature capture returned incomplete rows");
                return -1;
            }
        }
    }
    return 0;
}

bool engine_check_tokens(const struct dflash_engine * e, const int32_t * tokens, int32_t n, char * err, size_t err_len) {
    for (int32_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= e->n_vocab) {
            dflash_seterr(err, err_len, "token %d at index %d is outside the vocabulary (%d)", tokens[i], i, e->n_vocab);
            return false;
        }
    }
    return true;
}

// Empty this engine's target sequence (the whole cache when the context is its own).
void engine_clear_target(struct dflash_engine * e) {
    llama_memory_t mem = llama_get_memory(e->ctx);
    if (e->shared) {
        llama_memory_seq_rm(mem, e->seq, -1, -1);
    } else {
        llama_memory_clear(mem, true);
    }
}

int32_t dflash_engine_features(dflash_engine * e, const int32_t * tokens, int32_t n, float * out, char * err,
                               size_t err_len) {
    if (!e->capture) {
        dflash_seterr(err, err_len, "no feature capture on this target");
        return -1;
    }
    if (n < 1 || n > e->n_ctx) {
        dflash_seterr(err, err_len, "need 1..%d tokens (got %d)", e->n_ctx, n);
        return -1;
    }
    if (!engine_check_tokens(e, tokens, n, err, err_len)) return -1;
    const size_t width = (size_t) dflash_capture_row_width(e->capture);
    dflash_engine_forget(e);
    engine_clear_target(e);
    for (int32_t p = 0; p < n; p += e->n_batch) {
        const int32_t m = n - p < e->n_batch ? n - p : e->n_batch;
        const float * feats = NULL;
        if (engine_decode(e, tokens + p, m, p, m, &feats, err, err_len) != 0) return -1;
        memcpy(out + (size_t) p * width, feats, sizeof(float) * (size_t) m * width);
    }
    return 0;
}

int32_t engine_target_len(const struct dflash_engine * e) {
    return llama_memory_seq_pos_max(llama_get_memory(e->ctx), e->seq) + 1;
}


int32_t dflash_engine_start(dflash_engine * e, const int32_t * prompt, int32_t n_prompt,
                            const struct dflash_engine_params * params, float * out_margin, char * err,
                            size_t err_len) {
    struct dflash_stats * st = &e->stats;
    memset(st, 0, sizeof(*st));
    e->active = false;
    dflash_policy_begin(&e->policy, e->draft_fn != NULL);
    const int32_t max_tokens = params->max_tokens;
    const int32_t n_draft = params->n_draft;
    if (n_prompt < 1) {
        dflash_seterr(err, err_len, "the prompt is empty");
        return -1;
    }
    if (max_tokens < 1) {
        dflash_seterr(err, err_len, "max_tokens must be at least 1 (got %d)", max_tokens);
        return -1;
    }
    if (n_draft < 0 || n_draft > DFLASH_MAX_DRAFT) {
        dflash_seterr(err, err_len, "draft length must be in 0..%d (got %d)", DFLASH_MAX_DRAFT, n_draft);
        return -1;
    }
    if (n_draft > 0 && e->rollback_max == 0) {
        dflash_seterr(err, err_len, "this target's recurrent state cannot roll back rejected drafts (n_rs_seq 0)");
        return -1;
    }
    if (n_draft > 0 && !e->drafter && !e->draft_fn) {
        dflash_seterr(err, err_len, "draft length %d needs a drafter or a draft source", n_draft);
        return -1;
    }
    if (e->drafter && !e->draft_fn) {
        struct dflash_drafter_info info;
        dflash_drafter_get_info(e->drafter, &info);
        const int32_t n_max = dflash_max_draft(&info);
        if (n_draft > n_max) {
            dflash_seterr(err, err_len, "draft length %d exceeds the drafter's block (%d): at most %d", n_draft,
                          info.block_size, n_max);
            return -1;
        }
    }
    if (params->mode < DFLASH_VERIFY_GREEDY || params->mode > DFLASH_VERIFY_REJECTION) {
        dflash_seterr(err, err_len, "unknown verify mode %d", params->mode);
        return -1;
    }
    if (params->mode == DFLASH_VERIFY_MATCH && !params->sampler) {
        dflash_seterr(err, err_len, "match verification needs a sampler chain");
        return -1;
    }
    if (params->mode == DFLASH_VERIFY_REJECTION && n_draft > 0 && (e->draft_fn || !e->drafter)) {
        dflash_seterr(err, err_len, "rejection sampling needs the DFlash drafter's proposal q (not an external source)");
        return -1;
    }
    if (params->mode == DFLASH_VERIFY_REJECTION && !(params->temperature > 0.0f)) {
        dflash_seterr(err, err_len, "rejection sampling needs a temperature > 0 (got %g)", (double) params->temperature);
        return -1;
    }
    if (n_prompt > e->n_ctx) {
        dflash_seterr(err, err_len, "the prompt has %d tokens but n_ctx is %d", n_prompt, e->n_ctx);
        return -1;
    }
    if ((int64_t) n_prompt + max_tokens > e->n_ctx) {
        dflash_seterr(err, err_len, "prompt (%d tokens) + max_tokens (%d) exceeds n_ctx (%d)", n_prompt, max_tokens,
                      e->n_ctx);
        return -1;
    }
    if (!engine_check_tokens(e, prompt, n_prompt, err, err_len)) return -1;
    const int32_t need = n_prompt + max_tokens;
    if (need > e->history_cap) {
        int32_t * h = realloc(e->history, sizeof(int32_t) * need);
        if (!h) {
            dflash_seterr(err, err_len, "out of memory");
            return -1;
        }
        e->history = h;
        e->history_cap = need;
    }
    // Prefix reuse: the previous generation's target KV and drafter cache hold history[0..n_past);
    // keep their common prefix with this prompt (never the last prompt token: its logits are needed).
    llama_memory_t mem = llama_get_memory(e->ctx);
    int32_t reuse = 0;
    if (params->reuse_prefix && e->n_past > 0 && llama_memory_seq_pos_max(mem, e->seq) + 1 == e->n_past &&
        (!e->drafter || dflash_state_n_ctx_used(e->st) == e->n_past)) {
        while (reuse < e->n_past && reuse < n_prompt - 1 && e->history[reuse] == prompt[reuse]) reuse++;
        if (params->canonical_prefill) {
            const int32_t lim = reuse < e->n_prefilled ? reuse : e->n_prefilled;
            reuse = lim / e->n_batch * e->n_batch;
        }
        // a recurrent state keeps no snapshot of an older prefix: reused only when nothing is removed
        if (e->rs_memory && reuse < e->n_past) reuse = 0;
        if (reuse > 0 && !llama_memory_seq_rm(mem, e->seq, reuse, -1)) reuse = 0; // no partial removal
    }
    if (reuse > 0) {
        if (e->drafter) dflash_state_truncate(e->st, reuse);
    } else {
        engine_clear_target(e);
        if (e->drafter) dflash_state_reset(e->st);
    }
    e->n_past = 0; // until this generation's prefill is done
    memcpy(e->history, prompt, sizeof(int32_t) * n_prompt);
    e->prm = *params;
    e->n_hist = n_prompt;
    st->n_prompt = n_prompt;
    st->n_reused = reuse;

    // Prefill, chunk by chunk; every chunk's features go to the drafter.
    const double t0 = dflash_now();
    for (int32_t p = reuse; p < n_prompt; p += e->n_batch) {
        const int32_t n = n_prompt - p < e->n_batch ? n_prompt - p : e->n_batch;
        const float * feats = NULL;
        if (engine_decode(e, prompt + p, n, p, p + n == n_prompt ? n - 1 : n, &feats, err, err_len) != 0) return -1;
        if (e->drafter && dflash_state_push(e->st, feats, n, err, err_len) != 0) return -1;
    }
    dflash_rng_seed(&e->rng, params->seed);
    st->mode = params->mode;
    float margin = NAN;
    const int32_t tok = engine_pick_token(e, params, -1, out_margin || e->step_fn ? &margin : NULL);
    e->anchor_margin = margin;
    e->t_start = dflash_now();
    st->t_prefill_s = e->t_start - t0;
    if (out_margin) *out_margin = margin;

    e->n_gen = 1;
    e->history[e->n_hist++] = tok;
    e->n_past = n_prompt; // target KV length == position of the anchor
    e->n_prefilled = n_prompt;
    e->eos = params->stop_on_eos && llama_vocab_is_eog(e->vocab, tok);
    e->active = true;
    st->n_generated = 1;
    st->stop_reason = e->eos ? DFLASH_STOP_EOS : (max_tokens == 1 ? DFLASH_STOP_MAX_TOKENS : DFLASH_STOP_NONE);
    return tok;
}

// A step's first half: decide the draft length, draft, choose what to verify (e->plan).
// max_rows: the rows this step may verify; base_rows: other sequences' rows in the same batch.
// Returns 1 (a step to verify), 0 (the generation has ended) or -1.
int32_t engine_step_prepare(struct dflash_engine * e, int32_t max_rows, int32_t base_rows, char * err,
                            size_t err_len) {
    if (!e->active || e->eos || e->n_gen >= e->prm.max_tokens) {
        e->active = false;
        return 0;
    }
    const struct dflash_engine_params * params = &e->prm;
    struct dflash_stats * st = &e->stats;
    struct step_plan * pl = &e->plan;
    const bool rejection = params->mode == DFLASH_VERIFY_REJECTION;
    int32_t * drafts = pl->verify + 1;
    int32_t q_k = 0;

    // Never draft past the token budget or the context.
    const int32_t budget = params->draft_budget > 0 && params->draft_budget < params->max_tokens
                               ? params->draft_budget : params->max_tokens;
    int32_t n = params->n_draft;
    if (n > budget - e->n_gen - 1) n = budget - e->n_gen - 1;
    if (n > e->n_ctx - e->n_past - 1) n = e->n_ctx - e->n_past - 1;
    if (n > max_rows - 1) n = max_rows - 1;  // one llama_decode takes at most n_batch rows
    if (n > e->rollback_max) n = e->rollback_max;  // rejected drafts must be removable (n_rs_seq snapshots)
    if (n < 0) n = 0;
    const int32_t anchor = e->history[e->n_hist - 1];

    // Adaptive: the cost model decides whether to draft and how much (docs/architecture.md §5.9).
    const bool adaptive = params->adaptive && n > 0;
    bool probe = false;
    e->policy.base_rows = base_rows;
    e->policy.n_min = params->n_min;
    if (adaptive) n = dflash_policy_plan(&e->policy, n, &probe);
    float * conf_buf = pl->conf_buf;
    float * conf = NULL;  // each drafted slot's confidence, when the drafter gives one
    pl->n_conf = 0;
    float expected[DFLASH_MAX_DRAFT];

    const double ta = dflash_now();
    int32_t n_drafted = 0;
    struct dflash_token_filter grammar_filter = { engine_grammar_allowed, engine_grammar_accept, NULL, 0, false };
    struct dflash_token_filter * gf = NULL;
    if (n > 0 && params->grammar && params->grammar_drafts) {
        // the draft walks a clone of the grammar; the chain's own state moves only on commits
        grammar_filter.ud = llama_sampler_clone(params->grammar);
        gf = grammar_filter.ud ? &grammar_filter : NULL;
    }
    // the drafter's graph first injects the rows pushed since its last run (part of the draft's time)
    pl->n_injected = n > 0 && !e->draft_fn && e->drafter ? dflash_state_n_pending(e->st) : 0;
    if (n > 0) {
        if (e->draft_fn) {
            n_drafted = e->draft_fn(e->draft_ud, e->history, e->n_hist, n, drafts);
            if (n_drafted < 0 || n_drafted > n) {
                dflash_seterr(err, err_len, "draft source returned %d tokens (asked for at most %d)", n_drafted, n);
                n_drafted = -1;  // (after the grammar clone is freed below)
            }
            for (int32_t i = 0; i < n_drafted; i++) {
                if (drafts[i] < 0 || drafts[i] >= e->n_vocab) {
                    dflash_seterr(err, err_len, "draft source returned token %d outside the vocabulary", drafts[i]);
                    n_drafted = -1;
                }
            }
        } else if (e->drafter && rejection) {
            n_drafted = dflash_state_draft_sample(e->st, anchor, n, params->temperature, &e->rng, gf, drafts,
                                                  e->q_cand, e->q_prob, &q_k, err, err_len);
        } else if (e->drafter) {
            // (a trace reports them too, but only an adaptive step learns from them)
            float * want = adaptive || e->step_fn ? conf_buf : NULL;
            conf = adaptive ? conf_buf : NULL;
            n_drafted = dflash_state_draft(e->st, anchor, n, params->p_min, gf, drafts, want, NULL, err,
                                           err_len);
            pl->n_conf = want && n_drafted > 0 ? n_drafted : 0;
        }
        if (adaptive && rejection && n_drafted >= 0) {  // a sampled slot's confidence: its q
            conf = conf_buf;
            for (int32_t i = 0; i < n_drafted; i++) {
                conf[i] = 0.0f;
                for (int32_t j = 0; j < q_k; j++) {
                    if (e->q_cand[(size_t) i * q_k + j] == drafts[i]) conf[i] = e->q_prob[(size_t) i * q_k + j];
                }
            }
        }
        if (n_drafted < 0) {
            if (gf) llama_sampler_free(gf->ud);
            return -1;
        }
        if (gf && e->draft_fn) {
            // an external source knows no grammar: cut its draft at the first forbidden token
            int32_t k = 0;
            while (k < n_drafted && engine_grammar_allowed(gf->ud, drafts[k])) engine_grammar_accept(gf->ud, drafts[k++]);
            gf->cut = k < n_drafted;
            n_drafted = k;
        }
        if (gf) {
            st->grammar_cut += gf->cut;
            st->grammar_skipped += gf->n_skipped;
            llama_sampler_free(gf->ud);
        }
        // too short to pay for its verification (an adaptive step's cut keeps none shorter, and learns
        // what the longer ones it could have kept were worth)
        if (!adaptive && n_drafted < params->n_min) n_drafted = 0;
    }
    const int32_t n_made = n;  // what the drafter was asked for (its cost), n_drafted: what is verified
    pl->n_returned = n_drafted;  // (0 for a plain step)
    if (adaptive && n_made > 0) n_drafted = dflash_policy_choose(&e->policy, conf, n_drafted, n_made, expected);
    pl->t_predicted = 0.0;
    if (adaptive || e->policy.have_costs) {  // (a fixed-length step is predicted once a cost model exists)
        pl->t_predicted = dflash_policy_t_draft(&e->policy, n_made) + dflash_policy_t_verify(&e->policy, n_drafted + 1);
        st->t_predicted_s += pl->t_predicted;
    }
    if (adaptive) {
        st->plain_steps += n_made == 0;
        st->probes += probe;
        for (int32_t i = 0; i < n_drafted; i++) st->per_position_expected[i] += expected[i];
    }
    pl->verify[0] = anchor;
    pl->n_drafted = n_drafted;
    pl->n_made = n_made;
    pl->q_k = q_k;
    pl->adaptive = adaptive;
    pl->conf = conf;
    pl->anchor_margin = e->anchor_margin;
    pl->t_draft = e->clock.n_rows > 0 ? dflash_costs_t_draft(&e->clock, n_made) : dflash_now() - ta;
    return 1;
}

// A step's second half, after the decode of e->plan.verify (this engine's rows from e->row0;
// feats: their features): accept, commit, roll back, learn.  t_verify: the decode's seconds,
// rows_total: its rows.  Returns the tokens committed.
int32_t engine_step_finish(struct dflash_engine * e, const float * feats, double t_verify, int32_t rows_total,
                           int32_t * out_tokens, float * out_margins, char * err, size_t err_len) {
    const struct dflash_engine_params * params = &e->prm;
    struct dflash_stats * st = &e->stats;
    const struct step_plan * pl = &e->plan;
    const bool rejection = params->mode == DFLASH_VERIFY_REJECTION;
    const int32_t * drafts = pl->verify + 1;
    const int32_t n_drafted = pl->n_drafted, n_made = pl->n_made;
    const bool adaptive = pl->adaptive;
    const float * conf = pl->conf;
    float margin = NAN;
    int32_t tok = 0;
    const double tb = dflash_now();

    int32_t n_acc = 0, n_out = 0;
    for (int32_t i = 0; i <= n_drafted; i++) {
        bool keep_going;
        if (rejection && i < n_drafted) {
            keep_going = engine_rejection_accept(e, i, drafts, &tok);
            margin = NAN;
        } else {
            // Greedy / match: the target's own token for row i (the bonus after the last draft);
            // drafts are kept while they equal it.
            tok = engine_pick_token(e, params, i, out_margins || e->step_fn ? &margin : NULL);
            keep_going = i < n_drafted && drafts[i] == tok;
        }
        out_tokens[n_out] = tok;
        if (out_margins) out_margins[n_out] = margin;
        n_out++;
        e->history[e->n_hist++] = tok;
        if (params->stop_on_eos && llama_vocab_is_eog(e->vocab, tok)) {
            e->eos = true;
            break;
        }
        if (!keep_going) break;
        n_acc++;
    }
    const double tc = dflash_now();
    e->anchor_margin = margin;  // (the last token committed is the next step's anchor)

    // Roll back the rejected rows; the drafter gets the kept rows' features.
    const int32_t n_keep = n_acc + 1;
    // (n_drafted <= rollback_max: a hybrid target restores its recurrent state's snapshot after row
    // n_acc of this decode; the next decode consumes it)
    if (n_keep < n_drafted + 1 && !llama_memory_seq_rm(llama_get_memory(e->ctx), e->seq, e->n_past + n_keep, -1)) {
        dflash_seterr(err, err_len, "the target's memory cannot roll back %d rejected positions (n_rs_seq %d)",
                      n_drafted + 1 - n_keep, e->rs_memory ? e->rollback_max : -1);
        return -1;
    }
    if (e->drafter && dflash_state_push(e->st, feats, n_keep, err, err_len) != 0) return -1;
    e->n_past += n_keep;
    e->n_gen += n_out;

    // the decode and this engine's accept loop (a modelled clock: the batch's price on its machine)
    const double t_v = e->clock.n_rows > 0 ? dflash_costs_t_verify(&e->clock, rows_total) : t_verify + (tc - tb);
    e->joint_rows = rows_total;
    e->own_rows = n_drafted + 1;
    // (greedy / match: the slot past the cut would have been kept iff it equals the target's token)
    const int32_t shadow = adaptive && conf && !rejection && !e->eos && n_acc == n_drafted && n_drafted < pl->n_returned
                               ? drafts[n_drafted] == tok : -1;
    dflash_policy_observe(&e->policy, adaptive, n_made, conf, n_drafted, n_acc, n_out, pl->t_draft, pl->n_injected,
                          t_v, rows_total, shadow);
    st->steps++;
    st->length_hist[n_drafted]++;
    st->drafted += n_drafted;
    st->accepted += n_acc;
    for (int32_t i = 0; i < n_drafted; i++) {
        st->per_position_drafted[i]++;
        if (i < n_acc) st->per_position_accepted[i]++;
    }
    st->t_draft_s += pl->t_draft;
    st->t_verify_s += t_v;
    st->t_total_s = dflash_now() - e->t_start;
    st->n_generated = e->n_gen;
    st->stop_reason = e->eos ? DFLASH_STOP_EOS : (e->n_gen >= params->max_tokens ? DFLASH_STOP_MAX_TOKENS : DFLASH_STOP_NONE);

    if (e->step_fn) {
        struct dflash_step s = {
            .step = st->steps, .drafted = n_drafted, .accepted = n_acc, .committed = e->n_hist,
            .target_len = engine_target_len(e), .drafter_len = e->drafter ? dflash_state_n_ctx_used(e->st) : e->n_past,
            .made = n_made, .anchor_margin = pl->anchor_margin, .n_conf = pl->n_conf,
            .t_draft = pl->t_draft, .t_verify = t_v, .t_predicted = pl->t_predicted,
        };
        memcpy(s.conf, pl->conf_buf, sizeof(float) * (size_t) pl->n_conf);
        e->step_fn(e->step_ud, &s);
    }
    return n_out;
}


int32_t dflash_engine_step(dflash_engine * e, int32_t * out_tokens, float * out_margins, char * err, size_t err_len) {
    const int32_t rc = engine_step_prepare(e, e->n_batch, 0, err, err_len);
    if (rc <= 0) return rc;
    const struct step_plan * pl = &e->plan;
    const float * feats = NULL;
    e->row0 = 0;
    const double t0 = dflash_now();
    if (engine_decode(e, pl->verify, pl->n_drafted + 1, e->n_past, 0, &feats, err, err_len) != 0) return -1;
    return engine_step_finish(e, feats, dflash_now() - t0, pl->n_drafted + 1, out_tokens, out_margins, err, err_len);
}

void dflash_engine_get_stats(const dflash_engine * e, struct dflash_stats * out) {
    *out = e->stats;
}

const float * dflash_engine_last_logits(const dflash_engine * e, int32_t k) {
    // start: the prefill's last row; a step: verify row k produced its k-th token
    return llama_get_logits_ith(e->ctx, e->stats.steps == 0 ? -1 : engine_row_of(e, k));
}

void dflash_engine_forget(dflash_engine * e) {
    e->n_past = 0;
    e->active = false;
}

int32_t dflash_engine_generate(dflash_engine * e, const int32_t * prompt, int32_t n_prompt,
                               const struct dflash_engine_params * params, int32_t * out_tokens,
                               float * out_margins, struct dflash_stats * st, char * err, size_t err_len) {
    const int32_t first = dflash_engine_start(e, prompt, n_prompt, params, out_margins, err, err_len);
    if (first < 0) {
        *st = e->stats;
        return -1;
    }
    out_tokens[0] = first;
    int32_t n_gen = 1;
    for (;;) {
        const int32_t n = dflash_engine_step(e, out_tokens + n_gen, out_margins ? out_margins + n_gen : NULL, err,
                                             err_len);
        if (n < 0) return -1;
        if (n == 0) break;
        n_gen += n;
    }
    *st = e->stats;
    return n_gen;
}
