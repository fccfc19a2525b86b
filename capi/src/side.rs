//! What the engine's and the client's handles share: a name, the tensor table and host
//! or device addresses of tensors, through one generic body per C function pair
//! (`shmb_engine_tensor` and `shmb_client_tensor` are both [`tensor`]).

use std::ffi::{c_char, c_void, CString};

use shmbridge_core::layout::{Layout, TensorId};
use shmbridge_core::{Client, Engine, Error};

use crate::status::{CResult, Fail};
use crate::types::{c_string, info_of, put, shmb_tensor_info, str_arg};

/// The core object behind a handle: an engine or a client.
pub(crate) trait Side {
    fn layout(&self) -> &Layout;
    fn region_name(&self) -> &str;
    /// Host address of a tensor (the region, or a CPU mapping of device memory).
    fn address(&mut self, id: TensorId) -> Result<*const u8, Error>;
    fn device_ptr(&self, id: TensorId) -> Result<u64, Error>;
}

impl Side for Engine {
    fn layout(&self) -> &Layout {
        Engine::layout(self)
    }
    fn region_name(&self) -> &str {
        self.name()
    }
    fn address(&mut self, id: TensorId) -> Result<*const u8, Error> {
        self.tensors().address(id)
    }
    fn device_ptr(&self, id: TensorId) -> Result<u64, Error> {
        Engine::device_ptr(self, id)
    }
}

impl Side for Client {
    fn layout(&self) -> &Layout {
        Client::layout(self)
    }
    fn region_name(&self) -> &str {
        self.name()
    }
    fn address(&mut self, id: TensorId) -> Result<*const u8, Error> {
        self.tensors().address(id)
    }
    fn device_ptr(&self, id: TensorId) -> Result<u64, Error> {
        Client::device_ptr(self, id)
    }
}

/// A handle's object with the C strings it hands out (valid until it is closed).
pub(crate) struct Named<S> {
    pub side: S,
    name: CString,
    tensor_names: Vec<CString>,
}

impl<S: Side> Named<S> {
    pub(crate) fn new(side: S) -> Self {
        Named {
            name: c_string(side.region_name()),
            tensor_names: side
                .layout()
                .tensors
                .iter()
                .map(|t| c_string(&t.name))
                .collect(),
            side,
        }
    }
}

/// Which tensor: by name, or by index when `name` is NULL.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
pub(crate) unsafe fn key(layout: &Layout, name: *const c_char, index: usize) -> CResult<TensorId> {
    if name.is_null() {
        return layout
            .tensors
            .get(index)
            .and_then(|t| layout.id(&t.name).ok())
            .ok_or_else(|| {
                Fail::from(Error::NoSuchTensor {
                    name: format!("#{index}"),
                    available: layout.tensor_names(),
                })
            });
    }
    // SAFETY: forwarded contract.
    let name = unsafe { str_arg(name, "name")? };
    Ok(layout.id(name)?)
}

pub(crate) fn name<S>(h: &mut Named<S>) -> CResult<*const c_char> {
    Ok(h.name.as_ptr())
}

pub(crate) fn num_envs<S: Side>(h: &mut Named<S>) -> CResult<u32> {
    Ok(h.side.layout().num_envs)
}

pub(crate) fn tensor_count<S: Side>(h: &mut Named<S>) -> CResult<usize> {
    Ok(h.side.layout().tensors.len())
}

pub(crate) fn tensor_info<S: Side>(h: &mut Named<S>, index: usize) -> CResult<shmb_tensor_info> {
    // SAFETY: a NULL name: by index.
    let id = unsafe { key(h.side.layout(), std::ptr::null(), index)? };
    Ok(info_of(
        &h.side.layout().tensors[id.index()],
        &h.tensor_names[id.index()],
    ))
}

/// Host address and byte length of a tensor.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
pub(crate) unsafe fn tensor<S: Side>(
    h: &mut Named<S>,
    name: *const c_char,
    index: usize,
) -> CResult<(*mut c_void, usize)> {
    // SAFETY: forwarded contract.
    let id = unsafe { key(h.side.layout(), name, index)? };
    let n = h.side.layout().tensors[id.index()].nbytes as usize;
    Ok((h.side.address(id)? as *mut c_void, n))
}

/// Device address of a tensor.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
pub(crate) unsafe fn device_ptr<S: Side>(
    h: &mut Named<S>,
    name: *const c_char,
    index: usize,
) -> CResult<u64> {
    // SAFETY: forwarded contract.
    let id = unsafe { key(h.side.layout(), name, index)? };
    Ok(h.side.device_ptr(id)?)
}

/// Writes a pointer and a length (both checked before any work).
///
/// # Safety
/// Both NULL or writable.
pub(crate) unsafe fn put_pair<P, N>(data: *mut P, len: *mut N, (d, n): (P, N)) -> CResult {
    // SAFETY: forwarded contract.
    unsafe {
        put(data, d, "data")?;
        put(len, n, "length")
    }
}
