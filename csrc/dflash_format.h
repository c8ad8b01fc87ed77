/*
 * The DFlash drafter GGUF format, in one table (docs/architecture.md §4.4).
 *
 * This file is the one owner of the format: the C loader expands these lists
 * as X-macros, and python/llama_dflash/formats/table.py reads the same text to
 * write, read, convert and map drafters.  Keep every entry on one line, in the
 * shape shown, with C expressions over `hp->` (struct dflash_drafter_info) only.
 *
 * Keys: X(field, key, type, need, default, write)
 *   field    the hyper-parameter's name in struct dflash_drafter_info and in
 *            the Python DrafterConfig
 *   type     U32 | F32 | BOOL | STR | ARR_INT | ARR_BOOL
 *   need     REQ (always required) | OPT (default when absent) | V2 (required
 *            by DFlash2 drafters, which are detected by selector_hidden.weight)
 *   default  a literal, or an expression over fields listed above it
 *   write    when the writer emits it: ALWAYS | NONDEF (value != default) |
 *            SCALED (rope scaling set) | YARN | SWA (sliding window set) | V2
 * Exceptions the code handles by name: target_layers are stored as HF layer
 * id + 1; rope_scaling is a string in the file (DFLASH_ROPE_SCALINGS below);
 * causal_layers (ours, not upstream's) overrides the global causal flag per layer;
 * value_scale 0 means unset (upstream's convention).  llama3 RoPE and HF YaRN
 * variants ggml cannot express natively are stored as rope_freqs.weight factors.
 */
#ifndef DFLASH_FORMAT_H
#define DFLASH_FORMAT_H

#define DFLASH_ARCH "dflash"

#define DFLASH_GGUF_KEYS(X) \
    X(n_layer,          "dflash.block_count",                            U32,      REQ, 0,                          ALWAYS) \
    X(n_embd,           "dflash.embedding_length",                       U32,      REQ, 0,                          ALWAYS) \
    X(n_ff,             "dflash.feed_forward_length",                    U32,      REQ, 0,                          ALWAYS) \
    X(n_head,           "dflash.attention.head_count",                   U32,      REQ, 0,                          ALWAYS) \
    X(n_head_kv,        "dflash.attention.head_count_kv",                U32,      OPT, hp->n_head,                 ALWAYS) \
    X(head_dim,         "dflash.attention.key_length",                   U32,      OPT, hp->n_embd / hp->n_head,    ALWAYS) \
    X(n_ctx_train,      "dflash.context_length",                         U32,      OPT, 32768,                      ALWAYS) \
    X(block_size,       "dflash.block_size",                             U32,      REQ, 0,                          ALWAYS) \
    X(target_layers,    "dflash.target_layers",                          ARR_INT,  REQ, 0,                          ALWAYS) \
    X(mask_token_id,    "tokenizer.ggml.mask_token_id",                  U32,      REQ, 0,                          ALWAYS) \
    X(rms_eps,          "dflash.attention.layer_norm_rms_epsilon",       F32,      OPT, 1e-6f,                      ALWAYS) \
    X(rope_theta,       "dflash.rope.freq_base",                         F32,      OPT, 10000.0f,                   ALWAYS) \
    X(rope_dims,        "dflash.rope.dimension_count",                   U32,      OPT, hp->head_dim,               ALWAYS) \
    X(rope_sections,    "dflash.rope.dimension_sections",                ARR_INT,  OPT, 0,                          NONDEF) \
    X(rope_scaling,     "dflash.rope.scaling.type",                      STR,      OPT, "none",                     NONDEF) \
    X(rope_factor,      "dflash.rope.scaling.factor",                    F32,      OPT, 1.0f,                       SCALED) \
    X(rope_orig_ctx,    "dflash.rope.scaling.original_context_length",   U32,      OPT, hp->n_ctx_train,            YARN) \
    X(yarn_ext_factor,  "dflash.rope.scaling.yarn_ext_factor",           F32,      OPT, 1.0f,                       NONDEF) \
    X(yarn_attn_factor, "dflash.rope.scaling.attn_factor",               F32,      OPT, 1.0f,                       NONDEF) \
    X(yarn_beta_fast,   "dflash.rope.scaling.yarn_beta_fast",            F32,      OPT, 32.0f,                      YARN) \
    X(yarn_beta_slow,   "dflash.rope.scaling.yarn_beta_slow",            F32,      OPT, 1.0f,                       YARN) \
    X(causal,           "dflash.attention.causal",                       BOOL,     OPT, 0,                          NONDEF) \
    X(causal_layers,    "dflash.attention.causal_pattern",               ARR_BOOL, OPT, 0,                          NONDEF) \
    X(value_scale,      "dflash.attention.value_scale",                  F32,      OPT, 1.0f,                       NONDEF) \
    X(n_swa,            "dflash.attention.sliding_window",               U32,      OPT, 0,                          NONDEF) \
    X(swa_layers,       "dflash.attention.sliding_window_pattern",       ARR_BOOL, OPT, 0,                          SWA) \
    X(embedding_scale,  "dflash.embedding_scale",                        F32,      OPT, 1.0f,                       NONDEF) \
    X(logit_scale,      "dflash.logit_scale",                            F32,      OPT, 1.0f,                       NONDEF) \
    X(softcap,          "dflash.final_logit_softcapping",                F32,      OPT, 0.0f,                       NONDEF) \
    X(sample_from_anchor, "dflash.sample_from_anchor",                   BOOL,     OPT, 0,                          NONDEF) \
    X(conv_kernel_size, "dflash.conv_kernel_size",                       U32,      V2,  0,                          V2) \
    X(conv_group_size,  "dflash.conv_group_size",                        U32,      V2,  0,                          V2) \
    X(selector_rank,    "dflash.selector_rank",                          U32,      V2,  0,                          V2) \
    X(selector_top_k,   "dflash.selector_top_k",                         U32,      V2,  0,                          V2)

