// Target feature capture: the outputs of the drafter's tapped target layers
// for every row of every target decode.
//
// Two paths.  Architectures whose graph builder records layer inputs use
// llama_set_embeddings_layer_inp (input of layer L+1 == output of layer L).
// Others would abort inside libllama on that API, so they use a cb_eval
// callback that copies the `l_out-L` tensors as the scheduler computes them.
#include "dflash.h"

#include "common.h"
#include "llama_ext.h"

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <stdlib.h>
#include <string.h>

struct dflash_capture {
    int32_t mode;
    int32_t n_layers;
    int32_t layers[DFLASH_MAX_TAPS]; // HF ids
    int32_t n_embd;
    int32_t max_rows;
    struct llama_context * ctx;
    bool installed;        // cb_eval set in the context params
    // cb_eval path: one plane per tap, filled ubatch by ubatch
    float * planes;        // [n_layers][max_rows][n_embd]
    int32_t rows_done[DFLASH_MAX_TAPS];
    bool overflow;
    float * out;           // [max_rows][n_layers*n_embd]
};

// Graph builders in the pinned libllama that set t_layer_inp (checked against
// its src/models/*.cpp); any other architecture must use cb_eval.
static const char * k_layer_inp_archs[] = {
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2",
    "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35",
    "qwen35moe", "qwen3moe", "qwen3next", "qwen4exp",
};

bool dflash_target_has_layer_inp(const struct llama_model * target) {
    const dflash_llama_ext * ext = dflash_llama_ext_get();
    if (!ext->set_layer_inp || !ext->get_layer_inp) return false;
    char arch[64] = { 0 };
    if (llama_model_meta_val_str(target, "general.architecture", arch, sizeof(arch)) < 0) return false;
    for (size_t i = 0; i < sizeof(k_layer_inp_archs) / sizeof(k_layer_inp_archs[0]); i++) {
        if (strcmp(arch, k_layer_inp_archs[i]) == 0) return true;
    }
    return false;
}

dflash_capture * dflash_capture_new(const struct llama_model * target, const int32_t * layers, int32_t n_layers,
                                    int32_t max_rows, int32_t mode, char * err, size_t err_len) {
    if (n_layers <= 0 || n_layers > DFLASH_MAX_TAPS) {
        dflash_seterr(err, err_len, "capture needs 1..%d layers (got %d)", DFLASH_MAX_TAPS, n_layers);
        return NULL;
    }
    if (max_rows <= 0) {
        dflash_seterr(err, err_len, "capture max_rows must be positive");
        return NULL;
    }
    const int32_t n_layer = llama_model_n_layer(target);
    for (int32_t i = 0; i < n_layers; i++) {
        if (layers[i] < 0 || layers[i] >= n_layer - 1) {
            dflash_seterr(err, err_len, "cannot capture layer %d: the target has %d layers (usable: 0..%d)",
                          layers[i], n_layer, n_layer - 2);
            return NULL;
        }
    }
    const bool has_inp = dflash_target_has_layer_inp(target);
    if (mode == 0) mode = has_inp ? DFLASH_CAPTURE_LAYER_INP : DFLASH_CAPTURE_CB_EVAL;
    if (mode == DFLASH_CAPTURE_LAYER_INP && !has_inp) {
        dflash_seterr(err, err_len, "this target architecture does not record layer inputs; use cb_eval capture");
        return NULL;
    }
    if (mode != DFLASH_CAPTURE_LAYER_INP && mode != DFLASH_CAPTURE_CB_EVAL) {
        dflash_seterr(err, err_len, "unknown capture mode %d", mode);
        return NULL;
    }
    struct dflash_capture * c = calloc(1, sizeof(*c));
    c->mode = mode;
    c->n_layers = n_layers;
    memcpy(c->layers, layers, sizeof(int32_t) * n_layers);
    c->n_embd = llama_model_n_embd(target);
    c->max_rows = max_rows;
    c->out = malloc(sizeof(float) * (size_t) max_rows * n_layers * c->n_embd);
    if (mode == DFLASH_CAPTURE_CB_EVAL) {
        c->planes = malloc(sizeof(float) * (size_t) n_layers * max_rows * c->n_embd);
    }
    if (!c->out || (mode == DFLASH_CAPTURE_CB_EVAL && !c->planes)) {
        dflash_capture_free(c);
        dflash_seterr(err, err_len, "out of memory for the capture buffers");
        return NULL;
    }
    return c;
}

