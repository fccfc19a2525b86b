"""Watch a live region without being its client: ``shmbridge.observe(name)``.

    import shmbridge

    with shmbridge.observe("shmbridge-...") as watcher:     # the name an engine printed
        frame = watcher.latest()                          # a consistent copy, now
        print(frame.number, frame["obs"][0])
        print(watcher.stats())                            # episodes, returns, steps/s
        watcher.record("run.mp4", seconds=10)             # tiled frames of the first envs

An observer opens the region read-only and takes no lock: the engine never waits for it,
the learner never sees it, and it cannot change a byte. It copies the engine->client
tensors between the engine's writes (protocol 1.7: from a frame to the next action, and
outside the commands it answers; a copy that a write overlapped is thrown away and tried
again), so a learner that thinks between steps
leaves it plenty of chances, while one that posts its next action the instant a frame is
out leaves only microseconds (then ``latest()`` may take several tries, or time out).
Episode returns and lengths come from the stats area the engine keeps (a sampling
observer would miss most episode ends); steps per second from the frame counter.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._native import RawObserver

__all__ = ["observe", "Observer", "Frame", "Stats", "Episode", "tile_images", "to_rgb", "image_shape_problem"]


def tile_images(images: np.ndarray) -> np.ndarray:
    """``[N, H, W, C]`` images as one ``[rows*H, cols*W, C]`` image: a near-square grid,
    ``rows = ceil(sqrt(N))``, ``cols = ceil(N / rows)``, filled row by row, the rest
    black (Stable-Baselines3's ``tile_images``)."""
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"expected [N, H, W, C] images, got shape {images.shape}")
    n, h, w, c = images.shape
    rows = int(math.ceil(math.sqrt(n)))
    cols = int(math.ceil(n / rows))
    padded = np.zeros((rows * cols, h, w, c), dtype=images.dtype)
    padded[:n] = images
    return padded.reshape(rows, cols, h, w, c).transpose(0, 2, 1, 3, 4).reshape(rows * h, cols * w, c)


def image_shape_problem(shape: Sequence[int]) -> Optional[str]:
    """Why ``to_rgb`` cannot show images of ``shape``, or None if it can."""
    if len(shape) == 5 and shape[-1] in (1, 3, 4) or len(shape) == 4:
        return None
    return (f"shape {list(shape)} is not [N, H, W, C] (C 1, 3 or 4), [N, K, H, W] (a stack of K grey "
            f"frames) or [N, K, H, W, C]")


def to_rgb(images: np.ndarray) -> np.ndarray:
    """Frames as ``[N, H, W, 3]`` uint8 RGB: ``[N, H, W, C]`` with C 1 (grey), 3 (RGB) or 4
    (RGBA: alpha dropped), or a frame stack, of which the newest (last) frame is shown:
    ``[N, K, H, W, C]``, or ``[N, K, H, W]`` of grey frames (Atari's ``[N, 4, 84, 84]``;
    a 4-dimensional shape whose last axis is not 1, 3 or 4 is read so). Float images in
    [0, 1] are scaled to 0..255."""
    images = np.asarray(images)
    problem = image_shape_problem(images.shape)
    if problem is not None:
        raise ValueError(f"cannot show these images: {problem}")
    if images.ndim == 5:
        images = images[:, -1]
    elif images.shape[-1] not in (1, 3, 4):
        images = images[:, -1, :, :, None]
    if images.dtype != np.uint8:
        images = np.clip(np.asarray(images, dtype=np.float64) * 255.0, 0, 255).astype(np.uint8)
    if images.shape[-1] == 1:
        return np.repeat(images, 3, axis=-1)
    return np.ascontiguousarray(images[..., :3])


def _as_array(buf: bytearray, dtype: str) -> np.ndarray:
    """The bytes of a copy as a flat array of ``dtype`` (the region's name for it).
    NumPy has no bfloat16: those come back as float32, exactly (a bfloat16 is the top
    half of the float32 of the same value)."""
    if dtype == "bfloat16":
        bits = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    return np.frombuffer(buf, dtype=np.bool_ if dtype == "bool" else np.dtype(dtype))


@dataclass(frozen=True)
class Frame:
    """A consistent copy of some engine->client tensors: frame ``number``, taken at
    ``time`` (``time.monotonic()``)."""

    number: int
    tensors: Dict[str, np.ndarray]
    time: float

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name]


@dataclass(frozen=True)
class Episode:
    """One finished episode, as the engine recorded it."""

    env: int
    episode_return: float
    length: int
    shard: int
    number: int


