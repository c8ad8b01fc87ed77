// Loading a drafter: its GGUF keys and tensors read and validated through the
// format table (dflash_format.h), then bound to the target, whose embedding and
// head it borrows unless the file has its own (docs/architecture.md §2.1, §4.4).
#include "drafter.h"
#include "kernels/kernels.h"

#include "common.h"
#include "llama_ext.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#ifdef DFLASH_CUDA
#include "cuda/dflash_cuda.h"
#endif
#include "gguf.h"
#include "llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { DFLASH_NEED_REQ, DFLASH_NEED_OPT, DFLASH_NEED_V2, DFLASH_NEED_D2T };
enum { DFLASH_DTYPE_F32, DFLASH_DTYPE_W, DFLASH_DTYPE_I64 };

// ---------------------------------------------------------------------------
// keys

struct key_reader {
    const struct gguf_context * g;
    const char * path;
    char * err;
    size_t err_len;
    bool v2;
    int32_t n_target_layers, n_rope_sections, n_swa_layers, n_causal_layers; // array lengths read
};

#define X(id, name) name,
static const char * const ROPE_SCALING_NAMES[] = { DFLASH_ROPE_SCALINGS(X) };
#undef X

// Present?  An absent key is an error when the table requires it (V2: in a DFlash2 file).
static int64_t find_key(struct key_reader * r, const char * key, int need, bool * ok) {
    const int64_t id = gguf_find_key(r->g, key);
    if (id < 0 && (need == DFLASH_NEED_REQ || (need == DFLASH_NEED_V2 && r->v2))) {
        if (need == DFLASH_NEED_V2) {
            dflash_seterr(r->err, r->err_len, "'%s': DFlash2 drafter is missing conv/selector key '%s'", r->path, key);
        } else {
            dflash_seterr(r->err, r->err_len, "'%s': missing or invalid key '%s'", r->path, key);
        }
        *ok = false;
    }
    return id;
}

static bool wrong_type(struct key_reader * r, const char * key, int64_t id, const char * want) {
    dflash_seterr(r->err, r->err_len, "'%s': key '%s' has type %s, expected %s", r->path, key,
                  gguf_type_name(gguf_get_kv_type(r->g, id)), want);
    return false;
}

// Any integer type, if its value fits 0..INT32_MAX.
static bool int_value(struct key_reader * r, const char * key, int64_t id, enum gguf_type t, const void * data,
                      size_t i, int32_t * out) {
    long long v;
    switch (t) {
        case GGUF_TYPE_UINT8:  v = ((const uint8_t *) data)[i]; break;
        case GGUF_TYPE_INT8:   v = ((const int8_t *) data)[i]; break;
        case GGUF_TYPE_UINT16: v = ((const uint16_t *) data)[i]; break;
        case GGUF_TYPE_INT16:  v = ((const int16_t *) data)[i]; break;
        case GGUF_TYPE_UINT32: v = ((const uint32_t *) data)[i]; break;
        case GGUF_TYPE_INT32:  v = ((const int32_t *) data)[i]; break;
        case GGUF_TYPE_UINT64: v = ((const uint64_t *) data)[i] > INT32_MAX ? -1 : (long long) ((const uint64_t *) data)[i]; break;
        case GGUF_TYPE_INT64:  v = ((const int64_t *) data)[i]; break;
        case GGUF_TYPE_BOOL:   v = ((const int8_t *) data)[i] != 0; break;
        default: return wrong_type(r, key, id, "an integer");
    }
    if (v < 0 || v > INT32_MAX) {
        dflash_seterr(r->err, r->err_len, "'%s': key '%s' has value %lld, outside 0..%d", r->path, key, v, INT32_MAX);
        return false;
    }
    *out = (int32_t) v;
    return true;
}

static bool read_u32(struct key_reader * r, const char * key, int need, int32_t * dst, int64_t def) {
    bool ok = true;
    const int64_t id = find_key(r, key, need, &ok);
    *dst = (int32_t) def;
    if (id < 0) return ok;
    const enum gguf_type t = gguf_get_kv_type(r->g, id);
    if (t == GGUF_TYPE_BOOL || t == GGUF_TYPE_ARRAY || t == GGUF_TYPE_STRING) return wrong_type(r, key, id, "an integer");
    if (!int_value(r, key, id, t, gguf_get_val_data(r->g, id), 0, dst)) return false;
    if (need == DFLASH_NEED_REQ && *dst == 0 && strncmp(key, DFLASH_ARCH ".", 7) == 0) {
        // the required dflash.* keys are sizes: positive (later defaults divide by them)
        dflash_seterr(r->err, r->err_len, "'%s': key '%s' must be positive", r->path, key);
        return false;
    }
    return true;
}

static bool read_f32(struct key_reader * r, const char * key, int need, float * dst, double def) {
    bool ok = true;
    const int64_t id = find_key(r, key, need, &ok);
    *dst = (float) def;
    if (id < 0) return ok;
    switch (gguf_get_kv_type(r->g, id)) {
        case GGUF_TYPE_FLOAT32: *dst = gguf_get_val_f32(r->g, id); break;
        case GGUF_TYPE_FLOAT64: *dst = (float) gguf_get_val_f64(r->g, id); break;
        default: return wrong_type(r, key, id, "a float");
    }
    if (!isfinite(*dst)) {
        dflash_seterr(r->err, r->err_len, "'%s': key '%s' is not a finite number", r->path, key);
        return false;
    }
    return true;
}

static bool read_bool(struct key_reader * r, const char * key, int need, int32_t * dst, int def) {
    bool ok = true;
    const int64_t id = find_key(r, key, need, &ok);
    *dst = def;
    if (id < 0) return ok;
    if (gguf_get_kv_type(r->g, id) != GGUF_TYPE_BOOL) return wrong_type(r, key, id, "a bool");
    *dst = gguf_get_val_bool(r->g, id);
    return true;
}

// The one string key, rope scaling, held as its index in ROPE_SCALING_NAMES.
static bool read_str(struct key_reader * r, const char * key, int need, int32_t * dst, const char * def) {
    bool ok = true;
    const int64_t id = find_key(r, key, need, &ok);
    const char * v = def;
    if (id >= 0) {
        if (gguf_get_kv_type(r->g, id) != GGUF_TYPE_STRING) return wrong_type(r, key, id, "a string");
        v = gguf_get_val_str(r->g, id);
    }
    for (int32_t i = 0; i < (int32_t) (sizeof(ROPE_SCALING_NAMES) / sizeof(ROPE_SCALING_NAMES[0])); i++) {
        if (strcmp(v, ROPE_SCALING_NAMES[i]) == 0) {
            *dst = i;
            return ok;
        }
    }
    dflash_seterr(r->err, r->err_len, "'%s': %s '%.40s' is not supported (none, linear, yarn)", r->path, key, v);
    return false;
}

