"""The command line of ``python -m shmbridge.bench``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m shmbridge.bench",
                                description="Benchmarks of shmbridge from Python.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("step", help="client.step() round trip on the null engine, 64 B and 4096x100",
                       description="Median, p99, tail percentiles and a histogram of the Python "
                                   "client.step() round trip on the null engine (sparse), 64 B and "
                                   "4096x100 f32 observations, beside the raw Python floor, interleaved; "
                                   "what the scheduler did to each side meanwhile.")
    s.add_argument("--quick", action="store_true", help="a short smoke run")
    s.add_argument("--steps", type=int, default=None, help="timed steps per payload (default 200000; quick 5000)")
    s.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 20; quick 4)")
    s.add_argument("--blocking", action="store_true", help="blocking wait policy instead of spinning")
    s.add_argument("--no-floor", action="store_true", help="leave out the raw Python floor")
    s.add_argument("--out", default=None, help="also write DIR/step.md and DIR/step.json")

    q = sub.add_parser("peers", help="the same workload through shmbridge and its peers",
                       description="The same lock-step workload through shmbridge, gRPC, iceoryx2, "
                                   "multiprocessing.shared_memory + Pipe, Gymnasium's AsyncVectorEnv and "
                                   "a raw Python ping-pong; writes DIR/peers.md, DIR/peers.png, DIR/peers.json.")
    q.add_argument("--quick", action="store_true", help="a short smoke run (a few hundred steps per case)")
    q.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    q.add_argument("--steps", type=int, default=None,
                   help="measured steps per transport and payload, at most (default 10000; quick 300)")
    q.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 10; quick 2)")
    q.add_argument("--block-seconds", type=float, default=None,
                   help="cap on one block's time: slow transports get fewer steps (default 2; quick 0.25)")
    q.add_argument("--workloads", default="64B,4096x100,images,cartpole",
                   help="comma-separated, from 64B, 4096x100, images, cartpole (default: all)")
    q.add_argument("--transports", default=None,
                   help="comma-separated subset (shmbridge-spin always runs, as the reference): "
                        "shmbridge-spin, shmbridge-blocking, grpc-floats, grpc-bytes, iceoryx2-rr, "
                        "iceoryx2-ps, shm-pipe, floor, gym-async (grpc-seeds: a deprecated alias of grpc-floats)")
    q.add_argument("--cartpole-envs", type=int, default=None,
                   help="num_envs of the CartPole comparison (default 16; quick 4)")

    g = sub.add_parser("gpu", help="CUDA IPC against host-staged copies, obs 4096x100 and images",
                       description="Per-step cost of getting the engine's new frame to a torch consumer "
                                   "on the GPU: CUDA IPC (engine tensors on the GPU, zero copy) against "
                                   "copying from shared memory (pageable, and through a pinned buffer); "
                                   "obs 4096x100 f32 and images 64x84x84x3 u8, interleaved; median, p99, "
                                   "ratios.",
                       epilog="Exit status: 0 measured; 1 a check failed (not zero copy, or a stale "
                              "frame); 2 bad usage; 3 skipped: no usable GPU here (torch without CUDA, "
                              "shmbridge.cuda_available() false, or the engine refused CUDA), with "
                              "'bench gpu: skipped: <reason>' on stderr and nothing written.")
    g.add_argument("--quick", action="store_true", help="a short smoke run")
    g.add_argument("--steps", type=int, default=None,
                   help="timed steps per payload and path (default 10000; quick 200)")
    g.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 10; quick 2)")
    g.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before each block, 5x in the first round (default 100; quick 10)")
    g.add_argument("--device", default="cuda", help="the CUDA device: cuda (torch's current) or cuda:N")
    g.add_argument("--blocking", action="store_true", help="blocking wait policy instead of spinning")
    g.add_argument("--out", default=None, help="also write DIR/gpu.md and DIR/gpu.json")

    v = sub.add_parser("vulkan", help="rendered frames through a Vulkan export against host shared memory",
                       description="Per-step round trip of 64x84x84x4 u8 frames the engine writes into "
                                   "Vulkan memory it exports (imported by the client's Vulkan device, and on "
                                   "a CUDA machine into CUDA), against the same frames written into host "
                                   "shared memory (and, on the GPU, .cuda() of them); median, p99, ratios.",
                       epilog="Exit status: 0 measured; 1 a check failed (not zero copy, or a stale "
                              "frame); 2 bad usage; 3 skipped: no Vulkan driver here, with "
                              "'bench vulkan: skipped: <reason>' on stderr and nothing written.")
    v.add_argument("--quick", action="store_true", help="a short smoke run")
    v.add_argument("--steps", type=int, default=None, help="timed steps per path (default 5000; quick 100)")
    v.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 10; quick 2)")
    v.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before each block, 5x in the first round (default 50; quick 5)")
    v.add_argument("--num-envs", type=int, default=64, help="frames per step (default 64)")
    v.add_argument("--size", default="84x84", help="frame HxW (default 84x84; 4 channels)")
    v.add_argument("--blocking", action="store_true", help="blocking wait policy instead of spinning")
    v.add_argument("--out", default=None, help="also write DIR/vulkan.md and DIR/vulkan.json")
    v.add_argument("--c-engine", default=None, metavar="PATH",
                   help="instead, the C engine that renders with Vulkan itself (examples/c/vulkan_engine.c, "
                        "built): its own render target exported against copied into host shared memory")

    x = sub.add_parser("pixels", help="rendered CartPole frames to torch: the pixels engine against "
                                      "Gymnasium's rgb_array under SyncVectorEnv and AsyncVectorEnv",
                       description="Frames per second delivered to a torch consumer: the pixels engine "
                                   "(Vulkan export; host shared memory; a 4-frame stack) against "
                                   "Gymnasium CartPole-v1 with render_mode='rgb_array' under SyncVectorEnv "
                                   "and AsyncVectorEnv, resized to the same HxW; median, p99, ratios.",
                       epilog="Exit status: 0 measured; 1 a check failed (not zero copy, or not a drawn "
                              "frame); 2 bad usage; 3 skipped: neither a Vulkan driver nor Gymnasium "
                              "with pygame here, with 'bench pixels: skipped: <reason>' on stderr.")
    x.add_argument("--quick", action="store_true", help="a short smoke run")
    x.add_argument("--steps", type=int, default=None, help="timed steps per path (default 1000; quick 20)")
    x.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; quick 2)")
    x.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before each block, 5x in the first round (default 20; quick 2)")
    x.add_argument("--num-envs", type=int, default=16, help="envs, each one frame per step (default 16)")
    x.add_argument("--size", default="84x84", help="frame HxW (default 84x84; 3 channels)")
    x.add_argument("--blocking", action="store_true", help="blocking wait policy instead of spinning")
    x.add_argument("--mujoco", default=None, metavar="TASK",
                   help="instead, a MuJoCo task's camera (e.g. Hopper-v5): the native engine's frames "
                        "(launch('mujoco/TASK', camera=...), a build with the mujoco feature) against "
                        "Gymnasium's render_mode='rgb_array' of the same camera and size")
    x.add_argument("--camera", default="track", help="with --mujoco: the model's camera (default track)")
    x.add_argument("--out", default=None, help="also write DIR/pixels.md and DIR/pixels.json")

    w = sub.add_parser("vector", help="Gymnasium envs behind shards against AsyncVectorEnv, SyncVectorEnv, EnvPool",
                       description="CartPole-v1 and HalfCheetah-v5 as Gymnasium vector envs: shmbridge "
                                   "shards (K = 1, 2, 4) against AsyncVectorEnv(shared_memory=True), "
                                   "SyncVectorEnv and EnvPool, interleaved; plus the null transport one "
                                   "engine vs shards. Writes DIR/vector.md, .json, .png.")
    w.add_argument("--quick", action="store_true", help="a short smoke run")
    w.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    w.add_argument("--envs", default=None, help="comma-separated num_envs (default 1,8,16,64; quick 4)")
    w.add_argument("--shards", default=None, help="comma-separated shard counts (default 1,2,4; quick 1,2)")
    w.add_argument("--workloads", default=None, help="comma-separated Gymnasium ids (default CartPole-v1,HalfCheetah-v5)")
    w.add_argument("--steps", type=int, default=None, help="steps per block (default 200 CartPole, 60 MuJoCo)")
    w.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; quick 2)")
    w.add_argument("--contenders", default=None,
                   help="comma-separated subset of shmbridge, native, async, sync, envpool, pufferlib "
                        "(default: all; native: the native MuJoCo engine, built with the mujoco feature)")

    o = sub.add_parser("observers", help="client.step() with 0 observers, 1 at 1 Hz, 1 and 4 at 60 Hz, a browser",
                       description="The learner's client.step() latency (median, p99) and steps/s with no "
                                   "observer, one polling at 1 Hz, one and four at 60 Hz, and with "
                                   "`shmbridge view` open in headless Chromium, interleaved in one run.")
    o.add_argument("--quick", action="store_true", help="a short smoke run")
    o.add_argument("--env", default="cartpole", choices=["cartpole", "pixels"],
                   help="the engine (pixels: frames on the host, the page shows them; default cartpole)")
    o.add_argument("--num-envs", type=int, default=None, help="envs (default 64; pixels 16)")
    o.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 8; quick 2)")
    o.add_argument("--block-seconds", type=float, default=None,
                   help="timed seconds per configuration and round (default 2; quick 0.5)")
    o.add_argument("--no-browser", action="store_true", help="leave the browser configuration out")
    o.add_argument("--out", default=None, help="also write DIR/observers.md and DIR/observers.json")

    lr = sub.add_parser("learners", help="the learning libraries' own parallel envs against the same library on shmbridge",
                        description="SB3 (SubprocVecEnv), TorchRL (GymEnv over AsyncVectorEnv) and skrl (its "
                                    "wrapper of AsyncVectorEnv) against each on shmbridge shards, CartPole-v1 "
                                    "and HalfCheetah-v5, env-steps/s inside each library's collection loop, "
                                    "alternated; medians over the rounds. Writes DIR/learners.md and .json.")
    lr.add_argument("--quick", action="store_true", help="a short smoke run (N = 4, 4 steps, 2 rounds)")
    lr.add_argument("--out", default=None, help="also write DIR/learners.md and DIR/learners.json")
    lr.add_argument("--envs", default=None, help="comma-separated num_envs (default 16,64; quick 4)")
    lr.add_argument("--shards", type=int, default=2, help="shmbridge shard processes (default 2)")
    lr.add_argument("--workloads", default=None, help="comma-separated Gymnasium ids (default CartPole-v1,HalfCheetah-v5)")
    lr.add_argument("--libraries", default=None, help="comma-separated subset of sb3, torchrl, skrl (default: all)")
    lr.add_argument("--steps", type=int, default=None, help="vector steps per block (default 64 CartPole, 16 others)")
    lr.add_argument("--rounds", type=int, default=None, help="alternated rounds (default 3; quick 2)")

    st = sub.add_parser("stream", help="many producer processes streaming records to one consumer, by transport",
                        description="Records of tokens (int32), logprobs (float32), score, instance_id and JSON "
                                    "meta, 512 and 4096 tokens, from 1, 4 and 16 producer processes to one "
                                    "consumer: shmbridge's stream against the Atropos PR's fixed-slot buffer "
                                    "(re-implemented), multiprocessing.Queue and HTTP/JSON over aiohttp, "
                                    "interleaved; records/s, GB/s, latency p50/p99, and every record checked: "
                                    "lost, torn, duplicated.",
                        epilog="Exit status: 0 measured; 1 a case failed, or shmbridge lost, tore, duplicated "
                               "or reordered a record; 2 bad usage.")
    st.add_argument("--quick", action="store_true", help="a short smoke run")
    st.add_argument("--records", type=int, default=None,
                    help="records per case and round, shared among the producers (default 20000; quick 64)")
    st.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    st.add_argument("--tokens", default="512,4096", help="comma-separated tokens per record (default 512,4096)")
    st.add_argument("--producers", default="1,4,16", help="comma-separated producer counts (default 1,4,16)")
    st.add_argument("--contenders", default=None,
                    help="comma-separated subset of shmbridge, pr-slots, mp-queue, http-json (default: all)")
    st.add_argument("--slots", type=int, default=1000,
                    help="buffer size in records of 4096 tokens (the PR design's slots; the same bytes for "
                         "shmbridge, the same records for the Queue; default 1000)")
    st.add_argument("--blocking", action="store_true",
                    help="shmbridge's pops and full lanes wait asleep, never spinning (few cores, many producers)")
    st.add_argument("--out", default=None, help="also write DIR/stream.md and DIR/stream.json")

    args = p.parse_args(argv)
    args.command_line = " ".join(["python -m shmbridge.bench", *argv])
    if args.command == "step":
        from . import step

        return step.main(args)
    if args.command == "observers":
        from . import observers

        return observers.main(args)
    if args.command == "learners":
        from . import learners

        return learners.main(args)
    if args.command == "stream":
        from . import stream

        return stream.main(args)
    if args.command == "vector":
        from . import vector

        return vector.main(args)
    if args.command == "pixels":
        from . import pixels

        return pixels.main(args)
    if args.command == "vulkan":
        from . import vulkan

        return vulkan.main(args)
    if args.command == "gpu":
        from . import gpu

        return gpu.main(args)
    from . import peers

    return peers.main(args)

