"""iceoryx2 0.10 (PyPI `iceoryx2`): request/response, and a publish/subscribe ping-pong.

Set up as the iceoryx2 Python examples do (`examples/python/request_response`,
`publish_subscribe`): one `Node` per process (`ServiceType.Ipc`), services opened with
`open_or_create()`, fixed-size `ctypes.Structure` payloads (types with a `type_name()` so
both processes agree), samples loaned (`loan_uninit()`), written in place and sent, and
received payloads read in place through `payload()` (a `ctypes` pointer into the shared
segment: zero copy). As in iceoryx2's own latency benchmarks (`benchmarks/request-response`,
`benchmarks/publish-subscribe`), both sides busy-poll `receive()`; iceoryx2 has no
blocking receive on these ports (waking a sleeper takes a separate `event` service and a
`WaitSet`).

Request/response: the client loans a request (seq + actions), sends it and polls its
`PendingResponse`; the server polls `receive()`, loans a response from the
`ActiveRequest`, writes it and sends it. Pub/sub: two services, `actions` (client
publishes, server subscribes) and `frames` (the other way). The server writes the
first and last element of each tensor of the frame, as the `null` engine does."""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import time
from typing import Any, List, Tuple

from .common import (
    POLL_CHECK_EVERY,
    SERVER_CHECK_EVERY,
    PeerError,
    PollingPeer,
    ServerProcess,
    Workload,
    action_value,
    busy_server_loop,
)


def payload_types(wl: Workload) -> Tuple[type, type]:
    """(request, frame) payload types. Same definitions in both processes."""
    obs_t = ctypes.c_uint8 if wl.image else ctypes.c_float
    n, tag = wl.num_envs, wl.key

    class BenchActions(ctypes.Structure):
        _fields_ = [("seq", ctypes.c_uint64), ("actions", ctypes.c_float * wl.act_size)]

        @staticmethod
        def type_name() -> str:
            return f"ShmbridgeBenchActions_{tag}"

    class BenchFrame(ctypes.Structure):
        _fields_ = [
            ("seq", ctypes.c_uint64),
            ("obs", obs_t * wl.obs_size),
            ("rewards", ctypes.c_float * n),
            ("terminated", ctypes.c_bool * n),
            ("truncated", ctypes.c_bool * n),
        ]

        @staticmethod
        def type_name() -> str:
            return f"ShmbridgeBenchFrame_{tag}"

    return BenchActions, BenchFrame


def _node(prefix: str, root: str):
    """A node of the default config (what the examples use) but for its file-name
    `prefix` in /dev/shm and its `root` folder: iceoryx2 keeps a global management
    segment there after its last node is gone, which the bench removes at the end."""
    import iceoryx2 as iox2

    # Its "no config file" notice is noise.
    iox2.set_log_level(iox2.LogLevel.Error)
    config = iox2.config.default()
    config.global_cfg.prefix = iox2.FileName.new(prefix)
    config.global_cfg.root_path = iox2.Path.new(root)
    return iox2, iox2.NodeBuilder.new().config(config).create(iox2.ServiceType.Ipc)


def _remove_iceoryx2_files(prefix: str, root: str) -> None:
    """What iceoryx2 leaves once every node of `prefix` is gone: its files in /dev/shm
    and its root folder. The prefix is this peer's own: nothing else uses it."""
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass
    shutil.rmtree(root, ignore_errors=True)


def _fill(wl: Workload, f: Any, req: Any) -> None:
    """The server's work: the frame answering `req`."""
    seq = req.seq
    last = wl.obs_size - 1
    f.seq = seq
    obs = f.obs
    obs[0] = wl.obs_value(seq, 0)
    obs[last] = wl.obs_value(seq, last)
    acts = req.actions
    rewards = f.rewards
    rewards[0] = acts[0]
    rewards[wl.num_envs - 1] = acts[(wl.num_envs - 1) * wl.act_dim]
    te, tr = f.terminated, f.truncated
    te[0] = te[wl.num_envs - 1] = False
    tr[0] = tr[wl.num_envs - 1] = False


def _serve_polling(ctl: Any, receive: Any, answer: Any) -> None:
    """Busy-polls `receive()` (as iceoryx2's latency benchmarks do) and answers each
    message, checking the control pipe every SERVER_CHECK_EVERY empty polls."""

    def active() -> None:
        poll = ctl.poll
        idle = 0
        while True:
            message = receive()
            if message is None:
                idle += 1
                if idle >= SERVER_CHECK_EVERY:
                    idle = 0
                    if poll():
                        return
                continue
            answer(message)

    busy_server_loop(ctl, active)


def serve_rr(ctl: Any, wl_dict: dict, service: str, prefix: str, root: str) -> None:
    wl = Workload.from_dict(wl_dict)
    iox2, node = _node(prefix, root)
    Req, Frame = payload_types(wl)
    svc = node.service_builder(iox2.ServiceName.new(service)).request_response(Req, Frame).open_or_create()
    server = svc.server_builder().create()
    ctl.send(("ready", None))

    def answer(active_request: Any) -> None:
        response = active_request.loan_uninit()
        _fill(wl, response.payload().contents, active_request.payload().contents)
        response.assume_init().send()
        active_request.delete()

    _serve_polling(ctl, server.receive, answer)
    server.delete()


