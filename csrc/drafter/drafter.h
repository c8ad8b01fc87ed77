// The drafter's internals, shared by its units:
//   load.c   GGUF reading and validation (driven by dflash_format.h), weights
//   graph.c  the forward graph: context injection, the block, DFlash2 conv and selector
//   select.c host-side choice of the drafted tokens: greedy, p_min, filter, sampling, walk
//   draft.c  one graph run (inputs, compute, outputs) and the public draft calls
//   state.c  sequence states: context caches and queued features
//   vocab.c  the drafter's tokenizer, read and compared with the target's
#pragma once

#include "dflash.h"
#include "dflash_format.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <stdbool.h>
#include <stdint.h>

#define DFLASH_MAX_SEQ 16
#define DFLASH_GRAPH_SIZE 4096
#define DFLASH_INJECT_CHUNK 512

// Weights, one field per row of the format table.
struct dflash_cuda_ctx;

struct dflash_layer {
#define X(field, ...) struct ggml_tensor * field;
    DFLASH_LAYER_TENSORS(X)
#undef X
};

struct dflash_weights {
#define X(field, ...) struct ggml_tensor * field;
    DFLASH_TOP_TENSORS(X)
#undef X
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
    float * last_scores;  // not filled when the walk ran on the device (scores_on_device)
    bool scores_on_device;
    int32_t last_n;
};

struct dflash_drafter {
    struct dflash_drafter_info hp;
    int32_t n_embd_inp; // n_taps * n_embd

    struct ggml_context * ctx_w;    // own weights
    ggml_backend_buffer_t buf_w;
    struct ggml_context * ctx_wr;   // own matrices the CPU backend repacks for its batched kernels
    ggml_backend_buffer_t buf_wr;
    struct ggml_context * ctx_hc;   // a local copy of the target's head when it lives on an RPC server
    ggml_backend_buffer_t buf_hc;

    // w.tok_embd / w.head are the target's tensors unless the file has its own (own_*);
    // w.d2t (reduced vocabulary) holds the target ids as I32, also on the host in d2t_host.
    struct dflash_weights w;
    struct dflash_layer layers[DFLASH_MAX_LAYERS];
    int32_t * d2t_host;
    bool own_embd, own_head;

    ggml_backend_t backends[3];    // the device asked for or the target head's GPU, or our small-batch kernels; then the CPU
    int n_backends;
    bool gpu;                      // backends[0] is a device other than the CPU (a GPU, an RPC server)
    uint32_t flags;                // enum dflash_load_flags
    bool fused_conv;               // DFlash2's conv as one CPU node (no GPU; DFLASH_LOAD_GENERIC_CONV: ggml's ops)
    ggml_backend_t cpu;
    ggml_backend_sched_t sched;
    void * meta_buf;
    size_t meta_size;

    struct dflash_state * def;     // the state behind the single-sequence API
    struct dflash_cuda_ctx * cuda; // the device walk's scratch (CUDA builds, CUDA targets)
};

// Block rows of a draft of n tokens: the anchor and n - 1 masks when the anchor's slot predicts
// (sample_from_anchor), else the anchor and n masks.
static inline int32_t dflash_block_rows(const struct dflash_drafter_info * hp, int32_t n) {
    return n + (hp->sample_from_anchor ? 0 : 1);
}

// Attention mask kinds: bit 0 causal, bit 1 sliding window (docs/architecture.md §2.6).
#define DFLASH_MASK_KINDS 4
static inline int dflash_mask_kind(const struct dflash_drafter_info * hp, int il) {
    return (hp->causal_layers[il] ? 1 : 0) | (hp->n_swa > 0 && hp->swa_layers[il] ? 2 : 0);
}

