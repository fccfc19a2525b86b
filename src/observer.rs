//! Read-only observers of a live region (protocol 1.7, `docs/protocol.md` §5.9): any
//! number of processes that watch an engine serve its client, without being either.
//!
//! An observer opens the region `O_RDONLY`, maps it `PROT_READ` and takes no lock: it is
//! not the client, nobody waits for it, it cannot change a byte, and liveness checks and
//! `gc` never see it. It copies engine→client tensors between the engine's writes: an
//! engine writes them during a step, from the client's action `n` to its frame `n`, and
//! in a command's handler (a reset), which it brackets with the write sequence in its
//! block of the stats area (odd while it writes). A copy counts only if, before it,
//! every shard's frame was the client's last action and every write sequence even, and
//! nothing of that moved after it ([`crate::control::read_between_writes`]); otherwise it
//! is thrown away and tried again later. The copies go through `pread` of the region file, so a file truncated under
//! the observer is a short read (`RegionTooSmall`), never a SIGBUS; only the few control
//! words (the sequences, states and frame counters) are loaded through the mapping,
//! right after a size check. Whether the engine lives is judged by the lock it holds on
//! byte 0 of the region file (each shard on its own byte), asked with `F_OFD_GETLK`,
//! which takes nothing.
//!
//! Retries sleep (tens of microseconds, then up to a millisecond) rather than spin: a
//! reader spinning on the engine's cache line would make each of the engine's stores to
//! it a cache miss.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::control::{read_between_writes, read_consistent, EngineState, Stats};
use crate::error::{Error, Peer, PidNamespace, Result};
use crate::layout::{
    Direction, EpisodeEntry, Layout, Location, StatsArea, StatsBlock, TensorId, TensorInfo,
    RECENT_EPISODES, STATS_BLOCK_SIZE,
};
use crate::os;
use crate::region::{self, Region};
use crate::shard::{self, ShardSlot};
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
    region: Region,
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
        let (region, layout) = Region::open_observer(&name, timeout)?;
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
        for s in &layout.shards {
            region.stats_block(stats.block(s.index))?;
            ShardSlot::new(&region, s)?;
        }
        // Alive (it holds its lock) and not shown here: it lives in another PID namespace.
        let engine_pid_ns = match os::byte_locked(region.file()?, 0)? {
            true => os::pid_namespace(layout.engine_pid, layout.engine_start_time),
            false => PidNamespace::This,
        };
        let observer = Observer {
            region,
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
        self.region.name()
    }

    /// The region's layout: its tensors, envs and shards.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether every shard has published frame 0.
    fn ready(&self) -> Result<bool> {
        self.region.check_size()?;
        for s in &self.layout.shards {
            if ShardSlot::new(&self.region, s)?.state() != EngineState::Ready {
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
        self.region.check_size()?;
        if self.region.control().engine_state() == EngineState::Closed {
            return Err(Error::PeerClosed { peer: Peer::Engine });
        }
        if self.layout.is_sharded() {
            return shard::check_shards(&self.region, &self.layout, None);
        }
        if !os::byte_locked(self.region.file()?, 0)? {
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
        self.region.check_size()?;
        let mut frame = u64::MAX;
        for s in &self.layout.shards {
            frame = frame.min(ShardSlot::new(&self.region, s)?.frame());
        }
        Ok(frame)
    }

    /// The lowest frame the shards last published (`None` if a word cannot be read).
    fn lowest_frame(&self) -> Option<u64> {
        self.layout
            .shards
            .iter()
            .map(|s| {
                ShardSlot::new(&self.region, s)
                    .ok()
                    .map(|slot| slot.frame())
            })
            .min()
            .flatten()
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

    fn blocks(&self) -> Result<Vec<Stats<'_>>> {
        self.layout
            .shards
            .iter()
            .map(|s| self.region.stats_block(self.stats.block(s.index)))
            .collect()
    }

    /// One try at copying `picks` into `out` (resized to each pick's length) while no
    /// engine writes: the frame they hold, or `None` when a step was under way (the
    /// client's last action not yet answered by every shard) or a write overlapped the
    /// copy, and nothing in `out` is to be trusted.
    /// The engine's end is an error first ([`Observer::check`]): what a dead engine left
    /// is not a live frame.
    pub fn try_read(&self, picks: &[Pick], out: &mut [Vec<u8>]) -> Result<Option<u64>> {
        assert_eq!(picks.len(), out.len(), "one buffer per pick");
        self.check()?;
        let blocks = self.blocks()?;
        let seqs: Vec<_> = blocks.iter().map(|b| b.write_seq()).collect();
        let slots = self
            .layout
            .shards
            .iter()
            .map(|s| ShardSlot::new(&self.region, s))
            .collect::<Result<Vec<_>>>()?;
        let frames: Vec<_> = slots.iter().map(|s| s.frame_seq().counter).collect();
        let action_seq = self.region.control().action_seq().counter;
        let mut failed = None;
        let copied = read_between_writes(&seqs, action_seq, &frames, |frame| {
            for (pick, buf) in picks.iter().zip(out.iter_mut()) {
                let (offset, len) = self.span(pick);
                buf.resize(len as usize, 0);
                if let Err(e) = self.region.read_at(offset, buf) {
                    failed = Some(e);
                    break;
                }
            }
            frame
        });
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
    pub fn read(&self, picks: &[Pick], out: &mut [Vec<u8>], timeout: Duration) -> Result<u64> {
        self.retrying(timeout, "a frame between the engine's writes", || {
            self.try_read(picks, out)
        })
    }

    /// One try at reading the stats area while no engine records an episode (the stats
    /// have a sequence of their own: steps do not get in the way); `frame` is the lowest
    /// frame the shards had published.
    pub fn try_stats(&self) -> Result<Option<StatsSnapshot>> {
        self.check()?;
        let blocks = self.blocks()?;
        let seqs: Vec<_> = blocks.iter().map(|b| b.stats_seq()).collect();
        let mut bytes = vec![0u8; self.stats.len() as usize];
        let mut failed = None;
        let frame = read_consistent(&seqs, || {
            let frame = self.lowest_frame();
            if let Err(e) = self.region.read_at(self.stats.offset, &mut bytes) {
                failed = Some(e);
            }
            frame
        });
        if let Some(e) = failed {
            return Err(e);
        }
        let Some(Some(frame)) = frame else {
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
