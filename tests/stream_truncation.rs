//! A stream file truncated while it is mapped (anyone with the owner's rights can
//! truncate it): consumers and producers turn it into `RegionTooSmall` before they sleep
//! and when a sleep slice runs out, never a SIGBUS; the answer sticks, and dropping them
//! touches nothing. Attaching to a file shorter than its header says is `RegionTooSmall`,
//! and so are an observer's stats (read with `pread`, never mapped). Before the fix a
//! waiter woke into the vanished words: the test process died of SIGBUS.

mod common;

use std::time::Duration;

use shmbridge::error::Error;
use shmbridge::stream::{self, Consumer, Producer, StreamSpec};
use shmbridge::WaitPolicy;

const SCHEMA: &str = "tokens: int32[*], score: float64[1]";
const T: Duration = Duration::from_secs(60);

use common::stream::name;

fn spec(capacity: u64) -> StreamSpec {
    common::stream::spec_of(SCHEMA, 2, capacity, 1)
}

fn truncate_to(name: &str, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(common::shm_path(name))
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn file_len(name: &str) -> u64 {
    std::fs::metadata(common::shm_path(name)).unwrap().len()
}

fn tid() -> i32 {
    rustix::thread::gettid().as_raw_nonzero().get()
}

fn too_small<T: std::fmt::Debug>(what: &str, r: Result<T, Error>, needed: u64, actual: u64) {
    match r {
        Err(Error::RegionTooSmall {
            needed: n,
            actual: a,
        }) => assert_eq!((n, a), (needed, actual), "{what}"),
        other => panic!("{what}: expected RegionTooSmall, got {other:?}"),
    }
}

/// A consumer asleep in `pop` (blocking policy, nothing to pop) while the file is
/// truncated to nothing: the pop ends with `RegionTooSmall` when its sleep slice runs
/// out; every later pop, batch, stats and field access says the same without touching
/// the mapping; dropping a record popped before, the producer and the consumer touches
/// nothing. Before, the waiter reaped dead ranks' records in the vanished lanes: SIGBUS.
#[test]
fn a_consumer_asleep_in_pop_survives_truncation_to_nothing() {
    let n = name("cut-pop");
    let mut c = Consumer::create(&n, &spec(4096)).unwrap();
    c.set_wait_policy(WaitPolicy::BLOCKING);
    let p = Producer::attach(&n, None, T).unwrap();
    let mut r = p.reserve(&[3], T).unwrap();
    r.field_mut::<i32>(0).unwrap().copy_from_slice(&[1, 2, 3]);
    r.commit();
    let held = c.try_pop().unwrap().expect("the record");
    let size = file_len(&n);
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let popping = std::thread::spawn(move || {
        tid_tx.send(tid()).unwrap();
        let got = c.pop(T).map(|r| r.map(|r| r.seq()));
        (c, got)
    });
    common::until_asleep(tid_rx.recv().unwrap());
    truncate_to(&n, 0);
    let (c, got) = popping.join().unwrap();
    too_small("pop", got, size, 0);
    too_small("pop again", c.pop(T).map(|r| r.is_some()), size, 0);
    too_small("try_pop", c.try_pop().map(|r| r.is_some()), size, 0);
    too_small("pop_batch", c.pop_batch(8, T).map(|b| b.len()), size, 0);
    too_small("stats", c.stats(), size, 0);
    too_small("field of a held record", held.field_raw(0), size, 0);
    drop(held);
    drop(p);
    drop(c);
    assert!(!common::shm_exists(&n), "the creator removes the name");
}

/// A producer asleep on a full lane (blocking policy, the consumer not popping) while
/// the file is truncated to its header page (the lanes gone): the reserve ends with
/// `RegionTooSmall`; the next reserve and stats say the same; dropping the producer and
/// the consumer touches nothing. Before, the waiter reaped its lane between slices: SIGBUS.
#[test]
fn a_producer_asleep_on_a_full_lane_survives_truncation() {
    let n = name("cut-full");
    let c = Consumer::create(&n, &spec(256)).unwrap();
    let mut p = Producer::attach(&n, None, T).unwrap();
    p.set_wait_policy(WaitPolicy::BLOCKING);
    // 128-byte records in a 256-byte lane: the third finds it full.
    for _ in 0..2 {
        p.reserve(&[20], Duration::ZERO).unwrap().commit();
    }
    assert!(matches!(
        p.reserve(&[20], Duration::ZERO),
        Err(Error::Full { .. })
    ));
    let size = file_len(&n);
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let reserving = std::thread::spawn(move || {
        tid_tx.send(tid()).unwrap();
        let got = p.reserve(&[20], T).map(|r| r.seq());
        (p, got)
    });
    common::until_asleep(tid_rx.recv().unwrap());
    truncate_to(&n, 4096);
    let (p, got) = reserving.join().unwrap();
    too_small("reserve", got, size, 4096);
    too_small(
        "reserve again",
        p.reserve(&[1], T).map(|r| r.seq()),
        size,
        4096,
    );
    too_small("producer's stats", p.stats(), size, 4096);
    too_small("observer's stats", stream::stats(&n), size, 4096);
    drop(p);
    // The consumer has not looked yet: its drop looks before it marks its rank closed.
    drop(c);
    assert!(!common::shm_exists(&n), "the creator removes the name");
}

/// A file shorter than its header says: attaching a producer or a consumer rank, and an
/// observer's stats, are `RegionTooSmall` (checked against the layout before mapping).
#[test]
fn attaching_to_a_short_stream_file_is_region_too_small() {
    let n = name("cut-attach");
    let mut s = spec(4096);
    s.ranks = 2;
    let c = Consumer::create(&n, &s).unwrap();
    let size = file_len(&n);
    truncate_to(&n, size - 4096);
    too_small(
        "producer attach",
        Producer::attach(&n, None, T).map(|p| p.lane()),
        size,
        size - 4096,
    );
    too_small(
        "consumer attach",
        Consumer::attach(&n, 1, T).map(|c| c.rank()),
        size,
        size - 4096,
    );
    too_small("observer's stats", stream::stats(&n), size, size - 4096);
    // Below its header page.
    truncate_to(&n, 100);
    too_small(
        "producer attach",
        Producer::attach(&n, None, T).map(|p| p.lane()),
        4096,
        100,
    );
    too_small("observer's stats", stream::stats(&n), 4096, 100);
    drop(c);
}
