/*
 * llama-dflash C core: DFlash drafting on top of llama.cpp.
 *
 * Data flows one way:
 *   target decode -> captured features (dflash_capture)
 *                 -> drafter context cache (dflash_drafter_push)
 *                 -> draft (dflash_drafter_draft)
 *                 -> verify / accept / rollback (dflash_engine_*)
 *
 * Ownership: every *_new / *_load returns an object owned by the caller and
 * freed with the matching *_free.  Borrowed llama objects (model, context)
 * must outlive the objects that borrow them.  Functions that can fail return
 * NULL or a negative value and write a one-line message into `err`.
 *
 * This header is also fed to cffi: keep it free of macros in declarations.
 */
#ifndef DFLASH_H
#define DFLASH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct llama_model;
struct llama_context;

/* The core's limits, one name each (the binding reads them: Python never spells them) */
#define DFLASH_MAX_DRAFT 64      /* tokens one step drafts */
/* DFLASH_MAX_DRAFT + 1, a verify batch's rows (written as a number for the binding's parser) */
#define DFLASH_MAX_ROWS 65
#define DFLASH_MAX_LAYERS 64     /* drafter layers */
#define DFLASH_MAX_TAPS 64       /* target layers a drafter reads (capture taps) */
#define DFLASH_MAX_TOP_K 64      /* candidates per slot: DFlash2's selector_top_k, a lattice walk's K */
#define DFLASH_MAX_SEQ_GROUP 64  /* engines one group step takes (Llama's parallel) */

typedef struct dflash_drafter dflash_drafter;
typedef struct dflash_state   dflash_state;
typedef struct dflash_capture dflash_capture;
typedef struct dflash_engine  dflash_engine;

enum dflash_capture_mode {
    DFLASH_CAPTURE_LAYER_INP = 1, /* llama_set_embeddings_layer_inp (archs that record layer inputs) */
    DFLASH_CAPTURE_CB_EVAL   = 2  /* cb_eval callback on l_out-N tensors */
};

/* A drafter's hyper-parameters.  The fields read from the file are named as in the
 * format table (dflash_format.h) and in the Python DrafterConfig. */
struct dflash_drafter_info {
    int32_t version;          /* 1 = DFlash, 2 = DFlash2 (has selector_hidden.weight) */
    int32_t n_layer;
    int32_t n_embd;
    int32_t n_ff;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ctx_train;      /* dflash.context_length */
    int32_t block_size;
    int32_t n_taps;           /* entries of target_layers */
    int32_t target_layers[DFLASH_MAX_TAPS]; /* HF ids (output of target layer id), concat order */
    int32_t mask_token_id;
    float   rms_eps;
    float   rope_theta;
    int32_t rope_dims;        /* dimensions rotated (partial rotary: < head_dim; the first ones) */
    int32_t n_rope_sections;
    int32_t rope_sections[8]; /* M-RoPE drafts: [head_dim/2, 0, 0, 0] */
    int32_t rope_scaling;     /* 0 none, 1 linear, 2 yarn */
    float   rope_factor;
    int32_t rope_orig_ctx;    /* YaRN: the original context length */
    float   yarn_ext_factor;
    float   yarn_attn_factor;
    float   yarn_beta_fast;
    float   yarn_beta_slow;
    int32_t causal;           /* block attention causal (every layer, unless the file gives a pattern) */
    int32_t causal_layers[DFLASH_MAX_LAYERS]; /* 1: layer i's block attention is causal (all = causal without a pattern) */
    float   value_scale;      /* attention output scaled by this (MiMo's attention_value_scale) */
    int32_t n_swa;            /* sliding window (0 = none) */
    int32_t swa_layers[DFLASH_MAX_LAYERS]; /* 1: layer i uses the window (all layers when the file gives no pattern) */
    float   embedding_scale;
    float   logit_scale;
    float   softcap;
    int32_t sample_from_anchor; /* the anchor's slot predicts too: block_size drafted tokens per
                                   block instead of block_size - 1 (speculators' layout) */
    /* DFlash2 (zero for DFlash v1) */
    int32_t conv_kernel_size;
    int32_t conv_group_size;
    int32_t selector_rank;
    int32_t selector_top_k;
    /* from the target (dflash_drafter_check: from the file's tokenizer) and the load call */
    int32_t n_vocab;          /* the target's vocabulary */
    int32_t n_vocab_draft;    /* tokens the drafter can propose: n_vocab, or the size of its
                                 reduced vocabulary (`d2t` map + own `output.weight`) */
    int32_t n_ctx;            /* capacity of the context cache, in positions */
};

/* ---- drafter --------------------------------------------------------- */

/* Load flags (0: the fastest path on the device).  The alternatives compute the same numbers by
 * another route, for tests that prove the two agree bit for bit. */
enum dflash_load_flags {
    DFLASH_LOAD_GENERIC_CONV       = 1 << 0, /* DFlash2's conv as ggml's own ops, as on a GPU, not
                                                the fused CPU node */
    DFLASH_LOAD_GATHERED_AS_STORED = 1 << 1, /* codebooks gathered in the file's type, not held in f32 */
};

