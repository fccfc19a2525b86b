//! `shmbridge.Engine` and `shmbridge.EngineSpec`: a simulator written in Python serves a
//! region. The engine writes its engine→client tensors through writable views (DLPack or
//! NumPy), waits for actions with `wait_actions()`, publishes each frame with `publish()`
//! and answers `reset` and its own methods through a handler object.
//!
//! The handler is any Python object with (optional) methods
//! `reset(env_ids: list[int] | None, seeds: list[int], options: dict[str, str])` and
//! `call(method: str, args: dict[str, str], payload: bytes)`, the latter returning None,
//! a dict (the reply's arguments, values turned into text), bytes (the payload) or a
//! `(dict, bytes)` pair. What a handler raises goes back to the client as an error reply:
//! `NotImplementedError` as "unsupported", `ValueError`/`TypeError`/`KeyError` as a bad
//! request, anything else as an engine error. `KeyboardInterrupt` and other non-`Exception`
//! errors also end the wait and are raised by it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::args::{counts, Count, Seconds};
use super::errors::{to_pyerr, IntoPy};
use super::tensor::{tensor_named, Place, PyTensor};
use super::waits::{duration, next_slice, wait_policy};
use crate::actions::array_dtype_name;
use crate::command::{CommandError, CommandHandler, Reply, ResetRequest};
use crate::control::ClientState;
use crate::device::CudaSharingRequest;
use crate::engine::{Engine, EngineSpec, JoinOptions};
use crate::error::{Error, Peer};
use crate::layout::{DType, Direction, ShardInfo, TensorSpec};
use crate::region::Region;
use crate::shard::ShardSlot;
use crate::tensor::Tensors;

/// What an engine serves: its kind, number of envs, tensors and metadata.
#[pyclass(module = "shmbridge._native", name = "EngineSpec")]
pub struct PyEngineSpec {
    spec: EngineSpec,
}

/// A dtype given as a NumPy name ("float32"), a NumPy dtype or type, or a torch dtype.
fn parse_dtype(dtype: &Bound<'_, PyAny>) -> PyResult<DType> {
    let name: String = if let Ok(s) = dtype.extract::<String>() {
        s
    } else if let Ok(np_dtype) = dtype
        .py()
        .import("numpy")
        .and_then(|np| np.getattr("dtype")?.call1((dtype,)))
    {
        np_dtype.getattr("name")?.extract()?
    } else {
        // torch.float32 prints as "torch.float32".
        dtype.str()?.extract::<String>()?
    };
    let bare = name.strip_prefix("torch.").unwrap_or(&name);
    DType::ALL
        .into_iter()
        .find(|&d| array_dtype_name(d) == bare || d.name() == bare)
        .ok_or_else(|| {
            let known: Vec<&str> = DType::ALL.into_iter().map(array_dtype_name).collect();
            PyTypeError::new_err(format!(
                "unsupported dtype {name:?}; supported: {}",
                known.join(", ")
            ))
        })
}

fn parse_direction(direction: &str) -> PyResult<Direction> {
    match direction {
        "engine->client" => Ok(Direction::EngineToClient),
        "client->engine" => Ok(Direction::ClientToEngine),
        other => Err(PyValueError::new_err(format!(
            "direction {other:?}: use \"engine->client\" (observations, rewards, images) \
             or \"client->engine\" (actions, masks)"
        ))),
    }
}

#[pymethods]
impl PyEngineSpec {
    /// An engine of `kind` with `num_envs` environments and no tensors yet; add them with
    /// `tensor()` (or start from `EngineSpec.standard()`). `name`: the region name (random
    /// if None). `ring_capacity`: bytes of each command ring (0: no command channel).
    #[new]
    #[pyo3(signature = (kind, num_envs, *, name=None, ring_capacity=None))]
    fn new(
        kind: &str,
        num_envs: Count<u32>,
        name: Option<String>,
        ring_capacity: Option<Count<u64>>,
    ) -> Self {
        let mut spec = EngineSpec::new(kind, num_envs.0);
        spec.name = name;
        if let Some(Count(bytes)) = ring_capacity {
            spec.ring_capacity = bytes;
        }
        PyEngineSpec { spec }
    }

