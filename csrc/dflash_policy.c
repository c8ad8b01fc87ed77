// Cost-aware draft lengths (docs/architecture.md §5.9).
//
// A step that drafts n tokens and verifies k of them costs t_draft(n) + t_verify(k + 1) and
// commits 1 + sum_{j<=k} prod_{i<=j} a_i tokens on average, a_i being the chance that slot i
// is accepted once every earlier slot was.  The engine maximises committed tokens per second
// over the generation: each step takes the k with the largest  E[committed] - R * t,  R being
// the rate to beat (the best of plain decoding's 1 / t_verify(1) and the rate achieved so far).
// Before drafting, what the cut made of recent drafts' first m slots, less a draft of m's time, says
// how long a draft to make (every DRAFT_EXPLORE-th draft is made whole, so that the slots beyond
// stay known; the first drafts are sized by the recent per-position acceptance); whether to draft
// at all is decided by what recent drafts made in the same state (what the step before them
// accepted: acceptance comes in streaks) were expected to gain over a plain step once their
// confidences were seen (the cut above included, the draft's own time charged), with a probe every
// few steps while they gain nothing.  A draft from a cold state (nothing accepted last step) is
// credited with its whole streak -- the drafts it leads to -- since that is what it opens.
// Expected, not realised, gains: one step's luck is noise, and the calibration keeps the
// expectation honest.
// A draft source without confidences ("blind") teaches nothing by drafting, only by what is
// verified.  It is modelled as one chance p that a slot is accepted once the slots before it were,
// with a Beta belief over p from every verified slot: slots 0..i-1 all pass with chance E[p^i],
// which under an uncertain belief falls off more slowly than E[p]^i (a source that passed i slots
// is likely a good one), and a slot the cut stopped short of is judged by what the others showed
// (per-slot estimates kept an early rejection at slot 2 unverified for good).  Before the call the
// belief says whether a draft would be verified at all; if not, the step is plain, with a probe that
// verifies one slot now and then (one more after each that passed whole): the wait between probes
// halves after an accepted one that brings drafting within one more reading, triples after any
// other, and is reset when drafting pays.  Readings fade: past BLIND_CAP of them, over plain
// stretches (half every BLIND_HALF steps: a probe after a long one counts), into a new generation
// (its prior: the mean, as BLIND_START readings), and at once when a probe passes whole where the
// belief gave it little chance (the text has changed).  Replayed on i.i.d. sources at p = 0 .. 0.9
// and on sources that turn good or bad, with measured costs of SmolLM2, Qwen2.5-Coder-1.5B and
// Gemma-3-270M (tests/test_policy.py, bench/bench_blind.py).
#include "policy.h"

#include "common.h"

#include <math.h>
#include <string.h>

#define DRAFT_EXPLORE 8     // one draft in this many is made as long as allowed ...
#define VALUE_EMA 0.03      // ... and what the cut makes of a draft's slots is averaged over ~30 drafts
                            // (slots beyond the usual length learn from the drafts made whole only:
                            // over ~30 of those; weighted 8x, on the replays drafts grew too long)
#define GAIN_EMA 0.1        // a state's expected gain while drafting there pays: ~10 drafts, but for
#define GAIN_EMA_COLD 0.7   // a cold state's (its drafts' streaks), weighted to the newest
#define PROBE_MAX 64         // plain steps between probes, at most
#define PROBE_BUDGET 0.01    // probes may cost this fraction of the plain steps' time
#define CAL_CAP 100.0f       // calibration counts per cell before they decay (recent text matters)
#define BLIND_CAP 40.0       // a draft source's belief: readings kept (older ones fade, text changes) ...
#define BLIND_START 3.0      // ... carried into a new generation (as its prior) ...
#define BLIND_HALF 64.0      // ... plain steps that halve them ...
#define BLIND_SURPRISE 0.1   // ... and a probe this unlikely to pass, passing, leaves this many:
#define BLIND_RESET 2.0
#define BLIND_BACKOFF 3      // a blind probe's wait after a rejection (the drafter's doubles)

void dflash_policy_init(struct dflash_policy * p) {
    memset(p, 0, sizeof(*p));
    p->speed = 1.0;
    p->joint_speed = 0.0;  // (from the one-sequence speed at the first joint decode)
    for (int32_t i = 0; i < DFLASH_MAX_DRAFT; i++) p->recent[i] = -1.0;  // not seen yet
    for (int32_t c = 0; c < DFLASH_POLICY_STATES; c++) {
        p->gain[c] = 0.5;  // optimistic: draft first, learn from what the drafts gain
        p->probe_every[c] = 2;
    }
    p->ep_state = -1;
    p->blind_a = p->blind_b = 1.0;  // uniform: nothing known of a draft source
    p->blind_every = 2;
    p->explore_in = DRAFT_EXPLORE - 1;
}

