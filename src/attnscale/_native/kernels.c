/* attnscale's compiled kernels: fused per-row softmax statistics for attnscale.monitor, alone or
 * with the block's softmax weights (rowstats_kernel.h), the elementwise part of the soft-cap
 * attention kernel (softcap_kernel.h), the row entropy and log-sum-exp of adaptive temperature
 * and its bfloat16 screen (entropy_kernel.h), the bfloat16 row max of the S_max screen
 * (peak_kernel.h), the per-row steps of softpick and stick-breaking attention
 * (rectified_kernel.h), qk-rmsnorm's RMSNorm forward and backward (rownorm_kernel.h), and two
 * whole block loops on OpenMP threads with the caller's sgemm: the monitor's softmax with its
 * row statistics and the S_max rows (below, in this file).
 *
 * Row statistics: one call reduces a block of attention logits (rows x width, float32, row
 * stride ld) to the per-row statistics of attnscale.stats in two streaming passes over each row
 * (a third for the rare near-one-hot row), instead of the twenty-odd whole-tensor passes of the
 * PyTorch formulation.  The numerics are those of attnscale.stats: everything is centred on the
 * top logit z_t, with
 *     u_i = exp(z_i - z_ref)  for every non-top key,
 *     m   = exp(z_ref - z_t),  S = m U1,  p_t = 1 / (1 + S),
 *     H   = log1p(S) - p_t m sum_i u_i (z_i - z_t),
 *     |J| = p_t m sqrt(p_t^2 U1^2 + (1 + 2 p_t^2) U2 - 2 p_t m U3 + (p_t m U2)^2),
 * where U_k = sum_{i != t} u_i^k and z_ref = z_t while the largest u is at least 2^-40 (every
 * u^k a normal float), else z_ref = z_2, the largest logit below the top (then U_k >= 1): nothing
 * cancels and nothing underflows near one-hot (rowstats_kernel.h).
 * The logit std is the corrected two-pass formula around the row mean.
 *
 * Masked keys are -inf logits, and optionally every column at or beyond a per-row limit
 * (causal attention).  A row with no key gets count 0 and statistics 0; a row with a NaN or +inf
 * logit counts it as a key and gets NaN statistics.
 *
 * Plain C with GCC/Clang vector extensions and no Python or PyTorch headers: the library is
 * loaded with ctypes, and the caller splits rows across threads (ctypes releases the GIL).
 * Float partial sums are folded into double every CHUNK keys.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#define CHUNK 512    /* keys per float partial sum */
#define SUM_SCALE 0x1p-32f  /* exact scale of pass 1's float sums: 512 * FLT_MAX * 2^-32 is finite */

/* Output columns, in this order (ROW_STATS_COLUMNS on the Python side). */
enum { OUT_COUNT, OUT_MAX_WEIGHT, OUT_ENTROPY, OUT_JACOBIAN_FRO, OUT_LOGIT_STD, OUT_LOGIT_ABSMAX,
       OUT_LOGIT_MAX, OUT_COLUMNS };

/* Portable build: 128-bit vectors (SSE2 on x86-64, NEON on arm64). */
#define W 4
#define KERNEL(x) x##_v128
#include "kernel_set.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* AVX2 + FMA build, chosen at run time when the CPU has both. */
#define HAVE_AVX2_BUILD 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#define W 8
#define KERNEL(x) x##_avx2
#include "kernel_set.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

/* AVX-512 build (16 floats per vector), chosen at run time when the CPU has AVX512F, DQ and BW
 * besides AVX2 and FMA: about 1.5x the AVX2 build on the exp-bound kernels (measured). */
#define HAVE_AVX512_BUILD 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")
#endif
#define W 16
#define KERNEL(x) x##_avx512
#include "kernel_set.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

typedef void (*row_fn)(const float *, int64_t, double *);
typedef void (*softmax_row_fn)(const float *, int64_t, int64_t, double *, float *, float *);
typedef void (*softcap_exp_fn)(const float *, int64_t, int64_t, float, float *, float *);
typedef void (*softcap_bwd_fn)(float *, float *, const float *, float, float, int64_t, int64_t);
typedef void (*entropy_fn)(const float *, int64_t, double *);
typedef void (*bf16_entropy_fn)(const uint16_t *, int64_t, float, double *);
typedef float (*bf16_max_fn)(const uint16_t *, int64_t);
typedef void (*softpick_probs_fn)(const float *, int64_t, int64_t, float *, float *);
typedef void (*softpick_grad_fn)(const float *, float *, const float *, float, int64_t, int64_t);
typedef void (*sb_probs_fn)(const float *, int64_t, int64_t, float *);
typedef void (*sb_grad_fn)(const float *, float *, float *, int64_t, int64_t);
typedef void (*rownorm_fwd_fn)(const float *, float *, float *, const float *, int64_t, int64_t,
                               int64_t, const int64_t *, const int64_t *, int64_t, int, float,
                               float, int64_t, int64_t);
