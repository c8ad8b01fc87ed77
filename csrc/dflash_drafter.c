// DFlash (v1) drafter: GGUF loading, validation against the target, and the
// drafter forward as our own ggml graph (see docs: dflash-architecture §2).
//
// The context cache holds per-layer K and V of committed positions only.
// A draft call first projects pending context features into the cache, then
// runs the block [anchor, mask x n] whose own K/V go to scratch cells right
// after the committed ones (overwritten by the next injection).
#include "dflash.h"

#include "common.h"
#include "llama_ext.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"
#include "llama.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define DFLASH_MAX_LAYERS 64
#define DFLASH_MAX_SEQ 16
#define DFLASH_GRAPH_SIZE 4096
#define DFLASH_INJECT_CHUNK 512

struct dflash_layer {
    struct ggml_tensor * attn_norm, * wq, * wk, * wv, * wo, * q_norm, * k_norm;
    struct ggml_tensor * ffn_norm, * ffn_gate, * ffn_up, * ffn_down;
    struct ggml_tensor * attn_conv_base, * attn_conv_proj, * ffn_conv_base, * ffn_conv_proj; // DFlash2
};

// One sequence's context: per-layer K/V of committed positions, and queued features.
struct dflash_state {
    struct dflash_drafter * d;
    struct ggml_context * ctx_kv;
    ggml_backend_buffer_t buf_kv;
    struct ggml_tensor * k_cache[DFLASH_MAX_LAYERS]; // [head_dim*n_head_kv, n_ctx]: one row per position
    struct ggml_tensor * v_cache[DFLASH_MAX_LAYERS]; // [n_ctx, head_dim*n_head_kv]: transposed for kq*v
    int32_t n_cached;     // positions projected into the cache
    float * pending;      // queued feature rows
    int32_t n_pending;
    int32_t pending_cap;
    int32_t * last_cand;  // DFlash2: lattice of the last draft
    float * last_scores;
    int32_t last_n;
};

struct dflash_drafter {
    struct dflash_drafter_info hp;
    int32_t n_embd_inp; // n_taps * n_embd

    struct ggml_context * ctx_w;    // own weights
    ggml_backend_buffer_t buf_w;

    struct ggml_tensor * fc, * hidden_norm, * out_norm;
    struct ggml_tensor * sel_pred, * sel_succ, * sel_hidden; // DFlash2 selector
    struct dflash_layer layers[DFLASH_MAX_LAYERS];
    struct ggml_tensor * tok_embd; // borrowed from the target unless the file has one
    struct ggml_tensor * head;     // idem; rows = n_vocab_draft
    struct ggml_tensor * d2t;      // reduced draft vocabulary: [n_vocab_draft] target ids (I32), or NULL
    int32_t * d2t_host;            // the same ids on the host
    bool own_embd, own_head;

    ggml_backend_t backends[2];
    int n_backends;
    ggml_backend_t cpu;
    ggml_backend_sched_t sched;
    void * meta_buf;
    size_t meta_size;

    struct dflash_state * def;     // the state behind the single-sequence API
};

// ---------------------------------------------------------------------------
// GGUF metadata helpers

static int64_t kv_find(const struct gguf_context * g, const char * key) {
    return gguf_find_key(g, key);
}

static bool kv_u32(const struct gguf_context * g, const char * key, int32_t * out) {
    int64_t id = kv_find(g, key);
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT32: *out = (int32_t) gguf_get_val_u32(g, id); return true;
        case GGUF_TYPE_INT32:  *out = gguf_get_val_i32(g, id); return true;
        case GGUF_TYPE_UINT64: *out = (int32_t) gguf_get_val_u64(g, id); return true;
        case GGUF_TYPE_INT64:  *out = (int32_t) gguf_get_val_i64(g, id); return true;
        case GGUF_TYPE_UINT16: *out = gguf_get_val_u16(g, id); return true;
        default: return false;
    }
}

static bool kv_f32(const struct gguf_context * g, const char * key, float * out) {
    int64_t id = kv_find(g, key);
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_FLOAT32: *out = gguf_get_val_f32(g, id); return true;
        case GGUF_TYPE_FLOAT64: *out = (float) gguf_get_val_f64(g, id); return true;
        default: return false;
    }
}

static bool kv_bool(const struct gguf_context * g, const char * key, bool * out) {
    int64_t id = kv_find(g, key);
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_BOOL) return false;
    *out = gguf_get_val_bool(g, id);
    return true;
}

// Integer array into out[]; returns element count or -1.
static int32_t kv_arr_i32(const struct gguf_context * g, const char * key, int32_t * out, int32_t max_n) {
    int64_t id = kv_find(g, key);
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) return -1;
    enum gguf_type t = gguf_get_arr_type(g, id);
    size_t n = gguf_get_arr_n(g, id);
    const void * data = gguf_get_arr_data(g, id);
    if ((int64_t) n > max_n) return -1;
    for (size_t i = 0; i < n; i++) {
        switch (t) {
            case GGUF_TYPE_INT32:  out[i] = ((const int32_t *) data)[i]; break;
            case GGUF_TYPE_UINT32: out[i] = (int32_t) ((const uint32_t *) data)[i]; break;
            case GGUF_TYPE_INT64:  out[i] = (int32_t) ((const int64_t *) data)[i]; break;
            case GGUF_TYPE_UINT64: out[i] = (int32_t) ((const uint64_t *) data)[i]; break;
            case GGUF_TYPE_BOOL:   out[i] = ((const int8_t *) data)[i] != 0; break;
            default: return -1;
        }
    }
    return (int32_t) n;
}

// ---------------------------------------------------------------------------
// tensors

// Expected tensor: look it up in the file's meta context and check its shape.
static struct ggml_tensor * want3(struct ggml_context * meta, const char * name,
                                  int64_t ne0, int64_t ne1, int64_t ne2, bool required,
                                  char * err, size_t err_len, bool * ok) {
    struct ggml_tensor * t = ggml_get_tensor(meta, name);
    if (!t) {
        if (required) {
            dflash_seterr(err, err_len, "drafter is missing tensor '%s'", name);
            *ok = false;
        }
        return NULL;
    }
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1) {
        dflash_seterr(err, err_len,
                      "drafter tensor '%s' has shape [%lld, %lld, %lld], expected [%lld, %lld, %lld]",
                      name, (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                      (long long) ne0, (long long) ne1, (long long) ne2);
        *ok = false;
        return NULL;
    }
    return t;
}

static struct ggml_tensor * want(struct ggml_context * meta, const char * name, int64_t ne0, int64_t ne1,
                                 bool required, char * err, size_t err_len, bool * ok) {
    return want3(meta, name, ne0, ne1, 1, required, err, err_len, ok);
}

static bool is_known_tensor(const char * name, int n_layer) {
    static const char * top[] = { "fc.weight", "enc.output_norm.weight", "output_norm.weight",
                                  "token_embd.weight", "output.weight", "selector_predecessor.weight",
                                  "selector_successor.weight", "selector_hidden.weight", "d2t" };
    for (size_t i = 0; i < sizeof(top) / sizeof(top[0]); i++) {
        if (strcmp(name, top[i]) == 0) return true;
    }
    static const char * per_layer[] = { "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                        "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate",
                                        "ffn_up", "ffn_down" };
    int il = -1;
    char rest[64];
    if (sscanf(name, "blk.%d.%63s", &il, rest) != 2 || il < 0 || il >= n_layer) return false;
    for (size_t i = 0; i < sizeof(per_layer) / sizeof(per_layer[0]); i++) {
        char full[80];
        snprintf(full, sizeof(full), "%s.weight", per_layer[i]);
        if (strcmp(rest, full) == 0) return true;
    }
    static const char * conv[] = { "attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base", "ffn_conv_proj.weight" };
    for (size_t i = 0; i < sizeof(conv) / sizeof(conv[0]); i++) {
        if (strcmp(rest, conv[i]) == 0) return true;
    }
    return false;
}

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

// The reduced vocabulary's target ids: in range and distinct (a duplicate would give
// one token two proposal probabilities).
static bool read_d2t(struct dflash_drafter * d, const char * path, const int64_t * ids, char * err, size_t err_len) {
    const int32_t nv = d->hp.n_vocab, nd = d->hp.n_vocab_draft;
    d->d2t_host = malloc(sizeof(int32_t) * (size_t) nd);
    uint8_t * seen = calloc((size_t) nv, 1);
    bool ok = d->d2t_host && seen;
    if (!ok) dflash_seterr(err, err_len, "out of memory reading d2t");
    for (int32_t i = 0; ok && i < nd; i++) {
        if (ids[i] < 0 || ids[i] >= nv) {
            dflash_seterr(err, err_len, "drafter '%s': d2t[%d] = %lld is outside the target vocabulary (%d)", path, i,
                          (long long) ids[i], nv);
            ok = false;
        } else if (seen[ids[i]]++) {
            dflash_seterr(err, err_len, "drafter '%s': d2t maps two draft rows to target token %lld", path,
                          (long long) ids[i]);
            ok = false;
        } else {
            d->d2t_host[i] = (int32_t) ids[i];
        }
    }
    free(seen);
    return ok;
}

