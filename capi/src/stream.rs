//! Trajectory streams (`shmbridge::stream`): many producers, one consumer or a consumer
//! group, records of named fields written and read in place (docs/stream.md). Four kinds
//! of handle: a consumer (one rank), a producer (one lane), a reservation (a record being
//! written) and a record (popped, until released). Each call goes to the core's function
//! of the same name; the fields are the core's pointers into the stream, never copies.

use std::ffi::{c_char, c_void};

use shmbridge_core::stream::{
    Consumer, Producer, Record, Reservation, Schema, StreamSpec, StreamStats,
};

use crate::client::maybe;
use crate::registry::{Kind, Registry};
use crate::status::{guard, shmb_status, CResult, Fail};
use crate::types::{dtype_code, need, put, slice_arg, str_arg, timeout};

/// A stream's consumer: one rank of its group (opaque; a handle, never dereferenced).
#[allow(non_camel_case_types)]
pub struct shmb_stream_consumer {
    _opaque: [u8; 0],
}

/// A stream's producer: the writer of one lane (opaque; a handle).
#[allow(non_camel_case_types)]
pub struct shmb_stream_producer {
    _opaque: [u8; 0],
}

/// A record reserved by a producer, to write in place, then commit or abort (opaque; a
/// handle).
#[allow(non_camel_case_types)]
pub struct shmb_stream_reservation {
    _opaque: [u8; 0],
}

/// A record popped by a consumer, to read in place, then release (opaque; a handle).
#[allow(non_camel_case_types)]
pub struct shmb_stream_record {
    _opaque: [u8; 0],
}

/// A stream's flow metrics, summed over its lanes (`shmb_stream_consumer_stats`,
/// `shmb_stream_producer_stats`): plain words of the stream, read as they are.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct shmb_stream_stats {
    /// Lanes (the most producers at once) and ranks of the stream.
    pub lanes: u32,
    pub ranks: u32,
    /// Lanes that have a producer now.
    pub producers: u32,
    /// Records committed and not yet released or lost.
    pub depth: u64,
    /// Bytes committed and not yet released, over all lanes.
    pub bytes_in_use: u64,
    /// Records committed, released, over all lanes.
    pub records_committed: u64,
    pub records_released: u64,
    /// Reserves that found their lane full and waited.
    pub full_waits: u64,
    /// Records that dead ranks claimed and survivors released as lost.
    pub records_lost: u64,
}

impl From<StreamStats> for shmb_stream_stats {
    fn from(s: StreamStats) -> Self {
        shmb_stream_stats {
            lanes: s.lanes.len() as u32,
            ranks: s.ranks.len() as u32,
            producers: s.lanes.iter().filter(|l| l.producer_pid != 0).count() as u32,
            depth: s.depth,
            bytes_in_use: s.bytes_in_use,
            records_committed: s.lanes.iter().map(|l| l.records_committed).sum(),
            records_released: s.lanes.iter().map(|l| l.records_released).sum(),
            full_waits: s.full_waits,
            records_lost: s.records_lost,
        }
    }
}

static CONSUMERS: Registry<Consumer> = Registry::new("stream consumer", Kind::StreamConsumer);
static PRODUCERS: Registry<Producer> = Registry::new("stream producer", Kind::StreamProducer);
static RESERVATIONS: Registry<Reservation> =
    Registry::new("stream reservation", Kind::StreamReservation);
static RECORDS: Registry<Record> = Registry::new("stream record", Kind::StreamRecord);

/// A schema from C text (`"tokens: int32[*], score: float64[1]"`, docs/stream.md).
///
/// # Safety
/// `text` is NULL or a NUL-terminated string.
unsafe fn schema_arg(text: *const c_char) -> CResult<Schema> {
    // SAFETY: forwarded contract.
    let text = unsafe { str_arg(text, "schema")? };
    Ok(Schema::parse(text)?)
}

/// A field's address, count and dtype written through three out-pointers (all checked
/// before the call's work).
///
/// # Safety
/// Each pointer is NULL or writable.
unsafe fn put_field(
    field: (*mut u8, usize, shmbridge_core::DType),
    data: *mut *mut c_void,
    count: *mut usize,
    dtype: *mut u32,
) -> CResult {
    // SAFETY: checked non-null by the callers; writable per the caller's contract.
    unsafe {
        put(data, field.0 as *mut c_void, "data")?;
        put(count, field.1, "count")?;
        put(dtype, dtype_code(field.2), "dtype")
    }
}

