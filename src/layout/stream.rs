//! The bytes of a trajectory stream (protocol 1.11, `docs/protocol.md` §10): its header
//! (identity, sizes, the schema), the places of its live words, and the record format,
//! with their validation. Pure data, as the rest of `layout`: the live stream
//! (`crate::stream`) maps a file and works on these.
//!
//! A record is 8-aligned in its lane, never split at the wrap, and starts with three
//! 8-byte words: `word0` (the only word readers and the producer race on, always accessed
//! atomically: its length, kind, state, claiming rank and lap, [`Word0`]), the producer's
//! sequence number and the producer's lane generation; then one u32 element count per
//! variable field (schema order), padded to 8; then each field, 8-aligned.

use crate::error::{Error, Result};

use super::DType;

/// `magic` of a published stream: "SHMBSTRM" in little-endian bytes.
pub const STREAM_MAGIC: u64 = u64::from_le_bytes(*b"SHMBSTRM");
/// Word 1 of a stream header, written before anything else: a stream whose creator died
/// before publishing (`magic` still 0) is still known for one by the sweep.
pub const STREAM_TAG: u64 = u64::from_le_bytes(*b"sbstream");
/// The protocol minor version that added streams (`version_minor` of a stream header).
pub const STREAM_VERSION_MINOR: u16 = super::VERSION_MINOR_STREAMS;
/// The header's size: one page; the lanes follow.
pub const STREAM_HEADER_SIZE: u64 = 4096;
/// Most fields in a schema.
pub const MAX_FIELDS: usize = 16;
/// Bytes of a field's name, NUL-padded.
pub const FIELD_NAME_LEN: usize = 32;
/// One schema entry: name, DLPack code, bits, lanes, count.
pub const FIELD_ENTRY_SIZE: usize = 48;
/// Most consumer ranks of a group.
pub const MAX_RANKS: u32 = 16;
/// Most lanes (producers at once).
pub const MAX_LANES: u32 = 1024;
/// A lane's control words before its data.
pub const LANE_CTRL_SIZE: u64 = 256;
/// Smallest and largest lane capacity (bytes, a power of two).
pub const MIN_LANE_CAPACITY: u64 = 64;
pub const MAX_LANE_CAPACITY: u64 = 1 << 31;
/// A count that marks a variable-length field in a schema entry.
pub const VARIABLE: u32 = 0;

// Header offsets (docs/protocol.md §10.2).
pub const OFF_MAGIC: usize = 0;
pub const OFF_TAG: usize = 8;
pub const OFF_VERSION_MAJOR: usize = 16;
pub const OFF_VERSION_MINOR: usize = 18;
pub const OFF_HEADER_SIZE: usize = 20;
pub const OFF_FILE_SIZE: usize = 24;
pub const OFF_LANES: usize = 32;
pub const OFF_RANKS: usize = 36;
pub const OFF_LANE_CAPACITY: usize = 40;
pub const OFF_LANE_STRIDE: usize = 48;
pub const OFF_FIELD_COUNT: usize = 56;
pub const OFF_SCHEMA: usize = 64;
/// The consumers' doorbell (u32) on its own cache line.
pub const OFF_DOORBELL: usize = 1024;
/// Stream-wide stats: full waits, records lost to dead ranks (u64 each).
pub const OFF_FULL_WAITS: usize = 1088;
pub const OFF_LOST: usize = 1096;
/// The rank table: [`MAX_RANKS`] entries of [`RANK_ENTRY_SIZE`].
pub const OFF_RANKS_TABLE: usize = 1152;
pub const RANK_ENTRY_SIZE: usize = 64;

/// Record word0's kinds and states.
pub const KIND_RECORD: u8 = 1;
pub const KIND_PAD: u8 = 2;
pub const STATE_READY: u8 = 0;
pub const STATE_CLAIMED: u8 = 1;
pub const STATE_RELEASED: u8 = 2;
pub const STATE_LOST: u8 = 3;
/// The three fixed words of a record's header.
pub const RECORD_FIXED: usize = 24;

/// How many elements a field has per record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// The same count in every record (`score: float64[1]`).
    Fixed(u32),
    /// Chosen per record at reserve (`tokens: int32[*]`).
    Variable,
}