    /// The standard tensors: `obs (N, obs_dim) float32`, `actions (N, act_dim)
    /// act_dtype`, `rewards (N,) float32`, `terminated`/`truncated (N,) bool` and
    /// `reset_mask (N,) bool`: what `Client.step()` and `shmbridge.gym` expect.
    #[staticmethod]
    #[pyo3(signature = (kind, num_envs, obs_dim, act_dim, act_dtype=None, *, name=None))]
    fn standard(
        kind: &str,
        num_envs: Count<u32>,
        obs_dim: Count<u64>,
        act_dim: Count<u64>,
        act_dtype: Option<&Bound<'_, PyAny>>,
        name: Option<String>,
    ) -> PyResult<Self> {
        let act_dtype = match act_dtype {
            Some(d) => parse_dtype(d)?,
            None => DType::F32,
        };
        let mut spec = EngineSpec::standard(kind, num_envs.0, obs_dim.0, act_dim.0, act_dtype);
        spec.name = name;
        Ok(PyEngineSpec { spec })
    }

    /// Declares a tensor; returns the spec, so calls chain. Checked when the engine is
    /// created (names unique, shapes non-empty, sizes bounded).
    #[pyo3(signature = (name, dtype, shape, direction="engine->client"))]
    fn tensor<'py>(
        mut slf: PyRefMut<'py, Self>,
        name: &str,
        dtype: &Bound<'py, PyAny>,
        shape: Vec<Count<u64>>,
        direction: &str,
    ) -> PyResult<PyRefMut<'py, Self>> {
        let dtype = parse_dtype(dtype)?;
        let direction = parse_direction(direction)?;
        slf.spec
            .tensors
            .push(TensorSpec::new(name, dtype, &counts(shape), direction));
        Ok(slf)
    }

    /// Adds a key/value the engine reports in its schema (`Client.schema()["metadata"]`);
    /// returns the spec. `shmbridge.gym` reads `observation_low`/`observation_high`
    /// (comma-separated), `action_space` (`discrete:N`) and `autoreset_mode`.
    fn metadata<'py>(
        mut slf: PyRefMut<'py, Self>,
        key: &str,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<PyRefMut<'py, Self>> {
        let value: String = value.str()?.extract()?;
        slf.spec.metadata.retain(|(k, _)| k != key);
        slf.spec.metadata.push((key.to_string(), value));
        Ok(slf)
    }

    /// Splits the env axis over `count` engine processes (protocol 1.4): the engine made
    /// from this spec creates the region and serves shard 0; the others `Engine.join` it.
    /// Returns the spec.
    fn shards<'py>(mut slf: PyRefMut<'py, Self>, count: u32) -> PyRefMut<'py, Self> {
        slf.spec.shards = count;
        slf
    }

    #[getter]
    fn kind(&self) -> &str {
        &self.spec.kind
    }

    #[getter]
    fn num_envs(&self) -> u32 {
        self.spec.num_envs
    }

    #[getter]
    fn name(&self) -> Option<&str> {
        self.spec.name.as_deref()
    }

    /// The declared tensors as `(name, dtype, shape, direction)` tuples.
    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for t in &self.spec.tensors {
            list.append((
                t.name.as_str(),
                array_dtype_name(t.dtype),
                PyTuple::new(py, &t.shape)?,
                t.direction.arrow(),
            ))?;
        }
        Ok(list)
    }

    fn __repr__(&self) -> String {
        let tensors: Vec<String> = self
            .spec
            .tensors
            .iter()
            .map(|t| format!("{}{:?}:{}", t.name, t.shape, array_dtype_name(t.dtype)))
            .collect();
        format!(
            "<shmbridge.EngineSpec '{}' x{} [{}]>",
            self.spec.kind,
            self.spec.num_envs,
            tensors.join(" ")
        )
    }
}

/// Hands commands to a Python handler object, holding the GIL only while it runs.
struct PyHandler<'a> {
    handler: Option<&'a Py<PyAny>>,
    /// A non-`Exception` error (`KeyboardInterrupt`, `SystemExit`) the handler raised:
    /// the wait stops and raises it.
    raised: Option<PyErr>,
}

