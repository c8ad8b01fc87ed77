/*
 * A ggml backend of our own for the target's small matrix products and their attention
 * (docs/architecture.md §13).
 *
 * Registered through ggml's public registry as an ACCEL device, it sits ahead of the CPU backend in
 * every llama_context created afterwards.  Its buffer type is the CPU's own, so llama.cpp places no
 * weight differently (make_cpu_buft_list skips it) and prefill runs exactly as before; the scheduler
 * hands it a MUL_MAT, or a MUL_MAT_ID (a MoE layer's experts), whose weight lives in a host buffer in
 * ggml's standard layout (or ggml-cpu's repacked one), of a type qmm.h decodes, with 1..DFK_MAX_ROWS
 * activation rows (tokens, for MUL_MAT_ID), and, in the contexts llama-dflash drives, a FLASH_ATTN_EXT
 * of f16 K/V with as many query rows (attn.h).  Everything else stays with ggml-cpu.  A backend
 * switched to every row count (dflash_kernels_backend_set: exact mode's contexts) takes those ops
 * whatever their rows.
 * Threads are OpenMP's, the same pool ggml-cpu uses, so nothing spins beside it.
 */
#include "attn.h"
#include "dflash.h"
#include "ggml_abi.h"
#include "kernels.h"
#include "llama_ext.h"
#include "qmm.h"

#include "ggml-alloc.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "gguf.h"

#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef DFLASH_GGML_VERSION
#define DFLASH_GGML_VERSION "0.25.3"
#endif

static const struct dfk_isa * g_isa;
static atomic_bool g_enabled = true;
static atomic_llong g_products, g_rows, g_by_rows[DFK_MAX_ROWS + 1], g_products_id, g_attn, g_attn_rows, g_rowwise,
    g_ggml_ops;
static char g_status[160] = "not registered";

/* a product of fewer weight values stays on one thread: too small to be worth waking another */
#define DFK_SPLIT_MIN 65536

struct kctx {
    int n_threads;
    void * act;
    size_t act_size;
    /* MUL_MAT_ID only: the source rows quantized once, the experts' results before their scatter,
     * and the rows' order by expert */
    void * src, * y, * idx;
    size_t src_size, y_size, idx_size;
    float * attn;  /* attention: every thread's scratch */
    size_t attn_size;
    bool takes_attn, all_rows;  /* which device it answers as (dflash_kernels_backend_set) */
    /* the ggml-cpu ops run inside this backend's splits (is_cpu_op): a ggml-cpu backend of its own
     * and a graph to hand them to it */
    ggml_backend_t cpu;
    struct ggml_context * gctx;
    struct ggml_cgraph * graph;
};

static enum dfk_wtype wtype_of(enum ggml_type t, bool * ok) {
    *ok = true;
    switch (t) {
    case GGML_TYPE_Q4_0: return DFK_Q4_0;
    case GGML_TYPE_Q8_0: return DFK_Q8_0;
    case GGML_TYPE_Q4_K: return DFK_Q4_K;
    case GGML_TYPE_Q5_K: return DFK_Q5_K;
    case GGML_TYPE_Q6_K: return DFK_Q6_K;
    case GGML_TYPE_Q5_0: return DFK_Q5_0;
    case GGML_TYPE_Q4_1: return DFK_Q4_1;
    default: *ok = false; return DFK_Q4_0;
    }
}

static int64_t act_rows(const struct ggml_tensor * x) { return x->ne[1] * x->ne[2] * x->ne[3]; }

/* ggml-cpu's repacked weights (x86: Q4_0 and Q4_K in groups of 8 rows, qmm_common.h) */
static bool is_repack_buft(ggml_backend_buffer_type_t buft) { return strcmp(ggml_backend_buft_name(buft), "CPU_REPACK") == 0; }

/* The weight's layout as the kernels name it; false: one they do not read. */
static bool weight_type(const struct ggml_tensor * w, enum dfk_wtype * t) {
    bool ok;
    *t = wtype_of(w->type, &ok);
    if (!ok || !w->buffer || ggml_backend_buffer_get_size(w->buffer) == 0 || w->view_src) return false;
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(w->buffer);
    if (ggml_backend_buft_is_host(buft)) return true;
    /* repacked only where the pinned ggml-cpu repacks these types with 8-row groups: every row
     * count a multiple of 8 and the repack traits set (tensor->extra) */
    if (!is_repack_buft(buft) || !w->extra || w->ne[1] % 8 != 0) return false;
    if (*t == DFK_Q4_0) { *t = DFK_Q4_0_X8; return true; }
    if (*t == DFK_Q4_K) { *t = DFK_Q4_K_X8; return true; }
    return false;
}

/* MUL_MAT_ID (ggml_mul_mat_id): w [k, ncol, n_expert], x [k, ne11, n_tok], ids I32 [n_used, n_tok],
 * dst [ncol, n_used, n_tok] with dst[:, e, t] = W_ids[e,t] . x[:, e % ne11, t].  Rows of x, ids and
 * dst are read through their strides; the experts' matrices must follow each other (repacked ones
 * do: ggml-cpu repacks a 3D tensor's rows in groups of 8, and every expert has a multiple of 8). */
static bool takes_id(const struct ggml_tensor * op, const struct ggml_tensor * w, bool all) {
    const struct ggml_tensor * x = op->src[1], * ids = op->src[2];
    if (!ids || ids->type != GGML_TYPE_I32 || w->ne[3] != 1 || w->nb[2] != w->nb[1] * w->ne[1]) return false;
    const int64_t n_tok = x->ne[2];
    if (n_tok < 1 || (n_tok > DFK_MAX_ROWS && !all)) return false;
    if (x->ne[3] != 1 || x->ne[1] < 1 || ids->ne[1] != n_tok || ids->ne[0] % x->ne[1] != 0 || ids->ne[2] != 1 ||
        ids->ne[3] != 1) return false;
    return op->ne[0] == w->ne[1] && op->ne[1] == ids->ne[0] && op->ne[2] == n_tok && op->ne[3] == 1 &&
           op->nb[0] == sizeof(float);
}

/* A MoE layer's router (ffn_gate_inp, ffn_gate_inp_shexp): converters keep it f32, and ggml-cpu's f32
 * products take another path for 2 rows than for 1, so a MoE target's
 * verify batches differed from its one-token decodes there and nowhere else (tiny qwen3moe / gpt-oss
 * targets: 2.9e-06, the same targets with a Q8_0 router: bit-identical).  Only the router is taken:
 * it is a few dozen rows, where a plain dot is as fast as ggml's; the f32 matrices of the tests'
 * dense targets stay with ggml (and exact mode keeps refusing them). */
static bool router_named(enum ggml_type type, const char * name) {
    return type == GGML_TYPE_F32 && strstr(name, "ffn_gate_inp") != NULL;
}