/// Creates stream `name` and serves its rank 0: `schema` is its fields' text
/// (`"tokens: int32[*], logprobs: float32[*], score: float64[1]"`; a bad one is
/// `SHMB_INVALID_SPEC`), `lanes` the most producers at once (1..=1024), `lane_capacity`
/// each producer's buffer in bytes (a power of two, 64 B..2 GiB; a record holds at most
/// half of it), `ranks` the consumers of the group (1..=16; the others attach with
/// `shmb_stream_attach_consumer`). The name is canonical as region names are (the
/// namespace of `SHMBRIDGE_NAMESPACE`) and is removed when this consumer is closed.
///
/// Ownership: the strings are copied; `*out` is a new consumer owned by the caller,
/// closed with `shmb_stream_consumer_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_create(
    name: *const c_char,
    schema: *const c_char,
    lanes: u32,
    lane_capacity: u64,
    ranks: u32,
    out: *mut *mut shmb_stream_consumer,
) -> shmb_status {
    guard(|| {
        need(out, "out")?;
        // SAFETY: NUL-terminated strings or NULL per the caller's contract.
        let (name, schema) = unsafe { (str_arg(name, "name")?, schema_arg(schema)?) };
        let spec = StreamSpec {
            schema,
            lanes,
            lane_capacity,
            ranks,
        };
        let handle = CONSUMERS.insert(Consumer::create(name, &spec)?)?;
        // SAFETY: checked non-null above; writable per the caller's contract.
        unsafe { put(out, handle as *mut shmb_stream_consumer, "out") }
    })
}

/// Serves rank `rank` of stream `name`'s group (0 < `rank` < its ranks), waiting up to
/// `timeout_ms` for the stream to be published. A rank a live process serves is
/// `SHMB_ALREADY_ATTACHED`; one whose process ended is taken over (its unreleased records
/// released as lost first).
///
/// Ownership: `*out` is a new consumer, closed with `shmb_stream_consumer_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_attach_consumer(
    name: *const c_char,
    rank: u32,
    timeout_ms: u64,
    out: *mut *mut shmb_stream_consumer,
) -> shmb_status {
    guard(|| {
        need(out, "out")?;
        // SAFETY: a NUL-terminated string or NULL per the caller's contract.
        let name = unsafe { str_arg(name, "name")? };
        let consumer = Consumer::attach(name, rank, timeout(timeout_ms))?;
        let handle = CONSUMERS.insert(consumer)?;
        // SAFETY: checked non-null above; writable per the caller's contract.
        unsafe { put(out, handle as *mut shmb_stream_consumer, "out") }
    })
}

/// Attaches a producer to stream `name` (waiting up to `timeout_ms` for it to be
/// published) and claims a lane of its own: a free one, or one whose producer ended.
/// `schema` (NULL: any) must be the stream's (`SHMB_LAYOUT_MISMATCH` otherwise). Every
/// lane held by a live producer: `SHMB_ALREADY_ATTACHED`.
///
/// Ownership: `*out` is a new producer, closed with `shmb_stream_producer_close` (which
/// frees its lane).
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_attach_producer(
    name: *const c_char,
    schema: *const c_char,
    timeout_ms: u64,
    out: *mut *mut shmb_stream_producer,
) -> shmb_status {
    guard(|| {
        need(out, "out")?;
        // SAFETY: a NUL-terminated string or NULL per the caller's contract.
        let name = unsafe { str_arg(name, "name")? };
        let schema = if schema.is_null() {
            None
        } else {
            // SAFETY: as above.
            Some(unsafe { schema_arg(schema)? })
        };
        let producer = Producer::attach(name, schema.as_ref(), timeout(timeout_ms))?;
        let handle = PRODUCERS.insert(producer)?;
        // SAFETY: checked non-null above; writable per the caller's contract.
        unsafe { put(out, handle as *mut shmb_stream_producer, "out") }
    })
}

