//! The words of a client's device session (1.2, 1.5): the client's event handle, the
//! close acknowledgement of imported device memory (`client_cuda_state` and its session
//! tags) and the sessions that ended holding imports. The device backends use them at
//! attach and close; the lock-step loop never reads them.

use std::sync::atomic::{fence, Ordering};

use super::block::{Claim, Control};
use super::state::{ClientState, EngineState};
use crate::error::{Error, Peer, Result};
use crate::layout::{offsets, ClientEventHandle};
use crate::os;

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

/// `client_cuda_state` as 1.5 writes it: the state in bits 0..8, the tag of the session
/// that wrote it in bits 8..32 (a 1.2-1.4 client writes tag 0). Each client that claims
/// the slot of a 1.5 region takes the tag after the one it finds (never 0), so that a
/// late acknowledgement of an earlier session cannot mark a later one released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaWord {
    pub tag: u32,
    pub state: DeviceImport,
}

impl CudaWord {
    const TAG_SHIFT: u32 = 8;
    const TAG_MASK: u32 = 0x00ff_ffff;

    pub const fn from_word(word: u32) -> CudaWord {
        CudaWord {
            tag: word >> Self::TAG_SHIFT,
            state: DeviceImport::from_code(word & 0xff),
        }
    }

    pub const fn word(self) -> u32 {
        ((self.tag & Self::TAG_MASK) << Self::TAG_SHIFT) | (self.state.code() & 0xff)
    }

    /// Whether the session may still hold imports: any state but `NONE` and `RELEASED`
    /// (a code this build does not know included: only an acknowledgement frees).
    pub const fn may_hold(self) -> bool {
        !matches!(self.state, DeviceImport::None | DeviceImport::Released)
    }

    /// The tag a session that follows one tagged `tag` takes (24 bits, never 0).
    pub const fn next_tag(tag: u32) -> u32 {
        let next = tag.wrapping_add(1) & Self::TAG_MASK;
        if next == 0 {
            1
        } else {
            next
        }
    }
}

/// How a client acknowledges that it closed its last import of the engine's memory
/// ([`Control::publish_client_event`] says which; [`Control::acknowledge`] does it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReleaseAck {
    /// A 1.2-1.4 engine, which reads the word untagged: store `RELEASED`.
    #[default]
    Untagged,
    /// 1.5: the session `tag` this client took, and its process.
    Session { tag: u32, pid: u32, start_time: u64 },
}

/// Whether an engine may free its exported allocation now, as far as the last session
/// goes: it holds no handle (`client_cuda_state` is `NONE` or `RELEASED`: never opened,
/// or released; any other code counts as holding), or the process that held them is dead
/// (`client_alive` false: the driver closed them with it). 1.5 also requires every
/// earlier session that ended holding imports to be gone
/// ([`Control::device_memory_may_be_freed`]).
pub fn engine_may_free(client_cuda_state: u32, client_alive: bool) -> bool {
    !CudaWord::from_word(client_cuda_state).may_hold() || !client_alive
}

