//! Trajectory streams across fork and close: the rank's and lane's locks live on a
//! descriptor of their own, which forked children do not keep and a close lets go;
//! a record dropped in a forked child stays its parent's.

mod common;

use std::time::Duration;

use common::peer::{self, PeerProc};
use common::stream::{name, spec};
use shmbridge::error::Error;
use shmbridge::stream::{Consumer, Producer};

const T: Duration = Duration::from_secs(5);

/// Forks a child that only sleeps (as a DataLoader worker or a subprocess forked
/// without exec would live on); returns its pid once the child runs its own code, i.e.
/// after its fork handlers let go of the parent's locks (they run in the child, after
/// `fork` returned in the parent).
fn fork_sleeper() -> i32 {
    let mut ends = [0; 2];
    // SAFETY: a pipe into a local array; the child only makes async-signal-safe calls
    // and exits; the parent reads one byte from the pipe and closes both ends.
    unsafe {
        assert_eq!(libc::pipe(ends.as_mut_ptr()), 0);
        let pid = libc::fork();
        if pid == 0 {
            libc::write(ends[1], b"r".as_ptr().cast(), 1);
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            libc::sleep(60);
            libc::_exit(0);
        }
        let mut byte = 0u8;
        assert_eq!(libc::read(ends[0], (&mut byte as *mut u8).cast(), 1), 1);
        libc::close(ends[0]);
        libc::close(ends[1]);
        pid
    }
}

/// `rank1-fork NAME`: serves rank 1 of NAME, forks a sleeping child, says `ready PID`.
/// `producer-fork NAME`: holds a lane of NAME, forks a sleeping child, says `ready PID`.
#[test]
#[ignore = "a peer process the tests start themselves"]
fn fork_peer() {
    let Some(role) = peer::role() else {
        return;
    };
    let words: Vec<&str> = role.split_whitespace().collect();
    match words[..] {
        ["rank1-fork", n] => {
            let _c = Consumer::attach(n, 1, T).unwrap();
            let child = fork_sleeper();
            peer::say(&format!("ready {child}"));
            peer::block();
        }
        ["producer-fork", n] => {
            let _p = Producer::attach(n, None, T).unwrap();
            let child = fork_sleeper();
            peer::say(&format!("ready {child}"));
            peer::block();
        }
        _ => panic!("bad role {role:?}"),
    }
}

/// docs/stream.md: a rank "whose process ended is taken over" and its lock "the kernel
/// drops when its holder ends, however it ends", also while a child forked from it
/// (without exec) lives on with the stream mapped.
#[test]
fn a_dead_rank_with_a_forked_child_is_taken_over() {
    let n = name("forkrank");
    let _c0 = Consumer::create(&n, &spec(1, 4096, 2)).unwrap();
    let mut peer = PeerProc::start("fork_peer", &format!("rank1-fork {n}"));
    let child: u32 = peer.expect("ready").parse().unwrap();
    common::signal(peer.pid(), rustix::process::Signal::KILL);
    peer.wait_end();
    let got = Consumer::attach(&n, 1, T);
    common::signal(child, rustix::process::Signal::KILL);
    let got = got.map(drop);
    assert!(
        got.is_ok(),
        "rank 1's process is dead, but its forked child keeps its lock: {got:?}"
    );
}

#[test]
fn a_dead_producers_lane_with_a_forked_child_is_taken_over() {
    let n = name("forklane");
    let _c0 = Consumer::create(&n, &spec(1, 4096, 1)).unwrap();
    let mut peer = PeerProc::start("fork_peer", &format!("producer-fork {n}"));
    let child: u32 = peer.expect("ready").parse().unwrap();
    common::signal(peer.pid(), rustix::process::Signal::KILL);
    peer.wait_end();
    let got = Producer::attach(&n, None, T);
    common::signal(child, rustix::process::Signal::KILL);
    let got = got.map(drop);
    assert!(
        !matches!(got, Err(Error::NoFreeLane { .. })),
        "the lane's producer is dead, but its forked child keeps its lock: {got:?}"
    );
}

