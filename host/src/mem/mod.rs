//! Symmetric memory: VMM allocations ([`SymBuffer`], like `ncclMemAlloc`) and collective
//! window registration ([`register_window`], like `ncclCommWindowRegister`).

pub mod symmetric;
pub mod window;

pub use symmetric::{SymBuffer, granularity};
pub use window::{Window, register_window};
