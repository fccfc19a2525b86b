"""Benchmarks of shmbridge from Python (``python -m shmbridge.bench <command>``).

- ``step``: the ``client.step()`` round trip on the ``null`` engine, 64 B and 4096×100
  observations, median and p99.
- ``peers``: the same lock-step workload through shmbridge, gRPC, iceoryx2,
  ``multiprocessing.shared_memory`` + ``Pipe``, Gymnasium's ``AsyncVectorEnv`` and a raw
  Python ping-pong (the floor); a markdown table and a PNG plot.
- ``vector``: Gymnasium envs (CartPole-v1, HalfCheetah-v5) behind shards against
  ``AsyncVectorEnv``, ``SyncVectorEnv`` and EnvPool, and the ``null`` transport as one
  engine against shards; tables and a PNG plot.
- ``learners``: Stable-Baselines3, TorchRL and skrl, each on its own process-per-env
  vector env against the same library on shmbridge shards (CartPole-v1, HalfCheetah-v5,
  N = 16 and 64), env-steps/s inside the library's own collection loop (needs the extras
  ``sb3``, ``torchrl``, ``skrl`` and ``gym``).
- ``stream``: many producer processes streaming records (token ids, logprobs, a score,
  an instance id, JSON meta; 512 and 4096 tokens) to one consumer: shmbridge's stream
  against the fixed-slot shared-memory buffer proposed to Atropos (re-implemented),
  ``multiprocessing.Queue`` and HTTP/JSON over aiohttp; records/s, GB/s, latency, and
  every record checked (lost, torn, duplicated).
- ``gpu``: getting each new frame to a torch consumer on the GPU, CUDA IPC (the engine's
  tensors on the GPU, zero copy) against copies from shared memory (pageable, pinned);
  obs 4096×100 and images. Needs a GPU: without one it prints
  ``bench gpu: skipped: <reason>`` on stderr and exits with status 3.
- ``vulkan``: rendered frames through a Vulkan export against host shared memory (and,
  where CUDA can import the export, both on the GPU). Without a Vulkan driver it prints
  ``bench vulkan: skipped: <reason>`` and exits with status 3.

Each prints its report (markdown) on stdout and, with ``--out DIR``, writes it with its
figures as JSON (and a plot, where it draws one) through the one writer, :mod:`.report`.
The peers need the ``bench`` extra (``pip install "shmbridge[bench]"``); a transport
whose package is missing is skipped, and the table says so. ``--quick`` is a smoke run.
The Rust-level figures come from ``cargo bench --bench roundtrip`` and
``cargo bench --bench commands``; see docs/benchmarks.md.

Why this lives inside the package (and so inside the wheel): the figures that matter are
those of the user's own machine (its cores, load, GPU and Vulkan driver), so an installed
package must be able to measure itself without a checkout; the harness needs nothing but
the installed module and its reference engines (the gRPC ``.proto`` ships beside it);
and ``import shmbridge`` never imports it, so it costs the wheel some kilobytes and a
user nothing else.
"""

from .cli import main

__all__ = ["main"]
