/* Vector helpers shared by the kernels, included once per instruction set by kernels.c with
 *   W          floats per vector (8 for AVX2, 4 for the portable 128-bit build),
 *   KERNEL(x)  x with the instruction set's suffix.
 * vf / vi stay defined for the kernel headers included after this one; kernels.c undefines them.
 */
#define vf KERNEL(vf)
#define vi KERNEL(vi)
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

static inline vf KERNEL(splat)(float x) { vf v = {0}; return v + x; }
static inline vf KERNEL(sel)(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* max(a, b) lane by lane, b where either is NaN: one instruction on x86 (maxps keeps its second
 * operand when one is NaN) and a compare and select elsewhere. */
static inline vf KERNEL(vmax)(vf a, vf b) {
#if defined(__x86_64__) && W == 16
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__x86_64__) && W == 8
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#elif defined(__x86_64__) && W == 4
    return (vf)_mm_max_ps((__m128)a, (__m128)b);
#else
    return KERNEL(sel)(a > b, a, b);
#endif
}

/* Whether any lane of a comparison mask is set: one test instruction on x86. */
static inline int KERNEL(any)(vi mask) {
#if defined(__x86_64__) && W == 16
    return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#elif defined(__x86_64__) && W == 8
    return !_mm256_testz_si256((__m256i)mask, (__m256i)mask);
#elif defined(__x86_64__) && W == 4
    return _mm_movemask_ps((__m128)mask) != 0;
#else
    int any = 0;
    for (int j = 0; j < W; j++) any |= mask[j] != 0;
    return any;
#endif
}

/* Lane indices 0, 1, ..., W - 1. */
static inline vi KERNEL(iota)(void) {
    vi v;
    for (int j = 0; j < W; j++) v[j] = j;
    return v;
}

/* W keys from i on; keys at or beyond n read as -inf (masked). */
static inline vf KERNEL(load)(const float *z, int64_t i, int64_t n) {
    vf v;
    if (i + W <= n) {
        memcpy(&v, z + i, sizeof v);
    } else {
        for (int j = 0; j < W; j++) v[j] = i + j < n ? z[i + j] : -INFINITY;
    }
    return v;
}

/* Store v's first min(W, n - i) lanes at z + i. */
static inline void KERNEL(store)(float *z, int64_t i, int64_t n, vf v) {
    if (i + W <= n) {
        memcpy(z + i, &v, sizeof v);
    } else {
        for (int j = 0; i + j < n; j++) z[i + j] = v[j];
    }
}

static inline double KERNEL(hsum)(vf v) {
    double s = 0.0;
    for (int j = 0; j < W; j++) s += v[j];
    return s;
}

/* For -87 <= x <= 0: x = k ln2 + r with |r| <= ln2 / 2; returns expm1(r) from the degree-5
 * minimax polynomial of Cephes' expf, exp(r) = 1 + r + r^2 P(r), and 2^k in *two_k. */
static inline vf KERNEL(expm1_reduced)(vf x, vf *two_k) {
    vf kf = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi), vf);
    vf r = x - kf * 0.693359375f - kf * -2.12194440e-4f;
    vf p = KERNEL(splat)(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    *two_k = (vf)((__builtin_convertvector(kf, vi) + 127) << 23);  /* 2^k, k in [-126, 0] */
    return p * (r * r) + r;
}

/* exp(x) for x <= 0, x = -inf allowed, within ~2 ulp; 0 below -87, where exp(x) < 1.7e-38 and,
 * added to a sum >= 1, changes nothing.  NaN stays NaN.  On AVX-512 the same reduction and
 * polynomial with one rounding instruction for k and VSCALEFPS for 2^k (about a third fewer
 * instructions than building 2^k from its bits). */
#if defined(__x86_64__) && W == 16
static inline vf KERNEL(exp_nonpositive)(vf x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __m512 xv = (__m512)x;
    __mmask16 keep = _mm512_cmp_ps_mask(xv, lo, _CMP_NLT_UQ);    /* x >= -87 or NaN */
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), xv);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return (vf)_mm512_maskz_scalef_ps(keep, e, k);
}
#else
static inline vf KERNEL(exp_nonpositive)(vf x) {
    const vf lo = KERNEL(splat)(-87.0f);
    vi tiny = x < lo;
    vf two_k, q = KERNEL(expm1_reduced)(KERNEL(sel)(tiny, lo, x), &two_k);
    return KERNEL(sel)(tiny, KERNEL(splat)(0.0f), (q + 1.0f) * two_k);
}
#endif