static bool is_router(const struct ggml_tensor * w) {
    return router_named(w->type, w->name) && w->buffer &&
           ggml_backend_buffer_get_size(w->buffer) != 0 && !w->view_src &&
           ggml_backend_buft_is_host(ggml_backend_buffer_get_type(w->buffer));
}

/* The attention this backend takes (attn.h): f32 queries, f16 K and V of one head size, an f16 mask,
 * f32 sinks, no ALiBi; rows as for the products. */
static bool takes_attn(const struct ggml_tensor * op, bool all) {
    const struct ggml_tensor * q = op->src[0], * k = op->src[1], * v = op->src[2], * m = op->src[3], * sk = op->src[4];
    float max_bias;
    memcpy(&max_bias, (const float *) op->op_params + 1, sizeof(float));
    if (q->type != GGML_TYPE_F32 || k->type != GGML_TYPE_F16 || v->type != GGML_TYPE_F16 || op->type != GGML_TYPE_F32)
        return false;
    if (max_bias != 0.0f || q->nb[0] != sizeof(float) || k->nb[0] != 2 || v->nb[0] != 2 || !ggml_is_contiguous(op))
        return false;
    const int64_t d = q->ne[0];
    if (!dfk_attn_heads_ok(d, q->ne[2], k->ne[2]) || k->ne[0] != d || v->ne[0] != d || op->ne[0] != d) return false;
    if (k->ne[1] != v->ne[1] || k->ne[2] != v->ne[2] || k->ne[3] != v->ne[3] || k->ne[1] < 1) return false;
    if (k->ne[3] < 1 || q->ne[3] % k->ne[3] != 0) return false;
    if (op->ne[1] != q->ne[2] || op->ne[2] != q->ne[1] || op->ne[3] != q->ne[3]) return false;
    if (m && (m->type != GGML_TYPE_F16 || m->nb[0] != 2 || m->ne[0] != k->ne[1] || m->ne[1] < q->ne[1])) return false;
    if (sk && (sk->type != GGML_TYPE_F32 || sk->ne[0] != q->ne[2] || !ggml_is_contiguous(sk))) return false;
    const int64_t n = q->ne[1] * q->ne[3];
    return n >= 1 && (n <= DFK_MAX_ROWS || all);
}

/* The row-wise ops between the products (a layer's norms, norm weights, residual adds) in the
 * contexts llama-dflash drives: computed on the calling thread (a few rows), they keep the products
 * around them in one split instead of a split of ggml-cpu's between each.  Each value as ggml-cpu
 * computes it (SwiGLU's is not: ggml's vector exp is its own), so a context rounds as before. */
static bool is_rowwise(enum ggml_op op) { return op == GGML_OP_RMS_NORM || op == GGML_OP_MUL || op == GGML_OP_ADD; }

static bool f32_rows(const struct ggml_tensor * t) { return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t); }

/* a row-wise op's tokens: its outermost dimension (a q-norm's rows are heads x tokens) */
static int64_t n_tokens(const struct ggml_tensor * t) {
    const int dims = ggml_n_dims(t);
    return dims >= 2 ? t->ne[dims - 1] : 1;
}

static bool takes_rowwise(const struct ggml_tensor * op, bool all) {
    const struct ggml_tensor * a = op->src[0], * b = op->src[1];
    if (!f32_rows(op) || !a || !f32_rows(a) || !ggml_are_same_shape(a, op)) return false;
    if (n_tokens(op) > DFK_MAX_ROWS && !all) return false;
    switch (op->op) {
        case GGML_OP_RMS_NORM: return true;
        case GGML_OP_MUL:
        case GGML_OP_ADD:  /* the same shape, or one row for every row (a norm's weight, a bias) */
            return b && f32_rows(b) && (ggml_are_same_shape(a, b) || (b->ne[0] == a->ne[0] && ggml_nrows(b) == 1));
        default: return false;
    }
}

static void rowwise(const struct ggml_tensor * op) {
    const struct ggml_tensor * a = op->src[0], * b = op->src[1];
    const int64_t n = a->ne[0], rows = ggml_nrows(op);
    for (int64_t r = 0; r < rows; r++) {
        const float * x = (const float *) a->data + r * n;
        float * y = (float *) op->data + r * n;
        const float * z = b ? (const float *) b->data + (ggml_nrows(b) == 1 ? 0 : r * n) : NULL;
        switch (op->op) {
            case GGML_OP_RMS_NORM: {  /* as ggml-cpu: squares summed in double in order, one float scale */
                float eps;
                memcpy(&eps, op->op_params, sizeof(float));
                double sum = 0.0;
                for (int64_t i = 0; i < n; i++) sum += (double) (x[i] * x[i]);
                const float mean = (float) (sum / (double) n);
                const float scale = 1.0f / sqrtf(mean + eps);
                for (int64_t i = 0; i < n; i++) y[i] = x[i] * scale;
            } break;
            case GGML_OP_MUL: for (int64_t i = 0; i < n; i++) y[i] = x[i] * z[i]; break;
            case GGML_OP_ADD: for (int64_t i = 0; i < n; i++) y[i] = x[i] + z[i]; break;
            default: break;
        }
    }
}

/* The other ops of a layer between the products and the attention (RoPE, the KV cache writes, the
 * gated activation): no kernels of ours, but run inside this backend's split by ggml-cpu's own code
 * (cpu_run), single-threaded for a few rows, so their values are what ggml-cpu's split would give
 * (these ops compute each row alone, whatever the threads) and a layer is one split instead of three:
 * each split is a graph_compute of ggml-cpu's with an OpenMP team of its own. */
static bool is_cpu_op(enum ggml_op op) { return op == GGML_OP_ROPE || op == GGML_OP_SET_ROWS || op == GGML_OP_GLU; }

/* the rows an op computes (a KV write: the rows written, not the cache it writes into) */
static const struct ggml_tensor * computed(const struct ggml_tensor * op) {
    return op->op == GGML_OP_SET_ROWS ? op->src[1] : op;
}

static bool takes_cpu_op(const struct ggml_tensor * op) {
    if (!computed(op) || n_tokens(computed(op)) > DFK_MAX_ROWS) return false;
    static ggml_backend_dev_t cpu;
    if (!cpu) cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    return cpu && ggml_backend_dev_supports_op(cpu, op);
}

