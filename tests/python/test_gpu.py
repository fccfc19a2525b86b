"""The CUDA device path from Python.

The first tests run everywhere: they check what a machine without CUDA gets (a typed
error with the reason, `auto` falling back to host memory and saying so, nothing left
behind). The tests marked `gpu` need a usable CUDA device and a CUDA build of torch; where
there is none (CI) they are skipped with the reason `shmbridge.cuda_status()` gives.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import shmbridge
from conftest import pattern, regions

CUDA_OK, CUDA_WHY = shmbridge.cuda_status()


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, ""


TORCH_OK, TORCH_WHY = _torch_cuda()
gpu = pytest.mark.skipif(
    not (CUDA_OK and TORCH_OK),
    reason=f"no usable CUDA device: {CUDA_WHY if not CUDA_OK else TORCH_WHY}",
)
no_gpu = pytest.mark.skipif(CUDA_OK, reason="CUDA is usable here; this checks the fallback")


# ---------------------------------------------------------------------------------------
# Everywhere


def test_cuda_available_is_a_bool_and_cuda_status_gives_the_reason():
    available = shmbridge.cuda_available()
    assert type(available) is bool, f"cuda_available() returned {available!r}, not a bool"
    status = shmbridge.cuda_status()
    assert isinstance(status, shmbridge.CudaStatus) and isinstance(status, tuple)
    assert status.available is available and status == (available, status.reason)
    assert isinstance(status.reason, str) and status.reason
    assert shmbridge.cuda_status() == status and shmbridge.cuda_available() is available, "cached, stable"
    if not os.path.exists("/dev/nvidiactl"):  # no NVIDIA driver: this machine, CI
        assert bool(shmbridge.cuda_available()) is False, status.reason


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "cuda:-1", ""])
def test_launch_refuses_a_bad_device_before_starting_anything(bad):
    before = regions()
    with pytest.raises(ValueError, match="device"):
        shmbridge.launch("null", num_envs=2, device=bad)
    assert regions() == before


def test_launch_refuses_a_non_string_device():
    with pytest.raises(TypeError, match="device"):
        shmbridge.launch("null", num_envs=2, device=0)


def test_host_client_reports_cpu_everywhere(null_client):
    assert null_client.device == "cpu"
    assert {t.device for t in null_client.tensors} == {"cpu"}
    assert null_client.obs.__dlpack_device__() == (1, 0)
    # A stream applies to CUDA engines only; for host tensors it is ignored.
    null_client.step(stream=12345)
    assert null_client.frame == 1


@no_gpu
def test_launch_cuda_without_cuda_raises_cuda_unavailable_with_the_reason(capfd):
    before = regions()
    with pytest.raises(shmbridge.CudaUnavailableError) as e:
        shmbridge.launch("cartpole", num_envs=4, device="cuda")
    assert isinstance(e.value, shmbridge.ShmBridgeError)
    assert "CUDA is unavailable" in str(e.value)
    assert CUDA_WHY in str(e.value), "the reason the probe gives"
    assert regions() == before, "nothing left in /dev/shm"


@no_gpu
def test_launch_auto_without_cuda_serves_host_tensors_and_says_so(capfd):
    with shmbridge.launch("null", num_envs=4, obs_dim=3, device="auto") as c:
        err = capfd.readouterr().err
        assert "shmbridge: device auto -> cpu" in err, err
        assert CUDA_WHY in err
        assert c.device == "cpu"
        obs = np.from_dlpack(c.obs)
        c.step()
        assert np.array_equal(obs, pattern(1, np.arange(12)).reshape(4, 3))


@no_gpu
def test_engine_cli_device_cuda_fails_cleanly_without_cuda():
    import subprocess
    import sys

    before = regions()
    r = subprocess.run(
        [sys.executable, "-m", "shmbridge._engine", "--env", "cartpole", "--num-envs", "4",
         "--device", "cuda"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 1
    assert r.stdout == "", "no region name printed"
    assert "CUDA is unavailable" in r.stderr and CUDA_WHY in r.stderr
    assert regions() == before


def test_cuda_engines_get_the_nvrtc_wheel_on_their_loader_path():
    dirs = shmbridge.nvrtc_library_dirs()
    if not dirs:
        pytest.skip("the nvidia-cuda-nvrtc-cu12 wheel (the cuda extra) is not installed")
    env = shmbridge._launch._engine_env("cuda")
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[: len(dirs)] == dirs
    assert shmbridge._launch._engine_env("cpu") is None, "host engines run in the plain environment"


def test_the_nvrtc_wheel_is_found_behind_another_nvidia_package(tmp_path, monkeypatch):
    """A regular ``nvidia`` package earlier on sys.path (CUDA 13's wheels, a ``pip
    --target`` folder) hides the wheel's ``nvidia.cuda_nvrtc`` from imports; the folder
    is found by path all the same, once, and a folder without libnvrtc.so.12 is not."""
    earlier, wheel, empty = tmp_path / "earlier", tmp_path / "wheel", tmp_path / "empty"
    (earlier / "nvidia").mkdir(parents=True)
    (earlier / "nvidia" / "__init__.py").write_text("")
    lib = wheel / "nvidia" / "cuda_nvrtc" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvrtc.so.12").write_bytes(b"")
    (empty / "nvidia" / "cuda_nvrtc" / "lib").mkdir(parents=True)
    monkeypatch.setattr("sys.path", [str(earlier), str(empty), str(wheel), str(wheel)])
    assert shmbridge.nvrtc_library_dirs() == [str(lib)]


# ---------------------------------------------------------------------------------------
# On a GPU


@pytest.fixture
def cuda_null():
    with shmbridge.launch("null", num_envs=16, obs_dim=8, act_dim=3, device="cuda") as c:
        yield c


def _expected_obs(torch, seq: int, n: int, device):
    """``pattern(seq, 0..n)`` as a float32 tensor on ``device``."""
    return torch.from_numpy(pattern(seq, np.arange(n))).to(device)


@gpu
def test_cuda_tensors_are_zero_copy_views_of_the_opened_handle(cuda_null):
    import torch

    c = cuda_null
    assert c.device.startswith("cuda:")
    ordinal = int(c.device.split(":")[1])
    for t in c.tensors:
        assert t.device == c.device
        assert t.__dlpack_device__() == (2, ordinal)
        v = torch.from_dlpack(t)
        assert v.is_cuda and v.device.index == ordinal
        # Zero device copies: torch's pointer is the one opened from the handle + offset.
        assert v.data_ptr() == t.data_ptr
    obs, actions = c.obs, c.actions
    # One allocation, opened once: the offsets between tensors are the layout's.
    schema = c.schema()
    names = [d["name"] for d in schema["tensors"]]
    assert "obs" in names and "actions" in names
    assert all(d["location"] == "cuda" for d in schema["tensors"])
    assert obs.data_ptr != actions.data_ptr
    with pytest.raises(TypeError, match="cuda"):
        np.asarray(c.obs)


@gpu
def test_engine_kernel_writes_are_visible_after_from_dlpack_without_synchronize(cuda_null):
    import torch

    c = cuda_null
    n = 16 * 8
    for seq in range(1, 40):
        c.step()
        # A fresh import on the current stream: __dlpack__(stream=current) makes the
        # stream wait on the engine's event; no torch.cuda.synchronize() anywhere.
        obs = torch.from_dlpack(c.obs).reshape(-1)
        assert torch.equal(obs, _expected_obs(torch, seq, n, obs.device)), seq


@gpu
def test_persistent_views_follow_steps_on_a_side_stream(cuda_null):
    import torch

    c = cuda_null
    obs = torch.from_dlpack(c.obs).reshape(-1)
    side = torch.cuda.Stream(device=obs.device)
    acc = torch.zeros_like(obs)
    side.wait_stream(torch.cuda.current_stream(obs.device))  # acc's zeros first
    with torch.cuda.stream(side):
        for seq in range(1, 30):
            c.step()  # ordered on `side`, torch's current stream here
            acc += obs  # queued on `side` after the wait on the engine's event
            # The copy is queued on `side` too: it reads frame `seq`, not a later one.
            assert torch.equal(obs.clone(), _expected_obs(torch, seq, obs.numel(), obs.device))
    side.synchronize()
    want = sum(_expected_obs(torch, s, obs.numel(), obs.device) for s in range(1, 30))
    assert torch.equal(acc, want)


@gpu
def test_dlpack_stream_values(cuda_null):
    import torch

    c = cuda_null
    c.step()
    s = torch.cuda.Stream(device=torch.device(c.device))
    for stream in (None, 1, 2, -1, s.cuda_stream):
        cap = c.obs.__dlpack__(stream=stream)
        assert cap is not None
    with pytest.raises((ValueError, BufferError)):
        c.obs.__dlpack__(stream=0)  # ambiguous in the DLPack standard
    with pytest.raises(BufferError):
        c.obs.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        c.obs.__dlpack__(dl_device=(1, 0))


@gpu
def test_cuda_actions_are_copied_device_to_device_and_cpu_actions_refused(cuda_null):
    import torch

    c = cuda_null
    dev = torch.device(c.device)
    rewards = torch.from_dlpack(c.rewards)
    for seq in range(1, 20):
        a = torch.full((16, 3), float(seq), device=dev)
        a[:, 0] = torch.arange(16, device=dev, dtype=torch.float32) * seq
        c.step(a)
        assert torch.equal(rewards, a[:, 0]), seq  # null echoes actions[:, 0]
    frame = c.frame
    with pytest.raises(ValueError, match="cuda"):
        c.step(torch.zeros(16, 3))  # a CPU tensor for a CUDA slot: no silent transfer
    with pytest.raises(ValueError, match="cuda"):
        c.step(np.zeros((16, 3), np.float32))  # NumPy: a host DLPack tensor too
    with pytest.raises(TypeError, match="CUDA tensor"):
        c.step([[0.0] * 3] * 16)  # not a tensor at all
    with pytest.raises(TypeError, match="dtype"):
        c.step(torch.zeros(16, 3, dtype=torch.float64, device=dev))
    with pytest.raises(ValueError, match="shape"):
        c.step(torch.zeros(16, 4, device=dev))
    with pytest.raises(ValueError, match="contiguous"):
        c.step(torch.zeros(3, 16, device=dev).t())
    assert c.frame == frame, "nothing was sent"


@gpu
def test_cuda_cartpole_agrees_with_the_cpu_engine_on_the_same_seeds():
    import torch

    n, steps = 64, 400
    gen = np.random.default_rng(7)
    plan = gen.integers(0, 2, size=(steps, n, 1), dtype=np.int64)
    with shmbridge.launch("cartpole", num_envs=n, seed=3, device="cpu") as cpu, \
            shmbridge.launch("cartpole", num_envs=n, seed=3, device="cuda") as gpu_c:
        dev = torch.device(gpu_c.device)
        cobs = np.from_dlpack(cpu.obs)
        gobs = torch.from_dlpack(gpu_c.obs)
        assert np.allclose(cobs, gobs.cpu().numpy(), rtol=1e-5, atol=1e-6)
        diverged = np.zeros(n, bool)
        for k in range(steps):
            cpu.step(plan[k])
            gpu_c.step(torch.from_numpy(plan[k]).to(dev))
            g = {name: torch.from_dlpack(gpu_c[name]).cpu().numpy()
                 for name in ("obs", "rewards", "terminated", "truncated", "final_obs")}
            c = {name: np.from_dlpack(cpu[name]) for name in g}
            same_done = (g["terminated"].reshape(n) == c["terminated"].reshape(n)) & \
                        (g["truncated"].reshape(n) == c["truncated"].reshape(n))
            # An env whose done flag differs (a threshold met by an ulp on one side
            # only) is followed no further; the rest must agree to float tolerance.
            diverged |= ~same_done
            ok = ~diverged
            assert np.allclose(g["obs"][ok], c["obs"][ok], rtol=1e-5, atol=1e-6), k
            assert np.allclose(g["final_obs"][ok], c["final_obs"][ok], rtol=1e-5, atol=1e-6), k
            assert np.array_equal(g["rewards"][ok], c["rewards"][ok]), k
        assert diverged.mean() < 0.05, f"{diverged.sum()} of {n} envs diverged"


@gpu
def test_reset_over_the_command_channel_on_the_gpu():
    import torch

    with shmbridge.launch("cartpole", num_envs=8, seed=0, device="cpu") as cpu, \
            shmbridge.launch("cartpole", num_envs=8, seed=0, device="cuda") as g:
        cpu.reset(seed=[11, 12], env_ids=[2, 5])
        g.reset(seed=[11, 12], env_ids=[2, 5])
        got = torch.from_dlpack(g.obs).cpu().numpy()
        assert np.allclose(got, np.from_dlpack(cpu.obs), rtol=1e-6, atol=1e-7)


@gpu
def test_handles_are_closed_after_100_attach_close_cycles():
    import torch

    torch.cuda.init()
    free0, _ = torch.cuda.mem_get_info()
    for _ in range(100):
        with shmbridge.launch("null", num_envs=64, obs_dim=16384, device="cuda") as c:
            v = torch.from_dlpack(c.obs)
            c.step()
            assert v.sum().item() >= 0
            del v
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    # cuMemGetInfo is device-wide: other processes may allocate meanwhile; 100 leaked
    # 4 MiB allocations would be 400 MiB, so a 64 MiB slack still catches a leak.
    assert free0 - free1 < 64 << 20, (free0, free1)


@gpu
def test_engine_death_with_views_held_raises_and_releases_cleanly():
    import torch

    c = shmbridge.launch("cartpole", num_envs=8, device="cuda")
    obs = torch.from_dlpack(c.obs)
    c.step()
    os.kill(c.engine_pid, signal.SIGKILL)
    with pytest.raises(shmbridge.EngineDiedError):
        for _ in range(1000):
            c.step(timeout=10.0)
    c.close()  # closes the handles once; no crash, no hang
    assert c.closed and c.engine_process.poll() == -signal.SIGKILL
    del obs  # the last view: the lease closes the (dead engine's) handle


@gpu
def test_close_with_views_held_then_views_released():
    import torch

    c = shmbridge.launch("null", num_envs=4, obs_dim=4, device="cuda")
    obs = torch.from_dlpack(c.obs)
    c.step()
    assert torch.equal(obs.reshape(-1), _expected_obs(torch, 1, 16, obs.device))
    c.close()
    with pytest.raises(shmbridge.ClosedError):
        c.obs.__dlpack__()  # the client's own objects let go at close
    # close() waited for the engine: it gave up waiting for the acknowledgement (a view
    # was alive) and exited, which is when the driver reclaims its memory.
    assert c.engine_process.poll() == 0
    del obs
