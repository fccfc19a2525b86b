//! Numbers from Python, strictly: Python's `True == 1`, so a plain `u32` or `f64`
//! parameter would take `num_envs=True` as one env and `timeout=True` as one second. These
//! wrappers refuse a bool (and, as PyO3 does for ints, a float where an int is meant) with
//! `TypeError`; PyO3 prefixes the message with the argument's name.

use pyo3::exceptions::PyTypeError;
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
/// `__index__` (a NumPy integer), not a bool, a float or a string.
#[derive(Clone, Copy)]
pub(super) struct Count<T>(pub T);

impl<'a, 'py, T> FromPyObject<'a, 'py> for Count<T>
where
    T: FromPyObject<'a, 'py>,
{
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        refuse_bool(&obj, "an int")?;
        obj.extract::<T>().map(Count).map_err(Into::into)
    }
}

/// The values of a list of [`Count`]s.
pub(super) fn counts<T>(list: Vec<Count<T>>) -> Vec<T> {
    list.into_iter().map(|c| c.0).collect()
}
