//! Typed views of host tensors in a region.
//!
//! [`Tensors`] hands out slices of the tensors in a region: shared ones of any tensor,
//! mutable ones of the tensors this side writes, each at most once, and never a shared
//! and a mutable one of the same tensor. Validation guarantees tensors do not overlap, so
//! slices of different tensors never alias. A `Tensors` borrows its engine or client
//! mutably, so no slice outlives the next `publish()` / `step()`.
//!
//! The peer is another process: a well-behaved one does not touch a tensor it does not
//! own while the lock-step protocol gives it to us. A misbehaving one can change values
//! under a shared slice; that can give wrong numbers, never an out-of-bounds access.

use half::{bf16, f16};

use crate::device::{ClientBackend, EngineBackend};
use crate::error::{Error, Peer, Result};
use crate::layout::{DType, Layout, TensorInfo, TensorKey};
use crate::region::Region;

/// A Rust type that can view a tensor's elements.
pub trait Element: bytemuck::Pod {
    /// The dtypes this type can view (`u8` also views `bool` tensors, whose bytes are 0/1).
    const DTYPES: &'static [DType];
    const NAME: &'static str;
}

macro_rules! element {
    ($t:ty, $name:literal, $($d:expr),+) => {
        impl Element for $t {
            const DTYPES: &'static [DType] = &[$($d),+];
            const NAME: &'static str = $name;
        }
    };
}
element!(f16, "f16", DType::F16);
element!(bf16, "bf16", DType::BF16);
element!(f32, "f32", DType::F32);
element!(f64, "f64", DType::F64);
element!(i8, "i8", DType::I8);
element!(i16, "i16", DType::I16);
element!(i32, "i32", DType::I32);
element!(i64, "i64", DType::I64);
element!(u8, "u8", DType::U8, DType::Bool);
element!(u16, "u16", DType::U16);
element!(u32, "u32", DType::U32);
element!(u64, "u64", DType::U64);

fn not_on_host(t: &TensorInfo) -> Error {
    Error::NotOnHost {
        tensor: t.name.clone(),
        location: t.location().name(),
    }
}

/// Borrowed access to the tensors of one region, for one side.
///
/// An engine's views also hand out the engine's device backend ([`Tensors::engine_backend`]:
/// for CUDA tensors, its `stream()` is the one a frame's kernels go on) and device
/// addresses ([`Tensors::device_ptr`]), so that an env steps on the GPU
/// through the same `&mut Tensors` its steps and commands get.
pub struct Tensors<'a> {
    region: &'a Region,
    layout: &'a Layout,
    side: Peer,
    shared: u64,
    exclusive: u64,
    /// The engine's backend (engine views only).
    device: Option<&'a dyn EngineBackend>,
    /// The client's backend (client views only): host mappings of imported tensors.
    client_device: Option<&'a dyn ClientBackend>,
    /// Client views of an asynchronous client while shards outside its batch step:
    /// their engines write and read their rows now, so no whole-tensor slice is handed
    /// out (only [`Tensors::rows`] of the batch's envs).
    peers_stepping: bool,
}

impl<'a> Tensors<'a> {
    pub(crate) fn new(region: &'a Region, layout: &'a Layout, side: Peer) -> Self {
        Tensors {
            region,
            layout,
            side,
            shared: 0,
            exclusive: 0,
            device: None,
            client_device: None,
            peers_stepping: false,
        }
    }

    /// Client views while other shards step (asynchronous batches): `read` and `write`
    /// refuse with `OutOfOrder`.
    pub(crate) fn with_peers_stepping(mut self, stepping: bool) -> Self {
        self.peers_stepping = stepping;
        self
    }

    /// The client's views, with its device backend (host mappings of imports).
    pub(crate) fn with_client_device(mut self, device: &'a dyn ClientBackend) -> Self {
        self.client_device = Some(device);
        self
    }

    /// Where tensor `i`'s bytes are in this process: in the region for host tensors,
    /// else where the backend mapped them on the CPU (Vulkan host-visible memory);
    /// `NotOnHost` when they are not mapped here. Checked aligned for `align`.
    #[inline]
    fn base(&self, i: usize, t: &TensorInfo, align: usize) -> Result<*mut u8> {
        if t.location() == crate::layout::Location::Host {
            // SAFETY: validation (or the builder) puts `offset..offset + nbytes` inside
            // the mapping, so `add` stays inside the object.
            return Ok(unsafe { self.region.ptr().add(t.offset as usize) });
        }
        self.mapped_base(i, t, align)
    }

    /// [`base`](Self::base) of a tensor outside the region: kept out of line, so the
    /// host path of every step stays small enough to inline.
    #[cold]
    #[inline(never)]
    fn mapped_base(&self, i: usize, t: &TensorInfo, align: usize) -> Result<*mut u8> {
        let mapped = match (self.device, self.client_device) {
            (Some(d), _) => d.host_ptr(i, t),
            (_, Some(d)) => d.host_ptr(i, t),
            _ => None,
        };
        match mapped {
            Some(p) if (p.as_ptr() as usize) % align == 0 => Ok(p.as_ptr()),
            _ => Err(self
                .client_device
                .and_then(|d| d.import_error(i, t))
                .unwrap_or_else(|| not_on_host(t))),
        }
    }

