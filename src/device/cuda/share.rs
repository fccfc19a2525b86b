//! How an engine shares its CUDA allocation (protocol 1.9, `docs/protocol.md` §3.5.1):
//! by CUDA IPC handle (1.2) or by file descriptor over the region's fd socket. The
//! choice and the fd's travel need no driver, so this module is compiled in every build
//! (and tested without a GPU); the allocation itself is `driver::FdMemory`.

use std::os::fd::OwnedFd;
use std::time::Duration;

use crate::control::ControlMapping;
use crate::error::{Error, Peer, Result};
use crate::layout::{CudaSharing, Layout};

/// What an engine is asked to do with its CUDA allocation (`EngineSpec::cuda_sharing`,
/// Python `cuda_sharing=`, C `shmb_spec_set_cuda_sharing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaSharingRequest {
    /// [`decide`]: by file descriptor when the engine runs in a container (a PID
    /// namespace other than the host's) and its device can, else by IPC handle.
    #[default]
    Auto,
    /// CUDA IPC handles (1.2): a client in the engine's PID namespace only.
    Ipc,
    /// By file descriptor (1.9): any client that shares /dev/shm, whatever its PID
    /// namespace; `CudaUnavailable` where the driver or device cannot.
    Fd,
}

impl CudaSharingRequest {
    /// `auto`, `ipc` or `fd` (case-insensitive, surrounding blanks ignored). Anything
    /// else is `InvalidSpec`.
    pub fn parse(s: &str) -> Result<CudaSharingRequest> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(CudaSharingRequest::Auto),
            "ipc" => Ok(CudaSharingRequest::Ipc),
            "fd" => Ok(CudaSharingRequest::Fd),
            _ => Err(Error::InvalidSpec(format!(
                "cuda_sharing '{s}': expected auto, ipc or fd"
            ))),
        }
    }

    /// Its C ABI code: 0 auto, 1 ipc, 2 fd.
    pub fn from_code(code: u32) -> Result<CudaSharingRequest> {
        match code {
            0 => Ok(CudaSharingRequest::Auto),
            1 => Ok(CudaSharingRequest::Ipc),
            2 => Ok(CudaSharingRequest::Fd),
            _ => Err(Error::InvalidSpec(format!(
                "cuda_sharing code {code}: expected 0 (auto), 1 (ipc) or 2 (fd)"
            ))),
        }
    }
}

/// How the engine shares its allocation, decided when it creates its region (the choice
/// is then written in every CUDA entry of the table, where each client reads it at
/// attach: `super::choose_sharing`). `host_namespace`: whether the engine runs in the
/// host's PID namespace (`os::in_initial_pid_namespace`, `None`: unknown); `fd`: whether
/// its device can share by fd (`Err(why not)`).
///
/// `auto` takes fd sharing when the engine runs in a container and its device can: a
/// learner in another container (the usual reason to containerise an engine) cannot
/// open IPC handles, while fd sharing works for a learner anywhere. On the host it takes
/// IPC handles: a learner in the host's PID namespace opens them, and the frames are
/// ordered on the GPU by IPC events (fd sharing orders them on the host, one stream
/// synchronisation per step on each side, §3.5.1). A learner in a container driving an
/// engine on the host is told, at attach, to ask for `fd`.
pub fn decide(
    request: CudaSharingRequest,
    host_namespace: Option<bool>,
    fd: std::result::Result<(), String>,
) -> Result<CudaSharing> {
    match (request, fd) {
        (CudaSharingRequest::Ipc, _) => Ok(CudaSharing::Ipc),
        (CudaSharingRequest::Fd, Ok(())) => Ok(CudaSharing::Fd),
        (CudaSharingRequest::Fd, Err(why)) => Err(Error::CudaUnavailable {
            reason: format!(
                "cuda_sharing 'fd' was asked for, and CUDA memory cannot be shared by file \
                 descriptor here: {why} (use 'ipc' or 'auto')"
            ),
        }),
        (CudaSharingRequest::Auto, Ok(())) if host_namespace != Some(true) => Ok(CudaSharing::Fd),
        (CudaSharingRequest::Auto, _) => Ok(CudaSharing::Ipc),
    }
}

