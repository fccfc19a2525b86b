// Host shim for the kernels of kernels/*.cu: what NVRTC provides (qualifiers, thread
// indices, intrinsics), defined for a C++ compiler, so that a kernel's own source runs on
// the CPU one "thread" at a time (tests/cartpole_kernel.rs). Compile with
// -ffp-contract=off: NVRTC compiles the kernels with --fmad=false (src/envs/kernels.rs).
#ifndef SHMBRIDGE_CUDA_SHIM_H
#define SHMBRIDGE_CUDA_SHIM_H

#include <math.h>
#include <string.h>

#define __device__
#define __global__
#define __forceinline__ inline

struct shim_dim3 {
    unsigned int x, y, z;
};
// One launch's coordinates, set by the runner before each "thread" runs.
static shim_dim3 blockIdx, threadIdx, blockDim, gridDim;

static inline double __longlong_as_double(long long v) {
    double d;
    memcpy(&d, &v, sizeof d);
    return d;
}

#endif
