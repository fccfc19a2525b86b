//! Where tensors live: host memory or a CUDA device, and whether CUDA can be used here.
//!
//! This module is compiled in every build. Without the `cuda` feature every CUDA request
//! is answered with [`Error::CudaUnavailable`] ("built without the `cuda` feature"); with
//! it, [`probe`] loads the driver dynamically (cudarc's `dynamic-loading`) and checks it
//! before any other driver call is made. cudarc panics on the first `sys::cu*` call when
//! `libcuda.so` (or one of its symbols) is missing, so nothing outside [`driver`] calls
//! cudarc, and [`driver`] calls nothing before [`probe`] succeeded: its entry points take
//! a [`driver::Driver`] token that only a successful probe hands out.
//!
//! All CUDA FFI and its `unsafe` live in [`driver`].

use crate::error::{Error, Result};

pub mod kernels;

#[cfg(feature = "cuda")]
pub mod driver;
#[cfg(feature = "cuda")]
pub mod ipc;

/// What an engine did with its exported device memory when it closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaRelease {
    /// No CUDA tensors (or not closed yet).
    NoCuda,
    /// Freed: the client acknowledged closing its handles, died, or never opened them.
    Freed,
    /// Deliberately not freed: a live client still had the memory open (`client_cuda_state
    /// = OPEN`) when the bounded wait ran out. Freeing memory a peer has mapped is
    /// undefined behaviour in the driver; the driver reclaims it when this process exits.
    Leaked,
}

/// The ordinal (as this process numbers devices) of the engine's device: the one whose
/// UUID is `uuid` among `visible` (UUIDs by ordinal), else, when `uuid` is all zero
/// (unknown) or not visible, `ordinal` if this process has such a device. `None`: no
/// usable device.
pub fn pick_device(uuid: [u8; 16], ordinal: i32, visible: &[[u8; 16]]) -> Option<i32> {
    if uuid != [0; 16] {
        if let Some(i) = visible.iter().position(|u| *u == uuid) {
            return i32::try_from(i).ok();
        }
    }
    usize::try_from(ordinal)
        .ok()
        .filter(|&o| o < visible.len())
        .map(|_| ordinal)
}

pub use crate::device::{Device, DL_CPU, DL_CUDA};

/// What a user asked for (`--device`, `device=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRequest {
    /// CUDA device 0 when one is usable, else host memory (with the reason).
    Auto,
    Host,
    /// A CUDA device; `None` = device 0.
    Cuda(Option<i32>),
}

impl DeviceRequest {
    /// `auto`, `cpu`/`host`, `cuda`, `cuda:N` (case-insensitive, surrounding blanks
    /// ignored). Anything else is `InvalidSpec`.
    pub fn parse(s: &str) -> Result<DeviceRequest> {
        let t = s.trim().to_ascii_lowercase();
        let bad = || {
            Error::InvalidSpec(format!(
                "device '{s}': expected auto, cpu, host, cuda or cuda:N"
            ))
        };
        match t.as_str() {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" | "host" => Ok(DeviceRequest::Host),
            "cuda" => Ok(DeviceRequest::Cuda(None)),
            _ => {
                let n = t.strip_prefix("cuda:").ok_or_else(bad)?;
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                n.parse::<i32>()
                    .map(|n| DeviceRequest::Cuda(Some(n)))
                    .map_err(|_| bad())
            }
        }
    }
}

/// The device a request resolved to, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceChoice {
    pub requested: DeviceRequest,
    pub device: Device,
    /// Why this device: for `auto` falling back to host, the reason CUDA is unavailable.
    pub reason: String,
}

impl DeviceChoice {
    /// One line for logs: `shmbridge: device auto -> cpu (CUDA is unavailable: ...)`.
    pub fn log_line(&self) -> String {
        let asked = match self.requested {
            DeviceRequest::Auto => "auto".to_string(),
            DeviceRequest::Host => "cpu".to_string(),
            DeviceRequest::Cuda(None) => "cuda".to_string(),
            DeviceRequest::Cuda(Some(n)) => format!("cuda:{n}"),
        };
        format!(
            "shmbridge: device {asked} -> {} ({})",
            self.device, self.reason
        )
    }
}

/// What a successful probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaInfo {
    /// `cuDriverGetVersion`, e.g. 12080 for 12.8.
    pub driver_version: i32,
    pub device_count: i32,
}

/// Whether CUDA can be used in this process: `Ok` with what was found, or
/// `CudaUnavailable` with the reason. Never panics; cheap after the first call (the
/// result is cached for the life of the process).
pub fn probe() -> Result<CudaInfo> {
    #[cfg(feature = "cuda")]
    {
        driver::Driver::get().map(|d| d.info().clone())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(unavailable_without_feature())
    }
}

/// The error every CUDA path gives in a build without the `cuda` feature.
pub fn unavailable_without_feature() -> Error {
    Error::CudaUnavailable {
        reason: "this shmbridge was built without the `cuda` feature (rebuild with \
                 `--features cuda`; the Python wheel has it)"
            .into(),
    }
}

/// Resolves a request against this machine: `Host` always works; `Cuda` needs a usable
/// driver and the device (else `CudaUnavailable`); `Auto` takes CUDA device 0 when it is
/// usable and host memory otherwise, giving the reason in [`DeviceChoice::reason`].
pub fn resolve(requested: DeviceRequest) -> Result<DeviceChoice> {
    resolve_with(requested, probe())
}

