//! The client's Vulkan backend: one tensor object whatever imports the memory. It picks
//! the importer before the slot is claimed, receives the fds over the region's socket
//! at open, and imports each tensor's memory once.
//!
//! The importers:
//! - **a device** (an [`FdImporter`] the seam hands out, [`crate::device::fd_importer`]:
//!   CUDA, with the `cuda` feature, on a device whose UUID is the engine's Vulkan device
//!   UUID): the memory imported and mapped as one device buffer, handed out as device
//!   pointers (kDLCUDA). An exported timeline semaphore is imported too and waited on
//!   the consumer's stream before a frame is read ([`ClientBackend::order_after_frame`]):
//!   stream-ordered, no host sync. Without one the seq counters order frames (the engine
//!   completed the frame's work before it published it). Before an action is posted the
//!   consumer's stream is drained, since the engine then overwrites the frame. This
//!   folder names no other backend: the device importer is reached through the seam.
//! - **Vulkan** (the `vulkan` feature): a Vulkan device of the client's own maps
//!   host-visible memory and hands out host pointers (kDLCPU). Semaphores are closed:
//!   the CPU reads after `frame_seq`, which the engine publishes once the frame is done.
//!
//! Either way the views are the engine's bytes, never a copy. `auto` takes the device
//! importer when the UUIDs match one of its devices, else Vulkan, and says which and why
//! ([`ClientVulkan::importer_reason`]).

use std::any::Any;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use super::VulkanImporter;
use crate::control::ControlMapping;
use crate::device::backend::{
    ClientBackend, DeviceLease, DevicePlace, FdImporter, FdMemory, FdTimeline, StreamRef,
};
use crate::error::{Error, Peer, Result};
use crate::layout::location::{uuid_hex, Device, Location, VulkanDevice};
use crate::layout::{Layout, TensorInfo};

#[cfg(feature = "vulkan")]
use super::vk::{Context, ImportedMemory};

/// Which importer serves a client, decided before anything is imported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImporterChoice {
    /// Device `ordinal` of the device importer (as this process numbers them: CUDA's)
    /// has the engine's UUID.
    Device {
        ordinal: i32,
    },
    Vulkan,
}

/// Picks the importer for `requested`, given the engine's Vulkan device and what this
/// process sees of the device importer (`api`, its name in messages:
/// [`crate::device::fd_importer_name`]; `devices`: [`crate::device::fd_import_devices`],
/// the UUIDs of its devices by ordinal, or why there is none). Returns the choice and
/// the reason to report. The device importer requested but not possible is
/// `CudaUnavailable` with the reason; `auto` then takes Vulkan.
pub fn choose_importer(
    requested: VulkanImporter,
    engine: VulkanDevice,
    api: &str,
    devices: std::result::Result<Vec<[u8; 16]>, String>,
) -> Result<(ImporterChoice, String)> {
    let engine_uuid = uuid_hex(&engine.device_uuid);
    let matching = match devices {
        Ok(uuids) => match uuids.iter().position(|u| *u == engine.device_uuid) {
            Some(i) => Ok(i as i32),
            None => Err(format!(
                "no {api} device of this process has the engine's Vulkan device UUID \
                 {engine_uuid} ({} {api} device(s): {})",
                uuids.len(),
                uuids.iter().map(uuid_hex).collect::<Vec<_>>().join(", ")
            )),
        },
        Err(why) => Err(why),
    };
    match (requested, matching) {
        (VulkanImporter::Vulkan, _) => Ok((ImporterChoice::Vulkan, "requested".into())),
        (VulkanImporter::Cuda | VulkanImporter::Auto, Ok(ordinal)) => Ok((
            ImporterChoice::Device { ordinal },
            format!("{api} device {ordinal} has the engine's Vulkan device UUID {engine_uuid}"),
        )),
        (VulkanImporter::Cuda, Err(why)) => Err(Error::CudaUnavailable {
            reason: format!("importing the engine's Vulkan memory into {api}: {why}"),
        }),
        (VulkanImporter::Auto, Err(why)) => Ok((ImporterChoice::Vulkan, why)),
    }
}

/// The device a client imports into.
enum Importer {
    /// The seam's device importer (CUDA).
    Device(Arc<dyn FdImporter>),
    #[cfg(feature = "vulkan")]
    Vulkan(Arc<Context>),
}

