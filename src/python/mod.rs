//! The Python extension module `shmbridge._native` (feature `python`): a thin PyO3 layer
//! over [`Client`], [`crate::Engine`] (in [`engine`]) and the reference engines.
//!
//! - [`PyClient`] wraps a [`Client`] and a second read-write mapping of the same region,
//!   shared through an `Arc` with every DLPack capsule handed out, so a view of a tensor
//!   stays valid after `close()` (the client's own mapping goes away with it).
//! - [`PyTensor`] is one tensor of the region: a persistent object created at attach,
//!   with `__dlpack__` / `__dlpack_device__` (dlpark builds the capsules) and `__array__`.
//! - Errors become the exceptions of `shmbridge.errors` (defined in Python, so that e.g.
//!   `shmbridge.TimeoutError` can subclass both `ShmBridgeError` and the builtin), chosen
//!   variant by variant in [`to_pyerr`].
//! - `run_engine(argv)` serves a reference engine like `shmbridge engine`, so the wheel
//!   needs no separate binary: `shmbridge.launch()` runs `python -m shmbridge._engine`.

mod engine;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use dlpark::ffi::DLManagedTensorVersioned;
use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor};
use dlpark::metadata::Dynamic;
use dlpark::python::{DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};

use crate::envs::{self, EnvOptions};
use crate::error::{Error, Peer};
use crate::layout::{DType, TensorInfo};
use crate::region::{self, Region};
use crate::{AttachOptions, Client, WaitPolicy};

/// How long one native wait lasts before the GIL is taken back to check for signals
/// (Ctrl-C): the latency of `KeyboardInterrupt` during a long `step()`.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// The next native wait: [`SIGNAL_SLICE`], or less when `deadline` comes sooner.
fn next_slice(deadline: Option<Instant>) -> Duration {
    match deadline {
        Some(d) => d
            .saturating_duration_since(Instant::now())
            .min(SIGNAL_SLICE),
        None => SIGNAL_SLICE,
    }
}

// ---------------------------------------------------------------------------------------
// Errors

/// The `shmbridge.errors` class name for each variant, and the message.
fn error_class(e: &Error) -> &'static str {
    match e {
        Error::NotFound { .. } => "NotFoundError",
        Error::NameInUse { .. } => "NameInUseError",
        Error::PermissionDenied { .. } => "PermissionDeniedError",
        Error::InvalidName { .. } => "InvalidNameError",
        Error::BadMagic { .. } => "BadMagicError",
        Error::VersionMismatch { .. } => "VersionMismatchError",
        Error::LayoutMismatch { .. } => "LayoutMismatchError",
        Error::RegionTooSmall { .. } => "RegionTooSmallError",
        Error::InvalidHeader { .. } => "InvalidHeaderError",
        Error::TensorOutOfBounds { .. } => "TensorOutOfBoundsError",
        Error::InvalidTensor { .. } => "InvalidTensorError",
        Error::InvalidSpec(_) => "InvalidSpecError",
        Error::NoSuchTensor { .. } => "NoSuchTensorError",
        Error::DTypeMismatch { .. } => "DTypeMismatchError",
        Error::WrongDirection { .. } => "WrongDirectionError",
        Error::AlreadyBorrowed { .. } => "AlreadyBorrowedError",
        Error::AlreadyAttached { .. } => "AlreadyAttachedError",
        Error::PeerDied {
            peer: Peer::Engine, ..
        } => "EngineDiedError",
        Error::PeerDied {
            peer: Peer::Client, ..
        } => "ClientDiedError",
        Error::PeerClosed { peer: Peer::Engine } => "EngineClosedError",
        Error::PeerClosed { peer: Peer::Client } => "ClientClosedError",
        Error::Timeout { .. } => "TimeoutError",
        Error::Protocol { .. } => "ProtocolError",
        Error::RecordTooLarge { .. } => "RecordTooLargeError",
        Error::BadMessage(_) => "BadMessageError",
        Error::NoCommandChannel { .. } => "NoCommandChannelError",
        Error::Remote { .. } => "RemoteError",
        Error::OutOfOrder(_) => "OutOfOrderError",
        Error::Interrupted => "InterruptedError",
        Error::Closed(_) => "ClosedError",
        Error::CudaUnavailable { .. } => "CudaUnavailableError",
        Error::Cuda { .. } => "CudaError",
        Error::NotOnHost { .. } => "NotOnHostError",
        Error::Io { .. } => "ShmBridgeOSError",
    }
}

/// Turns a crate error into an instance of its `shmbridge.errors` class, carrying the
/// Rust message (and, where the variant has them, a few fields as attributes).
fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    let class = error_class(&e);
    let message = e.to_string();
    let build = || -> PyResult<PyErr> {
        let errors = py.import("shmbridge.errors")?;
        let cls = errors.getattr(class)?;
        let exc = cls.call1((message.clone(),))?;
        match &e {
            Error::PeerDied { pid, .. } | Error::AlreadyAttached { pid, .. } => {
                exc.setattr("pid", *pid)?;
            }
            Error::Remote { method, code, .. } => {
                exc.setattr("method", method.as_str())?;
                exc.setattr("code", *code)?;
            }
            Error::Timeout { waited, .. } => {
                exc.setattr("waited", waited.as_secs_f64())?;
            }
            _ => {}
        }
        Ok(PyErr::from_value(exc))
    };
    // If the Python side cannot be imported (a broken install), still say what happened.
    build().unwrap_or_else(|import_error| {
        PyRuntimeError::new_err(format!(
            "{message} (and shmbridge.errors failed: {import_error})"
        ))
    })
}

trait IntoPy<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, e))
    }
}

// ---------------------------------------------------------------------------------------
// Tensors

/// NumPy-style name of a dtype (what `numpy.dtype(name)` and torch understand).
fn numpy_name(d: DType) -> &'static str {
    match d {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::I8 => "int8",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::U8 => "uint8",
        DType::U16 => "uint16",
        DType::U32 => "uint32",
        DType::U64 => "uint64",
        DType::Bool => "bool",
    }
}

fn dl_dtype(d: DType) -> DLDataType {
    let (code, bits) = d.dlpack();
    DLDataType {
        code: DLDataTypeCode(code),
        bits,
        lanes: 1,
    }
}

/// Where a [`PyTensor`]'s bytes are, in this process.
enum Place {
    /// In the shared-memory region, at the layout's offset.
    Host,
    /// In the engine's CUDA allocation, opened from its IPC handle: `ptr` is the opened
    /// base plus the tensor's offset, on this process's device `ordinal`. The lease
    /// keeps the handle open (and the engine's event) while the client is open or a
    /// capsule of it lives; `close()` takes this object's reference away, so that only
    /// views handed out delay the close acknowledgement (the memory itself lives only
    /// as long as the engine process: it owns it).
    #[cfg(feature = "cuda")]
    Cuda {
        ptr: u64,
        ordinal: i32,
        lease: Mutex<Option<Arc<crate::cuda::ipc::CudaLease>>>,
    },
}