impl PyHandler<'_> {
    /// The reply for an exception the handler raised.
    fn refusal(&mut self, py: Python<'_>, method: &str, e: PyErr) -> CommandError {
        let text = format!("{method}: {e}");
        if !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
            self.raised = Some(e);
            return CommandError {
                code: crate::wire::code::ENGINE_ERROR,
                message: format!("{method}: the engine was interrupted"),
            };
        }
        if e.is_instance_of::<PyNotImplementedError>(py) {
            CommandError::unsupported(text)
        } else if e.is_instance_of::<PyValueError>(py)
            || e.is_instance_of::<PyTypeError>(py)
            || e.is_instance_of::<pyo3::exceptions::PyKeyError>(py)
        {
            CommandError::bad_request(text)
        } else {
            CommandError {
                code: crate::wire::code::ENGINE_ERROR,
                message: text,
            }
        }
    }

    fn method<'py>(&self, py: Python<'py>, name: &str) -> Option<Bound<'py, PyAny>> {
        let h = self.handler?.bind(py);
        h.getattr(name).ok().filter(|m| m.is_callable())
    }
}

impl CommandHandler for PyHandler<'_> {
    fn reset(&mut self, _io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        Python::attach(|py| {
            let Some(reset) = self.method(py, "reset") else {
                return Err(CommandError::unsupported(
                    "this engine's handler has no reset()",
                ));
            };
            let options = PyDict::new(py);
            for (k, v) in &req.options {
                options
                    .set_item(k, v)
                    .map_err(|e| self.refusal(py, "reset", e))?;
            }
            let kwargs = PyDict::new(py);
            let set = |k: &str, v: Bound<'_, PyAny>| kwargs.set_item(k, v);
            let env_ids = match &req.env_ids {
                Some(ids) => PyList::new(py, ids).map(|l| l.into_any()),
                None => Ok(py.None().into_bound(py)),
            };
            let filled = env_ids
                .and_then(|ids| set("env_ids", ids))
                .and_then(|_| PyList::new(py, &req.seeds))
                .and_then(|seeds| set("seeds", seeds.into_any()))
                .and_then(|_| set("options", options.into_any()));
            filled
                .and_then(|_| reset.call((), Some(&kwargs)))
                .map(|_| ())
                .map_err(|e| self.refusal(py, "reset", e))
        })
    }

    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        method: &str,
        args: &[(String, String)],
        payload: &[u8],
    ) -> Result<Reply, CommandError> {
        Python::attach(|py| {
            let Some(call) = self.method(py, "call") else {
                return Err(CommandError::unknown_method(method, &[]));
            };
            let result = (|| -> PyResult<Option<Reply>> {
                let kwargs = PyDict::new(py);
                for (k, v) in args {
                    kwargs.set_item(k, v)?;
                }
                let out = call.call1((method, kwargs, PyBytes::new(py, payload)))?;
                if out.is(py.NotImplemented()) {
                    return Ok(None);
                }
                reply_from(&out).map(Some)
            })();
            match result {
                Ok(Some(reply)) => Ok(reply),
                Ok(None) => Err(CommandError::unknown_method(method, &[])),
                Err(e) => Err(self.refusal(py, method, e)),
            }
        })
    }
}

/// A handler's return value as a reply: None, a dict, bytes, or `(dict, bytes)`.
fn reply_from(out: &Bound<'_, PyAny>) -> PyResult<Reply> {
    let mut reply = Reply::default();
    let (args, payload) = if out.is_none() {
        (None, None)
    } else if let Ok(t) = out.cast::<PyTuple>() {
        if t.len() != 2 {
            return Err(PyTypeError::new_err(
                "a handler's tuple reply must be (dict, bytes)",
            ));
        }
        (Some(t.get_item(0)?), Some(t.get_item(1)?))
    } else if out.cast::<PyBytes>().is_ok() {
        (None, Some(out.clone()))
    } else {
        (Some(out.clone()), None)
    };
    if let Some(args) = args {
        let dict = args
            .cast::<PyDict>()
            .map_err(|_| PyTypeError::new_err("a handler's reply arguments must be a dict"))?;
        for (k, v) in dict.iter() {
            reply.args.push((k.str()?.extract()?, v.str()?.extract()?));
        }
    }
    if let Some(payload) = payload {
        reply.payload = payload.extract::<Vec<u8>>()?;
    }
    Ok(reply)
}

