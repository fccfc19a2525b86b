"""The README's commands, as pasted.

Every ```python block of README.md runs as it stands, in a fresh interpreter of this
environment (the package installed as users install it), and must exit 0 leaving nothing
in /dev/shm; a block that imports a module this environment lacks is skipped, naming it.
The README's shell commands are run elsewhere: `bash scripts/main-job.sh` and
`bash scripts/test.sh` by scripts/fresh-machine.sh (one after the other in one clone, in
a fresh Debian 12 root file system); `bash scripts/build-wheel.sh` by scripts/test.sh
itself, which installs the wheel it writes (target/dist/shmbridge-*.whl) into the test
environment, and main-job.sh builds and installs the checkout (`pip wheel .`, what
`pip install .` builds). The wheel's file name the README's `pip install` names is
checked here against the name of the wheel this package was installed from.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shmbridge
from conftest import regions

README = Path(__file__).resolve().parents[2] / "README.md"
TEXT = README.read_text()


def _blocks(lang: str) -> list:
    return re.findall(rf"^```{lang}\n(.*?)^```$", TEXT, re.S | re.M)


PYTHON_BLOCKS = _blocks("python")


def test_the_readme_is_one_a_newcomer_reads_in_five_minutes():
    lines = TEXT.count("\n")
    assert lines <= 200, f"README.md has {lines} lines"
    assert PYTHON_BLOCKS, "no python block in README.md"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_a_python_block_runs_as_pasted(index, tmp_path):
    code = PYTHON_BLOCKS[index]
    imported = re.findall(r"^\s*(?:import|from)\s+([A-Za-z_][\w]*)", code, re.M)
    imported += re.findall(r"^\s*import\s+[\w.]+\s*,\s*([A-Za-z_]\w*)", code, re.M)
    missing = sorted({m for m in imported if importlib.util.find_spec(m) is None})
    if missing:
        pytest.skip(f"README block {index} imports {', '.join(missing)}, not installed here")
    before = regions()
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr:\n{out.stderr}"
    assert regions() - before == set(), "the block left regions behind"


def _installed_wheel_name() -> str:
    """The file name of the wheel this package came from, as maturin writes it: the tags
    of its dist-info's WHEEL, platform tags joined by dots in maturin's order."""
    dist = next(Path(shmbridge.__file__).resolve().parents[1].glob("shmbridge-*.dist-info"), None)
    if dist is None:
        pytest.skip("shmbridge is not installed from a wheel here (no dist-info beside it)")
    tags = [line.split(":", 1)[1].strip() for line in (dist / "WHEEL").read_text().splitlines()
            if line.startswith("Tag:")]
    if not tags or "abi3" not in tags[0]:
        pytest.skip(f"installed from a wheel that is not the abi3 one build-wheel.sh makes: {tags}")
    python, abi = tags[0].split("-")[:2]
    platforms = ".".join(t.split("-")[2] for t in tags)
    return f"shmbridge-{shmbridge.__version__}-{python}-{abi}-{platforms}.whl"


def test_the_wheel_the_readme_installs_is_the_one_build_wheel_writes():
    commands = [line for block in _blocks("sh") for line in block.splitlines()
                if re.match(r"pip install dist/\S+\.whl", line)]
    assert len(commands) == 1, commands
    pattern = commands[0].split()[2]
    name = _installed_wheel_name()
    assert fnmatch.fnmatch(name, pattern.removeprefix("dist/")), f"README's {pattern} does not match {name}"
    built = sorted((README.parent / "target" / "dist").glob("shmbridge-*.whl"))
    for wheel in built:  # what scripts/build-wheel.sh wrote in this checkout, where it ran
        assert fnmatch.fnmatch(wheel.name, pattern.removeprefix("dist/")), wheel.name
