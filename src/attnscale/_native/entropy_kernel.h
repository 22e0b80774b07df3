/* The row-entropy kernel (see kernels.c), included after simd.h once per instruction set.
 *
 * H and the log-sum-exp of softmax over one row, nothing else: adaptive temperature's statistics
 * pass.  Two streaming passes.  Pass 1 finds the top logit z_t (and NaN / +inf); pass 2 sums,
 * over the keys below the top, e_i = exp(z_i - z_t) and e_i (z_i - z_t), and counts the ties at
 * the top.  With S' = sum e_i and T = sum e_i (z_i - z_t):
 *     lse = z_t + log1p(ties - 1 + S'),   H = log1p(ties - 1 + S') - T / (ties + S').
 * The top key is left out of the float sums, so a near one-hot row keeps its tail mass instead
 * of rounding 1 + S' to 1; keys more than 87 below the top underflow to 0 and change H by less
 * than 1e-36.  out: two doubles (H, lse); a row with no key gets 0, 0, a row with a NaN or +inf
 * logit NaN, NaN. */
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
    int bad = 0;
    for (j = 0; j < W; j++) {
        zmax = top[j] > zmax ? top[j] : zmax;
        bad |= vbad[j] != 0;
    }
    if (bad || zmax == INFINITY) {
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