// Scale a draft source's belief down to at most n readings, keeping its mean.
static void blind_fade(struct dflash_policy * p, double n) {
    const double tot = p->blind_a + p->blind_b;
    if (tot > n) {
        p->blind_a *= n / tot;
        p->blind_b *= n / tot;
    }
}

void dflash_policy_begin(struct dflash_policy * p, bool blind) {
    p->blind = blind;
    // (the drafter's recent[] and values only size its drafts: kept as they are)
    blind_fade(p, BLIND_START);
}

void dflash_policy_set_costs(struct dflash_policy * p, const struct dflash_costs * costs) {
    p->costs = *costs;
    p->have_costs = costs->n_rows > 0;
    p->speed = 1.0;
    p->n_valued[0] = p->n_valued[1] = 0;  // (gains priced on the old curves)
}

void dflash_policy_set_clock(struct dflash_policy * p) {
    p->speed = 1.0;
    p->joint_speed = 0.0;
    p->rate = 0.0;
    p->t_draft_ext = 0.0;
    p->t_probe = 0.0;
}

// No size more than twice a larger one, nor more than twice per row a smaller one (plus slack).
static bool curve_plausible(const double * t, int32_t n) {
    const double slack = 5e-4;
    for (int32_t i = 1; i <= n; i++) {
        for (int32_t j = i + 1; j <= n; j++) {
            if (t[i - 1] > 2.0 * t[j - 1] + slack) return false;
            if (t[j - 1] > 2.0 * t[i - 1] * j / i + slack) return false;
        }
    }
    return true;
}

bool dflash_costs_plausible(const struct dflash_costs * c) {
    if (c->n_rows < 0 || c->n_rows > DFLASH_MAX_ROWS || c->n_draft < 0 || c->n_draft > DFLASH_MAX_DRAFT) return false;
    for (int32_t k = 0; k < c->n_rows; k++) {
        if (!(c->t_verify[k] > 0.0) || !isfinite(c->t_verify[k])) return false;
    }
    for (int32_t n = 0; n < c->n_draft; n++) {
        if (!(c->t_draft[n] >= 0.0) || !isfinite(c->t_draft[n])) return false;
    }
    return curve_plausible(c->t_verify, c->n_rows) && curve_plausible(c->t_draft, c->n_draft);
}

// t[j - 1] holds the value at j = 1 .. n; linear beyond the last two.
static double curve(const double * t, int32_t n, int32_t k) {
    if (k <= n) return t[k - 1];
    if (n == 1) return t[0] * k;
    return t[n - 1] + (t[n - 1] - t[n - 2]) * (k - n);
}

double dflash_costs_t_verify(const struct dflash_costs * c, int32_t k) {
    return c->n_rows >= 1 ? curve(c->t_verify, c->n_rows, k) : 0.0;
}

// (no draft curve: a draft source whose calls cost nothing here)
double dflash_costs_t_draft(const struct dflash_costs * c, int32_t n) {
    return n >= 1 && c->n_draft >= 1 ? curve(c->t_draft, c->n_draft, n) : 0.0;
}

double dflash_policy_t_verify(const struct dflash_policy * p, int32_t k) {
    if (!p->have_costs || p->costs.n_rows < 1) return 1.0 + 0.5 * (k - 1);  // unit-free: compute-bound rows
    return p->speed * curve(p->costs.t_verify, p->costs.n_rows, k);
}

double dflash_policy_t_draft(const struct dflash_policy * p, int32_t n) {
    if (n <= 0) return 0.0;
    if (!p->have_costs) return 0.3 + 0.02 * n;
    if (p->costs.n_draft < 1) return p->t_draft_ext;  // a draft source: what its calls took
    return p->speed * curve(p->costs.t_draft, p->costs.n_draft, n);
}

static int32_t bin_of(float c) {
    const int32_t b = (int32_t) (c * DFLASH_CAL_BINS);
    return b < 0 ? 0 : (b >= DFLASH_CAL_BINS ? DFLASH_CAL_BINS - 1 : b);
}

static int32_t pos_of(int32_t i) { return i < DFLASH_CAL_POS ? i : DFLASH_CAL_POS - 1; }

