//! Entry points shared by the fuzz targets (`fuzz/`) and the regression tests that replay
//! their findings (`tests/fuzz_regressions.rs`). Not a stable API.

use crate::error::Peer;
use crate::ring::HeapRing;
use crate::wire::Envelope;

/// Capacity of the ring the fuzzer drives.
pub const FUZZ_RING: u64 = 1024;

/// Interprets `data` as a hostile ring state and reads it the way a peer would: the first
/// 16 bytes are the head and tail counters (little-endian u64), the rest is the ring's
/// buffer. Pops records until the ring is empty or reports an error, decodes each as an
/// envelope, and also decodes the whole input as an envelope. Must never panic, read out
/// of bounds or loop forever; the invariants it checks panic (for the fuzzer) if broken.
pub fn ring_reader(data: &[u8]) {
    let _ = Envelope::decode(data);
    if data.len() < 16 {
        return;
    }
    let head = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
    let tail = u64::from_le_bytes(data[8..16].try_into().expect("8 bytes"));
    let heap = HeapRing::new(FUZZ_RING).expect("valid capacity");
    heap.set_raw(head, tail, &data[16..]);
    let ring = heap.ring(Peer::Client);
    let mut record = Vec::new();
    // Each successful pop consumes ≥ 8 bytes of at most one capacity's worth.
    for _ in 0..=(FUZZ_RING / 8) {
        match ring.try_pop(&mut record) {
            Ok(true) => {
                assert!(record.len() as u64 <= ring.max_record());
                if let Ok(env) = Envelope::decode(&record) {
                    // Whatever decodes re-encodes to an envelope that decodes the same.
                    let again =
                        Envelope::decode(&env.encode()).expect("re-encoded envelope decodes");
                    assert_eq!(again, env);
                }
            }
            Ok(false) | Err(_) => return,
        }
    }
    panic!("ring yielded more records than it can hold");
}