    /// The engine's views, with its device backend.
    pub(crate) fn with_device(mut self, device: &'a dyn EngineBackend) -> Self {
        self.device = Some(device);
        self
    }

    /// The engine's device backend: launch the kernels that write a frame (or a
    /// command's reset) on its stream (`engine_backend()?.stream()`), so that the
    /// engine's event, recorded before `frame_seq` or the reply is published, follows
    /// them. An error for a client's views.
    pub fn engine_backend(&self) -> Result<&'a dyn EngineBackend> {
        self.device.ok_or_else(|| {
            Error::NoDeviceSide(format!(
                "these are the {} views of engine '{}': only an engine's views have its \
                 device backend",
                self.side, self.layout.engine_kind
            ))
        })
    }

    /// Device address (in this process) of a tensor in device memory. An engine's
    /// views: in the engine's device memory, for kernels on the engine's stream (the
    /// tensor's direction is not checked here: a kernel may read any tensor, and must
    /// write only engine→client ones). A client's views: what
    /// [`Client::device_ptr`](crate::Client::device_ptr) gives, where the client's
    /// backend imported the tensor. `NotOnHost` for a tensor with no device address
    /// here (a host tensor).
    pub fn device_ptr(&self, key: impl TensorKey) -> Result<u64> {
        let (i, t) = key.resolve(self.layout)?;
        match (self.device, self.client_device) {
            (Some(d), _) => d.device_ptr(t),
            (_, Some(d)) => d.device_ptr(i, t),
            // Unreached: an engine's and a client's views both carry their backend.
            (None, None) => Err(Error::NoDeviceSide(format!(
                "tensor '{}': these {} views have no device backend",
                t.name, self.side
            ))),
        }
    }

    // `always`: LLVM left these calls out of line in a step loop (Result of a slice
    // returned through memory, a prologue each), which cost about 10 ns per round trip
    // on the client's path from a frame to its next action.
    #[inline(always)]
    fn lookup<T: Element>(&self, key: impl TensorKey) -> Result<(usize, &'a TensorInfo)> {
        let (i, t) = key.resolve(self.layout)?;
        if !T::DTYPES.contains(&t.dtype) {
            return Err(dtype_mismatch(t, T::NAME));
        }
        Ok((i, t))
    }

    /// A shared view of any tensor, by name or [`TensorId`](crate::layout::TensorId).
    /// `OutOfOrder` for an asynchronous client's views while shards outside its batch
    /// step (their engines write their rows now): [`Client::batch_rows`](crate::Client::batch_rows).
    #[inline(always)]
    pub fn read<T: Element>(&mut self, key: impl TensorKey) -> Result<&'a [T]> {
        if self.peers_stepping {
            return Err(peers_stepping());
        }
        let (base, len, _) = self.claim::<T>(key, false)?;
        // SAFETY: `claim` returns the first of `len` elements of `T` inside a live
        // mapping: the region (validation, or the builder on the engine side, bounds the
        // span) or the backend's host mapping of the tensor's memory (which checked the
        // span against the mapped size), aligned for `T`. Every bit pattern is a valid
        // `T` (Pod). No mutable slice of this tensor exists in this process (bitmask in
        // `claim`), and the `'a` borrow of the engine/client keeps both mappings alive and
        // prevents a new `Tensors` meanwhile. The peer process does not write it while
        // the slice lives: in lock-step the next `publish()`/`step()` needs that borrow;
        // an asynchronous client's views refuse (above) while any shard steps.
        Ok(unsafe { std::slice::from_raw_parts(base, len) })
    }

    /// A mutable view of a tensor this side writes; each tensor at most once.
    /// `OutOfOrder` as for [`Tensors::read`].
    #[inline(always)]
    pub fn write<T: Element>(&mut self, key: impl TensorKey) -> Result<&'a mut [T]> {
        if self.peers_stepping {
            return Err(peers_stepping());
        }
        let (base, len, _) = self.claim::<T>(key, true)?;
        // SAFETY: bounds, alignment, validity and the peer as in `read`. The bitmask in
        // `claim` ensures this is the only slice of this tensor handed out by this
        // `Tensors`, tensors do not overlap (host tensors: validated; a Vulkan tensor is
        // in memory of its own), and the mutable borrow of the engine/client that this
        // `Tensors` holds for `'a` rules out any other `Tensors` over the same memory in
        // this process.
        Ok(unsafe { std::slice::from_raw_parts_mut(base, len) })
    }

    /// Rows `envs` (ranges of the leading, env axis) of a tensor, one slice per range:
    /// the views of an asynchronous client's batch, whose shards' engines do not touch
    /// those rows until their actions are sent. Mutable (`write`) for a tensor this side
    /// writes; each tensor claimed once as for `read`/`write`. `InvalidSpec` for a
    /// tensor whose leading axis is not the envs, or a range outside it.
    pub(crate) fn rows<T: Element>(
        &mut self,
        key: impl TensorKey,
        envs: &[std::ops::Range<u32>],
        write: bool,
    ) -> Result<Vec<(*mut T, usize)>> {
        let (base, len, t) = self.claim::<T>(key, write)?;
        let num_envs = self.layout.num_envs as usize;
        let out_of_axis = || {
            Error::InvalidSpec(format!(
                "tensor '{}' (shape {:?}) has no row per env (num_envs {num_envs})",
                t.name, t.shape
            ))
        };
        if t.shape.first() != Some(&(num_envs as u64)) || num_envs == 0 {
            return Err(out_of_axis());
        }
        let row = len / num_envs;
        envs.iter()
            .map(|r| {
                if r.start > r.end || r.end as usize > num_envs {
                    return Err(out_of_axis());
                }
                // SAFETY: `r.start * row ≤ len` (checked above), so the pointer stays
                // inside the tensor's `len` elements that `claim` returned.
                let p = unsafe { base.add(r.start as usize * row) };
                Ok((p, (r.end - r.start) as usize * row))
            })
            .collect()
    }

    /// The checks and bookkeeping of a view: dtype, direction (`write`), no conflicting
    /// slice of this `Tensors`; the tensor's first element, its length in `T`s, its entry.
    #[inline(always)]
    fn claim<T: Element>(
        &mut self,
        key: impl TensorKey,
        write: bool,
    ) -> Result<(*mut T, usize, &'a TensorInfo)> {
        let (i, t) = self.lookup::<T>(key)?;
        if write && t.direction.writer() != self.side {
            return Err(wrong_direction(t, self.side));
        }
        let taken = if write {
            self.shared | self.exclusive
        } else {
            self.exclusive
        };
        if taken & (1 << i) != 0 {
            return Err(already_borrowed(t));
        }
        let base = self.base(i, t, std::mem::align_of::<T>())?;
        if write {
            self.exclusive |= 1 << i;
        } else {
            self.shared |= 1 << i;
        }
        let len = (t.nbytes as usize) / std::mem::size_of::<T>();
        Ok((base as *mut T, len, t))
    }

    /// A tensor's table entry (dtype, shape, size, where it lives).
    pub fn info(&self, key: impl TensorKey) -> Result<&'a TensorInfo> {
        key.resolve(self.layout).map(|(_, t)| t)
    }

    /// Resolves a tensor name once, for use as a key in hot loops.
    pub fn id(&self, name: &str) -> Result<crate::layout::TensorId> {
        self.layout.id(name)
    }

    /// Engine views (1.7): env `env` (this engine's numbering, `0..num_envs`) ended an
    /// episode of return `episode_return` after `length` steps. Recorded in this
    /// engine's block of the region's stats area, where observers read it (`shmbridge
    /// view` plots it); nothing happens in a region without one. A reference env calls
    /// it from its step as envs finish. `WrongDirection` for a client's views, `InvalidSpec`
    /// for an env past this side's.
    pub fn episode_ended(&mut self, env: usize, episode_return: f64, length: u64) -> Result<()> {
        if self.side != Peer::Engine {
            return Err(Error::WrongDirection {
                tensor: "<episode stats>".into(),
                writer: Peer::Engine,
                requester: self.side,
            });
        }
        let Some(shard) = self.layout.shards.first() else {
            return Ok(());
        };
        if env >= shard.env_count as usize {
            return Err(Error::InvalidSpec(format!(
                "episode of env {env}: this engine steps {} envs",
                shard.env_count
            )));
        }
        if let Some(area) = self.layout.stats {
            let block = self.region.stats_block(area.block(shard.index))?;
            block.record_episode(shard.env_start + env as u32, episode_return, length);
        }
        Ok(())
    }

    /// Address of a tensor's first byte in this process (for zero-copy checks): in
    /// the region, or in the host mapping of a Vulkan tensor's memory.
    pub fn address(&self, key: impl TensorKey) -> Result<*const u8> {
        let (i, t) = key.resolve(self.layout)?;
        Ok(self.base(i, t, 1)? as *const u8)
    }
}

// The errors of a view, out of line: `read` and `write` stay small enough to inline into
// the step loops that call them.

#[cold]
#[inline(never)]
fn dtype_mismatch(t: &TensorInfo, requested: &'static str) -> Error {
    Error::DTypeMismatch {
        tensor: t.name.clone(),
        requested,
        actual: t.dtype.name(),
    }
}

#[cold]
#[inline(never)]
fn peers_stepping() -> Error {
    Error::OutOfOrder(
        "shards outside the batch are stepping (their engines write their rows now): \
         use batch_rows()/batch_rows_mut() for the envs recv() handed out",
    )
}

#[cold]
#[inline(never)]
fn already_borrowed(t: &TensorInfo) -> Error {
    Error::AlreadyBorrowed {
        tensor: t.name.clone(),
    }
}

#[cold]
#[inline(never)]
fn wrong_direction(t: &TensorInfo, requester: Peer) -> Error {
    Error::WrongDirection {
        tensor: t.name.clone(),
        writer: t.direction.writer(),
        requester,
    }
}