/// One named field of a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    pub dtype: DType,
    pub count: Count,
}

/// The fields of every record of a stream, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema {
    fields: Vec<Field>,
}

fn spec_err(reason: impl Into<String>) -> Error {
    Error::InvalidHeader {
        field: "schema",
        reason: reason.into(),
    }
}

impl Schema {
    /// A schema of `fields`: 1..=16 of them, names of 1..=31 bytes from `[A-Za-z0-9_]`,
    /// unique, fixed counts ≥ 1.
    pub fn new(fields: Vec<Field>) -> Result<Schema> {
        if fields.is_empty() || fields.len() > MAX_FIELDS {
            return Err(spec_err(format!(
                "{} fields: a schema has 1 to {MAX_FIELDS}",
                fields.len()
            )));
        }
        for (i, f) in fields.iter().enumerate() {
            let ok = !f.name.is_empty()
                && f.name.len() < FIELD_NAME_LEN
                && f.name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !ok {
                return Err(spec_err(format!(
                    "field name '{}': use 1 to {} characters from [A-Za-z0-9_]",
                    f.name,
                    FIELD_NAME_LEN - 1
                )));
            }
            if fields[..i].iter().any(|g| g.name == f.name) {
                return Err(spec_err(format!("field '{}' named twice", f.name)));
            }
            if f.count == Count::Fixed(VARIABLE) {
                return Err(spec_err(format!(
                    "field '{}': a fixed count is at least 1",
                    f.name
                )));
            }
        }
        Ok(Schema { fields })
    }

