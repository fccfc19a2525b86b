//! CUDA C sources of the reference engines' kernels (`kernels/*.cu`), embedded in the
//! binary and compiled at run time with NVRTC (with the `cuda` feature: `envs::gpu`), and
//! the launch sizes and generator constants they share with the CPU engines.

/// `kernels/null.cu`: the `null` engine's pattern.
pub const NULL_CU: &str = include_str!("../../kernels/null.cu");
/// `kernels/cartpole.cu`: the `cartpole` engine's dynamics, resets and autoreset.
pub const CARTPOLE_CU: &str = include_str!("../../kernels/cartpole.cu");

/// (file name, source, kernel entry points) of every embedded kernel file.
pub const SOURCES: &[(&str, &str, &[&str])] = &[
    (
        "null.cu",
        NULL_CU,
        &["null_step", "null_fill", "null_fill_u8", "null_sparse"],
    ),
    (
        "cartpole.cu",
        CARTPOLE_CU,
        &[
            "cartpole_reset_listed",
            "cartpole_write_obs",
            "cartpole_step",
        ],
    ),
];

/// Threads per block of the reference engines' launches.
pub const BLOCK: u32 = 256;

/// The most blocks a reference engine launches for a grid-stride kernel (its threads then
/// loop over the rest): far below CUDA's x-dimension limit of 2^31 - 1 blocks.
pub const MAX_BLOCKS: u64 = 1 << 20;

/// How many threads to launch (the `n` of `driver::Module::launch`, which makes
/// `ceil(n / block)` blocks) for a grid-stride kernel over `elements` items: one per item,
/// at most `MAX_BLOCKS * BLOCK`, at least one. Computed in u64 (no overflow for any
/// tensor size); the result fits `u32` and gives at most `MAX_BLOCKS` blocks of `BLOCK`.
pub fn launch_threads(elements: u64) -> u32 {
    // MAX_BLOCKS * BLOCK = 2^28 < 2^32: the cast is exact.
    elements.clamp(1, MAX_BLOCKS * BLOCK as u64) as u32
}

/// A cartpole reset (frame 0's seeding, a `Reset` command) as `cartpole_reset_listed`
/// runs it, in one buffer for one upload: each env to reset once (u32 ids from offset 0),
/// how many resets in a row it gets (u64), and, when seeded, its new generator (u64
/// states, then u64 increments: what `rand_pcg::Pcg32::seed_from_u64` gives, [`pcg32_seed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetUpload {
    pub bytes: Vec<u8>,
    /// How many envs are listed (each once).
    pub n: usize,
    /// Byte offsets of the `n` counts, generator states and increments (the last two
    /// only meaningful when `seeded`).
    pub counts_at: usize,
    pub states_at: usize,
    pub incs_at: usize,
    pub seeded: bool,
}

impl ResetUpload {
    /// `ids` in list order, duplicates allowed, and when given one seed per listing: what
    /// the CPU engine does one listing at a time, folded per env (envs are independent, so
    /// only each env's own sequence matters). Unseeded, an env listed `c` times is reset
    /// `c` times in a row (it draws that many states from its stream, keeping the last);
    /// seeded, only its last listing counts, once (each listing replaces the stream before
    /// drawing). Envs keep the order of their first listing.
    pub fn new(ids: &[u32], seeds: Option<&[u64]>) -> ResetUpload {
        let mut index = std::collections::HashMap::with_capacity(ids.len());
        let mut envs: Vec<(u32, u64, u64)> = Vec::new(); // (id, count, seed)
        for (k, &id) in ids.iter().enumerate() {
            let seed = seeds.map_or(0, |s| s[k]);
            let i = *index.entry(id).or_insert_with(|| {
                envs.push((id, 0, seed));
                envs.len() - 1
            });
            let env = &mut envs[i];
            match seeds {
                None => env.1 += 1,
                Some(_) => *env = (id, 1, seed),
            }
        }
        let n = envs.len();
        let counts_at = (4 * n).next_multiple_of(8);
        let states_at = counts_at + 8 * n;
        let incs_at = states_at + 8 * n;
        let mut bytes = Vec::with_capacity(incs_at + 8 * n);
        bytes.extend(envs.iter().flat_map(|e| e.0.to_ne_bytes()));
        bytes.resize(counts_at, 0);
        bytes.extend(envs.iter().flat_map(|e| e.1.to_ne_bytes()));
        if seeds.is_some() {
            let generators: Vec<(u64, u64)> = envs.iter().map(|e| pcg32_seed(e.2)).collect();
            bytes.extend(generators.iter().flat_map(|g| g.0.to_ne_bytes()));
            bytes.extend(generators.iter().flat_map(|g| g.1.to_ne_bytes()));
        }
        ResetUpload {
            bytes,
            n,
            counts_at,
            states_at,
            incs_at,
            seeded: seeds.is_some(),
        }
    }
}

/// NVRTC options for every kernel: no FMA contraction, so `a * b + c` rounds twice as
/// it does in the CPU engines (cartpole's reset draws and dynamics must match them).
pub const COMPILE_OPTIONS: &[&str] = &["--fmad=false"];

