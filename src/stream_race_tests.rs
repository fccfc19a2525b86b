//! A rank holding a stale `read` position must not claim a *payload* word of a later lap
//! as a record (the lap tag only protects positions that are record starts in the later
//! lap too): it publishes the position and checks `tail` first. `after_cursors` is a test-only hook in `Lane::try_claim`,
//! between its loads of `read`/`head` and of `word0` (where a preemption stops a rank).

use std::cell::RefCell;

use super::*;
use crate::layout::stream::{Word0, KIND_RECORD, STATE_READY};

thread_local! {
    static HOOK: RefCell<Option<Box<dyn FnOnce()>>> = RefCell::new(None);
}

pub(super) fn after_cursors() {
    if let Some(f) = HOOK.with(|h| h.borrow_mut().take()) {
        f();
    }
}

const CAP: u64 = 128;

struct Heap {
    ctrl: LaneCtrl,
    data: Vec<u64>,
    doorbell: AtomicU32,
    ranks: Vec<RankCtrl>,
    full_waits: AtomicU64,
    lost: AtomicU64,
    schema: Schema,
}

impl Heap {
    fn lane(&self) -> Lane<'_> {
        Lane {
            ctrl: &self.ctrl,
            data: self.data.as_ptr() as *mut u8,
            capacity: CAP,
            index: 0,
            ranks: &self.ranks,
        }
    }
    fn group(&self) -> Group<'_> {
        Group {
            doorbell: &self.doorbell,
            ranks: &self.ranks,
            full_waits: &self.full_waits,
            lost: &self.lost,
        }
    }
    /// Reserve (room checked, no wait), write `payload`, commit; returns the record's pos.
    fn produce(&self, payload: &[u8], seq: u64) -> u64 {
        let l = self.lane();
        let head = self.ctrl.head.load(Ordering::Relaxed);
        let spans = self.schema.spans(&[payload.len() as u32], CAP / 2).unwrap();
        let need = l.needed(head, spans.len() as u64);
        assert!(
            head + need - self.ctrl.tail.load(Ordering::Relaxed) <= CAP,
            "no room"
        );
        let p = l.write_header(head, spans, &[payload.len() as u32], seq, 1, 32);
        let (off, _) = spans.field(0);
        let dst = l.field_ptr(p.pos, spans.len(), off);
        // SAFETY: the field lies inside the record just reserved (room checked above),
        // which nobody reads before its commit; `payload` is its length.
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), dst, payload.len()) };
        l.commit(&p, head, &self.group());
        p.pos
    }
}

