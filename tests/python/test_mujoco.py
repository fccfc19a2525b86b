"""The native MuJoCo engine (``launch("mujoco/<Task>")``, the ``mujoco`` cargo feature;
docs/mujoco.md) against Gymnasium's own env: both start from the same ``qpos``/``qvel``
(Gymnasium's reset state, set on the engine with the ``set_state`` command) and take the
same random actions for 1,000 steps; observations, rewards, terminations and truncations
agree. After an episode ends, Gymnasium is reset and its new state set on the engine's
env (whose own autoreset drew the same noise for the tasks of uniform noise, other noise
for HalfCheetah's and Ant's normal velocities), and on they go.

Observations: bit for bit those of Gymnasium rounded to ``float32`` (what the engine
serves). Both step the same MuJoCo 3.17 build on the same model file, so the state agrees
to the bit, and so does every observation element (``qpos``, ``qvel``, ``cfrc_ext``,
``cinert``, ...) read from it. Rewards: within 1e-5, plus half an ulp of the served
``float32`` (2**-24 relative: it matters only above about 160). The reward is arithmetic
on that state where the order of operations differs: NumPy sums the control cost of the
``float32`` action in ``float32`` and pairwise, the engine in ``float64`` and in order
(HalfCheetah and Ant differ from ``float32(gymnasium's reward)`` by an ulp or so on a
third of their steps or more).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import shmbridge
from shmbridge.errors import EngineStartError


def _built_with_mujoco() -> bool:
    """Whether the installed shmbridge has the native MuJoCo engines (the cargo feature
    `mujoco`): its `engine --env` help lists the registry's entries, theirs only then."""
    out = subprocess.run([sys.executable, "-m", "shmbridge", "engine", "--help"],
                         capture_output=True, text=True, timeout=120)
    return "mujoco/HalfCheetah-v5" in out.stdout


# The default wheel has no MuJoCo engine: scripts/test-mujoco.sh builds one that has and
# runs this file with it.
if not _built_with_mujoco():
    pytest.skip("shmbridge was built without the `mujoco` feature (docs/mujoco.md)", allow_module_level=True)

# torch's CUDA wheels bring triton, which the PPO test's torch imports; triton's LLVM
# loaded after Mesa's llvmpipe (the camera tests draw with it) crashes the process in its
# import, while the other order works: import it first, at collection.
try:
    import triton  # noqa: F401
except ImportError:
    pass

gymnasium = pytest.importorskip("gymnasium", reason="the alignment tests compare with gymnasium[mujoco]")
pytest.importorskip("mujoco", reason="the alignment tests compare with gymnasium[mujoco]")

TOL = 1e-5
RTOL = 2.0**-24  # half an ulp of float32, relative
STEPS = 1000
TASKS = ["HalfCheetah-v5", "InvertedPendulum-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5", "Humanoid-v5"]


def launch_mujoco(task: str, num_envs: int, **kwargs):
    try:
        return shmbridge.launch(f"mujoco/{task}", num_envs=num_envs, **kwargs)
    except EngineStartError as e:
        if "without the `mujoco` feature" in str(e):
            pytest.skip("shmbridge was built without the `mujoco` feature (docs/mujoco.md)")
        raise


def numbers(values) -> str:
    """Comma-separated, each float as Python's shortest round-trip repr: exact."""
    return ",".join(repr(float(v)) for v in values)


def set_state(client, env: int, qpos, qvel) -> None:
    client.call("set_state", env=env, qpos=numbers(qpos), qvel=numbers(qvel))


@pytest.mark.parametrize("task", TASKS)
def test_the_native_engine_matches_gymnasium_for_1000_steps(task: str) -> None:
    genv = gymnasium.make(task)
    sim = genv.unwrapped
    rng = np.random.default_rng(7)
    # Two envs: the compared one is env 1, so a wrong index would show.
    with launch_mujoco(task, 2, seed=3) as client:
        low, high = genv.action_space.low, genv.action_space.high
        gobs, _ = genv.reset(seed=11)
        set_state(client, 1, sim.data.qpos, sim.data.qvel)
        np.testing.assert_array_equal(np.asarray(client.obs)[1], gobs.astype(np.float32))
        final_obs = client["final_obs"]
        episodes = 0
        for step in range(STEPS):
            actions = rng.uniform(low, high, size=(2, len(low))).astype(np.float32)
            gobs, greward, gterm, gtrunc, _ = genv.step(actions[1])
            _, rewards, terminated, truncated = client.step(actions)
            ours = np.asarray(final_obs)[1]
            where = f"{task}, step {step}"
            np.testing.assert_array_equal(ours, gobs.astype(np.float32), err_msg=where)
            assert abs(float(np.asarray(rewards)[1]) - greward) <= TOL + RTOL * abs(greward), where
            assert bool(np.asarray(terminated)[1]) == gterm, where
            assert bool(np.asarray(truncated)[1]) == gtrunc, where
            if gterm or gtrunc:
                episodes += 1
                genv.reset()
                set_state(client, 1, sim.data.qpos, sim.data.qvel)
        print(f"{task}: {STEPS} steps, {episodes} episodes ended")
    genv.close()


def test_state_round_trips_exactly_and_bad_states_are_refused() -> None:
    with launch_mujoco("Hopper-v5", 3) as client:
        info = client.call("model_info")
        assert (info["nq"], info["nv"], info["nu"]) == ("6", "6", "3")
        assert info["joints"] == "rootx,rootz,rooty,thigh_joint,leg_joint,foot_joint"
        assert info["actuators"] == ",,"  # hopper.xml names none of its motors
        state = client.call("get_state", env=2)
        qpos = [float(v) for v in state["qpos"].split(",")]
        assert len(qpos) == 6 and abs(qpos[1] - 1.25) < 0.01
        qpos[3] = 0.1 + 1e-17 * 3  # any double: written and read back exactly
        client.call("set_state", env=2, qpos=numbers(qpos), qvel=state["qvel"], time="1.5")
        back = client.call("get_state", env=2)
        assert back["qpos"] == numbers(qpos)
        assert back["qvel"] == state["qvel"]
        assert float(back["time"]) == 1.5
        # The served observation follows: qpos[1:] then qvel.
        np.testing.assert_allclose(np.asarray(client.obs)[2][:5], np.array(qpos[1:], np.float32))
        bad = [
            dict(env=3, qpos=state["qpos"], qvel=state["qvel"]),  # no such env
            dict(env=0, qpos="1,2", qvel=state["qvel"]),  # wrong length
            dict(env=0, qpos=state["qpos"].replace(state["qpos"].split(",")[0], "nan", 1), qvel=state["qvel"]),
            dict(env=0, qpos="a,b,c,d,e,f", qvel=state["qvel"]),
            dict(env=0, qpos=state["qpos"], qvel="1e300,0,0,0,0,0"),  # past MuJoCo's mjMAXVAL
            dict(env=0, qpos=state["qpos"], qvel=state["qvel"], time="inf"),
            dict(env=0, qvel=state["qvel"]),  # qpos missing
        ]
        before = client.call("get_state", env=0)
        for args in bad:
            with pytest.raises(shmbridge.errors.RemoteError):
                client.call("set_state", **args)
        assert client.call("get_state", env=0) == before
        with pytest.raises(shmbridge.errors.RemoteError, match="unknown method"):
            client.call("set_qpos")