static bool read_arr(struct key_reader * r, const char * key, int need, int32_t * dst, int32_t max_n, int32_t * n,
                     bool is_bool) {
    bool ok = true;
    const int64_t id = find_key(r, key, need, &ok);
    *n = 0;
    if (id < 0) return ok;
    if (gguf_get_kv_type(r->g, id) != GGUF_TYPE_ARRAY) return wrong_type(r, key, id, "an array");
    const enum gguf_type t = gguf_get_arr_type(r->g, id);
    if ((is_bool && t != GGUF_TYPE_BOOL) || t == GGUF_TYPE_STRING || t == GGUF_TYPE_ARRAY || t == GGUF_TYPE_FLOAT32 ||
        t == GGUF_TYPE_FLOAT64) {
        dflash_seterr(r->err, r->err_len, "'%s': key '%s' is an array of %s, expected %s", r->path, key,
                      gguf_type_name(t), is_bool ? "bools" : "integers");
        return false;
    }
    const size_t len = gguf_get_arr_n(r->g, id);
    if (len == 0 || len > (size_t) max_n) {
        dflash_seterr(r->err, r->err_len, "'%s': key '%s' has %zu entries, expected 1..%d", r->path, key, len, max_n);
        return false;
    }
    const void * data = gguf_get_arr_data(r->g, id);
    for (size_t i = 0; i < len; i++) {
        if (!int_value(r, key, id, t, data, i, &dst[i])) return false;
    }
    *n = (int32_t) len;
    return true;
}