static bool read_weights(struct dflash_drafter * d, const char * path, const struct gguf_context * g,
                         char * err, size_t err_len) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        dflash_seterr(err, err_len, "cannot open drafter file '%s'", path);
        return false;
    }
    size_t data_off = gguf_get_data_offset(g);
    void * tmp = NULL;
    size_t tmp_size = 0;
    bool ok = true;
    for (struct ggml_tensor * t = ggml_get_first_tensor(d->ctx_w); t; t = ggml_get_next_tensor(d->ctx_w, t)) {
        int64_t id = gguf_find_tensor(g, ggml_get_name(t));
        const bool is_d2t = t == d->d2t;
        size_t nbytes = is_d2t ? sizeof(int64_t) * (size_t) t->ne[0] : ggml_nbytes(t);
        if (nbytes > tmp_size) {
            free(tmp);
            tmp = malloc(nbytes);
            tmp_size = nbytes;
        }
        if (!tmp || fseek(f, (long) (data_off + gguf_get_tensor_offset(g, id)), SEEK_SET) != 0 ||
            fread(tmp, 1, nbytes, f) != nbytes) {
            dflash_seterr(err, err_len, "drafter file '%s' is truncated (tensor '%s')", path, ggml_get_name(t));
            ok = false;
            break;
        }
        if (is_d2t) {
            ok = read_d2t(d, path, (const int64_t *) tmp, err, err_len);
            if (!ok) break;
            ggml_backend_tensor_set(t, d->d2t_host, 0, ggml_nbytes(t));
            continue;
        }
        ggml_backend_tensor_set(t, tmp, 0, nbytes);
    }
    free(tmp);
    fclose(f);
    return ok;
}

// ---------------------------------------------------------------------------
// graph
//
// One graph serves n_seq sequences (states) at once: each injects its pending
// features into its own cache; their blocks [anchor, mask x n] run together
// (projections, convolutions, MLP and head batched), attention per sequence
// against its own cache.  Blocks are laid out contiguously, B rows each.

struct dflash_graph {
    struct ggml_context * ctx;
    struct ggml_cgraph * gf;
    struct ggml_tensor * feat[DFLASH_MAX_SEQ], * feat_pos[DFLASH_MAX_SEQ]; // injection inputs (or NULL)
    struct ggml_tensor * tokens, * block_pos;                            // [B * n_seq] (or NULL)
    struct ggml_tensor * mask_full[DFLASH_MAX_SEQ], * mask_swa[DFLASH_MAX_SEQ]; // [n_kv_s, B] (or NULL)
    struct ggml_tensor * logits, * argmax;                               // outputs, [.., n * n_seq]
    struct ggml_tensor * anchor;                                         // DFlash2: [n_seq] anchor ids
    struct ggml_tensor * cand, * scores;                                 // top-K ids, lattice / logits
    int32_t n_kv[DFLASH_MAX_SEQ];                                        // keys each block attends to
};

// DFlash2 per-slot kernels of one sub-layer (docs §3.1): kern[:, side*K + t, i] =
// base[side, t] + dyn_i[side, t, grp(c)], the group value spread over its g channels.
// dyn: [2*K*G, N] from the normed sub-layer input.  Result: [H, 2*K, N].
static struct ggml_tensor * conv_kernels(const struct dflash_drafter * d, struct ggml_context * ctx,
                                         struct ggml_tensor * dyn, struct ggml_tensor * base) {
    const struct dflash_drafter_info * hp = &d->hp;
    const int64_t H = hp->n_embd, N = dyn->ne[1], K = hp->conv_kernel_size, g = hp->conv_group_size;
    const int64_t G = H / g;
    struct ggml_tensor * k = ggml_repeat_4d(ctx, ggml_reshape_3d(ctx, dyn, 1, 2 * K * G, N), g, 2 * K * G, N, 1);
    k = ggml_reshape_3d(ctx, k, H, 2 * K, N);
    return ggml_add(ctx, k, ggml_reshape_3d(ctx, base, H, 2 * K, 1));
}

// One side of the convolution over each block:
//   out[:, i] = sum_t kern[:, side*K + t, i] * x[:, i - t],  x[:, j < 0] = 0,
// i counted from the start of its own block.  x: [H, B * S].
static struct ggml_tensor * dyn_conv(const struct dflash_drafter * d, struct ggml_context * ctx,
                                     struct ggml_tensor * x, struct ggml_tensor * kern, int side, int64_t B) {
    const struct dflash_drafter_info * hp = &d->hp;
    const int64_t H = hp->n_embd, N = x->ne[1], S = N / B, K = hp->conv_kernel_size;
    if (!ggml_is_contiguous(x)) x = ggml_cont(ctx, x); // a copy only when the block views need one
    struct ggml_tensor * out = NULL;
    for (int64_t t = 0; t < K && t < B; t++) {
        struct ggml_tensor * kt = ggml_view_2d(ctx, kern, H, N, kern->nb[2], (size_t) (side * K + t) * kern->nb[1]);
        struct ggml_tensor * xs = x;
        if (t > 0) {
            // shift by t inside every block: the first t slots of each block read zeros
            struct ggml_tensor * v = ggml_view_3d(ctx, x, H, B - t, S, x->nb[1], x->nb[1] * B, 0);
            xs = ggml_reshape_2d(ctx, ggml_pad_ext(ctx, v, 0, 0, (int) t, 0, 0, 0, 0, 0), H, N);
        }
        struct ggml_tensor * term = ggml_mul(ctx, kt, xs);
        out = out ? ggml_add(ctx, out, term) : term;
    }
    return out;
}

static struct ggml_tensor * rms(struct ggml_context * ctx, struct ggml_tensor * x, struct ggml_tensor * w, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), w);
}

// NeoX RoPE over the full head, with the file's linear / YaRN scaling.
static struct ggml_tensor * rope(struct ggml_context * ctx, const struct dflash_drafter_info * hp,
                                 struct ggml_tensor * x, struct ggml_tensor * pos) {
    return ggml_rope_ext(ctx, x, pos, NULL, hp->head_dim, GGML_ROPE_TYPE_NEOX, hp->rope_n_ctx_orig, hp->rope_theta,
                         hp->rope_freq_scale, hp->rope_ext_factor, hp->rope_attn_factor, hp->rope_beta_fast,
                         hp->rope_beta_slow);
}

// Project x ([n_embd, n]) to K/V for layer il and store them in st's cache at
// cells [off, off+n); the copies are added to the graph before their readers.
static void store_kv(const struct dflash_drafter * d, struct dflash_state * st, struct ggml_context * ctx,
                     struct ggml_cgraph * gf, int il, struct ggml_tensor * x, struct ggml_tensor * pos,
                     int32_t off, int32_t n) {
    const struct dflash_drafter_info * hp = &d->hp;
    const struct dflash_layer * L = &d->layers[il];
    const int64_t n_kv_embd = (int64_t) hp->head_dim * hp->n_head_kv;
    struct ggml_tensor * kc = st->k_cache[il], * vc = st->v_cache[il];

    struct ggml_tensor * k = ggml_mul_mat(ctx, L->wk, x);
    k = ggml_reshape_3d(ctx, k, hp->head_dim, hp->n_head_kv, n);
    k = rms(ctx, k, L->k_norm, hp->rms_eps);
    k = rope(ctx, hp, k, pos);
    struct ggml_tensor * v = ggml_mul_mat(ctx, L->wv, x); // [n_kv_embd, n]

    struct ggml_tensor * k_dst = ggml_view_2d(ctx, kc, n_kv_embd, n, kc->nb[1], (size_t) off * kc->nb[1]);
    struct ggml_tensor * v_dst = ggml_view_2d(ctx, vc, n, n_kv_embd, vc->nb[1], (size_t) off * ggml_element_size(vc));
    ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_reshape_2d(ctx, k, n_kv_embd, n), k_dst));
    ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, v), v_dst));
}

// Draft-vocabulary row ids [K, N] -> target token ids (the identity without a d2t map).
static struct ggml_tensor * to_target_ids(const struct dflash_drafter * d, struct ggml_context * ctx,
                                          struct ggml_tensor * ids) {
    if (!d->d2t) return ids;
    struct ggml_tensor * flat = ggml_reshape_1d(ctx, ids, ggml_nelements(ids));
    struct ggml_tensor * t = ggml_get_rows(ctx, ggml_reshape_2d(ctx, d->d2t, 1, d->hp.n_vocab_draft), flat);
    return ggml_reshape_2d(ctx, t, ids->ne[0], ids->ne[1]);
}

// DFlash2 selector (docs §3.2), all on the backend: top-K candidates per slot and the
// lattice scores[k][a][b] = U_k(c_kb) + <A[c_{k-1,a}] * gate_k, S[c_kb]>, slot 0's predecessor
// being its block's anchor.  z: [H, n * S], logits: [V, n * S].  Only ids and K x K scores per
// slot go back to the host.
static void build_selector(const struct dflash_drafter * d, struct dflash_graph * G, struct ggml_context * ctx,
                           struct ggml_tensor * z, struct ggml_tensor * logits, int64_t n, int64_t S) {
    const struct dflash_drafter_info * hp = &d->hp;
    const int64_t K = hp->selector_top_k, R = hp->selector_rank, V = logits->ne[0], N = n * S;
    struct ggml_tensor * cand_d = ggml_top_k(ctx, logits, (int) K);                                // [K, N]
    struct ggml_tensor * unary = ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, V, N), cand_d); // [1, K, N]
    struct ggml_tensor * cand = to_target_ids(d, ctx, cand_d);
    struct ggml_tensor * gate = ggml_mul_mat(ctx, d->sel_hidden, z);                                // [R, N]
    struct ggml_tensor * flat = ggml_reshape_1d(ctx, cand, K * N);
    struct ggml_tensor * succ = ggml_reshape_4d(ctx, ggml_get_rows(ctx, d->sel_succ, flat), R, K, n, S);
    G->anchor = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, S);
    ggml_set_input(G->anchor);
    struct ggml_tensor * prev = ggml_reshape_4d(ctx, ggml_get_rows(ctx, d->sel_pred, G->anchor), R, 1, 1, S);
    prev = ggml_repeat_4d(ctx, prev, R, K, 1, S);
    if (n > 1) {
        struct ggml_tensor * pred = ggml_reshape_4d(ctx, ggml_get_rows(ctx, d->sel_pred, flat), R, K, n, S);
        pred = ggml_cont(ctx, ggml_view_4d(ctx, pred, R, K, n - 1, S, pred->nb[1], pred->nb[2], pred->nb[3], 0));
        prev = ggml_concat(ctx, prev, pred, 2);                                                    // [R, K, n, S]
    }
    prev = ggml_mul(ctx, prev, ggml_reshape_4d(ctx, gate, R, 1, n, S));
    struct ggml_tensor * scores = ggml_mul_mat(ctx, succ, prev);                                    // [K(b), K(a), n, S]
    scores = ggml_add(ctx, scores, ggml_reshape_4d(ctx, unary, K, 1, n, S));
    G->cand = cand;
    G->scores = scores;
    ggml_set_output(cand);
    ggml_set_output(scores);
    ggml_build_forward_expand(G->gf, cand);
    ggml_build_forward_expand(G->gf, scores);
}

