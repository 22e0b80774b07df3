/* The soft-cap attention kernels (see kernels.c), included after simd.h once per instruction set.
 *
 * With s = 2 scale q.k / c (the caller folds 2 scale / c into q), the soft-capped logit is
 * c tanh(s / 2) = 2c sigmoid(s) - c, and softmax ignores the constant -c, so
 *     p = softmax(2c sigmoid(s)),
 *     dS = p (dP - delta) sigmoid(s) (1 - sigmoid(s))    (the caller applies the factor 4 scale).
 * sigmoid(s) = 1 / (1 + e^-s) for s >= 0 and e^s / (1 + e^s) below, so exp only sees -|s| <= 0.
 */

static inline vf KERNEL(sigmoid)(vf s) {
    const vf zero = KERNEL(splat)(0.0f), one = KERNEL(splat)(1.0f);
    vi neg = s < zero;
    vf e = KERNEL(exp_nonpositive)(KERNEL(sel)(neg, s, -s));
    return KERNEL(sel)(neg, e, one) / (one + e);
}

/* One row: p[j] = softmax over the first n keys (s > -inf) of 2c sigmoid(s); every other entry of
 * the width-long row is 0, and so is a row without a key.  p may be s. */
static void KERNEL(softcap_probs_row)(const float *s, int64_t n, int64_t width, float twoc,
                                      float *p) {
    const vf ninf = KERNEL(splat)(-INFINITY), zero = KERNEL(splat)(0.0f);
    const vf c2 = KERNEL(splat)(twoc);
    int64_t i;
    int j;
    vf vmax = ninf;
    for (i = 0; i < n; i += W) {                 /* z = 2c sigmoid(s), -inf where masked */
        vf v = KERNEL(load)(s, i, n);
        vf z = KERNEL(sel)(v > ninf, c2 * KERNEL(sigmoid)(v), ninf);
        vmax = KERNEL(sel)(z > vmax, z, vmax);
        KERNEL(store)(p, i, n, z);
    }
    float m = -INFINITY;
    for (j = 0; j < W; j++) m = vmax[j] > m ? vmax[j] : m;
    for (i = n; i < width; i++) p[i] = 0.0f;
    if (m == -INFINITY) {                        /* no key: no distribution, zero weights */
        for (i = 0; i < n; i++) p[i] = 0.0f;
        return;
    }
    const vf vm = KERNEL(splat)(m);
    vf vsum = zero;
    double sum = 0.0;
    for (i = 0; i < n; i += W) {                 /* e = exp(z - max); masked: exp(-inf) = 0 */
        vf e = KERNEL(exp_nonpositive)(KERNEL(load)(p, i, n) - vm);
        vsum += e;
        KERNEL(store)(p, i, n, e);
        if ((i / W) % (CHUNK / W) == CHUNK / W - 1) { sum += KERNEL(hsum)(vsum); vsum = zero; }
    }
    sum += KERNEL(hsum)(vsum);
    const float inv = (float)(1.0 / sum);       /* sum >= 1: the top key contributes e^0 */
    for (i = 0; i < n; i++) p[i] *= inv;
}

/* One row of the backward: dp[j] <- p[j] (dp[j] - delta) u (1 - u), u = sigmoid(s[j]), over the
 * whole width (p is 0 wherever a key is masked, so those entries become 0). */
static void KERNEL(softcap_grad_row)(const float *s, const float *p, float *dp, float delta,
                                     int64_t width) {
    const vf one = KERNEL(splat)(1.0f), zero = KERNEL(splat)(0.0f);
    const vf vd = KERNEL(splat)(delta);
    int64_t i;
    for (i = 0; i + W <= width; i += W) {
        vf vs, vp, vg;
        memcpy(&vs, s + i, sizeof vs);
        memcpy(&vp, p + i, sizeof vp);
        memcpy(&vg, dp + i, sizeof vg);
        vf u = KERNEL(sigmoid)(KERNEL(sel)(vs > KERNEL(splat)(-INFINITY), vs, zero));
        vg = vp * (vg - vd) * (u * (one - u));
        memcpy(dp + i, &vg, sizeof vg);
    }
    for (; i < width; i++) {
        float u = s[i] > -INFINITY ? 1.0f / (1.0f + expf(-s[i])) : 0.0f;
        dp[i] = p[i] * (dp[i] - delta) * (u * (1.0f - u));
    }
}
