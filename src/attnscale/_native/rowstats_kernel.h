/* The row-statistics kernel (see kernels.c), included after simd.h once per instruction set.
 *
 * Two streaming passes over a row, a third for the rare near-one-hot row.  Pass 1: the top
 * logit z_t, the smallest valid logit, the count and the sum of the valid keys.  Pass 2
 * (KERNEL(moments)): u_i = exp(z_i - z_ref) over the keys below the top and their sums, with
 * z_ref = z_t.  That keeps every sum a sum of normal floats while the largest u is at least
 * 2^-40 (u^3 >= 2^-120): a row whose keys all lie more than 27.7 below a single top key takes
 * a third pass for the largest logit below the top, z_2, and repeats pass 2 with z_ref = z_2,
 * where the largest u is 1 (as kernels.c's formulas assume in general: m = exp(z_ref - z_t)). */

#ifndef ATTNSCALE_ROWSTATS_ONCE
#define ATTNSCALE_ROWSTATS_ONCE
/* The smallest largest-u of the fast pass (see above). */
#define MOMENTS_MIN_U 0x1p-40f

/* Sums of pass 2 (see KERNEL(moments)). */
struct moments { double U1, U2, U3, Ud, s1, s2, ties; float umax; };
#endif

/* Pass 2 over a row: with u_i = exp(z_i - zref) for the keys below the top zmax (0 for masked
 * keys), d_i = z_i - zmax, c_i = z_i / 2^e - mean / 2^e over the valid keys:
 * U_k = sum u^k, Ud = sum u d, s1 = sum c, s2 = sum c^2, ties = #{z_i = zmax}, umax = max u.
 * e: NULL, or (when zref = zmax) where the softmax's unnormalised weights exp(z_i - zmax) go,
 * u_i below the top and 1 at it. */
static void KERNEL(moments)(const float *z, int64_t n, float zmax, float zref, float vinv_f,
                            float mean_unit, struct moments *m, float *e) {
    const vf ninf = KERNEL(splat)(-INFINITY), zero = KERNEL(splat)(0.0f);
    const vf one = KERNEL(splat)(1.0f);
    const vf vtop = KERNEL(splat)(zmax), vref = KERNEL(splat)(zref);
    const vf vlowest = KERNEL(splat)(-FLT_MAX);
    const vf vinv = KERNEL(splat)(vinv_f), vmean_unit = KERNEL(splat)(mean_unit);
    const int same = zref == zmax;
    vf vumax = zero;
    m->U1 = m->U2 = m->U3 = m->Ud = m->s1 = m->s2 = m->ties = 0.0;
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        vf vu1 = zero, vu2 = zero, vu3 = zero, vud = zero, vs1 = zero, vs2 = zero, vt = zero;
        for (int64_t i = c0; i < c1; i += W) {
            vf v = KERNEL(load)(z, i, c1);
            vi ok = v > ninf, low = v < vtop;
            vf d = v - vtop;                               /* -inf at masked keys */
            vf u = KERNEL(exp_nonpositive)(KERNEL(sel)(low, same ? d : v - vref, ninf));
            vf c = KERNEL(sel)(ok, v * vinv - vmean_unit, zero);
            vf u2 = u * u;
            vi at_top = v == vtop;
            if (e) KERNEL(store)(e, i, c1, KERNEL(sel)(at_top, one, u));
            vt += KERNEL(sel)(at_top, one, zero);
            vumax = KERNEL(vmax)(u, vumax);
            vu1 += u;
            vu2 += u2;
            vu3 += u2 * u;
            vud += u * KERNEL(vmax)(d, vlowest);           /* u = 0 where d = -inf or 0 */
            vs1 += c;
            vs2 += c * c;
        }
        m->U1 += KERNEL(hsum)(vu1);
        m->U2 += KERNEL(hsum)(vu2);
        m->U3 += KERNEL(hsum)(vu3);
        m->Ud += KERNEL(hsum)(vud);
        m->s1 += KERNEL(hsum)(vs1);
        m->s2 += KERNEL(hsum)(vs2);
        m->ties += KERNEL(hsum)(vt);
    }
    float umax = 0.0f;
    for (int j = 0; j < W; j++) umax = vumax[j] > umax ? vumax[j] : umax;
    m->umax = umax;
}

/* The statistics of one row of n keys into out (OUT_COLUMNS doubles).  w: NULL, or where the
 * row's unnormalised softmax weights exp(z_i - max z) go, written by the first pass 2 (a second
 * one near one-hot still reads z, so w must not be z). */
