//! CUDA streams from Python: the stream arguments of `step`, `reset` and `call` (an
//! int `CUstream`, `torch.cuda.Stream`, the `__cuda_stream__` protocol, or torch's
//! current stream), and the ordering of a CUDA client's steps and commands on them. A
//! host client has no stream (`None`) and none of this does anything for it.

use dlpark::ffi::DLDevice;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use std::time::{Duration, Instant};

use crate::client::Client;
use crate::device::StreamRef;
use crate::error::Error;

/// How a client picks the stream a step or command orders its work on.
pub(super) struct ConsumerStreams {
    /// N of `"cuda:N"`; `None` for a host client.
    ordinal: Option<i32>,
    /// The `torch.cuda` module, once torch has initialised CUDA in this process (it
    /// stays initialised): [`consumer_stream`](Self::consumer_stream) then skips the
    /// lookup and the check on every step.
    torch_cuda: PyOnceLock<Py<PyAny>>,
}

impl ConsumerStreams {
    /// For a client whose tensors are on `cuda:ordinal`, or on the host (`None`).
    pub(super) fn new(ordinal: Option<i32>) -> Self {
        ConsumerStreams {
            ordinal,
            torch_cuda: PyOnceLock::new(),
        }
    }

    /// The CUDA stream a step or reset of a CUDA client orders its work on: `stream` as
    /// given (an int `CUstream`, an object with `cuda_stream` like `torch.cuda.Stream`,
    /// or one with `__cuda_stream__`), else torch's current stream on the engine's
    /// device when torch has initialised CUDA, else the legacy default stream (1).
    /// `None` for a host client (`stream` is then ignored).
    pub(super) fn consumer_stream(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<u64>> {
        let Some(ordinal) = self.ordinal else {
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
}

/// A CUDA stream handed to a DLPack producer (`__dlpack__(stream=...)`) when importing
/// CUDA actions: the producer orders its pending writes before it.
pub(super) struct ConsumerStream(pub(super) u64);

// SAFETY: `ConsumerStream` holds 0, 1, 2 or a live stream of the device the tensor is
// on (see `ConsumerStreams::consumer_stream`), encoded by dlpark's CUDA convention, and
// lives for the whole `__dlpack__` call.
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

/// `Client::step_sliced`, for a device client on the consumer stream `raw` (the client's
/// event is recorded there, after the action writes queued on it).
pub(super) fn step_on(
    client: &mut Client,
    stream: Option<u64>,
    deadline: Option<Instant>,
    slice: Duration,
    between: impl FnMut() -> Result<(), Error>,
) -> Result<u64, Error> {
    // SAFETY: `raw` is 0, 1, 2 or a live stream of the engine's device
    // (`consumer_stream`), used for this call only.
    let stream = stream.map(|raw| unsafe { StreamRef::from_raw(raw) });
    client.step_sliced(stream, deadline, slice, between)
}

/// Runs a command that may write device tensors (reset, engine methods) ordered after
/// the work queued on the consumer stream (reads of the current frame): the client's
/// event is recorded there before the request goes out, and once the reply arrived the
/// stream waits on the engine's event ([`order_after_engine`]). Plain `call` for a host
/// client.
pub(super) fn on_stream<T>(
    client: &mut Client,
    stream: Option<u64>,
    call: impl FnOnce(&mut Client) -> Result<T, Error>,
) -> Result<T, Error> {
    let Some(raw) = stream else {
        return call(client);
    };
    // SAFETY: `raw` is 0, 1, 2 or a live stream of the engine's device
    // (`consumer_stream`), and is unset before this returns.
    unsafe { client.set_command_stream(raw) };
    let out = call(client);
    // SAFETY: 1, the legacy default stream.
    unsafe { client.set_command_stream(1) };
    let out = out?;
    order_after_engine(client, stream)?;
    Ok(out)
}

/// After a frame (or a command's reply) arrived: makes the consumer stream `raw` wait,
/// on the GPU, for the engine's event, so work queued on it afterwards sees the new
/// device tensors. Nothing for a host client.
pub(super) fn order_after_engine(client: &Client, stream: Option<u64>) -> Result<(), Error> {
    match stream {
        // SAFETY: `raw` is 0, 1, 2 or a live stream of the engine's device
        // (`consumer_stream`), used for this call only.
        Some(raw) => client
            .backend()
            .order_after_frame(unsafe { StreamRef::from_raw(raw) }),
        None => Ok(()),
    }
}

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