/* Load a GGUF drafter (architecture `dflash`) and bind it to `target`, whose
 * token embedding and output head it borrows (no copy).  n_ctx bounds the
 * context cache; flags: enum dflash_load_flags.  Validates the file against the target. */
dflash_drafter * dflash_drafter_load(const char * path, const struct llama_model * target,
                                     int32_t n_ctx, int32_t n_threads, uint32_t flags,
                                     char * err, size_t err_len);
/* The same, with the drafter's weights, cache and graph on `device` (a ggml_backend_dev_t: an RPC
 * server's, for a target split over RPC), the CPU taking what that device cannot run; NULL: where
 * dflash_drafter_load puts it (the device of a target head on a GPU, else the CPU). */
dflash_drafter * dflash_drafter_load_on(const char * path, const struct llama_model * target,
                                        int32_t n_ctx, int32_t n_threads, uint32_t flags, void * device,
                                        char * err, size_t err_len);
void dflash_drafter_free(dflash_drafter * d);
/* Read and validate a drafter file as the loader does, without loading its weights: every
 * key, tensor name, shape and type, and with a target (optional: may be NULL; a model loaded
 * with vocab_only suffices) everything checked against it -- the same tokenizer, hidden size,
 * taps.  Without one, n_vocab is the file's tokenizer.ggml.tokens.  out (optional) receives
 * its hyper-parameters.  Returns 0, or -1 with the reason. */
int32_t dflash_drafter_check(const char * path, const struct llama_model * target, struct dflash_drafter_info * out,
                             char * err, size_t err_len);
void dflash_drafter_get_info(const dflash_drafter * d, struct dflash_drafter_info * out);

/* Bytes the drafter allocated itself (the borrowed embedding/head excluded). */
struct dflash_drafter_memory {
    size_t weights;           /* its own tensors, the repacked ones included */
    size_t repacked;          /* of which the CPU backend holds repacked for its multi-row kernels */
    size_t cache;
    size_t compute;
    size_t borrowed;          /* size of the target tensors it uses in place */
    bool   borrows_embedding; /* token embedding is the target's tensor */
    bool   borrows_head;      /* output head is the target's tensor */
};
void dflash_drafter_get_memory(const dflash_drafter * d, struct dflash_drafter_memory * out);

/* Forget all context (new sequence). */
void    dflash_drafter_reset(dflash_drafter * d);
/* Truncate the context cache to its first n positions. */
int32_t dflash_drafter_truncate(dflash_drafter * d, int32_t n);
/* Committed positions whose features are in the cache or pending. */
int32_t dflash_drafter_n_ctx_used(const dflash_drafter * d);

/* Queue features of the next n_rows committed positions; rows are
 * n_taps*n_embd floats in target_layers order.  Projected lazily. */
int32_t dflash_drafter_push(dflash_drafter * d, const float * rows, int32_t n_rows,
                            char * err, size_t err_len);

/* A constraint on drafted tokens (e.g. a grammar), walked slot by slot: each slot takes its
 * best (or sampled) candidate among those `allowed` says may follow the tokens `accept`ed so
 * far, and the draft ends at a slot with no allowed candidate. */
struct dflash_token_filter {
    bool (*allowed)(void * ud, int32_t token);
    void (*accept)(void * ud, int32_t token);
    void * ud;
    int32_t n_skipped;  /* out: slots whose best candidate was forbidden and replaced */
    bool    cut;        /* out: the draft ended at a slot with no allowed candidate */
};

/* Greedy draft of up to n tokens after `anchor` (the token at position n_ctx_used).
 * p_min > 0 cuts the draft at the first slot whose chosen token has a confidence
 * below p_min (DFlash v1: softmax of the slot's DFLASH_V1_SAMPLE_K best logits;
 * DFlash2: softmax of the selector scores on the walk).  filter (optional): only
 * allowed candidates (v1: among the slot's DFLASH_V1_SAMPLE_K best; DFlash2: the
 * lattice's K).  out_tokens: the ids.  out_conf (optional): each drafted slot's confidence,
 * what adaptive steps calibrate (v1: as p_min reads it; DFlash2: p_min's, capped by the unary
 * head's probability of the token over the draft vocabulary; see DFLASH_CONF_VERSION).
 * out_logits (optional): n x n_vocab floats, after logit scale and softcap.  Returns the number of tokens drafted, or -1. */
int32_t dflash_drafter_draft(dflash_drafter * d, int32_t anchor, int32_t n, float p_min,
                             struct dflash_token_filter * filter, int32_t * out_tokens, float * out_conf,
                             float * out_logits, char * err, size_t err_len);

/* Random state of the sampled paths (xoshiro256**). */
struct dflash_rng {
    uint64_t s[4];
};

#define DFLASH_V1_SAMPLE_K 32

/* Draft by sampling at temperature T > 0 and return the proposal q:
 * DFlash v1 samples each slot independently from softmax(logits / T) over its
 * DFLASH_V1_SAMPLE_K best tokens; DFlash2 walks the lattice, sampling each slot
 * from softmax(scores[prev] / T).  filter (optional): forbidden candidates get q = 0
 * (the proposal stays exact for rejection sampling).  out_cand / out_q: n x k candidate
 * ids and their proposal probabilities (k returned in *out_k).  Returns the number of
 * tokens drafted (< n only when the filter allowed nothing), or -1. */
