//! Streams under load: 1,000,000 records of varying lengths from 8 producers, every one
//! checked by the consumer (its producer, its sequence number, its bytes against their
//! hash): no loss, no duplicate, per-producer order. Then the same into a group of 2
//! ranks. Producers are threads with a lane each, as producer processes are; lanes are
//! small so that they wrap and fill all the time.

mod common;

use std::time::Duration;

use shmbridge::stream::{Consumer, Producer, Record, Schema, StreamSpec};

const PRODUCERS: u32 = 8;
const RECORDS: u64 = 1_000_000;
const PER_PRODUCER: u64 = RECORDS / PRODUCERS as u64;
const T: Duration = Duration::from_secs(60);

fn schema() -> Schema {
    Schema::parse("producer: uint32[1], seq: uint64[1], hash: uint64[1], data: uint8[*]").unwrap()
}

/// SplitMix64: the bytes of record (p, seq) and its length come from it.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn fill(p: u32, seq: u64, out: &mut [u8]) {
    let mut s = mix(((p as u64) << 40) ^ seq);
    for chunk in out.chunks_mut(8) {
        s = mix(s);
        chunk.copy_from_slice(&s.to_le_bytes()[..chunk.len()]);
    }
}

fn len_of(p: u32, seq: u64) -> u32 {
    (mix(seq.wrapping_mul(31) ^ p as u64) % 200) as u32
}

fn produce(name: &str, p: u32) {
    let prod = Producer::attach(name, Some(&schema()), T).unwrap();
    for seq in 0..PER_PRODUCER {
        let n = len_of(p, seq);
        let mut r = prod.reserve(&[n], T).unwrap();
        assert_eq!(r.seq(), seq);
        let data = r.bytes_mut(3).unwrap();
        fill(p, seq, data);
        let h = fnv(data);
        r.field_mut::<u32>(0).unwrap()[0] = p;
        r.field_mut::<u64>(1).unwrap()[0] = seq;
        r.field_mut::<u64>(2).unwrap()[0] = h;
        r.commit();
    }
}

/// Checks one record whole; returns (producer, seq).
fn check(rec: &Record) -> (u32, u64) {
    let p = rec.field::<u32>(0).unwrap()[0];
    let seq = rec.field::<u64>(1).unwrap()[0];
    let h = rec.field::<u64>(2).unwrap()[0];
    let data = rec.bytes(3).unwrap();
    assert!(p < PRODUCERS, "producer {p}");
    assert_eq!(rec.seq(), seq, "the header's sequence number");
    assert_eq!(data.len() as u32, len_of(p, seq), "length of ({p}, {seq})");
    assert_eq!(fnv(data), h, "hash of ({p}, {seq})");
    let mut want = vec![0u8; data.len()];
    fill(p, seq, &mut want);
    assert_eq!(data, &want[..], "bytes of ({p}, {seq})");
    (p, seq)
}

/// Pops until `total` records were seen by all ranks together (`seen`), checking each;
/// returns the (producer, seq) pairs this rank got, in its order.
fn consume(c: &Consumer, seen: &std::sync::atomic::AtomicU64) -> Vec<(u32, u64)> {
    use std::sync::atomic::Ordering;
    let mut got = Vec::new();
    while seen.load(Ordering::Relaxed) < RECORDS {
        for rec in c.pop_batch(64, Duration::from_millis(20)).unwrap() {
            got.push(check(&rec));
            seen.fetch_add(1, Ordering::Relaxed);
        }
    }
    got
}

/// Per producer, the sequence numbers a rank got are increasing (each lane is claimed
/// in order); across ranks every (producer, seq) arrived exactly once.
fn verify(ranks: Vec<Vec<(u32, u64)>>) {
    let mut count = vec![vec![0u8; PER_PRODUCER as usize]; PRODUCERS as usize];
    for got in &ranks {
        let mut last = vec![None::<u64>; PRODUCERS as usize];
        for &(p, seq) in got {
            let l = &mut last[p as usize];
            assert!(l.is_none_or(|l| seq > l), "producer {p}: {seq} after {l:?}");
            *l = Some(seq);
            count[p as usize][seq as usize] += 1;
        }
    }
    for (p, c) in count.iter().enumerate() {
        for (seq, &n) in c.iter().enumerate() {
            assert_eq!(n, 1, "record ({p}, {seq}) arrived {n} times");
        }
    }
}

fn run(ranks: u32) {
    let name = shmbridge::region::canonical_name(&format!("stress{ranks}")).unwrap();
    let spec = StreamSpec {
        schema: schema(),
        lanes: PRODUCERS,
        lane_capacity: 16 << 10,
        ranks,
    };
    let c0 = Consumer::create(&name, &spec).unwrap();
    let others: Vec<Consumer> = (1..ranks)
        .map(|r| Consumer::attach(&name, r, T).unwrap())
        .collect();
    let seen = std::sync::atomic::AtomicU64::new(0);
    let got = std::thread::scope(|s| {
        for p in 0..PRODUCERS {
            let name = &name;
            s.spawn(move || produce(name, p));
        }
        let handles: Vec<_> = others
            .iter()
            .map(|c| s.spawn(|| consume(c, &seen)))
            .collect();
        let mut got = vec![consume(&c0, &seen)];
        got.extend(handles.into_iter().map(|h| h.join().unwrap()));
        got
    });
    if ranks > 1 {
        assert!(got.iter().all(|g| !g.is_empty()), "every rank got records");
    }
    verify(got);
    let s = c0.stats().unwrap();
    assert_eq!(s.depth, 0);
    assert_eq!(s.records_lost, 0);
    assert_eq!(
        s.lanes.iter().map(|l| l.records_committed).sum::<u64>(),
        RECORDS
    );
}

#[test]
fn a_million_records_from_8_producers_to_one_consumer() {
    run(1);
}

#[test]
fn a_million_records_from_8_producers_to_2_ranks() {
    run(2);
}
