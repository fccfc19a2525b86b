//! Read-only observers of a live region (protocol 1.7, `docs/protocol.md` §5.9): any
//! number of processes that watch an engine serve its client, without being either.
//!
//! An observer opens the region `O_RDONLY`, maps nothing and takes no lock: it is
//! not the client, nobody waits for it, it cannot change a byte, and liveness checks and
//! `gc` never see it. It copies engine→client tensors between the engine's writes: an
//! engine writes them during a step, from the client's action `n` to its frame `n`, and
//! in a command's handler (a reset), which it brackets with the write sequence in its
//! block of the stats area (odd while it writes). A copy counts only if, before it,
//! every shard's frame was the client's last action and every write sequence even, and
//! nothing of that moved after it ([`crate::control::read_between_writes`]); otherwise it
//! is thrown away and tried again later. An observer does not map the region: every byte
//! it reads, the control words (the sequences, states and frame counters, each one
//! 8-byte-aligned `pread`, [`SeqWord`]) as much as the copies, comes from `pread` of the
//! region file, so a file truncated under the observer at any moment is a short read
//! (`RegionTooSmall`), never a SIGBUS. Buffers are sized by the validated header and
//! allocated fallibly ([`Observer::buffers`]): a header that promises more than this
//! process can hold is an `Io` error of kind `OutOfMemory`, never an abort. Whether the
//! engine lives is judged by the lock it holds on byte 0 of the region file (each shard
//! on its own byte), asked with `F_OFD_GETLK`, which takes nothing.
//!
//! Retries sleep (tens of microseconds, then up to a millisecond) rather than spin: a
//! reader spinning on the engine's cache line would make each of the engine's stores to
//! it a cache miss.

use std::fs::File;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::control::{read_between_writes, read_consistent, EngineState, SeqWord};
use crate::error::{Error, Peer, PidNamespace, Result};
use crate::layout::{
    offsets, stats_offsets, Direction, EpisodeEntry, Layout, Location, ShardInfo, StatsArea,
    StatsBlock, TensorId, TensorInfo, RECENT_EPISODES, STATS_BLOCK_SIZE,
};
use crate::os;
use crate::primitive::{fence, Ordering};
use crate::region::{self, Region};
use crate::shard;
use crate::sync::Backoff;

/// Rows `envs` (along the first axis, the env axis) of one engine→client host tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    pub tensor: TensorId,
    pub envs: Range<u32>,
}

/// One finished episode, as the stats area remembers it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Episode {
    /// The shard whose block holds it (0 for an unsharded region).
    pub shard: u32,
    /// Its number among the episodes that shard saw end, from 0.
    pub number: u64,
    pub env: u32,
    pub episode_return: f64,
    pub length: u32,
}

/// What the stats area said at one moment, summed over the shards.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsSnapshot {
    /// The frame published when it was read (the lowest shard's).
    pub frame: u64,
    /// Episodes that ended, ever.
    pub episodes: u64,
    pub return_sum: f64,
    pub length_sum: u64,
    /// The last episodes (at most [`RECENT_EPISODES`] per shard), oldest first within
    /// each shard.
    pub recent: Vec<Episode>,
}

/// A read-only observer of one region.
#[derive(Debug)]
pub struct Observer {
    name: String,
    /// The region file, open `O_RDONLY`: read with `pread` only, never mapped.
    file: File,
    layout: Layout,
    stats: StatsArea,
    /// Where the engine's pid means something: this PID namespace if it showed the
    /// engine at attach, else another one (an engine in another container).
    engine_pid_ns: PidNamespace,
}

/// How long [`Observer::read`] sleeps after a torn copy, at first and at most.
const RETRY_FIRST: Duration = Duration::from_micros(50);
const RETRY_MAX: Duration = Duration::from_millis(1);
/// How often a retrying read checks that the engine still lives.
const CHECK_EVERY: Duration = Duration::from_millis(10);

