// Access to the parts of libllama that are not in its C API: the staging
// functions of src/llama-ext.h (C++ linkage, so mangled names) and the
// model's tensor table.  Every symbol is resolved at run time from the
// libllama already loaded in the process, so a missing one is reported as
// "unsupported" instead of failing to load.
#include "llama_ext.h"

#include "dflash.h"
#include "kernels/kernels.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <dlfcn.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

using tensor_map = std::vector<std::pair<std::string, ggml_tensor *>>;
using tensor_map_fn = const tensor_map & (*)(const llama_model *);

void * libllama_handle() {
    static void * h = [] {
        // RTLD_NOLOAD: never map a second copy; llama_cpp has loaded it already
        // (or our own DT_NEEDED entry did).
        void * p = dlopen("libllama.so.0", RTLD_NOW | RTLD_NOLOAD);
        if (!p) p = dlopen("libllama.so", RTLD_NOW | RTLD_NOLOAD);
        return p;
    }();
    return h;
}

void * sym(const char * name) {
    void * h = libllama_handle();
    return h ? dlsym(h, name) : nullptr;
}

} // namespace

extern "C" {

const dflash_llama_ext * dflash_llama_ext_get(void) {
    static dflash_llama_ext ext = [] {
        dflash_llama_ext e;
        std::memset(&e, 0, sizeof(e));
        e.set_layer_inp = (void (*)(llama_context *, uint32_t, bool))
            sym("_Z30llama_set_embeddings_layer_inpP13llama_contextjb");
        e.get_layer_inp = (float * (*)(llama_context *, uint32_t))
            sym("_Z30llama_get_embeddings_layer_inpP13llama_contextj");
        e.tensor_map = sym("_Z29llama_internal_get_tensor_mapB5cxx11PK11llama_model");
        e.get_sched = (ggml_backend_sched_t (*)(const llama_context *))
            sym("_ZNK13llama_context9get_schedEv");  // llama_context::get_sched() const
        return e;
    }();
    return &ext;
}

int32_t dflash_model_tensors(const llama_model * model, const char * name,
                             ggml_tensor ** out, int32_t max_out) {
    const dflash_llama_ext * ext = dflash_llama_ext_get();
    if (!ext->tensor_map) return -1;
    const tensor_map & map = ((tensor_map_fn) ext->tensor_map)(model);
    int32_t n = 0;
    for (const auto & [tname, t] : map) {
        if (tname == name) {
            if (n < max_out) out[n] = t;
            n++;
        }
    }
    return n;
}

int32_t dflash_context_reference_kernels(llama_context * ctx, bool on) {
    const dflash_llama_ext * ext = dflash_llama_ext_get();
    if (!ext->get_sched) return -1;
    ggml_backend_sched_t sched = ext->get_sched(ctx);
    if (!sched) return -1;
    int32_t n = 0;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); i++) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        if (b && ggml_backend_is_cpu(b)) {
            ggml_backend_cpu_set_use_ref(b, on);
            n++;
        }
        // and every product and attention to the small-batch kernels, prefill included: a prompt's
        // rows then round as one-token decodes of them do (a re-evaluated last prompt token, a reused prefix)
        dflash_kernels_backend_set(b, -1, on);
    }
    return n;
}

int32_t dflash_context_kernels_attention(llama_context * ctx, bool on) {
    const dflash_llama_ext * ext = dflash_llama_ext_get();
    ggml_backend_sched_t sched = ext->get_sched ? ext->get_sched(ctx) : nullptr;
    if (!sched) return -1;
    int32_t n = 0;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); i++)
        n += dflash_kernels_backend_set(ggml_backend_sched_get_backend(sched, i), on, -1);
    return n;
}

} // extern "C"