/// One tensor's import.
#[derive(Debug)]
enum Import {
    /// Mapped on the CPU by the client's Vulkan device.
    #[cfg(feature = "vulkan")]
    Mapped(ImportedMemory),
    /// Imported into the device importer's device, with the engine's semaphore if it
    /// exported one.
    Device {
        memory: Box<dyn FdMemory>,
        semaphore: Option<Box<dyn FdTimeline>>,
    },
}

impl Import {
    /// `(size now, size mapped)` when the file behind a CPU mapping shrank under it
    /// ([`ImportedMemory::check_size`]). A device import maps no file on the CPU.
    fn shrunk(&self) -> Option<(u64, u64)> {
        match self {
            #[cfg(feature = "vulkan")]
            Import::Mapped(m) => m.check_size().err().map(|now| (now, m.size())),
            Import::Device { .. } => None,
        }
    }
}

/// The imports of a client's Vulkan tensors: the lease its views hold.
#[derive(Debug, Default)]
struct Imports {
    /// By tensor index.
    tensors: Vec<Option<Import>>,
    /// The newest frame that arrived: the value a timeline semaphore is waited for.
    latest_frame: std::sync::atomic::AtomicU64,
    /// Once a check found a tensor's memory shorter than its mapping: which, how large
    /// now, how large mapped. From then on no view of any of them is handed out (the
    /// bytes past the end are gone; touching them is a SIGBUS).
    shrunk: std::sync::OnceLock<(String, u64, u64)>,
}

impl Imports {
    /// The import of tensor `index`, unless the imports were found shrunk.
    fn get(&self, index: usize) -> Option<&Import> {
        if self.shrunk.get().is_some() {
            return None;
        }
        self.tensors.get(index)?.as_ref()
    }

    /// The sticky error of memory found shrunk, if it was.
    fn shrunk_error(&self) -> Option<Error> {
        let (tensor, now, size) = self.shrunk.get()?;
        Some(Error::InvalidTensor {
            tensor: tensor.clone(),
            reason: format!(
                "the engine's exported memory of it shrank to {now} bytes of the {size} mapped (a \
                 process of this user truncated it): no view of the Vulkan tensors is used any \
                 more; close and attach again"
            ),
        })
    }

    /// Looks at the size of every import that may shrink (`ImportedMemory::check_size`).
    fn check_sizes(&self, layout_names: impl Fn(usize) -> String) -> Result<()> {
        if let Some(e) = self.shrunk_error() {
            return Err(e);
        }
        for (i, import) in self.tensors.iter().enumerate() {
            if let Some((now, size)) = import.as_ref().and_then(Import::shrunk) {
                let _ = self.shrunk.set((layout_names(i), now, size));
                return Err(self.shrunk_error().expect("set above"));
            }
        }
        Ok(())
    }

    fn host_ptr(&self, index: usize, t: &TensorInfo) -> Option<NonNull<u8>> {
        match self.get(index)? {
            #[cfg(feature = "vulkan")]
            Import::Mapped(m) => m.span(t.offset, t.nbytes),
            Import::Device { .. } => {
                let _ = t;
                None
            }
        }
    }

    /// Device address of tensor `index`'s first byte (the CPU's, when mapped).
    fn device_ptr(&self, index: usize, t: &TensorInfo) -> Option<u64> {
        match self.get(index)? {
            #[cfg(feature = "vulkan")]
            Import::Mapped(m) => m.span(t.offset, t.nbytes).map(|p| p.as_ptr() as u64),
            Import::Device { memory, .. } => memory.span(t.offset, t.nbytes),
        }
    }

    /// The device imports' timeline semaphores (none for the CPU importer).
    fn semaphores(&self) -> impl Iterator<Item = &dyn FdTimeline> {
        self.tensors.iter().filter_map(|i| match i.as_ref()? {
            Import::Device {
                semaphore: Some(s), ..
            } => Some(s.as_ref()),
            _ => None,
        })
    }
}

impl DeviceLease for Imports {
    /// Device imports with a timeline semaphore: `stream` waits on the device until the
    /// semaphore reached the last frame that arrived. Mapped on the CPU, or without a
    /// semaphore: the engine published the frame once its work was complete and the
    /// client reads after `frame_seq` moved, so there is nothing to wait for.
    fn order_after_frame(&self, stream: StreamRef<'_>) -> Result<()> {
        let frame = self.latest_frame.load(std::sync::atomic::Ordering::Acquire);
        for s in self.semaphores() {
            s.wait(stream, frame)?;
        }
        Ok(())
    }
}

