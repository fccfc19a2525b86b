"""shmbridge.gym.ShmVectorEnv: Gymnasium's API, registration, seeding, and agreement with
Gymnasium's own CartPole-v1 (step by step, and in episode statistics)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import shmbridge

gym = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from gymnasium.utils import env_checker, passive_env_checker  # noqa: E402
from gymnasium.vector import AutoresetMode  # noqa: E402
from gymnasium.wrappers.vector import (  # noqa: E402
    ClipReward,
    DictInfoToList,
    NormalizeReward,
    RecordEpisodeStatistics,
)

from shmbridge.gym import ShmVectorEnv  # noqa: E402
from conftest import CARTPOLE_BOUNDS  # noqa: E402

ENV_ID = "shmbridge/CartPole-v1"
# The infos of a SAME_STEP SyncVectorEnv step in which some env finished, in its order.
FINAL_KEYS = ["final_obs", "_final_obs", "final_info", "_final_info"]


@pytest.fixture
def envs():
    e = ShmVectorEnv("cartpole", num_envs=8, seed=0)
    yield e
    e.close()


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60
    )


# --- registration, optional gymnasium -----------------------------------------------------

@pytest.mark.parametrize(
    "imports",
    [
        "import shmbridge; assert 'gymnasium' not in sys.modules; import gymnasium",
        "import gymnasium; import shmbridge",
    ],
)
def test_make_vec_after_import_shmbridge_in_either_order(imports):
    code = f"""
import sys
{imports}
env = gymnasium.make_vec("shmbridge/CartPole-v1", num_envs=3)
assert type(env).__name__ == "ShmVectorEnv", type(env)
obs, _ = env.reset(seed=1)
assert obs.shape == (3, 4) and obs.dtype.name == "float32"
env.close()
print("ok")
"""
    r = _run(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_import_shmbridge_does_not_import_gymnasium():
    r = _run("import sys, shmbridge; print('gymnasium' in sys.modules)")
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_import_shmbridge_without_gymnasium():
    # sys.modules[name] = None makes `import name` fail as if it were not installed.
    code = """
import sys
sys.modules["gymnasium"] = None
import shmbridge
with shmbridge.launch("cartpole", num_envs=2) as c:
    c.step()
try:
    import shmbridge.gym
except ImportError:
    print("ok")
