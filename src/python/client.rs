//! `shmbridge.Client`: a [`Client`] behind a mutex, so the Python object can be shared
//! and the GIL released while it waits; its tensors are [`PyTensor`]s made once at
//! attach. Waits are sliced to notice Ctrl-C ([`super::waits`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::actions::{check_rows, copy_actions};
use super::args::{counts, Count, Seconds};
use super::errors::{to_pyerr, IntoPy};
use super::streams::{on_stream, order_after_engine, step_on, ConsumerStreams};
use super::tensor::{client_place, no_such_tensor, tensor_named, PyTensor};
use super::waits::{duration, next_slice, wait_policy, SignalCheck, SIGNAL_SLICE};
use crate::actions::array_dtype_name;
use crate::device::VulkanImporter;
use crate::error::{Error, Peer};
use crate::layout::TensorInfo;
use crate::region;
use crate::{AttachOptions, Client};

/// How long a host step spins on the engine's frame with the GIL held before it
/// releases the GIL to wait: a fast engine's frame comes within it (a round trip is
/// about a microsecond), and another Python thread is kept out for about as long (not at
/// all where a thread of this process serves the engine: `Client::step_spinning`).
const GIL_HELD_SPIN: Duration = Duration::from_micros(10);

/// The mutable part of a client, behind a mutex so the Python object can be shared and
/// the GIL released while it waits.
struct Core {
    client: Option<Client>,
    /// An action was posted whose frame has not been received (a timeout or Ctrl-C
    /// interrupted the wait): the next step first waits for that frame.
    pending: bool,
    /// The batch size of the last `async_reset` (asynchronous batches).
    batch_size: Option<usize>,
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
    /// `(start, end)` of each shard's envs.
    shard_envs: Vec<(u32, u32)>,
    /// `"cpu"`, or `"cuda:N"` when the engine's tensors live on a CUDA device.
    device: String,
    /// The Vulkan importer's choice and reason, when the engine has Vulkan tensors.
    importer: Option<String>,
    /// How steps and commands pick their CUDA stream (none for a host client).
    streams: ConsumerStreams,
    tensors: Vec<Py<PyTensor>>,
    actions_index: Option<usize>,
    step_outputs: Option<Py<PyTuple>>,
    /// Called once after close (launch() uses it to wait for its engine).
    on_close: Mutex<Option<Py<PyAny>>>,
    /// The engine process `launch()` started, if any.
    engine_process: Mutex<Option<Py<PyAny>>>,
    /// The process that attached: in a child forked from it, `close()` and the drop
    /// leave the session (and a launched engine) to the parent.
    pid: u32,
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