/// One tensor of a region, as Python sees it: host memory in the region, or (with the
/// `cuda` feature) device memory opened from the engine's CUDA IPC handle. Created once
/// per client at attach.
#[pyclass(module = "shmbridge._native", name = "Tensor", frozen)]
pub struct PyTensor {
    /// A second mapping of the region (`map_again`): every host capsule holds a clone,
    /// so views outlive the client or engine that made them.
    region: Arc<Region>,
    info: TensorInfo,
    shape: Vec<i64>,
    /// Whether the side holding this object writes the tensor (the client writes
    /// client→engine tensors, the engine engine→client ones).
    writable: bool,
    place: Place,
}

/// The place of tensor `index` for a client: CUDA for the tensors the engine placed on
/// its device (opened at attach), host for the others.
#[cfg(feature = "cuda")]
fn client_place(client: &Client, index: usize, info: &TensorInfo) -> Result<Place, Error> {
    if info.cuda.is_none() {
        return Ok(Place::Host);
    }
    let cuda = client.cuda().ok_or(Error::Closed(Peer::Client))?;
    let lease = cuda.lease().ok_or(Error::Closed(Peer::Client))?;
    Ok(Place::Cuda {
        ptr: cuda.ptr(index, info)?,
        ordinal: cuda.ordinal(),
        lease: Mutex::new(Some(Arc::clone(lease))),
    })
}

impl PyTensor {
    /// The tensors of `layout` as `side` sees them, all sharing `region`; `place` says
    /// where tensor `i` lives in this process.
    fn all(
        py: Python<'_>,
        region: &Arc<Region>,
        layout: &crate::layout::Layout,
        side: Peer,
        place: impl Fn(usize, &TensorInfo) -> Result<Place, Error>,
    ) -> PyResult<Vec<Py<PyTensor>>> {
        layout
            .tensors
            .iter()
            .enumerate()
            .map(|(i, info)| {
                Py::new(
                    py,
                    PyTensor {
                        region: Arc::clone(region),
                        info: info.clone(),
                        shape: info.shape.iter().map(|&d| d as i64).collect(),
                        writable: info.direction.writer() == side,
                        place: place(i, info).py_err(py)?,
                    },
                )
            })
            .collect()
    }

    /// The host address of the first byte. Only meaningful for [`Place::Host`]; every
    /// caller checks the place first ([`Self::host_address`]).
    fn address(&self) -> *mut u8 {
        // SAFETY: the layout was validated against the region's length, and this mapping
        // (`map_again`) has that same length: `offset + nbytes <= len`, so the pointer
        // stays inside it. (For a CUDA tensor the range is reserved but unused.)
        unsafe { self.region.ptr().add(self.info.offset as usize) }
    }

    /// The host address, or `TypeError` for a CUDA tensor (no host bytes to give).
    fn host_address(&self) -> PyResult<*mut u8> {
        match &self.place {
            Place::Host => Ok(self.address()),
            #[cfg(feature = "cuda")]
            Place::Cuda { ordinal, .. } => Err(PyTypeError::new_err(format!(
                "tensor '{}' lives on cuda:{ordinal}, not in host memory: use \
                 torch.from_dlpack(tensor) (or another CUDA DLPack consumer)",
                self.info.name
            ))),
        }
    }

    /// Address of the first byte in this process: host or device.
    fn data_address(&self) -> u64 {
        match &self.place {
            Place::Host => self.address() as u64,
            #[cfg(feature = "cuda")]
            Place::Cuda { ptr, .. } => *ptr,
        }
    }

    /// The lease of a CUDA tensor of an open client; `ClosedError` after `close()`.
    #[cfg(feature = "cuda")]
    fn lease(&self) -> PyResult<Arc<crate::cuda::ipc::CudaLease>> {
        let Place::Cuda { lease, .. } = &self.place else {
            return Err(PyTypeError::new_err(format!(
                "tensor '{}' lives in host memory",
                self.info.name
            )));
        };
        lease
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Python::attach(|py| to_pyerr(py, Error::Closed(Peer::Client))))
    }

    /// Drops this object's reference to the CUDA lease (at the client's close).
    fn detach_lease(&self) {
        #[cfg(feature = "cuda")]
        if let Place::Cuda { lease, .. } = &self.place {
            lease.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
    }

    fn dl_device(&self) -> DLDevice {
        match &self.place {
            Place::Host => DLDevice::CPU,
            #[cfg(feature = "cuda")]
            Place::Cuda { ordinal, .. } => DLDevice::cuda(*ordinal),
        }
    }

    /// `"cpu"` or `"cuda:N"`.
    fn device_name(&self) -> String {
        match &self.place {
            Place::Host => "cpu".to_string(),
            #[cfg(feature = "cuda")]
            Place::Cuda { ordinal, .. } => format!("cuda:{ordinal}"),
        }
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let layout = Dynamic::compact(self.shape.clone());
        let mut init = match &self.place {
            Place::Host => layout.initialize_as::<M>(Arc::clone(&self.region)),
            #[cfg(feature = "cuda")]
            Place::Cuda { .. } => layout.initialize_as::<M>(self.lease()?),
        }
        .map_err(|e| PyRuntimeError::new_err(format!("building a DLPack tensor: {e}")))?;
        init.set_data(self.data_address() as usize as *mut std::ffi::c_void)
            .set_dtype(dl_dtype(self.info.dtype))
            .set_device(self.dl_device());
        // SAFETY: host: `data` points at `nbytes` bytes inside the mapping (validated
        // bounds, 64-byte aligned), and the context is an `Arc` of that mapping, so the
        // bytes stay mapped until the consumer calls the deleter, even after the client
        // closes. CUDA: `data` is the opened base plus the offset, checked against the
        // size the driver reports for the allocation (`ImportedMemory::span`), and the
        // context is an `Arc` of the lease that keeps the handle open until the deleter
        // runs. Both are laid out C-contiguously with the shape and the compact strides
        // dlpark wrote. No flags are set: the memory is writable, and concurrent writes
        // by the peer follow the lock-step protocol, not Rust aliasing.
        Ok(unsafe { init.finish() })
    }
}

/// A CUDA stream handed to a DLPack producer (`__dlpack__(stream=...)`) when importing
/// CUDA actions: the producer orders its pending writes before it.
#[cfg(feature = "cuda")]
struct ConsumerStream(u64);

// SAFETY: `ConsumerStream` holds 0, 1, 2 or a live stream of the device the tensor is
// on (see `PyClient::consumer_stream`), encoded by dlpark's CUDA convention, and lives
// for the whole `__dlpack__` call.
#[cfg(feature = "cuda")]
unsafe impl dlpark::python::DlpackStream for ConsumerStream {
    fn as_python_arg(
        &self,
        _py: Python<'_>,
        _device: DLDevice,
    ) -> PyResult<dlpark::python::StreamArg> {
        Ok(dlpark::python::consumer::stream::cuda(
            self.0 as usize as *mut std::ffi::c_void,
        ))
    }
}

