"""shmbridge.integrations.torchrl.ShmAsyncEnvPool: TorchRL's AsyncEnvPool API over
asynchronous batches (docs/async.md): the same trajectories as the client's own
recv/send, the region's memory handed out (by address), sends of envs not handed out
refused with nothing posted, the per-env forms refused, a timed-out recv keeping what it
received, and TorchRL's synchronous loops (rollout, Collector) over it."""

from __future__ import annotations

import numpy as np
import pytest

import shmbridge
from shmbridge.errors import OutOfOrderError

torch = pytest.importorskip("torch")
pytest.importorskip("torchrl")

from torchrl.collectors import Collector  # noqa: E402

from shmbridge.integrations.torchrl import ShmAsyncEnvPool  # noqa: E402

N, SHARDS, STEPS = 8, 4, 40


def action(i: int, k: int) -> int:
    """Env ``i``'s ``k``-th action, the same for both ways of stepping, for any ``k``: the
    loops run until the slowest env has STEPS steps, and on a loaded machine a shard that
    answers more often takes its envs far past that."""
    return int(np.random.default_rng([0, i, k]).integers(0, 2))


def ids_of(td) -> list:
    return [int(i) for i in td["env_index"]]


def core_trajectories(batch_size: int) -> dict:
    """Per env: the observations handed out, and each step's reward, terminated and
    truncated, stepping the client's recv/send directly."""
    client = shmbridge.launch("cartpole", N, shards=SHARDS, batch_size=batch_size)
    client.async_reset(batch_size, 5)  # env i seeded with 5 + i, as the pool's first reset
    obs = {i: [] for i in range(N)}
    steps = {i: [] for i in range(N)}
    try:
        first = True
        while min(len(s) for s in steps.values()) < STEPS:
            batch = client.recv()
            ids = [int(i) for i in batch.env_ids]
            rows = (np.array(batch.obs), np.array(batch.rewards), np.array(batch.terminated), np.array(batch.truncated))
            for k, i in enumerate(ids):
                obs[i].append(rows[0][k])
                if len(obs[i]) > 1:
                    steps[i].append((rows[1][k], rows[2][k], rows[3][k]))
            region = np.asarray(client["actions"])
            actions = np.array([action(i, len(obs[i]) - 1) for i in ids], dtype=region.dtype)
            actions = actions.reshape((len(ids), *region.shape[1:]))
            client.send(actions, ids)
            first = False
        assert not first
    finally:
        client.close()
    return {"obs": obs, "steps": steps}


