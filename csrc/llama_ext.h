// Internal: run-time access to libllama functions outside its C API.
#pragma once

#include "ggml-backend.h"
#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dflash_llama_ext {
    void    (*set_layer_inp)(struct llama_context * ctx, uint32_t lid, bool value);
    float * (*get_layer_inp)(struct llama_context * ctx, uint32_t lid);
    void *    tensor_map; // C++ function, used by dflash_model_tensors only
    ggml_backend_sched_t (*get_sched)(const struct llama_context * ctx); // a const member: ctx is `this`
} dflash_llama_ext;

// Resolved once; absent functions are NULL.
const dflash_llama_ext * dflash_llama_ext_get(void);

// All tensors of `model` named `name` (tied heads appear twice: the embedding
// and its duplicate).  Returns the count, or -1 if the table is unreachable.
int32_t dflash_model_tensors(const struct llama_model * model, const char * name,
                             struct ggml_tensor ** out, int32_t max_out);

#ifdef __cplusplus
}
#endif
