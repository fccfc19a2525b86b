"""`python -m shmbridge.bench observers`: what watching costs the learner. The Python
client's `step()` latency on a `cartpole` engine (or `pixels` with frames on the host)
with no observer, one polling at 1 Hz, one and four polling at 60 Hz (each poll:
`latest()` of the observations, or of the first 16 frames, and `stats()`), and with
`shmbridge view` serving the region to a headless Chromium that has the page open; and
the steps/s of each (the writer's throughput beside its readers' rates).

Everything runs in one process tree, in interleaved rounds (each round runs every
configuration once, in rotating order), so drift on a shared machine hits all alike.
The observers are separate processes, started once and switched between polling and
idle over a pipe; the viewer is started for each of its blocks and stopped after
(Chromium stays up, on a blank page, through the whole run). The figure to watch is each
configuration's median over the no-observer median, with the observers' own success
counts beside it (a copy that an engine write overlapped is retried, not counted).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

import shmbridge

from .common import Stats
from .report import fmt_ratio, log, machine_description, machine_header, markdown_table, publish

POLLER = r"""
import os, select, sys, time
import shmbridge
name, image, hz = sys.argv[1], sys.argv[2], float(sys.argv[3])
o = shmbridge.observe(name)
names = [image] if image != "-" else ["obs"]
copies = torn = stats = 0
active = quit = False
print("ready", flush=True)
period = 1.0 / hz
next_poll = time.monotonic()
pending = b""
while not quit:
    wait = max(0.0, next_poll - time.monotonic()) if active else None
    ready, _, _ = select.select([0], [], [], wait)
    if ready:
        # Unbuffered: two commands that arrive together ("idle", then "quit") are both
        # seen here (a buffered readline would keep the second where select cannot).
        chunk = os.read(0, 4096)
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line == b"go":
                active, next_poll = True, time.monotonic()
            elif line == b"idle":
                active = False
            else:
                quit = True
        quit = quit or not chunk
        continue
    try:
        o.latest(names, envs=16, timeout=period / 2)
        copies += 1
    except shmbridge.TimeoutError:
        torn += 1
    try:
        o.stats(timeout=period / 2)
        stats += 1
    except shmbridge.TimeoutError:
        pass
    next_poll += period