typedef void (*rownorm_bwd_fn)(const float *, const float *, float *, const float *,
                               const float *, double *, float *, int64_t, int64_t, int64_t,
                               const int64_t *, const int64_t *, const int64_t *, int64_t, int,
                               float, int64_t, int64_t, int64_t);

/* The widest build any call runs (2 = AVX-512, 1 = AVX2, 0 = the portable one), set by the loader
 * from ATTNSCALE_ISA: to time the narrower builds, as an older CPU runs them, on a wider one. */
static int isa_cap = 2;

void attnscale_cap_isa(int level) { isa_cap = level < 0 ? 0 : (level > 2 ? 2 : level); }

/* The build a call runs: 2 = AVX-512, 1 = AVX2, 0 = the portable 128-bit one.  ``portable`` caps
 * it: 0 = the best this CPU runs, 1 = the portable build, 2 = AVX2 at most (to test each). */
static int build_level(int portable) {
#ifdef HAVE_AVX2_BUILD
    if (portable == 1 || isa_cap == 0) return 0;
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
    if (portable == 2 || isa_cap == 1) return 1;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")
           && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") ? 2 : 1;
#else
    (void)portable;
    return 0;
#endif
}

#ifdef HAVE_AVX2_BUILD
#define PICK(name, portable) (build_level(portable) == 2 ? name##_avx512 \
                              : build_level(portable) == 1 ? name##_avx2 : name##_v128)
#else
#define PICK(name, portable) name##_v128
#endif

/* Name of the instruction set the kernels run on: "avx512", "avx2" or "v128". */
const char *attnscale_kernels_isa(void) {
    static const char *names[] = {"v128", "avx2", "avx512"};
    return names[build_level(0)];
}

/* Whether the CPU has AVX512_BF16 (bfloat16 dot products, AMD Zen 4 and later, Intel Cooper Lake
 * and Sapphire Rapids): oneDNN then runs a bfloat16 q k^T about 4x faster than float32 (80 ->
 * 346 GFLOPS on one core of an AMD EPYC Zen 5, measured), as AMX does on Intel. */
int attnscale_cpu_bf16(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
    return 0;
#endif
}

static int64_t row_limit(const int64_t *limit, int64_t period, int64_t r, int64_t width) {
    if (!limit) return width;
    int64_t l = limit[r % period];
    return l < 0 ? 0 : (l < width ? l : width);
}

/* Statistics of rows [row0, row1) of z.  Row r reads columns [0, n_r) with
 * n_r = limit ? clamp(limit[r % period], 0, width) : width.  out: OUT_COLUMNS doubles per row.
 * portable: which build (see build_level). */
void attnscale_row_stats(const float *z, int64_t width, int64_t ld, const int64_t *limit,
                         int64_t period, int64_t row0, int64_t row1, double *out, int portable) {
    row_fn one_row = PICK(one_row, portable);
    for (int64_t r = row0; r < row1; r++)
        one_row(z + r * ld, row_limit(limit, period, r, width), out + r * OUT_COLUMNS);
}

int attnscale_row_stats_columns(void) { return OUT_COLUMNS; }

/* Softmax forward of rows [row0, row1) of z with their statistics (rows as for
 * attnscale_row_stats): e = exp(z - m), 0 beyond each row's n_r keys (to width); out:
 * OUT_COLUMNS doubles per row; stats: (m, 1 / sum e) per row (two floats).  e must not be z. */
void attnscale_softmax_rows(const float *z, float *e, int64_t width, int64_t ld,
                            const int64_t *limit, int64_t period, int64_t row0, int64_t row1,
                            double *out, float *stats, int portable) {
    softmax_row_fn row = PICK(softmax_row, portable);
    for (int64_t r = row0; r < row1; r++)
        row(z + r * ld, row_limit(limit, period, r, width), width, out + r * OUT_COLUMNS,
            e + r * ld, stats + 2 * r);
}

