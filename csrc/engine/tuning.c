// The cost model's settings, passed to the policy (dflash_policy.c): costs, clock, calibration.
#include "engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// The curves that are usable: positive finite verify times, non-negative finite draft times (else none).
static struct dflash_costs usable_costs(const struct dflash_costs * costs) {
    struct dflash_costs c = *costs;
    if (c.n_rows < 0 || c.n_rows > DFLASH_MAX_DRAFT + 1) c.n_rows = 0;
    if (c.n_draft < 0 || c.n_draft > DFLASH_MAX_DRAFT) c.n_draft = 0;
    for (int32_t k = 0; k < c.n_rows; k++) {
        if (!(c.t_verify[k] > 0.0) || !isfinite(c.t_verify[k])) c.n_rows = 0;
    }
    for (int32_t n = 0; n < c.n_draft; n++) {
        if (!(c.t_draft[n] >= 0.0) || !isfinite(c.t_draft[n])) c.n_draft = 0;
    }
    return c;
}

void dflash_engine_set_costs(dflash_engine * e, const struct dflash_costs * costs) {
    const struct dflash_costs c = usable_costs(costs);  // (unusable: the defaults)
    dflash_policy_set_costs(&e->policy, &c);
}

void dflash_engine_set_clock(dflash_engine * e, const struct dflash_costs * machine) {
    memset(&e->clock, 0, sizeof(e->clock));
    if (machine) e->clock = usable_costs(machine);  // (no usable verify curve: the live clock)
    dflash_policy_set_clock(&e->policy);
}

bool dflash_engine_get_costs(const dflash_engine * e, struct dflash_costs * out) {
    struct dflash_costs c = e->policy.costs;  // the refined curves, in seconds at today's speed
    for (int32_t k = 0; k < c.n_rows; k++) c.t_verify[k] *= e->policy.speed;
    for (int32_t n = 0; n < c.n_draft; n++) c.t_draft[n] *= e->policy.speed;
    *out = c;
    return e->policy.have_costs;
}

double dflash_engine_step_cost(const dflash_engine * e, int32_t n_draft, int32_t k) {
    return dflash_policy_t_draft(&e->policy, n_draft) + dflash_policy_t_verify(&e->policy, k + 1);
}

void dflash_engine_set_calibration(dflash_engine * e, const struct dflash_calibration * cal) {
    dflash_policy_set_calibration(&e->policy, cal);
}

void dflash_engine_get_calibration(const dflash_engine * e, struct dflash_calibration * out) {
    *out = e->policy.cal;
}
