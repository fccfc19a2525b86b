//! What the stream tests share: their schema, a spec of it, and full stream names.

use shmbridge::stream::{Schema, StreamSpec};

/// The schema of most stream tests: a variable, a fixed and a bytes field.
pub const SCHEMA: &str = "tokens: int32[*], score: float64[1], meta: uint8[*]";

/// A stream of `schema` with `lanes` lanes of `capacity` bytes and `ranks` ranks.
pub fn spec_of(schema: &str, lanes: u32, capacity: u64, ranks: u32) -> StreamSpec {
    StreamSpec {
        schema: Schema::parse(schema).unwrap(),
        lanes,
        lane_capacity: capacity,
        ranks,
    }
}

/// [`spec_of`] with [`SCHEMA`].
pub fn spec(lanes: u32, capacity: u64, ranks: u32) -> StreamSpec {
    spec_of(SCHEMA, lanes, capacity, ranks)
}

/// A full stream name in this process's namespace (peers, in namespaces of their own,
/// are handed full names).
pub fn name(short: &str) -> String {
    shmbridge::region::canonical_name(short).unwrap()
}
