"""The main job's PPO example (shmbridge.examples.ppo) on a short budget: it learns,
writes its learning curve, and leaves nothing in /dev/shm; on the CPU everywhere, and on a
GPU (engine tensors in GPU memory, zero-copy CUDA views) where there is a usable one."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import shmbridge
from conftest import regions

pytest.importorskip("torch")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

import torch  # noqa: E402

from shmbridge.examples import ppo  # noqa: E402

# A random policy averages about 22 on CartPole-v1. With the defaults and 24,576 env
# steps (12 updates, about 3 s), seeds 1-10 ended at a mean return (last 100 episodes)
# of 126-147 (the same range with and without final_obs bootstrapping: that early, few
# episodes reach the 500-step truncation); 3x random leaves a margin of about 2x below
# the worst of them.
RANDOM_RETURN = 22.0
THRESHOLD = 3 * RANDOM_RETURN
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _no_cuda() -> str:
    """Why PPO cannot run on CUDA here ('' where it can)."""
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    ok, why = shmbridge.cuda_status()
    return "" if ok else f"shmbridge.cuda_status(): {why}"


NO_CUDA = _no_cuda()
needs_cuda = pytest.mark.skipif(bool(NO_CUDA), reason=f"PPO on CUDA needs a usable GPU: {NO_CUDA}")


def test_ppo_learns_on_a_short_budget(tmp_path, capsys):
    before = regions()
    plot, csv = tmp_path / "curve.png", tmp_path / "curve.csv"
    rc = ppo.main([
        "--total-steps", "24576", "--seed", "1", "--device", "cpu",
        "--plot", str(plot), "--csv", str(csv), "--no-progress",
    ])
    out = capsys.readouterr().out
    assert rc == 0, out

    m = re.search(r"^final mean return over the last (\d+) episodes: ([0-9.]+) "
                  r"\(([0-9,]+) episodes, [0-9.]+ s, [0-9,]+ env-steps/s\)$", out, re.M)
    assert m, out
    window, mean, episodes = int(m.group(1)), float(m.group(2)), int(m.group(3).replace(",", ""))
    assert window == 100 and episodes >= 100, out
    assert mean >= THRESHOLD, out
    assert "device: cpu for the learner and the engine's tensors (--device cpu)" in out
    assert "torch device: cpu" in out

    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert f"learning curve: {plot}" in out
    rows = csv.read_text().splitlines()  # a row per update: 12 of 16 envs x 128 steps
    assert rows[0] == "env_steps,train_mean" and len(rows) == 13, rows
    assert rows[-1] == f"24576,{mean:.1f}", rows
    assert not regions() - before  # nothing new left (other processes may come and go)


def test_train_returns_the_result(tmp_path):
    before = regions()
    cfg = ppo.Config(total_steps=2048, num_steps=64, num_envs=8, seed=3, device="cpu",
                     plot=str(tmp_path / "c.png"), progress=False)
    r = ppo.train(cfg, log=lambda *a: None)
    assert r.env_steps == 2048 and not r.reached_target
    assert r.episodes > 0 and r.window_episodes == min(r.episodes, 100)
    assert len(r.curve_steps) == len(r.curve_returns) == 4
    assert r.curve_steps[-1] == 2048
    assert r.plot == str(tmp_path / "c.png") and (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC
    assert r.summary().startswith(f"final mean return over the last {r.window_episodes} episodes: ")
    assert not regions() - before  # nothing new left (other processes may come and go)


def test_ppo_trains_on_the_c_engine_exactly_as_on_the_reference_one(tmp_path):
    """`--engine-command` with the C CartPole engine (examples/c, through the C ABI): the
    same seeds give the same episodes and the same learning curve as the Rust engine."""
    from native_engines import build_c_engine, build_capi

    engine = build_c_engine(build_capi(), tmp_path)
    before = regions()
    runs = {}
    for name, command in [("rust", None), ("c", str(engine))]:
        cfg = ppo.Config(total_steps=4096, num_steps=64, num_envs=16, seed=5, device="cpu",
                         threads=1, plot=None, progress=False, engine_command=command)
        runs[name] = ppo.train(cfg, log=lambda *a: None)
    assert runs["c"].episodes > 50
    assert runs["c"].episodes == runs["rust"].episodes
    assert runs["c"].curve_returns == runs["rust"].curve_returns
    assert not regions() - before
    # Refused before anything starts: such an engine serves host memory, one engine.
    assert ppo.main(["--engine-command", str(engine), "--shards", "2"]) == 2
    with pytest.raises(ValueError, match="host memory"):
        ppo.train(ppo.Config(device="cuda", engine_command=str(engine)), log=lambda *a: None)


@pytest.mark.parametrize("image_device", ["vulkan", "host"])
def test_ppo_from_pixels_runs_plots_and_saves(tmp_path, capsys, image_device):
    """`--env pixels`: a CNN on the stacked frames the pixels engine draws, read through
    zero-copy views of the client's import (Vulkan) or of the region (host); the agent
    saved loads back."""
    from shmbridge.examples import ppo_pixels

    before = regions()
    plot, saved = tmp_path / "pixels.png", tmp_path / "agent.pt"
    rc = ppo.main([
        "--env", "pixels", "--image", "32x32x4", "--frame-stack", "3", "--num-envs", "4",
        "--num-steps", "32", "--num-minibatches", "2", "--total-steps", "256", "--seed", "1",
        "--device", "cpu", "--image-device", image_device, "--plot", str(plot),
        "--save", str(saved), "--no-progress",
    ])
    out, err = capsys.readouterr()
    if rc == 2 and "Vulkan is unavailable" in err:
        pytest.skip(f"no Vulkan driver here: {err.strip()}")
    assert rc == 0, out + err
    assert "frames: (4, 3, 32, 32, 4) u8 on cpu" in out, out
    assert "9 input channels of 32x32" in out, out
    assert re.search(r"^final mean return over the last \d+ episodes: ", out, re.M), out
    assert plot.read_bytes()[:8] == PNG_MAGIC
    agent, image, stack = ppo_pixels.load_agent(str(saved))
    assert (image, stack) == ("32x32x4", 3)
    assert agent.evaluate(torch.zeros(2, 9, 32, 32, dtype=torch.uint8))[0].shape == (2, 2)
    assert not regions() - before


# PPO from pixels on a short budget: 32x32 grey frames, two to a stack, 16 envs x 64
# steps an update, 96 updates (98,304 env steps; about 40 s on 2 free cores, 50-85 s
# with the machine shared). Seeds 1-6 ended at a mean return (last 100 episodes) of
# 89.9, 72.3, 79.7, 66.0, 67.4 and 73.6; with the renderer before it (Gymnasium's
# proportions: the lean under a pixel) seeds 1 and 2 ended at 30.8 and 34.3, and at
# 65,536 steps the new one still ended at 40-50. Twice the random policy's return sits
# between, with a margin of 1.5x below the worst seed.
PIXELS_ARGS = ["--env", "pixels", "--image", "32x32x1", "--frame-stack", "2", "--num-envs", "16",
               "--num-steps", "64", "--lr", "1e-3", "--total-steps", "98304", "--device", "cpu",
               "--threads", "1", "--no-progress", "--plot", "", "--save", ""]
PIXELS_THRESHOLD = 2 * RANDOM_RETURN


@pytest.mark.long
def test_ppo_learns_from_pixels_on_a_short_budget(capsys):
    """From the frames alone (the learner never reads the state), the mean return of the
    last 100 episodes ends at least twice a random policy's."""
    before = regions()
    rc = ppo.main(PIXELS_ARGS + ["--seed", "1"])
    out, err = capsys.readouterr()
    if rc == 2 and "Vulkan is unavailable" in err:
        pytest.skip(f"no Vulkan driver here: {err.strip()}")
    assert rc == 0, out + err
    m = re.search(r"^final mean return over the last (\d+) episodes: ([0-9.]+) ", out, re.M)
    assert m and int(m.group(1)) == 100, out
    assert float(m.group(2)) >= PIXELS_THRESHOLD, out
    assert not regions() - before