"""
    r = _run(code)  # -W error: no warning either
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_module_colon_id_form_works_too():
    env = gym.make_vec("shmbridge.gym:" + ENV_ID, num_envs=2)
    try:
        assert isinstance(env, ShmVectorEnv)
    finally:
        env.close()


# --- gymnasium.make: the one-env view ------------------------------------------------------

def test_make_serves_a_one_env_view_that_passes_gymnasiums_check_env():
    from shmbridge.gym import ShmEnv

    env = gym.make(ENV_ID)
    try:
        assert isinstance(env.unwrapped, ShmEnv) and env.unwrapped.client.num_envs == 1
        assert env.spec.max_episode_steps == 500
        assert env.observation_space == gym.make("CartPole-v1").observation_space
        assert env.action_space == spaces.Discrete(2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # Infinite velocity bounds, as Gymnasium's own CartPole-v1 has: only warned of.
            warnings.filterwarnings("ignore", message=".*value is (-)?infinity")
            # Its close check makes a second env from the spec and closes it twice.
            env_checker.check_env(env.unwrapped)
        obs, info = env.reset(seed=3)
        assert info == {} and obs.shape == (4,) and obs.dtype == np.float32
        obs, reward, terminated, truncated, info = env.step(1)
        assert type(reward) is float and type(terminated) is bool and type(truncated) is bool
        assert info == {} and env.observation_space.contains(obs)
    finally:
        env.close()


def test_make_episode_matches_gymnasium_cartpole_to_its_last_observation():
    """An episode of the one-env view is Gymnasium's CartPole-v1 step by step, the last
    (terminal) observation included although the engine resets in that same step; a step
    after it raises ResetNeeded, and reset() starts the next episode."""
    env = gym.make(ENV_ID)
    ref = gym.make("CartPole-v1").unwrapped
    ref.reset(seed=0)
    try:
        for episode in range(3):
            obs, _ = env.reset(seed=10 + episode)
            steps = 0
            while True:
                ref.state = obs.astype(np.float64)
                ref.steps_beyond_terminated = None
                expected, ref_reward, ref_terminated, _, _ = ref.step(0)
                obs, reward, terminated, truncated, _ = env.step(0)  # always left: falls soon
                steps += 1
                np.testing.assert_allclose(obs, expected, rtol=1e-6, atol=1e-6)
                assert (reward, terminated, truncated) == (ref_reward, ref_terminated, False)
                if terminated:
                    break
            assert 5 < steps < 100 and (np.abs(obs[[0, 2]]) > CARTPOLE_BOUNDS).any()
            with pytest.raises(gym.error.ResetNeeded):
                env.step(0)
        again, _ = env.reset(seed=12)
        assert (np.abs(again) < 0.05).all()
    finally:
        env.close()


def test_make_one_env_view_is_seeded_like_the_vector_env():
    env = gym.make(ENV_ID)
    vec = ShmVectorEnv(num_envs=3)
    try:
        one, _ = env.reset(seed=77)
        many, _ = vec.reset(seed=[5, 77, 6])
        assert np.array_equal(one, many[1])
        with pytest.raises(ValueError):
            env.step(2)  # not in Discrete(2): refused, nothing sent
        with pytest.raises(ValueError):
            env.reset(options={"reset_mask": np.ones(1, dtype=bool)})
    finally:
        env.close()
        vec.close()


def test_one_env_view_refuses_a_client_of_many_envs(cartpole_client):
    from shmbridge.gym import ShmEnv

    with pytest.raises(ValueError, match="ShmVectorEnv"):
        ShmEnv(client=cartpole_client)


def test_make_of_a_sharded_id_says_to_use_make_vec():
    with pytest.raises(gym.error.Error, match=r"make_vec\('shmbridge/Pendulum-v1'"):
        gym.make("shmbridge/Pendulum-v1")


# --- spaces, metadata, Gymnasium's checkers -----------------------------------------------

def test_make_vec_spaces_and_dtypes_match_gymnasium_cartpole():
    env = gym.make_vec(ENV_ID, num_envs=8)
    ref = gym.make_vec("CartPole-v1", num_envs=8, vectorization_mode="vector_entry_point")
    try:
        assert isinstance(env, ShmVectorEnv) and env.num_envs == 8
        assert env.spec is not None and env.spec.id == ENV_ID
        assert env.spec.max_episode_steps == 500 and env.max_episode_steps == 500
        assert env.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
        assert env.single_observation_space == ref.single_observation_space
        assert env.observation_space == ref.observation_space
        assert env.single_action_space == spaces.Discrete(2) == ref.single_action_space
        assert env.action_space == ref.action_space == spaces.MultiDiscrete([2] * 8)
        assert env.single_observation_space.dtype == np.float32
        # The bounds are CartPole-v1's, infinities included.
        assert np.isinf(env.single_observation_space.high[[1, 3]]).all()
        assert env.single_observation_space.high[0] == np.float32(4.8)

        obs, info = env.reset(seed=0)
        assert info == {}
        assert obs.dtype == np.float32 and obs.shape == (8, 4)
        assert env.observation_space.contains(obs)
        assert (np.abs(obs) < 0.05).all()  # CartPole's reset distribution U(-0.05, 0.05)
        env.action_space.seed(0)
        for _ in range(50):
            obs, rewards, terminated, truncated, info = env.step(env.action_space.sample())
            assert env.observation_space.contains(obs)
            assert rewards.dtype == np.float32 and rewards.shape == (8,)
            assert terminated.dtype == np.bool_ and terminated.shape == (8,)
            assert truncated.dtype == np.bool_ and truncated.shape == (8,)
            done = terminated | truncated
            if done.any():  # the structure in detail: test_step_infos_are_gymnasiums_same_step_infos
                assert list(info) == FINAL_KEYS and np.array_equal(info["_final_obs"], done)
            else:
                assert info == {}
    finally:
        env.close()
        ref.close()


def test_gymnasium_env_checkers_that_apply_to_vector_envs():
    """`env_checker.check_env` itself requires a `gymnasium.Env` (it asserts isinstance), so
    it does not apply. Of its parts, these do; not applicable: `check_step_determinism`
    (asserts `truncated is False`, a Python bool, where a vector env returns arrays; its
    content is `test_step_is_deterministic` below), `env_step_passive_checker` (expects a
    scalar reward and bool flags), `check_space_limit` (only warns that the bounds are
    infinite, as they are in Gymnasium's own CartPole-v1)."""
    env = gym.make_vec(ENV_ID, num_envs=4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the passive checks only warn
            passive_env_checker.check_observation_space(env.observation_space)
            passive_env_checker.check_observation_space(env.single_observation_space)
            passive_env_checker.check_action_space(env.action_space)
            passive_env_checker.check_action_space(env.single_action_space)
            env_checker.check_seed_deprecation(env)
            env_checker.check_reset_return_info_deprecation(env)
            env_checker.check_reset_return_type(env)
            env_checker.check_reset_seed_determinism(env)  # needs env.spec (make_vec sets it)
            env_checker.check_reset_options(env)
            obs, _ = passive_env_checker.env_reset_passive_checker(env, seed=5)
            passive_env_checker.check_obs(obs, env.observation_space, "reset")
            obs, *_ = env.step(env.action_space.sample())
            passive_env_checker.check_obs(obs, env.observation_space, "step")
    finally:
        env.close()


def test_returned_data_not_reused_check():
    # Gymnasium's check does `if terminated or truncated`: it needs num_envs=1.
    env = gym.make_vec(ENV_ID, num_envs=1)
    try:
        env_checker.check_returned_data_not_reused(env)
    finally:
        env.close()
    # copy=False returns views of the shared memory, the same every call: the check must
    # catch that (so it would catch a copy=True that forgot to copy).
    views = ShmVectorEnv(num_envs=1, copy=False)
    try:
        with pytest.raises(AssertionError, match="share an object"):
            env_checker.check_returned_data_not_reused(views)
    finally:
        views.close()


def test_step_is_deterministic(envs):
    actions = np.array([0, 1, 1, 0, 1, 0, 0, 1])
    results = []
    for _ in range(2):
        envs.reset(seed=123)
        steps = [envs.step(actions) for _ in range(5)]
        results.append(steps)
    for a, b in zip(*results):
        for x, y in zip(a[:4], b[:4]):
            assert np.array_equal(x, y)


def test_copy_false_returns_read_only_views_of_the_shared_memory():
    env = ShmVectorEnv(num_envs=4, copy=False, seed=0)
    try:
        obs0, _ = env.reset()
        first = env.step(np.zeros(4, dtype=np.int64))
        second = env.step(np.zeros(4, dtype=np.int64))
        assert all(x is y for x, y in zip(first[:4], second[:4]))
        assert first[0] is obs0
        assert obs0.ctypes.data == env.client.obs.data_ptr
        assert first[1].ctypes.data == env.client.rewards.data_ptr
        assert not obs0.flags.writeable
        with pytest.raises(ValueError):
            obs0[0, 0] = 1.0
        before = np.array(obs0)
        env.step(np.ones(4, dtype=np.int64))
        assert not np.array_equal(before, obs0), "views follow the frames"
    finally:
        env.close()


def test_copies_are_not_overwritten_by_the_next_step(envs):
    obs, _ = envs.reset(seed=0)
    kept = obs.copy()
    out = envs.step(np.ones(8, dtype=np.int64))
    assert np.array_equal(obs, kept)
    assert not np.shares_memory(out[0], obs)
    assert out[0].ctypes.data != envs.client.obs.data_ptr


# --- seeding and reset ---------------------------------------------------------------------

def test_reset_int_seed_is_deterministic_across_engines():
    a = ShmVectorEnv(num_envs=6)
    b = ShmVectorEnv(num_envs=6)
    try:
        obs_a, _ = a.reset(seed=42)
        a.step(np.ones(6, dtype=np.int64))
        again, _ = a.reset(seed=42)
        obs_b, _ = b.reset(seed=42)
        assert np.array_equal(obs_a, again)
        assert np.array_equal(obs_a, obs_b), "same seed, same obs, whatever the engine's start"
        other, _ = b.reset(seed=43)
        assert not np.array_equal(other, obs_a)
        # Envs of one reset differ from each other (env i is seeded with 42 + i) ...
        assert len({tuple(o) for o in obs_a}) == 6
        # ... so seed 43 gives env i what seed 42 gave env i + 1.
        assert np.array_equal(other[:-1], obs_a[1:])
        # An unseeded reset after a seeded one is deterministic too.
        a.reset(seed=7)
        n1, _ = a.reset()
        b.reset(seed=7)
        n2, _ = b.reset()
        assert np.array_equal(n1, n2)
        # np_random is Gymnasium's, seeded by an int seed.
        a.reset(seed=9)
        b.reset(seed=9)
        assert a.np_random.bit_generator.state == b.np_random.bit_generator.state
        assert a.np_random_seed == 9
    finally:
        a.close()
        b.close()


def test_reset_list_seed(envs):
    by_int, _ = envs.reset(seed=100)
    by_list, _ = envs.reset(seed=[100 + i for i in range(8)])
    assert np.array_equal(by_int, by_list)
    shuffled = [107, 106, 105, 104, 103, 102, 101, 100]
    reversed_obs, _ = envs.reset(seed=shuffled)
    assert np.array_equal(reversed_obs, by_int[::-1])
    # None entries: those envs are reset without reseeding, the others as seeded.
    mixed, _ = envs.reset(seed=[100, None, 102, None, 104, None, 106, None])
    assert np.array_equal(mixed[::2], by_int[::2])
    assert not np.array_equal(mixed[1::2], by_int[1::2])
    with pytest.raises(ValueError, match="8 entries"):
        envs.reset(seed=[1, 2, 3])
    with pytest.raises(ValueError):
        envs.reset(seed=-1)
    with pytest.raises(TypeError):
        envs.reset(seed="42")


def test_constructor_seed_is_the_first_resets_seed():
    a = ShmVectorEnv(num_envs=4, seed=5)
    b = ShmVectorEnv(num_envs=4)
    try:
        first, _ = a.reset()
        seeded, _ = b.reset(seed=5)
        assert np.array_equal(first, seeded)
        second, _ = a.reset()  # the constructor's seed is used once
        assert not np.array_equal(second, first)
    finally:
        a.close()
        b.close()


def test_reset_mask_resets_only_those_envs_with_gymnasiums_seeds(envs):
    full, _ = envs.reset(seed=10)
    for _ in range(3):
        stepped, *_ = envs.step(np.ones(8, dtype=np.int64))
    mask = np.zeros(8, dtype=bool)
    mask[[2, 5]] = True
    obs, info = envs.reset(seed=10, options={"reset_mask": mask})
    assert info == {}
    assert np.array_equal(obs[~mask], stepped[~mask]), "unmasked envs untouched"
    # As in Gymnasium's vector envs, env i gets seed 10 + i, masked or not.
    assert np.array_equal(obs[mask], full[mask])
    # A list seed: the masked envs' entries.
    obs, _ = envs.reset(seed=[10 + i for i in range(8)], options={"reset_mask": mask})
    assert np.array_equal(obs[mask], full[mask])
    # Unseeded: new starts for the masked envs only.
    before = obs.copy()
    obs, _ = envs.reset(options={"reset_mask": mask})
    assert np.array_equal(obs[~mask], before[~mask])
    assert not np.array_equal(obs[mask], before[mask])
    assert (np.abs(obs[mask]) < 0.05).all()


@pytest.mark.parametrize(
    "mask, exc",
    [
        ([True] * 8, TypeError),  # not an ndarray (as SyncVectorEnv)
        (np.ones(8, dtype=np.int64), TypeError),
        (np.ones(7, dtype=bool), ValueError),
        (np.zeros(8, dtype=bool), ValueError),
    ],
)
def test_bad_reset_masks(envs, mask, exc):
    envs.reset(seed=0)
    frame = envs.client.frame
    with pytest.raises(exc):
        envs.reset(options={"reset_mask": mask})
    assert envs.client.frame == frame


def test_unknown_reset_options_raise(envs):
    with pytest.raises(ValueError, match="low"):
        envs.reset(options={"low": -0.1, "high": 0.1})
    envs.reset(options={})  # fine


# --- actions ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "make_bad",
    [
        lambda n: np.zeros(n + 1, dtype=np.int64),
        lambda n: np.zeros((n, 2), dtype=np.int64),
        lambda n: np.zeros((1, n), dtype=np.int64),
        lambda n: np.int64(0),
        lambda n: np.zeros(n, dtype=np.float32),
        lambda n: np.zeros(n, dtype=bool),
        lambda n: np.full(n, 2),
        lambda n: np.array([0] * (n - 1) + [-1]),
        lambda n: [0] * (n - 1),
        lambda n: ["left"] * n,
        lambda n: None,
    ],
)
def test_bad_actions_raise_value_error_and_send_nothing(envs, make_bad):
    envs.reset(seed=0)
    counters = envs.client.counters()
    frame = envs.client.frame
    actions_before = np.asarray(envs.client.actions).copy()
    with pytest.raises(ValueError):
        envs.step(make_bad(envs.num_envs))
    assert envs.client.counters() == counters and envs.client.frame == frame
    assert np.array_equal(np.asarray(envs.client.actions), actions_before)
    envs.step(np.zeros(envs.num_envs, dtype=np.int64))
    assert envs.client.frame == frame + 1


def _accepts(check, actions) -> bool:
    try:
        check(actions)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    "space",
    [
        spaces.Box(-1.0, 1.0, (3,), np.float32),  # one bound for every element
        spaces.Box(np.array([-1, 0, -np.inf], np.float32), np.array([1, 2, np.inf], np.float32), (3,), np.float32),
        spaces.Box(-np.inf, np.inf, (2,), np.float32),
        spaces.Box(-5, 5, (2,), np.int32),
    ],
)
@pytest.mark.parametrize("n", [4, 20])  # below and above _SMALL elements
def test_box_action_check_agrees_with_box_contains(space, n):
    """The quick check (every value or min/max against one bound, or Box.contains)
    accepts exactly what Gymnasium's batched Box contains after the cast to the action
    dtype."""
    from gymnasium.vector.utils import batch_space

    from shmbridge.gym import _SMALL, _ActionCheck

    assert (n * space.shape[0] <= _SMALL) == (n == 4)
    batched = batch_space(space, n)
    check = _ActionCheck(space, n, (n, *space.shape), space.dtype)
    rng = np.random.default_rng(0)
    shape = (n, *space.shape)
    cases = [rng.uniform(-6, 6, size=shape) for _ in range(200)]
    cases += [rng.uniform(-1, 1, size=shape) for _ in range(50)]
    edges = [np.nan, np.inf, -np.inf, -1.0, 1.0, 0.0, 2.0, 5.0, -5.0, 5.5]
    for v in edges:
        for i in range(shape[0]):
            a = np.zeros(shape)
            a[i, -1] = v
            cases.append(a)
    for a in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the float->int cast of NaN and inf
            want = batched.contains(a.astype(space.dtype))
            got = _accepts(check, a)
        assert got == want, (a, got, want)