// Calibrated acceptance of slot i (reached) at confidence c: the cell's counts, shrunk towards
// the bin's count over all positions, itself shrunk towards the confidence.
static double cal_accept(const struct dflash_policy * p, int32_t i, float c) {
    const int32_t b = bin_of(c), pos = pos_of(i);
    double A = 0.0, T = 0.0;
    for (int32_t j = 0; j < DFLASH_CAL_POS; j++) {
        A += p->cal.accepted[j][b];
        T += p->cal.reached[j][b];
    }
    const double pool = (A + 2.0 * (b + 0.5) / DFLASH_CAL_BINS) / (T + 2.0);
    return (p->cal.accepted[pos][b] + 4.0 * pool) / (p->cal.reached[pos][b] + 4.0);
}

// Recent acceptance of position i; a position never reached yet takes the one before it's.
static double recent_at(const struct dflash_policy * p, int32_t i) {
    while (i > 0 && p->recent[i] < 0.0) i--;
    return p->recent[i] < 0.0 ? 0.5 : p->recent[i];
}

// Without confidences, the chance that slot i is accepted once slots 0..i-1 were: a blind source's
// E[p^(i+1)] / E[p^i] under its Beta belief; the drafter's recent acceptance.
static double next_accept(const struct dflash_policy * p, int32_t i) {
    return p->blind ? (p->blind_a + i) / (p->blind_a + p->blind_b + i) : recent_at(p, i);
}

// A joint decode of k rows (several sequences'), as the model predicts it now.
static double t_joint(const struct dflash_policy * p, int32_t k) {
    if (!p->have_costs || p->costs.n_rows < 1) return dflash_policy_t_verify(p, k);
    const double js = p->joint_speed > 0.0 ? p->joint_speed : p->speed;
    return js * curve(p->costs.t_verify, p->costs.n_rows, k);
}

// Seconds that k rows of this sequence add to the verify batch (alone: the batch's own time).
// The one-sequence curve is not monotonic (llama.cpp switches kernels at some sizes): a joint
// batch's rows are never priced below nothing.  With a KV stream per sequence the first row joins
// the others' ubatch and the rest run as one of their own (the others verify their anchors
// alone, as they mostly do under load).
static double t_rows(const struct dflash_policy * p, int32_t k) {
    const int32_t b = p->base_rows;
    if (b == 0) return dflash_policy_t_verify(p, k);
    const int32_t shared = p->split_ubatches ? 1 : k;
    double d = t_joint(p, b + shared) - t_joint(p, b);
    d = d > 0.0 ? d : 0.0;
    return k > shared ? d + dflash_policy_t_verify(p, k - shared) : d;
}

// Tokens per second of plain steps (in a joint batch: of the batch, one token per sequence).
static double plain_rate(const struct dflash_policy * p) {
    const int32_t b = p->base_rows;
    return b == 0 ? 1.0 / dflash_policy_t_verify(p, 1) : (b + 1) / t_joint(p, b + 1);
}

// The rate a cut must beat: the larger of plain decoding's and the rate achieved so far (in seconds:
// costs needed; in a joint batch one sequence's rate means nothing).
static double rate_to_beat(const struct dflash_policy * p) {
    const double R0 = plain_rate(p);
    return p->have_costs && p->base_rows == 0 && p->rate > R0 ? p->rate : R0;
}

// The shortest draft the engine may verify: one slot, or n_min when that is larger.
static int32_t min_draft(const struct dflash_policy * p) { return p->n_min > 1 ? p->n_min : 1; }

// How many of n drafted slots the cut keeps: the k with the most expected committed tokens net of
// its rows' time; a(i) = conf ? calibrated : recent acceptance.  expected (may be NULL) receives the
// chance that slots 0..i are all accepted, *e the expected tokens committed at the chosen k; upto (may
// be NULL) receives for each m what the best cut within the first m slots gains over a plain step.
static int32_t cut_at(const struct dflash_policy * p, const float * conf, int32_t n, float * expected, double * e,
                      double * upto) {
    const double R = rate_to_beat(p);
    const double v0 = 1.0 - R * t_rows(p, 1);  // a plain step's
    double E = 1.0, prod = 1.0, best_v = v0, best_e = 1.0;
    int32_t best_k = 0;
    for (int32_t k = 1; k <= n; k++) {
        prod *= conf ? cal_accept(p, k - 1, conf[k - 1]) : next_accept(p, k - 1);
        E += prod;
        if (expected) expected[k - 1] = (float) prod;
        const double v = E - R * t_rows(p, k + 1);
        if (v > best_v && k >= p->n_min) {  // (shorter than n_min: not an option)
            best_v = v;
            best_k = k;
            best_e = E;
        }
        if (upto) upto[k - 1] = best_v - v0;
    }
    if (e) *e = best_e;
    return best_k;
}