def test_module_help_and_bad_device():
    # -m entry point; --help needs neither torch nor an engine.
    p = subprocess.run([sys.executable, "-m", "shmbridge.examples.ppo", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for opt in ("--num-envs", "--total-steps", "--target-return", "--plot", "--threads"):
        assert opt in p.stdout

    if NO_CUDA:  # --device cuda where CUDA is unusable: a clear error, nothing started
        before = regions()
        assert ppo.main(["--device", "cuda", "--plot", "", "--no-progress"]) == 2
        assert not regions() - before


def test_device_choice_says_what_and_why():
    import torch

    assert ppo.choose_device("cpu") == ("cpu", "--device cpu")
    with pytest.raises(ValueError, match="expected auto, cpu or cuda"):
        ppo.choose_device("tpu")
    where, why = ppo.choose_device("auto")
    if not NO_CUDA:
        assert where == f"cuda:{torch.cuda.current_device()}"
        assert why.startswith("auto: torch and shmbridge can both use ")
        assert ppo.choose_device("cuda") == (where, "--device cuda")
        return
    assert where == "cpu"
    if not torch.cuda.is_available():
        assert why == f"auto: torch {torch.__version__} sees no CUDA device"
        with pytest.raises(ValueError, match="torch .* sees no CUDA device"):
            ppo.choose_device("cuda")
    else:
        reason = shmbridge.cuda_status().reason
        assert why == f"auto: torch sees a GPU but shmbridge cannot use CUDA: {reason}"
        with pytest.raises(ValueError, match="shmbridge cannot use CUDA"):
            ppo.choose_device("cuda")


def test_bootstrap_truncated_adds_gamma_v_of_the_final_observation():
    import torch

    gamma = 0.9
    terminated = torch.tensor([False, False, True, True, False])
    truncated = torch.tensor([False, True, False, True, True])  # envs 1, 4: cut by the limit
    final_obs = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    values = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0])
    seen = []

    def value_fn(x):
        seen.append(x.clone())
        return x.sum(-1)

    rewards = torch.ones(5)
    ppo.bootstrap_truncated(rewards, values, terminated, truncated, final_obs, value_fn, gamma)
    expected = torch.ones(5)
    expected[[1, 4]] += gamma * final_obs[[1, 4]].sum(-1)
    assert torch.allclose(rewards, expected)
    assert len(seen) == 1 and torch.equal(seen[0], final_obs[[1, 4]]), "V of the final obs only"

    # An engine without final_obs: V(obs before) stands in; the value function is not called.
    rewards = torch.ones(5)
    ppo.bootstrap_truncated(rewards, values, terminated, truncated, None, value_fn, gamma)
    assert torch.allclose(rewards, torch.tensor([1.0, 1 + gamma * 20, 1.0, 1.0, 1 + gamma * 50]))
    assert len(seen) == 1

    # Nothing truncated (or only with termination): rewards unchanged.
    rewards = torch.ones(5)
    ppo.bootstrap_truncated(rewards, values, terminated, terminated, final_obs, value_fn, gamma)
    assert torch.equal(rewards, torch.ones(5)) and len(seen) == 1