/* Fortran-interface sgemm (column-major), the one PyTorch's CPU library exports; its integer
 * arguments are passed as pointers to int64_t holding values below 2^31, which an LP64 library
 * (32-bit integers, the low half on little-endian x86-64 and arm64) and an ILP64 one read alike. */
typedef void (*sgemm_fn)(const char *, const char *, const int64_t *, const int64_t *,
                         const int64_t *, const float *, const float *, const int64_t *,
                         const float *, const int64_t *, const float *, float *,
                         const int64_t *);

/* Whether this build spreads attnscale_softmax_rows_attention's blocks over OpenMP threads.  It
 * is linked against libgomp by soname, so in a process where PyTorch (built with GNU OpenMP) has
 * loaded its own libgomp.so.1, both share one runtime and one thread team: the team PyTorch's
 * ops just ran on picks the blocks up while it would otherwise spin-wait (libgomp's default spin
 * count; on 2 cores a second pool of threads lost about 9 ms a layer of the monitor to it). */
int attnscale_openmp(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

/* Calls fn(thread, threads) once on each thread of an OpenMP team of `threads` opened on the
 * calling thread (once, fn(0, 1), without OpenMP): attnscale.kernels.team runs its Python
 * workers on PyTorch's own threads this way, rather than on a second pool of threads that would
 * compete with the team's spin-wait. */
typedef void (*team_fn)(int, int);

void attnscale_team(int threads, team_fn fn) {
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (threads > 1)
    fn(omp_get_thread_num(), omp_get_num_threads());
#else
    (void)threads;
    fn(0, 1);
#endif
}

/* The block loops below hand their blocks to `threads` OpenMP threads one at a time, in order
 * (none without OpenMP); each thread works in its own part of the caller's scratch. */
#if defined(_OPENMP)
#define BLOCKS_PARALLEL(threads) \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)")
#else
#define BLOCKS_PARALLEL(threads)
#endif

static float *thread_scratch(float *scratch, int64_t per_thread) {
#if defined(_OPENMP)
    return scratch + (int64_t)omp_get_thread_num() * per_thread;
#else
    (void)per_thread;
    return scratch;
#endif
}

/* Softmax attention with every row's statistics, block by block, in one call: the whole loop of
 * attnscale.kernels.softmax_rows, without a return to Python between blocks.  Block c of
 * `blocks` is (batch, head, first query, queries), four int64; it sees keys [0, n_c) with
 * n_c = n_k, or under top-left causality min(n_k, first query + queries), and query i of it keys
 * [0, min(n_k, i + 1)).  Per block:
 *     z = scale q kᵀ      (sgemm, into z: queries x n_c, row stride n_c)
 *     e, stats, rows      (the softmax_row pass: e = exp(z - m), the row's statistics)
 *     o = (e v) / sum e   (sgemm, then each row times stats[1]).
 * q, k, v, o: float32 with unit stride along their last dimension and the given (batch, head,
 * token) strides in elements; rows: float64, OUT_COLUMNS contiguous per query, strides likewise.
 * scratch: `threads` x per_thread floats, per_thread >= 2 x queries x n_k + 2 x queries of the
 * largest block.  threads: OpenMP threads to spread the blocks over, dynamically in the given
 * order (largest first balances best); 1 without OpenMP.  gemm: a sgemm_fn. */
void attnscale_softmax_rows_attention(const float *q, const float *k, const float *v, float *o,
                                      double *rows, const int64_t *strides, int64_t d,
                                      int64_t dv, int64_t n_k, int64_t causal, float scale,
                                      const int64_t *blocks, int64_t count, float *scratch,
                                      int64_t per_thread, int threads, void *gemm,
                                      int portable) {
    softmax_row_fn row = PICK(softmax_row, portable);
    sgemm_fn sgemm = (sgemm_fn)gemm;
    /* strides: q, k, v, o, rows, each (batch, head, token) */
    const int64_t *qs = strides, *ks = strides + 3, *vs = strides + 6, *os = strides + 9,
                  *rs = strides + 12;
    int64_t largest = 0;
    for (int64_t c = 0; c < count; c++)
        if (blocks[4 * c + 3] > largest) largest = blocks[4 * c + 3];
    BLOCKS_PARALLEL(threads)
    for (int64_t c = 0; c < count; c++) {
        const float one = 1.0f, zero = 0.0f;
        float scale_ = scale;
        int64_t d_ = d, dv_ = dv;
        float *z = thread_scratch(scratch, per_thread);
        float *e = z + largest * n_k, *stats = e + largest * n_k;
        int64_t b = blocks[4 * c], h = blocks[4 * c + 1], i0 = blocks[4 * c + 2];
        int64_t nr = blocks[4 * c + 3];
        int64_t nb = causal ? (i0 + nr < n_k ? i0 + nr : n_k) : n_k;
        const float *qb = q + b * qs[0] + h * qs[1] + i0 * qs[2];
        const float *kb = k + b * ks[0] + h * ks[1];
        const float *vb = v + b * vs[0] + h * vs[1];
        float *ob = o + b * os[0] + h * os[1] + i0 * os[2];
        double *rb = rows + b * rs[0] + h * rs[1] + i0 * rs[2];
        int64_t ldq = qs[2], ldk = ks[2], ldv = vs[2], ldo = os[2];
        if (nb > 0 && d_ > 0) {
            /* row-major z (nr x nb) = q kᵀ is column-major zᵀ = kᵀ' q', k and q read as
             * column-major (d x nb) and (d x nr) with their token strides */
            sgemm("T", "N", &nb, &nr, &d_, &scale_, kb, &ldk, qb, &ldq, &zero, z, &nb);
        } else {
            for (int64_t i = 0; i < nr * nb; i++) z[i] = 0.0f;
        }
        for (int64_t r = 0; r < nr; r++) {
            int64_t n_r = causal ? (i0 + r + 1 < nb ? i0 + r + 1 : nb) : nb;
            row(z + r * nb, n_r, nb, rb + r * rs[2], e + r * nb, stats + 2 * r);
        }
        if (nb > 0 && dv_ > 0) {
            /* row-major o (nr x dv) = e v is column-major oᵀ = vᵀ eᵀ */
            sgemm("N", "N", &dv_, &nr, &nb, &one, vb, &ldv, e, &nb, &zero, ob, &ldo);
            for (int64_t r = 0; r < nr; r++) {
                float w = stats[2 * r + 1];
                float *orow = ob + r * ldo;
                for (int64_t j = 0; j < dv_; j++) orow[j] *= w;
            }
        } else {
            for (int64_t r = 0; r < nr; r++)
                for (int64_t j = 0; j < dv_; j++) ob[r * ldo + j] = 0.0f;
        }
    }
}

/* The extremes of one row of n float32 logits: *top = max, *low = min, both NaN where a logit
 * is NaN; -inf and +inf for a row without a key.  Written as compares and selects so that the
 * compiler vectorises them. */
static void row_extremes(const float *z, int64_t n, float *top, float *low) {
    float hi = -INFINITY, lo = INFINITY;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        float x = z[i];
        hi = x > hi ? x : hi;
        lo = x < lo ? x : lo;
        nan |= x != x;
    }
    *top = nan ? NAN : hi;
    *low = nan ? NAN : lo;
}

