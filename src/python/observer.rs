//! `shmbridge._native.RawObserver`: a read-only observer of a live region
//! ([`crate::observer::Observer`]), which `shmbridge.observe()` wraps with NumPy arrays,
//! tiling and video. Copies come back as `bytearray`s, one per tensor picked, which the
//! copy fills in place (made by Python's allocator: a size it cannot hold is
//! `MemoryError`); every wait runs without the GIL, in slices, so Ctrl-C is noticed.
//!
//! Threads: the observer is shared (`Arc`), and the mutex around it is held only to
//! clone or take that `Arc`, never across a wait: a thread that holds the GIL never
//! waits for one that gave the GIL up (the deadlock of holding the lock through a
//! `detach`). Reads from several threads run side by side; `close()` returns at once,
//! and a read in flight ends at its next slice with `ValueError`.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict, PyList};

use super::args::{Count, Seconds};
use super::errors::{to_pyerr, IntoPy};
use super::waits::{duration, next_slice};
use crate::actions::array_dtype_name;
use crate::error::Error;
use crate::observer::{Observer, Pick};

/// A read-only observer of one region.
#[pyclass(module = "shmbridge._native", name = "RawObserver", frozen)]
pub struct PyObserver {
    /// Held only to clone or take the `Arc` (never across a wait or a call into Python).
    observer: Mutex<Option<Arc<Observer>>>,
}

fn closed_err() -> PyErr {
    PyValueError::new_err("this observer is closed")
}

impl PyObserver {
    fn lock(&self) -> MutexGuard<'_, Option<Arc<Observer>>> {
        self.observer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The observer, shared with whatever else uses it now; `ValueError` once closed.
    fn get(&self) -> PyResult<Arc<Observer>> {
        self.lock().clone().ok_or_else(closed_err)
    }

    fn with<T>(&self, f: impl FnOnce(&Observer) -> PyResult<T>) -> PyResult<T> {
        f(self.get()?.as_ref())
    }

    /// Runs `attempt` (one native try of at most a slice, without the GIL) until it
    /// gives a value, `timeout` passes (None: never), a signal arrives, or `close()`
    /// (another thread) closes the observer: `ValueError`.
    fn sliced<T: Send>(
        &self,
        py: Python<'_>,
        timeout: Option<Seconds>,
        what: &'static str,
        attempt: impl FnMut(Duration) -> Result<T, Error> + Send,
    ) -> PyResult<T> {
        sliced(py, timeout, what, attempt, || self.lock().is_none())
    }
}

/// Runs `attempt` (one native try of at most a slice, without the GIL) until it gives a
/// value, `timeout` passes (None: never), a signal arrives or `closed()` says so.
fn sliced<T: Send>(
    py: Python<'_>,
    timeout: Option<Seconds>,
    what: &'static str,
    mut attempt: impl FnMut(Duration) -> Result<T, Error> + Send,
    closed: impl Fn() -> bool,
) -> PyResult<T> {
    let limit = timeout.map(|t| duration(t, "timeout")).transpose()?;
    let deadline = limit.and_then(|t| Instant::now().checked_add(t));
    loop {
        if closed() {
            return Err(closed_err());
        }
        let slice = next_slice(deadline);
        match py.detach(|| attempt(slice)) {
            Ok(v) => return Ok(v),
            Err(Error::Timeout { .. }) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    let waited = limit.unwrap_or(Duration::MAX);
                    return Err(to_pyerr(py, Error::Timeout { waited, what }));
                }
                py.check_signals()?;
            }
            Err(e) => return Err(to_pyerr(py, e)),
        }
    }
}

#[pymethods]
impl PyObserver {
    /// Observes region `name`: opens it read-only and waits up to `timeout` seconds for
    /// frame 0. `NotFoundError` at once when no region has the name.
    #[staticmethod]
    #[pyo3(signature = (name, timeout=Seconds(10.0)))]
    fn attach(py: Python<'_>, name: String, timeout: Seconds) -> PyResult<Self> {
        let timeout = duration(timeout, "timeout")?;
        let observer = py.detach(|| Observer::attach(&name, timeout)).py_err(py)?;
        Ok(PyObserver {
            observer: Mutex::new(Some(Arc::new(observer))),
        })
    }

    #[getter]
    fn name(&self) -> PyResult<String> {
        self.with(|o| Ok(o.name().to_string()))
    }

    #[getter]
    fn num_envs(&self) -> PyResult<u32> {
        self.with(|o| Ok(o.layout().num_envs))
    }