int32_t dflash_drafter_draft_sample(dflash_drafter * d, int32_t anchor, int32_t n, float temperature,
                                    struct dflash_rng * rng, struct dflash_token_filter * filter,
                                    int32_t * out_tokens, int32_t * out_cand, float * out_q, int32_t * out_k,
                                    char * err, size_t err_len);

/* DFlash2: the candidate lattice of the last draft of n tokens.  cand: n x K
 * token ids; scores: n x K x K, scores[k][a][b] = score of candidate b of slot
 * k after candidate a of slot k-1 (slot 0: the anchor, same row for every a).
 * Returns n, or -1 for a DFlash v1 drafter. */
int32_t dflash_drafter_last_lattice(const dflash_drafter * d, int32_t * cand, float * scores);

/* ---- CUDA -------------------------------------------------------------------
 * A build with CUDA (scripts/setup.sh --cuda) walks a DFlash2 lattice on the device when the
 * drafter's graph ran there (the drafter follows the target head's device): the scores stay on
 * the device, so dflash_*_last_lattice then returns -1 when asked for them (cand still works). */

/* CUDA devices this build can use: 0 in a CPU build or without a device. */
int32_t dflash_cuda_devices(void);

/* One DFlash2 walk over host arrays cand (n x K) and scores (n x K x K), by the host code
 * (on_cuda 0) or by its CUDA twin on device copies (on_cuda 1): temperature > 0 samples with a
 * generator seeded with `seed` (out_q: n x K), else greedy with the p_min cut-off (out_conf: n,
 * optional).  For the twins' tests.  Returns the tokens drafted, or -1. */
int32_t dflash_walk_lattice(int32_t on_cuda, const int32_t * cand, const float * scores, int32_t n, int32_t K,
                            float temperature, uint64_t seed, float p_min, int32_t * out_tokens, float * out_q,
                            float * out_conf, char * err, size_t err_len);

/* ---- several sequences ------------------------------------------------------
 * A drafter's functions above act on its own state (one sequence).  More
 * sequences get states of their own (each a context cache of n_ctx positions);
 * their blocks can then be drafted together in one graph. */
dflash_state * dflash_state_new(dflash_drafter * d, char * err, size_t err_len);
dflash_state * dflash_drafter_default_state(dflash_drafter * d);  /* the single-sequence API's (owned by d) */
void    dflash_state_free(dflash_state * st);
void    dflash_state_reset(dflash_state * st);
int32_t dflash_state_truncate(dflash_state * st, int32_t n);
int32_t dflash_state_n_ctx_used(const dflash_state * st);
int32_t dflash_state_n_pending(const dflash_state * st);  /* pushed rows the next graph run injects */
int32_t dflash_state_push(dflash_state * st, const float * rows, int32_t n_rows, char * err, size_t err_len);
int32_t dflash_state_last_lattice(const dflash_state * st, int32_t * cand, float * scores);
/* dflash_drafter_draft / _draft_sample on the state `st` instead of the drafter's own. */
int32_t dflash_state_draft(dflash_state * st, int32_t anchor, int32_t n, float p_min,
                           struct dflash_token_filter * filter, int32_t * out_tokens, float * out_conf,
                           float * out_logits, char * err, size_t err_len);
int32_t dflash_state_draft_sample(dflash_state * st, int32_t anchor, int32_t n, float temperature,
                                  struct dflash_rng * rng, struct dflash_token_filter * filter,
                                  int32_t * out_tokens, int32_t * out_cand, float * out_q, int32_t * out_k,
                                  char * err, size_t err_len);
/* Greedy draft of n tokens for each of n_seq states (distinct, same drafter) after
 * anchors[s]; out_tokens: n_seq x n; out_logits (optional): n_seq x n x n_vocab.
 * Returns n, or -1. */
int32_t dflash_drafter_draft_batch(dflash_drafter * d, dflash_state ** states, int32_t n_seq,
                                   const int32_t * anchors, int32_t n, int32_t * out_tokens,
                                   float * out_logits, char * err, size_t err_len);

/* ---- feature capture --------------------------------------------------- */

/* Capture the outputs of target layers `layers` (HF ids) for every row of
 * every decode.  mode 0 = pick automatically from the target architecture. */
dflash_capture * dflash_capture_new(const struct llama_model * target, const int32_t * layers,
                                    int32_t n_layers, int32_t max_rows, int32_t mode,
                                    char * err, size_t err_len);
void    dflash_capture_free(dflash_capture * c);
int32_t dflash_capture_mode(const dflash_capture * c);
/* True if the target architecture records layer inputs in this libllama. */
bool    dflash_target_has_layer_inp(const struct llama_model * target);
/* cb_eval mode: install the callback into a `struct llama_context_params *`
 * before the context is created. */
void    dflash_capture_install(dflash_capture * c, void * llama_context_params);
/* Bind to the target context (after creation, before its first decode). */
int32_t dflash_capture_attach(dflash_capture * c, struct llama_context * ctx,
                              char * err, size_t err_len);