static int32_t blind_cut(const struct dflash_policy * p, int32_t n) { return cut_at(p, NULL, n, NULL, NULL, NULL); }

// The drafter's draft length: the m whose slots the cut has recently made most of, net of the draft's
// time (a longer draft costs more to make, and its last slots are verified only when confident).
// Sizing by the recent acceptance drafted 5-6 tokens where the cut verified 1.5 of them; replayed on
// two drafters' dense traces of HumanEval (bench/bench_policy.py) this drafts ~4 (one draft in
// DRAFT_EXPLORE of n_max included), and with GAIN_EMA gained 3-6 %.  Each slot's share is learnt
// from the drafts that had it, as a difference within the same draft: whole values per m, learnt
// from different drafts (slot 4 only from drafts of 4 or more), compared a recent level for m = 3
// with a stale one for m = 4 .. 7 and drafted 4, 5 or 7 tokens where the cut kept 3 (HumanEval,
// 2026-12-03's dense traces and cost curves: 611 of 998 drafts longer than 3, 28 of them verified
// beyond it; now 178, replayed 0.4 % slower to 3 % faster in 12 set x cost-curve cases, +0.8 %
// geomean).
static int32_t draft_size(struct dflash_policy * p, int32_t n_cap, bool explore) {
    const double R = plain_rate(p);  // (as the gate charges a draft's time: dflash_policy_choose)
    const int32_t j = p->base_rows > 0;
    const int32_t lo = min_draft(p);  // (n_cap >= lo: dflash_policy_plan)
    double best_v = -INFINITY;
    int32_t best_n = lo;
    if (p->n_valued[j] < lo) {
        // nothing known yet: the recent acceptance, one slot more (the cut may keep it)
        double E = 1.0, prod = 1.0;
        for (int32_t n = 1; n <= n_cap; n++) {
            prod *= recent_at(p, n - 1);
            E += prod;
            const double v = E - R * (dflash_policy_t_draft(p, n) + t_rows(p, n + 1));
            if (v > best_v && n >= lo) {
                best_v = v;
                best_n = n;
            }
        }
        return best_n + 1 < n_cap ? best_n + 1 : n_cap;
    }
    double cum = 0.0;
    for (int32_t m = 1; m < lo; m++) cum += p->value[j][m - 1];
    for (int32_t m = lo; m <= n_cap && m <= p->n_valued[j]; m++) {
        cum += p->value[j][m - 1];
        const double v = cum - R * dflash_policy_t_draft(p, m);
        if (v > best_v) {
            best_v = v;
            best_n = m;
        }
    }
    return explore && p->explore_in == 0 ? n_cap : best_n;
}

int32_t dflash_policy_plan(struct dflash_policy * p, int32_t n_cap, bool * probe) {
    *probe = false;
    p->probing = false;
    if (n_cap < min_draft(p)) return 0;  // (no draft it may verify)
    if (p->blind) {
        // a source without confidences: its draft says nothing new, so what the cut will verify is
        // known now -- a draft it would verify some of, or a plain step (a probe now and then); its
        // drafts are whole (a source's call costs about the same for any length), the cut decides
        if (blind_cut(p, n_cap) > 0) return n_cap;
        // what was verified before a plain stretch says less the longer ago it was: the belief fades
        // by half every BLIND_HALF plain steps (keeping its mean), so a probe after a long stretch counts
        blind_fade(p, fmax(2.0, (p->blind_a + p->blind_b) * exp2(-1.0 / BLIND_HALF)));
        if (++p->blind_skipped >= p->blind_every) {
            *probe = p->probing = true;
            return n_cap;
        }
        return 0;
    }
    const int32_t c = p->state;
    if (p->gain[c] > 0.0) return draft_size(p, n_cap, true);
    if (++p->skipped[c] >= p->probe_every[c]) {
        // (a probe is never the draft made whole: where drafts have not been paying, one of n_max
        // tokens after a plain stretch took a random drafter 12.5-16.4 ms against ~3 for its usual probe)
        *probe = p->probing = true;
        return draft_size(p, n_cap, false);
    }
    return 0;
}

