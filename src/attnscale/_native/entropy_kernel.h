/* The row-entropy kernels (see kernels.c), included after simd.h once per instruction set.
 *
 * H and the log-sum-exp of softmax over one row, nothing else: adaptive temperature's statistics
 * pass.  Two streaming passes.  Pass 1 finds the top logit z_t (and NaN / +inf); pass 2 sums,
 * over the keys below the top, e_i = exp(z_i - z_t) and e_i (z_i - z_t), and counts the ties at
 * the top.  With S' = sum e_i and T = sum e_i (z_i - z_t):
 *     lse = z_t + log1p(ties - 1 + S'),   H = log1p(ties - 1 + S') - T / (ties + S').
 * The top key is left out of the float sums, so a near one-hot row keeps its tail mass instead
 * of rounding 1 + S' to 1; keys more than 87 below the top underflow to 0 and change H by less
 * than 1e-36.  out: two doubles (H, lse); a row with no key gets 0, 0, a row with a NaN or +inf
 * logit NaN, NaN.
 *
 * The bfloat16 variant reads bfloat16 logits times a float scale (the bfloat16 screen of
 * attnscale.kernels.entropy) and gives H, the largest logit and the standard deviation of the
 * logits under the row's softmax (-inf and 0 without a key, NaN with a NaN).
 */

static void KERNEL(entropy_row)(const float *z, int64_t n, double *out) {
    const vf ninf = KERNEL(splat)(-INFINITY), zero = KERNEL(splat)(0.0f);
    const vf one = KERNEL(splat)(1.0f);
    int64_t i, c0;
    int j;
    out[0] = 0.0;
    out[1] = 0.0;

    vf top = ninf;
    vi vbad = {0};
    for (i = 0; i < n; i += W) {
        vf v = KERNEL(load)(z, i, n);
        vbad |= v != v;
        top = KERNEL(vmax)(v, top);     /* a NaN lane keeps top; vbad has it */
    }
    float zmax = -INFINITY;
    for (j = 0; j < W; j++) zmax = top[j] > zmax ? top[j] : zmax;
    if (KERNEL(any)(vbad) || zmax == INFINITY) {
        out[0] = NAN;
        out[1] = NAN;
        return;
    }
    if (zmax == -INFINITY) return;           /* no key */

    /* d = max(z - z_t, -FLT_MAX) is finite at masked keys (-inf) too, where exp gives 0 and
     * e d = 0; the top's own e = 1 is left out and counted as a tie. */
    const vf vtop = KERNEL(splat)(zmax), vlowest = KERNEL(splat)(-FLT_MAX);
    double S = 0.0, T = 0.0, ties = 0.0;
    for (c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        vf vs = zero, vt = zero, vties = zero;
        for (i = c0; i < c1; i += W) {
            vf v = KERNEL(load)(z, i, c1);
            vf d = KERNEL(vmax)(v - vtop, vlowest);
            vi tie = v == vtop;
            vf e = KERNEL(sel)(tie, zero, KERNEL(exp_nonpositive)(d));
            vs += e;
            vt += e * d;
            vties += KERNEL(sel)(tie, one, zero);
        }
        S += KERNEL(hsum)(vs);
        T += KERNEL(hsum)(vt);
        ties += KERNEL(hsum)(vties);
    }
    double l = log1p(ties - 1.0 + S);
    out[0] = l - T / (ties + S);
    out[1] = (double)zmax + l;
}

/* 2W bfloat16 logits from i on as two float vectors (*hi, *lo) in an order of their own (each
 * 32-bit lane holds two: the key at the higher address in the high half, little endian); keys
 * at or beyond n read as -inf.  Sums, maxima and ties do not depend on the order. */
typedef uint32_t KERNEL(vu) __attribute__((vector_size(W * sizeof(uint32_t))));
static inline void KERNEL(load_bf16_pairs)(const uint16_t *z, int64_t i, int64_t n, vf *hi,
                                           vf *lo) {
    const KERNEL(vu) high_half = (KERNEL(vu)){0} + 0xFFFF0000u;
    KERNEL(vu) u;
    if (i + 2 * W <= n) {
        memcpy(&u, z + i, sizeof u);
    } else {
        uint16_t tail[2 * W];
        for (int j = 0; j < 2 * W; j++) tail[j] = i + j < n ? z[i + j] : 0xFF80;   /* -inf */
        memcpy(&u, tail, sizeof u);
    }
    *hi = (vf)(u & high_half);
    *lo = (vf)(u << 16);
}

/* out: three doubles (H, largest logit, an upper bound on the standard deviation of the logits
 * under the row's softmax) of scale times bfloat16 z, scale > 0: H as entropy_row's, from
 * d = s (z - z_t); the variance is sum e d^2 / sum e - (sum e d / sum e)^2 over the same e. */
#ifndef ATTNSCALE_VAR_SLACK
#define ATTNSCALE_VAR_SLACK
#define VAR_SLACK 1e-4
#endif
static void KERNEL(bf16_entropy_row)(const uint16_t *z, int64_t n, float scale, double *out) {
    const vf ninf = KERNEL(splat)(-INFINITY), zero = KERNEL(splat)(0.0f);
    const vf one = KERNEL(splat)(1.0f);
    int64_t i, c0;
    int j;
    out[0] = 0.0;
    out[1] = -INFINITY;
    out[2] = 0.0;
    vf top = ninf, hi, lo;
    vi vbad = {0};
    for (i = 0; i < n; i += 2 * W) {
        KERNEL(load_bf16_pairs)(z, i, n, &hi, &lo);
        vbad |= (hi != hi) | (lo != lo);
        top = KERNEL(vmax)(KERNEL(vmax)(hi, lo), top);
    }
    float zmax = -INFINITY;
    for (j = 0; j < W; j++) zmax = top[j] > zmax ? top[j] : zmax;
    if (KERNEL(any)(vbad) || zmax == INFINITY) {
        out[0] = out[1] = out[2] = NAN;
        return;
    }
    if (zmax == -INFINITY) return;           /* no key */
    const vf vtop = KERNEL(splat)(zmax), vs_ = KERNEL(splat)(scale);
    const vf vlowest = KERNEL(splat)(-FLT_MAX);
    double S = 0.0, T = 0.0, T2 = 0.0, ties = 0.0;
    for (c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        vf vs = zero, vt = zero, vt2 = zero, vties = zero;
        for (i = c0; i < c1; i += 2 * W) {
            KERNEL(load_bf16_pairs)(z, i, c1, &hi, &lo);
            for (int half = 0; half < 2; half++) {
                vf v = half ? lo : hi;
                vf d = KERNEL(vmax)((v - vtop) * vs_, vlowest);
                vi tie = v == vtop;
                vf e = KERNEL(sel)(tie, zero, KERNEL(exp_nonpositive)(d));
                vf ed = e * d;
                vs += e;
                vt += ed;
                vt2 += ed * d;
                vties += KERNEL(sel)(tie, one, zero);
            }
        }
        S += KERNEL(hsum)(vs);
        T += KERNEL(hsum)(vt);
        T2 += KERNEL(hsum)(vt2);
        ties += KERNEL(hsum)(vties);
    }
    double l = log1p(ties - 1.0 + S), mass = ties + S, mean = T / mass, second = T2 / mass;
    double var = second - mean * mean;
    out[0] = l - mean;
    out[1] = (double)zmax * scale;
    /* the float partial sums err by at most 512 * 2^-24 relative each: VAR_SLACK of the second
     * moment covers what their rounding can take from the variance */
    out[2] = sqrt((var > 0.0 ? var : 0.0) + VAR_SLACK * second);
}
