//! Trajectory streams from Python (`shmbridge.stream`): thin classes over
//! [`crate::stream`]'s consumer, producer, record and reservation. Field views are NumPy
//! slices of one array over the mapping ([`PyStreamMemory`], exported once through DLPack
//! with a [`Mapping`] as its context, so the bytes stay mapped while any view lives); the
//! classes here hand out where each field lies in it (`spans`), and
//! `python/shmbridge/stream.py` builds the views.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLDeviceType, DLManagedTensor, DLManagedTensorVersioned,
};
use dlpark::metadata::Dynamic;
use dlpark::python::{DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyInt, PyList, PySlice, PyString, PyTuple};

use super::args::{counts, Count, Seconds};
use super::errors::{error_of_kind, to_pyerr, IntoPy};
use super::waits::{duration, next_slice, wait_policy};
use crate::error::{Error, ErrorKind, Peer};
use crate::layout::stream::{Field, LANE_CTRL_SIZE};
use crate::layout::{DType, DL_UINT};
use crate::stream::{
    Consumer, Count as FieldCount, Mapping, Producer, Record, Reservation, Schema, StreamSpec,
    StreamStats,
};
use crate::sync::WaitPolicy;

/// Bytes of a stream's mapping as one uint8 array: the whole stream (a consumer's,
/// read-only once NumPy has it) or one lane's data (its producer's).
#[pyclass(module = "shmbridge._native", name = "StreamMemory", frozen)]
pub struct PyStreamMemory {
    mapping: Mapping,
    /// The address of the first byte exported, and how many.
    start: usize,
    len: usize,
}

impl PyStreamMemory {
    /// `offset..offset + len` of `mapping` (checked against its length).
    fn new(mapping: Mapping, offset: usize, len: usize) -> PyResult<PyStreamMemory> {
        let (base, total) = mapping.span();
        if offset.checked_add(len).is_none_or(|end| end > total) {
            return Err(PyRuntimeError::new_err(format!(
                "stream memory {offset}+{len} past its mapping of {total} bytes"
            )));
        }
        Ok(PyStreamMemory {
            start: base as usize + offset,
            len,
            mapping,
        })
    }

    /// The offset of `nbytes` bytes at `address`, checked to lie in this memory (the
    /// views are slices of it).
    fn offset_of(&self, address: usize, nbytes: usize) -> PyResult<usize> {
        address
            .checked_sub(self.start)
            .filter(|off| off.checked_add(nbytes).is_some_and(|end| end <= self.len))
            .ok_or_else(|| {
                PyRuntimeError::new_err(format!(
                    "stream field at {address:#x}+{nbytes} outside the mapping at {:#x}+{}",
                    self.start, self.len
                ))
            })
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        fn failed(e: impl std::fmt::Display) -> PyErr {
            PyRuntimeError::new_err(format!("building a DLPack tensor: {e}"))
        }
        let mut init = Dynamic::compact(vec![self.len as i64])
            .initialize_as::<M>(Arc::new(self.mapping.clone()))
            .map_err(failed)?;
        init.set_data(self.start as *mut std::ffi::c_void)
            .set_dtype(DLDataType {
                code: DLDataTypeCode(crate::layout::DL_UINT),
                bits: 8,
                lanes: 1,
            })
            .set_device(DLDevice::CPU);
        // SAFETY: `start..start + len` lies inside the mapping (checked in `new`), and
        // the context is an `Arc` of a `Mapping`, which keeps that mapping alive until
        // the consumer of the capsule calls the deleter. Which bytes may be written when
        // is the stream's protocol, applied by the classes that hand out the spans.
        Ok(unsafe { init.finish() })
    }
}

