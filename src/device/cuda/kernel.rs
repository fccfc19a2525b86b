//! Kernels: CUDA C compiled at run time with NVRTC ([`compile_cubin`], [`compile`],
//! [`build`]), loaded as a [`Module`] and launched on a stream ([`Module::launch`]). On
//! top of the driver layer ([`super::driver`]): every entry point takes a probed
//! [`Driver`] or an object made from one, and NVRTC is checked for every symbol cudarc
//! calls before the first call.

use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::driver::{check, missing, Driver, PrimaryContext, Stream};
pub use super::Arg;
use crate::error::{Error, Result};

/// Every NVRTC symbol cudarc's `compile_ptx_with_opts` calls.
const NVRTC_SYMBOLS: &[&str] = &[
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcDestroyProgram",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
];

/// What NVRTC compiles to: PTX (for the driver to compile) or a cubin (machine code)
/// for one compute capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Ptx,
    Cubin(i32, i32),
}

/// A successful NVRTC compilation: the image and NVRTC's program log, which is empty
/// unless NVRTC warned (CI fails on a non-empty one: tests/cuda.rs).
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The PTX text (without its NUL) or the cubin (an ELF image).
    pub image: Vec<u8>,
    /// NVRTC's warnings, trimmed; empty when there were none.
    pub log: String,
}

/// Compiles CUDA C to PTX with NVRTC (loaded dynamically; `CudaUnavailable` if absent).
pub fn compile(_driver: &Driver, name: &str, source: &str, options: &[&str]) -> Result<String> {
    let ptx = compile_to(name, source, options, Target::Ptx)?.image;
    String::from_utf8(ptx).map_err(|_| Error::Cuda {
        call: "nvrtcGetPTX",
        detail: format!("{name}: NVRTC produced PTX that is not UTF-8"),
    })
}

/// Compiles CUDA C to a cubin (machine code) for compute capability `arch` with NVRTC.
/// Needs NVRTC only, no driver or device. A cubin loads on any driver of NVRTC's CUDA
/// major version (minor-version compatibility), whereas PTX must be compiled by the
/// driver, which refuses PTX from a newer NVRTC than itself
/// (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). An architecture NVRTC does not know is an
/// `Error::Cuda` (then fall back to [`compile`]).
pub fn compile_cubin(
    name: &str,
    source: &str,
    options: &[&str],
    arch: (i32, i32),
) -> Result<Vec<u8>> {
    Ok(compile_to(name, source, options, Target::Cubin(arch.0, arch.1))?.image)
}