@pytest.mark.parametrize("n", [5, 40])  # below and above _SMALL elements
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint64])
def test_discrete_action_check_agrees_with_discrete_contains(dtype, n):
    from shmbridge.gym import _ActionCheck

    count = 3
    check = _ActionCheck(spaces.Discrete(count), n, (n, 1), np.dtype(np.int64))
    info = np.iinfo(dtype)
    values = [0, 1, 2, 3, info.max, info.min, -1 if info.min < 0 else 0]
    for v in values:
        for i in range(n):
            a = np.zeros(n, dtype=dtype)
            a[i] = np.array(v).astype(dtype)
            want = bool(((a >= 0) & (a < count)).all())
            assert _accepts(check, a) == want, (a, want)
            assert _accepts(check, a.reshape(n, 1)) == want
            assert _accepts(check, a[::-1]) == want, "strided"


def test_actions_in_every_accepted_form_reach_the_engine(envs):
    torch = pytest.importorskip("torch")
    n = envs.num_envs
    pattern = np.array([0, 1, 1, 0, 0, 0, 1, 1])
    forms = [
        pattern,
        pattern.reshape(n, 1),
        pattern.astype(np.uint8),
        pattern.tolist(),
        torch.from_numpy(pattern),
        envs.action_space.sample() * 0 + pattern,
    ]
    for form in forms:
        envs.step(form)
        assert np.array_equal(np.asarray(envs.client.actions)[:, 0], pattern), type(form)