/* The ops this backend takes; the scheduler asks with the weight's buffer set.  all: at any row count. */
static bool takes(const struct ggml_tensor * op, bool all) {
    if (!g_isa || !atomic_load(&g_enabled)) return false;
    if (op->op == GGML_OP_FLASH_ATTN_EXT) return takes_attn(op, all);
    if (is_rowwise(op->op)) return takes_rowwise(op, all);
    if (is_cpu_op(op->op)) return takes_cpu_op(op);
    if (op->op != GGML_OP_MUL_MAT && op->op != GGML_OP_MUL_MAT_ID) return false;
    const struct ggml_tensor * w = op->src[0], * x = op->src[1];
    if (x->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32) return false;
    if (x->ne[0] != w->ne[0] || x->nb[0] != sizeof(float)) return false;
    if (is_router(w)) {
        if (op->op != GGML_OP_MUL_MAT || w->nb[0] != sizeof(float) || w->nb[1] != sizeof(float) * (size_t) w->ne[0])
            return false;
    } else {
        enum dfk_wtype t;
        if (!weight_type(w, &t)) return false;
        if (w->ne[0] % dfk_block_values(t) != 0 || !g_isa->takes(t, w->ne[0])) return false;
        if (w->nb[0] != ggml_type_size(w->type) || w->nb[1] != ggml_row_size(w->type, w->ne[0])) return false;
        if (op->op == GGML_OP_MUL_MAT_ID) return takes_id(op, w, all);
    }
    if (w->ne[2] != 1 || w->ne[3] != 1) return false;
    const int64_t n = act_rows(x);
    if (n < 1 || (n > DFK_MAX_ROWS && !all)) return false;
    /* activation rows evenly strided, f32 values contiguous; the output likewise */
    if (x->nb[2] != x->nb[1] * x->ne[1] || x->nb[3] != x->nb[2] * x->ne[2]) return false;
    if (op->ne[0] != w->ne[1] || op->nb[0] != sizeof(float) || op->nb[2] != op->nb[1] * op->ne[1] ||
        op->nb[3] != op->nb[2] * op->ne[2] || act_rows(op) != n) return false;
    return true;
}

static bool grow(void ** p, size_t * have, size_t need) {
    if (*have >= need) return true;
    free(*p);
    *p = aligned_alloc(64, (need + 63) & ~(size_t) 63);
    *have = *p ? need : 0;
    return *p != NULL;
}

/* n quantized activation rows in buf (dfk_act_size bytes, 64-byte aligned): xq [n][kp], then dxl and
 * xsl [n][kp / 4], then xzp and xbs [n][kp / 32] (kp is a multiple of 64: each array stays aligned) */
static struct dfk_act act_in(void * buf, int64_t k, int64_t kp, int n) {
    struct dfk_act a = { k, kp, n, (int8_t *) buf, NULL, NULL, NULL, NULL };
    a.dxl = (float *) (a.xq + (size_t) n * kp);
    a.xsl = a.dxl + (size_t) n * (kp / 4);
    a.xzp = (int64_t *) (a.xsl + (size_t) n * (kp / 4));
    a.xbs = (int16_t *) (a.xzp + (size_t) n * (kp / 32));
    return a;
}

/* rows [r0, r0 + n) of a */
static struct dfk_act act_rows_of(const struct dfk_act * a, int r0, int n) {
    const size_t q = (size_t) r0 * a->kp;
    struct dfk_act v = { a->k, a->kp, n, a->xq + q, a->dxl + q / 4, a->xsl + q / 4, a->xzp + q / 32, a->xbs + q / 32 };
    return v;
}

/* the columns [c0, c1) thread ith of nt computes */
static void col_range(int64_t ncol, int ith, int nt, int64_t * c0, int64_t * c1) {
    const int64_t per = ((ncol + nt - 1) / nt + 7) & ~(int64_t) 7;  /* whole repacked groups of 8 rows */
    *c0 = per * ith < ncol ? per * ith : ncol;
    *c1 = *c0 + per < ncol ? *c0 + per : ncol;
}

/* y = x . W^T for the n rows of x, the columns split over threads. */
static void run(const struct dfk_isa * isa, enum dfk_wtype t, const void * w, size_t w_row, int64_t k, int64_t ncol,
                const float * x, size_t x_stride, int n, float * y, size_t y_stride, int nth, void * act) {
    const struct dfk_act a = act_in(act, k, (k + DFK_CHUNK - 1) / DFK_CHUNK * DFK_CHUNK, n);
    /* a few rows: quantized by the calling thread, so the team meets only once, at the end */
    isa->quantize(t, x, x_stride, &a, 0, n);
    #pragma omp parallel num_threads(nth) if (nth > 1)
    {
        int64_t c0, c1;
        col_range(ncol, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);
        if (c1 > c0) isa->mul(t, w, w_row, c0, c1, &a, y, y_stride);
    }
}

static int64_t padded(int64_t k) { return (k + DFK_CHUNK - 1) / DFK_CHUNK * DFK_CHUNK; }

static void count(int64_t products, int64_t n) {
    atomic_fetch_add(&g_products, products);
    atomic_fetch_add(&g_rows, n);
    atomic_fetch_add(&g_by_rows[n < DFK_MAX_ROWS ? n : DFK_MAX_ROWS], 1);
}

/* w . x in one fixed order whatever the other rows (eight running sums, then a fixed tree): a row's
 * result is the same in a batch as alone.  Plain C, no FMA (this file is built without it), no
 * threads: the routers it serves are a few dozen rows of a few thousand values. */
static float dot_f32(const float * w, const float * x, int64_t k) {
    float s[8] = { 0 };
    int64_t i = 0;
    for (; i + 8 <= k; i += 8)
        for (int j = 0; j < 8; j++) s[j] += w[i + j] * x[i + j];
    float tail = 0.0f;
    for (; i < k; i++) tail += w[i] * x[i];
    return (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))) + tail;
}

static void mul_f32(const float * w, size_t w_row, int64_t k, int64_t ncol, const float * x, size_t x_stride, int n,
                    float * y, size_t y_stride) {
    for (int r = 0; r < n; r++) {
        const float * xr = (const float *) ((const char *) x + (size_t) r * x_stride);
        float * yr = (float *) ((char *) y + (size_t) r * y_stride);
        for (int64_t c = 0; c < ncol; c++) yr[c] = dot_f32((const float *) ((const char *) w + (size_t) c * w_row), xr, k);
    }
}

/* a MoE router's f32 product (is_router); the quantized products go through mul_mat_run */
static enum ggml_status mul_router(struct ggml_tensor * op) {
    const struct ggml_tensor * w = op->src[0], * x = op->src[1];
    mul_f32((const float *) w->data, w->nb[1], w->ne[0], w->ne[1], (const float *) x->data, x->nb[1],
            (int) act_rows(x), (float *) op->data, op->nb[1]);
    count(1, act_rows(x));
    return GGML_STATUS_SUCCESS;
}

/* MUL_MAT_ID (takes_id): every source row quantized once, its copies grouped by expert, each used
 * expert's rows against its matrix as one product, the results scattered to dst.  A row's operations
 * are a one-row product's whatever the tokens and experts beside it: batch-invariant as run() is. */