impl DlpackExporter for PyTensor {
    fn device(&self) -> DLDevice {
        self.dl_device()
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        match &self.place {
            // Host memory: nothing to synchronise; the lock-step protocol orders the bytes.
            Place::Host => Ok(()),
            // The consumer's stream waits (on the GPU) for the engine's last frame.
            #[cfg(feature = "cuda")]
            Place::Cuda { .. } => {
                let lease = self.lease()?;
                use dlpark::python::producer::CudaStreamRequest as S;
                let raw = match _request.cuda_stream()? {
                    S::NoSync => return Ok(()),
                    // No stream given: the protocol's legacy default stream.
                    S::Omitted | S::LegacyDefault => 1,
                    S::PerThreadDefault => 2,
                    S::Pointer(p) => p as u64,
                };
                // SAFETY: 1, 2, or a stream pointer the consumer says is live on this
                // tensor's device for the duration of the call (the DLPack contract).
                unsafe { lease.wait_on(raw) }.py_err(_py)
            }
        }
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[pymethods]
impl PyTensor {
    /// A DLPack capsule viewing the tensor's bytes in shared memory. `copy=True` (the
    /// consumer asks the producer for a copy, e.g. `numpy.from_dlpack(t, copy=True)`)
    /// exports a fresh NumPy copy instead; `copy=None`/`False` never copies.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        #[cfg(feature = "cuda")]
        if let Place::Cuda { .. } = slf.get().place {
            // A device tensor: the consumer's stream waits on the engine's event
            // (`prepare_export`); copy=True is refused (BufferError) by dlpark, as this
            // producer only exports the engine's memory itself.
            let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
            return dlpark::python::export_dlpack(slf.get(), py, request);
        }
        // For kDLCPU the standard says `stream` must be None (a consumer may pass -1).
        if let Some(s) = &stream {
            if !s.is_none() && s.extract::<i64>().ok() != Some(-1) {
                return Err(PyValueError::new_err(
                    "stream must be None for a CPU tensor",
                ));
            }
        }
        if copy == Some(true) {
            let np = py.import("numpy")?;
            let owned = np
                .call_method1("from_dlpack", (slf,))?
                .call_method0("copy")?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("max_version", max_version)?;
            kwargs.set_item("dl_device", dl_device)?;
            return Ok(owned.call_method("__dlpack__", (), Some(&kwargs))?.unbind());
        }
        let request = ExportRequest::parse(None, max_version, dl_device, copy)?;
        dlpark::python::export_dlpack(slf.get(), py, request)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        let d = self.dl_device();
        (d.device_type.0, d.device_id)
    }

    /// A NumPy array viewing the same bytes (`numpy.from_dlpack(self)`).
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        slf.get().host_address()?;
        let np = py.import("numpy")?;
        let mut array = np.call_method1("from_dlpack", (slf,))?;
        if let Some(dtype) = dtype {
            if copy == Some(false) {
                let same = np
                    .getattr("dtype")?
                    .call1((&dtype,))?
                    .eq(array.getattr("dtype")?)?;
                if !same {
                    return Err(PyValueError::new_err(
                        "a dtype conversion needs a copy, and copy=False was given",
                    ));
                }
            }
            let kwargs = PyDict::new(py);
            kwargs.set_item("copy", copy == Some(true))?;
            array = array.call_method("astype", (dtype,), Some(&kwargs))?;
        } else if copy == Some(true) {
            array = array.call_method0("copy")?;
        }
        Ok(array)
    }

    #[getter]
    fn name(&self) -> &str {
        &self.info.name
    }

    /// NumPy-style dtype name: "float32", "int64", "bool", ...
    #[getter]
    fn dtype(&self) -> &'static str {
        numpy_name(self.info.dtype)
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    #[getter]
    fn ndim(&self) -> usize {
        self.shape.len()
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.info.nbytes
    }

    /// The address of the first byte in this process (what a zero-copy view points at):
    /// in the shared-memory mapping, or on the device for a CUDA tensor.
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.data_address()
    }

    /// `"cpu"` or `"cuda:N"` (this process's ordinal of the engine's device).
    #[getter]
    fn device(&self) -> String {
        self.device_name()
    }

    /// True for the tensors this side writes: `actions` and `reset_mask` for a client,
    /// observations, rewards and dones for an engine.
    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }

    /// "engine->client" or "client->engine".
    #[getter]
    fn direction(&self) -> &'static str {
        self.info.direction.arrow()
    }

    fn __repr__(&self) -> String {
        format!(
            "<shmbridge.Tensor '{}' {} {:?} {} on {} at {:#x}>",
            self.info.name,
            numpy_name(self.info.dtype),
            self.shape,
            self.info.direction.arrow(),
            self.device_name(),
            self.data_address()
        )
    }
}

// ---------------------------------------------------------------------------------------
// Client

/// The mutable part of a client, behind a mutex so the Python object can be shared and
/// the GIL released while it waits.
struct Core {
    client: Option<Client>,
    /// An action was posted whose frame has not been received (a timeout or Ctrl-C
    /// interrupted the wait): the next step first waits for that frame.
    pending: bool,
}

/// A client attached to an engine (`shmbridge.attach()` / `shmbridge.launch()`).
#[pyclass(module = "shmbridge._native", name = "Client", frozen)]
pub struct PyClient {
    core: Mutex<Core>,
    /// Set by `close()` before it takes the lock: a step waiting in another thread
    /// gives up at its next slice instead of keeping `close()` waiting. Also the
    /// `closed` property (only `close()` takes the client away).
    closing: AtomicBool,
    name: String,
    num_envs: usize,
    engine_kind: String,
    engine_pid: u32,
    /// `"cpu"`, or `"cuda:N"` when the engine's tensors live on a CUDA device.
    device: String,
    /// N of `"cuda:N"`; `None` for a host client.
    cuda_ordinal: Option<i32>,
    /// The `torch.cuda` module, once torch has initialised CUDA in this process (it
    /// stays initialised): [`consumer_stream`](Self::consumer_stream) then skips the
    /// lookup and the check on every step.
    torch_cuda: PyOnceLock<Py<PyAny>>,
    tensors: Vec<Py<PyTensor>>,
    actions_index: Option<usize>,
    step_outputs: Option<Py<PyTuple>>,
    /// Called once after close (launch() uses it to wait for its engine).
    on_close: Mutex<Option<Py<PyAny>>>,
    /// The engine process `launch()` started, if any.
    engine_process: Mutex<Option<Py<PyAny>>>,
}

/// `blocking`: never spin; else spin `spin_us` microseconds (default budget if None).
fn wait_policy(spin_us: Option<f64>, blocking: bool) -> PyResult<WaitPolicy> {
    Ok(if blocking {
        WaitPolicy::BLOCKING
    } else if let Some(us) = spin_us {
        WaitPolicy::spinning(duration(us / 1e6, "spin_us")?)
    } else {
        WaitPolicy::default()
    })
}

fn duration(seconds: f64, what: &str) -> PyResult<Duration> {
    if seconds.is_nan() || seconds < 0.0 {
        return Err(PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, got {seconds}"
        )));
    }
    Ok(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX))
}

