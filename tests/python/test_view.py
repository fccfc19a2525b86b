"""`shmbridge view` in a real browser: headless Chromium (Debian's, through selenium's
WebDriver) against the page of a running `pixels` engine (frames in host memory) that a
learner steps. Frames must arrive and change, the plots must grow, the page must say
when the engine ends and come back when a new one serves the name. A screenshot is
saved (``SHMBRIDGE_VIEW_SCREENSHOT=path`` keeps it there; docs/view.png is one). For a
state-only engine (cartpole) the page plots the chosen observation components instead.

Also without a browser, through the page's WebSocket (every message parsed as strictly
as the page's ``JSON.parse``): the token keeps other users out (a malformed one is a 403,
not a 500), idle connections of another user do not keep the page from loading,
``--open`` puts no token on a command line and does not wait for the browser, bad
arguments are refused up front, and the watcher reports what it cannot watch (a frame
stack, a file of another user, no descriptors left) instead of dying while the page says
"live"; values that are not finite go out as null. ``--help`` lists ``view``."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import resource
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import shmbridge

from conftest import exited, wait_exited

pytest.importorskip("aiohttp")
pytest.importorskip("PIL")

WAIT = 60.0


def start_view(name: str, *args: str, **popen) -> tuple:
    """`python -m shmbridge view NAME ARGS`: the process and the URL it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "shmbridge", "view", name, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    url = proc.stdout.readline().strip()
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"view printed {url!r}: {proc.stderr.read()}")
    return proc, url


def stop_view(proc) -> None:
    proc.terminate()
    assert proc.wait(10) == 0, proc.stderr.read()