/// [`resolve`] with the probe's answer given (tests feed it both outcomes).
pub fn resolve_with(requested: DeviceRequest, probed: Result<CudaInfo>) -> Result<DeviceChoice> {
    let choice = |device, reason: String| {
        Ok(DeviceChoice {
            requested,
            device,
            reason,
        })
    };
    let cuda = |ordinal: i32, info: &CudaInfo| -> Result<()> {
        if ordinal < 0 || ordinal >= info.device_count {
            return Err(Error::CudaUnavailable {
                reason: format!(
                    "no CUDA device {ordinal} (this process sees {} device(s))",
                    info.device_count
                ),
            });
        }
        Ok(())
    };
    match requested {
        DeviceRequest::Host => choice(Device::Host, "requested".into()),
        DeviceRequest::Cuda(n) => {
            let info = probed?;
            let n = n.unwrap_or(0);
            cuda(n, &info)?;
            choice(
                Device::cuda(n),
                format!(
                    "requested; driver {}, {} device(s)",
                    info.driver_version, info.device_count
                ),
            )
        }
        DeviceRequest::Auto => match probed.and_then(|info| cuda(0, &info).map(|()| info)) {
            Ok(info) => choice(
                Device::cuda(0),
                format!(
                    "CUDA usable: driver {}, {} device(s)",
                    info.driver_version, info.device_count
                ),
            ),
            Err(e) => choice(Device::Host, format!("falling back to host memory: {e}")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_requests() {
        assert_eq!(DeviceRequest::parse("auto").unwrap(), DeviceRequest::Auto);
        assert_eq!(DeviceRequest::parse(" CPU ").unwrap(), DeviceRequest::Host);
        assert_eq!(DeviceRequest::parse("host").unwrap(), DeviceRequest::Host);
        assert_eq!(
            DeviceRequest::parse("cuda").unwrap(),
            DeviceRequest::Cuda(None)
        );
        assert_eq!(
            DeviceRequest::parse("cuda:3").unwrap(),
            DeviceRequest::Cuda(Some(3))
        );
        for bad in [
            "",
            "gpu",
            "cuda:",
            "cuda:-1",
            "cuda:x",
            "cuda:99999999999",
            "cuda:+1",
        ] {
            let e = DeviceRequest::parse(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidSpec(_)), "{bad}: {e}");
        }
    }

    #[test]
    fn devices_are_matched_by_uuid_then_ordinal() {
        let (a, b) = ([1u8; 16], [2u8; 16]);
        assert_eq!(
            pick_device(b, 0, &[a, b]),
            Some(1),
            "uuid wins over ordinal"
        );
        assert_eq!(pick_device([0; 16], 1, &[a, b]), Some(1), "unknown uuid");
        assert_eq!(
            pick_device([9; 16], 0, &[a, b]),
            Some(0),
            "uuid not visible"
        );
        assert_eq!(pick_device([9; 16], 2, &[a, b]), None);
        assert_eq!(pick_device([0; 16], -1, &[a]), None);
        assert_eq!(pick_device(a, 0, &[]), None);
    }

    fn unavailable() -> Result<CudaInfo> {
        Err(Error::CudaUnavailable {
            reason: "no driver".into(),
        })
    }

    #[test]
    fn auto_falls_back_with_the_reason() {
        let c = resolve_with(DeviceRequest::Auto, unavailable()).unwrap();
        assert_eq!(c.device, Device::Host);
        assert!(c.reason.contains("no driver"), "{}", c.reason);
        assert!(c.log_line().contains("auto -> cpu"), "{}", c.log_line());
        // A driver with no device: also host.
        let none = Ok(CudaInfo {
            driver_version: 12080,
            device_count: 0,
        });
        let c = resolve_with(DeviceRequest::Auto, none).unwrap();
        assert_eq!(c.device, Device::Host);
        assert!(c.reason.contains("no CUDA device 0"), "{}", c.reason);
    }

    #[test]
    fn auto_takes_cuda_when_usable() {
        let two = || {
            Ok(CudaInfo {
                driver_version: 12080,
                device_count: 2,
            })
        };
        let c = resolve_with(DeviceRequest::Auto, two()).unwrap();
        assert_eq!(c.device, Device::cuda(0));
        let c = resolve_with(DeviceRequest::Cuda(Some(1)), two()).unwrap();
        assert_eq!(c.device, Device::cuda(1));
        let e = resolve_with(DeviceRequest::Cuda(Some(2)), two()).unwrap_err();
        assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}");
    }

    #[test]
    fn explicit_cuda_without_cuda_is_a_typed_error() {
        let e = resolve_with(DeviceRequest::Cuda(None), unavailable()).unwrap_err();
        assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}");
        assert_eq!(
            resolve_with(DeviceRequest::Host, unavailable())
                .unwrap()
                .device,
            Device::Host
        );
    }

    /// The real probe on this machine. On a machine without a driver (CI) it must return
    /// `CudaUnavailable` with a reason, never panic; where CUDA works it reports devices.
    #[test]
    fn real_probe_never_panics() {
        match probe() {
            Ok(info) => {
                assert!(info.device_count >= 1, "{info:?}");
                assert!(info.driver_version > 0, "{info:?}");
            }
            Err(Error::CudaUnavailable { reason }) => {
                assert!(!reason.is_empty());
                eprintln!("CUDA unavailable here: {reason}");
                let c = resolve(DeviceRequest::Auto).unwrap();
                assert_eq!(c.device, Device::Host);
                assert!(c.reason.contains(&reason), "{}", c.reason);
            }
            Err(e) => panic!("probe gave {e}, not CudaUnavailable"),
        }
    }
}