void dflash_capture_free(dflash_capture * c) {
    if (!c) return;
    free(c->planes);
    free(c->out);
    free(c);
}

int32_t dflash_capture_mode(const dflash_capture * c) { return c->mode; }

int32_t dflash_capture_row_width(const dflash_capture * c) { return c->n_layers * c->n_embd; }

static bool capture_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    struct dflash_capture * c = user_data;
    const char * name = ggml_get_name(t);
    if (strncmp(name, "l_out-", 6) != 0) return false;
    char * end = NULL;
    long il = strtol(name + 6, &end, 10);
    if (!end || *end != '\0') return false;
    int32_t j = -1;
    for (int32_t i = 0; i < c->n_layers; i++) {
        if (c->layers[i] == il) { j = i; break; }
    }
    if (j < 0) return false;
    if (ask) return true;
    // Returning false would abort the target's compute: always return true.
    const int64_t n = t->ne[1];
    if (t->type != GGML_TYPE_F32 || t->ne[0] != c->n_embd || !ggml_is_contiguous(t) ||
        c->rows_done[j] + n > c->max_rows) {
        c->overflow = true;
        return true;
    }
    ggml_backend_tensor_get(t, c->planes + ((size_t) j * c->max_rows + c->rows_done[j]) * c->n_embd, 0,
                            sizeof(float) * (size_t) n * c->n_embd);
    c->rows_done[j] += (int32_t) n;
    return true;
}

void dflash_capture_install(dflash_capture * c, void * params) {
    if (c->mode != DFLASH_CAPTURE_CB_EVAL) return;
    struct llama_context_params * p = params;
    p->cb_eval = capture_cb;
    p->cb_eval_user_data = c;
    c->installed = true;
}

int32_t dflash_capture_attach(dflash_capture * c, struct llama_context * ctx, char * err, size_t err_len) {
    if (c->mode == DFLASH_CAPTURE_CB_EVAL && !c->installed) {
        dflash_seterr(err, err_len, "cb_eval capture must be installed in the context params before the context is created");
        return -1;
    }
    if ((int64_t) c->max_rows < (int64_t) llama_n_batch(ctx)) {
        dflash_seterr(err, err_len, "capture holds %d rows but the context's n_batch is %u", c->max_rows, llama_n_batch(ctx));
        return -1;
    }
    c->ctx = ctx;
    if (c->mode == DFLASH_CAPTURE_LAYER_INP) {
        const dflash_llama_ext * ext = dflash_llama_ext_get();
        for (int32_t i = 0; i < c->n_layers; i++) ext->set_layer_inp(ctx, (uint32_t) c->layers[i] + 1, true);
    }
    return 0;
}

void dflash_capture_begin(dflash_capture * c) {
    memset(c->rows_done, 0, sizeof(c->rows_done));
    c->overflow = false;
}

const float * dflash_capture_rows(dflash_capture * c, int32_t n_tokens) {
    if (!c->ctx || n_tokens <= 0 || n_tokens > c->max_rows) return NULL;
    const size_t E = (size_t) c->n_embd, W = (size_t) c->n_layers * E;
    const dflash_llama_ext * ext = dflash_llama_ext_get();
    for (int32_t j = 0; j < c->n_layers; j++) {
        const float * src;
        if (c->mode == DFLASH_CAPTURE_LAYER_INP) {
            src = ext->get_layer_inp(c->ctx, (uint32_t) c->layers[j] + 1);
            if (!src) return NULL;
        } else {
            if (c->overflow || c->rows_done[j] != n_tokens) return NULL;
            src = c->planes + (size_t) j * c->max_rows * E;
        }
        for (int32_t r = 0; r < n_tokens; r++) memcpy(c->out + r * W + j * E, src + r * E, sizeof(float) * E);
    }
    return c->out;
}