    /// Parses `"tokens: int32[*], score: float64[1], meta: uint8[*]"`: comma-separated
    /// `name: dtype[count]` (NumPy-style dtype names, or the short ones: `i32`), `*` for a
    /// variable count; `name: dtype` alone is `[1]`. Printed back (`Display`) with the
    /// NumPy-style names.
    pub fn parse(text: &str) -> Result<Schema> {
        let mut fields = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, ty) = part
                .split_once(':')
                .ok_or_else(|| spec_err(format!("'{part}': write name: dtype[count]")))?;
            let ty = ty.trim();
            let (dt, count) = match ty.split_once('[') {
                Some((dt, rest)) => {
                    let n = rest
                        .strip_suffix(']')
                        .ok_or_else(|| spec_err(format!("'{part}': missing ']'")))?
                        .trim();
                    let count = if n == "*" {
                        Count::Variable
                    } else {
                        Count::Fixed(n.parse().map_err(|_| {
                            spec_err(format!("'{part}': the count is a number or *"))
                        })?)
                    };
                    (dt.trim(), count)
                }
                None => (ty, Count::Fixed(1)),
            };
            let dtype = DType::parse_any(dt)
                .ok_or_else(|| spec_err(format!("'{part}': unknown dtype '{dt}'")))?;
            fields.push(Field {
                name: name.trim().to_string(),
                dtype,
                count,
            });
        }
        Schema::new(fields)
    }

    pub fn fields(&self) -> &[Field] {
        &self.fields
    }

    /// The index of field `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.fields.iter().position(|f| f.name == name)
    }

    /// How many fields are variable (how many lengths a reserve takes).
    pub fn variable_count(&self) -> usize {
        self.fields
            .iter()
            .filter(|f| f.count == Count::Variable)
            .count()
    }

    /// The variable lengths (schema order) of a record whose fields have `nbytes`
    /// bytes each (one per field, schema order): what [`Schema::spans`] takes.
    /// `InvalidTensor` naming the field for a wrong number of fields, a size that is no
    /// whole number of elements, a fixed field of another count, or a count past `u32`.
    pub fn lengths_of(&self, nbytes: &[usize]) -> Result<Vec<u32>> {
        if nbytes.len() != self.fields.len() {
            return Err(Error::InvalidTensor {
                tensor: "<fields>".into(),
                reason: format!(
                    "{} fields given; the schema '{self}' has {}",
                    nbytes.len(),
                    self.fields.len()
                ),
            });
        }
        let mut lengths = Vec::with_capacity(self.variable_count());
        for (f, &n) in self.fields.iter().zip(nbytes) {
            let size = f.dtype.size();
            let bad = |reason: String| Error::InvalidTensor {
                tensor: f.name.clone(),
                reason,
            };
            if n % size != 0 {
                return Err(bad(format!(
                    "{n} bytes are no whole number of {} elements",
                    f.dtype
                )));
            }
            let count = u32::try_from(n / size)
                .map_err(|_| bad(format!("{} elements: at most {}", n / size, u32::MAX)))?;
            match f.count {
                Count::Fixed(c) if c != count => {
                    return Err(bad(format!("{count} elements; the field has {c}")));
                }
                Count::Fixed(_) => {}
                Count::Variable => lengths.push(count),
            }
        }
        Ok(lengths)
    }

    /// Bytes of a record's header: the three words and the variable counts, 8-aligned.
    pub fn record_header_len(&self) -> usize {
        (RECORD_FIXED + 4 * self.variable_count()).next_multiple_of(8)
    }

    /// Where each field of a record with these variable `lengths` (one per variable
    /// field, in order) lies, and the record's total length. `InvalidTensor` naming the
    /// field for a wrong number of lengths; `RecordTooLarge` past `max`.
    pub fn spans(&self, lengths: &[u32], max: u64) -> Result<Spans> {
        if lengths.len() != self.variable_count() {
            return Err(Error::InvalidTensor {
                tensor: "<lengths>".into(),
                reason: format!(
                    "{} lengths given; the schema '{self}' has {} variable fields",
                    lengths.len(),
                    self.variable_count()
                ),
            });
        }
        let mut out = Spans {
            fields: [(0, 0); MAX_FIELDS],
            n: self.fields.len(),
            len: 0,
        };
        let mut at = self.record_header_len() as u64;
        let mut var = lengths.iter();
        for (i, f) in self.fields.iter().enumerate() {
            let count = match f.count {
                Count::Fixed(n) => n,
                Count::Variable => *var.next().expect("counted above"),
            };
            let bytes = count as u64 * f.dtype.size() as u64;
            out.fields[i] = (at as u32, count);
            at = at
                .checked_add(bytes.next_multiple_of(8))
                .filter(|&e| e <= max)
                .ok_or(Error::RecordTooLarge {
                    len: at.saturating_add(bytes),
                    capacity: max,
                })?;
            // `at <= max <= MAX_LANE_CAPACITY < 2^32`: the u32 offsets above hold.
        }
        out.len = at as u32;
        Ok(out)
    }

    /// The schema's entries as they are written in a stream header.
    fn encode(&self, out: &mut [u8]) {
        for (i, f) in self.fields.iter().enumerate() {
            let e = &mut out[OFF_SCHEMA + i * FIELD_ENTRY_SIZE..][..FIELD_ENTRY_SIZE];
            e[..f.name.len()].copy_from_slice(f.name.as_bytes());
            let (code, bits) = f.dtype.dlpack();
            e[32] = code;
            e[33] = bits;
            e[34..36].copy_from_slice(&1u16.to_le_bytes());
            let count = match f.count {
                Count::Fixed(n) => n,
                Count::Variable => VARIABLE,
            };
            e[36..40].copy_from_slice(&count.to_le_bytes());
        }
    }

    /// The schema of a header's entries, validated as [`Schema::new`] does.
    fn decode(bytes: &[u8], n: usize) -> Result<Schema> {
        if n == 0 || n > MAX_FIELDS {
            return Err(spec_err(format!(
                "{n} fields: a schema has 1 to {MAX_FIELDS}"
            )));
        }
        let mut fields = Vec::with_capacity(n);
        for i in 0..n {
            let e = &bytes[OFF_SCHEMA + i * FIELD_ENTRY_SIZE..][..FIELD_ENTRY_SIZE];
            let name_len = e[..FIELD_NAME_LEN]
                .iter()
                .position(|&b| b == 0)
                .unwrap_or(FIELD_NAME_LEN);
            let name = std::str::from_utf8(&e[..name_len])
                .map_err(|_| spec_err(format!("field {i}: its name is not UTF-8")))?;
            let lanes = u16::from_le_bytes([e[34], e[35]]);
            let dtype = DType::from_dlpack(e[32], e[33], lanes).ok_or_else(|| {
                spec_err(format!(
                    "field '{name}': DLPack dtype ({}, {}, {lanes}) is not one of shmbridge's",
                    e[32], e[33]
                ))
            })?;
            let count = u32::from_le_bytes(e[36..40].try_into().expect("4 bytes"));
            fields.push(Field {
                name: name.to_string(),
                dtype,
                count: match count {
                    VARIABLE => Count::Variable,
                    n => Count::Fixed(n),
                },
            });
        }
        Schema::new(fields)
    }
}