class Learner:
    """Steps a client in a thread with a hand-written controller that looks at its frames
    (a mean over them, as a policy would read them) between steps."""

    def __init__(self, client):
        self.client = client
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self) -> None:
        c = self.client
        acts, obs = np.asarray(c.actions), np.asarray(c.obs)
        rng = np.random.default_rng(0)
        while not self.stop.is_set():
            lean = obs[:, 2] + 0.5 * obs[:, 3] > 0
            acts[:, 0] = np.where(rng.random(len(lean)) < 0.9, lean, rng.integers(0, 2, len(lean)))
            c.step()
            if "rgb" in c:
                np.asarray(c["rgb"]).mean()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def test_the_token_keeps_others_out_and_help_lists_view():
    out = subprocess.run([sys.executable, "-m", "shmbridge", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "\n  view " in out.stdout, out.stdout
    out = subprocess.run([sys.executable, "-m", "shmbridge", "view", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--grid" in out.stdout
    with shmbridge.launch("null", num_envs=2) as c:
        proc, url = start_view(c.name)
        try:
            base, token = url.split("/?token=")
            assert len(token) >= 32
            # Not ASCII: compare_digest refuses such a str (it was HTTP 500 and a traceback).
            for bad in (base + "/", base + "/?token=" + secrets.token_urlsafe(24), base + "/ws",
                        base + "/?token=%C3%A9", base + "/ws?token=%C3%A9" + token[2:], base + "/?token=%FF"):
                with pytest.raises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(bad, timeout=10)
                assert e.value.code == 403
            page = urllib.request.urlopen(url, timeout=10).read().decode()
            assert "shmbridge view" in page
        finally:
            stop_view(proc)


def chromium():
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (scripts/lib.sh ensure_chromium)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1320,860"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


@pytest.mark.long
def test_the_page_shows_frames_and_plots_and_follows_the_engine(tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    name = "shmbridge-viewtest-" + secrets.token_hex(6)
    client = shmbridge.launch("pixels", num_envs=16, image_device="host", name=name)
    learner = Learner(client)
    proc, url = start_view(name, "--grid", "16", "--fps", "20")
    browser = chromium()
    try:
        browser.get(url)
        wait = WebDriverWait(browser, WAIT, poll_frequency=0.1)
        text = lambda id: browser.find_element("id", id).text  # noqa: E731
        number = lambda id: int(text(id) or 0)  # noqa: E731
        wait.until(lambda b: "live: pixels engine, 16 envs" in text("status"))
        # Frames arrive, and they change: two of them differ in frame number and pixels.
        wait.until(lambda b: number("frames-received") >= 3)
        # The page shows a frame's number once its image has decoded (a busy machine may
        # decode after more frames arrived: the newest waits, the others are dropped).
        wait.until(lambda b: text("frame-number").isdigit())
        # The frame shown: its width and pixels (null while the image holds none: a page
        # that never shows a frame fails the wait below).
        pixels_of = ("const i = document.getElementById('frame');"
                     "if (!i.complete || i.naturalWidth === 0) return null;"
                     "const c = document.createElement('canvas');"
                     "c.width = i.naturalWidth; c.height = i.naturalHeight;"
                     "c.getContext('2d').drawImage(i, 0, 0); return [i.naturalWidth, c.toDataURL()];")
        width, first = wait.until(lambda b: b.execute_script(pixels_of))
        assert width == 4 * 84, "the first 16 envs, 4 by 4"
        first_frame = number("frame-number")

        def a_later_frame_with_other_pixels(b):
            shown = b.execute_script(pixels_of)
            return number("frame-number") > first_frame and shown is not None and shown[1] != first

        wait.until(a_later_frame_with_other_pixels)
        # The plots grow: returns (once episodes end) and steps per second.
        points = number("return-points"), number("sps-points")
        wait.until(lambda b: number("episodes") > 0)
        wait.until(lambda b: number("return-points") > points[0] and number("sps-points") > points[1] + 2)
        # A few seconds of history for the screenshot: 25 points, 5 a second.
        wait.until(lambda b: number("return-points") >= 3 and number("sps-points") >= 25)
        shot = str(tmp_path / "view.png")
        assert browser.save_screenshot(shot)
        keep = os.environ.get("SHMBRIDGE_VIEW_SCREENSHOT")
        if keep:
            shutil.copy(shot, keep)

        # The engine ends: the page says so.
        learner.close()
        pid = client.engine_pid
        client.close()
        assert wait_exited(pid, WAIT)
        wait.until(lambda b: "The engine has ended" in text("status") and "closed" in text("status"))
        # A new engine under the name: the page is live again, with new frames.
        client = shmbridge.launch("pixels", num_envs=16, image_device="host", name=name)
        learner = Learner(client)
        received = number("frames-received")
        wait.until(lambda b: "live: pixels engine" in text("status"))
        wait.until(lambda b: number("frames-received") > received + 2)
    finally:
        browser.quit()
        learner.close()
        client.close()
        stop_view(proc)
    assert not exited(os.getpid())


def test_a_state_only_engine_shows_the_chosen_observation_components():
    from selenium.webdriver.support.ui import WebDriverWait

    client = shmbridge.launch("cartpole", num_envs=8)
    learner = Learner(client)
    proc, url = start_view(client.name, "--obs", "obs", "--env", "3", "--components", "0,2")
    browser = chromium()
    try:
        browser.get(url)
        wait = WebDriverWait(browser, WAIT, poll_frequency=0.1)
        text = lambda id: browser.find_element("id", id).text  # noqa: E731
        shown = lambda id: browser.find_element("id", id).is_displayed()  # noqa: E731
        wait.until(lambda b: "live: cartpole engine, 8 envs" in text("status"))
        assert not shown("frames"), "no image tensor: no frames card"
        wait.until(lambda b: shown("values-card"))
        assert text("values-title") == "observation: obs[3, 0], obs[3, 2]"
        # The values plot grows, and what it shows moves: env 3's cart position and pole
        # angle, read from the region while the learner steps.
        wait.until(lambda b: int(text("values-points") or 0) >= 3)
        first = text("values-now")
        assert first.startswith("obs[3, 0] = ") and " · obs[3, 2] = " in first, first
        wait.until(lambda b: int(text("values-points") or 0) >= 10 and text("values-now") != first)
    finally:
        browser.quit()
        learner.close()
        client.close()
        stop_view(proc)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (the page's JSON.parse rejects it)")


class PageSocket:
    """The page's WebSocket, read in a thread of its own: each text message parsed as
    strictly as the page does (``NaN`` or ``Infinity`` is an error), each binary one (a
    JPEG frame) noted as ``{"type": "jpeg"}``."""

    def __init__(self, url: str):
        base, token = url.split("/?token=")
        self.url = base.replace("http://", "ws://") + "/ws?token=" + token
        self.messages: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=asyncio.run, args=(self._read(),), daemon=True)
        self.thread.start()

    async def _read(self) -> None:
        import aiohttp

        try:
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(self.url) as ws:
                    async for msg in ws:
                        if msg.type == aiohttp.WSMsgType.TEXT:
                            self.messages.put(json.loads(msg.data, parse_constant=_no_constant))
                        elif msg.type == aiohttp.WSMsgType.BINARY:
                            self.messages.put({"type": "jpeg", "size": len(msg.data)})
        except Exception as e:  # handed to the test
            self.messages.put(e)
        self.messages.put(None)

    def wait_for(self, what: str, test) -> dict:
        """The first message (from now) that passes ``test``; fails after ``WAIT`` s."""
        deadline = time.monotonic() + WAIT
        while True:
            try:
                m = self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the page never got {what}") from None
            if m is None or isinstance(m, Exception):
                raise AssertionError(f"the page's socket ended waiting for {what}: {m!r}")
            if test(m):
                return m

    def status(self, state: str, reason: str = "") -> dict:
        return self.wait_for(f"status {state} ({reason})",
                             lambda m: m["type"] == "status" and m["state"] == state and reason in (m["reason"] or ""))


def test_bad_arguments_are_refused_up_front():
    for args in (["--quality", "0"], ["--quality", "101"], ["--quality", "x"], ["--tensor", ""], ["--port", "70000"],
                 ["--env", "-1"]):
        out = subprocess.run([sys.executable, "-m", "shmbridge", "view", "shmbridge-any", *args],
                             capture_output=True, text=True, timeout=WAIT)
        assert out.returncode == 2 and "error: argument" in out.stderr, (args, out.returncode, out.stderr)


def test_a_stack_of_grey_frames_shows_its_newest_frame():
    spec = shmbridge.EngineSpec.standard("stacks", 2, 1, 1).tensor("frames", "u8", (2, 4, 84, 84), "engine->client")
    with shmbridge.Engine(spec) as e:
        frames = np.asarray(e["frames"])
        frames[:, -1] = 200  # the newest frame of each stack
        e.publish()
        proc, url = start_view(e.name)
        try:
            page = PageSocket(url)
            live = page.status("live")
            assert live["image"] == "frames" and live["note"] is None
            page.wait_for("a frame", lambda m: m["type"] == "jpeg")
            jpeg = urllib.request.urlopen(url.replace("/?token=", "/frame.jpg?token="), timeout=WAIT).read()
            from PIL import Image
            import io

            grid = np.asarray(Image.open(io.BytesIO(jpeg)).convert("L"))
            assert grid.shape == (2 * 84, 84), "two envs, one above the other, one frame each"
            assert abs(float(grid.mean()) - 200) < 8, "the newest frame, grey 200"
        finally:
            stop_view(proc)


def test_a_file_of_another_user_is_said_and_the_watcher_goes_on():
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")
    name = "shmbridge-viewtest-" + secrets.token_hex(6)
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    os.chown(path, 65534, 65534)
    proc, url = start_view(name)
    client = None
    try:
        page = PageSocket(url)
        page.status("error", "PermissionDenied")
        os.unlink(path)
        client = shmbridge.launch("null", num_envs=2, name=name)
        page.status("live")
    finally:
        if os.path.exists(path):
            os.unlink(path)
        if client is not None:
            client.close()
        stop_view(proc)


def _lowest_free_fd(pid: int) -> int:
    used = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in range(len(used) + 1) if n not in used)


def test_no_descriptors_left_is_said_and_the_watcher_goes_on():
    name = "shmbridge-viewtest-" + secrets.token_hex(6)
    proc, url = start_view(name)
    client = None
    try:
        page = PageSocket(url)
        page.status("waiting")
        limits = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        # Its next open fails with EMFILE: the region's, once an engine serves the name.
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(proc.pid), limits[1]))
        client = shmbridge.launch("null", num_envs=2, name=name)
        page.status("error", "Too many open files")
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, limits)
        page.status("live")
    finally:
        if client is not None:
            client.close()
        stop_view(proc)


def test_values_that_are_not_finite_go_out_as_null():
    spec = shmbridge.EngineSpec.standard("nans", 2, 3, 1)
    with shmbridge.Engine(spec) as e:
        np.asarray(e["obs"])[0] = [np.nan, np.inf, 1.5]
        e.publish()
        proc, url = start_view(e.name, "--components", "0,1,2")
        try:
            page = PageSocket(url)
            page.status("live")
            page.wait_for("values", lambda m: m["type"] == "point" and m["values"] == [None, None, 1.5])
            e.record_episode(0, float("nan"), 3)
            e.record_episode(1, 2.0, 4)
            # One point, or two if a sample fell between the episodes.
            returns = []
            while len(returns) < 2:
                point = page.wait_for("the episodes", lambda m: m["type"] == "point" and m["returns"])
                returns += point["returns"]
                if None in point["returns"]:
                    assert point["mean_return"] is None, point
            assert returns == [None, 2.0]
        finally:
            stop_view(proc)


@pytest.mark.long
def test_idle_connections_of_another_user_do_not_keep_the_page_from_loading():
    def few_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    with shmbridge.launch("null", num_envs=2) as c:
        proc, url = start_view(c.name, preexec_fn=few_descriptors)
        port = int(url.split(":")[2].split("/")[0])
        idle = []
        try:
            # More connections than the viewer has descriptors: open, and never a request.
            for _ in range(300):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT))
            page = urllib.request.urlopen(url, timeout=WAIT).read().decode()
            assert "shmbridge view" in page
        finally:
            for s in idle:
                s.close()
            stop_view(proc)