/// A child forked while a record is held (a DataLoader worker, `multiprocessing` with
/// fork) that drops its copy leaves the parent's record held: the parent still reads
/// it, the producer does not write over it.
#[test]
fn a_record_dropped_in_a_forked_child_stays_held_in_the_parent() {
    let n = name("forkrec");
    let c = Consumer::create(&n, &spec(1, 256, 1)).unwrap();
    let p = Producer::attach(&n, None, T).unwrap();
    let mut r = p.reserve(&[4, 0], T).unwrap();
    r.field_mut::<i32>(0).unwrap().fill(7);
    r.commit();
    let rec = c.pop(T).unwrap().unwrap();
    assert_eq!(c.stats().unwrap().depth, 1);
    // SAFETY: the child drops the record (atomics and a futex wake) and exits.
    let child = unsafe { libc::fork() };
    if child == 0 {
        drop(rec);
        // SAFETY: ends the forked child at once, without running the parent's handlers.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child, writing its status into a local.
    unsafe { libc::waitpid(child, &mut status, 0) };
    // Still held here: it must not be released, nor its room handed to the producer.
    let depth = c.stats().unwrap().depth;
    let mut overwritten = false;
    for k in 0..8 {
        match p.reserve(&[4, 0], Duration::ZERO) {
            Ok(mut r) => {
                r.field_mut::<i32>(0).unwrap().fill(100 + k);
                r.commit();
                if let Some(x) = c.try_pop().unwrap() {
                    drop(x);
                }
            }
            Err(_) => break,
        }
        overwritten |= rec.field::<i32>(0).unwrap() != [7; 4];
    }
    assert!(
        depth == 1 && !overwritten,
        "the parent's held record was released by the child (depth {depth}); \
         overwritten under the parent's view: {overwritten}"
    );
}

/// The Python `Producer`/`Consumer` keep a `Mapping` (their `memory`) for the object's
/// life, and NumPy views keep one after that: `close()` frees the lane and the rank all
/// the same.
#[test]
fn a_closed_producer_frees_its_lane_and_a_closed_rank_can_be_served_again() {
    let n = name("closemap");
    let _c0 = Consumer::create(&n, &spec(1, 4096, 2)).unwrap();
    let p = Producer::attach(&n, None, T).unwrap();
    let keep = p.mapping(); // what PyStreamProducer.memory holds
    drop(p); // PyStreamProducer.close()
    let again = Producer::attach(&n, None, T).map(drop);
    let c1 = Consumer::attach(&n, 1, T).unwrap();
    let keep1 = c1.mapping();
    drop(c1); // PyStreamConsumer.close()
    let rank_again = Consumer::attach(&n, 1, T).map(drop);
    drop((keep, keep1));
    assert!(
        again.is_ok() && rank_again.is_ok(),
        "lane after close: {again:?}; rank after close: {rank_again:?}"
    );
}

/// A child forked from a stream's consumer and producer process (a DataLoader worker)
/// that asks their stats reads the stream it maps, not the descriptor its fork handler
/// pointed at /dev/null: whose size, 0, is no truncation of the stream's file.
#[test]
fn stats_in_a_forked_child_are_no_truncation() {
    let n = name("forkstats");
    let c = Consumer::create(&n, &spec(1, 256, 1)).unwrap();
    let p = Producer::attach(&n, None, T).unwrap();
    // SAFETY: the child reads the stats (reads of the mapping, an `fstat`, allocations:
    // glibc's malloc is usable after fork) and exits.
    let child = unsafe { libc::fork() };
    if child == 0 {
        let truncated = |r: Result<(), Error>| matches!(r, Err(Error::RegionTooSmall { .. }));
        let code = i32::from(truncated(c.stats().map(drop)) || truncated(p.stats().map(drop)));
        // SAFETY: ends the forked child at once, without running the parent's handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(libc::WIFEXITED(status), "status {status:#x}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's stats said the stream's file was truncated"
    );
    assert!(c.stats().is_ok() && p.stats().is_ok());
}