def test_model_info_gives_each_objects_name_and_size() -> None:
    """``model_info``: per joint its widths in ``qpos``/``qvel``, per sensor its outputs,
    per camera its resolution, next to the names; they agree with MuJoCo's own model."""
    import mujoco

    with launch_mujoco("Ant-v5", 1) as client:
        info = client.call("model_info")
    model = gymnasium.make("Ant-v5").unwrapped.model
    assert info["joint_qpos_sizes"] == "7" + ",1" * 8  # the free root, 8 hinges
    assert info["joint_qvel_sizes"] == "6" + ",1" * 8
    assert sum(int(v) for v in info["joint_qpos_sizes"].split(",")) == model.nq == int(info["nq"])
    assert info["sensor_sizes"] == ",".join(str(d) for d in model.sensor_dim)
    assert info["camera_sizes"] == ",".join(f"{w}x{h}" for w, h in model.cam_resolution)
    assert len(info["cameras"].split(",")) == model.ncam
    assert info["bodies"].split(",")[1] == mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_BODY, 1)


def test_set_control_is_the_envs_ctrl_until_the_next_step() -> None:
    """``set_control(env, ctrl)``: the env's ``ctrl``, then ``mj_forward``; its observation
    is rewritten (Humanoid's holds ``qfrc_actuator``: the same as Gymnasium's after the same
    ``ctrl`` and ``mj_forward``, as float32). The next step sets ``ctrl`` to its action.
    Bad controls are refused and nothing is written."""
    import mujoco

    genv = gymnasium.make("Humanoid-v5")
    sim = genv.unwrapped
    genv.reset(seed=0)
    ctrl = np.random.default_rng(3).uniform(-0.4, 0.4, sim.model.nu)
    with launch_mujoco("Humanoid-v5", 2) as client:
        set_state(client, 1, sim.data.qpos, sim.data.qvel)
        before = np.asarray(client.obs)[1].copy()
        client.call("set_control", env=1, ctrl=numbers(ctrl))
        sim.data.ctrl[:] = ctrl
        mujoco.mj_forward(sim.model, sim.data)
        assert client.call("get_state", env=1)["ctrl"] == numbers(ctrl)
        obs = np.asarray(client.obs)[1]
        np.testing.assert_array_equal(obs, sim._get_obs().astype(np.float32))
        assert not np.array_equal(obs, before)  # the actuator forces are in it
        for bad in ["1,2", numbers(ctrl).replace(numbers(ctrl).split(",")[0], "nan", 1), ""]:
            with pytest.raises(shmbridge.errors.RemoteError):
                client.call("set_control", env=1, ctrl=bad)
        with pytest.raises(shmbridge.errors.RemoteError):
            client.call("set_control", env=2, ctrl=numbers(ctrl))
        assert client.call("get_state", env=1)["ctrl"] == numbers(ctrl)
        actions = np.zeros((2, sim.model.nu), np.float32)
        actions[1] = 0.25
        client.step(actions)
        assert client.call("get_state", env=1)["ctrl"] == numbers(actions[1])


def test_reset_by_env_ids_resets_those_envs_only() -> None:
    """``client.reset(env_ids=..., seed=...)`` restarts the listed envs (the k-th listed
    with ``seed + k``, Gymnasium's initial state of that seed) and leaves the others
    where they are."""
    genv = gymnasium.make("Hopper-v5")
    with launch_mujoco("Hopper-v5", 4, seed=0) as client:
        for _ in range(5):
            client.step(np.full((4, 3), 0.3, np.float32))
        states = [client.call("get_state", env=i) for i in range(4)]
        client.reset(env_ids=[3, 1], seed=40)
        after = [client.call("get_state", env=i) for i in range(4)]
        assert after[0] == states[0] and after[2] == states[2]
        for i, seed in ((3, 40), (1, 41)):
            genv.reset(seed=seed)
            assert after[i]["qpos"] == numbers(genv.unwrapped.data.qpos)
            assert after[i]["qvel"] == numbers(genv.unwrapped.data.qvel)
            assert after[i]["time"] == "0"


def test_hostile_actions_do_not_stop_the_engine() -> None:
    """NaN, infinite and huge controls: MuJoCo zeroes bad controls (its mjWARN_BADCTRL)
    and the engine serves on; the reward is what Gymnasium's formula gives for them (NaN,
    -inf); the next steps with good actions are finite everywhere."""
    with launch_mujoco("Hopper-v5", 3) as client:
        bad = np.array([[np.nan, 0, 0], [np.inf, -np.inf, 1e30], [0.1, 0.1, 0.1]], np.float32)
        _, rewards, _, _ = client.step(bad)
        rewards = np.asarray(rewards).copy()
        assert np.isnan(rewards[0]) and rewards[1] == -np.inf and np.isfinite(rewards[2])
        assert np.isfinite(np.asarray(client.obs)).all()
        for _ in range(5):
            _, rewards, _, _ = client.step(np.zeros((3, 3), np.float32))
            assert np.isfinite(np.asarray(rewards)).all()
        assert np.isfinite(np.asarray(client.obs)).all()


def test_warnings_leave_no_log_file_and_raw_rewards_zero_for_bad_actions(tmp_path, monkeypatch) -> None:
    """MuJoCo's warnings go to the engine's stderr only: HalfCheetah's model (its
    deprecated ``settotalmass``) and a client's NaN controls, at every episode, leave no
    ``MUJOCO_LOG.TXT`` in the caller's working folder. ``mujoco/raw`` (no control cost)
    rewards a NaN or infinite action with 0, not NaN."""
    path = tmp_path / "cart_pole.xml"
    path.write_text(RAW_XML)
    monkeypatch.chdir(tmp_path)
    launch_mujoco("HalfCheetah-v5", 2).close()
    with shmbridge.launch("mujoco/raw", num_envs=2, model=str(path)) as client:
        bad = np.array([[np.nan, 0], [np.inf, -np.inf]], np.float32)
        mask = np.asarray(client.reset_mask)
        for _ in range(3):
            # A reset clears MuJoCo's count of warnings: each episode's NaN warns again.
            mask[:] = True
            client.step(np.zeros((2, 2), np.float32))
            mask[:] = False
            _, rewards, _, _ = client.step(bad)
            assert np.asarray(rewards).tolist() == [0.0, 0.0]
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()


