/* The RMSNorm kernels of qk-rmsnorm (see kernels.c and attnscale/mechanisms/rownorm.py), included
 * after simd.h once per instruction set.
 *
 * y = w * x * rho,  rho = (sum x^2 / m + eps)^(-1/2), the sum over one row of d values (per head)
 * or over the H rows of one token (over the model).  Backward, with gw = w * g and
 * dot = sum gw x over the same rows:
 *     dx = rho gw - (rho^3 dot / m) x,     dw += rho g x  (summed over every row sharing w).
 * One pass over x (forward) and one over x and g (backward), whatever the layouts of x, g and the
 * outputs: each row is d unit-stride floats, rows addressed by (a, h, c) strides.
 */

/* d floats from p, the tail read as 0. */
static inline vf KERNEL(load0)(const float *p, int64_t i, int64_t d) {
    vf v;
    if (i + W <= d) {
        memcpy(&v, p + i, sizeof v);
    } else {
        for (int j = 0; j < W; j++) v[j] = i + j < d ? p[i + j] : 0.0f;
    }
    return v;
}

/* sum of squares of one row of d floats. */
static inline float KERNEL(sum_squares)(const float *x, int64_t d) {
    vf acc = KERNEL(splat)(0.0f);
    for (int64_t i = 0; i < d; i += W) {
        vf v = KERNEL(load0)(x, i, d);
        acc += v * v;
    }
    float s = 0.0f;
    for (int j = 0; j < W; j++) s += acc[j];
    return s;
}

/* y_row = (x_row * rho) * w (w NULL: 1), rounding as x * rho then * w. */
static inline void KERNEL(scale_row)(const float *x, float *y, const float *w, float rho,
                                     int64_t d) {
    const vf r = KERNEL(splat)(rho);
    for (int64_t i = 0; i < d; i += W) {
        vf v = KERNEL(load0)(x, i, d) * r;
        if (w) v *= KERNEL(load0)(w, i, d);
        KERNEL(store)(y, i, d, v);
    }
}

/* Forward over tokens [t0, t1) of the (a, c) grid (token t = a * n_c + c); each token has n_h
 * rows h, at x + a xs[0] + h xs[1] + c xs[2] (floats).  grouped: one rho per token over its n_h
 * rows (rho[a n_c + c]); else one per row (rho[(a n_h + h) n_c + c]).  w: the gain, row h's at
 * w + h w_h (w_h = 0: shared), or NULL. */
static void KERNEL(rownorm_forward)(const float *x, float *y, float *rho, const float *w,
                                    int64_t d, int64_t n_h, int64_t n_c, const int64_t *xs,
                                    const int64_t *ys, int64_t w_h, int grouped, float m,
                                    float eps, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        int64_t a = t / n_c, c = t % n_c;
        const float *xt = x + a * xs[0] + c * xs[2];
        float *yt = y + a * ys[0] + c * ys[2];
        if (grouped) {
            double ss = 0.0;
            for (int64_t h = 0; h < n_h; h++) ss += KERNEL(sum_squares)(xt + h * xs[1], d);
            float r = (float)(1.0 / sqrt(ss / m + eps));
            rho[t] = r;
            for (int64_t h = 0; h < n_h; h++)
                KERNEL(scale_row)(xt + h * xs[1], yt + h * ys[1], w ? w + h * w_h : NULL, r, d);
        } else {
            for (int64_t h = 0; h < n_h; h++) {
                double ss = KERNEL(sum_squares)(xt + h * xs[1], d);
                float r = (float)(1.0 / sqrt(ss / m + eps));
                rho[(a * n_h + h) * n_c + c] = r;
                KERNEL(scale_row)(xt + h * xs[1], yt + h * ys[1], w ? w + h * w_h : NULL, r, d);
            }
        }
    }
}

/* acc += part in double; part zeroed. */
static inline void KERNEL(fold)(double *acc, float *part, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        acc[i] += part[i];
        part[i] = 0.0f;
    }
}

