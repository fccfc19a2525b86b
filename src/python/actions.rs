//! `step(actions)`: a NumPy array, torch tensor or other DLPack object becomes a plain
//! array description, which the core checks against the action tensor and copies
//! ([`crate::actions`]). This layer only imports the DLPack tensor and maps errors:
//! the core's wrong dtypes to `TypeError`, its other complaints to `ValueError`.

use dlpark::ffi::DLDevice;
use dlpark::tensor::TensorRef;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::tensor::{Place, PyTensor};
use crate::actions::{self as core, ActionError, ActionSlot, ArrayDesc, ArrayDevice, ElementType};
use crate::client::Client;
use crate::device::{Device, StreamRef};

/// Validates `actions` against `target`, the action tensor, and copies it there: a host
/// copy into the shared memory, or for a CUDA action tensor a device-to-device copy
/// ordered on `stream` (the step's consumer stream) of `client`'s context. Nothing is
/// written on error.
pub(super) fn copy_actions(
    py: Python<'_>,
    client: &Client,
    target: &PyTensor,
    actions: &Bound<'_, PyAny>,
    stream: Option<u64>,
) -> PyResult<()> {
    // `client.step(client.actions)`: already in place.
    if let Ok(t) = actions.cast::<PyTensor>() {
        if std::ptr::eq(t.get(), target) {
            return Ok(());
        }
    }
    if let Place::Device { ptr, device, .. } = &target.place {
        return copy_device_actions(py, client, actions, target, *ptr, *device, stream);
    }
    let imported = import_host(py, &host_source(py, actions)?)?;
    let view = imported.validate().map_err(invalid_tensor)?;
    let slot = slot_of(target);
    let strides = byte_strides(&view)?;
    let array = describe(&view, strides.as_deref());
    core::check(&slot, &array).map_err(action_error)?;
    // SAFETY: the producer guarantees its DLPack descriptor describes live memory for as
    // long as we hold `imported`; `offset_bytes_ptr` includes `byte_offset`.
    let src = unsafe { view.offset_bytes_ptr() }.map_err(invalid_tensor)?;
    // SAFETY: the array lives in host memory (checked) and its shape and strides address
    // the producer's elements, readable while `imported` lives; the destination is the
    // host action tensor (a CUDA one was handled above, and the core refuses a slot not
    // on the host), `nbytes` inside the validated mapping. The GIL is held: no
    // other thread of this process writes either meanwhile (the engine reads the slot
    // only after the step is posted).
    unsafe { core::copy_to_host_slot(&slot, &array, src, target.address()) }
        .map_err(action_error)?;
    drop(imported);
    Ok(())
}

/// `actions` as a DLPack producer: itself, or a NumPy array of it (`TypeError` for an
/// object that is neither).
fn host_source<'py>(py: Python<'py>, actions: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if actions.hasattr("__dlpack__")? {
        Ok(actions.clone())
    } else if actions.hasattr("__array__")? {
        py.import("numpy")?.call_method1("asarray", (actions,))
    } else {
        Err(PyTypeError::new_err(format!(
            "actions must be a NumPy array, a torch tensor or another DLPack object, not {}",
            actions.get_type().name()?
        )))
    }
}

/// The checks of [`copy_actions`] for the actions of `rows` envs (an asynchronous
/// `send`): `actions` is `rows` rows of `target`, of its dtype, on its device. Copies
/// nothing.
pub(super) fn check_rows(
    py: Python<'_>,
    target: &PyTensor,
    actions: &Bound<'_, PyAny>,
    rows: usize,
) -> PyResult<()> {
    let imported = import_host(py, &host_source(py, actions)?)?;
    let view = imported.validate().map_err(invalid_tensor)?;
    let shape: Vec<u64> = std::iter::once(rows as u64)
        .chain(target.info.shape.iter().skip(1).copied())
        .collect();
    let slot = ActionSlot {
        shape: &shape,
        ..slot_of(target)
    };
    let strides = byte_strides(&view)?;
    core::check(&slot, &describe(&view, strides.as_deref())).map_err(action_error)
}

/// `source`'s DLPack tensor, asked for as the DLPack 1.0 array API does
/// (`__dlpack__(max_version=...)`), else as producers before it do (`__dlpack__()`):
/// NumPy before 2.1 (the package supports 1.23 and later) has `__dlpack_device__` but a
/// `__dlpack__` without `max_version`, and raises `TypeError` when asked with it.
fn import_host(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
) -> PyResult<dlpark::python::ImportedDlpack> {
    match dlpark::python::from_dlpack(source.as_borrowed(), None, None) {
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            // A producer whose own TypeError was real raises it again here.
            let capsule = source.call_method0(pyo3::intern!(py, "__dlpack__"))?;
            dlpark::python::from_dlpack(capsule.as_borrowed(), None, None)
        }
        other => other,
    }
}