impl DlpackExporter for PyStreamMemory {
    fn device(&self) -> DLDevice {
        DLDevice::CPU
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[pymethods]
impl PyStreamMemory {
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if let Some(s) = &stream {
            if !s.is_none() && s.extract::<i64>().ok() != Some(-1) {
                return Err(PyValueError::new_err(
                    "stream must be None for a CPU tensor",
                ));
            }
        }
        let request = ExportRequest::parse(None, max_version, dl_device, copy)?;
        dlpark::python::export_dlpack(slf.get(), slf.py(), request)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        (DLDevice::CPU.device_type.0, DLDevice::CPU.device_id)
    }

    /// The address of its first byte.
    #[getter]
    fn address(&self) -> usize {
        self.start
    }

    fn __len__(&self) -> usize {
        self.len
    }
}

/// `(name, numpy dtype name, fixed count or None)` of each field.
fn fields_of(schema: &Schema) -> Vec<(String, &'static str, Option<u32>)> {
    schema
        .fields()
        .iter()
        .map(|f| {
            let count = match f.count {
                FieldCount::Fixed(n) => Some(n),
                FieldCount::Variable => None,
            };
            (f.name.clone(), f.dtype.array_name(), count)
        })
        .collect()
}

fn closed(py: Python<'_>, peer: Peer) -> PyErr {
    to_pyerr(py, Error::Closed(peer))
}

/// A timeout argument: `None` waits without limit.
fn limit(timeout: Option<Seconds>) -> PyResult<Option<Duration>> {
    timeout.map(|t| duration(t, "timeout")).transpose()
}

fn stats_dict<'py>(py: Python<'py>, s: &StreamStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("depth", s.depth)?;
    d.set_item("bytes_in_use", s.bytes_in_use)?;
    d.set_item("full_waits", s.full_waits)?;
    d.set_item("records_lost", s.records_lost)?;
    let lanes = PyList::empty(py);
    for l in &s.lanes {
        let e = PyDict::new(py);
        e.set_item("producer_pid", l.producer_pid)?;
        e.set_item("records_committed", l.records_committed)?;
        e.set_item("bytes_committed", l.bytes_committed)?;
        e.set_item("records_released", l.records_released)?;
        e.set_item("records_lost", l.records_lost)?;
        e.set_item("bytes_in_use", l.bytes_in_use)?;
        lanes.append(e)?;
    }
    d.set_item("lanes", lanes)?;
    let ranks = PyList::empty(py);
    for r in &s.ranks {
        let e = PyDict::new(py);
        e.set_item("pid", r.pid)?;
        e.set_item(
            "state",
            match r.state {
                1 => "live",
                2 => "closed",
                _ => "never attached",
            },
        )?;
        e.set_item("popped", r.popped)?;
        e.set_item("released", r.released)?;
        e.set_item("lost", r.lost)?;
        ranks.append(e)?;
    }
    d.set_item("ranks", ranks)?;
    Ok(d)
}

/// Stream `name`'s flow metrics, for an observer (nothing is written).
#[pyfunction]
pub(super) fn stream_stats<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
    let s = py.detach(|| crate::stream::stats(name)).py_err(py)?;
    stats_dict(py, &s)
}

/// The names of the streams of this process's region namespace (`SHMBRIDGE_NAMESPACE`),
/// sorted.
#[pyfunction]
pub(super) fn stream_names(py: Python<'_>) -> PyResult<Vec<String>> {
    py.detach(crate::stream::names).py_err(py)
}

// ---- Consumers ----

/// One rank of a stream's consumer group (`shmbridge.stream.Consumer` wraps it).
#[pyclass(module = "shmbridge._native", name = "StreamConsumer", frozen)]
pub struct PyStreamConsumer {
    /// Taken out by `close()`; a pop in flight holds its own reference (the lock is
    /// never held while the GIL is released: another thread may wait on it holding the
    /// GIL).
    consumer: Mutex<Option<Arc<Consumer>>>,
    memory: Py<PyStreamMemory>,
    #[pyo3(get)]
    name: String,
    #[pyo3(get)]
    rank: u32,
    #[pyo3(get)]
    schema: String,
    #[pyo3(get)]
    fields: Vec<(String, &'static str, Option<u32>)>,
    /// Each field's element size in bytes.
    sizes: Vec<usize>,
    /// What its records' views are sliced from, once the Python layer gave it
    /// (`use_views`).
    views: OnceLock<Arc<RecordViews>>,
}

/// What every record of one consumer shares: its fields' names and element sizes, and
/// one NumPy array per field over the consumer's memory, of that field's dtype (the
/// Python layer makes them: `Consumer.__init__`). A field's view is one slice of its
/// array: no copy.
struct RecordViews {
    names: Vec<String>,
    sizes: Vec<usize>,
    typed: Vec<Py<PyAny>>,
}

impl RecordViews {
    /// Field `name`'s index; `KeyError` naming the fields otherwise.
    fn index(&self, name: &str) -> PyResult<usize> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            PyKeyError::new_err(format!(
                "no field '{name}': the stream's fields are {}",
                self.names.join(", ")
            ))
        })
    }
}