// Inject every state's pending rows; then, if n_block > 0, run one block per state at
// positions [a_s, a_s + n_block) with a_s = its committed length.
static bool build_graph(struct dflash_drafter * d, struct dflash_graph * G, struct dflash_state ** sts,
                        int32_t n_seq, int32_t n_block, bool want_logits, bool want_topk) {
    const struct dflash_drafter_info * hp = &d->hp;
    memset(G, 0, sizeof(*G));
    struct ggml_init_params ip = { d->meta_size, d->meta_buf, true };
    G->ctx = ggml_init(ip);
    if (!G->ctx) return false;
    struct ggml_context * ctx = G->ctx;
    G->gf = ggml_new_graph_custom(ctx, DFLASH_GRAPH_SIZE, false);

    for (int32_t s = 0; s < n_seq; s++) {
        struct dflash_state * st = sts[s];
        if (st->n_pending == 0) continue;
        G->feat[s] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d->n_embd_inp, st->n_pending);
        ggml_set_input(G->feat[s]);
        G->feat_pos[s] = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, st->n_pending);
        ggml_set_input(G->feat_pos[s]);
        struct ggml_tensor * c = rms(ctx, ggml_mul_mat(ctx, d->fc, G->feat[s]), d->hidden_norm, hp->rms_eps);
        for (int il = 0; il < hp->n_layer; il++) {
            store_kv(d, st, ctx, G->gf, il, c, G->feat_pos[s], st->n_cached, st->n_pending);
        }
    }
    if (n_block <= 0) return true;

    const int64_t B = n_block, N = B * n_seq;
    G->tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, N);
    ggml_set_input(G->tokens);
    G->block_pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, N);
    ggml_set_input(G->block_pos);
    // Masks only for the layer kinds that exist: an input no node reads is never
    // allocated, and setting it would abort.
    bool any_full = false, any_swa = false;
    for (int il = 0; il < hp->n_layer; il++) {
        if (hp->n_swa > 0 && ((hp->swa_layers >> il) & 1u)) any_swa = true; else any_full = true;
    }
    for (int32_t s = 0; s < n_seq; s++) {
        G->n_kv[s] = sts[s]->n_cached + sts[s]->n_pending + n_block;
        if (hp->causal && any_full) {
            G->mask_full[s] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, G->n_kv[s], B);
            ggml_set_input(G->mask_full[s]);
        }
        if (any_swa) {
            G->mask_swa[s] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, G->n_kv[s], B);
            ggml_set_input(G->mask_swa[s]);
        }
    }

    struct ggml_tensor * h = ggml_get_rows(ctx, d->tok_embd, G->tokens);
    if (hp->embedding_scale != 1.0f) h = ggml_scale(ctx, h, hp->embedding_scale);
    const float kq_scale = 1.0f / sqrtf((float) hp->head_dim);

    for (int il = 0; il < hp->n_layer; il++) {
        const struct dflash_layer * L = &d->layers[il];
        const bool v2 = hp->version == 2;
        const bool swa = hp->n_swa > 0 && ((hp->swa_layers >> il) & 1u);
        struct ggml_tensor * u = rms(ctx, h, L->attn_norm, hp->rms_eps);
        struct ggml_tensor * kern_a = NULL;
        if (v2) {
            kern_a = conv_kernels(d, ctx, ggml_mul_mat(ctx, L->attn_conv_proj, u), L->attn_conv_base);
            u = dyn_conv(d, ctx, u, kern_a, 0, B);
        }
        if (!ggml_is_contiguous(u)) u = ggml_cont(ctx, u); // per-sequence column views below

        struct ggml_tensor * q = ggml_mul_mat(ctx, L->wq, u);
        q = ggml_reshape_3d(ctx, q, hp->head_dim, hp->n_head, N);
        q = rms(ctx, q, L->q_norm, hp->rms_eps);
        q = rope(ctx, hp, q, G->block_pos);

        struct ggml_tensor * o = NULL;
        for (int32_t s = 0; s < n_seq; s++) {
            struct dflash_state * st = sts[s];
            const int32_t a = st->n_cached + st->n_pending, n_kv = G->n_kv[s];
            struct ggml_tensor * u_s = ggml_view_2d(ctx, u, hp->n_embd, B, u->nb[1], (size_t) s * B * u->nb[1]);
            struct ggml_tensor * pos_s = ggml_view_1d(ctx, G->block_pos, B, (size_t) s * B * sizeof(int32_t));
            store_kv(d, st, ctx, G->gf, il, u_s, pos_s, a, (int32_t) B);

            struct ggml_tensor * K = ggml_view_3d(ctx, st->k_cache[il], hp->head_dim, hp->n_head_kv, n_kv,
                                                  ggml_row_size(st->k_cache[il]->type, hp->head_dim),
                                                  st->k_cache[il]->nb[1], 0);
            K = ggml_permute(ctx, K, 0, 2, 1, 3);                                    // [d, n_kv, H_kv]
            struct ggml_tensor * q_s = ggml_view_3d(ctx, q, hp->head_dim, hp->n_head, B, q->nb[1], q->nb[2],
                                                    (size_t) s * B * q->nb[2]);
            struct ggml_tensor * Q = ggml_permute(ctx, q_s, 0, 2, 1, 3);            // [d, B, H]
            struct ggml_tensor * kq = ggml_mul_mat(ctx, K, Q);                       // [n_kv, B, H]
            kq = ggml_soft_max_ext(ctx, kq, swa ? G->mask_swa[s] : G->mask_full[s], kq_scale, 0.0f);
            struct ggml_tensor * V = ggml_view_3d(ctx, st->v_cache[il], n_kv, hp->head_dim, hp->n_head_kv,
                                                  st->v_cache[il]->nb[1], st->v_cache[il]->nb[1] * hp->head_dim, 0);
            struct ggml_tensor * o_s = ggml_mul_mat(ctx, V, kq);                     // [d, B, H]
            o_s = ggml_cont(ctx, ggml_permute(ctx, o_s, 0, 2, 1, 3));               // [d, H, B]
            o = o ? ggml_concat(ctx, o, o_s, 2) : o_s;
        }
        o = ggml_reshape_2d(ctx, o, (int64_t) hp->head_dim * hp->n_head, N);
        o = ggml_mul_mat(ctx, L->wo, o);
        if (v2) o = dyn_conv(d, ctx, o, kern_a, 1, B);
        h = ggml_add(ctx, h, o);

        struct ggml_tensor * v = rms(ctx, h, L->ffn_norm, hp->rms_eps);
        struct ggml_tensor * kern_m = NULL;
        if (v2) {
            kern_m = conv_kernels(d, ctx, ggml_mul_mat(ctx, L->ffn_conv_proj, v), L->ffn_conv_base);
            v = dyn_conv(d, ctx, v, kern_m, 0, B);
        }
        struct ggml_tensor * g = ggml_silu(ctx, ggml_mul_mat(ctx, L->ffn_gate, v));
        struct ggml_tensor * m = ggml_mul(ctx, g, ggml_mul_mat(ctx, L->ffn_up, v));
        m = ggml_mul_mat(ctx, L->ffn_down, m);
        if (v2) m = dyn_conv(d, ctx, m, kern_m, 1, B);
        h = ggml_add(ctx, h, m);
    }

    // Slot 0 (the anchor) of every block predicts nothing: drop it before the head.
    const int64_t n = B - 1;
    struct ggml_tensor * z = ggml_view_3d(ctx, h, hp->n_embd, n, n_seq, h->nb[1], h->nb[1] * B, h->nb[1]);
    z = ggml_reshape_2d(ctx, ggml_cont(ctx, z), hp->n_embd, n * n_seq);
    z = rms(ctx, z, d->out_norm, hp->rms_eps);
    struct ggml_tensor * logits = ggml_mul_mat(ctx, d->head, z); // [n_vocab_draft, n * n_seq]
    if (hp->logit_scale != 1.0f) logits = ggml_scale(ctx, logits, hp->logit_scale);
    if (hp->softcap > 0.0f) {
        logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / hp->softcap)), hp->softcap);
    }
    G->logits = logits;
    if (want_logits) {
        ggml_set_output(G->logits);
        ggml_build_forward_expand(G->gf, G->logits);
    }
    if (hp->version == 2) {
        build_selector(d, G, ctx, z, logits, n, n_seq);
        return true;
    }
    if (want_topk) {
        // v1 sampling: the DFLASH_V1_SAMPLE_K best tokens of each slot and their logits
        const int64_t K = DFLASH_V1_SAMPLE_K < logits->ne[0] ? DFLASH_V1_SAMPLE_K : logits->ne[0];
        struct ggml_tensor * cand_d = ggml_top_k(ctx, logits, (int) K);
        G->scores = ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, logits->ne[0], logits->ne[1]), cand_d);
        G->cand = to_target_ids(d, ctx, cand_d);
        ggml_set_output(G->cand);
        ggml_set_output(G->scores);
        ggml_build_forward_expand(G->gf, G->cand);
        ggml_build_forward_expand(G->gf, G->scores);
        return true;
    }
    G->argmax = ggml_argmax(ctx, logits);
    ggml_set_output(G->argmax);
    ggml_build_forward_expand(G->gf, G->argmax);
    return true;
}

