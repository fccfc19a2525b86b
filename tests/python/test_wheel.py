"""The package as pip installs it from the wheel: the extension links only what the
manylinux policy allows (the Vulkan loader and the CUDA driver are opened at run time),
so it imports and steps on a machine with neither; and, where scripts/test.sh says the
suite runs against the wheel (SHMBRIDGE_EXPECT_WHEEL), that is what was imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shmbridge
from conftest import needs_root

PACKAGE = Path(shmbridge.__file__).resolve().parent
# What a manylinux wheel may link without bundling (PEP 599/600: glibc's own libraries
# and libgcc_s).
MANYLINUX_LIBS = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1",
                  "libgcc_s.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def _extension() -> Path:
    found = list(PACKAGE.glob("_native*.so"))
    assert len(found) == 1, found
    return found[0]


def test_the_extension_links_only_what_manylinux_allows():
    dynamic = subprocess.run(["readelf", "-d", str(_extension())], capture_output=True, text=True, check=True)
    needed = {line.split("[")[1].rstrip("]") for line in dynamic.stdout.splitlines() if "(NEEDED)" in line}
    assert needed and needed <= MANYLINUX_LIBS, needed - MANYLINUX_LIBS


@pytest.mark.skipif(not os.environ.get("SHMBRIDGE_EXPECT_WHEEL"), reason="the suite runs against a wheel only "
                    "under scripts/test.sh (SHMBRIDGE_EXPECT_WHEEL)")
def test_the_package_imported_is_the_installed_wheel():
    venv = Path(sys.prefix).resolve()
    assert venv in PACKAGE.parents, f"{PACKAGE} is not installed in {venv}"
    dist = next(venv.glob("lib/python*/site-packages/shmbridge-*.dist-info"))
    assert "abi3" in (dist / "WHEEL").read_text()
    assert not (dist / "direct_url.json").exists() or not json.loads(
        (dist / "direct_url.json").read_text()).get("dir_info", {}).get("editable")


@needs_root
def test_it_imports_and_steps_without_a_vulkan_loader_or_a_cuda_driver():
    """In a private mount namespace where every libvulkan and libcuda the loader knows
    is hidden: import, a CPU engine steps, CUDA and Vulkan answer with their reasons."""
    code = r"""
import numpy as np, shmbridge
ok, why = shmbridge.cuda_status()
assert not ok, why
with shmbridge.launch("cartpole", num_envs=4) as c:
    c.step(np.zeros((4, 1), dtype=np.int64))
    assert c.frame == 1
try:
    shmbridge.launch("null", num_envs=4, obs_dim=2, image="8x8x4", image_device="vulkan")
except shmbridge.EngineStartError as e:
    assert "Vulkan is unavailable" in str(e), e
else:
    raise AssertionError("a Vulkan engine started with no Vulkan loader")
print("ok:", why)
"""
    hide = ('for f in $(ldconfig -p | awk \'/libvulkan\\.so|libcuda\\.so/ {print $NF}\'); do '
            'mount --bind /dev/null "$(readlink -f "$f")"; done; exec "$0" "$@"')
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", hide, sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok: "), out.stdout
