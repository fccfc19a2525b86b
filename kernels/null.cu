// `null` engine on the GPU: the same pattern as src/envs/null.rs.
//   obs[i] of frame s = (float)(((s * 2654435761) mod 2^64 + i) & 0xFFFFFF)   (exact in f32)
//   rewards[e] = actions[e, 0]  (frames s >= 1)
// Compiled at run time with NVRTC (src/cuda/kernels.rs). No headers: NVRTC has none.

typedef unsigned long long u64;

extern "C" __global__ void null_fill(float *obs, u64 n, u64 seq) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        obs[i] = (float)((seq * 2654435761ULL + i) & 0xFFFFFFULL);
    }
}

// One frame: `obs` (n elements) gets frame `seq`'s pattern, rewards[e] = actions[e * act_dim].
extern "C" __global__ void null_step(float *obs, u64 n, u64 seq, const float *actions,
                                     u64 act_dim, float *rewards, u64 num_envs) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        obs[i] = (float)((seq * 2654435761ULL + i) & 0xFFFFFFULL);
    }
    if (i < num_envs) {
        rewards[i] = actions[i * act_dim];
    }
}