/// The producer's lane and the largest record it can reserve, in bytes (each NULL to
/// skip).
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_producer_info(
    producer: *mut shmb_stream_producer,
    lane: *mut u32,
    max_record: *mut u64,
) -> shmb_status {
    guard(|| {
        let (l, m) = PRODUCERS.with(producer as usize, |p| Ok((p.lane(), p.max_record())))?;
        // SAFETY: NULL or writable per the caller's contract.
        unsafe {
            maybe(lane, l);
            maybe(max_record, m);
        }
        Ok(())
    })
}

/// Reserves a record whose variable fields (`[*]` in the schema) have `lengths[i]`
/// elements, one per variable field in schema order (`n_lengths` of them; `lengths` may
/// be NULL when it is 0), waiting up to `timeout_ms` for room in the lane. Errors:
/// `SHMB_FULL` (the lane stayed full the whole time: nothing was written),
/// `SHMB_RECORD_TOO_LARGE` (larger than half a lane), `SHMB_INVALID_TENSOR` (a wrong
/// number of lengths), `SHMB_OUT_OF_ORDER` (this producer's previous reservation is still
/// open), `SHMB_CLIENT_CLOSED`/`SHMB_CLIENT_DIED` (no consumer rank is left).
///
/// Ownership: `*out` is a new reservation: write its fields (`shmb_stream_reservation_field`),
/// then `shmb_stream_commit` or `shmb_stream_abort`, either of which closes the handle.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_reserve(
    producer: *mut shmb_stream_producer,
    lengths: *const u32,
    n_lengths: usize,
    timeout_ms: u64,
    out: *mut *mut shmb_stream_reservation,
) -> shmb_status {
    guard(|| {
        need(out, "out")?;
        // SAFETY: NULL or `n_lengths` readable u32s per the caller's contract.
        let lengths = unsafe { slice_arg(lengths, n_lengths, "lengths")? };
        let r = PRODUCERS.with(producer as usize, |p| {
            Ok(p.reserve(lengths, timeout(timeout_ms))?)
        })?;
        let handle = RESERVATIONS.insert(r)?;
        // SAFETY: checked non-null above; writable per the caller's contract.
        unsafe { put(out, handle as *mut shmb_stream_reservation, "out") }
    })
}

/// Field `index` of a reservation: its address in the stream (to write in place), its
/// element count and its dtype (a `shmb_dtype`). A field past the schema:
/// `SHMB_INVALID_TENSOR`.
///
/// Ownership: the memory is the stream's, writable until the reservation is committed or
/// aborted, and not read by anyone before the commit.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_reservation_field(
    reservation: *mut shmb_stream_reservation,
    index: usize,
    data: *mut *mut c_void,
    count: *mut usize,
    dtype: *mut u32,
) -> shmb_status {
    guard(|| {
        need(data, "data")?;
        need(count, "count")?;
        need(dtype, "dtype")?;
        let field = RESERVATIONS.with(reservation as usize, |r| Ok(r.field_raw(index)?))?;
        // SAFETY: all three checked non-null above; writable per the caller's contract.
        unsafe { put_field(field, data, count, dtype) }
    })
}

/// Publishes the record, whole, and wakes a sleeping consumer. The handle is closed
/// (the record's memory is no longer the producer's).
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_commit(
    reservation: *mut shmb_stream_reservation,
) -> shmb_status {
    guard(|| {
        RESERVATIONS.remove(reservation as usize)?.commit();
        Ok(())
    })
}

/// Gives the reservation up: nothing is published. The handle is closed.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_abort(
    reservation: *mut shmb_stream_reservation,
) -> shmb_status {
    guard(|| {
        RESERVATIONS.remove(reservation as usize)?.abort();
        Ok(())
    })
}

/// Takes the next record of any lane (the lanes in turn), waiting up to `timeout_ms`
/// (0: no wait). `SHMB_TIMEOUT` when none came in that time (`*out` untouched);
/// `SHMB_PROTOCOL` when a record's bytes break the stream's rules (the stream is unusable
/// from then on: every later pop says so again).
///
/// Ownership: `*out` is a new record, closed by `shmb_stream_release` (its space goes
/// back to its producer). Records may be released in any order, and outlive the
/// consumer's handle.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_pop(
    consumer: *mut shmb_stream_consumer,
    timeout_ms: u64,
    out: *mut *mut shmb_stream_record,
) -> shmb_status {
    guard(|| {
        need(out, "out")?;
        let wait = timeout(timeout_ms);
        let record = CONSUMERS
            .with(consumer as usize, |c| Ok(c.pop(wait)?))?
            .ok_or_else(|| {
                Fail::new(
                    shmb_status::SHMB_TIMEOUT,
                    format!("no record came within {timeout_ms} ms"),
                )
            })?;
        let handle = RECORDS.insert(record)?;
        // SAFETY: checked non-null above; writable per the caller's contract.
        unsafe { put(out, handle as *mut shmb_stream_record, "out") }
    })
}

