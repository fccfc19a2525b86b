//! Waiting from Python: waits are cut into slices so that Ctrl-C is noticed, and the
//! timeouts and wait policies of the Python API are checked here.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::args::Seconds;
use crate::client::Interrupt;
use crate::error::Error;
use crate::WaitPolicy;

/// How long one native wait lasts before the GIL is taken back to check for signals
/// (Ctrl-C): the latency of `KeyboardInterrupt` during a long `step()`.
pub(super) const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// The next native wait: [`SIGNAL_SLICE`], or less when `deadline` comes sooner.
pub(super) fn next_slice(deadline: Option<Instant>) -> Duration {
    match deadline {
        Some(d) => d
            .saturating_duration_since(Instant::now())
            .min(SIGNAL_SLICE),
        None => SIGNAL_SLICE,
    }
}

/// `blocking`: never spin; else spin `spin_us` microseconds (default budget if None).
pub(super) fn wait_policy(spin_us: Option<Seconds>, blocking: bool) -> PyResult<WaitPolicy> {
    Ok(if blocking {
        WaitPolicy::BLOCKING
    } else if let Some(Seconds(us)) = spin_us {
        WaitPolicy::spinning(duration(Seconds(us / 1e6), "spin_us")?)
    } else {
        WaitPolicy::default()
    })
}

/// `seconds` as a Duration: `ValueError` if negative or NaN; past what a Duration holds
/// (inf), no limit.
pub(super) fn duration(Seconds(seconds): Seconds, what: &str) -> PyResult<Duration> {
    if seconds.is_nan() || seconds < 0.0 {
        return Err(PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, got {seconds}"
        )));
    }
    Ok(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX))
}

/// An interrupt hook for the core's waits ([`crate::client::Interrupt`]) that checks for
/// Python signals: the exception a signal handler raised (KeyboardInterrupt) stops the
/// wait with `Error::Interrupted` and is kept here, to be raised once the GIL is back.
#[derive(Default)]
pub(super) struct SignalCheck {
    raised: Arc<Mutex<Option<PyErr>>>,
}

impl SignalCheck {
    pub(super) fn hook(&self) -> Interrupt {
        let store = Arc::clone(&self.raised);
        Arc::new(move || {
            Python::attach(|py| py.check_signals()).map_err(|e| {
                *store.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                Error::Interrupted
            })
        })
    }

    /// The exception a signal handler raised, if one did.
    pub(super) fn take(&self) -> Option<PyErr> {
        self.raised.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}
