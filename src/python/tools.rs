//! The module's functions: the command line (`cli`, which also serves the reference
//! engines) and the region tools (`list_regions`, `gc`, `cuda_available`).

use std::ffi::OsString;

use pyo3::prelude::*;

use super::errors::IntoPy;
use super::waits::SignalCheck;
use crate::cli::Invocation;
use crate::error::Error;
use crate::region;

/// Whether CUDA tensors can be served and opened here: `(True, "driver 12080, 1
/// device(s)")`, or `(False, reason)` (built without the `cuda` feature, no loadable
/// driver, no device). Never raises; cached after the first call.
#[pyfunction]
pub(super) fn cuda_available(py: Python<'_>) -> (bool, String) {
    match py.detach(crate::device::probe) {
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
pub(super) fn list_regions(py: Python<'_>) -> PyResult<Vec<String>> {
    region::list_names().py_err(py)
}

/// Removes regions whose engine is dead; returns their names.
#[pyfunction]
pub(super) fn gc(py: Python<'_>) -> PyResult<Vec<String>> {
    region::sweep().py_err(py)
}

/// Runs the `shmbridge` command line, the binary's own ([`crate::cli`]), on `argv` (the
/// program name first); returns the exit status. Runs without the GIL. `client --launch`
/// starts its engine as `python -m shmbridge engine`. Ctrl-C: `client` checks for
/// signals between steps and in its waits, closes, and raises the KeyboardInterrupt;
/// `engine` closes its region and ends the process (status 130), as the binary does.
#[pyfunction]
pub(super) fn cli(py: Python<'_>, argv: Vec<OsString>) -> PyResult<u8> {
    let python = py
        .import("sys")?
        .getattr("executable")?
        .extract::<OsString>()
        .ok()
        .filter(|p| !p.is_empty());
    let signals = SignalCheck::default();
    let invocation = Invocation {
        self_command: python.map(|p| vec![p, "-m".into(), "shmbridge".into()]),
        interrupt: Some(signals.hook()),
    };
    let status = py.detach(|| crate::cli::run(argv, &invocation));
    match signals.take() {
        Some(raised) => Err(raised),
        None => Ok(status),
    }
}