int32_t dflash_policy_choose(struct dflash_policy * p, const float * conf, int32_t n, int32_t n_made,
                             float * expected) {
    const double R0 = plain_rate(p);
    double best_e, upto[DFLASH_MAX_DRAFT];
    int32_t best_k = cut_at(p, p->blind ? NULL : conf, n, expected, &best_e, upto);
    if (!p->blind && conf) {
        // what the cut made of the first m slots of the n_made asked for (the drafter returned n: it
        // stopped where its own p_min or a grammar did, and slots beyond add nothing)
        const int32_t j = p->base_rows > 0;
        double * val = p->value[j];
        double prev = 0.0;
        for (int32_t m = 1; m <= n_made && m <= DFLASH_MAX_DRAFT; m++) {
            const double v = n >= 1 ? upto[(m < n ? m : n) - 1] : 0.0;
            const double inc = v - prev;  // what slot m added to this draft's cut
            prev = v;
            val[m - 1] = m > p->n_valued[j] ? inc : val[m - 1] + VALUE_EMA * (inc - val[m - 1]);
        }
        if (n_made > p->n_valued[j]) p->n_valued[j] = n_made < DFLASH_MAX_DRAFT ? n_made : DFLASH_MAX_DRAFT;
        p->explore_in = p->explore_in > 0 ? p->explore_in - 1 : DRAFT_EXPLORE - 1;
    }
    // without confidences only verified slots teach anything: a probe (or the very first draft)
    // verifies one at least, even where the belief says it does not pay
    if (p->blind && best_k == 0 && n >= min_draft(p) && (p->probing || !p->blind_known)) {
        // (one slot more after each probe that passed whole: a source that keeps passing is learnt
        // faster, and its accepted slots are tokens; n_min slots at least)
        best_k = 1 + p->probe_run < n ? 1 + p->probe_run : n;
        if (best_k < p->n_min) best_k = p->n_min;
        double prod = 1.0;
        best_e = 1.0;
        for (int32_t i = 0; i < best_k; i++) best_e += (prod *= next_accept(p, i));
    }
    // over a plain step, in plain-step units (alone, a plain step's time buys one token)
    p->last_gain = best_e - R0 * (dflash_policy_t_draft(p, n_made) + t_rows(p, best_k + 1))
                   - (1.0 - R0 * t_rows(p, 1));
    return best_k;
}

// The drafter's recent acceptance of the slots a step reached (every earlier one accepted), k verified.
static void update_recent(struct dflash_policy * p, int32_t k, int32_t n_acc) {
    for (int32_t i = 0; i < k && i <= n_acc; i++) {
        if (p->recent[i] < 0.0) p->recent[i] = recent_at(p, i);
        p->recent[i] += 0.3 * ((i < n_acc ? 1.0 : 0.0) - p->recent[i]);
    }
}

// A blind source's belief after k verified slots, n_acc of them accepted (each reached slot is a reading).
static void blind_observe(struct dflash_policy * p, int32_t k, int32_t n_acc) {
    if (k < 1) return;
    const int32_t got = n_acc < k ? n_acc : k;
    if (got == k && p->probing) {
        // a probe passed whole where the belief gave it little chance: the source has changed (a new
        // text), and what was learnt of the old one counts as a prior only
        double like = 1.0;
        for (int32_t i = 0; i < k; i++) like *= (p->blind_a + i) / (p->blind_a + p->blind_b + i);
        if (like < BLIND_SURPRISE) blind_fade(p, BLIND_RESET);
    }
    p->blind_known = true;
    p->blind_a += got;
    p->blind_b += got < k ? 1.0 : 0.0;
    blind_fade(p, BLIND_CAP);
}

// The drafter's probes back off while they find nothing, as far as keeps their cost (a draft each)
// at PROBE_BUDGET of the time.
static int32_t probe_backoff(const struct dflash_policy * p, int32_t every) {
    double cost = fmax(dflash_policy_t_draft(p, 1), p->t_probe) / dflash_policy_t_verify(p, 1);
    if (p->blind) cost += fmax(0.0, t_rows(p, 2) - t_rows(p, 1)) / dflash_policy_t_verify(p, 1);
    int32_t cap = (int32_t) ceil(cost / PROBE_BUDGET);
    cap = cap < 2 ? 2 : (cap > PROBE_MAX ? PROBE_MAX : cap);
    const int32_t next = (p->blind ? BLIND_BACKOFF : 2) * every;
    return next < cap ? next : cap;
}

