// The DFlash2 selector walk on the device: the twin of dflash_walk (drafter/select.c).
//
// A walk is sequential (slot k's row depends on slot k-1's choice) and tiny (K <= 32 scores per
// slot, n <= 15 slots), so one thread walks one sequence with the twin's own arithmetic
// (drafter/walk_math.h): greedy picks are identical by construction (comparisons only); sampled
// picks draw the twin's uniforms, and q and confidences differ from the host's by the device's
// exp / expf rounding at most.
#include "dflash_cuda.h"
#include "../drafter/walk_math.h"

#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

struct dflash_cuda_ctx {
    int device;
    cudaStream_t stream;
    void * buf;       // outputs and uniforms of one walk
    size_t buf_size;
};

static void set_err(char * err, size_t err_len, const char * what, cudaError_t e) {
    if (err && err_len) snprintf(err, err_len, "CUDA: %s: %s", what, cudaGetErrorString(e));
}

#define CHECK(call, what)                          \
    do {                                           \
        cudaError_t e_ = (call);                   \
        if (e_ != cudaSuccess) {                   \
            set_err(err, err_len, what, e_);       \
            return -1;                             \
        }                                          \
    } while (0)

__global__ static void walk_kernel(const int32_t * cand, const float * scores, int32_t n, int32_t K, float T,
                                   const double * u, float p_min, int want_conf, int32_t * tokens, int32_t * n_out,
                                   float * q, float * conf) {
    const int32_t s = blockIdx.x;
    const int32_t * c = cand + (size_t) s * n * K;
    const float * sc = scores + (size_t) s * n * K * K;
    int32_t prev = 0, k = 0;
    for (; k < n; k++) {
        const float * row = sc + ((size_t) k * K + prev) * K;
        int32_t best;
        if (T > 0.0f) {
            best = dflash_sample_k(row, K, T, u[(size_t) s * n + k], q + ((size_t) s * n + k) * K);
        } else {
            best = dflash_argmax_k(row, K);
            if (p_min > 0.0f || want_conf) {
                const float cf = dflash_softmax_at_k(row, K, best);
                if (cf < p_min) break;
                if (want_conf) conf[(size_t) s * n + k] = cf;
            }
        }
        tokens[(size_t) s * n + k] = c[(size_t) k * K + best];
        prev = best;
    }
    n_out[s] = k;
}

int32_t dflash_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); // clear the sticky "no driver / no device" error
        return 0;
    }
    return n;
}

void dflash_cuda_ctx_free(struct dflash_cuda_ctx * ctx) {
    if (!ctx) return;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(ctx->device);
    if (ctx->buf) cudaFree(ctx->buf);
    if (ctx->stream) cudaStreamDestroy(ctx->stream);
    cudaSetDevice(prev);
    delete ctx;
}

// The device holding `ptr` (a ggml CUDA buffer's memory), made current.
static int32_t device_of(const void * ptr, int * device, char * err, size_t err_len) {
    cudaPointerAttributes attr;
    CHECK(cudaPointerGetAttributes(&attr, ptr), "locating the drafter's lattice");
    if (attr.type != cudaMemoryTypeDevice) {
        if (err && err_len) snprintf(err, err_len, "CUDA: the drafter's lattice is not in device memory");
        return -1;
    }
    *device = attr.device;
    CHECK(cudaSetDevice(attr.device), "selecting the drafter's device");
    return 0;
}

static int32_t check_args(const struct dflash_cuda_walk_args * a, char * err, size_t err_len) {
    if (a->n_seq < 1 || a->n < 1 || a->K < 1 || a->K > DFLASH_CUDA_MAX_K) {
        if (err && err_len) {
            snprintf(err, err_len, "CUDA walk: bad shape (n_seq %d, n %d, K %d; K <= %d)", a->n_seq, a->n, a->K,
                     DFLASH_CUDA_MAX_K);
        }
        return -1;
    }
    if (a->temperature > 0.0f && !a->u) {
        if (err && err_len) snprintf(err, err_len, "CUDA walk: a sampled walk needs its uniforms");
        return -1;
    }
    return 0;
}