/// An engine serving a region from Python.
#[pyclass(module = "shmbridge._native", name = "Engine", frozen)]
pub struct PyEngine {
    engine: Mutex<Option<Engine>>,
    /// The tensors' mapping, also read for the live counters: `frame` and
    /// `client_attached` must not wait for a `wait_actions()` in another thread.
    region: Arc<Region>,
    closed: AtomicBool,
    name: String,
    kind: String,
    num_envs: usize,
    /// The shard served (the whole region unsharded): where its frame counter is.
    shard: ShardInfo,
    tensors: Vec<Py<PyTensor>>,
}

impl PyEngine {
    /// The Python handle of a created or joined engine: a second mapping for the tensor
    /// views (they outlive the engine) and the views of what it serves.
    fn serving(py: Python<'_>, engine: Engine) -> PyResult<Self> {
        let region = Arc::new(engine.map_again().py_err(py)?);
        let layout = engine.layout().clone();
        // An engine written in Python serves host tensors (its EngineSpec has no device).
        let tensors = PyTensor::all(py, &region, &layout, Peer::Engine, |_, _| Ok(Place::Host))?;
        let shard = *engine.shard();
        Ok(PyEngine {
            name: engine.name().to_string(),
            kind: layout.engine_kind.clone(),
            num_envs: layout.num_envs as usize,
            shard,
            engine: Mutex::new(Some(engine)),
            region,
            closed: AtomicBool::new(false),
            tensors,
        })
    }

    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, Option<Engine>>> {
        match self.engine.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
            Err(TryLockError::WouldBlock) => Err(PyRuntimeError::new_err(
                "this engine is busy in another thread (one wait or publish at a time)",
            )),
        }
    }

    /// Runs `wait` (one native wait of at most `slice`, without the GIL) until it ends
    /// otherwise than by that slice's timeout; between slices: the overall deadline
    /// (`timeout`, None: none), `close()` from another thread, and signals (Ctrl-C).
    fn sliced<T>(
        &self,
        py: Python<'_>,
        timeout: Option<Seconds>,
        what: &'static str,
        mut wait: impl FnMut(Python<'_>, &mut Engine, Duration) -> PyResult<Result<T, Error>>,
    ) -> PyResult<T> {
        let limit = timeout.map(|t| duration(t, "timeout")).transpose()?;
        let deadline = limit.and_then(|t| Instant::now().checked_add(t));
        let mut guard = self.lock()?;
        let engine = guard
            .as_mut()
            .ok_or_else(|| to_pyerr(py, Error::Closed(Peer::Engine)))?;
        loop {
            match wait(py, engine, next_slice(deadline))? {
                Ok(v) => return Ok(v),
                Err(Error::Timeout { .. }) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        let waited = limit.unwrap_or(Duration::MAX);
                        return Err(to_pyerr(py, Error::Timeout { waited, what }));
                    }
                    if self.closed.load(Ordering::Acquire) {
                        return Err(to_pyerr(py, Error::Closed(Peer::Engine)));
                    }
                    py.check_signals()?;
                }
                Err(e) => return Err(to_pyerr(py, e)),
            }
        }
    }

    fn with_engine<T>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Engine) -> Result<T, Error>,
    ) -> PyResult<T> {
        let mut guard = self.lock()?;
        let engine = guard
            .as_mut()
            .ok_or_else(|| to_pyerr(py, Error::Closed(Peer::Engine)))?;
        f(engine).py_err(py)
    }
}