static void fill_mask(float * m, int32_t n_kv, int32_t n_block, int32_t a, bool causal, int32_t window) {
    for (int32_t i = 0; i < n_block; i++) {
        const int32_t qp = a + i;
        for (int32_t j = 0; j < n_kv; j++) {
            bool vis = true;
            if (causal && j > qp) vis = false;
            if (window > 0 && (qp - j >= window || j - qp >= window)) vis = false;
            m[(size_t) i * n_kv + j] = vis ? 0.0f : -INFINITY;
        }
    }
}

// A sampled draft (T > 0): its temperature, random state and proposal outputs.
static int32_t sample_softmax(const float * x, int32_t k, float T, struct dflash_rng * rng, float * q);

struct dflash_sample_req {
    float temperature;
    struct dflash_rng * rng;  // NULL: greedy choice (p_min cut-off only)
    int32_t * cand;   // n x k
    float * q;        // n x k
    int32_t k;
    float p_min;      // greedy: stop at the first slot less confident than this
    int32_t n_out;    // tokens produced
    struct dflash_token_filter * filter;  // optional: only allowed candidates
};

// The slot's choice among its k candidates x[0..k) (ids c) under the filter: greedy takes
// the best allowed one, sampling draws from softmax(x / T) over the allowed ones (q of the
// rest is 0).  Returns the index, or -1 when nothing is allowed; the choice is accepted
// into the filter.
static int32_t choose(const float * x, const int32_t * c, int32_t k, struct dflash_sample_req * samp, float * q) {
    struct dflash_token_filter * f = samp ? samp->filter : NULL;
    float masked[DFLASH_V1_SAMPLE_K > 64 ? DFLASH_V1_SAMPLE_K : 64];
    const float * row = x;
    if (f) {
        int32_t best = -1, n_ok = 0, top = 0;
        for (int32_t j = 0; j < k; j++) {
            top = x[j] > x[top] ? j : top;
            const bool ok = f->allowed(f->ud, c[j]);
            masked[j] = ok ? x[j] : -INFINITY;
            if (ok) {
                n_ok++;
                if (best < 0 || x[j] > x[best]) best = j;
            }
        }
        if (n_ok == 0) {
            f->cut = true;
            return -1;
        }
        if (best != top) f->n_skipped++;
        row = masked;
    }
    int32_t pick = 0;
    if (samp && samp->rng) {
        pick = sample_softmax(row, k, samp->temperature, samp->rng, q);
    } else {
        for (int32_t j = 1; j < k; j++) pick = row[j] > row[pick] ? j : pick;
    }
    if (f) f->accept(f->ud, c[pick]);
    return pick;
}

// Softmax probability of x[j] among x[0..k) at temperature 1.
static float softmax_at(const float * x, int32_t k, int32_t j) {
    float mx = x[0];
    for (int32_t i = 1; i < k; i++) mx = x[i] > mx ? x[i] : mx;
    double sum = 0.0;
    for (int32_t i = 0; i < k; i++) sum += exp((double) x[i] - mx);
    return (float) (exp((double) x[j] - mx) / sum);
}

// Sample index j ~ softmax(x / T) over x[0..k); q receives the probabilities.
static int32_t sample_softmax(const float * x, int32_t k, float T, struct dflash_rng * rng, float * q) {
    float mx = x[0];
    for (int32_t j = 1; j < k; j++) mx = x[j] > mx ? x[j] : mx;
    double sum = 0.0;
    for (int32_t j = 0; j < k; j++) {
        q[j] = expf((x[j] - mx) / T);
        sum += q[j];
    }
    const double u = dflash_rng_uniform(rng) * sum;
    double c = 0.0;
    int32_t pick = k - 1;
    for (int32_t j = 0; j < k; j++) {
        c += q[j];
        if (u < c && pick == k - 1) pick = j;
        q[j] = (float) (q[j] / sum);
    }
    return pick;
}

// DFlash2: walk one block's lattice from its anchor (greedy, sampled, or greedy with
// a p_min cut-off); returns the tokens produced.
static int32_t walk(const struct dflash_drafter_info * hp, const int32_t * cand, const float * scores, int32_t n,
                    int32_t * out_tokens, struct dflash_sample_req * samp) {
    const int32_t K = hp->selector_top_k;
    int32_t prev = 0;
    for (int32_t k = 0; k < n; k++) {
        const float * row = scores + ((size_t) k * K + prev) * K;
        // sampled walk: q conditioned on the drafted predecessor
        const int32_t best = choose(row, cand + (size_t) k * K, K, samp, samp ? samp->q + (size_t) k * K : NULL);
        if (best < 0) return k;
        if (samp && samp->rng) {
            memcpy(samp->cand + (size_t) k * K, cand + (size_t) k * K, sizeof(int32_t) * K);
        } else if (samp && samp->p_min > 0.0f && softmax_at(row, K, best) < samp->p_min) {
            return k;
        }
        out_tokens[k] = cand[k * K + best];
        prev = best;
    }
    return n;
}

// Run one graph over n_seq states: inject their pending rows (which become cached)
// and, if n_block > 0, draft n_block - 1 tokens after each anchor.  out_tokens /
// out_logits hold n_seq consecutive rows of n_block - 1.  samp (one state only)
// requests sampling or a p_min cut-off.
static int32_t run_graph(struct dflash_drafter * d, struct dflash_state ** sts, int32_t n_seq,
                         const int32_t * anchors, int32_t n_block, int32_t * out_tokens, float * out_logits,
                         struct dflash_sample_req * samp, char * err, size_t err_len) {
    const struct dflash_drafter_info * hp = &d->hp;
    struct dflash_graph G;
    if (!build_graph(d, &G, sts, n_seq, n_block, out_logits != NULL, samp && hp->version == 1)) {
        dflash_seterr(err, err_len, "failed to build the drafter graph");
        return -1;
    }
    ggml_backend_sched_reset(d->sched);
    if (!ggml_backend_sched_alloc_graph(d->sched, G.gf)) {
        ggml_free(G.ctx);
        dflash_seterr(err, err_len, "failed to allocate the drafter graph");
        return -1;
    }
    for (int32_t s = 0; s < n_seq; s++) {
        struct dflash_state * st = sts[s];
        if (!G.feat[s]) continue;
        ggml_backend_tensor_set(G.feat[s], st->pending, 0, sizeof(float) * (size_t) st->n_pending * d->n_embd_inp);
        int32_t * pos = malloc(sizeof(int32_t) * st->n_pending);
        for (int32_t i = 0; i < st->n_pending; i++) pos[i] = st->n_cached + i;
        ggml_backend_tensor_set(G.feat_pos[s], pos, 0, sizeof(int32_t) * st->n_pending);
        free(pos);
    }
    if (n_block > 0) {
        const size_t N = (size_t) n_block * n_seq;
        int32_t * buf = malloc(sizeof(int32_t) * N * 2);
        for (int32_t s = 0; s < n_seq; s++) {
            const int32_t a = sts[s]->n_cached + sts[s]->n_pending;
            for (int32_t i = 0; i < n_block; i++) {
                buf[s * n_block + i] = i == 0 ? anchors[s] : hp->mask_token_id;
                buf[N + s * n_block + i] = a + i;
            }
        }
        ggml_backend_tensor_set(G.tokens, buf, 0, sizeof(int32_t) * N);
        ggml_backend_tensor_set(G.block_pos, buf + N, 0, sizeof(int32_t) * N);
        free(buf);
        if (G.anchor) ggml_backend_tensor_set(G.anchor, anchors, 0, sizeof(int32_t) * n_seq);
        for (int32_t s = 0; s < n_seq; s++) {
            if (!G.mask_full[s] && !G.mask_swa[s]) continue;
            const int32_t a = sts[s]->n_cached + sts[s]->n_pending;
            float * m = malloc(sizeof(float) * (size_t) G.n_kv[s] * n_block);
            if (G.mask_full[s]) {
                fill_mask(m, G.n_kv[s], n_block, a, hp->causal, 0);
                ggml_backend_tensor_set(G.mask_full[s], m, 0, sizeof(float) * (size_t) G.n_kv[s] * n_block);
            }
            if (G.mask_swa[s]) {
                fill_mask(m, G.n_kv[s], n_block, a, hp->causal, hp->n_swa);
                ggml_backend_tensor_set(G.mask_swa[s], m, 0, sizeof(float) * (size_t) G.n_kv[s] * n_block);
            }
            free(m);
        }
    }
    enum ggml_status status = ggml_backend_sched_graph_compute(d->sched, G.gf);
    if (status != GGML_STATUS_SUCCESS) {
        ggml_free(G.ctx);
        dflash_seterr(err, err_len, "drafter graph compute failed (status %d)", (int) status);
        return -1;
    }
    for (int32_t s = 0; s < n_seq; s++) {
        sts[s]->n_cached += sts[s]->n_pending;
        sts[s]->n_pending = 0;
    }
    const int32_t n = n_block - 1;
    if (n_block > 0 && hp->version == 2) {
        const int32_t K = hp->selector_top_k;
        const size_t nk = (size_t) n * K;
        for (int32_t s = 0; s < n_seq; s++) {
            struct dflash_state * st = sts[s];
            ggml_backend_tensor_get(G.cand, st->last_cand, sizeof(int32_t) * nk * s, sizeof(int32_t) * nk);
            ggml_backend_tensor_get(G.scores, st->last_scores, sizeof(float) * nk * K * s, sizeof(float) * nk * K);
            st->last_n = n;
            const int32_t got = walk(hp, st->last_cand, st->last_scores, n, out_tokens + (size_t) s * n, samp);
            if (samp) {
                samp->k = K;
                samp->n_out = got;
            }
        }
    } else if (n_block > 0 && samp) {
        // v1: every slot sampled independently from its top candidates (or cut at p_min)
        const int32_t K = (int32_t) G.cand->ne[0];
        float * lg = malloc(sizeof(float) * (size_t) n * K);
        ggml_backend_tensor_get(G.cand, samp->cand, 0, sizeof(int32_t) * (size_t) n * K);
        ggml_backend_tensor_get(G.scores, lg, 0, sizeof(float) * (size_t) n * K);
        samp->n_out = n;
        for (int32_t k = 0; k < n; k++) {
            const float * x = lg + (size_t) k * K;
            const int32_t j = choose(x, samp->cand + (size_t) k * K, K, samp, samp->q + (size_t) k * K);
            if (j < 0 || (!samp->rng && samp->p_min > 0.0f && softmax_at(x, K, j) < samp->p_min)) {
                samp->n_out = k;
                break;
            }
            out_tokens[k] = samp->cand[(size_t) k * K + j];
        }
        free(lg);
        samp->k = K;
    } else if (n_block > 0) {
        ggml_backend_tensor_get(G.argmax, out_tokens, 0, sizeof(int32_t) * (size_t) n * n_seq);
        if (d->d2t_host) {
            for (int32_t i = 0; i < n * n_seq; i++) out_tokens[i] = d->d2t_host[out_tokens[i]];
        }
    }
    if (n_block > 0 && out_logits) {
        const size_t rows = (size_t) n * n_seq;
        if (!d->d2t_host) {
            ggml_backend_tensor_get(G.logits, out_logits, 0, sizeof(float) * rows * hp->n_vocab);
        } else {
            // target-vocabulary rows, -inf where the drafter cannot propose (as upstream scatters them)
            const size_t nd = (size_t) hp->n_vocab_draft;
            float * tmp = malloc(sizeof(float) * rows * nd);
            if (!tmp) {
                ggml_free(G.ctx);
                dflash_seterr(err, err_len, "out of memory scattering the draft logits");
                return -1;
            }
            ggml_backend_tensor_get(G.logits, tmp, 0, sizeof(float) * rows * nd);
            for (size_t r = 0; r < rows; r++) {
                float * o = out_logits + r * hp->n_vocab;
                for (int32_t v = 0; v < hp->n_vocab; v++) o[v] = -INFINITY;
                for (size_t j = 0; j < nd; j++) o[d->d2t_host[j]] = tmp[r * nd + j];
            }
            free(tmp);
        }
    }
    ggml_free(G.ctx);
    return 0;
}