def test_open_passes_no_token_on_a_command_line_and_does_not_wait_for_the_browser(tmp_path):
    # A browser command that records how it was started and then never returns (as a
    # console browser, or a $BROWSER script, may not).
    browser = tmp_path / "browser"
    browser.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\nprintf '%s\\n' \"$@\" > {tmp_path}/args.tmp\n"
                       f"mv {tmp_path}/args.tmp {tmp_path}/args\nexec tail -f /dev/null\n")
    browser.chmod(0o755)
    env = dict(os.environ, BROWSER=str(browser))
    with shmbridge.launch("null", num_envs=2) as c:
        proc, url = start_view(c.name, "--open", env=env)
        token = url.split("token=")[1]
        try:
            # The page loads while the browser command still runs.
            page = urllib.request.urlopen(url, timeout=WAIT).read().decode()
            assert "shmbridge view" in page
            deadline = time.monotonic() + WAIT
            while not (tmp_path / "args").exists():
                assert time.monotonic() < deadline, "the browser was never started"
                time.sleep(0.01)
            args = (tmp_path / "args").read_text()
            assert token not in args
            opened = args.strip()
            assert opened.startswith("file://"), args
            path = opened[len("file://"):]
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
            with open(path) as f:
                assert url in f.read()
        finally:
            pid = (tmp_path / "pid").read_text().strip() if (tmp_path / "pid").exists() else None
            if pid:
                os.kill(int(pid), 9)
            stop_view(proc)
        assert not os.path.exists(path), "the file is removed when the viewer stops"


