/* The per-row steps of the softpick and stick-breaking attention kernels (see kernels.c and
 * attnscale/kernels/softpick.py, stick_breaking.py), included after simd.h and softcap_kernel.h
 * once per instruction set.  Each row holds the logits of one query against its keys, -inf where a
 * key is masked; only the first n keys of a width-long row are seen (causality as a count), the
 * rest get weight and gradient 0.
 *
 * Softpick (Zuhri et al. 2025, arXiv 2504.20966), with M = max(0, max_j z_j) and c = e^{-M}:
 *     u_j = e^{z_j - M} - c,  D = sum_j |u_j| + eps c,  p_j = max(u_j, 0) / D,
 *     dz_j = (e^{z_j - M} / D) ([u_j > 0] g_j - sgn(u_j) delta),  delta = sum_i g_i p_i.
 * Stick-breaking (Tan et al. 2024, arXiv 2410.17980), keys in order, the nearest last:
 *     log p_j = z_j - sp(z_j) - sum_{k > j} sp(z_k),  sp = softplus,
 *     dz_k = g_k p_k (1 - b_k) - b_k sum_{j < k} g_j p_j,  b = sigmoid(z).
 * The two scans over a row run as SCAN_LANES independent chains over contiguous segments of it
 * (float adds do not wait on each other), joined by each segment's offset afterwards.
 */

#ifndef ATTNSCALE_RECTIFIED_ONCE
#define ATTNSCALE_RECTIFIED_ONCE
#define SCAN_LANES 4
/* Softpick's epsilon (SOFTPICK_EPS in attnscale/kernels/softpick.py). */
#define SOFTPICK_EPS_F 1e-8f
#endif

/* log1p(x) for 0 <= x <= 1 within ~2 ulp: u = 1 + x = 2^e (1 + f) with f in [sqrt(1/2) - 1,
 * sqrt 2 - 1], log(1 + f) from Cephes' logf polynomial, and (x - (u - 1)) / u restoring what the
 * rounding of u lost (the classic log1p correction). */
static inline vf KERNEL(log1p_unit)(vf x) {
    const vf one = KERNEL(splat)(1.0f);
    vf u = one + x;
    vi big = u > 1.41421356237f;
    vf e = KERNEL(sel)(big, one, KERNEL(splat)(0.0f));
    vf f = KERNEL(sel)(big, 0.5f * u, u) - one;
    vf z = f * f;
    vf y = KERNEL(splat)(7.0376836292e-2f);
    y = y * f - 1.1514610310e-1f;
    y = y * f + 1.1676998740e-1f;
    y = y * f - 1.2420140846e-1f;
    y = y * f + 1.4249322787e-1f;
    y = y * f - 1.6668057665e-1f;
    y = y * f + 2.0000714765e-1f;
    y = y * f - 2.4999993993e-1f;
    y = y * f + 3.3333331174e-1f;
    y = y * f * z;
    y += e * -2.12194440e-4f;
    y += -0.5f * z;
    vf r = f + y + e * 0.693359375f;
    return r + (x - (u - one)) / u;
}

/* e^{-|z|}: 0 at z = -inf. */
static inline vf KERNEL(exp_neg_abs)(vf z) {
    const vi none = {0}, sign_bit = none + INT32_MIN;
    return KERNEL(exp_nonpositive)((vf)((vi)z | sign_bit));
}

/* softplus(z) = max(z, 0) + log1p(e^{-|z|}): 0 at -inf, NaN stays NaN. */
static inline vf KERNEL(softplus)(vf z) {
    vf e = KERNEL(exp_neg_abs)(z);
    vf pos = KERNEL(sel)(z > 0.0f, z, KERNEL(splat)(0.0f));
    vf sp = pos + KERNEL(log1p_unit)(e);
    return KERNEL(sel)(z != z, z, sp);
}

/* One softpick row: p[j] for the first n keys (0 beyond them, to width), stats = (M, D).
 * p may be s.  A row holding NaN among its keys is NaN there; a row without keys is 0. */