// graph.c: one graph over n_seq states (inputs named in struct dflash_graph).
struct dflash_graph {
    struct ggml_context * ctx;
    struct ggml_cgraph * gf;
    struct ggml_tensor * feat[DFLASH_MAX_SEQ], * feat_pos[DFLASH_MAX_SEQ]; // injection inputs (or NULL)
    struct ggml_tensor * tokens, * block_pos;                            // [B * n_seq] (or NULL)
    struct ggml_tensor * mask[DFLASH_MASK_KINDS][DFLASH_MAX_SEQ];        // [n_kv_s, B] per kind (or NULL)
    struct ggml_tensor * logits, * argmax;                               // outputs, [.., n * n_seq]
    struct ggml_tensor * anchor;                                         // DFlash2: [n_seq] anchor ids
    struct ggml_tensor * cand, * scores;                                 // top-K ids, lattice / logits
    struct ggml_tensor * cand_p;                                         // DFlash2 (on request): [K, n * n_seq]
                                                                         // the unary head's probability of each
                                                                         // candidate over the draft vocabulary
    int32_t n_kv[DFLASH_MAX_SEQ];                                        // keys in each block's attention,
                                                                         // padded (DFLASH_KV_PAD) ...
    int32_t n_kv_used[DFLASH_MAX_SEQ];                                   // ... of which real: the rest masked
    int32_t conv_ud[2][2];                                               // DFlash2's fused CPU conv: {side, B}
};

// Attention spans a multiple of this many cache cells (the unused ones masked): the CPU's tiled
// f32 GEMM (llamafile's sgemm) takes K.Q only for key counts that are multiples of 4 and V.softmax
// only for multiples of 16; otherwise each block row dots each key separately.
#define DFLASH_KV_PAD 16

// vocab.c: the file's token list (required, valid UTF-8) -> its size; the same list as the target's
struct gguf_context;
struct llama_model;
bool dflash_vocab_read(const struct gguf_context * g, const char * path, int32_t * n_tokens, char * err, size_t err_len);
bool dflash_vocab_match(const struct gguf_context * g, const struct llama_model * target, const char * path,
                        char * err, size_t err_len);

bool dflash_build_graph(struct dflash_drafter * d, struct dflash_graph * G, struct dflash_state ** sts,
                        int32_t n_seq, int32_t n_block, bool want_logits, bool want_topk, bool want_probs);
// mask rows [n_block][n_kv] for a block at positions a.. ; keys from n_used on are padding (hidden)
void dflash_fill_mask(float * m, int32_t n_kv, int32_t n_used, int32_t n_block, int32_t a, bool causal,
                      int32_t window);

// select.c: a draft's token choice on the host.
struct dflash_sample_req {
    float temperature;
    struct dflash_rng * rng;  // NULL: greedy choice (p_min cut-off only)
    int32_t * cand;   // n x k
    float * q;        // n x k
    int32_t k;
    float p_min;      // greedy: stop at the first slot less confident than this
    float * conf;     // greedy (optional): each drafted slot's confidence (DFlash2: the smaller of the
                      // walk's, which p_min reads, and the unary head's probability of the token)
    int32_t n_out;    // tokens produced
    struct dflash_token_filter * filter;  // optional: only allowed candidates
};

int32_t dflash_choose(const float * x, const int32_t * c, int32_t k, struct dflash_sample_req * samp, float * q);
int32_t dflash_walk(const struct dflash_drafter_info * hp, const int32_t * cand, const float * scores, int32_t n,
                    int32_t * out_tokens, struct dflash_sample_req * samp);
int32_t dflash_choose_v1(const float * logits, int32_t * cand, int32_t n, int32_t K, int32_t * out_tokens,
                         struct dflash_sample_req * samp);

// draft.c: run one graph (injects pending rows; drafts n_block - 1 tokens per state when n_block > 0).
int32_t dflash_run_graph(struct dflash_drafter * d, struct dflash_state ** sts, int32_t n_seq,
                         const int32_t * anchors, int32_t n_block, int32_t * out_tokens, float * out_logits,
                         struct dflash_sample_req * samp, char * err, size_t err_len);