# --- dynamics and statistics against Gymnasium's CartPole-v1 -------------------------------

def test_dynamics_agree_with_gymnasium_cartpole_step_by_step():
    """For every env, Gymnasium's CartPole-v1 started from the previous observation and given
    the same action reaches the same state: the observation returned for an env that did
    not finish this step, ``infos["final_obs"][i]`` for one that did (its returned
    observation being the new episode's first).

    Tolerance: the engine integrates in f64 from its own f64 state and rounds the result to
    f32; the reference starts from the f32-rounded observation (relative error <= 2^-24,
    |state| < ~3 here, so < 2e-7) and one Euler step scales that by at most 1 + tau * 15
    (d theta_acc / d theta ~ g / (4/3 l) = 14.7), then both round to f32. The differences
    are therefore below ~5e-7 (measured: 2.4e-7); atol = rtol = 1e-6 leaves a factor ~2-4
    and still catches any change of constants or integrator (those differ by >= 1e-4).
    The final observations are the same kind of step (the terminal states are a little
    larger: |theta_dot| up to ~3.5), so the same tolerance applies."""
    n, steps = 64, 300
    env = ShmVectorEnv(num_envs=n)
    ref = gym.make("CartPole-v1").unwrapped
    ref.reset(seed=0)
    rng = np.random.default_rng(1)
    compared = finished = 0
    episode_steps = np.zeros(n, dtype=np.int64)
    try:
        obs, _ = env.reset(seed=2024)
        for _ in range(steps):
            actions = rng.integers(0, 2, size=n)
            new_obs, rewards, terminated, truncated, infos = env.step(actions)
            episode_steps += 1
            assert (rewards == 1.0).all()
            assert np.array_equal(truncated, episode_steps >= 500)
            ref_obs = np.empty_like(new_obs)
            for i in range(n):
                ref.state = obs[i].astype(np.float64)
                ref.steps_beyond_terminated = None
                ref_obs[i], ref_reward, ref_terminated, _, _ = ref.step(int(actions[i]))
                assert ref_reward == rewards[i]
                assert ref_terminated == bool(terminated[i]), (i, obs[i], actions[i])
            done = terminated | truncated
            # Same-step autoreset: a finished env shows its new episode's first observation.
            assert (np.abs(new_obs[done]) < 0.05).all()
            np.testing.assert_allclose(new_obs[~done], ref_obs[~done], rtol=1e-6, atol=1e-6)
            # ... and infos its finished episode's last observation: Gymnasium's step.
            if done.any():
                assert np.array_equal(infos["_final_obs"], done)
                assert all(infos["final_obs"][i] is None for i in np.flatnonzero(~done))
                final = np.stack(list(infos["final_obs"][done]))
                assert final.dtype == np.float32
                np.testing.assert_allclose(final, ref_obs[done], rtol=1e-6, atol=1e-6)
                assert (np.abs(final) >= 0.05).any(axis=1).all(), "terminal states, not resets"
            else:
                assert infos == {}
            finished += int(done.sum())
            compared += int((~done).sum())
            episode_steps[done] = 0
            obs = new_obs
    finally:
        env.close()
    assert finished > 500 and compared > 15000, (finished, compared)  # the test saw both