static void KERNEL(row_pass)(const float *z, int64_t n, double *out, float *w) {
    const vf ninf = KERNEL(splat)(-INFINITY), pinf = KERNEL(splat)(INFINITY);
    const vf zero = KERNEL(splat)(0.0f), one = KERNEL(splat)(1.0f);
    int64_t i, c0;
    int j;
    for (j = 0; j < OUT_COLUMNS; j++) out[j] = 0.0;

    /* Pass 1, per lane: the top logit, the smallest valid logit, the number of valid keys, their
     * sum (scaled by the exact power of two SUM_SCALE so that no float partial sum overflows)
     * and whether a logit is NaN. */
    vf top = ninf, vmin = pinf, vcnt = zero;
    vi vbad = {0};
    double sum = 0.0, count = 0.0;
    for (c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        vf vsum = zero;
        for (i = c0; i < c1; i += W) {
            vf v = KERNEL(load)(z, i, c1);
            vi ok = v > ninf;
            vbad |= v != v;
            top = KERNEL(vmax)(v, top);                    /* a NaN lane keeps top */
            vmin = KERNEL(sel)(ok & (v < vmin), v, vmin);
            vcnt += KERNEL(sel)(ok, one, zero);
            vsum += KERNEL(sel)(ok, v * SUM_SCALE, zero);
        }
        sum += KERNEL(hsum)(vsum) / SUM_SCALE;
        count += KERNEL(hsum)(vcnt);
        vcnt = zero;
    }
    float zmax = -INFINITY, zmin = INFINITY;
    int bad = KERNEL(any)(vbad);
    for (j = 0; j < W; j++) {
        zmax = top[j] > zmax ? top[j] : zmax;
        zmin = vmin[j] < zmin ? vmin[j] : zmin;
    }
    if (bad || zmax == INFINITY) {  /* NaN or +inf logits: no distribution; say so */
        double nans = 0.0;
        for (i = 0; i < n; i++) nans += z[i] != z[i];
        out[OUT_COUNT] = count + nans;
        for (j = OUT_COUNT + 1; j < OUT_COLUMNS; j++) out[j] = NAN;
        if (w)
            for (i = 0; i < n; i++) w[i] = NAN;
        return;
    }
    if (count == 0.0) {
        if (w)
            for (i = 0; i < n; i++) w[i] = 0.0f;
        return;
    }
    double amax = fabs((double)zmax), amin = fabs((double)zmin);
    out[OUT_COUNT] = count;
    out[OUT_LOGIT_ABSMAX] = amax > amin ? amax : amin;
    out[OUT_LOGIT_MAX] = (double)zmax;       /* signed: the top logit, QK-Clip's S_max */
    out[OUT_MAX_WEIGHT] = 1.0;
    if (count == 1.0) {  /* one key: weight 1, entropy 0, Jacobian 0, std 0 */
        if (w)
            for (i = 0; i < n; i++) w[i] = z[i] == zmax ? 1.0f : 0.0f;
        return;
    }

    /* Pass 2 (and 3 and 2 again near one-hot, see the top): u_i = exp(z_i - z_ref) over the keys
     * below the top (masked keys give u = 0; every other tie at the top adds u = 1 and
     * z - z_t = 0), and the sums of (z - mean) / 2^e and its square over the valid keys for the
     * corrected two-pass variance, with 2^e >= max |z| / 2 an exact power of two so the squares
     * neither overflow nor lose precision. */
    int e;
    frexp(out[OUT_LOGIT_ABSMAX], &e);        /* e = 0 when every logit is 0 */
    e = e < -100 ? -100 : e;                 /* 2^-e stays a finite float */
    const double unit = ldexp(1.0, e);
    const float vinv = (float)(1.0 / unit);
    const float mean_unit = (float)(sum / count) * vinv;   /* |z / 2^e| < 1: no overflow */
    struct moments mo;
    float zref = zmax;
    KERNEL(moments)(z, n, zmax, zref, vinv, mean_unit, &mo, w);
    if (mo.ties < 2.0 && mo.umax < MOMENTS_MIN_U) {
        /* a single top far above every other key: z_2, the largest logit below the top */
        vf below = ninf;
        const vf vtop = KERNEL(splat)(zmax);
        for (i = 0; i < n; i += W) {
            vf v = KERNEL(load)(z, i, n);
            below = KERNEL(sel)((v < vtop) & (v > below), v, below);
        }
        zref = -INFINITY;
        for (j = 0; j < W; j++) zref = below[j] > zref ? below[j] : zref;
        KERNEL(moments)(z, n, zmax, zref, vinv, mean_unit, &mo, NULL);
    }
    double ties = mo.ties;
    double U1 = mo.U1 + (ties - 1.0), U2 = mo.U2 + (ties - 1.0), U3 = mo.U3 + (ties - 1.0);
    double var = (mo.s2 - mo.s1 * mo.s1 / count) / (count - 1.0);
    out[OUT_LOGIT_STD] = var > 0.0 ? sqrt(var) * unit : 0.0;

    double m = exp((double)zref - (double)zmax);
    double S = m * U1;
    double pt = 1.0 / (1.0 + S);
    double pm = pt * m;
    double inner = (pt * U1) * (pt * U1) + (1.0 + 2.0 * pt * pt) * U2 - 2.0 * pm * U3
                   + (pm * U2) * (pm * U2);
    out[OUT_MAX_WEIGHT] = pt;
    out[OUT_ENTROPY] = log1p(S) - pm * mo.Ud;
    out[OUT_JACOBIAN_FRO] = pm * sqrt(inner > 0.0 ? inner : 0.0);
}

static void KERNEL(one_row)(const float *z, int64_t n, double *out) {
    KERNEL(row_pass)(z, n, out, NULL);
}

/* One row of the softmax forward with the row's statistics: e[i] = exp(z_i - m) over the first n
 * keys (0 at masked ones, and 0 from n to width), m the largest logit; out as KERNEL(one_row);
 * stats = (m, 1 / sum_i e_i), the weights being e * stats[1].  A row with a NaN or +inf logit
 * gives NaN weights and stats (NaN, NaN); a row without a key zeros and (-inf, 0).  e must not
 * be z. */
static void KERNEL(softmax_row)(const float *z, int64_t n, int64_t width, double *out, float *e,
                                float *stats) {
    KERNEL(row_pass)(z, n, out, e);
    for (int64_t i = n; i < width; i++) e[i] = 0.0f;
    double count = out[OUT_COUNT];
    if (count == 0.0) {
        stats[0] = -INFINITY;
        stats[1] = 0.0f;
    } else if (out[OUT_MAX_WEIGHT] != out[OUT_MAX_WEIGHT]) {
        stats[0] = stats[1] = NAN;
    } else {
        /* max weight = 1 / sum_i e_i, the top's weight (e = 1 there) */
        stats[0] = (float)out[OUT_LOGIT_MAX];
        stats[1] = (float)out[OUT_MAX_WEIGHT];
    }
}