#[test]
fn a_stale_position_inside_a_later_payload_is_claimed_as_a_record() {
    let h = std::sync::Arc::new(Heap {
        ctrl: LaneCtrl::default(),
        data: vec![0; (CAP / 8) as usize],
        doorbell: AtomicU32::new(0),
        ranks: (0..2).map(|_| RankCtrl::default()).collect(),
        full_waits: AtomicU64::new(0),
        lost: AtomicU64::new(0),
        schema: Schema::parse("data: uint8[*]").unwrap(),
    });
    // Lap 0: R0 [0,32), R1 [32,96), R2 [96,128).
    assert_eq!(h.produce(&[], 0), 0);
    assert_eq!(h.produce(&[1; 32], 1), 32);
    assert_eq!(h.produce(&[], 2), 96);
    let l = h.lane();
    let r0 = l.try_claim(0, 32).unwrap().unwrap();
    assert_eq!(r0.pos, 0);
    // R3's payload: ordinary user bytes that happen to read as a ready record of lap 0
    // (for int32 tokens: [32, 1], then zeros).
    let fake = Word0 {
        len: 32,
        kind: KIND_RECORD,
        state: STATE_READY,
        rank: 0,
        lap: 0,
    }
    .pack();
    let mut payload = [0u8; 32];
    payload[..8].copy_from_slice(&fake.to_le_bytes());
    payload[8..16].copy_from_slice(&0xBADu64.to_le_bytes());
    // Rank 1 loads read = 32, head = 128, and stops there; meanwhile rank 0 claims R1,
    // both are released, and the producer writes R3 at 128 (offsets 0..64: its payload
    // covers offset 32).
    let h2 = h.clone();
    HOOK.with(|k| {
        *k.borrow_mut() = Some(Box::new(move || {
            let l = h2.lane();
            let r1 = l.try_claim(0, 32).unwrap().unwrap();
            assert_eq!(r1.pos, 32);
            assert!(l.release(r0));
            assert!(l.release(r1));
            assert_eq!(h2.ctrl.tail.load(Ordering::Relaxed), 96);
            assert_eq!(h2.produce(&payload, 3), 128);
        }))
    });
    let got = l.try_claim(1, 32).unwrap().expect("R2 is there");
    let (_, seq, _) = l.decode(&h.schema, got).unwrap();
    // What rank 0 then reads of R3: its first payload word was changed by rank 1's CAS.
    let mut r3_first = 0u64;
    if got.pos == 32 {
        let r2 = l.try_claim(0, 32).unwrap().unwrap();
        let r3 = l.try_claim(0, 32).unwrap().unwrap();
        let (sp, _, _) = l.decode(&h.schema, r3).unwrap();
        let p = l.field_ptr(r3.pos, sp.len(), sp.field(0).0);
        // SAFETY: the field of R3, claimed by rank 0 and committed, is 32 bytes long.
        r3_first = unsafe { (p as *const u64).read_unaligned() };
        let _ = r2;
    }
    assert_eq!(
        (got.pos, seq),
        (96, 2),
        "rank 1 claimed position {} (seq {seq:#x}) inside R3's payload; R3's first payload \
         word is now {r3_first:#x}, written {fake:#x}",
        got.pos
    );
}

thread_local! {
    static LANE_HOOK: RefCell<Option<Box<dyn FnMut(u32)>>> = RefCell::new(None);
}

pub(super) fn before_lane_reap(i: u32) {
    let hook = LANE_HOOK.with(|h| h.borrow_mut().take());
    if let Some(mut f) = hook {
        f(i);
        LANE_HOOK.with(|h| *h.borrow_mut() = Some(f));
    }
}

/// `Map::reap(None)` (a surviving rank's `pop`, between slices) decides per lane whether
/// a rank is dead. Rank 1 is found dead in lane 0; before lane 1 is reaped, a new
/// process takes rank 1 over and pops a record of lane 1: that live record is not
/// released as lost.
#[test]
fn a_rank_taken_over_during_a_reap_keeps_its_new_records() {
    use std::rc::Rc;
    let n = crate::region::canonical_name(&format!("streamreap{}", std::process::id())).unwrap();
    let spec = StreamSpec {
        schema: Schema::parse("x: uint8[*]").unwrap(),
        lanes: 2,
        lane_capacity: 4096,
        ranks: 2,
    };
    let c0 = Consumer::create(&n, &spec).unwrap();
    let p0 = Producer::attach(&n, None, Duration::from_secs(1)).unwrap();
    let p1 = Producer::attach(&n, None, Duration::from_secs(1)).unwrap();
    assert_eq!((p0.lane(), p1.lane()), (0, 1));
    // Rank 1 served by a process now gone: LIVE, its lock free, one claim in lane 0.
    p0.reserve(&[1], Duration::ZERO).unwrap().commit();
    let map = &c0.map;
    primitive::store(&map.group().ranks[1].state, RANK_LIVE, Ordering::Release);
    let hl = map.layout.schema.record_header_len();
    map.lane(0).try_claim(1, hl).unwrap().unwrap();
    // Before lane 1: the takeover, and a pop of a record of lane 1 by the new rank 1.
    let held: Rc<RefCell<Vec<(Consumer, Record)>>> = Rc::default();
    let h2 = held.clone();
    let n2 = n.clone();
    let p1 = Rc::new(p1);
    let p1b = p1.clone();
    LANE_HOOK.with(|h| {
        *h.borrow_mut() = Some(Box::new(move |i| {
            if i == 1 && h2.borrow().is_empty() {
                let c1 = Consumer::attach(&n2, 1, Duration::from_secs(1)).unwrap();
                p1b.reserve(&[1], Duration::ZERO).unwrap().commit();
                let rec = c1.try_pop().unwrap().expect("lane 1's record");
                assert_eq!(rec.lane(), 1);
                h2.borrow_mut().push((c1, rec));
            }
        }))
    });
    let lost = map.reap(None);
    LANE_HOOK.with(|h| h.borrow_mut().take());
    let s = c0.stats().unwrap();
    assert_eq!(
        (lost, s.lanes[1].records_lost),
        (1, 0),
        "the new rank 1's live record in lane 1 was released as lost: {s:?}"
    );
    drop(held);
}

