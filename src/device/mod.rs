//! Where bytes live: the one location type, device requests, and the backends behind
//! one seam.
//!
//! - [`location`]: [`Device`], the plain data type `layout` encodes (defined there,
//!   re-exported here);
//! - [`request`]: `cpu | cuda | cuda:N | auto`, and what it resolves to here;
//! - [`backend`]: the engine's and the client's hooks ([`EngineBackend`],
//!   [`ClientBackend`]);
//! - [`host`]: host memory (every hook a no-op); [`cuda`]: CUDA IPC (driver layer,
//!   exports and imports, events), compiled in every build, served with the `cuda`
//!   feature; [`vulkan`]: Vulkan external memory passed as fds (1.3), served with the
//!   `vulkan` feature (and imported into a device, CUDA with the `cuda` feature, through
//!   [`fd_importer`]);
//! - [`compute`]: device code an env runs on its engine's device (CUDA kernels, a Vulkan
//!   compute shader), through types that name no backend's own.
//!
//! [`engine_backend`] and [`client_backend`] are the one place that picks a backend for
//! a layout. Outside the backends' folders, the code that knows the `cuda` and `vulkan`
//! features is: this file ([`client_backend`], [`built_for`], [`cuda_stream`]),
//! [`importers`] ([`fd_import_devices`], [`fd_importer`]), [`compute`] (each kind of
//! device code with its feature, the typed error without) and `src/os.rs` (only
//! dead-code allowances on the platform calls a backend alone uses); `docs/backends.md`
//! says why. No backend's folder names another: what one needs of another (the
//! Vulkan client importing into CUDA) is a trait of [`backend`] ([`FdImporter`]) that
//! the other implements, handed out here. [`compute`] is how the envs run device code
//! without them. A new kind of memory is one more folder here, one
//! [`Device`] variant and one arm in each: `docs/backends.md` lists every file it
//! touches, and why.

pub mod backend;
pub mod compute;
pub mod cuda;
pub mod host;
pub mod importers;
pub mod request;
pub mod server;
pub mod vulkan;

/// Where a tensor lives: layout vocabulary ([`crate::layout::location`]), re-exported
/// here, where the backends that serve each place are.
pub mod location {
    pub use crate::layout::location::*;
}

pub use backend::{
    ClientBackend, DeviceLease, DevicePlace, DeviceRelease, EngineBackend, FdImporter, FdMemory,
    FdTimeline, StreamRef,
};
pub use cuda::share::CudaSharingRequest;
pub use cuda::CudaInfo;
pub use importers::{fd_import_devices, fd_importer, fd_importer_name};
pub use location::{CudaDevice, Device, Location, VulkanDevice, DL_CPU, DL_CUDA, DL_VULKAN};
pub use request::{resolve_with, DeviceChoice, DeviceRequest, VulkanImporter};

use crate::error::Result;
use crate::layout::{HeaderBuilder, Layout};

/// Whether CUDA can be used in this process: `Ok` with what was found, or
/// `CudaUnavailable` with the reason. Never panics; cheap after the first call (the
/// result is cached for the life of the process).
pub fn probe() -> Result<CudaInfo> {
    #[cfg(feature = "cuda")]
    {
        cuda::driver::Driver::get().map(|d| d.info().clone())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(cuda::unavailable_without_feature())
    }
}

/// `Ok` where this build serves memory at `location`: host memory always, CUDA with the
/// `cuda` feature, Vulkan with `vulkan`; else the `CudaUnavailable` or
/// `VulkanUnavailable` every path of such a build gives. Whether this machine can is
/// another question ([`probe`]).
pub fn built_for(location: Location) -> Result<()> {
    match location {
        Location::Host => Ok(()),
        Location::Cuda if cfg!(feature = "cuda") => Ok(()),
        Location::Cuda => Err(cuda::unavailable_without_feature()),
        Location::Vulkan if cfg!(feature = "vulkan") => Ok(()),
        Location::Vulkan => Err(vulkan::unavailable_without_feature()),
    }
}

