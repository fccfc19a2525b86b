"""Vulkan tensors from Python: `rgb` of an engine that exports it as Vulkan memory is
the engine's memory mapped into this process (kDLCPU through a Vulkan device of the
client's own), viewed without a copy by NumPy and torch; views outlive the client; bad
importer choices are typed errors; nothing is left behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import shmbridge
from conftest import pattern, regions


def launch_vulkan(**kwargs):
    """A `null` engine whose `rgb` lives in Vulkan memory it exports, or a skip (with
    the reason) where this machine has no Vulkan driver."""
    try:
        return shmbridge.launch(
            "null", num_envs=4, obs_dim=2, image="8x8x4", image_device="vulkan", **kwargs
        )
    except shmbridge.EngineStartError as e:
        if "Vulkan is unavailable" in str(e):
            pytest.skip(f"no Vulkan driver here: {e}")
        raise


def rgb_pattern(seq: int, n: int) -> np.ndarray:
    """The `null` engine's `rgb` bytes of frame `seq` (the pattern's low byte)."""
    return (pattern(seq, np.arange(n)).astype(np.uint32) & 0xFF).astype(np.uint8)


def test_vulkan_frames_are_the_engines_memory_without_a_copy():
    before = regions()
    with launch_vulkan(importer="vulkan") as client:
        assert "Vulkan importer" in client.importer
        rgb = client["rgb"]
        assert rgb.__dlpack_device__() == (1, 0)
        assert rgb.device == "cpu"
        assert (rgb.shape, rgb.dtype) == ((4, 8, 8, 4), "uint8")
        a = np.from_dlpack(rgb)
        t = torch.from_dlpack(rgb)
        # One address: the mapping of the engine's export, shared by every view.
        assert a.ctypes.data == rgb.data_ptr == t.data_ptr()
        # Outside the region: a Vulkan mapping, not the shared-memory tensor table.
        obs = np.from_dlpack(client.obs)
        assert not (obs.ctypes.data <= rgb.data_ptr < obs.ctypes.data + (1 << 20))
        for k in range(1, 6):
            client.step()
            # The same views see each new frame the engine wrote.
            np.testing.assert_array_equal(a.ravel(), rgb_pattern(k, a.size))
            assert torch.equal(t.flatten(), torch.from_numpy(rgb_pattern(k, a.size)))
        assert np.asarray(client["rgb"]).ctypes.data == rgb.data_ptr
    assert regions() <= before


def test_auto_takes_the_vulkan_importer_without_cuda_and_says_why():
    with launch_vulkan() as client:
        reason = client.importer
        assert reason.startswith("Vulkan importer on ")
        if not torch.cuda.is_available():
            assert "CUDA" in reason


def test_a_view_outlives_the_client_and_the_tensor_object_refuses_after_close():
    client = launch_vulkan(importer="vulkan")
    client.step()
    view = np.from_dlpack(client["rgb"])
    rgb = client["rgb"]
    client.close()
    # The view holds the import: the mapping stays, with the last frame in it.
    np.testing.assert_array_equal(view.ravel(), rgb_pattern(1, view.size))
    with pytest.raises(shmbridge.ClosedError):
        np.asarray(rgb)
    with pytest.raises(shmbridge.ClosedError):
        np.from_dlpack(rgb)
    del view


def test_an_unknown_importer_is_refused_before_attaching():
    with pytest.raises(shmbridge.InvalidSpecError, match="auto, vulkan or cuda"):
        shmbridge.attach("shmbridge-none", importer="opengl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks a machine without CUDA")
def test_the_cuda_importer_without_cuda_is_a_typed_error_and_nothing_is_left():
    before = regions()
    with pytest.raises(shmbridge.CudaUnavailableError):
        launch_vulkan(importer="cuda")
    assert regions() <= before


def launch_pixels(**kwargs):
    """The `pixels` engine, or a skip (with the reason) where there is no Vulkan driver."""
    try:
        return shmbridge.launch("pixels", **kwargs)
    except shmbridge.EngineStartError as e:
        if "Vulkan is unavailable" in str(e):
            pytest.skip(f"no Vulkan driver here: {e}")
        raise


def test_pixels_frames_reach_torch_without_a_copy_and_follow_the_state():
    """The frames the `pixels` engine's shader rendered, seen by torch at the import's
    address; each step the cart is drawn where the observation puts it."""
    before = regions()
    h, w = 64, 96
    with launch_pixels(num_envs=3, seed=5, image=f"{h}x{w}x4") as client:
        rgb = client["rgb"]
        assert (rgb.shape, rgb.dtype) == ((3, h, w, 4), "uint8")
        frames = torch.from_dlpack(rgb)
        assert frames.data_ptr() == rgb.data_ptr
        obs = torch.from_dlpack(client.obs)
        actions = torch.from_dlpack(client.actions)
        previous = frames.clone()
        cart_row = int(h * 0.75) - 2  # above the track, inside the cart
        for step in range(1, 41):
            actions.fill_((step // 4) % 2)
            client.step()
            assert not torch.equal(frames, previous), f"step {step}: the frame did not change"
            previous = frames.clone()
            for env in range(3):
                # The cart: the dark pixels of its row, centred where x puts it
                # (Gymnasium's picture: 4.8 m across the frame).
                dark = (frames[env, cart_row, :, 0] < 128).nonzero().flatten().float()
                assert len(dark) > 0, f"step {step} env {env}: no cart"
                want = w / 2 + float(obs[env, 0]) * w / 4.8
                assert abs(float(dark.mean()) + 0.5 - want) < 1.0, (step, env, dark, want)
        assert torch.from_dlpack(client["rgb"]).data_ptr() == frames.data_ptr()
    assert regions() <= before