impl PyClient {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, Core>> {
        match self.core.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(PyRuntimeError::new_err(
                "this client is busy in another thread (one step or call at a time)",
            )),
        }
    }

    fn tensor_named(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyTensor>> {
        tensor_named(py, &self.tensors, name)
    }

    /// Waits for the frame of the action in flight, in slices, checking for signals
    /// between them. `deadline` None: no limit.
    fn wait_frame_sliced(
        &self,
        py: Python<'_>,
        core: &mut Core,
        deadline: Option<Instant>,
        timeout: Duration,
    ) -> PyResult<()> {
        loop {
            let slice = next_slice(deadline);
            let client = core.client.as_mut().ok_or_else(|| closed_err(py))?;
            match py.detach(|| client.wait_frame(slice)) {
                Ok(_) => {
                    core.pending = false;
                    return Ok(());
                }
                Err(Error::Timeout { .. }) => {
                    if let Some(d) = deadline {
                        if Instant::now() >= d {
                            return Err(to_pyerr(
                                py,
                                Error::Timeout {
                                    waited: timeout,
                                    what: "the engine's next frame",
                                },
                            ));
                        }
                    }
                    if self.closing.load(Ordering::Acquire) {
                        return Err(closed_err(py));
                    }
                    py.check_signals()?;
                }
                Err(e) => return Err(to_pyerr(py, e)),
            }
        }
    }

    /// Validates `actions` against the action tensor and copies it there: a host copy
    /// into the shared memory, or for a CUDA action tensor a device-to-device copy
    /// ordered on `stream` (the step's consumer stream) of `client`'s context. Nothing is
    /// written on error.
    fn copy_actions(
        &self,
        py: Python<'_>,
        client: &Client,
        actions: &Bound<'_, PyAny>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let index = self
            .actions_index
            .ok_or_else(|| no_such_tensor(py, &self.tensors, "actions"))?;
        let target = self.tensors[index].get();
        // `client.step(client.actions)`: already in place.
        if let Ok(t) = actions.cast::<PyTensor>() {
            if std::ptr::eq(t.get(), target) {
                return Ok(());
            }
        }
        #[cfg(feature = "cuda")]
        if let Place::Cuda { ptr, ordinal, .. } = &target.place {
            let cuda = client.cuda().ok_or_else(|| closed_err(py))?;
            return copy_cuda_actions(py, actions, target, *ptr, *ordinal, cuda, stream);
        }
        let _ = (client, stream);
        let source = if actions.hasattr("__dlpack__")? {
            actions.clone()
        } else if actions.hasattr("__array__")? {
            py.import("numpy")?.call_method1("asarray", (actions,))?
        } else {
            return Err(PyTypeError::new_err(format!(
                "actions must be a NumPy array, a torch tensor or another DLPack object, not {}",
                actions.get_type().name()?
            )));
        };
        let imported = dlpark::python::from_dlpack(source.as_borrowed(), None, None)?;
        let view = imported
            .validate()
            .map_err(|e| PyValueError::new_err(format!("invalid DLPack tensor: {e}")))?;
        if view.device() != DLDevice::CPU {
            return Err(PyValueError::new_err(format!(
                "actions are on device {}:{}, but the engine's 'actions' live in host \
                 memory: pass a CPU array (no implicit device-to-host copy)",
                view.device().device_type.0,
                view.device().device_id
            )));
        }
        check_actions(&view, target)?;
        let itemsize = target.info.dtype.size();
        let strides = view
            .strides_or_compact()
            .map_err(|e| PyValueError::new_err(format!("invalid DLPack strides: {e}")))?;
        // SAFETY: the producer guarantees its DLPack descriptor describes live memory for
        // as long as we hold `imported`; `offset_bytes_ptr` includes `byte_offset`.
        let src = unsafe { view.offset_bytes_ptr() }
            .map_err(|e| PyValueError::new_err(format!("invalid DLPack tensor: {e}")))?;
        let dst = target.address();
        let compact = view
            .is_compact()
            .map_err(|e| PyValueError::new_err(format!("invalid DLPack strides: {e}")))?;
        if compact {
            // SAFETY: both ranges are `nbytes` long (same dtype and shape): the source is
            // the producer's compact tensor, the destination our validated action slot.
            // They do not overlap unless the caller passed a view of the slot itself, for
            // which `copy` (memmove) is still correct.
            unsafe { std::ptr::copy(src, dst, target.info.nbytes as usize) };
        } else {
            // Strided source (e.g. a transposed torch tensor): element by element.
            let shape = target.shape.clone();
            let numel = target.info.numel() as usize;
            let mut index = vec![0i64; shape.len()];
            for k in 0..numel {
                let offset: i64 = index
                    .iter()
                    .zip(strides.iter())
                    .map(|(i, s)| i * s * itemsize as i64)
                    .sum();
                // SAFETY: `index` is inside `shape`, so the producer's strides address an
                // element of its tensor; the destination is element `k` of our slot.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.offset(offset as isize),
                        dst.add(k * itemsize),
                        itemsize,
                    )
                };
                for d in (0..shape.len()).rev() {
                    index[d] += 1;
                    if index[d] < shape[d] {
                        break;
                    }
                    index[d] = 0;
                }
            }
        }
        drop(imported);
        Ok(())
    }

    /// The CUDA stream a step or reset of a CUDA client orders its work on: `stream` as
    /// given (an int `CUstream`, an object with `cuda_stream` like `torch.cuda.Stream`,
    /// or one with `__cuda_stream__`), else torch's current stream on the engine's
    /// device when torch has initialised CUDA, else the legacy default stream (1).
    /// `None` for a host client (`stream` is then ignored).
    fn consumer_stream(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<u64>> {
        let Some(ordinal) = self.cuda_ordinal else {
            return Ok(None);
        };
        if let Some(s) = stream.filter(|s| !s.is_none()) {
            return stream_handle(s).map(Some);
        }
        if let Some(cuda) = self.torch_cuda(py)? {
            let current = cuda.call_method1("current_stream", (ordinal,))?;
            return stream_handle(&current).map(Some);
        }
        Ok(Some(1))
    }

    /// `torch.cuda` if torch is imported and has initialised CUDA; looked up on each
    /// call until it has, then kept.
    fn torch_cuda<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        if let Some(cuda) = self.torch_cuda.get(py) {
            return Ok(Some(cuda.bind(py).clone()));
        }
        let Ok(torch) = py.import("sys")?.getattr("modules")?.get_item("torch") else {
            return Ok(None);
        };
        let cuda = torch.getattr("cuda")?;
        if !cuda.call_method0("is_initialized")?.is_truthy()? {
            return Ok(None);
        }
        Ok(Some(
            self.torch_cuda
                .get_or_init(py, || cuda.unbind())
                .bind(py)
                .clone(),
        ))
    }

    /// Runs a command-channel call without the GIL, with Ctrl-C checked at every sleep
    /// slice of its waits (about every 10 ms): a signal's exception (KeyboardInterrupt)
    /// stops the call and is raised; the reply, if it comes later, is dropped by id.
    /// Steps do not use this: their wait is sliced in `step()` itself.
    fn command<T: Send>(
        &self,
        py: Python<'_>,
        timeout: Duration,
        call: impl FnOnce(&mut Client) -> Result<T, Error> + Send,
    ) -> PyResult<T> {
        let mut core = self.lock()?;
        if core.pending {
            // A step timed out or was interrupted: its frame comes first (a command sent
            // now would be answered after it anyway, and for CUDA its event record must
            // not overtake the step's).
            let deadline = Instant::now().checked_add(timeout);
            self.wait_frame_sliced(py, &mut core, deadline, timeout)?;
        }
        let client = core.client.as_mut().ok_or_else(|| closed_err(py))?;
        let raised: Arc<Mutex<Option<PyErr>>> = Arc::default();
        let store = Arc::clone(&raised);
        client.set_interrupt(Some(Arc::new(move || {
            Python::attach(|py| py.check_signals()).map_err(|e| {
                *store.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                Error::Interrupted
            })
        })));
        let out = py.detach(|| call(&mut *client));
        client.set_interrupt(None);
        match out {
            Err(Error::Interrupted) => {
                let raised = raised.lock().unwrap_or_else(|p| p.into_inner()).take();
                Err(raised.unwrap_or_else(|| to_pyerr(py, Error::Interrupted)))
            }
            other => other.map_err(|e| to_pyerr(py, e)),
        }
    }

    fn run_on_close(&self, py: Python<'_>) -> PyResult<()> {
        let hook = self
            .on_close
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(hook) = hook {
            hook.call0(py)?;
        }
        Ok(())
    }
}