/* The largest and smallest raw logit q kᵀ of every query over the keys it attends (all n_k, or
 * under top-left causality keys [0, min(n_k, i + 1)) for query i), block by block in one call,
 * for attnscale.kernels.peak's S_max.  Blocks as for attnscale_softmax_rows_attention (batch,
 * head, first query, queries); query head h reads key head h / group (grouped-query attention).
 * q, k: float32, unit stride along d, (batch, head, token) strides in `strides` (q's three,
 * then k's).  top, low: float32 (B, H, Nq) contiguous, n_h heads and n_q queries.  scratch:
 * `threads` x per_thread floats, per_thread >= queries x n_k of the largest block. */
void attnscale_peak_rows(const float *q, const float *k, const int64_t *strides, int64_t d,
                         int64_t n_k, int64_t causal, int64_t group, const int64_t *blocks,
                         int64_t count, float *top, float *low, int64_t n_h, int64_t n_q,
                         float *scratch, int64_t per_thread, int threads, void *gemm) {
    sgemm_fn sgemm = (sgemm_fn)gemm;
    const int64_t *qs = strides, *ks = strides + 3;
    BLOCKS_PARALLEL(threads)
    for (int64_t c = 0; c < count; c++) {
        const float one = 1.0f, zero = 0.0f;
        int64_t d_ = d;
        float *z = thread_scratch(scratch, per_thread);
        int64_t b = blocks[4 * c], h = blocks[4 * c + 1], i0 = blocks[4 * c + 2];
        int64_t nr = blocks[4 * c + 3];
        int64_t nb = causal ? (i0 + nr < n_k ? i0 + nr : n_k) : n_k;
        const float *qb = q + b * qs[0] + h * qs[1] + i0 * qs[2];
        const float *kb = k + b * ks[0] + (h / group) * ks[1];
        int64_t ldq = qs[2], ldk = ks[2];
        if (nb > 0 && d_ > 0) {
            sgemm("T", "N", &nb, &nr, &d_, &one, kb, &ldk, qb, &ldq, &zero, z, &nb);
        } else {
            for (int64_t i = 0; i < nr * nb; i++) z[i] = 0.0f;
        }
        float *tb = top + (b * n_h + h) * n_q + i0, *lb = low + (b * n_h + h) * n_q + i0;
        for (int64_t r = 0; r < nr; r++) {
            int64_t n_r = causal ? (i0 + r + 1 < nb ? i0 + r + 1 : nb) : nb;
            row_extremes(z + r * nb, n_r, tb + r, lb + r);
        }
    }
}