impl Observer {
    /// Observes region `name` (the name an engine printed): opens it read-only, validates
    /// its header, and waits up to `timeout` until the engine (every shard) has
    /// published frame 0. `NotFound` at once when no region has the name;
    /// `InvalidHeader` (field `flags`) for an engine of an earlier version, which keeps
    /// no write sequence to copy by.
    pub fn attach(name: &str, timeout: Duration) -> Result<Observer> {
        let name = region::canonical_name(name)?;
        let start = Instant::now();
        let (file, layout) = Region::open_observer(&name, timeout)?;
        let Some(stats) = layout.stats else {
            return Err(Error::InvalidHeader {
                field: "flags",
                reason: format!(
                    "region '{name}' has no stats area (flags bit 0 clear): its engine \
                     predates observers (protocol {}.{} < 1.7) and does not mark its writes \
                     for them; serve it with this version",
                    layout.version.0, layout.version.1
                ),
            });
        };
        // The words read as one aligned `pread` each (validation placed them so: checked
        // again, a word that straddles two pages could be read torn).
        for s in &layout.shards {
            let w = &s.words;
            if stats.block(s.index) % 8 != 0
                || w.frame_seq % 8 != 0
                || w.action_seq % 8 != 0
                || w.state % 4 != 0
            {
                return Err(Error::InvalidHeader {
                    field: "shard table",
                    reason: format!("shard {}'s words are not aligned", s.index),
                });
            }
        }
        // Alive (it holds its lock) and not shown here: it lives in another PID namespace.
        let engine_pid_ns = match os::byte_locked(&file, 0)? {
            true => os::pid_namespace(layout.engine_pid, layout.engine_start_time),
            false => PidNamespace::This,
        };
        let observer = Observer {
            name,
            file,
            layout,
            stats,
            engine_pid_ns,
        };
        let mut backoff = Backoff::default();
        while !observer.ready()? {
            observer.check()?;
            if start.elapsed() >= timeout {
                return Err(Error::Timeout {
                    waited: timeout,
                    what: "the engine to publish frame 0",
                });
            }
            backoff.snooze();
        }
        Ok(observer)
    }

