/* Weight block layouts of ggml's standard quantized types (the GGUF format) and their scale helpers,
 * shared by the kernels of every instruction set. */
#ifndef DFLASH_QMM_COMMON_H
#define DFLASH_QMM_COMMON_H

#include "qmm.h"

#include <immintrin.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#define QK4_0 32
#define QK8_0 32
#define QK_K 256

typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_K;

static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (of 8) */
static inline void scale_min_k4(int j, const uint8_t * q, uint8_t * sc, uint8_t * m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#endif
