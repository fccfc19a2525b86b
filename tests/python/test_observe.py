"""shmbridge.observe(): consistent copies beside a live client, new frames as they come,
episode stats, tiling, and videos (GIF and MP4) of the tiled frames."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import shmbridge
from shmbridge.observe import tile_images, to_rgb

from conftest import needs_root, pattern, run_in_private_shm


def test_latest_is_the_frame_the_client_sees(null_client):
    with shmbridge.observe(null_client.name) as o:
        assert o.engine_kind == "null" and o.num_envs == 16
        assert "actions" not in o.observable and "obs" in o.observable
        for _ in range(5):
            null_client.step()
        f = o.latest()
        assert f.number == 5 == o.frame
        np.testing.assert_array_equal(f["obs"], pattern(5, np.arange(16 * 8)).reshape(16, 8))
        # A copy, not a view: stepping on does not change it.
        null_client.step()
        np.testing.assert_array_equal(f["obs"], pattern(5, np.arange(16 * 8)).reshape(16, 8))
        rows = o.latest(["obs"], envs=(4, 6))
        assert rows.number == 6
        np.testing.assert_array_equal(rows["obs"], pattern(6, np.arange(4 * 8, 6 * 8)).reshape(2, 8))
        assert o.latest(["obs"], envs=3)["obs"].shape == (3, 8)


def test_client_writes_are_refused_and_closed_observers_say_so(null_client):
    o = shmbridge.observe(null_client.name)
    with pytest.raises(shmbridge.InvalidTensorError, match="written by the client"):
        o.latest(["actions"])
    with pytest.raises(shmbridge.NoSuchTensorError):
        o.latest(["nothing"])
    o.close()
    assert o.closed
    with pytest.raises(ValueError, match="closed"):
        o.latest()
    with pytest.raises(shmbridge.NotFoundError):
        shmbridge.observe("shmbridge-nothing-here")


def test_frames_yields_new_frames_only_and_ends_with_the_engine():
    c = shmbridge.launch("null", num_envs=4)
    o = shmbridge.observe(c.name)
    seen = []
    stepped = threading.Event()

    def learner():
        for _ in range(40):
            c.step()
            stepped.wait(5)  # one step per frame the observer took
            stepped.clear()
        c.close()

    t = threading.Thread(target=learner)
    t.start()
    with pytest.raises(shmbridge.EngineClosedError):
        for f in o.frames(["obs"], interval=0.001, timeout=30):
            seen.append(f.number)
            np.testing.assert_array_equal(f["obs"], pattern(f.number, np.arange(4 * 16)).reshape(4, 16))
            stepped.set()
    t.join()
    assert seen == sorted(set(seen)), "each frame once, in order"
    assert len(seen) >= 10


def test_stats_report_the_episodes_and_the_rate(cartpole_client):
    with shmbridge.observe(cartpole_client.name) as o:
        first = o.stats()
        assert first.episodes == 0 and np.isnan(first.steps_per_second)
        done = 0
        for _ in range(200):
            cartpole_client.step()
            done += int(np.count_nonzero(np.asarray(cartpole_client.terminated) | np.asarray(cartpole_client.truncated)))
        s = o.stats()
        assert s.frame == 200 and s.env_steps == 200 * 32
        assert s.episodes == s.episodes_since == done
        assert s.steps_per_second > 0 and s.frames_per_second > 0
        assert s.mean_return == pytest.approx(s.return_sum / s.episodes)
        assert len(s.new_episodes) == min(done, 28)
        again = o.stats()
        assert again.new_episodes == [] and again.episodes_since == 0 and np.isnan(again.mean_return)


def test_python_engine_records_episodes():
    spec = shmbridge.EngineSpec.standard("pyeng", 2, 1, 1)
    with shmbridge.Engine(spec) as e:
        e.publish()
        with shmbridge.observe(e.name) as o:
            e.record_episode(1, 3.5, 7)
            s = o.stats()
            assert (s.episodes, s.return_sum, s.length_sum) == (1, 3.5, 7)
            assert [(x.env, x.episode_return, x.length) for x in s.new_episodes] == [(1, 3.5, 7)]
            with pytest.raises(shmbridge.InvalidSpecError):
                e.record_episode(2, 1.0, 1)


def test_tiles_are_a_near_square_grid():
    frames = np.arange(5 * 2 * 3 * 1, dtype=np.uint8).reshape(5, 2, 3, 1)
    grid = tile_images(frames)
    # 5 frames: 3 rows (ceil(sqrt(5))), 2 columns, the sixth tile black.
    assert grid.shape == (6, 6, 1)
    np.testing.assert_array_equal(grid[0:2, 0:3], frames[0])
    np.testing.assert_array_equal(grid[0:2, 3:6], frames[1])
    np.testing.assert_array_equal(grid[4:6, 0:3], frames[4])
    assert not grid[4:6, 3:6].any()
    rgba = np.full((2, 4, 4, 4), 7, np.uint8)
    assert to_rgb(rgba).shape == (2, 4, 4, 3)
    stack = np.zeros((2, 3, 4, 4, 1), np.uint8)
    stack[:, -1] = 9
    assert (to_rgb(stack) == 9).all() and to_rgb(stack).shape == (2, 4, 4, 3)


@pytest.mark.parametrize("suffix", [".gif", ".mp4"])
def test_record_writes_a_video_of_tiled_frames(tmp_path, suffix):
    iio = pytest.importorskip("imageio.v3")
    if suffix == ".mp4":
        pytest.importorskip("imageio_ffmpeg")
    with shmbridge.launch("pixels", num_envs=4, image_device="host") as c:
        o = shmbridge.observe(c.name)
        assert o.image == "rgb"
        stop = threading.Event()

        def learner():
            while not stop.is_set():
                c.step()
                np.asarray(c["rgb"]).mean()  # a learner that looks at its frames

        t = threading.Thread(target=learner)
        t.start()
        try:
            path = str(tmp_path / f"run{suffix}")
            written = o.record(path, seconds=1.5, fps=10, envs=4)
        finally:
            stop.set()
            t.join()
        o.close()
    assert written >= 2
    video = iio.imread(path)
    # 4 envs of 84x84: a 2x2 grid, 168 pixels a side (MP4: padded to 176, 11 x 16).
    assert video.shape[1:3] == ((168, 168) if suffix == ".gif" else (176, 176))
    assert video.shape[0] >= 2 if suffix == ".gif" else video.shape[0] >= 1
    assert os.path.getsize(path) > 1000


def test_a_sharded_gymnasium_region_is_observed_whole():
    pytest.importorskip("gymnasium")
    client = shmbridge.launch_gym("CartPole-v1", num_envs=6, shards=2, seed=3)
    try:
        with shmbridge.observe(client.name) as o:
            assert o.num_envs == 6 and o._raw.shards == [(0, 3), (3, 6)]
            o.stats()
            done = 0
            rng = np.random.default_rng(1)
            for _ in range(120):
                client.step(rng.integers(0, 2, 6))
                done += int(np.count_nonzero(np.asarray(client.terminated) | np.asarray(client.truncated)))
            f = o.latest(["obs", "rewards"])
            assert f.number == 120
            np.testing.assert_array_equal(f["obs"], np.asarray(client.obs))
            s = o.stats()
            assert s.episodes == done > 0, "both shards' episodes, summed"
            assert {e.shard for e in s.new_episodes} == {0, 1}
            assert all(0 <= e.env < 3 if e.shard == 0 else 3 <= e.env < 6 for e in s.new_episodes)
            assert s.return_sum == s.length_sum, "CartPole: reward 1 per step"
    finally:
        client.close()


# A learner's action in flight that the engine never answers: every copy waits for the
# step to end, so a read with no timeout stays inside the native call (without the GIL)
# until the observer is closed. Each round: a reader thread waits in ``latest()``; the
# main thread, holding the GIL, reads properties and the stats and closes the observer.
# Before the fix the reader held the observer's mutex while it waited, and the main
# thread blocked on that mutex with the GIL held: both hung (Ctrl-C did nothing). The
# run is a process of its own, so a hang is a failed test, not a hung suite.
TWO_THREADS = r"""
import sys, threading
import shmbridge

