//! The live control block: a typed view of the words both processes read and write in
//! the first [`CONTROL_SIZE`] bytes of a region while it is served.
//!
//! [`crate::layout`] says where each field lies; this module is the only place that
//! turns those offsets into atomics. Everything else asks for what it means: claim the
//! client slot, publish the client's event handle, the sequence counters, the doorbell,
//! the ring control words, the states, the close acknowledgement of imported device
//! memory, and the wake-ups that go with closing. The states are enums here, encoded as
//! the `u32` codes `docs/protocol.md` lists; a value a peer wrote that is no known code
//! is kept as `Unknown`, never a panic.

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::error::{Error, Peer, Result};
use crate::layout::{offsets, ClientEventHandle, CONTROL_SIZE, MAGIC};
use crate::os;
use crate::sync::{Doorbell, SharedSeq};

/// `engine_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineState {
    /// Created, frame 0 not yet published.
    Starting,
    /// Frame 0 published, serving.
    Ready,
    /// Closed cleanly.
    Closed,
    /// Declared dead.
    Invalidated,
    /// A code this build does not know.
    Unknown(u32),
}

impl EngineState {
    pub const fn from_code(code: u32) -> EngineState {
        match code {
            0 => EngineState::Starting,
            1 => EngineState::Ready,
            2 => EngineState::Closed,
            3 => EngineState::Invalidated,
            other => EngineState::Unknown(other),
        }
    }
    pub const fn code(self) -> u32 {
        match self {
            EngineState::Starting => 0,
            EngineState::Ready => 1,
            EngineState::Closed => 2,
            EngineState::Invalidated => 3,
            EngineState::Unknown(c) => c,
        }
    }
    pub const fn name(self) -> &'static str {
        match self {
            EngineState::Starting => "starting",
            EngineState::Ready => "ready",
            EngineState::Closed => "closed",
            EngineState::Invalidated => "invalidated",
            EngineState::Unknown(_) => "unknown",
        }
    }
}

/// `client_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientState {
    /// No client attached (yet).
    None,
    /// A client is attached.
    Attached,
    /// Closed cleanly.
    Closed,
    /// Declared dead by the engine, which freed the slot.
    Invalidated,
    /// A client is claiming the slot (writing its pid and start time).
    Claiming,
    /// A code this build does not know.
    Unknown(u32),
}

impl ClientState {
    pub const fn from_code(code: u32) -> ClientState {
        match code {
            0 => ClientState::None,
            1 => ClientState::Attached,
            2 => ClientState::Closed,
            3 => ClientState::Invalidated,
            4 => ClientState::Claiming,
            other => ClientState::Unknown(other),
        }
    }
    pub const fn code(self) -> u32 {
        match self {
            ClientState::None => 0,
            ClientState::Attached => 1,
            ClientState::Closed => 2,
            ClientState::Invalidated => 3,
            ClientState::Claiming => 4,
            ClientState::Unknown(c) => c,
        }
    }
    pub const fn name(self) -> &'static str {
        match self {
            ClientState::None => "none",
            ClientState::Attached => "attached",
            ClientState::Claiming => "claiming",
            ClientState::Closed => "closed",
            ClientState::Invalidated => "invalidated",
            ClientState::Unknown(_) => "unknown",
        }
    }
}

/// `client_cuda_state` (1.2): whether the attached client holds imports of the engine's
/// device memory. The engine frees exported memory only when it is not `Open` (or the
/// client died).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceImport {
    /// The client holds no handle of this engine (never opened, or a host client).
    None,
    /// The client is opening or holds handles. Stored (SeqCst) before the first open.
    Open,
    /// The client closed every handle. Stored (SeqCst) after the last close.
    Released,
    /// A code this build does not know (not `Open`).
    Unknown(u32),
}

impl DeviceImport {
    pub const fn from_code(code: u32) -> DeviceImport {
        match code {
            0 => DeviceImport::None,
            1 => DeviceImport::Open,
            2 => DeviceImport::Released,
            other => DeviceImport::Unknown(other),
        }
    }
    pub const fn code(self) -> u32 {
        match self {
            DeviceImport::None => 0,
            DeviceImport::Open => 1,
            DeviceImport::Released => 2,
            DeviceImport::Unknown(c) => c,
        }
    }
}