/// The tensor called `name`, or `NoSuchTensorError` listing the names there are.
fn tensor_named(py: Python<'_>, tensors: &[Py<PyTensor>], name: &str) -> PyResult<Py<PyTensor>> {
    match tensors.iter().find(|t| t.get().info.name == name) {
        Some(t) => Ok(t.clone_ref(py)),
        None => Err(no_such_tensor(py, tensors, name)),
    }
}

/// `NoSuchTensorError` for `name`, listing the names of `tensors`.
fn no_such_tensor(py: Python<'_>, tensors: &[Py<PyTensor>], name: &str) -> PyErr {
    let available: Vec<&str> = tensors.iter().map(|t| t.get().info.name.as_str()).collect();
    to_pyerr(
        py,
        Error::NoSuchTensor {
            name: name.to_string(),
            available: available.join(", "),
        },
    )
}

fn closed_err(py: Python<'_>) -> PyErr {
    to_pyerr(py, Error::Closed(Peer::Client))
}

/// `Client::step`, or for a CUDA client `step_on` the consumer stream `raw` (the client's
/// event is recorded there, after the action writes queued on it).
fn step_on(client: &mut Client, stream: Option<u64>, timeout: Duration) -> Result<u64, Error> {
    #[cfg(feature = "cuda")]
    if let (Some(raw), Some(cuda)) = (stream, client.cuda()) {
        // SAFETY: `raw` is 0, 1, 2 or a live stream of the engine's device
        // (`consumer_stream`), used for this call only.
        let s = unsafe { crate::cuda::driver::Stream::borrowed(cuda.context(), raw) };
        return client.step_on(&s, timeout);
    }
    let _ = stream;
    client.step(timeout)
}

/// Runs a command that may write device tensors (reset, engine methods) ordered after
/// the work queued on the consumer stream (reads of the current frame): the client's
/// event is recorded there before the request goes out, and once the reply arrived the
/// stream waits on the engine's event ([`order_after_engine`]). Plain `call` for a host
/// client.
fn on_stream<T>(
    client: &mut Client,
    stream: Option<u64>,
    call: impl FnOnce(&mut Client) -> Result<T, Error>,
) -> Result<T, Error> {
    #[cfg(feature = "cuda")]
    if let Some(raw) = stream {
        // SAFETY: `raw` is 0, 1, 2 or a live stream of the engine's device
        // (`consumer_stream`), and is unset before this returns.
        unsafe { client.set_command_stream(raw) };
        let out = call(client);
        // SAFETY: 1, the legacy default stream.
        unsafe { client.set_command_stream(1) };
        let out = out?;
        order_after_engine(client, stream)?;
        return Ok(out);
    }
    let _ = stream;
    call(client)
}

/// After a frame (or a command's reply) arrived: makes the consumer stream `raw` wait,
/// on the GPU, for the engine's event, so work queued on it afterwards sees the new
/// device tensors. Nothing for a host client.
fn order_after_engine(client: &Client, stream: Option<u64>) -> Result<(), Error> {
    #[cfg(feature = "cuda")]
    if let (Some(raw), Some(cuda)) = (stream, client.cuda()) {
        // SAFETY: `raw` is 0, 1, 2 or a live stream of the engine's device
        // (`consumer_stream`), used for this call only.
        let s = unsafe { crate::cuda::driver::Stream::borrowed(cuda.context(), raw) };
        return cuda.wait_frame_on(&s);
    }
    let _ = (client, stream);
    Ok(())
}

/// Checks an imported action tensor's dtype and shape against the action slot.
fn check_actions(view: &dlpark::tensor::TensorRef<'_>, target: &PyTensor) -> PyResult<()> {
    let want = dl_dtype(target.info.dtype);
    let got = view.dtype();
    if got != want {
        let name = DType::from_dlpack(got.code.0, got.bits, got.lanes)
            .map(numpy_name)
            .map(str::to_string)
            .unwrap_or_else(|| {
                format!("code {} bits {} lanes {}", got.code.0, got.bits, got.lanes)
            });
        return Err(PyTypeError::new_err(format!(
            "actions have dtype {name}, the engine expects {}",
            numpy_name(target.info.dtype)
        )));
    }
    if view.shape() != target.shape.as_slice() {
        return Err(PyValueError::new_err(format!(
            "actions have shape {:?}, the engine expects {:?}",
            view.shape(),
            target.shape
        )));
    }
    Ok(())
}

/// The raw `CUstream` of a Python stream argument: an int (0, 1 and 2 are the legacy,
/// legacy and per-thread default streams), an object with `cuda_stream`
/// (`torch.cuda.Stream`, CuPy), or one with `__cuda_stream__` (the CUDA stream protocol:
/// `(version, handle)`).
fn stream_handle(s: &Bound<'_, PyAny>) -> PyResult<u64> {
    let value = if let Ok(v) = s.extract::<i64>() {
        v
    } else if let Ok(v) = s.getattr("cuda_stream") {
        v.extract::<i64>()?
    } else if let Ok(v) = s.getattr("__cuda_stream__") {
        let v = if v.is_callable() { v.call0()? } else { v };
        match v.extract::<(i64, i64)>() {
            Ok((_, handle)) => handle,
            Err(_) => v.extract::<i64>()?,
        }
    } else {
        return Err(PyTypeError::new_err(format!(
            "stream must be an int CUstream, a torch.cuda.Stream or an object with \
             __cuda_stream__, not {}",
            s.get_type().name()?
        )));
    };
    u64::try_from(value)
        .map_err(|_| PyValueError::new_err(format!("stream {value}: a CUstream is not negative")))
}

