// The drafter forward as one ggml graph (docs/architecture.md §2, §3).
//
// The context cache holds per-layer K and V of committed positions only.
// A draft call first projects pending context features into the cache, then
// runs the block [anchor, mask x n] whose own K/V go to scratch cells right
// after the committed ones (overwritten by the next injection).
//
// One graph serves n_seq sequences (states) at once: each injects its pending
// features into its own cache; their blocks [anchor, mask x n] run together
// (projections, convolutions, MLP and head batched), attention per sequence
// against its own cache.  Blocks are laid out contiguously, B rows each.
#include "drafter.h"

#include "common.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// DFlash2 per-slot kernels of one sub-layer (docs/architecture.md §3.1): kern[:, side*K + t, i] =
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

// The same convolution as one CPU node (conv_kernels + dyn_conv are ~10 nodes a side, and ggml's
// repeat and pad run element by element when they broadcast along rows): a = x [H, N], b = dyn
// [2*K*G, N], c = base [H, K, 2], ud = {side, B}.  The float operations and their order are
// dyn_conv's -- (dyn + base) * x per tap, the taps summed from t = 0, a shifted-out row read as 0
// -- so the result is bit-identical (this file is compiled without FMA contraction).
static void conv_fused_cpu(struct ggml_tensor * dst, const struct ggml_tensor * a, const struct ggml_tensor * b,
                       const struct ggml_tensor * c, int ith, int nth, void * ud) {
    const int32_t side = ((const int32_t *) ud)[0], B = ((const int32_t *) ud)[1];
    const int64_t H = a->ne[0], N = a->ne[1], K = c->ne[1], G = b->ne[0] / (2 * K), g = H / G;
    for (int64_t i = ith; i < N; i += nth) {
        const int64_t p = i % B;
        const float * x = (const float *) ((const char *) a->data + i * a->nb[1]);
        const float * dy = (const float *) ((const char *) b->data + i * b->nb[1]);
        float * o = (float *) ((char *) dst->data + i * dst->nb[1]);
        for (int64_t h = 0; h < H; h++) {
            float acc = 0.0f;
            for (int64_t t = 0; t < K && t < B; t++) {
                const int64_t j = side * K + t;
                const float kern = dy[j * G + h / g] + ((const float *) c->data)[j * H + h];
                const float xs = p >= t ? x[h - t * (a->nb[1] / (int64_t) sizeof(float))] : 0.0f;
                const float term = kern * xs;
                acc = t == 0 ? term : acc + term;
            }
            o[h] = acc;
        }
    }
}

// One side of a sub-layer's convolution: the fused CPU node when the drafter runs on the CPU alone
// (d->fused_conv),
// else conv_kernels + dyn_conv (*kern: the kernels, made once for both sides).
static struct ggml_tensor * conv_side(const struct dflash_drafter * d, struct ggml_context * ctx,
                                      struct dflash_graph * G, struct ggml_tensor * x, struct ggml_tensor * dyn,
                                      struct ggml_tensor * base, struct ggml_tensor ** kern, int side, int64_t B) {
    if (d->fused_conv) {
        if (!ggml_is_contiguous(x)) x = ggml_cont(ctx, x);
        G->conv_ud[side][0] = side;
        G->conv_ud[side][1] = (int32_t) B;
        return ggml_map_custom3(ctx, x, dyn, base, conv_fused_cpu, 1, G->conv_ud[side]);
    }
    if (!*kern) *kern = conv_kernels(d, ctx, dyn, base);
    return dyn_conv(d, ctx, x, *kern, side, B);
}

static struct ggml_tensor * rms(struct ggml_context * ctx, struct ggml_tensor * x, struct ggml_tensor * w, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), w);
}

// NeoX RoPE over the first rope_dims dimensions of each head (partial rotary: the rest pass), with
// the file's linear / YaRN scaling and per-dimension frequency factors (rope_freqs: llama3 scaling, or
// HF YaRN variants ggml's own ramp does not express).  yarn_attn_factor scales cos / sin in every mode.
static struct ggml_tensor * rope(const struct dflash_drafter * d, struct ggml_context * ctx, struct ggml_tensor * x,
                                 struct ggml_tensor * pos) {
    const struct dflash_drafter_info * hp = &d->hp;
    const bool scaled = hp->rope_scaling != DFLASH_ROPE_NONE, yarn = hp->rope_scaling == DFLASH_ROPE_YARN;
    return ggml_rope_ext(ctx, x, pos, d->w.rope_freqs, hp->rope_dims, GGML_ROPE_TYPE_NEOX, hp->rope_orig_ctx,
                         hp->rope_theta, scaled ? 1.0f / hp->rope_factor : 1.0f, yarn ? hp->yarn_ext_factor : 0.0f,
                         hp->yarn_attn_factor, hp->yarn_beta_fast, hp->yarn_beta_slow);
}

