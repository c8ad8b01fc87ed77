/*
 * Small-batch quantized matrix products for the target's verify batches (docs/architecture.md §13).
 *
 * y[r][c] = dot(W row c, x row r) for a handful of activation rows r, each weight block read once
 * for all of them.  Every weight type is decoded, block by block, into one canonical form: 8-bit
 * unsigned values q with a scale s and an offset o per 4-value lane (value = s*q + o); activations
 * are quantized per 32 values to int8 with a float scale.  The integer dot of a lane, its scaling and
 * the final sum run in one fixed order per (r, c), whatever the number of rows, the rows beside it
 * or the thread that computes it: a k-row product is bit-identical to k one-row products.
 */
#ifndef DFLASH_QMM_H
#define DFLASH_QMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Q4_0_X8 / Q4_K_X8: ggml-cpu's repacked layout of those types (its CPU_REPACK buffers on x86):
 * groups of 8 rows, each block of the 8 rows interleaved 8 bytes at a time, the same bytes a row. */
enum dfk_wtype { DFK_Q4_0, DFK_Q8_0, DFK_Q4_K, DFK_Q5_K, DFK_Q6_K, DFK_Q4_0_X8, DFK_Q4_K_X8, DFK_Q5_0, DFK_Q4_1, DFK_N_WTYPES };

#define DFK_MAX_ROWS 16  /* activation rows one product takes */
#define DFK_CHUNK 64     /* values per step of the widest kernel: rows are padded to a multiple */

/* Quantized activation rows: xq [n][kp] int8, per 4-value lane dxl (scales) and xsl (sums), and
 * xzp [n][kp / 32] each 32 values' zero-point starts of the interleaved kernels' lane pair, and xbs
 * [n][kp / 32] the integer sum of every 32 values: qmm_common.h, dfk_quantize. */
struct dfk_act {
    int64_t k, kp;
    int     n;
    int8_t * xq;
    float  * dxl;
    float  * xsl;
    int64_t * xzp;
    int16_t * xbs;
};

struct dfk_attn;

/* One instruction set's kernels (qmm_avx512.c, qmm_avx2.c). */
struct dfk_isa {
    const char * name;
    /* whether it takes weights of type t with rows of k values */
    bool (*takes)(enum dfk_wtype t, int64_t k);
    /* quantize rows [r0, r1) of x (row stride in bytes) into a, for weights of type t */
    void (*quantize)(enum dfk_wtype t, const float * x, size_t x_stride, const struct dfk_act * a, int r0, int r1);
    /* y[r][c] for c in [c0, c1) and every row of a */
    void (*mul)(enum dfk_wtype t, const void * w, size_t w_row, int64_t c0, int64_t c1,
                const struct dfk_act * a, float * y, size_t y_stride);
    /* int8 multiply-adds of this instruction set's dot, n of them, on the calling thread (roofline) */
    int64_t (*mac_loop)(int64_t n);
    /* attention work items [t0, t1) of a (attn.h) */
    void (*attn)(const struct dfk_attn * a, int64_t t0, int64_t t1, float * scratch);
};

size_t dfk_act_size(int64_t kp, int n);            /* bytes for a dfk_act's five arrays */
int64_t dfk_block_values(enum dfk_wtype t);         /* values per weight block */
size_t  dfk_block_bytes(enum dfk_wtype t);          /* bytes per weight block */

const struct dfk_isa * dfk_isa_avx512(void);        /* NULL where not compiled */
const struct dfk_isa * dfk_isa_avx2(void);
const struct dfk_isa * dfk_isa_best(void);           /* the best this CPU runs, NULL: none */
const struct dfk_isa * dfk_isa_by_name(const char * name); /* "avx512vnni" / "avx2" if this CPU runs it, "": best */

#ifdef __cplusplus
}
#endif
#endif