// What a draft decided in state c turned out to be worth, in expectation: an EMA while drafting
// there pays.  Within a streak (warm states) over ~10 drafts: one unconfident draft there is noise --
// weighted 0.7 to the newest, one stopped drafting on HumanEval, where drafting pays on the whole.
// A cold state's draft is credited with its whole streak, and when the text turns to where the
// drafter fails, each draft there costs its time for nothing: weighted 0.7 to the newest, it stops
// after a few (at 0.1, stretches where every draft fails cost ~20 drafts each).  Replayed on two
// drafters' dense traces (bench/bench_policy.py) with draft sizing by value: HumanEval greedy / T 0.7
// 1.039 / 1.008 -> 1.097 / 1.056x and 1.081 / 1.062 -> 1.112 / 1.072x, prose within 1 %.  After a
// probe, the fresh value replaces the stale one.
static void credit(struct dflash_policy * p, int32_t c, double g) {
    if (p->gain[c] > 0.0) {
        p->gain[c] += (c <= 1 ? GAIN_EMA_COLD : GAIN_EMA) * (g - p->gain[c]);
    } else {
        p->gain[c] = g;
        p->probe_every[c] = g > 0.0 ? 2 : probe_backoff(p, p->probe_every[c]);
    }
}

void dflash_policy_observe(struct dflash_policy * p, bool adaptive, int32_t n_drafted, const float * conf, int32_t k,
                           int32_t n_acc, int32_t committed, double t_draft, int32_t n_injected, double t_verify,
                           int32_t rows_total, int32_t shadow) {
    struct dflash_costs * cm = &p->costs;
    if (rows_total < k + 1) rows_total = k + 1;
    if (p->have_costs && cm->n_rows >= 1) {
        const double model = curve(cm->t_verify, cm->n_rows, rows_total);
        double r = model > 0.0 ? t_verify / model : 1.0;
        r = r < 0.2 ? 0.2 : (r > 5.0 ? 5.0 : r);  // one preempted step must not swing the model
        if (p->base_rows > 0) {
            // a joint decode: its own speed factor (the one-sequence curves stay as they are)
            p->joint_speed = 0.8 * (p->joint_speed > 0.0 ? p->joint_speed : p->speed) + 0.2 * r;
        } else {
            // machine drift moves every size alike; each size's own curve follows more slowly, but for
            // one row's, which anchors the speed factor: were both refined, a run of plain steps (all
            // one row) could trade one for the other without end, the speed drifting up, the one-row
            // time down and every larger batch priced too high (t(2) / t(1) measured 1.4-1.7 here
            // reached 3.3 over a long bench)
            p->speed = 0.9 * p->speed + 0.1 * r;
            if (rows_total >= 2 && rows_total <= cm->n_rows) {
                cm->t_verify[rows_total - 1] += 0.05 * (t_verify / p->speed - cm->t_verify[rows_total - 1]);
            }
        }
        // the draft's own time, alone or beside a joint decode (in the group it is paid before the decode);
        // not from a draft that first injected the rows of a plain stretch (a probe: 64 rows cost more
        // than the draft itself, and a draft within a streak injects only the last step's few)
        if (n_drafted >= 1 && n_drafted <= cm->n_draft && n_injected <= n_drafted + 2) {
            cm->t_draft[n_drafted - 1] += 0.1 * (t_draft / p->speed - cm->t_draft[n_drafted - 1]);
        } else if (n_drafted >= 1 && cm->n_draft == 0) {
            p->t_draft_ext = p->t_draft_ext > 0.0 ? 0.9 * p->t_draft_ext + 0.1 * t_draft : t_draft;
        }
    }
    const double t = t_draft + t_verify;
    if (t > 0.0 && p->base_rows == 0) p->rate = p->rate > 0.0 ? 0.9 * p->rate + 0.1 * committed / t : committed / t;
    if (p->probing && n_drafted > 0) p->t_probe = p->t_probe > 0.0 ? 0.7 * p->t_probe + 0.3 * t_draft : t_draft;
    const int32_t c = p->state;  // the state this step's draft was decided in
    p->state = k == 0 ? 0 : (n_acc == 0 ? 1 : (n_acc < 3 ? 2 : 3));
    if (adaptive && n_drafted > 0) {  // (a fixed-length step formed no expectation)
        if (p->blind) {  // a source without confidences: its belief decides (dflash_policy_plan)
            blind_observe(p, k, n_acc);
            p->blind_skipped = 0;
            if (p->probing) {
                // drafting resumes once what the probes verified makes a cut pay; until then an accepted
                // probe halves the wait for the next one if one more would make it pay, and anything
                // else triples it (a source far from paying is not probed often, however lucky)
                const int32_t half = p->blind_every / 2 > 2 ? p->blind_every / 2 : 2;
                p->probe_run = k >= 1 && n_acc >= k ? p->probe_run + 1 : 0;
                if (blind_cut(p, n_drafted) > 0) {
                    p->blind_every = 2;
                    p->probe_run = 0;
                } else if (n_acc == 0) {
                    p->blind_every = probe_backoff(p, p->blind_every);
                } else {
                    p->blind_a += 1.0;
                    const bool near = blind_cut(p, n_drafted) > 0;
                    p->blind_a -= 1.0;
                    p->blind_every = near ? half : probe_backoff(p, p->blind_every);
                }
            }
            return;
        }
        p->skipped[c] = 0;
        const double g = p->last_gain;  // expected from the confidences, not realised
        if (c <= 1) {  // a draft from a cold state starts an episode: it is worth its whole streak
            p->ep_state = c;
            p->ep_gain = g;
        } else {
            if (p->ep_state >= 0) p->ep_gain += g;
            credit(p, c, g);
        }
    }
    if (p->ep_state >= 0 && (p->state <= 1 || !adaptive || n_drafted == 0)) {  // the streak is over
        credit(p, p->ep_state, p->ep_gain);
        p->ep_state = -1;
    }
    if (n_drafted == 0) return;
    if (p->blind) {  // (a fixed-length step of a draft source)
        blind_observe(p, k, n_acc);
        return;
    }
    // The slot just past a cut that kept only accepted slots, compared with the token the target
    // committed there, is a verified slot in all but cost: without it the calibration learnt only
    // from slots the cut kept, and a bin the cut stopped before (a probe cut to nothing, the tail
    // of a confident stretch) kept what it had once seen.
    if (conf && shadow >= 0 && n_acc == k && k < n_drafted) {
        k++;
        n_acc += shadow > 0;
    }
    update_recent(p, k, n_acc);
    for (int32_t i = 0; conf && i < k && i <= n_acc; i++) {  // slots reached: every earlier one accepted
        const float ok = i < n_acc ? 1.0f : 0.0f;
        const int32_t b = bin_of(conf[i]), pos = pos_of(i);
        if (p->cal.reached[pos][b] >= CAL_CAP) {
            p->cal.reached[pos][b] *= 0.5f;
            p->cal.accepted[pos][b] *= 0.5f;
        }
        p->cal.reached[pos][b] += 1.0f;
        p->cal.accepted[pos][b] += ok;
    }
}

