// `null` engine on the GPU: the same pattern as src/envs/null.rs.
//   obs[i] of frame s = (float)(((s * 2654435761) mod 2^64 + i) & 0xFFFFFF)   (exact in f32)
//   rgb[i] of frame s = the same value's low byte
//   rewards[e] = actions[e, 0]  (frames s >= 1)
// Compiled at run time with NVRTC (src/envs/kernels.rs). No headers: NVRTC has none.
//
// Every kernel loops grid-stride over a 64-bit element count, so any grid size covers any
// tensor (the host caps the grid: src/envs/kernels.rs, launch_threads).

typedef unsigned long long u64;

#define FOR_EACH(i, n)                                                           \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);           \
         i += (u64)gridDim.x * blockDim.x)

__device__ __forceinline__ u64 pattern(u64 seq, u64 i) {
    return (seq * 2654435761ULL + i) & 0xFFFFFFULL;
}

// `obs` (n elements) gets frame `seq`'s pattern.
extern "C" __global__ void null_fill(float *obs, u64 n, u64 seq) {
    FOR_EACH(i, n) obs[i] = (float)pattern(seq, i);
}

// `out` (n bytes, the `rgb` image) gets the low byte of frame `seq`'s pattern.
extern "C" __global__ void null_fill_u8(unsigned char *out, u64 n, u64 seq) {
    FOR_EACH(i, n) out[i] = (unsigned char)pattern(seq, i);
}

// One frame: `obs` (n elements) gets frame `seq`'s pattern, rewards[e] = actions[e * act_dim].
extern "C" __global__ void null_step(float *obs, u64 n, u64 seq, const float *actions,
                                     u64 act_dim, float *rewards, u64 num_envs) {
    FOR_EACH(i, n) obs[i] = (float)pattern(seq, i);
    FOR_EACH(e, num_envs) rewards[e] = actions[e * act_dim];
}

// Sparse mode, one thread: only the first and last element of `obs` (n >= 1 elements),
// of `rgb` (rgb_n >= 1 bytes; skipped when rgb is null) and of `rewards` (num_envs >= 1;
// skipped when rewards is null: frame 0 and resets write no rewards).
extern "C" __global__ void null_sparse(float *obs, u64 n, unsigned char *rgb, u64 rgb_n,
                                       u64 seq, const float *actions, u64 act_dim,
                                       float *rewards, u64 num_envs) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    obs[0] = (float)pattern(seq, 0);
    obs[n - 1] = (float)pattern(seq, n - 1);
    if (rgb) {
        rgb[0] = (unsigned char)pattern(seq, 0);
        rgb[rgb_n - 1] = (unsigned char)pattern(seq, rgb_n - 1);
    }
    if (rewards) {
        rewards[0] = actions[0];
        rewards[num_envs - 1] = actions[(num_envs - 1) * act_dim];
    }
}