impl PyStreamConsumer {
    fn wrap(
        py: Python<'_>,
        mut consumer: Consumer,
        policy: WaitPolicy,
    ) -> PyResult<PyStreamConsumer> {
        consumer.set_wait_policy(policy);
        let mapping = consumer.mapping();
        let len = mapping.span().1;
        let memory = PyStreamMemory::new(mapping, 0, len)?;
        Ok(PyStreamConsumer {
            name: consumer.name().to_string(),
            rank: consumer.rank(),
            schema: consumer.schema().to_string(),
            fields: fields_of(consumer.schema()),
            sizes: consumer
                .schema()
                .fields()
                .iter()
                .map(|f| f.dtype.size())
                .collect(),
            memory: Py::new(py, memory)?,
            consumer: Mutex::new(Some(Arc::new(consumer))),
            views: OnceLock::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Option<Arc<Consumer>>> {
        self.consumer.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn consumer(&self, py: Python<'_>) -> PyResult<Arc<Consumer>> {
        self.lock().clone().ok_or_else(|| closed(py, Peer::Client))
    }

    fn record(&self, py: Python<'_>, rec: Record) -> PyResult<PyStreamRecord> {
        let n = self.fields.len();
        let mut spans = Vec::with_capacity(n);
        for i in 0..n {
            let (p, count, dtype) = rec.field_raw(i).py_err(py)?;
            spans.push((
                self.memory
                    .get()
                    .offset_of(p as usize, count * dtype.size())?,
                count,
            ));
        }
        Ok(PyStreamRecord {
            lane: rec.lane(),
            seq: rec.seq(),
            producer: rec.producer(),
            spans,
            views: self.views.get().cloned(),
            record: Mutex::new(Some(rec)),
        })
    }

    /// Pops within `timeout` in slices, checking for signals between them.
    fn pop_sliced(
        &self,
        py: Python<'_>,
        timeout: Option<Duration>,
        pop: impl Fn(&Consumer, Duration) -> Result<Vec<Record>, Error> + Sync,
    ) -> PyResult<Vec<Record>> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let consumer = self.consumer(py)?;
        let consumer = &*consumer;
        loop {
            let slice = next_slice(deadline);
            let got = py.detach(|| pop(consumer, slice)).py_err(py)?;
            if !got.is_empty() || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(got);
            }
            if self.lock().is_none() {
                return Err(closed(py, Peer::Client)); // closed by another thread meanwhile
            }
            py.check_signals()?;
        }
    }
}

#[pymethods]
impl PyStreamConsumer {
    /// Creates stream `name` (its rank 0) of `schema` (`"tokens: int32[*], score:
    /// float64"`), `lanes` producers at once, `lane_capacity` bytes each (a power of
    /// two), `ranks` consumers. Pops spin `spin_us` microseconds (default: the core's
    /// budget) before they sleep; `blocking`: never spin.
    #[staticmethod]
    #[pyo3(signature = (name, schema, lanes, lane_capacity, ranks, spin_us=None, blocking=false))]
    #[allow(clippy::too_many_arguments)]
    fn create(
        py: Python<'_>,
        name: &str,
        schema: &str,
        lanes: Count<u32>,
        lane_capacity: Count<u64>,
        ranks: Count<u32>,
        spin_us: Option<Seconds>,
        blocking: bool,
    ) -> PyResult<PyStreamConsumer> {
        let policy = wait_policy(spin_us, blocking)?;
        let spec = StreamSpec {
            schema: Schema::parse(schema).py_err(py)?,
            lanes: lanes.0,
            lane_capacity: lane_capacity.0,
            ranks: ranks.0,
        };
        let consumer = py.detach(|| Consumer::create(name, &spec)).py_err(py)?;
        Self::wrap(py, consumer, policy)
    }

    /// Serves rank `rank` of stream `name`, waiting up to `timeout` for it (`spin_us`,
    /// `blocking`: as `create`).
    #[staticmethod]
    #[pyo3(signature = (name, rank, timeout, spin_us=None, blocking=false))]
    fn attach(
        py: Python<'_>,
        name: &str,
        rank: Count<u32>,
        timeout: Seconds,
        spin_us: Option<Seconds>,
        blocking: bool,
    ) -> PyResult<PyStreamConsumer> {
        let timeout = duration(timeout, "timeout")?;
        let policy = wait_policy(spin_us, blocking)?;
        let consumer = py
            .detach(|| Consumer::attach(name, rank.0, timeout))
            .py_err(py)?;
        Self::wrap(py, consumer, policy)
    }

    /// The stream's bytes (read-only for a consumer): what `spans` index.
    #[getter]
    fn memory(&self, py: Python<'_>) -> Py<PyStreamMemory> {
        self.memory.clone_ref(py)
    }

    /// The arrays its records' views are sliced from: one per field, over `memory`, of
    /// that field's dtype. Given once; records popped before have no views.
    fn use_views(&self, typed: Vec<Py<PyAny>>) -> PyResult<()> {
        if typed.len() != self.fields.len() {
            return Err(PyValueError::new_err(format!(
                "{} arrays for {} fields",
                typed.len(),
                self.fields.len()
            )));
        }
        let views = RecordViews {
            names: self.fields.iter().map(|f| f.0.clone()).collect(),
            sizes: self.sizes.clone(),
            typed,
        };
        self.views
            .set(Arc::new(views))
            .map_err(|_| PyRuntimeError::new_err("this consumer's views were given already"))
    }

    /// The next record, waiting up to `timeout` seconds (None: no limit; Ctrl-C
    /// interrupts); None once `timeout` passed with none.
    #[pyo3(signature = (timeout=None))]
    fn pop(&self, py: Python<'_>, timeout: Option<Seconds>) -> PyResult<Option<PyStreamRecord>> {
        let got = self.pop_sliced(py, limit(timeout)?, |c, slice| {
            Ok(c.pop(slice)?.into_iter().collect())
        })?;
        got.into_iter()
            .next()
            .map(|r| self.record(py, r))
            .transpose()
    }

    /// Up to `max_records` records: waits up to `timeout` for the first, then takes
    /// what is there. Empty once `timeout` passed with none.
    #[pyo3(signature = (max_records, timeout=None))]
    fn pop_batch(
        &self,
        py: Python<'_>,
        max_records: Count<u32>,
        timeout: Option<Seconds>,
    ) -> PyResult<Vec<PyStreamRecord>> {
        if max_records.0 == 0 {
            return Ok(Vec::new());
        }
        let got = self.pop_sliced(py, limit(timeout)?, |c, slice| {
            c.pop_batch(max_records.0 as usize, slice)
        })?;
        got.into_iter().map(|r| self.record(py, r)).collect()
    }

    /// The stream's flow metrics.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = {
            let guard = self.lock();
            guard
                .as_ref()
                .ok_or_else(|| closed(py, Peer::Client))?
                .stats()
        }
        .py_err(py)?;
        stats_dict(py, &s)
    }

