//! 05_fused — compute written straight into the next rank's window (see the `fused` module
//! of examples/lib.rs). Alone it runs 4 virtual ranks on device 0; as a job it is one rank:
//! `ferrolink-run -n 4 target/release/examples/05_fused`.

fn main() -> Result<(), ferrolink::Error> {
    ferrolink_examples::report(ferrolink_examples::job(4, |c| ferrolink_examples::fused::rank(c, 1 << 20)))
}