/* Keys that must equal a field when present (the writer emits them): X(key, type, field) */
#define DFLASH_GGUF_EQUAL(X) \
    X("dflash.attention.value_length",                U32, head_dim)

/* Second names of a field (read after the first, so they win): X(key, type, field) */
#define DFLASH_GGUF_ALIAS(X) \
    X("dflash.rope.scaling.yarn_attn_factor",         F32, yarn_attn_factor)

/* Keys of layouts we do not run: refused unless absent or equal to `allowed`
 * (type ANY: refused whenever present).  X(key, type, allowed, what) */
#define DFLASH_GGUF_REFUSED(X) \
    X("dflash.rope.scaling.yarn_log_multiplier",      F32,  0, "YaRN with yarn_log_multiplier") \
    X("dflash.hidden_activation",                     ANY,  0, "Gemma-style drafters (hidden_activation)") \
    X("dflash.attention.scale",                       ANY,  0, "Gemma-style drafters (attention.scale)")

/*
 * Tensors: X(field, name, need, dtype, ne0, ne1, ne2, hf)
 *   field    the weight's name in the C structs (struct dflash_weights / dflash_layer)
 *   name     GGUF name; per-layer tensors are prefixed "blk.<i>."
 *   need     REQ | OPT | V2 (DFlash2 only, required there) | D2T (required with a d2t map)
 *   dtype    F32 (kept in f32: norms, biases, conv bases, rope factors) | W (a matrix: f32,
 *            f16, bf16 or quantized; the selector codebooks too, gathered by get_rows, as
 *            upstream's converter and llama-quantize write them) | I64 (id map)
 *   ne0..2   ggml shape (ne0 = the contiguous dimension; PyTorch order is reversed)
 *   hf       HF checkpoint names, "|"-separated, the first one canonical ("" = none);
 *            per-layer names are prefixed "layers.<i>."
 */
#define DFLASH_TOP_TENSORS(X) \
    X(fc,          "fc.weight",                   REQ, W,   hp->n_taps * hp->n_embd, hp->n_embd, 1, "fc.weight|encoder.fc.weight") \
    X(hidden_norm, "enc.output_norm.weight",      REQ, F32, hp->n_embd, 1, 1, "hidden_norm.weight|encoder.output_norm_enc.weight") \
    X(out_norm,    "output_norm.weight",          REQ, F32, hp->n_embd, 1, 1, "norm.weight") \
    X(tok_embd,    "token_embd.weight",           OPT, W,   hp->n_embd, hp->n_vocab, 1, "") \
    X(head,        "output.weight",               D2T, W,   hp->n_embd, hp->n_vocab_draft, 1, "") \
    X(d2t,         "d2t",                         OPT, I64, hp->n_vocab_draft, 1, 1, "") \
    X(rope_freqs,  "rope_freqs.weight",           OPT, F32, hp->head_dim / 2, 1, 1, "") \
    X(sel_pred,    "selector_predecessor.weight", V2,  W,   hp->selector_rank, hp->n_vocab, 1, "candidate_selector.predecessor_codebook|candidate_selector.predecessor_codebook.weight") \
    X(sel_succ,    "selector_successor.weight",   V2,  W,   hp->selector_rank, hp->n_vocab, 1, "candidate_selector.successor_codebook|candidate_selector.successor_codebook.weight") \
    X(sel_hidden,  "selector_hidden.weight",      V2,  W,   hp->n_embd, hp->selector_rank, 1, "candidate_selector.hidden_projection.weight")

