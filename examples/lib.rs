//! ferrolink's examples live beside this file as `NN_name.rs`; run one with
//! `cargo run --release -p ferrolink-examples --example 01_copy`. Each prints the backend it
//! ran on and checks its own result.