    /// Marks this rank closed (records still held stay valid until released).
    fn close(&self) {
        self.lock().take();
    }

    #[getter]
    fn closed(&self) -> bool {
        self.lock().is_none()
    }
}

/// A popped record (`shmbridge.stream.Record`): `rec["tokens"]` is a read-only NumPy
/// view of the field in the consumer's memory, valid until the record is released
/// (`release()`, the end of a `with` block, or its garbage collection).
#[pyclass(module = "shmbridge._native", name = "StreamRecord", frozen)]
pub struct PyStreamRecord {
    record: Mutex<Option<Record>>,
    /// `(offset in the consumer's memory, element count)` of each field.
    #[pyo3(get)]
    spans: Vec<(usize, usize)>,
    /// The lane (the producer's slot).
    #[pyo3(get)]
    lane: u32,
    /// The producer's sequence number of this record (0, 1, 2 ... per producer).
    #[pyo3(get)]
    seq: u64,
    /// The lane's generation: tells two producers of one lane apart.
    #[pyo3(get)]
    producer: u64,
    views: Option<Arc<RecordViews>>,
}

impl PyStreamRecord {
    fn released_error(py: Python<'_>) -> PyErr {
        error_of_kind(
            py,
            ErrorKind::Closed,
            "this record was released: its space went back to its producer".into(),
        )
    }

    /// Its views' arrays and field `name`'s index, while it is not released (nor its
    /// stream's file found truncated).
    fn field(&self, py: Python<'_>, name: &str) -> PyResult<(&RecordViews, usize)> {
        let views = self.views.as_deref().ok_or_else(|| {
            PyRuntimeError::new_err("records of this consumer have no views (use_views)")
        })?;
        let i = views.index(name)?;
        match &*self.record.lock().unwrap_or_else(|p| p.into_inner()) {
            None => return Err(Self::released_error(py)),
            // A file found truncated: no view of the vanished bytes.
            Some(rec) => rec.check_mapped().py_err(py)?,
        }
        Ok((views, i))
    }

    /// Field `i`'s view: one slice of its dtype's array.
    fn view<'py>(
        &self,
        py: Python<'py>,
        views: &RecordViews,
        i: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (offset, count) = self.spans[i];
        let size = views.sizes[i];
        // Records and their fields are 8-aligned in lanes that start 8-aligned in the
        // stream (checked when popped): never otherwise.
        if offset % size != 0 {
            return Err(PyRuntimeError::new_err(format!(
                "field {:?} at byte {offset} is not aligned to its {size}-byte elements",
                views.names[i]
            )));
        }
        let start = (offset / size) as isize;
        let slice = PySlice::new(py, start, start + count as isize, 1);
        views.typed[i].bind(py).get_item(slice)
    }
}