/* Call before each llama_decode on the target. */
void    dflash_capture_begin(dflash_capture * c);
/* After a decode of n_tokens rows: the features, [n_tokens][n_layers*n_embd],
 * or NULL if they are incomplete. */
const float * dflash_capture_rows(dflash_capture * c, int32_t n_tokens);
int32_t dflash_capture_row_width(const dflash_capture * c);

/* ---- exact mode -------------------------------------------------------- */

/* Put the target context's CPU backends into ggml's reference kernels (or back): flash attention
 * without its split-KV and tiled variants, no fused ops.  The optimized one-token flash attention
 * splits the KV across threads once the context's KV view spans 512 cells (past 256 positions)
 * and rounds differently from the same row in a verify batch; in reference mode a one-token
 * decode and a verify batch take the same kernels at every length.  The context's small-batch
 * kernels (if registered) take its products and attention at every row count.  Exact mode sets it
 * before its self-check.  Returns the number of CPU backends set (0: none, e.g. every layer
 * offloaded), or -1 when libllama does not export what it needs (llama_context::get_sched). */
int32_t dflash_context_reference_kernels(struct llama_context * ctx, bool on);
/* The context's small-batch kernels take its attention of 1..16 query rows and the row-wise ops
 * between its products (norms, norm weights, residual adds) too (on), from its next graph split; a
 * context llama-dflash did not set keeps ggml's.  Idempotent.  Returns the number of kernel backends
 * set (0: the kernels are off), -1 as above. */
int32_t dflash_context_kernels_attention(struct llama_context * ctx, bool on);

/* ---- small-batch kernels (csrc/kernels, docs/architecture.md §13) ------- */

/* A ggml ACCEL backend that takes the target's matrix products (MUL_MAT, and MUL_MAT_ID: MoE experts)
 * with 1..16 activation rows on the weight types docs/architecture.md §13 lists (the quantized types
 * of Q4_0, Q8_0, Q4_K_M and Q5_K_M files), in ggml's standard layout or ggml-cpu's repacked one;
 * other types stay with ggml-cpu.  Each weight block is read once for all rows, and a row's result
 * does not depend on the rows beside it: verify batches are bit-identical to one-row decodes in
 * the products it takes.  Register it before any llama_context is created: contexts made earlier
 * never see it.  Returns 0, or -1 with the reason in err (a libggml of another version, a CPU
 * without AVX2). */
int32_t dflash_kernels_register(char * err, size_t err_len);
#define DFLASH_KERNELS_REPACKED 256
/* Off: the scheduler gives ggml-cpu every product from the next graph it splits on (process-wide). */
void    dflash_kernels_set_enabled(bool on);
/* Whether the kernels, as registered and switched now, take products of weights of this ggml type
 * (in either layout: the repacked one where ggml-cpu repacks it). */
bool    dflash_kernels_take_type(int32_t type);
/* Whether they take the products of every matrix (every tensor of 2 or more dimensions; an f32 MoE
 * router, ffn_gate_inp, as f32) of a GGUF model file.  Reads the file's header only.  1, 0, or -1 where
 * the file cannot be read as GGUF. */
int32_t dflash_kernels_take_file(const char * path);

struct dflash_kernel_stats {
    bool    registered;
    bool    enabled;
    char    status[160];       /* one line: on (which instruction set) or why off */
    int64_t products;          /* matrix products computed since the process started */
    int64_t rows;              /* activation rows in them */
    int64_t by_rows[17];       /* products by activation rows (1..16; [16]: 16 and more) */
    int64_t products_id;       /* of the products, MUL_MAT_IDs (a MoE layer's experts; rows: its tokens) */
    int64_t attention;         /* attentions (FLASH_ATTN_EXT) computed */
    int64_t attention_rows;    /* query rows in them (tokens) */
    int64_t rowwise;           /* row-wise ops between products (norms, norm weights, residual adds) */
    int64_t ggml_ops;          /* ggml-cpu's ops run inside the kernels' splits (RoPE, KV writes, SwiGLU) */
};
void    dflash_kernels_get_stats(struct dflash_kernel_stats * out);
/* y [n][ncol] = x [n][k] . W^T for W (ncol rows of k values) of ggml type `type` in its standard
 * layout (or, with DFLASH_KERNELS_REPACKED added to a Q4_0 / Q4_K type, in ggml-cpu's repacked layout of
 * 8-row groups; or F32: a MoE router's product, the only f32 weights the backend takes), on n_threads threads:
 * the backend's own path, for tests and benchmarks.  isa: "avx512vnni",
 * "avx2" or "" (the best this CPU runs).  -1: a product the kernels do not take, -2: an instruction
 * set this CPU lacks. */
int32_t dflash_kernels_mul(const char * isa, int32_t type, const void * w, int64_t k, int64_t ncol, const float * x,
                           int32_t n, float * y, int32_t n_threads);
/* The machine's roofline on n_threads threads: read bandwidth in GB/s (a sum over `bytes` of memory)
 * and G int8 multiply-adds per second with the kernels' dot instruction of `isa` (as above).
 * bench/bench_kernels.py prints it beside the kernels' times.  -1: no such instruction set here. */
