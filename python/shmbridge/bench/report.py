"""The one report writer of ``python -m shmbridge.bench``: every benchmark formats its
figures, describes the machine and writes its report through this module.

A report is markdown: a ``## title``, the command, :func:`machine_header` (the machine, the
software, the load and, on a busy machine, a warning), the tables, then what the figures
mean. :func:`publish` prints it on stdout and, with ``--out DIR``, writes ``DIR/NAME.md``
(the same text), ``DIR/NAME.json`` (the figures, for programs) and ``DIR/NAME.png`` (a
plot), then names what it wrote in one line on stderr. A benchmark that cannot run here
says why in one line on stderr and exits with :data:`SKIPPED` (:func:`skip`).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# Exit status of a benchmark that cannot run on this machine (0: measured; 1: a check
# failed; 2: bad usage).
SKIPPED = 3


def log(msg: str) -> None:
    """Progress, on stderr (stdout carries the report)."""
    print(msg, file=sys.stderr, flush=True)


def one_line(text: str) -> str:
    """``text``'s non-empty lines, joined with ``"; "``."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def skip(bench: str, reason: str) -> int:
    """Says on stderr, in one line, why ``bench`` cannot run here; returns :data:`SKIPPED`."""
    log(f"bench {bench}: skipped: {one_line(reason)}")
    return SKIPPED


def run_mode(quick: bool) -> str:
    """How a run's ``Command:`` line describes its size."""
    return "QUICK (smoke test: too few steps to quote)" if quick else "full"


# ---------------------------------------------------------------------------------------
# Figures


def frame_size(bench: str, size: str, num_envs: int) -> Optional[Tuple[int, int]]:
    """``(height, width)`` of a ``--size HxW`` option, or ``None`` (said on stderr) when
    it or ``--num-envs`` is not positive."""
    try:
        h, w = (int(v) for v in size.lower().split("x"))
        if h <= 0 or w <= 0 or num_envs <= 0:
            raise ValueError
    except ValueError:
        log(f"bench {bench}: --size {size} --num-envs {num_envs}: expected HxW and "
            "positive integers")
        return None
    return h, w


def fmt_time(ns: float) -> str:
    """A duration with three significant digits and a unit that fits."""
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.3g} µs"
    if ns < 1e9:
        return f"{ns / 1e6:.3g} ms"
    return f"{ns / 1e9:.3g} s"


def fmt_us(ns: float) -> str:
    us = ns / 1e3
    if us >= 100:
        return f"{us:,.0f}"
    if us >= 10:
        return f"{us:.1f}"
    return f"{us:.2f}"


def fmt_rate(per_s: float) -> str:
    if per_s >= 100:
        return f"{per_s:,.0f}"
    return f"{per_s:.3g}"


def fmt_ratio(r: float) -> str:
    if r >= 100:
        return f"{r:,.0f}×"
    if r >= 10:
        return f"{r:.1f}×"
    return f"{r:.2f}×"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
    """`align`: one character per column, 'l' or 'r'."""
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:  # noqa: BLE001 - not installed, or no metadata
        return None


def machine_description() -> Dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = float("nan")
    pkgs = {}
    for name in ("shmbridge", "numpy", "grpcio", "protobuf", "iceoryx2", "gymnasium", "mujoco", "envpool"):
        v = _version(name)
        if v:
            pkgs[name] = v
    return dict(
        cpu=_cpu_model(),
        cores=os.cpu_count(),
        usable_cores=usable,
        memory_gib=round(mem_gib, 1),
        kernel=f"{platform.system()} {platform.release()}",
        python=f"{platform.python_implementation()} {platform.python_version()}",
        packages=pkgs,
        load_average=[round(x, 2) for x in load],
        date=time.strftime("%Y-%m-%d %H:%M:%S %z"),
    )


def busy_warning(m: Dict[str, Any]) -> Optional[str]:
    """A warning when other work ran as the benchmark started: spinning transports (both
    shmbridge's spin policy and the busy-polling peers) then measure the scheduler."""
    load1, cores = m["load_average"][0], m["usable_cores"] or 1
    if load1 == load1 and load1 > max(0.5, 0.25 * cores):  # not NaN, and busy
        return (f"**Warning:** load average {load1} on {cores} usable cores as the run started: "
                "other work was running. Spinning transports need a free core per side; "
                "these figures then measure the scheduler as much as the transport.")
    return None


def machine_lines(m: Dict[str, Any]) -> List[str]:
    """The machine and software a run had, as markdown list items."""
    pk = ", ".join(f"{k} {v}" for k, v in m["packages"].items())
    return [
        f"- Machine: {m['cpu']}, {m['cores']} logical cores ({m['usable_cores']} usable), "
        f"{m['memory_gib']} GiB; {m['kernel']}",
        f"- Software: {m['python']}; {pk}",
        f"- Load average at start: {', '.join(str(x) for x in m['load_average'])}; date {m['date']}",
    ]


def machine_header(m: Dict[str, Any], extra: Sequence[str] = ()) -> List[str]:
    """:func:`machine_lines`, then ``extra`` lines (more of the same list), then, if the
    machine was busy as the run started, a blank line and :func:`busy_warning`."""
    lines = machine_lines(m) + list(extra)
    warning = busy_warning(m)
    return lines + ["", warning] if warning else lines


# ---------------------------------------------------------------------------------------
# Writing


def publish(name: str, text: str, out: Optional[str], doc: Optional[Dict[str, Any]] = None,
            plot: Optional[Callable[[str], None]] = None, echo: bool = True) -> None:
    """Hands a run's report out: ``text`` (markdown, ending in a newline) on stdout unless
    ``echo`` is false (a benchmark that printed its tables as it went); with ``out``,
    ``out/NAME.md`` holding ``text``, ``out/NAME.json`` holding ``doc`` (if given) and
    ``out/NAME.png`` drawn by ``plot(path)`` (if given), then one line on stderr naming
    the files."""
    if echo:
        print(text)
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    md = os.path.join(out, f"{name}.md")
    with open(md, "w") as f:
        f.write(text)
    wrote = [md]
    if doc is not None:
        path = os.path.join(out, f"{name}.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
        wrote.append(path)
    if plot is not None:
        path = os.path.join(out, f"{name}.png")
        plot(path)
        wrote.append(path)
    log(f"{name}: wrote {', '.join(wrote)}")
