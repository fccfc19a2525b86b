//! The module's functions: the command line (`cli`, which also serves the reference
//! engines) and the region tools (`list_regions`, `gc`, `cuda_available`,
//! `_cuda_status`).

use std::ffi::OsString;

use pyo3::prelude::*;

use super::errors::IntoPy;
use super::waits::SignalCheck;
use crate::cli::Invocation;
use crate::error::Error;
use crate::region;

/// Whether CUDA tensors can be served and opened here: `True` or `False`, never a
/// tuple (`shmbridge.cuda_status()` gives the reason). Never raises; the probe is cached
/// after the first call.
#[pyfunction]
pub(super) fn cuda_available(py: Python<'_>) -> bool {
    cuda_probe(py).0
}

/// `(True, "driver 12080, 1 device(s)")`, or `(False, reason)` (built without the `cuda`
/// feature, no loadable driver, no device): what `shmbridge.cuda_status()` returns as a
/// named tuple. Never raises.
#[pyfunction]
pub(super) fn _cuda_status(py: Python<'_>) -> (bool, String) {
    cuda_probe(py)
}

fn cuda_probe(py: Python<'_>) -> (bool, String) {
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

/// Names of the shmbridge regions in /dev/shm of this process's region namespace
/// (`SHMBRIDGE_NAMESPACE`; unset: every one).
#[pyfunction]
pub(super) fn list_regions(py: Python<'_>) -> PyResult<Vec<String>> {
    region::list_names().py_err(py)
}

/// Removes the regions of this process's region namespace whose engine is dead; returns
/// their names.
#[pyfunction]
pub(super) fn gc(py: Python<'_>) -> PyResult<Vec<String>> {
    region::sweep().py_err(py)
}

/// `ValueError` with the parser's message unless `argv` (the arguments after the
/// program) is a command line `shmbridge` accepts: `launch()` checks the engine's
/// command with the same parser the engine uses, before it starts a process.
#[pyfunction]
pub(super) fn _check_cli_args(argv: Vec<String>) -> PyResult<()> {
    let args = std::iter::once("shmbridge".to_string()).chain(argv);
    crate::cli::check_args(args).map_err(pyo3::exceptions::PyValueError::new_err)
}

/// Starts an engine process for `launch()` through the library's one spawning path
/// ([`crate::launch::spawn_engine`]: it gets SIGTERM when this process dies, and does not
/// start if this process died first; its own session): `argv` (program first), `env`
/// (the whole environment, or None: this process's), stdin from /dev/null, stdout a pipe,
/// stderr onto a duplicate of descriptor `stderr_fd`, stdin a pipe if `stdin` (else
/// /dev/null). Returns `(pid, stdout_fd, stdin_fd)` (`stdin_fd` -1 without one): the
/// caller owns the pipe ends and reaps the process (`os.waitpid`).
#[pyfunction]
#[pyo3(signature = (argv, env, stderr_fd, stdin=false))]
pub(super) fn _spawn_engine(
    py: Python<'_>,
    argv: Vec<OsString>,
    env: Option<Vec<(OsString, OsString)>>,
    stderr_fd: i32,
    stdin: bool,
) -> PyResult<(u32, i32, i32)> {
    use std::os::fd::{BorrowedFd, IntoRawFd};
    use std::process::{Command, Stdio};
    let Some((program, args)) = argv.split_first() else {
        return Err(pyo3::exceptions::PyValueError::new_err("argv is empty"));
    };
    if stderr_fd < 0 {
        return Err(pyo3::exceptions::PyValueError::new_err("stderr_fd < 0"));
    }
    // SAFETY: the caller passes a descriptor it keeps open for this call; it is only
    // duplicated here (the child gets the duplicate).
    let stderr = unsafe { BorrowedFd::borrow_raw(stderr_fd) }
        .try_clone_to_owned()
        .map_err(pyo3::exceptions::PyOSError::new_err)?;
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr));
    if let Some(env) = env {
        command.env_clear().envs(env);
    }
    let mut child = py
        .detach(|| crate::launch::spawn_engine(command, true))
        .py_err(py)?;
    let stdout = child
        .stdout
        .take()
        .map(IntoRawFd::into_raw_fd)
        .unwrap_or(-1);
    let stdin = child.stdin.take().map(IntoRawFd::into_raw_fd).unwrap_or(-1);
    // The caller reaps it by pid; dropping `child` neither waits nor kills.
    Ok((child.id(), stdout, stdin))
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