def test_truncation_at_500_steps_with_a_balancing_policy():
    """A policy that keeps the pole up (push towards the side the pole falls to) lasts the
    whole 500 steps from every start: the engine then truncates, as Gymnasium's
    CartPole-v1 (TimeLimit 500) does, and resets in the same step; ``infos["final_obs"]``
    holds the 500th state (Gymnasium's step from the 499th: what a truncated episode's
    value is bootstrapped from)."""
    n = 16
    env = ShmVectorEnv(num_envs=n)
    ref = gym.make("CartPole-v1").unwrapped
    ref.reset(seed=0)
    try:
        obs, _ = env.reset(seed=0)
        for t in range(1, 501):
            actions = (10 * obs[:, 2] + 2 * obs[:, 3] > 0).astype(np.int64)
            before = obs
            obs, rewards, terminated, truncated, infos = env.step(actions)
            assert not terminated.any(), t
            assert truncated.all() == (t == 500) and truncated.any() == (t == 500), t
            assert (infos != {}) == (t == 500), t
        assert (np.abs(obs) < 0.05).all()  # new episodes
        assert list(infos) == FINAL_KEYS and infos["_final_obs"].all() and infos["_final_info"].all()
        for i in range(n):
            ref.state = before[i].astype(np.float64)
            ref.steps_beyond_terminated = None
            expected, *_ = ref.step(int(actions[i]))
            np.testing.assert_allclose(infos["final_obs"][i], expected, rtol=1e-6, atol=1e-6)
        assert not np.allclose(np.stack(list(infos["final_obs"])), obs, atol=1e-3)
    finally:
        env.close()
    # The same policy under Gymnasium's CartPole-v1 also lasts exactly 500 steps.
    ref = gym.make("CartPole-v1")
    o, _ = ref.reset(seed=0)
    for t in range(1, 501):
        o, _, term, trunc, _ = ref.step(int(10 * o[2] + 2 * o[3] > 0))
        assert not term and trunc == (t == 500)