/// Compiles CUDA C with NVRTC to `target`, and returns the image with NVRTC's log (its
/// warnings). Needs NVRTC only, no driver or device. A compile error is an `Error::Cuda`
/// that quotes the log; `CudaUnavailable` where NVRTC is missing.
pub fn compile_to(name: &str, source: &str, options: &[&str], target: Target) -> Result<Compiled> {
    use cudarc::nvrtc::{result, sys as nv};
    nvrtc_usable()?;
    let nul = |what: &str| Error::InvalidSpec(format!("kernel '{name}': {what} contains NUL"));
    let src = CString::new(source).map_err(|_| nul("the source"))?;
    let cname = CString::new(name).map_err(|_| nul("the name"))?;
    let mut opts: Vec<String> = options.iter().map(|s| s.to_string()).collect();
    let what = match target {
        Target::Ptx => "PTX".to_string(),
        Target::Cubin(major, minor) => {
            opts.push(format!("--gpu-architecture=sm_{major}{minor}"));
            format!("sm_{major}{minor}")
        }
    };
    // cudarc's compile_program unwraps each option's conversion to a C string.
    if opts.iter().any(|o| o.contains('\0')) {
        return Err(nul("an option"));
    }
    let nv_err = |call: &'static str, e: result::NvrtcError| Error::Cuda {
        call,
        detail: format!("{name} for {what}: {e:?}"),
    };
    let prog =
        result::create_program(&src, Some(&cname)).map_err(|e| nv_err("nvrtcCreateProgram", e))?;
    // Destroys the program on every path below.
    struct Program(nv::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: a program from nvrtcCreateProgram, destroyed once, here.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let prog = Program(prog);
    // SAFETY: a live program; the options hold no NUL (checked above).
    let compiled = unsafe { result::compile_program(prog.0, &opts) };
    // SAFETY: a live program whose compilation ran.
    let log = unsafe { result::get_program_log(prog.0) }
        .map(|l| {
            let bytes: Vec<u8> = l
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).trim().to_string()
        })
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(Error::Cuda {
            call: "nvrtcCompileProgram",
            detail: format!("{name} for {what}: {e:?} {log}"),
        });
    }
    type SizeOf = unsafe fn(nv::nvrtcProgram, *mut usize) -> nv::nvrtcResult;
    type Get = unsafe fn(nv::nvrtcProgram, *mut std::ffi::c_char) -> nv::nvrtcResult;
    let (size_of, get, calls): (SizeOf, Get, _) = match target {
        Target::Ptx => (
            nv::nvrtcGetPTXSize,
            nv::nvrtcGetPTX,
            ("nvrtcGetPTXSize", "nvrtcGetPTX"),
        ),
        Target::Cubin(..) => (
            nv::nvrtcGetCUBINSize,
            nv::nvrtcGetCUBIN,
            ("nvrtcGetCUBINSize", "nvrtcGetCUBIN"),
        ),
    };
    let mut size = 0usize;
    // SAFETY: a live, compiled program; valid out-pointer.
    unsafe { size_of(prog.0, &mut size) }
        .result()
        .map_err(|e| nv_err(calls.0, e))?;
    if size == 0 {
        return Err(Error::Cuda {
            call: calls.1,
            detail: format!("{name}: NVRTC produced no image for {what}"),
        });
    }
    let mut image = vec![0u8; size];
    // SAFETY: `image` has the `size` bytes NVRTC asked for.
    unsafe { get(prog.0, image.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| nv_err(calls.1, e))?;
    if target == Target::Ptx {
        // PTX is a C string: its size counts the NUL.
        let text = image.iter().position(|&b| b == 0).unwrap_or(image.len());
        image.truncate(text);
    }
    Ok(Compiled { image, log })
}

/// `CudaUnavailable` unless libnvrtc loads and has every entry point used here.
fn nvrtc_usable() -> Result<()> {
    // SAFETY: only dlopen()s the candidate library names and drops the handles.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::CudaUnavailable {
            reason: "NVRTC (libnvrtc.so) cannot be loaded: install the CUDA toolkit's \
                     nvrtc library (e.g. the nvidia-cuda-nvrtc-cu12 wheel) on the loader path"
                .into(),
        });
    }
    // SAFETY: the library loads (checked above) and `culib` tries the same names.
    let lib = unsafe { cudarc::nvrtc::sys::culib() };
    let absent = missing(NVRTC_SYMBOLS, |n| {
        // SAFETY: a dlsym lookup only; the pointer is never called or dereferenced.
        unsafe { lib.get::<*const c_void>(n.as_bytes()) }.is_ok()
    });
    if !absent.is_empty() {
        return Err(Error::CudaUnavailable {
            reason: format!("NVRTC lacks {}", absent.join(", ")),
        });
    }
    Ok(())
}

/// A loaded module (PTX) in a context. Unloaded on drop.
#[derive(Debug)]
pub struct Module {
    raw: sys::CUmodule,
    /// The kernels launched so far, by name: `cuModuleGetFunction` runs once per kernel,
    /// not once per launch. Valid while the module is loaded (until our drop).
    functions: Mutex<Vec<(String, sys::CUfunction)>>,
    ctx: Arc<PrimaryContext>,
}

