/*
 * The attention kernel, written once over a vector width (attn_avx512.c, attn_avx2.c define VF,
 * VLEN and the v* helpers, then include this).  Per query vector, in this order:
 *   scores: s_j = (q . k_j) * scale for every cell j the mask leaves visible (-inf elsewhere): each
 *           dot one accumulator over d in ascending chunks, its lanes summed by a fixed tree;
 *   softmax: M = max s_j (and the head's sink), p_j = exp(s_j - M), S = sum of p_j by lane j % VLEN
 *           then a fixed reduction (masked cells contribute an exact 0);
 *   output: sum of p_j * v_j over the cells with p_j != 0 in ascending j, times 1 / S.
 * Nothing in it depends on the other query vectors of the tile, the tile size, the thread, or the
 * cells past the last visible one, so a row's result is the same in any batch.  The query vectors
 * that share a KV head (GQA heads, batch rows) form a tile: each block of VLEN keys is converted
 * to f32 once for all of them.
 */
#include "attn.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

#define F16_NEG_INF 0xFC00u

/* visible cells of block [j0, j0 + nw) for any of the tile's rows */
static inline bool any_visible(const uint16_t * const * mp, int nt, int64_t j0, int nw) {
    if (!mp[0]) return true;
    for (int t = 0; t < nt; t++)
        for (int w = 0; w < nw; w++)
            if (mp[t][j0 + w] != F16_NEG_INF) return true;
    return false;
}

/* one query vector's p_j (in place over its scores) and S; false: no visible cell and no sink */
static inline bool softmax_row(float * sc, int64_t n_kvp, const float * sink, float * S_out) {
    VF mx = vset1(-INFINITY);
    for (int64_t j0 = 0; j0 < n_kvp; j0 += VLEN) mx = vmax(mx, vld(sc + j0));
    float M = vred_max(mx);
    if (sink && *sink > M) M = *sink;
    if (M == -INFINITY) return false;
    const VF vm = vset1(M);
    VF vs = vzero();
    for (int64_t j0 = 0; j0 < n_kvp; j0 += VLEN) {
        const VF p = vexp(vsub(vld(sc + j0), vm));
        vst(sc + j0, p);
        vs = vadd(vs, p);
    }
    float S = vred_add(vs);
    if (sink) {
        float e[VLEN];
        vst(e, vexp(vset1(*sink - M)));
        S += e[0];
    }
    *S_out = S;
    return true;
}

/* acc += p_j v_j over the cells j in [j_lo, j_hi) with p_j != 0, ascending, v_j in f32 at
 * vf + (j - j_lo) * d; nc = d / VLEN.  Two sets of accumulators (acc0, acc1 in memory between
 * calls, alternating by the row's count of cells taken) where a row has few chunks, so that
 * consecutive cells' multiply-adds overlap. */
static inline __attribute__((always_inline)) void weigh_v(const float * p, int64_t j_lo, int64_t j_hi, const float * vf,
                                                         const int nc, float * acc0, float * acc1, int64_t * taken) {
    VF a0[32], a1[32];  /* (nc <= 32: d <= 256; a constant nc's loops unroll and these stay in registers) */
    _Pragma("GCC unroll 32") for (int c = 0; c < nc; c++) a0[c] = vld(acc0 + c * VLEN), a1[c] = vld(acc1 + c * VLEN);
    const bool two = nc <= 8;
    int64_t n = *taken;
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += VLEN) {
        unsigned bits = vnonzero(vld(p + j0));
        while (bits) {
            const int64_t j = j0 + __builtin_ctz(bits);
            bits &= bits - 1;
            const VF pj = vset1(p[j]);
            const float * vr = vf + (j - j_lo) * nc * VLEN;
            if (two && (n++ & 1)) {
                _Pragma("GCC unroll 32") for (int c = 0; c < nc; c++) a1[c] = vfma(pj, vld(vr + c * VLEN), a1[c]);
            } else {
                _Pragma("GCC unroll 32") for (int c = 0; c < nc; c++) a0[c] = vfma(pj, vld(vr + c * VLEN), a0[c]);
            }
        }
    }
    *taken = n;
    _Pragma("GCC unroll 32") for (int c = 0; c < nc; c++) vst(acc0 + c * VLEN, a0[c]), vst(acc1 + c * VLEN, a1[c]);
}