def _random_policy_episode_lengths(env, seed: int, steps: int):
    env = RecordEpisodeStatistics(env, buffer_length=10**6)
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    for _ in range(steps):
        env.step(rng.integers(0, 2, size=env.num_envs))
    lengths = np.array(env.length_queue, dtype=np.float64)
    returns = np.array(env.return_queue, dtype=np.float64)
    env.close()
    return lengths, returns


def test_random_policy_episode_statistics_match_gymnasium():
    """Same protocol on both sides (256 envs, 400 steps, same-step autoreset, episodes that
    finish within the window; Gymnasium's RecordEpisodeStatistics counts them): the mean
    episode length (= return) must agree within 5 standard errors of the difference.
    ~4,500 episodes a side: SE ~ 0.24, so the bound (~1.2, ~5 % of the mean ~22) catches a
    force, length or threshold off by a few percent; chance failure rate ~6e-7."""
    n, steps = 256, 400
    ours_l, ours_r = _random_policy_episode_lengths(ShmVectorEnv(num_envs=n), seed=11, steps=steps)
    ref_env = gym.make_vec(
        "CartPole-v1",
        num_envs=n,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
    )
    ref_l, ref_r = _random_policy_episode_lengths(ref_env, seed=12, steps=steps)
    assert len(ours_l) >= 2000 and len(ref_l) >= 2000, (len(ours_l), len(ref_l))
    assert np.array_equal(ours_r, ours_l), "reward 1 per step"
    assert np.array_equal(ref_r, ref_l)
    diff = ours_l.mean() - ref_l.mean()
    se = np.sqrt(ours_l.var(ddof=1) / len(ours_l) + ref_l.var(ddof=1) / len(ref_l))
    assert abs(diff) < 5 * se, (ours_l.mean(), ref_l.mean(), se)
    assert 18 < ours_l.mean() < 27, ours_l.mean()  # the known ~22 of a random policy
    # The spread agrees too. The lengths have kurtosis ~9, so the ratio of the standard
    # deviations has SE ~ sqrt(2 (k - 1) / (4 n)) ~ 0.03: 15 % is 5 SE.
    assert abs(ours_l.std() / ref_l.std() - 1) < 0.15, (ours_l.std(), ref_l.std())


# --- final observations in infos (SAME_STEP, engine metadata final_obs) ---------------------

def _structure(value):
    """What of an ``infos`` value does not depend on the episodes: keys (in order), types,
    dtypes, shapes; for an object array, the set of its non-None entries' (dtype, shape)."""
    if isinstance(value, dict):
        return [(k, _structure(v)) for k, v in value.items()]
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            entries = {(e.dtype.str, e.shape) if isinstance(e, np.ndarray) else type(e).__name__
                       for e in value if e is not None}
            return ("ndarray", "object", value.shape, sorted(entries))
        return ("ndarray", value.dtype.str, value.shape)
    return type(value).__name__


def _check_final_infos(infos, done, what):
    """``infos`` is SAME_STEP SyncVectorEnv's for a step where ``done`` envs finished."""
    if not done.any():
        assert infos == {}, what
        return
    assert list(infos) == FINAL_KEYS, what
    assert infos["_final_obs"].dtype == np.bool_ and np.array_equal(infos["_final_obs"], done), what
    assert infos["_final_info"].dtype == np.bool_ and np.array_equal(infos["_final_info"], done), what
    assert infos["_final_info"] is not infos["_final_obs"], what
    assert infos["final_info"] == {}, what  # CartPole-v1's step infos are empty
    final = infos["final_obs"]
    assert final.dtype == object and final.shape == done.shape, what
    for i, d in enumerate(done):
        if d:
            assert isinstance(final[i], np.ndarray), what
            assert final[i].dtype == np.float32 and final[i].shape == (4,), what
        else:
            assert final[i] is None, what