int32_t dflash_kernels_roofline(const char * isa, int32_t n_threads, int64_t bytes, double * gbps, double * gmacs);
/* Attention as the kernels compute ggml's FLASH_ATTN_EXT for one sequence: q [n_q][n_head][d] (f32),
 * k and v [n_kv][n_head_kv][d] (f16 bits), mask [n_q][n_kv] (f16 bits, -inf hides a cell; NULL: all
 * visible), sinks [n_head] (f32 or NULL), out [n_q][n_head][d]; scores softcap * tanh(scale * q.k / softcap)
 * where softcap != 0.  tile: query vectors per work item (1..16; 0: the backend's choice), which
 * must not change the result.  -1: a shape the kernels do not take, -2: an instruction set this CPU
 * lacks.  dflash_kernels_attn_ggml: the same by ggml-cpu's FLASH_ATTN_EXT (-1: failed). */
int32_t dflash_kernels_attn(const char * isa, const float * q, const uint16_t * k, const uint16_t * v,
                            const uint16_t * mask, const float * sinks, float * out, int64_t d, int64_t n_q,
                            int64_t n_head, int64_t n_kv, int64_t n_head_kv, float scale, float softcap,
                            int32_t tile, int32_t n_threads);
int32_t dflash_kernels_attn_ggml(const float * q, const uint16_t * k, const uint16_t * v, const uint16_t * mask,
                                 const float * sinks, float * out, int64_t d, int64_t n_q, int64_t n_head,
                                 int64_t n_kv, int64_t n_head_kv, float scale, float softcap, int32_t n_threads);
/* The same product computed by ggml-cpu: the reference of the tests.  -1: failed. */
int32_t dflash_kernels_mul_ggml(int32_t type, const void * w, int64_t k, int64_t ncol, const float * x, int32_t n,
                                float * y, int32_t n_threads);

/* ---- the speculative loop ---------------------------------------------- */

/* External draft source: write up to n tokens proposed after the committed
 * sequence (history[0..n_history-1], last = anchor) into out; return count. */
typedef int32_t (*dflash_draft_fn)(void * user_data, const int32_t * history, int32_t n_history,
                                    int32_t n, int32_t * out);

struct dflash_stats {
    int32_t n_prompt;
    int32_t n_generated;
    int32_t steps;
    int32_t drafted;
    int32_t accepted;
    int32_t per_position_drafted[DFLASH_MAX_DRAFT];
    int32_t per_position_accepted[DFLASH_MAX_DRAFT];
    double  t_prefill_s;
    double  t_draft_s;
    double  t_verify_s;
    double  t_total_s;     /* decode phase: after prefill until the end */
    int32_t stop_reason;   /* enum dflash_stop_reason */
    int32_t mode;          /* the verify mode that ran */
    int32_t n_reused;      /* prompt tokens whose KV was kept from the previous generation */
    int32_t grammar_cut;   /* drafts the grammar ended early (no allowed candidate at a slot) */
    int32_t grammar_skipped; /* draft slots whose best candidate the grammar forbade (replaced) */
    int32_t grammar_argmax;  /* rows whose raw argmax the grammar allowed (no full-vocabulary pass) */
    /* adaptive drafting (params.adaptive) */
    int32_t plain_steps;     /* steps that did not call the drafter (the cost model said it would not pay) */
    int32_t probes;          /* of the drafted steps: probes while drafting was not paying */
    int32_t length_hist[DFLASH_MAX_ROWS]; /* steps by the draft length they verified (0 = anchor alone) */
    double  t_predicted_s;   /* the cost model's prediction of the steps' draft + verify time (once one exists) */
    float   per_position_expected[DFLASH_MAX_DRAFT]; /* calibrated acceptance, summed over verified slots */
};

enum dflash_stop_reason {
    DFLASH_STOP_NONE       = 0, /* still generating, or stopped by the caller */
    DFLASH_STOP_EOS        = 1, /* an end-of-generation token */
    DFLASH_STOP_MAX_TOKENS = 2  /* max_tokens reached */
};

enum dflash_verify_mode {
    DFLASH_VERIFY_GREEDY    = 0, /* argmax; token-identical to plain greedy decoding */
    DFLASH_VERIFY_MATCH     = 1, /* rows sampled with the request's llama.cpp sampler chain; drafts kept
                                    while equal to the sample (same seed => same text as plain) */
    DFLASH_VERIFY_REJECTION = 2  /* speculative rejection sampling with the drafter's q */
};