#[pymethods]
impl PyEngine {
    /// Creates the region for `spec` (sweeping regions of dead engines first). Tensors
    /// start zeroed: write the reset observations, then `publish()` frame 0; clients can
    /// attach from then on. `spin_us`/`blocking`: how `wait_actions()` waits.
    /// `cuda_sharing`: how CUDA tensors are shared: `"ipc"` (CUDA IPC handles: a learner
    /// in this PID namespace), `"fd"` (file descriptors over the region's socket: a
    /// learner in any container that shares /dev/shm), or `"auto"` (fd when this engine
    /// runs in a container and its GPU can, else ipc).
    #[new]
    #[pyo3(signature = (spec, *, spin_us=None, blocking=false, cuda_sharing="auto"))]
    fn new(
        py: Python<'_>,
        spec: PyRef<'_, PyEngineSpec>,
        spin_us: Option<Seconds>,
        blocking: bool,
        cuda_sharing: &str,
    ) -> PyResult<Self> {
        let sharing = CudaSharingRequest::parse(cuda_sharing).py_err(py)?;
        let spec = spec
            .spec
            .clone()
            .policy(wait_policy(spin_us, blocking)?)
            .cuda_sharing(sharing);
        let engine = py.detach(|| Engine::create(spec)).py_err(py)?;
        PyEngine::serving(py, engine)
    }

    /// Joins the sharded region `name` as shard `shard` (protocol 1.4), waiting up to
    /// `timeout` seconds for its creator to make it: validated as a client validates it,
    /// then served like any engine, over this shard's envs only (`num_envs`, every
    /// tensor and `shard_envs` are the slice's). `metadata`: key/values kept with the
    /// engine (the schema is shard 0's). Raises `AlreadyAttachedError` when a live
    /// process serves that shard.
    #[staticmethod]
    #[pyo3(signature = (name, shard, *, timeout=Seconds(10.0), spin_us=None, blocking=false))]
    fn join(
        py: Python<'_>,
        name: &str,
        shard: Count<u32>,
        timeout: Seconds,
        spin_us: Option<Seconds>,
        blocking: bool,
    ) -> PyResult<Self> {
        let options = JoinOptions {
            timeout: duration(timeout, "timeout")?,
            policy: wait_policy(spin_us, blocking)?,
            metadata: Vec::new(),
        };
        let engine = py
            .detach(|| Engine::join(name, shard.0, options))
            .py_err(py)?;
        PyEngine::serving(py, engine)
    }

    /// Which shard this engine serves (0 for an unsharded one).
    #[getter]
    fn shard(&self) -> u32 {
        self.shard.index
    }

    /// `(start, end)`: the envs of the region this engine steps (all of them unsharded).
    #[getter]
    fn shard_envs(&self) -> (u32, u32) {
        let envs = self.shard.envs();
        (envs.start, envs.end)
    }

    /// Publishes the frame: the engine→client tensors must hold it. The first call
    /// publishes frame 0 (the reset observations); each later one answers the action
    /// `wait_actions()` returned. Returns the frame number.
    fn publish(&self, py: Python<'_>) -> PyResult<u64> {
        self.with_engine(py, |e| e.publish())
    }

    /// Records that env `env` (this engine's numbering) ended an episode of return
    /// `episode_return` after `length` steps, in the region's stats area, where
    /// observers read it (`shmbridge view` plots it). Call it between `wait_actions()`
    /// and `publish()`, as envs finish.
    fn record_episode(
        &self,
        py: Python<'_>,
        env: Count<u64>,
        episode_return: f64,
        length: Count<u64>,
    ) -> PyResult<()> {
        self.with_engine(py, |e| {
            e.record_episode(env.0 as usize, episode_return, length.0)
        })
    }

    /// Waits for the client's next action and returns its number; the action tensors
    /// then hold it. Commands arriving meanwhile are answered (built-ins by the library,
    /// `reset` and custom methods by `handler`, see the module docs). `timeout` None: no
    /// limit. Raises `ClientClosedError` when the client closed, `ClientDiedError` when it
    /// died (once per client: a later call waits for a new client, and its first action),
    /// `TimeoutError` after `timeout`, `KeyboardInterrupt` on Ctrl-C.
    #[pyo3(signature = (timeout=None, handler=None))]
    fn wait_actions(
        &self,
        py: Python<'_>,
        timeout: Option<Seconds>,
        handler: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let mut adapter = PyHandler {
            handler: handler.as_ref(),
            raised: None,
        };
        self.sliced(
            py,
            timeout,
            "the client's next action",
            |py, engine, slice| {
                let got = py.detach(|| engine.wait_actions_with(slice, &mut adapter));
                match adapter.raised.take() {
                    Some(e) => Err(e),
                    None => Ok(got),
                }
            },
        )
    }

