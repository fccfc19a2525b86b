// Runs kernels/cartpole.cu's kernels on the host (through cuda_shim.h), as
// src/envs/gpu.rs launches them on the device, for tests/cartpole_kernel.rs.
//
// Usage: cartpole_runner INPUT OUTPUT. INPUT (native byte order): u64 num_envs, then
// operations, each a u64 code:
//   1 reset: u64 upload length, the upload's bytes (src/envs/kernels.rs ResetUpload),
//     u64 n, u64 counts_at, u64 states_at, u64 incs_at, u64 seeded. Runs
//     cartpole_reset_listed (when n > 0), then cartpole_write_obs (GpuCartPole::queue_reset).
//   2 step: num_envs i64 actions, num_envs u8 reset_mask, f64 pole length. Runs
//     cartpole_step (GpuCartPole::step).
//   0 end.
// After each operation OUTPUT gets the frame: obs and final_obs (4 * num_envs f32 each),
// rewards (num_envs f32), terminated and truncated (num_envs u8 each).
#include "cuda_shim.h"
#include "../../kernels/cartpole.cu"

#include <stdio.h>
#include <stdlib.h>

#include <vector>

static FILE *in;

static void read_bytes(void *p, size_t n) {
    if (n != 0 && fread(p, 1, n, in) != n) {
        fprintf(stderr, "cartpole_runner: input ends early\n");
        exit(2);
    }
}

static u64 read_u64() {
    u64 v;
    read_bytes(&v, sizeof v);
    return v;
}

// Runs `thread(t)` for t in 0..n as a 1-D launch of BLOCK-thread blocks would.
template <typename F> static void launch(u64 n, F thread) {
    const unsigned int block = 256;
    blockDim.x = block;
    gridDim.x = (unsigned int)((n + block - 1) / block);
    for (u64 t = 0; t < n; t++) {
        blockIdx.x = (unsigned int)(t / block);
        threadIdx.x = (unsigned int)(t % block);
        thread();
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: cartpole_runner INPUT OUTPUT\n");
        return 2;
    }
    in = fopen(argv[1], "rb");
    FILE *out = fopen(argv[2], "wb");
    if (!in || !out) {
        perror("cartpole_runner");
        return 2;
    }
    u64 n = read_u64();
    // The env's own state (StateLayout) and the engine's tensors, zeroed as
    // DeviceAllocation::new zeroes them.
    std::vector<double> state(4 * n, 0.0);
    std::vector<u32> steps(n, 0);
    std::vector<u64> rng_state(n, 0), rng_inc(n, 0);
    std::vector<float> obs(4 * n, 0.0f), final_obs(4 * n, 0.0f), rewards(n, 0.0f);
    std::vector<unsigned char> terminated(n, 0), truncated(n, 0), reset_mask(n, 0);
    std::vector<i64> actions(n, 0);
    for (;;) {
        u64 op = read_u64();
        if (op == 0) break;
        if (op == 1) {
            size_t len = (size_t)read_u64();
            std::vector<u64> words(len / 8 + 1, 0); // 8-byte aligned, as on the device
            read_bytes(words.data(), len);
            const unsigned char *up = (const unsigned char *)words.data();
            u64 k = read_u64(), counts_at = read_u64(), states_at = read_u64(),
                incs_at = read_u64(), seeded = read_u64();
            if (k > 0) {
                launch(k, [&] {
                    cartpole_reset_listed(state.data(), steps.data(), rng_state.data(),
                                          rng_inc.data(), (const u32 *)up,
                                          (const u64 *)(up + counts_at), k,
                                          (const u64 *)(up + states_at),
                                          (const u64 *)(up + incs_at), (u32)seeded);
                });
            }
            launch(n, [&] {
                cartpole_write_obs(state.data(), obs.data(), final_obs.data(), n);
            });
        } else if (op == 2) {
            read_bytes(actions.data(), n * sizeof(i64));
            read_bytes(reset_mask.data(), n);
            double length;
            read_bytes(&length, sizeof length);
            launch(n, [&] {
                cartpole_step(state.data(), steps.data(), rng_state.data(), rng_inc.data(),
                              actions.data(), reset_mask.data(), obs.data(), rewards.data(),
                              terminated.data(), truncated.data(), final_obs.data(), length,
                              n);
            });
        } else {
            fprintf(stderr, "cartpole_runner: unknown operation %llu\n", op);
            return 2;
        }
        fwrite(obs.data(), sizeof(float), 4 * n, out);
        fwrite(final_obs.data(), sizeof(float), 4 * n, out);
        fwrite(rewards.data(), sizeof(float), n, out);
        fwrite(terminated.data(), 1, n, out);
        fwrite(truncated.data(), 1, n, out);
    }
    return fclose(out) == 0 ? 0 : 1;
}