def test_train_bootstraps_from_the_engines_final_obs_view(monkeypatch):
    """With the cartpole engine, train() passes bootstrap_truncated the engine's final_obs
    as one zero-copy view, the same every step; --no-bootstrap-truncated skips it."""
    import torch

    calls = []
    real = ppo.bootstrap_truncated

    def spy(rewards, values, terminated, truncated, final_obs, value_fn, gamma):
        calls.append(final_obs)
        return real(rewards, values, terminated, truncated, final_obs, value_fn, gamma)

    monkeypatch.setattr(ppo, "bootstrap_truncated", spy)
    cfg = ppo.Config(total_steps=256, num_steps=32, num_envs=8, seed=3, device="cpu",
                     plot=None, progress=False)
    ppo.train(cfg, log=lambda *a: None)
    assert len(calls) == 32
    view = calls[0]
    assert isinstance(view, torch.Tensor) and view.shape == (8, 4) and view.dtype == torch.float32
    assert all(c is view for c in calls)

    calls.clear()
    cfg.bootstrap_truncated = False
    ppo.train(cfg, log=lambda *a: None)
    assert calls == []


@needs_cuda
def test_ppo_learns_on_cuda_end_to_end(tmp_path):
    """--device cuda: the engine's tensors in GPU memory, the learner's views of them
    CUDA tensors on the same memory, no host synchronisation in the rollout loop (torch's
    sync debug mode raises on any), and it learns as on the CPU."""
    before = regions()
    lines = []
    cfg = ppo.Config(total_steps=24576, seed=1, device="cuda", plot=str(tmp_path / "curve.png"),
                     progress=False, sync_debug="error")
    r = ppo.train(cfg, log=lines.append)
    assert r.device.startswith("cuda:") and r.engine_device == r.device, (r.device, r.engine_device)
    assert lines[0] == f"device: {r.device} for the learner and the engine's tensors (--device cuda)"
    # Each view was checked in train(): data_ptr() == the engine tensor's, on r.device.
    assert r.zero_copy_views == ["obs", "actions", "rewards", "terminated", "truncated", "final_obs"]
    assert r.env_steps == 24576
    assert r.window_episodes == 100 and r.episodes >= 100, r
    assert r.mean_return >= THRESHOLD, r.summary()
    assert (tmp_path / "curve.png").read_bytes()[:8] == PNG_MAGIC
    assert not regions() - before


