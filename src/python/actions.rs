//! `step(actions)`: a NumPy array, torch tensor or other DLPack object becomes a plain
//! array description, which the core checks against the action tensor and copies
//! ([`crate::actions`]). This layer only imports the DLPack tensor and maps errors:
//! the core's wrong dtypes to `TypeError`, its other complaints to `ValueError`.

use dlpark::ffi::DLDevice;
use dlpark::tensor::TensorRef;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

#[cfg(feature = "cuda")]
use super::tensor::Place;
use super::tensor::PyTensor;
use crate::actions::{self as core, ActionError, ActionSlot, ArrayDesc, ArrayDevice, ElementType};
use crate::client::Client;

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
    #[cfg(feature = "cuda")]
    if let Place::Cuda { ptr, ordinal, .. } = &target.place {
        let cuda = client.cuda().ok_or_else(|| super::client::closed_err(py))?;
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

/// [`copy_actions`] for a CUDA action slot: `actions` must be a CUDA DLPack tensor on
/// the same device, of the slot's dtype and shape, C-contiguous; it is copied
/// device-to-device on `stream` after the producer ordered its writes before that stream
/// (`__dlpack__(stream=...)`). A host array is an error, not a silent transfer.
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
    use super::errors::IntoPy;
    use super::streams::ConsumerStream;

    if !actions.hasattr("__dlpack__")? {
        return Err(PyTypeError::new_err(format!(
            "the engine's 'actions' live on cuda:{ordinal}: pass a CUDA tensor (e.g. torch), \
             not {} (no implicit host-to-device copy)",
            actions.get_type().name()?
        )));
    }
    let slot = slot_of(target);
    // Before the import: the consumer stream handed to the producer must be of its device.
    let device = dlpark::python::dlpack_device(actions.as_borrowed())?;
    core::check_device(&slot, array_device(device)).map_err(action_error)?;
    let raw = stream.unwrap_or(1);
    let imported =
        dlpark::python::from_dlpack(actions.as_borrowed(), Some(&ConsumerStream(raw)), None)?;
    let view = imported.validate().map_err(invalid_tensor)?;
    let strides = byte_strides(&view)?;
    core::check(&slot, &describe(&view, strides.as_deref())).map_err(action_error)?;
    // SAFETY: the producer's descriptor describes live device memory while `imported`
    // lives; `offset_bytes_ptr` includes `byte_offset` (pointer arithmetic only).
    let src = unsafe { view.offset_bytes_ptr() }.map_err(invalid_tensor)?;
    // SAFETY: `raw` is 0, 1, 2 or a live stream of this device (`consumer_stream`).
    let stream = unsafe { crate::cuda::driver::Stream::borrowed(cuda.context(), raw) };
    // The engine may still be reading the previous actions (a frame is published once its
    // kernels are queued, not done); on another stream than the last step's, the copy
    // must wait for them.
    cuda.wait_frame_on(&stream).py_err(py)?;
    // SAFETY: `src` is `nbytes` of C-contiguous device memory of the producer (same
    // dtype and shape as the slot, checked above), ordered before `stream` by
    // `__dlpack__`; `dst` is the action slot in the engine's allocation (span checked at
    // attach), which the engine reads only after waiting on the client event recorded
    // after this copy. The producer keeps `src` alive for work ordered on its stream; a
    // caller passing a foreign stream keeps it alive until the step returns (documented
    // on `step`).
    unsafe { stream.copy_dtod(dst, src as usize as u64, slot.nbytes()) }.py_err(py)?;
    drop(imported);
    Ok(())
}
