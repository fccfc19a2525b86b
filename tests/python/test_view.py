"""`shmbridge view` in a real browser: headless Chromium (Debian's, through selenium's
WebDriver) against the page of a running `pixels` engine (frames in host memory) that a
learner steps. Frames must arrive and change, the plots must grow, the page must say
when the engine ends and come back when a new one serves the name. A screenshot is
saved (``SHMBRIDGE_VIEW_SCREENSHOT=path`` keeps it there; docs/view.png is one). For a
state-only engine (cartpole) the page plots the chosen observation components instead.

Also without a browser: the token keeps other users out, ``--help`` lists ``view``."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

import shmbridge

from conftest import exited, wait_exited

pytest.importorskip("aiohttp")
pytest.importorskip("PIL")

WAIT = 60.0


def start_view(name: str, *args: str) -> tuple:
    """`python -m shmbridge view NAME ARGS`: the process and the URL it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "shmbridge", "view", name, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
            for bad in (base + "/", base + "/?token=" + secrets.token_urlsafe(24), base + "/ws"):
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
        pixels_of = ("const i = document.getElementById('frame'); const c = document.createElement('canvas');"
                     "c.width = i.naturalWidth; c.height = i.naturalHeight;"
                     "c.getContext('2d').drawImage(i, 0, 0); return [i.naturalWidth, c.toDataURL()];")
        width, first = browser.execute_script(pixels_of)
        assert width == 4 * 84, "the first 16 envs, 4 by 4"
        first_frame = number("frame-number")
        wait.until(lambda b: number("frame-number") > first_frame and browser.execute_script(pixels_of)[1] != first)
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
