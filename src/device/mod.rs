//! Where bytes live.

pub mod location;

pub use location::{CudaDevice, Device, Location, DL_CPU, DL_CUDA};