    /// The region's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The region's layout: its tensors, envs and shards.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Reads `out.len()` bytes at byte `offset` of the region file with `pread`: a file
    /// truncated meanwhile gives `RegionTooSmall`, not a SIGBUS.
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let filled = os::read_at(&self.file, offset, out)
            .map_err(|e| Error::io(format!("reading '{}'", self.name), e))?;
        if filled < out.len() {
            return Err(self.too_small(os::file_identity(&self.file)?.0));
        }
        Ok(())
    }

    fn too_small(&self, actual: u64) -> Error {
        Error::RegionTooSmall {
            needed: self.layout.region_size,
            actual,
        }
    }

    /// `RegionTooSmall` if the file is now shorter than the header says.
    fn check_size(&self) -> Result<()> {
        let (size, _, _) = os::file_identity(&self.file)?;
        if size < self.layout.region_size {
            return Err(self.too_small(size));
        }
        Ok(())
    }

    /// The u32 word at byte `offset`, with one `pread`.
    fn u32_at(&self, offset: usize) -> Result<u32> {
        let mut b = [0u8; 4];
        self.read_at(offset as u64, &mut b)?;
        Ok(u32::from_ne_bytes(b))
    }

    /// The u64 word at byte `offset`, with one `pread`.
    fn u64_at(&self, offset: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read_at(offset, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    fn word(&self, offset: u64) -> FileWord<'_> {
        FileWord {
            observer: self,
            offset,
        }
    }

    fn state_of(&self, s: &ShardInfo) -> Result<EngineState> {
        Ok(EngineState::from_code(self.u32_at(s.words.state)?))
    }

    /// Whether every shard has published frame 0.
    fn ready(&self) -> Result<bool> {
        self.check_size()?;
        for s in &self.layout.shards {
            if self.state_of(s)? != EngineState::Ready {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether the engine still serves the region: `RegionTooSmall` if the file was
    /// truncated, `PeerClosed` once it closed, `PeerDied` (`ShardDied`, `ShardClosed` for
    /// a sharded region) once it is gone. Takes no lock and removes nothing: that is
    /// the client's and `gc`'s business.
    pub fn check(&self) -> Result<()> {
        self.check_size()?;
        if EngineState::from_code(self.u32_at(offsets::ENGINE_STATE)?) == EngineState::Closed {
            return Err(Error::PeerClosed { peer: Peer::Engine });
        }
        if self.layout.is_sharded() {
            return shard::check_shards_by(&self.file, &self.layout, None, |s| {
                Ok((self.state_of(s)?, self.u32_at(s.words.pid)?))
            });
        }
        if !os::byte_locked(&self.file, 0)? {
            return Err(Error::PeerDied {
                peer: Peer::Engine,
                pid: self.layout.engine_pid,
                pid_ns: self.engine_pid_ns,
                hint: "the region it served is left to its client or `shmbridge gc`",
            });
        }
        Ok(())
    }

    /// The frame published last (every shard's; the lowest while a step is under way).
    pub fn frame(&self) -> Result<u64> {
        self.check_size()?;
        let mut frame = u64::MAX;
        for s in &self.layout.shards {
            frame = frame.min(self.u64_at(s.words.frame_seq as u64)?);
        }
        Ok(frame)
    }

    /// Names rows `envs` of tensor `name` for [`Observer::read`]: an engine→client tensor
    /// in host memory (client→engine ones are written while the engine's sequence is
    /// even, and device memory is not the region's), `envs` inside the env axis. A
    /// tensor whose first axis is not the env axis can only be picked whole
    /// (`0..num_envs`).
    pub fn pick(&self, name: &str, envs: Range<u32>) -> Result<Pick> {
        let tensor = self.layout.id(name)?;
        let t = &self.layout.tensors[tensor.index()];
        let refuse = |reason: &str| {
            Err(Error::InvalidTensor {
                tensor: t.name.clone(),
                reason: reason.into(),
            })
        };
        if t.direction != Direction::EngineToClient {
            return refuse(
                "written by the client: observers read engine->client tensors, which hold \
                 still between the engine's writes",
            );
        }
        if t.location() != Location::Host {
            return refuse(&format!(
                "lives in {} memory: observers read host tensors only (an exported device \
                 allocation would give them write access; serve images on the host to \
                 watch them)",
                t.location().name()
            ));
        }
        let n = self.layout.num_envs;
        let whole = envs == (0..n);
        if envs.is_empty() || envs.end > n || (!whole && t.shape[0] != u64::from(n)) {
            return refuse(&format!(
                "envs {envs:?}: pick a non-empty range of 0..{n} (a tensor whose first axis \
                 is not the {n} envs only whole)"
            ));
        }
        Ok(Pick { tensor, envs })
    }

    /// Where a pick's bytes lie in the region: (offset, length).
    fn span(&self, pick: &Pick) -> (u64, u64) {
        let t: &TensorInfo = &self.layout.tensors[pick.tensor.index()];
        let n = u64::from(self.layout.num_envs);
        if pick.envs == (0..self.layout.num_envs) || t.shape[0] != n {
            return (t.offset, t.nbytes);
        }
        let row = t.nbytes / n;
        (
            t.offset + row * u64::from(pick.envs.start),
            row * u64::from(pick.envs.end - pick.envs.start),
        )
    }

    /// Bytes a pick copies.
    pub fn pick_len(&self, pick: &Pick) -> usize {
        self.span(pick).1 as usize
    }

    /// One zeroed buffer per pick, of its length, for [`Observer::read`]: allocated
    /// fallibly, so a tensor larger than this process can hold (a hostile header over a
    /// sparse file may promise any size) is an `Io` error of kind `OutOfMemory`, not an
    /// abort.
    pub fn buffers(&self, picks: &[Pick]) -> Result<Vec<Vec<u8>>> {
        picks
            .iter()
            .map(|pick| {
                let len = self.pick_len(pick);
                let mut buf = Vec::new();
                buf.try_reserve_exact(len).map_err(|_| {
                    Error::io(
                        format!(
                            "allocating {len} bytes to copy tensor '{}' of '{}'",
                            self.layout.tensors[pick.tensor.index()].name,
                            self.name
                        ),
                        std::io::ErrorKind::OutOfMemory,
                    )
                })?;
                buf.resize(len, 0);
                Ok(buf)
            })
            .collect()
    }

    /// One try at copying `picks` into `out` (one buffer per pick, each of its
    /// [`Observer::pick_len`]; [`Observer::buffers`] makes them) while no engine writes:
    /// the frame they hold, or `None` when a step was under way (the client's last
    /// action not yet answered by every shard) or a write overlapped the copy, and
    /// nothing in `out` is to be trusted. The engine's end is an error first
    /// ([`Observer::check`]): what a dead engine left is not a live frame.
    pub fn try_read<B: AsMut<[u8]>>(&self, picks: &[Pick], out: &mut [B]) -> Result<Option<u64>> {
        if picks.len() != out.len() {
            return Err(Error::InvalidSpec(format!(
                "{} buffers for {} picks: one buffer per pick",
                out.len(),
                picks.len()
            )));
        }
        for (pick, buf) in picks.iter().zip(out.iter_mut()) {
            let (len, want) = (buf.as_mut().len(), self.pick_len(pick));
            if len != want {
                return Err(Error::InvalidTensor {
                    tensor: self.layout.tensors[pick.tensor.index()].name.clone(),
                    reason: format!("a {len}-byte buffer for a {want}-byte copy"),
                });
            }
        }
        self.check()?;
        let seqs: Vec<_> = (self.layout.shards.iter())
            .map(|s| self.word(self.stats.block(s.index) + stats_offsets::WRITE_SEQ as u64))
            .collect();
        let frames: Vec<_> = (self.layout.shards.iter())
            .map(|s| self.word(s.words.frame_seq as u64))
            .collect();
        let action = self.word(offsets::ACTION_SEQ as u64);
        let shard_actions: Vec<_> = (self.layout.shards.iter())
            .filter(|_| self.layout.shard_actions)
            .map(|s| self.word(s.words.action_seq as u64))
            .collect();
        let mut failed = None;
        let copied = read_between_writes(&seqs, action, &shard_actions, &frames, |frame| {
            for (pick, buf) in picks.iter().zip(out.iter_mut()) {
                if let Err(e) = self.read_at(self.span(pick).0, buf.as_mut()) {
                    failed = Some(e);
                    break;
                }
            }
            frame
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        Ok(copied)
    }

    /// Copies `picks` into `out` as [`Observer::try_read`] does, trying again (sleeping
    /// between tries, never spinning) until a copy is whole; returns its frame. `Timeout`
    /// if none is within `timeout` (an engine that writes all the time, or a learner
    /// that posts its next action the moment a frame is out, leaves gaps shorter than
    /// the copy); the engine's end is an error as [`Observer::check`] says.
    pub fn read<B: AsMut<[u8]>>(
        &self,
        picks: &[Pick],
        out: &mut [B],
        timeout: Duration,
    ) -> Result<u64> {
        self.retrying(timeout, "a frame between the engine's writes", || {
            self.try_read(picks, out)
        })
    }

    /// One try at reading the stats area while no engine records an episode (the stats
    /// have a sequence of their own: steps do not get in the way); `frame` is the lowest
    /// frame the shards had published.
    pub fn try_stats(&self) -> Result<Option<StatsSnapshot>> {
        self.check()?;
        let seqs: Vec<_> = (self.layout.shards.iter())
            .map(|s| self.word(self.stats.block(s.index) + stats_offsets::STATS_SEQ as u64))
            .collect();
        // At most MAX_SHARDS blocks: validation bounds the area.
        let mut bytes = vec![0u8; self.stats.len() as usize];
        let mut failed = None;
        let frame = read_consistent(&seqs, || {
            let frame = self.frame();
            if let Err(e) = self.read_at(self.stats.offset, &mut bytes) {
                failed = Some(e);
            }
            frame
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        let Some(frame) = frame.transpose()? else {
            return Ok(None);
        };
        let mut snapshot = StatsSnapshot {
            frame,
            episodes: 0,
            return_sum: 0.0,
            length_sum: 0,
            recent: Vec::new(),
        };
        for (shard, raw) in bytes.chunks_exact(STATS_BLOCK_SIZE).enumerate() {
            let block: StatsBlock = bytemuck::pod_read_unaligned(raw);
            snapshot.episodes = snapshot.episodes.wrapping_add(block.episodes);
            snapshot.return_sum += block.return_sum;
            snapshot.length_sum = snapshot.length_sum.wrapping_add(block.length_sum);
            let first = block.episodes.saturating_sub(RECENT_EPISODES as u64);
            for number in first..block.episodes {
                let e: EpisodeEntry = block.recent[(number % RECENT_EPISODES as u64) as usize];
                snapshot.recent.push(Episode {
                    shard: shard as u32,
                    number,
                    env: e.env,
                    episode_return: e.episode_return,
                    length: e.length,
                });
            }
        }
        Ok(Some(snapshot))
    }

    /// The stats area as [`Observer::try_stats`] reads it, trying again until a read is
    /// whole or `timeout` passes (`Timeout`).
    pub fn stats(&self, timeout: Duration) -> Result<StatsSnapshot> {
        self.retrying(
            timeout,
            "the stats area between the engine's writes",
            || self.try_stats(),
        )
    }

    fn retrying<T>(
        &self,
        timeout: Duration,
        what: &'static str,
        mut attempt: impl FnMut() -> Result<Option<T>>,
    ) -> Result<T> {
        let start = Instant::now();
        let mut checked = start;
        let mut pause = RETRY_FIRST;
        loop {
            if let Some(v) = attempt()? {
                return Ok(v);
            }
            let now = Instant::now();
            if now.duration_since(checked) >= CHECK_EVERY {
                self.check()?;
                checked = now;
            }
            if now.duration_since(start) >= timeout {
                self.check()?;
                return Err(Error::Timeout {
                    waited: timeout,
                    what,
                });
            }
            std::thread::sleep(pause.min(timeout.saturating_sub(now.duration_since(start))));
            pause = (pause * 2).min(RETRY_MAX);
        }
    }
}

/// A sequence word of the region, loaded with one `pread` ([`SeqWord`]): `RegionTooSmall`
/// where a load through a mapping of the truncated file would be a SIGBUS. A word is
/// 8-aligned, so it never straddles two pages, and the kernel copies it with whole-word
/// loads on the machines this runs on; were one torn by a store during the copy, its
/// value would differ from the one loaded after the copy (the sequences only grow), and
/// the seqlock would throw the copy away.
struct FileWord<'a> {
    observer: &'a Observer,
    offset: u64,
}

impl SeqWord for FileWord<'_> {
    type Error = Error;
    fn load(&self, order: Ordering) -> Result<u64> {
        let value = self.observer.u64_at(self.offset)?;
        if !matches!(order, Ordering::Relaxed) {
            // What the caller reads next is ordered after this word, as after an Acquire
            // load of it.
            fence(Ordering::Acquire);
        }
        Ok(value)
    }
}
