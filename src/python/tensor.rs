//! `shmbridge.Tensor`: one tensor of a region, created once per client or engine at
//! attach, with `__dlpack__` / `__dlpack_device__` (dlpark builds the capsules) and
//! `__array__`. Host tensors share a second mapping of the region through an `Arc` with
//! every capsule handed out, so a view stays valid after `close()`.

use std::sync::{Arc, Mutex};

use dlpark::ffi::DLManagedTensorVersioned;
use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor};
use dlpark::metadata::Dynamic;
use dlpark::python::{DlpackExporter, ExportAbi, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::errors::{to_pyerr, IntoPy};
use crate::actions::array_dtype_name;
use crate::client::Client;
use crate::device::{Device, DeviceLease, DevicePlace, StreamRef};
use crate::error::{Error, Peer};
use crate::layout::{DType, TensorInfo};
use crate::region::Region;

fn dl_dtype(d: DType) -> DLDataType {
    let (code, bits) = d.dlpack();
    DLDataType {
        code: DLDataTypeCode(code),
        bits,
        lanes: 1,
    }
}

/// Where a [`PyTensor`]'s bytes are, in this process.
pub(super) enum Place {
    /// In the shared-memory region, at the layout's offset.
    Host,
    /// In the engine's device memory, imported by the client's device backend: `ptr` is
    /// the tensor's address on this process's `device`. The lease keeps the import open
    /// (and, for CUDA, the engine's event) while the client is open or a capsule of it
    /// lives; `close()` takes this object's reference away, so that only views handed
    /// out delay the close acknowledgement (the memory itself lives only as long as the
    /// engine process: it owns it).
    Device {
        ptr: u64,
        device: Device,
        lease: Mutex<Option<Arc<dyn DeviceLease>>>,
    },
}

/// One tensor of a region, as Python sees it: host memory in the region, or device
/// memory imported by the client's device backend (CUDA IPC). Created once per client at
/// attach.
#[pyclass(module = "shmbridge._native", name = "Tensor", frozen)]
pub struct PyTensor {
    /// A second mapping of the region (`map_again`): every host capsule holds a clone,
    /// so views outlive the client or engine that made them.
    region: Arc<Region>,
    pub(super) info: TensorInfo,
    pub(super) shape: Vec<i64>,
    /// Whether the side holding this object writes the tensor (the client writes
    /// client→engine tensors, the engine engine→client ones).
    writable: bool,
    pub(super) place: Place,
}

/// The place of tensor `index` for a client: device memory for the tensors the engine
/// placed on a device (imported at attach), host for the others.
pub(super) fn client_place(
    client: &Client,
    index: usize,
    info: &TensorInfo,
) -> Result<Place, Error> {
    Ok(match client.backend().place(index, info)? {
        None => Place::Host,
        Some(DevicePlace { ptr, device, lease }) => Place::Device {
            ptr,
            device,
            lease: Mutex::new(Some(lease)),
        },
    })
}

impl PyTensor {
    /// The tensors of `layout` as `side` sees them, all sharing `region`; `place` says
    /// where tensor `i` lives in this process.
    pub(super) fn all(
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
    pub(super) fn address(&self) -> *mut u8 {
        // SAFETY: the layout was validated against the region's length, and this mapping
        // (`map_again`) has that same length: `offset + nbytes <= len`, so the pointer
        // stays inside it. (For a CUDA tensor the range is reserved but unused.)
        unsafe { self.region.ptr().add(self.info.offset as usize) }
    }

    /// Whether the bytes are host memory of this process: in the region, or device
    /// memory the import mapped on the CPU (a Vulkan tensor imported into a Vulkan
    /// device of the client's own).
    fn on_cpu(&self) -> bool {
        match &self.place {
            Place::Host => true,
            Place::Device { device, .. } => *device == Device::Host,
        }
    }

    /// The host address, or `TypeError` for a CUDA tensor (no host bytes to give).
    fn host_address(&self) -> PyResult<*mut u8> {
        match &self.place {
            Place::Host => Ok(self.address()),
            Place::Device { ptr, device, .. } if *device == Device::Host => {
                // The lease must still be held: after close() the mapping may be gone.
                self.lease()?;
                Ok(*ptr as usize as *mut u8)
            }
            Place::Device { device, .. } => Err(PyTypeError::new_err(format!(
                "tensor '{}' lives on {device}, not in host memory: use \
                 torch.from_dlpack(tensor) (or another CUDA DLPack consumer)",
                self.info.name
            ))),
        }
    }

    /// Address of the first byte in this process: host or device.
    fn data_address(&self) -> u64 {
        match &self.place {
            Place::Host => self.address() as u64,
            Place::Device { ptr, .. } => *ptr,
        }
    }

    /// The lease of a device tensor of an open client; `ClosedError` after `close()`.
    pub(super) fn lease(&self) -> PyResult<Arc<dyn DeviceLease>> {
        let Place::Device { lease, .. } = &self.place else {
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

    /// Drops this object's reference to the device lease (at the client's close).
    pub(super) fn detach_lease(&self) {
        if let Place::Device { lease, .. } = &self.place {
            lease.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
    }

    pub(super) fn dl_device(&self) -> DLDevice {
        match &self.place {
            Place::Host => DLDevice::CPU,
            Place::Device { device, .. } => {
                let (device_type, device_id) = device.dlpack();
                DLDevice {
                    device_type: dlpark::ffi::DLDeviceType(device_type as u32),
                    device_id,
                }
            }
        }
    }

    /// `"cpu"` or `"cuda:N"`.
    pub(super) fn device_name(&self) -> String {
        match &self.place {
            Place::Host => "cpu".to_string(),
            Place::Device { device, .. } => device.to_string(),
        }
    }

    fn managed<M: ManagedTensorBase>(&self, flags: DlpackFlags) -> PyResult<Managed<M>> {
        let layout = Dynamic::compact(self.shape.clone());
        fn failed(e: impl std::fmt::Display) -> PyErr {
            PyRuntimeError::new_err(format!("building a DLPack tensor: {e}"))
        }
        let mut init = match &self.place {
            Place::Host => layout.initialize_as::<M>(Arc::clone(&self.region)),
            Place::Device { .. } => layout.initialize_as::<M>(Arc::new(self.lease()?)),
        }
        .map_err(failed)?;
        init.set_data(self.data_address() as usize as *mut std::ffi::c_void)
            .set_dtype(dl_dtype(self.info.dtype))
            .set_device(self.dl_device());
        // READ_ONLY (a no-op for the legacy struct, which has no flags).
        init.set_flags(flags).map_err(failed)?;
        // SAFETY: host: `data` points at `nbytes` bytes inside the mapping (validated
        // bounds, 64-byte aligned), and the context is an `Arc` of that mapping, so the
        // bytes stay mapped until the consumer calls the deleter, even after the client
        // closes. CUDA: `data` is the opened base plus the offset, checked against the
        // size the driver reports for the allocation (`ImportedMemory::span`), and the
        // context is an `Arc` of the lease that keeps the handle open until the deleter
        // runs. Both are laid out C-contiguously with the shape and the compact strides
        // dlpark wrote. Concurrent writes by the peer follow the lock-step protocol, not
        // Rust aliasing; READ_ONLY, where set, only tells the consumer not to write.
        Ok(unsafe { init.finish() })
    }

    /// Whether a versioned export of this tensor says READ_ONLY: the tensors the other
    /// side writes (`obs`, `rewards`... for a client; `actions` for an engine).
    fn versioned_flags(&self) -> DlpackFlags {
        if self.writable {
            DlpackFlags::empty()
        } else {
            DlpackFlags::READ_ONLY
        }
    }
}

/// A [`PyTensor`] exported with its READ_ONLY flag: only for consumers that asked for a
/// versioned capsule (DLPack 1.x). The legacy struct cannot carry flags (dlpark refuses
/// flags there), so legacy consumers still get an unflagged view.
struct Flagged<'t>(&'t PyTensor);

impl DlpackExporter for Flagged<'_> {
    fn device(&self) -> DLDevice {
        self.0.dl_device()
    }

    fn flags(&self) -> DlpackFlags {
        self.0.versioned_flags()
    }

    fn prepare_export(&self, py: Python<'_>, request: &ExportRequest<'_>) -> PyResult<()> {
        self.0.prepare_export(py, request)
    }

    fn export_legacy(&self, py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.0.export_legacy(py)
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.0.managed(self.0.versioned_flags())
    }
}

/// Exports `tensor` for `request`: flagged READ_ONLY if the consumer takes DLPack 1.x.
fn export<'py>(
    tensor: &PyTensor,
    py: Python<'py>,
    request: ExportRequest<'py>,
) -> PyResult<Py<PyAny>> {
    if request.abi() == ExportAbi::Versioned {
        dlpark::python::export_dlpack(&Flagged(tensor), py, request)
    } else {
        dlpark::python::export_dlpack(tensor, py, request)
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
            // Device memory mapped on the CPU: `frame_seq` orders it, as for the region.
            Place::Device { .. } if self.on_cpu() => Ok(()),
            // The consumer's stream waits (on the GPU) for the engine's last frame.
            Place::Device { .. } => {
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
                let stream = unsafe { StreamRef::from_raw(raw) };
                lease.order_after_frame(stream).py_err(_py)
            }
        }
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed(DlpackFlags::empty())
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed(DlpackFlags::empty())
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
        if !slf.get().on_cpu() {
            // A device tensor: the consumer's stream waits on the engine's event
            // (`prepare_export`); copy=True is refused (BufferError) by dlpark, as this
            // producer only exports the engine's memory itself.
            let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
            return export(slf.get(), py, request);
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
        export(slf.get(), py, request)
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
        } else if !slf.get().writable {
            // The other side writes it: a view (NumPy that asks for a legacy capsule
            // would get a writable one) is made read-only here.
            array.getattr("flags")?.setattr("writeable", false)?;
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
        array_dtype_name(self.info.dtype)
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
            array_dtype_name(self.info.dtype),
            self.shape,
            self.info.direction.arrow(),
            self.device_name(),
            self.data_address()
        )
    }
}

/// The tensor called `name`, or `NoSuchTensorError` listing the names there are.
pub(super) fn tensor_named(
    py: Python<'_>,
    tensors: &[Py<PyTensor>],
    name: &str,
) -> PyResult<Py<PyTensor>> {
    match tensors.iter().find(|t| t.get().info.name == name) {
        Some(t) => Ok(t.clone_ref(py)),
        None => Err(no_such_tensor(py, tensors, name)),
    }
}

/// `NoSuchTensorError` for `name`, listing the names of `tensors`.
pub(super) fn no_such_tensor(py: Python<'_>, tensors: &[Py<PyTensor>], name: &str) -> PyErr {
    let available: Vec<&str> = tensors.iter().map(|t| t.get().info.name.as_str()).collect();
    to_pyerr(
        py,
        Error::NoSuchTensor {
            name: name.to_string(),
            available: available.join(", "),
        },
    )
}
