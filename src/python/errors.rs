//! Crate errors as the exceptions of `shmbridge.errors` (defined in Python, so that e.g.
//! `shmbridge.TimeoutError` can subclass both `ShmBridgeError` and the builtin): one
//! class per [`ErrorKind`], looked up once.

use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::error::{Error, ErrorKind, PidNamespace};

/// The `shmbridge.errors` class of each kind.
fn class_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::NotFound => "NotFoundError",
        ErrorKind::NameInUse => "NameInUseError",
        ErrorKind::PermissionDenied => "PermissionDeniedError",
        ErrorKind::InvalidName => "InvalidNameError",
        ErrorKind::NotARegionFile => "NotARegionFileError",
        ErrorKind::BadMagic => "BadMagicError",
        ErrorKind::VersionMismatch => "VersionMismatchError",
        ErrorKind::LayoutMismatch => "LayoutMismatchError",
        ErrorKind::RegionTooSmall => "RegionTooSmallError",
        ErrorKind::InvalidHeader => "InvalidHeaderError",
        ErrorKind::TensorOutOfBounds => "TensorOutOfBoundsError",
        ErrorKind::InvalidTensor => "InvalidTensorError",
        ErrorKind::InvalidSpec => "InvalidSpecError",
        ErrorKind::NoSuchTensor => "NoSuchTensorError",
        ErrorKind::DTypeMismatch => "DTypeMismatchError",
        ErrorKind::WrongDirection => "WrongDirectionError",
        ErrorKind::AlreadyBorrowed => "AlreadyBorrowedError",
        ErrorKind::AlreadyAttached => "AlreadyAttachedError",
        ErrorKind::EngineDied => "EngineDiedError",
        ErrorKind::ClientDied => "ClientDiedError",
        ErrorKind::EngineClosed => "EngineClosedError",
        ErrorKind::ClientClosed => "ClientClosedError",
        ErrorKind::Timeout => "TimeoutError",
        ErrorKind::Protocol => "ProtocolError",
        ErrorKind::RecordTooLarge => "RecordTooLargeError",
        ErrorKind::BadMessage => "BadMessageError",
        ErrorKind::NoCommandChannel => "NoCommandChannelError",
        ErrorKind::Remote => "RemoteError",
        ErrorKind::OutOfOrder => "OutOfOrderError",
        ErrorKind::Interrupted => "InterruptedError",
        ErrorKind::Closed => "ClosedError",
        ErrorKind::CudaUnavailable => "CudaUnavailableError",
        ErrorKind::Cuda => "CudaError",
        ErrorKind::VulkanUnavailable => "VulkanUnavailableError",
        ErrorKind::Vulkan => "VulkanError",
        ErrorKind::NotOnHost => "NotOnHostError",
        ErrorKind::NoSpace => "NoSpaceError",
        ErrorKind::CommandBacklog => "CommandBacklogError",
        ErrorKind::NotPosted => "NotPostedError",
        ErrorKind::NoDeviceSide => "NoDeviceSideError",
        ErrorKind::Io => "ShmBridgeOSError",
        ErrorKind::Full => "FullError",
    }
}

/// The classes of [`ErrorKind::ALL`], in that order, imported at the first error.
static CLASSES: PyOnceLock<Vec<Py<PyAny>>> = PyOnceLock::new();

fn class_of<'py>(py: Python<'py>, kind: ErrorKind) -> PyResult<Bound<'py, PyAny>> {
    let classes = CLASSES.get_or_try_init(py, || {
        let errors = py.import("shmbridge.errors")?;
        ErrorKind::ALL
            .iter()
            .map(|&k| errors.getattr(class_name(k)).map(Bound::unbind))
            .collect::<PyResult<Vec<_>>>()
    })?;
    Ok(classes[kind as usize].bind(py).clone())
}

/// Turns a crate error into an instance of its `shmbridge.errors` class, carrying the
/// Rust message (and, where the variant has them, a few fields as attributes).
pub(super) fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    let message = e.to_string();
    let build = || -> PyResult<PyErr> {
        let exc = class_of(py, e.kind())?.call1((message.clone(),))?;
        match &e {
            Error::PeerDied { pid, pid_ns, .. } | Error::AlreadyAttached { pid, pid_ns, .. } => {
                exc.setattr("pid", *pid)?;
                exc.setattr("pid_in_other_namespace", *pid_ns == PidNamespace::Other)?;
            }
            Error::ShardDied {
                shard,
                pid,
                pid_ns,
                env_start,
                env_end,
            } => {
                exc.setattr("pid", *pid)?;
                exc.setattr("pid_in_other_namespace", *pid_ns == PidNamespace::Other)?;
                exc.setattr("shard", *shard)?;
                exc.setattr("envs", (*env_start, *env_end))?;
            }
            Error::ShardClosed {
                shard,
                env_start,
                env_end,
            } => {
                exc.setattr("shard", *shard)?;
                exc.setattr("envs", (*env_start, *env_end))?;
            }
            Error::Remote { method, code, .. } => {
                exc.setattr("method", method.as_str())?;
                exc.setattr("code", *code)?;
            }
            Error::Timeout { waited, .. } | Error::NotPosted { waited, .. } => {
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

/// An instance of `kind`'s `shmbridge.errors` class with `message` (for errors of the
/// binding's own objects, said in their own words).
pub(super) fn error_of_kind(py: Python<'_>, kind: ErrorKind, message: String) -> PyErr {
    match class_of(py, kind).and_then(|c| c.call1((message.clone(),))) {
        Ok(exc) => PyErr::from_value(exc),
        Err(import_error) => PyRuntimeError::new_err(format!(
            "{message} (and shmbridge.errors failed: {import_error})"
        )),
    }
}

pub(super) trait IntoPy<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, e))
    }
}

/// The `shmbridge.errors` class of each error kind (for tests and docs).
#[pyfunction]
pub(super) fn _error_classes() -> Vec<&'static str> {
    ErrorKind::ALL.into_iter().map(class_name).collect()
}

/// Raises the exception a Rust error maps to (for tests of the mapping).
#[pyfunction]
pub(super) fn _raise_timeout(py: Python<'_>) -> PyErr {
    to_pyerr(
        py,
        Error::Timeout {
            waited: Duration::from_millis(1500),
            what: "a test",
        },
    )
}