#define READ_U32(f, key, need, def) read_u32(&r, key, DFLASH_NEED_##need, &hp->f, (def))
#define READ_F32(f, key, need, def) read_f32(&r, key, DFLASH_NEED_##need, &hp->f, (def))
#define READ_BOOL(f, key, need, def) read_bool(&r, key, DFLASH_NEED_##need, &hp->f, (def))
#define READ_STR(f, key, need, def) read_str(&r, key, DFLASH_NEED_##need, &hp->f, (def))
#define READ_ARR_INT(f, key, need, def) \
    read_arr(&r, key, DFLASH_NEED_##need, hp->f, (int32_t) (sizeof(hp->f) / sizeof(hp->f[0])), &r.n_##f, false)
#define READ_ARR_BOOL(f, key, need, def) \
    read_arr(&r, key, DFLASH_NEED_##need, hp->f, (int32_t) (sizeof(hp->f) / sizeof(hp->f[0])), &r.n_##f, true)

#define FAIL(...) do { dflash_seterr(err, err_len, __VA_ARGS__); return false; } while (0)

// Values the graph cannot run, refused here rather than computed into NaNs or an abort.
static bool check_values(const struct dflash_drafter_info * hp, const char * path, char * err, size_t err_len) {
    if (hp->n_layer < 1 || hp->n_layer > DFLASH_MAX_LAYERS) FAIL("'%s': %d drafter layers (supported: 1..%d)", path, hp->n_layer, DFLASH_MAX_LAYERS);
    if (hp->n_embd < 1 || hp->n_ff < 1 || hp->n_head < 1) FAIL("'%s': hidden size, feed-forward size and head count must be positive", path);
    if (hp->n_head_kv < 1 || hp->n_head % hp->n_head_kv != 0 || hp->head_dim < 1 || hp->head_dim % 2 != 0) {
        FAIL("'%s': unsupported attention shape (heads %d, kv heads %d, head size %d)", path, hp->n_head, hp->n_head_kv, hp->head_dim);
    }
    if (hp->block_size < 2 || hp->block_size > DFLASH_MAX_DRAFT + 1) FAIL("'%s': block_size %d is outside 2..%d", path, hp->block_size, DFLASH_MAX_DRAFT + 1);
    if (dflash_max_draft(hp) > DFLASH_MAX_DRAFT) {  // (sample_from_anchor: every row of the block drafts)
        FAIL("'%s': block_size %d with sample_from_anchor drafts %d tokens, more than %d", path, hp->block_size,
             dflash_max_draft(hp), DFLASH_MAX_DRAFT);
    }
    if (!(hp->rms_eps > 0.0f && hp->rms_eps < 1.0f)) FAIL("'%s': rms epsilon %g is outside (0, 1)", path, (double) hp->rms_eps);
    if (!(hp->rope_theta > 0.0f)) FAIL("'%s': rope freq_base %g must be positive", path, (double) hp->rope_theta);
    if (hp->n_ctx_train < hp->block_size) {
        FAIL("'%s': dflash.context_length %d is shorter than one block (block_size %d)", path, hp->n_ctx_train, hp->block_size);
    }
    for (int32_t i = 0; i < hp->n_taps; i++) {
        for (int32_t j = 0; j < i; j++) {
            if (hp->target_layers[i] == hp->target_layers[j]) {
                FAIL("'%s': dflash.target_layers taps layer %d twice", path, hp->target_layers[i]);
            }
        }
    }
    for (int32_t i = 1; i < hp->n_rope_sections; i++) {
        // M-RoPE drafts carry [head_dim/2, 0, 0, 0]: plain 1-D positions
        if (hp->rope_sections[i] != 0) FAIL("'%s': multi-axis rope sections are not supported", path);
    }
    if (hp->rope_dims < 2 || hp->rope_dims > hp->head_dim || hp->rope_dims % 2 != 0) {
        FAIL("'%s': dflash.rope.dimension_count %d must be even and in 2..head_dim (%d)", path, hp->rope_dims, hp->head_dim);
    }
    if (hp->rope_scaling != DFLASH_ROPE_NONE && !(hp->rope_factor > 0.0f)) {
        FAIL("'%s': rope scaling '%s' needs a positive dflash.rope.scaling.factor", path, ROPE_SCALING_NAMES[hp->rope_scaling]);
    }
    if (hp->rope_scaling == DFLASH_ROPE_YARN && hp->rope_orig_ctx < 1) FAIL("'%s': YaRN needs a positive original_context_length", path);
    if (hp->softcap < 0.0f) FAIL("'%s': final_logit_softcapping %g is negative", path, (double) hp->softcap);
    if (hp->version == 2) {
        if (hp->conv_kernel_size < 1 || hp->conv_kernel_size > 8) FAIL("'%s': conv_kernel_size %d is outside 1..8", path, hp->conv_kernel_size);
        if (hp->selector_top_k < 1 || hp->selector_top_k > DFLASH_MAX_TOP_K) FAIL("'%s': selector_top_k %d is outside 1..%d", path, hp->selector_top_k, DFLASH_MAX_TOP_K);
        if (hp->selector_rank < 1 || hp->conv_group_size < 1 || hp->n_embd % hp->conv_group_size != 0) {
            FAIL("'%s': conv_group_size %d must divide the hidden size %d (selector_rank %d)", path, hp->conv_group_size,
                 hp->n_embd, hp->selector_rank);
        }
    }
    return true;
}

// Every key of the table into hp, then the equal / alias / refused keys.
static bool read_keys(struct dflash_drafter_info * hp, const struct gguf_context * g, bool v2, const char * path,
                      char * err, size_t err_len) {
    struct key_reader r = { g, path, err, err_len, v2, 0, 0, 0, 0 };
    memset(hp, 0, sizeof(*hp));
    hp->version = v2 ? 2 : 1;
    bool ok = true;
#define X(field, key, type, need, def, write) ok = ok && READ_##type(field, key, need, def);
    DFLASH_GGUF_KEYS(X)
#undef X
    if (!ok) return false;
    hp->n_taps = r.n_target_layers;
    hp->n_rope_sections = r.n_rope_sections;
    for (int i = 0; i < hp->n_taps; i++) {
        if (hp->target_layers[i] < 1) FAIL("'%s': dflash.target_layers holds %d (layer ids are stored + 1)", path, hp->target_layers[i]);
        hp->target_layers[i] -= 1; // GGUF stores HF id + 1
    }
    for (int i = 0; i < DFLASH_MAX_LAYERS; i++) {
        // no pattern: every layer uses the window
        hp->swa_layers[i] = hp->n_swa > 0 && (r.n_swa_layers == 0 || (i < r.n_swa_layers && hp->swa_layers[i]));
    }
    if (r.n_causal_layers > 0 && r.n_causal_layers != hp->n_layer) {
        FAIL("'%s': dflash.attention.causal_pattern has %d entries for %d layers", path, r.n_causal_layers, hp->n_layer);
    }
    for (int i = 0; i < DFLASH_MAX_LAYERS; i++) {
        // no pattern: the global flag (upstream's one key) for every layer
        hp->causal_layers[i] = r.n_causal_layers > 0 ? (i < r.n_causal_layers && hp->causal_layers[i]) : hp->causal;
    }
    if (hp->value_scale == 0.0f) hp->value_scale = 1.0f; // upstream writes 0 for "unset"
    if (!v2) {
        hp->conv_kernel_size = hp->conv_group_size = hp->selector_rank = hp->selector_top_k = 0;
    }
    int32_t iv = 0;
    float fv = 0.0f;
#define EQUAL_U32(key, v) read_u32(&r, key, DFLASH_NEED_OPT, &iv, (v))
#define X(key, type, field) \
    if (ok) { \
        ok = EQUAL_##type(key, hp->field); \
        if (ok && iv != hp->field) FAIL("'%s': %s = %d differs from " #field " (%d)", path, key, iv, hp->field); \
    }
    DFLASH_GGUF_EQUAL(X)
#undef X
#define X(key, type, field) if (ok && gguf_find_key(g, key) >= 0) ok = READ_##type(field, key, OPT, hp->field);
    DFLASH_GGUF_ALIAS(X)
#undef X
#define REFUSED_U32(key, allowed) (read_u32(&r, key, DFLASH_NEED_OPT, &iv, 0) && iv == (allowed))
#define REFUSED_F32(key, allowed) (read_f32(&r, key, DFLASH_NEED_OPT, &fv, 0) && fv == (float) (allowed))
#define REFUSED_BOOL(key, allowed) (read_bool(&r, key, DFLASH_NEED_OPT, &iv, 0) && iv == (allowed))
#define REFUSED_ANY(key, allowed) false
#define X(key, type, allowed, what) \
    if (ok && gguf_find_key(g, key) >= 0 && !REFUSED_##type(key, allowed)) FAIL("'%s': %s is not supported (%s)", path, what, key);
    DFLASH_GGUF_REFUSED(X)
#undef X
    (void) iv;
    (void) fv;
    return ok && check_values(hp, path, err, err_len);
}

// ---------------------------------------------------------------------------
// tensors

// The table's tensors found in the file's meta context, checked for shape and type.
struct file_tensors {
    struct dflash_weights w;
    struct dflash_layer layers[DFLASH_MAX_LAYERS];
};

static bool type_ok(int dtype, enum ggml_type t) {
    switch (dtype) {
        case DFLASH_DTYPE_F32: return t == GGML_TYPE_F32;
        case DFLASH_DTYPE_I64: return t == GGML_TYPE_I64;
        default: return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || ggml_is_quantized(t);
    }
}

static const char * dtype_name(int dtype) {
    return dtype == DFLASH_DTYPE_F32 ? "f32" : dtype == DFLASH_DTYPE_I64 ? "i64" : "f32, f16, bf16 or quantized";
}

// Look a tensor up; absent is an error when `required`.  A dimension of -1 is not checked
// (the vocabulary, when there is no target to take it from).
static bool want(struct ggml_context * meta, const char * name, bool required, int dtype, int64_t ne0, int64_t ne1,
                 int64_t ne2, struct ggml_tensor ** out, const char * path, char * err, size_t err_len) {
    struct ggml_tensor * t = ggml_get_tensor(meta, name);
    *out = t;
    if (!t) {
        if (required) FAIL("drafter '%s' is missing tensor '%s'", path, name);
        return true;
    }
    const int64_t ne[3] = { ne0, ne1, ne2 };
    for (int i = 0; i < 4; i++) {
        const int64_t want_ne = i < 3 ? ne[i] : 1;
        if (want_ne >= 0 && t->ne[i] != want_ne) {
            FAIL("drafter tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld, %lld]", name,
                 (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2], (long long) t->ne[3],
                 (long long) ne0, (long long) ne1, (long long) ne2);
        }
    }
    if (!type_ok(dtype, t->type)) FAIL("drafter tensor '%s' has type %s, expected %s", name, ggml_type_name(t->type), dtype_name(dtype));
    return true;
}

// Is `name` a row of the table (per-layer names for layers < n_layer)?
static bool known_tensor(const char * name, int n_layer) {
#define X(field, tname, ...) if (strcmp(name, tname) == 0) return true;
    DFLASH_TOP_TENSORS(X)
#undef X
    int il = -1, used = 0;
    if (sscanf(name, "blk.%d.%n", &il, &used) != 1 || used == 0 || il < 0 || il >= n_layer) return false;
    const char * rest = name + used;
#define X(field, tname, ...) if (strcmp(rest, tname) == 0) return true;
    DFLASH_LAYER_TENSORS(X)
#undef X
    return false;
}

#define NEED_REQ(v2, d2t) true
#define NEED_OPT(v2, d2t) false
#define NEED_V2(v2, d2t) (v2)
#define NEED_D2T(v2, d2t) (d2t)
#define DIM(e) (vocab_dim(hp, #e) ? -1 : (int64_t) (e))

// A shape expression over the vocabulary, when its size is not known (n_vocab 0).
static bool vocab_dim(const struct dflash_drafter_info * hp, const char * expr) {
    return hp->n_vocab == 0 && strstr(expr, "n_vocab") != NULL;
}

static bool find_tensors(const struct dflash_drafter_info * hp, const struct gguf_context * g, struct ggml_context * meta,
                         struct file_tensors * ft, const char * path, char * err, size_t err_len) {
    for (int64_t i = 0; i < gguf_get_n_tensors(g); i++) {
        const char * name = gguf_get_tensor_name(g, i);
#define X(tname, what) if (strcmp(name, tname) == 0) FAIL("'%s' is %s; only DFlash is supported", path, what);
        DFLASH_REFUSED_TENSORS(X)
#undef X
        if (!known_tensor(name, hp->n_layer)) FAIL("drafter '%s' has an unsupported tensor '%s'", path, name);
    }
    const bool v2 = hp->version == 2, d2t = ggml_get_tensor(meta, "d2t") != NULL;
    memset(ft, 0, sizeof(*ft));
    bool ok = true;
    // a DFlash2 tensor in a file without the selector is refused (its shape may not even be computable)
#define V2_ONLY(need, nm) \
    (DFLASH_NEED_##need == DFLASH_NEED_V2 && !v2 && \
     (!ggml_get_tensor(meta, nm) || (ok = false, dflash_seterr(err, err_len, \
         "drafter '%s' has the DFlash2 tensor '%s' but no selector_hidden.weight", path, nm), true)))
#define X(field, tname, need, dtype, e0, e1, e2, hf) \
    if (ok && !V2_ONLY(need, tname)) { \
        ok = want(meta, tname, NEED_##need(v2, d2t), DFLASH_DTYPE_##dtype, DIM(e0), DIM(e1), DIM(e2), &ft->w.field, path, err, err_len); \
    }
    DFLASH_TOP_TENSORS(X)
#undef X
    for (int il = 0; ok && il < hp->n_layer; il++) {
        struct dflash_layer * L = &ft->layers[il];
        char nm[96];
#define X(field, tname, need, dtype, e0, e1, e2, hf) \
    snprintf(nm, sizeof(nm), "blk.%d.%s", il, tname); \
    if (ok && !V2_ONLY(need, nm)) { \
        ok = want(meta, nm, NEED_##need(v2, d2t), DFLASH_DTYPE_##dtype, DIM(e0), DIM(e1), DIM(e2), &L->field, path, err, err_len); \
    }
        DFLASH_LAYER_TENSORS(X)
#undef X
    }
#undef V2_ONLY
    return ok;
}

// The file must hold every tensor's bytes.
static bool check_extent(const struct gguf_context * g, const char * path, long long file_size, char * err, size_t err_len) {
    size_t end = gguf_get_data_offset(g);
    for (int64_t i = 0; i < gguf_get_n_tensors(g); i++) {
        size_t e = gguf_get_data_offset(g) + gguf_get_tensor_offset(g, i) + gguf_get_tensor_size(g, i);
        if (e > end) end = e;
    }
    if (end > (size_t) file_size) FAIL("drafter file '%s' is truncated (%lld of %lld bytes)", path, file_size, (long long) end);
    return true;
}

// Header, keys and tensor table of a drafter file: the part of loading that needs no target.
struct drafter_file {
    struct gguf_context * g;
    struct ggml_context * meta;
    long long size;
};

static void file_close(struct drafter_file * f) {
    if (f->g) gguf_free(f->g);
    if (f->meta) ggml_free(f->meta);
}

static bool file_open(struct drafter_file * f, struct dflash_drafter_info * hp, const char * path, char * err, size_t err_len) {
    memset(f, 0, sizeof(*f));
    struct stat stt;
    if (!path || stat(path, &stt) != 0 || !S_ISREG(stt.st_mode)) FAIL("drafter file '%s' does not exist", path ? path : "(null)");
    f->size = (long long) stt.st_size;
    struct gguf_init_params gp = { true, &f->meta };
    f->g = gguf_init_from_file(path, gp);
    if (!f->g) FAIL("'%s' is not a valid GGUF file (unreadable or truncated header)", path);
    const int64_t id = gguf_find_key(f->g, "general.architecture");
    if (id < 0 || gguf_get_kv_type(f->g, id) != GGUF_TYPE_STRING) FAIL("'%s' has no general.architecture: not a llama.cpp GGUF model", path);
    const char * arch = gguf_get_val_str(f->g, id);
    if (strcmp(arch, DFLASH_ARCH) != 0) FAIL("'%s' is a '%.40s' model, not a DFlash drafter (architecture 'dflash')", path, arch);
#define X(tname, what) if (ggml_get_tensor(f->meta, tname)) FAIL("'%s' is %s; only DFlash is supported", path, what);
    DFLASH_REFUSED_TENSORS(X)
#undef X
    // DFlash2 is detected as upstream does, by the selector tensor; its keys are then required.
    if (!read_keys(hp, f->g, ggml_get_tensor(f->meta, "selector_hidden.weight") != NULL, path, err, err_len)) return false;
    if (!dflash_vocab_read(f->g, path, &hp->n_vocab, err, err_len)) return false;
    const struct ggml_tensor * d2t = ggml_get_tensor(f->meta, "d2t");
    if (d2t) {
        // upstream's layout: absolute target ids, I64, one per row of the drafter's own head
        if (d2t->type != GGML_TYPE_I64 || ggml_n_dims(d2t) != 1 || d2t->ne[0] < 1 || d2t->ne[0] > INT32_MAX) {
            FAIL("'%s': tensor d2t must be a 1-D I64 map of target ids", path);
        }
        hp->n_vocab_draft = (int32_t) d2t->ne[0];
    }
    return check_extent(f->g, path, f->size, err, err_len);
}

// Bytes of one tensor of the file into buf.
static bool read_tensor_bytes(FILE * fp, const struct gguf_context * g, const char * name, void * buf, size_t n) {
    const int64_t id = gguf_find_tensor(g, name);
    return id >= 0 && fseek(fp, (long) (gguf_get_data_offset(g) + gguf_get_tensor_offset(g, id)), SEEK_SET) == 0 &&
           fread(buf, 1, n, fp) == n;
}

// The reduced vocabulary's target ids: in range and distinct (a duplicate would give
// one token two proposal probabilities).
static bool check_d2t(const int64_t * ids, int32_t nd, int32_t nv, int32_t * out, const char * path, char * err, size_t err_len) {
    uint8_t * seen = calloc((size_t) nv, 1);
    if (!seen) FAIL("out of memory reading d2t");
    bool ok = true;
    for (int32_t i = 0; ok && i < nd; i++) {
        if (ids[i] < 0 || ids[i] >= nv) {
            dflash_seterr(err, err_len, "drafter '%s': d2t[%d] = %lld is outside the target vocabulary (%d)", path, i,
                          (long long) ids[i], nv);
            ok = false;
        } else if (seen[ids[i]]++) {
            dflash_seterr(err, err_len, "drafter '%s': d2t maps two draft rows to target token %lld", path, (long long) ids[i]);
            ok = false;
        } else if (out) {
            out[i] = (int32_t) ids[i];
        }
    }
    free(seen);
    return ok;
}

// Checks against the vocabulary (the target's, or the file's own tokenizer for a check).
static bool check_vocab(struct dflash_drafter_info * hp, const char * path, char * err, size_t err_len) {
    const int32_t nv = hp->n_vocab;
    if (hp->n_vocab_draft == 0) hp->n_vocab_draft = nv;
    if (hp->n_vocab_draft > nv) FAIL("drafter '%s' maps %d draft tokens but the target has only %d", path, hp->n_vocab_draft, nv);
    if (hp->version == 2 && hp->selector_top_k > hp->n_vocab_draft) {
        FAIL("drafter '%s': selector_top_k %d exceeds its %d-token vocabulary", path, hp->selector_top_k, hp->n_vocab_draft);
    }
    if (hp->mask_token_id >= nv) FAIL("drafter '%s' has mask token id %d outside the target vocabulary (%d tokens)", path, hp->mask_token_id, nv);
    return true;
}

// A target hyper-parameter: the model's own, or from its metadata where a vocab-only load
// (dflash_drafter_check's target) left it 0.
static int32_t target_hparam(const struct llama_model * m, int32_t have, const char * suffix) {
    char arch[64], key[128], val[32];
    if (have > 0 || llama_model_meta_val_str(m, "general.architecture", arch, sizeof(arch)) < 0) return have;
    snprintf(key, sizeof(key), "%s.%s", arch, suffix);
    return llama_model_meta_val_str(m, key, val, sizeof(val)) < 0 ? have : (int32_t) strtol(val, NULL, 10);
}

// The file against its target: the same tokenizer, its hidden size, taps inside it.
static bool validate_target(struct dflash_drafter_info * hp, const struct gguf_context * g,
                            const struct llama_model * target, const char * path, char * err, size_t err_len) {
    if (!dflash_vocab_match(g, target, path, err, err_len)) return false;
    const int32_t t_embd = target_hparam(target, llama_model_n_embd(target), "embedding_length");
    const int32_t t_layer = target_hparam(target, llama_model_n_layer(target), "block_count");
    hp->n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(target));
    if (!check_vocab(hp, path, err, err_len)) return false;
    if (hp->n_embd != t_embd) FAIL("drafter '%s' has hidden size %d but the target has %d", path, hp->n_embd, t_embd);
    for (int i = 0; i < hp->n_taps; i++) {
        // The last layer's output is pruned to output rows inside llama.cpp,
        // so taps must lie strictly below it.
        if (hp->target_layers[i] < 0 || hp->target_layers[i] >= t_layer - 1) {
            FAIL("drafter '%s' taps target layer %d but the target has %d layers (usable: 0..%d)", path,
                 hp->target_layers[i], t_layer, t_layer - 2);
        }
    }
    return true;
}

int32_t dflash_drafter_check(const char * path, const struct llama_model * target, struct dflash_drafter_info * out,
                             char * err, size_t err_len) {
    struct dflash_drafter_info hp;
    struct drafter_file f;
    struct file_tensors * ft = calloc(1, sizeof(*ft));
    bool ok = ft && file_open(&f, &hp, path, err, err_len);
    // (file_open took n_vocab from the file's own tokenizer)
    ok = ok && (target ? validate_target(&hp, f.g, target, path, err, err_len) : check_vocab(&hp, path, err, err_len));
    ok = ok && find_tensors(&hp, f.g, f.meta, ft, path, err, err_len);
    if (ok && ft->w.d2t) {
        FILE * fp = fopen(path, "rb");
        int64_t * ids = malloc(sizeof(int64_t) * (size_t) hp.n_vocab_draft);
        ok = fp && ids && read_tensor_bytes(fp, f.g, "d2t", ids, sizeof(int64_t) * (size_t) hp.n_vocab_draft);
        if (!ok) dflash_seterr(err, err_len, "drafter file '%s' is unreadable (tensor 'd2t')", path);
        ok = ok && check_d2t(ids, hp.n_vocab_draft, hp.n_vocab, NULL, path, err, err_len);
        if (fp) fclose(fp);
        free(ids);
    }
    if (ft) file_close(&f);
    free(ft);
    if (ok && out) *out = hp;
    return ok ? 0 : -1;
}

// ---------------------------------------------------------------------------
// weights

// Pick the target tensor usable by get_rows (host memory) or by mul_mat (any).
static struct ggml_tensor * target_tensor(const struct llama_model * target, const char * name, bool need_host) {
    struct ggml_tensor * ts[4];
    int32_t n = dflash_model_tensors(target, name, ts, 4);
    if (n <= 0) return NULL;
    if (n > 4) n = 4;
    for (int32_t i = 0; i < n; i++) {
        bool host = ts[i]->buffer && ggml_backend_buffer_is_host(ts[i]->buffer);
        if (host == need_host) return ts[i];
    }
    return need_host ? NULL : ts[0];
}

// Reads the file's bytes of every tensor of ctx (a repacking buffer converts them as they are set).
static bool read_weights(struct dflash_drafter * d, const char * path, const struct gguf_context * g,
                         struct ggml_context * ctx, char * err, size_t err_len) {
    if (!ggml_get_first_tensor(ctx)) return true;
    FILE * f = fopen(path, "rb");
    if (!f) FAIL("cannot open drafter file '%s'", path);
    void * tmp = NULL;
    size_t tmp_size = 0;
    bool ok = true;
    for (struct ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        const bool is_d2t = t == d->w.d2t;
        size_t nbytes = is_d2t ? sizeof(int64_t) * (size_t) t->ne[0] : ggml_nbytes(t);
        // a tensor held in f32 though the file's is not (hold_f32): the file's bytes, converted below
        const int64_t fid = gguf_find_tensor(g, ggml_get_name(t));
        const enum ggml_type ftype = fid >= 0 ? gguf_get_tensor_type(g, fid) : t->type;
        const bool convert = !is_d2t && ftype != t->type;
        if (convert) nbytes = gguf_get_tensor_size(g, fid) + sizeof(float) * (size_t) ggml_nelements(t);
        if (nbytes > tmp_size) {
            free(tmp);
            tmp = malloc(nbytes);
            tmp_size = nbytes;
        }
        if (convert) nbytes = gguf_get_tensor_size(g, fid);
        if (!tmp || !read_tensor_bytes(f, g, ggml_get_name(t), tmp, nbytes)) {
            dflash_seterr(err, err_len, "drafter file '%s' is truncated (tensor '%s')", path, ggml_get_name(t));
            ok = false;
            break;
        }
        if (is_d2t) {
            d->d2t_host = malloc(sizeof(int32_t) * (size_t) t->ne[0]);
            ok = d->d2t_host && check_d2t((const int64_t *) tmp, (int32_t) t->ne[0], d->hp.n_vocab, d->d2t_host, path, err, err_len);
            if (!ok) break;
            ggml_backend_tensor_set(t, d->d2t_host, 0, ggml_nbytes(t));
            continue;
        }
        if (convert) {
            float * f32 = (float *) ((char *) tmp + nbytes);
            ggml_get_type_traits(ftype)->to_float(tmp, f32, ggml_nelements(t));
            ggml_backend_tensor_set(t, f32, 0, ggml_nbytes(t));
            continue;
        }
        ggml_backend_tensor_set(t, tmp, 0, nbytes);
    }
    free(tmp);
    fclose(f);
    return ok;
}

// Whether t lives on a remote device (llama.cpp's RPC backend): the drafter stays local, so it
// cannot borrow such a tensor in place.
static bool on_rpc_device(const struct ggml_tensor * t) {
    if (!t || !t->buffer || ggml_backend_buffer_is_host(t->buffer)) return false;
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : NULL;
    return reg && strcmp(ggml_backend_reg_name(reg), "RPC") == 0;
}

// A local copy of a target head held by an RPC server (read once, at load; counted as weights).
static bool copy_remote_head(struct dflash_drafter * d, char * err, size_t err_len) {
    struct ggml_tensor * src = d->w.head;
    struct ggml_init_params ip = { 2 * ggml_tensor_overhead(), NULL, true };
    d->ctx_hc = ggml_init(ip);
    if (!d->ctx_hc) FAIL("out of memory copying the target's head");
    struct ggml_tensor * t = ggml_dup_tensor(d->ctx_hc, src);
    ggml_set_name(t, ggml_get_name(src));
    d->buf_hc = ggml_backend_alloc_ctx_tensors(d->ctx_hc, d->cpu);
    void * tmp = malloc(ggml_nbytes(src));
    if (!d->buf_hc || !tmp) {
        free(tmp);
        FAIL("out of memory copying the target's head (%zu MiB)", ggml_nbytes(src) >> 20);
    }
    ggml_backend_buffer_set_usage(d->buf_hc, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_tensor_get(src, tmp, 0, ggml_nbytes(src));
    ggml_backend_tensor_set(t, tmp, 0, ggml_nbytes(src));
    free(tmp);
    d->w.head = t;
    return true;
}

// The target's embedding and head where the file has none.
static bool borrow(struct dflash_drafter * d, const struct llama_model * target, const struct file_tensors * ft,
                   char * err, size_t err_len) {
    const struct dflash_drafter_info * hp = &d->hp;
    struct ggml_tensor * embd = ft->w.tok_embd ? NULL : target_tensor(target, "token_embd.weight", true);
    struct ggml_tensor * head = NULL;
    if (!ft->w.head) {
        head = target_tensor(target, "output.weight", false);
        if (!head) head = target_tensor(target, "token_embd.weight", false); // tied
    }
    if ((!ft->w.tok_embd && !embd) || (!ft->w.head && !head)) FAIL("cannot reach the target's token embedding / output head in this libllama");
    struct ggml_tensor * ts[2] = { embd, head };
    for (int i = 0; i < 2; i++) {
        if (ts[i] && (ts[i]->ne[0] != hp->n_embd || ts[i]->ne[1] != hp->n_vocab)) {
            FAIL("target tensor '%s' has an unexpected shape", ggml_get_name(ts[i]));
        }
    }
    // a head on an RPC server: a tied one is the embedding, which llama.cpp keeps in host memory
    if (on_rpc_device(head)) {
        struct ggml_tensor * host = target_tensor(target, ggml_get_name(head), true);
        if (host) head = host;
    }
    d->w.tok_embd = embd;
    d->w.head = head;
    return true;
}

// `device` when asked for (dflash_drafter_load_on), else the device holding the target's head (also
// when the drafter has its own); plus the CPU.
static bool init_backends(struct dflash_drafter * d, const struct llama_model * target, int32_t n_threads,
                          ggml_backend_dev_t device, char * err, size_t err_len) {
    d->cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
    if (!d->cpu) FAIL("no CPU backend available");
    ggml_backend_t main_be = NULL;
    struct ggml_tensor * t_head = d->w.head && !d->own_head ? d->w.head : target_tensor(target, "output.weight", false);
    if (!t_head) t_head = target_tensor(target, "token_embd.weight", false);
    // a target split over RPC servers: the drafter and its cache stay here (the documented
    // upstream workaround), with a local copy of a head the servers hold
    if (on_rpc_device(t_head)) t_head = NULL;
    if (device) {
        main_be = ggml_backend_dev_init(device, NULL);
        if (!main_be) FAIL("cannot start the drafter's device %s", ggml_backend_dev_name(device));
    } else if (t_head && t_head->buffer) {
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t_head->buffer));
        if (dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) main_be = ggml_backend_dev_init(dev, NULL);
    }
    // on the CPU, the drafter's own small products (n + 1 rows) go to the kernels where they run
    ggml_backend_t kern = main_be ? NULL : dflash_kernels_backend(n_threads > 0 ? n_threads : 1);
    d->gpu = main_be != NULL;
    if (main_be) d->backends[d->n_backends++] = main_be;
    if (kern) d->backends[d->n_backends++] = kern;
    d->backends[d->n_backends++] = d->cpu;
    ggml_backend_cpu_set_n_threads(d->cpu, n_threads > 0 ? n_threads : 1);
    // (the generic graph stays reachable on the CPU so that tests compare the two bit for bit)
    d->fused_conv = !d->gpu && !(d->flags & DFLASH_LOAD_GENERIC_CONV);
    return true;
}

// The CPU backend's repacking buffer type (llama.cpp's CPU_REPACK: Q4_0 and IQ4_NL matrices in
// interleaved blocks for its multi-row kernels on AVX2, more types on ARM), when the drafter runs
// on the CPU; NULL otherwise.
static ggml_backend_buffer_type_t repack_buft(const struct dflash_drafter * d) {
    if (d->gpu) return NULL;
    ggml_backend_dev_t dev = ggml_backend_get_device(d->cpu);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : NULL;
    typedef ggml_backend_buffer_type_t * (*extra_bufts_fn)(ggml_backend_dev_t);
    extra_bufts_fn fn = reg ? (extra_bufts_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts")
                            : NULL;
    for (ggml_backend_buffer_type_t * b = fn ? fn(dev) : NULL; b && *b; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    }
    return NULL;
}

// Whether the CPU device runs a mul_mat with w held in buft (llama.cpp's own test for its weights:
// the repacking buffer takes only the types and shapes its kernels handle on this CPU).
static bool runs_repacked(const struct dflash_drafter * d, ggml_backend_buffer_type_t buft,
                          const struct ggml_tensor * w) {
    if (!buft || ggml_n_dims(w) != 2) return false;
    struct ggml_init_params ip = { 4 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    ggml_backend_buffer_t probe = ggml_backend_buft_alloc_buffer(buft, 0);
    bool ok = false;
    if (ctx && probe) {
        struct ggml_tensor * wt = ggml_dup_tensor(ctx, w);
        wt->buffer = probe;
        struct ggml_tensor * op = ggml_mul_mat(ctx, wt, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], 8));
        ok = ggml_backend_dev_supports_op(ggml_backend_get_device(d->cpu), op);
    }
    if (probe) ggml_backend_buffer_free(probe);
    if (ctx) ggml_free(ctx);
    return ok;
}

// Matrices read by get_rows (the embedding, the DFlash2 codebooks): never in the repacking buffer,
// whose layout only its mul_mat kernels read.
static bool gathered(const char * field) {
    return strcmp(field, "tok_embd") == 0 || strcmp(field, "sel_pred") == 0 || strcmp(field, "sel_succ") == 0;
}

// Whether a gathered tensor is held in f32 though the file's is not.  The DFlash2 codebooks are: a
// draft gathers hundreds of their rows, and f32 rows need no dequantizing (a draft 2 % faster, for 4x
// the memory of q8_0); DFLASH_LOAD_GATHERED_AS_STORED keeps them as stored (tests compare the two
// paths).  Any gathered tensor is too where the backend's get_rows lacks its type (CUDA: K-quants).
static bool hold_f32(const struct dflash_drafter * d, const char * field, enum ggml_type type) {
    if (type == GGML_TYPE_F32) return false;
    const bool as_stored = d->flags & DFLASH_LOAD_GATHERED_AS_STORED;
    if (strcmp(field, "tok_embd") != 0 && !as_stored) return true;
    if (!d->gpu) return false;
    struct ggml_init_params ip = { 4 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) return true;
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, 256, 2);
    struct ggml_tensor * op = ggml_get_rows(ctx, w, ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1));
    const bool ok = ggml_backend_supports_op(d->backends[0], op);
    ggml_free(ctx);
    return !ok;
}

// Copies of the file's tensors in our own buffers (the target's borrowed ones stay where they are):
// matrices that only multiply (W; the embedding is also gathered) in the repacking buffer where
// the CPU takes them, everything else in the first backend's buffer.
static bool alloc_weights(struct dflash_drafter * d, const struct gguf_context * g, const struct file_tensors * ft,
                          const char * path, char * err, size_t err_len) {
    struct ggml_init_params ip = { ((size_t) gguf_get_n_tensors(g) + 8) * ggml_tensor_overhead(), NULL, true };
    d->ctx_w = ggml_init(ip);
    d->ctx_wr = ggml_init(ip);
    if (!d->ctx_w || !d->ctx_wr) FAIL("out of memory allocating drafter weights");
    ggml_backend_buffer_type_t rbuft = repack_buft(d);
    int32_t n_repacked = 0;
#define DFLASH_MULTIPLIES_F32 0
#define DFLASH_MULTIPLIES_W 1
#define DFLASH_MULTIPLIES_I64 0
#define DUP(dst, m, mat, f32)                                                              \
    if (m) {                                                                               \
        const bool r = (mat) && runs_repacked(d, rbuft, m);                                \
        dst = (f32) ? ggml_new_tensor(d->ctx_w, GGML_TYPE_F32, GGML_MAX_DIMS, m->ne)       \
                    : ggml_dup_tensor(r ? d->ctx_wr : d->ctx_w, m);                        \
        ggml_set_name(dst, ggml_get_name(m));                                              \
        n_repacked += r;                                                                   \
    }
#define X(field, name, need, dtype, ...)                                                    \
    if (strcmp(#field, "d2t") != 0) {                                                      \
        DUP(d->w.field, ft->w.field, DFLASH_MULTIPLIES_##dtype && !gathered(#field),       \
            gathered(#field) && hold_f32(d, #field, ft->w.field->type))                      \
    }
    DFLASH_TOP_TENSORS(X)
#undef X
    for (int il = 0; il < d->hp.n_layer; il++) {
#define X(field, name, need, dtype, ...) DUP(d->layers[il].field, ft->layers[il].field, DFLASH_MULTIPLIES_##dtype, false)
        DFLASH_LAYER_TENSORS(X)
#undef X
    }
#undef DUP
#undef DFLASH_MULTIPLIES_F32
#undef DFLASH_MULTIPLIES_W
#undef DFLASH_MULTIPLIES_I64
    if (ft->w.d2t) {
        // held as I32 (what get_rows takes as indices); read_weights converts the file's I64
        d->w.d2t = ggml_new_tensor_1d(d->ctx_w, GGML_TYPE_I32, d->hp.n_vocab_draft);
        ggml_set_name(d->w.d2t, "d2t");
    }
    d->buf_w = ggml_backend_alloc_ctx_tensors(d->ctx_w, d->backends[0]);
    if (!d->buf_w) FAIL("out of memory allocating drafter weights");
    ggml_backend_buffer_set_usage(d->buf_w, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (n_repacked > 0) {
        d->buf_wr = ggml_backend_alloc_ctx_tensors_from_buft(d->ctx_wr, rbuft);
        if (!d->buf_wr) FAIL("out of memory allocating drafter weights");
        ggml_backend_buffer_set_usage(d->buf_wr, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    }
    return read_weights(d, path, g, d->ctx_w, err, err_len) && read_weights(d, path, g, d->ctx_wr, err, err_len);
}

// Scheduler, sized by the largest single-sequence graph: a full context, a full
// injection chunk and a full block (larger batched graphs grow it on demand).
static bool init_compute(struct dflash_drafter * d, int32_t n_ctx, char * err, size_t err_len) {
    struct dflash_drafter_info * hp = &d->hp;
    hp->n_ctx = n_ctx;
    d->meta_size = ggml_tensor_overhead() * DFLASH_GRAPH_SIZE + ggml_graph_overhead_custom(DFLASH_GRAPH_SIZE, false);
    d->meta_buf = malloc(d->meta_size);
    d->sched = ggml_backend_sched_new(d->backends, NULL, d->n_backends, DFLASH_GRAPH_SIZE, false, true);
    if (!d->meta_buf || !d->sched) FAIL("out of memory creating the drafter scheduler");
    d->def = dflash_state_new(d, err, err_len);
    if (!d->def) return false;
    struct dflash_state * st = d->def;
    // a block needs its anchor's position and at least one committed row before it
    const int32_t n_block = hp->block_size <= n_ctx - 1 ? hp->block_size : n_ctx - 1;
    int32_t n_feat = n_ctx - n_block < DFLASH_INJECT_CHUNK ? n_ctx - n_block : DFLASH_INJECT_CHUNK;
    if (n_feat < 1) n_feat = 1;
    st->n_pending = n_feat;
    st->n_cached = n_ctx - n_block - n_feat > 0 ? n_ctx - n_block - n_feat : 0;
    bool ok = true;
    struct dflash_graph G;
    if (n_block >= 2 && dflash_build_graph(d, &G, &st, 1, n_block, true, false, true)) {
        if (!ggml_backend_sched_reserve(d->sched, G.gf)) {
            dflash_seterr(err, err_len, "out of memory reserving the drafter compute buffer");
            ok = false;
        }
        ggml_free(G.ctx);
    }
    st->n_pending = 0;
    st->n_cached = 0;
    return ok;
}

// ---------------------------------------------------------------------------
// public API

void dflash_drafter_free(dflash_drafter * d) {
    if (!d) return;
    if (d->sched) ggml_backend_sched_free(d->sched);
    dflash_state_free(d->def);
    if (d->buf_w) ggml_backend_buffer_free(d->buf_w);
    if (d->ctx_w) ggml_free(d->ctx_w);
    if (d->buf_wr) ggml_backend_buffer_free(d->buf_wr);
    if (d->ctx_wr) ggml_free(d->ctx_wr);
    if (d->buf_hc) ggml_backend_buffer_free(d->buf_hc);
    if (d->ctx_hc) ggml_free(d->ctx_hc);
    for (int i = 0; i < d->n_backends; i++) ggml_backend_free(d->backends[i]);
    free(d->meta_buf);
    free(d->d2t_host);
#ifdef DFLASH_CUDA
    dflash_cuda_ctx_free(d->cuda);
#endif
    free(d);
}

dflash_drafter * dflash_drafter_load(const char * path, const struct llama_model * target, int32_t n_ctx,
                                     int32_t n_threads, uint32_t flags, char * err, size_t err_len) {
    return dflash_drafter_load_on(path, target, n_ctx, n_threads, flags, NULL, err, err_len);
}

dflash_drafter * dflash_drafter_load_on(const char * path, const struct llama_model * target, int32_t n_ctx,
                                        int32_t n_threads, uint32_t flags, void * device, char * err, size_t err_len) {
    if (!path || !target) {
        dflash_seterr(err, err_len, "drafter path and target model are required");
        return NULL;
    }
    if (n_ctx <= 0) {
        dflash_seterr(err, err_len, "n_ctx must be positive (got %d)", n_ctx);
        return NULL;
    }
    struct dflash_drafter * d = calloc(1, sizeof(*d));
    struct file_tensors * ft = calloc(1, sizeof(*ft));
    struct drafter_file f = { 0 };
    bool ok = d && ft;
    if (!ok) dflash_seterr(err, err_len, "out of memory loading a drafter");
    if (d) d->flags = flags;
    ok = ok && file_open(&f, &d->hp, path, err, err_len) && validate_target(&d->hp, f.g, target, path, err, err_len) &&
         find_tensors(&d->hp, f.g, f.meta, ft, path, err, err_len);
    if (ok) {
        d->n_embd_inp = d->hp.n_taps * d->hp.n_embd;
        d->own_embd = ft->w.tok_embd != NULL;
        d->own_head = ft->w.head != NULL;
    }
    ok = ok && borrow(d, target, ft, err, err_len) && init_backends(d, target, n_threads, device, err, err_len) &&
         (!on_rpc_device(d->w.head) || copy_remote_head(d, err, err_len)) &&
         alloc_weights(d, f.g, ft, path, err, err_len) && init_compute(d, n_ctx, err, err_len);
    file_close(&f);
    free(ft);
    if (!ok) {
        dflash_drafter_free(d);
        return NULL;
    }
    return d;
}

void dflash_drafter_get_info(const dflash_drafter * d, struct dflash_drafter_info * out) {
    *out = d->hp;
}

void dflash_drafter_get_memory(const dflash_drafter * d, struct dflash_drafter_memory * out) {
    memset(out, 0, sizeof(*out));
    out->weights = (d->buf_w ? ggml_backend_buffer_get_size(d->buf_w) : 0) +
                   (d->buf_wr ? ggml_backend_buffer_get_size(d->buf_wr) : 0) +
                   (d->buf_hc ? ggml_backend_buffer_get_size(d->buf_hc) : 0);
    out->repacked = d->buf_wr ? ggml_backend_buffer_get_size(d->buf_wr) : 0;
    out->cache = d->def && d->def->buf_kv ? ggml_backend_buffer_get_size(d->def->buf_kv) : 0;
    for (int i = 0; i < d->n_backends; i++) out->compute += ggml_backend_sched_get_buffer_size(d->sched, d->backends[i]);
    out->borrows_embedding = !d->own_embd;
    out->borrows_head = !d->own_head;
    if (!d->own_embd) out->borrowed += ggml_nbytes(d->w.tok_embd);
    if (!d->own_head && !d->buf_hc && d->w.head != d->w.tok_embd) out->borrowed += ggml_nbytes(d->w.head);
}