// ---------------------------------------------------------------------------
// public API

void dflash_drafter_free(dflash_drafter * d) {
    if (!d) return;
    if (d->sched) ggml_backend_sched_free(d->sched);
    dflash_state_free(d->def);
    if (d->buf_w) ggml_backend_buffer_free(d->buf_w);
    if (d->ctx_w) ggml_free(d->ctx_w);
    for (int i = 0; i < d->n_backends; i++) ggml_backend_free(d->backends[i]);
    free(d->meta_buf);
    free(d->d2t_host);
    free(d);
}

static bool parse_hparams(struct dflash_drafter * d, const struct gguf_context * g, struct ggml_context * meta,
                          const char * path, char * err, size_t err_len) {
    struct dflash_drafter_info * hp = &d->hp;
    int64_t id = kv_find(g, "general.architecture");
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) {
        dflash_seterr(err, err_len, "'%s' has no general.architecture: not a llama.cpp GGUF model", path);
        return false;
    }
    const char * arch = gguf_get_val_str(g, id);
    if (strcmp(arch, "dflash") != 0) {
        dflash_seterr(err, err_len, "'%s' is a '%s' model, not a DFlash drafter (architecture 'dflash')", path, arch);
        return false;
    }
    if (ggml_get_tensor(meta, "markov_w1.weight")) {
        dflash_seterr(err, err_len, "'%s' is a DSpark drafter (markov_w1.weight); only DFlash is supported", path);
        return false;
    }
    const struct ggml_tensor * d2t = ggml_get_tensor(meta, "d2t");
    hp->n_vocab_draft = 0; // the target's vocabulary unless d2t says otherwise (set in validate_target)
    if (d2t) {
        // upstream's layout: absolute target ids, I64, one per row of the drafter's own head
        if (d2t->type != GGML_TYPE_I64 || ggml_n_dims(d2t) != 1 || d2t->ne[0] < 1 || d2t->ne[0] > INT32_MAX) {
            dflash_seterr(err, err_len, "'%s': tensor d2t must be a 1-D I64 map of target ids", path);
            return false;
        }
        hp->n_vocab_draft = (int32_t) d2t->ne[0];
    }
    bool b = false;
    if (kv_bool(g, "dflash.sample_from_anchor", &b) && b) {
        dflash_seterr(err, err_len, "'%s' sets dflash.sample_from_anchor (DSpark layout); not supported", path);
        return false;
    }
    hp->version = 1;
    if (ggml_get_tensor(meta, "selector_hidden.weight")) {
        // DFlash2: detected as upstream does, by the selector tensor; its keys are then required.
        hp->version = 2;
        struct { const char * key; int32_t * dst; } v2[] = {
            { "dflash.conv_kernel_size", &hp->conv_kernel_size },
            { "dflash.conv_group_size", &hp->conv_group_size },
            { "dflash.selector_rank", &hp->selector_rank },
            { "dflash.selector_top_k", &hp->selector_top_k },
        };
        for (size_t i = 0; i < sizeof(v2) / sizeof(v2[0]); i++) {
            if (!kv_u32(g, v2[i].key, v2[i].dst) || *v2[i].dst <= 0) {
                dflash_seterr(err, err_len, "'%s': DFlash2 drafter is missing conv/selector key '%s'", path, v2[i].key);
                return false;
            }
        }
    }
    struct { const char * key; int32_t * dst; } req[] = {
        { "dflash.block_count", &hp->n_layer },
        { "dflash.embedding_length", &hp->n_embd },
        { "dflash.feed_forward_length", &hp->n_ff },
        { "dflash.attention.head_count", &hp->n_head },
        { "dflash.block_size", &hp->block_size },
    };
    for (size_t i = 0; i < sizeof(req) / sizeof(req[0]); i++) {
        if (!kv_u32(g, req[i].key, req[i].dst) || *req[i].dst <= 0) {
            dflash_seterr(err, err_len, "'%s': missing or invalid key '%s'", path, req[i].key);
            return false;
        }
    }
    if (hp->n_layer > DFLASH_MAX_LAYERS) {
        dflash_seterr(err, err_len, "'%s': %d drafter layers exceed the supported %d", path, hp->n_layer, DFLASH_MAX_LAYERS);
        return false;
    }
    if (!kv_u32(g, "dflash.attention.head_count_kv", &hp->n_head_kv)) hp->n_head_kv = hp->n_head;
    if (!kv_u32(g, "dflash.attention.key_length", &hp->head_dim)) hp->head_dim = hp->n_embd / hp->n_head;
    int32_t vlen = hp->head_dim;
    kv_u32(g, "dflash.attention.value_length", &vlen);
    if (hp->n_head_kv <= 0 || hp->n_head % hp->n_head_kv != 0 || vlen != hp->head_dim || hp->head_dim <= 0) {
        dflash_seterr(err, err_len, "'%s': unsupported attention shape (heads %d, kv heads %d, key %d, value %d)",
                      path, hp->n_head, hp->n_head_kv, hp->head_dim, vlen);
        return false;
    }
    hp->rms_eps = 1e-6f;
    kv_f32(g, "dflash.attention.layer_norm_rms_epsilon", &hp->rms_eps);
    hp->rope_theta = 10000.0f;
    kv_f32(g, "dflash.rope.freq_base", &hp->rope_theta);
    int32_t rot = hp->head_dim;
    if (kv_u32(g, "dflash.rope.dimension_count", &rot) && rot != hp->head_dim) {
        dflash_seterr(err, err_len, "'%s': partial rotary embeddings (%d of %d dims) are not supported", path, rot, hp->head_dim);
        return false;
    }
    // RoPE scaling, read as llama.cpp reads it (keys of convert_hf_to_gguf): linear or YaRN.
    hp->rope_freq_scale = 1.0f;
    hp->rope_ext_factor = 0.0f;
    hp->rope_attn_factor = 1.0f;
    hp->rope_beta_fast = 32.0f;
    hp->rope_beta_slow = 1.0f;
    hp->rope_n_ctx_orig = 0;
    kv_u32(g, "dflash.context_length", &hp->rope_n_ctx_orig);
    int64_t st_id = kv_find(g, "dflash.rope.scaling.type");
    const char * scaling = st_id >= 0 && gguf_get_kv_type(g, st_id) == GGUF_TYPE_STRING ? gguf_get_val_str(g, st_id) : "none";
    if (strcmp(scaling, "none") != 0) {
        float factor = 0.0f;
        if (strcmp(scaling, "linear") != 0 && strcmp(scaling, "yarn") != 0) {
            dflash_seterr(err, err_len, "'%s': rope scaling '%s' is not supported (linear, yarn)", path, scaling);
            return false;
        }
        if (!kv_f32(g, "dflash.rope.scaling.factor", &factor) || !(factor > 0.0f)) {
            dflash_seterr(err, err_len, "'%s': rope scaling '%s' without a valid dflash.rope.scaling.factor", path, scaling);
            return false;
        }
        hp->rope_freq_scale = 1.0f / factor;
        if (strcmp(scaling, "yarn") == 0) {
            float log_mul = 0.0f;
            if (kv_f32(g, "dflash.rope.scaling.yarn_log_multiplier", &log_mul) && log_mul != 0.0f) {
                dflash_seterr(err, err_len, "'%s': YaRN with yarn_log_multiplier is not supported", path);
                return false;
            }
            hp->rope_ext_factor = 1.0f;
            kv_f32(g, "dflash.rope.scaling.yarn_ext_factor", &hp->rope_ext_factor);
            kv_f32(g, "dflash.rope.scaling.attn_factor", &hp->rope_attn_factor);
            kv_f32(g, "dflash.rope.scaling.yarn_attn_factor", &hp->rope_attn_factor);
            kv_f32(g, "dflash.rope.scaling.yarn_beta_fast", &hp->rope_beta_fast);
            kv_f32(g, "dflash.rope.scaling.yarn_beta_slow", &hp->rope_beta_slow);
            kv_u32(g, "dflash.rope.scaling.original_context_length", &hp->rope_n_ctx_orig);
        }
    }
    int32_t sections[8] = { 0 };
    int32_t n_sec = kv_arr_i32(g, "dflash.rope.dimension_sections", sections, 8);
    if (n_sec > 0) {
        // M-RoPE drafts carry [head_dim/2, 0, 0, 0]: plain 1-D positions.
        for (int i = 1; i < n_sec; i++) {
            if (sections[i] != 0) {
                dflash_seterr(err, err_len, "'%s': multi-axis rope sections are not supported", path);
                return false;
            }
        }
    }
    float fv = 0.0f;
    if (kv_f32(g, "dflash.attention.value_scale", &fv) && fv != 1.0f) {
        dflash_seterr(err, err_len, "'%s': dflash.attention.value_scale is not supported", path);
        return false;
    }
    hp->n_taps = kv_arr_i32(g, "dflash.target_layers", hp->target_layers, 64);
    if (hp->n_taps <= 0) {
        dflash_seterr(err, err_len, "'%s': missing or invalid 'dflash.target_layers'", path);
        return false;
    }
    for (int i = 0; i < hp->n_taps; i++) hp->target_layers[i] -= 1; // GGUF stores HF id + 1
    if (!kv_u32(g, "tokenizer.ggml.mask_token_id", &hp->mask_token_id)) {
        dflash_seterr(err, err_len, "'%s': missing 'tokenizer.ggml.mask_token_id'", path);
        return false;
    }
    hp->causal = kv_bool(g, "dflash.attention.causal", &b) && b;
    hp->n_swa = 0;
    hp->swa_layers = 0;
    if (kv_u32(g, "dflash.attention.sliding_window", &hp->n_swa) && hp->n_swa > 0) {
        int32_t pat[DFLASH_MAX_LAYERS];
        int32_t np = kv_arr_i32(g, "dflash.attention.sliding_window_pattern", pat, DFLASH_MAX_LAYERS);
        for (int i = 0; i < hp->n_layer; i++) {
            if (np < 0 || (i < np && pat[i])) hp->swa_layers |= 1u << i;
        }
    }
    hp->embedding_scale = 1.0f;
    kv_f32(g, "dflash.embedding_scale", &hp->embedding_scale);
    hp->logit_scale = 1.0f;
    kv_f32(g, "dflash.logit_scale", &hp->logit_scale);
    hp->softcap = 0.0f;
    kv_f32(g, "dflash.final_logit_softcapping", &hp->softcap);
    if (kv_find(g, "dflash.hidden_activation") >= 0 || kv_find(g, "dflash.attention.scale") >= 0) {
        dflash_seterr(err, err_len, "'%s': Gemma-style drafters (hidden_activation / attention.scale) are not supported", path);
        return false;
    }
    if (hp->version == 2) {
        if (hp->n_embd % hp->conv_group_size != 0) {
            dflash_seterr(err, err_len, "'%s': conv_group_size %d does not divide the hidden size %d", path,
                          hp->conv_group_size, hp->n_embd);
            return false;
        }
        if (hp->selector_top_k > 64 || hp->conv_kernel_size > 8) {
            dflash_seterr(err, err_len, "'%s': selector_top_k %d / conv_kernel_size %d are out of range", path,
                          hp->selector_top_k, hp->conv_kernel_size);
            return false;
        }
    }
    d->n_embd_inp = hp->n_taps * hp->n_embd;
    return true;
}