static enum ggml_status mul_mat_id(struct kctx * c, struct ggml_tensor * op) {
    const struct ggml_tensor * w = op->src[0], * x = op->src[1], * ids = op->src[2];
    enum dfk_wtype t;
    if (!weight_type(w, &t)) return GGML_STATUS_FAILED;
    const int64_t k = w->ne[0], kp = padded(k), ncol = w->ne[1], n_exp = w->ne[2];
    const int n_used = (int) ids->ne[0], n_tok = (int) ids->ne[1], ne11 = (int) x->ne[1];
    const int n_src = ne11 * n_tok, n = n_used * n_tok;
    /* idx: start[n_exp + 1] (an expert's first row in the grouped order), at[n_exp], then the grouped
     * rows' slot e + n_used * t */
    if (!grow(&c->idx, &c->idx_size, sizeof(int32_t) * (size_t) (2 * n_exp + 1 + n)) ||
        !grow(&c->src, &c->src_size, dfk_act_size(kp, n_src)) || !grow(&c->act, &c->act_size, dfk_act_size(kp, n)) ||
        !grow(&c->y, &c->y_size, sizeof(float) * (size_t) n * (size_t) ncol)) return GGML_STATUS_ALLOC_FAILED;
    int32_t * start = (int32_t *) c->idx, * at = start + n_exp + 1, * slot = at + n_exp;
    memset(start, 0, sizeof(int32_t) * (size_t) (n_exp + 1));
    for (int tk = 0; tk < n_tok; tk++)
        for (int e = 0; e < n_used; e++) {
            const int32_t id = *(const int32_t *) ((const char *) ids->data + tk * ids->nb[1] + e * ids->nb[0]);
            if (id < 0 || id >= n_exp) return GGML_STATUS_FAILED;
            start[id + 1]++;
        }
    int n_active = 0;
    for (int64_t i = 0; i < n_exp; i++) {
        n_active += start[i + 1] > 0;
        start[i + 1] += start[i];
        at[i] = start[i];
    }
    for (int tk = 0; tk < n_tok; tk++)
        for (int e = 0; e < n_used; e++) {
            const int32_t id = *(const int32_t *) ((const char *) ids->data + tk * ids->nb[1] + e * ids->nb[0]);
            slot[at[id]++] = e + n_used * tk;
        }
    /* quantized by the calling thread, as in run(): a token's ne11 rows at a time through their strides */
    const struct dfk_act src = act_in(c->src, k, kp, n_src), g = act_in(c->act, k, kp, n);
    for (int tk = 0; tk < n_tok; tk++) {
        const struct dfk_act v = act_rows_of(&src, tk * ne11, ne11);
        g_isa->quantize(t, (const float *) ((const char *) x->data + tk * x->nb[2]), x->nb[1], &v, 0, ne11);
    }
    for (int r = 0; r < n; r++) {
        const int e = slot[r] % n_used, s = e % ne11 + ne11 * (slot[r] / n_used);
        memcpy(g.xq + (size_t) r * kp, src.xq + (size_t) s * kp, (size_t) kp);
        memcpy(g.dxl + (size_t) r * (kp / 4), src.dxl + (size_t) s * (kp / 4), sizeof(float) * (size_t) (kp / 4));
        memcpy(g.xsl + (size_t) r * (kp / 4), src.xsl + (size_t) s * (kp / 4), sizeof(float) * (size_t) (kp / 4));
        memcpy(g.xzp + (size_t) r * (kp / 32), src.xzp + (size_t) s * (kp / 32), sizeof(int64_t) * (size_t) (kp / 32));
        memcpy(g.xbs + (size_t) r * (kp / 32), src.xbs + (size_t) s * (kp / 32), sizeof(int16_t) * (size_t) (kp / 32));
    }
    int nth = c->n_threads > 0 ? c->n_threads : 1;
    if (ncol * k * n_active < DFK_SPLIT_MIN) nth = 1;
    float * y = (float *) c->y;
    /* one team for every expert: each thread its columns of each, scattered by the thread itself */
    #pragma omp parallel num_threads(nth) if (nth > 1)
    {
        int64_t c0, c1;
        col_range(ncol, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);
        for (int64_t i = 0; i < n_exp && c1 > c0; i++) {
            const int r0 = start[i], m = start[i + 1] - r0;
            if (m == 0) continue;
            const struct dfk_act a = act_rows_of(&g, r0, m);
            g_isa->mul(t, (const char *) w->data + i * w->nb[2], w->nb[1], c0, c1, &a, y + (size_t) r0 * ncol,
                       sizeof(float) * (size_t) ncol);
            for (int r = r0; r < r0 + m; r++) {
                char * d = (char *) op->data + (slot[r] % n_used) * op->nb[1] + (slot[r] / n_used) * op->nb[2];
                memcpy((float *) d + c0, y + (size_t) r * ncol + c0, sizeof(float) * (size_t) (c1 - c0));
            }
        }
    }
    count(1, n_tok);
    atomic_fetch_add(&g_products_id, 1);
    return GGML_STATUS_SUCCESS;
}

/* backend */

static const char * be_name(ggml_backend_t b) { return "DFLASH"; }

static void be_free(ggml_backend_t b) {
    struct kctx * c = (struct kctx *) b->context;
    if (c->cpu) ggml_backend_free(c->cpu);
    if (c->gctx) ggml_free(c->gctx);
    free(c->act);
    free(c->src);
    free(c->y);
    free(c->idx);
    free(c->attn);
    free(c);
    free(b);
}

static bool is_view(enum ggml_op op) {
    return op == GGML_OP_NONE || op == GGML_OP_RESHAPE || op == GGML_OP_VIEW || op == GGML_OP_PERMUTE ||
           op == GGML_OP_TRANSPOSE;
}

/* Whether t is, or views, one of the products in[0..n). */
static bool made_by(const struct ggml_tensor * t, struct ggml_tensor * const * in, int n) {
    for (; t; t = t->view_src)
        for (int i = 0; i < n; i++)
            if (t == in[i]) return true;
    return false;
}

/* A run of quantized MUL_MATs none of which reads another's result (a layer's Q, K and V; its gate
 * and up): each quantized by the calling thread, then one team computes every product's columns and
 * meets once, instead of once per product.  Each column's dot is the one-product path's. */