static void KERNEL(softpick_probs_row)(const float *s, int64_t n, int64_t width, float *p,
                                       float *stats) {
    const vf ninf = KERNEL(splat)(-INFINITY), zero = KERNEL(splat)(0.0f);
    int64_t i;
    int j;
    vf vmax = ninf;
    vi vnan = {0};
    for (i = 0; i < n; i += W) {
        vf z = KERNEL(load)(s, i, n);
        vnan |= z != z;
        vmax = KERNEL(sel)(z > vmax, z, vmax);
    }
    float m = 0.0f;                                   /* M = max(0, row max) */
    int nan = 0;
    for (j = 0; j < W; j++) {
        m = vmax[j] > m ? vmax[j] : m;
        nan |= vnan[j] != 0;
    }
    if (nan || m == INFINITY) {                       /* NaN (or +inf) in: NaN out */
        for (i = 0; i < n; i++) p[i] = NAN;
        for (i = n; i < width; i++) p[i] = 0.0f;
        stats[0] = stats[1] = NAN;
        return;
    }
    const float c = expf(-m);
    const vf vm = KERNEL(splat)(m), vc = KERNEL(splat)(c);
    vf vsum = zero;
    double sum = 0.0;
    for (i = 0; i < n; i += W) {                      /* u = e^{z - M} - c; |u| over keys */
        vf z = KERNEL(load)(s, i, n);
        vf u = KERNEL(exp_nonpositive)(z - vm) - vc;
        vf au = KERNEL(sel)(z == ninf, zero, KERNEL(sel)(u < 0.0f, -u, u));
        vsum += au;
        KERNEL(store)(p, i, n, u);
        if ((i / W) % (CHUNK / W) == CHUNK / W - 1) { sum += KERNEL(hsum)(vsum); vsum = zero; }
    }
    sum += KERNEL(hsum)(vsum);
    const float d = (float)(sum + (double)SOFTPICK_EPS_F * c);
    const vf inv = KERNEL(splat)(1.0f / d);
    for (i = 0; i < n; i += W) {                      /* p = max(u, 0) / D */
        vf u = KERNEL(load)(p, i, n);
        KERNEL(store)(p, i, n, KERNEL(sel)(u > 0.0f, u * inv, zero));
    }
    for (i = n; i < width; i++) p[i] = 0.0f;
    stats[0] = m;
    stats[1] = d;
}

/* One softpick backward row, in place on dp: dz = (e / D) ([u > 0] g - sgn(u) delta) over the
 * first n keys, 0 beyond them. */
static void KERNEL(softpick_grad_row)(const float *s, float *dp, const float *stats,
                                      float delta, int64_t n, int64_t width) {
    const vf zero = KERNEL(splat)(0.0f), one = KERNEL(splat)(1.0f);
    const float m = stats[0];
    const vf vm = KERNEL(splat)(m), vc = KERNEL(splat)(expf(-m));
    const vf inv = KERNEL(splat)(1.0f / stats[1]), vd = KERNEL(splat)(delta);
    for (int64_t i = 0; i < n; i += W) {
        vf z = KERNEL(load)(s, i, n);
        vf e = KERNEL(exp_nonpositive)(z - vm);
        vf u = e - vc;
        vf g = KERNEL(load)(dp, i, n);
        vf sgn = KERNEL(sel)(u > 0.0f, one, KERNEL(sel)(u < 0.0f, -one, zero));
        vf t = KERNEL(sel)(u > 0.0f, g, zero) - sgn * vd;
        KERNEL(store)(dp, i, n, e * inv * t);
    }
    for (int64_t i = n; i < width; i++) dp[i] = 0.0f;
}

/* Segment k of SCAN_LANES over n keys: [k L, min((k + 1) L, n)), L a multiple of W. */
static inline int64_t KERNEL(scan_len)(int64_t n) {
    int64_t len = (n + SCAN_LANES - 1) / SCAN_LANES;
    return (len + W - 1) / W * W;
}

