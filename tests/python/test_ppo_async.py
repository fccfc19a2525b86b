"""PPO with asynchronous batches (shmbridge.examples.ppo_async) on a short budget: it
learns, every step it trains on is CartPole's own step of the env it names from the
action sent to that env, and a learner whose actions go to the wrong envs is caught."""

from __future__ import annotations

import pytest

import shmbridge
from conftest import regions

pytest.importorskip("torch")
pytest.importorskip("tqdm")

from shmbridge.examples import ppo_async  # noqa: E402

# A random policy averages about 22 on CartPole-v1. With these settings (16 envs in 4
# shards, batches of 8, 40,960 env steps: 20 updates, about 4 s here), five runs of seed 1
# ended at a mean return (last 100 episodes) of 213-253 (runs of one seed differ: which
# shards answer first is not chosen), and seeds 2 and 3 (40,000 steps) at 244 and 227;
# the lock-step example with the same settings, 243.
THRESHOLD = 150.0


def _cfg(**kw) -> ppo_async.AsyncConfig:
    base = dict(total_steps=40960, seed=1, target_return=None, progress=False,
                check_dynamics=True)
    base.update(kw)
    return ppo_async.AsyncConfig(**base)


@pytest.mark.long
def test_ppo_with_asynchronous_batches_learns_on_a_short_budget():
    before = regions()
    r = ppo_async.train(_cfg(), log=lambda *a: None)
    assert r.env_steps >= 40960 and r.window_episodes == 100
    assert r.mean_return >= THRESHOLD, r.summary()
    assert len(r.curve_steps) == len(r.curve_returns) > 0
    assert not regions() - before


class _Swapped:
    """A client that sends each batch's actions to the batch's envs in reverse order."""

    def __init__(self, client) -> None:
        self.client = client

    def __enter__(self) -> "_Swapped":
        return self

    def __exit__(self, *exc) -> None:
        self.client.__exit__(*exc)

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def __getitem__(self, name: str):
        return self.client[name]

    def __contains__(self, name: str) -> bool:
        return name in self.client

    def send(self, actions, env_ids) -> None:
        self.client.send(actions[::-1].copy(), env_ids)


def test_actions_sent_to_the_wrong_envs_are_caught(monkeypatch):
    launch = shmbridge.launch
    monkeypatch.setattr(shmbridge, "launch", lambda *a, **k: _Swapped(launch(*a, **k)))
    with pytest.raises(RuntimeError, match="CartPole's equations give"):
        ppo_async.train(_cfg(total_steps=4096), log=lambda *a: None)


def test_per_env_gae_bootstraps_each_env_at_its_own_last_step():
    import torch

    # Env 0: two steps, not done, bootstrapped from 10; env 1: one step that ended the
    # episode (no bootstrap); env 2: no step. gamma 0.5, lambda 1.
    rewards = torch.tensor([[1.0, 2.0, 0.0], [1.0, 7.0, 0.0], [9.0, 9.0, 9.0]])
    values = torch.tensor([[0.0, 0.0, 0.0], [4.0, 5.0, 0.0], [5.0, 5.0, 5.0]])
    dones = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    length = torch.tensor([2, 1, 0])
    adv, ret = ppo_async.per_env_gae(rewards, values, dones, length,
                                     torch.tensor([10.0, 3.0, 3.0]), 0.5, 1.0)
    # Env 0: returns 1 + 0.5 * (1 + 0.5 * 10) = 4, then 1 + 0.5 * 10 = 6.
    assert ret[:, 0].tolist() == [4.0, 6.0, 0.0]
    assert ret[:, 1].tolist() == [2.0, 0.0, 0.0]
    assert ret[:, 2].tolist() == [0.0, 0.0, 0.0]
    assert adv[:, 0].tolist() == [4.0, 2.0, 0.0]


