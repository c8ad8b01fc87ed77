// The engine's internals, shared by its units:
//   loop.c    lifecycle, prefill, a step's two halves (draft and plan; accept, commit, roll back)
//   sample.c  the sampling math of verification: greedy, the request's chain, rejection sampling
//   group.c   several sequences' steps verified in one joint batch
//   timing.c  timing verify batches and drafts for the cost model
//   tuning.c  the cost model's settings: costs, modelled clock, calibration
//
// State between steps (docs/architecture.md §5.1): the committed tokens end with the anchor, which
// the target has not consumed yet; the target KV cache and the drafter's context both cover every
// position before it.
#pragma once

#include "dflash.h"

#include "common.h"
#include "policy.h"

#include "llama.h"

#include <stdbool.h>
#include <stdint.h>

// One step between drafting and verification: what is verified, and what the policy needs after.
struct step_plan {
    int32_t verify[DFLASH_MAX_DRAFT + 1];  // the anchor, then the drafts kept
    int32_t n_drafted;                     // drafts verified
    int32_t n_returned;                    // drafts the drafter returned (those past the cut: drafts[n_drafted..])
    int32_t n_made;                        // drafts asked of the drafter (its cost)
    int32_t q_k;                           // rejection: candidates per slot in q_cand / q_prob
    bool adaptive;
    float conf_buf[DFLASH_MAX_DRAFT];
    const float * conf;                    // each drafted slot's confidence, when the drafter gives one
    int32_t n_conf;                        // traces: slots the drafter returned with a confidence in conf_buf
    float anchor_margin;                   // traces: the anchor row's top-1 minus top-2 logit
    double t_draft;
    double t_predicted;                    // the cost model's draft + verify time (0: none)
    int32_t n_injected;                    // queued feature rows the draft injected (part of t_draft)
};

struct dflash_engine {
    struct llama_context * ctx;
    const struct llama_model * model;
    const struct llama_vocab * vocab;
    int32_t n_vocab;
    int32_t n_ctx;
    int32_t n_batch;
    // Trailing positions the target's memory can drop after a decode: KV caches any (DFLASH_MAX_DRAFT
    // bounds a step's drafts anyway); recurrent / hybrid memories only llama.cpp's per-token
    // snapshots of their state, n_rs_seq of them (0: none), and only within the last decode's rows.
    int32_t rollback_max;
    bool rs_memory;
    dflash_drafter * drafter;
    dflash_capture * capture;
    dflash_draft_fn draft_fn;
    void * draft_ud;
    dflash_step_fn step_fn;
    void * step_ud;
    struct llama_batch batch;
    int32_t * history;     // committed tokens
    int32_t history_cap;
    // sampled verification (T > 0)
    float * p;                 // target distribution of one row, dense [n_vocab]
    float anchor_margin;       // the last committed token's row: top-1 minus top-2 logit (NAN: not computed)
    llama_token_data * cur;    // candidates handed to the sampler transforms
    struct dflash_rng rng;
    // the generation in progress (dflash_engine_start .. dflash_engine_step)
    struct dflash_engine_params prm;
    struct dflash_stats stats;
    bool active, eos;
    int32_t n_hist, n_gen, n_past;  // committed tokens, generated tokens, target KV length
    int32_t n_prefilled;            // the last prompt (its KV made by prefill chunks from position 0)
    double t_start;
    int32_t q_cand[DFLASH_MAX_DRAFT * DFLASH_MAX_TOP_K]; // rejection: the drafter's proposal, n x k candidates
    float q_prob[DFLASH_MAX_DRAFT * DFLASH_MAX_TOP_K]; // and their q
    struct dflash_policy policy;           // adaptive draft lengths: the cost model and calibration
    struct dflash_costs clock;             // a modelled clock's machine (dflash_engine_set_clock; n_rows 0: live)
    int32_t seq;               // the target sequence this engine drives
    bool shared;               // on a context shared with other engines (dflash_engine_new_seq)
    dflash_state * st;         // the drafter state: the drafter's own, or (shared) this engine's
    int32_t row0;              // this engine's first row in the last verify decode
    int32_t joint_rows, own_rows; // the last joint decode's rows, and this engine's share of them
    struct step_plan plan;     // the step between its draft and its verify
};

// Row i of this engine's part of the last decode (-1: the last row of a prefill).
static inline int32_t engine_row_of(const struct dflash_engine * e, int32_t i) { return i < 0 ? i : e->row0 + i; }

// loop.c
// Decode tokens[0..n) at positions pos0.. with logits on rows [first_logit, n); feats (optional):
// the captured rows.
int32_t engine_decode(struct dflash_engine * e, const int32_t * tokens, int32_t n, int32_t pos0, int32_t first_logit,
                      const float ** feats, char * err, size_t err_len);
// Empty this engine's target sequence (the whole cache when the context is its own).
void engine_clear_target(struct dflash_engine * e);
// A step's first half: decide the draft length, draft, choose what to verify (e->plan).
// max_rows: the rows this step may verify; base_rows: other sequences' rows in the same batch.
// Returns 1 (a step to verify), 0 (the generation has ended) or -1.
int32_t engine_step_prepare(struct dflash_engine * e, int32_t max_rows, int32_t base_rows, char * err,
                            size_t err_len);
// A step's second half, after the decode of e->plan.verify (this engine's rows from e->row0;
// feats: their features): accept, commit, roll back, learn.  t_verify: the decode's seconds,
// rows_total: its rows.  Returns the tokens committed.
int32_t engine_step_finish(struct dflash_engine * e, const float * feats, double t_verify, int32_t rows_total,
                           int32_t * out_tokens, float * out_margins, char * err, size_t err_len);

// sample.c
// Greedy choice over one row of logits, with the top-1 minus top-2 margin.
int32_t engine_argmax_margin(const float * row, int32_t n, float * margin);
// One committed token of row `row` (match: the chain samples it and accepts it into its own state).
// margin (optional): the row's raw top-1 minus top-2 logit.
int32_t engine_pick_token(struct dflash_engine * e, const struct dflash_engine_params * prm, int32_t row,
                          float * margin);
// Rejection sampling at draft slot i (row i): keep drafts[i] with probability min(1, p / q), else draw
// from the residual.  *tok: the committed token; returns whether the draft was kept.
bool engine_rejection_accept(struct dflash_engine * e, int32_t i, const int32_t * drafts, int32_t * tok);
// May `token` follow what the grammar has accepted?  (A one-candidate apply: no state change.)
bool engine_grammar_allowed(void * grammar, int32_t token);
void engine_grammar_accept(void * grammar, int32_t token);