thread_local! {
    static RANK_HOOK: RefCell<Option<Box<dyn FnOnce(u8)>>> = RefCell::new(None);
}

/// In `Map::reap`, between the verdict that a rank is dead and the clear of its hazard.
pub(super) fn after_rank_verdict(k: u8) {
    if let Some(f) = RANK_HOOK.with(|h| h.borrow_mut().take()) {
        f(k);
    }
}

fn two_rank_stream(tag: &str) -> (String, Consumer, Producer) {
    let n = crate::region::canonical_name(&format!("{tag}{}", std::process::id())).unwrap();
    let spec = StreamSpec {
        schema: Schema::parse("x: uint8[*]").unwrap(),
        lanes: 1,
        lane_capacity: 4096,
        ranks: 2,
    };
    let c0 = Consumer::create(&n, &spec).unwrap();
    let p = Producer::attach(&n, None, Duration::from_secs(1)).unwrap();
    (n, c0, p)
}

/// A dead rank's hazard is cleared by whoever reaps. Rank 1's process died while it
/// examined position 0 of lane 0 (LIVE, its lock free, its hazard on 0). Rank 0 reaps
/// and finds rank 1 dead; right then a new process takes rank 1 over and examines
/// position 0 again: the same hazard word (an ABA). The reaper's clear must not take
/// that hazard away: once `tail` passes 0 the producer would rewrite the bytes the new
/// rank 1 reads as a record's first word. Either the takeover waits for the reaper (it
/// cannot take the rank while the reaper clears), or its hazard stays.
#[test]
fn a_rank_taken_over_while_its_hazard_is_cleared_keeps_its_new_hazard() {
    use std::rc::Rc;
    let (n, c0, p) = two_rank_stream("streamhz");
    p.reserve(&[1], Duration::ZERO).unwrap().commit();
    let map = &c0.map;
    let ranks = map.group().ranks;
    let l = map.lane(0);
    primitive::store(&ranks[1].state, RANK_LIVE, Ordering::Release);
    assert!(l.guard(Some(1), 0));
    let hz = primitive::load(&ranks[1].hazard, Ordering::SeqCst);
    assert_eq!(hz, hazard_word(0, 0));
    let taken: Rc<RefCell<Option<Result<Consumer>>>> = Rc::default();
    let t2 = taken.clone();
    let n2 = n.clone();
    let m2 = c0.map.clone();
    RANK_HOOK.with(|h| {
        *h.borrow_mut() = Some(Box::new(move |k| {
            assert_eq!(k, 1);
            let got = Consumer::attach(&n2, 1, Duration::ZERO);
            if let Ok(c1) = &got {
                // The new rank 1 loads `read = 0` and publishes it: the same word.
                assert!(c1.map.lane(0).guard(Some(1), 0));
                let now = primitive::load(&m2.group().ranks[1].hazard, Ordering::SeqCst);
                assert_eq!(now, hz);
            }
            *t2.borrow_mut() = Some(got);
        }))
    });
    map.reap(None);
    RANK_HOOK.with(|h| h.borrow_mut().take());
    let got = taken
        .borrow_mut()
        .take()
        .expect("the reaper judged rank 1 dead");
    match got {
        Ok(c1) => {
            // Rank 0 takes the record at 0 and releases it: `tail` passes 0, and only
            // rank 1's hazard keeps the producer off the bytes it examines.
            let rec = c0.try_pop().unwrap().expect("the record at 0");
            let len = rec.len() as u64;
            drop(rec);
            assert_eq!(primitive::load(&l.ctrl.tail, Ordering::SeqCst), len);
            let now = primitive::load(&ranks[1].hazard, Ordering::SeqCst);
            assert_eq!(
                (now, l.room_limit()),
                (hz, 0),
                "the reaper cleared the hazard of the process that took rank 1 over: the \
                 producer may now rewrite the bytes it examines"
            );
            drop(c1);
        }
        Err(Error::Timeout { .. }) => {
            // The takeover could not take the rank while the reaper held it; the dead
            // rank's hazard is gone, and the rank can be taken over now.
            assert_eq!(primitive::load(&ranks[1].hazard, Ordering::SeqCst), 0);
            let c1 = Consumer::attach(&n, 1, Duration::ZERO).expect("rank 1 is free again");
            assert_eq!(c1.rank(), 1);
        }
        Err(e) => panic!("taking rank 1 over during the reap: {e}"),
    }
}