def test_sharded_engines_serve_their_own_envs() -> None:
    with launch_mujoco("HalfCheetah-v5", 4, shards=2, seed=5) as client:
        assert client.shards == [(0, 2), (2, 4)]
        obs = np.asarray(client.obs).copy()
        # Each shard answers for its own slice, by region index.
        s2 = client.call("get_state", env=2, shard=1)
        qpos = np.array([float(v) for v in s2["qpos"].split(",")])
        np.testing.assert_allclose(obs[2][:8], qpos[1:].astype(np.float32))
        with pytest.raises(shmbridge.errors.RemoteError, match="not served here"):
            client.call("get_state", env=2, shard=0)
        # One engine with the same seed starts its envs where the two shards did.
    with launch_mujoco("HalfCheetah-v5", 4, seed=5) as whole:
        np.testing.assert_array_equal(np.asarray(whole.obs), obs)
        for _ in range(3):
            _, rewards, _, _ = whole.step(np.zeros((4, 6), np.float32))
        assert np.all(np.isfinite(np.asarray(rewards)))


def test_threads_step_the_same_episodes_as_one_thread() -> None:
    """``threads``: each thread steps a contiguous run of envs; with the same seed and
    actions every output agrees to the bit with one thread, through the ends and
    autoresets of many episodes (Hopper, random actions: about 25 steps each)."""
    n, steps = 7, 200
    rng = np.random.default_rng(1)
    actions = rng.uniform(-1, 1, size=(steps, n, 3)).astype(np.float32)
    runs = []
    for threads in (1, 3):
        with launch_mujoco("Hopper-v5", n, seed=9, threads=threads) as client:
            out = []
            for a in actions:
                _, rewards, terminated, truncated = client.step(a)
                out.append((np.asarray(client.obs).copy(), np.asarray(client["final_obs"]).copy(),
                            np.asarray(rewards).copy(), np.asarray(terminated).copy(), np.asarray(truncated).copy()))
            runs.append(out)
    ended = 0
    for one, three in zip(*runs):
        for x, y in zip(one, three):
            np.testing.assert_array_equal(x, y)
        ended += int(one[3].sum())
    assert ended > n  # many episodes ended and restarted on every thread's run of envs


def test_step_threads_are_started_once_for_the_engines_life() -> None:
    """``threads=T``: the engine keeps T - 1 step threads (its own is the T-th) from start
    to end; a step hands them work and starts none. Between steps the engine process has
    T - 1 threads more than an engine with one thread, the same ones (same thread ids)
    after the first step and after many."""
    import os

    def threads_of(client) -> set:
        return set(os.listdir(f"/proc/{client.engine_process.pid}/task"))

    seen = {}
    for threads in (1, 3):
        with launch_mujoco("Hopper-v5", 6, seed=1, threads=threads) as client:
            client.step(np.zeros((6, 3), np.float32))
            after_one = threads_of(client)
            for _ in range(20):
                client.step(np.zeros((6, 3), np.float32))
            assert threads_of(client) == after_one
            seen[threads] = after_one
    assert len(seen[3]) == len(seen[1]) + 2


@pytest.mark.parametrize("task", TASKS)
def test_the_same_seed_gives_gymnasiums_initial_states(task: str) -> None:
    """Env ``i`` of an engine launched (or reset) with ``seed`` draws its reset noise from
    NumPy's generator as Gymnasium's ``reset(seed=seed + i)`` seeds it, and its later
    autoresets go on drawing from it as Gymnasium's ``reset()`` does: the same states, bit
    for bit. HalfCheetah and Ant draw their velocities from ``standard_normal`` (NumPy's
    ziggurat, not reproduced: docs/mujoco.md): their positions agree, their velocities
    not."""
    normal = task in ("HalfCheetah-v5", "Ant-v5")
    n, seed = 3, 11
    genvs = [gymnasium.make(task) for _ in range(n)]

    def check(client, i: int) -> None:
        sim = genvs[i].unwrapped
        state = client.call("get_state", env=i)
        qpos = np.array([float(v) for v in state["qpos"].split(",")])
        qvel = np.array([float(v) for v in state["qvel"].split(",")])
        np.testing.assert_array_equal(qpos, sim.data.qpos)
        if not normal:
            np.testing.assert_array_equal(qvel, sim.data.qvel)

    with launch_mujoco(task, n, seed=seed) as client:
        for i, genv in enumerate(genvs):
            genv.reset(seed=seed + i)
            check(client, i)
        client.reset(seed=seed + 5)
        for i, genv in enumerate(genvs):
            genv.reset(seed=seed + 5 + i)
            check(client, i)
        if normal:
            return
        # Env 1's next episodes start where Gymnasium's next reset() starts.
        zeros = np.zeros((n, genvs[1].action_space.shape[0]), np.float32)
        for _ in range(2):
            genvs[1].reset()
            for _ in range(1000):
                _, _, terminated, truncated = client.step(zeros)
                if np.asarray(terminated)[1] or np.asarray(truncated)[1]:
                    break
            check(client, 1)


def compare_camera_with_mujoco_renderer(task: str, depth: bool) -> None:
    """Env 1 of a 2-env engine with ``camera="track"`` (and ``camera_depth``) against
    ``mujoco.Renderer(model, H, W)`` drawing Gymnasium's env after
    ``update_scene(data, camera="track")``: Gymnasium's env set to the engine's env 1
    state (``set_state``), then both stepped with the same actions for 6 steps (so both
    ``mjData`` agree to the bit, the kinematics of the last substep included). Each step's
    ``rgb`` row equals ``render()`` and, with ``depth``, the ``depth`` row equals
    ``render()`` after ``enable_depth_rendering()``, bit for bit."""
    import mujoco

    h, w = 48, 64
    genv = gymnasium.make(task)
    sim = genv.unwrapped
    genv.reset(seed=1)
    renderer = mujoco.Renderer(sim.model, h, w)
    rng = np.random.default_rng(0)
    nu = sim.model.nu
    extra = {"camera_depth": True} if depth else {}
    with renderer, launch_mujoco(task, 2, seed=0, camera="track", camera_size=f"{h}x{w}", **extra) as client:
        assert client["rgb"].shape == (2, h, w, 3)
        if depth:
            assert client["depth"].shape == (2, h, w)
            assert np.asarray(client["depth"]).dtype == np.float32
        else:
            with pytest.raises(KeyError):
                client["depth"]
        set_state(client, 1, sim.data.qpos, sim.data.qvel)
        frames, depths = [], []
        for step in range(6):
            renderer.update_scene(sim.data, camera="track")
            want = renderer.render()
            got = np.asarray(client["rgb"])[1]
            np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
            frames.append(got.copy())
            if depth:
                renderer.enable_depth_rendering()
                want_depth = renderer.render()
                renderer.disable_depth_rendering()
                got_depth = np.asarray(client["depth"])[1]
                np.testing.assert_array_equal(got_depth, want_depth, err_msg=f"depth, step {step}")
                depths.append(got_depth.copy())
            action = rng.uniform(-0.2, 0.2, nu)
            actions = np.zeros((2, nu), np.float32)
            actions[1] = action
            _, _, terminated, truncated = client.step(actions)
            genv.step(actions[1])
            assert not (np.asarray(terminated)[1] or np.asarray(truncated)[1])
        assert not np.array_equal(frames[0], frames[-1])  # the body moved in view
        assert len(np.unique(frames[0].reshape(-1, 3), axis=0)) > 10  # a scene, not a blank
        if depth:
            assert not np.array_equal(depths[0], depths[-1])
            # Metres: the body within a few of the camera, the background at the far clip
            # plane (up to the float32 coefficients' rounding: 200.0068 m for 200 m).
            extent = sim.model.stat.extent
            near, far = sim.model.vis.map.znear * extent, sim.model.vis.map.zfar * extent
            assert near <= depths[0].min() < 10
            assert depths[0].max() == pytest.approx(far, rel=1e-4)


