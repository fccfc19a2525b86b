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
use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType, DLManagedTensor};
use dlpark::metadata::Dynamic;
use dlpark::python::{DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::envs::{self, EnvOptions};
use crate::error::{Error, Peer};
use crate::layout::{DType, Direction, TensorInfo};
use crate::region::{self, Region};
use crate::{AttachOptions, Client, WaitPolicy};

/// How long one native wait lasts before the GIL is taken back to check for signals
/// (Ctrl-C): the latency of `KeyboardInterrupt` during a long `step()`.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

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

/// One host tensor of a region, as Python sees it. Created once per client at attach.
#[pyclass(module = "shmbridge._native", name = "Tensor", frozen)]
pub struct PyTensor {
    /// A second mapping of the region (`map_again`): every capsule holds a clone, so
    /// views outlive the client or engine that made them.
    region: Arc<Region>,
    info: TensorInfo,
    shape: Vec<i64>,
    /// Whether the side holding this object writes the tensor (the client writes
    /// client→engine tensors, the engine engine→client ones).
    writable: bool,
}

impl PyTensor {
    /// The tensors of `layout` as `side` sees them, all sharing `region`.
    fn all(
        py: Python<'_>,
        region: &Arc<Region>,
        layout: &crate::layout::Layout,
        side: Peer,
    ) -> PyResult<Vec<Py<PyTensor>>> {
        layout
            .tensors
            .iter()
            .map(|info| {
                let writer = match info.direction {
                    Direction::EngineToClient => Peer::Engine,
                    Direction::ClientToEngine => Peer::Client,
                };
                Py::new(
                    py,
                    PyTensor {
                        region: Arc::clone(region),
                        info: info.clone(),
                        shape: info.shape.iter().map(|&d| d as i64).collect(),
                        writable: writer == side,
                    },
                )
            })
            .collect()
    }

    fn address(&self) -> *mut u8 {
        // SAFETY: the layout was validated against the region's length, and this mapping
        // (`map_again`) has that same length: `offset + nbytes <= len`, so the pointer
        // stays inside it.
        unsafe { self.region.ptr().add(self.info.offset as usize) }
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let mut init = Dynamic::compact(self.shape.clone())
            .initialize_as::<M>(Arc::clone(&self.region))
            .map_err(|e| PyRuntimeError::new_err(format!("building a DLPack tensor: {e}")))?;
        init.set_data(self.address().cast())
            .set_dtype(dl_dtype(self.info.dtype))
            .set_device(DLDevice::CPU);
        // SAFETY: `data` points at `nbytes` bytes inside the mapping (validated bounds,
        // 64-byte aligned), laid out C-contiguously with the shape and the compact strides
        // dlpark wrote; the managed tensor's context is an `Arc` of that mapping, so the
        // bytes stay mapped until the consumer calls the deleter, even after the client
        // closes. No flags are set: the memory is writable (MAP_SHARED, read-write), and
        // concurrent writes by the peer follow the lock-step protocol, not Rust aliasing.
        Ok(unsafe { init.finish() })
    }
}

impl DlpackExporter for PyTensor {
    fn device(&self) -> DLDevice {
        DLDevice::CPU
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        // Host memory: nothing to synchronise; the lock-step protocol orders the bytes.
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
            let owned = np.call_method1("from_dlpack", (slf,))?.call_method0("copy")?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("max_version", max_version)?;
            kwargs.set_item("dl_device", dl_device)?;
            return Ok(owned.call_method("__dlpack__", (), Some(&kwargs))?.unbind());
        }
        let request = ExportRequest::parse(None, max_version, dl_device, copy)?;
        dlpark::python::export_dlpack(slf.get(), py, request)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        (DLDeviceType::CPU.0, 0)
    }

    /// A NumPy array viewing the same bytes (`numpy.from_dlpack(self)`).
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
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

    /// The address of the first byte in this process (what a zero-copy view points at).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.address() as usize
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
            "<shmbridge.Tensor '{}' {} {:?} {} at {:#x}>",
            self.info.name,
            numpy_name(self.info.dtype),
            self.shape,
            self.info.direction.arrow(),
            self.address() as usize
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
    /// gives up at its next slice instead of keeping `close()` waiting.
    closing: AtomicBool,
    name: String,
    num_envs: usize,
    engine_kind: String,
    engine_pid: u32,
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
            let slice = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    left.min(SIGNAL_SLICE)
                }
                None => SIGNAL_SLICE,
            };
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

    /// Validates `actions` against the action tensor and copies it there.
    fn copy_actions(&self, py: Python<'_>, actions: &Bound<'_, PyAny>) -> PyResult<()> {
        let index = self.actions_index.ok_or_else(|| {
            to_pyerr(
                py,
                Error::NoSuchTensor {
                    name: "actions".into(),
                    available: self
                        .tensors
                        .iter()
                        .map(|t| t.get().info.name.clone())
                        .collect::<Vec<_>>()
                        .join(", "),
                },
            )
        })?;
        let target = self.tensors[index].get();
        // `client.step(client.actions)`: already in place.
        if let Ok(t) = actions.cast::<PyTensor>() {
            if std::ptr::eq(t.get(), target) {
                return Ok(());
            }
        }
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
                "actions must be on the CPU (device type {}:{}) to go into the shared-memory tensor",
                view.device().device_type.0,
                view.device().device_id
            )));
        }
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

    /// Runs a command-channel call without the GIL, with Ctrl-C checked at every sleep
    /// slice of its waits (about every 10 ms): a signal's exception (KeyboardInterrupt)
    /// stops the call and is raised; the reply, if it comes later, is dropped by id.
    /// Steps do not use this: their wait is sliced in `step()` itself.
    fn command<T: Send>(
        &self,
        py: Python<'_>,
        call: impl FnOnce(&mut Client) -> Result<T, Error> + Send,
    ) -> PyResult<T> {
        let mut core = self.lock()?;
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
    if let Some(t) = tensors.iter().find(|t| t.get().info.name == name) {
        return Ok(t.clone_ref(py));
    }
    let available: Vec<&str> = tensors.iter().map(|t| t.get().info.name.as_str()).collect();
    Err(to_pyerr(
        py,
        Error::NoSuchTensor {
            name: name.to_string(),
            available: available.join(", "),
        },
    ))
}

