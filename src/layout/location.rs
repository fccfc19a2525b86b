//! Where a tensor's bytes live: the one type for a spec's placement, a resolved device
//! request and a validated tensor-table entry. Plain data: the tensor table encodes it
//! (the `location` byte is [`Device::location`], the ordinal and UUID have their own
//! fields) and the backends in `crate::device` serve it (which re-exports it).

/// Where a tensor's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory: the tensor's bytes are in the shared-memory region.
    Host,
    /// A CUDA device.
    Cuda(CudaDevice),
    /// Vulkan device memory exported as an fd (1.3), passed to the client over the
    /// region's socket.
    Vulkan(VulkanDevice),
}

/// A Vulkan device, by the UUIDs of `VkPhysicalDeviceIDProperties`: an opaque fd can
/// only be imported by a device (and driver) with the same UUIDs, and a CUDA device with
/// the same UUID is the same GPU. All zero in a spec: any device that can export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct VulkanDevice {
    pub device_uuid: [u8; 16],
    pub driver_uuid: [u8; 16],
}

impl VulkanDevice {
    /// The first Vulkan device that can export memory (an engine's spec).
    pub const ANY: VulkanDevice = VulkanDevice {
        device_uuid: [0; 16],
        driver_uuid: [0; 16],
    };
}

/// A CUDA device: the ordinal as the process that wrote it numbers devices, and the
/// device's UUID, which names the same device in a process whose
/// `CUDA_VISIBLE_DEVICES` numbers them differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CudaDevice {
    pub ordinal: i32,
    /// `cuDeviceGetUuid`; all zero = unknown (a spec or request names an ordinal only).
    pub uuid: [u8; 16],
}

/// Which kind of memory a [`Device`] is: the tensor table's `location` byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Location {
    Host = 0,
    Cuda = 1,
    /// Vulkan memory exported as an opaque fd (1.3).
    Vulkan = 2,
}

impl Location {
    pub fn name(self) -> &'static str {
        match self {
            Location::Host => "host",
            Location::Cuda => "cuda",
            Location::Vulkan => "vulkan",
        }
    }

    /// The `location` byte.
    pub const fn code(self) -> u8 {
        self as u8
    }

    pub const fn from_code(code: u8) -> Option<Location> {
        match code {
            0 => Some(Location::Host),
            1 => Some(Location::Cuda),
            2 => Some(Location::Vulkan),
            _ => None,
        }
    }
}

/// DLPack `kDLCPU`.
pub const DL_CPU: i32 = 1;
/// DLPack `kDLCUDA`.
pub const DL_CUDA: i32 = 2;
/// DLPack `kDLVulkan`: where a Vulkan tensor lives before a client imports it (the
/// client's importer then says `kDLCPU` or `kDLCUDA`).
pub const DL_VULKAN: i32 = 7;

impl Device {
    /// CUDA device `ordinal`, UUID unknown.
    pub const fn cuda(ordinal: i32) -> Device {
        Device::Cuda(CudaDevice {
            ordinal,
            uuid: [0; 16],
        })
    }

    pub const fn location(self) -> Location {
        match self {
            Device::Host => Location::Host,
            Device::Cuda(_) => Location::Cuda,
            Device::Vulkan(_) => Location::Vulkan,
        }
    }

    /// The device ordinal (0 for host and Vulkan memory, as the tensor table writes it:
    /// a Vulkan device is named by its UUIDs).
    pub const fn ordinal(self) -> i32 {
        match self {
            Device::Host | Device::Vulkan(_) => 0,
            Device::Cuda(c) => c.ordinal,
        }
    }

    /// `"cpu"`, `"cuda:N"` (what torch's `torch.device(...)` understands) or `"vulkan"`.
    pub fn torch_name(self) -> String {
        match self {
            Device::Host => "cpu".to_string(),
            Device::Cuda(c) => format!("cuda:{}", c.ordinal),
            Device::Vulkan(_) => "vulkan".to_string(),
        }
    }

    /// DLPack `(device_type, device_id)`: `(1, 0)` (kDLCPU), `(2, ordinal)` (kDLCUDA), or
    /// `(7, 0)` (kDLVulkan) for the table's placement of a Vulkan tensor; a client's
    /// importer decides what its view of one is (`ClientBackend::dlpack_device`).
    pub fn dlpack(self) -> (i32, i32) {
        match self {
            Device::Host => (DL_CPU, 0),
            Device::Cuda(c) => (DL_CUDA, c.ordinal),
            Device::Vulkan(_) => (DL_VULKAN, 0),
        }
    }
}

/// A 16-byte UUID (CUDA or Vulkan device, Vulkan driver) as 32 lowercase hex digits.
pub fn uuid_hex(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.torch_name())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        assert_eq!(Device::Host.torch_name(), "cpu");
        assert_eq!(Device::cuda(1).to_string(), "cuda:1");
        assert_eq!(Device::Host.dlpack(), (1, 0));
        assert_eq!(Device::cuda(2).dlpack(), (2, 2));
    }

    #[test]
    fn location_codes_round_trip() {
        for l in [Location::Host, Location::Cuda, Location::Vulkan] {
            assert_eq!(Location::from_code(l.code()), Some(l));
        }
        assert_eq!(Location::from_code(3), None);
        assert_eq!(Device::cuda(0).location(), Location::Cuda);
        assert_eq!(Device::Host.location().code(), 0);
    }
}