@pytest.mark.parametrize("task", ["Hopper-v5", "Humanoid-v5"])
def test_the_camera_serves_the_frames_of_mujoco_renderer(task: str) -> None:
    """``camera="track"``: ``rgb [N, H, W, 3] uint8`` holds each env's view through the
    model's camera, as ``mujoco.Renderer(model, H, W)`` draws it from the same state.
    Both draw with MuJoCo 3.17 on Mesa's llvmpipe through EGL: byte for byte the same.
    An unknown camera, a bad size and a depth without a camera are refused."""
    compare_camera_with_mujoco_renderer(task, depth=False)
    with pytest.raises(EngineStartError, match="no camera 'nope'.*track"):
        launch_mujoco(task, 1, camera="nope")
    with pytest.raises(ValueError, match="camera size"):
        launch_mujoco(task, 1, camera="track", camera_size="0x9")
    with pytest.raises(EngineStartError, match="without --camera"):
        launch_mujoco(task, 1, camera_depth=True)


@pytest.mark.parametrize("task", ["Hopper-v5", "Humanoid-v5"])
def test_the_camera_depth_is_mujoco_renderers_depth(task: str) -> None:
    """``camera_depth=True``: ``depth [N, H, W] float32`` holds each env's distances (m)
    as ``mujoco.Renderer``'s depth rendering gives them (its pass with the segmentation
    flags, its reverse-Z conversion with float32 frustum coefficients), from the same
    state, next to the same ``rgb``. Measured: equal to the bit (max error 0.0 on every
    pixel of 6 steps, Hopper and Humanoid at 48x64): both draw with the same MuJoCo build
    on the same Mesa and convert with the same operations in the same precisions, so the
    test asserts equality."""
    compare_camera_with_mujoco_renderer(task, depth=True)


def test_opengl_writes_the_frames_into_exported_vulkan_memory() -> None:
    """``image_device="vulkan"``: ``rgb`` lives in Vulkan memory the library allocates
    and exports (lavapipe here), which the learner imports; the engine's OpenGL (Mesa's
    llvmpipe) imports the same memory (``GL_EXT_memory_object_fd``) and writes each
    frame into it, ``glReadPixels`` into it as a pixel-pack buffer, then ``glFinish``
    before the frame is published (``model_info``'s ``camera_frames`` says ``opengl``).
    Every frame equals that of the same engine with ``rgb`` in the region, byte for
    byte: after launch, steps, ``set_state`` of one env and a reset of another (each a
    frame at its own offset of the memory)."""
    kw = dict(seed=0, camera="track", camera_size="24x32", camera_depth=True)
    try:
        vulkan = launch_mujoco("Hopper-v5", 3, image_device="vulkan", **kw)
    except EngineStartError as e:
        if "Vulkan" in str(e):
            pytest.skip(f"no Vulkan device for the frames: {e}")
        raise
    with vulkan, launch_mujoco("Hopper-v5", 3, **kw) as host:
        # OpenGL writes the frames where it shares the Vulkan device's host pages
        # (llvmpipe and lavapipe, as here); another driver falls back to the host copy,
        # naming its device, and must give the same frames.
        frames = vulkan.call("model_info")["camera_frames"]
        assert frames == "opengl" or (frames.startswith("host (") and "llvmpipe" not in frames), frames
        assert host.call("model_info")["camera_frames"] == "host"
        rng = np.random.default_rng(3)

        def same(what: str) -> None:
            got = np.asarray(vulkan["rgb"])
            np.testing.assert_array_equal(got, np.asarray(host["rgb"]), err_msg=what)
            np.testing.assert_array_equal(np.asarray(vulkan["depth"]), np.asarray(host["depth"]), err_msg=what)
            assert len(np.unique(got[2].reshape(-1, 3), axis=0)) > 10, what  # a scene, not a blank

        same("launch")
        first = np.asarray(vulkan["rgb"]).copy()
        for step in range(5):
            actions = rng.uniform(-1, 1, (3, 3)).astype(np.float32)
            vulkan.step(actions)
            host.step(actions)
            same(f"step {step}")
        assert not np.array_equal(first, np.asarray(vulkan["rgb"]))  # the frames moved
        state = host.call("get_state", env=0)
        for client in (vulkan, host):
            client.call("set_state", env=1, qpos=state["qpos"], qvel=state["qvel"])
            client.reset(seed=9, env_ids=[2])
        same("set_state and reset")


def test_a_seeded_reset_restarts_the_episodes_a_seeded_launch_starts() -> None:
    """Env ``i`` draws its reset noise from a stream seeded ``seed + i``, at launch and
    on ``client.reset(seed=...)``: the same seed gives the same starts, another seed other
    ones, every env its own."""
    with launch_mujoco("HalfCheetah-v5", 3, seed=4) as client:
        first = np.asarray(client.obs).copy()
        assert not np.array_equal(first[0], first[1])
        for _ in range(5):
            client.step(np.ones((3, 6), np.float32))
        assert not np.array_equal(np.asarray(client.obs), first)
        client.reset(seed=4)
        np.testing.assert_array_equal(np.asarray(client.obs), first)
        client.reset(seed=5)
        assert not np.array_equal(np.asarray(client.obs)[0], first[0])
        # Seed 5 for env 0 is seed 4's stream for env 1.
        np.testing.assert_array_equal(np.asarray(client.obs)[0], first[1])