fn closed_err(py: Python<'_>) -> PyErr {
    to_pyerr(py, Error::Closed(Peer::Client))
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
        let tensors = PyTensor::all(py, &region, &layout, Peer::Client)?;
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
            actions_index: find("actions"),
            tensors,
            step_outputs,
            on_close: Mutex::new(None),
            engine_process: Mutex::new(None),
        })
    }

    /// Sends one action and waits for the engine's frame; returns
    /// `(obs, rewards, terminated, truncated)`, the same tensor objects every time.
    #[pyo3(signature = (actions=None, timeout=None))]
    fn step<'py>(
        &self,
        py: Python<'py>,
        actions: Option<Bound<'py, PyAny>>,
        timeout: Option<f64>,
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
        if let Some(a) = &actions {
            self.copy_actions(py, a)?;
        }
        let first = match deadline {
            Some(d) => d
                .saturating_duration_since(Instant::now())
                .min(SIGNAL_SLICE),
            None => SIGNAL_SLICE,
        };
        let client = core.client.as_mut().ok_or_else(|| closed_err(py))?;
        match py.detach(|| client.step(first)) {
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
    #[pyo3(signature = (seed=None, env_ids=None, timeout=10.0))]
    fn reset(
        &self,
        py: Python<'_>,
        seed: Option<Bound<'_, PyAny>>,
        env_ids: Option<Vec<u32>>,
        timeout: f64,
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
        self.command(py, |client| {
            client.reset(env_ids.as_deref(), &seeds, timeout)
        })
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
        let reply = self.command(py, |client| {
            let args: Vec<(&str, &str)> =
                args.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            client.call_method(method, &args, &payload, timeout)
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
        let body = self.command(py, |client| client.schema(timeout))?;
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
        let back = self.command(py, |client| client.ping(&payload, timeout))?;
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
        if let Some(c) = client {
            c.close();
        }
        self.run_on_close(py)
    }

    #[getter]
    fn closed(&self) -> bool {
        self.core.lock().map(|c| c.client.is_none()).unwrap_or(true)
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