impl std::fmt::Display for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, field) in self.fields.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}: {}", field.name, field.dtype.array_name())?;
            match field.count {
                Count::Fixed(n) => write!(f, "[{n}]")?,
                Count::Variable => f.write_str("[*]")?,
            }
        }
        Ok(())
    }
}

impl std::str::FromStr for Schema {
    type Err = Error;
    fn from_str(s: &str) -> Result<Schema> {
        Schema::parse(s)
    }
}

/// Where a record's fields lie: each field's byte offset from the record's start and
/// its element count; and the record's total length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spans {
    fields: [(u32, u32); MAX_FIELDS],
    n: usize,
    len: u32,
}

impl Spans {
    /// `(offset from the record's start, element count)` of field `i`.
    pub fn field(&self, i: usize) -> (u32, u32) {
        self.fields[..self.n][i]
    }
    pub fn len(&self) -> u32 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    pub fn count(&self) -> usize {
        self.n
    }
}

/// A record's first word, unpacked: `len` bits 0-31, `kind` 32-35, `state` 36-39, `rank`
/// 40-47 (the claiming rank, while claimed or after), `lap` 48-63 (the record's position
/// divided by the lane capacity, low 16 bits: a reader holding a stale position tells a
/// newer record at the same place from the one it looked for).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Word0 {
    pub len: u32,
    pub kind: u8,
    pub state: u8,
    pub rank: u8,
    pub lap: u16,
}

impl Word0 {
    pub const fn pack(self) -> u64 {
        self.len as u64
            | ((self.kind as u64 & 0xF) << 32)
            | ((self.state as u64 & 0xF) << 36)
            | ((self.rank as u64) << 40)
            | ((self.lap as u64) << 48)
    }
    pub const fn unpack(w: u64) -> Word0 {
        Word0 {
            len: w as u32,
            kind: ((w >> 32) & 0xF) as u8,
            state: ((w >> 36) & 0xF) as u8,
            rank: (w >> 40) as u8,
            lap: (w >> 48) as u16,
        }
    }
    /// The same word in another state, claimed by `rank`.
    pub const fn with_state(self, state: u8, rank: u8) -> Word0 {
        Word0 {
            state,
            rank,
            ..self
        }
    }
}

/// The largest record of a lane of `capacity` bytes: half of it. A record that does not
/// fit before the lane's end goes to its start after a pad; past half the lane the pad
/// and the record could overlap (a record longer than the bytes before `head`'s place).
pub const fn max_record(capacity: u64) -> u64 {
    capacity / 2
}

/// The lap tag of position `pos` in a lane of `capacity` bytes (a power of two).
pub const fn lap_of(pos: u64, capacity: u64) -> u16 {
    (pos / capacity) as u16
}

/// Checks `word0` as read at position `pos` of a lane of `capacity` bytes whose producer
/// has committed up to `head` (`pos < head`): a pad that reaches exactly to the lane's
/// end, or a record of at least `min_len` bytes, 8-aligned, not crossing the end, not
/// past `head`, of the lap of `pos`. The detail of what is wrong otherwise.
pub fn check_word0(
    w: Word0,
    pos: u64,
    head: u64,
    capacity: u64,
    min_len: usize,
) -> std::result::Result<(), String> {
    let at = pos % capacity;
    if w.lap != lap_of(pos, capacity) {
        return Err(format!(
            "record at {pos} has lap {}, not {}",
            w.lap,
            lap_of(pos, capacity)
        ));
    }
    let len = w.len as u64;
    let end_ok = pos.checked_add(len).is_some_and(|e| e <= head);
    match w.kind {
        KIND_PAD if len == capacity - at && end_ok => Ok(()),
        KIND_PAD => Err(format!(
            "pad at {pos} of {len} bytes does not reach the lane's end ({} bytes on) or passes head {head}",
            capacity - at
        )),
        KIND_RECORD
            if len >= min_len as u64 && len % 8 == 0 && at + len <= capacity && end_ok =>
        {
            Ok(())
        }
        KIND_RECORD => Err(format!(
            "record at {pos} of {len} bytes: under its header ({min_len}), not 8-aligned, across the lane's end or past head {head}"
        )),
        k => Err(format!("record at {pos} has kind {k}")),
    }
}