// x W (+ b, where the file has the bias: gpt-oss drafters' attention_bias)
static struct ggml_tensor * linear(struct ggml_context * ctx, struct ggml_tensor * w, struct ggml_tensor * b,
                                   struct ggml_tensor * x) {
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, x);
    return b ? ggml_add(ctx, y, b) : y;
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

    struct ggml_tensor * k = linear(ctx, L->wk, L->bk, x);
    k = ggml_reshape_3d(ctx, k, hp->head_dim, hp->n_head_kv, n);
    k = rms(ctx, k, L->k_norm, hp->rms_eps);
    k = rope(d, ctx, k, pos);
    struct ggml_tensor * v = linear(ctx, L->wv, L->bv, x); // [n_kv_embd, n]

    struct ggml_tensor * k_dst = ggml_view_2d(ctx, kc, n_kv_embd, n, kc->nb[1], (size_t) off * kc->nb[1]);
    struct ggml_tensor * v_dst = ggml_view_2d(ctx, vc, n, n_kv_embd, vc->nb[1], (size_t) off * ggml_element_size(vc));
    ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_reshape_2d(ctx, k, n_kv_embd, n), k_dst));
    ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, v), v_dst));
}

// Draft-vocabulary row ids [K, N] -> target token ids (the identity without a d2t map).
static struct ggml_tensor * to_target_ids(const struct dflash_drafter * d, struct ggml_context * ctx,
                                          struct ggml_tensor * ids) {
    if (!d->w.d2t) return ids;
    struct ggml_tensor * flat = ggml_reshape_1d(ctx, ids, ggml_nelements(ids));
    struct ggml_tensor * t = ggml_get_rows(ctx, ggml_reshape_2d(ctx, d->w.d2t, 1, d->hp.n_vocab_draft), flat);
    return ggml_reshape_2d(ctx, t, ids->ne[0], ids->ne[1]);
}

// DFlash2 selector (docs/architecture.md §3.2), all on the backend: top-K candidates per slot and the
// lattice scores[k][a][b] = U_k(c_kb) + <A[c_{k-1,a}] * gate_k, S[c_kb]>, slot 0's predecessor
// being its block's anchor.  z: [H, n * S], logits: [V, n * S].  Only ids and K x K scores per
// slot go back to the host.
static void build_selector(const struct dflash_drafter * d, struct dflash_graph * G, struct ggml_context * ctx,
                           struct ggml_tensor * z, struct ggml_tensor * logits, int64_t n, int64_t S, bool want_probs) {
    const struct dflash_drafter_info * hp = &d->hp;
    const int64_t K = hp->selector_top_k, R = hp->selector_rank, V = logits->ne[0], N = n * S;
    struct ggml_tensor * cand_d = ggml_top_k(ctx, logits, (int) K);                                // [K, N]
    struct ggml_tensor * unary = ggml_get_rows(ctx, ggml_reshape_3d(ctx, logits, 1, V, N), cand_d); // [1, K, N]
    struct ggml_tensor * cand = to_target_ids(d, ctx, cand_d);
    struct ggml_tensor * gate = ggml_mul_mat(ctx, d->w.sel_hidden, z);                                // [R, N]
    struct ggml_tensor * flat = ggml_reshape_1d(ctx, cand, K * N);
    struct ggml_tensor * succ = ggml_reshape_4d(ctx, ggml_get_rows(ctx, d->w.sel_succ, flat), R, K, n, S);
    G->anchor = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, S);
    ggml_set_input(G->anchor);
    struct ggml_tensor * prev = ggml_reshape_4d(ctx, ggml_get_rows(ctx, d->w.sel_pred, G->anchor), R, 1, 1, S);
    prev = ggml_repeat_4d(ctx, prev, R, K, 1, S);
    if (n > 1) {
        struct ggml_tensor * pred = ggml_reshape_4d(ctx, ggml_get_rows(ctx, d->w.sel_pred, flat), R, K, n, S);
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
    if (want_probs) {
        // the lattice's softmax sees only its K candidates: the mass beyond them (a flat unary
        // distribution) says how sure the slot really is
        struct ggml_tensor * p = ggml_soft_max(ctx, logits);
        G->cand_p = ggml_get_rows(ctx, ggml_reshape_3d(ctx, p, 1, V, N), cand_d); // [1, K, N]
        ggml_set_output(G->cand_p);
        ggml_build_forward_expand(G->gf, G->cand_p);
    }
}