def pool_trajectories(batch_size: int) -> dict:
    """The same through the pool: async_reset_send/recv, then
    async_step_and_maybe_reset_send/recv of each batch handed out."""
    pool = ShmAsyncEnvPool("cartpole", N, shards=SHARDS, batch_size=batch_size, seed=5)
    obs = {i: [] for i in range(N)}
    steps = {i: [] for i in range(N)}
    try:
        pool.async_reset_send()
        roots = [pool.async_reset_recv() for _ in range(N // batch_size)]
        assert sorted(i for r in roots for i in ids_of(r)) == list(range(N))
        for root in roots:
            for k, i in enumerate(ids_of(root)):
                obs[i].append(root["observation"][k].numpy())
        for root in roots:
            ids = ids_of(root)
            root["action"] = torch.as_tensor([action(i, len(obs[i]) - 1) for i in ids])
            pool.async_step_and_maybe_reset_send(root)
        while min(len(s) for s in steps.values()) < STEPS:
            out, root = pool.async_step_and_maybe_reset_recv()
            ids = ids_of(out)
            assert ids == ids_of(root) == sorted(ids) and len(ids) == batch_size
            for k, i in enumerate(ids):
                assert int(out["action"][k]) == action(i, len(obs[i]) - 1)  # the root is what was sent
                obs[i].append(root["observation"][k].numpy())
                nxt = out["next"]
                steps[i].append((nxt["reward"][k, 0].item(), nxt["terminated"][k, 0].item(), nxt["truncated"][k, 0].item()))
                assert not root["done"][k].item()
            root["action"] = torch.as_tensor([action(i, len(obs[i]) - 1) for i in ids])
            pool.async_step_and_maybe_reset_send(root)
    finally:
        pool.close()
    return {"obs": obs, "steps": steps}


@pytest.mark.parametrize("batch_size", [2, 4])
def test_pool_steps_the_trajectories_of_the_clients_recv_send(batch_size):
    core, pool = core_trajectories(batch_size), pool_trajectories(batch_size)
    finished = 0
    for i in range(N):
        n = min(len(core["steps"][i]), len(pool["steps"][i]))
        assert n >= STEPS
        np.testing.assert_array_equal(np.stack(core["obs"][i][: n + 1]), np.stack(pool["obs"][i][: n + 1]))
        for k in range(n):
            c, p = core["steps"][i][k], pool["steps"][i][k]
            assert (float(c[0]), bool(c[1]), bool(c[2])) == (float(p[0]), bool(p[1]), bool(p[2])), (i, k)
            finished += bool(c[1]) or bool(c[2])
    assert finished > 4  # episodes ended, and the autoreset's rows came through


def test_copy_false_hands_out_the_regions_rows():
    # One shard per batch: a batch's rows are adjacent, so they are views.
    pool = ShmAsyncEnvPool("cartpole", N, shards=SHARDS, batch_size=N // SHARDS, seed=1, copy=False)
    client = pool.client
    region = {name: torch.from_dlpack(client[name]) for name in ("obs", "rewards", "terminated", "truncated", "actions")}
    try:
        pool.async_reset_send()
        td = pool.async_reset_recv()
        first = ids_of(td)[0]
        assert td["observation"].data_ptr() == region["obs"][first].data_ptr()
        rest = [pool.async_reset_recv() for _ in range(SHARDS - 1)]
        td["action"] = torch.tensor([1, 0])
        pool.async_step_send(td)
        assert region["actions"][first : first + 2].flatten().tolist() == [1, 0]  # written into the region
        for r in rest:
            r["action"] = torch.zeros(2, dtype=torch.long)
            pool.async_step_send(r)
        out = pool.async_step_recv()
        i = ids_of(out)[0]
        nxt = out["next"]
        assert nxt["reward"].data_ptr() == region["rewards"][i].data_ptr()
        assert nxt["terminated"].data_ptr() == region["terminated"][i].data_ptr()
        assert nxt["truncated"].data_ptr() == region["truncated"][i].data_ptr()
        if not bool(nxt["done"].any()):
            assert nxt["observation"].data_ptr() == region["obs"][i].data_ptr()
    finally:
        pool.close()
    copying = ShmAsyncEnvPool("cartpole", N, shards=SHARDS, batch_size=N // SHARDS, seed=1)
    try:
        copying.async_reset_send()
        td = copying.async_reset_recv()
        whole = torch.from_dlpack(copying.client["obs"])
        start, end = whole.data_ptr(), whole.data_ptr() + whole.numel() * whole.element_size()
        assert not start <= td["observation"].data_ptr() < end  # a copy, TorchRL's to keep
    finally:
        copying.close()


def test_send_of_envs_not_handed_out_is_refused_and_posts_nothing():
    pool = ShmAsyncEnvPool("cartpole", N, shards=SHARDS, batch_size=4, seed=2)
    client = pool.client
    try:
        pool.async_reset_send()
        held = pool.async_reset_recv()
        mine = ids_of(held)
        others = sorted(set(range(N)) - set(mine))  # their resets are in flight
        before = np.asarray(client["actions"]).copy()
        td = held.clone()
        td["action"] = torch.ones(4, dtype=torch.long)
        for env_index in (others, mine[:2], mine[:3] + mine[:1], [mine[0]] + others[:3]):
            with pytest.raises(OutOfOrderError, match="nothing was sent"):
                pool.async_step_send(td, env_index=env_index)
        # Every env's reset must be received before a step is sent.
        with pytest.raises(OutOfOrderError, match="reset"):
            pool.async_step_send(td)
        np.testing.assert_array_equal(np.asarray(client["actions"]), before)  # nothing written
        second = pool.async_reset_recv()
        assert sorted(mine + ids_of(second)) == list(range(N))
        # Every shard is held: had a refused send posted, some shard would be stepping.
        with pytest.raises(OutOfOrderError):
            client.recv(timeout=10)
        # The batches handed out are still sendable, each once.
        pool.async_step_send(td)
        rest = second.clone()
        rest["action"] = torch.ones(4, dtype=torch.long)
        before = np.asarray(client["actions"]).copy()
        for env_index in (mine, ids_of(second)[:2], ids_of(second) + mine[:1]):
            # (mine: in flight; a part of a batch; a batch and an env in flight)
            with pytest.raises(OutOfOrderError, match="nothing was sent"):
                pool.async_step_send(rest, env_index=env_index)
        np.testing.assert_array_equal(np.asarray(client["actions"]), before)
        assert ids_of(pool.async_step_recv()) == sorted(mine)
        with pytest.raises(OutOfOrderError):
            client.recv(timeout=10)  # every shard held again: the refused sends posted nothing
    finally:
        pool.close()


def test_per_env_forms_are_refused_with_what_to_do():
    pool = ShmAsyncEnvPool("cartpole", N, shards=SHARDS, batch_size=4, seed=3)
    try:
        with pytest.raises(NotImplementedError, match="every env"):
            pool.async_reset_send(env_index=[0, 1])
        with pytest.raises(NotImplementedError, match="per-env"):
            pool.async_reset_send(env_index=0)
        pool.async_reset_send()
        with pytest.raises(NotImplementedError, match="max_get >= 4"):
            pool.async_reset_recv(max_get=2)
        with pytest.raises(NotImplementedError, match="per-env"):
            pool.async_reset_recv(env_index=0)
        td = pool.async_reset_recv(min_get=2, max_get=4)  # one whole batch
        assert len(ids_of(td)) == 4
        td["action"] = torch.zeros(4, dtype=torch.long)
        with pytest.raises(NotImplementedError, match="per-env"):
            pool.async_step_send(td[:1], env_index=ids_of(td)[0])
        with pytest.raises(OutOfOrderError, match="in flight"):
            pool.async_reset_send()  # envs' resets still in flight
    finally:
        pool.close()


def test_rollout_and_collector_over_the_pool():
    pool = ShmAsyncEnvPool("cartpole", N, shards=SHARDS, batch_size=4, seed=4)
    try:
        r = pool.rollout(30, break_when_any_done=False)
        assert r.batch_size == torch.Size([N, 30])
        done = r["next", "done"].squeeze(-1)
        assert done.any()
        # Each step starts where the last ended, but after a finished episode.
        same = ~done[:, :-1]
        assert torch.equal(r["next", "observation"][:, :-1][same], r["observation"][:, 1:][same])
        collector = Collector(pool, None, frames_per_batch=2 * N, total_frames=4 * N)
        try:
            batches = [b.batch_size for b in collector]
        finally:
            collector.shutdown(close_env=False)
        assert batches == [torch.Size([N, 2])] * 2
    finally:
        pool.close()


def test_seeds_serve_the_next_reset_and_batches_must_divide_the_envs():
    with pytest.raises(shmbridge.errors.InvalidSpecError, match="multiple of batch_size"):
        ShmAsyncEnvPool("cartpole", 6, shards=3, batch_size=4)
    # Env i seeded with s + i, as an unsharded engine's reset(seed=s) does.
    client = shmbridge.launch("cartpole", N, seed=7)
    try:
        seeded = np.array(client.obs)
    finally:
        client.close()
    pool = ShmAsyncEnvPool("cartpole", N, shards=SHARDS, batch_size=4, seed=7)
    try:
        first = pool.reset()  # every env, through async_reset_send/recv
        assert ids_of(first) == list(range(N))
        np.testing.assert_array_equal(first["observation"].numpy(), seeded)  # the constructor's seed
        assert not np.array_equal(pool.reset()["observation"].numpy(), seeded)  # it served one reset
        pool.set_seed(7)
        np.testing.assert_array_equal(pool.reset()["observation"].numpy(), seeded)
    finally:
        pool.close()


def test_a_recv_that_times_out_keeps_what_it_received():
    import os
    import signal

    pool = ShmAsyncEnvPool("cartpole", N, shards=SHARDS, batch_size=2, seed=6)  # a shard a batch
    stopped = pool.client.shard_pids[SHARDS - 1]  # envs 6 and 7
    try:
        pool.async_reset_send()
        roots = [pool.async_reset_recv() for _ in range(SHARDS)]
        os.kill(stopped, signal.SIGSTOP)  # its step cannot come
        for root in roots:  # (in the order the shards answered)
            root["action"] = torch.tensor([(i // 2) % 2 for i in ids_of(root)])
            pool.async_step_send(root)
        with pytest.raises(TimeoutError):
            pool.async_step_recv(min_get=N, timeout=0.5)
        os.kill(stopped, signal.SIGCONT)
        out = pool.async_step_recv(min_get=N)  # the batches received before, and the last
        assert ids_of(out) == list(range(N))
        assert out["action"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    finally:
        os.kill(stopped, signal.SIGCONT)
        pool.close()