    /// What `step` returns: the step's output tensors, or None.
    fn outputs(&self, py: Python<'_>) -> Py<PyAny> {
        match &self.step_outputs {
            Some(t) => t.clone_ref(py).into_any(),
            None => py.None(),
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
        let signals = SignalCheck::default();
        client.set_interrupt(Some(signals.hook()));
        let out = py.detach(|| call(&mut *client));
        client.set_interrupt(None);
        match out {
            Err(Error::Interrupted) => Err(signals
                .take()
                .unwrap_or_else(|| to_pyerr(py, Error::Interrupted))),
            other => other.map_err(|e| to_pyerr(py, e)),
        }
    }

    /// `(start, end)` of the envs of each of `shards`.
    fn spans_of(&self, shards: &[u32]) -> Vec<(u32, u32)> {
        shards
            .iter()
            .map(|&k| self.shard_envs[k as usize])
            .collect()
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

/// `seed` as `reset` takes it: none, one int, or one per env.
fn seeds_of(py: Python<'_>, seed: Option<Bound<'_, PyAny>>) -> PyResult<Vec<u64>> {
    Ok(match seed.filter(|s| !s.is_none()) {
        None => Vec::new(),
        Some(s) => match s.extract::<Count<u64>>() {
            Ok(one) => vec![one.0],
            // An int out of range: its own message, not "must be a list".
            Err(e) if e.is_instance_of::<PyValueError>(py) => return Err(e),
            Err(_) => s
                .extract::<Vec<Count<u64>>>()
                .map(counts)
                .map_err(|e| match e.is_instance_of::<PyValueError>(py) {
                    true => e,
                    false => PyTypeError::new_err(
                        "seed must be None, a non-negative int, or a list of them",
                    ),
                })?,
        },
    })
}

pub(super) fn closed_err(py: Python<'_>) -> PyErr {
    to_pyerr(py, Error::Closed(Peer::Client))
}

#[pymethods]
impl PyClient {
    /// Attaches to the engine's region `name` (as printed by `shmbridge engine`).
    #[staticmethod]
    #[pyo3(signature = (name, timeout=Seconds(10.0), spin_us=None, blocking=false, importer="auto"))]
    fn attach(
        py: Python<'_>,
        name: &str,
        timeout: Seconds,
        spin_us: Option<Seconds>,
        blocking: bool,
        importer: &str,
    ) -> PyResult<PyClient> {
        let timeout = duration(timeout, "timeout")?;
        let policy = wait_policy(spin_us, blocking)?;
        let importer = VulkanImporter::parse(importer).py_err(py)?;
        // Ctrl-C while the engine has not published (its header, or frame 0) ends the
        // attach with the KeyboardInterrupt, as it ends a step.
        let signals = SignalCheck::default();
        let options = AttachOptions::default()
            .timeout(timeout)
            .policy(policy)
            .importer(importer)
            .interrupt(Some(signals.hook()));
        let name = name.to_string();
        let attached = py.detach(|| -> Result<_, Error> {
            let mut client = Client::attach(&name, options)?;
            // Later waits install their own hook (`command`) or check between slices.
            client.set_interrupt(None);
            let region = Arc::new(client.map_again()?);
            Ok((client, region))
        });
        let (client, region) = match attached {
            Err(Error::Interrupted) => {
                return Err(signals
                    .take()
                    .unwrap_or_else(|| to_pyerr(py, Error::Interrupted)))
            }
            other => other.py_err(py)?,
        };
        let layout = client.layout().clone();
        let importer = client.backend().importer_reason().map(str::to_string);
        let place = |i: usize, info: &TensorInfo| client_place(&client, i, info);
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
                batch_size: None,
            }),
            closing: AtomicBool::new(false),
            name: layout_name(&name),
            num_envs: layout.num_envs as usize,
            engine_kind: layout.engine_kind.clone(),
            engine_pid: layout.engine_pid,
            shard_envs: layout
                .shards
                .iter()
                .map(|s| (s.envs().start, s.envs().end))
                .collect(),
            device,
            importer,
            streams: ConsumerStreams::new(cuda_ordinal),
            actions_index: find("actions"),
            tensors,
            step_outputs,
            on_close: Mutex::new(None),
            engine_process: Mutex::new(None),
            pid: crate::os::current_pid(),
        })
    }

    /// Sends one action and waits for the engine's frame; returns
    /// `(obs, rewards, terminated, truncated)`, the same tensor objects every time.
    ///
    /// CUDA engines: the step is ordered on `stream` (see `ConsumerStreams::consumer_stream`; default
    /// torch's current stream). CUDA `actions` are copied device-to-device on it, the
    /// client's event is recorded on it before the action is sent (the engine's kernels
    /// wait for it), and once the frame arrived it waits on the engine's event, so work
    /// queued on it afterwards reads the new frame without a host synchronisation.
    #[pyo3(signature = (actions=None, timeout=None, stream=None))]
    fn step<'py>(
        &self,
        py: Python<'py>,
        actions: Option<Bound<'py, PyAny>>,
        timeout: Option<Seconds>,
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
        let cuda_stream = self.streams.consumer_stream(py, stream.as_ref())?;
        if let Some(a) = &actions {
            let client = core.client.as_ref().ok_or_else(|| closed_err(py))?;
            // Refused (an asynchronous client) before the actions are written.
            client.check_can_step().map_err(|e| to_pyerr(py, e))?;
            let index = self
                .actions_index
                .ok_or_else(|| no_such_tensor(py, &self.tensors, "actions"))?;
            copy_actions(py, client, self.tensors[index].get(), a, cuda_stream)?;
        }
        let client = core.client.as_mut().ok_or_else(|| closed_err(py))?;
        if cuda_stream.is_none() && client.steps_on_host() {
            // A host step keeps the GIL while a fast engine answers (releasing and taking
            // it back costs about as much as the rest of the step); a slower one is waited
            // for without it, in slices, as below.
            let spin = match deadline {
                Some(d) => d
                    .saturating_duration_since(Instant::now())
                    .min(GIL_HELD_SPIN),
                None => GIL_HELD_SPIN,
            };
            match client.step_spinning(spin) {
                Ok(Some(_)) => {}
                Ok(None) => {
                    core.pending = true;
                    self.wait_frame_sliced(py, &mut core, deadline, limit)?;
                }
                Err(e) => return Err(to_pyerr(py, e)),
            }
            drop(core);
            return Ok(self.outputs(py));
        }
        // The device work the action waits on (a CUDA consumer stream of a Vulkan engine
        // with a semaphore) drains in slices, with Ctrl-C and close() looked at between
        // them; only then is the action posted, once. `NotPosted` (the deadline passed
        // first): nothing is in flight.
        let mut raised: Option<PyErr> = None;
        let closing = &self.closing;
        let between = || {
            if closing.load(Ordering::Acquire) {
                return Err(Error::Closed(Peer::Client));
            }
            Python::attach(|py| py.check_signals()).map_err(|e| {
                raised = Some(e);
                Error::Interrupted
            })
        };
        let stepped = py.detach(|| step_on(client, cuda_stream, deadline, SIGNAL_SLICE, between));
        match stepped {
            Ok(_) => {}
            Err(Error::Interrupted) => {
                return Err(raised.unwrap_or_else(|| to_pyerr(py, Error::Interrupted)))
            }
            Err(Error::NotPosted { what, .. }) => {
                return Err(to_pyerr(
                    py,
                    Error::NotPosted {
                        waited: limit,
                        what,
                    },
                ))
            }
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
        Ok(self.outputs(py))
    }

    /// Resets envs over the command channel: all of them, or `env_ids`. `seed`: none, an
    /// int (env k of the list gets `seed + k`, as in Gymnasium), or one int per env. When
    /// it returns, `obs` holds the reset observations. Returns the frame number, which a
    /// reset does not change.
    /// CUDA engines: `stream` (default torch's current one) then waits on the engine's
    /// event, so work queued on it sees the reset observations.
    #[pyo3(signature = (seed=None, env_ids=None, timeout=Seconds(10.0), stream=None))]
    fn reset(
        &self,
        py: Python<'_>,
        seed: Option<Bound<'_, PyAny>>,
        env_ids: Option<Vec<Count<u32>>>,
        timeout: Seconds,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let seeds = seeds_of(py, seed)?;
        let env_ids = env_ids.map(counts);
        let timeout = duration(timeout, "timeout")?;
        let cuda_stream = self.streams.consumer_stream(py, stream.as_ref())?;
        let frame = self.command(py, timeout, |client| {
            on_stream(client, cuda_stream, |c| {
                c.reset(env_ids.as_deref(), &seeds, timeout)
            })
        })?;
        Ok(frame)
    }

    /// Starts asynchronous batches (docs/async.md): resets every env (``seed`` as for
    /// ``reset``) and makes every shard ready; then ``recv()`` hands out ``batch_size``
    /// envs at a time (whole shards: a multiple of the shard size). ``batch_size``:
    /// default the last one given (``launch(batch_size=...)`` gives one). From here on
    /// ``step()`` raises ``OutOfOrderError``.
    #[pyo3(signature = (batch_size=None, seed=None, timeout=Seconds(10.0)))]
    fn async_reset(
        &self,
        py: Python<'_>,
        batch_size: Option<Count<u32>>,
        seed: Option<Bound<'_, PyAny>>,
        timeout: Seconds,
    ) -> PyResult<()> {
        let seeds = seeds_of(py, seed)?;
        let timeout = duration(timeout, "timeout")?;
        let size = match batch_size {
            Some(b) => b.0 as usize,
            None => self.lock()?.batch_size.ok_or_else(|| {
                PyValueError::new_err("async_reset() needs a batch_size (none was given before)")
            })?,
        };
        self.command(py, timeout, |client| {
            client.async_reset(size, &seeds, timeout)
        })?;
        self.lock()?.batch_size = Some(size);
        Ok(())
    }

    /// Waits (``timeout`` seconds, default forever; Ctrl-C interrupts) until
    /// ``batch_size`` envs have frames; returns a ``shmbridge.Batch``: ``obs, rewards,
    /// terminated, truncated, env_ids = client.recv()``, each shard's rows read in
    /// place (``batch.views(name)``: zero-copy numpy views into the region, one per
    /// shard).
    #[pyo3(signature = (timeout=None))]
    fn recv(slf: &Bound<'_, Self>, timeout: Option<Seconds>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let limit = match timeout {
            Some(t) => Some(duration(t, "timeout")?),
            None => None,
        };
        let deadline = limit.and_then(|t| Instant::now().checked_add(t));
        let (env_ids, spans) = {
            let mut core = this.lock()?;
            let client = core.client.as_mut().ok_or_else(|| closed_err(py))?;
            loop {
                let slice = next_slice(deadline);
                match py.detach(|| client.recv(slice).map(<[u32]>::to_vec)) {
                    Ok(ids) => break (ids, this.spans_of(client.batch_shards())),
                    Err(Error::Timeout { .. }) => {
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            return Err(to_pyerr(
                                py,
                                Error::Timeout {
                                    waited: limit.unwrap_or(Duration::MAX),
                                    what: "the frames of a batch",
                                },
                            ));
                        }
                        if this.closing.load(Ordering::Acquire) {
                            return Err(closed_err(py));
                        }
                        py.check_signals()?;
                    }
                    Err(e) => return Err(to_pyerr(py, e)),
                }
            }
        };
        let batch = py.import("shmbridge._batch")?.getattr("Batch")?;
        Ok(batch.call1((slf, env_ids, spans))?.unbind())
    }

    /// Writes ``actions`` (one row per env of ``env_ids``, in that order) into those
    /// rows of the actions tensor and posts them: the envs of whole shards handed out by
    /// ``recv()`` and not sent yet, each once (``env_ids`` default: the last ``recv``'s).
    /// ``actions=None``: the rows were written already. ``actions`` is checked as
    /// ``step``'s are: the action tensor's dtype (``TypeError``), shape
    /// ``(len(env_ids), ...)`` (``ValueError``), no cast or broadcast. ``OutOfOrderError``
    /// for an env not received, sent already, listed twice, or a shard listed in part.
    /// On any error nothing is written nor posted.
    #[pyo3(signature = (actions=None, env_ids=None))]
    fn send(
        &self,
        py: Python<'_>,
        actions: Option<Bound<'_, PyAny>>,
        env_ids: Option<Vec<Count<u32>>>,
    ) -> PyResult<()> {
        let mut core = self.lock()?;
        let client = core.client.as_mut().ok_or_else(|| closed_err(py))?;
        let ids: Vec<u32> = match env_ids {
            Some(ids) => counts(ids),
            None => client
                .batch_shards()
                .iter()
                .flat_map(|&k| client.shards()[k as usize].envs())
                .collect(),
        };
        if let Some(a) = actions.filter(|a| !a.is_none()) {
            // The rows of a shard still stepping are the engine's: validate before writing.
            client.check_send(&ids).map_err(|e| to_pyerr(py, e))?;
            let index = self
                .actions_index
                .ok_or_else(|| no_such_tensor(py, &self.tensors, "actions"))?;
            // The checks of `step` (dtype, shape, device): no silent cast or broadcast.
            check_rows(py, self.tensors[index].get(), &a, ids.len())?;
            let view = py
                .import("numpy")?
                .call_method1("asarray", (self.tensors[index].bind(py),))?;
            view.set_item(ids.clone(), a)?;
        }
        client.send(&ids).map_err(|e| to_pyerr(py, e))
    }

    /// The shards of the last ``recv()``, in the order of its env ids.
    #[getter]
    fn batch_shards(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let core = self.lock()?;
        let client = core.client.as_ref().ok_or_else(|| closed_err(py))?;
        Ok(client.batch_shards().to_vec())
    }

    /// Calls an engine-defined method. Keyword arguments travel as text (`str(value)`);
    /// `payload` as raw bytes. Returns the reply's arguments as a dict of str, with the
    /// reply's payload under `"payload"` when it has one. A sharded engine: shard 0
    /// answers, or shard `shard` (an int); `shard="all"` calls every shard at once and
    /// returns the list of their replies, in shard order.
    #[pyo3(signature = (method, *, payload=None, timeout=Seconds(10.0), shard=None, **kwargs))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        payload: Option<Vec<u8>>,
        timeout: Seconds,
        shard: Option<Bound<'py, PyAny>>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let target = match shard.filter(|s| !s.is_none()) {
            None => Some(0u32),
            Some(s) if s.extract::<String>().is_ok_and(|t| t == "all") => None,
            Some(s) => Some(s.extract::<Count<u32>>().map(|c| c.0).map_err(|e| {
                // An int out of range keeps its own message.
                if e.is_instance_of::<PyValueError>(py) {
                    return e;
                }
                PyTypeError::new_err("shard must be None, a shard index, or \"all\"")
            })?),
        };
        let mut args: Vec<(String, String)> = Vec::new();
        if let Some(kw) = kwargs {
            for (k, v) in kw.iter() {
                args.push((k.extract::<String>()?, v.str()?.extract::<String>()?));
            }
        }
        let payload = payload.unwrap_or_default();
        let timeout = duration(timeout, "timeout")?;
        // CUDA: an engine-defined method may write device tensors; ordered like a reset.
        let cuda_stream = self.streams.consumer_stream(py, None)?;
        let replies = self.command(py, timeout, |client| {
            let args: Vec<(&str, &str)> =
                args.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            on_stream(client, cuda_stream, |c| match target {
                Some(k) => c
                    .call_method_on(k, method, &args, &payload, timeout)
                    .map(|r| vec![r]),
                None => c.call_method_all(method, &args, &payload, timeout),
            })
        })?;
        let dicts = replies
            .into_iter()
            .map(|reply| {
                let out = PyDict::new(py);
                for (k, v) in reply.args {
                    out.set_item(k, v)?;
                }
                if !reply.payload.is_empty() {
                    out.set_item("payload", pyo3::types::PyBytes::new(py, &reply.payload))?;
                }
                Ok(out)
            })
            .collect::<PyResult<Vec<_>>>()?;
        match target {
            Some(_) => Ok(dicts.into_iter().next().expect("one reply").into_any()),
            None => Ok(pyo3::types::PyList::new(py, dicts)?.into_any()),
        }
    }

    /// The engine processes serving the region, as the `(start, end)` env range of each
    /// (one range, every env, for an unsharded engine).
    #[getter]
    fn shards(&self) -> Vec<(u32, u32)> {
        self.shard_envs.clone()
    }

    /// The pid of the process serving each shard, in shard order.
    #[getter]
    fn shard_pids(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let core = self.lock()?;
        let client = core.client.as_ref().ok_or_else(|| closed_err(py))?;
        client.shard_pids().py_err(py)
    }

    /// The engine's schema over the command channel: `num_envs`, `engine_kind`, the
    /// tensors (name, dtype, shape, direction, location) in table order, and the
    /// engine's metadata (observation bounds, action space, autoreset mode, ...).
    #[pyo3(signature = (timeout=Seconds(10.0)))]
    fn schema<'py>(&self, py: Python<'py>, timeout: Seconds) -> PyResult<Bound<'py, PyDict>> {
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
            d.set_item("dtype", array_dtype_name(t.dtype))?;
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
    #[pyo3(signature = (payload=None, timeout=Seconds(10.0)))]
    fn ping<'py>(
        &self,
        py: Python<'py>,
        payload: Option<Vec<u8>>,
        timeout: Seconds,
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
        if crate::os::current_pid() != self.pid {
            // A forked child: the launched engine is its parent's to stop and wait for.
            return Ok(());
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

    /// Which importer serves the engine's Vulkan tensors, and why; `None` when it has
    /// none.
    #[getter]
    fn importer(&self) -> Option<&str> {
        self.importer.as_deref()
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

    /// Number of the frame the tensors hold (0 after attach). After ``async_reset()``
    /// the shards stand at frames of their own: this keeps the last lock-step number.
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