@needs_cuda
def test_ppo_host_staged_on_cuda_learns_from_host_memory(tmp_path):
    """--host-staged with a CUDA learner: the engine's tensors stay in host memory, the
    learner reads copies on its GPU (the run bench and docs compare with CUDA IPC)."""
    before = regions()
    lines = []
    cfg = ppo.Config(total_steps=24576, seed=1, device="cuda", plot=None, progress=False,
                     host_staged=True)
    r = ppo.train(cfg, log=lines.append)
    assert r.device.startswith("cuda:") and r.engine_device == "cpu", (r.device, r.engine_device)
    assert lines[0].endswith("copied to it every step (--host-staged)"), lines[0]
    assert r.zero_copy_views == [], "no engine memory on the GPU: every view is a copy"
    assert r.mean_return >= THRESHOLD, r.summary()
    assert not regions() - before


def test_host_staged_on_a_cpu_learner_is_the_zero_copy_run():
    """On a CPU learner there is nothing to stage: the same views, the same curve."""
    runs = [ppo.train(ppo.Config(total_steps=2048, num_steps=32, seed=4, device="cpu", plot=None,
                                 progress=False, host_staged=staged), log=lambda *a: None)
            for staged in (False, True)]
    assert runs[1].zero_copy_views == runs[0].zero_copy_views
    assert runs[1].engine_device == runs[0].engine_device == "cpu"
    assert (runs[1].curve_steps, runs[1].curve_returns) == (runs[0].curve_steps, runs[0].curve_returns)
    assert runs[1].episodes == runs[0].episodes > 0


def test_staging_copies_engine_views_to_another_device_and_leaves_actions_in_place():
    """_Staging with the learner on another device: each engine→client view gets a copy
    there (other memory), which refresh() rewrites in place from the engine's view;
    actions stay the engine's own view. torch takes "cpu:0" for a device other than
    "cpu" (and .to() copies), which stands for a GPU here."""
    import torch

    views = {"obs": torch.zeros(4, 3), "actions": torch.zeros(4, 1, dtype=torch.int64),
             "rewards": torch.zeros(4)}
    staging = ppo._Staging(dict(views), torch.device("cpu", 0))
    learner = staging.learner_views
    assert sorted(staging.staged) == ["obs", "rewards"]
    assert learner["actions"] is views["actions"]
    copies = {name: learner[name] for name in staging.staged}
    for name, copy in copies.items():
        assert copy.data_ptr() != views[name].data_ptr(), name
    views["obs"].copy_(torch.arange(12.0).reshape(4, 3))
    views["rewards"].fill_(7.0)
    assert not torch.equal(learner["obs"], views["obs"]), "a copy, not a view"
    staging.refresh()
    assert all(learner[name] is copies[name] for name in copies), "refreshed in place"
    assert torch.equal(learner["obs"], views["obs"]) and torch.equal(learner["rewards"], views["rewards"])
    same = ppo._Staging(dict(views), torch.device("cpu"))
    assert same.staged == [] and all(same.learner_views[n] is views[n] for n in views)


