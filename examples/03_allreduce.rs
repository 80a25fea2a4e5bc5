//! 03_allreduce — one-shot all-reduce over LSA (see the `allreduce` module of
//! examples/lib.rs). Alone it runs 8 virtual ranks on device 0; as a job it is one rank:
//! `ferrolink-run -n 4 target/release/examples/03_allreduce`.

fn main() -> Result<(), ferrolink::Error> {
    ferrolink_examples::report(ferrolink_examples::job(8, |c| ferrolink_examples::allreduce::rank(c, 1 << 20)))
}