def test_step_infos_are_gymnasiums_same_step_infos():
    """A seeded random policy, the same actions to ShmVectorEnv and to Gymnasium's own
    SyncVectorEnv(autoreset_mode=SAME_STEP) of CartPole-v1: every step's infos have the
    same structure (keys in order, dtypes, shapes, masks = terminated | truncated, None for
    the envs that did not finish), and ours are exactly what Gymnasium's ``_add_info``
    (what SyncVectorEnv.step calls) makes of the same final observations."""
    n, steps = 16, 200
    ours = ShmVectorEnv(num_envs=n)
    ref = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(n)], autoreset_mode=AutoresetMode.SAME_STEP
    )
    rng = np.random.default_rng(5)
    both = several = 0
    try:
        assert ours.reset(seed=7)[1] == {} and ref.reset(seed=7)[1] == {}
        for t in range(steps):
            actions = rng.integers(0, 2, size=n)
            _, _, term, trunc, infos = ours.step(actions)
            _, _, ref_term, ref_trunc, ref_infos = ref.step(actions)
            _check_final_infos(infos, term | trunc, f"ours, step {t}")
            _check_final_infos(ref_infos, ref_term | ref_trunc, f"gymnasium's, step {t}")
            if infos and ref_infos:
                assert _structure(infos) == _structure(ref_infos), t
                both += 1
            if infos:
                several += int(infos["_final_obs"].sum() > 1)
                expected = {}
                for i in np.flatnonzero(infos["_final_obs"]):
                    expected = ours._add_info(
                        expected, {"final_obs": infos["final_obs"][i].copy(), "final_info": {}}, i
                    )
                assert _structure(expected) == _structure(infos)
                assert np.array_equal(expected["_final_obs"], infos["_final_obs"])
                assert all(
                    (a is None and b is None) or np.array_equal(a, b)
                    for a, b in zip(expected["final_obs"], infos["final_obs"])
                )
    finally:
        ours.close()
        ref.close()
    assert both > 40 and several > 5, (both, several)  # the test saw those cases


def test_final_observations_are_copies_that_the_next_step_leaves_alone():
    env = ShmVectorEnv(num_envs=8, seed=3, copy=False)
    region = np.asarray(env.client["final_obs"])
    rng = np.random.default_rng(0)
    try:
        env.reset()
        kept = []
        for _ in range(60):
            obs, _, term, trunc, infos = env.step(rng.integers(0, 2, size=8))
            for i in np.flatnonzero(term | trunc):
                final = infos["final_obs"][i]
                assert not np.shares_memory(final, region) and not np.shares_memory(final, obs)
                assert final.flags.writeable and final.flags.owndata
                kept.append((final, final.copy()))
        assert len(kept) >= 10
        assert all(np.array_equal(a, b) for a, b in kept), "later steps changed a final obs"
    finally:
        env.close()


def test_gymnasium_wrappers_see_the_final_infos_as_syncvectorenvs():
    """RecordEpisodeStatistics, DictInfoToList and the reward wrappers pass the final
    infos on (the episode statistics are added next to them) for ShmVectorEnv exactly as
    for Gymnasium's SyncVectorEnv. (Gymnasium's vectorised observation wrappers refuse
    SAME_STEP envs, SyncVectorEnv too, so they do not apply.)"""
    n, steps = 8, 60

    def run(env):
        env = DictInfoToList(ClipReward(NormalizeReward(RecordEpisodeStatistics(env)), -5.0, 5.0))
        rng = np.random.default_rng(3)
        env.reset(seed=1)
        keys = []
        for _ in range(steps):
            _, _, term, trunc, infos = env.step(rng.integers(0, 2, size=n))
            assert isinstance(infos, list) and len(infos) == n
            for i, info in enumerate(infos):
                if term[i] or trunc[i]:
                    assert set(info) == {"final_obs", "final_info", "episode"}, info
                    assert info["final_obs"].dtype == np.float32 and info["final_obs"].shape == (4,)
                    assert info["episode"]["l"] == info["episode"]["r"] > 0
                    keys.append(tuple(info))
                else:
                    assert info == {}
        env.close()
        return keys

    ours = run(ShmVectorEnv(num_envs=n))
    theirs = run(gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(n)], autoreset_mode=AutoresetMode.SAME_STEP
    ))
    assert len(ours) > 10 and len(theirs) > 10
    assert set(ours) == set(theirs) and len(set(ours)) == 1