@needs_cuda
def test_cuda_views_are_the_engines_memory():
    """What train() relies on, seen from outside: torch.from_dlpack of a CUDA cartpole
    engine's tensors gives CUDA tensors at the engine's device pointers, and actions
    written into the view in place drive the engine."""
    import torch

    with shmbridge.launch("cartpole", num_envs=8, device="cuda", seed=3) as c:
        assert c.device.startswith("cuda:")
        views = {n: torch.from_dlpack(c[n]) for n in ("obs", "actions", "final_obs")}
        for name, v in views.items():
            assert v.is_cuda and str(v.device) == c.device == c[name].device, name
            assert v.data_ptr() == c[name].data_ptr, name
        obs, act = views["obs"], views["actions"]
        first = obs.clone()
        act.fill_(1)
        c.step()
        assert not torch.equal(obs, first)  # the same view now holds the next frame
        # cartpole: pushing right (action 1) speeds the cart to the right
        assert bool((obs[:, 1] > first[:, 1]).all()), (first, obs)
        del views, obs, act  # before close: the client acknowledges once no view holds the memory


@needs_cuda
def test_bootstrap_truncated_on_cuda_matches_the_host_version():
    import torch

    gamma = 0.9
    terminated = torch.tensor([False, False, True, True, False])
    truncated = torch.tensor([False, True, False, True, True])
    final_obs = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    values = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0])
    for fo in (final_obs, None):
        host = torch.ones(5)
        ppo.bootstrap_truncated(host, values, terminated, truncated, fo, lambda x: x.sum(-1), gamma)
        dev = torch.ones(5, device="cuda")
        ppo.bootstrap_truncated(dev, values.cuda(), terminated.cuda(), truncated.cuda(),
                                None if fo is None else fo.cuda(), lambda x: x.sum(-1), gamma)
        assert torch.allclose(dev.cpu(), host), (fo is None, dev, host)


VIEWER = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "pixels_viewer.py")


@pytest.mark.parametrize("suffix", [".gif", ".mp4"])
def test_the_viewer_writes_a_video_of_a_saved_agent(tmp_path, suffix):
    """examples/pixels_viewer.py --policy: the frames of an agent that ppo_pixels saved,
    as a GIF (Pillow) or an MP4 (imageio-ffmpeg), one video frame per step; the host
    path, so no Vulkan driver is needed."""
    iio = pytest.importorskip("imageio.v3")
    if suffix == ".mp4":
        pytest.importorskip("imageio_ffmpeg")
    from shmbridge.examples import ppo_pixels

    cfg = ppo.Config(env="pixels", image="32x32x1", frame_stack=2)
    agent = ppo_pixels._agent(2, 32, 32, 2)
    ppo_pixels.save_agent(str(tmp_path / "agent.pt"), agent, cfg)
    before = regions()
    video = tmp_path / f"out{suffix}"
    proc = subprocess.run([sys.executable, VIEWER, "--policy", str(tmp_path / "agent.pt"),
                           "--video", str(video), "--steps", "12", "--num-envs", "2",
                           "--image", "32x48x4", "--image-device", "host"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {video} (12 frames of " in proc.stdout, proc.stdout
    frames = iio.imread(video, index=None, **({"plugin": "FFMPEG"} if suffix == ".mp4" else {}))
    assert len(frames) == 12 and frames.shape[-1] >= 3
    assert frames.min() < 64 and frames.max() > 200  # a drawn picture, not a blank one
    assert not regions() - before