struct dflash_engine_params {
    int32_t n_draft;       /* draft length per step (0 = plain decoding) */
    int32_t max_tokens;
    bool    stop_on_eos;
    int32_t mode;          /* enum dflash_verify_mode */
    /* MATCH: the full chain (ending in a dist sampler).  REJECTION: the chain's
     * transforms only (penalties, grammar, top-k/p, min-p, temperature; no dist):
     * p is the softmax of what survives.  Committed tokens are accepted into it. */
    struct llama_sampler * sampler;
    float    p_min;        /* GREEDY / MATCH: confidence cut-off of the draft (0 = off) */
    bool     reuse_prefix; /* keep the target KV / drafter cache of the previous generation's common
                              prefix with this prompt and prefill only the rest */
    int32_t  draft_budget; /* no drafts past this many generated tokens (0 = max_tokens): a caller
                              that usually stops there (a completion's max_tokens) but may read
                              on wastes no verification */
    float    temperature;  /* REJECTION: temperature of the drafter's q */
    uint64_t seed;         /* REJECTION: seed of the accept / resample draws */
    /* The request's grammar sampler inside `sampler` (e.g. llama_sampler_chain_get(sampler, i)),
     * whose state is the committed tokens; NULL: none.  grammar_drafts: each draft walks a
     * clone of it (forbidden candidates are skipped, the draft ends where nothing is allowed).
     * grammar_argmax: MATCH at T = 0 where the grammar is the chain's only transform before
     * its greedy pick: a row's raw argmax, when the grammar allows it, is what the chain would
     * pick, so the chain (a grammar check of the whole vocabulary) runs only when it does not. */
    struct llama_sampler * grammar;
    bool     grammar_drafts;
    bool     grammar_argmax;
    int32_t  n_min;        /* a draft shorter than this (after p_min / grammar cuts) is dropped:
                              the step verifies the anchor alone (0 = keep every draft); an adaptive
                              step's cut keeps none shorter */
    bool     adaptive;     /* choose each step's draft length in 0..n_draft from the cost model and the
                              calibrated confidence of the drafted slots (see dflash_engine_set_costs) */
    bool     canonical_prefill; /* a prompt's KV as a fresh prefill computes it, whatever the cache held:
                              chunks of n_batch from position 0, so prefix reuse keeps only whole chunks
                              of the previous prompt's prefill (exact mode: llama.cpp's CPU kernels
                              round a row differently in another split, so a reused prefix made of
                              other batches would change the output's last bits) */
};

/* ---- cost-aware drafting ------------------------------------------------------
 * An adaptive step drafts only when the cost model says a draft pays for itself, then
 * verifies the prefix of the draft that maximises expected committed tokens per second:
 * k drafted slots are worth their k extra verify rows when the calibrated chance that
 * they are accepted covers the rows' cost.  The engine refines both tables from the steps
 * it times; callers persist them between runs (docs/architecture.md §5.9). */

/* Seconds per verify batch of k rows (t_verify[k - 1], k = 1 .. n_rows) and per draft of
 * n tokens (t_draft[n - 1], n = 1 .. n_draft), on this target, context and machine. */
struct dflash_costs {
    int32_t n_rows;
    double  t_verify[DFLASH_MAX_ROWS];
    int32_t n_draft;
    double  t_draft[DFLASH_MAX_DRAFT];
};

#define DFLASH_CONF_VERSION 2 /* what drafters' confidences mean (2: DFlash2's capped by the unary probability) */
#define DFLASH_CAL_POS  16  /* draft positions calibrated separately (later ones share the last) */
#define DFLASH_CAL_BINS 10  /* confidence bins of width 0.1 */

/* Calibration of the drafter's confidence into acceptance: per draft position and
 * confidence bin, how many slots were verified with every earlier slot accepted
 * (reached) and how many of those were accepted.  Counts decay (recent text matters). */
struct dflash_calibration {
    float reached[DFLASH_CAL_POS][DFLASH_CAL_BINS];
    float accepted[DFLASH_CAL_POS][DFLASH_CAL_BINS];
};

/* State after one verify step, for tracing and invariant checks. */
struct dflash_step {
    int32_t step;
    int32_t drafted;
    int32_t accepted;
    int32_t committed;     /* prompt + generated tokens (the last one is the anchor) */
    int32_t target_len;    /* positions in the target KV cache */
    int32_t drafter_len;   /* positions whose features the drafter holds */
    int32_t made;          /* drafts the drafter was asked for (its cost; drafted: those verified) */
    float   anchor_margin; /* the raw top-1 minus top-2 logit of the row that gave the anchor (NAN where
                            * rejection sampling drew it from a residual) */
    int32_t n_conf;        /* slots with a confidence in conf: those the drafter returned (greedy drafts;
                            * 0 for a draft source or a sampled draft) */
    float   conf[DFLASH_MAX_DRAFT]; /* the drafter's confidence per returned slot (what adaptive steps calibrate) */
    double  t_draft;       /* seconds: drafting (injecting queued feature rows included) */
    double  t_verify;      /* seconds: the verify decode and the accept loop (in a group: the joint decode) */
    double  t_predicted;   /* the cost model's t_draft + t_verify for this step (0 before it has one) */
};
typedef void (*dflash_step_fn)(void * user_data, const struct dflash_step * step);

/* The engine drives `tctx` (sequence 0).  drafter and capture may be NULL
 * (plain decoding, or an external draft source). */
dflash_engine * dflash_engine_new(struct llama_context * tctx, dflash_drafter * d,
                                  dflash_capture * c, char * err, size_t err_len);
void dflash_engine_free(dflash_engine * e);
/* An engine on sequence seq_id of a context shared with other engines (n_seq_max > seq_id;
 * its n_ctx / n_seq_max positions), with a drafter state of its own (the drafter and capture
 * are shared).  Such engines step together, see
 * dflash_engine_step_group; prefix reuse, rollback and resets touch only their sequence. */
