"""shmbridge.observe(): consistent copies beside a live client, new frames as they come,
episode stats, tiling, and videos (GIF and MP4) of the tiled frames."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import shmbridge
from shmbridge.observe import tile_images, to_rgb

from conftest import pattern


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