static bool validate_target(struct dflash_drafter * d, const struct llama_model * target, const char * path,
                            char * err, size_t err_len) {
    struct dflash_drafter_info * hp = &d->hp;
    const int32_t t_embd = llama_model_n_embd(target);
    const int32_t t_layer = llama_model_n_layer(target);
    const int32_t t_vocab = llama_vocab_n_tokens(llama_model_get_vocab(target));
    hp->n_vocab = t_vocab;
    if (hp->n_vocab_draft == 0) hp->n_vocab_draft = t_vocab;
    if (hp->n_vocab_draft > t_vocab) {
        dflash_seterr(err, err_len, "drafter '%s' maps %d draft tokens but the target has only %d", path,
                      hp->n_vocab_draft, t_vocab);
        return false;
    }
    if (hp->n_embd != t_embd) {
        dflash_seterr(err, err_len, "drafter '%s' has hidden size %d but the target has %d", path, hp->n_embd, t_embd);
        return false;
    }
    for (int i = 0; i < hp->n_taps; i++) {
        // The last layer's output is pruned to output rows inside llama.cpp,
        // so taps must lie strictly below it.
        if (hp->target_layers[i] < 0 || hp->target_layers[i] >= t_layer - 1) {
            dflash_seterr(err, err_len, "drafter '%s' taps target layer %d but the target has %d layers (usable: 0..%d)",
                          path, hp->target_layers[i], t_layer, t_layer - 2);
            return false;
        }
    }
    if (hp->version == 2 && hp->selector_top_k > hp->n_vocab_draft) {
        dflash_seterr(err, err_len, "drafter '%s': selector_top_k %d exceeds its %d-token vocabulary", path,
                      hp->selector_top_k, hp->n_vocab_draft);
        return false;
    }
    if (hp->mask_token_id < 0 || hp->mask_token_id >= t_vocab) {
        dflash_seterr(err, err_len, "drafter '%s' has mask token id %d outside the target vocabulary (%d tokens)",
                      path, hp->mask_token_id, t_vocab);
        return false;
    }
    return true;
}