/// [`PyClient::copy_actions`] for a CUDA action slot: `actions` must be a CUDA DLPack
/// tensor on the same device, of the slot's dtype and shape, C-contiguous; it is copied
/// device-to-device on `stream` after the producer ordered its writes before that
/// stream (`__dlpack__(stream=...)`). A host array is an error, not a silent transfer.
#[cfg(feature = "cuda")]
fn copy_cuda_actions(
    py: Python<'_>,
    actions: &Bound<'_, PyAny>,
    target: &PyTensor,
    dst: u64,
    ordinal: i32,
    cuda: &crate::cuda::ipc::ClientCuda,
    stream: Option<u64>,
) -> PyResult<()> {
    if !actions.hasattr("__dlpack__")? {
        return Err(PyTypeError::new_err(format!(
            "the engine's 'actions' live on cuda:{ordinal}: pass a CUDA tensor (e.g. torch), \
             not {} (no implicit host-to-device copy)",
            actions.get_type().name()?
        )));
    }
    let device = dlpark::python::dlpack_device(actions.as_borrowed())?;
    if device != DLDevice::cuda(ordinal) {
        return Err(PyValueError::new_err(format!(
            "actions are on device {}:{}, but the engine's 'actions' live on cuda:{ordinal} \
             (DLPack device 2:{ordinal}): move them there first (no implicit transfer)",
            device.device_type.0, device.device_id
        )));
    }
    let raw = stream.unwrap_or(1);
    let imported =
        dlpark::python::from_dlpack(actions.as_borrowed(), Some(&ConsumerStream(raw)), None)?;
    let view = imported
        .validate()
        .map_err(|e| PyValueError::new_err(format!("invalid DLPack tensor: {e}")))?;
    check_actions(&view, target)?;
    let compact = view
        .is_compact()
        .map_err(|e| PyValueError::new_err(format!("invalid DLPack strides: {e}")))?;
    if !compact {
        return Err(PyValueError::new_err(
            "CUDA actions must be C-contiguous (call .contiguous() first)",
        ));
    }
    // SAFETY: the producer's descriptor describes live device memory while `imported`
    // lives; `offset_bytes_ptr` includes `byte_offset` (pointer arithmetic only).
    let src = unsafe { view.offset_bytes_ptr() }
        .map_err(|e| PyValueError::new_err(format!("invalid DLPack tensor: {e}")))?;
    // SAFETY: `raw` is 0, 1, 2 or a live stream of this device (`consumer_stream`).
    let stream = unsafe { crate::cuda::driver::Stream::borrowed(cuda.context(), raw) };
    // The engine may still be reading the previous actions (a frame is published once its
    // kernels are queued, not done); on another stream than the last step's, the copy
    // must wait for them.
    cuda.wait_frame_on(&stream).py_err(py)?;
    // SAFETY: `src` is `nbytes` of compact device memory of the producer (same dtype and
    // shape as the slot, checked above), ordered before `stream` by `__dlpack__`; `dst`
    // is the action slot in the engine's allocation (span checked at attach), which the
    // engine reads only after waiting on the client event recorded after this copy. The
    // producer keeps `src` alive for work ordered on its stream; a caller passing a
    // foreign stream keeps it alive until the step returns (documented on `step`).
    unsafe { stream.copy_dtod(dst, src as usize as u64, target.info.nbytes as usize) }
        .py_err(py)?;
    drop(imported);
    Ok(())
}

#[pymethods]
impl PyClient {
    /// Attaches to the engine's region `name` (as printed by `shmbridge engine`).
    #[staticmethod]
    #[pyo3(signature = (name, timeout=10.0, spin_us=None, blocking=false))]
    fn attach(
        py: Python<'_>,
        name: &str,
        timeout: f64,
        spin_us: Option<f64>,
        blocking: bool,
    ) -> PyResult<PyClient> {
        let timeout = duration(timeout, "timeout")?;
        let policy = wait_policy(spin_us, blocking)?;
        let options = AttachOptions::default().timeout(timeout).policy(policy);
        let name = name.to_string();
        let (client, region) = py
            .detach(|| -> Result<_, Error> {
                let client = Client::attach(&name, options)?;
                let region = Arc::new(client.map_again()?);
                Ok((client, region))
            })
            .py_err(py)?;
        let layout = client.layout().clone();
        #[cfg(feature = "cuda")]
        let place = |i: usize, info: &TensorInfo| client_place(&client, i, info);
        #[cfg(not(feature = "cuda"))]
        let place = |_: usize, _: &TensorInfo| Ok(Place::Host);
        let tensors = PyTensor::all(py, &region, &layout, Peer::Client, place)?;
        let device = tensors
            .iter()
            .map(|t| t.get().device_name())
            .find(|d| d != "cpu")
            .unwrap_or_else(|| "cpu".to_string());
        let cuda_ordinal = device.strip_prefix("cuda:").and_then(|n| n.parse().ok());
        let find = |n: &str| layout.tensors.iter().position(|t| t.name == n);
        let step_outputs = match (
            find("obs"),
            find("rewards"),
            find("terminated"),
            find("truncated"),
        ) {
            (Some(a), Some(b), Some(c), Some(d)) => Some(
                PyTuple::new(
                    py,
                    [a, b, c, d].map(|i| tensors[i].clone_ref(py).into_any()),
                )?
                .unbind(),
            ),
            _ => None,
        };
        Ok(PyClient {
            core: Mutex::new(Core {
                client: Some(client),
                pending: false,
            }),
            closing: AtomicBool::new(false),
            name: layout_name(&name),
            num_envs: layout.num_envs as usize,
            engine_kind: layout.engine_kind.clone(),
            engine_pid: layout.engine_pid,
            device,
            cuda_ordinal,
            torch_cuda: PyOnceLock::new(),
            actions_index: find("actions"),
            tensors,
            step_outputs,
            on_close: Mutex::new(None),
            engine_process: Mutex::new(None),
        })
    }

