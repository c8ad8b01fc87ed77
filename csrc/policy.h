// Cost-aware draft lengths (docs/architecture.md §5.9): the engine's model of what a step
// costs and of how likely each drafted slot is to be accepted, and the two decisions an
// adaptive step takes from it -- how many tokens to draft, and how many of them to verify.
#pragma once

#include "dflash.h"

#include <stdbool.h>
#include <stdint.h>

#define DFLASH_POLICY_STATES 4

struct dflash_policy {
    struct dflash_costs costs;    // the shape of the cost curves, in seconds at speed 1
    bool have_costs;
    double speed;                 // measured / modelled step time (machine drift), EMA
    double t_draft_ext;           // an external draft source's time per draft (no measured curve), EMA
    struct dflash_calibration cal;
    double recent[DFLASH_MAX_DRAFT]; // the drafter's acceptance of a reached slot per position, EMA (sizes the
                                     // first drafts; a cut without confidences)
    // What slot m added to what the cut made of a draft (the expected gain over a plain step of the
    // best cut within its first m slots, less that within m - 1; the draft's own time left out), EMA
    // over the drafts that had slot m, m = 1 .. n_valued: their sum to m sizes drafts once known;
    // [0] alone, [1] in a joint batch (its rows are priced otherwise)
    double value[2][DFLASH_MAX_DRAFT];
    int32_t n_valued[2];
    int32_t explore_in;           // drafts until the next one made whole (DRAFT_EXPLORE)
    // A draft source without confidences ("blind"): one chance p that a slot is accepted once the
    // ones before it were, with a Beta(blind_a, blind_b) belief over it from the slots verified
    double blind_a, blind_b;
    int32_t blind_skipped;        // a blind source's plain steps since its last draft ...
    int32_t blind_every;          // ... and while its drafts do not pay, one probe in this many
    int32_t probe_run;            // ... its probes in a row that passed whole
    bool blind_known;             // a slot of a draft source has been verified (the first draft verifies one)
    // Acceptance runs in streaks: what the last step accepted predicts the next draft, so the
    // decision to draft is learnt per state (DFLASH_POLICY_STATES: no draft verified, first slot
    // rejected, 1-2 accepted, 3 or more accepted).
    int32_t state;
    double gain[DFLASH_POLICY_STATES];  // what a draft in this state is expected to gain over a plain step, EMA
    double last_gain;                   // the same for the last draft (dflash_policy_choose)
    int32_t skipped[DFLASH_POLICY_STATES];     // plain steps in this state since its last draft
    int32_t probe_every[DFLASH_POLICY_STATES]; // while drafts in this state do not pay: one in this many
    bool probing;                 // the last plan was such a probe
    double t_probe;               // a probe's measured draft time, EMA: it first injects the rows of the plain
                                  // stretch before it, which the draft curve (drafts within a streak) leaves out
    bool blind;                   // this generation drafts with a source without confidences (a draft_fn): a
                                  // probe verifies its first slot at least, or nothing would ever be learnt
    int32_t ep_state;             // the cold state (0, 1) whose draft opened the current streak, or -1
    double ep_gain;               // the streak's expected gain so far
    double rate;                  // committed tokens per second, EMA over steps
    // rows other sequences put in the same verify batch (dflash_engine_step_group): a step's rows
    // cost what they add to the joint batch, and the rate to beat is the batch's plain rate
    int32_t base_rows;
    double joint_speed;           // joint decodes' time / the one-sequence curve at their rows, EMA (several
                                  // sequences' rows cost more than one's: attention per sequence, masks)
    bool split_ubatches;          // a KV stream per sequence: llama.cpp decodes a joint batch as ubatches of
                                  // equal rows per sequence, so rows beyond the others' take decodes of their own
    int32_t n_min;                // the engine's n_min: a cut verifies no draft shorter (0: any length), and
                                  // drafts are sized at least this long
};

void   dflash_policy_init(struct dflash_policy * p);
// A new generation, drafted by a source without confidences (blind: a draft_fn) or the drafter: a
// draft source's quality depends on the text (prompt lookup on a prompt that quotes what follows,
// or not), so what was learnt of it is kept only as a prior.
void   dflash_policy_begin(struct dflash_policy * p, bool blind);
void   dflash_policy_set_calibration(struct dflash_policy * p, const struct dflash_calibration * cal);
// New cost curves (seconds at speed 1): what was learnt in the old ones' terms is dropped.
void   dflash_policy_set_costs(struct dflash_policy * p, const struct dflash_costs * costs);
// A verify batch of k rows / a draft of n tokens on the given curves (linear beyond their last two
// points; no draft curve: 0), at speed 1.
double dflash_costs_t_verify(const struct dflash_costs * c, int32_t k);
double dflash_costs_t_draft(const struct dflash_costs * c, int32_t n);
// Another clock (dflash_engine_set_clock): what was learnt in the old one's seconds -- the speed
// factors, the rate achieved, a draft source's and a probe's draft times -- is dropped (the curves are
// kept: set new ones after).
void   dflash_policy_set_clock(struct dflash_policy * p);
// Seconds of a verify batch of k rows / a draft of n tokens, as the model predicts them now.
double dflash_policy_t_verify(const struct dflash_policy * p, int32_t k);
double dflash_policy_t_draft(const struct dflash_policy * p, int32_t n);
// Before a step: tokens to draft (0: a plain step; *probe: a draft although it has not been paying).
int32_t dflash_policy_plan(struct dflash_policy * p, int32_t n_cap, bool * probe);
// After drafting n tokens (n_made asked for): how many of them to verify; conf (may be NULL) holds
// each slot's confidence, expected[i] receives the calibrated chance that slots 0..i are all accepted.
int32_t dflash_policy_choose(struct dflash_policy * p, const float * conf, int32_t n, int32_t n_made,
                             float * expected);
// After the verify: whether the step was adaptive, what was drafted (n_drafted, 0 for a plain
// step), verified (k), accepted, committed, and the measured times (t_draft includes injecting
// n_injected queued feature rows); rows_total: the rows of the decode that verified them (k + 1
// alone, more in a joint batch).  shadow: where all k verified slots were accepted and the draft
// went on past the cut, whether its slot k equals the token the target committed there (1 / 0;
// -1: no such slot) -- what verifying it would have shown, learnt at no cost.
void   dflash_policy_observe(struct dflash_policy * p, bool adaptive, int32_t n_drafted, const float * conf,
                             int32_t k, int32_t n_acc, int32_t committed, double t_draft, int32_t n_injected,
                             double t_verify, int32_t rows_total, int32_t shadow);