print(f"{copies} {torn} {stats}", flush=True)
"""


class Poller:
    """An observer process polling at ``hz`` while told to."""

    def __init__(self, name: str, image: Optional[str], hz: float):
        self.proc = subprocess.Popen([sys.executable, "-c", POLLER, name, image or "-", str(hz)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def tell(self, what: str) -> None:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()

    def finish(self) -> List[int]:
        self.tell("quit")
        out = self.proc.stdout.readline().split()
        self.proc.wait(10)
        return [int(x) for x in out]


class Browser:
    """`shmbridge view` of the region, and a headless Chromium (kept up) that opens it."""

    def __init__(self) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium") or "chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
            options.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"),
                                       options=options)
        self.driver.get("about:blank")
        self.view: Optional[subprocess.Popen] = None
        self.frames = 0

    def open(self, name: str) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.view = subprocess.Popen([sys.executable, "-m", "shmbridge", "view", name, "--fps", "60"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        url = self.view.stdout.readline().strip()
        self.driver.get(url)
        WebDriverWait(self.driver, 30, 0.05).until(
            lambda d: "live" in d.find_element("id", "status").get_attribute("class"))

    def close_page(self) -> None:
        received = self.driver.execute_script("return +document.getElementById('frames-received').textContent")
        self.frames += int(received or 0)
        self.driver.get("about:blank")
        if self.view is not None:
            self.view.terminate()
            self.view.wait(10)
            self.view = None

    def quit(self) -> None:
        if self.view is not None:
            self.view.kill()
            self.view.wait()
        self.driver.quit()


def main(args: Any) -> int:
    quick = args.quick
    rounds = args.rounds or (2 if quick else 8)
    seconds = args.block_seconds or (0.5 if quick else 2.0)
    warmup = 0.2 if quick else 0.5
    env = args.env
    num_envs = args.num_envs or (16 if env == "pixels" else 64)
    configs = ["none", "1 observer, 1 Hz", "1 observer, 60 Hz", "4 observers, 60 Hz"]
    browser: Optional[Browser] = None
    if not args.no_browser:
        if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
            log("bench observers: no chromium/chromedriver here: the browser configuration is left out")
        else:
            configs.append("browser")
    machine = machine_description()
    extra = {"image_device": "host"} if env == "pixels" else {}
    client = shmbridge.launch(env, num_envs=num_envs, **extra)
    pollers: List[Poller] = []
    samples: Dict[str, List[int]] = {c: [] for c in configs}
    t_start = time.monotonic()
    try:
        image = "rgb" if env == "pixels" else None
        pollers = [Poller(client.name, image, 60.0) for _ in range(4)]
        slow = Poller(client.name, image, 1.0)
        pollers.append(slow)
        fast = pollers[:4]
        if "browser" in configs:
            browser = Browser()
        actions = np.asarray(client.actions)
        rng = np.random.default_rng(0)
        pc = time.perf_counter_ns
        for r in range(rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for config in order:
                active = {"none": [], "1 observer, 1 Hz": [slow], "1 observer, 60 Hz": fast[:1],
                          "4 observers, 60 Hz": fast, "browser": []}[config]
                for p in active:
                    p.tell("go")
                if config == "browser":
                    browser.open(client.name)
                end = time.monotonic() + warmup
                while time.monotonic() < end:
                    actions[:] = rng.integers(0, 2, actions.shape)
                    client.step()
                out = samples[config]
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    actions[:] = rng.integers(0, 2, actions.shape)
                    t0 = pc()
                    client.step()
                    out.append(pc() - t0)
                for p in active:
                    p.tell("idle")
                if config == "browser":
                    browser.close_page()
        elapsed = time.monotonic() - t_start
        counts = [p.finish() for p in pollers]
        pollers = []
    finally:
        for p in pollers:
            p.proc.kill()
            p.proc.wait()
        if browser is not None:
            browser.quit()
        client.close()
    load_end = os.getloadavg()

    stats = {c: Stats.of(samples[c]) for c in configs}
    base = stats["none"]
    rows = []
    for c in configs:
        s = stats[c]
        rows.append([c, f"{s.n:,}", f"{s.median_ns:,.0f}", f"{s.p99_ns:,.0f}", f"{s.steps_per_s:,.0f}",
                     fmt_ratio(s.median_ns / base.median_ns), fmt_ratio(s.p99_ns / base.p99_ns),
                     fmt_ratio(s.steps_per_s / base.steps_per_s)])
    copies = sum(c[0] for c in counts)
    torn = sum(c[1] for c in counts)
    polls = sum(c[2] for c in counts)
    worst = max(stats[c].median_ns / base.median_ns for c in configs)
    what = (f"`{env}`, {num_envs} envs" + (", frames on the host (`--image-device host`)" if env == "pixels" else ""))
    polled = "the first 16 envs' frames" if env == "pixels" else "the first 16 envs' observations"
    lines = [
        "## What watching costs the learner: client.step() with observers",
        "",
        f"Command: `{args.command_line}` ({'QUICK, ' if quick else ''}{what}; random actions; {rounds} interleaved "
        f"rounds of {seconds:g} s per configuration after {warmup:g} s of warm-up; {elapsed:.1f} s in all)",
        "",
        *machine_header(machine, [f"- Load average at the end: {', '.join(f'{x:.2f}' for x in load_end)}"]),
        "",
        markdown_table(["configuration", "steps", "median ns", "p99 ns", "steps/s", "median ÷ none", "p99 ÷ none",
                        "steps/s ÷ none"], rows, "lrrrrrrr"),
        "",
        f"Each observer is its own process polling at 60 Hz (one at 1 Hz): `latest()` of {polled} and `stats()`. "
        f"Over the run they made {copies:,} copies and {polls:,} stats reads; {torn:,} copies found no gap "
        f"between the engine's writes within half a period and were skipped.",
    ]
    if "browser" in configs:
        lines.append(f"`browser`: `shmbridge view` (60 fps cap) with headless Chromium on the page; the page "
                     f"received {browser.frames if browser else 0:,} frames over the run" +
                     ("." if env == "pixels" else " (state-only engine: plots only)."))
    lines += ["", f"Targets: median within 5 % of no observer: {'met' if worst <= 1.05 else 'NOT met'}; "
                  f"within 2 %: {'met' if worst <= 1.02 else 'NOT met'} (worst {fmt_ratio(worst)}). "
                  "Reported, not asserted."]
    publish("observers", "\n".join(lines) + "\n", args.out,
            doc={c: stats[c].to_dict() for c in configs} | {"machine": machine})
    return 0