/* Version of the kernels' contract, checked by the loader against a stale build: 2 = soft-cap
 * on tanh with NaN propagation (1 was 2c sigmoid(2x)), 3 = the signed top logit column,
 * 4 = attnscale_row_entropy and attnscale_bf16_row_max, 5 = the softpick and stick-breaking
 * steps, 6 = the RMSNorm kernels, attnscale_cpu_bf16 and the soft-cap forward keeping each
 * row's max and 1 / sum, with a one-pass backward (attnscale_softcap_exp, _backward, in place
 * of attnscale_softcap_probs, _grad) and attnscale_bf16_row_entropy, 7 = attnscale_softmax_rows
 * (the softmax forward with the row statistics), 8 = attnscale_softmax_rows_attention (its whole
 * block loop, with the caller's sgemm), attnscale_peak_rows, attnscale_openmp and
 * attnscale_team. */
int attnscale_kernels_version(void) { return 8; }

/* Soft-cap forward of rows [row0, row1) (n_r keys as for attnscale_row_stats): e = exp(cap
 * tanh(s) - m) unnormalised, stats (m, 1 / sum) per row (two floats); e may be s. */
void attnscale_softcap_exp(const float *s, float *e, int64_t width, int64_t ld,
                           const int64_t *limit, int64_t period, int64_t row0, int64_t row1,
                           float cap, float *stats, int portable) {
    softcap_exp_fn row = PICK(softcap_exp_row, portable);
    for (int64_t r = row0; r < row1; r++)
        row(s + r * ld, row_limit(limit, period, r, width), width, cap, e + r * ld, stats + 2 * r);
}

/* Soft-cap backward of rows [row0, row1) in one pass, from the forward's stats:
 * s <- p, dp <- p (dp - delta[r]) (1 - tanh^2 s). */
void attnscale_softcap_backward(float *s, float *dp, const float *stats, const float *delta,
                                int64_t width, int64_t ld, const int64_t *limit, int64_t period,
                                int64_t row0, int64_t row1, float cap, int portable) {
    softcap_bwd_fn row = PICK(softcap_backward_row, portable);
    for (int64_t r = row0; r < row1; r++)
        row(s + r * ld, dp + r * ld, stats + 2 * r, delta[r], cap,
            row_limit(limit, period, r, width), width);
}

/* Entropy and log-sum-exp of softmax over rows [row0, row1) of z (columns as for
 * attnscale_row_stats); out: two doubles (H, lse) per row. */
void attnscale_row_entropy(const float *z, int64_t width, int64_t ld, const int64_t *limit,
                           int64_t period, int64_t row0, int64_t row1, double *out,
                           int portable) {
    entropy_fn row = PICK(entropy_row, portable);
    for (int64_t r = row0; r < row1; r++)
        row(z + r * ld, row_limit(limit, period, r, width), out + 2 * r);
}

/* Entropy, largest logit and the logits' standard deviation under softmax over rows
 * [row0, row1) of scale times bfloat16 z (columns as for attnscale_row_stats, scale > 0); out:
 * three doubles per row. */
void attnscale_bf16_row_entropy(const uint16_t *z, int64_t width, int64_t ld,
                                const int64_t *limit, int64_t period, int64_t row0, int64_t row1,
                                float scale, double *out, int portable) {
    bf16_entropy_fn row = PICK(bf16_entropy_row, portable);
    for (int64_t r = row0; r < row1; r++)
        row(z + r * ld, row_limit(limit, period, r, width), scale, out + 3 * r);
}

