"""The viewer's server: one observer thread (``Watcher``) that samples the region, and an
aiohttp app on 127.0.0.1 that hands its samples to each browser over a WebSocket.

The watcher reads frames only while a browser is connected, at most ``--fps`` a second,
tiles the first envs, encodes one JPEG (Pillow) and keeps the newest; each connection
sends the newest it has not sent, so a slow browser skips frames instead of queueing
them (aiohttp's ``send_bytes`` waits for the socket to drain). Plot points (episode
returns, steps per second, observation values) are small and all delivered, from a
bounded history that a late or lagging page gets whole. Every message is strict JSON:
a NaN or infinite value goes out as ``null``.

The watcher never dies quietly: what it cannot watch (a file of another user under the
name, no descriptors left, a tensor it cannot show) is the page's ``error`` state with
the reason, and it tries again; were the thread itself to end, the page says that
too, never "live". Other local users (who have no token) can neither crash a route
nor starve the page of connections: at most ``MAX_CONNECTIONS`` (fewer where the
descriptor limit is low) are kept, the oldest idle ones closed to make room, and a
connection that sends no request is closed after ``IDLE_TIMEOUT`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.resources
import io
import json
import math
import os
import resource
import secrets
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web
from PIL import Image

from .. import errors
from ..observe import Observer, image_shape_problem, observe, tile_images, to_rgb
from .streams import StreamFlows

# What ends an observation: the engine closed, died or was truncated, or the name now
# holds something that is not a region we can watch.
_ENDED = (errors.PeerClosedError, errors.PeerDiedError, errors.InvalidRegionError)
# How often the stats area (and observation values) are sampled, and how many messages
# the history keeps (ten minutes of points at 5 a second and streams at 1 a second).
STATS_EVERY = 0.2
HISTORY = 3600
# How often a name with no live engine is looked at again.
RETRY_EVERY = 0.5
# How often the streams of the namespace are read (their rates span one interval).
STREAMS_EVERY = 1.0
# Connections the server keeps at most (the oldest idle ones are closed to make room),
# and how long one may stay idle (no request, or none since its last answer).
MAX_CONNECTIONS = 256
IDLE_TIMEOUT = 15.0
BACKLOG = 16


def _finite(x: Any) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None


def _json(message: Dict[str, Any]) -> str:
    """``message`` as strict JSON (what ``JSON.parse`` reads): no NaN or Infinity, ever
    (``allow_nan=False`` raises rather than send one; the values that may be non-finite
    are mapped to null before)."""
    return json.dumps(message, allow_nan=False)


class Watcher:
    """Samples one region by name, across engines that come and go under it."""

    def __init__(self, args: argparse.Namespace, loop: asyncio.AbstractEventLoop):
        self.args = args
        self.loop = loop
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.clients = 0
        # The newest frame: (version, frame number, JPEG bytes).
        self.image: Tuple[int, int, Optional[bytes]] = (0, -1, None)
        # Messages in order: (number, session, type, JSON); the status also kept apart.
        self.messages: Deque[Tuple[int, int, str, str]] = collections.deque(maxlen=HISTORY)
        self.next_message = 0
        self.status: Dict[str, Any] = {"type": "status", "state": "waiting", "name": args.name, "session": 0,
                                       "reason": "looking for the engine"}
        self.session_start = time.monotonic()
        self.event = asyncio.Event()
        # The streams of the namespace: the newest reading, also handed to a new page.
        self.flows = StreamFlows()
        self.streams: Optional[Dict[str, Any]] = None
        self.next_streams = 0.0

    # --- Handing samples to the event loop ---

    def _wake(self) -> None:
        event, self.event = self.event, asyncio.Event()
        event.set()

    def _notify(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake)

    def _say(self, message: Dict[str, Any]) -> None:
        text = _json(message)
        with self.lock:
            self.messages.append((self.next_message, message["session"], message["type"], text))
            self.next_message += 1
            if message["type"] == "status":
                self.status = message
            elif message["type"] == "streams":
                self.streams = message
        self._notify()

    def since(self, seen: int) -> Tuple[Optional[List[str]], int]:
        """Messages numbered ``seen`` and later, and the next number; ``None`` when some
        are gone from the history (the page then starts over from the history)."""
        with self.lock:
            first = self.messages[0][0] if self.messages else self.next_message
            if seen < first:
                return None, self.next_message
            return [m[3] for m in self.messages if m[0] >= seen], self.next_message

    def history(self) -> Tuple[List[str], int]:
        """The status, the newest reading of the streams, then every point of the current
        session: what a new page gets."""
        with self.lock:
            session = self.status["session"]
            points = [m[3] for m in self.messages if m[1] == session and m[2] == "point"]
            streams = [] if self.streams is None else [_json(self.streams)]
            return [_json(self.status), *streams, *points], self.next_message

    # --- The observer thread ---

    def run(self) -> None:
        try:
            self._watch()
        except BaseException as e:
            # The page must not say "live" over a watcher that is gone.
            self._error(f"the viewer stopped watching ({type(e).__name__}: {e}); restart shmbridge view")
            raise

    def _watch(self) -> None:
        observer: Optional[Observer] = None
        session = 0
        while not self.stop.is_set():
            self._streams_if_due()
            try:
                if observer is None:
                    observer = self._attach()
                    if observer is None:
                        self.stop.wait(RETRY_EVERY)
                        continue
                    session += 1
                    self._start(observer, session)
                self._sample(observer, session)
            except _ENDED as e:
                assert observer is not None
                self._end(observer, session, e)
                observer.close()
                observer = None
            except Exception as e:
                # Not the engine's end: something this viewer cannot read or show (a file
                # of another user under the name, no descriptors left, ...). Said on the
                # page and on stderr; tried again, as for a new engine.
                if observer is not None:
                    observer.close()
                    observer = None
                self._error(f"cannot watch {self.args.name}: {type(e).__name__}: {e}")
                self.stop.wait(RETRY_EVERY)
        if observer is not None:
            observer.close()

    def _streams_if_due(self) -> None:
        """Reads every stream of the namespace once ``STREAMS_EVERY`` has passed (as an
        observer: ``StreamFlows``) and hands the page a ``streams`` message. A stream that
        is gone is left out, one that cannot be read is shown with its error; what keeps
        the listing itself from being read is said in the message, never raised (the
        region's watch goes on)."""
        now = time.monotonic()
        if now < self.next_streams:
            return
        self.next_streams = now + STREAMS_EVERY
        try:
            streams, error = self.flows.sample(), None
        except Exception as e:
            streams, error = [], f"cannot list the streams: {type(e).__name__}: {e}"
        for s in streams:
            s["records_per_s"] = None if s.get("records_per_s") is None else _finite(s["records_per_s"])
            for lane in s.get("lanes", []):
                rate = lane["records_per_s"]
                lane["records_per_s"] = None if rate is None else _finite(rate)
        with self.lock:
            session = self.status["session"]
        self._say({"type": "streams", "session": session, "streams": streams, "error": error})

    def _error(self, reason: str) -> None:
        """The page's error state (said once while it lasts), with ``reason``."""
        with self.lock:
            same = self.status["state"] == "error" and self.status["reason"] == reason
            session = self.status["session"]
        if same:
            return
        print(f"shmbridge view: {reason}", file=sys.stderr, flush=True)
        self._say({"type": "status", "state": "error", "session": session, "name": self.args.name,
                   "image": None, "labels": [], "note": None, "reason": reason})

    def _attach(self) -> Optional[Observer]:
        try:
            observer = observe(self.args.name, timeout=RETRY_EVERY)
        except (errors.NotFoundError, errors.TimeoutError, *_ENDED):
            return None
        try:
            observer.check()
        except _ENDED:
            # What a dead or closed engine left under the name: not a new engine.
            observer.close()
            return None
        return observer

    def _start(self, o: Observer, session: int) -> None:
        a = self.args
        image = a.tensor or o.image
        note = None
        if image is not None and image not in o.tensors:
            note = f"the engine serves no tensor '{image}' (it has {', '.join(o.tensors)})"
            image = None
        elif image is not None and image not in o.observable:
            t = o.tensors[image]
            if t["direction"] != "engine->client":
                note = f"'{image}' is written by the learner, not an image the engine shows"
            else:
                note = (f"the frames ('{image}') live in {t['location']} memory, which observers cannot read: "
                        f"serve them on the host (shmbridge engine --image-device host) to see them here")
            image = None
        elif image is not None:
            problem = image_shape_problem(o.tensors[image]["shape"])  # type: ignore[arg-type]
            if problem is None and o.tensors[image]["dtype"] not in ("uint8", "float16", "bfloat16", "float32",
                                                                     "float64"):
                problem = f"dtype {o.tensors[image]['dtype']} (images are uint8, or floats in [0, 1])"
            if problem is not None:
                note = f"'{image}' cannot be shown as images: {problem}"
                image = None
        self.image_name = image
        self.values: Optional[Tuple[str, int, List[int]]] = None
        labels: List[str] = []
        if image is None and a.obs in o.observable:
            shape = o.tensors[a.obs]["shape"]
            width = int(np.prod(shape[1:])) if len(shape) > 1 else 1  # type: ignore[arg-type]
            picked = [c for c in (a.components or range(min(4, width))) if c < width]
            env = min(max(a.env, 0), o.num_envs - 1)
            if picked:
                self.values = (a.obs, env, picked)
                labels = [f"{a.obs}[{env}, {c}]" for c in picked]
        self.session_start = time.monotonic()
        self.next_frame = 0.0
        # The first call starts the rate's interval; the first point comes one later.
        o.stats()
        self.next_stats = time.monotonic() + STATS_EVERY
        self._say({"type": "status", "state": "live", "session": session, "name": o.name,
                   "engine_kind": o.engine_kind, "num_envs": o.num_envs, "image": image,
                   "grid": min(a.grid, o.num_envs), "labels": labels, "note": note, "reason": None})

    def _end(self, o: Observer, session: int, e: BaseException) -> None:
        if isinstance(e, errors.PeerClosedError):
            what = "closed"
        elif isinstance(e, errors.PeerDiedError):
            what = "died"
        else:
            what = "is gone"
        self._say({"type": "status", "state": "ended", "session": session, "name": o.name,
                   "engine_kind": o.engine_kind, "num_envs": o.num_envs, "image": None, "labels": [],
                   "reason": f"the engine {what}: {e}"})

    def _sample(self, o: Observer, session: int) -> None:
        now = time.monotonic()
        if now >= self.next_stats:
            self.next_stats = now + STATS_EVERY
            self._point(o, session)
        if self.image_name is not None and self.clients > 0 and now >= self.next_frame:
            self.next_frame = now + 1.0 / self.args.fps
            self._frame(o)
        wait = min(self.next_stats, self.next_streams,
                   self.next_frame if self.clients > 0 and self.image_name else self.next_stats)
        self.stop.wait(max(0.0, wait - time.monotonic()))

    def _point(self, o: Observer, session: int) -> None:
        try:
            s = o.stats(timeout=STATS_EVERY)
        except errors.TimeoutError:
            o.check()
            return
        values = None
        if self.values is not None:
            name, env, picked = self.values
            try:
                row = o.latest([name], (env, env + 1), timeout=STATS_EVERY)[name].reshape(-1)
                values = [_finite(row[c]) for c in picked]
            except errors.TimeoutError:
                pass
        self._say({"type": "point", "session": session, "t": round(s.time - self.session_start, 3),
                   "frame": s.frame, "episodes": s.episodes, "sps": _finite(s.steps_per_second),
                   "mean_return": _finite(s.mean_return), "mean_length": _finite(s.mean_length),
                   "returns": [_finite(e.episode_return) for e in s.new_episodes], "values": values})

    def _frame(self, o: Observer) -> None:
        name = self.image_name
        assert name is not None
        try:
            frame = o.latest([name], min(self.args.grid, o.num_envs), timeout=1.0 / self.args.fps)
        except errors.TimeoutError:
            return
        if frame.number == self.image[1]:
            return
        grid = tile_images(to_rgb(frame[name]))
        buf = io.BytesIO()
        Image.fromarray(grid).save(buf, format="JPEG", quality=self.args.quality)
        with self.lock:
            self.image = (self.image[0] + 1, frame.number, buf.getvalue())
        self._notify()


def _page() -> str:
    return importlib.resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


def make_app(watcher: Watcher, token: str) -> web.Application:
    page = _page()

    expected = token.encode()

    def allowed(request: web.Request) -> bool:
        # Bytes: compare_digest refuses str with non-ASCII characters (a TypeError, then
        # HTTP 500, for ?token=%C3%A9).
        return secrets.compare_digest(request.query.get("token", "").encode("utf-8", "surrogateescape"), expected)

    async def index(request: web.Request) -> web.StreamResponse:
        if not allowed(request):
            raise web.HTTPForbidden(text="a token is needed: open the URL shmbridge view printed\n")
        return web.Response(text=page, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def frame(request: web.Request) -> web.StreamResponse:
        if not allowed(request):
            raise web.HTTPForbidden()
        _, number, jpeg = watcher.image
        if jpeg is None:
            raise web.HTTPNotFound(text="no frame yet\n")
        return web.Response(body=jpeg, content_type="image/jpeg", headers={"X-Frame": str(number)})

    async def socket(request: web.Request) -> web.StreamResponse:
        if not allowed(request):
            raise web.HTTPForbidden()
        ws = web.WebSocketResponse(heartbeat=20.0)
        await ws.prepare(request)
        watcher.clients += 1
        sockets.add(ws)

        async def drain() -> None:
            # Reading is what notices the page's close.
            async for msg in ws:
                if msg.type == WSMsgType.ERROR:
                    break

        reader = asyncio.ensure_future(drain())
        try:
            texts, seen = watcher.history()
            for text in texts:
                await ws.send_str(text)
            sent_image = 0
            while not ws.closed and not reader.done():
                event = watcher.event
                texts_or_none, next_seen = watcher.since(seen)
                if texts_or_none is None:
                    texts_or_none, next_seen = watcher.history()
                    await ws.send_str(_json({"type": "reset"}))
                seen = next_seen
                for text in texts_or_none:
                    await ws.send_str(text)
                version, number, jpeg = watcher.image
                if version != sent_image and jpeg is not None:
                    sent_image = version
                    await ws.send_str(_json({"type": "image", "frame": number}))
                    await ws.send_bytes(jpeg)
                    continue  # newer ones may have come while this one went out
                try:
                    await asyncio.wait_for(event.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
        except (ConnectionResetError, RuntimeError):
            pass
        finally:
            watcher.clients -= 1
            sockets.discard(ws)
            reader.cancel()
        return ws

    async def close_sockets(app: web.Application) -> None:
        # On the way out: an open page would otherwise hold the shutdown for its timeout.
        for ws in list(sockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"the viewer stops")

    sockets: "set[web.WebSocketResponse]" = set()
    app = web.Application()
    app.on_shutdown.append(close_sockets)
    app.add_routes([web.get("/", index), web.get("/frame.jpg", frame), web.get("/ws", socket)])
    return app


def _connection_limit() -> int:
    """The connections to keep at most: ``MAX_CONNECTIONS``, or fewer where the
    descriptor limit would not hold them (the soft limit raised to the hard one first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    # Half of what is left after the descriptors the process holds besides (Python, the
    # observer, the event loop): the rest stays free for them.
    return max(8, min(MAX_CONNECTIONS, (int(soft) - 64 - BACKLOG) // 2))


class _Bounded:
    """A protocol factory around aiohttp's server that keeps at most ``limit``
    connections: each new one past it first closes the oldest connections that are idle
    (no request in hand: one that never sent one, or is between requests), so idle
    connections of another local user cannot use up the descriptors and keep the page
    from loading. WebSockets and requests in hand are never closed. (The server is
    made with a small ``BACKLOG``, which asyncio also takes as the most connections it
    accepts at once, before any of them is counted here.)"""

    def __init__(self, server: web.Server, limit: int):
        self.server = server
        self.limit = limit

    def __call__(self):  # type: ignore[no-untyped-def]
        open_ = [h for h in self.server.connections if not getattr(h, "_force_close", False)]
        excess = len(open_) + 1 - self.limit
        for h in open_:  # oldest first
            if excess <= 0:
                break
            if getattr(h, "_current_request", None) is None and not getattr(h, "_messages", None):
                h.force_close()
                excess -= 1
        return self.server()


def _open_in_browser(url: str) -> Tuple[threading.Thread, str]:
    """Opens ``url`` in the default browser without its token on any command line (which
    every local user can read in ``ps``): the browser is given a file, readable by this
    user only in a folder of its own, that sends it on to ``url``. ``webbrowser.open``
    runs in a thread of its own (a console browser, or ``$BROWSER``, may not return until
    it ends). Returns the thread and the folder (removed when the viewer stops)."""
    import webbrowser
    from html import escape

    folder = tempfile.mkdtemp(prefix="shmbridge-view-")  # mode 0700
    path = os.path.join(folder, "open.html")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        target = escape(url, quote=True)
        f.write(f'<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="0; url={target}">'
                f'<title>shmbridge view</title><a href="{target}">shmbridge view</a>\n')
    thread = threading.Thread(target=webbrowser.open, args=("file://" + path,), name="shmbridge-view-browser",
                              daemon=True)
    thread.start()
    return thread, folder


async def _serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    token = secrets.token_urlsafe(24)
    watcher = Watcher(args, loop)
    runner = web.AppRunner(make_app(watcher, token), handle_signals=False, access_log=None,
                           keepalive_timeout=IDLE_TIMEOUT)
    await runner.setup()
    assert runner.server is not None
    try:
        server = await loop.create_server(_Bounded(runner.server, _connection_limit()), "127.0.0.1", args.port,
                                          backlog=BACKLOG)
    except OSError as e:
        await runner.cleanup()
        print(f"shmbridge view: cannot listen on 127.0.0.1:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/?token={token}"
    thread = threading.Thread(target=watcher.run, name="shmbridge-view-watcher", daemon=True)
    thread.start()
    print(url, flush=True)
    print(f"shmbridge view: watching {args.name} at {url} (Ctrl-C stops)", file=sys.stderr, flush=True)
    opened = _open_in_browser(url) if args.open else None
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        watcher.stop.set()
        server.close()
        await runner.cleanup()
        await loop.run_in_executor(None, thread.join, 5.0)
        if opened is not None:
            import shutil

            shutil.rmtree(opened[1], ignore_errors=True)
    return 0


def serve(args: argparse.Namespace) -> int:
    """Serves until SIGINT or SIGTERM; returns the exit status."""
    return asyncio.run(_serve(args))
