//! The validated header as a whole ([`Layout`]): everything a client needs, copied out of
//! shared memory, and the keys that name its tensors ([`TensorKey`], [`TensorId`]).

use super::location::Location;
use super::shard::ShardInfo;
use super::stats::StatsArea;
use super::tensor::{Rings, TensorInfo};
use crate::error::{Error, Result};

/// A validated header: everything a client needs, copied out of shared memory.
#[derive(Debug, Clone)]
pub struct Layout {
    pub version: (u16, u16),
    pub header_size: u64,
    pub region_size: u64,
    pub num_envs: u32,
    pub engine_pid: u32,
    pub engine_start_time: u64,
    pub engine_kind: String,
    pub tensors: Vec<TensorInfo>,
    /// The command rings (protocol ≥ 1.1 with non-zero capacity).
    pub rings: Option<Rings>,
    /// 1.2: the engine's interprocess event handle, present iff a tensor is on CUDA.
    pub engine_event_handle: Option<[u8; 64]>,
    /// 1.4: the engine processes serving the region, in env order; one (in the control
    /// block) for an unsharded region.
    pub shards: Vec<ShardInfo>,
    /// 1.7: the stats area (one block per shard), present iff the header's
    /// `FLAG_OBSERVABLE` is set: the region can be observed.
    pub stats: Option<StatsArea>,
    /// 1.10: a sharded region whose shards take actions posted to each shard alone
    /// (`FLAG_SHARD_ACTIONS`): what asynchronous batches need.
    pub shard_actions: bool,
}

impl Layout {
    /// Whether more than one engine process serves the region (1.4).
    pub fn is_sharded(&self) -> bool {
        self.shards.len() > 1
    }

    /// The shard that serves env `env`.
    pub fn shard_of(&self, env: u32) -> Option<&ShardInfo> {
        self.shards.iter().find(|s| s.envs().contains(&env))
    }

    /// This layout as shard `shard` sees it: every tensor narrowed to the shard's envs
    /// (its rows of the env axis, in place), `num_envs` the slice's, `rings` the shard's.
    pub fn narrowed(&self, shard: &ShardInfo) -> Layout {
        let mut out = self.clone();
        if !self.is_sharded() {
            return out;
        }
        for t in &mut out.tensors {
            // Sharded layouts have the env axis first on every (host) tensor: checked by
            // the builder and by validation.
            let row = t.nbytes / u64::from(self.num_envs);
            t.offset += row * u64::from(shard.env_start);
            t.nbytes = row * u64::from(shard.env_count);
            t.shape[0] = u64::from(shard.env_count);
        }
        out.num_envs = shard.env_count;
        out.rings = shard.rings;
        out.shards = vec![*shard];
        out
    }
    /// Whether any tensor lives on a CUDA device.
    pub fn has_cuda(&self) -> bool {
        self.tensors.iter().any(|t| t.location() == Location::Cuda)
    }
}

/// A tensor resolved once by name ([`Layout::id`]), for hot loops that should not compare
/// strings every step. Only valid for the layout (engine or client) that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorId(usize);

impl TensorId {
    pub fn index(self) -> usize {
        self.0
    }
}

/// Something that names a tensor: its name, or a [`TensorId`].
pub trait TensorKey {
    fn resolve<'l>(&self, layout: &'l Layout) -> Result<(usize, &'l TensorInfo)>;
}

impl TensorKey for &str {
    #[inline]
    fn resolve<'l>(&self, layout: &'l Layout) -> Result<(usize, &'l TensorInfo)> {
        layout.tensor(self)
    }
}

impl TensorKey for TensorId {
    #[inline]
    fn resolve<'l>(&self, layout: &'l Layout) -> Result<(usize, &'l TensorInfo)> {
        match layout.tensors.get(self.0) {
            Some(t) => Ok((self.0, t)),
            None => Err(no_such_id(layout, self.0)),
        }
    }
}

#[cold]
#[inline(never)]
fn no_such_id(layout: &Layout, id: usize) -> Error {
    Error::NoSuchTensor {
        name: format!("#{id}"),
        available: layout.tensor_names(),
    }
}

impl Layout {
    /// Resolves a tensor name once.
    pub fn id(&self, name: &str) -> Result<TensorId> {
        Ok(TensorId(self.tensor(name)?.0))
    }

    /// The per-env tensor `name`: its first dimension must be the header's `num_envs`,
    /// and, if `per_env` is given, each env must have that many elements (`Some(1)`:
    /// shape `[num_envs]`). `InvalidTensor` otherwise: a header whose `num_envs`
    /// disagrees with its tensors is not indexed by either.
    pub fn per_env_tensor(&self, name: &str, per_env: Option<u64>) -> Result<&TensorInfo> {
        let (_, t) = self.tensor(name)?;
        let elements: u64 = t.shape.iter().product();
        let n = u64::from(self.num_envs);
        let fits =
            t.shape.first() == Some(&n) && per_env.is_none_or(|k| elements == n.saturating_mul(k));
        if !fits {
            return Err(Error::InvalidTensor {
                tensor: name.to_string(),
                reason: format!(
                    "shape {:?} does not hold {} per env for the header's num_envs {n}",
                    t.shape,
                    per_env.map_or("a row".to_string(), |k| format!("{k} element(s)"))
                ),
            });
        }
        Ok(t)
    }

    pub fn tensor(&self, name: &str) -> Result<(usize, &TensorInfo)> {
        self.tensors
            .iter()
            .enumerate()
            .find(|(_, t)| t.name == name)
            .ok_or_else(|| Error::NoSuchTensor {
                name: name.to_string(),
                available: self.tensor_names(),
            })
    }
    pub fn tensor_names(&self) -> String {
        self.tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}
