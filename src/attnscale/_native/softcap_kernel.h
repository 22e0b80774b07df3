/* The soft-cap attention kernels (see kernels.c), included after simd.h once per instruction set.
 *
 * With s = scale q.k / c (the caller folds scale / c into q), the soft-capped logit is
 * z = c tanh(s), so
 *     p  = softmax(c tanh(s)),
 *     dS = p (dP - delta) (1 - tanh^2(s))    (the caller applies the factor scale).
 * tanh is formed from one expm1 on -2|s| <= 0, so it keeps float32's relative accuracy for every
 * s, tiny ones included: c tanh(s) -> c s as c grows, without the cancellation of
 * 2c sigmoid(2s) - c.  A logit s = -inf marks a masked key; a NaN logit makes its row NaN.
 */

/* expm1(x) for x <= 0, x = -inf allowed, within a few ulp relative: with x = k ln2 + r,
 * expm1(x) = 2^k expm1(r) + (2^k - 1), exact for k = 0 and without cancellation below; -1 below
 * -87. */
static inline vf KERNEL(expm1_nonpositive)(vf x) {
    const vf lo = KERNEL(splat)(-87.0f);
    vi tiny = x < lo;
    vf two_k, q = KERNEL(expm1_reduced)(KERNEL(sel)(tiny, lo, x), &two_k);
    return KERNEL(sel)(tiny, KERNEL(splat)(-1.0f), two_k * q + (two_k - 1.0f));
}

/* tanh(x) = sign(x) (-e / (2 + e)), e = expm1(-2|x|) in [-1, 0]; NaN stays NaN. */
static inline vf KERNEL(tanh)(vf x) {
    const vi none = {0}, sign_bit = none + INT32_MIN;   /* splat(-0.0f) would be +0.0f */
    vi sign = (vi)x & sign_bit;
    vf ax = (vf)((vi)x & ~sign_bit);
    vf e = KERNEL(expm1_nonpositive)(-2.0f * ax);
    vf t = (vf)((vi)(-e / (2.0f + e)) | sign);
    return KERNEL(sel)(x != x, x, t);
}

/* One row: p[j] = softmax over the first n keys (s > -inf) of c tanh(s); every other entry of
 * the width-long row is 0, and so is a row without a key.  A row holding a NaN logit among its
 * first n keys is NaN over those keys.  p may be s. */
static void KERNEL(softcap_probs_row)(const float *s, int64_t n, int64_t width, float cap,
                                      float *p) {
    const vf ninf = KERNEL(splat)(-INFINITY), zero = KERNEL(splat)(0.0f);
    const vf vc = KERNEL(splat)(cap);
    int64_t i;
    int j;
    vf vmax = ninf;
    vi vnan = {0};
    for (i = 0; i < n; i += W) {                 /* z = c tanh(s), -inf where masked */
        vf v = KERNEL(load)(s, i, n);
        vf z = KERNEL(sel)(v == ninf, ninf, vc * KERNEL(tanh)(v));
        vnan |= z != z;
        vmax = KERNEL(sel)(z > vmax, z, vmax);
        KERNEL(store)(p, i, n, z);
    }
    float m = -INFINITY;
    int nan = 0;
    for (j = 0; j < W; j++) {
        m = vmax[j] > m ? vmax[j] : m;
        nan |= vnan[j] != 0;
    }
    for (i = n; i < width; i++) p[i] = 0.0f;
    if (nan || m == -INFINITY) {                 /* NaN in: NaN out; no key: zero weights */
        for (i = 0; i < n; i++) p[i] = nan ? NAN : 0.0f;
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

/* One row of the backward: dp[j] <- p[j] (dp[j] - delta) (1 - t^2), t = tanh(s[j]), over the
 * whole width (p is 0 wherever a key is masked, and tanh(-inf) = -1, so those entries become 0
 * unless dp or delta is NaN). */
static void KERNEL(softcap_grad_row)(const float *s, const float *p, float *dp, float delta,
                                     int64_t width) {
    const vf one = KERNEL(splat)(1.0f);
    const vf vd = KERNEL(splat)(delta);
    for (int64_t i = 0; i < width; i += W) {
        vf t = KERNEL(tanh)(KERNEL(load)(s, i, width));
        vf g = KERNEL(load)(p, i, width) * (KERNEL(load)(dp, i, width) - vd) * (one - t * t);
        KERNEL(store)(dp, i, width, g);
    }
}
