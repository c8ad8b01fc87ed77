/* The small-batch kernels' backend, for the core's own graphs (the drafter's scheduler). */
#ifndef DFLASH_KERNELS_H
#define DFLASH_KERNELS_H

#include "ggml-backend.h"

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A new instance of the kernels' backend on n_threads threads, owned by the caller (ggml_backend_free);
 * NULL where the kernels are not registered or switched off. */
ggml_backend_t dflash_kernels_backend(int n_threads);

/* Whether b is an instance of the kernels' backend; if so, from its context's next graph split it
 * takes that context's attention and row-wise ops of 1..16 rows too (attention 1) or not (0), and
 * all of it at every row count (all_rows 1: exact mode's contexts, whose prompt rows must round as
 * their one-token decodes do) or 1..16 rows (0).  -1 leaves a setting as it is. */
bool dflash_kernels_backend_set(ggml_backend_t b, int attention, int all_rows);

#ifdef __cplusplus
}
#endif
#endif
