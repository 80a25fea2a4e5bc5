//! 06_barrier — LSA barriers under stress (see the `barrier` module of examples/lib.rs). Alone
//! it runs 4 virtual ranks on device 0; as a job it is one rank:
//! `ferrolink-run -n 4 target/release/examples/06_barrier`.

fn main() -> Result<(), ferrolink::Error> {
    ferrolink_examples::report(ferrolink_examples::job(4, |c| {
        let gpu = c.device().backend() == ferrolink::Backend::Cuda;
        let (ctas, rounds) = if gpu { (8, 2000) } else { (2, 40) };
        ferrolink_examples::barrier::rank(c, ctas, rounds)
    }))
}
