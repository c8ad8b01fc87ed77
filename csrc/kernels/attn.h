/*
 * Attention for the target's small batches: ggml's FLASH_ATTN_EXT (f32 queries, f16 K and V, an f16
 * mask) computed row by row, so that a query row's result does not depend on the rows beside it,
 * the cells the KV view spans past its own, or the thread that computes it (docs/architecture.md §13).
 */
#ifndef DFLASH_ATTN_H
#define DFLASH_ATTN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One FLASH_ATTN_EXT, as ggml lays it out: q [d][n_q][n_head][n_seq] (f32), k and v
 * [d][n_kv][n_head_kv][n_seq_kv] (f16; n_head a multiple of n_head_kv, n_seq of n_seq_kv), mask
 * [n_kv][>= n_q][m_ne2][m_ne3] (f16, broadcast over heads and sequences; NULL: every cell visible),
 * sinks [n_head] (f32, or NULL), dst [d][n_head][n_q][n_seq] (f32, rows of d_nb1 bytes).  Strides
 * in bytes.  s = softcap * tanh(scale * q.k / softcap) where softcap != 0, else scale * q.k (ggml's
 * op parameters as they are); head sizes as dfk_attn_heads_ok takes them. */
struct dfk_attn {
    const char * q, * k, * v, * mask;
    const float * sinks;
    char * dst;
    size_t q_nb[4], k_nb[4], v_nb[4], m_nb[4], d_nb1;
    int64_t d, n_q, n_head, n_seq, n_kv, n_head_kv, n_seq_kv, m_ne2, m_ne3;
    float scale, softcap;
    int tile;  /* query vectors a work item takes, 1..DFK_ATTN_TILE: the work's split, not its result */
};

/* head sizes the kernels take: d values a head (a multiple of 16, at most 256: the accumulators of a
 * query vector's values stay in registers), n_head query heads over n_head_kv KV heads */
#define DFK_ATTN_MAX_D 256
static inline bool dfk_attn_heads_ok(int64_t d, int64_t n_head, int64_t n_head_kv) {
    return d >= 16 && d % 16 == 0 && d <= DFK_ATTN_MAX_D && n_head_kv >= 1 && n_head >= n_head_kv &&
           n_head % n_head_kv == 0;
}

/* work items: a KV head of one sequence and up to `tile` of the query vectors that read it */
#define DFK_ATTN_TILE 16
static inline int64_t dfk_attn_tiles(const struct dfk_attn * a) {
    return a->n_seq * a->n_head_kv * ((a->n_head / a->n_head_kv * a->n_q + a->tile - 1) / a->tile);
}
/* cells of values converted to f32 at once: 32 KB of them, a multiple of 16 */
#define DFK_ATTN_V_CHUNK(d) (8192 / (d) / 16 * 16)
/* floats of scratch one thread needs: a block of keys, the tile's scores, a chunk of values, the
 * tile's accumulators */
static inline size_t dfk_attn_scratch(const struct dfk_attn * a) {
    return (size_t) (16 * a->d + a->tile * ((a->n_kv + 15) / 16 * 16) + DFK_ATTN_V_CHUNK(a->d) * a->d +
                     a->tile * 2 * a->d);
}

/* work items [t0, t1) on the calling thread (each instruction set's) */
void dfk_attn_avx512(const struct dfk_attn * a, int64_t t0, int64_t t1, float * scratch);
void dfk_attn_avx2(const struct dfk_attn * a, int64_t t0, int64_t t1, float * scratch);

#ifdef __cplusplus
}
#endif
#endif