#[pymethods]
impl PyStreamRecord {
    fn __getitem__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        let (views, i) = self.field(py, name)?;
        self.view(py, views, i)
    }

    /// Every field's view, by name.
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        if let Some(views) = self.views.as_deref() {
            for name in &views.names {
                out.set_item(name, self.__getitem__(py, name)?)?;
            }
        }
        Ok(out)
    }

    /// Field `name`'s bytes, copied (for `bytes` fields: `rec.bytes("meta")`).
    fn bytes<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let (_, i) = self.field(py, name)?;
        let guard = self.record.lock().unwrap_or_else(|p| p.into_inner());
        let rec = guard.as_ref().ok_or_else(|| Self::released_error(py))?;
        Ok(PyBytes::new(py, rec.bytes(i).py_err(py)?))
    }

    /// Field `name`'s element count in this record.
    fn length(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        let (_, i) = self.field(py, name)?;
        Ok(self.spans[i].1)
    }

    /// The address of field `name`'s first byte, as the core reports it (its view's).
    fn address(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        let (_, i) = self.field(py, name)?;
        let guard = self.record.lock().unwrap_or_else(|p| p.into_inner());
        let rec = guard.as_ref().ok_or_else(|| Self::released_error(py))?;
        let (p, _, _) = rec.field_raw(i).py_err(py)?;
        Ok(p as usize)
    }

    /// The fields' names, in order.
    fn keys(&self) -> Vec<String> {
        self.views
            .as_deref()
            .map(|v| v.names.clone())
            .unwrap_or_default()
    }

    fn __len__(&self) -> usize {
        self.spans.len()
    }

    /// Gives the record's space back to its producer (again: nothing); its views are no
    /// longer valid.
    fn release(&self) {
        self.record.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    #[getter]
    fn released(&self) -> bool {
        self.record
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) {
        self.release();
    }

    fn __repr__(&self) -> String {
        let state = if self.released() {
            "released".to_string()
        } else {
            let names = self.keys();
            names
                .iter()
                .zip(&self.spans)
                .map(|(n, (_, count))| format!("{n}[{count}]"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "<shmbridge.stream.Record lane {} seq {}: {state}>",
            self.lane, self.seq
        )
    }
}

// ---- Producers ----

/// A producer: the writer of one lane (`shmbridge.stream.Producer` wraps it).
#[pyclass(module = "shmbridge._native", name = "StreamProducer", frozen)]
pub struct PyStreamProducer {
    /// Taken out by `close()`; a reserve in flight holds its own reference (as the
    /// consumer's).
    producer: Mutex<Option<Arc<Producer>>>,
    memory: Py<PyStreamMemory>,
    #[pyo3(get)]
    name: String,
    #[pyo3(get)]
    lane: u32,
    #[pyo3(get)]
    schema: String,
    #[pyo3(get)]
    fields: Vec<(String, &'static str, Option<u32>)>,
    #[pyo3(get)]
    max_record: u64,
}

impl PyStreamProducer {
    fn lock(&self) -> MutexGuard<'_, Option<Arc<Producer>>> {
        self.producer.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn producer(&self, py: Python<'_>) -> PyResult<Arc<Producer>> {
        self.lock().clone().ok_or_else(|| closed(py, Peer::Engine))
    }

    /// Reserves with `lengths` within `timeout` in slices, checking for signals between
    /// them (the GIL released while it waits); `FullError` for the whole wait.
    fn reserve_within(
        &self,
        py: Python<'_>,
        lengths: &[u32],
        timeout: Option<Seconds>,
    ) -> PyResult<Reservation> {
        let limit = limit(timeout)?;
        let deadline = limit.and_then(|t| Instant::now().checked_add(t));
        let producer = self.producer(py)?;
        let producer = &*producer;
        let mut first = true;
        loop {
            let slice = next_slice(deadline);
            // One reserve is one full wait in the stats, however many slices it takes.
            let count = std::mem::replace(&mut first, false);
            match py.detach(|| producer.reserve_counted(lengths, slice, count)) {
                Ok(r) => return Ok(r),
                // A slice passed with the lane still full: on to the next, or `Full`
                // for the whole wait once the deadline passed.
                Err(Error::Full { .. }) if deadline.is_none_or(|d| Instant::now() < d) => {
                    if self.lock().is_none() {
                        return Err(closed(py, Peer::Engine)); // closed by another thread
                    }
                    py.check_signals()?;
                }
                Err(Error::Full {
                    lane, needed, free, ..
                }) => {
                    let waited = limit.unwrap_or(Duration::MAX);
                    return Err(to_pyerr(
                        py,
                        Error::Full {
                            lane,
                            needed,
                            free,
                            waited,
                        },
                    ));
                }
                Err(e) => return Err(to_pyerr(py, e)),
            }
        }
    }
}

#[pymethods]
impl PyStreamProducer {
    /// Attaches to stream `name` (waiting up to `timeout` for it) and claims a lane;
    /// `schema`, if given, must be the stream's. A full lane is waited for spinning
    /// `spin_us` microseconds (default: the core's budget), then asleep; `blocking`:
    /// never spin.
    #[staticmethod]
    #[pyo3(signature = (name, timeout, schema=None, spin_us=None, blocking=false))]
    fn attach(
        py: Python<'_>,
        name: &str,
        timeout: Seconds,
        schema: Option<&str>,
        spin_us: Option<Seconds>,
        blocking: bool,
    ) -> PyResult<PyStreamProducer> {
        let timeout = duration(timeout, "timeout")?;
        let policy = wait_policy(spin_us, blocking)?;
        let schema = schema.map(Schema::parse).transpose().py_err(py)?;
        let mut producer = py
            .detach(|| Producer::attach(name, schema.as_ref(), timeout))
            .py_err(py)?;
        producer.set_wait_policy(policy);
        let mapping = producer.mapping();
        let layout = mapping.layout();
        let offset = (layout.lane_offset(producer.lane()) + LANE_CTRL_SIZE) as usize;
        let memory = PyStreamMemory::new(mapping.clone(), offset, layout.lane_capacity as usize)?;
        Ok(PyStreamProducer {
            name: producer.name().to_string(),
            lane: producer.lane(),
            schema: producer.schema().to_string(),
            fields: fields_of(producer.schema()),
            max_record: producer.max_record(),
            memory: Py::new(py, memory)?,
            producer: Mutex::new(Some(Arc::new(producer))),
        })
    }

    /// This producer's lane's bytes (writable): what a reservation's `spans` index.
    #[getter]
    fn memory(&self, py: Python<'_>) -> Py<PyStreamMemory> {
        self.memory.clone_ref(py)
    }

    /// Reserves a record whose variable fields have `lengths` elements (schema order),
    /// waiting up to `timeout` seconds (None: no limit; Ctrl-C interrupts) for room:
    /// `FullError` after it.
    #[pyo3(signature = (lengths, timeout=None))]
    fn reserve(
        &self,
        py: Python<'_>,
        lengths: Vec<Count<u32>>,
        timeout: Option<Seconds>,
    ) -> PyResult<PyStreamReservation> {
        let mut res = self.reserve_within(py, &counts(lengths), timeout)?;
        let n = self.fields.len();
        let mut spans = Vec::with_capacity(n);
        for i in 0..n {
            let (p, count, dtype) = res.field_raw(i).py_err(py)?;
            spans.push((
                self.memory
                    .get()
                    .offset_of(p as usize, count * dtype.size())?,
                count,
            ));
        }
        Ok(PyStreamReservation {
            seq: res.seq(),
            spans,
            reservation: Mutex::new(Some(res)),
        })
    }

    /// Reserves, copies `values` (one per field, schema order) into place and commits:
    /// one record; returns its sequence number. A C-contiguous buffer of the field's
    /// element type (a NumPy array, bytes) is copied as it is; a float or int for a
    /// one-element float64/float32/int64/int32 field is written directly; anything
    /// else goes through `numpy.array(value, dtype, order="C")` first (a str: its
    /// UTF-8 bytes). The variable lengths follow from the sizes; nothing is reserved
    /// when a value does not fit its field.
    #[pyo3(signature = (values, timeout=None))]
    fn push(
        &self,
        py: Python<'_>,
        values: Vec<Bound<'_, PyAny>>,
        timeout: Option<Seconds>,
    ) -> PyResult<u64> {
        let producer = self.producer(py)?;
        let schema = producer.schema();
        if values.len() != schema.fields().len() {
            return Err(PyValueError::new_err(format!(
                "push takes {} values (one per field), not {}",
                schema.fields().len(),
                values.len()
            )));
        }
        let mut held = values
            .iter()
            .zip(schema.fields())
            .map(|(v, f)| FieldValue::of(py, v, f).map(Some))
            .collect::<PyResult<Vec<_>>>()?;
        let sizes: Vec<usize> = held.iter().flatten().map(|v| v.bytes().len()).collect();
        let lengths = schema.lengths_of(&sizes).py_err(py)?;
        // Room now: reserved with the GIL held all along, so the imports stay valid.
        let now = match producer.reserve_counted(&lengths, Duration::ZERO, false) {
            Ok(r) => Some(r),
            Err(Error::Full { .. }) => None,
            Err(e) => return Err(to_pyerr(py, e)),
        };
        let (mut res, held) = match now {
            Some(r) => (r, held),
            None => {
                // The wait releases the GIL: meanwhile another thread may free or resize
                // the memory of a tensor the caller lent (`torch.Tensor.resize_`, its
                // storage's `resize_`). Such imports are let go here and made again, with
                // the GIL held until the copy, once the record is reserved; bytes, numbers
                // and NumPy's conversions are this call's own and stay.
                for v in held.iter_mut() {
                    if v.as_ref().is_some_and(FieldValue::lent) {
                        *v = None;
                    }
                }
                let res = self.reserve_within(py, &lengths, timeout)?;
                let held = held
                    .into_iter()
                    .zip(values.iter().zip(schema.fields()))
                    .map(|(h, (v, f))| {
                        h.map_or_else(|| FieldValue::of(py, v, f).map(Some), |h| Ok(Some(h)))
                    })
                    .collect::<PyResult<Vec<_>>>()?;
                (res, held)
            }
        };
        let held: Vec<FieldValue<'_>> = held.into_iter().flatten().collect();
        let fields: Vec<&[u8]> = held.iter().map(FieldValue::bytes).collect();
        // A value whose size changed meanwhile no longer fits: `InvalidTensor`, and the
        // reservation is dropped (nothing is published).
        res.write_fields(&fields).py_err(py)?;
        let seq = res.seq();
        res.commit();
        Ok(seq)
    }

    /// The stream's flow metrics.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = {
            let guard = self.lock();
            guard
                .as_ref()
                .ok_or_else(|| closed(py, Peer::Engine))?
                .stats()
        }
        .py_err(py)?;
        stats_dict(py, &s)
    }

    /// Frees the lane (an open reservation is aborted first).
    fn close(&self) {
        self.lock().take();
    }

    #[getter]
    fn closed(&self) -> bool {
        self.lock().is_none()
    }
}

/// One value of a `push`, as bytes of its field's element type: a bytes object, a
/// host DLPack tensor of the field's dtype, C-contiguous (the object's own bytes, or
/// NumPy's conversion of it), or a number written out. Holds what keeps the bytes alive.
enum FieldValue<'py> {
    Bytes(Bound<'py, PyBytes>),
    /// The import (held: it keeps the bytes alive), its validated data pointer and size
    /// in bytes.
    Tensor {
        _held: dlpark::python::ImportedDlpack,
        p: *const u8,
        len: usize,
        /// The caller's own tensor (not NumPy's conversion made here): its memory may
        /// change whenever the GIL is released.
        lent: bool,
    },
    Number([u8; 8], usize),
}

impl<'py> FieldValue<'py> {
    fn of(py: Python<'py>, value: &Bound<'py, PyAny>, field: &Field) -> PyResult<FieldValue<'py>> {
        if let Ok(b) = value.cast::<PyBytes>() {
            return Ok(FieldValue::Bytes(b.clone()));
        }
        if let Ok(text) = value.cast::<PyString>() {
            return Ok(FieldValue::Bytes(text.encode_utf8()?));
        }
        if field.count == FieldCount::Fixed(1) {
            if let Some(n) = number(value, field.dtype) {
                return Ok(n);
            }
        }
        if value.hasattr(pyo3::intern!(py, "__dlpack__"))? {
            match host_tensor(py, value, field.dtype, true) {
                Ok(Some(t)) => return Ok(t),
                Ok(None) => {}
                // An export refused (NumPy refuses read-only and byte-swapped arrays):
                // NumPy converts it below.
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyException>(py) => {}
                Err(e) => return Err(e),
            }
        }
        // Anything else (lists, numbers, other dtypes, strided, read-only or byte-swapped
        // arrays): NumPy converts it to the field's dtype, as an assignment to the field's
        // view would, into a new array of its own (which it can export).
        let numpy_dtype = match field.dtype {
            DType::BF16 => "uint16", // the raw bits, as the views show them
            d => d.array_name(),
        };
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", numpy_dtype)?;
        kwargs.set_item("order", "C")?;
        let converted = py
            .import("numpy")?
            .call_method("array", (value,), Some(&kwargs))
            .map_err(|e| {
                let why = PyValueError::new_err(format!(
                    "field {:?} takes {numpy_dtype} values: {e}",
                    field.name
                ));
                why.set_cause(py, Some(e));
                why
            })?;
        host_tensor(py, &converted, field.dtype, false)?.ok_or_else(|| {
            PyValueError::new_err(format!(
                "field {:?}: NumPy's array of the value is not a host {numpy_dtype} array",
                field.name
            ))
        })
    }

    fn bytes(&self) -> &[u8] {
        match self {
            FieldValue::Bytes(b) => b.as_bytes(),
            // SAFETY: `host_tensor` checked that the import is a compact host tensor of
            // `len` bytes at `p` (`len` 0: no pointer is read); the import held in
            // `self` keeps them alive. A `lent` tensor's memory is read only while the
            // GIL has been held since its import (`push` imports it again after the
            // reserve), so no Python code freed or resized it meanwhile; NumPy's
            // conversions are referenced by this value alone.
            FieldValue::Tensor { p, len, .. } => match len {
                0 => &[],
                _ => unsafe { std::slice::from_raw_parts(*p, *len) },
            },
            FieldValue::Number(bytes, n) => &bytes[..*n],
        }
    }

    /// Whether its bytes are the caller's tensor's memory (see `FieldValue::Tensor`).
    fn lent(&self) -> bool {
        matches!(self, FieldValue::Tensor { lent: true, .. })
    }
}

