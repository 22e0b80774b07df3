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
static inline vf KERNEL(tanh_expm1)(vf x) {
    const vi none = {0}, sign_bit = none + INT32_MIN;   /* splat(-0.0f) would be +0.0f */
    vi sign = (vi)x & sign_bit;
    vf ax = (vf)((vi)x & ~sign_bit);
    vf e = KERNEL(expm1_nonpositive)(-2.0f * ax);
    vf t = (vf)((vi)(-e / (2.0f + e)) | sign);
    return KERNEL(sel)(x != x, x, t);
}

/* tanh(x): for |x| < 0.625 Cephes' tanhf polynomial, x + x^3 P(x^2) (relative error ~1e-7, no
 * cancellation: it is x times a factor in (0.83, 1]), 6 multiply-adds; a vector with any lane at
 * or beyond 0.625 (or NaN) takes tanh_expm1 there.  The soft-cap's logits are scale q.k / c, so
 * with c = 50 every logit below 31 in magnitude takes the polynomial. */
static inline vf KERNEL(tanh)(vf x) {
    const vi none = {0}, sign_bit = none + INT32_MIN;
    vf ax = (vf)((vi)x & ~sign_bit);
    vi big = ~(ax < 0.625f);                         /* NaN lanes too */
    vf z = x * x;
    vf p = KERNEL(splat)(-5.70498872745e-3f);
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    vf t = p * z * x + x;
    return KERNEL(any)(big) ? KERNEL(sel)(big, KERNEL(tanh_expm1)(x), t) : t;
}

/* One row of the forward: e[j] = exp(c tanh(s[j]) - m) over the first n keys with s > -inf, 0
 * elsewhere (to width), m the row's largest c tanh(s); stats = (m, 1 / sum_j e[j]), so that the
 * weights are e * stats[1].  A row holding NaN among its first n keys gives NaN there and
 * stats (NaN, NaN); a row without a key gives zeros and stats (-inf, 0).  e may be s. */
static void KERNEL(softcap_exp_row)(const float *s, int64_t n, int64_t width, float cap, float *e,
                                    float *stats) {
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
        KERNEL(store)(e, i, n, z);
    }
    float m = -INFINITY;
    int nan = 0;
    for (j = 0; j < W; j++) {
        m = vmax[j] > m ? vmax[j] : m;
        nan |= vnan[j] != 0;
    }
    for (i = n; i < width; i++) e[i] = 0.0f;
    if (nan || m == -INFINITY) {                 /* NaN in: NaN out; no key: zero weights */
        for (i = 0; i < n; i++) e[i] = nan ? NAN : 0.0f;
        stats[0] = nan ? NAN : -INFINITY;
        stats[1] = nan ? NAN : 0.0f;
        return;
    }
    const vf vm = KERNEL(splat)(m);
    vf vsum = zero;
    double sum = 0.0;
    for (i = 0; i < n; i += W) {                 /* e = exp(z - max); masked: exp(-inf) = 0 */
        vf x = KERNEL(exp_nonpositive)(KERNEL(load)(e, i, n) - vm);
        vsum += x;
        KERNEL(store)(e, i, n, x);
        if ((i / W) % (CHUNK / W) == CHUNK / W - 1) { sum += KERNEL(hsum)(vsum); vsum = zero; }
    }
    sum += KERNEL(hsum)(vsum);
    stats[0] = m;
    stats[1] = (float)(1.0 / sum);               /* sum >= 1: the top key contributes e^0 */
}

/* One row of the backward, from the forward's stats = (m, 1 / sum): with t = tanh(s[j]) and
 * p = exp(c t - m) / sum over the first n keys with s > -inf (0 elsewhere, to width),
 *     s[j] <- p,   dp[j] <- p (dp[j] - delta) (1 - t^2),
 * the weights and the gradient with respect to s / c in one pass (the caller applies scale). */
static void KERNEL(softcap_backward_row)(float *s, float *dp, const float *stats, float delta,
                                         float cap, int64_t n, int64_t width) {
    const vf ninf = KERNEL(splat)(-INFINITY), zero = KERNEL(splat)(0.0f);
    const vf one = KERNEL(splat)(1.0f), vc = KERNEL(splat)(cap);
    const vf vm = KERNEL(splat)(stats[0]), inv = KERNEL(splat)(stats[1]);
    const vf vd = KERNEL(splat)(delta);
    /* keys [0, n) are seen; a row without a key (m = -inf) sees none */
    const vi iota = KERNEL(iota)();
    const int32_t seen_n = stats[0] != -INFINITY ? (int32_t)n : 0;
    for (int64_t i = 0; i < width; i += W) {
        vf v = KERNEL(load)(s, i, width);
        vf t = KERNEL(tanh)(v);
        vf p = KERNEL(exp_nonpositive)(KERNEL(sel)(v == ninf, ninf, vc * t - vm)) * inv;
        p = KERNEL(sel)(iota + (int32_t)i < seen_n, p, zero);
        /* tanh(-inf) = -1: a masked key's 1 - t^2 is 0 */
        vf g = p * (KERNEL(load)(dp, i, width) - vd) * (one - t * t);
        KERNEL(store)(s, i, width, p);
        KERNEL(store)(dp, i, width, g);
    }
}