@pytest.mark.long
def test_gymnasium_make_vec_native_serves_the_native_engine() -> None:
    """``gymnasium.make_vec("shmbridge/<id>", native=True)``: a Gymnasium vector env over
    the native engine, same-step autoreset (``final_obs`` in the infos), the spaces from
    the engine; what it cannot honour is refused before anything starts."""
    with pytest.raises(ValueError, match="same-step"):
        gymnasium.make_vec("shmbridge/Hopper-v5", num_envs=2, native=True, autoreset_mode="next-step")
    with pytest.raises(TypeError, match="ctrl_cost_weight"):
        gymnasium.make_vec("shmbridge/Hopper-v5", num_envs=2, native=True, ctrl_cost_weight=0.0)
    try:
        envs = gymnasium.make_vec(
            "shmbridge/Hopper-v5", num_envs=3, native=True, seed=2, threads=2, camera="track", camera_size="24x32"
        )
    except EngineStartError as e:
        if "without the `mujoco` feature" in str(e):
            pytest.skip("shmbridge was built without the `mujoco` feature (docs/mujoco.md)")
        raise
    try:
        assert envs.single_observation_space.shape == (11,)
        assert envs.client["rgb"].shape == (3, 24, 32, 3)  # the camera's frames
        assert envs.single_action_space.shape == (3,)
        assert envs.metadata["autoreset_mode"] == gymnasium.vector.AutoresetMode.SAME_STEP
        obs, _ = envs.reset(seed=2)
        ended = False
        for _ in range(200):
            obs, rewards, terminated, truncated, infos = envs.step(envs.action_space.sample())
            if terminated.any():
                ended = True
                assert "final_obs" in infos
        assert ended and obs.shape == (3, 11) and np.isfinite(obs).all()
    finally:
        envs.close()


def test_an_unknown_task_is_refused_with_the_list() -> None:
    with pytest.raises(EngineStartError, match="HalfCheetah-v5") as e:
        launch_mujoco("Nope-v0", 1)
    assert "unknown env" in str(e.value)  # the registry of reference engines answers


@pytest.mark.long
def test_sb3_ppo_through_the_native_engine_balances_the_inverted_pendulum() -> None:
    """Learning, CI-sized: Stable-Baselines3's PPO (``MlpPolicy``, ``n_steps=128`` on 8
    envs, otherwise its defaults) on ``SB3VecEnv`` over ``mujoco/InvertedPendulum-v5``
    keeps the pole up for the whole 1,000 steps (return 1000, the maximum) in each of
    20 episodes in a row within 200,000 env steps. Random actions average 5.2 (at most
    20 in 200 episodes of Gymnasium's env: an episode ends when the pole passes 0.2 rad).
    With seed 0 it stops at 58,704 steps, in about 30 s on two loaded cores."""
    pytest.importorskip("stable_baselines3", reason="the learning test runs SB3's PPO (the sb3 extra)")
    torch = pytest.importorskip("torch", reason="the learning test runs SB3's PPO (the sb3 extra)")
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecMonitor

    from shmbridge.integrations.sb3 import SB3VecEnv

    torch.set_num_threads(1)
    budget, run = 200_000, 20

    class UntilBalanced(BaseCallback):
        def _on_step(self) -> bool:
            returns = [e["r"] for e in self.model.ep_info_buffer]
            return not (len(returns) >= run and min(returns[-run:]) >= 1000)

    with launch_mujoco("InvertedPendulum-v5", 8, seed=0) as client:
        env = VecMonitor(SB3VecEnv(client=client))
        model = PPO("MlpPolicy", env, n_steps=128, batch_size=64, seed=0, verbose=0)
        model.learn(budget, callback=UntilBalanced())
        returns = [e["r"] for e in model.ep_info_buffer][-run:]
    assert len(returns) == run and min(returns) == 1000, (model.num_timesteps, returns)
    assert model.num_timesteps <= budget


@pytest.mark.long
@pytest.mark.parametrize("lockstep", [False, True], ids=["async", "lockstep"])
def test_the_async_ppo_examples_gaussian_policy_learns_the_inverted_pendulum(lockstep) -> None:
    """Learning, CI-sized: the PPO example with asynchronous batches
    (``shmbridge.examples.ppo_async``: 16 envs in 4 shards, batches of 8) in its
    continuous-action form (a Gaussian policy, actions clipped to the engine's
    ``action_low``/``action_high``) on ``mujoco/InvertedPendulum-v5``, and its lock-step
    twin (the same loop over ``client.step()``), 40,960 env steps each with the command
    line's defaults. Random actions average 5.2. Measured here (2 loaded cores, 6-30 s a
    run): asynchronous seeds 1-4 ended at a mean return (last 100 episodes) of 117, 140,
    126 and 145, lock-step seeds 1-4 at 108, 185, 131 and 139."""
    pytest.importorskip("torch", reason="the PPO example needs torch (the ppo extra)")
    pytest.importorskip("tqdm", reason="the PPO example needs tqdm (the ppo extra)")
    from shmbridge.examples import ppo_async

    cfg = ppo_async.AsyncConfig(env="mujoco/InvertedPendulum-v5", lockstep=lockstep,
                                total_steps=40960, seed=1, target_return=None, progress=False)
    r = ppo_async.train(cfg, log=lambda *a: None)
    assert r.env_steps >= 40960 and r.window_episodes == 100
    assert r.mean_return >= 60.0, r.summary()


# A small model for `mujoco/raw`: a hinge pendulum on a slider, two motors (one with a
# control range), three sensors (5 outputs).
RAW_XML = """<mujoco>
  <option timestep="0.01"/>
  <worldbody>
    <body name="cart">
      <joint name="slide" type="slide" axis="1 0 0" damping="0.1"/>
      <geom type="box" size="0.2 0.1 0.05" mass="1"/>
      <body name="pole">
        <joint name="hinge" type="hinge" axis="0 1 0" ref="0.1"/>
        <geom type="capsule" fromto="0 0 0 0 0 0.6" size="0.03" mass="0.2"/>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor name="push" joint="slide" ctrlrange="-2 2" ctrllimited="true"/>
    <motor name="twist" joint="hinge" ctrlrange="-0.5 0.5" ctrllimited="true"/>
  </actuator>
  <sensor>
    <jointpos joint="hinge"/>
    <jointvel joint="slide"/>
    <framepos objtype="body" objname="pole"/>
  </sensor>
</mujoco>
"""