#define RUN_MAX 8
static enum ggml_status mul_mat_run(struct kctx * c, struct ggml_tensor * const * ops, int m) {
    size_t off[RUN_MAX], total = 0;
    enum dfk_wtype t[RUN_MAX];
    int nth = 1;
    for (int j = 0; j < m; j++) {
        const struct ggml_tensor * w = ops[j]->src[0];
        if (!weight_type(w, &t[j])) return GGML_STATUS_FAILED;
        off[j] = total;
        total += (dfk_act_size(padded(w->ne[0]), (int) act_rows(ops[j]->src[1])) + 63) & ~(size_t) 63;
        if (w->ne[1] * w->ne[0] >= DFK_SPLIT_MIN && c->n_threads > nth) nth = c->n_threads;
    }
    if (!grow(&c->act, &c->act_size, total)) return GGML_STATUS_ALLOC_FAILED;
    struct dfk_act a[RUN_MAX];
    for (int j = 0; j < m; j++) {
        const struct ggml_tensor * w = ops[j]->src[0], * x = ops[j]->src[1];
        const int n = (int) act_rows(x);
        a[j] = act_in((char *) c->act + off[j], w->ne[0], padded(w->ne[0]), n);
        g_isa->quantize(t[j], (const float *) x->data, x->nb[1], &a[j], 0, n);
        count(1, n);
    }
    #pragma omp parallel num_threads(nth) if (nth > 1)
    {
        for (int j = 0; j < m; j++) {
            const struct ggml_tensor * w = ops[j]->src[0];
            int64_t c0, c1;
            if (w->ne[1] * w->ne[0] < DFK_SPLIT_MIN) {  /* too small to split: the first thread's */
                c0 = 0;
                c1 = omp_get_thread_num() == 0 ? w->ne[1] : 0;
            } else {
                col_range(w->ne[1], omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);
            }
            if (c1 > c0) g_isa->mul(t[j], w->data, w->nb[1], c0, c1, &a[j], (float *) ops[j]->data, ops[j]->nb[1]);
        }
    }
    return GGML_STATUS_SUCCESS;
}

/* attention of fewer multiply-adds stays on one thread */
#define DFK_ATTN_SPLIT_MIN 65536

/* Run one attention (attn.h), the work items split evenly over the threads.  tile 0: up to n_threads
 * (one for small work), tiles halved from the most until each thread gets two items and a thread's
 * scores fit in 4 MB; else (tests) those tiles on exactly n_threads.  A row's result is the same
 * whichever tile size and thread compute it. */
static enum ggml_status attn_run(const struct dfk_isa * isa, struct dfk_attn * a, int n_threads, int tile,
                                 float ** scratch, size_t * have) {
    const int64_t macs = a->n_q * a->n_seq * a->n_head * a->n_kv * a->d;
    const int nth = n_threads > 1 && (tile > 0 || macs >= DFK_ATTN_SPLIT_MIN) ? n_threads : 1;
    a->tile = tile > 0 ? tile : DFK_ATTN_TILE;
    while (tile == 0 && a->tile > 1 && (dfk_attn_tiles(a) < 2 * nth || dfk_attn_scratch(a) > ((size_t) 1 << 20)))
        a->tile /= 2;
    const size_t per = (dfk_attn_scratch(a) + 15) & ~(size_t) 15;
    if (!grow((void **) scratch, have, per * nth * sizeof(float))) return GGML_STATUS_ALLOC_FAILED;
    const int64_t n = dfk_attn_tiles(a);
    float * base = *scratch;
    #pragma omp parallel num_threads(nth) if (nth > 1)
    {
        const int ith = omp_get_thread_num(), nt = omp_get_num_threads();
        isa->attn(a, n * ith / nt, n * (ith + 1) / nt, base + per * ith);
    }
    return GGML_STATUS_SUCCESS;
}

static struct dfk_attn attn_of(const struct ggml_tensor * op) {
    const struct ggml_tensor * q = op->src[0], * k = op->src[1], * v = op->src[2], * m = op->src[3], * sk = op->src[4];
    struct dfk_attn a;
    memset(&a, 0, sizeof(a));
    a.q = (const char *) q->data;
    a.k = (const char *) k->data;
    a.v = (const char *) v->data;
    a.mask = m ? (const char *) m->data : NULL;
    a.sinks = sk ? (const float *) sk->data : NULL;
    a.dst = (char *) op->data;
    for (int i = 0; i < 4; i++) {
        a.q_nb[i] = q->nb[i];
        a.k_nb[i] = k->nb[i];
        a.v_nb[i] = v->nb[i];
        a.m_nb[i] = m ? m->nb[i] : 0;
    }
    a.d_nb1 = op->nb[1];
    a.d = q->ne[0];
    a.n_q = q->ne[1];
    a.n_head = q->ne[2];
    a.n_seq = q->ne[3];
    a.n_kv = k->ne[1];
    a.n_head_kv = k->ne[2];
    a.n_seq_kv = k->ne[3];
    a.m_ne2 = m ? m->ne[2] : 1;
    a.m_ne3 = m ? m->ne[3] : 1;
    memcpy(&a.scale, (const float *) op->op_params + 0, sizeof(float));
    memcpy(&a.softcap, (const float *) op->op_params + 2, sizeof(float));
    return a;
}

#define CPU_RUN_MAX 64           /* ggml-cpu ops handed over at once at most */
#define CPU_RUN_THREADS (1 << 15) /* values from which they get the context's threads */

/* consecutive ggml-cpu ops (is_cpu_op), in graph order, by ggml-cpu */
static enum ggml_status cpu_run(struct kctx * c, struct ggml_tensor ** nodes, int n) {
    if (!c->cpu) {
        struct ggml_init_params ip = { ggml_graph_overhead_custom(CPU_RUN_MAX, false), NULL, true };
        c->cpu = ggml_backend_cpu_init();
        c->gctx = c->cpu ? ggml_init(ip) : NULL;
        c->graph = c->gctx ? ggml_new_graph_custom(c->gctx, CPU_RUN_MAX, false) : NULL;
        if (!c->graph) return GGML_STATUS_ALLOC_FAILED;
    }
    ggml_graph_clear(c->graph);
    int64_t work = 0;
    for (int i = 0; i < n; i++) {
        ggml_graph_add_node(c->graph, nodes[i]);
        work += ggml_nelements(computed(nodes[i]));
    }
    ggml_backend_cpu_set_n_threads(c->cpu, work >= CPU_RUN_THREADS ? c->n_threads : 1);
    atomic_fetch_add(&g_ggml_ops, n);
    return ggml_backend_graph_compute(c->cpu, c->graph);
}