def test_the_page_shows_every_stream_of_the_namespace_and_leaves_out_one_removed():
    import shmbridge.stream as st

    c = st.create(schema="tokens: int32[*]", capacity=1 << 14, lanes=2)
    name = c.name
    p = st.attach(name)
    for k in range(7):
        p.push(tokens=[k])
    # No engine under the view's name: the page waits for one, and shows the streams.
    proc, url = start_view("shmbridge-viewtest-" + secrets.token_hex(6))
    try:
        page = PageSocket(url)
        page.status("waiting")

        def ours(m):
            found = [s for s in m["streams"] if s["name"] == name] if m["type"] == "streams" else []
            return found[0] if found else None

        shown = ours(page.wait_for("the stream", ours))
        raw = st.stats(name)
        assert shown["error"] is None and shown["depth"] == raw["depth"] == 7
        assert shown["bytes_in_use"] == raw["bytes_in_use"] and shown["full_waits"] == raw["full_waits"] == 0
        [lane] = shown["lanes"]
        assert (lane["lane"], lane["producer_pid"], lane["records_committed"]) == (p.lane, os.getpid(), 7)
        assert shown["ranks"][0]["state"] == "live" and shown["ranks"][0]["popped"] == 0
        # A later reading has a rate: nothing was committed between the two.
        later = ours(page.wait_for("a rate", lambda m: (ours(m) or {}).get("records_per_s") is not None))
        assert later["records_per_s"] == 0.0 and later["lanes"][0]["records_per_s"] == 0.0
        p.close()
        c.close()
        page.wait_for("the stream gone", lambda m: m["type"] == "streams" and ours(m) is None)
    finally:
        p.close()
        c.close()
        stop_view(proc)


def test_the_page_in_a_browser_shows_the_streams_card():
    from selenium.webdriver.support.ui import WebDriverWait
    import shmbridge.stream as st

    with st.create(schema="tokens: int32[*]", capacity=1 << 14, lanes=2) as c, st.attach(c.name) as p:
        for k in range(3):
            p.push(tokens=[k])
        proc, url = start_view("shmbridge-viewtest-" + secrets.token_hex(6))
        browser = chromium()
        try:
            browser.get(url)
            wait = WebDriverWait(browser, WAIT, poll_frequency=0.1)
            text = lambda id: browser.find_element("id", id).text  # noqa: E731
            wait.until(lambda b: int(text("streams-readings") or 0) >= 2)
            assert text("streams-count") == "1"
            card = text("streams")
            # The name (as text), its numbers (depth 3), the producer's lane and pid, and
            # a rate once two readings were taken (nothing committed meanwhile: 0.0).
            assert c.name in card and str(os.getpid()) in card, card
            rows = [r.text for r in browser.find_elements("css selector", "#streams tr")]
            assert rows[1].split()[:1] == ["3"], rows
            wait.until(lambda b: any(r.text.split()[:3] == [str(p.lane), str(os.getpid()), "0.0"]
                                     for r in b.find_elements("css selector", "#streams tr")))
        finally:
            browser.quit()
            stop_view(proc)