impl Control<'_> {
    /// While claiming (1.2): writes the client's event handle (published by
    /// [`Self::attach_client`]) and stores `client_cuda_state = OPEN` before any handle
    /// of the engine is opened. The SeqCst store of OPEN and load of `engine_state` pair
    /// with the engine's SeqCst store of CLOSED and load of `client_cuda_state` when it
    /// closes: either the engine sees OPEN (and does not free under the client) or the
    /// client sees CLOSED, acknowledges, gives the slot back and gets `PeerClosed`.
    ///
    /// `tagged` (a 1.5 region): OPEN goes in with a new session tag, by a SeqCst
    /// compare-and-swap from the word the previous session left; if that one still holds
    /// imports (not `RELEASED`) and was another process, it is first recorded in
    /// `client_cuda_ended`, so the engine waits for it too. Without `tagged` (a 1.2-1.4
    /// engine reads the word untagged) OPEN is stored as before. Returns how to
    /// acknowledge this session's release.
    pub fn publish_client_event(
        &self,
        handle: &[u8; 64],
        claim: &Claim,
        tagged: bool,
    ) -> Result<ReleaseAck> {
        for (i, chunk) in handle.chunks_exact(8).enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            self.u64(offsets::CLIENT_EVENT_HANDLE + 8 * i)
                .store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
        let word = self.u32(offsets::CLIENT_CUDA_STATE);
        let ack = if tagged {
            let me = (claim.pid, claim.start_time);
            let mut seen = word.load(Ordering::SeqCst);
            loop {
                let prev = CudaWord::from_word(seen);
                let recorded = if prev.may_hold() && claim.previous.0 != 0 && claim.previous != me {
                    self.record_ended(prev.tag, claim.previous)
                } else {
                    None
                };
                let tag = CudaWord::next_tag(prev.tag);
                let open = CudaWord {
                    tag,
                    state: DeviceImport::Open,
                }
                .word();
                // Only the previous session changes the word meanwhile (its late
                // RELEASED): then its entry is not needed, and the swap is retried.
                match word.compare_exchange(seen, open, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(_) => {
                        break ReleaseAck::Session {
                            tag,
                            pid: claim.pid,
                            start_time: claim.start_time,
                        }
                    }
                    Err(now) => {
                        if let Some((slot, key)) = recorded {
                            let _ = self.u64(slot).compare_exchange(
                                key,
                                0,
                                Ordering::AcqRel,
                                Ordering::Relaxed,
                            );
                        }
                        seen = now;
                    }
                }
            }
        } else {
            word.store(DeviceImport::Open.code(), Ordering::SeqCst);
            ReleaseAck::Untagged
        };
        let engine = self.u32(offsets::ENGINE_STATE).load(Ordering::SeqCst);
        if EngineState::from_code(engine) == EngineState::Closed {
            self.acknowledge(ack);
            self.u32(offsets::CLIENT_STATE)
                .store(ClientState::Closed.code(), Ordering::Release);
            return Err(Error::PeerClosed { peer: Peer::Engine });
        }
        Ok(ack)
    }

    /// Records that session `tag` of `(pid, start_time)` ended holding imports: in a free
    /// entry of `client_cuda_ended`, else one of a dead process, else (all held by live
    /// ones) by setting `client_cuda_overflow`, after which the engine never frees.
    /// Returns the entry's word offset and value. Only a claiming client calls this (one
    /// at a time); other processes only clear entries.
    fn record_ended(&self, tag: u32, (pid, start_time): (u32, u64)) -> Option<(usize, u64)> {
        let key = (u64::from(pid) << 32) | u64::from(tag);
        for reclaim_dead in [false, true] {
            for off in offsets::CLIENT_CUDA_ENDED {
                let entry = self.u64(off);
                let cur = entry.load(Ordering::Acquire);
                if cur != 0 {
                    let start = self.u64(off + 8).load(Ordering::Relaxed);
                    if !reclaim_dead
                        || os::process_alive((cur >> 32) as u32, start)
                        || entry
                            .compare_exchange(cur, 0, Ordering::AcqRel, Ordering::Relaxed)
                            .is_err()
                    {
                        continue;
                    }
                }
                // The start time first: the Release below publishes it with the key.
                self.u64(off + 8).store(start_time, Ordering::Relaxed);
                if entry
                    .compare_exchange(0, key, Ordering::Release, Ordering::Relaxed)
                    .is_ok()
                {
                    return Some((off, key));
                }
            }
        }
        self.u32(offsets::CLIENT_CUDA_OVERFLOW)
            .store(1, Ordering::SeqCst);
        None
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

    /// The state of `client_cuda_state` (its tag aside).
    pub fn device_import(&self) -> DeviceImport {
        self.cuda_word().state
    }

    /// `client_cuda_state`: the state and the session tag (1.5; 0 from a 1.2-1.4 client).
    pub fn cuda_word(&self) -> CudaWord {
        CudaWord::from_word(self.u32(offsets::CLIENT_CUDA_STATE).load(Ordering::SeqCst))
    }

    /// The untagged close acknowledgement (a 1.2-1.4 engine): `client_cuda_state =
    /// RELEASED`, stored after its last handle is closed (the closes happen-before an
    /// engine's load that sees it).
    pub fn acknowledge_device_release(&self) {
        self.u32(offsets::CLIENT_CUDA_STATE)
            .store(DeviceImport::Released.code(), Ordering::SeqCst);
    }

    /// The client's close acknowledgement, once this process holds no import of the
    /// engine's memory any more (its last handle closed).
    pub fn acknowledge(&self, ack: ReleaseAck) {
        match ack {
            ReleaseAck::Untagged => self.acknowledge_device_release(),
            ReleaseAck::Session {
                tag,
                pid,
                start_time,
            } => self.acknowledge_session(tag, pid, start_time),
        }
    }

    /// 1.5: `(tag, OPEN)` → `(tag, RELEASED)` by compare-and-swap, so a late one never
    /// touches a later session's word; every `client_cuda_ended` entry of this process
    /// cleared. Also releases the current session when it is this process's and has
    /// closed (`client_state = CLOSED`): repeated clients of one process share its
    /// imports, so a later one's close leaves OPEN while an earlier one's views hold
    /// them, and this process now holds none.
    fn acknowledge_session(&self, tag: u32, pid: u32, start_time: u64) {
        let word = self.u32(offsets::CLIENT_CUDA_STATE);
        let mine = CudaWord {
            tag,
            state: DeviceImport::Open,
        }
        .word();
        let mut seen = word.load(Ordering::SeqCst);
        loop {
            let cur = CudaWord::from_word(seen);
            let ours = seen == mine
                || (cur.state == DeviceImport::Open
                    && self.client_identity() == (pid, start_time)
                    && self.client_state() == ClientState::Closed);
            if !ours {
                break;
            }
            let released = CudaWord {
                tag: cur.tag,
                state: DeviceImport::Released,
            }
            .word();
            match word.compare_exchange(seen, released, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => break,
                Err(now) => seen = now,
            }
        }
        // A claimer that replaced our OPEN recorded us before its swap, which our load
        // above (SeqCst) saw: its entry is visible here.
        for off in offsets::CLIENT_CUDA_ENDED {
            let entry = self.u64(off);
            let cur = entry.load(Ordering::Acquire);
            if cur != 0
                && (cur >> 32) as u32 == pid
                && self.u64(off + 8).load(Ordering::Relaxed) == start_time
            {
                let _ = entry.compare_exchange(cur, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }

    /// For an engine that closed: whether it may free its exported memory now. The last
    /// session: [`engine_may_free`] of the live word and the current client's liveness.
    /// 1.5: and every session recorded in `client_cuda_ended` is gone (acknowledged, or
    /// its process dead), and none was lost (`client_cuda_overflow` clear). In a 1.2-1.4
    /// region these words are all 0.
    pub fn device_memory_may_be_freed(&self) -> bool {
        let st = self.u32(offsets::CLIENT_CUDA_STATE).load(Ordering::SeqCst);
        let (pid, start) = self.client_identity();
        engine_may_free(st, os::process_alive(pid, start)) && self.ended_sessions_gone()
    }

    /// No session recorded in `client_cuda_ended` may still hold imports, and none was
    /// lost: each entry is free or of a dead process. An entry is read seqlock-style (its
    /// key again after the start time); one that keeps changing counts as alive.
    fn ended_sessions_gone(&self) -> bool {
        if self
            .u32(offsets::CLIENT_CUDA_OVERFLOW)
            .load(Ordering::SeqCst)
            != 0
        {
            return false;
        }
        offsets::CLIENT_CUDA_ENDED.iter().all(|&off| {
            let entry = self.u64(off);
            for _ in 0..100 {
                let key = entry.load(Ordering::Acquire);
                if key == 0 {
                    return true;
                }
                let start = self.u64(off + 8).load(Ordering::Relaxed);
                fence(Ordering::Acquire);
                if entry.load(Ordering::Relaxed) == key {
                    return !os::process_alive((key >> 32) as u32, start);
                }
            }
            false
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

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
        assert!(
            !engine_may_free(77, true),
            "a code this build does not know is not an acknowledgement"
        );
        let tagged = |tag, state| CudaWord { tag, state }.word();
        assert!(!engine_may_free(tagged(9, DeviceImport::Open), true));
        assert!(engine_may_free(tagged(9, DeviceImport::Released), true));
    }

    #[test]
    fn session_tags_round_trip_and_never_wrap_to_zero() {
        for (tag, state) in [(0, DeviceImport::Open), (1, DeviceImport::Released)] {
            let w = CudaWord { tag, state };
            assert_eq!(CudaWord::from_word(w.word()), w);
        }
        let w = CudaWord {
            tag: 0xff_ffff,
            state: DeviceImport::Open,
        };
        assert_eq!(CudaWord::from_word(w.word()), w);
        // 1.2-1.4 codes are tag 0.
        assert_eq!(CudaWord::from_word(2).state, DeviceImport::Released);
        assert_eq!(CudaWord::next_tag(0), 1);
        assert_eq!(CudaWord::next_tag(0xff_ffff), 1);
        assert_eq!(CudaWord::next_tag(u32::MAX), 1);
        assert_eq!(
            CudaWord::from_word(u32::MAX).state,
            DeviceImport::Unknown(0xff)
        );
        assert!(CudaWord::from_word(u32::MAX).may_hold());
    }

    /// Per-session acknowledgement (1.5) on a real region, with real processes for the
    /// liveness the engine checks: live and reaped children.
    mod sessions {
        use super::*;
        use crate::layout::{DType, Direction, HeaderBuilder, TensorSpec, CUDA_ENDED_SLOTS};
        use crate::region::{random_name, Region};
        use std::process::{Child, Command, Stdio};

        fn region() -> Region {
            let specs = [TensorSpec::new(
                "obs",
                DType::F32,
                &[1],
                Direction::EngineToClient,
            )];
            let b = HeaderBuilder::new("acks", 1, &specs, 0).unwrap();
            let r = Region::create(&random_name().unwrap(), &b).unwrap();
            r.control().publish_engine(os::current_pid(), 1);
            r.control().set_engine_ready();
            r
        }

        /// A live process other than this one (killed and reaped by `dead`).
        struct Other(Child, u64);
        impl Other {
            fn spawn() -> Other {
                let child = Command::new("cat")
                    .stdin(Stdio::piped())
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("spawn cat");
                let start = os::process_start_time(child.id()).expect("its start time");
                Other(child, start)
            }
            fn id(&self) -> (u32, u64) {
                (self.0.id(), self.1)
            }
            /// Kills and reaps it: its (pid, start) names no process afterwards.
            fn dead(mut self) -> (u32, u64) {
                let id = self.id();
                self.0.kill().unwrap();
                self.0.wait().unwrap();
                assert!(!os::process_alive(id.0, id.1));
                id
            }
        }
        impl Drop for Other {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }

        fn me() -> (u32, u64) {
            let pid = os::current_pid();
            (pid, os::process_start_time(pid).unwrap())
        }

        /// One session: claim, OPEN (tagged), ATTACHED.
        fn open(c: Control<'_>, (pid, start): (u32, u64)) -> ReleaseAck {
            let claim = c
                .claim_client("acks", pid, start, |p, s| os::process_alive(p, s))
                .unwrap();
            let ack = c.publish_client_event(&[1; 64], &claim, true).unwrap();
            c.attach_client();
            ack
        }

        #[test]
        fn a_late_ack_cannot_release_a_later_session_and_the_engine_waits_for_the_earlier_one() {
            let r = region();
            let c = r.control();
            let a = Other::spawn();
            let ack_a = open(c, a.id());
            // A closes while a view still holds its imports: no acknowledgement.
            c.close_client();
            let ack_b = open(c, me());
            assert_ne!(ack_a, ack_b, "each session has its own tag");
            // A's last view dies while B is attached.
            c.acknowledge(ack_a);
            assert_eq!(
                c.device_import(),
                DeviceImport::Open,
                "B still holds its imports"
            );
            assert!(!c.device_memory_may_be_freed(), "B is open and alive");
            c.acknowledge(ack_b);
            c.close_client();
            assert_eq!(c.device_import(), DeviceImport::Released);
            assert!(
                c.device_memory_may_be_freed(),
                "A acknowledged under its own tag"
            );
        }

        /// A (another, live process) closes with its views alive; B (this process) then
        /// attaches, releases and closes cleanly. Returns A and its acknowledgement.
        fn a_lingers_after_b_released(c: Control<'_>) -> (Other, ReleaseAck) {
            let a = Other::spawn();
            let ack_a = open(c, a.id());
            c.close_client();
            let ack_b = open(c, me());
            c.acknowledge(ack_b);
            c.close_client();
            assert_eq!(c.device_import(), DeviceImport::Released, "B released");
            assert!(
                !c.device_memory_may_be_freed(),
                "A closed without acknowledging and its process lives"
            );
            (a, ack_a)
        }

        #[test]
        fn a_session_that_ended_holding_imports_keeps_the_memory_until_its_process_dies() {
            let r = region();
            let (a, _) = a_lingers_after_b_released(r.control());
            a.dead();
            assert!(
                r.control().device_memory_may_be_freed(),
                "A died: the driver closed its imports"
            );
        }

        #[test]
        fn an_earlier_sessions_late_ack_after_a_later_one_released_frees() {
            let r = region();
            let (_a, ack_a) = a_lingers_after_b_released(r.control());
            r.control().acknowledge(ack_a);
            assert!(
                r.control().device_memory_may_be_freed(),
                "both sessions acknowledged"
            );
        }

        /// Repeated clients of one process share its imports: a later one's close leaves
        /// OPEN while the earlier one's views hold them, and their drop releases both.
        #[test]
        fn sessions_of_one_process_are_released_by_its_last_close() {
            let r = region();
            let c = r.control();
            let ack_a = open(c, me());
            c.close_client();
            let _ack_b = open(c, me());
            c.close_client();
            assert!(
                !c.device_memory_may_be_freed(),
                "this process still maps the memory"
            );
            c.acknowledge(ack_a);
            assert_eq!(c.device_import(), DeviceImport::Released);
            assert!(c.device_memory_may_be_freed());
        }

        /// A later client of the same process attached and not yet closed keeps OPEN even
        /// if the earlier session's views drop (it may be about to open).
        #[test]
        fn an_earlier_sessions_ack_leaves_an_attached_session_of_the_same_process_open() {
            let r = region();
            let c = r.control();
            let ack_a = open(c, me());
            c.close_client();
            let _ack_b = open(c, me());
            c.acknowledge(ack_a);
            assert_eq!(c.device_import(), DeviceImport::Open);
        }

        #[test]
        fn more_ended_sessions_than_entries_keep_the_memory() {
            let r = region();
            let c = r.control();
            let others: Vec<Other> = (0..CUDA_ENDED_SLOTS + 1).map(|_| Other::spawn()).collect();
            let acks: Vec<ReleaseAck> = others
                .iter()
                .map(|o| {
                    let ack = open(c, o.id());
                    c.close_client();
                    ack
                })
                .collect();
            let last = open(c, me());
            for ack in acks.into_iter().chain([last]) {
                c.acknowledge(ack);
            }
            c.close_client();
            assert!(
                !c.device_memory_may_be_freed(),
                "one session could not be recorded: the engine cannot know it is gone"
            );
            drop(others);
        }

        /// An entry of a dead process is reused.
        #[test]
        fn entries_of_dead_processes_are_reused() {
            let r = region();
            let c = r.control();
            let dead: Vec<Other> = (0..CUDA_ENDED_SLOTS).map(|_| Other::spawn()).collect();
            for o in &dead {
                open(c, o.id());
                c.close_client();
            }
            let live = Other::spawn();
            open(c, live.id());
            for o in dead {
                o.dead();
            }
            c.close_client();
            // Recording `live` (the previous session) takes a dead one's entry.
            let ack = open(c, me());
            c.acknowledge(ack);
            c.close_client();
            assert!(!c.device_memory_may_be_freed(), "`live` is recorded");
            live.dead();
            assert!(c.device_memory_may_be_freed());
        }
    }
}
