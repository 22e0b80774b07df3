/* Every kernel, once per instruction set: kernels.c defines W (floats per vector) and KERNEL(x)
 * (x with the set's suffix), includes this file, and gets each kernel under that suffix. */
#include "simd.h"
#include "rowstats_kernel.h"
#include "softcap_kernel.h"
#include "entropy_kernel.h"
#include "peak_kernel.h"
#include "rectified_kernel.h"
#include "rownorm_kernel.h"
#undef vf
#undef vi
#undef KERNEL
#undef W
