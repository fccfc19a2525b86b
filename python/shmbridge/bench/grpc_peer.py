"""gRPC (`grpcio`), Python client and server on loopback, as the founding gRPC API is used.

`bench_step.proto` (next to this file) keeps the founding API's message shape: `Step` carries
the actions as `repeated float` and answers with an `AgentFrame` whose observations are a
`repeated float` (camera frames, for the images workload, are `CameraFrame` messages with
a `bytes` payload, one per env), plus reward signals and terminated/truncated flags.
`StepBytes` is the same exchange with every tensor as one `bytes` field, the cheapest
encoding protobuf offers. Stubs are generated with `grpc_tools.protoc` as the founding API's
page and gRPC's Python quick start say, here at run time into a temporary directory so
that they always match the installed protobuf runtime.

Server: `grpc.server(ThreadPoolExecutor(max_workers=1))`, an insecure port on
127.0.0.1, message size limits lifted (the frames exceed gRPC's 4 MiB default only for
larger workloads, but both sides set them as one must for tensors). Each `Step` writes
the first and last element of the server's observation array, then builds the whole
response message: serialising every element is what protobuf requires. Client: one
`insecure_channel`, a stub, one unary call per step with a deadline."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import sys
import tempfile
import time
from concurrent import futures
from typing import Any, List, Tuple

import numpy as np

from .common import STEP_TIMEOUT_S, Peer, PeerError, ServerProcess, Workload, action_value

PROTO = "bench_step.proto"
OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
_modules: Any = None


def protos() -> Tuple[Any, Any]:
    """(bench_step_pb2, bench_step_pb2_grpc), generated once per process."""
    global _modules
    if _modules is None:
        from grpc_tools import protoc

        try:
            from importlib.resources import files

            src = str(files(__package__).joinpath(PROTO))
        except (ImportError, TypeError):
            src = os.path.join(os.path.dirname(__file__), PROTO)
        out = tempfile.mkdtemp(prefix="shmbridge-bench-grpc-")
        atexit.register(shutil.rmtree, out, True)
        shutil.copy(src, os.path.join(out, PROTO))
        include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        rc = protoc.main(["grpc_tools.protoc", f"-I{out}", f"-I{include}", f"--python_out={out}",
                          f"--grpc_python_out={out}", os.path.join(out, PROTO)])
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {src} (exit status {rc})")
        sys.path.insert(0, out)
        try:
            _modules = (importlib.import_module("bench_step_pb2"), importlib.import_module("bench_step_pb2_grpc"))
        finally:
            sys.path.remove(out)
    return _modules


def serve(ctl: Any, wl_dict: dict) -> None:
    import grpc

    wl = Workload.from_dict(wl_dict)
    pb, pb_grpc = protos()
    obs = np.zeros(wl.obs_size, wl.obs_dtype)
    last = wl.obs_size - 1
    n = wl.num_envs
    rewards = np.zeros(n, np.float32)
    terminated = np.zeros(n, bool)
    truncated = np.zeros(n, bool)
    a_last = (n - 1) * wl.act_dim
    frames = obs.reshape(n, -1)
    if wl.image:
        h, w, c = wl.obs_shape

    def write(seq: int, a0: float, a_end: float) -> None:
        obs[0] = wl.obs_value(seq, 0)
        obs[last] = wl.obs_value(seq, last)
        rewards[0] = a0
        rewards[-1] = a_end

    class AgentService(pb_grpc.AgentServiceServicer):
        def Step(self, request: Any, context: Any) -> Any:
            acts = request.actions
            seq = int(acts[0])
            write(seq, acts[0], acts[a_last])
            resp = pb.StepResponse()
            frame = resp.observation
            frame.frame_number = seq
            if wl.image:
                add = resp.camera_frames.add
                for i in range(n):
                    add(name=f"env{i}", width=w, height=h, channels=c, data=frames[i].tobytes())
            else:
                frame.observations.extend(memoryview(obs))
            resp.reward_signals.extend(memoryview(rewards))
            resp.terminated.extend(terminated.tolist())
            resp.truncated.extend(truncated.tolist())
            return resp

        def StepBytes(self, request: Any, context: Any) -> Any:
            acts = np.frombuffer(request.actions, np.float32)
            write(int(acts[0]), acts[0], acts[a_last])
            return pb.StepBytesResponse(
                observations=obs.tobytes(), rewards=rewards.tobytes(),
                terminated=terminated.tobytes(), truncated=truncated.tobytes(),
                frame_number=request.seq)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=OPTIONS)
    pb_grpc.add_AgentServiceServicer_to_server(AgentService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ctl.send(("ready", port))
    try:
        while ctl.recv() != "stop":
            pass
    finally:
        server.stop(None)


class _GrpcPeer(Peer):
    needs = ("grpc", "grpc_tools")

    def launch(self) -> None:
        self.server = ServerProcess(serve, self.wl.to_dict(), name=f"{self.key}-{self.wl.key}")

    def start(self) -> None:
        import grpc

        port = self.server.wait_ready()
        self.pb, pb_grpc = protos()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=STEP_TIMEOUT_S)
        self.stub = pb_grpc.AgentServiceStub(self.channel)
        self.actions = np.zeros(self.wl.act_size, np.float32)
        self.act = memoryview(self.actions)
        self.last_reward = None

    def check(self) -> None:
        if self.last_reward != action_value(self.k):
            raise PeerError(f"{self.label}: rewards[0]={self.last_reward} after action {action_value(self.k)}")

    def close(self) -> None:
        ch = getattr(self, "channel", None)
        if ch is not None:
            ch.close()
            self.channel = None
        super().close()


class GrpcSeeds(_GrpcPeer):
    key = "grpc-floats"
    label = "gRPC, founding proto"

    def run(self, n: int, out: List[int]) -> None:
        StepRequest = self.pb.StepRequest
        call = self.stub.Step
        a, act = self.act, self.actions
        image = self.wl.image
        pc = time.perf_counter_ns
        app = out.append
        k = self.k
        resp = None
        for _ in range(n):
            k += 1
            x = action_value(k)
            t0 = pc()
            a[0] = x
            req = StepRequest()
            req.actions.extend(memoryview(act))
            resp = call(req, timeout=STEP_TIMEOUT_S)
            if image:
                cf = resp.camera_frames
                cf[0].data[0]; cf[-1].data[-1]  # noqa: E702,B018
            else:
                o = resp.observation.observations
                o[0]; o[-1]  # noqa: E702,B018
            r, te, tr = resp.reward_signals, resp.terminated, resp.truncated
            r[0]; r[-1]; te[0]; te[-1]; tr[0]; tr[-1]  # noqa: E702,B018
            app(pc() - t0)
        self.k = k
        if resp is not None:
            self.last_reward = resp.reward_signals[0]


class GrpcBytes(_GrpcPeer):
    key = "grpc-bytes"
    label = "gRPC, bytes fields"

    def run(self, n: int, out: List[int]) -> None:
        StepBytesRequest = self.pb.StepBytesRequest
        call = self.stub.StepBytes
        a, act = self.act, self.actions
        obs_dtype = np.dtype(self.wl.obs_dtype)
        f32, b = np.float32, np.bool_
        frombuffer = np.frombuffer
        pc = time.perf_counter_ns
        app = out.append
        k = self.k
        r = None
        for _ in range(n):
            k += 1
            x = action_value(k)
            t0 = pc()
            a[0] = x
            resp = call(StepBytesRequest(actions=act.tobytes(), seq=k), timeout=STEP_TIMEOUT_S)
            o = frombuffer(resp.observations, obs_dtype)
            r = frombuffer(resp.rewards, f32)
            te = frombuffer(resp.terminated, b)
            tr = frombuffer(resp.truncated, b)
            o[0]; o[-1]; r[0]; r[-1]; te[0]; te[-1]; tr[0]; tr[-1]  # noqa: E702,B018
            app(pc() - t0)
        self.k = k
        if r is not None:
            self.last_reward = float(r[0])