#define DFLASH_LAYER_TENSORS(X) \
    X(attn_norm,      "attn_norm.weight",      REQ, F32, hp->n_embd, 1, 1, "input_layernorm.weight") \
    X(wq,             "attn_q.weight",         REQ, W,   hp->n_embd, hp->n_head * hp->head_dim, 1, "self_attn.q_proj.weight") \
    X(wk,             "attn_k.weight",         REQ, W,   hp->n_embd, hp->n_head_kv * hp->head_dim, 1, "self_attn.k_proj.weight") \
    X(wv,             "attn_v.weight",         REQ, W,   hp->n_embd, hp->n_head_kv * hp->head_dim, 1, "self_attn.v_proj.weight") \
    X(wo,             "attn_output.weight",    REQ, W,   hp->n_head * hp->head_dim, hp->n_embd, 1, "self_attn.o_proj.weight") \
    X(bq,             "attn_q.bias",           OPT, F32, hp->n_head * hp->head_dim, 1, 1, "self_attn.q_proj.bias") \
    X(bk,             "attn_k.bias",           OPT, F32, hp->n_head_kv * hp->head_dim, 1, 1, "self_attn.k_proj.bias") \
    X(bv,             "attn_v.bias",           OPT, F32, hp->n_head_kv * hp->head_dim, 1, 1, "self_attn.v_proj.bias") \
    X(bo,             "attn_output.bias",      OPT, F32, hp->n_embd, 1, 1, "self_attn.o_proj.bias") \
    X(q_norm,         "attn_q_norm.weight",    REQ, F32, hp->head_dim, 1, 1, "self_attn.q_norm.weight") \
    X(k_norm,         "attn_k_norm.weight",    REQ, F32, hp->head_dim, 1, 1, "self_attn.k_norm.weight") \
    X(ffn_norm,       "ffn_norm.weight",       REQ, F32, hp->n_embd, 1, 1, "post_attention_layernorm.weight") \
    X(ffn_gate,       "ffn_gate.weight",       REQ, W,   hp->n_embd, hp->n_ff, 1, "mlp.gate_proj.weight") \
    X(ffn_up,         "ffn_up.weight",         REQ, W,   hp->n_embd, hp->n_ff, 1, "mlp.up_proj.weight") \
    X(ffn_down,       "ffn_down.weight",       REQ, W,   hp->n_ff, hp->n_embd, 1, "mlp.down_proj.weight") \
    X(attn_conv_base, "attn_conv_base",        V2,  F32, hp->n_embd, hp->conv_kernel_size, 2, "attention_conv.base_kernel") \
    X(attn_conv_proj, "attn_conv_proj.weight", V2,  W,   hp->n_embd, 2 * hp->conv_kernel_size * (hp->n_embd / hp->conv_group_size), 1, "attention_conv.kernel_projection.weight") \
    X(ffn_conv_base,  "ffn_conv_base",         V2,  F32, hp->n_embd, hp->conv_kernel_size, 2, "mlp_conv.base_kernel") \
    X(ffn_conv_proj,  "ffn_conv_proj.weight",  V2,  W,   hp->n_embd, 2 * hp->conv_kernel_size * (hp->n_embd / hp->conv_group_size), 1, "mlp_conv.kernel_projection.weight")

/* Tensors of other drafter families, named in the refusal: X(name, what) */
#define DFLASH_REFUSED_TENSORS(X) \
    X("markov_w1.weight", "a DSpark drafter (markov_w1.weight)")

/* rope_scaling's values, numbered in this order in struct dflash_drafter_info: X(ID, name) */
#define DFLASH_ROPE_SCALINGS(X) \
    X(NONE,   "none") \
    X(LINEAR, "linear") \
    X(YARN,   "yarn")

#define X(id, name) DFLASH_ROPE_##id,
enum dflash_rope_scaling { DFLASH_ROPE_SCALINGS(X) };
#undef X

/* Tokens one block drafts: block_size - 1, or block_size when the anchor's slot predicts too
 * (sample_from_anchor).  An expression over hp-> as in the keys' defaults. */
#define DFLASH_MAX_DRAFT_EXPR hp->block_size - 1 + hp->sample_from_anchor

#endif /* DFLASH_FORMAT_H */
