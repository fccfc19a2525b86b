"""LLM-RL rollouts through a trajectory stream: one generator process per worker (vLLM-
like: it samples completions of random lengths and scores them) writes each trajectory in
place into shared memory; the trainer pops batches, pads them and takes a (stand-in)
policy-gradient step.

    python examples/stream_llm.py                         # 4 workers, 4000 trajectories
    python examples/stream_llm.py --workers 8 --records 20000 --batch 128

A trajectory: ``tokens`` (int32, the prompt and completion ids), ``logprobs`` (float32,
one per token), ``score`` (float64, the reward), ``instance_id`` (bytes, the task) and
``meta`` (bytes, JSON: worker, sequence number, sampling settings). The generator
reserves the record with its lengths, samples straight into the stream's memory and
commits; nothing is serialised or copied on the way. The trainer's padded batch is the
one copy, made where a trainer wants one: into the tensors it trains on.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

import numpy as np

import shmbridge.stream

SCHEMA = {"tokens": "int32[*]", "logprobs": "float32[*]", "score": "float64", "instance_id": "bytes",
          "meta": "bytes"}
VOCAB = 151_000


def generator(name: str, worker: int, count: int, max_tokens: int) -> None:
    """A worker's generator: ``count`` trajectories into stream ``name``."""
    rng = np.random.default_rng(worker)
    with shmbridge.stream.attach(name, timeout=30, schema=SCHEMA) as producer:
        for seq in range(count):
            n = int(rng.integers(16, max_tokens + 1))  # this completion's length
            task = f"task-{int(rng.integers(0, 1000)):04d}".encode()
            meta = json.dumps({"worker": worker, "seq": seq, "temperature": 0.7}).encode()
            with producer.reserve(timeout=60, tokens=n, logprobs=n, instance_id=len(task),
                                  meta=len(meta)) as r:
                # "Sampling", written in place: token ids, then their log-probabilities.
                r["tokens"][:] = rng.integers(0, VOCAB, n, dtype=np.int32)
                lp = r["logprobs"]
                rng.standard_exponential(out=lp, dtype=np.float32)
                np.negative(lp, out=lp)
                r["score"] = float(rng.random() < 0.3)  # a verifier's 0/1 reward
                r["instance_id"] = task
                r["meta"] = meta


def train(args: argparse.Namespace) -> int:
    per_worker = -(-args.records // args.workers)
    total = per_worker * args.workers
    capacity = 4 * (args.max_tokens * 8 + 1024)  # room for a few trajectories per worker
    try:
        import torch
    except ImportError:
        torch = None
    with shmbridge.stream.create(schema=SCHEMA, capacity=capacity, lanes=args.workers) as stream:
        ctx = mp.get_context("spawn")
        workers = [ctx.Process(target=generator, args=(stream.name, w, per_worker, args.max_tokens))
                   for w in range(args.workers)]
        for w in workers:
            w.start()
        seen = {w: 0 for w in range(args.workers)}
        received = steps = tokens_total = 0
        t0 = None  # from the first record (the workers start up before)
        try:
            while received < total:
                with stream.pop_batch(args.batch, timeout=60) as batch:
                    if not batch:
                        raise RuntimeError(f"no trajectory for 60 s ({received} of {total} received)")
                    t0 = t0 or time.monotonic()
                    tokens, lengths = batch.to_padded("tokens")
                    logprobs, _ = batch.to_padded("logprobs")
                    scores = np.array([r["score"][0] for r in batch])
                    for r in batch:  # each worker's trajectories arrive in its order
                        m = json.loads(r.bytes("meta"))
                        assert m["seq"] == seen[m["worker"]], m
                        seen[m["worker"]] += 1
                received += len(batch)
                tokens_total += int(lengths.sum())
                # A stand-in policy-gradient step: mean of score-weighted log-probs.
                mask = np.arange(tokens.shape[1]) < lengths[:, None]
                if torch is not None:
                    lp, adv = torch.from_numpy(logprobs), torch.from_numpy(scores - scores.mean())
                    loss = -(lp * torch.from_numpy(mask) * adv[:, None]).sum() / max(1, int(mask.sum()))
                    loss = float(loss)
                else:
                    loss = float(-(logprobs * mask * (scores - scores.mean())[:, None]).sum() / max(1, mask.sum()))
                steps += 1
        finally:
            for w in workers:
                w.join(60)
                if w.is_alive():
                    w.kill()
        elapsed = time.monotonic() - t0
        stats = stream.stats()
        failed = [w.exitcode for w in workers if w.exitcode != 0]
    print(f"trained on {received} trajectories ({tokens_total} tokens) in {steps} steps from "
          f"{args.workers} workers in {elapsed:.2f} s: {received / elapsed:,.0f} trajectories/s; "
          f"last loss {loss:.4f}; stream depth {stats['depth']}, full waits {stats['full_waits']}")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="generator processes (default 4)")
    p.add_argument("--records", type=int, default=4000, help="trajectories in all (default 4000)")
    p.add_argument("--batch", type=int, default=64, help="trajectories per training batch (default 64)")
    p.add_argument("--max-tokens", type=int, default=2048, help="longest trajectory (default 2048)")
    return train(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
