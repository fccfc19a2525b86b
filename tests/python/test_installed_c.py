"""The C library as C and C++ users get it: installed into a prefix (scripts/install-c.sh:
libshmbridge.so with its soname, libshmbridge.a, shmbridge.h, shmbridge.pc and the CMake
package config), then a C engine built with ``pkg-config --cflags --libs shmbridge`` and a
C++ engine built by CMake with ``find_package(shmbridge)`` (examples/cpp), each launched
from Python and checked on every step, and each shown to run the installed library.

The prefix is ``$SHMBRIDGE_C_PREFIX`` (scripts/test.sh installs it before the Python tests,
which then run with no cargo on PATH); without it, scripts/install-c.sh installs one here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import shmbridge
from conftest import pattern
from native_engines import ROOT, installed_prefix, pkg_config


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> Path:
    given = installed_prefix()
    if given is not None:
        return given
    made = tmp_path_factory.mktemp("prefix")
    subprocess.run(["bash", str(ROOT / "scripts/install-c.sh"), str(made)], check=True)
    return made


@pytest.fixture
def on_loader_path(prefix, monkeypatch):
    """The prefix's library folder on LD_LIBRARY_PATH, as docs/c-api.md says for a
    prefix the loader does not search."""
    libdir = pkg_config(prefix, "--variable=libdir")[0]
    monkeypatch.setenv("LD_LIBRARY_PATH", libdir)
    return Path(libdir).resolve()


def header_version(header: Path) -> str:
    text = header.read_text()
    parts = [re.search(rf"#define SHMB_VERSION_{p} (\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def test_the_prefix_holds_what_c_and_cpp_builds_expect(prefix):
    lib = Path(pkg_config(prefix, "--variable=libdir")[0]).resolve()
    version = header_version(ROOT / "include/shmbridge.h")
    assert (prefix / "include/shmbridge.h").read_bytes() == (ROOT / "include/shmbridge.h").read_bytes()
    assert pkg_config(prefix, "--modversion") == [version]
    # The soname chain: libshmbridge.so -> .so.<ABI> -> .so.<version>, and the soname
    # recorded in the file is the ABI's.
    assert os.readlink(lib / "libshmbridge.so") == "libshmbridge.so.1"
    assert os.readlink(lib / "libshmbridge.so.1") == f"libshmbridge.so.{version}"
    dynamic = subprocess.run(["readelf", "-d", str(lib / f"libshmbridge.so.{version}")],
                             capture_output=True, text=True, check=True).stdout
    assert "Library soname: [libshmbridge.so.1]" in dynamic
    assert (lib / "libshmbridge.a").stat().st_size > 0
    cmake = lib / "cmake/shmbridge"
    assert (cmake / "shmbridgeConfig.cmake").exists() and (cmake / "shmbridgeConfigVersion.cmake").exists()
    assert f'set(PACKAGE_VERSION "{version}")' in (cmake / "shmbridgeConfigVersion.cmake").read_text()


def _libraries_mapped(pid: int) -> set:
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if "libshmbridge" in line}


def _check_null_engine(command, libdir: "Path | None", kind: str) -> None:
    """Launches ``command`` (a `null` engine: frame k's obs is pattern(k, i), rewards echo
    actions[:, 0]), checks 2,000 steps, and that the process runs the library in
    ``libdir`` (None: no libshmbridge.so at all, a static link)."""
    n, obs_dim, act_dim = 8, 5, 3
    rng = np.random.default_rng(3)
    with shmbridge.launch(command=[*command, "--num-envs", str(n), "--obs-dim", str(obs_dim),
                                   "--act-dim", str(act_dim)]) as client:
        assert client.engine_kind == kind
        mapped = _libraries_mapped(client.engine_pid)
        if libdir is None:
            assert not mapped, mapped
        else:
            assert {str(Path(m).resolve().parent) for m in mapped} == {str(libdir)}, mapped
        index = np.arange(n * obs_dim).reshape(n, obs_dim)
        np.testing.assert_array_equal(np.asarray(client.obs), pattern(0, index))
        for k in range(1, 2001):
            actions = rng.standard_normal((n, act_dim), dtype=np.float32)
            client.step(actions)
            np.testing.assert_array_equal(np.asarray(client.obs), pattern(k, index))
            np.testing.assert_array_equal(np.asarray(client.rewards), actions[:, 0])


def test_a_c_engine_built_with_pkg_config_runs_on_the_installed_library(prefix, on_loader_path, tmp_path):
    exe = tmp_path / "null_engine"
    subprocess.run(
        ["cc", "-std=c11", "-D_GNU_SOURCE", "-O2", "-Wall", "-Wextra", "-Werror",
         *pkg_config(prefix, "--cflags"), str(ROOT / "examples/c/null_engine.c"),
         *pkg_config(prefix, "--libs"), "-o", str(exe)],
        check=True,
    )
    _check_null_engine([str(exe)], on_loader_path, "null-c")


@pytest.fixture(scope="module")
def cpp_engines(prefix, tmp_path_factory) -> Path:
    assert shutil.which("cmake"), "cmake not found: scripts/test.sh installs it"
    build = tmp_path_factory.mktemp("cpp")
    subprocess.run(["cmake", "-S", str(ROOT / "examples/cpp"), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}",
                    "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_CXX_FLAGS=-Wall -Wextra -Werror"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build)], check=True, stdout=subprocess.DEVNULL)
    return build


def test_a_cpp_engine_built_with_cmake_find_package_runs_on_the_installed_library(cpp_engines, prefix):
    # CMake's build-tree rpath points at the prefix: no LD_LIBRARY_PATH needed.
    libdir = Path(pkg_config(prefix, "--variable=libdir")[0]).resolve()
    env = os.environ.pop("LD_LIBRARY_PATH", None)
    try:
        _check_null_engine([str(cpp_engines / "null_engine_cpp")], libdir, "null-cpp")
    finally:
        if env is not None:
            os.environ["LD_LIBRARY_PATH"] = env


def test_the_static_cpp_engine_needs_no_library_at_run_time(cpp_engines):
    needed = subprocess.run(["readelf", "-d", str(cpp_engines / "null_engine_cpp_static")],
                            capture_output=True, text=True, check=True).stdout
    assert "libshmbridge" not in needed
    _check_null_engine([str(cpp_engines / "null_engine_cpp_static")], None, "null-cpp")


def test_find_package_refuses_an_incompatible_version(prefix, tmp_path):
    """shmbridgeConfigVersion.cmake: a 0.y release is compatible only with 0.y."""
    version = header_version(ROOT / "include/shmbridge.h")
    major, minor, _ = (int(p) for p in version.split("."))
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(probe LANGUAGES NONE)\n"
        f"find_package(shmbridge {major}.{minor + 1} REQUIRED)\n")
    out = subprocess.run(["cmake", "-S", str(tmp_path), "-B", str(tmp_path / "b"), f"-DCMAKE_PREFIX_PATH={prefix}"],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "The following configuration files were considered but not accepted" in out.stderr, out.stderr
