"""``python -m shmbridge.bench vector``: Gymnasium environments behind sharded shmbridge
engines against Gymnasium's own vector envs and EnvPool, side by side in one run.

Workloads: ``CartPole-v1`` (pure Python physics) and ``HalfCheetah-v5`` (MuJoCo), at
``--envs`` (default 1, 8, 16 and 64) environments. Contenders, each a Gymnasium ``VectorEnv``
stepped through ``envs.step(actions)`` with pre-drawn random actions, copies returned (the
Gymnasium default everywhere):

* ``shmbridge K=k``: ``ShmVectorEnv`` over ``shmbridge.launch_gym(env, N, shards=k)``
  for each ``--shards`` k (default 1, 2, 4), with the default wait policy (which adapts
  to the cores: it spins only while the shards and the learner fit them);
* ``AsyncVectorEnv``: ``gymnasium.vector.AsyncVectorEnv(shared_memory=True)``, one worker
  process per env (Gymnasium's default);
* ``SyncVectorEnv``: every env in this process (the one-core baseline);
* ``EnvPool``: ``envpool.make(env, env_type="gymnasium")`` (C++ threads in this process;
  the ceiling), when envpool is installed: for CartPole with its default threads; for the
  MuJoCo workloads with ``num_threads`` each of ``--shards`` (``EnvPool T=k``) and in its
  asynchronous mode with batches of N/2 (``EnvPool async B=N/2 T=k``: a timed step is one
  ``recv()`` and one ``send()`` of N/2 envs, so compare its env-steps/s, not its step);
* ``PufferLib B=N/2 W=k``: PufferLib's ``Multiprocessing`` vector env (``pufferlib-core``),
  k worker processes (each even ``--shards`` k), batches of N/2 handed out as workers
  answer, compared by env-steps/s as the asynchronous EnvPool rows are;
* ``native K=k``: ``ShmVectorEnv`` over ``shmbridge.launch("mujoco/<id>", N, shards=k)``,
  the native MuJoCo engine (docs/mujoco.md), and ``native K=1 T=2`` (one shard, 2
  threads), for the MuJoCo workloads where shmbridge was built with the ``mujoco``
  feature (else left out, saying so); and its asynchronous batches, ``native async B=N/2
  K=k`` (``shmbridge.AsyncEnvPool``, EnvPool's ``recv``/``send``; K even), beside
  EnvPool's of the same threads and batch.

Every contender of a workload is started first, then the rounds interleave them (each
runs a block of steps per round, the order rotated every round), so load on the machine
falls on all of them alike. Per contender: median and p99 of one vector step, env-steps/s
(from the mean), the learner's idle time (its wait for the envs, timed around the call:
the whole step where every env steps at once, ``recv()`` for the asynchronous rows; per
step and per env step, that time over the envs the call returned; median and p99), and its ratios to AsyncVectorEnv and SyncVectorEnv (of the means, and
the median of the per-round ratios to SyncVectorEnv: the blocks of one round ran within
seconds of each other, so a machine whose speed drifts disturbs them least). The targets
are checked against SyncVectorEnv: one shard within 1.1x of its mean step time, two
shards faster than it (CartPole N = 64, HalfCheetah N >= 16); ``--contenders`` picks a
subset (``shmbridge,sync``: no 64-process AsyncVectorEnv on a small machine).

Also the pure transport: the ``null`` engine (``--envs`` 64 by default for it too, 16 f32
observations each) as one engine and as 2 and 4 shards, through ``client.step()``.

Writes DIR/vector.md, DIR/vector.json and DIR/vector.png (``--out``, default
bench-results). ``--quick``: a smoke run (few steps, 4 envs, K = 1 and 2).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List

import numpy as np

from .common import Stats, random_actions
from .report import fmt_rate, fmt_ratio, fmt_us, log, machine_description, machine_header, markdown_table, publish

ASYNC, SYNC, ENVPOOL = "AsyncVectorEnv", "SyncVectorEnv", "EnvPool"


class Contender:
    """One vector env under test: ``step_block(n, out)`` times ``n`` steps."""

    def __init__(self, label: str, make: Callable[[], Any], num_envs: int, processes: int) -> None:
        self.label = label
        self.num_envs = num_envs
        self.processes = processes  # processes that step envs (for the per-core view)
        self.envs = make()
        self.envs.reset(seed=0)
        space = self.envs.action_space
        space.seed(0)
        self.bank = [space.sample() for _ in range(64)]
        self.k = 0
        self.times: List[int] = []
        self.block_means: List[float] = []

    def step_block(self, n: int) -> None:
        step, bank, pc, out = self.envs.step, self.bank, time.perf_counter_ns, self.times
        first = len(out)
        for _ in range(n):
            self.k += 1
            a = bank[self.k % len(bank)]
            t0 = pc()
            o, r, te, tr, _ = step(a)
            o[0]; r[-1]; te[-1]; tr[-1]  # noqa: B018 - touch what came back
            out.append(pc() - t0)
        self.block_means.append(sum(out[first:]) / max(1, len(out) - first))
        if not np.isfinite(np.asarray(o, dtype=np.float64)).all():
            raise RuntimeError(f"{self.label}: non-finite observations")

    def close(self) -> None:
        self.envs.close()


class EnvPoolContender(Contender):
    """EnvPool's synchronous vector env: ``envpool.make(env_id, env_type="gymnasium",
    num_envs=N, num_threads=T)``, stepped like the others (``T = 0``: EnvPool's default,
    a thread per core)."""

    def __init__(self, num_envs: int, env_id: str = "CartPole-v1", threads: int = 0) -> None:
        import envpool

        self.label = ENVPOOL if not threads else f"{ENVPOOL} T={threads}"
        self.num_envs = num_envs
        self.processes = threads or 1
        self.envs = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, seed=0, num_threads=threads)
        self.envs.reset()
        self.bank = random_actions(self.envs.action_space, num_envs, 64)
        self.k = 0
        self.times = []
        self.block_means = []


class AsyncBatchContender(Contender):
    """An asynchronous pool in EnvPool's shape (``recv()`` the first ``batch_size`` envs
    ready, ``send()`` their actions): each timed step is one ``recv`` and one ``send``, B
    env-steps. Its per-step ratios to the vector envs do not apply (a step here is B envs,
    not N); compare env-steps/s. A block ends with a batch in flight, which steps while the
    next contender is timed (and is ready at this one's next block): a small bias in its
    favour, the same for every asynchronous row."""

    def _start(self, label: str, envs: Any, space: Any, batch_size: int, processes: int) -> None:
        self.label = label
        self.whole_batch = False
        self.num_envs = batch_size  # env-steps per timed step
        self.processes = processes
        self.envs = envs
        self.envs.async_reset()
        self.bank = random_actions(space, batch_size, 64)
        self.k = 0
        self.times = []
        self.waits: List[int] = []  # each step's recv(): the learner's wait for the batch
        self.block_means = []

    def step_block(self, n: int) -> None:
        recv, send, bank, pc, out = self.envs.recv, self.envs.send, self.bank, time.perf_counter_ns, self.times
        waited = self.waits
        first = len(out)
        for _ in range(n):
            self.k += 1
            a = bank[self.k % len(bank)]
            t0 = pc()
            o, r, te, tr, info = recv()
            waited.append(pc() - t0)
            send(a, info["env_id"])
            out.append(pc() - t0)
        self.block_means.append(sum(out[first:]) / max(1, len(out) - first))
        if not np.isfinite(np.asarray(o, dtype=np.float64)).all():
            raise RuntimeError(f"{self.label}: non-finite observations")


class EnvPoolAsyncContender(AsyncBatchContender):
    """EnvPool's asynchronous mode: ``num_envs`` N, ``batch_size`` B < N, ``num_threads``."""

    def __init__(self, num_envs: int, env_id: str, threads: int, batch_size: int) -> None:
        import envpool

        envs = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, seed=0,
                            num_threads=threads, batch_size=batch_size)
        self._start(f"{ENVPOOL} async B={batch_size} T={threads}", envs, envs.action_space, batch_size, threads)