void dflash_policy_set_calibration(struct dflash_policy * p, const struct dflash_calibration * cal) {
    p->cal = *cal;
    p->n_valued[0] = p->n_valued[1] = 0;  // (the cut's values under the old calibration)
    for (int32_t i = 0; i < DFLASH_CAL_POS; i++) {
        for (int32_t b = 0; b < DFLASH_CAL_BINS; b++) {  // counts: finite, >= 0, accepted <= reached
            float r = p->cal.reached[i][b], a = p->cal.accepted[i][b];
            r = isfinite(r) && r > 0.0f ? r : 0.0f;
            a = isfinite(a) && a > 0.0f ? (a < r ? a : r) : 0.0f;
            p->cal.reached[i][b] = r;
            p->cal.accepted[i][b] = a;
        }
    }
    for (int32_t i = 0; i < DFLASH_MAX_DRAFT; i++) {  // the prior before any draft: each position's mean
        double A = 0.0, T = 0.0;
        for (int32_t b = 0; b < DFLASH_CAL_BINS; b++) {
            A += p->cal.accepted[pos_of(i)][b];
            T += p->cal.reached[pos_of(i)][b];
        }
        p->recent[i] = T >= 1.0 ? (A + 1.0) / (T + 2.0) : -1.0;
    }
}