def test_a_raw_mjcf_file_is_served_as_a_task(tmp_path) -> None:
    """``launch("mujoco/raw", model=PATH)``: observation ``qpos, qvel, sensordata``
    (float32), reward 0, action ``ctrl`` clamped to ``ctrlrange``, one ``mj_step`` a step,
    no termination, truncation at ``max_episode_steps`` and a reset to the model's
    initial state: step by step what MuJoCo's Python bindings give for the same file and
    controls, bit for bit."""
    mujoco = pytest.importorskip("mujoco")
    path = tmp_path / "cart_pole.xml"
    path.write_text(RAW_XML)
    model = mujoco.MjModel.from_xml_path(str(path))
    data = mujoco.MjData(model)

    def observation() -> np.ndarray:
        return np.concatenate([data.qpos, data.qvel, data.sensordata]).astype(np.float32)

    mujoco.mj_forward(model, data)
    first = observation()
    assert first.shape == (2 + 2 + 5,)
    rng = np.random.default_rng(3)
    with shmbridge.launch("mujoco/raw", num_envs=2, model=str(path), max_episode_steps=7) as client:
        assert np.asarray(client.obs).shape == (2, 9)
        metadata = client.schema()["metadata"]
        assert metadata["action_low"] == "-2,-0.5"
        assert metadata["action_high"] == "2,0.5"
        assert metadata["max_episode_steps"] == "7"
        np.testing.assert_array_equal(np.asarray(client.obs), np.stack([first, first]))
        final_obs = client["final_obs"]
        for step in range(1, 16):
            # Out of the range on purpose: MuJoCo clamps the control, the engine too.
            actions = rng.uniform(-3, 3, size=(2, 2)).astype(np.float32)
            data.ctrl[:] = actions[1]
            mujoco.mj_step(model, data)
            mujoco.mj_rnePostConstraint(model, data)
            obs, rewards, terminated, truncated = client.step(actions)
            where = f"step {step}"
            np.testing.assert_array_equal(np.asarray(final_obs)[1], observation(), err_msg=where)
            assert np.asarray(rewards).tolist() == [0.0, 0.0], where
            assert not np.asarray(terminated).any(), where
            assert np.asarray(truncated).tolist() == [step % 7 == 0] * 2, where
            if step % 7 == 0:
                np.testing.assert_array_equal(np.asarray(obs)[1], first, err_msg=where)
                mujoco.mj_resetData(model, data)
                mujoco.mj_forward(model, data)
            else:
                np.testing.assert_array_equal(np.asarray(obs)[1], observation(), err_msg=where)
        info = client.call("model_info")
        assert info["actuators"] == "push,twist" and info["nsensordata"] == "5"


def test_bad_mjcf_files_are_refused_before_a_region_is_made(tmp_path, region_namespace) -> None:
    """``mujoco/raw`` with no file, a missing one, one MuJoCo cannot load, or a model
    without an actuator or a velocity: the engine refuses to start (``EngineStartError``
    with MuJoCo's reason), and no region is left half-made."""
    broken = tmp_path / "broken.xml"
    broken.write_text("<mujoco><worldbody><body><joint type='hinge'/>")
    unknown = tmp_path / "unknown.xml"
    unknown.write_text("<mujoco><worldbody><geom type='sphere' size='0.1'/></worldbody><nope/></mujoco>")
    no_actuator = tmp_path / "no_actuator.xml"
    no_actuator.write_text(
        "<mujoco><worldbody><body><joint type='hinge'/><geom size='0.1'/></body></worldbody></mujoco>"
    )
    static = tmp_path / "static.xml"
    static.write_text(
        "<mujoco><worldbody><geom size='0.1'/></worldbody></mujoco>"
    )
    cases = [
        ({}, "no model file"),
        ({"model": str(tmp_path / "missing.xml")}, "no such model file"),
        ({"model": str(broken)}, "loading"),
        ({"model": str(unknown)}, "loading"),
        ({"model": str(no_actuator)}, "nu 0"),
        ({"model": str(static)}, "nv 0"),
    ]
    for kwargs, reason in cases:
        with pytest.raises(EngineStartError, match=reason):
            launch_mujoco("raw", 2, **kwargs)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(region_namespace)], kwargs


def test_raw_actuators_without_a_ctrlrange_are_unbounded(tmp_path) -> None:
    """A motor without ``ctrlrange`` is not limited (MuJoCo's range [0, 0] then means
    none, and MuJoCo does not clamp it): its action bounds are the whole line, not 0..0,
    which would have clipped every action of a learner to 0."""
    path = tmp_path / "unlimited.xml"
    path.write_text(RAW_XML.replace(' ctrlrange="-0.5 0.5" ctrllimited="true"', ""))
    with launch_mujoco("raw", 1, model=str(path)) as client:
        metadata = client.schema()["metadata"]
        assert metadata["action_low"] == "-2,-inf"
        assert metadata["action_high"] == "2,inf"


def test_a_shard_built_from_another_model_is_refused(tmp_path, region_namespace) -> None:
    """Each shard builds its env from its own options: a shard whose model has other
    sizes than the region's is refused, with the reason, before it serves (it wrote rows
    of another width into the region's tensors, and panicked past their end)."""
    region_model = tmp_path / "cart_pole.xml"
    region_model.write_text(RAW_XML)
    other = tmp_path / "slider.xml"
    other.write_text(
        "<mujoco><worldbody><body><joint name='s' type='slide'/><geom size='0.1'/></body>"
        "</worldbody><actuator><motor joint='s'/></actuator></mujoco>"
    )
    name = region_namespace + "mjshards"
    shard = [sys.executable, "-m", "shmbridge", "engine", "--env", "mujoco/raw", "--num-envs", "4",
             "--name", name]
    first = subprocess.Popen(shard + ["--model", str(region_model), "--shard", "0/2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        second = subprocess.run(shard + ["--model", str(other), "--shard", "1/2"],
                                capture_output=True, text=True, timeout=120)
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert second.returncode != 0, second.stderr
    assert "does not serve the region's tensors" in second.stderr, second.stderr
    assert "panicked" not in second.stderr, second.stderr


def _bench(tmp_path, task: str, *args: str) -> dict:
    """`python -m shmbridge.bench ARGS --out DIR` with the native engine of `task` (skipped
    where shmbridge was built without the feature): its JSON report."""
    import json

    launch_mujoco(task, 1).close()
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "shmbridge.bench", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / f"{args[0]}.json").read_text())


@pytest.mark.long
def test_bench_pixels_measures_the_cameras_frames_zero_copy(tmp_path) -> None:
    """``bench pixels --mujoco``: the native engine's camera (one shard and two) against
    Gymnasium's ``rgb_array`` of the same camera, a smoke run: every path measured, the
    engine's frames a drawn picture and the torch view the region's memory."""
    doc = _bench(tmp_path, "Hopper-v5", "pixels", "--quick", "--mujoco", "Hopper-v5", "--num-envs", "2",
                 "--size", "24x32", "--steps", "4", "--rounds", "1", "--warmup", "1")
    assert not doc["skipped"], doc["skipped"]
    paths = doc["paths"]
    assert set(paths) == {"mujoco-native", "mujoco-native-k2", "gym-sync", "gym-async"}
    for key in ("mujoco-native", "mujoco-native-k2"):
        assert paths[key]["zero_copy"] is True and not paths[key]["failures"], paths[key]
    assert all(p["frames_per_s"] > 0 and not p["failures"] for p in paths.values()), paths