static enum ggml_status be_compute(ggml_backend_t b, struct ggml_cgraph * g) {
    struct kctx * c = (struct kctx *) b->context;
    struct ggml_tensor * pending[RUN_MAX];  /* the run so far */
    struct ggml_tensor * cpu_ops[CPU_RUN_MAX];  /* ggml-cpu's ops so far */
    int m = 0, mc = 0;
    enum ggml_status st = GGML_STATUS_SUCCESS;
    for (int i = 0; i < ggml_graph_n_nodes(g) && st == GGML_STATUS_SUCCESS; i++) {
        struct ggml_tensor * node = ggml_graph_node(g, i);
        if (is_view(node->op)) continue;
        const bool attn = node->op == GGML_OP_FLASH_ATTN_EXT, row = is_rowwise(node->op), cop = is_cpu_op(node->op);
        if (node->op != GGML_OP_MUL_MAT && node->op != GGML_OP_MUL_MAT_ID && !attn && !row && !cop)
            return GGML_STATUS_FAILED;
        if (mc > 0 && (!cop || mc == CPU_RUN_MAX)) {
            st = cpu_run(c, cpu_ops, mc);
            mc = 0;
            if (st != GGML_STATUS_SUCCESS) break;
        }
        const bool runs = node->op == GGML_OP_MUL_MAT && !is_router(node->src[0]);
        if (m > 0 && (!runs || m == RUN_MAX || made_by(node->src[1], pending, m))) {  /* the run so far first */
            st = mul_mat_run(c, pending, m);
            m = 0;
        }
        if (st != GGML_STATUS_SUCCESS) break;
        if (cop) cpu_ops[mc++] = node;
        else if (runs) pending[m++] = node;
        else if (row) {
            rowwise(node);
            atomic_fetch_add(&g_rowwise, 1);
        }
        else if (attn) {
            struct dfk_attn a = attn_of(node);
            st = attn_run(g_isa, &a, c->n_threads, 0, &c->attn, &c->attn_size);
            atomic_fetch_add(&g_attn, 1);
            atomic_fetch_add(&g_attn_rows, a.n_q * a.n_seq);
        } else st = node->op == GGML_OP_MUL_MAT ? mul_router(node) : mul_mat_id(c, node);
    }
    if (st == GGML_STATUS_SUCCESS && m > 0) st = mul_mat_run(c, pending, m);
    if (st == GGML_STATUS_SUCCESS && mc > 0) st = cpu_run(c, cpu_ops, mc);
    return st;
}

static void set_n_threads(ggml_backend_t b, int n) { ((struct kctx *) b->context)->n_threads = n; }

static ggml_guid_t guid(void) {
    static ggml_guid g = { 0x64, 0x66, 0x6c, 0x61, 0x73, 0x68, 0x2d, 0x6b, 0x65, 0x72, 0x6e, 0x65, 0x6c, 0x73, 0x00, 0x01 };
    return &g;
}

static ggml_backend_t dev_init(ggml_backend_dev_t dev, const char * params) {
    struct kctx * c = (struct kctx *) calloc(1, sizeof(*c));
    ggml_backend_t b = (ggml_backend_t) calloc(1, sizeof(*b));
    if (!c || !b) { free(c); free(b); return NULL; }
    c->n_threads = GGML_DEFAULT_N_THREADS;
    b->guid = guid();
    b->iface.get_name = be_name;
    b->iface.free = be_free;
    b->iface.graph_compute = be_compute;
    b->device = dev;
    b->context = c;
    return b;
}

/* device */

static const char * dev_name(ggml_backend_dev_t d) { return "DFLASH"; }

static const char * dev_desc(ggml_backend_dev_t d) {
    static char s[96];
    snprintf(s, sizeof(s), "llama-dflash small-batch kernels (%s)", g_isa ? g_isa->name : "none");
    return s;
}

static void dev_memory(ggml_backend_dev_t d, size_t * free_, size_t * total) {
    const long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGE_SIZE);
    *total = pages > 0 ? (size_t) pages * (size_t) psz : 0;
    *free_ = avail > 0 ? (size_t) avail * (size_t) psz : 0;
}

static enum ggml_backend_dev_type dev_type(ggml_backend_dev_t d) { return GGML_BACKEND_DEVICE_TYPE_ACCEL; }

static void dev_props(ggml_backend_dev_t d, struct ggml_backend_dev_props * p) {
    memset(p, 0, sizeof(*p));
    p->name = dev_name(d);
    p->description = dev_desc(d);
    p->type = GGML_BACKEND_DEVICE_TYPE_ACCEL;
    dev_memory(d, &p->memory_free, &p->memory_total);
}

/* the CPU's own buffer type: llama.cpp then places no weight differently */
static ggml_backend_buffer_type_t dev_buft(ggml_backend_dev_t d) { return ggml_backend_cpu_buffer_type(); }

/* views are left where the scheduler puts them (taking one would split the graph for nothing) */
static bool dev_supports_op(ggml_backend_dev_t d, const struct ggml_tensor * op) {
    return !is_view(op->op) && op->op != GGML_OP_FLASH_ATTN_EXT && !is_rowwise(op->op) && !is_cpu_op(op->op) &&
           takes(op, false);
}
static bool dev_supports_op_attn(ggml_backend_dev_t d, const struct ggml_tensor * op) { return !is_view(op->op) && takes(op, false); }
static bool dev_supports_op_all(ggml_backend_dev_t d, const struct ggml_tensor * op) { return !is_view(op->op) && takes(op, true); }

static bool dev_supports_buft(ggml_backend_dev_t d, ggml_backend_buffer_type_t buft) {
    return ggml_backend_buft_is_host(buft) || is_repack_buft(buft);
}

static bool dev_offload_op(ggml_backend_dev_t d, const struct ggml_tensor * op) { return false; }

/* registry */

/* The scheduler asks a backend's device what it takes.  g_dev, the registered device, takes small
 * products only: attention is not taken in contexts llama-dflash does not drive, since a context
 * created with flash attention "auto" would find it on another device than its layers' and turn
 * flash attention off.  g_dev_attn takes their attention too, g_dev_all both at every row count:
 * the devices of backends switched by dflash_kernels_backend_set. */
static struct ggml_backend_device g_dev, g_dev_attn, g_dev_all;
static struct ggml_backend_reg g_reg;

static const char * reg_name(ggml_backend_reg_t r) { return "DFLASH"; }
static size_t reg_count(ggml_backend_reg_t r) { return 1; }
static ggml_backend_dev_t reg_dev(ggml_backend_reg_t r, size_t i) { return i == 0 ? &g_dev : NULL; }

static void * reg_proc(ggml_backend_reg_t r, const char * name) {
    return strcmp(name, "ggml_backend_set_n_threads") == 0 ? (void *) set_n_threads : NULL;
}

int32_t dflash_kernels_register(char * err, size_t err_len) {
    static int done = 0;  /* 1 registered, -1 refused */
    if (!done) {
        const char * v = ggml_version();
        if (!v || strcmp(v, DFLASH_GGML_VERSION) != 0)
            snprintf(g_status, sizeof(g_status), "kernels off: libggml %s, built for %s", v ? v : "?", DFLASH_GGML_VERSION);
        else if (!(g_isa = dfk_isa_by_name(getenv("LLAMA_DFLASH_KERNELS_ISA"))))  /* unset: the best */
            snprintf(g_status, sizeof(g_status), "kernels off: this CPU has neither AVX512-VNNI nor AVX2 with FMA and F16C"
                     " (or not the instruction set LLAMA_DFLASH_KERNELS_ISA names)");
        done = -1;
        if (g_isa) {
            g_dev.iface.get_name = dev_name;
            g_dev.iface.get_description = dev_desc;
            g_dev.iface.get_memory = dev_memory;
            g_dev.iface.get_type = dev_type;
            g_dev.iface.get_props = dev_props;
            g_dev.iface.init_backend = dev_init;
            g_dev.iface.get_buffer_type = dev_buft;
            g_dev.iface.supports_op = dev_supports_op;
            g_dev.iface.supports_buft = dev_supports_buft;
            g_dev.iface.offload_op = dev_offload_op;
            g_dev.reg = &g_reg;
            g_dev_attn = g_dev_all = g_dev;
            g_dev_attn.iface.supports_op = dev_supports_op_attn;
            g_dev_all.iface.supports_op = dev_supports_op_all;
            g_reg.api_version = DFLASH_GGML_BACKEND_API_VERSION;
            g_reg.iface.get_name = reg_name;
            g_reg.iface.get_device_count = reg_count;
            g_reg.iface.get_device = reg_dev;
            g_reg.iface.get_proc_address = reg_proc;
            ggml_backend_register(&g_reg);
            snprintf(g_status, sizeof(g_status), "kernels on (%s)", g_isa->name);
            done = 1;
        }
    }
    if (done < 0 && err) snprintf(err, err_len, "%s", g_status);
    return done > 0 ? 0 : -1;
}