/// The fields of a record of `len` bytes whose header bytes (the three words and the
/// variable counts) are `header`: each count times its dtype, 8-aligned, must end exactly
/// at `len`. The detail of what is wrong otherwise.
pub fn decode_record(
    schema: &Schema,
    header: &[u8],
    len: u32,
) -> std::result::Result<Spans, String> {
    let hl = schema.record_header_len();
    if header.len() < hl || (len as usize) < hl {
        return Err(format!(
            "a record of {len} bytes is shorter than its {hl}-byte header"
        ));
    }
    let counts: Vec<u32> = (0..schema.variable_count())
        .map(|i| {
            let at = RECORD_FIXED + 4 * i;
            u32::from_le_bytes(header[at..at + 4].try_into().expect("4 bytes"))
        })
        .collect();
    let spans = schema
        .spans(&counts, len as u64)
        .map_err(|_| format!("its element counts {counts:?} need more than its {len} bytes"))?;
    if spans.len() != len {
        return Err(format!(
            "its element counts {counts:?} make {} bytes, not its {len}",
            spans.len()
        ));
    }
    Ok(spans)
}

/// What a stream is made of: its schema, lanes (one per producer at a time), each lane's
/// capacity in bytes, and the ranks of its consumer group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSpec {
    pub schema: Schema,
    pub lanes: u32,
    pub lane_capacity: u64,
    pub ranks: u32,
}

/// A stream header, validated: what a stream's file holds and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamLayout {
    pub schema: Schema,
    pub lanes: u32,
    pub ranks: u32,
    pub lane_capacity: u64,
    pub lane_stride: u64,
    pub file_size: u64,
}

impl StreamLayout {
    /// The layout of a spec: checked ([`StreamSpec`]'s rules, `InvalidSpec`-free: the
    /// errors name the field as a header error would).
    pub fn of(spec: &StreamSpec) -> Result<StreamLayout> {
        let bad = |field, reason: String| Err(Error::InvalidHeader { field, reason });
        if spec.lanes == 0 || spec.lanes > MAX_LANES {
            return bad("lanes", format!("{}: use 1 to {MAX_LANES}", spec.lanes));
        }
        if spec.ranks == 0 || spec.ranks > MAX_RANKS {
            return bad("ranks", format!("{}: use 1 to {MAX_RANKS}", spec.ranks));
        }
        let c = spec.lane_capacity;
        if !c.is_power_of_two() || !(MIN_LANE_CAPACITY..=MAX_LANE_CAPACITY).contains(&c) {
            return bad(
                "lane_capacity",
                format!("{c}: a power of two from {MIN_LANE_CAPACITY} to {MAX_LANE_CAPACITY}"),
            );
        }
        // The smallest record must fit.
        spec.schema
            .spans(&vec![0; spec.schema.variable_count()], max_record(c))?;
        let stride = LANE_CTRL_SIZE + c;
        let file_size = (spec.lanes as u64)
            .checked_mul(stride)
            .and_then(|l| l.checked_add(STREAM_HEADER_SIZE))
            .ok_or_else(|| Error::InvalidHeader {
                field: "lanes",
                reason: "the stream's size overflows".into(),
            })?;
        Ok(StreamLayout {
            schema: spec.schema.clone(),
            lanes: spec.lanes,
            ranks: spec.ranks,
            lane_capacity: c,
            lane_stride: stride,
            file_size,
        })
    }

    /// Byte offset of lane `i`'s control words; its data follow them.
    pub fn lane_offset(&self, i: u32) -> u64 {
        STREAM_HEADER_SIZE + i as u64 * self.lane_stride
    }

