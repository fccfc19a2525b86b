//! Numbers from Python, strictly: Python's `True == 1`, so a plain `u32` or `f64`
//! parameter would take `num_envs=True` as one env and `timeout=True` as one second. These
//! wrappers refuse a bool (and, as PyO3 does for ints, a float where an int is meant) with
//! `TypeError`.

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBool;
use pyo3::Borrowed;

fn refuse_bool(obj: &Borrowed<'_, '_, PyAny>, expected: &str) -> PyResult<()> {
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "expected {expected}, not a bool"
        )));
    }
    Ok(())
}

/// A number of seconds: an int or a float (a NumPy scalar too), not a bool or a string.
/// Range checks (not negative, not NaN) happen where it becomes a `Duration`.
#[derive(Clone, Copy)]
pub(super) struct Seconds(pub f64);

impl<'a, 'py> FromPyObject<'a, 'py> for Seconds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        refuse_bool(&obj, "a number")?;
        obj.extract::<f64>().map(Seconds).map_err(|_| {
            let kind = obj
                .get_type()
                .name()
                .map_or_else(|_| "?".to_string(), |n| n.to_string());
            PyTypeError::new_err(format!("expected a number, not {kind}"))
        })
    }
}

/// A non-negative integer of type `T` (`u32`, `u64`): an int or anything with
/// `__index__` (a NumPy integer), not a bool, a float or a string (`TypeError`). An int
/// out of `T`'s range is a `ValueError` that names the value and the bound, as `launch()`'s
/// checks do, rather than PyO3's bare "out of range integral type conversion".
#[derive(Clone, Copy)]
pub(super) struct Count<T>(pub T);

/// The integer types a [`Count`] holds, with their largest value for the range error.
pub(super) trait CountType {
    const MAX: u64;
}

impl CountType for u32 {
    const MAX: u64 = u32::MAX as u64;
}

impl CountType for u64 {
    const MAX: u64 = u64::MAX;
}

impl<'a, 'py, T> FromPyObject<'a, 'py> for Count<T>
where
    T: FromPyObject<'a, 'py> + CountType,
    PyErr: From<T::Error>,
{
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        refuse_bool(&obj, "an int")?;
        let err = match obj.extract::<T>() {
            Ok(v) => return Ok(Count(v)),
            Err(e) => PyErr::from(e),
        };
        // Only an int that does not fit is a range error; anything else keeps its TypeError.
        if !err.is_instance_of::<PyOverflowError>(obj.py()) {
            return Err(err);
        }
        let shown = obj
            .str()
            .map_or_else(|_| "?".to_string(), |s| s.to_string());
        Err(match obj.lt(0) {
            Ok(true) => PyValueError::new_err(format!("expected a non-negative int, got {shown}")),
            _ => PyValueError::new_err(format!("{shown} is too large: at most {}", T::MAX)),
        })
    }
}

/// The values of a list of [`Count`]s.
pub(super) fn counts<T>(list: Vec<Count<T>>) -> Vec<T> {
    list.into_iter().map(|c| c.0).collect()
}
