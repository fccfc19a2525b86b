//! CUDA C sources of the reference engines' kernels (`kernels/*.cu`), embedded in the
//! binary and compiled at run time with NVRTC (with the `cuda` feature).

/// `kernels/null.cu`: the `null` engine's pattern.
pub const NULL_CU: &str = include_str!("../../kernels/null.cu");
/// `kernels/cartpole.cu`: the `cartpole` engine's dynamics, resets and autoreset.
pub const CARTPOLE_CU: &str = include_str!("../../kernels/cartpole.cu");

/// (file name, source, kernel entry points) of every embedded kernel file.
pub const SOURCES: &[(&str, &str, &[&str])] = &[
    ("null.cu", NULL_CU, &["null_step", "null_fill"]),
    (
        "cartpole.cu",
        CARTPOLE_CU,
        &["cartpole_seed", "cartpole_reset_all", "cartpole_step"],
    ),
];

/// Compiles every embedded kernel file with NVRTC and loads it into `ctx`: what a GPU
/// engine does at start. `CudaUnavailable` where NVRTC is missing.
#[cfg(feature = "cuda")]
pub fn load_all(
    driver: &super::driver::Driver,
    ctx: &std::sync::Arc<super::driver::PrimaryContext>,
) -> crate::error::Result<Vec<(&'static str, super::driver::Module)>> {
    SOURCES
        .iter()
        .map(|(file, src, _)| {
            let ptx = super::driver::compile(driver, file, src, &[])?;
            Ok((*file, super::driver::Module::load(ctx, &ptx)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_embedded_and_name_their_kernels() {
        for (file, src, kernels) in SOURCES {
            let on_disk = std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("kernels")
                    .join(file),
            )
            .unwrap();
            assert_eq!(&on_disk, src, "{file} embedded = on disk");
            assert!(!src.contains('\0'), "{file}: NVRTC takes a C string");
            for k in *kernels {
                assert!(
                    src.contains(&format!("extern \"C\" __global__ void {k}(")),
                    "{file} lacks kernel {k}"
                );
            }
        }
    }

    #[test]
    fn cartpole_kernel_uses_the_cpu_constants() {
        use crate::envs::cartpole as cp;
        let has = |needle: String| assert!(CARTPOLE_CU.contains(&needle), "{needle}");
        has(format!("#define GRAVITY {:?}", cp::GRAVITY));
        has(format!("#define MASS_CART {:?}", cp::MASS_CART));
        has(format!("#define MASS_POLE {:?}", cp::MASS_POLE));
        has(format!("#define FORCE_MAG {:?}", cp::FORCE_MAG));
        has(format!("#define TAU {:?}", cp::TAU));
        has(format!("#define X_THRESHOLD {:?}", cp::X_THRESHOLD));
        has(format!("#define MAX_STEPS {}u", cp::MAX_STEPS));
        assert!(NULL_CU.contains("2654435761ULL") && NULL_CU.contains("0xFFFFFFULL"));
    }
}