    /// The header's bytes with `magic` 0 (published last, by the creator).
    pub fn header_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; STREAM_HEADER_SIZE as usize];
        let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        put(OFF_TAG, &STREAM_TAG.to_le_bytes());
        put(OFF_VERSION_MAJOR, &super::VERSION_MAJOR.to_le_bytes());
        put(OFF_VERSION_MINOR, &STREAM_VERSION_MINOR.to_le_bytes());
        put(OFF_HEADER_SIZE, &(STREAM_HEADER_SIZE as u32).to_le_bytes());
        put(OFF_FILE_SIZE, &self.file_size.to_le_bytes());
        put(OFF_LANES, &self.lanes.to_le_bytes());
        put(OFF_RANKS, &self.ranks.to_le_bytes());
        put(OFF_LANE_CAPACITY, &self.lane_capacity.to_le_bytes());
        put(OFF_LANE_STRIDE, &self.lane_stride.to_le_bytes());
        put(
            OFF_FIELD_COUNT,
            &(self.schema.fields.len() as u32).to_le_bytes(),
        );
        self.schema.encode(&mut b);
        b
    }

    /// Validates a published header's bytes (a copy) against the file's `actual` size.
    pub fn validate(name: &str, bytes: &[u8], actual: u64) -> Result<StreamLayout> {
        if bytes.len() < STREAM_HEADER_SIZE as usize || actual < STREAM_HEADER_SIZE {
            return Err(Error::RegionTooSmall {
                needed: STREAM_HEADER_SIZE,
                actual: actual.min(bytes.len() as u64),
            });
        }
        let u16_at = |at: usize| u16::from_le_bytes(bytes[at..at + 2].try_into().expect("2"));
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"));
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        let magic = u64_at(OFF_MAGIC);
        if magic != STREAM_MAGIC || u64_at(OFF_TAG) != STREAM_TAG {
            return Err(Error::BadMagic {
                name: name.to_string(),
                found: magic,
            });
        }
        let (major, minor) = (u16_at(OFF_VERSION_MAJOR), u16_at(OFF_VERSION_MINOR));
        if major != super::VERSION_MAJOR || minor < STREAM_VERSION_MINOR {
            return Err(Error::VersionMismatch {
                ours_major: super::VERSION_MAJOR,
                ours_minor: STREAM_VERSION_MINOR,
                theirs_major: major,
                theirs_minor: minor,
            });
        }
        if u32_at(OFF_HEADER_SIZE) as u64 != STREAM_HEADER_SIZE {
            return Err(Error::InvalidHeader {
                field: "header_size",
                reason: format!("{}, not {STREAM_HEADER_SIZE}", u32_at(OFF_HEADER_SIZE)),
            });
        }
        let schema = Schema::decode(bytes, u32_at(OFF_FIELD_COUNT) as usize)?;
        let layout = StreamLayout::of(&StreamSpec {
            schema,
            lanes: u32_at(OFF_LANES),
            lane_capacity: u64_at(OFF_LANE_CAPACITY),
            ranks: u32_at(OFF_RANKS),
        })?;
        if u64_at(OFF_LANE_STRIDE) != layout.lane_stride {
            return Err(Error::InvalidHeader {
                field: "lane_stride",
                reason: format!("{}, not {}", u64_at(OFF_LANE_STRIDE), layout.lane_stride),
            });
        }
        let file_size = u64_at(OFF_FILE_SIZE);
        if file_size != layout.file_size || actual < file_size {
            return Err(Error::RegionTooSmall {
                needed: layout.file_size,
                actual: actual.min(file_size),
            });
        }
        Ok(layout)
    }
}

/// Whether header bytes `bytes` are a stream's, published or not: its tag (for the sweep).
pub fn is_stream(bytes: &[u8]) -> bool {
    bytes.len() >= 16 && bytes[OFF_TAG..OFF_TAG + 8] == STREAM_TAG.to_le_bytes()
}