/// Whether an engine may free its exported allocation now: the client holds no handle
/// (`client_cuda_state` is not `OPEN`: never opened, or released), or the process that
/// held them is dead (`client_alive` false: the driver closed them with it).
pub fn engine_may_free(client_cuda_state: u32, client_alive: bool) -> bool {
    DeviceImport::from_code(client_cuda_state) != DeviceImport::Open || !client_alive
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
    fn u64(&self, offset: usize) -> &'a AtomicU64 {
        assert!(offset % 8 == 0 && offset + 8 <= CONTROL_SIZE);
        // SAFETY: `new`'s contract: the mapping is 8-aligned, at least CONTROL_SIZE long
        // and mapped for `'a`; the offset is 8-aligned and inside it, so the pointer is
        // valid and aligned for AtomicU64 for `'a`. Both processes access it atomically.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU64) }
    }

    #[inline]
    fn u32(&self, offset: usize) -> &'a AtomicU32 {
        assert!(offset % 4 == 0 && offset + 4 <= CONTROL_SIZE);
        // SAFETY: as for `u64`, with 4-byte alignment.
        unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// The low 32 bits of the live u64 counter at `offset`: the futex word for it.
    #[inline]
    fn low_u32(&self, offset: usize) -> &'a AtomicU32 {
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
    /// holds it or another one is claiming it.
    pub fn claim_client(
        &self,
        name: &str,
        pid: u32,
        start_time: u64,
        client_alive: impl Fn(u32, u64) -> bool,
    ) -> Result<()> {
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
                        });
                    }
                }
                ClientState::Claiming | ClientState::Unknown(_) => {
                    return Err(Error::AlreadyAttached {
                        name: name.to_string(),
                        pid: self.client_identity().0,
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
        self.u32(offsets::CLIENT_PID).store(pid, Ordering::Relaxed);
        self.u64(offsets::CLIENT_START_TIME)
            .store(start_time, Ordering::Relaxed);
        Ok(())
    }

    /// While claiming (1.2): writes the client's event handle (published by
    /// [`Self::attach_client`]) and stores `client_cuda_state = OPEN` before any handle
    /// of the engine is opened. The SeqCst store of OPEN and load of `engine_state` pair
    /// with the engine's SeqCst store of CLOSED and load of `client_cuda_state` when it
    /// closes: either the engine sees OPEN (and does not free under the client) or the
    /// client sees CLOSED, acknowledges, gives the slot back and gets `PeerClosed`.
    pub fn publish_client_event(&self, handle: &[u8; 64]) -> Result<()> {
        for (i, chunk) in handle.chunks_exact(8).enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            self.u64(offsets::CLIENT_EVENT_HANDLE + 8 * i)
                .store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
        self.u32(offsets::CLIENT_CUDA_STATE)
            .store(DeviceImport::Open.code(), Ordering::SeqCst);
        let engine = self.u32(offsets::ENGINE_STATE).load(Ordering::SeqCst);
        if EngineState::from_code(engine) == EngineState::Closed {
            self.acknowledge_device_release();
            self.u32(offsets::CLIENT_STATE)
                .store(ClientState::Closed.code(), Ordering::Release);
            return Err(Error::PeerClosed { peer: Peer::Engine });
        }
        Ok(())
    }

    /// Ends the claim: `client_state = ATTACHED` (Release), so an engine that sees it
    /// also sees the pid, start time and event handle written while claiming; then rings
    /// the doorbell, waking an engine asleep on it waiting for a client.
    pub fn attach_client(&self) {
        self.u32(offsets::CLIENT_STATE)
            .store(ClientState::Attached.code(), Ordering::Release);
        crate::sync::post(&self.doorbell(), 0);
    }

    /// The attached client's pid, start time and event handle, read seqlock-style: the
    /// client writes them while `client_state = CLAIMING` and publishes them with its
    /// Release store of `ATTACHED`. Read `client_state` (Acquire), then the fields, then
    /// (after an Acquire fence) `client_state` and `client_pid` again, and retry if
    /// either changed; `None` when no client is attached. A re-attach by the same
    /// process between the two reads is not detected (same state, same pid): the handle
    /// could then mix two events, and opening it fails with a driver error rather than
    /// anything undefined.
    pub fn read_client_event(&self) -> Option<ClientEventHandle> {
        let st = self.u32(offsets::CLIENT_STATE);
        let pid_word = self.u32(offsets::CLIENT_PID);
        for _ in 0..1000 {
            let s1 = st.load(Ordering::Acquire);
            if ClientState::from_code(s1) != ClientState::Attached {
                return None;
            }
            let pid = pid_word.load(Ordering::Relaxed);
            let start_time = self.u64(offsets::CLIENT_START_TIME).load(Ordering::Relaxed);
            let mut handle = [0u8; 64];
            for (i, chunk) in handle.chunks_exact_mut(8).enumerate() {
                let w = self
                    .u64(offsets::CLIENT_EVENT_HANDLE + 8 * i)
                    .load(Ordering::Relaxed);
                chunk.copy_from_slice(&w.to_le_bytes());
            }
            fence(Ordering::Acquire);
            if st.load(Ordering::Relaxed) == s1 && pid_word.load(Ordering::Relaxed) == pid {
                return Some(ClientEventHandle {
                    pid,
                    start_time,
                    handle,
                });
            }
            std::hint::spin_loop();
        }
        None
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
                hint: "it was declared dead earlier",
            }),
            ClientState::Attached => {
                let (pid, start) = self.client_identity();
                if client_alive(pid, start) {
                    Ok(())
                } else {
                    // Free the slot so another client may attach.
                    self.u32(offsets::CLIENT_STATE)
                        .store(ClientState::Invalidated.code(), Ordering::Release);
                    Err(Error::PeerDied {
                        peer: Peer::Client,
                        pid,
                        hint: "the learner process exited without closing; restart it",
                    })
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

    // --- Imported device memory (1.2) ---

    pub fn device_import(&self) -> DeviceImport {
        DeviceImport::from_code(self.u32(offsets::CLIENT_CUDA_STATE).load(Ordering::SeqCst))
    }

    /// The client's close acknowledgement: `client_cuda_state = RELEASED`, stored after
    /// its last handle is closed (the closes happen-before an engine's load that sees it).
    pub fn acknowledge_device_release(&self) {
        self.u32(offsets::CLIENT_CUDA_STATE)
            .store(DeviceImport::Released.code(), Ordering::SeqCst);
    }

    /// For an engine that closed: whether it may free its exported memory now
    /// ([`engine_may_free`] of the live state and the client's liveness).
    pub fn device_memory_may_be_freed(&self) -> bool {
        let st = self.u32(offsets::CLIENT_CUDA_STATE).load(Ordering::SeqCst);
        let (pid, start) = self.client_identity();
        engine_may_free(st, os::process_alive(pid, start))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_codes_round_trip_and_unknown_codes_are_kept() {
        for code in 0..6 {
            assert_eq!(EngineState::from_code(code).code(), code);
            assert_eq!(ClientState::from_code(code).code(), code);
            assert_eq!(DeviceImport::from_code(code).code(), code);
        }
        assert_eq!(EngineState::from_code(7), EngineState::Unknown(7));
        assert_eq!(EngineState::from_code(7).name(), "unknown");
        assert_eq!(ClientState::from_code(4).name(), "claiming");
        assert_eq!(
            ClientState::from_code(u32::MAX),
            ClientState::Unknown(u32::MAX)
        );
    }

    #[test]
    fn engine_frees_only_without_a_live_importer() {
        let (none, open, released) = (
            DeviceImport::None.code(),
            DeviceImport::Open.code(),
            DeviceImport::Released.code(),
        );
        assert!(engine_may_free(none, true), "never opened");
        assert!(engine_may_free(released, true), "acknowledged");
        assert!(
            !engine_may_free(open, true),
            "a live client holds the handle"
        );
        assert!(engine_may_free(open, false), "the holder died");
        assert!(engine_may_free(77, true), "garbage is not OPEN");
    }

    /// The typed view over a plain, aligned buffer: what the methods store lands at the
    /// offsets `layout` documents.
    #[test]
    fn methods_touch_the_documented_fields() {
        #[repr(C, align(4096))]
        struct Block([u8; CONTROL_SIZE]);
        let mut block = Block([0; CONTROL_SIZE]);
        // SAFETY: `block` is 4096-aligned, CONTROL_SIZE long and outlives `c`; only `c`
        // touches it until the header is read back below.
        let c = unsafe { Control::new(NonNull::new(block.0.as_mut_ptr()).unwrap()) };
        c.publish_engine(42, 7);
        assert!(c.is_published());
        c.set_engine_ready();
        c.claim_client("r", 43, 8, |_, _| false).unwrap();
        c.publish_client_event(&[5; 64]).unwrap();
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
