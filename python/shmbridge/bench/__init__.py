"""Benchmarks of shmbridge from Python (``python -m shmbridge.bench <command>``).

- ``step``: the ``client.step()`` round trip on the ``null`` engine, 64 B and 4096×100
  observations, median and p99.
- ``peers``: the same lock-step workload through shmbridge, gRPC, iceoryx2,
  ``multiprocessing.shared_memory`` + ``Pipe``, Gymnasium's ``AsyncVectorEnv`` and a raw
  Python ping-pong (the floor); a markdown table and a PNG plot.
- ``gpu``: getting each new frame to a torch consumer on the GPU, CUDA IPC (the engine's
  tensors on the GPU, zero copy) against copies from shared memory (pageable, pinned);
  obs 4096×100 and images. Needs a GPU: without one it prints
  ``bench gpu: skipped: <reason>`` on stderr and exits with status 3.

The peers need the ``bench`` extra (``pip install "shmbridge[bench]"``); a transport
whose package is missing is skipped, and the table says so. ``--quick`` is a smoke run.
The Rust-level figures come from ``cargo bench --bench roundtrip`` and
``cargo bench --bench commands``; see docs/benchmarks.md.
"""

from .cli import main

__all__ = ["main"]