/// `value`'s DLPack tensor if it lies in host memory, holds `dtype`'s elements (a
/// bfloat16 field also takes uint16: the raw bits) and is C-contiguous; `None` if it
/// does not (NumPy converts it then).
fn host_tensor<'py>(
    py: Python<'py>,
    value: &Bound<'py, PyAny>,
    dtype: DType,
    lent: bool,
) -> PyResult<Option<FieldValue<'py>>> {
    // The capsule of a plain `__dlpack__()` (host memory: no stream to name), which
    // costs a fraction of the negotiated import.
    let capsule = value.call_method0(pyo3::intern!(py, "__dlpack__"))?;
    let imported = dlpark::python::from_dlpack(capsule.as_borrowed(), None, None)?;
    let Ok(view) = imported.validate() else {
        return Ok(None);
    };
    let d = view.dtype();
    let (code, bits) = dtype.dlpack();
    let same = d.lanes == 1
        && d.bits == bits
        && (d.code.0 == code || (dtype == DType::BF16 && d.code.0 == DL_UINT));
    let host = view.device().device_type == DLDeviceType::CPU;
    if !(same && host && view.is_compact().unwrap_or(false)) {
        return Ok(None);
    }
    let len = view.num_bytes();
    // SAFETY: a host tensor (checked) whose producer keeps its memory alive while
    // `imported` lives; the pointer includes `byte_offset`.
    let p = match len {
        0 => std::ptr::null(),
        _ => {
            unsafe { view.offset_bytes_ptr() }.map_err(|e| PyValueError::new_err(e.to_string()))?
        }
    };
    Ok(Some(FieldValue::Tensor {
        _held: imported,
        p,
        len,
        lent,
    }))
}