/* sum_i (w_i g_i) x_i of one row (w NULL: 1). */
static inline float KERNEL(gain_dot)(const float *g, const float *x, const float *w, int64_t d) {
    vf acc = KERNEL(splat)(0.0f);
    for (int64_t i = 0; i < d; i += W) {
        vf gw = KERNEL(load0)(g, i, d);
        if (w) gw *= KERNEL(load0)(w, i, d);
        acc += gw * KERNEL(load0)(x, i, d);
    }
    float s = 0.0f;
    for (int j = 0; j < W; j++) s += acc[j];
    return s;
}

/* dx_row = rho (w g) - k x, and dw_row += rho g x (dw NULL: not wanted); dw holds d floats. */
static inline void KERNEL(grad_row)(const float *x, const float *g, float *dx, const float *w,
                                    float *dw, float rho, float k, int64_t d) {
    const vf r = KERNEL(splat)(rho), vk = KERNEL(splat)(k);
    for (int64_t i = 0; i < d; i += W) {
        vf xv = KERNEL(load0)(x, i, d), gv = KERNEL(load0)(g, i, d);
        vf gw = w ? gv * KERNEL(load0)(w, i, d) : gv;
        KERNEL(store)(dx, i, d, gw * r - vk * xv);
        if (dw) KERNEL(store)(dw, i, d, KERNEL(load0)(dw, i, d) + r * gv * xv);
    }
}

/* Backward over tokens [t0, t1) (geometry as for the forward; g, dx with their own strides).
 * dw: NULL, or n_w rows of d doubles (n_w = 1 for a shared gain, n_h else) that row h's
 * rho g x is added to (row h of dw when w_h > 0, row 0 else), through the float rows of
 * ``part`` (n_w d floats, zero on entry and on return), folded into dw at every token index that
 * is a multiple of ``fold`` (so the float sums do not depend on how the caller splits the tokens
 * when it splits at such multiples); the caller gives each thread its own dw and part and sums
 * the dw. */
static void KERNEL(rownorm_backward)(const float *x, const float *g, float *dx, const float *rho,
                                     const float *w, double *dw, float *part, int64_t d,
                                     int64_t n_h,
                                     int64_t n_c, const int64_t *xs, const int64_t *gs,
                                     const int64_t *dxs, int64_t w_h, int grouped, float m,
                                     int64_t fold, int64_t t0, int64_t t1) {
    const int64_t n_w = w_h ? n_h : 1;
    for (int64_t t = t0; t < t1; t++) {
        if (dw && t % fold == 0 && t > t0) KERNEL(fold)(dw, part, n_w * d);
        int64_t a = t / n_c, c = t % n_c;
        const float *xt = x + a * xs[0] + c * xs[2], *gt = g + a * gs[0] + c * gs[2];
        float *dxt = dx + a * dxs[0] + c * dxs[2];
        if (grouped) {
            float r = rho[t], dot = 0.0f;
            for (int64_t h = 0; h < n_h; h++)
                dot += KERNEL(gain_dot)(gt + h * gs[1], xt + h * xs[1], w ? w + h * w_h : NULL, d);
            float k = (float)((double)r * r * r * dot / m);
            for (int64_t h = 0; h < n_h; h++)
                KERNEL(grad_row)(xt + h * xs[1], gt + h * gs[1], dxt + h * dxs[1],
                                 w ? w + h * w_h : NULL, dw ? part + (w_h ? h * d : 0) : NULL,
                                 r, k, d);
        } else {
            for (int64_t h = 0; h < n_h; h++) {
                float r = rho[(a * n_h + h) * n_c + c];
                const float *wr = w ? w + h * w_h : NULL;
                float dot = KERNEL(gain_dot)(gt + h * gs[1], xt + h * xs[1], wr, d);
                KERNEL(grad_row)(xt + h * xs[1], gt + h * gs[1], dxt + h * dxs[1], wr,
                                 dw ? part + (w_h ? h * d : 0) : NULL, r,
                                 (float)((double)r * r * r * dot / m), d);
            }
        }
    }
    if (dw) KERNEL(fold)(dw, part, n_w * d);
}
