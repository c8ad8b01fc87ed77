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

struct llama_model;
/* Every product of `model`'s weights (a type the kernels read) to the kernels whatever its rows (on),
 * or back to 1..16 rows (off): exact mode's contexts, whose prompt rows must round as their
 * one-token decodes do.  No effect where the kernels are not registered. */
void dflash_kernels_all_rows(const struct llama_model * model, bool on);

#ifdef __cplusplus
}
#endif
#endif