dflash_engine * dflash_engine_new_seq(struct llama_context * tctx, dflash_drafter * d, dflash_capture * c,
                                      int32_t seq_id, char * err, size_t err_len);
void dflash_engine_set_draft_fn(dflash_engine * e, dflash_draft_fn fn, void * user_data);
void dflash_engine_set_step_fn(dflash_engine * e, dflash_step_fn fn, void * user_data);

/* Run the target over tokens (from position 0, clearing its cache) and write
 * the captured features, [n][row width], into out.  Needs a capture. */
int32_t dflash_engine_features(dflash_engine * e, const int32_t * tokens, int32_t n, float * out,
                               char * err, size_t err_len);

/* Step by step (streaming): start prefills the prompt and returns the first token
 * (its margin in *out_margin, optional); each step then verifies one draft and
 * writes the tokens it commits (at most n_draft + 1) to out_tokens, returning
 * their count, 0 once EOS or max_tokens is reached, -1 on error.  The sampler
 * in params must outlive the generation.  Stopping early is always allowed. */
int32_t dflash_engine_start(dflash_engine * e, const int32_t * prompt, int32_t n_prompt,
                            const struct dflash_engine_params * params, float * out_margin,
                            char * err, size_t err_len);
int32_t dflash_engine_step(dflash_engine * e, int32_t * out_tokens, float * out_margins,
                           char * err, size_t err_len);
void    dflash_engine_get_stats(const dflash_engine * e, struct dflash_stats * out);
/* One step of each of n engines (dflash_engine_new_seq, one context, distinct sequences, each
 * started) with a single llama_decode of all their verify rows: several requests' steps cost
 * little more than one on a compute-bound machine.  max_rows: rows of the joint decode at most
 * (0: n_batch; exact mode: the largest batch its self-check proved invariant), each engine
 * drafting within an equal share.  out_tokens: n x DFLASH_MAX_ROWS; out_counts[i]: what
 * dflash_engine_step would return for engine i (tokens committed, 0 once it has finished, -1:
 * its own error, in err; the others still step).  An adaptive engine prices its rows at their
 * marginal cost in the joint batch.  Returns 0, or -1 when the joint decode failed. */
int32_t dflash_engine_step_group(dflash_engine ** engines, int32_t n, int32_t max_rows, int32_t * out_tokens,
                                 int32_t * out_counts, char * err, size_t err_len);
/* Logits (n_vocab floats, the target's raw row) that produced the k-th token returned
 * by the last start (k = 0) or step; valid until the next start / step. */
const float * dflash_engine_last_logits(const dflash_engine * e, int32_t k);
/* Forget what the target KV holds (someone else used the context): no prefix reuse next time. */
void    dflash_engine_forget(dflash_engine * e);

/* Time verify batches of 1 .. n_rows rows and drafts of 1 .. n_draft tokens (a sample of
 * the sizes, interpolated; the drafter's if there is one) after a short prefix, and set
 * them as the engine's costs: each size's least time over the rounds, repeated (up to 6
 * rounds) until the curves are plausible.  Uses the context: clears its KV and the drafter's
 * cache. */
int32_t dflash_engine_measure_costs(dflash_engine * e, int32_t n_rows, int32_t n_draft, struct dflash_costs * out,
                                    char * err, size_t err_len);
/* Whether cost curves have a shape a machine can have: no size costs more than twice a larger one,
 * nor more than twice per row what a smaller one costs (0.5 ms of slack for timer noise).  A
 * measurement taken while something else held the cores fails this (one-row verifies timed at
 * 1.1 s against 56-210 ms for larger batches were seen cached): no speed factor repairs such a
 * shape, so it is measured again. */
bool    dflash_costs_plausible(const struct dflash_costs * costs);
/* The cost model and calibration adaptive steps use (set: e.g. from a previous run's get). */
void    dflash_engine_set_costs(dflash_engine * e, const struct dflash_costs * costs);
bool    dflash_engine_get_costs(const dflash_engine * e, struct dflash_costs * out); /* false: none set */
/* The cost model's seconds for a step that drafts n_draft tokens and verifies k of them (a plain
 * step: 0, 0), at the machine's current speed. */
double  dflash_engine_step_cost(const dflash_engine * e, int32_t n_draft, int32_t k);
void    dflash_engine_set_calibration(dflash_engine * e, const struct dflash_calibration * cal);
void    dflash_engine_get_calibration(const dflash_engine * e, struct dflash_calibration * out);
/* A modelled clock, for tests: each step's verify and draft are timed not on the live clock but as
 * `machine` prices them (a verify batch of k rows: t_verify at k, a draft of n tokens: t_draft at n,
 * linear beyond each curve's last two points; no draft curve: drafts take no time), what the policy
 * learns from and the stats report as t_draft_s / t_verify_s.  Every adaptive decision is then a
 * function of the drafts alone.  A machine that differs from the cost model by a factor exercises the
 * speed factor as drift would.  NULL or no verify curve: the live clock (the default).  Either way
 * what the policy learnt in the old clock's seconds (speed factors, the rate achieved) is dropped;
 * the cost model is kept (set it after). */