def serve_ps(ctl: Any, wl_dict: dict, service: str, prefix: str, root: str) -> None:
    wl = Workload.from_dict(wl_dict)
    iox2, node = _node(prefix, root)
    Req, Frame = payload_types(wl)
    actions = node.service_builder(iox2.ServiceName.new(service + "/actions")).publish_subscribe(Req).open_or_create()
    frames = node.service_builder(iox2.ServiceName.new(service + "/frames")).publish_subscribe(Frame).open_or_create()
    subscriber = actions.subscriber_builder().create()
    publisher = frames.publisher_builder().create()
    ctl.send(("ready", None))

    def answer(sample: Any) -> None:
        out = publisher.loan_uninit()
        _fill(wl, out.payload().contents, sample.payload().contents)
        out.assume_init().send()
        sample.delete()

    _serve_polling(ctl, subscriber.receive, answer)
    subscriber.delete()
    publisher.delete()


class _IoxPeer(PollingPeer):
    needs = ("iceoryx2",)
    serve: Any = None  # the server function, serve_rr or serve_ps

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.service = f"shmbridge-bench/{os.getpid()}/{id(self):x}/{wl.key}"
        # This peer's own iceoryx2 instance: removed, files and folder, at close.
        self.prefix = f"shmbridge-bench-{os.getpid()}-{id(self):x}_"
        self.root = tempfile.mkdtemp(prefix="shmbridge-bench-iceoryx2-") + "/"
        self.node = None
        self.last_seq = None
        self.last_reward = None

    def launch(self) -> None:
        self.server = ServerProcess(self.serve, self.wl.to_dict(), self.service, self.prefix,
                                    self.root, name=f"{self.key}-{self.wl.key}")

    def _node(self):
        iox2, self.node = _node(self.prefix, self.root)
        return iox2

    def close_ports(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        super().close()  # the server process and its node first
        self.close_ports()
        self.node = None
        _remove_iceoryx2_files(self.prefix, self.root)

    def check(self) -> None:
        if self.last_seq != self.k or self.last_reward != action_value(self.k):
            raise PeerError(f"{self.label}: frame {self.last_seq} rewards[0]={self.last_reward} "
                            f"after step {self.k}")


class Iceoryx2RequestResponse(_IoxPeer):
    key = "iceoryx2-rr"
    label = "iceoryx2 request/response"
    serve = staticmethod(serve_rr)

    def start(self) -> None:
        self.server.wait_ready()
        iox2 = self._node()
        Req, Frame = payload_types(self.wl)
        svc = self.node.service_builder(iox2.ServiceName.new(self.service)).request_response(Req, Frame).open_or_create()
        self.client = svc.client_builder().create()

    def run(self, n: int, out: List[int]) -> None:
        loan = self.client.loan_uninit
        pc = time.perf_counter_ns
        app = out.append
        k = self.k
        for _ in range(n):
            k += 1
            x = action_value(k)
            t0 = pc()
            request = loan()
            q = request.payload().contents
            q.seq = k
            q.actions[0] = x
            pending = request.assume_init().send()
            i = 0
            while True:
                response = pending.receive()
                if response is not None:
                    break
                i += 1
                if i >= POLL_CHECK_EVERY:
                    i = 0
                    self._stalled(t0)
            f = response.payload().contents
            o, r, te, tr = f.obs, f.rewards, f.terminated, f.truncated
            o[0]; o[-1]; r0 = r[0]; r[-1]; te[0]; te[-1]; tr[0]; tr[-1]  # noqa: E702,B018
            seq = f.seq  # read before the sample is released, for check()
            response.delete()
            pending.delete()
            app(pc() - t0)
        self.k = k
        if n:
            self.last_seq, self.last_reward = seq, r0

    def close_ports(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.delete()
            self.client = None


class Iceoryx2PubSub(_IoxPeer):
    key = "iceoryx2-ps"
    label = "iceoryx2 pub/sub ping-pong"
    serve = staticmethod(serve_ps)

    def start(self) -> None:
        self.server.wait_ready()
        iox2 = self._node()
        Req, Frame = payload_types(self.wl)
        b = self.node.service_builder
        actions = b(iox2.ServiceName.new(self.service + "/actions")).publish_subscribe(Req).open_or_create()
        frames = b(iox2.ServiceName.new(self.service + "/frames")).publish_subscribe(Frame).open_or_create()
        self.publisher = actions.publisher_builder().create()
        self.subscriber = frames.subscriber_builder().create()

    def run(self, n: int, out: List[int]) -> None:
        loan = self.publisher.loan_uninit
        receive = self.subscriber.receive
        pc = time.perf_counter_ns
        app = out.append
        k = self.k
        for _ in range(n):
            k += 1
            x = action_value(k)
            t0 = pc()
            sample = loan()
            q = sample.payload().contents
            q.seq = k
            q.actions[0] = x
            sample.assume_init().send()
            i = 0
            while True:
                frame = receive()
                if frame is not None:
                    break
                i += 1
                if i >= POLL_CHECK_EVERY:
                    i = 0
                    self._stalled(t0)
            f = frame.payload().contents
            o, r, te, tr = f.obs, f.rewards, f.terminated, f.truncated
            o[0]; o[-1]; r0 = r[0]; r[-1]; te[0]; te[-1]; tr[0]; tr[-1]  # noqa: E702,B018
            seq = f.seq  # read before the sample is released, for check()
            frame.delete()
            app(pc() - t0)
        self.k = k
        if n:
            self.last_seq, self.last_reward = seq, r0

    def close_ports(self) -> None:
        for port in ("publisher", "subscriber"):
            p = getattr(self, port, None)
            if p is not None:
                p.delete()
                setattr(self, port, None)