dflash_drafter * dflash_drafter_load(const char * path, const struct llama_model * target, int32_t n_ctx,
                                     int32_t n_threads, char * err, size_t err_len) {
    if (!path || !target) {
        dflash_seterr(err, err_len, "drafter path and target model are required");
        return NULL;
    }
    struct stat stt;
    if (stat(path, &stt) != 0 || !S_ISREG(stt.st_mode)) {
        dflash_seterr(err, err_len, "drafter file '%s' does not exist", path);
        return NULL;
    }
    if (n_ctx <= 0) {
        dflash_seterr(err, err_len, "n_ctx must be positive (got %d)", n_ctx);
        return NULL;
    }
    struct ggml_context * meta = NULL;
    struct gguf_init_params gp = { true, &meta };
    struct gguf_context * g = gguf_init_from_file(path, gp);
    if (!g) {
        dflash_seterr(err, err_len, "'%s' is not a valid GGUF file (unreadable or truncated header)", path);
        return NULL;
    }
    struct dflash_drafter * d = calloc(1, sizeof(*d));
    bool ok = parse_hparams(d, g, meta, path, err, err_len) && validate_target(d, target, path, err, err_len);
    struct dflash_drafter_info * hp = &d->hp;

    // The file must hold every tensor's bytes.
    if (ok) {
        size_t end = gguf_get_data_offset(g);
        for (int64_t i = 0; i < gguf_get_n_tensors(g); i++) {
            size_t e = gguf_get_data_offset(g) + gguf_get_tensor_offset(g, i) + gguf_get_tensor_size(g, i);
            if (e > end) end = e;
            if (!is_known_tensor(gguf_get_tensor_name(g, i), hp->n_layer)) {
                dflash_seterr(err, err_len, "drafter '%s' has an unsupported tensor '%s'", path, gguf_get_tensor_name(g, i));
                ok = false;
                break;
            }
        }
        if (ok && end > (size_t) stt.st_size) {
            dflash_seterr(err, err_len, "drafter file '%s' is truncated (%lld of %lld bytes)", path,
                          (long long) stt.st_size, (long long) end);
            ok = false;
        }
    }

    // Shapes.
    const int64_t E = hp->n_embd, qd = (int64_t) hp->head_dim * hp->n_head, kvd = (int64_t) hp->head_dim * hp->n_head_kv;
    struct ggml_tensor * m_fc = NULL, * m_hn = NULL, * m_on = NULL, * m_te = NULL, * m_out = NULL;
    struct ggml_tensor * m_l[DFLASH_MAX_LAYERS][11];
    if (ok) {
        m_fc = want(meta, "fc.weight", (int64_t) hp->n_taps * E, E, true, err, err_len, &ok);
        if (ok) m_hn = want(meta, "enc.output_norm.weight", E, 1, true, err, err_len, &ok);
        if (ok) m_on = want(meta, "output_norm.weight", E, 1, true, err, err_len, &ok);
        if (ok) m_te = want(meta, "token_embd.weight", E, hp->n_vocab, false, err, err_len, &ok);
        // a reduced vocabulary needs the drafter's own head over exactly its rows
        const bool reduced = ggml_get_tensor(meta, "d2t") != NULL;
        if (ok) m_out = want(meta, "output.weight", E, hp->n_vocab_draft, reduced, err, err_len, &ok);
        static const char * names[11] = { "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                           "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down" };
        const int64_t shp[11][2] = { { E, 1 }, { E, qd }, { E, kvd }, { E, kvd }, { qd, E }, { hp->head_dim, 1 },
                                     { hp->head_dim, 1 }, { E, 1 }, { E, hp->n_ff }, { E, hp->n_ff }, { hp->n_ff, E } };
        for (int il = 0; ok && il < hp->n_layer; il++) {
            for (int k = 0; ok && k < 11; k++) {
                char nm[96];
                snprintf(nm, sizeof(nm), "blk.%d.%s.weight", il, names[k]);
                m_l[il][k] = want(meta, nm, shp[k][0], shp[k][1], true, err, err_len, &ok);
            }
        }
    }

    // DFlash2 tensors: conv bases (ggml {H, K, 2}, no .weight), projections, selector.
    struct ggml_tensor * m_conv[DFLASH_MAX_LAYERS][4] = { { 0 } };
    struct ggml_tensor * m_sel[3] = { 0 };
    if (ok && hp->version == 2) {
        const int64_t K = hp->conv_kernel_size, G = E / hp->conv_group_size, R = hp->selector_rank;
        for (int il = 0; ok && il < hp->n_layer; il++) {
            char nm[96];
            const char * sides[2] = { "attn", "ffn" };
            for (int s2 = 0; ok && s2 < 2; s2++) {
                snprintf(nm, sizeof(nm), "blk.%d.%s_conv_base", il, sides[s2]);
                m_conv[il][2 * s2] = want3(meta, nm, E, K, 2, true, err, err_len, &ok);
                snprintf(nm, sizeof(nm), "blk.%d.%s_conv_proj.weight", il, sides[s2]);
                if (ok) m_conv[il][2 * s2 + 1] = want(meta, nm, E, 2 * K * G, true, err, err_len, &ok);
            }
        }
        if (ok) m_sel[0] = want(meta, "selector_predecessor.weight", R, hp->n_vocab, true, err, err_len, &ok);
        if (ok) m_sel[1] = want(meta, "selector_successor.weight", R, hp->n_vocab, true, err, err_len, &ok);
        if (ok) m_sel[2] = want(meta, "selector_hidden.weight", E, R, true, err, err_len, &ok);
    }

    // Borrow the target's embedding and head.
    if (ok) {
        d->tok_embd = m_te ? NULL : target_tensor(target, "token_embd.weight", true);
        struct ggml_tensor * head = m_out ? NULL : target_tensor(target, "output.weight", false);
        if (!m_out && !head) head = target_tensor(target, "token_embd.weight", false); // tied
        if (m_out) head = NULL;
        d->head = head;
        if ((!m_te && !d->tok_embd) || (!m_out && !d->head)) {
            dflash_seterr(err, err_len, "cannot reach the target's token embedding / output head in this libllama");
            ok = false;
        } else {
            struct ggml_tensor * ts[2] = { d->tok_embd, d->head };
            for (int i = 0; i < 2; i++) {
                if (ts[i] && (ts[i]->ne[0] != E || ts[i]->ne[1] != hp->n_vocab)) {
                    dflash_seterr(err, err_len, "target tensor '%s' has an unexpected shape", ggml_get_name(ts[i]));
                    ok = false;
                }
            }
        }
    }

    // Backends: the device holding the target's head (also when the drafter has its own), plus the CPU.
    if (ok) {
        d->cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, NULL);
        ggml_backend_t main_be = NULL;
        struct ggml_tensor * t_head = d->head;
        if (!t_head) t_head = target_tensor(target, "output.weight", false);
        if (!t_head) t_head = target_tensor(target, "token_embd.weight", false);
        if (t_head && t_head->buffer) {
            ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t_head->buffer));
            if (dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) main_be = ggml_backend_dev_init(dev, NULL);
        }
        if (main_be) d->backends[d->n_backends++] = main_be;
        d->backends[d->n_backends++] = d->cpu;
        if (!d->cpu) {
            dflash_seterr(err, err_len, "no CPU backend available");
            ok = false;
        } else {
            ggml_backend_cpu_set_n_threads(d->cpu, n_threads > 0 ? n_threads : 1);
        }
    }

    // Own weights.
    if (ok) {
        size_t n_t = (size_t) gguf_get_n_tensors(g) + 8;
        struct ggml_init_params ip = { n_t * ggml_tensor_overhead(), NULL, true };
        d->ctx_w = ggml_init(ip);
        struct ggml_tensor * dst[DFLASH_MAX_LAYERS * 15 + 8];
        int nd = 0;
#define DUP(m) (m ? (dst[nd] = ggml_dup_tensor(d->ctx_w, m), ggml_set_name(dst[nd], ggml_get_name(m)), dst[nd++]) : NULL)
        d->fc = DUP(m_fc);
        d->hidden_norm = DUP(m_hn);
        d->out_norm = DUP(m_on);
        if (m_te) d->tok_embd = DUP(m_te);
        if (m_out) d->head = DUP(m_out);
        d->own_embd = m_te != NULL;
        d->own_head = m_out != NULL;
        for (int il = 0; il < hp->n_layer; il++) {
            struct dflash_layer * L = &d->layers[il];
            struct ggml_tensor ** slots[11] = { &L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->q_norm,
                                                &L->k_norm, &L->ffn_norm, &L->ffn_gate, &L->ffn_up, &L->ffn_down };
            for (int k = 0; k < 11; k++) *slots[k] = DUP(m_l[il][k]);
            L->attn_conv_base = DUP(m_conv[il][0]);
            L->attn_conv_proj = DUP(m_conv[il][1]);
            L->ffn_conv_base = DUP(m_conv[il][2]);
            L->ffn_conv_proj = DUP(m_conv[il][3]);
        }
        d->sel_pred = DUP(m_sel[0]);
        d->sel_succ = DUP(m_sel[1]);
        d->sel_hidden = DUP(m_sel[2]);
        if (ggml_get_tensor(meta, "d2t")) {
            // held as I32 (what get_rows takes as indices); read_weights converts the file's I64
            d->d2t = ggml_new_tensor_1d(d->ctx_w, GGML_TYPE_I32, hp->n_vocab_draft);
            ggml_set_name(d->d2t, "d2t");
        }
#undef DUP
        d->buf_w = ggml_backend_alloc_ctx_tensors(d->ctx_w, d->backends[0]);
        if (!d->buf_w) {
            dflash_seterr(err, err_len, "out of memory allocating drafter weights");
            ok = false;
        } else {
            ggml_backend_buffer_set_usage(d->buf_w, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            ok = read_weights(d, path, g, err, err_len);
        }
    }

    // Scheduler, sized by the largest single-sequence graph: a full context, a full
    // injection chunk and a full block (larger batched graphs grow it on demand).
    if (ok) {
        hp->n_ctx = n_ctx;
        d->meta_size = ggml_tensor_overhead() * DFLASH_GRAPH_SIZE + ggml_graph_overhead_custom(DFLASH_GRAPH_SIZE, false);
        d->meta_buf = malloc(d->meta_size);
        d->sched = ggml_backend_sched_new(d->backends, NULL, d->n_backends, DFLASH_GRAPH_SIZE, false, true);
        d->def = dflash_state_new(d, err, err_len);
        ok = d->def != NULL;
    }
    if (ok) {
        struct dflash_state * st = d->def;
        const int32_t n_block = hp->block_size <= n_ctx ? hp->block_size : n_ctx;
        int32_t n_feat = n_ctx - n_block < DFLASH_INJECT_CHUNK ? n_ctx - n_block : DFLASH_INJECT_CHUNK;
        if (n_feat < 1) n_feat = 1;
        st->n_pending = n_feat;
        st->n_cached = n_ctx - n_block - n_feat > 0 ? n_ctx - n_block - n_feat : 0;
        struct dflash_graph G;
        if (n_block >= 2 && build_graph(d, &G, &st, 1, n_block, true, false)) {
            if (!ggml_backend_sched_reserve(d->sched, G.gf)) {
                dflash_seterr(err, err_len, "out of memory reserving the drafter compute buffer");
                ok = false;
            }
            ggml_free(G.ctx);
        }
        st->n_pending = 0;
        st->n_cached = 0;
    }

    gguf_free(g);
    ggml_free(meta);
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
    out->weights = d->buf_w ? ggml_backend_buffer_get_size(d->buf_w) : 0;
    out->cache = d->def && d->def->buf_kv ? ggml_backend_buffer_get_size(d->def->buf_kv) : 0;
    for (int i = 0; i < d->n_backends; i++) out->compute += ggml_backend_sched_get_buffer_size(d->sched, d->backends[i]);
    out->borrows_embedding = !d->own_embd;
    out->borrows_head = !d->own_head;
    if (!d->own_embd) out->borrowed += ggml_nbytes(d->tok_embd);
    if (!d->own_head && d->head != d->tok_embd) out->borrowed += ggml_nbytes(d->head);
}