int32_t dflash_cuda_walk(struct dflash_cuda_ctx ** pctx, const struct dflash_cuda_walk_args * a, int32_t * out_tokens,
                         int32_t * out_n, float * out_q, float * out_conf, char * err, size_t err_len) {
    if (check_args(a, err, err_len)) return -1;
    int device = 0;
    if (device_of(a->cand, &device, err, err_len)) return -1;
    struct dflash_cuda_ctx * ctx = *pctx;
    if (ctx && ctx->device != device) {
        dflash_cuda_ctx_free(ctx);
        *pctx = ctx = NULL;
        CHECK(cudaSetDevice(device), "selecting the drafter's device");
    }
    if (!ctx) {
        ctx = new dflash_cuda_ctx();
        ctx->device = device;
        CHECK(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking), "creating the walk's stream");
        *pctx = ctx;
    }
    const bool sampled = a->temperature > 0.0f;
    const size_t nt = (size_t) a->n_seq * a->n, nq = sampled ? nt * a->K : 0;
    // layout: u (double) | tokens | n_out | conf | q
    const size_t off_tok = sizeof(double) * (sampled ? nt : 0);
    const size_t off_n = off_tok + sizeof(int32_t) * nt;
    const size_t off_conf = off_n + sizeof(int32_t) * a->n_seq;
    const size_t off_q = off_conf + sizeof(float) * nt;
    const size_t need = off_q + sizeof(float) * nq;
    if (need > ctx->buf_size) {
        if (ctx->buf) cudaFree(ctx->buf);
        ctx->buf = NULL;
        ctx->buf_size = 0;
        CHECK(cudaMalloc(&ctx->buf, need), "allocating the walk's outputs");
        ctx->buf_size = need;
    }
    char * b = (char *) ctx->buf;
    if (sampled) CHECK(cudaMemcpyAsync(b, a->u, sizeof(double) * nt, cudaMemcpyHostToDevice, ctx->stream), "uniforms");
    walk_kernel<<<a->n_seq, 1, 0, ctx->stream>>>(a->cand, a->scores, a->n, a->K, sampled ? a->temperature : 0.0f,
                                                 (const double *) b, a->p_min, a->want_conf ? 1 : 0,
                                                 (int32_t *) (b + off_tok), (int32_t *) (b + off_n),
                                                 (float *) (b + off_q), (float *) (b + off_conf));
    CHECK(cudaGetLastError(), "launching the walk");
    CHECK(cudaMemcpyAsync(out_tokens, b + off_tok, sizeof(int32_t) * nt, cudaMemcpyDeviceToHost, ctx->stream), "ids");
    CHECK(cudaMemcpyAsync(out_n, b + off_n, sizeof(int32_t) * a->n_seq, cudaMemcpyDeviceToHost, ctx->stream), "counts");
    if (out_conf && !sampled) {
        CHECK(cudaMemcpyAsync(out_conf, b + off_conf, sizeof(float) * nt, cudaMemcpyDeviceToHost, ctx->stream), "conf");
    }
    if (out_q && sampled) {
        CHECK(cudaMemcpyAsync(out_q, b + off_q, sizeof(float) * nq, cudaMemcpyDeviceToHost, ctx->stream), "q");
    }
    CHECK(cudaStreamSynchronize(ctx->stream), "running the walk");
    return 0;
}

int32_t dflash_cuda_walk_host(const struct dflash_cuda_walk_args * a, int32_t * out_tokens, int32_t * out_n,
                              float * out_q, float * out_conf, char * err, size_t err_len) {
    if (check_args(a, err, err_len)) return -1;
    if (dflash_cuda_device_count() < 1) {
        if (err && err_len) snprintf(err, err_len, "CUDA: no device visible to this process");
        return -1;
    }
    const size_t nc = (size_t) a->n_seq * a->n * a->K;
    int32_t * d_cand = NULL;
    float * d_scores = NULL;
    CHECK(cudaMalloc(&d_cand, sizeof(int32_t) * nc), "allocating the lattice");
    const cudaError_t e = cudaMalloc(&d_scores, sizeof(float) * nc * a->K);
    if (e != cudaSuccess) {
        cudaFree(d_cand);
        set_err(err, err_len, "allocating the lattice", e);
        return -1;
    }
    struct dflash_cuda_walk_args dev = *a;
    dev.cand = d_cand;
    dev.scores = d_scores;
    struct dflash_cuda_ctx * ctx = NULL;
    int32_t rc = -1;
    if (cudaMemcpy(d_cand, a->cand, sizeof(int32_t) * nc, cudaMemcpyHostToDevice) == cudaSuccess &&
        cudaMemcpy(d_scores, a->scores, sizeof(float) * nc * a->K, cudaMemcpyHostToDevice) == cudaSuccess) {
        rc = dflash_cuda_walk(&ctx, &dev, out_tokens, out_n, out_q, out_conf, err, err_len);
    } else {
        set_err(err, err_len, "copying the lattice", cudaGetLastError());
    }
    dflash_cuda_ctx_free(ctx);
    cudaFree(d_cand);
    cudaFree(d_scores);
    return rc;
}