def test_a_rollout_that_does_not_divide_into_the_minibatches_keeps_the_agent_finite(monkeypatch):
    """5 envs x 13 steps = 65 samples in 32 minibatches: near-equal minibatches of 2 and 3
    samples, never a last one of a single sample (whose advantage has no standard
    deviation, which made every parameter NaN and the next rollout's sampling fail)."""
    import torch

    from shmbridge.examples import ppo

    agents = []
    make = ppo._agent
    monkeypatch.setattr(ppo, "_agent", lambda *a: agents.append(make(*a)) or agents[-1])
    r = ppo_async.train(_cfg(lockstep=True, num_envs=5, shards=1, num_steps=13,
                             num_minibatches=32, total_steps=130), log=lambda *a: None)
    assert r.env_steps == 130
    assert all(torch.isfinite(p).all() for p in agents[0].parameters())


def _minibatches_seen(batch: int, num_minibatches: int):
    """The samples of each minibatch ``ppo_update`` evaluates (one epoch), each sample's
    observation its index."""
    import torch

    from shmbridge.examples.ppo_core import Config, ppo_update

    torch.manual_seed(0)
    net = torch.nn.Linear(1, 3)
    seen = []

    def evaluate(x):
        seen.append(x[:, 0].long().tolist())
        out = net(x)
        return out[:, :2], out[:, 2]

    obs = torch.arange(batch, dtype=torch.float32).unsqueeze(1)
    zeros = torch.zeros(batch)
    ppo_update(Config(update_epochs=1, num_minibatches=num_minibatches), net,
               torch.optim.SGD(net.parameters(), lr=0.0), evaluate, obs,
               zeros.long(), zeros, torch.randn(batch), zeros)
    return seen


def test_ppo_update_splits_a_batch_into_near_equal_minibatches_of_two_or_more():
    import torch

    # 65 samples in 32: one of 3 and 31 of 2, each sample once.
    seen = _minibatches_seen(65, 32)
    assert sorted(len(mb) for mb in seen) == [2] * 31 + [3]
    assert sorted(sum(seen, [])) == list(range(65))
    # 5 samples in 4: as many minibatches as leave 2 samples in each.
    assert sorted(len(mb) for mb in _minibatches_seen(5, 4)) == [2, 3]
    # A batch that divides evenly: the permutation's slices in order, as before.
    seen = _minibatches_seen(64, 4)
    torch.manual_seed(0)
    torch.nn.Linear(1, 3), torch.randn(64)  # what the helper draws before the update
    perm = torch.randperm(64).tolist()
    assert seen == [perm[s:s + 16] for s in range(0, 64, 16)]


