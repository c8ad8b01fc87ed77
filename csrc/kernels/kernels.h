/* The small-batch kernels' backend, for the core's own graphs (the drafter's scheduler). */
#ifndef DFLASH_KERNELS_H
#define DFLASH_KERNELS_H

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A new instance of the kernels' backend on n_threads threads, owned by the caller (ggml_backend_free);
 * NULL where the kernels are not registered or switched off. */
ggml_backend_t dflash_kernels_backend(int n_threads);

#ifdef __cplusplus
}
#endif
#endif