    #[getter]
    fn engine_kind(&self) -> PyResult<String> {
        self.with(|o| Ok(o.layout().engine_kind.clone()))
    }

    #[getter]
    fn engine_pid(&self) -> PyResult<u32> {
        self.with(|o| Ok(o.layout().engine_pid))
    }

    /// `(start, end)` of each shard's envs.
    #[getter]
    fn shards(&self) -> PyResult<Vec<(u32, u32)>> {
        self.with(|o| {
            Ok(o.layout()
                .shards
                .iter()
                .map(|s| (s.envs().start, s.envs().end))
                .collect())
        })
    }

    /// Every tensor of the region: `{"name", "dtype", "shape", "direction", "location"}`.
    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.with(|o| {
            let out = PyList::empty(py);
            for t in &o.layout().tensors {
                let d = PyDict::new(py);
                d.set_item("name", &t.name)?;
                d.set_item("dtype", array_dtype_name(t.dtype))?;
                d.set_item("shape", t.shape.clone())?;
                d.set_item("direction", t.direction.arrow())?;
                d.set_item("location", t.location().name())?;
                out.append(d)?;
            }
            Ok(out)
        })
    }

    /// The frame the engine published last.
    fn frame(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(|o| o.frame().py_err(py))
    }

    /// Raises what ended the engine (`EngineClosedError`, `EngineDiedError`,
    /// `RegionTooSmallError`, a shard's error); `None` while it serves.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.with(|o| o.check().py_err(py))
    }

    /// Copies rows `env_start..env_end` (None: every env) of each tensor in `names` while
    /// no engine writes, trying again until `timeout` seconds pass (None: no limit);
    /// returns `(frame, [bytearray, ...])`.
    #[pyo3(signature = (names, env_start=None, env_end=None, timeout=Some(Seconds(1.0))))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        names: Vec<String>,
        env_start: Option<Count<u32>>,
        env_end: Option<Count<u32>>,
        timeout: Option<Seconds>,
    ) -> PyResult<(u64, Vec<Bound<'py, PyByteArray>>)> {
        let o = self.get()?;
        let n = o.layout().num_envs;
        let envs = env_start.map_or(0, |c| c.0)..env_end.map_or(n, |c| c.0);
        let picks: Vec<Pick> = names
            .iter()
            .map(|name| o.pick(name, envs.clone()))
            .collect::<Result<_, _>>()
            .py_err(py)?;
        // The copies land in the bytearrays returned, not in a buffer copied again
        // (`MemoryError` from Python's allocator for a size it cannot hold).
        let arrays: Vec<Bound<'py, PyByteArray>> = picks
            .iter()
            .map(|p| PyByteArray::new_with(py, o.pick_len(p), |_| Ok(())))
            .collect::<PyResult<_>>()?;
        // SAFETY: the bytearrays were made here and no other reference to them exists
        // until they are returned, so no Python code (another thread's included) can
        // resize, free or read them while the copy writes into their buffers.
        let mut out: Vec<&mut [u8]> = arrays.iter().map(|a| unsafe { a.as_bytes_mut() }).collect();
        let frame = self.sliced(
            py,
            timeout,
            "a frame between the engine's writes",
            |slice| o.read(&picks, &mut out, slice),
        )?;
        Ok((frame, arrays))
    }

    /// The stats area, summed over shards: `{"frame", "episodes", "return_sum",
    /// "length_sum", "recent": [(shard, number, env, return, length), ...]}`.
    #[pyo3(signature = (timeout=Some(Seconds(1.0))))]
    fn stats<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<Seconds>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let o = self.get()?;
        let s = self.sliced(
            py,
            timeout,
            "the stats area between the engine's writes",
            |slice| o.stats(slice),
        )?;
        let d = PyDict::new(py);
        d.set_item("frame", s.frame)?;
        d.set_item("episodes", s.episodes)?;
        d.set_item("return_sum", s.return_sum)?;
        d.set_item("length_sum", s.length_sum)?;
        let recent: Vec<(u32, u64, u32, f64, u32)> = s
            .recent
            .iter()
            .map(|e| (e.shard, e.number, e.env, e.episode_return, e.length))
            .collect();
        d.set_item("recent", recent)?;
        Ok(d)
    }

    /// Closes the region's descriptor (once no read of another thread is under way:
    /// such a read ends with `ValueError` at its next slice); later calls raise
    /// `ValueError`. Returns at once.
    fn close(&self) {
        let taken = self.lock().take();
        drop(taken);
    }

    #[getter]
    fn closed(&self) -> bool {
        self.lock().is_none()
    }
}