    /// Sends one action and waits for the engine's frame; returns
    /// `(obs, rewards, terminated, truncated)`, the same tensor objects every time.
    ///
    /// CUDA engines: the step is ordered on `stream` (see `consumer_stream`; default
    /// torch's current stream). CUDA `actions` are copied device-to-device on it, the
    /// client's event is recorded on it before the action is sent (the engine's kernels
    /// wait for it), and once the frame arrived it waits on the engine's event, so work
    /// queued on it afterwards reads the new frame without a host synchronisation.
    #[pyo3(signature = (actions=None, timeout=None, stream=None))]
    fn step<'py>(
        &self,
        py: Python<'py>,
        actions: Option<Bound<'py, PyAny>>,
        timeout: Option<f64>,
        stream: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let limit = match timeout {
            Some(t) => Some(duration(t, "timeout")?),
            None => None,
        };
        let deadline = limit.and_then(|t| Instant::now().checked_add(t));
        let limit = limit.unwrap_or(Duration::MAX);
        let mut core = self.lock()?;
        if core.client.is_none() {
            return Err(closed_err(py));
        }
        // Validate before anything is sent (or waited for).
        let actions = actions.filter(|a| !a.is_none());
        if core.pending {
            // A previous step was interrupted: its frame must arrive before the action
            // slot may be written again (the engine may be reading it).
            self.wait_frame_sliced(py, &mut core, deadline, limit)?;
        }
        let cuda_stream = self.consumer_stream(py, stream.as_ref())?;
        if let Some(a) = &actions {
            let client = core.client.as_ref().ok_or_else(|| closed_err(py))?;
            self.copy_actions(py, client, a, cuda_stream)?;
        }
        let first = next_slice(deadline);
        let client = core.client.as_mut().ok_or_else(|| closed_err(py))?;
        match py.detach(|| step_on(client, cuda_stream, first)) {
            Ok(_) => {}
            Err(Error::Timeout { .. }) => {
                core.pending = true;
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(to_pyerr(
                        py,
                        Error::Timeout {
                            waited: limit,
                            what: "the engine's next frame",
                        },
                    ));
                }
                py.check_signals()?;
                self.wait_frame_sliced(py, &mut core, deadline, limit)?;
            }
            Err(e) => return Err(to_pyerr(py, e)),
        }
        let client = core.client.as_ref().ok_or_else(|| closed_err(py))?;
        order_after_engine(client, cuda_stream).py_err(py)?;
        drop(core);
        match &self.step_outputs {
            Some(t) => Ok(t.clone_ref(py).into_any()),
            None => Ok(py.None()),
        }
    }

    /// Resets envs over the command channel: all of them, or `env_ids`. `seed`: none, an
    /// int (env k of the list gets `seed + k`, as in Gymnasium), or one int per env. When
    /// it returns, `obs` holds the reset observations. Returns the frame number, which a
    /// reset does not change.
    /// CUDA engines: `stream` (default torch's current one) then waits on the engine's
    /// event, so work queued on it sees the reset observations.
    #[pyo3(signature = (seed=None, env_ids=None, timeout=10.0, stream=None))]
    fn reset(
        &self,
        py: Python<'_>,
        seed: Option<Bound<'_, PyAny>>,
        env_ids: Option<Vec<u32>>,
        timeout: f64,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let seeds: Vec<u64> = match seed.filter(|s| !s.is_none()) {
            None => Vec::new(),
            Some(s) => match s.extract::<u64>() {
                Ok(one) => vec![one],
                Err(_) => s.extract::<Vec<u64>>().map_err(|_| {
                    PyTypeError::new_err("seed must be None, a non-negative int, or a list of them")
                })?,
            },
        };
        let timeout = duration(timeout, "timeout")?;
        let cuda_stream = self.consumer_stream(py, stream.as_ref())?;
        let frame = self.command(py, timeout, |client| {
            on_stream(client, cuda_stream, |c| {
                c.reset(env_ids.as_deref(), &seeds, timeout)
            })
        })?;
        Ok(frame)
    }

    /// Calls an engine-defined method. Keyword arguments travel as text (`str(value)`);
    /// `payload` as raw bytes. Returns the reply's arguments as a dict of str, with the
    /// reply's payload under `"payload"` when it has one.
    #[pyo3(signature = (method, *, payload=None, timeout=10.0, **kwargs))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        payload: Option<Vec<u8>>,
        timeout: f64,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut args: Vec<(String, String)> = Vec::new();
        if let Some(kw) = kwargs {
            for (k, v) in kw.iter() {
                args.push((k.extract::<String>()?, v.str()?.extract::<String>()?));
            }
        }
        let payload = payload.unwrap_or_default();
        let timeout = duration(timeout, "timeout")?;
        // CUDA: an engine-defined method may write device tensors; ordered like a reset.
        let cuda_stream = self.consumer_stream(py, None)?;
        let reply = self.command(py, timeout, |client| {
            let args: Vec<(&str, &str)> =
                args.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            on_stream(client, cuda_stream, |c| {
                c.call_method(method, &args, &payload, timeout)
            })
        })?;
        let out = PyDict::new(py);
        for (k, v) in reply.args {
            out.set_item(k, v)?;
        }
        if !reply.payload.is_empty() {
            out.set_item("payload", pyo3::types::PyBytes::new(py, &reply.payload))?;
        }
        Ok(out)
    }

    /// The engine's schema over the command channel: `num_envs`, `engine_kind`, the
    /// tensors (name, dtype, shape, direction, location) in table order, and the
    /// engine's metadata (observation bounds, action space, autoreset mode, ...).
    #[pyo3(signature = (timeout=10.0))]
    fn schema<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyDict>> {
        let timeout = duration(timeout, "timeout")?;
        let body = self.command(py, timeout, |client| client.schema(timeout))?;
        let crate::wire::Body::Schema {
            num_envs,
            engine_kind,
            tensors,
            metadata,
        } = body
        else {
            return Err(PyRuntimeError::new_err(
                "GetSchema answered with another body",
            ));
        };
        let out = PyDict::new(py);
        out.set_item("num_envs", num_envs)?;
        out.set_item("engine_kind", engine_kind)?;
        let list = pyo3::types::PyList::empty(py);
        for t in tensors {
            let d = PyDict::new(py);
            d.set_item("name", t.name)?;
            d.set_item("dtype", numpy_name(t.dtype))?;
            d.set_item("shape", PyTuple::new(py, t.shape)?)?;
            d.set_item("direction", t.direction.arrow())?;
            d.set_item("location", t.location.name())?;
            list.append(d)?;
        }
        out.set_item("tensors", list)?;
        let meta = PyDict::new(py);
        for (k, v) in metadata {
            meta.set_item(k, v)?;
        }
        out.set_item("metadata", meta)?;
        Ok(out)
    }

    /// Round trip of a `Ping` over the command channel; returns the echoed payload.
    #[pyo3(signature = (payload=None, timeout=10.0))]
    fn ping<'py>(
        &self,
        py: Python<'py>,
        payload: Option<Vec<u8>>,
        timeout: f64,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let payload = payload.unwrap_or_default();
        let timeout = duration(timeout, "timeout")?;
        let back = self.command(py, timeout, |client| client.ping(&payload, timeout))?;
        Ok(pyo3::types::PyBytes::new(py, &back))
    }

    /// Closes the client: the engine sees it, exits and removes its region. Views of
    /// the tensors stay readable. Waits for an engine started by `launch()`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.closing.store(true, Ordering::Release);
        // Without the GIL: a step in another thread holds the lock until its next slice,
        // and needs the GIL to return.
        let client = py.detach(|| {
            let mut core = self.core.lock().unwrap_or_else(|p| p.into_inner());
            core.client.take()
        });
        // CUDA: only the views handed out (capsules) may keep the engine's handles open
        // past this point; this client's own tensor objects let go of them.
        for t in &self.tensors {
            t.get().detach_lease();
        }
        if let Some(c) = client {
            c.close();
        }
        self.run_on_close(py)
    }

    /// Whether `close()` was called (read without the lock, which a step in another
    /// thread holds while it waits, and without waiting for that step).
    #[getter]
    fn closed(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __getitem__(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyTensor>> {
        self.tensor_named(py, name).map_err(|e| {
            if e.is_instance_of::<PyKeyError>(py) {
                e
            } else {
                PyKeyError::new_err(name.to_string())
            }
        })
    }

    fn __contains__(&self, name: &str) -> bool {
        self.tensors.iter().any(|t| t.get().info.name == name)
    }

    #[getter]
    fn obs(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        self.tensor_named(py, "obs")
    }
    #[getter]
    fn actions(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        self.tensor_named(py, "actions")
    }
    #[getter]
    fn rewards(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        self.tensor_named(py, "rewards")
    }
    #[getter]
    fn terminated(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        self.tensor_named(py, "terminated")
    }
    #[getter]
    fn truncated(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        self.tensor_named(py, "truncated")
    }
    #[getter]
    fn reset_mask(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        self.tensor_named(py, "reset_mask")
    }

    /// Every tensor, in table order.
    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.tensors.iter().map(|t| t.clone_ref(py)))
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    #[getter]
    fn num_envs(&self) -> usize {
        self.num_envs
    }

    #[getter]
    fn engine_kind(&self) -> &str {
        &self.engine_kind
    }

    #[getter]
    fn engine_pid(&self) -> u32 {
        self.engine_pid
    }

    /// Where the engine's tensors live: `"cpu"` (shared memory) or `"cuda:N"` (device
    /// memory opened from the engine's CUDA IPC handles; N is this process's ordinal).
    #[getter]
    fn device(&self) -> &str {
        &self.device
    }

    /// Number of the frame the tensors hold (0 after attach).
    #[getter]
    fn frame(&self, py: Python<'_>) -> PyResult<u64> {
        let core = self.lock()?;
        Ok(core.client.as_ref().ok_or_else(|| closed_err(py))?.frame())
    }

    /// The live `(action_seq, frame_seq)` counters of the region.
    fn counters(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let core = self.lock()?;
        Ok(core
            .client
            .as_ref()
            .ok_or_else(|| closed_err(py))?
            .counters())
    }

    /// The engine process started by `launch()`, or None.
    #[getter]
    fn engine_process(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.engine_process
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|p| p.clone_ref(py))
    }

    /// For `launch()`: the engine process, and a callable run once after close.
    fn _adopt_engine(&self, process: Py<PyAny>, on_close: Py<PyAny>) {
        *self
            .engine_process
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(process);
        *self.on_close.lock().unwrap_or_else(|p| p.into_inner()) = Some(on_close);
    }

    fn __repr__(&self) -> String {
        format!(
            "<shmbridge.Client '{}' {} x{}{}>",
            self.name,
            self.engine_kind,
            self.num_envs,
            if self.closed() { " closed" } else { "" }
        )
    }
}