void    dflash_engine_set_clock(dflash_engine * e, const struct dflash_costs * machine);

/* The engine's adaptive steps replayed on dense traces, without a model: for every anchor
 * position j of a fixed output (traces one after another, lens[t] positions each), accepted[j]
 * says how many tokens of the drafter's n_max-token draft from there the output continues with,
 * and conf[j * n_max + i] that draft's confidence in slot i (NULL: a draft source without them).
 * One policy state runs through every trace in order, as through one engine's generations,
 * taking the steps dflash_engine_step takes (plan, draft, cut, verify, learn) with the cost
 * model's times as the measured ones; passes > 1 replays them again from the state reached (the
 * last pass is reported).  cal: a starting calibration (NULL: none).  t_inject_row: seconds a draft
 * pays per feature row committed since the last draft (it injects them first: a probe after a
 * plain stretch pays for the whole stretch); 0: drafts cost the curve alone.  Returns 0, -1 on bad
 * arguments (in err). */
struct dflash_replay {
    double  seconds;       /* the cost model's time of the steps taken */
    double  plain_seconds; /* of plain steps over the same tokens */
    int32_t steps, plain_steps, drafted, accepted, made;
};
int32_t dflash_policy_replay(const struct dflash_costs * costs, const struct dflash_calibration * cal, int32_t n_max,
                             int32_t n_traces, const int32_t * lens, const int32_t * accepted, const float * conf,
                             int32_t passes, double t_inject_row, struct dflash_replay * out, char * err,
                             size_t err_len);

/* The whole generation (start + steps).  out_tokens must hold max_tokens ids; out_margins
 * (optional) receives, for every generated token, the target's top-1 minus
 * top-2 logit at the row that produced it.  Returns tokens generated or < 0. */
int32_t dflash_engine_generate(dflash_engine * e, const int32_t * prompt, int32_t n_prompt,
                               const struct dflash_engine_params * params,
                               int32_t * out_tokens, float * out_margins,
                               struct dflash_stats * stats, char * err, size_t err_len);

/* ---- llama.cpp's RPC backend (the target's layers on rpc-server hosts) -------------------------
 * ggml-rpc aborts the process when a server disconnects and waits for ever on one that stops
 * answering.  A guard is a local forwarder (127.0.0.1, an ephemeral port) in front of one server:
 * ggml-rpc is registered with the guard's endpoint; a server lost mid-stream (or silent past
 * timeout_s) is counted as a failure and the guard answers the rest of that connection itself with
 * well-formed empty responses, so the client returns instead of aborting; callers read the count
 * after each decode and discard its results.  A new connection reaches the server afresh.
 * dflash_rpc_guard_new first checks the server: reachable, and speaking this llama.cpp's RPC
 * protocol (one-line errors otherwise). */
typedef struct dflash_rpc_guard dflash_rpc_guard;
dflash_rpc_guard * dflash_rpc_guard_new(const char * host, int32_t port, double timeout_s, char * err, size_t err_len);
void    dflash_rpc_guard_free(dflash_rpc_guard * g);
int32_t dflash_rpc_guard_port(const dflash_rpc_guard * g);
/* failures so far (a lost server, a silent one); the last one's message into err when > 0 */
int64_t dflash_rpc_guard_failures(dflash_rpc_guard * g, char * err, size_t err_len);
/* allocations the server itself refused (out of memory) */
int64_t dflash_rpc_guard_alloc_failures(const dflash_rpc_guard * g);
/* connections the guard is forwarding now (a model loaded over it; its server serves one client at a time) */
int32_t dflash_rpc_guard_connections(const dflash_rpc_guard * g);
/* the client's requests, bytes to the server, bytes from it, GETs answered from read-ahead, GETs read
 * ahead and dropped, the client's requests that have an answer (6 values; the client waited a round
 * trip for each of those not answered from read-ahead) */
void    dflash_rpc_guard_traffic(const dflash_rpc_guard * g, int64_t * out);
/* Read-ahead (on by default): after the first GET_TENSOR of a run the guard has seen before, the
 * rest of that run is requested at once, so the reads after a decode wait on one round trip instead
 * of one each; an answer is used only for the identical request with nothing sent between. */
void    dflash_rpc_guard_read_ahead(dflash_rpc_guard * g, bool on);
/* Connect + handshake only: 0 and the server's protocol version (3 ints), or -1 with a message. */
int32_t dflash_rpc_probe(const char * host, int32_t port, double timeout_s, int32_t * version, char * err,
                         size_t err_len);
void    dflash_rpc_client_version(int32_t * version);
bool    dflash_rpc_available(void);  /* the loaded libggml has the RPC backend */
/* ggml_backend_rpc_add_server(endpoint) through the registry: the ggml_backend_reg_t, or NULL */
void *  dflash_rpc_add_server(const char * endpoint, char * err, size_t err_len);
/* the registry's devices (ggml_backend_dev_t) into out; returns their count */
int32_t dflash_rpc_devices(void * reg, void ** out, int32_t max_out);


#ifdef __cplusplus
}
#endif

#endif /* DFLASH_H */