/// Whether a stream's header bytes carry its magic (published).
pub fn stream_published(bytes: &[u8]) -> bool {
    bytes.len() >= 8 && bytes[..8] == STREAM_MAGIC.to_le_bytes()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn schema() -> Schema {
        Schema::parse("tokens: int32[*], score: float64[1], meta: uint8[*]").unwrap()
    }

    #[test]
    fn a_schema_parses_prints_and_places_its_fields() {
        let s = schema();
        assert_eq!(
            s.to_string(),
            "tokens: int32[*], score: float64[1], meta: uint8[*]"
        );
        assert_eq!(s.record_header_len(), 32);
        let sp = s.spans(&[3, 5], 1 << 20).unwrap();
        assert_eq!(sp.field(0), (32, 3)); // 12 bytes -> 16
        assert_eq!(sp.field(1), (48, 1));
        assert_eq!(sp.field(2), (56, 5)); // 5 -> 8
        assert_eq!(sp.len(), 64);
    }

    #[test]
    fn bad_schemas_and_lengths_are_refused() {
        for bad in [
            "",
            "x",
            "a: int32[0]",
            "a: int33[1]",
            "a: u8[1], a: u8[1]",
            "a b: u8",
        ] {
            assert!(Schema::parse(bad).is_err(), "{bad}");
        }
        let s = schema();
        assert!(matches!(
            s.spans(&[1], 1 << 20),
            Err(Error::InvalidTensor { .. })
        ));
        assert!(matches!(
            s.spans(&[1000, 0], 256),
            Err(Error::RecordTooLarge { capacity: 256, .. })
        ));
        assert!(matches!(
            s.spans(&[u32::MAX, u32::MAX], MAX_LANE_CAPACITY),
            Err(Error::RecordTooLarge { .. })
        ));
    }

    #[test]
    fn a_header_round_trips_and_bad_ones_are_refused() {
        let l = StreamLayout::of(&StreamSpec {
            schema: schema(),
            lanes: 3,
            lane_capacity: 4096,
            ranks: 2,
        })
        .unwrap();
        let mut b = l.header_bytes();
        assert!(is_stream(&b) && !stream_published(&b));
        assert!(matches!(
            StreamLayout::validate("s", &b, l.file_size),
            Err(Error::BadMagic { .. })
        ));
        b[..8].copy_from_slice(&STREAM_MAGIC.to_le_bytes());
        assert_eq!(StreamLayout::validate("s", &b, l.file_size).unwrap(), l);
        assert!(matches!(
            StreamLayout::validate("s", &b, l.file_size - 1),
            Err(Error::RegionTooSmall { .. })
        ));
        let mut c = b.clone();
        c[OFF_LANE_CAPACITY] = 3;
        assert!(StreamLayout::validate("s", &c, l.file_size).is_err());
        let mut c = b.clone();
        c[OFF_FIELD_COUNT] = 17;
        assert!(StreamLayout::validate("s", &c, l.file_size).is_err());
        let mut c = b.clone();
        c[OFF_SCHEMA + 32] = 9; // dtype code
        assert!(StreamLayout::validate("s", &c, l.file_size).is_err());
    }

    #[test]
    fn hostile_record_words_are_refused() {
        let cap = 256;
        let ok = Word0 {
            len: 64,
            kind: KIND_RECORD,
            state: STATE_READY,
            rank: 0,
            lap: 1,
        };
        assert_eq!(check_word0(ok, 256, 1024, cap, 32), Ok(()));
        for bad in [
            Word0 { lap: 0, ..ok },
            Word0 { len: 60, ..ok },
            Word0 { len: 8, ..ok },
            Word0 { len: 512, ..ok },
            Word0 { kind: 7, ..ok },
            Word0 {
                kind: KIND_PAD,
                ..ok
            },
        ] {
            assert!(check_word0(bad, 256, 1024, cap, 32).is_err(), "{bad:?}");
        }
        // Past head.
        assert!(check_word0(ok, 256, 300, cap, 32).is_err());
        // Across the end.
        assert!(check_word0(Word0 { len: 64, ..ok }, 256 + 224, 2048, cap, 32).is_err());
        let s = schema();
        let mut h = vec![0u8; 32];
        h[24..28].copy_from_slice(&3u32.to_le_bytes());
        h[28..32].copy_from_slice(&5u32.to_le_bytes());
        assert!(decode_record(&s, &h, 64).is_ok());
        assert!(decode_record(&s, &h, 72).is_err());
        h[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_record(&s, &h, 64).is_err());
        assert!(decode_record(&s, &h[..8], 64).is_err());
    }
}
