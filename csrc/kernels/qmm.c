/* qmm.h: sizes and the choice of instruction set at run time. */
#include "qmm.h"

#include <string.h>

size_t dfk_act_size(int64_t kp, int n) { return (size_t) n * (size_t) kp * 3 + (size_t) n * (size_t) (kp / 32) * 10; }

int64_t dfk_block_values(enum dfk_wtype t) {
    return t == DFK_Q4_0 || t == DFK_Q8_0 || t == DFK_Q4_0_X8 || t == DFK_Q5_0 || t == DFK_Q4_1 ? 32 : 256;
}

size_t dfk_block_bytes(enum dfk_wtype t) {
    switch (t) {
    case DFK_Q4_0: case DFK_Q4_0_X8: return 18;
    case DFK_Q8_0: return 34;
    case DFK_Q5_0: return 22;
    case DFK_Q4_1: return 20;
    case DFK_Q4_K: case DFK_Q4_K_X8: return 144;
    case DFK_Q5_K: return 176;
    case DFK_Q6_K: return 210;
    default: return 0;
    }
}

static bool has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

static bool has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

const struct dfk_isa * dfk_isa_best(void) {
    return has_avx512() ? dfk_isa_avx512() : has_avx2() ? dfk_isa_avx2() : NULL;
}

const struct dfk_isa * dfk_isa_by_name(const char * name) {
    if (!name || !*name) return dfk_isa_best();
    if (strcmp(name, "avx512vnni") == 0) return has_avx512() ? dfk_isa_avx512() : NULL;
    if (strcmp(name, "avx2") == 0) return has_avx2() ? dfk_isa_avx2() : NULL;
    return NULL;
}
