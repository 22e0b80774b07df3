/* The bfloat16 row-max kernel (see kernels.c), included after simd.h once per instruction set:
 * the first pass of attnscale.kernels.peak's bfloat16 screen.  A bfloat16 is the top half of a
 * float32, so widening is a 16-bit shift; the max is that of the floats (-inf for a row of
 * masked keys or no key; NaN lanes are skipped, the caller checks finiteness). */
typedef uint32_t KERNEL(vu) __attribute__((vector_size(W * sizeof(uint32_t))));

/* Each 32-bit lane holds two bfloat16, the key at the lower address in the low half (little
 * endian): masking gives the high one as a float, shifting the low one, and the max needs no
 * order.  Four independent running maxima keep the loop off the compare's latency. */
static float KERNEL(bf16_row_max)(const uint16_t *z, int64_t n) {
    const KERNEL(vu) high_half = (KERNEL(vu)){0} + 0xFFFF0000u;
    vf top[4];
    for (int a = 0; a < 4; a++) top[a] = KERNEL(splat)(-INFINITY);
    int64_t i = 0;
    for (; i + 8 * W <= n; i += 8 * W) {
        for (int a = 0; a < 4; a++) {
            KERNEL(vu) u;
            memcpy(&u, z + i + 2 * W * a, sizeof u);
            vf pair = KERNEL(vmax)((vf)(u & high_half), (vf)(u << 16));
            top[a] = KERNEL(vmax)(pair, top[a]);
        }
    }
    for (; i + 2 * W <= n; i += 2 * W) {
        KERNEL(vu) u;
        memcpy(&u, z + i, sizeof u);
        top[0] = KERNEL(vmax)(KERNEL(vmax)((vf)(u & high_half), (vf)(u << 16)), top[0]);
    }
    vf all = KERNEL(vmax)(KERNEL(vmax)(top[0], top[1]), KERNEL(vmax)(top[2], top[3]));
    float best = -INFINITY;
    for (int j = 0; j < W; j++) best = all[j] > best ? all[j] : best;
    for (; i < n; i++) {
        uint32_t u = (uint32_t)z[i] << 16;
        float v;
        memcpy(&v, &u, sizeof v);
        best = v > best ? v : best;
    }
    return best;
}
