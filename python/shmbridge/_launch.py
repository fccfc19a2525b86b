"""Starting engines and attaching to them: :func:`attach`, :func:`launch` (a reference
engine, or an engine executable of your own, in one process or as shards) and
:func:`launch_gym` (any Gymnasium env behind shards), re-exported by the package.

Every engine process starts through one path, :class:`._process.EngineProcess` (it gets
SIGTERM if this process dies, even while it is still being waited for); arguments are
checked before anything starts; a failed start stops what did start and raises
:class:`EngineStartError` with the engine's stderr. The shard side of ``launch_gym`` (the
process each shard runs) is :mod:`shmbridge.gym_shards`, started by module name: this
module does not import it.
"""

from __future__ import annotations

import numbers
import os
import secrets
import selectors
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

from . import _native
from ._native import Client, _check_cli_args
from ._process import EngineProcess
from .errors import CudaUnavailableError, EngineStartError, ShmBridgeError

#: What :func:`launch_gym` serves: a Gymnasium id, or a function returning an env.
EnvTarget = Union[str, Callable[[], Any]]


def attach(
    name: str,
    timeout: float = 10.0,
    *,
    spin_us: Optional[float] = None,
    blocking: bool = False,
    importer: str = "auto",
) -> Client:
    """Attaches to the engine serving region ``name``; waits up to ``timeout`` seconds
    for it to be ready. ``spin_us``/``blocking``: how the client waits for frames.

    ``importer``: how the engine's Vulkan tensors (if any) are imported. ``"vulkan"``:
    into a Vulkan device of this process, mapped on the CPU (kDLCPU); ``"cuda"``: into
    the CUDA device with the engine's Vulkan device UUID (kDLCUDA); ``"auto"``: CUDA
    when such a device is usable, else Vulkan. ``client.importer`` says which, and why.
    Either way the tensor is the engine's memory, not a copy."""
    return Client.attach(name, timeout, spin_us, blocking, importer)


