"""The engine process ``launch()`` starts: the part of ``subprocess.Popen`` it offers
(``pid``, ``args``, ``stdout``, ``poll()``, ``wait()``, ``send_signal()``, ``terminate()``,
``kill()``, ``returncode``). It is started by the library's one spawning path
(``_native._spawn_engine``, the same as ``shmbridge client --launch``): the engine gets
SIGTERM when this process dies, so a learner killed while it waits for its engine leaves
no engine or region behind."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from typing import List, Optional


class EngineProcess:
    """A launched engine: reaped by pid (``os.waitpid``), as ``Popen`` does."""

    def __init__(self, args: List[str], env: Optional[dict], stderr_fd: int, stdin: bytes = b"") -> None:
        """Starts ``args`` with environment ``env`` (None: this process's), stdout piped,
        stderr onto ``stderr_fd``, and ``stdin`` written to its standard input and closed
        (empty: /dev/null)."""
        from ._native import _spawn_engine

        env_items = None if env is None else [(k, v) for k, v in env.items()]
        self.args = args
        self.pid, stdout_fd, stdin_fd = _spawn_engine(args, env_items, stderr_fd, bool(stdin))
        self.stdout = os.fdopen(stdout_fd, "rb", buffering=0)
        self.returncode: Optional[int] = None
        if stdin_fd >= 0:
            with os.fdopen(stdin_fd, "wb") as pipe:
                try:
                    pipe.write(stdin)
                except BrokenPipeError:  # it exited already; its status says why
                    pass

    def poll(self) -> Optional[int]:
        """The exit status (``-N`` for signal N), or None while it runs."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: as Popen, say 0
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits for the exit status; ``subprocess.TimeoutExpired`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            fd = os.pidfd_open(self.pid)  # readable once the process exited
        except (AttributeError, OSError):
            fd = None
        try:
            while self.poll() is None:
                left = 1.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                if fd is not None:
                    select.select([fd], [], [], min(left, 1.0))
                else:
                    time.sleep(min(left, 0.01))
        finally:
            if fd is not None:
                os.close(fd)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM: a shmbridge engine closes and removes its region, then exits."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<shmbridge engine process {self.pid} returncode={self.returncode}>"