/// The action tensor as the core's checks see it.
fn slot_of(target: &PyTensor) -> ActionSlot<'_> {
    ActionSlot {
        dtype: target.info.dtype,
        shape: &target.info.shape,
        device: array_device(target.dl_device()),
    }
}

fn array_device(d: DLDevice) -> ArrayDevice {
    ArrayDevice {
        kind: d.device_type.0,
        id: d.device_id,
    }
}

/// The strides of an imported tensor in bytes; `None` when it has none (C-contiguous).
fn byte_strides(view: &TensorRef<'_>) -> PyResult<Option<Vec<i64>>> {
    let dtype = element_type(view);
    view.strides()
        .map(|s| core::byte_strides(s, dtype))
        .transpose()
        .map_err(action_error)
}

fn element_type(view: &TensorRef<'_>) -> ElementType {
    let d = view.dtype();
    ElementType {
        code: d.code.0,
        bits: d.bits,
        lanes: d.lanes,
    }
}

/// The plain description of an imported tensor, with its strides in bytes.
fn describe<'a>(view: &TensorRef<'a>, byte_strides: Option<&'a [i64]>) -> ArrayDesc<'a> {
    ArrayDesc {
        dtype: element_type(view),
        shape: view.shape(),
        byte_strides,
        device: array_device(view.device()),
    }
}

fn action_error(e: ActionError) -> PyErr {
    if e.is_type_error() {
        PyTypeError::new_err(e.to_string())
    } else {
        PyValueError::new_err(e.to_string())
    }
}

fn invalid_tensor(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("invalid DLPack tensor: {e}"))
}

/// [`copy_actions`] for an action slot in device memory: `actions` must be a DLPack
/// tensor on the same device, of the slot's dtype and shape, C-contiguous; the client's
/// device backend copies it device-to-device on `stream` after the producer ordered its
/// writes before that stream (`__dlpack__(stream=...)`). A host array is an error, not a
/// silent transfer.
fn copy_device_actions(
    py: Python<'_>,
    client: &Client,
    actions: &Bound<'_, PyAny>,
    target: &PyTensor,
    dst: u64,
    device: Device,
    stream: Option<u64>,
) -> PyResult<()> {
    use super::errors::IntoPy;
    use super::streams::ConsumerStream;

    if !actions.hasattr("__dlpack__")? {
        return Err(PyTypeError::new_err(format!(
            "the engine's 'actions' live on {device}: pass a CUDA tensor (e.g. torch), \
             not {} (no implicit host-to-device copy)",
            actions.get_type().name()?
        )));
    }
    let slot = slot_of(target);
    // Before the import: the consumer stream handed to the producer must be of its device.
    let array_dev = dlpark::python::dlpack_device(actions.as_borrowed())?;
    core::check_device(&slot, array_device(array_dev)).map_err(action_error)?;
    let raw = stream.unwrap_or(1);
    let imported =
        dlpark::python::from_dlpack(actions.as_borrowed(), Some(&ConsumerStream(raw)), None)?;
    let view = imported.validate().map_err(invalid_tensor)?;
    let strides = byte_strides(&view)?;
    core::check(&slot, &describe(&view, strides.as_deref())).map_err(action_error)?;
    // SAFETY: the producer's descriptor describes live device memory while `imported`
    // lives; `offset_bytes_ptr` includes `byte_offset` (pointer arithmetic only).
    let src = unsafe { view.offset_bytes_ptr() }.map_err(invalid_tensor)?;
    // SAFETY: `raw` is 0, 1, 2 or a live stream of this device (`consumer_stream`), used
    // for this call only. `src` is `nbytes` of C-contiguous memory of the slot's device
    // (same dtype and shape as the slot, checked above), ordered before `stream` by
    // `__dlpack__`; `dst` is the action slot's address from the client's backend. The
    // producer keeps `src` alive for work ordered on its stream; a caller passing a
    // foreign stream keeps it alive until the step returns (documented on `step`).
    unsafe {
        client.backend().copy_into(
            dst,
            src as usize as u64,
            slot.nbytes(),
            StreamRef::from_raw(raw),
        )
    }
    .py_err(py)?;
    drop(imported);
    Ok(())
}
