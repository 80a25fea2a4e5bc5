//! 08_all_to_all — all-to-all over GIN, then the hybrid all-to-all (LSA stores to the peers
//! of this rank's LSA domain, GIN to the others; see the `all_to_all` module of
//! examples/lib.rs). Alone it runs 4 virtual ranks on device 0; as a job it is one rank:
//! `ferrolink-run -n 4 target/release/examples/08_all_to_all`. `FERROLINK_LSA=2` (or
//! `process`) splits the ranks into LSA domains so that GIN crosses between them.

fn main() -> Result<(), ferrolink::Error> {
    ferrolink_examples::report(ferrolink_examples::job(4, |c| {
        let (bytes, rounds) = if c.device().backend() == ferrolink::Backend::Cuda { (1 << 20, 20) } else { (4099, 3) };
        let plain = ferrolink_examples::all_to_all::rank(c, bytes, rounds, false)?;
        let hybrid = ferrolink_examples::all_to_all::rank(c, bytes, rounds, true)?;
        Ok(format!("{plain}\n{hybrid}"))
    }))
}