def test_bench_vector_times_the_native_engines_asynchronous_batches(tmp_path) -> None:
    """``bench vector`` with the native engine: its lock-step shards and its asynchronous
    batches (``native async B=N/2 K=2``, EnvPool's recv/send through ``AsyncEnvPool``),
    the latter counted as B env-steps a step and not compared per step."""
    doc = _bench(tmp_path, "HalfCheetah-v5", "vector", "--quick", "--workloads", "HalfCheetah-v5", "--envs", "4",
                 "--shards", "2", "--contenders", "native", "--steps", "3", "--rounds", "1")
    rows = doc["results"]["HalfCheetah-v5 N=4"]
    assert [r["label"] for r in rows] == ["native K=2", "native K=1 T=2", "native async B=2 K=2"]
    pool = rows[-1]
    assert pool["num_envs"] == 2 and pool["processes"] == 2 and pool["env_steps_per_s"] > 0
    assert "round_ratios_to_sync" not in pool
    # The learner's idle time: each step's recv(), timed apart from the step it is part of.
    assert 0 < pool["idle_median_ns"] <= pool["median_ns"] and 0 < pool["idle_p99_ns"] <= pool["p99_ns"]


REWARD_C = r"""
#include <math.h>
#include <stdint.h>
#include <mujoco/mujoco.h>

/* The pole's angle squared as a cost, the push's control cost, and the env's index (so
   that a reward given to the wrong env shows); the episode ends past 0.5 rad. */
int32_t shmbridge_mujoco_reward(const mjModel* m, const mjData* d, uint32_t env,
                                const float* action, uint32_t nu, double* reward,
                                uint8_t* terminated) {
  if (nu != (uint32_t)m->nu) return 7;
  double angle = d->qpos[1];
  *reward = -angle * angle - 0.1 * action[0] * action[0] + env;
  *terminated = fabs(angle) > 0.5;
  if (env == FAIL_ENV) {  /* the ways a call can fail, FAIL_MODE picks one */
    if (FAIL_MODE == 0) return 3;
    if (FAIL_MODE == 1) *reward = NAN;
    if (FAIL_MODE == 2) *terminated = 2;
  }
  return 0;
}
"""


def _reward_lib(tmp_path, fail_env: int = 1000, symbol: str = "shmbridge_mujoco_reward",
                fail_mode: int = 0) -> str:
    """`REWARD_C` built as a shared library against the mujoco wheel's headers."""
    import shutil

    mujoco = pytest.importorskip("mujoco")
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the reward library")
    tag = f"{fail_env}_{fail_mode}_{symbol}"
    src = tmp_path / f"reward_{tag}.c"
    src.write_text(REWARD_C.replace("FAIL_ENV", str(fail_env)).replace("FAIL_MODE", str(fail_mode))
                   .replace("shmbridge_mujoco_reward", symbol))
    lib = tmp_path / f"libreward_{tag}.so"
    include = os.path.join(os.path.dirname(mujoco.__file__), "include")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-I", include, str(src), "-o", str(lib)], check=True)
    return str(lib)


@pytest.mark.parametrize("layout", [{"threads": 2}, {"shards": 2}])
def test_a_raw_tasks_reward_and_termination_come_from_a_c_callback(tmp_path, layout) -> None:
    """``launch("mujoco/raw", model=..., reward_lib=...)``: each step's reward and
    ``terminated`` are what the library's ``shmbridge_mujoco_reward`` computes from that
    env's ``mjData``, action and region index (checked against its formula on the
    observation the step ended in, ``final_obs``), with two step threads and with two
    shards; a terminated env starts again from the model's initial state."""
    path = tmp_path / "cart_pole.xml"
    path.write_text(RAW_XML)
    lib = _reward_lib(tmp_path)
    rng = np.random.default_rng(5)
    ended = 0
    with launch_mujoco("raw", 4, model=str(path), reward_lib=lib, **layout) as client:
        first = np.asarray(client.obs)[0].copy()
        final_obs = client["final_obs"]
        for step in range(200):
            actions = rng.uniform(-2, 2, size=(4, 2)).astype(np.float32)
            actions[:, 1] = np.float32(0.5)  # twist the pole over, so that episodes end
            obs, rewards, terminated, _ = client.step(actions)
            angle = np.asarray(final_obs)[:, 1].astype(np.float64)
            want = -angle * angle - 0.1 * actions[:, 0].astype(np.float64) ** 2 + np.arange(4)
            np.testing.assert_allclose(np.asarray(rewards), want.astype(np.float32), rtol=1e-6,
                                       err_msg=f"step {step}")
            done = np.asarray(terminated).copy()
            assert done.tolist() == (np.abs(angle) > 0.5).tolist(), step
            for i in np.flatnonzero(done):
                np.testing.assert_array_equal(np.asarray(obs)[i], first, err_msg=f"step {step} env {i}")
            ended += int(done.sum())
    assert ended > 0  # the termination was exercised


