"""What ``shmbridge view`` shows of the trajectory streams of its region namespace
(``shmbridge.view.streams.StreamFlows``, the ``streams`` list of the page's message),
without a server or a browser: the numbers are the stream's counters, records per second
come from two readings, and a stream that vanishes or is truncated between readings is
left out or shown with its error, never raised. The page's own socket is in
test_view.py."""

from __future__ import annotations

import os

import shmbridge.stream as st
from shmbridge.view.streams import StreamFlows

SCHEMA = "tokens: int32[*], score: float64"


class Clock:
    """The readings' clock, moved by the test (no sleeping, no timing)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _one(sample, name):
    found = [s for s in sample if s["name"] == name]
    assert len(found) == 1, sample
    return found[0]


def _same_counters(shown, raw):
    """Every number shown is the stream's counter of that name."""
    for key in ("depth", "bytes_in_use", "full_waits", "records_lost"):
        assert shown[key] == raw[key], key
    assert shown["lanes_total"] == len(raw["lanes"])
    for lane in shown["lanes"]:
        r = raw["lanes"][lane["lane"]]
        for key in ("producer_pid", "records_committed", "records_released", "records_lost", "bytes_in_use"):
            assert lane[key] == r[key], (lane, r)
    assert [{k: v for k, v in r.items() if k != "rank"} for r in shown["ranks"]] == raw["ranks"]


def test_each_stream_is_shown_with_its_counters_and_records_per_second():
    clock = Clock()
    flows = StreamFlows(clock=clock)
    with st.create(schema=SCHEMA, capacity=1 << 16, lanes=4, ranks=2) as c, \
            st.attach(c.name) as p, st.attach(c.name) as q:
        for k in range(5):
            p.push(tokens=[k] * 3, score=k)
        for k in range(2):
            q.push(tokens=[k], score=k)
        with c.pop_batch(3, timeout=5) as batch:
            assert len(batch) == 3
        first = _one(flows.sample(), c.name)
        assert first["error"] is None
        _same_counters(first, st.stats(c.name))
        assert first["depth"] == 4
        lanes = {lane["lane"]: lane for lane in first["lanes"]}
        assert set(lanes) == {p.lane, q.lane}, "only the lanes with a producer or records"
        assert lanes[p.lane]["producer_pid"] == os.getpid() and lanes[p.lane]["records_committed"] == 5
        assert lanes[q.lane]["records_committed"] == 2
        assert all(lane["records_per_s"] is None for lane in first["lanes"]), "one reading: no rate yet"
        assert first["records_per_s"] is None
        assert [(r["rank"], r["state"], r["popped"], r["released"]) for r in first["ranks"]] == [
            (0, "live", 3, 3), (1, "never attached", 0, 0)]

        # Two seconds later by the readings' clock, 8 more records from p, none from q.
        clock.now += 2.0
        for k in range(8):
            p.push(tokens=[k], score=k)
        second = _one(flows.sample(), c.name)
        _same_counters(second, st.stats(c.name))
        lanes = {lane["lane"]: lane for lane in second["lanes"]}
        assert lanes[p.lane]["records_committed"] == 13
        assert lanes[p.lane]["records_per_s"] == 4.0
        assert lanes[q.lane]["records_per_s"] == 0.0
        assert second["records_per_s"] == 4.0
        assert second["depth"] == 12


def test_a_stream_removed_or_truncated_between_readings_leaves_or_says_its_error():
    flows = StreamFlows()
    a = st.create(schema=SCHEMA, capacity=4096, lanes=1)
    b = st.create(schema=SCHEMA, capacity=4096, lanes=1)
    a_name, b_name = a.name, b.name
    try:
        first = flows.sample()
        assert {s["name"] for s in first} == {a_name, b_name}
        assert all(s["error"] is None for s in first)
        # b's creator closes (its name goes); a's file is cut to its header page.
        b.close()
        os.truncate(f"/dev/shm/{a_name}", 4096)
        second = flows.sample()
        assert [s["name"] for s in second] == [a_name]
        assert second[0]["error"].startswith("RegionTooSmallError"), second
        # Listed, then gone before its reading (the listing raced with the removal).
        gone = StreamFlows(names=lambda: [b_name])
        assert gone.sample() == []
    finally:
        a.close()
        b.close()
