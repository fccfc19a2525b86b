//! Who may hold which byte of a region's file, and where its fd socket lives (1.6): the
//! words of the region's ownership proofs, which the region makes and checks
//! ([`crate::region::Region`]) and a device backend that serves or fetches fds outside
//! the region uses through its [`ControlMapping`](super::ControlMapping).

use crate::error::{Error, Result};
use crate::os;

/// The fd socket of region `<name>` (protocol 1.6, §3.6) is the file `<name>.fd` beside
/// it in /dev/shm; no region name ends so.
pub const SOCKET_SUFFIX: &str = ".fd";
/// The longest path a Unix socket address holds (`sun_path`, less its NUL).
const MAX_SOCKET_PATH: usize = 107;
/// The byte of a region file whose OFD write lock the engine that created it holds for
/// its whole life, on a descriptor of its own (1.6): handing that descriptor over proves
/// that one is the engine ([`ControlMapping::proves`](super::ControlMapping::proves)).
/// Above every client's bytes ([`client_lock_byte`]).
pub const ENGINE_PROOF_BYTE: u64 = 1 << 62;
/// The byte of a region file whose OFD write lock the attached client holds on a
/// descriptor of its own (1.8), from before it claims the slot until it closes: handing
/// that descriptor over proves to the engine's fd socket that one is the attached client.
/// One byte for the slot, not one derived from who the slot says the client is: the
/// kernel lets one open file description at a time hold it, so a process that writes
/// itself into the slot has nothing to prove with (1.6 derived it from the slot's pid and
/// start time, which anyone who can write the slot can choose).
pub const CLIENT_PROOF_BYTE: u64 = ENGINE_PROOF_BYTE + 1;

/// The path of region `name`'s fd socket (1.6): `/dev/shm/<name>.fd`, beside the region,
/// so that it reaches wherever /dev/shm is shared (an abstract socket lives in one
/// network namespace). `InvalidName` when the path does not fit a socket address:
/// engines with Vulkan tensors take names of at most 95 characters.
pub fn socket_path(name: &str) -> Result<String> {
    let path = format!("{}/{name}{SOCKET_SUFFIX}", os::SHM_DIR);
    if path.len() > MAX_SOCKET_PATH {
        return Err(Error::InvalidName {
            name: name.to_string(),
            reason: "too long for the fd socket's path: engines with Vulkan tensors take names of at most 95 characters",
        });
    }
    Ok(path)
}

/// The byte of a region file whose lock the client recorded as `(pid, start_time)` holds
/// while attached. Derived from what the slot records, so the engine needs no other field
/// to find it; a client forked from another, or one in another PID namespace, has another
/// pid or start time, hence another byte. In `[2^61, 2^62)`: far above the bytes
/// `0..shards` the shards of a sharded region lock (1.4), and below `i64::MAX` (`off_t`).
pub fn client_lock_byte(pid: u32, start_time: u64) -> u64 {
    // splitmix64 of the pair: distinct clients land on distinct bytes.
    let mut z = (u64::from(pid) << 32 ^ start_time).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 3) | (1 << 61)
}
