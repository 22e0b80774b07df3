/* The row-statistics kernel (see kernels.c), included after simd.h once per instruction set. */
static void KERNEL(one_row)(const float *z, int64_t n, double *out) {
    const vf ninf = KERNEL(splat)(-INFINITY), pinf = KERNEL(splat)(INFINITY);
    const vf zero = KERNEL(splat)(0.0f), one = KERNEL(splat)(1.0f);
    int64_t i, c0;
    int j;
    for (j = 0; j < OUT_COLUMNS; j++) out[j] = 0.0;

    /* Pass 1, per lane: the top logit, how often it occurs, the largest logit below it, the
     * smallest valid logit, the number of valid keys, their sum (scaled by the exact power of two
     * SUM_SCALE so that no float partial sum overflows) and the number of NaN logits. */
    vf top = ninf, ntop = zero, below = ninf, vmin = pinf, vcnt = zero, vbad = zero;
    double sum = 0.0, count = 0.0, bad = 0.0;
    for (c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        vf vsum = zero;
        for (i = c0; i < c1; i += W) {
            vf v = KERNEL(load)(z, i, c1);
            vbad += KERNEL(sel)(v != v, one, zero);
            vi ok = v > ninf, up = v > top;
            vi tie = ok & (v == top), second = (v < top) & (v > below);
            below = KERNEL(sel)(up, top, KERNEL(sel)(second, v, below));
            ntop = KERNEL(sel)(up, one, ntop + KERNEL(sel)(tie, one, zero));
            top = KERNEL(sel)(up, v, top);
            vmin = KERNEL(sel)(ok & (v < vmin), v, vmin);
            vcnt += KERNEL(sel)(ok, one, zero);
            vsum += KERNEL(sel)(ok, v * SUM_SCALE, zero);
        }
        sum += KERNEL(hsum)(vsum) / SUM_SCALE;
        count += KERNEL(hsum)(vcnt);
        bad += KERNEL(hsum)(vbad);
        vcnt = zero;
        vbad = zero;
    }
    if (count == 0.0 && bad == 0.0) return;
    float zmax = -INFINITY, zmin = INFINITY, zsec = -INFINITY;
    for (j = 0; j < W; j++) zmax = top[j] > zmax ? top[j] : zmax;
    if (bad > 0.0 || zmax == INFINITY) {  /* NaN or +inf logits: no distribution; say so */
        out[OUT_COUNT] = count + bad;
        for (j = OUT_COUNT + 1; j < OUT_COLUMNS; j++) out[j] = NAN;
        return;
    }
    double ties = 0.0;
    for (j = 0; j < W; j++) {
        float lane_below = top[j] < zmax ? top[j] : below[j];
        zsec = lane_below > zsec ? lane_below : zsec;
        ties += top[j] == zmax ? ntop[j] : 0.0f;
        zmin = vmin[j] < zmin ? vmin[j] : zmin;
    }
    double amax = fabs((double)zmax), amin = fabs((double)zmin);
    out[OUT_COUNT] = count;
    out[OUT_LOGIT_ABSMAX] = amax > amin ? amax : amin;
    out[OUT_LOGIT_MAX] = (double)zmax;       /* signed: the top logit, QK-Clip's S_max */
    out[OUT_MAX_WEIGHT] = 1.0;
    if (count == 1.0) return;  /* one key: weight 1, entropy 0, Jacobian 0, std 0 */

    /* Pass 2: u_i = exp(z_i - z_2) over the keys below the top (masked keys give u = 0; every
     * other tie at the top adds u = 1 and z - z_t = 0), and the sums of (z - mean) / 2^e and its
     * square over the valid keys for the corrected two-pass variance, with 2^e >= max |z| / 2 an
     * exact power of two so the squares neither overflow nor lose precision. */
    const float zref = ties >= 2.0 ? zmax : zsec;
    const vf vtop = KERNEL(splat)(zmax), vref = KERNEL(splat)(zref);
    const vf vlowest = KERNEL(splat)(-FLT_MAX);
    const vf vmean = KERNEL(splat)((float)(sum / count));
    int e;
    frexp(out[OUT_LOGIT_ABSMAX], &e);        /* e = 0 when every logit is 0 */
    e = e < -100 ? -100 : e;                 /* 2^-e stays a finite float */
    const double unit = ldexp(1.0, e);
    const vf vinv = KERNEL(splat)((float)(1.0 / unit));
    const vf vmean_unit = vmean * vinv;      /* |z / 2^e| < 1: differences cannot overflow */
    double U1 = ties - 1.0, U2 = ties - 1.0, U3 = ties - 1.0, Ud = 0.0, s1 = 0.0, s2 = 0.0;
    for (c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        vf vu1 = zero, vu2 = zero, vu3 = zero, vud = zero, vs1 = zero, vs2 = zero;
        for (i = c0; i < c1; i += W) {
            vf v = KERNEL(load)(z, i, c1);
            vi ok = v > ninf, low = v < vtop;
            vf u = KERNEL(exp_nonpositive)(KERNEL(sel)(low, v - vref, ninf));
            vf d = KERNEL(sel)(low & ok, v - vtop, zero);
            d = KERNEL(sel)(d < vlowest, vlowest, d);   /* z - z_t beyond -FLT_MAX: finite */
            vf c = KERNEL(sel)(ok, v * vinv - vmean_unit, zero);
            vf u2 = u * u;
            vu1 += u;
            vu2 += u2;
            vu3 += u2 * u;
            vud += u * d;
            vs1 += c;
            vs2 += c * c;
        }
        U1 += KERNEL(hsum)(vu1);
        U2 += KERNEL(hsum)(vu2);
        U3 += KERNEL(hsum)(vu3);
        Ud += KERNEL(hsum)(vud);
        s1 += KERNEL(hsum)(vs1);
        s2 += KERNEL(hsum)(vs2);
    }
    double var = (s2 - s1 * s1 / count) / (count - 1.0);
    out[OUT_LOGIT_STD] = var > 0.0 ? sqrt(var) * unit : 0.0;

    double m = exp((double)zref - (double)zmax);
    double S = m * U1;
    double pt = 1.0 / (1.0 + S);
    double pm = pt * m;
    double inner = (pt * U1) * (pt * U1) + (1.0 + 2.0 * pt * pt) * U2 - 2.0 * pm * U3
                   + (pm * U2) * (pm * U2);
    out[OUT_MAX_WEIGHT] = pt;
    out[OUT_ENTROPY] = log1p(S) - pm * Ud;
    out[OUT_JACOBIAN_FRO] = pm * sqrt(inner > 0.0 ? inner : 0.0);
}

