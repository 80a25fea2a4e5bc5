//! 02_ring — every rank puts its buffer into the next rank's window slot (see the `ring`
//! module of examples/lib.rs). Alone it runs 4 virtual ranks on device 0; as a job it is one
//! rank: `ferrolink-run -n 4 target/release/examples/02_ring`.

fn main() -> Result<(), ferrolink::Error> {
    ferrolink_examples::report(ferrolink_examples::job(4, |c| ferrolink_examples::ring::rank(c, 16 << 20)))
}