// ---- states (one per sequence) ----------------------------------------------

dflash_state * dflash_state_new(dflash_drafter * d, char * err, size_t err_len) {
    const struct dflash_drafter_info * hp = &d->hp;
    const int64_t kvd = (int64_t) hp->head_dim * hp->n_head_kv;
    struct dflash_state * st = calloc(1, sizeof(*st));
    st->d = d;
    struct ggml_init_params ip = { (size_t) (2 * hp->n_layer + 1) * ggml_tensor_overhead(), NULL, true };
    st->ctx_kv = ggml_init(ip);
    for (int il = 0; il < hp->n_layer; il++) {
        st->k_cache[il] = ggml_new_tensor_2d(st->ctx_kv, GGML_TYPE_F32, kvd, hp->n_ctx);
        st->v_cache[il] = ggml_new_tensor_2d(st->ctx_kv, GGML_TYPE_F32, hp->n_ctx, kvd);
    }
    st->buf_kv = ggml_backend_alloc_ctx_tensors(st->ctx_kv, d->backends[0]);
    st->pending_cap = DFLASH_INJECT_CHUNK;
    st->pending = malloc(sizeof(float) * (size_t) st->pending_cap * d->n_embd_inp);
    if (hp->version == 2) {
        const size_t nk = (size_t) hp->block_size * hp->selector_top_k;
        st->last_cand = malloc(sizeof(int32_t) * nk);
        st->last_scores = malloc(sizeof(float) * nk * hp->selector_top_k);
    }
    if (!st->buf_kv || !st->pending || (hp->version == 2 && (!st->last_cand || !st->last_scores))) {
        dflash_state_free(st);
        dflash_seterr(err, err_len, "out of memory allocating a drafter context of %d positions", hp->n_ctx);
        return NULL;
    }
    ggml_backend_buffer_clear(st->buf_kv, 0);
    return st;
}

void dflash_state_free(dflash_state * st) {
    if (!st) return;
    if (st->buf_kv) ggml_backend_buffer_free(st->buf_kv);
    if (st->ctx_kv) ggml_free(st->ctx_kv);
    free(st->pending);
    free(st->last_cand);
    free(st->last_scores);
    free(st);
}

void dflash_state_reset(dflash_state * st) {
    st->n_cached = 0;
    st->n_pending = 0;
}

int32_t dflash_state_truncate(dflash_state * st, int32_t n) {
    if (n < 0) return -1;
    if (n < st->n_cached) {
        st->n_cached = n;
        st->n_pending = 0;
    } else if (n < st->n_cached + st->n_pending) {
        st->n_pending = n - st->n_cached;
    }
    return dflash_state_n_ctx_used(st);
}

int32_t dflash_state_n_ctx_used(const dflash_state * st) {
    return st->n_cached + st->n_pending;
}

int32_t dflash_state_push(dflash_state * st, const float * rows, int32_t n_rows, char * err, size_t err_len) {
    struct dflash_drafter * d = st->d;
    if (n_rows < 0) return -1;
    if (st->n_cached + st->n_pending + n_rows > d->hp.n_ctx) {
        dflash_seterr(err, err_len, "drafter context overflow: %d + %d positions exceed n_ctx %d",
                      st->n_cached + st->n_pending, n_rows, d->hp.n_ctx);
        return -1;
    }
    while (n_rows > 0) {
        if (st->n_pending == st->pending_cap) {
            if (run_graph(d, &st, 1, NULL, 0, NULL, NULL, NULL, err, err_len) != 0) return -1;
        }
        int32_t take = st->pending_cap - st->n_pending;
        if (take > n_rows) take = n_rows;
        memcpy(st->pending + (size_t) st->n_pending * d->n_embd_inp, rows, sizeof(float) * (size_t) take * d->n_embd_inp);
        st->n_pending += take;
        rows += (size_t) take * d->n_embd_inp;
        n_rows -= take;
    }
    return 0;
}

int32_t dflash_state_last_lattice(const dflash_state * st, int32_t * cand, float * scores) {
    const struct dflash_drafter_info * hp = &st->d->hp;
    if (hp->version != 2) return -1;
    const size_t nk = (size_t) st->last_n * hp->selector_top_k;
    if (cand) memcpy(cand, st->last_cand, sizeof(int32_t) * nk);
    if (scores) memcpy(scores, st->last_scores, sizeof(float) * nk * hp->selector_top_k);
    return st->last_n;
}

static bool check_draft_args(const dflash_state * st, int32_t anchor, int32_t n, char * err, size_t err_len) {
    const struct dflash_drafter_info * hp = &st->d->hp;
    if (n < 1 || n > hp->block_size - 1) {
        dflash_seterr(err, err_len, "draft length %d is outside 1..%d (block size %d)", n, hp->block_size - 1, hp->block_size);
        return false;
    }
    if (anchor < 0 || anchor >= hp->n_vocab) {
        dflash_seterr(err, err_len, "anchor token %d is outside the vocabulary", anchor);
        return false;
    }
    if (st->n_cached + st->n_pending + n + 1 > hp->n_ctx) {
        dflash_seterr(err, err_len, "drafter context overflow: %d positions + block %d exceed n_ctx %d",
                      st->n_cached + st->n_pending, n + 1, hp->n_ctx);
        return false;
    }
    return true;
}

int32_t dflash_drafter_draft_batch(dflash_drafter * d, dflash_state ** states, int32_t n_seq, const int32_t * anchors,
                                   int32_t n, int32_t * out_tokens, float * out_logits, char * err, size_t err_len) {
    if (n_seq < 1 || n_seq > DFLASH_MAX_SEQ) {
        dflash_seterr(err, err_len, "a batched draft takes 1..%d sequences (got %d)", DFLASH_MAX_SEQ, n_seq);
        return -1;
    }
    for (int32_t s = 0; s < n_seq; s++) {
        if (!states[s] || states[s]->d != d) {
            dflash_seterr(err, err_len, "state %d does not belong to this drafter", s);
            return -1;
        }
        for (int32_t r = 0; r < s; r++) {
            if (states[r] == states[s]) {
                dflash_seterr(err, err_len, "state %d appears twice in the batch", s);
                return -1;
            }
        }
        if (!check_draft_args(states[s], anchors[s], n, err, err_len)) return -1;
    }
    return run_graph(d, states, n_seq, anchors, n + 1, out_tokens, out_logits, NULL, err, err_len) ? -1 : n;
}

// ---- the single-sequence API: the drafter's own state --------------------------

void dflash_drafter_reset(dflash_drafter * d) { dflash_state_reset(d->def); }

int32_t dflash_drafter_truncate(dflash_drafter * d, int32_t n) { return dflash_state_truncate(d->def, n); }

int32_t dflash_drafter_n_ctx_used(const dflash_drafter * d) { return dflash_state_n_ctx_used(d->def); }

int32_t dflash_drafter_push(dflash_drafter * d, const float * rows, int32_t n_rows, char * err, size_t err_len) {
    return dflash_state_push(d->def, rows, n_rows, err, err_len);
}

int32_t dflash_drafter_last_lattice(const dflash_drafter * d, int32_t * cand, float * scores) {
    return dflash_state_last_lattice(d->def, cand, scores);
}

int32_t dflash_drafter_draft(dflash_drafter * d, int32_t anchor, int32_t n, float p_min,
                             struct dflash_token_filter * filter, int32_t * out_tokens, float * out_logits, char * err,
                             size_t err_len) {
    struct dflash_state * st = d->def;
    if (!check_draft_args(st, anchor, n, err, err_len)) return -1;
    if (!(p_min > 0.0f) && !filter) {
        return run_graph(d, &st, 1, &anchor, n + 1, out_tokens, out_logits, NULL, err, err_len) ? -1 : n;
    }
    // the cut-off needs each slot's candidates: v1 runs its top-K path, v2 its lattice
    const int32_t K = d->hp.version == 2 ? d->hp.selector_top_k : DFLASH_V1_SAMPLE_K;
    int32_t * cand = malloc(sizeof(int32_t) * (size_t) n * K);
    float * q = malloc(sizeof(float) * (size_t) n * K);
    struct dflash_sample_req req = { 1.0f, NULL, cand, q, 0, p_min, 0, filter };
    const int32_t rc = run_graph(d, &st, 1, &anchor, n + 1, out_tokens, out_logits, &req, err, err_len);
    free(cand);
    free(q);
    return rc ? -1 : req.n_out;
}

int32_t dflash_drafter_draft_sample(dflash_drafter * d, int32_t anchor, int32_t n, float temperature,
                                    struct dflash_rng * rng, struct dflash_token_filter * filter,
                                    int32_t * out_tokens, int32_t * out_cand, float * out_q, int32_t * out_k,
                                    char * err, size_t err_len) {
    struct dflash_state * st = d->def;
    if (!(temperature > 0.0f)) {
        dflash_seterr(err, err_len, "sampled drafting needs a temperature > 0 (got %g)", (double) temperature);
        return -1;
    }
    if (!check_draft_args(st, anchor, n, err, err_len)) return -1;
    struct dflash_sample_req req = { temperature, rng, out_cand, out_q, 0, 0.0f, 0, filter };
    if (run_graph(d, &st, 1, &anchor, n + 1, out_tokens, NULL, &req, err, err_len) != 0) return -1;
    *out_k = req.k;
    return req.n_out;
}
