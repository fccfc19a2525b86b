"""Engines written against the C ABI, for the tests: the C library (``libshmbridge.so``),
``examples/c/cartpole_engine.c`` compiled with ``cc``, the engines that render with Vulkan
themselves (``examples/c/vulkan_engine.c``, ``capi/tests/vulkan_faults.c``, their shader
compiled by ``glslangValidator``), and the C# binding (``Shmbridge.dll``) and programs
compiled with Mono's ``mcs``; and a check that steps any of them next to the Rust
reference CartPole, comparing every tensor bit for bit.

The C library is the one installed in ``$SHMBRIDGE_C_PREFIX`` where that is set
(scripts/test.sh installs it there with scripts/install-c.sh, so these tests run without
cargo, as a user's machine would), found and linked through its ``shmbridge.pc`` as users
do; elsewhere ``cargo build -p shmbridge-capi`` builds it in the checkout."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

import shmbridge

ROOT = Path(__file__).resolve().parents[2]
TENSORS = ("obs", "rewards", "terminated", "truncated", "final_obs")


@dataclass(frozen=True)
class CLibrary:
    """Where the C library is and how a C program compiles and links against it."""

    libdir: Path
    cflags: List[str]
    libs: List[str]


def installed_prefix() -> "Path | None":
    """The prefix the C library was installed into for these tests, if any."""
    prefix = os.environ.get("SHMBRIDGE_C_PREFIX")
    return Path(prefix) if prefix else None


def pkg_config(prefix: Path, *args: str) -> List[str]:
    """``pkg-config ARGS shmbridge`` with the prefix's .pc file first on the search path."""
    env = dict(os.environ, PKG_CONFIG_PATH=os.pathsep.join(
        [str(p) for p in prefix.glob("lib*/**/pkgconfig")] + [os.environ.get("PKG_CONFIG_PATH", "")]))
    out = subprocess.run(["pkg-config", *args, "shmbridge"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"pkg-config {' '.join(args)} shmbridge: {out.stderr}"
    return out.stdout.split()


@functools.lru_cache(maxsize=None)
def c_library() -> CLibrary:
    """The C library: installed in ``$SHMBRIDGE_C_PREFIX``, or built by cargo here."""
    prefix = installed_prefix()
    if prefix is not None:
        libdir = Path(pkg_config(prefix, "--variable=libdir")[0]).resolve()
        library = CLibrary(libdir, pkg_config(prefix, "--cflags"), pkg_config(prefix, "--libs"))
    else:
        target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug"
        subprocess.run(["cargo", "build", "--locked", "-q", "-p", "shmbridge-capi"], cwd=ROOT, check=True)
        library = CLibrary(target, ["-I", str(ROOT / "include")], ["-L", str(target), "-lshmbridge"])
    lib = ctypes.CDLL(str(library.libdir / "libshmbridge.so"))
    assert lib.shmb_abi_version() == 1, "not the C library (another build wrote libshmbridge.so?)"
    return library


def build_capi() -> Path:
    """The folder holding libshmbridge.so (see :func:`c_library`)."""
    return c_library().libdir


def build_c_engine(lib: Path, out: Path) -> Path:
    """examples/c/cartpole_engine.c compiled against :func:`c_library` (``lib``, its
    folder, is the run-time path)."""
    library = c_library()
    exe = out / "cartpole_engine"
    subprocess.run(
        ["cc", "-std=c11", "-D_GNU_SOURCE", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
         *library.cflags, str(ROOT / "examples/c/cartpole_engine.c"),
         *library.libs, f"-Wl,-rpath,{lib}", "-lm", "-o", str(exe)],
        check=True,
    )
    return exe


def build_csharp_binding(out: Path) -> Path:
    """The C# binding as the library assembly ``out/Shmbridge.dll`` (Mono's mcs)."""
    dll = out / "Shmbridge.dll"
    if not dll.exists():
        subprocess.run(
            [_mcs(), "-target:library", "-unsafe", "-langversion:7.2", "-warnaserror", f"-out:{dll}",
             str(ROOT / "bindings/csharp/Shmbridge.cs")],
            check=True,
        )
    return dll


def build_csharp(program: str, out: Path) -> Path:
    """``program`` (a path under the repository) compiled by Mono's mcs into ``out``,
    referencing the binding's assembly ``out/Shmbridge.dll`` (built there first): Mono
    loads a referenced assembly from the program's folder."""
    dll = build_csharp_binding(out)
    exe = out / (Path(program).stem + ".exe")
    subprocess.run(
        [_mcs(), "-unsafe", "-langversion:7.2", "-warnaserror", f"-r:{dll}", f"-out:{exe}", str(ROOT / program)],
        check=True,
    )
    return exe


def _mcs() -> str:
    mcs = shutil.which("mcs")
    assert mcs, "mcs not found: scripts/test.sh installs mono-mcs and mono-runtime"
    return mcs


def build_csharp_engine(out: Path) -> Path:
    """The C# CartPole engine (examples/csharp), compiled by Mono's mcs into ``out``."""
    return build_csharp("examples/csharp/CartPoleEngine.cs", out)


def same_frames(engine: shmbridge.Client, reference: shmbridge.Client, step: int) -> None:
    for name in TENSORS:
        a, b = np.asarray(engine[name]), np.asarray(reference[name])
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
        if a.tobytes() != b.tobytes():
            diff = np.argwhere(a != b)[:5].tolist()
            raise AssertionError(f"step {step}: {name!r} differs at {diff}: {a.ravel()[:8]} vs {b.ravel()[:8]}")


def step_side_by_side(engine: shmbridge.Client, reference: shmbridge.Client, steps: int,
                      check: Callable[[int], None] = lambda step: None) -> int:
    """Steps both clients with the same actions (a fixed pseudo-random policy, resets by
    mask, by command with seeds, and a pole-length change) and checks that every tensor
    is the same, bit for bit, after every step and command, and then runs ``check(step)``.
    Returns how many episodes ended."""
    n = engine.num_envs
    assert reference.num_envs == n
    rng = np.random.default_rng(1234)
    same_frames(engine, reference, 0)
    check(0)
    episodes = 0
    for step in range(1, steps + 1):
        actions = rng.integers(0, 2, size=(n, 1), dtype=np.int64)
        mask = np.zeros(n, dtype=np.bool_)
        if step % 97 == 0:
            mask[step % n] = True
        for client in (engine, reference):
            np.asarray(client.reset_mask)[:] = mask
            client.step(actions)
        same_frames(engine, reference, step)
        check(step)
        episodes += int(np.asarray(reference.terminated).sum() + np.asarray(reference.truncated).sum())
        if step % 1000 == 500:
            for client in (engine, reference):
                client.reset(seed=step)
            same_frames(engine, reference, step)
            check(step)
        if step % 1000 == 700:
            ids = [n - 1, 0, n - 1]
            for client in (engine, reference):
                client.reset(seed=[step, step + 1, step + 2], env_ids=ids)
            same_frames(engine, reference, step)
            check(step)
        if step == steps // 2:
            replies = [c.call("set_pole_length", length="0.6") for c in (engine, reference)]
            assert replies[0] == replies[1] == {"previous": "0.5"}, replies
    return episodes


# ---- Engines that render with Vulkan themselves ------------------------------------------

SANITIZERS = ["-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
_C_FLAGS = ["-std=c11", "-D_GNU_SOURCE", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror"]


def _need(tool: str) -> str:
    path = shutil.which(tool)
    assert path, (f"{tool} not found: scripts/test.sh installs it (scripts/lib.sh ensure_vulkan_dev: "
                  "Debian's libvulkan-dev and glslang-tools)")
    return path


def vulkan_shader(out: Path) -> Path:
    """examples/c/vulkan_frames.comp compiled to SPIR-V as a C array (vulkan_frames.spv.h)
    in ``out``, by glslangValidator; returns ``out``, the folder to include."""
    assert Path("/usr/include/vulkan/vulkan.h").exists(), (
        "the Vulkan headers are missing: scripts/test.sh installs libvulkan-dev (scripts/lib.sh ensure_vulkan_dev)")
    subprocess.run(
        [_need("glslangValidator"), "-V", "--target-env", "vulkan1.1", "--vn", "vulkan_frames_spv",
         "-o", str(out / "vulkan_frames.spv.h"), str(ROOT / "examples/c/vulkan_frames.comp")],
        check=True, stdout=subprocess.DEVNULL,
    )
    return out


def build_vulkan_c(source: str, lib: Path, out: Path, sanitize: bool = False) -> Path:
    """``source`` (a path under the repository: examples/c/vulkan_engine.c or
    capi/tests/vulkan_faults.c) and examples/c/vulkan_frames.c, compiled against
    ``libshmbridge.so`` in ``lib`` and the Vulkan loader; with ``sanitize``, under
    AddressSanitizer and UndefinedBehaviorSanitizer."""
    include = vulkan_shader(out)
    exe = out / (Path(source).stem + ("-asan" if sanitize else ""))
    subprocess.run(
        [_need("cc"), *_C_FLAGS, *(SANITIZERS if sanitize else []),
         "-I", str(ROOT / "include"), "-I", str(ROOT / "examples/c"), "-I", str(include),
         str(ROOT / source), str(ROOT / "examples/c/vulkan_frames.c"),
         "-L", str(lib), f"-Wl,-rpath,{lib}", "-lshmbridge", "-lvulkan", "-lm", "-o", str(exe)],
        check=True,
    )
    return exe


def build_vulkan_frames_library(out: Path) -> Path:
    """examples/c/vulkan_frames.c as ``libvulkan_frames.so`` in ``out`` (the C# engine's
    renderer, through P/Invoke); returns ``out``."""
    include = vulkan_shader(out)
    subprocess.run(
        [_need("cc"), *_C_FLAGS, "-shared", "-fPIC", "-I", str(ROOT / "include"), "-I", str(include),
         str(ROOT / "examples/c/vulkan_frames.c"), "-lvulkan", "-lm",
         "-o", str(out / "libvulkan_frames.so")],
        check=True,
    )
    return out


def build_csharp_vulkan_engine(out: Path) -> Path:
    """examples/csharp/VulkanCartPoleEngine.cs (with CartPoleEngine.cs's environment)
    compiled by Mono's mcs into ``out``, referencing the binding's assembly
    ``out/Shmbridge.dll``, beside the ``libvulkan_frames.so`` it
    calls: run it with ``out`` and the C library's folder on LD_LIBRARY_PATH."""
    build_vulkan_frames_library(out)
    dll = build_csharp_binding(out)
    exe = out / "VulkanCartPoleEngine.exe"
    subprocess.run(
        [_mcs(), "-unsafe", "-langversion:7.2", "-warnaserror", "-main:VulkanCartPoleProgram", f"-r:{dll}",
         f"-out:{exe}", str(ROOT / "examples/csharp/CartPoleEngine.cs"),
         str(ROOT / "examples/csharp/VulkanCartPoleEngine.cs")],
        check=True,
    )
    return exe


def sanitizer_env() -> dict:
    """The environment a sanitized engine runs in: any report fails it (exit status 99),
    leaks included. Mesa's lavapipe keeps a buffer it allocates once in a global; the
    Vulkan loader unloads the driver at vkDestroyInstance, and the leak checker, running
    at exit, then finds that buffer unreachable. So the driver is preloaded (after the
    ASan runtime, which must come first): it stays loaded, its globals stay roots, and
    only a real leak is reported. The engine is pinned to lavapipe for that reason."""
    env = dict(os.environ,
               ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=99",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    lvp = lavapipe()
    if lvp:
        runtime = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True,
                                 check=True).stdout.strip()
        env["LD_PRELOAD"] = f"{runtime} {lvp[1]}"
        env["VK_ICD_FILENAMES"] = lvp[0]
    return env


def lavapipe() -> Optional[tuple]:
    """Mesa's CPU Vulkan driver here: (its ICD manifest, its library), or None."""
    import json

    for manifest in sorted(Path("/usr/share/vulkan/icd.d").glob("lvp_icd.*.json")):
        library = json.loads(manifest.read_text())["ICD"]["library_path"]
        if Path(library).exists():
            return str(manifest), library
    return None


def sanitizer_reports(stderr: str) -> list:
    """The lines of ``stderr`` that report a sanitizer finding."""
    return [line for line in stderr.splitlines()
            if "AddressSanitizer" in line or "LeakSanitizer" in line or "runtime error" in line]