/* One stick-breaking row: p[j] for the first n keys (0 beyond them, to width); p must not be s.
 * Pass 1 writes sp(z) to p; pass 2 (the suffix scan, SCAN_LANES chains) turns it into
 * -(sp_j + sum_{k > j, same segment} sp_k) with each segment's total kept; pass 3 adds z and the
 * later segments' totals and exponentiates. */
static void KERNEL(stick_breaking_probs_row)(const float *s, int64_t n, int64_t width,
                                             float *p) {
    int64_t i;
    for (i = 0; i < n; i += W) KERNEL(store)(p, i, n, KERNEL(softplus)(KERNEL(load)(s, i, n)));
    const int64_t len = KERNEL(scan_len)(n);
    float acc[SCAN_LANES] = {0.0f};
    for (int64_t o = len - 1; o >= 0; o--) {
        for (int k = 0; k < SCAN_LANES; k++) {
            int64_t j = k * len + o;
            if (j < n) {
                float t = p[j];
                p[j] = -(t + acc[k]);
                acc[k] += t;
            }
        }
    }
    float later = 0.0f;                               /* sp of the later segments */
    for (int k = SCAN_LANES - 1; k >= 0; k--) {
        const vf off = KERNEL(splat)(later);
        int64_t hi = (k + 1) * len < n ? (k + 1) * len : n;
        for (i = k * len; i < hi; i += W) {
            vf lp = KERNEL(load)(s, i, hi) + KERNEL(load)(p, i, hi) - off;
            /* log p <= 0 (a NaN stays NaN: exp_nonpositive's selects keep it) */
            vf q = KERNEL(exp_nonpositive)(KERNEL(sel)(lp > 0.0f, KERNEL(splat)(0.0f), lp));
            KERNEL(store)(p, i, hi, KERNEL(sel)(lp != lp, lp, q));
        }
        later += acc[k];
    }
    for (i = n; i < width; i++) p[i] = 0.0f;
}

/* One stick-breaking backward row, in place on dp (p is overwritten): with gp = g p,
 * dz_k = gp_k (1 - b_k) - b_k sum_{j < k} gp_j over the first n keys, 0 beyond them. */
static void KERNEL(stick_breaking_grad_row)(const float *s, float *p, float *dp, int64_t n,
                                            int64_t width) {
    int64_t i;
    const vf one = KERNEL(splat)(1.0f);
    for (i = 0; i < n; i += W)
        KERNEL(store)(dp, i, n, KERNEL(load)(dp, i, n) * KERNEL(load)(p, i, n));
    const int64_t len = KERNEL(scan_len)(n);
    float acc[SCAN_LANES] = {0.0f};
    for (int64_t o = 0; o < len; o++) {               /* p <- prefix sums within segments */
        for (int k = 0; k < SCAN_LANES; k++) {
            int64_t j = k * len + o;
            if (j < n) {
                p[j] = acc[k];
                acc[k] += dp[j];
            }
        }
    }
    float earlier = 0.0f;
    for (int k = 0; k < SCAN_LANES; k++) {
        const vf off = KERNEL(splat)(earlier);
        int64_t hi = (k + 1) * len < n ? (k + 1) * len : n;
        for (i = k * len; i < hi; i += W) {
            /* b = sigmoid(z) and 1 - b from e = e^{-|z|}: sigmoid(|z|) = 1 / (1 + e) and
             * sigmoid(-|z|) = e / (1 + e) */
            vf z = KERNEL(load)(s, i, hi), e = KERNEL(exp_neg_abs)(z);
            vf r = one / (one + e);
            vf hi_s = KERNEL(sel)(z != z, z, r), lo_s = KERNEL(sel)(z != z, z, e * r);
            vi pos = z >= 0.0f;
            vf b = KERNEL(sel)(pos, hi_s, lo_s), nb = KERNEL(sel)(pos, lo_s, hi_s);
            vf pre = KERNEL(load)(p, i, hi) + off;
            KERNEL(store)(dp, i, hi, KERNEL(load)(dp, i, hi) * nb - b * pre);
        }
        earlier += acc[k];
    }
    for (i = n; i < width; i++) dp[i] = 0.0f;
}
