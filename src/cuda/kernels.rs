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

/// NVRTC options for every kernel: no FMA contraction, so `a * b + c` rounds twice as
/// it does in the CPU engines (cartpole's reset draws and dynamics must match them).
pub const COMPILE_OPTIONS: &[&str] = &["--fmad=false"];

/// The generator state `(state, increment)` of `rand_pcg::Pcg32::seed_from_u64(seed)`
/// (rand_core 0.10's `seed_from_u64` then `Lcg64Xsh32::from_seed`): what the host uploads
/// per env with `cartpole_seed` so the GPU draws what the CPU engine draws.
pub fn pcg32_seed(seed: u64) -> (u64, u64) {
    // rand_core's seed expander: a PCG32 with fixed constants, 4 outputs of 4 bytes.
    const MUL: u64 = 0x5851_F42D_4C95_7F2D;
    const INC: u64 = 0xA176_54E4_6FBE_17F3;
    let mut st = seed;
    let mut bytes = [0u8; 16];
    for chunk in bytes.chunks_exact_mut(4) {
        st = st.wrapping_mul(MUL).wrapping_add(INC);
        let xorshifted = (((st >> 18) ^ st) >> 27) as u32;
        let rot = (st >> 59) as u32;
        chunk.copy_from_slice(&xorshifted.rotate_right(rot).to_le_bytes());
    }
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[8 * i..8 * i + 8]);
        u64::from_le_bytes(w)
    };
    // from_seed: increment forced odd; from_state_incr: state += inc, then one step.
    let inc = word(1) | 1;
    let state = word(0)
        .wrapping_add(inc)
        .wrapping_mul(PCG_MUL)
        .wrapping_add(inc);
    (state, inc)
}

/// `PCG_MUL` of kernels/cartpole.cu (and rand_pcg's Lcg64Xsh32 multiplier).
pub const PCG_MUL: u64 = 6364136223846793005;

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
            let ptx = super::driver::compile(driver, file, src, COMPILE_OPTIONS)?;
            Ok((*file, super::driver::Module::load(ctx, &ptx)?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kernels/cartpole.cu's `pcg32_next`, line for line.
    fn pcg32_next(state: &mut u64, inc: u64) -> u32 {
        let old = *state;
        *state = old.wrapping_mul(PCG_MUL).wrapping_add(inc);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        (xorshifted >> rot) | (xorshifted << (32u32.wrapping_sub(rot) & 31))
    }

    /// kernels/cartpole.cu's `uniform`, line for line (separate multiply and add: the
    /// kernel is compiled with --fmad=false).
    fn uniform(state: &mut u64, inc: u64, low: f64, high: f64) -> f64 {
        let scale = high - low;
        let lo = pcg32_next(state, inc) as u64;
        let hi = pcg32_next(state, inc) as u64;
        let bits = (hi << 32) | lo;
        let v12 = f64::from_bits((bits >> 12) | 0x3FF0_0000_0000_0000);
        (v12 - 1.0) * scale + low
    }

    /// The GPU cartpole's random scheme (host seeding + the kernel's generator and
    /// uniform draw, mirrored above) gives bit for bit what the CPU engine's
    /// `Pcg32::seed_from_u64(seed + e)` and `random_range(-0.05..0.05)` give. What this
    /// cannot show: that the GPU evaluates the kernel the same way (checked on a GPU).
    #[test]
    fn cartpole_rng_scheme_matches_rand_pcg() {
        use rand::{Rng, RngExt, SeedableRng};
        use rand_pcg::Pcg32;
        for seed in (0..300u64).chain([u64::MAX, u64::MAX - 1, 1 << 63, 0xDEAD_BEEF]) {
            let (mut st, inc) = pcg32_seed(seed);
            let mut cpu = Pcg32::seed_from_u64(seed);
            for _ in 0..64 {
                assert_eq!(pcg32_next(&mut st, inc), cpu.next_u32(), "seed {seed}");
            }
            let (mut st, inc) = pcg32_seed(seed);
            let mut cpu = Pcg32::seed_from_u64(seed);
            for k in 0..400 {
                let gpu = uniform(&mut st, inc, -0.05, 0.05);
                let want: f64 = cpu.random_range(-0.05..0.05);
                assert_eq!(gpu.to_bits(), want.to_bits(), "seed {seed} draw {k}");
            }
        }
        // The mirror is the kernel's code: tie the two.
        for line in [
            "*state = old * PCG_MUL + inc;",
            "u32 xorshifted = (u32)(((old >> 18) ^ old) >> 27);",
            "return (xorshifted >> rot) | (xorshifted << ((32u - rot) & 31u));",
            "double v12 = __longlong_as_double((i64)((bits >> 12) | 0x3FF0000000000000ULL));",
            "return (v12 - 1.0) * scale + low;",
            "#define PCG_MUL 6364136223846793005ULL",
        ] {
            assert!(CARTPOLE_CU.contains(line), "kernel lacks: {line}");
        }
        assert!(!CARTPOLE_CU.contains("for (;;)"), "rand 0.10 draws once");
        assert!(COMPILE_OPTIONS.contains(&"--fmad=false"));
    }

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
