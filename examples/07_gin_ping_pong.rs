//! 07_gin_ping_pong — put-with-signal ping-pong over GIN between ranks 0 and 1 (see the
//! `gin_ping_pong` module of examples/lib.rs). Alone it runs 2 virtual ranks on device 0; as
//! a job it is one rank: `ferrolink-run -n 2 target/release/examples/07_gin_ping_pong`.
//! `FERROLINK_GIN=proxy` sends through the proxy (copy engine, or TCP with
//! `FERROLINK_GIN_TRANSPORT=tcp`) instead of the direct backend.

fn main() -> Result<(), ferrolink::Error> {
    ferrolink_examples::report(ferrolink_examples::job(2, |c| {
        let iters = if c.device().backend() == ferrolink::Backend::Cuda { 10_000 } else { 200 };
        ferrolink_examples::gin_ping_pong::rank(c, 8, iters)
    }))
}