/// The client's Vulkan state: the importer's device, and each tensor's import.
pub struct ClientVulkan {
    name: String,
    timeout: Duration,
    /// Why this importer (for logs and `importer_reason`).
    reason: String,
    /// Each tensor's import; shared with every view handed out (the lease), so a view
    /// keeps its mapping after the client closed. `None` before open and after release.
    imports: Option<Arc<Imports>>,
    importer: Importer,
    /// The layout's tensor names, by index (for messages).
    names: Vec<String>,
}

impl std::fmt::Debug for ClientVulkan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientVulkan")
            .field("region", &self.name)
            .field("importer", &self.reason)
            .finish_non_exhaustive()
    }
}

/// The one device of the engine's Vulkan tensors (1.3 serves one per engine).
fn engine_device(layout: &Layout) -> Result<VulkanDevice> {
    let mut devices = layout.tensors.iter().filter_map(|t| match t.device {
        Device::Vulkan(v) => Some((t, v)),
        _ => None,
    });
    let Some((first, dev)) = devices.next() else {
        return Err(Error::InvalidSpec("no Vulkan tensor in the layout".into()));
    };
    if let Some((t, _)) = devices.find(|(_, v)| *v != dev) {
        return Err(Error::InvalidTensor {
            tensor: t.name.clone(),
            reason: format!("on another Vulkan device than '{}'", first.name),
        });
    }
    Ok(dev)
}

impl ClientVulkan {
    /// Before claiming the slot: picks the importer and opens its device (the one with
    /// the engine's UUIDs). Nothing in the region is touched.
    pub fn prepare(
        layout: &Layout,
        name: &str,
        importer: VulkanImporter,
        timeout: Duration,
    ) -> Result<ClientVulkan> {
        let dev = engine_device(layout)?;
        if layout.version.1 < crate::layout::VERSION_MINOR_FD_HELLO {
            let first = layout
                .tensors
                .iter()
                .find(|t| t.location() == Location::Vulkan)
                .map_or("?", |t| t.name.as_str());
            return Err(Error::InvalidTensor {
                tensor: first.to_string(),
                reason: match layout.version.1 < crate::layout::VERSION_MINOR_FD_SOCKET {
                    true => format!(
                        "an engine of protocol 1.{} serves Vulkan fds on an abstract socket, \
                         which proves nothing about who answers (and does not cross network \
                         namespaces); this client takes them only from a 1.8 engine: update \
                         the engine's shmbridge",
                        layout.version.1
                    ),
                    false => format!(
                        "an engine of protocol 1.{} asks for a client proof that any process \
                         of this user can forge, and has the client show it before the engine \
                         proved who it is; this client takes Vulkan fds only from a 1.8 \
                         engine: update the engine's shmbridge",
                        layout.version.1
                    ),
                },
            });
        }
        let api = crate::device::fd_importer_name();
        let (choice, why) =
            choose_importer(importer, dev, api, crate::device::fd_import_devices())?;
        let (importer, reason) = match choice {
            ImporterChoice::Device { ordinal } => match crate::device::fd_importer(ordinal) {
                Ok(device) => {
                    let reason = format!("{}: {why}", device.describe());
                    (Importer::Device(device), reason)
                }
                Err(e) if importer == VulkanImporter::Auto => Self::vulkan_importer(
                    layout,
                    dev,
                    &format!("{api} device {ordinal} matches but is not usable: {e}"),
                )?,
                Err(e) => return Err(e),
            },
            ImporterChoice::Vulkan => Self::vulkan_importer(layout, dev, &why)?,
        };
        Ok(ClientVulkan {
            name: name.to_string(),
            timeout,
            reason,
            imports: None,
            importer,
            names: layout.tensors.iter().map(|t| t.name.clone()).collect(),
        })
    }

    #[cfg(feature = "vulkan")]
    fn vulkan_importer(_: &Layout, dev: VulkanDevice, why: &str) -> Result<(Importer, String)> {
        let ctx = Context::open(dev)?;
        let reason = format!(
            "Vulkan importer on {} (host-mapped, kDLCPU): {why}",
            ctx.name()
        );
        Ok((Importer::Vulkan(ctx), reason))
    }

