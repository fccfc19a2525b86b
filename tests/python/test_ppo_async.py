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