class NativeAsyncContender(AsyncBatchContender):
    """The native MuJoCo engine's asynchronous batches (docs/async.md) through
    ``shmbridge.AsyncEnvPool``, EnvPool's shape: K shards, batches of B envs (whole
    shards), arrays copied as EnvPool's are."""

    def __init__(self, num_envs: int, env_id: str, shards: int, batch_size: int) -> None:
        import shmbridge

        space = _action_space(env_id)
        envs = shmbridge.AsyncEnvPool(f"mujoco/{env_id}", num_envs, batch_size=batch_size, shards=shards)
        try:
            self._start(f"native async B={batch_size} K={shards}", envs, space, batch_size, shards)
        except BaseException:
            envs.close()
            raise


def _action_space(env_id: str) -> Any:
    """The action space of Gymnasium's `env_id` (the env made for it closed)."""
    import gymnasium

    env = gymnasium.make(env_id)
    try:
        return env.action_space
    finally:
        env.close()


class _GymMaker:
    """A picklable ``gymnasium.make(env_id)``."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id

    def __call__(self) -> Any:
        import gymnasium

        return gymnasium.make(self.env_id)


class _PufferPool:
    """PufferLib's vector env in the ``recv``/``send`` shape of the others: its ``recv``
    returns eight arrays (the envs' ids seventh) and its ``send`` takes the actions of
    the batch it handed out."""

    def __init__(self, envs: Any) -> None:
        self.envs = envs

    def async_reset(self) -> None:
        self.envs.async_reset(seed=0)

    def recv(self) -> Any:
        o, r, d, t, _ta, _infos, ids, _mask = self.envs.recv()
        return o, r, d, t, {"env_id": ids}

    def send(self, actions: Any, env_id: Any) -> None:
        self.envs.send(actions)

    def close(self) -> None:
        self.envs.close()


class PufferLibContender(AsyncBatchContender):
    """PufferLib's ``Multiprocessing`` vector env (``pufferlib-core``, its defaults): W
    worker processes of N/W Gymnasium envs each (``GymnasiumPufferEnv``), batches of B envs,
    the workers' batches taken in turn (``sync_traj``); its arrays are views of its shared
    memory, not copies. Its idle workers spin for half a second after their last work, on
    the cores the next contender of a round is timed on: a cost it puts on the others."""

    def __init__(self, num_envs: int, env_id: str, workers: int, batch_size: int) -> None:
        import functools

        import pufferlib.emulation
        import pufferlib.vector

        space = _action_space(env_id)
        creator = functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=_GymMaker(env_id))
        envs = pufferlib.vector.make(creator, backend=pufferlib.vector.Multiprocessing, num_envs=num_envs,
                                     num_workers=workers, batch_size=batch_size, overwork=True)
        try:
            self._start(f"PufferLib B={batch_size} W={workers}", _PufferPool(envs), space, batch_size, workers)
        except BaseException:
            envs.close()  # its workers never exit by themselves
            raise


class NullContender:
    """The transport alone: ``client.step()`` on the null engine, sharded or not."""

    def __init__(self, num_envs: int, shards: int) -> None:
        import shmbridge

        self.label = "one engine" if shards == 1 else f"{shards} shards"
        self.num_envs = num_envs
        self.processes = shards
        self.client = shmbridge.launch("null", num_envs=num_envs, obs_dim=16, shards=shards)
        self.times: List[int] = []
        self.block_means: List[float] = []

    def step_block(self, n: int) -> None:
        step, pc, out = self.client.step, time.perf_counter_ns, self.times
        first = len(out)
        for _ in range(n):
            t0 = pc()
            step()
            out.append(pc() - t0)
        self.block_means.append(sum(out[first:]) / max(1, len(out) - first))

    def close(self) -> None:
        self.client.close()


CONTENDERS = ("shmbridge", "native", "async", "sync", "envpool", "pufferlib")

#: The workloads the native MuJoCo engine serves (``mujoco/<id>``).
NATIVE = ("HalfCheetah-v5", "InvertedPendulum-v5", "Hopper-v5", "Walker2d-v5", "Ant-v5", "Humanoid-v5")


def _gym_contenders(env_id: str, n: int, shard_counts: List[int], which: List[str]) -> List[Any]:
    """Every contender of `env_id` at `n` envs, started; on a failure, those started are
    closed before it is raised (pools' workers would otherwise outlive the bench)."""
    out: List[Any] = []
    try:
        _add_gym_contenders(out, env_id, n, shard_counts, which)
    except BaseException:
        for c in out:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - the first failure is the one to raise
                pass
        raise
    return out


def _add_gym_contenders(out: List[Any], env_id: str, n: int, shard_counts: List[int], which: List[str]) -> None:
    import gymnasium

    import shmbridge
    from shmbridge.gym import ShmVectorEnv

    for k in shard_counts if "shmbridge" in which else []:
        if k > n:
            continue
        out.append(Contender(
            f"shmbridge K={k}",
            lambda k=k: ShmVectorEnv(client=shmbridge.launch_gym(env_id, n, k), close_client=True),
            n, k,
        ))
    native = [(k, 1) for k in shard_counts if k <= n] + ([(1, 2)] if n > 1 else [])
    for k, t in native if "native" in which and env_id in NATIVE else []:
        label = f"native K={k}" + (f" T={t}" if t > 1 else "")
        try:
            out.append(Contender(
                label,
                lambda k=k, t=t: ShmVectorEnv(
                    client=shmbridge.launch(f"mujoco/{env_id}", n, shards=k, threads=t), close_client=True),
                n, k * t,
            ))
        except shmbridge.errors.EngineStartError as e:
            if "without the `mujoco` feature" not in str(e):
                raise
            log(f"bench vector: no native {env_id}: shmbridge was built without the `mujoco` feature")
            break
    else:  # no break: the engine has the feature
        # Its asynchronous batches beside EnvPool's: the same threads (shards) and batch,
        # N/2 (whole shards: K even and dividing N).
        for k in [k for k in shard_counts if k >= 2 and k % 2 == 0 and n % k == 0] \
                if "native" in which and env_id in NATIVE else []:
            out.append(NativeAsyncContender(n, env_id, k, n // 2))
    fns = [lambda: gymnasium.make(env_id) for _ in range(n)]
    if "async" in which:
        out.append(Contender(ASYNC, lambda: gymnasium.vector.AsyncVectorEnv(fns, shared_memory=True), n, n))
    if "sync" in which:
        out.append(Contender(SYNC, lambda: gymnasium.vector.SyncVectorEnv(fns), n, 1))
    if "envpool" in which:
        try:
            if env_id == "CartPole-v1":
                out.append(EnvPoolContender(n))
            else:
                # At equal threads with the native engine's processes (K), and async with
                # half the envs per batch where there are enough of them.
                for k in [k for k in shard_counts if k <= n]:
                    out.append(EnvPoolContender(n, env_id, threads=k))
                for k in [k for k in shard_counts if n >= 4 and k <= n // 2]:
                    out.append(EnvPoolAsyncContender(n, env_id, threads=k, batch_size=n // 2))
        except ImportError:
            pass
    if "pufferlib" in which:
        # W workers for each even --shards W dividing N, batches of N/2.
        try:
            for w in [w for w in shard_counts if w >= 2 and w % 2 == 0 and n % w == 0]:
                out.append(PufferLibContender(n, env_id, w, n // 2))
        except ImportError:
            log("bench vector: pufferlib-core is not installed: its contender is left out")


def _measure(contenders: List[Any], rounds: int, steps: int) -> None:
    for c in contenders:  # warm-up, not kept
        c.step_block(max(1, steps // 5))
        c.times.clear()
        getattr(c, "waits", []).clear()
        c.block_means.clear()
    for r in range(rounds):
        # Rotate the order, so that no contender always runs right after the same other.
        for i in range(len(contenders)):
            contenders[(r + i) % len(contenders)].step_block(steps)


def _rows(contenders: List[Any]) -> List[Dict[str, Any]]:
    stats = {c.label: Stats.of(c.times) for c in contenders}
    blocks = {c.label: c.block_means for c in contenders}
    rows = []
    for c in contenders:
        s = stats[c.label]
        # The learner's idle time: its wait for the envs, the whole step where every env
        # steps at once, recv() where batches of part of them are handed out.
        idle = Stats.of(getattr(c, "waits", c.times))
        row = dict(label=c.label, num_envs=c.num_envs, processes=c.processes, **s.to_dict(),
                   env_steps_per_s=c.num_envs * s.steps_per_s,
                   idle_median_ns=idle.median_ns, idle_p99_ns=idle.p99_ns,
                   idle_per_env_step_median_ns=idle.median_ns / c.num_envs,
                   idle_per_env_step_p99_ns=idle.p99_ns / c.num_envs)
        if not getattr(c, "whole_batch", True):
            rows.append(row)  # a step of part of the envs: only its env-steps/s compare
            continue
        for ref in (ASYNC, SYNC):
            if ref in stats:
                row[f"vs_{ref}"] = stats[ref].mean_ns / s.mean_ns  # > 1: faster than ref
        if SYNC in blocks:
            # Round by round: ours over Sync's (below 1: faster), then their median.
            per_round = [b / r for b, r in zip(c.block_means, blocks[SYNC])]
            row["round_ratios_to_sync"] = per_round
            row["round_ratio_to_sync_median"] = float(np.median(per_round))
        rows.append(row)
    return rows


def _table(rows: List[Dict[str, Any]], refs: bool = True) -> str:
    header = ["contender", "median µs/step", "p99 µs/step", "mean µs/step", "env-steps/s",
              "idle µs/step median (p99)", "idle µs/env-step median (p99)"]
    if refs:
        header += [f"× {ASYNC}", f"× {SYNC}", f"÷ {SYNC} per round"]
    body = []
    for r in rows:
        line = [r["label"], fmt_us(r["median_ns"]), fmt_us(r["p99_ns"]), fmt_us(r["mean_ns"]),
                fmt_rate(r["env_steps_per_s"]),
                f"{fmt_us(r['idle_median_ns'])} ({fmt_us(r['idle_p99_ns'])})",
                f"{fmt_us(r['idle_per_env_step_median_ns'])} ({fmt_us(r['idle_per_env_step_p99_ns'])})"]
        if refs:
            line += [fmt_ratio(r[f"vs_{ref}"]) if f"vs_{ref}" in r else "" for ref in (ASYNC, SYNC)]
            rr = r.get("round_ratios_to_sync")
            line.append(f"{np.median(rr):.2f} ({min(rr):.2f}..{max(rr):.2f})" if rr else "")
        body.append(line)
    return markdown_table(header, body, "lrrrrrrrrr" if refs else "lrrrrrr")


def _targets(results: Dict[str, List[Dict[str, Any]]]) -> List[str]:
    """The issue's targets against SyncVectorEnv, met or not, from the means (and the
    per-round ratios beside them)."""
    lines = []
    for key, rows in results.items():
        if key.startswith("null"):
            continue
        by = {r["label"]: r for r in rows}
        sync = by.get(SYNC)
        if sync is None:
            continue
        env_id, n = key.rsplit(" N=", 1)
        n = int(n)
        one, two = by.get("shmbridge K=1"), by.get("shmbridge K=2")
        if one is not None:
            ratio = one["mean_ns"] / sync["mean_ns"]
            lines.append(f"- {key}: one shard {ratio:.2f}× SyncVectorEnv's mean step time (per round "
                         f"{one['round_ratio_to_sync_median']:.2f}×; target ≤ 1.10×): "
                         f"{'met' if ratio <= 1.10 else 'NOT met'}")
        wants_two = (env_id == "CartPole-v1" and n >= 64) or (env_id == "HalfCheetah-v5" and n >= 16)
        if two is not None and wants_two:
            ratio = two["mean_ns"] / sync["mean_ns"]
            lines.append(f"- {key}: two shards {ratio:.2f}× SyncVectorEnv's mean step time (per round "
                         f"{two['round_ratio_to_sync_median']:.2f}×; target < 1: faster): "
                         f"{'met' if ratio < 1 else 'NOT met'}")
    return lines


def _plot(results: Dict[str, List[Dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.2), dpi=100, squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = results[key]
        labels = [r["label"].replace("shmbridge ", "") for r in rows]
        values = [r["env_steps_per_s"] for r in rows]
        colors = ["tab:blue" if r["label"].startswith(("shmbridge", "one engine")) or "shards" in r["label"]
                  else "tab:gray" for r in rows]
        ax.bar(range(len(rows)), values, color=colors)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(key, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("env-steps/s (log)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args: Any) -> int:
    quick = args.quick
    envs_list = [int(x) for x in (args.envs or ("4" if quick else "1,8,16,64")).split(",")]
    shard_counts = [int(x) for x in (args.shards or ("1,2" if quick else "1,2,4")).split(",")]
    workloads = [w for w in (args.workloads or "CartPole-v1,HalfCheetah-v5").split(",") if w]
    rounds = args.rounds or (2 if quick else 5)
    which = [c for c in (args.contenders or ",".join(CONTENDERS)).split(",") if c]
    unknown = sorted(set(which) - set(CONTENDERS))
    if unknown:
        log(f"bench vector: unknown contenders {unknown}; pick from {', '.join(CONTENDERS)}")
        return 2
    machine = machine_description()
    results: Dict[str, List[Dict[str, Any]]] = {}
    for env_id in workloads:
        for n in envs_list:
            steps = args.steps or (20 if quick else (200 if env_id == "CartPole-v1" else 60))
            print(f"vector: {env_id} x{n}: starting contenders", flush=True)
            contenders = _gym_contenders(env_id, n, shard_counts, which)
            try:
                _measure(contenders, rounds, steps)
            finally:
                for c in contenders:
                    c.close()
            results[f"{env_id} N={n}"] = _rows(contenders)
            print(_table(results[f"{env_id} N={n}"]), flush=True)
    transport_envs = 4 if quick else 64
    null = [NullContender(transport_envs, k) for k in [1, *[k for k in shard_counts if k > 1]]]
    try:
        _measure(null, rounds, args.steps or (200 if quick else 5000))
    finally:
        for c in null:
            c.close()
    transport = _rows(null)
    results[f"null transport N={transport_envs}"] = transport
    print(_table(transport, refs=False), flush=True)

    load_end = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = ["# shmbridge vector benchmark", "", f"Command: `{args.command_line}`", ""]
    lines += machine_header(machine, [f"- Load average at the end: {load_end}"])
    lines += ["", f"{rounds} interleaved rounds per workload; times are one vector step "
                  "(`envs.step(actions)`, copies returned; the asynchronous rows' step is one `recv()` "
                  "and one `send()` of B envs). Idle: the learner's wait for the envs, the "
                  "whole step, or `recv()` for the asynchronous rows, per step and per env "
                  "step (over the envs a step returns). `× X`: mean step time of X / ours "
                  f"(above 1: faster than X). `÷ {SYNC} per round`: ours over SyncVectorEnv's "
                  "block mean, round by round: median (min..max) (below 1: faster).", ""]
    targets = _targets(results)
    if targets:
        lines += ["Targets (reported, not asserted):", "", *targets, ""]
    for key, rows in results.items():
        lines += [f"## {key}", "", _table(rows, refs=not key.startswith("null")), ""]
    one = {r["label"]: r for r in transport}
    lines += ["Transport: `client.step()` on the `null` engine (16 f32 per env), one engine "
              "vs shards; median ratio K/1: " + ", ".join(
                  f"{r['label']} {r['median_ns'] / one['one engine']['median_ns']:.2f}×"
                  for r in transport if r["label"] != "one engine"), ""]
    # The tables went to stdout as each was measured: the file gets the whole report.
    publish("vector", "\n".join(lines) + "\n", args.out,
            dict(machine=machine, load_average_end=os.getloadavg(), rounds=rounds, results=results),
            plot=lambda path: _plot(results, path), echo=False)
    return 0