    #[cfg(not(feature = "vulkan"))]
    fn vulkan_importer(layout: &Layout, _: VulkanDevice, why: &str) -> Result<(Importer, String)> {
        let reason = match super::unavailable_without_feature() {
            Error::VulkanUnavailable { reason } => reason,
            e => e.to_string(),
        };
        let first = layout
            .tensors
            .iter()
            .find(|t| t.location() == Location::Vulkan)
            .map_or("?", |t| t.name.as_str());
        Err(Error::VulkanUnavailable {
            reason: format!("tensor '{first}' lives in Vulkan memory: {reason}; and {why}"),
        })
    }

    /// Which importer serves this client, and why.
    pub fn importer_reason(&self) -> &str {
        &self.reason
    }

    /// Copies tensor `index`'s bytes as this client's import holds them into `out`
    /// (`t.nbytes` long): from the mapping, or device to host for a CUDA import. For
    /// tests and debugging; views never copy.
    pub fn read_tensor(&self, index: usize, t: &TensorInfo, out: &mut [u8]) -> Result<()> {
        let imports = self.imports.as_ref().ok_or(Error::Closed(Peer::Client))?;
        if out.len() as u64 != t.nbytes {
            return Err(Error::InvalidSpec(format!(
                "read_tensor: {} bytes for '{}' of {}",
                out.len(),
                t.name,
                t.nbytes
            )));
        }
        match imports.get(index) {
            #[cfg(feature = "vulkan")]
            Some(Import::Mapped(m)) => {
                let p = m.span(t.offset, t.nbytes).ok_or(Error::NotOnHost {
                    tensor: t.name.clone(),
                    location: "vulkan",
                })?;
                // SAFETY: `span` checked `offset + nbytes` against the live mapping,
                // which `imports` keeps alive across the copy; `out` is another buffer.
                out.copy_from_slice(unsafe { std::slice::from_raw_parts(p.as_ptr(), out.len()) });
                Ok(())
            }
            Some(Import::Device { memory, .. }) => memory.read(t.offset, out),
            None => Err(Error::InvalidTensor {
                tensor: t.name.clone(),
                reason: "not imported".into(),
            }),
        }
    }

    /// Whether the device importer (CUDA) serves this client: its views are device
    /// pointers (kDLCUDA), not host-mapped.
    pub fn imports_into_device(&self) -> bool {
        match self.importer {
            Importer::Device(_) => true,
            #[cfg(feature = "vulkan")]
            Importer::Vulkan(_) => false,
        }
    }

    /// The tensors' fds, from the engine and nobody else ([`crate::device::server::receive`]).
    fn receive_from_the_engine(
        &self,
        layout: &Layout,
        region: &dyn ControlMapping,
    ) -> Result<Vec<OwnedFd>> {
        let expected = super::fd_count(layout);
        crate::device::server::receive(&self.name, layout, region, expected, self.timeout)
    }

    /// The name of tensor `index` of the layout this client imported, for messages.
    fn tensor_name(&self, index: usize) -> String {
        self.names
            .get(index)
            .cloned()
            .unwrap_or_else(|| format!("#{index}"))
    }