/// A Python float or int as one element of `dtype`, where that is exact and cheap
/// (float64, float32, int64, int32); `None` leaves it to NumPy.
fn number<'py>(value: &Bound<'py, PyAny>, dtype: DType) -> Option<FieldValue<'py>> {
    let mut out = [0u8; 8];
    let n = match dtype {
        DType::F64 if value.is_exact_instance_of::<PyFloat>() => {
            out.copy_from_slice(&value.extract::<f64>().ok()?.to_ne_bytes());
            8
        }
        DType::F32 if value.is_exact_instance_of::<PyFloat>() => {
            out[..4].copy_from_slice(&(value.extract::<f64>().ok()? as f32).to_ne_bytes());
            4
        }
        DType::I64 if value.is_exact_instance_of::<PyInt>() => {
            out.copy_from_slice(&value.extract::<i64>().ok()?.to_ne_bytes());
            8
        }
        DType::I32 if value.is_exact_instance_of::<PyInt>() => {
            out[..4].copy_from_slice(&value.extract::<i32>().ok()?.to_ne_bytes());
            4
        }
        _ => return None,
    };
    Some(FieldValue::Number(out, n))
}

/// A reserved record: where its fields lie in the producer's memory, until committed or
/// aborted.
#[pyclass(module = "shmbridge._native", name = "StreamReservation", frozen)]
pub struct PyStreamReservation {
    reservation: Mutex<Option<Reservation>>,
    /// `(offset in the producer's memory, element count)` of each field.
    #[pyo3(get)]
    spans: Vec<(usize, usize)>,
    #[pyo3(get)]
    seq: u64,
}

impl PyStreamReservation {
    fn take(&self, py: Python<'_>) -> PyResult<Reservation> {
        self.reservation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| {
                to_pyerr(
                    py,
                    Error::OutOfOrder("this reservation was already committed or aborted"),
                )
            })
    }
}

#[pymethods]
impl PyStreamReservation {
    /// Publishes the record, whole.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        self.take(py)?.commit();
        Ok(())
    }

    /// Drops the record: nothing is published.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        self.take(py)?.abort();
        Ok(())
    }

    /// Whether it was committed or aborted.
    #[getter]
    fn done(&self) -> bool {
        self.reservation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }
}
