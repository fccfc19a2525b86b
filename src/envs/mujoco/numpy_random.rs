//! NumPy's default generator, as Gymnasium seeds it: `np.random.Generator(PCG64(
//! SeedSequence(seed)))` (`gymnasium.utils.seeding.np_random`), written from NumPy's
//! documented algorithms so the same seed gives the same draws, bit for bit:
//!
//! - `SeedSequence(seed)`: the seed's 32-bit words (least significant first) hashed into
//!   a pool of four words, and `generate_state(4, uint64)` drawn from the pool;
//! - `PCG64`: the 128-bit LCG with the XSL-RR output (O'Neill's `pcg_setseq_128_xsl_rr_64`),
//!   seeded from those four words (state, then stream), advanced before each output;
//! - `Generator.uniform(low, high)`: `low + (high - low) * u`, with `u` the top 53 bits of
//!   one output over 2⁵³ (NumPy's `next_double`).
//!
//! `Generator.standard_normal` is not here: NumPy's ziggurat reads tables of constants
//! this crate does not carry (docs/mujoco.md, "Seeding").

/// The pool size of `SeedSequence` (32-bit words).
const POOL: usize = 4;
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;

/// PCG64's multiplier.
const MULTIPLIER: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;

/// `SeedSequence`'s hash of one word; `hash` is its running constant.
fn hashmix(value: u32, hash: &mut u32) -> u32 {
    let mut v = value ^ *hash;
    *hash = hash.wrapping_mul(MULT_A);
    v = v.wrapping_mul(*hash);
    v ^ (v >> XSHIFT)
}

fn mix(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L
        .wrapping_mul(x)
        .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> XSHIFT)
}

/// `SeedSequence(seed).generate_state(4, np.uint64)`.
fn seed_sequence_state(seed: u64) -> [u64; 4] {
    // The seed as 32-bit words, least significant first (0 is one word).
    let entropy: Vec<u32> = match seed >> 32 {
        0 => vec![seed as u32],
        high => vec![seed as u32, high as u32],
    };
    let mut hash = INIT_A;
    let mut pool = [0u32; POOL];
    for (i, p) in pool.iter_mut().enumerate() {
        *p = hashmix(entropy.get(i).copied().unwrap_or(0), &mut hash);
    }
    for src in 0..POOL {
        for dst in 0..POOL {
            if src != dst {
                let h = hashmix(pool[src], &mut hash);
                pool[dst] = mix(pool[dst], h);
            }
        }
    }
    // (An entropy longer than the pool is mixed in further: a u64 never is.)
    let mut hash = INIT_B;
    let mut words = [0u32; 2 * 4];
    for (i, w) in words.iter_mut().enumerate() {
        let mut v = pool[i % POOL] ^ hash;
        hash = hash.wrapping_mul(MULT_B);
        v = v.wrapping_mul(hash);
        *w = v ^ (v >> XSHIFT);
    }
    // Viewed as uint64 on a little-endian machine: the first word is the low half.
    let mut out = [0u64; 4];
    for (k, o) in out.iter_mut().enumerate() {
        *o = u64::from(words[2 * k]) | (u64::from(words[2 * k + 1]) << 32);
    }
    out
}

/// NumPy's `PCG64` bit generator with `Generator`'s `uniform` on top.
#[derive(Clone, Debug)]
pub struct NumpyRandom {
    state: u128,
    inc: u128,
}

impl NumpyRandom {
    /// `np.random.Generator(np.random.PCG64(seed))`, i.e. Gymnasium's `np_random(seed)`.
    pub fn new(seed: u64) -> Self {
        let s = seed_sequence_state(seed);
        let init_state = (u128::from(s[0]) << 64) | u128::from(s[1]);
        let init_seq = (u128::from(s[2]) << 64) | u128::from(s[3]);
        // pcg_setseq_128_srandom_r: state 0, step, add the initial state, step.
        let mut rng = NumpyRandom {
            state: 0,
            inc: (init_seq << 1) | 1,
        };
        rng.step();
        rng.state = rng.state.wrapping_add(init_state);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(MULTIPLIER).wrapping_add(self.inc);
    }

    /// The next 64-bit output (`bit_generator.random_raw()`): advance, then XSL-RR.
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let s = self.state;
        ((s >> 64) as u64 ^ s as u64).rotate_right((s >> 122) as u32)
    }

    /// `Generator.random()`: uniform on [0, 1), 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `Generator.uniform(low, high)`.
    pub fn uniform(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * self.next_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Outputs NumPy 2.4 gives (`PCG64(seed).random_raw(3)`, `Generator(PCG64(seed))
    /// .uniform(-0.1, 0.1)` then `.random()`, `SeedSequence(0).generate_state(4,
    /// np.uint64)`), one seed of one word, one of two.
    #[test]
    fn the_draws_are_numpys() {
        assert_eq!(
            seed_sequence_state(0),
            [
                15793235383387715774,
                12390638538380655177,
                2361836109651742017,
                3188717715514472916
            ]
        );
        let raw = |seed| {
            let mut r = NumpyRandom::new(seed);
            [r.next_u64(), r.next_u64(), r.next_u64()]
        };
        assert_eq!(
            raw(0),
            [0xa30febcfd9c2825f, 0x4510bdf882d9d721, 0x0a7d3da94ecde8b8]
        );
        assert_eq!(
            raw(12345),
            [0x3a32b18db2ffc19d, 0x51171315c9e4c4de, 0xcc2024823444efd9]
        );
        assert_eq!(
            raw((1 << 40) + 7),
            [0xd46e9e2034de21aa, 0x415badc99c087675, 0x275ed40f045acb84]
        );
        for (seed, u, x) in [
            (0, 0.027392337464290872, 0.2697867137638703),
            (12345, -0.05453279550656607, 0.31675833970975287),
            ((1 << 40) + 7, 0.0659625783658826, 0.25530515834910417),
        ] {
            let mut r = NumpyRandom::new(seed);
            assert_eq!(r.uniform(-0.1, 0.1).to_bits(), f64::to_bits(u));
            assert_eq!(r.next_f64().to_bits(), f64::to_bits(x));
        }
    }
}