    /// Imports each tensor's memory from the fds received (after the slot is claimed:
    /// the engine sends them only to its attached client). Every fd received is owned
    /// here at once, so each is closed exactly once (by the driver after an import,
    /// else when dropped).
    fn import_all(&mut self, layout: &Layout, fds: Vec<OwnedFd>) -> Result<()> {
        let mut fds = fds.into_iter();
        let mut imports = Imports {
            tensors: (0..layout.tensors.len()).map(|_| None).collect(),
            latest_frame: 0.into(),
            shrunk: Default::default(),
        };
        for (i, t) in layout.tensors.iter().enumerate() {
            let Some(table) = t.vulkan.filter(|_| t.location() == Location::Vulkan) else {
                continue;
            };
            let too_few = || Error::Protocol {
                peer: Peer::Engine,
                detail: "fewer fds than the tensor table calls for".into(),
            };
            let memory = fds.next().ok_or_else(too_few)?;
            let semaphore = match table.semaphore {
                Some(kind) => Some((fds.next().ok_or_else(too_few)?, kind)),
                None => None,
            };
            let import = match &self.importer {
                #[cfg(feature = "vulkan")]
                Importer::Vulkan(ctx) => {
                    // Read after `frame_seq` on the CPU: the semaphore adds nothing.
                    drop(semaphore);
                    Import::Mapped(ImportedMemory::import(ctx, memory, &table, &t.name)?)
                }
                Importer::Device(device) => {
                    let memory = device
                        .import_memory(memory, table.alloc_size, table.dedicated)
                        .map_err(|e| Error::InvalidTensor {
                            tensor: t.name.clone(),
                            reason: format!(
                                "importing the engine's memory into {}: {e}",
                                device.name()
                            ),
                        })?;
                    // Validation let only timeline semaphores through.
                    let semaphore = match semaphore {
                        Some((fd, _)) => Some(device.import_timeline(fd)?),
                        None => None,
                    };
                    Import::Device { memory, semaphore }
                }
            };
            imports.tensors[i] = Some(import);
            if imports.device_ptr(i, t).is_none() {
                return Err(Error::InvalidTensor {
                    tensor: t.name.clone(),
                    reason: "the tensor lies outside its imported memory".into(),
                });
            }
        }
        if fds.next().is_some() {
            return Err(Error::Protocol {
                peer: Peer::Engine,
                detail: "more fds than the tensor table calls for".into(),
            });
        }
        self.imports = Some(Arc::new(imports));
        Ok(())
    }
}

impl ClientBackend for ClientVulkan {
    fn importer_reason(&self) -> Option<&str> {
        Some(&self.reason)
    }

    fn open(&mut self, layout: &Layout, region: &dyn ControlMapping) -> Result<()> {
        let fds = self.receive_from_the_engine(layout, region)?;
        self.import_all(layout, fds)
    }

    fn check_imports(&self) -> Result<()> {
        match &self.imports {
            Some(imports) => imports.check_sizes(|i| self.tensor_name(i)),
            None => Ok(()),
        }
    }

    fn import_error(&self, _index: usize, _t: &TensorInfo) -> Option<Error> {
        self.imports.as_ref()?.shrunk_error()
    }

    /// The device importer: the engine's next frame overwrites the memory the consumer's
    /// queued work may still read, and a Vulkan engine cannot wait on a CUDA event, so
    /// the consumer's stream (the legacy default stream if `None`) is drained first.
    /// Reads queued on other streams must be ordered before it by the caller, as for any
    /// cross-stream use in torch. With a semaphore the stream may wait for a value the
    /// engine never signals: the drain then polls, checking the engine between polls, and
    /// gives up after `timeout` (`Timeout`, which the client's step reports as
    /// `NotPosted`: the action is not posted, nothing is in flight). The CPU importer
    /// reads synchronously: nothing to do.
    fn before_post(
        &self,
        stream: Option<StreamRef<'_>>,
        timeout: Duration,
        check: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        match &self.importer {
            Importer::Device(device) => {
                if self
                    .imports
                    .as_ref()
                    .is_some_and(|i| i.semaphores().next().is_some())
                {
                    let what = "the consumer's stream on the device importer, which waits \
                                for the engine's timeline semaphore to reach the last frame's \
                                number";
                    crate::sync::poll_until(timeout, what, || device.is_idle(stream), check)
                } else {
                    device.synchronize(stream)
                }
            }
            #[cfg(feature = "vulkan")]
            Importer::Vulkan(_) => {
                let _ = (stream, timeout, check);
                Ok(())
            }
        }
    }

    fn after_frame(&self, frame: u64) -> Result<()> {
        if let Some(imports) = &self.imports {
            imports
                .latest_frame
                .fetch_max(frame, std::sync::atomic::Ordering::AcqRel);
        }
        Ok(())
    }

    fn device_ptr(&self, index: usize, t: &TensorInfo) -> Result<u64> {
        self.imports
            .as_ref()
            .and_then(|i| i.device_ptr(index, t))
            .ok_or_else(|| Error::NotOnHost {
                tensor: t.name.clone(),
                location: t.location().name(),
            })
    }

    fn host_ptr(&self, index: usize, t: &TensorInfo) -> Option<NonNull<u8>> {
        self.imports.as_ref()?.host_ptr(index, t)
    }