void dflash_kernels_set_enabled(bool on) { atomic_store(&g_enabled, on); }

bool dflash_kernels_take_type(int32_t type) {
    bool ok;
    wtype_of((enum ggml_type) type, &ok);
    return ok && g_isa != NULL && atomic_load(&g_enabled);
}

int32_t dflash_kernels_take_file(const char * path) {
    struct ggml_context * meta = NULL;
    struct gguf_init_params gp = { true, &meta };  // (no_alloc: the tensors' shapes, not their data)
    struct gguf_context * g = path ? gguf_init_from_file(path, gp) : NULL;
    if (!g) return -1;
    int32_t n = 0, taken = 0;
    for (struct ggml_tensor * t = meta ? ggml_get_first_tensor(meta) : NULL; t; t = ggml_get_next_tensor(meta, t)) {
        if (ggml_n_dims(t) < 2) continue;
        n++;
        taken += router_named(t->type, t->name) || dflash_kernels_take_type(t->type);
    }
    gguf_free(g);
    if (meta) ggml_free(meta);
    return n > 0 && taken == n;
}

bool dflash_kernels_backend_set(ggml_backend_t b, int attention, int all_rows) {
    if (!b || b->iface.graph_compute != be_compute) return false;
    struct kctx * c = (struct kctx *) b->context;
    if (attention >= 0) c->takes_attn = attention;
    if (all_rows >= 0) c->all_rows = all_rows;
    b->device = c->all_rows ? &g_dev_all : c->takes_attn ? &g_dev_attn : &g_dev;
    return true;
}

ggml_backend_t dflash_kernels_backend(int n_threads) {
    if (!g_isa || !atomic_load(&g_enabled)) return NULL;
    ggml_backend_t b = dev_init(&g_dev, NULL);
    if (b) set_n_threads(b, n_threads);
    return b;
}

void dflash_kernels_get_stats(struct dflash_kernel_stats * out) {
    memset(out, 0, sizeof(*out));
    out->registered = g_isa != NULL;
    out->enabled = g_isa != NULL && atomic_load(&g_enabled);
    snprintf(out->status, sizeof(out->status), "%s", g_isa && !atomic_load(&g_enabled) ? "kernels off (switched off)" : g_status);
    out->products = atomic_load(&g_products);
    out->rows = atomic_load(&g_rows);
    for (int i = 0; i <= DFK_MAX_ROWS; i++) out->by_rows[i] = atomic_load(&g_by_rows[i]);
    out->products_id = atomic_load(&g_products_id);
    out->attention = atomic_load(&g_attn);
    out->attention_rows = atomic_load(&g_attn_rows);
    out->rowwise = atomic_load(&g_rowwise);
    out->ggml_ops = atomic_load(&g_ggml_ops);
}

int32_t dflash_kernels_mul(const char * isa_name, int32_t type, const void * w, int64_t k, int64_t ncol, const float * x,
                           int32_t n, float * y, int32_t n_threads) {
    if (type == GGML_TYPE_F32) {  /* the router's product */
        if (!dfk_isa_by_name(isa_name)) return -2;
        if (n < 1 || n > DFK_MAX_ROWS || k < 1 || ncol < 1) return -1;
        mul_f32((const float *) w, sizeof(float) * (size_t) k, k, ncol, x, sizeof(float) * (size_t) k, n, y,
                sizeof(float) * (size_t) ncol);
        return 0;
    }
    bool ok;
    enum dfk_wtype t = wtype_of((enum ggml_type) (type & ~DFLASH_KERNELS_REPACKED), &ok);
    if (ok && (type & DFLASH_KERNELS_REPACKED)) {
        if (ncol % 8 != 0 || (t != DFK_Q4_0 && t != DFK_Q4_K)) return -1;
        t = t == DFK_Q4_0 ? DFK_Q4_0_X8 : DFK_Q4_K_X8;
    }
    const struct dfk_isa * isa = dfk_isa_by_name(isa_name);
    if (!isa) return -2;
    if (!ok || n < 1 || n > DFK_MAX_ROWS || k < 1 || ncol < 1 || k % dfk_block_values(t) != 0 || !isa->takes(t, k))
        return -1;
    const int nth = n_threads > 0 ? n_threads : 1;
    const size_t w_row = (size_t) (k / dfk_block_values(t)) * dfk_block_bytes(t);
    void * act = NULL;
    size_t have = 0;
    if (!grow(&act, &have, dfk_act_size(padded(k), n))) return -1;
    run(isa, t, w, w_row, k, ncol, x, (size_t) k * sizeof(float), n, y, (size_t) ncol * sizeof(float), nth, act);
    free(act);
    return 0;
}

/* Compute `out` of ctx on ggml-cpu with n_threads into result, its inputs in[i] set from data[i]
 * (in[i] NULL: none); frees ctx.  -1: failed. */
static int32_t ggml_cpu_run(struct ggml_context * ctx, struct ggml_tensor * out, struct ggml_tensor * const * in,
                            const void * const * data, int n_in, void * result, int32_t n_threads) {
    int32_t rc = -1;
    ggml_backend_t cpu = ggml_backend_cpu_init();
    struct ggml_cgraph * g = cpu ? ggml_new_graph(ctx) : NULL;
    if (g) ggml_build_forward_expand(g, out);
    ggml_backend_buffer_t buf = g ? ggml_backend_alloc_ctx_tensors(ctx, cpu) : NULL;
    if (buf) {
        ggml_backend_cpu_set_n_threads(cpu, n_threads > 0 ? n_threads : 1);
        for (int i = 0; i < n_in; i++)
            if (in[i]) ggml_backend_tensor_set(in[i], data[i], 0, ggml_nbytes(in[i]));
        if (ggml_backend_graph_compute(cpu, g) == GGML_STATUS_SUCCESS) {
            ggml_backend_tensor_get(out, result, 0, ggml_nbytes(out));
            rc = 0;
        }
        ggml_backend_buffer_free(buf);
    }
    if (cpu) ggml_backend_free(cpu);
    ggml_free(ctx);
    return rc;
}