spec = shmbridge.EngineSpec.standard("pyeng", 2, 1, 1)
with shmbridge.Engine(spec) as e:
    e.publish()
    c = shmbridge.Client.attach(e.name)
    try:
        c.step(timeout=0.01)
    except shmbridge.TimeoutError:
        pass  # action 1 stays posted: a step under way, for good
    for _ in range(30):
        o = shmbridge.observe(e.name)
        got = []

        def reader():
            try:
                o.latest(timeout=None)
            except ValueError as err:
                got.append(err)

        t = threading.Thread(target=reader)
        t.start()
        # Until the reader is in latest() (in the native read, or about to be).
        while True:
            frame = sys._current_frames().get(t.ident)
            if frame is not None and frame.f_code.co_name == "latest":
                break
            if not t.is_alive():
                sys.exit(f"the reader ended early: {got}")
        for _ in range(100):
            assert o.num_envs == 2 and o.name == e.name
        assert o.stats().frame == 0
        o.close()
        t.join()
        assert len(got) == 1 and "closed" in str(got[0]), got
    c.close()
print("ok")
"""


def test_an_observer_used_by_two_threads_never_deadlocks():
    import subprocess
    import sys

    # The hang guard: a deadlock never ends; a run that works takes a second or two.
    done = subprocess.run([sys.executable, "-c", TWO_THREADS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_bfloat16_tensors_are_copied_as_float32():
    import ctypes

    spec = shmbridge.EngineSpec.standard("pyeng", 2, 1, 1).tensor("half", "bf16", (2, 3), "engine->client")
    with shmbridge.Engine(spec) as e:
        # 1, -2.5, 0.5, 3, inf, nan as bfloat16 bits (NumPy cannot write bfloat16).
        bits = np.array([0x3F80, 0xC020, 0x3F00, 0x4040, 0x7F80, 0x7FC0], dtype=np.uint16)
        ctypes.memmove(e["half"].data_ptr, bits.ctypes.data, bits.nbytes)
        e.publish()
        with shmbridge.observe(e.name) as o:
            assert o.tensors["half"]["dtype"] == "bfloat16"
            half = o.latest(["half", "obs"])["half"]
            assert half.dtype == np.float32 and half.shape == (2, 3)
            np.testing.assert_array_equal(half.reshape(-1)[:5], [1.0, -2.5, 0.5, 3.0, np.inf])
            assert np.isnan(half[1, 2])


# An engine whose header promises a tensor larger than the observer's process may
# allocate (a hostile header over a sparse file may promise any size; here a real 512 MiB
# tensor, and an observer whose data segment is capped 256 MiB above what it uses). The
# copy must be MemoryError; before the fix the buffer was an infallible Rust allocation
# and the observer died of SIGABRT.
HUGE_OBSERVER = r"""
import resource, sys
import shmbridge
with open("/proc/self/status") as f:
    data = next(int(l.split()[1]) for l in f if l.startswith("VmData:")) * 1024
resource.setrlimit(resource.RLIMIT_DATA, (data + (256 << 20), resource.getrlimit(resource.RLIMIT_DATA)[1]))
with shmbridge.observe(sys.argv[1]) as o:
    try:
        o.latest(["big"])
    except MemoryError:
        print("MemoryError")
    assert o.latest(["obs"])["obs"].shape == (2, 1), "and it goes on"
"""
HUGE_COPY = f"""
import subprocess, sys
import shmbridge

spec = shmbridge.EngineSpec.standard("pyeng", 2, 1, 1).tensor("big", "u8", (2, 256 << 20), "engine->client")
with shmbridge.Engine(spec) as e:
    e.publish()
    child = subprocess.run([sys.executable, "-c", {HUGE_OBSERVER!r}, e.name], capture_output=True, text=True)
    print(child.returncode, child.stdout.strip(), child.stderr[-2000:])
"""


@needs_root
def test_a_copy_too_large_to_hold_is_memory_error_not_an_abort():
    done = run_in_private_shm(HUGE_COPY, "1g")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("0 MemoryError"), done.stdout
