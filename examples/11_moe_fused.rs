//! 11_moe_fused — MoE with the experts' MLP fused into the combine: each rank dispatches its
//! tokens to their experts, each expert's kernel computes `W2 relu(W1 x)` for its rows and
//! adds `weight * y` straight into the token's accumulator on the token's rank (no combine
//! pass moves rows), and each rank checks its output against a host model (see the
//! `moe_fused` module of examples/lib.rs). Alone it runs 4 virtual ranks on device 0; as a
//! job it is one rank: `ferrolink-run -n 4 target/release/examples/11_moe_fused`.

fn main() -> Result<(), ferrolink::Error> {
    ferrolink_examples::report(ferrolink_examples::job(4, |c| {
        let shape = if c.device().backend() == ferrolink::Backend::Cuda {
            ferrolink_examples::moe_fused::Shape::gpu()
        } else {
            ferrolink_examples::moe_fused::Shape::small()
        };
        ferrolink_examples::moe_fused::rank(c, shape)
    }))
}