// Inject every state's pending rows; then, if n_block > 0, run one block per state at
// positions [a_s, a_s + n_block) with a_s = its committed length.
bool dflash_build_graph(struct dflash_drafter * d, struct dflash_graph * G, struct dflash_state ** sts,
                        int32_t n_seq, int32_t n_block, bool want_logits, bool want_topk, bool want_probs) {
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
        struct ggml_tensor * c = rms(ctx, ggml_mul_mat(ctx, d->w.fc, G->feat[s]), d->w.hidden_norm, hp->rms_eps);
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
    // Masks only for the layer kinds (causal or not, window or not) that exist: an input no node
    // reads is never allocated, and setting it would abort.
    bool kinds[DFLASH_MASK_KINDS] = { false };
    for (int il = 0; il < hp->n_layer; il++) kinds[dflash_mask_kind(hp, il)] = true;
    for (int32_t s = 0; s < n_seq; s++) {
        // (used <= n_ctx: the draft calls check it; the cache's cells are n_ctx rounded up to DFLASH_KV_PAD)
        const int32_t used = sts[s]->n_cached + sts[s]->n_pending + n_block;
        const int32_t cells = (int32_t) sts[s]->k_cache[0]->ne[1];
        const int32_t padded = (used + DFLASH_KV_PAD - 1) / DFLASH_KV_PAD * DFLASH_KV_PAD;
        G->n_kv_used[s] = used;
        G->n_kv[s] = padded < cells ? padded : cells;
        // (the cells past the used ones hold zeros or stale rows: masked, they weigh nothing -- but for a
        // NaN once written there, which would spoil drafts, never the verified output)
        for (int k = 0; k < DFLASH_MASK_KINDS; k++) {
            // (the non-causal full-attention kind needs no mask when no padding cell is read)
            if (!kinds[k] || (k == 0 && G->n_kv[s] == used)) continue;
            G->mask[k][s] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, G->n_kv[s], B);
            ggml_set_input(G->mask[k][s]);
        }
    }

    struct ggml_tensor * h = ggml_get_rows(ctx, d->w.tok_embd, G->tokens);
    if (hp->embedding_scale != 1.0f) h = ggml_scale(ctx, h, hp->embedding_scale);
    const float kq_scale = 1.0f / sqrtf((float) hp->head_dim);

    for (int il = 0; il < hp->n_layer; il++) {
        const struct dflash_layer * L = &d->layers[il];
        const bool v2 = hp->version == 2;
        const int kind = dflash_mask_kind(hp, il);
        struct ggml_tensor * u = rms(ctx, h, L->attn_norm, hp->rms_eps);
        struct ggml_tensor * kern_a = NULL, * dyn_a = NULL;
        if (v2) {
            dyn_a = ggml_mul_mat(ctx, L->attn_conv_proj, u);
            u = conv_side(d, ctx, G, u, dyn_a, L->attn_conv_base, &kern_a, 0, B);
        }
        if (!ggml_is_contiguous(u)) u = ggml_cont(ctx, u); // per-sequence column views below

        struct ggml_tensor * q = linear(ctx, L->wq, L->bq, u);
        q = ggml_reshape_3d(ctx, q, hp->head_dim, hp->n_head, N);
        q = rms(ctx, q, L->q_norm, hp->rms_eps);
        q = rope(d, ctx, q, G->block_pos);

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
            // contiguous per head: the CPU then multiplies each head's block by its keys as one tiled
            // GEMM (llamafile's sgemm) instead of B x n_kv separate 64-wide dot products
            struct ggml_tensor * Q = ggml_cont(ctx, ggml_permute(ctx, q_s, 0, 2, 1, 3)); // [d, B, H]
            struct ggml_tensor * kq = ggml_mul_mat(ctx, K, Q);                       // [n_kv, B, H]
            kq = ggml_soft_max_ext(ctx, kq, G->mask[kind][s], kq_scale, 0.0f);
            struct ggml_tensor * V = ggml_view_3d(ctx, st->v_cache[il], n_kv, hp->head_dim, hp->n_head_kv,
                                                  st->v_cache[il]->nb[1], st->v_cache[il]->nb[1] * hp->head_dim, 0);
            struct ggml_tensor * o_s = ggml_mul_mat(ctx, V, kq);                     // [d, B, H]
            o_s = ggml_cont(ctx, ggml_permute(ctx, o_s, 0, 2, 1, 3));               // [d, H, B]
            o = o ? ggml_concat(ctx, o, o_s, 2) : o_s;
        }
        o = ggml_reshape_2d(ctx, o, (int64_t) hp->head_dim * hp->n_head, N);
        o = ggml_mul_mat(ctx, L->wo, o);
        // value scale: on the attention's output, as upstream applies it (= scaling V, before o's bias)
        if (hp->value_scale != 1.0f) o = ggml_scale(ctx, o, hp->value_scale);
        if (L->bo) o = ggml_add(ctx, o, L->bo);
        if (v2) o = conv_side(d, ctx, G, o, dyn_a, L->attn_conv_base, &kern_a, 1, B);
        h = ggml_add(ctx, h, o);

        struct ggml_tensor * v = rms(ctx, h, L->ffn_norm, hp->rms_eps);
        struct ggml_tensor * kern_m = NULL, * dyn_m = NULL;
        if (v2) {
            dyn_m = ggml_mul_mat(ctx, L->ffn_conv_proj, v);
            v = conv_side(d, ctx, G, v, dyn_m, L->ffn_conv_base, &kern_m, 0, B);
        }
        struct ggml_tensor * g = ggml_silu(ctx, ggml_mul_mat(ctx, L->ffn_gate, v));
        struct ggml_tensor * m = ggml_mul(ctx, g, ggml_mul_mat(ctx, L->ffn_up, v));
        m = ggml_mul_mat(ctx, L->ffn_down, m);
        if (v2) m = conv_side(d, ctx, G, m, dyn_m, L->ffn_conv_base, &kern_m, 1, B);
        h = ggml_add(ctx, h, m);
    }

    // Slot 0 (the anchor) of every block predicts nothing (unless sample_from_anchor): drop it before the head.
    const int64_t skip = hp->sample_from_anchor ? 0 : 1, n = B - skip;
    struct ggml_tensor * z = ggml_view_3d(ctx, h, hp->n_embd, n, n_seq, h->nb[1], h->nb[1] * B, h->nb[1] * skip);
    z = ggml_reshape_2d(ctx, ggml_cont(ctx, z), hp->n_embd, n * n_seq);
    z = rms(ctx, z, d->w.out_norm, hp->rms_eps);
    // The head's product runs on 4-row tiles: 5-7 rows cost more than 8 (a 49152-token head at n = 7: 1.5x),
    // so above 4 rows it takes zero rows up to a multiple of 4 and the logits are the first rows.
    const int64_t R = n * n_seq, R_pad = (R + 3) / 4 * 4;
    struct ggml_tensor * logits = R > 4 && R_pad > R ? ggml_pad(ctx, z, 0, (int) (R_pad - R), 0, 0) : z;
    logits = ggml_mul_mat(ctx, d->w.head, logits); // [n_vocab_draft, R_pad]
    if (logits->ne[1] > R) logits = ggml_view_2d(ctx, logits, logits->ne[0], R, logits->nb[1], 0);
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
        build_selector(d, G, ctx, z, logits, n, n_seq, want_probs);
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

void dflash_fill_mask(float * m, int32_t n_kv, int32_t n_used, int32_t n_block, int32_t a, bool causal,
                      int32_t window) {
    for (int32_t i = 0; i < n_block; i++) {
        const int32_t qp = a + i;
        for (int32_t j = 0; j < n_kv; j++) {
            bool vis = j < n_used;
            if (causal && j > qp) vis = false;
            if (window > 0 && (qp - j >= window || j - qp >= window)) vis = false;
            m[(size_t) i * n_kv + j] = vis ? 0.0f : -INFINITY;
        }
    }
}