static void weigh_v_any(const float * p, int64_t j_lo, int64_t j_hi, const float * vf, int nc, float * acc0,
                        float * acc1, int64_t * taken) {
    switch (nc) {  /* the usual head sizes with their chunks in registers */
        case 4: weigh_v(p, j_lo, j_hi, vf, 4, acc0, acc1, taken); break;
        case 8: weigh_v(p, j_lo, j_hi, vf, 8, acc0, acc1, taken); break;
        case 16: weigh_v(p, j_lo, j_hi, vf, 16, acc0, acc1, taken); break;
        default: weigh_v(p, j_lo, j_hi, vf, nc, acc0, acc1, taken); break;
    }
}

/* tiles [t0, t1) of a (dfk_attn_tiles); scratch: dfk_attn_scratch(a) floats */
void ATTN_FN(const struct dfk_attn * a, int64_t t0, int64_t t1, float * scratch) {
    const int tile = a->tile;
    const int64_t d = a->d, nc = d / VLEN, g = a->n_head / a->n_head_kv, nvec = g * a->n_q;
    const int64_t per = (nvec + tile - 1) / tile, n_kvp = (a->n_kv + 15) / 16 * 16;
    const int64_t ch = DFK_ATTN_V_CHUNK(d);  /* cells of values converted at once */
    float * kf = scratch;                     /* [VLEN][d]: a block of keys in f32 */
    float * sc = kf + 16 * d;                 /* [tile][n_kvp]: scores, then p */
    float * vf = sc + tile * n_kvp;           /* [ch][d]: a chunk of values in f32 */
    float * acc = vf + ch * d;                /* [tile][2][d]: the rows' accumulators */
    for (int64_t ti = t0; ti < t1; ti++) {
        const int64_t iq3 = ti / (a->n_head_kv * per), hk = ti / per % a->n_head_kv, v0 = ti % per * tile;
        const int nt = (int) (nvec - v0 < tile ? nvec - v0 : tile);
        const int64_t ik3 = iq3 / (a->n_seq / a->n_seq_kv);
        const char * kb = a->k + hk * a->k_nb[2] + ik3 * a->k_nb[3];
        const char * vb = a->v + hk * a->v_nb[2] + ik3 * a->v_nb[3];
        const float * qp[DFK_ATTN_TILE];
        const uint16_t * mp[DFK_ATTN_TILE];
        int64_t head[DFK_ATTN_TILE], row[DFK_ATTN_TILE];
        for (int t = 0; t < nt; t++) {
            head[t] = hk * g + (v0 + t) / a->n_q;
            row[t] = (v0 + t) % a->n_q;
            qp[t] = (const float *) (a->q + row[t] * a->q_nb[1] + head[t] * a->q_nb[2] + iq3 * a->q_nb[3]);
            mp[t] = a->mask ? (const uint16_t *) (a->mask + row[t] * a->m_nb[1] + head[t] % a->m_ne2 * a->m_nb[2] +
                                                  iq3 % a->m_ne3 * a->m_nb[3])
                            : NULL;
        }
        const VF vscale = vset1(a->softcap != 0.0f ? a->scale / a->softcap : a->scale);  /* (as ggml divides it) */
        for (int64_t j0 = 0; j0 < n_kvp; j0 += VLEN) {
            const int nw = (int) (a->n_kv - j0 < VLEN ? (a->n_kv - j0 > 0 ? a->n_kv - j0 : 0) : VLEN);
            if (nw == 0 || !any_visible(mp, nt, j0, nw)) {
                for (int t = 0; t < nt; t++) vst(sc + t * n_kvp + j0, vset1(-INFINITY));
                continue;
            }
            for (int w = 0; w < VLEN; w++)
                for (int64_t c = 0; c < nc; c++)
                    vst(kf + w * d + c * VLEN,
                        w < nw ? vcvth((const uint16_t *) (kb + (j0 + w) * a->k_nb[1]) + c * VLEN) : vzero());
            for (int t = 0; t < nt; t++) {
                VF acc[VLEN];
                for (int w = 0; w < VLEN; w++) acc[w] = vzero();
                for (int64_t c = 0; c < nc; c++) {
                    const VF qc = vld(qp[t] + c * VLEN);
                    for (int w = 0; w < VLEN; w++) acc[w] = vfma(qc, vld(kf + w * d + c * VLEN), acc[w]);
                }
                VF s = vmul(vhsum(acc), vscale);
                if (a->softcap != 0.0f) {  /* (Gemma-2's logit soft-capping: rare, scalar) */
                    float x[VLEN];
                    vst(x, s);
                    for (int w = 0; w < VLEN; w++) x[w] = a->softcap * tanhf(x[w]);
                    s = vld(x);
                }
                uint16_t mt[VLEN];  /* the mask's block, -inf past the view's last cell */
                const uint16_t * m = mt;
                if (mp[t] && nw == VLEN) m = mp[t] + j0;
                else
                    for (int w = 0; w < VLEN; w++) mt[w] = w >= nw ? F16_NEG_INF : mp[t] ? mp[t][j0 + w] : 0;
                vst(sc + t * n_kvp + j0, vmask_add(s, vcvth(m)));
            }
        }
        float S[DFK_ATTN_TILE];
        bool seen[DFK_ATTN_TILE];
        int64_t taken[DFK_ATTN_TILE];
        for (int t = 0; t < nt; t++) {
            seen[t] = softmax_row(sc + t * n_kvp, n_kvp, a->sinks ? a->sinks + head[t] : NULL, &S[t]);
            memset(acc + t * 2 * d, 0, 2 * d * sizeof(float));
            taken[t] = 0;
        }
        for (int64_t c0 = 0; c0 < a->n_kv; c0 += ch) {  /* each chunk of values converted once for the tile */
            const int64_t c1 = c0 + ch < a->n_kv ? c0 + ch : a->n_kv;
            bool any = false;
            for (int t = 0; t < nt && !any; t++)
                for (int64_t j0 = c0; j0 < c1 && !any; j0 += VLEN) any = seen[t] && vnonzero(vld(sc + t * n_kvp + j0));
            if (!any) continue;
            for (int64_t j = c0; j < c1; j++)
                for (int64_t c = 0; c < nc; c++)
                    vst(vf + (j - c0) * d + c * VLEN, vcvth((const uint16_t *) (vb + j * a->v_nb[1]) + c * VLEN));
            for (int t = 0; t < nt; t++)
                if (seen[t])
                    weigh_v_any(sc + t * n_kvp, c0, c1, vf, (int) nc, acc + t * 2 * d, acc + t * 2 * d + d, &taken[t]);
        }
        for (int t = 0; t < nt; t++) {
            float * out = (float *) (a->dst + ((iq3 * a->n_q + row[t]) * a->n_head + head[t]) * a->d_nb1);
            if (!seen[t]) {
                memset(out, 0, d * sizeof(float));
                continue;
            }
            const VF inv = vset1(S[t] == 0.0f ? 0.0f : 1.0f / S[t]);
            const float * a0 = acc + t * 2 * d, * a1 = a0 + d;
            for (int64_t c = 0; c < nc; c++)  /* (one set of accumulators: the second stayed 0) */
                vst(out + c * VLEN, vmul(nc <= 8 ? vadd(vld(a0 + c * VLEN), vld(a1 + c * VLEN)) : vld(a0 + c * VLEN), inv));
        }
    }
}
