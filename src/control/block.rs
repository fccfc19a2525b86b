//! The control block itself ([`Control`]: a typed view of its live words) and the
//! lock-step words: the engine's identity and state, the client slot, the sequence
//! counters and the doorbell. The words of a client's device session are in
//! `release.rs`.

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::state::{ClientState, EngineState};
use crate::error::{Error, Peer, Result};
use crate::layout::{offsets, CONTROL_SIZE, MAGIC};
use crate::os;
use crate::sync::{Doorbell, SharedSeq};

/// What [`Control::claim_client`] learnt: who claims, and the identity the slot held
/// before (the previous session's, whose imports a 1.5 claimer records if it left them
/// open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub pid: u32,
    pub start_time: u64,
    pub previous: (u32, u64),
}

/// A view of a region's live control block.
#[derive(Clone, Copy)]
pub struct Control<'a> {
    base: NonNull<u8>,
    _mapping: PhantomData<&'a [u8]>,
}

impl std::fmt::Debug for Control<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Control")
            .field("engine_state", &self.engine_state())
            .field("client_state", &self.client_state())
            .finish_non_exhaustive()
    }
}

impl<'a> Control<'a> {
    /// A view of the control block at `base`.
    ///
    /// # Safety
    ///
    /// `base` is 8-byte aligned and points to at least [`CONTROL_SIZE`] bytes of a
    /// shared mapping that stays mapped for `'a`, whose live fields every party
    /// accesses only atomically.
    #[inline]
    pub(crate) unsafe fn new(base: NonNull<u8>) -> Control<'a> {
        Control {
            base,
            _mapping: PhantomData,
        }
    }

    #[inline]
    pub(super) fn u64(&self, offset: usize) -> &'a AtomicU64 {
        assert!(offset % 8 == 0 && offset + 8 <= CONTROL_SIZE);
        // SAFETY: `new`'s contract: the mapping is 8-aligned, at least CONTROL_SIZE long
        // and mapped for `'a`; the offset is 8-aligned and inside it, so the pointer is
        // valid and aligned for AtomicU64 for `'a`. Both processes access it atomically.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU64) }
    }

    #[inline]
    pub(super) fn u32(&self, offset: usize) -> &'a AtomicU32 {
        assert!(offset % 4 == 0 && offset + 4 <= CONTROL_SIZE);
        // SAFETY: as for `u64`, with 4-byte alignment.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// The low 32 bits of the live u64 counter at `offset`: the futex word for it.
    #[inline]
    pub(super) fn low_u32(&self, offset: usize) -> &'a AtomicU32 {
        assert!(offset % 8 == 0);
        // On little-endian targets (the only ones this crate builds for, see lib.rs) the
        // low half of a u64 is its first four bytes; the kernel's futex compare reads
        // these four bytes atomically.
        self.u32(offset)
    }

    // --- The engine's identity and state ---

    /// Writes the engine's pid and start time, then publishes `magic` (Release): all
    /// that was written into the region before happens-before an Acquire load seeing it.
    pub fn publish_engine(&self, pid: u32, start_time: u64) {
        self.u64(offsets::ENGINE_START_TIME)
            .store(start_time, Ordering::Relaxed);
        self.u32(offsets::ENGINE_PID).store(pid, Ordering::Relaxed);
        self.u64(offsets::MAGIC).store(MAGIC, Ordering::Release);
    }

    /// Whether the engine has published the header (`magic` set; Acquire).
    pub fn is_published(&self) -> bool {
        self.u64(offsets::MAGIC).load(Ordering::Acquire) != 0
    }

    pub fn engine_start_time(&self) -> u64 {
        self.u64(offsets::ENGINE_START_TIME).load(Ordering::Relaxed)
    }

    pub fn engine_state(&self) -> EngineState {
        EngineState::from_code(self.u32(offsets::ENGINE_STATE).load(Ordering::Acquire))
    }

    /// Frame 0 is published (Release: the frame's bytes happen-before it).
    pub fn set_engine_ready(&self) {
        self.u32(offsets::ENGINE_STATE)
            .store(EngineState::Ready.code(), Ordering::Release);
    }

    /// Marks the engine closed (SeqCst: it pairs with the client's SeqCst store of
    /// `client_cuda_state = OPEN` and load of `engine_state` at attach) and wakes a client
    /// asleep on a frame, on a reply or on room for a request.
    pub fn close_engine(&self) {
        self.u32(offsets::ENGINE_STATE)
            .store(EngineState::Closed.code(), Ordering::SeqCst);
        for word in [offsets::FRAME_SEQ, offsets::E2C_HEAD, offsets::C2E_TAIL] {
            os::futex_wake_all(self.low_u32(word));
        }
    }

    // --- The client slot ---

    pub fn client_state(&self) -> ClientState {
        ClientState::from_code(self.u32(offsets::CLIENT_STATE).load(Ordering::Acquire))
    }

    /// The attached client's `(pid, start time)` as last written.
    pub fn client_identity(&self) -> (u32, u64) {
        (
            self.u32(offsets::CLIENT_PID).load(Ordering::Relaxed),
            self.u64(offsets::CLIENT_START_TIME).load(Ordering::Relaxed),
        )
    }

    /// Claims the client slot for `(pid, start_time)`: moves `client_state` to
    /// `CLAIMING` (a free slot: none, closed, invalidated, or attached by a client that
    /// `client_alive` says is dead: `Region::client_alive`), then writes who claims it.
    /// Publish it with [`Self::attach_client`]. `AlreadyAttached` when a live client
    /// holds it or another one is claiming it. The [`Claim`] carries the identity the
    /// slot held before, for [`Self::publish_client_event`].
    pub fn claim_client(
        &self,
        name: &str,
        pid: u32,
        start_time: u64,
        client_alive: impl Fn(u32, u64) -> bool,
    ) -> Result<Claim> {
        let slot = self.u32(offsets::CLIENT_STATE);
        loop {
            let code = slot.load(Ordering::Acquire);
            match ClientState::from_code(code) {
                ClientState::None | ClientState::Closed | ClientState::Invalidated => {}
                ClientState::Attached => {
                    let (holder, start) = self.client_identity();
                    if client_alive(holder, start) {
                        return Err(Error::AlreadyAttached {
                            name: name.to_string(),
                            pid: holder,
                            pid_ns: Default::default(),
                        });
                    }
                }
                ClientState::Claiming | ClientState::Unknown(_) => {
                    return Err(Error::AlreadyAttached {
                        name: name.to_string(),
                        pid: self.client_identity().0,
                        pid_ns: Default::default(),
                    });
                }
            }
            if slot
                .compare_exchange(
                    code,
                    ClientState::Claiming.code(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                break;
            }
        }
        // Read while CLAIMING (no other claimer can write it now), before it is replaced.
        let previous = self.client_identity();
        self.u32(offsets::CLIENT_PID).store(pid, Ordering::Relaxed);
        self.u64(offsets::CLIENT_START_TIME)
            .store(start_time, Ordering::Relaxed);
        Ok(Claim {
            pid,
            start_time,
            previous,
        })
    }

    /// Ends the claim: `client_state = ATTACHED` (Release), so an engine that sees it
    /// also sees the pid, start time and event handle written while claiming; then rings
    /// the doorbell, waking an engine asleep on it waiting for a client.
    pub fn attach_client(&self) {
        self.u32(offsets::CLIENT_STATE)
            .store(ClientState::Attached.code(), Ordering::Release);
        crate::sync::post(&self.doorbell(), 0);
    }

    /// The engine's check of its client: `PeerClosed` or `PeerDied` when it is gone
    /// (`client_alive` judges: `Region::client_alive`). A client that died attached is
    /// marked `INVALIDATED`, so another may attach.
    pub fn check_client(&self, client_alive: impl Fn(u32, u64) -> bool) -> Result<()> {
        match self.client_state() {
            ClientState::Closed => Err(Error::PeerClosed { peer: Peer::Client }),
            ClientState::Invalidated => Err(Error::PeerDied {
                peer: Peer::Client,
                pid: self.client_identity().0,
                pid_ns: Default::default(),
                hint: "it was declared dead earlier",
            }),
            ClientState::Attached => {
                let (pid, start) = self.client_identity();
                if client_alive(pid, start) {
                    return Ok(());
                }
                // Free the slot so another client may attach: only if it is still this
                // client's (a client that closed meanwhile, and then exited, released
                // its lock: it closed, it did not die).
                let attached = ClientState::Attached.code();
                match self.u32(offsets::CLIENT_STATE).compare_exchange(
                    attached,
                    ClientState::Invalidated.code(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    // The slot may have been claimed and attached anew between the
                    // identity read above and the swap (another client that also found
                    // this one dead): the swap then hit the new client's ATTACHED.
                    // Its identity, written before that Release store, is visible
                    // after the AcqRel swap: give the slot back and judge the new one.
                    Ok(_) if self.client_identity() != (pid, start) => {
                        let _ = self.u32(offsets::CLIENT_STATE).compare_exchange(
                            ClientState::Invalidated.code(),
                            attached,
                            Ordering::AcqRel,
                            Ordering::Acquire,
                        );
                        self.check_client(client_alive)
                    }
                    Ok(_) => Err(Error::PeerDied {
                        peer: Peer::Client,
                        pid,
                        pid_ns: Default::default(),
                        hint: "the learner process exited without closing; restart it",
                    }),
                    // Closed, invalidated by another judge, or claimed anew: as it is now.
                    Err(_) => self.check_client(client_alive),
                }
            }
            _ => Ok(()),
        }
    }

    /// Marks the client closed (SeqCst) and wakes an engine asleep on its doorbell
    /// (1.1), its action counter (1.0), or on room for a reply.
    pub fn close_client(&self) {
        self.u32(offsets::CLIENT_STATE)
            .store(ClientState::Closed.code(), Ordering::SeqCst);
        os::futex_wake_all(self.u32(offsets::ENGINE_DOORBELL));
        os::futex_wake_all(self.low_u32(offsets::ACTION_SEQ));
        os::futex_wake_all(self.low_u32(offsets::E2C_TAIL));
    }

    // --- Counters, doorbell, rings ---

    /// `action_seq`, with the engine's waiter flag (1.0 engines sleep on it).
    #[inline]
    pub fn action_seq(&self) -> SharedSeq<'a> {
        SharedSeq {
            counter: self.u64(offsets::ACTION_SEQ),
            low: self.low_u32(offsets::ACTION_SEQ),
            waiting: self.u32(offsets::ENGINE_WAITING),
        }
    }

    /// `frame_seq`, with the client's waiter flag.
    #[inline]
    pub fn frame_seq(&self) -> SharedSeq<'a> {
        SharedSeq {
            counter: self.u64(offsets::FRAME_SEQ),
            low: self.low_u32(offsets::FRAME_SEQ),
            waiting: self.u32(offsets::CLIENT_WAITING),
        }
    }

    /// The live `(action_seq, frame_seq)` (Acquire).
    pub fn counters(&self) -> (u64, u64) {
        (
            self.u64(offsets::ACTION_SEQ).load(Ordering::Acquire),
            self.u64(offsets::FRAME_SEQ).load(Ordering::Acquire),
        )
    }

    /// The engine's doorbell (1.1), as a command push rings it.
    #[inline]
    pub fn doorbell(&self) -> Doorbell<'a> {
        Doorbell {
            bell: self.u32(offsets::ENGINE_DOORBELL),
            engine_waiting: self.u32(offsets::ENGINE_WAITING),
            action_seq: None,
        }
    }

    /// The doorbell as an action post rings it: `action_seq` stored, then the bell.
    #[inline]
    pub fn doorbell_with_action(&self) -> Doorbell<'a> {
        Doorbell {
            action_seq: Some(self.u64(offsets::ACTION_SEQ)),
            ..self.doorbell()
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::control::ReleaseAck;

    /// A control block in plain, aligned memory.
    #[repr(C, align(4096))]
    struct Block([u8; CONTROL_SIZE]);

    /// The typed view of `block`, with an engine (pid 42) published and ready.
    fn ready_engine(block: &mut Block) -> Control<'_> {
        // SAFETY: `block` is 4096-aligned, CONTROL_SIZE long and outlives the view
        // (its lifetime is the borrow's); only the view touches it meanwhile.
        let c = unsafe { Control::new(NonNull::new(block.0.as_mut_ptr()).unwrap()) };
        c.publish_engine(42, 7);
        c.set_engine_ready();
        c
    }

    /// The client closes (and exits, releasing its lock) between the engine's read of
    /// `ATTACHED` and its look at the client's liveness: the engine reports the close,
    /// and the slot stays `CLOSED`. Before the fix a plain store of `INVALIDATED` wrote
    /// over the client's `CLOSED`: a shard of a sharded region whose client closed then
    /// reported "the client died; it was declared dead earlier" (a client in other
    /// namespaces, 1 run in 30 of tests/containers.rs).
    #[test]
    fn a_client_that_closes_while_it_is_judged_is_closed_not_dead() {
        let mut block = Block([0; CONTROL_SIZE]);
        let c = ready_engine(&mut block);
        let claim = c.claim_client("r", 43, 8, |_, _| false).unwrap();
        let _ = claim;
        c.attach_client();
        let got = c.check_client(|_, _| {
            // The client closes and is gone before the liveness answer comes back.
            c.close_client();
            false
        });
        assert!(
            matches!(got, Err(Error::PeerClosed { peer: Peer::Client })),
            "{got:?}"
        );
        assert_eq!(c.client_state(), ClientState::Closed);
        // A client that dies attached is still marked dead, once.
        let claim = c.claim_client("r", 44, 9, |_, _| false).unwrap();
        let _ = claim;
        c.attach_client();
        assert!(matches!(
            c.check_client(|_, _| false),
            Err(Error::PeerDied { .. })
        ));
        assert_eq!(c.client_state(), ClientState::Invalidated);
    }

    /// Another client finds the dead one, claims the slot and attaches between the
    /// engine's read of the dead client's identity and its swap to `INVALIDATED`: the
    /// new, live client keeps the slot. Before the fix the swap hit its `ATTACHED` and
    /// the engine marked it dead.
    #[test]
    fn a_client_attached_while_the_engine_judges_a_dead_one_keeps_the_slot() {
        let mut block = Block([0; CONTROL_SIZE]);
        let c = ready_engine(&mut block);
        let _ = c.claim_client("r", 43, 8, |_, _| false).unwrap();
        c.attach_client();
        let got = c.check_client(|pid, _| {
            if pid == 43 {
                // Client 43 is dead; client 44 finds so too and attaches meanwhile.
                let _ = c.claim_client("r", 44, 9, |_, _| false).unwrap();
                c.attach_client();
                false
            } else {
                true
            }
        });
        assert!(got.is_ok(), "{got:?}");
        assert_eq!(c.client_state(), ClientState::Attached);
        assert_eq!(c.client_identity(), (44, 9));
    }

    /// The typed view over a plain, aligned buffer: what the methods store lands at the
    /// offsets `layout` documents.
    #[test]
    fn methods_touch_the_documented_fields() {
        let mut block = Block([0; CONTROL_SIZE]);
        // SAFETY: `block` is 4096-aligned, CONTROL_SIZE long and outlives `c`; only `c`
        // touches it until the header is read back below.
        let c = unsafe { Control::new(NonNull::new(block.0.as_mut_ptr()).unwrap()) };
        c.publish_engine(42, 7);
        assert!(c.is_published());
        c.set_engine_ready();
        let claim = c.claim_client("r", 43, 8, |_, _| false).unwrap();
        assert_eq!(claim.previous, (0, 0), "nobody held the slot");
        assert_eq!(
            c.publish_client_event(&[5; 64], &claim, false).unwrap(),
            ReleaseAck::Untagged
        );
        assert_eq!(c.read_client_event(), None, "not attached yet");
        c.attach_client();
        let seen = c.read_client_event().unwrap();
        assert_eq!((seen.pid, seen.start_time, seen.handle), (43, 8, [5; 64]));
        crate::sync::post(&c.doorbell_with_action(), 3);
        let h: crate::layout::Header = bytemuck::pod_read_unaligned(&block.0);
        assert_eq!((h.magic, h.engine_pid, h.engine_start_time), (MAGIC, 42, 7));
        assert_eq!(
            (h.engine_state, h.client_state, h.client_cuda_state),
            (1, 1, 1)
        );
        assert_eq!((h.client_pid, h.client_start_time), (43, 8));
        // The doorbell rang twice: at attach, and with the action.
        assert_eq!((h.action_seq, h.engine_doorbell), (3, 2));
        assert_eq!(h.client_event_handle, [5; 64]);
    }
}