/// The CUDA stream an engine's kernels go on (its backend `engine`; `name` for the
/// message): `CudaUnavailable` in a build without the `cuda` feature, or for an engine
/// with no tensor on CUDA.
pub fn cuda_stream<'a>(engine: &'a dyn EngineBackend, name: &str) -> Result<StreamRef<'a>> {
    built_for(Location::Cuda)?;
    engine
        .stream()
        .ok_or_else(|| crate::error::Error::CudaUnavailable {
            reason: format!("engine '{name}' has no tensor on CUDA"),
        })
}

/// Resolves a request against this machine: `Host` always works; `Cuda` needs a usable
/// driver and the device (else `CudaUnavailable`); `Auto` takes CUDA device 0 when it is
/// usable and host memory otherwise, giving the reason in [`DeviceChoice::reason`].
pub fn resolve(requested: DeviceRequest) -> Result<DeviceChoice> {
    resolve_with(requested, probe())
}

/// The engine's backend for the tensors `builder` placed: host memory, or the CUDA
/// allocation it creates and exports into `builder` (before the region, hence `magic`,
/// exists), shared as `cuda_sharing` asks ([`cuda::share::decide`]). `CudaUnavailable`
/// without a usable driver or device, or the feature.
pub fn engine_backend(
    builder: &mut HeaderBuilder,
    name: &str,
    cuda_sharing: CudaSharingRequest,
) -> Result<Box<dyn EngineBackend>> {
    if !builder.vulkan.is_empty() {
        #[cfg(feature = "vulkan")]
        {
            return Ok(Box::new(vulkan::engine::EngineVulkan::create(
                builder, name,
            )?));
        }
        #[cfg(not(feature = "vulkan"))]
        {
            let _ = name;
            return Err(vulkan::unavailable_without_feature());
        }
    }
    if builder.cuda_alloc.is_none() {
        return Ok(Box::new(host::HostEngine));
    }
    #[cfg(feature = "cuda")]
    {
        Ok(Box::new(cuda::ipc::EngineCuda::create(
            builder,
            name,
            cuda_sharing,
        )?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = cuda_sharing;
        Err(cuda::unavailable_without_feature())
    }
}

/// How many fds the engine of `layout` serves its attached client over the region's
/// socket: the Vulkan tensors' (1.3) or the CUDA allocation's when it is shared by fd
/// (1.9). A client of such a layout holds its proof from before its claim.
pub fn fd_count(layout: &Layout) -> usize {
    vulkan::fd_count(layout) + cuda::share::fd_count(layout)
}

/// The client's backend for a validated layout: host memory, CUDA imports (the driver
/// probed, the device found, the client's event created), or Vulkan imports (the
/// importer chosen and its device opened): nothing in the region touched yet, so a
/// failure leaves no trace there. `name`: the region (Vulkan fds come over its socket,
/// within `timeout`); `importer`: which importer takes Vulkan tensors.
pub fn client_backend(
    layout: &Layout,
    name: &str,
    importer: VulkanImporter,
    timeout: std::time::Duration,
) -> Result<Box<dyn ClientBackend>> {
    if layout
        .tensors
        .iter()
        .any(|t| t.location() == Location::Vulkan)
    {
        if layout.has_cuda() {
            return Err(crate::error::Error::InvalidHeader {
                field: "location",
                reason: "CUDA and Vulkan tensors in one table (protocol 1.3 serves one kind)"
                    .into(),
            });
        }
        return Ok(Box::new(vulkan::client::ClientVulkan::prepare(
            layout, name, importer, timeout,
        )?));
    }
    let Some(t) = layout
        .tensors
        .iter()
        .find(|t| t.location() == Location::Cuda)
    else {
        return Ok(Box::new(host::HostClient));
    };
    // Chosen before anything else (no driver needed): IPC handles of an engine in
    // another PID namespace are refused here, with the reason.
    let engine = crate::os::pid_namespace(layout.engine_pid, layout.engine_start_time);
    let sharing = cuda::choose_sharing(layout, engine)?.unwrap_or(crate::layout::CudaSharing::Ipc);
    #[cfg(feature = "cuda")]
    {
        let _ = t;
        Ok(Box::new(cuda::ipc::ClientCuda::prepare(
            layout, sharing, name, timeout,
        )?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = sharing;
        use crate::error::Error;
        let reason = match cuda::unavailable_without_feature() {
            Error::CudaUnavailable { reason } => reason,
            e => e.to_string(),
        };
        Err(Error::CudaUnavailable {
            reason: format!("tensor '{}' lives on CUDA: {reason}", t.name),
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::error::Error;

    /// The seam is the only way between backends: no code (comments aside) in a
    /// backend's folder names another backend's module or build feature; what one needs
    /// of another (the Vulkan client's device importer) comes through `backend.rs` and
    /// this file ([`fd_importer`]).
    #[test]
    fn no_backend_folder_names_another() {
        let folders = ["cuda", "vulkan"];
        for folder in folders {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("src/device")
                .join(folder);
            for file in std::fs::read_dir(&dir).unwrap() {
                let path = file.unwrap().path();
                let text = std::fs::read_to_string(&path).unwrap();
                for other in folders.iter().filter(|o| **o != folder) {
                    if let Some(how) = names_backend(&text, other) {
                        panic!("{} names {other}: {how}", path.display());
                    }
                }
            }
        }
    }

    /// The checker above on the forms a path to another backend can take: a plain path,
    /// a group (at any place in it), the folder's parent renamed, the feature; and what
    /// it must let pass (comments, strings, a `Cuda` variant, `layout::vulkan`).
    #[test]
    fn the_seam_check_sees_every_form_of_a_path() {
        for code in [
            "use crate::device::cuda::driver;",
            "use crate :: device :: cuda;",
            "use crate::device::{cuda::driver};",
            "use crate::device::{\n    host,\n    cuda::{driver, ipc},\n};",
            "use crate::{layout::Layout, device::{backend::X, cuda}};",
            "use super::super::cuda as c;",
            "use super::super::{host, cuda};",
            "use crate::device as d; fn f() { d::cuda::x() }",
            "use super::super as d;",
            "use crate::device::{self as d};",
            "#[cfg(feature = \"cuda\")] fn f() {}",
            "#[cfg(all(unix, feature=\"cuda\"))] fn f() {}",
        ] {
            assert!(names_backend(code, "cuda").is_some(), "not seen: {code}");
        }
        for code in [
            "// use crate::device::cuda;\nfn f() {}",
            "/* use crate::device::{cuda}; */ fn f() {}",
            "fn f() -> &'static str { \"crate::device::cuda, feature = cuda\" }",
            "fn f(c: char) -> bool { c == '\"' || c == '\\'' } use crate::device::backend;",
            "fn r#type() -> &'static str { r#\"device::cuda\"# }",
            "match x { VulkanImporter::Cuda => Device::Cuda(c) }",
            "use crate::layout::vulkan::SharedFd; use crate::device::{backend::{cuda_like}};",
            "let cuda = device.cuda_ordinal();",
        ] {
            assert_eq!(names_backend(code, "cuda"), None, "{code}");
        }
    }

    /// Where `code` names the backend module `other` of `src/device` (through
    /// `device::` or `super::super::`, in a path or a group, or by renaming the
    /// folder's parent) or its build feature: the tokens that do, or `None`.
    fn names_backend(code: &str, other: &str) -> Option<String> {
        let t = tokens(code);
        let at = |i: usize, s: &str| t.get(i).is_some_and(|x| x == s);
        let quoted = format!("\"{other}\"");
        for i in 0..t.len() {
            let shown = || t[i.saturating_sub(4)..(i + 6).min(t.len())].join(" ");
            if at(i, "feature") && at(i + 1, "=") && at(i + 2, &quoted) {
                return Some(shown());
            }
            // The parent of the backends' folders: `device` or `super::super`.
            let after = if at(i, "device") && at(i + 1, "::") {
                i + 2
            } else if at(i, "super") && at(i + 1, "::") && at(i + 2, "super") {
                if at(i + 3, "as") {
                    return Some(shown());
                }
                if !at(i + 3, "::") {
                    continue;
                }
                i + 4
            } else {
                if at(i, "device") && at(i + 1, "as") && i > 0 && at(i - 1, "::") {
                    return Some(shown()); // `use crate::device as d;`
                }
                continue;
            };
            if at(after, other) {
                return Some(shown());
            }
            if at(after, "{") {
                // The group's first segments (depth 1): `{host, cuda::driver, self as d}`.
                let mut depth = 0;
                let mut segment_start = true;
                for (j, token) in t.iter().enumerate().skip(after) {
                    match token.as_str() {
                        "{" => {
                            depth += 1;
                            segment_start = true;
                            continue;
                        }
                        "}" => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        "," => {
                            segment_start = true;
                            continue;
                        }
                        s if depth == 1
                            && segment_start
                            && (s == other || (s == "self" && at(j + 1, "as"))) =>
                        {
                            return Some(shown());
                        }
                        _ => {}
                    }
                    segment_start = false;
                }
            }
        }
        None
    }

    /// Rust source as tokens, comments left out: identifiers, `::`, string literals
    /// whole (quotes kept), any other character alone.
    fn tokens(code: &str) -> Vec<String> {
        let c: Vec<char> = code.chars().collect();
        let mut out = Vec::new();
        let peek = |i: usize, k: usize| c.get(i + k).copied();
        let mut i = 0;
        while i < c.len() {
            if c[i].is_whitespace() {
                i += 1;
            } else if c[i] == '/' && peek(i, 1) == Some('/') {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            } else if c[i] == '/' && peek(i, 1) == Some('*') {
                let mut depth = 0;
                while i < c.len() {
                    if c[i] == '/' && peek(i, 1) == Some('*') {
                        depth += 1;
                        i += 2;
                    } else if c[i] == '*' && peek(i, 1) == Some('/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            } else if c[i] == '"' || (c[i] == 'r' && raw_string_at(&c[i + 1..])) {
                // A string, raw (`r#"…"#`) or not.
                let start = i;
                let raw = c[i] == 'r';
                let mut hashes = 0;
                if raw {
                    i += 1;
                    while c.get(i) == Some(&'#') {
                        hashes += 1;
                        i += 1;
                    }
                }
                i += 1; // the opening quote
                while i < c.len() {
                    if !raw && c[i] == '\\' {
                        i += 2;
                    } else if c[i] == '"' && (0..hashes).all(|k| c.get(i + 1 + k) == Some(&'#')) {
                        i += 1 + hashes;
                        break;
                    } else {
                        i += 1;
                    }
                }
                out.push(c[start..i.min(c.len())].iter().collect());
            } else if c[i] == '\'' && (peek(i, 1) == Some('\\') || peek(i, 2) == Some('\'')) {
                // A char literal (a lifetime's quote falls through to "any other").
                i += if peek(i, 1) == Some('\\') { 3 } else { 2 };
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c[i].is_alphanumeric() || c[i] == '_' {
                let start = i;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                out.push(c[start..i].iter().collect());
            } else if c[i] == ':' && peek(i, 1) == Some(':') {
                out.push("::".into());
                i += 2;
            } else {
                out.push(c[i].to_string());
                i += 1;
            }
        }
        out
    }

    /// Whether `c`, after an `r`, goes on as a raw string (`"…"` or `#"…"#`), not as a
    /// raw identifier (`r#type`).
    fn raw_string_at(c: &[char]) -> bool {
        c.iter().find(|x| **x != '#') == Some(&'"')
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