/* Max of each of rows [row0, row1) of bfloat16 z (rows of stride ld, width keys): out[r]. */
void attnscale_bf16_row_max(const uint16_t *z, int64_t width, int64_t ld, int64_t row0,
                            int64_t row1, float *out, int portable) {
    bf16_max_fn row = PICK(bf16_row_max, portable);
    for (int64_t r = row0; r < row1; r++) out[r] = row(z + r * ld, width);
}

/* Softpick weights of rows [row0, row1) of s (see rectified_kernel.h): p over each row's first
 * n_r keys (n_r as for attnscale_row_stats), 0 beyond; stats: (M, D) per row.  p may be s. */
void attnscale_softpick_probs(const float *s, float *p, int64_t width, int64_t ld,
                              const int64_t *limit, int64_t period, int64_t row0, int64_t row1,
                              float *stats, int portable) {
    softpick_probs_fn row = PICK(softpick_probs_row, portable);
    for (int64_t r = row0; r < row1; r++)
        row(s + r * ld, row_limit(limit, period, r, width), width, p + r * ld, stats + 2 * r);
}

/* Softpick backward of rows [row0, row1), in place on dp, from the forward's (M, D) per row and
 * delta[r] = sum_j dp_j p_j. */
void attnscale_softpick_grad(const float *s, float *dp, const float *stats, const float *delta,
                             int64_t width, int64_t ld, const int64_t *limit, int64_t period,
                             int64_t row0, int64_t row1, int portable) {
    softpick_grad_fn row = PICK(softpick_grad_row, portable);
    for (int64_t r = row0; r < row1; r++)
        row(s + r * ld, dp + r * ld, stats + 2 * r, delta[r],
            row_limit(limit, period, r, width), width);
}

/* Stick-breaking weights of rows [row0, row1) of s into p (not s), keys in order. */
void attnscale_stick_breaking_probs(const float *s, float *p, int64_t width, int64_t ld,
                                    const int64_t *limit, int64_t period, int64_t row0,
                                    int64_t row1, int portable) {
    sb_probs_fn row = PICK(stick_breaking_probs_row, portable);
    for (int64_t r = row0; r < row1; r++)
        row(s + r * ld, row_limit(limit, period, r, width), width, p + r * ld);
}

/* Stick-breaking backward of rows [row0, row1), in place on dp; p (the weights) is overwritten. */
void attnscale_stick_breaking_grad(const float *s, float *p, float *dp, int64_t width, int64_t ld,
                                   const int64_t *limit, int64_t period, int64_t row0,
                                   int64_t row1, int portable) {
    sb_grad_fn row = PICK(stick_breaking_grad_row, portable);
    for (int64_t r = row0; r < row1; r++)
        row(s + r * ld, p + r * ld, dp + r * ld, row_limit(limit, period, r, width), width);
}

/* RMSNorm forward of tokens [t0, t1) (see rownorm_kernel.h): x (rows of d floats at a xs[0] +
 * h xs[1] + c xs[2]) -> y (strides ys), rho per row or, grouped, per token over its n_h rows;
 * w the gain (row h at w + h w_h) or NULL. */
void attnscale_rownorm_forward(const float *x, float *y, float *rho, const float *w, int64_t d,
                               int64_t n_h, int64_t n_c, const int64_t *xs, const int64_t *ys,
                               int64_t w_h, int grouped, float m, float eps, int64_t t0,
                               int64_t t1, int portable) {
    rownorm_fwd_fn run = PICK(rownorm_forward, portable);
    run(x, y, rho, w, d, n_h, n_c, xs, ys, w_h, grouped, m, eps, t0, t1);
}

/* RMSNorm backward of tokens [t0, t1): dx from x, g and the forward's rho; the gain's gradient
 * added into dw (doubles, NULL: none) through the float scratch part, folded at every multiple
 * of fold (>= 1) tokens. */
void attnscale_rownorm_backward(const float *x, const float *g, float *dx, const float *rho,
                                const float *w, double *dw, float *part, int64_t d, int64_t n_h,
                                int64_t n_c, const int64_t *xs, const int64_t *gs,
                                const int64_t *dxs, int64_t w_h, int grouped, float m, int64_t fold,
                                int64_t t0, int64_t t1, int portable) {
    rownorm_bwd_fn run = PICK(rownorm_backward, portable);
    run(x, g, dx, rho, w, dw, part, d, n_h, n_c, xs, gs, dxs, w_h, grouped, m, fold, t0, t1);
}