/// Field `index` of a popped record: its address in the stream (read in place), its
/// element count and its dtype (a `shmb_dtype`). A field past the schema:
/// `SHMB_INVALID_TENSOR`.
///
/// Ownership: the memory is the stream's, valid until `shmb_stream_release`; never write
/// it.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_record_field(
    record: *mut shmb_stream_record,
    index: usize,
    data: *mut *const c_void,
    count: *mut usize,
    dtype: *mut u32,
) -> shmb_status {
    guard(|| {
        need(data, "data")?;
        need(count, "count")?;
        need(dtype, "dtype")?;
        let (p, n, d) = RECORDS.with(record as usize, |r| Ok(r.field_raw(index)?))?;
        // SAFETY: all three checked non-null above; writable per the caller's contract.
        unsafe { put_field((p as *mut u8, n, d), data as *mut *mut c_void, count, dtype) }
    })
}

/// Where a record came from: its lane, its producer's sequence number (0, 1, 2, ... per
/// producer attach, in commit order) and the lane's producer generation (tells two
/// producers of one lane apart). Each pointer may be NULL to skip it.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_record_info(
    record: *mut shmb_stream_record,
    lane: *mut u32,
    seq: *mut u64,
    producer: *mut u64,
) -> shmb_status {
    guard(|| {
        let (l, s, p) = RECORDS.with(record as usize, |r| Ok((r.lane(), r.seq(), r.producer())))?;
        // SAFETY: NULL or writable per the caller's contract.
        unsafe {
            maybe(lane, l);
            maybe(seq, s);
            maybe(producer, p);
        }
        Ok(())
    })
}

/// Releases a record: its space goes back to its producer and the handle is closed
/// (used again: `SHMB_CLOSED`).
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_release(record: *mut shmb_stream_record) -> shmb_status {
    guard(|| {
        RECORDS.remove(record as usize)?.release();
        Ok(())
    })
}

/// The stream's flow metrics, as the consumer sees them.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_consumer_stats(
    consumer: *mut shmb_stream_consumer,
    stats: *mut shmb_stream_stats,
) -> shmb_status {
    guard(|| {
        need(stats, "stats")?;
        let s = CONSUMERS.with(consumer as usize, |c| Ok(c.stats()?))?;
        // SAFETY: checked non-null above; writable per the caller's contract.
        unsafe { put(stats, s.into(), "stats") }
    })
}

/// The stream's flow metrics, as the producer sees them.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_producer_stats(
    producer: *mut shmb_stream_producer,
    stats: *mut shmb_stream_stats,
) -> shmb_status {
    guard(|| {
        need(stats, "stats")?;
        let s = PRODUCERS.with(producer as usize, |p| Ok(p.stats()?))?;
        // SAFETY: checked non-null above; writable per the caller's contract.
        unsafe { put(stats, s.into(), "stats") }
    })
}

/// Closes a consumer: its rank is marked closed (producers get `SHMB_CLIENT_CLOSED` once
/// no rank is live) and, for the creator, the stream's name is removed. Records it
/// popped stay valid until released.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_consumer_close(
    consumer: *mut shmb_stream_consumer,
) -> shmb_status {
    guard(|| {
        CONSUMERS.remove(consumer as usize)?.close();
        Ok(())
    })
}

/// Closes a producer and frees its lane. A reservation still open stays writable until
/// committed or aborted.
#[no_mangle]
pub unsafe extern "C" fn shmb_stream_producer_close(
    producer: *mut shmb_stream_producer,
) -> shmb_status {
    guard(|| {
        drop(PRODUCERS.remove(producer as usize)?);
        Ok(())
    })
}