def test_reward_libraries_that_fail_are_clear_errors(tmp_path) -> None:
    """A library without the function, or one for a task of Gymnasium's, is refused at
    start; a callback that returns nonzero stops the engine with an error naming the env
    and the value."""
    path = tmp_path / "cart_pole.xml"
    path.write_text(RAW_XML)
    no_symbol = _reward_lib(tmp_path, symbol="something_else")
    with pytest.raises(EngineStartError, match="no function shmbridge_mujoco_reward"):
        launch_mujoco("raw", 2, model=str(path), reward_lib=no_symbol)
    with pytest.raises(EngineStartError, match="cannot load it"):
        launch_mujoco("raw", 2, model=str(path), reward_lib=str(tmp_path / "missing.so"))
    with pytest.raises(EngineStartError, match="--reward-lib is for mujoco/raw"):
        launch_mujoco("Hopper-v5", 2, reward_lib=no_symbol)
    for mode, says in ((0, "returned 3"), (1, "gave the reward NaN"), (2, "gave terminated = 2")):
        failing = _reward_lib(tmp_path, fail_env=3, fail_mode=mode)
        engine = subprocess.Popen(
            [sys.executable, "-m", "shmbridge", "engine", "--env", "mujoco/raw", "--num-envs", "4",
             "--threads", "2", "--model", str(path), "--reward-lib", failing],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            name = engine.stdout.readline().strip()
            assert name, engine.stderr.read()
            with shmbridge.attach(name) as client:
                with pytest.raises(shmbridge.EngineClosedError):
                    client.step(np.zeros((4, 2), np.float32), timeout=30)
            assert engine.wait(30) != 0
            said = engine.stderr.read()
            assert "reward callback (shmbridge_mujoco_reward) for env 3" in said and says in said, said
        finally:
            engine.kill()
            engine.wait()
        assert not [n for n in os.listdir("/dev/shm") if name.split("/")[-1] in n], name


def test_ppo_from_pixels_trains_on_the_cameras_frames_in_the_region(monkeypatch) -> None:
    """`shmbridge-ppo --env mujoco/InvertedPendulum-v5` (examples/ppo_pixels.py): two
    updates from the camera the example adds to the model. Every stack the policy is
    evaluated on while stepping is the region's frames, read through the zero-copy view
    (the same address as the region's tensor): the last three frames the camera drew,
    oldest first, a new episode's stack filled with its first frame."""
    torch = pytest.importorskip("torch", reason="the example's PPO needs torch (the ppo extra)")
    pytest.importorskip("tqdm", reason="the example's PPO needs tqdm (the ppo extra)")
    from shmbridge.examples import ppo, ppo_pixels

    n, t_len, k, updates = 4, 16, 3, 2
    drawn, ended, seen, addresses = [], [], [], []  # the region's frames; what the policy saw
    launch = shmbridge.launch

    class Recorded:
        """The client, recording the region's frames after launch and after every step."""

        def __init__(self, client) -> None:
            self.client, self.importer = client, client.importer
            drawn.append(np.asarray(client["rgb"]).copy())

        def __getitem__(self, name):
            return self.client[name]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.client.__exit__(*exc)

        def step(self) -> None:
            self.client.step()
            drawn.append(np.asarray(self.client["rgb"]).copy())
            ended.append(np.asarray(self.client["terminated"]) | np.asarray(self.client["truncated"]))

    def recorded_launch(*args, **kwargs):
        return Recorded(launch(*args, **kwargs))

    views = ppo_pixels._views

    def checked_views(client):
        v = views(client)
        addresses.append((v["rgb"].data_ptr(), client["rgb"].data_ptr))
        return v

    agent_of = ppo_pixels._agent

    def recording_agent(*args, **kwargs):
        agent = agent_of(*args, **kwargs)
        evaluate = agent.evaluate

        def recording_evaluate(x):
            if not torch.is_grad_enabled():  # stepping (and the value after a rollout)
                seen.append(x.numpy().copy())
            return evaluate(x)

        agent.evaluate = recording_evaluate
        return agent

    monkeypatch.setattr(shmbridge, "launch", recorded_launch)
    monkeypatch.setattr(ppo_pixels, "_views", checked_views)
    monkeypatch.setattr(ppo_pixels, "_agent", recording_agent)
    cfg = ppo.Config(env="mujoco/InvertedPendulum-v5", image="24x32x3", frame_stack=k, num_envs=n,
                     num_steps=t_len, num_minibatches=2, total_steps=updates * n * t_len, seed=3,
                     device="cpu", lr=3e-4, update_epochs=1, target_return=None, plot=None,
                     progress=False)
    r = ppo_pixels.train(cfg, log=lambda *a: None)

    assert r.env_steps == updates * n * t_len and r.episodes > 0
    assert r.zero_copy_views == ["rgb", "actions", "rewards", "terminated", "truncated"]
    assert len(addresses) == 1 and addresses[0][0] == addresses[0][1]
    assert len(drawn) == updates * t_len + 1 and drawn[0].shape == (n, 24, 32, 3)
    assert any(e.any() for e in ended)  # random-ish actions: episodes ended and restarted
    # The stack after each step, from the frames the region held, as the learner keeps it.
    stacks = [np.repeat(drawn[0][:, None], k, axis=1)]
    for i in range(1, len(drawn)):
        s = np.concatenate([stacks[-1][:, 1:], drawn[i][:, None]], axis=1)
        s[ended[i - 1]] = drawn[i][ended[i - 1], None]
        stacks.append(s)
    # (n, K, H, W, 3) -> (n, K * 3, H, W): each frame's RGB planes, oldest frame first.
    expected = [s.transpose(0, 1, 4, 2, 3).reshape(n, k * 3, 24, 32) for s in stacks]
    order = [u * t_len + t for u in range(updates) for t in range(t_len + 1)]
    assert len(seen) == len(order)
    for i, j in enumerate(order):
        assert np.array_equal(seen[i], expected[j]), (i, j)
    assert any(not np.array_equal(f, drawn[0]) for f in drawn[1:])  # the camera saw the motion


def test_the_camera_the_pixels_example_adds_leaves_the_pendulum_gymnasiums() -> None:
    """InvertedPendulum-v5's model has no camera; examples/ppo_pixels.py serves it with
    one added (``cart``). The task is the same: with the same seed and actions its
    observations, rewards and ends equal those of the stock model, bit for bit, while its
    frames show the pole moving."""
    pytest.importorskip("torch", reason="the example's module needs torch (the ppo extra)")
    from shmbridge.examples import ppo, ppo_pixels

    n = 3
    cfg = ppo.Config(env="mujoco/InvertedPendulum-v5", image="16x16x3", num_envs=n, seed=5)
    actions = np.random.default_rng(0).uniform(-3, 3, (60, n, 1)).astype(np.float32)
    assets = os.environ.get("SHMBRIDGE_MUJOCO_ASSETS")
    with ppo_pixels._launch(cfg, n) as seen, launch_mujoco("InvertedPendulum-v5", n, seed=5) as stock:
        assert os.environ.get("SHMBRIDGE_MUJOCO_ASSETS") == assets  # as it was before the launch
        assert seen.call("model_info")["cameras"] == "cart"
        frames = [np.asarray(seen["rgb"]).copy()]
        for a in actions:
            seen.step(a)
            stock.step(a)
            for name in ("obs", "rewards", "terminated", "truncated", "final_obs"):
                assert np.array_equal(np.asarray(seen[name]), np.asarray(stock[name])), name
            frames.append(np.asarray(seen["rgb"]).copy())
    assert any(not np.array_equal(f, frames[0]) for f in frames[1:])


def test_ppo_from_the_camera_refuses_what_it_cannot_do(capsys) -> None:
    """Before any engine starts: a camera image that is not RGB, and `--save` (whose
    agents are the pixels engine's, for examples/pixels_viewer.py)."""
    pytest.importorskip("torch", reason="the example's PPO needs torch (the ppo extra)")
    from shmbridge.examples import ppo

    base = ["--env", "mujoco/InvertedPendulum-v5", "--total-steps", "64", "--no-progress", "--plot", ""]
    assert ppo.main(base + ["--image", "32x32x1"]) == 2
    assert "the MuJoCo camera draws RGB (HxWx3)" in capsys.readouterr().err
    assert ppo.main(base + ["--save", "agent.pt"]) == 2
    assert "--save keeps an agent of the pixels engine" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ppo.main(["--env", "mujoco/"])