/// The generator state `(state, increment)` of `rand_pcg::Pcg32::seed_from_u64(seed)`
/// (rand_core 0.10's `seed_from_u64` then `Lcg64Xsh32::from_seed`): what the host uploads
/// per env (`cartpole_reset_listed`) so the GPU draws what the CPU engine draws.
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

/// Host mirrors of kernels/cartpole.cu's device functions, for CPU tests of the GPU
/// scheme (what they cannot show: that the GPU evaluates the kernel the same way).
#[cfg(all(test, not(loom)))]
pub(crate) mod mirror {
    use super::PCG_MUL;

    /// kernels/cartpole.cu's `pcg32_next`, line for line.
    pub fn pcg32_next(state: &mut u64, inc: u64) -> u32 {
        let old = *state;
        *state = old.wrapping_mul(PCG_MUL).wrapping_add(inc);
        let xorshifted = (((old >> 18) ^ old) >> 27) as u32;
        let rot = (old >> 59) as u32;
        (xorshifted >> rot) | (xorshifted << (32u32.wrapping_sub(rot) & 31))
    }

    /// kernels/cartpole.cu's `uniform`, line for line (separate multiply and add: the
    /// kernel is compiled with --fmad=false).
    pub fn uniform(state: &mut u64, inc: u64, low: f64, high: f64) -> f64 {
        let scale = high - low;
        let lo = pcg32_next(state, inc) as u64;
        let hi = pcg32_next(state, inc) as u64;
        let bits = (hi << 32) | lo;
        let v12 = f64::from_bits((bits >> 12) | 0x3FF0_0000_0000_0000);
        (v12 - 1.0) * scale + low
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::mirror::{pcg32_next, uniform};
    use super::*;
    use crate::device::cuda::blocks;

    #[test]
    fn launch_sizes_stay_within_cuda_limits() {
        const MAX_GRID_X: u64 = (1 << 31) - 1;
        let cap = MAX_BLOCKS * u64::from(BLOCK);
        for n in [
            0u64,
            1,
            255,
            256,
            257,
            4096 * 100,       // null obs, 4096 envs x 100
            64 * 84 * 84 * 3, // null rgb, 64 envs x 84x84x3
            4096 * 84 * 84 * 3,
            u64::from(u32::MAX),
            1 << 40,
            u64::MAX,
        ] {
            let t = launch_threads(n);
            assert_eq!(u64::from(t), n.clamp(1, cap), "{n}");
            let b = u64::from(blocks(t, BLOCK));
            assert!(
                (1..=MAX_BLOCKS).contains(&b) && b <= MAX_GRID_X,
                "{n}: {b} blocks"
            );
            // One thread per element up to the cap; grid-stride loops cover the rest.
            assert!(b * u64::from(BLOCK) >= n.min(cap), "{n}");
        }
        assert_eq!(blocks(launch_threads(4096 * 100), BLOCK), 1600);
        assert_eq!(blocks(launch_threads(64 * 84 * 84 * 3), BLOCK), 5292);
        // One thread per env (cartpole): any u32 env count stays within the limit.
        assert_eq!(blocks(u32::MAX, BLOCK), 1 << 24);
        assert_eq!(blocks(0, BLOCK), 1);
        assert_eq!(blocks(5, 0), 5, "block 0 counts as 1");
    }

    #[test]
    fn reset_uploads_fold_listings_per_env() {
        let u32_at = |b: &[u8], at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().unwrap());
        let u64_at = |b: &[u8], at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().unwrap());
        let read = |up: &ResetUpload| -> Vec<(u32, u64)> {
            (0..up.n)
                .map(|k| {
                    (
                        u32_at(&up.bytes, 4 * k),
                        u64_at(&up.bytes, up.counts_at + 8 * k),
                    )
                })
                .collect()
        };
        // Unseeded: every listing is one more reset, envs in first-listing order.
        let up = ResetUpload::new(&[3, 1, 3, 3, 0], None);
        assert_eq!(read(&up), [(3, 3), (1, 1), (0, 1)]);
        assert_eq!((up.counts_at, up.bytes.len(), up.seeded), (16, 40, false));
        // Seeded: the last listing's seed, one reset.
        let up = ResetUpload::new(&[3, 1, 3], Some(&[5, 6, u64::MAX]));
        assert_eq!(read(&up), [(3, 1), (1, 1)]);
        assert_eq!((up.counts_at, up.states_at, up.incs_at), (8, 24, 40));
        assert_eq!(up.bytes.len(), 56);
        for (k, seed) in [u64::MAX, 6].into_iter().enumerate() {
            let (st, inc) = pcg32_seed(seed);
            assert_eq!(u64_at(&up.bytes, up.states_at + 8 * k), st);
            assert_eq!(u64_at(&up.bytes, up.incs_at + 8 * k), inc);
            assert_eq!(inc % 2, 1, "PCG increments are odd");
        }
        assert!(up.seeded);
        let none = ResetUpload::new(&[], Some(&[]));
        assert_eq!((none.n, none.bytes.len()), (0, 0));
        assert!(ResetUpload::new(&[], None).bytes.is_empty());
        let one = ResetUpload::new(&[7], None);
        assert_eq!((one.counts_at, one.bytes.len()), (8, 16));
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