class _Tracking:
    """A fake sharded client for ``shmbridge.launch`` serving a 1-D target-tracking task
    with continuous actions, in EnvPool's recv/send shape: each env shows its target
    ``tau`` (uniform in [-1, 1], new every step) beside a badly scaled dimension of noise
    (about 300 +- 100); the reward is ``-|action - tau|`` for an action in the bounds
    [-1, 1]; every 20th step truncates the episode. ``recv()`` hands out the envs of
    shards drawn at random among those not held by the learner (the shards answer in a
    random order). It records every action sent, with the target of the env it was sent
    to and the targets of the other envs of its batch."""

    def __init__(self, num_envs: int, shards: int, seed: int) -> None:
        import numpy as np

        self.np, self.num_envs = np, num_envs
        self.rng = np.random.default_rng(seed)
        self.size = num_envs // shards
        self.shards = shards
        self.t = {"obs": np.zeros((num_envs, 2), np.float32),
                  "final_obs": np.zeros((num_envs, 2), np.float32),
                  "actions": np.zeros((num_envs, 1), np.float32),
                  "rewards": np.zeros(num_envs, np.float32),
                  "terminated": np.zeros(num_envs, bool),
                  "truncated": np.zeros(num_envs, bool)}
        self.steps = np.zeros(num_envs, int)
        self.held: set = set()
        self.batch_size = 0
        self.sent = []  # (action, own target, the batch's other targets)

    def __enter__(self) -> "_Tracking":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __getitem__(self, name: str):
        return self.t[name]

    def __contains__(self, name: str) -> bool:
        return name in self.t

    def schema(self) -> dict:
        return {"metadata": {"action_space": "box", "action_low": "-1", "action_high": "1"}}

    def _show(self, envs) -> None:
        self.t["obs"][envs, 0] = self.rng.uniform(-1, 1, len(envs))
        self.t["obs"][envs, 1] = 300 + 100 * self.rng.standard_normal(len(envs))

    def async_reset(self, batch_size: int, seed: int) -> None:
        self.batch_size = batch_size
        self._show(self.np.arange(self.num_envs))

    def recv(self):
        import shmbridge

        np = self.np
        free = [s for s in range(self.shards) if s not in self.held]
        chosen = self.rng.permutation(free)[: self.batch_size // self.size].tolist()
        self.held.update(chosen)
        spans = [(s * self.size, (s + 1) * self.size) for s in chosen]
        return shmbridge.Batch(self, np.concatenate([np.arange(a, b) for a, b in spans]), spans)

    def send(self, actions, env_ids) -> None:
        np = self.np
        ids = np.asarray(env_ids)
        shards = set((ids // self.size).tolist())
        assert shards <= self.held and len(ids) == len(shards) * self.size, "envs not handed out"
        self.held -= shards
        a = np.asarray(actions, np.float32).reshape(len(ids))
        tau = self.t["obs"][ids, 0].copy()
        for i in range(len(ids)):
            self.sent.append((float(a[i]), float(tau[i]), np.delete(tau, i)))
        self.t["rewards"][ids] = -np.abs(np.clip(a, -1, 1) - tau)
        self.steps[ids] += 1
        trunc = self.steps[ids] % 20 == 0
        self.t["truncated"][ids] = trunc
        self._show(ids)
        self.t["final_obs"][ids] = self.t["obs"][ids]


def _train_tracking(monkeypatch, **kw):
    fakes = []

    def launch(env, num_envs, shards, seed, **_):
        fakes.append(_Tracking(num_envs, shards, seed))
        return fakes[-1]

    monkeypatch.setattr(shmbridge, "launch", launch)
    base = dict(env="tracking", num_envs=8, shards=4, batch_size=4, num_steps=32,
                total_steps=4096, check_dynamics=False, normalize=True, log_std_init=-1.0)
    base.update(kw)
    return ppo_async.train(_cfg(**base), log=lambda *a: None), fakes[0]


def test_the_continuous_form_with_normalize_learns_a_tracking_task_in_bounds(monkeypatch):
    """The Gaussian policy and --normalize without MuJoCo, on the fake tracking task
    (about 3 s): it learns well above random, every action sent is within the bounds, and
    each action reaches the env it was chosen for (mixed-up batches would leave the
    actions no closer to an env's own target than to the others')."""
    import numpy as np

    r, fake = _train_tracking(monkeypatch)
    assert r.env_steps >= 4096 and r.window_episodes == 100
    # Uniform random actions in the bounds cost 2/3 a step: -13.3 an episode of 20. Seeds
    # 1-5 ended at -5.3 to -6.3 (without --normalize, seed 1: -9.7).
    assert r.mean_return > -8.0, r.summary()
    actions = np.array([a for a, _, _ in fake.sent])
    assert len(actions) >= 4096 and np.abs(actions).max() <= 1.0
    # The actions each env received late in the run track that env's own target: closer to
    # it than to the other targets of the same batch (seeds 1-5: 0.26-0.31 against 0.63).
    late = fake.sent[-1000:]
    own = np.mean([abs(a - tau) for a, tau, _ in late])
    others = np.mean([np.abs(a - rest).mean() for a, _, rest in late])
    assert own < 0.6 * others, (own, others)


def test_running_mean_std_matches_numpy_over_uneven_batches():
    """Batches of 1, 7, 1, 30, 2 and 0 samples, merged one by one, give the mean and the
    (population) variance NumPy computes over all the samples at once, the prior (mean
    0, variance 1) weighing as 1e-4 of a sample."""
    import numpy as np
    import torch

    from shmbridge.examples.ppo_core import RunningMeanStd

    rng = np.random.default_rng(0)
    rms, scalars = RunningMeanStd((3,)), RunningMeanStd()
    seen = []
    for m in (1, 7, 1, 30, 2, 0):
        x = rng.normal([5.0, -2.0, 300.0], [0.5, 3.0, 100.0], size=(m, 3))
        seen.append(x)
        rms.update(torch.from_numpy(x))
        scalars.update(torch.from_numpy(x[:, 2].copy()))
    every = np.concatenate(seen)
    eps, n = 1e-4, len(every)
    mean = every.mean(0) * n / (n + eps)
    var = (n * (every.var(0) + (every.mean(0) - mean) ** 2) + eps * (1 + mean ** 2)) / (n + eps)
    assert rms.count == pytest.approx(n + eps, rel=1e-12)
    np.testing.assert_allclose(rms.mean.numpy(), mean, rtol=1e-10)
    np.testing.assert_allclose(rms.var.numpy(), var, rtol=1e-10)
    # The prior hardly weighs: NumPy's own figures to 1e-3.
    np.testing.assert_allclose(rms.var.numpy(), every.var(0), rtol=1e-3)
    assert scalars.mean.item() == pytest.approx(mean[2], rel=1e-10)
    assert scalars.var.item() == pytest.approx(var[2], rel=1e-10)
    x = torch.from_numpy(every[:2])
    np.testing.assert_allclose(rms.normalize(x).numpy(), (every[:2] - mean) / np.sqrt(var + 1e-8),
                               rtol=1e-6)
    np.testing.assert_allclose(scalars.scale(x[:, 2]).numpy(), every[:2, 2] / np.sqrt(var[2] + 1e-8),
                               rtol=1e-6)


def test_the_lock_step_twin_trains_an_engine_without_final_obs():
    """``--env null --lockstep``: continuous actions (float32, no metadata: unbounded),
    no ``final_obs`` (the truncation bootstrap's stand-in is used)."""
    r = ppo_async.train(_cfg(env="null", lockstep=True, num_envs=2, shards=1, num_steps=8,
                             total_steps=32, check_dynamics=False), log=lambda *a: None)
    assert r.env_steps == 32


class _Actions:
    """A client with an ``actions`` tensor of ``dtype`` and the metadata given."""

    def __init__(self, dtype, metadata: dict) -> None:
        import numpy as np

        self.actions = np.zeros((4, 2), dtype)
        self.metadata = metadata

    def schema(self) -> dict:
        return {"metadata": self.metadata}

    def __getitem__(self, name: str):
        return {"actions": self.actions}[name]


def test_the_action_space_without_metadata_follows_the_actions_dtype():
    import numpy as np

    shape, low, high, count = ppo_async._action_space(_Actions(np.float32, {}))
    assert (shape, count) == ((2,), 0) and (low == -np.inf).all() and (high == np.inf).all()
    shape, low, high, count = ppo_async._action_space(
        _Actions(np.float32, {"action_space": "box", "action_low": "-1,0", "action_high": "1,2"}))
    assert low.tolist() == [-1, 0] and high.tolist() == [1, 2] and count == 0
    assert ppo_async._action_space(_Actions(np.int64, {"action_space": "discrete:3"}))[3] == 3
    with pytest.raises(ValueError, match="int32 .discrete. but its metadata has no action_space"):
        ppo_async._action_space(_Actions(np.int32, {}))


@pytest.mark.parametrize("flag", [["--normalize"], ["--log-std-init", "-1"], ["--check-dynamics"]])
def test_lockstep_on_cartpole_refuses_what_the_lock_step_example_does_not_do(flag, capsys):
    with pytest.raises(SystemExit) as exit:
        ppo_async.main(["--lockstep", "--num-envs", "2", "--shards", "1", "--num-steps", "8", "--total-steps", "16",
                        "--num-minibatches", "2", "--no-progress"] + flag)
    assert exit.value.code == 2
    assert (f"--lockstep on cartpole trains the lock-step example (shmbridge.examples.ppo), "
            f"which has no {flag[0]}") in capsys.readouterr().err