def _read_line(proc: "EngineProcess", timeout: float) -> Optional[str]:
    """The first line the engine prints, or None on EOF or timeout."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            # In slices: select() refuses a timeout past what a time_t holds.
            if not sel.select(min(left, 60.0)):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace").strip() or None


def _stop(proc: "EngineProcess", grace: float) -> None:
    """Waits for the engine to exit; SIGTERM (it then removes its region), then SIGKILL."""
    try:
        proc.wait(grace)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _spawn_engine(
    args: list, env: Optional[dict] = None, stdin: bytes = b""
) -> "tuple[EngineProcess, Any]":
    """Starts an engine process (``launch``'s and ``launch_gym``'s one way to do it)
    through the library's one spawning path: it gets SIGTERM if this process dies (while
    it waits for the engine too), in a session of its own so that Ctrl-C in the terminal
    interrupts the learner, not its engine (which stops when the client closes or dies).
    stdout piped (the engine prints its region name there), stderr to a temporary file
    (returned, for error messages), ``stdin`` written to its standard input and closed."""
    stderr = tempfile.TemporaryFile()
    try:
        proc = EngineProcess(args, env, stderr.fileno(), stdin)
    except BaseException:
        stderr.close()
        raise
    return proc, stderr


def _start_shards(arg_lists: list, timeout: float, what: str, stdin: bytes = b"") -> list:
    """Starts one engine process per argument list (the shards of one region) and
    waits until each printed its region name (frame 0 of its slice is published).
    Returns ``[(proc, stderr_file)]``; on any failure every one is stopped first and
    :class:`EngineStartError` names the shard and carries its stderr."""
    procs: list = []
    try:
        for args in arg_lists:
            procs.append(_spawn_engine(args, stdin=stdin))
        for k, (proc, err) in enumerate(procs):
            if _read_line(proc, timeout) is None:
                err.seek(0)
                text = err.read().decode(errors="replace").strip()
                _stop_shards(procs, grace=0.0)
                raise EngineStartError(
                    f"{what}: shard {k}/{len(procs)} did not start within {timeout} s "
                    f"(exit status {proc.returncode}; command: {' '.join(arg_lists[k])})"
                    + (f"\nshard stderr:\n{text}" if text else " (nothing on stderr)")
                )
            assert proc.stdout is not None
            proc.stdout.close()
    except BaseException:
        _stop_shards(procs, grace=0.0)
        raise
    return procs


def _stop_shards(procs: list, grace: float) -> None:
    """Waits ``grace`` seconds for each shard to exit by itself (its client closed),
    then stops it (SIGTERM: it closes its shard; shard 0 removes the region)."""
    for proc, err in procs:
        if grace <= 0 and proc.poll() is None:
            proc.terminate()
        _stop(proc, grace if grace > 0 else 5.0)
        err.close()


def _attach_shards(
    name: str, procs: list, timeout: float, spin_us: Optional[float], blocking: bool
) -> Client:
    """Attaches to the region the shards ``procs`` serve; ``client.close()`` then
    waits for (and if need be stops) every shard. A failed attach stops them."""
    try:
        client = Client.attach(name, timeout, spin_us, blocking, "auto")
    except BaseException:
        _stop_shards(procs, grace=0.0)
        raise
    client._adopt_engine(procs[0][0], lambda: _stop_shards(procs, grace=10.0))
    return client


# The options of `shmbridge engine` that launch() passes through.
_ENGINE_ARGS = frozenset(
    {"seed", "obs_dim", "act_dim", "sparse", "image", "frame_stack", "image_device", "name",
     "idle_timeout", "threads", "camera", "camera_size", "camera_depth", "model", "reward_lib",
     "max_episode_steps"}
)


class CudaStatus(NamedTuple):
    """What :func:`cuda_status` returns: ``available`` (``cuda_available()``'s answer)
    and ``reason`` (the driver version and device count where CUDA is usable, else why
    not: built without the ``cuda`` feature, no loadable driver, no device)."""

    available: bool
    reason: str


def cuda_status() -> CudaStatus:
    """Whether CUDA tensors can be served and opened here, and why:
    ``CudaStatus(available=True, reason="driver 12080, 1 device(s)")`` or
    ``CudaStatus(available=False, reason=...)``. Never raises; the probe is made once per
    process. ``shmbridge.cuda_available()`` is its ``available``, a plain bool."""
    available, reason = _native._cuda_status()
    return CudaStatus(available, reason)


def nvrtc_library_dirs() -> list:
    """Folders holding the NVRTC library of the ``nvidia-cuda-nvrtc-cu12`` wheel (the
    ``cuda`` extra), if installed: ``launch()`` puts them on a CUDA engine's loader path,
    so the engine compiles its kernels without a CUDA toolkit. Found by path in each
    ``sys.path`` entry (as torch finds its CUDA libraries), not by import: another
    ``nvidia`` package earlier on the path (CUDA 13's wheels, a ``pip --target`` folder)
    would hide it from ``import nvidia.cuda_nvrtc``."""
    dirs = []
    for entry in sys.path:
        lib = os.path.join(entry or os.getcwd(), "nvidia", "cuda_nvrtc", "lib")
        if os.path.isfile(os.path.join(lib, "libnvrtc.so.12")) and lib not in dirs:
            dirs.append(lib)
    return dirs


def _engine_env(device: str) -> Optional[dict]:
    """The environment of an engine on ``device``: NVRTC's wheel on its loader path."""
    dirs = nvrtc_library_dirs() if device != "cpu" else []
    if not dirs:
        return None
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    return env


def _check_device(device: str) -> str:
    """``device`` normalised (``"cpu"``, ``"auto"``, ``"cuda"``, ``"cuda:N"``), or
    ``ValueError`` before anything is started."""
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cpu', 'cuda:0' or 'auto', not {type(device).__name__}")
    d = device.strip().lower()
    if d == "host":
        d = "cpu"
    if d in ("cpu", "auto", "cuda") or (d.startswith("cuda:") and d[5:].isdigit()):
        return d
    raise ValueError(f"device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'auto'")


# The type each engine option of `launch()` takes: ints and floats are checked (and a
# bool is not an int here), strings passed as they are.
_ENGINE_ARG_TYPES = {
    "seed": int, "obs_dim": int, "act_dim": int, "sparse": bool, "image": str, "frame_stack": int,
    "image_device": str, "name": str, "idle_timeout": float, "threads": int,
    "camera": str, "camera_size": str, "camera_depth": bool, "model": str, "reward_lib": str, "max_episode_steps": int,
}


def _check_int(what: str, value: Any, low: int) -> int:
    """``value`` as an int of at least ``low``: ``TypeError`` for anything but an int
    (a float, a string, a bool), ``ValueError`` below ``low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, not {type(value).__name__} ({value!r})")
    if value < low:
        raise ValueError(f"{what} must be at least {low}, not {value}")
    return int(value)


def _check_number(what: str, value: Any, positive: bool = True) -> float:
    """``value`` as a finite float (``> 0`` if ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, not {type(value).__name__} ({value!r})")
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")) or (positive and v <= 0):
        raise ValueError(f"{what} must be a finite {'positive ' if positive else ''}number, not {value!r}")
    return v


def _check_engine_args(engine_args: dict) -> None:
    """Every engine option of the right type, before a process starts."""
    for key, value in engine_args.items():
        kind = _ENGINE_ARG_TYPES[key]
        if value is None:
            continue
        if kind is int:
            _check_int(key, value, 0 if key == "seed" else 1)
        elif kind is float:
            _check_number(key, value)
        elif kind is bool:
            if not isinstance(value, bool):
                raise TypeError(f"{key} must be a bool, not {type(value).__name__} ({value!r})")
        elif not isinstance(value, str):
            raise TypeError(f"{key} must be a str, not {type(value).__name__} ({value!r})")


def launch(
    env: str = "cartpole",
    num_envs: int = 256,
    device: str = "cpu",
    *,
    timeout: float = 30.0,
    spin_us: Optional[float] = None,
    blocking: bool = False,
    importer: str = "auto",
    shards: int = 1,
    batch_size: Optional[int] = None,
    command: Optional[Sequence[str]] = None,
    **engine_args: Any,
) -> Client:
    """Starts the reference engine ``env`` (or any engine executable: ``command``) as a
    child process and attaches to it.

    ``shards``: how many engine processes serve the ``num_envs`` envs (protocol 1.4,
    host memory only): each steps a contiguous slice, all write one region, and
    ``client.obs`` is still one ``[num_envs, ...]`` tensor. A dead shard makes the next
    step raise :class:`EngineDiedError` naming it and its envs.

    ``batch_size``: asynchronous batches (``docs/async.md``, EnvPool's ``recv``/``send``):
    the client starts them (``client.async_reset()``, which may be called again to
    reset) and ``client.recv()`` returns the ``batch_size`` envs of whichever shards
    answered first, ``client.send(actions, env_ids)`` steps them. A multiple of the shard
    size (``num_envs // shards``, which must divide ``num_envs``); needs ``shards`` ≥ 2.

    ``device``: where the engine's tensors live. ``"cpu"`` (shared memory), ``"cuda"``
    or ``"cuda:N"`` (device memory, stepped by the CUDA kernels; the client opens it
    through CUDA IPC, so ``torch.from_dlpack(client.obs)`` is a CUDA tensor), or
    ``"auto"``: CUDA device 0 when one is usable, else host memory. ``client.device``
    says which it got, and for anything but ``"cpu"`` the engine's choice is printed
    on stderr (``shmbridge: device auto -> cpu (...)``). ``"cuda"`` without a usable
    device raises :class:`CudaUnavailableError` with the reason.

    ``engine_args`` are the options of ``shmbridge engine`` (``seed``, ``obs_dim``,
    ``act_dim``, ``sparse``, ``image`` (null: an ``rgb`` uint8 tensor, e.g. ``"84x84x3"``;
    pixels: the frame shape, ``"HxWxC"`` with C 4, 3 or 1 (grey)), ``frame_stack``
    (pixels: ``rgb`` is ``[num_envs, frame_stack, H, W, C]``, the last frames of each
    env, oldest first; default 2), ``image_device`` (``"vulkan"``: ``rgb`` in Vulkan
    memory the engine exports, pixels' default; ``"host"``: in the region, null's
    default), ``threads`` (``mujoco/<Task>``: threads stepping each shard's envs, default
    1; docs/mujoco.md), ``camera`` and ``camera_size`` (``mujoco/<Task>``: ``rgb``, uint8
    ``[num_envs, H, W, 3]``, each env's view through that named camera, ``"HxW"``,
    default ``"84x84"``), ``camera_depth`` (``True``: also ``depth``, float32
    ``[num_envs, H, W]``, the camera's distances in metres as ``mujoco.Renderer``'s depth
    rendering gives them), ``model`` (``mujoco/raw``: the MJCF file served as a task, a
    ``str`` path), ``reward_lib`` (``mujoco/raw``: a shared library whose
    ``shmbridge_mujoco_reward`` gives each step's reward and termination), ``max_episode_steps`` (``mujoco/<Task>``: truncation, default 1000),
    ``name``, ``idle_timeout``). ``importer``: as for
    :func:`attach`. ``timeout`` bounds the engine's
    start; if it fails, :class:`EngineStartError` carries the engine's stderr. Closing
    the client stops the engine and waits for it; nothing is left in /dev/shm. The engine
    gets SIGTERM if this process dies, even while ``launch()`` still waits for it, so it
    never outlives the learner; ``client.engine_process`` is the process.

    ``command``: the program and arguments of an engine of your own (a C, C++, C# or
    Rust simulator built on the C ABI, e.g. ``["./cartpole_engine", "--seed", "3"]``)
    that follows the engine CLI convention of ``docs/protocol.md`` §9: it prints the
    region name on stdout once frame 0 is published and serves until the client closes.
    It is started exactly as the reference engines are (same spawning, checks, stderr
    reporting and stop on close); ``env``, ``num_envs``, ``device``, ``shards`` and
    ``engine_args`` do not apply (the command says everything).
    """
    if command is not None:
        args = _check_command(command, engine_args)
        timeout = _check_number("timeout", timeout)
        if spin_us is not None:
            _check_number("spin_us", spin_us, positive=False)
        return _serve_launched(args, None, None, timeout, spin_us, blocking, importer)
    unknown = sorted(set(engine_args) - _ENGINE_ARGS)
    if unknown:
        raise TypeError(
            f"launch() got unknown engine options {unknown}; "
            f"the reference engines take {sorted(_ENGINE_ARGS)}"
        )
    if not isinstance(env, str):
        raise TypeError(f"env must be a str such as 'cartpole', not {type(env).__name__}")
    num_envs = _check_int("num_envs", num_envs, 1)
    timeout = _check_number("timeout", timeout)
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be a bool, not {type(blocking).__name__} ({blocking!r})")
    if not isinstance(importer, str):
        raise TypeError(f"importer must be a str ('auto', 'cuda' or 'vulkan'), not {type(importer).__name__}")
    if spin_us is not None:
        _check_number("spin_us", spin_us, positive=False)
    _check_engine_args(engine_args)
    device = _check_device(device)
    shards = _check_int("shards", shards, 1)
    if batch_size is not None:
        batch_size = _check_int("batch_size", batch_size, 1)
        if shards < 2:
            raise ValueError(f"batch_size={batch_size} needs shards >= 2: a batch is made of whole shards")
    if shards > 1:
        client = _launch_sharded(env, num_envs, device, shards, timeout, spin_us, blocking, engine_args)
        if batch_size is not None:
            try:
                # Its reset is the episodes' start: seeded as the engine's frame 0 was
                # (env i with seed + i), so a seeded launch starts the same episodes.
                client.async_reset(batch_size, seed=engine_args.get("seed"))
            except BaseException:
                client.close()
                raise
        return client
    args = _engine_command(env, num_envs, device, spin_us, blocking, engine_args)
    return _serve_launched(args, device, _engine_env(device), timeout, spin_us, blocking, importer)


def _check_command(command: Any, engine_args: dict) -> list:
    """``command`` as a list of strings, or ``TypeError``/``ValueError`` before anything
    is started."""
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence):
        raise TypeError(f"command must be a list of strings (program, then arguments), not {type(command).__name__}")
    if not command:
        raise ValueError("command is empty: give the engine program, then its arguments")
    for part in command:
        if not isinstance(part, str):
            raise TypeError(f"command holds {part!r} ({type(part).__name__}): every part must be a str")
    if engine_args:
        raise TypeError(
            f"launch(command=...) takes no engine options ({sorted(engine_args)}): put them in the command"
        )
    return list(command)


def _serve_launched(
    args: list,
    device: Optional[str],
    env: Optional[dict],
    timeout: float,
    spin_us: Optional[float],
    blocking: bool,
    importer: str,
) -> Client:
    """Starts the single engine ``args`` with :func:`_spawn_engine` (a reference engine on
    ``device``, or an engine executable when ``device`` is None), reads the region name
    it prints, attaches, and hands the process to the client (closing it stops the
    engine)."""
    try:
        proc, stderr = _spawn_engine(args, env)
    except OSError as e:
        raise EngineStartError(f"cannot start the engine {args[0]!r}: {e}") from e

    def engine_stderr() -> str:
        stderr.seek(0)
        return stderr.read().decode(errors="replace").strip()

    def fail(what: str) -> EngineStartError:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        text = engine_stderr()
        stderr.close()
        detail = f"\nengine stderr:\n{text}" if text else " (nothing on stderr)"
        return EngineStartError(
            f"{what} (command: {' '.join(args)}; exit status {proc.returncode}){detail}"
        )

    try:
        name = _read_line(proc, timeout)
    except BaseException:
        fail("interrupted")
        raise
    if name is None:
        try:
            # Its stdout reaches EOF a moment before an exiting engine can be reaped.
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            raise fail(f"the engine did not print its region name within {timeout} s") from None
        text = engine_stderr()
        reason = [line for line in text.splitlines() if "CUDA is unavailable" in line]
        if device not in (None, "cpu") and reason:
            proc.wait()
            stderr.close()
            said = reason[-1].removeprefix("shmbridge: error: ")
            raise CudaUnavailableError(f"launch(device={device!r}): {said}")
        raise fail("the engine exited before serving")
    if device not in (None, "cpu"):
        # The engine's choice (`shmbridge: device auto -> cuda:0 (...)`), for the user.
        for line in engine_stderr().splitlines():
            if line.startswith("shmbridge: device "):
                print(line, file=sys.stderr, flush=True)
    assert proc.stdout is not None
    proc.stdout.close()
    try:
        client = Client.attach(name, timeout, spin_us, blocking, importer)
    except BaseException as e:
        # Ask the engine to remove its region and exit.
        proc.terminate()
        _stop(proc, 5.0)
        text = engine_stderr()
        stderr.close()
        if text and isinstance(e, ShmBridgeError):
            e.args = (f"{e.args[0] if e.args else e}\nengine stderr:\n{text}",)
        raise

    def on_close() -> None:
        _stop(proc, 10.0)
        stderr.close()

    client._adopt_engine(proc, on_close)
    return client


def _launch_sharded(
    env: str, num_envs: int, device: str, shards: int, timeout: float,
    spin_us: Optional[float], blocking: bool, engine_args: dict,
) -> Client:
    """``launch`` with ``shards`` > 1: ``shmbridge engine --shard k/K`` processes."""
    if device != "cpu":
        raise ValueError(f"shards={shards} with device={device!r}: sharded engines serve host memory")
    if shards > num_envs:
        raise ValueError(f"shards={shards} > num_envs={num_envs}: each shard needs an env")
    # A short name: the library adds the prefix of this process's region namespace
    # (SHMBRIDGE_NAMESPACE), for the engines and the client alike.
    name = engine_args.pop("name", None) or secrets.token_hex(16)
    base = _engine_command(env, num_envs, device, spin_us, blocking, {**engine_args, "name": name})
    procs = _start_shards([base + ["--shard", f"{k}/{shards}"] for k in range(shards)],
                          timeout, f"launch({env!r}, shards={shards})")
    return _attach_shards(name, procs, timeout, spin_us, blocking)


def _engine_command(
    env: str, num_envs: int, device: str, spin_us: Optional[float], blocking: bool, engine_args: dict
) -> list:
    """The ``shmbridge engine`` command line of ``launch``."""
    args = [
        sys.executable, "-m", "shmbridge", "engine",
        "--env", str(env), "--num-envs", str(num_envs), "--device", device,
    ]
    # `--flag=value`: a negative value is a value, not another flag.
    if spin_us is not None:
        args.append(f"--spin-us={spin_us}")
    if blocking:
        args.append("--blocking")
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False and value is not None:
            args.append(f"{flag}={value}")
    # The engine's own parser: every bound (u32 counts, u64 seeds, the image shape, the
    # spin budget) as the engine would check it, but before a process starts.
    _check_cli_args(args[3:])
    return args


def default_shards(num_envs: int) -> int:
    """One shard per core this process may run on (at most one per env), keeping one core
    for the learner when there are more than two."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(num_envs, cores - 1 if cores > 2 else cores))


def launch_gym(
    env: EnvTarget,
    num_envs: int = 16,
    shards: Optional[int] = None,
    *,
    seed: Optional[int] = None,
    autoreset_mode: str = "next-step",
    timeout: float = 60.0,
    spin_us: Optional[float] = None,
    blocking: bool = False,
    **env_kwargs: Any,
) -> Client:
    """Starts ``shards`` processes (default ``default_shards(num_envs)``) serving ``num_envs``
    envs of ``env`` (a Gymnasium id, or a function returning an env) and attaches to
    them. ``env_kwargs`` go to ``gymnasium.make``. ``seed``: frame 0's seeds (env ``i``
    gets ``seed + i``). ``spin_us``/``blocking``: how every side waits; by default the
    shards and the client spin only while the shards and the learner fit the cores
    (``shards + 1 <= cores``), else they sleep on the futex at once (the core's adaptive
    default), so busy shards never take turns with spinning waiters on an
    oversubscribed machine. ``timeout`` bounds
    the start (a MuJoCo env takes a second to import). Closing the client stops the
    shards; nothing is left in /dev/shm.
    """
    num_envs = _check_int("num_envs", num_envs, 1)
    shards = default_shards(num_envs) if shards is None else _check_int("shards", shards, 1)
    if shards > num_envs:
        raise ValueError(f"shards={shards} > num_envs={num_envs}: each shard needs an env")
    if seed is not None:
        seed = _check_int("seed", seed, 0)
    if autoreset_mode not in ("next-step", "same-step"):
        raise ValueError(f"autoreset_mode={autoreset_mode!r}: 'next-step' or 'same-step'")
    timeout = _check_number("timeout", timeout)
    if not isinstance(env, str) and not callable(env):
        raise TypeError(f"env must be a Gymnasium id or a function making an env, not {type(env).__name__}")
    import cloudpickle

    blob = cloudpickle.dumps((env, env_kwargs))
    name = "gym-" + secrets.token_hex(16)  # the library adds the namespace's prefix
    base = [
        sys.executable, "-m", "shmbridge.gym_shards", "--name", name,
        "--shards", str(shards), "--num-envs", str(num_envs), "--autoreset", autoreset_mode,
        "--timeout", str(timeout),
    ]
    if seed is not None:
        base += ["--seed", str(seed)]
    if blocking:
        base.append("--blocking")
    elif spin_us is not None:
        base += ["--spin-us", str(spin_us)]
    procs = _start_shards([base + ["--shard", str(k)] for k in range(shards)], timeout,
                          f"launch_gym({env!r})", stdin=blob)
    # Closing the client stops every shard (each sees the client close; shard 0 removes
    # the region); one that does not is stopped.
    return _attach_shards(name, procs, timeout, spin_us, blocking)
