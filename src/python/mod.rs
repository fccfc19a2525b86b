//! The Python extension module `shmbridge._native` (feature `python`): a thin PyO3 layer
//! over [`crate::Client`], [`crate::Engine`] and the command line ([`crate::cli`]), which
//! also serves the reference engines: the wheel needs no separate binary.
//!
//! - [`client`]: `Client`, a [`crate::Client`] plus a second read-write mapping of the
//!   same region, shared through an `Arc` with every DLPack capsule handed out, so a
//!   view of a tensor stays valid after `close()`.
//! - [`tensor`]: `Tensor`, one tensor of the region, with `__dlpack__` and `__array__`.
//! - [`actions`]: `step(actions)`; DLPack arrays become plain descriptions for the core's
//!   checks and copy ([`crate::actions`]).
//! - [`stream`]: trajectory streams (`shmbridge.stream`): consumer, producer, record,
//!   reservation, and the mapping their NumPy views slice.
//! - [`streams`]: CUDA stream arguments and the ordering of CUDA steps on them.
//! - [`engine`]: `Engine` and `EngineSpec`, a simulator written in Python.
//! - [`observer`]: `RawObserver`, a read-only observer of a live region (1.7), under
//!   `shmbridge.observe()`.
//! - [`errors`]: crate errors as the exceptions of `shmbridge.errors`.
//! - [`waits`]: sliced waits (Ctrl-C) and the timeouts of the Python API.
//! - [`args`]: counts and seconds taken strictly (a bool is neither).
//! - [`tools`]: `cli` (the `shmbridge` command line), `list_regions`, `gc`,
//!   `cuda_available`, `_cuda_status`.

mod actions;
mod args;
mod client;
mod engine;
mod errors;
mod observer;
mod stream;
mod streams;
mod tensor;
mod tools;
mod waits;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::PyClient>()?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PyEngineSpec>()?;
    m.add_class::<observer::PyObserver>()?;
    m.add_class::<stream::PyStreamMemory>()?;
    m.add_class::<stream::PyStreamConsumer>()?;
    m.add_class::<stream::PyStreamRecord>()?;
    m.add_class::<stream::PyStreamProducer>()?;
    m.add_class::<stream::PyStreamReservation>()?;
    m.add_function(wrap_pyfunction!(stream::stream_stats, m)?)?;
    m.add_function(wrap_pyfunction!(stream::stream_names, m)?)?;
    m.add_function(wrap_pyfunction!(tools::cli, m)?)?;
    m.add_function(wrap_pyfunction!(tools::list_regions, m)?)?;
    m.add_function(wrap_pyfunction!(tools::cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(tools::_cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(tools::gc, m)?)?;
    m.add_function(wrap_pyfunction!(tools::_spawn_engine, m)?)?;
    m.add_function(wrap_pyfunction!(tools::_check_cli_args, m)?)?;
    m.add_function(wrap_pyfunction!(errors::_error_classes, m)?)?;
    m.add_function(wrap_pyfunction!(errors::_raise_timeout, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "PROTOCOL_VERSION",
        (crate::layout::VERSION_MAJOR, crate::layout::VERSION_MINOR),
    )?;
    Ok(())
}