int32_t dflash_policy_replay(const struct dflash_costs * costs, const struct dflash_calibration * cal, int32_t n_max,
                             int32_t n_traces, const int32_t * lens, const int32_t * accepted, const float * conf,
                             int32_t passes, double t_inject_row, struct dflash_replay * out, char * err,
                             size_t err_len) {
    if (!costs || !out || (n_traces > 0 && (!lens || !accepted))) {
        dflash_seterr(err, err_len, "replay: costs, out, lens and accepted are required");
        return -1;
    }
    if (!(t_inject_row >= 0.0) || !isfinite(t_inject_row)) {
        dflash_seterr(err, err_len, "replay: t_inject_row is not a time");
        return -1;
    }
    if (n_max < 1 || n_max > DFLASH_MAX_DRAFT || costs->n_rows < n_max + 1 || costs->n_rows > DFLASH_MAX_ROWS ||
        costs->n_draft < 0 || costs->n_draft > DFLASH_MAX_DRAFT || n_traces < 0 || passes < 1) {
        dflash_seterr(err, err_len, "replay: n_max %d (1 .. %d) needs verify costs of 1 .. n_max + 1 rows (have %d), "
                      "draft costs of at most %d sizes (have %d), n_traces >= 0, passes >= 1", n_max, DFLASH_MAX_DRAFT,
                      costs->n_rows, DFLASH_MAX_DRAFT, costs->n_draft);
        return -1;
    }
    for (int32_t k = 0; k < costs->n_rows; k++) {
        if (!(costs->t_verify[k] > 0.0) || !isfinite(costs->t_verify[k])) {
            dflash_seterr(err, err_len, "replay: t_verify[%d] is not a positive time", k);
            return -1;
        }
    }
    for (int32_t n = 0; n < costs->n_draft; n++) {
        if (!(costs->t_draft[n] >= 0.0) || !isfinite(costs->t_draft[n])) {
            dflash_seterr(err, err_len, "replay: t_draft[%d] is not a time", n);
            return -1;
        }
    }
    size_t total = 0;
    for (int32_t t = 0; t < n_traces; t++) {
        if (lens[t] < 0) {
            dflash_seterr(err, err_len, "replay: trace %d has a negative length", t);
            return -1;
        }
        total += (size_t) lens[t];
    }
    for (size_t j = 0; j < total; j++) {
        if (accepted[j] < 0 || accepted[j] > n_max) {
            dflash_seterr(err, err_len, "replay: accepted[%zu] = %d is outside 0 .. n_max", j, accepted[j]);
            return -1;
        }
    }
    for (size_t i = 0; conf && i < total * (size_t) n_max; i++) {
        if (!(conf[i] >= 0.0f && conf[i] <= 1.0f)) {
            dflash_seterr(err, err_len, "replay: conf[%zu] is not a probability", i);
            return -1;
        }
    }
    struct dflash_policy p;
    dflash_policy_init(&p);
    dflash_policy_set_costs(&p, costs);
    if (cal) dflash_policy_set_calibration(&p, cal);
    float expected[DFLASH_MAX_DRAFT];
    for (int32_t pass = 0; pass < passes; pass++) {
        memset(out, 0, sizeof(*out));
        size_t off = 0;
        for (int32_t t = 0; t < n_traces; off += (size_t) lens[t++]) {
            dflash_policy_begin(&p, conf == NULL);
            int32_t pending = 0;  // rows committed since the last draft (the next one injects them)
            // dflash_engine_step's order: the cap, plan, draft, cut, verify (greedy), observe
            for (int32_t j = 0; j < lens[t];) {
                const int32_t left = lens[t] - j - 1;  // never draft past the token budget
                const int32_t n_cap = left < n_max ? left : n_max;
                const bool adaptive = n_cap > 0;
                bool probe = false;
                const int32_t n = adaptive ? dflash_policy_plan(&p, n_cap, &probe) : 0;
                const float * c = n > 0 && conf ? conf + (off + (size_t) j) * (size_t) n_max : NULL;
                const int32_t k = n > 0 ? dflash_policy_choose(&p, c, n, n, expected) : 0;
                const int32_t a = accepted[off + (size_t) j];
                const int32_t got = k < a ? k : a;
                const int32_t injected = n > 0 ? pending : 0;
                // the machine's times are the given curves; the policy's model learns from them (timing
                // with its own, which moves towards what it observes, would feed the injection back
                // into the draft curve step after step)
                const double td = n > 0 ? dflash_costs_t_draft(costs, n) + injected * t_inject_row : 0.0;
                const double tv = dflash_costs_t_verify(costs, k + 1);
                dflash_policy_observe(&p, adaptive, n, c, k, got, got + 1, td, injected, tv, k + 1,
                                      got == k && k < n ? a > k : -1);
                pending = (n > 0 ? 0 : pending) + got + 1;
                out->seconds += td + tv;
                out->steps++;
                out->plain_steps += adaptive && n == 0;
                out->made += n;
                out->drafted += k;
                out->accepted += got;
                j += got + 1;
            }
        }
        out->plain_seconds = (double) total * costs->t_verify[0];
    }
    return 0;
}