    /// Waits until a client is attached (at once if one is), sleeping: the way to serve
    /// one client after another. After `wait_actions` raised `ClientClosedError` or
    /// `ClientDiedError`, call this, then `wait_actions` again (which, meanwhile, waits
    /// for a new client rather than raising again). `timeout` None: no limit; raises
    /// `TimeoutError` after it, `KeyboardInterrupt` on Ctrl-C.
    #[pyo3(signature = (timeout=None))]
    fn wait_for_client(&self, py: Python<'_>, timeout: Option<Seconds>) -> PyResult<()> {
        self.sliced(py, timeout, "a client to attach", |py, engine, slice| {
            Ok(py.detach(|| engine.wait_for_client(slice)))
        })
    }

    /// Answers the commands waiting now, without waiting for an action; returns how
    /// many. For an engine busy with a long step, or before frame 0 is published.
    #[pyo3(signature = (handler=None))]
    fn poll_commands(&self, py: Python<'_>, handler: Option<Py<PyAny>>) -> PyResult<usize> {
        let mut guard = self.lock()?;
        let engine = guard
            .as_mut()
            .ok_or_else(|| to_pyerr(py, Error::Closed(Peer::Engine)))?;
        let mut adapter = PyHandler {
            handler: handler.as_ref(),
            raised: None,
        };
        let answered = engine.poll_commands(&mut adapter);
        if let Some(e) = adapter.raised.take() {
            return Err(e);
        }
        answered.py_err(py)
    }

    /// Closes the region: a waiting client gets `EngineClosedError`, and the name is
    /// removed from /dev/shm. Views of the tensors stay readable.
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Release);
        // Without the GIL: a wait_actions() in another thread holds the lock until its
        // next slice (it sees `closed` there), and needs the GIL to return.
        let engine = py.detach(|| self.engine.lock().unwrap_or_else(|p| p.into_inner()).take());
        if let Some(e) = engine {
            e.close();
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }

    /// The region name clients attach with (`shmbridge.attach(engine.name)`).
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    #[getter]
    fn kind(&self) -> &str {
        &self.kind
    }

    #[getter]
    fn num_envs(&self) -> usize {
        self.num_envs
    }

    /// Number of the last frame this engine (its shard, for a sharded one) published
    /// (read from the region: no waiting).
    #[getter]
    fn frame(&self, py: Python<'_>) -> PyResult<u64> {
        let slot = ShardSlot::new(&self.region, &self.shard).py_err(py)?;
        Ok(slot.frame())
    }

    /// Whether a client is attached now (read from the region: no waiting).
    #[getter]
    fn client_attached(&self) -> bool {
        self.region.control().client_state() == ClientState::Attached
    }

    /// Replies dropped because nobody waited for them (their calls had timed out).
    #[getter]
    fn dropped_replies(&self, py: Python<'_>) -> PyResult<u64> {
        self.with_engine(py, |e| Ok(e.dropped_replies()))
    }

    fn __getitem__(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyTensor>> {
        tensor_named(py, &self.tensors, name)
    }

    fn __contains__(&self, name: &str) -> bool {
        self.tensors.iter().any(|t| t.get().info.name == name)
    }

    #[getter]
    fn tensors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.tensors.iter().map(|t| t.clone_ref(py)))
    }

    #[getter]
    fn obs(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        tensor_named(py, &self.tensors, "obs")
    }
    #[getter]
    fn actions(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        tensor_named(py, &self.tensors, "actions")
    }
    #[getter]
    fn rewards(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        tensor_named(py, &self.tensors, "rewards")
    }
    #[getter]
    fn terminated(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        tensor_named(py, &self.tensors, "terminated")
    }
    #[getter]
    fn truncated(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        tensor_named(py, &self.tensors, "truncated")
    }
    #[getter]
    fn reset_mask(&self, py: Python<'_>) -> PyResult<Py<PyTensor>> {
        tensor_named(py, &self.tensors, "reset_mask")
    }

    fn __repr__(&self) -> String {
        format!(
            "<shmbridge.Engine '{}' {} x{}{}>",
            self.name,
            self.kind,
            self.num_envs,
            if self.closed() { " closed" } else { "" }
        )
    }
}