// SAFETY: CUmodule and CUfunction are driver handles usable from any thread; the cache
// of functions is behind a mutex.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// Loads a cubin from [`compile_cubin`].
    pub fn load_cubin(ctx: &Arc<PrimaryContext>, cubin: &[u8]) -> Result<Module> {
        // SAFETY: `cubin` is an ELF image from NVRTC (the driver validates it and fails
        // on garbage) that lives through the call.
        unsafe { Module::load_image(ctx, cubin.as_ptr().cast()) }
    }

    pub fn load(ctx: &Arc<PrimaryContext>, ptx: &str) -> Result<Module> {
        let image =
            CString::new(ptx).map_err(|_| Error::InvalidSpec("PTX contains a NUL byte".into()))?;
        // SAFETY: `image` is a NUL-terminated PTX string that lives through the call.
        unsafe { Module::load_image(ctx, image.as_ptr().cast()) }
    }

    /// `cuModuleLoadData` of `image` in `ctx`.
    ///
    /// # Safety
    /// `image` must point to a cubin or a NUL-terminated PTX string, valid for the call.
    unsafe fn load_image(ctx: &Arc<PrimaryContext>, image: *const c_void) -> Result<Module> {
        let _current = ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the caller's contract for `image`; context current.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut raw, image)
        })?;
        Ok(Module {
            raw,
            functions: Mutex::new(Vec::new()),
            ctx: ctx.clone(),
        })
    }

    /// The function `kernel` of this module: looked up with `cuModuleGetFunction` on its
    /// first launch (our context current), then from the cache.
    fn function(&self, kernel: &str) -> Result<sys::CUfunction> {
        let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&(_, f)) = functions.iter().find(|(name, _)| name == kernel) {
            return Ok(f);
        }
        let cname = CString::new(kernel)
            .map_err(|_| Error::InvalidSpec("kernel name contains NUL".into()))?;
        let mut f = std::ptr::null_mut();
        // SAFETY: valid out-pointer; live module; NUL-terminated name.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut f, self.raw, cname.as_ptr())
        })?;
        functions.push((kernel.to_string(), f));
        Ok(f)
    }

    /// Launches `kernel` over `n` threads (1-D grid, `block` threads per block).
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list exactly (types and order), and
    /// every pointer argument must be device memory valid for what the kernel does with
    /// it until the launch completes on `stream`.
    pub unsafe fn launch(
        &self,
        kernel: &str,
        stream: &Stream,
        n: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        let _current = self.ctx.bind()?;
        let f = self.function(kernel)?;
        // Each parameter's value lives in `vals`; `params` points at each one.
        let mut vals: Vec<[u8; 8]> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(v) | Arg::U64(v) => v.to_ne_bytes(),
                Arg::I64(v) => v.to_ne_bytes(),
                Arg::F64(v) => v.to_ne_bytes(),
                Arg::U32(v) => {
                    let mut b = [0u8; 8];
                    b[..4].copy_from_slice(&v.to_ne_bytes());
                    b
                }
                Arg::F32(v) => {
                    let mut b = [0u8; 8];
                    b[..4].copy_from_slice(&v.to_ne_bytes());
                    b
                }
            })
            .collect();
        let mut params: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v.as_mut_ptr() as *mut c_void)
            .collect();
        let block = block.max(1);
        let grid = super::blocks(n, block);
        // SAFETY: `f` is a function of this module; `params` holds one pointer per
        // argument, each to 8 bytes that outlive the call (the driver copies them before
        // returning); the caller guarantees they match the kernel's signature.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream.handle(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if let Ok(_current) = self.ctx.bind() {
            // SAFETY: a module we loaded, unloaded once.
            let _ = unsafe { sys::cuModuleUnload(self.raw) };
        }
    }
}

/// Compiles one kernel file for `ctx`'s device with `options` and loads it: a cubin for
/// its compute capability (loads on any driver of NVRTC's major version), else, when
/// NVRTC cannot target that architecture or the driver refuses the cubin, PTX for the
/// driver to compile. `CudaUnavailable` where NVRTC is missing.
pub fn build(
    driver: &Driver,
    ctx: &Arc<PrimaryContext>,
    file: &str,
    source: &str,
    options: &[&str],
) -> Result<Module> {
    let arch = ctx.compute_capability()?;
    let cubin = compile_cubin(file, source, options, arch)
        .and_then(|image| Module::load_cubin(ctx, &image));
    match cubin {
        Ok(module) => Ok(module),
        Err(e @ Error::CudaUnavailable { .. }) => Err(e),
        Err(first) => {
            // Both failures in the error: the cubin's is usually the telling one (an
            // architecture NVRTC does not know, a driver older than NVRTC).
            let both = |call, e: Error| Error::Cuda {
                call,
                detail: format!("{file}: cubin: {first}; PTX: {e}"),
            };
            let ptx = compile(driver, file, source, options)
                .map_err(|e| both("nvrtcCompileProgram", e))?;
            Module::load(ctx, &ptx).map_err(|e| both("cuModuleLoadData", e))
        }
    }
}
