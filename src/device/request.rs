//! What a user asks for (`--device`, `device=`), and what it resolves to.

use super::cuda::CudaInfo;
use crate::error::{Error, Result};
use crate::layout::Device;

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

/// How a client imports Vulkan tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VulkanImporter {
    /// CUDA when a CUDA device has the engine's Vulkan device UUID, else Vulkan.
    #[default]
    Auto,
    /// A Vulkan device of the client's own, mapped on the CPU (kDLCPU).
    Vulkan,
    /// CUDA external memory (kDLCUDA).
    Cuda,
}

impl VulkanImporter {
    /// `auto`, `vulkan` or `cuda` (case-insensitive, surrounding blanks ignored).
    /// Anything else is `InvalidSpec`.
    pub fn parse(s: &str) -> Result<VulkanImporter> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(VulkanImporter::Auto),
            "vulkan" => Ok(VulkanImporter::Vulkan),
            "cuda" => Ok(VulkanImporter::Cuda),
            _ => Err(Error::InvalidSpec(format!(
                "importer '{s}': expected auto, vulkan or cuda"
            ))),
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

/// [`resolve`](super::resolve) with the probe's answer given (tests feed it both outcomes).
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn importer_names() {
        assert!(matches!(
            VulkanImporter::parse(" Auto "),
            Ok(VulkanImporter::Auto)
        ));
        assert!(matches!(
            VulkanImporter::parse("vulkan"),
            Ok(VulkanImporter::Vulkan)
        ));
        assert!(matches!(
            VulkanImporter::parse("CUDA"),
            Ok(VulkanImporter::Cuda)
        ));
        assert!(matches!(
            VulkanImporter::parse("cpu"),
            Err(Error::InvalidSpec(m)) if m.contains("auto, vulkan or cuda")
        ));
    }

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
}