thread_local! {
    static ATTACH_HOOK: RefCell<Option<Box<dyn FnOnce()>>> = RefCell::new(None);
}

/// In `Consumer::attach`, when the rank's byte is held shared (a reaper), before it waits.
pub(super) fn attach_waits() {
    if let Some(f) = ATTACH_HOOK.with(|h| h.borrow_mut().take()) {
        f();
    }
}

/// A takeover that meets a reaper's hold of the rank waits for it instead of failing:
/// rank 0 reaps dead rank 1's hazard and stops holding the rank; another thread attaches
/// as rank 1 meanwhile (with a long timeout), and is let through once the reaper goes on.
#[test]
fn a_takeover_waits_for_a_reapers_hold_of_the_rank() {
    use std::sync::mpsc::channel;
    let (n, c0, _p) = two_rank_stream("streamhzwait");
    let ranks = c0.map.group().ranks;
    primitive::store(&ranks[1].state, RANK_LIVE, Ordering::Release);
    assert!(c0.map.lane(0).guard(Some(1), 0));
    let (holding_tx, holding) = channel::<()>();
    let (go_tx, go) = channel::<()>();
    let (waiting_tx, waiting) = channel::<()>();
    std::thread::scope(|s| {
        let reaper = s.spawn(|| {
            RANK_HOOK.with(|h| {
                *h.borrow_mut() = Some(Box::new(move |k| {
                    assert_eq!(k, 1);
                    holding_tx.send(()).unwrap();
                    go.recv().unwrap();
                }))
            });
            c0.map.reap(None);
        });
        holding.recv().expect("the reaper holds rank 1");
        let taker = s.spawn(|| {
            ATTACH_HOOK
                .with(|h| *h.borrow_mut() = Some(Box::new(move || waiting_tx.send(()).unwrap())));
            Consumer::attach(&n, 1, Duration::from_secs(60))
        });
        // The taker saw the reaper's hold (or it ended without waiting: it failed).
        let waited = waiting.recv().is_ok();
        go_tx.send(()).unwrap();
        reaper.join().unwrap();
        let got = taker.join().unwrap();
        assert!(waited, "the takeover did not wait for the reaper: {got:?}");
        let c1 = got.expect("rank 1 taken over once the reaper let go");
        assert_eq!(c1.rank(), 1);
        assert_eq!(primitive::load(&ranks[1].hazard, Ordering::SeqCst), 0);
    });
}