/* The same product by ggml-cpu (a one-node graph): the reference the tests hold the kernels to. */
int32_t dflash_kernels_mul_ggml(int32_t type, const void * w, int64_t k, int64_t ncol, const float * x, int32_t n,
                                float * y, int32_t n_threads) {
    struct ggml_init_params ip = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) return -1;
    struct ggml_tensor * tw = ggml_new_tensor_2d(ctx, (enum ggml_type) type, k, ncol);
    struct ggml_tensor * tx = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    struct ggml_tensor * in[] = { tw, tx };
    const void * data[] = { w, x };
    return ggml_cpu_run(ctx, ggml_mul_mat(ctx, tw, tx), in, data, 2, y, n_threads);
}

static struct dfk_attn attn_flat(const float * q, const uint16_t * k, const uint16_t * v, const uint16_t * mask,
                                  const float * sinks, float * out, int64_t d, int64_t n_q, int64_t n_head,
                                  int64_t n_kv, int64_t n_head_kv, float scale, float softcap) {
    struct dfk_attn a;
    memset(&a, 0, sizeof(a));
    a.q = (const char *) q;
    a.k = (const char *) k;
    a.v = (const char *) v;
    a.mask = (const char *) mask;
    a.sinks = sinks;
    a.dst = (char *) out;
    a.q_nb[0] = sizeof(float), a.q_nb[2] = d * sizeof(float), a.q_nb[1] = n_head * a.q_nb[2], a.q_nb[3] = n_q * a.q_nb[1];
    a.k_nb[0] = 2, a.k_nb[2] = d * 2, a.k_nb[1] = n_head_kv * a.k_nb[2], a.k_nb[3] = n_kv * a.k_nb[1];
    memcpy(a.v_nb, a.k_nb, sizeof(a.v_nb));
    a.m_nb[0] = 2, a.m_nb[1] = n_kv * 2, a.m_nb[2] = a.m_nb[3] = n_q * a.m_nb[1];
    a.d_nb1 = d * sizeof(float);
    a.d = d, a.n_q = n_q, a.n_head = n_head, a.n_seq = 1, a.n_kv = n_kv, a.n_head_kv = n_head_kv, a.n_seq_kv = 1;
    a.m_ne2 = a.m_ne3 = 1;
    a.scale = scale, a.softcap = softcap;
    return a;
}

int32_t dflash_kernels_attn(const char * isa_name, const float * q, const uint16_t * k, const uint16_t * v,
                            const uint16_t * mask, const float * sinks, float * out, int64_t d, int64_t n_q,
                            int64_t n_head, int64_t n_kv, int64_t n_head_kv, float scale, float softcap,
                            int32_t tile, int32_t n_threads) {
    const struct dfk_isa * isa = dfk_isa_by_name(isa_name);
    if (!isa) return -2;
    if (!dfk_attn_heads_ok(d, n_head, n_head_kv) || n_q < 1 || n_kv < 1 || tile < 0 || tile > DFK_ATTN_TILE)
        return -1;
    struct dfk_attn a = attn_flat(q, k, v, mask, sinks, out, d, n_q, n_head, n_kv, n_head_kv, scale, softcap);
    float * scratch = NULL;
    size_t have = 0;
    const enum ggml_status st = attn_run(isa, &a, n_threads > 0 ? n_threads : 1, tile, &scratch, &have);
    free(scratch);
    return st == GGML_STATUS_SUCCESS ? 0 : -1;
}

/* ggml-cpu's own FLASH_ATTN_EXT on the same data (a one-node graph, the layout llama.cpp builds). */
int32_t dflash_kernels_attn_ggml(const float * q, const uint16_t * k, const uint16_t * v, const uint16_t * mask,
                                 const float * sinks, float * out, int64_t d, int64_t n_q, int64_t n_head,
                                 int64_t n_kv, int64_t n_head_kv, float scale, float softcap, int32_t n_threads) {
    struct ggml_init_params ip = { ggml_tensor_overhead() * 16 + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);
    if (!ctx) return -1;
    struct ggml_tensor * tq = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d, n_head, n_q);
    struct ggml_tensor * tk = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, d, n_head_kv, n_kv);
    struct ggml_tensor * tv = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, d, n_head_kv, n_kv);
    struct ggml_tensor * tm = mask ? ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_q) : NULL;
    struct ggml_tensor * ts = sinks ? ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_head) : NULL;
    struct ggml_tensor * fa = ggml_flash_attn_ext(ctx, ggml_permute(ctx, tq, 0, 2, 1, 3), ggml_permute(ctx, tk, 0, 2, 1, 3),
                                                  ggml_permute(ctx, tv, 0, 2, 1, 3), tm, scale, 0.0f, softcap);
    if (ts) ggml_flash_attn_ext_add_sinks(fa, ts);
    struct ggml_tensor * in[] = { tq, tk, tv, tm, ts };
    const void * data[] = { q, k, v, mask, sinks };
    return ggml_cpu_run(ctx, fa, in, data, 5, out, n_threads);
}

/* The machine's roofline on n_threads threads: read bandwidth (GB/s, a sum over `bytes` of memory) and
 * int8 multiply-adds per second (G) with the kernels' own dot instruction.  -1: no kernels here. */
int32_t dflash_kernels_roofline(const char * isa_name, int32_t n_threads, int64_t bytes, double * gbps, double * gmacs) {
    const struct dfk_isa * isa = dfk_isa_by_name(isa_name);
    if (!isa || bytes < 4096) return -1;
    const int nth = n_threads > 0 ? n_threads : 1;
    int64_t * buf = (int64_t *) aligned_alloc(64, (size_t) bytes);
    if (!buf) return -1;
    const int64_t n = bytes / 8;
    for (int64_t i = 0; i < n; i++) buf[i] = i;  /* touched: the pages exist before the timing */
    double best = 1e30;
    int64_t sink = 0;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = omp_get_wtime();
        int64_t total = 0;
        #pragma omp parallel for num_threads(nth) reduction(+ : total) schedule(static)
        for (int64_t i = 0; i < n; i++) total += buf[i];
        const double dt = omp_get_wtime() - t0;
        sink += total;
        if (dt < best) best = dt;
    }
    *gbps = (double) bytes / best / 1e9;
    free(buf);
    const int64_t per = (int64_t) 1 << 31;
    best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = omp_get_wtime();
        int64_t total = 0;
        #pragma omp parallel num_threads(nth) reduction(+ : total)
        total += isa->mac_loop(per);
        const double dt = omp_get_wtime() - t0;
        sink += total;
        if (dt < best) best = dt;
    }
    *gmacs = (double) per * nth / best / 1e9 + (double) (sink & 1) * 1e-30;
    return 0;
}