class _EditedSchema:
    """A client whose schema metadata is edited (``None`` deletes a key); the rest is the
    real client's."""

    def __init__(self, client, **edits):
        self._client, self._edits = client, edits

    def schema(self, *args):
        schema = self._client.schema(*args)
        meta = {k: v for k, v in schema["metadata"].items() if self._edits.get(k, "") is not None}
        meta.update({k: v for k, v in self._edits.items() if v is not None})
        return {**schema, "metadata": meta}

    def __getitem__(self, name):
        return self._client[name]

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_without_final_obs_metadata_infos_stay_empty():
    with shmbridge.launch("cartpole", num_envs=8, seed=2) as client:
        for edits in ({"final_obs": None}, {"autoreset_mode": "disabled"}):
            env = ShmVectorEnv(client=_EditedSchema(client, **edits))
            env.reset(seed=0)
            finished = 0
            for _ in range(40):
                _, _, term, trunc, infos = env.step(np.ones(8, dtype=np.int64))
                assert infos == {}, edits
                finished += int((term | trunc).sum())
            assert finished > 0
            env.close()


@pytest.mark.parametrize("name", ["no_such_tensor", "rewards", "actions"])
def test_final_obs_metadata_must_name_an_observation_like_tensor(name):
    with shmbridge.launch("cartpole", num_envs=4, seed=2) as client:
        with pytest.raises(ValueError, match="final_obs"):
            ShmVectorEnv(client=_EditedSchema(client, final_obs=name))


# --- ownership, close, errors --------------------------------------------------------------

def test_close_stops_the_engine_and_removes_its_region():
    env = gym.make_vec(ENV_ID, num_envs=4)
    client = env.client
    name = client.name
    assert name in shmbridge.list_regions() and os.path.exists(f"/dev/shm/{name}")
    env.reset(seed=0)
    env.close()
    assert env.closed and client.closed
    assert client.engine_process.returncode == 0
    assert name not in shmbridge.list_regions()
    assert not os.path.exists(f"/dev/shm/{name}")
    env.close()  # idempotent
    with pytest.raises(gym.error.ClosedEnvironmentError):
        env.step(np.zeros(4, dtype=np.int64))
    with pytest.raises(gym.error.ClosedEnvironmentError):
        env.reset()


def test_wrapping_a_client_leaves_it_open_unless_asked():
    with shmbridge.launch("cartpole", num_envs=4, seed=3) as client:
        env = ShmVectorEnv(client=client)
        assert env.num_envs == 4
        env.reset(seed=0)
        env.step(np.zeros(4, dtype=np.int64))
        env.close()
        assert not client.closed
        client.step()  # still usable
        with pytest.raises(ValueError, match="num_envs"):
            ShmVectorEnv(num_envs=5, client=client)
        with pytest.raises(TypeError, match="launch"):
            ShmVectorEnv(client=client, blocking=True)
        owner = ShmVectorEnv(client=client, close_client=True)
        owner.close()
        assert client.closed
        assert client.name not in shmbridge.list_regions()


def test_constructor_errors_close_what_they_launched(monkeypatch):
    launched = []
    real_launch = shmbridge.launch

    def recording_launch(*args, **kwargs):
        launched.append(real_launch(*args, **kwargs))
        return launched[-1]

    monkeypatch.setattr(shmbridge, "launch", recording_launch)
    with pytest.raises(ValueError, match="max_episode_steps"):
        ShmVectorEnv(num_envs=2, max_episode_steps=200)  # the engine's limit is 500
    assert len(launched) == 1
    assert launched[0].closed and launched[0].engine_process.returncode == 0
    assert launched[0].name not in shmbridge.list_regions()
    with pytest.raises(ValueError, match="render"):
        ShmVectorEnv(num_envs=2, render_mode="rgb_array")
    assert len(launched) == 1  # refused before launching
    ShmVectorEnv(num_envs=2, max_episode_steps=500).close()  # the engine's own limit is fine
    assert len(launched) == 2 and launched[1].closed


def test_render_is_not_supported(envs):
    assert envs.render_mode is None
    with pytest.raises(NotImplementedError):
        envs.render()


# --- the null engine: spaces from the tensors ----------------------------------------------

def test_null_engine_box_spaces_and_actions_reach_the_engine():
    env = ShmVectorEnv("null", num_envs=4, obs_dim=3, act_dim=2)
    try:
        assert env.single_observation_space == spaces.Box(-np.inf, np.inf, (3,), np.float32)
        assert env.single_action_space == spaces.Box(-np.inf, np.inf, (2,), np.float32)
        assert env.observation_space.shape == (4, 3) and env.action_space.shape == (4, 2)
        assert env.metadata["autoreset_mode"] is AutoresetMode.DISABLED
        assert env.max_episode_steps is None
        with pytest.warns(UserWarning, match="takes no seeds"):
            obs, _ = env.reset(seed=1)
        assert env.observation_space.contains(obs)
        actions = np.arange(8, dtype=np.float64).reshape(4, 2)  # cast to float32
        obs, rewards, terminated, truncated, _ = env.step(actions)
        assert np.array_equal(rewards, actions[:, 0]), "null echoes actions[:, 0]"
        assert not terminated.any() and not truncated.any()
        with pytest.raises(ValueError):
            env.step(np.zeros((4, 3)))
        with pytest.raises(ValueError):
            env.step(np.full((4, 2), np.nan))
    finally:
        env.close()
