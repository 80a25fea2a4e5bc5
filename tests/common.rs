//! Helpers shared by ferrolink's integration tests.

/// Deterministic pseudo-random bytes (splitmix64), different for each `seed`: tests never
/// check copies on zeros or on patterns a wrong index could reproduce.
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// Index of the first difference between two slices, for readable failures.
pub fn first_mismatch<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// `Ok(())` if `cond`, else an error carrying `what()`: device tests return errors from inside
/// `for_each_backend` bodies, which then fail naming the backend.
pub fn check(cond: bool, what: impl FnOnce() -> String) -> ferrolink::Result<()> {
    if cond { Ok(()) } else { Err(ferrolink::Error::InvalidArgument(format!("check failed: {}", what()))) }
}