/// How many fds the engine sends for `layout`'s CUDA tensors (1.9): one, the
/// allocation's, when they are shared by fd; else none.
pub fn fd_count(layout: &Layout) -> usize {
    usize::from(
        layout
            .tensors
            .iter()
            .any(|t| t.cuda.is_some_and(|c| c.sharing == CudaSharing::Fd)),
    )
}

/// The engine's fd of its CUDA allocation, for a client of a `layout` shared by fd, over
/// region `name`'s fd socket: from the engine and nobody else, and only to the attached
/// client (`region` holds its proof), within `timeout`
/// ([`crate::device::server::receive`]). The fd is untrusted: the driver's import is
/// what checks it is such an allocation, of at least the table's `export_size`.
pub fn receive(
    name: &str,
    layout: &Layout,
    region: &dyn ControlMapping,
    timeout: Duration,
) -> Result<OwnedFd> {
    if fd_count(layout) != 1 {
        return Err(Error::InvalidSpec(
            "no CUDA tensor of this layout is shared by fd".into(),
        ));
    }
    let mut fds = crate::device::server::receive(name, layout, region, 1, timeout)?;
    match (fds.pop(), fds.is_empty()) {
        (Some(fd), true) => Ok(fd),
        _ => Err(Error::Protocol {
            peer: Peer::Engine,
            detail: "the reply did not carry exactly the one fd of the CUDA allocation".into(),
        }),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_auto_takes_fd_in_a_container() {
        use CudaSharingRequest::{Auto, Fd, Ipc};
        assert_eq!(CudaSharingRequest::parse(" FD ").unwrap(), Fd);
        assert_eq!(CudaSharingRequest::parse("ipc").unwrap(), Ipc);
        assert_eq!(CudaSharingRequest::parse("auto").unwrap(), Auto);
        assert_eq!(CudaSharingRequest::default(), Auto);
        assert!(matches!(
            CudaSharingRequest::parse("vmm"),
            Err(Error::InvalidSpec(m)) if m.contains("auto, ipc or fd")
        ));
        assert_eq!(CudaSharingRequest::from_code(2).unwrap(), Fd);
        assert!(CudaSharingRequest::from_code(3).is_err());
        let no = || Err("device 0 does not support POSIX file descriptor handles".to_string());
        // auto: fd in a container (or where it cannot tell) when the device can.
        assert_eq!(decide(Auto, Some(false), Ok(())).unwrap(), CudaSharing::Fd);
        assert_eq!(decide(Auto, None, Ok(())).unwrap(), CudaSharing::Fd);
        assert_eq!(decide(Auto, Some(true), Ok(())).unwrap(), CudaSharing::Ipc);
        // The fallback: a device that cannot share by fd keeps IPC handles.
        assert_eq!(decide(Auto, Some(false), no()).unwrap(), CudaSharing::Ipc);
        assert_eq!(decide(Ipc, Some(false), Ok(())).unwrap(), CudaSharing::Ipc);
        assert_eq!(decide(Fd, Some(true), Ok(())).unwrap(), CudaSharing::Fd);
        match decide(Fd, Some(true), no()) {
            Err(Error::CudaUnavailable { reason }) => {
                assert!(reason.contains("POSIX file descriptor handles"), "{reason}")
            }
            other => panic!("fd asked for where it cannot be: {other:?}"),
        }
    }

    // ---- The fd exchange for CUDA memory shared by fd, without a GPU: a memfd stands
    // in for the driver's fd (`FdMemory::export_fd`); the engine's server and the
    // client's `receive` are the ones `EngineCuda` and `ClientCuda` use. ----

    use crate::device::server::FdServer;
    use crate::layout::vulkan::SharedFd;
    use crate::layout::{DType, Direction, HeaderBuilder, TensorSpec};
    use crate::region::Region;
    use std::os::fd::{AsFd, BorrowedFd};

    const T: Duration = Duration::from_secs(10);
    const STAND_IN: &[u8] = b"the engine's CUDA allocation";

    /// A published region of a CUDA engine that shares by fd (1.9), made by this
    /// process as `Engine::create` makes it, and serving `fd` as its allocation's.
    fn engine_region(fd: OwnedFd) -> (Region, FdServer) {
        let specs = [
            TensorSpec::new("obs", DType::F32, &[4, 3], Direction::EngineToClient)
                .on(crate::device::Device::cuda(0)),
            TensorSpec::new("reward", DType::F32, &[4], Direction::EngineToClient),
        ];
        let mut b = HeaderBuilder::new("gpu", 4, &specs, 0).unwrap();
        b.set_cuda_fd_export([2; 16], 2 << 20);
        let name = crate::region::random_name().unwrap();
        let region = Region::create_unpublished(&name, &b).unwrap();
        crate::shard::lock_shard(&region, 0).unwrap();
        let server = FdServer::bind_and_start(&region, vec![SharedFd::new(fd)]).unwrap();
        region.publish().unwrap();
        (region, server)
    }

    fn stand_in() -> OwnedFd {
        let fd = rustix::fs::memfd_create("cuda", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::io::write(&fd, STAND_IN).unwrap();
        fd
    }

    /// What an fd received holds (read from its start).
    fn contents(fd: BorrowedFd<'_>) -> Vec<u8> {
        let mut buf = vec![0u8; 64];
        let n = rustix::io::pread(fd, &mut buf, 0).unwrap();
        buf.truncate(n);
        buf
    }

    /// A client of region `name` as `Client::attach` makes one, up to its import: opens
    /// and validates the region, chooses the CUDA path, holds its proof, claims the slot;
    /// then receives the allocation's fd.
    fn attach_and_receive(name: &str) -> Result<OwnedFd> {
        let (mut region, layout) = Region::open(name, T, || Ok(()))?;
        let engine = crate::os::pid_namespace(layout.engine_pid, layout.engine_start_time);
        assert_eq!(
            crate::device::cuda::choose_sharing(&layout, engine)?,
            Some(CudaSharing::Fd)
        );
        assert_eq!(crate::device::fd_count(&layout), 1);
        assert_eq!(layout.engine_event_handle, None, "fd sharing has no event");
        let me = crate::os::current_pid();
        let start = crate::os::process_start_time(me).unwrap();
        region.hold_client_lock(me, start)?;
        assert!(region.hold_client_proof()?);
        let control = region.control();
        control.claim_client(name, me, start, |_, _| false)?;
        control.attach_client();
        let fd = receive(name, &layout, &region, T);
        region.control().close_client();
        fd
    }

    #[test]
    fn the_attached_client_receives_the_allocations_fd() {
        let (region, _server) = engine_region(stand_in());
        let fd = attach_and_receive(region.name()).unwrap();
        assert_eq!(contents(fd.as_fd()), STAND_IN);
    }

    /// Nobody but the attached client gets the fd: a process that connects and proves
    /// nothing (a descriptor of another file), or before any client is attached, is
    /// refused, and the attached client still gets it afterwards.
    #[test]
    fn a_peer_that_is_not_the_attached_client_gets_no_fd() {
        let (region, _server) = engine_region(stand_in());
        let name = region.name().to_string();
        let path = crate::control::socket_path(&name).unwrap();
        let proof = rustix::fs::memfd_create("proof", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        match crate::fdpass::request(&name, &path, proof.as_fd(), 1, T) {
            Err(Error::Protocol { detail, .. }) => {
                assert!(detail.contains("not the attached client"), "{detail}")
            }
            Err(e) => panic!("expected a refusal, got {e}"),
            Ok(a) => panic!("an impostor got {} fd(s)", a.fds.len()),
        }
        // The region's own file, without the client's proof byte: no better.
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .open(format!("/dev/shm/{name}"))
            .unwrap();
        assert!(crate::fdpass::request(&name, &path, file.as_fd(), 1, T).is_err());
        let fd = attach_and_receive(&name).unwrap();
        assert_eq!(contents(fd.as_fd()), STAND_IN);
    }

    /// A process that took the engine's socket (it removed the engine's and bound its
    /// own) but cannot prove it owns the region is not shown the client's proof, and
    /// nothing it sends is taken.
    #[test]
    fn a_server_that_is_not_the_engine_is_refused() {
        let (region, mut server) = engine_region(stand_in());
        let name = region.name().to_string();
        let path = crate::control::socket_path(&name).unwrap();
        server.stop();
        std::fs::remove_file(&path).unwrap();
        let impostor = crate::fdpass::Listener::bind(&path).unwrap();
        let own = std::fs::File::options()
            .read(true)
            .write(true)
            .open(format!("/dev/shm/{name}"))
            .unwrap();
        std::thread::scope(|s| {
            let served = s.spawn(|| {
                let Some(conn) = impostor.accept() else {
                    return false;
                };
                conn.hello(crate::fdpass::ReplyStatus::Ok, Some(own.as_fd()), 1)
                    .unwrap();
                let request = conn.read_request();
                let fake = stand_in();
                let _ = conn.reply(crate::fdpass::ReplyStatus::Ok, &[fake.as_fd()]);
                request.is_ok()
            });
            let got = std::panic::catch_unwind(|| attach_and_receive(&name));
            // Whatever the client did, the impostor's wait ends (`accept` gives `None`).
            impostor.shutdown();
            let sent_proof = served.join().unwrap();
            let got = got.unwrap_or_else(|p| std::panic::resume_unwind(p));
            match got {
                Err(Error::Protocol { detail, .. }) => {
                    assert!(detail.contains("is not the engine of region"), "{detail}");
                    assert!(
                        detail.contains("proof of owning the region fails"),
                        "{detail}"
                    );
                }
                other => panic!("expected the impostor refused, got {other:?}"),
            }
            assert!(!sent_proof, "the client sent its proof");
        });
    }

    /// The client in a PID namespace of its own (`unshare --pid --fork --mount-proc`, as
    /// a learner in another container sees the engine: not at all) receives the fd over
    /// the socket in /dev/shm and reads what the engine's allocation holds. Skipped
    /// where the namespace cannot be made (not root).
    #[test]
    fn a_client_in_another_pid_namespace_receives_the_fd() {
        let (region, _server) = engine_region(stand_in());
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc"])
            .arg(&exe)
            .args([
                "--exact",
                "device::cuda::share::tests::peer_in_another_pid_namespace",
                "--ignored",
                "--nocapture",
            ])
            .env("SHMBRIDGE_TEST_CUDA_FD_REGION", region.name())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() && stderr.starts_with("unshare:") {
            eprintln!("SKIPPED a_client_in_another_pid_namespace_receives_the_fd: {stderr}");
            return;
        }
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert!(
            stdout.contains("ENGINE NOT SEEN") && stdout.contains("RECEIVED the engine's CUDA"),
            "{stdout}\n{stderr}"
        );
    }

    /// Not a test: the client of `a_client_in_another_pid_namespace_receives_the_fd`.
    #[test]
    #[ignore = "run by a_client_in_another_pid_namespace_receives_the_fd in a PID namespace"]
    fn peer_in_another_pid_namespace() {
        let Ok(name) = std::env::var("SHMBRIDGE_TEST_CUDA_FD_REGION") else {
            return;
        };
        let (_, layout) = Region::open(&name, T, || Ok(())).unwrap();
        if crate::os::pid_namespace(layout.engine_pid, layout.engine_start_time)
            == crate::error::PidNamespace::Other
        {
            println!("ENGINE NOT SEEN");
        }
        let fd = attach_and_receive(&name).unwrap();
        println!(
            "RECEIVED {}",
            String::from_utf8_lossy(&contents(fd.as_fd()))
        );
    }

    #[test]
    fn the_initial_pid_namespace_is_told_apart() {
        // Whatever this machine is, the answer agrees with the inode /proc shows.
        let ino = rustix::fs::stat("/proc/self/ns/pid").unwrap().st_ino as u64;
        assert_eq!(
            crate::os::in_initial_pid_namespace(),
            Some(ino == crate::os::INITIAL_PID_NAMESPACE_INO)
        );
    }
}
