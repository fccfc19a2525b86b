"""The trajectory streams ``shmbridge view`` shows beside the region: every stream of the
region namespace, read as an observer (``shmbridge.stream.stats``: the file is read,
never mapped; no lane or rank is taken, nothing is written), with records per second
per producer from two successive readings of its lane's plain counters.

Needs nothing beyond the package (no aiohttp), so what the page shows can be checked
without a server: :meth:`StreamFlows.sample` is the ``streams`` list of the page's
``streams`` message.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import errors
from .. import stream as _stream

__all__ = ["StreamFlows"]


def _rate(count: int, before: Optional[Tuple[int, int]], pid: int, dt: float) -> Optional[float]:
    """Records a second from the previous reading ``before`` (its pid and count): None
    the first time, when the lane changed hands, or when the counter went back (a new
    stream under the name)."""
    if before is None or dt <= 0:
        return None
    was_pid, was = before
    if was_pid != pid or count < was:
        return None
    rate = (count - was) / dt
    return rate if math.isfinite(rate) else None


class StreamFlows:
    """Successive readings of every stream of the namespace.

    ``sample()`` returns one dict per stream, sorted by name: ``name``; ``error`` (None,
    or what reading it raised: a stream truncated, corrupt or not yet published is shown
    with its error, never raised); and, when it was read, ``depth``, ``bytes_in_use``,
    ``full_waits``, ``records_lost``, ``lanes_total``, ``records_per_s`` (the sum of its
    lanes' rates; None until two readings), ``lanes`` (the lanes that have a producer or
    ever held a record: ``lane``, ``producer_pid``, ``records_committed``,
    ``records_released``, ``records_lost``, ``bytes_in_use``, ``records_per_s``) and
    ``ranks`` (``rank``, ``pid``, ``state``, ``popped``, ``released``, ``lost``). A
    stream removed between the listing and its reading is left out (it is gone).
    """

    def __init__(self, names: Callable[[], List[str]] = _stream.names,
                 stats: Callable[[str], Dict[str, Any]] = _stream.stats,
                 clock: Callable[[], float] = time.monotonic):
        self._names = names
        self._stats = stats
        self._clock = clock
        # Per stream: the time of its last reading and each lane's (pid, committed).
        self._last: Dict[str, Tuple[float, List[Tuple[int, int]]]] = {}

    def sample(self) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        seen: Dict[str, Tuple[float, List[Tuple[int, int]]]] = {}
        for name in self._names():
            now = self._clock()
            try:
                s = self._stats(name)
            except errors.NotFoundError:
                continue  # removed since the listing
            except errors.ShmBridgeError as e:
                out.append({"name": name, "error": f"{type(e).__name__}: {e}"})
                continue
            before = self._last.get(name)
            dt = now - before[0] if before is not None else 0.0
            lanes = []
            total: Optional[float] = None
            counts = []
            for i, lane in enumerate(s["lanes"]):
                pid, committed = lane["producer_pid"], lane["records_committed"]
                counts.append((pid, committed))
                was = before[1][i] if before is not None and i < len(before[1]) else None
                rate = _rate(committed, was, pid, dt)
                if rate is not None:
                    total = rate + (total or 0.0)
                if pid == 0 and committed == 0:
                    continue
                lanes.append({"lane": i, "producer_pid": pid, "records_committed": committed,
                              "records_released": lane["records_released"], "records_lost": lane["records_lost"],
                              "bytes_in_use": lane["bytes_in_use"], "records_per_s": rate})
            seen[name] = (now, counts)
            out.append({"name": name, "error": None, "depth": s["depth"], "bytes_in_use": s["bytes_in_use"],
                        "full_waits": s["full_waits"], "records_lost": s["records_lost"],
                        "lanes_total": len(s["lanes"]), "records_per_s": total, "lanes": lanes,
                        "ranks": [{"rank": k, **r} for k, r in enumerate(s["ranks"])]})
        self._last = seen
        return out
