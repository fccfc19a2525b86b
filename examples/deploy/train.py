"""The learner of examples/deploy: attaches to the engine NAME, steps it, closes.

    python3 train.py [--name demo] [--steps 1000] [--deadline 120]

The engine runs in another container and may start after this one (Compose and
Kubernetes start containers in any order, and a started container is not a ready one):
until ``--deadline`` seconds have passed, a name that does not exist yet is waited for,
never raced. Past the deadline it exits with status 1 and says why. Replace the random
actions with your policy.
"""

import argparse
import sys
import time

import numpy as np

import shmbridge


def attach_within(name: str, deadline_s: float) -> shmbridge.Client:
    """``shmbridge.attach(name)`` once the engine has published it, or
    ``shmbridge.TimeoutError`` after ``deadline_s`` seconds."""
    deadline = time.monotonic() + deadline_s
    said = False
    while True:
        left = deadline - time.monotonic()
        try:
            # Waits (up to what is left) for an engine that created the region to publish
            # its first frame.
            return shmbridge.attach(name, timeout=max(left, 0.1))
        except shmbridge.NotFoundError:
            if left <= 0:
                raise shmbridge.TimeoutError(f"no engine published {name!r} within {deadline_s:g} s") from None
            if not said:
                print(f"train.py: waiting for engine {name!r} (up to {deadline_s:g} s)", flush=True)
                said = True
            time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="demo", help="the engine's region name (shmbridge engine --name)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--deadline", type=float, default=120.0, help="seconds to wait for the engine")
    args = p.parse_args()
    try:
        client = attach_within(args.name, args.deadline)
    except shmbridge.TimeoutError as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 1
    with client:
        shape = client.actions.shape
        rng = np.random.default_rng(0)
        for _ in range(args.steps):
            client.step(rng.integers(0, 2, size=shape))  # your policy's actions here
        print(f"train.py: {args.steps} steps of {shape[0]} envs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