    fn place(&self, index: usize, t: &TensorInfo) -> Result<Option<DevicePlace>> {
        if t.location() != Location::Vulkan {
            return Ok(None);
        }
        let imports = self.imports.as_ref().ok_or(Error::Closed(Peer::Client))?;
        let not_imported = || Error::InvalidTensor {
            tensor: t.name.clone(),
            reason: "not imported".into(),
        };
        let ptr = imports.device_ptr(index, t).ok_or_else(not_imported)?;
        let device = match &self.importer {
            // Mapped on the CPU: host memory of this process, outside the region, held
            // open by the lease.
            #[cfg(feature = "vulkan")]
            Importer::Vulkan(_) => Device::Host,
            Importer::Device(device) => device.device()?,
        };
        Ok(Some(DevicePlace {
            ptr,
            device,
            lease: imports.clone(),
        }))
    }

    fn order_after_frame(&self, stream: StreamRef<'_>) -> Result<()> {
        match &self.imports {
            Some(imports) => imports.order_after_frame(stream),
            None => Ok(()),
        }
    }

    unsafe fn copy_into(&self, _: u64, _: u64, _: usize, _: StreamRef<'_>) -> Result<()> {
        Err(Error::OutOfOrder(
            "a device copy into a Vulkan client's tensors: they are engine->client only",
        ))
    }

    fn dlpack_device(&self, index: usize, t: &TensorInfo) -> (i32, i32) {
        match (
            &self.importer,
            self.imports.as_ref().and_then(|i| i.get(index)),
        ) {
            (Importer::Device(device), Some(_)) => device.dlpack_device(),
            #[cfg(feature = "vulkan")]
            (Importer::Vulkan(_), Some(_)) => (crate::layout::location::DL_CPU, 0),
            _ => t.device.dlpack(),
        }
    }

