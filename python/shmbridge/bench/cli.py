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
                       description="Median and p99 of the Python client.step() round trip on the "
                                   "null engine (sparse), 64 B and 4096x100 f32 observations, interleaved.")
    s.add_argument("--quick", action="store_true", help="a short smoke run")
    s.add_argument("--steps", type=int, default=None, help="timed steps per payload (default 200000; quick 5000)")
    s.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 20; quick 4)")
    s.add_argument("--blocking", action="store_true", help="blocking wait policy instead of spinning")
    s.add_argument("--out", default=None, help="also write DIR/step.md")

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
                        "shmbridge-spin, shmbridge-blocking, grpc-seeds, grpc-bytes, iceoryx2-rr, "
                        "iceoryx2-ps, shm-pipe, floor, gym-async")
    q.add_argument("--cartpole-envs", type=int, default=None,
                   help="num_envs of the CartPole comparison (default 16; quick 4)")

    args = p.parse_args(argv)
    args.argv = argv[1:]
    if args.command == "step":
        from . import step

        return step.main(args)
    from . import peers

    return peers.main(args)