fn layout_name(name: &str) -> String {
    region::canonical_name(name).unwrap_or_else(|_| name.to_string())
}

// ---------------------------------------------------------------------------------------
// Engine runner

/// Serves a reference engine until the client closes, like `shmbridge engine`. Prints
/// the region name on stdout once frame 0 is published. Returns the exit status.
#[pyfunction]
#[pyo3(signature = (env="cartpole", num_envs=256, name=None, obs_dim=None, act_dim=None, sparse=false, seed=0, spin_us=None, blocking=false, idle_timeout=3600.0, image=None, device="cpu"))]
#[allow(clippy::too_many_arguments)]
fn run_engine(
    py: Python<'_>,
    env: &str,
    num_envs: u32,
    name: Option<String>,
    obs_dim: Option<u64>,
    act_dim: Option<u64>,
    sparse: bool,
    seed: u64,
    spin_us: Option<f64>,
    blocking: bool,
    idle_timeout: f64,
    image: Option<&str>,
    device: &str,
) -> PyResult<u64> {
    let device = crate::cuda::DeviceRequest::parse(device).py_err(py)?;
    let image = image
        .map(envs::parse_image_shape)
        .transpose()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let policy = wait_policy(spin_us, blocking)?;
    let idle = duration(idle_timeout, "idle_timeout")?;
    let options = EnvOptions {
        obs_dim,
        act_dim,
        sparse,
        seed,
        image,
    };
    let engine = envs::ReferenceEngine {
        env: env.to_string(),
        num_envs,
        name,
        options,
        policy,
        idle_timeout: idle,
        device,
    };
    py.detach(move || envs::run_reference(&engine)).py_err(py)
}

/// Whether CUDA tensors can be served and opened here: `(True, "driver 12080, 1
/// device(s)")`, or `(False, reason)` (built without the `cuda` feature, no loadable
/// driver, no device). Never raises; cached after the first call.
#[pyfunction]
fn cuda_available(py: Python<'_>) -> (bool, String) {
    match py.detach(crate::cuda::probe) {
        Ok(info) => (
            true,
            format!(
                "driver {}, {} device(s)",
                info.driver_version, info.device_count
            ),
        ),
        Err(Error::CudaUnavailable { reason }) => (false, reason),
        Err(e) => (false, e.to_string()),
    }
}

/// Names of the shmbridge regions in /dev/shm.
#[pyfunction]
fn list_regions(py: Python<'_>) -> PyResult<Vec<String>> {
    region::list_names().py_err(py)
}

/// Removes regions whose engine is dead; returns their names.
#[pyfunction]
fn gc(py: Python<'_>) -> PyResult<Vec<String>> {
    region::sweep().py_err(py)
}

/// The `shmbridge.errors` class each Rust error variant maps to (for tests and docs).
#[pyfunction]
fn _error_classes() -> Vec<&'static str> {
    use std::io;
    let samples = [
        Error::NotFound {
            name: String::new(),
        },
        Error::NameInUse {
            name: String::new(),
        },
        Error::PermissionDenied {
            name: String::new(),
        },
        Error::InvalidName {
            name: String::new(),
            reason: "",
        },
        Error::BadMagic {
            name: String::new(),
            found: 0,
        },
        Error::VersionMismatch {
            ours_major: 0,
            ours_minor: 0,
            theirs_major: 0,
            theirs_minor: 0,
        },
        Error::LayoutMismatch { ours: 0, theirs: 0 },
        Error::RegionTooSmall {
            needed: 0,
            actual: 0,
        },
        Error::InvalidHeader {
            field: "",
            reason: String::new(),
        },
        Error::TensorOutOfBounds {
            tensor: String::new(),
            offset: 0,
            len: 0,
            region_size: 0,
        },
        Error::InvalidTensor {
            tensor: String::new(),
            reason: String::new(),
        },
        Error::InvalidSpec(String::new()),
        Error::NoSuchTensor {
            name: String::new(),
            available: String::new(),
        },
        Error::DTypeMismatch {
            tensor: String::new(),
            requested: "",
            actual: "",
        },
        Error::WrongDirection {
            tensor: String::new(),
            writer: Peer::Engine,
            requester: Peer::Client,
        },
        Error::AlreadyBorrowed {
            tensor: String::new(),
        },
        Error::AlreadyAttached {
            name: String::new(),
            pid: 0,
        },
        Error::PeerDied {
            peer: Peer::Engine,
            pid: 0,
            hint: "",
        },
        Error::PeerDied {
            peer: Peer::Client,
            pid: 0,
            hint: "",
        },
        Error::PeerClosed { peer: Peer::Engine },
        Error::PeerClosed { peer: Peer::Client },
        Error::Timeout {
            waited: Duration::ZERO,
            what: "",
        },
        Error::Protocol {
            peer: Peer::Engine,
            detail: String::new(),
        },
        Error::RecordTooLarge {
            len: 0,
            capacity: 0,
        },
        Error::BadMessage(String::new()),
        Error::NoCommandChannel { major: 0, minor: 0 },
        Error::Remote {
            method: String::new(),
            code: 0,
            message: String::new(),
        },
        Error::OutOfOrder(""),
        Error::Interrupted,
        Error::Closed(Peer::Client),
        Error::CudaUnavailable {
            reason: String::new(),
        },
        Error::Cuda {
            call: "",
            detail: String::new(),
        },
        Error::NotOnHost {
            tensor: String::new(),
            location: "",
        },
        Error::Io {
            context: String::new(),
            source: io::Error::other("x"),
        },
    ];
    samples.iter().map(error_class).collect()
}

/// Raises the exception a Rust error maps to (for tests of the mapping).
#[pyfunction]
fn _raise_timeout(py: Python<'_>) -> PyErr {
    to_pyerr(
        py,
        Error::Timeout {
            waited: Duration::from_millis(1500),
            what: "a test",
        },
    )
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyClient>()?;
    m.add_class::<PyTensor>()?;
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PyEngineSpec>()?;
    m.add_function(wrap_pyfunction!(run_engine, m)?)?;
    m.add_function(wrap_pyfunction!(list_regions, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(gc, m)?)?;
    m.add_function(wrap_pyfunction!(_error_classes, m)?)?;
    m.add_function(wrap_pyfunction!(_raise_timeout, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "PROTOCOL_VERSION",
        (crate::layout::VERSION_MAJOR, crate::layout::VERSION_MINOR),
    )?;
    Ok(())
}