    fn release(&mut self, _: &dyn ControlMapping) {
        // The engine needs no acknowledgement: an import holds its own reference to the
        // memory, so each mapping goes when its last holder (this client or a view) does.
        self.imports = None;
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl dyn ClientBackend {
    /// The Vulkan side of a client of Vulkan tensors; `None` for any other backend.
    pub fn as_vulkan(&self) -> Option<&ClientVulkan> {
        self.as_any().downcast_ref()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::layout::VulkanTable;

    const ENGINE: VulkanDevice = VulkanDevice {
        device_uuid: [7; 16],
        driver_uuid: [1; 16],
    };

    #[test]
    fn auto_takes_the_device_importer_only_for_the_engines_device() {
        let (c, why) = choose_importer(
            VulkanImporter::Auto,
            ENGINE,
            "XPU",
            Ok(vec![[3; 16], [7; 16]]),
        )
        .unwrap();
        assert_eq!(c, ImporterChoice::Device { ordinal: 1 });
        assert!(why.contains("XPU device 1"), "{why}");
        let (c, why) =
            choose_importer(VulkanImporter::Auto, ENGINE, "XPU", Ok(vec![[3; 16]])).unwrap();
        assert_eq!(c, ImporterChoice::Vulkan);
        assert!(why.contains("no XPU device"), "{why}");
        let (c, why) =
            choose_importer(VulkanImporter::Auto, ENGINE, "XPU", Err("no driver".into())).unwrap();
        assert_eq!(c, ImporterChoice::Vulkan);
        assert_eq!(why, "no driver");
    }

    #[test]
    fn a_requested_importer_is_taken_or_refused() {
        let (c, _) =
            choose_importer(VulkanImporter::Vulkan, ENGINE, "XPU", Ok(vec![[7; 16]])).unwrap();
        assert_eq!(
            c,
            ImporterChoice::Vulkan,
            "vulkan requested wins over a match"
        );
        let e =
            choose_importer(VulkanImporter::Cuda, ENGINE, "XPU", Ok(vec![[3; 16]])).unwrap_err();
        assert!(
            matches!(&e, Error::CudaUnavailable { reason } if reason.contains("07070707") && reason.contains("into XPU")),
            "{e}"
        );
        let e = choose_importer(VulkanImporter::Cuda, ENGINE, "XPU", Err("no driver".into()));
        assert!(matches!(e, Err(Error::CudaUnavailable { .. })));
    }

    /// A device importer that maps nothing: each import holds the bytes read from its
    /// fd, and its "device addresses" are theirs. It records what the client asks of it.
    #[derive(Default)]
    struct Recorder(Arc<std::sync::Mutex<Vec<String>>>);

    impl Recorder {
        fn say(&self, what: String) {
            self.0.lock().unwrap().push(what);
        }
        fn said(&self) -> Vec<String> {
            std::mem::take(&mut *self.0.lock().unwrap())
        }
    }

    #[derive(Debug)]
    struct HeldBytes(Vec<u8>);

    impl FdMemory for HeldBytes {
        fn span(&self, offset: u64, len: u64) -> Option<u64> {
            let end = offset.checked_add(len)?;
            (end <= self.0.len() as u64).then(|| self.0.as_ptr() as u64 + offset)
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
            let at = offset as usize;
            out.copy_from_slice(&self.0[at..at + out.len()]);
            Ok(())
        }
    }

    #[derive(Debug)]
    struct Waits(Arc<std::sync::Mutex<Vec<String>>>);

    impl FdTimeline for Waits {
        fn wait(&self, stream: StreamRef<'_>, value: u64) -> Result<()> {
            let what = format!("wait stream {} for {value}", stream.raw());
            self.0.lock().unwrap().push(what);
            Ok(())
        }
    }

    impl FdImporter for Recorder {
        fn name(&self) -> &'static str {
            "the recorder"
        }
        fn describe(&self) -> String {
            "the recorder's importer".into()
        }
        fn device(&self) -> Result<Device> {
            Ok(Device::Cuda(crate::layout::location::CudaDevice {
                ordinal: 3,
                uuid: [9; 16],
            }))
        }
        fn dlpack_device(&self) -> (i32, i32) {
            (crate::layout::location::DL_CUDA, 3)
        }
        fn import_memory(
            &self,
            fd: OwnedFd,
            size: u64,
            dedicated: bool,
        ) -> Result<Box<dyn FdMemory>> {
            use std::os::unix::fs::FileExt;
            self.say(format!("memory of {size} bytes, dedicated {dedicated}"));
            let mut bytes = vec![0; size as usize];
            std::fs::File::from(fd)
                .read_exact_at(&mut bytes, 0)
                .unwrap();
            Ok(Box::new(HeldBytes(bytes)))
        }
        fn import_timeline(&self, _fd: OwnedFd) -> Result<Box<dyn FdTimeline>> {
            self.say("timeline".into());
            Ok(Box::new(Waits(self.0.clone())))
        }
        fn synchronize(&self, stream: Option<StreamRef<'_>>) -> Result<()> {
            self.say(format!("synchronize {:?}", stream.map(StreamRef::raw)));
            Ok(())
        }
        fn is_idle(&self, stream: Option<StreamRef<'_>>) -> Result<bool> {
            self.say(format!("is idle {:?}", stream.map(StreamRef::raw)));
            Ok(true)
        }
    }

    fn memfd(bytes: &[u8]) -> OwnedFd {
        let fd = rustix::fs::memfd_create("m", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::io::write(&fd, bytes).unwrap();
        fd
    }

    fn vulkan_tensor(name: &str, offset: u64, nbytes: u64, table: VulkanTable) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: crate::layout::DType::U8,
            shape: vec![nbytes],
            direction: crate::layout::Direction::EngineToClient,
            device: Device::Vulkan(ENGINE),
            offset,
            nbytes,
            cuda: None,
            vulkan: Some(table),
        }
    }

    fn layout_of(tensors: Vec<TensorInfo>) -> Layout {
        Layout {
            version: (crate::layout::VERSION_MAJOR, crate::layout::VERSION_MINOR),
            header_size: 0,
            region_size: 0,
            num_envs: 1,
            engine_pid: 0,
            engine_start_time: 0,
            engine_kind: "test".into(),
            tensors,
            rings: None,
            engine_event_handle: None,
            shards: Vec::new(),
            stats: None,
            shard_actions: false,
        }
    }

    fn client_on(recorder: &Recorder, layout: &Layout) -> ClientVulkan {
        ClientVulkan {
            name: "test".into(),
            timeout: Duration::from_secs(5),
            reason: "test".into(),
            imports: None,
            importer: Importer::Device(Arc::new(Recorder(recorder.0.clone()))),
            names: layout.tensors.iter().map(|t| t.name.clone()).collect(),
        }
    }

    /// The device importer is reached through the seam only: whatever implements
    /// `FdImporter` takes each tensor's memory fd (and its timeline semaphore's), hands
    /// out device pointers into the import, places the views on its device, orders the
    /// consumer's stream after the last frame, and drains it before an action is posted.
    #[test]
    fn any_fd_importer_serves_the_vulkan_client() {
        use crate::layout::SemaphoreKind;
        let table = |alloc_size, semaphore: Option<SemaphoreKind>| VulkanTable {
            alloc_size,
            memory_type_index: 0,
            dedicated: semaphore.is_some(),
            semaphore,
        };
        let layout = layout_of(vec![
            vulkan_tensor("rgb", 8, 16, table(32, Some(SemaphoreKind::Timeline))),
            vulkan_tensor("depth", 0, 4, table(4, None)),
        ]);
        let rgb_bytes: Vec<u8> = (0..32).collect();
        let recorder = Recorder::default();
        let mut client = client_on(&recorder, &layout);
        assert!(client.imports_into_device());
        let fds = vec![memfd(&rgb_bytes), memfd(b"s"), memfd(&[7, 7, 7, 7])];
        client.import_all(&layout, fds).unwrap();
        assert_eq!(
            recorder.said(),
            [
                "memory of 32 bytes, dedicated true",
                "timeline",
                "memory of 4 bytes, dedicated false"
            ]
        );
        let rgb = &layout.tensors[0];
        let ptr = client.device_ptr(0, rgb).unwrap();
        // SAFETY: the recorder's "device addresses" are those of the bytes its import
        // holds, alive while the client holds its imports.
        assert_eq!(
            unsafe { *(ptr as *const u8) },
            rgb_bytes[8],
            "the tensor's offset"
        );
        let place = client.place(0, rgb).unwrap().unwrap();
        assert_eq!(place.ptr, ptr);
        assert!(matches!(place.device, Device::Cuda(c) if c.ordinal == 3));
        assert_eq!(
            client.dlpack_device(0, rgb),
            (crate::layout::location::DL_CUDA, 3)
        );
        assert!(
            client.host_ptr(0, rgb).is_none(),
            "device memory is not host memory"
        );
        let mut out = [0u8; 16];
        client.read_tensor(0, rgb, &mut out).unwrap();
        assert_eq!(out[..], rgb_bytes[8..24]);
        // SAFETY: the recorder never touches a stream; 77 only travels as a number.
        let stream = unsafe { StreamRef::from_raw(77) };
        client.after_frame(5).unwrap();
        client.after_frame(4).unwrap();
        client.order_after_frame(stream).unwrap();
        assert_eq!(recorder.said(), ["wait stream 77 for 5"]);
        // A semaphore the stream waits on: a bounded poll, not a blocking drain.
        client
            .before_post(Some(stream), Duration::from_secs(5), &|| Ok(()))
            .unwrap();
        assert_eq!(recorder.said(), ["is idle Some(77)"]);
        drop(client);

        // Without a semaphore: the consumer's stream (the default one) is drained.
        let layout = layout_of(vec![vulkan_tensor("depth", 0, 4, table(4, None))]);
        let mut client = client_on(&recorder, &layout);
        client
            .import_all(&layout, vec![memfd(&[1, 2, 3, 4])])
            .unwrap();
        recorder.said();
        client.order_after_frame(stream).unwrap();
        client
            .before_post(None, Duration::from_secs(5), &|| Ok(()))
            .unwrap();
        assert_eq!(recorder.said(), ["synchronize None"]);
    }

    /// The fds the engine sends must be the ones the table calls for, through any
    /// importer: fewer or more is the engine's `Protocol` error.
    #[test]
    fn the_fd_count_is_checked_whatever_the_importer() {
        let table = VulkanTable {
            alloc_size: 4,
            memory_type_index: 0,
            dedicated: false,
            semaphore: None,
        };
        let layout = layout_of(vec![vulkan_tensor("depth", 0, 4, table)]);
        let recorder = Recorder::default();
        for fds in [vec![], vec![memfd(&[0; 4]), memfd(&[0; 4])]] {
            let e = client_on(&recorder, &layout)
                .import_all(&layout, fds)
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Protocol {
                        peer: Peer::Engine,
                        ..
                    }
                ),
                "{e}"
            );
        }
    }
}