@dataclass(frozen=True)
class Stats:
    """What the stats area says now, and what changed since the previous ``stats()``.

    ``steps_per_second`` (env steps: frames times envs) and ``frames_per_second`` are
    measured over that interval, NaN on the first call; ``mean_return``/``mean_length``
    are over the episodes that ended in it (NaN if none did), ``new_episodes`` those of
    them the engine still remembers (the last 28 per shard)."""

    frame: int
    num_envs: int
    episodes: int
    return_sum: float
    length_sum: int
    steps_per_second: float
    frames_per_second: float
    episodes_since: int
    mean_return: float
    mean_length: float
    new_episodes: List[Episode]
    time: float

    @property
    def env_steps(self) -> int:
        return self.frame * self.num_envs


class Observer:
    """A read-only observer of one region; see the module docs. Use ``observe()``."""

    def __init__(self, raw: RawObserver):
        self._raw = raw
        self._tensors = {t["name"]: t for t in raw.tensors}
        self._last_stats: Optional[Tuple[float, int, int, float, int]] = None
        self._seen: Dict[int, int] = {}

    # --- What the region is ---

    @property
    def name(self) -> str:
        return self._raw.name

    @property
    def num_envs(self) -> int:
        return self._raw.num_envs

    @property
    def engine_kind(self) -> str:
        return self._raw.engine_kind

    @property
    def tensors(self) -> Dict[str, Dict[str, object]]:
        """Every tensor: ``{"name", "dtype", "shape", "direction", "location"}``."""
        return dict(self._tensors)

    @property
    def observable(self) -> List[str]:
        """The tensors ``latest()`` can copy: engine->client, in host memory."""
        return [n for n, t in self._tensors.items() if t["direction"] == "engine->client" and t["location"] == "host"]

    @property
    def image(self) -> Optional[str]:
        """The image tensor, if the engine serves one in host memory: ``rgb`` (or the
        first u8 tensor of 4 or 5 dimensions)."""
        candidates = [n for n in self.observable if self._tensors[n]["dtype"] == "uint8" and len(self._tensors[n]["shape"]) in (4, 5)]  # type: ignore[arg-type]
        if "rgb" in candidates:
            return "rgb"
        return candidates[0] if candidates else None

    @property
    def frame(self) -> int:
        """The frame the engine published last."""
        return self._raw.frame()

    def check(self) -> None:
        """Raises what ended the engine (``EngineClosedError``, ``EngineDiedError``,
        ``RegionTooSmallError``, a shard's error); returns while it serves."""
        self._raw.check()

    # --- Copies ---

    def latest(
        self,
        names: Optional[Sequence[str]] = None,
        envs: Union[None, int, Tuple[int, int], range] = None,
        timeout: Optional[float] = 1.0,
    ) -> Frame:
        """A consistent copy of ``names`` (default: every engine->client host tensor) as
        NumPy arrays, with the frame number they hold. ``envs``: the first ``envs`` envs,
        a ``(start, stop)`` pair or a ``range`` (default: all). Tries again until
        ``timeout`` seconds pass (``None``: no limit), then raises ``TimeoutError``;
        ``ValueError`` if another thread closes the observer meanwhile, ``MemoryError``
        for a copy larger than this process can hold. bfloat16 tensors come back as
        float32 (exactly; NumPy has no bfloat16)."""
        names = list(self.observable if names is None else names)
        start, stop = self._envs(envs)
        number, buffers = self._raw.read(names, start, stop, timeout)
        now = time.monotonic()
        tensors = {}
        for name, buf in zip(names, buffers):
            t = self._tensors[name]
            shape = list(t["shape"])  # type: ignore[call-overload]
            if shape and shape[0] == self.num_envs:
                shape[0] = stop - start
            tensors[name] = _as_array(buf, str(t["dtype"])).reshape(shape)
        return Frame(number, tensors, now)

    def frames(
        self,
        names: Optional[Sequence[str]] = None,
        envs: Union[None, int, Tuple[int, int], range] = None,
        interval: float = 1 / 60,
        timeout: Optional[float] = None,
    ) -> Iterator[Frame]:
        """New frames as they come: polls every ``interval`` seconds and yields a copy
        whenever the frame number moved on (frames in between are skipped: latest only,
        never a queue). Ends when the engine does, with its error; ``timeout`` bounds the
        wait for each frame (``None``: none)."""
        last = -1
        waited = time.monotonic()
        while True:
            current = self.frame
            if current != last:
                try:
                    frame = self.latest(names, envs, timeout=max(interval, 0.05))
                except TimeoutError:
                    frame = None
                if frame is not None and frame.number != last:
                    last = frame.number
                    waited = time.monotonic()
                    yield frame
                    continue
            else:
                self.check()
            if timeout is not None and time.monotonic() - waited > timeout:
                raise TimeoutError(f"no new frame of {self.name} for {timeout} s")
            time.sleep(interval)

    __iter__ = frames

    def stats(self, timeout: Optional[float] = 1.0) -> Stats:
        """The episode statistics the engine keeps, and the step rate (see ``Stats``)."""
        raw = self._raw.stats(timeout)
        now = time.monotonic()
        frame, episodes = int(raw["frame"]), int(raw["episodes"])
        return_sum, length_sum = float(raw["return_sum"]), int(raw["length_sum"])
        new = []
        for shard, number, env, ret, length in raw["recent"]:
            if number >= self._seen.get(shard, 0):
                new.append(Episode(env, ret, length, shard, number))
                self._seen[shard] = number + 1
        nan = float("nan")
        sps = fps = mean_return = mean_length = nan
        since = 0
        if self._last_stats is not None:
            t0, f0, e0, r0, l0 = self._last_stats
            dt = now - t0
            if dt > 0:
                fps = (frame - f0) / dt
                sps = fps * self.num_envs
            since = episodes - e0
            if since > 0:
                mean_return = (return_sum - r0) / since
                mean_length = (length_sum - l0) / since
        self._last_stats = (now, frame, episodes, return_sum, length_sum)
        return Stats(frame, self.num_envs, episodes, return_sum, length_sum, sps, fps, since,
                     mean_return, mean_length, new, now)

    def grid(self, envs: int = 16, name: Optional[str] = None, timeout: Optional[float] = 1.0) -> Tuple[int, np.ndarray]:
        """The frames of the first ``envs`` envs of the image tensor (``name``, default
        ``image``) tiled into one RGB image: ``(frame, [H', W', 3] uint8)``."""
        name = name or self.image
        if name is None:
            raise ValueError(f"{self.name} ({self.engine_kind}) serves no image tensor in host memory")
        frame = self.latest([name], min(envs, self.num_envs), timeout=timeout)
        return frame.number, tile_images(to_rgb(frame[name]))

    def record(
        self,
        path: str,
        seconds: float,
        fps: int = 30,
        envs: int = 16,
        name: Optional[str] = None,
    ) -> int:
        """Writes ``seconds`` of tiled frames (the first ``envs`` envs of the image
        tensor) to ``path``: ``.mp4`` through imageio-ffmpeg (sides padded with black to
        multiples of 16), ``.gif`` through Pillow (``pip install 'shmbridge[video]'``). At most ``fps`` frames a second, each a new
        frame of the engine's; returns how many were written (a paused engine adds
        none)."""
        import imageio.v3 as iio

        images: List[np.ndarray] = []
        interval = 1.0 / fps
        end = time.monotonic() + seconds
        last = -1
        while time.monotonic() < end:
            tick = time.monotonic()
            if self.frame != last:
                try:
                    number, image = self.grid(envs, name, timeout=interval)
                except TimeoutError:
                    number = last
                if number != last:
                    images.append(image)
                    last = number
            else:
                self.check()
            time.sleep(max(0.0, interval - (time.monotonic() - tick)))
        if not images:
            raise RuntimeError(f"no frame of {self.name} in {seconds} s: the engine did not step")
        stack = np.stack(images)
        if path.lower().endswith(".gif"):
            iio.imwrite(path, stack, extension=".gif", duration=int(1000 / fps), loop=0)
        else:
            # H.264 players want sides that are multiples of 16: black borders, right and
            # bottom, rather than ffmpeg's resampling.
            h, w = stack.shape[1:3]
            pad = ((0, 0), (0, -h % 16), (0, -w % 16), (0, 0))
            iio.imwrite(path, np.pad(stack, pad), plugin="FFMPEG", fps=fps, macro_block_size=1)
        return len(images)

    def _envs(self, envs: Union[None, int, Tuple[int, int], range]) -> Tuple[int, int]:
        n = self.num_envs
        if envs is None:
            return 0, n
        if isinstance(envs, range):
            if envs.step != 1:
                raise ValueError("envs: a contiguous range")
            return envs.start, envs.stop
        if isinstance(envs, tuple):
            return int(envs[0]), int(envs[1])
        return 0, min(int(envs), n)

    # --- Life ---

    def close(self) -> None:
        """Unmaps the region; the engine and its client never notice."""
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def __enter__(self) -> "Observer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<shmbridge.Observer (closed)>"
        return f"<shmbridge.Observer {self.name} ({self.engine_kind}, {self.num_envs} envs)>"


def observe(name: str, timeout: float = 10.0) -> Observer:
    """Observes region ``name`` (what an engine printed): read-only, unseen by engine and
    learner. Waits up to ``timeout`` seconds for the engine's frame 0; raises
    ``NotFoundError`` at once if no region has the name."""
    return Observer(RawObserver.attach(name, timeout))
