"""Asynchronous batches (protocol 1.10, docs/async.md) from Python: launch(batch_size=...),
client.async_reset(), client.recv() returning views into the region, client.send()."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import shmbridge
from conftest import pattern


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_recv_hands_out_whole_shards_read_in_place_and_send_steps_only_them():
    n, k, b = 8, 4, 4
    with shmbridge.launch("null", num_envs=n, shards=k, batch_size=b) as c:
        whole = np.asarray(c.obs)
        row = whole.strides[0]
        width = whole.shape[1]
        base = _address(whole)
        frames = [0] * k  # the client's own count of actions sent to each shard
        held = set()
        shard_size = n // k
        seen_orders = set()
        for round_ in range(200):
            batch = c.recv(timeout=30)
            assert len(batch) == b
            ids = batch.env_ids.tolist()
            assert not held & set(ids), "an env handed out twice before its action was sent"
            held |= set(ids)
            seen_orders.add(tuple(c.batch_shards))
            # Zero-copy: each shard's rows are the region's, at the shard's own address.
            for (start, end), view in zip(batch.spans, batch.views("obs")):
                assert _address(view) == base + start * row
                assert not view.flags.owndata
            if batch.contiguous:
                assert _address(batch.obs) == base + batch.spans[0][0] * row
            obs, rew, term, trunc, env_ids = batch
            assert obs.shape == (b, width) and rew.shape == (b,)
            assert env_ids.tolist() == ids
            # Each shard's rows hold the frame of exactly the actions it was sent.
            for s, (start, end) in zip(c.batch_shards, batch.spans):
                flat = np.arange(start * width, end * width)
                np.testing.assert_array_equal(
                    whole[start:end].ravel(), pattern(frames[s], flat), err_msg=f"shard {s}"
                )
            actions = np.zeros((b,) + np.asarray(c.actions).shape[1:], np.asarray(c.actions).dtype)
            if round_ % 2:
                c.send(actions, env_ids)
            else:
                # Shard by shard, in reverse: any order, over several sends.
                for s, (start, end) in reversed(list(zip(c.batch_shards, batch.spans))):
                    c.send(actions[: end - start], list(range(start, end)))
            for s in c.batch_shards:
                frames[s] += 1
            held -= set(ids)
        assert all(len(o) == b // shard_size for o in seen_orders)


def test_misuse_is_out_of_order_and_posts_nothing():
    with shmbridge.launch("null", num_envs=8, shards=4) as c:
        with pytest.raises(shmbridge.OutOfOrderError):
            c.recv(timeout=1)
        with pytest.raises(shmbridge.InvalidSpecError):
            c.async_reset(3)  # not a multiple of the shard size (2)
        c.async_reset(4)
        with pytest.raises(shmbridge.OutOfOrderError):
            c.step()
        batch = c.recv(timeout=30)
        ids = batch.env_ids.tolist()
        other = next(e for e in range(8) if e not in ids)
        with pytest.raises(shmbridge.OutOfOrderError, match=f"env {other}"):
            c.send(None, [other])
        with pytest.raises(shmbridge.OutOfOrderError, match="twice"):
            c.send(None, ids + ids[:1])
        with pytest.raises(shmbridge.OutOfOrderError, match="missing"):
            c.send(None, ids[:1])
        c.send(None, ids)
        with pytest.raises(shmbridge.OutOfOrderError):
            c.send(None, ids)


def test_batch_size_needs_shards():
    with pytest.raises(ValueError):
        shmbridge.launch("null", num_envs=8, batch_size=4)


def test_envpool_shaped_pool_steps_each_env_once_per_action():
    with shmbridge.AsyncEnvPool("null", num_envs=8, shards=4, batch_size=4) as pool:
        obs, info = pool.reset()
        assert obs.shape[0] == 4 and info["env_id"].shape == (4,)
        assert obs.flags.owndata, "copies by default"
        width = obs.shape[1]
        act_shape = np.asarray(pool.client.actions).shape[1:]
        act_dtype = np.asarray(pool.client.actions).dtype
        steps = np.zeros(8, np.int64)
        env_id = info["env_id"]
        for _ in range(50):
            obs, rew, term, trunc, info = pool.step(np.zeros((4,) + act_shape, act_dtype), env_id)
            steps[env_id] += 1
            env_id = info["env_id"]
            # Row e of a shard at frame f is the null pattern of (f, e's flat elements); all
            # envs of a shard step together, so env e's frame is its own step count.
            for i, e in enumerate(env_id):
                flat = np.arange(e * width, (e + 1) * width)
                np.testing.assert_array_equal(obs[i], pattern(steps[e], flat))


def test_refused_sends_and_steps_write_no_actions():
    with shmbridge.launch("null", num_envs=4, shards=2) as c:
        region = np.asarray(c.actions)
        shape, dtype = region.shape[1:], region.dtype
        # A lock-step client may not step once it went asynchronous: nothing is written.
        c.async_reset(2)
        before = region.copy()
        with pytest.raises(shmbridge.OutOfOrderError):
            c.step(np.full((4,) + shape, 9, dtype))
        np.testing.assert_array_equal(region, before)
        batch = c.recv(timeout=30)
        ids = batch.env_ids.tolist()
        c.send(np.full((2,) + shape, 7, dtype), ids)
        # The shard is stepping on those rows: a second send is refused and writes nothing.
        with pytest.raises(shmbridge.OutOfOrderError):
            c.send(np.full((2,) + shape, 99, dtype), ids)
        np.testing.assert_array_equal(region[ids], np.full((2,) + shape, 7, dtype))


def test_send_checks_actions_as_step_does_nothing_cast_or_broadcast():
    with shmbridge.launch("cartpole", num_envs=4, shards=2, batch_size=2) as c:
        region = np.asarray(c.actions)
        assert region.dtype == np.int64
        batch = c.recv(timeout=30)
        ids = batch.env_ids.tolist()
        before = region.copy()
        # Floats into int64 actions: step() refuses them, and so does send().
        with pytest.raises(TypeError):
            c.send(np.full((2,) + region.shape[1:], 0.7), ids)
        # One value, or one row, for every env of the batch: no broadcast.
        with pytest.raises(ValueError):
            c.send(np.int64(1), ids)
        with pytest.raises(ValueError):
            c.send(np.ones(region.shape[1:], np.int64), ids)
        with pytest.raises(TypeError):
            c.send(1, ids)
        np.testing.assert_array_equal(region, before)
        # Nothing was posted: the same envs are still the caller's to send.
        c.send(np.array([1, 0], np.int64).reshape((2,) + region.shape[1:]), ids)
        assert region[ids].ravel().tolist() == [1, 0]


def test_a_sharded_python_engine_reports_its_own_shard_frame():
    spec = shmbridge.EngineSpec.standard("py-frames", 4, 3, 1).shards(2)
    engines = [shmbridge.Engine(spec)]
    engines.append(shmbridge.Engine.join(engines[0].name, 1))
    published = [0, 0]
    errors = []

    class Resets:  # async_reset's reset, which publishes no frame
        def reset(self, env_ids, seeds, options):
            pass

    def serve(k):
        engine = engines[k]
        engine.publish()
        try:
            while True:
                engine.wait_actions(timeout=30, handler=Resets())
                engine.publish()
                published[k] += 1
        except shmbridge.ClientClosedError:
            pass
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    client = shmbridge.attach(engines[0].name)
    try:
        for _ in range(3):
            client.step()
        assert [e.frame for e in engines] == [3, 3]
        # Asynchronously the shards part: each reports the frames it published itself.
        client.async_reset(2)
        for _ in range(5):
            batch = client.recv(timeout=30)
            client.send(None, batch.env_ids.tolist())
        client.recv(timeout=30)
        client.recv(timeout=30)
    finally:
        client.close()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert sum(published) == 3 * 2 + 5
    assert [e.frame for e in engines] == published
    for e in engines:
        e.close()


class _CountResets:
    """A client that counts its async_reset() calls, forwarding everything."""

    def __init__(self, client):
        self._client = client
        self.resets = 0

    def async_reset(self, *args, **kwargs):
        self.resets += 1
        return self._client.async_reset(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_envpool_resets_whenever_asked_after_the_first_steps():
    spy = _CountResets(shmbridge.launch("null", num_envs=8, shards=4))
    with shmbridge.AsyncEnvPool(batch_size=4, client=spy) as pool:
        assert spy.resets == 1
        # Stepping straight away (no async_reset() first), then asking for a reset.
        act = np.asarray(pool.client.actions)
        zeros = np.zeros((4,) + act.shape[1:], act.dtype)
        _, _, _, _, info = pool.recv()
        pool.send(zeros, info["env_id"])
        pool.async_reset()
        assert spy.resets == 2
        pool.recv()
        pool.reset()
        assert spy.resets == 3
        with pytest.raises(NotImplementedError):
            pool.reset(env_id=[0])
    # async_reset() right after the construction is the construction's reset.
    spy = _CountResets(shmbridge.launch("null", num_envs=8, shards=4))
    with shmbridge.AsyncEnvPool(batch_size=4, client=spy) as pool:
        pool.async_reset()
        assert spy.resets == 1


def test_a_seeded_launch_with_batches_starts_the_seeded_episodes():
    """``launch(..., batch_size=B, seed=s)``: the batches start from the episodes seed
    ``s`` gives (env i seeded with s + i), as a lock-step launch with that seed does."""
    with shmbridge.launch("cartpole", num_envs=4, seed=7) as lock_step:
        want = np.asarray(lock_step.obs).copy()
    with shmbridge.launch("cartpole", num_envs=4, shards=2, batch_size=2, seed=7) as client:
        seen = {}
        for _ in range(2):
            obs, _, _, _, env_ids = client.recv(timeout=30)
            for row, env in zip(np.asarray(obs), np.asarray(env_ids).tolist()):
                seen[env] = row.copy()
            client.send(np.zeros((2, 1), np.int64), env_ids)
    assert sorted(seen) == [0, 1, 2, 3]
    np.testing.assert_array_equal(np.stack([seen[i] for i in range(4)]), want)
