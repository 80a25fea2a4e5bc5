//! nvptx64 implementation of the arch layer: inline PTX.
//!
//! Every asm block here names its state space and ordering explicitly; none relies on
//! LLVM's lowering of Rust atomics (see the module docs of `arch::atomic`).

use super::atomic::{FenceOrder, LoadOrder, RmwOrder, Scope, StoreOrder};
use super::index::Axis;
use super::memory::U32x4;
use core::arch::asm;

pub(super) enum Special {
    Tid,
    Ntid,
    Ctaid,
    Nctaid,
}

macro_rules! sreg {
    ($name:literal) => {{
        let v: u32;
        // SAFETY: reading a special register has no side effects.
        unsafe { asm!(concat!("mov.u32 {v}, ", $name, ";"), v = out(reg32) v, options(nomem, nostack, pure)) };
        v
    }};
}

#[inline(always)]
pub(super) fn special(which: Special, axis: Axis) -> u32 {
    match (which, axis) {
        (Special::Tid, Axis::X) => sreg!("%tid.x"),
        (Special::Tid, Axis::Y) => sreg!("%tid.y"),
        (Special::Tid, Axis::Z) => sreg!("%tid.z"),
        (Special::Ntid, Axis::X) => sreg!("%ntid.x"),
        (Special::Ntid, Axis::Y) => sreg!("%ntid.y"),
        (Special::Ntid, Axis::Z) => sreg!("%ntid.z"),
        (Special::Ctaid, Axis::X) => sreg!("%ctaid.x"),
        (Special::Ctaid, Axis::Y) => sreg!("%ctaid.y"),
        (Special::Ctaid, Axis::Z) => sreg!("%ctaid.z"),
        (Special::Nctaid, Axis::X) => sreg!("%nctaid.x"),
        (Special::Nctaid, Axis::Y) => sreg!("%nctaid.y"),
        (Special::Nctaid, Axis::Z) => sreg!("%nctaid.z"),
    }
}

#[inline(always)]
pub(super) fn lane_id() -> u32 {
    sreg!("%laneid")
}

#[inline(always)]
pub(super) fn sync_threads() {
    // SAFETY: a CTA barrier every non-exited thread reaches. Not `nomem`: it orders memory.
    // `barrier.sync` (not `bar.sync`, which means `barrier.sync.aligned`): the aligned form
    // requires every warp to arrive converged, and our protocols reach it from diverged
    // warps (lanes that spun on a peer's flag arrive later than their warp-mates); with the
    // aligned form the LSA barrier stress kernel hung on the H200.
    unsafe { asm!("barrier.sync 0;", options(nostack)) }
}

#[inline(always)]
pub(super) fn sync_threads_converged() {
    // SAFETY: a CTA barrier reached by converged warps (contract of
    // `arch::sync_threads_converged`). Orders memory like `barrier.sync`.
    unsafe { asm!("bar.sync 0;", options(nostack)) }
}

#[inline(always)]
pub(super) fn sync_threads_or(pred: bool) -> bool {
    let r: u32;
    // SAFETY: a CTA barrier with an OR reduction; same contract as `sync_threads` (and the
    // same reason for the non-aligned form).
    unsafe {
        asm!("{{ .reg .pred %pi; .reg .pred %po; setp.ne.u32 %pi, {v}, 0; barrier.red.or.pred %po, 0, %pi; selp.u32 {r}, 1, 0, %po; }}",
            v = in(reg32) pred as u32, r = out(reg32) r, options(nostack))
    };
    r != 0
}

#[inline(always)]
pub(super) fn trap() -> ! {
    // SAFETY: `trap` aborts the kernel; it does not return.
    unsafe { asm!("trap;", options(noreturn, nostack)) }
}

#[inline(always)]
pub(super) fn nanosleep(ns: u32) {
    // SAFETY: a pure delay. Not `nomem`, so the compiler re-reads memory after it, as a
    // spin loop needs.
    unsafe { asm!("nanosleep.u32 {ns};", ns = in(reg32) ns, options(nostack)) }
}

// The CUDA device runtime (libcudadevrt), linked in when a module that calls it is loaded.
unsafe extern "C" {
    fn cudaGraphLaunch(exec: u64, stream: u64) -> u32;
}

#[inline(always)]
pub(super) unsafe fn launch_graph(exec: u64, stream: u64) -> u32 {
    // SAFETY: the caller's contract (`arch::launch_graph`).
    unsafe { cudaGraphLaunch(exec, stream) }
}

#[inline(always)]
pub(super) fn global_timer_ns() -> u64 {
    let v: u64;
    // SAFETY: reading a special register. Not `pure`: it changes between reads.
    unsafe { asm!("mov.u64 {v}, %globaltimer;", v = out(reg64) v, options(nomem, nostack)) };
    v
}

#[inline(always)]
pub(super) fn clock64() -> u64 {
    let v: u64;
    // SAFETY: reading a special register. Not `pure`: it changes between reads.
    unsafe { asm!("mov.u64 {v}, %clock64;", v = out(reg64) v, options(nomem, nostack)) };
    v
}

// ---- scoped atomics -------------------------------------------------------------------
// `$sem` and `$scope` are literal fragments so that each (order, scope) pair becomes its own
// asm string; with constant arguments the matches fold to one instruction.

macro_rules! scoped {
    ($scope:expr, $m:ident ! ( $($args:tt)* )) => {
        match $scope {
            Scope::Cta => $m!($($args)* ".cta"),
            Scope::Gpu => $m!($($args)* ".gpu"),
            Scope::Sys => $m!($($args)* ".sys"),
        }
    };
}

macro_rules! ld {
    ($p:ident, $ty:literal, $reg:ident, $sem:literal $scope:literal) => {{
        let v;
        // SAFETY: the caller guarantees `p` is valid and aligned (arch::atomic::load).
        unsafe { asm!(concat!("ld", $sem, $scope, ".", $ty, " {v}, [{p}];"), v = out($reg) v, p = in(reg64) $p, options(nostack)) };
        v
    }};
}
macro_rules! st {
    ($p:ident, $v:ident, $ty:literal, $reg:ident, $sem:literal $scope:literal) => {
        // SAFETY: the caller guarantees `p` is valid and aligned (arch::atomic::store).
        unsafe { asm!(concat!("st", $sem, $scope, ".", $ty, " [{p}], {v};"), v = in($reg) $v, p = in(reg64) $p, options(nostack)) }
    };
}
macro_rules! rmw {
    ($p:ident, $v:ident, $op:literal, $ty:literal, $reg:ident, $sem:literal $scope:literal) => {{
        let old;
        // SAFETY: the caller guarantees `p` is valid and aligned (arch::atomic).
        unsafe { asm!(concat!("atom", $sem, $scope, ".", $op, ".", $ty, " {o}, [{p}], {v};"), o = out($reg) old, v = in($reg) $v, p = in(reg64) $p, options(nostack)) };
        old
    }};
}
macro_rules! cas {
    ($p:ident, $c:ident, $n:ident, $ty:literal, $reg:ident, $sem:literal $scope:literal) => {{
        let old;
        // SAFETY: the caller guarantees `p` is valid and aligned (arch::atomic::compare_swap).
        unsafe { asm!(concat!("atom", $sem, $scope, ".cas.", $ty, " {o}, [{p}], {c}, {n};"), o = out($reg) old, c = in($reg) $c, n = in($reg) $n, p = in(reg64) $p, options(nostack)) };
        old
    }};
}
macro_rules! red {
    ($p:ident, $v:ident, $ty:literal, $reg:ident, $sem:literal $scope:literal) => {
        // SAFETY: the caller guarantees `p` is valid and aligned (arch::atomic::red_add).
        unsafe { asm!(concat!("red", $sem, $scope, ".add.", $ty, " [{p}], {v};"), v = in($reg) $v, p = in(reg64) $p, options(nostack)) }
    };
}
macro_rules! fence_asm {
    ($sem:literal $scope:literal) => {
        // SAFETY: a fence has no operands; it only orders memory.
        unsafe { asm!(concat!("fence", $sem, $scope, ";"), options(nostack)) }
    };
}

macro_rules! rmw_orders {
    ($order:expr, $scope:expr, $m:ident ! ( $($args:tt)* )) => {
        match $order {
            RmwOrder::Relaxed => scoped!($scope, $m!($($args)* ".relaxed")),
            RmwOrder::Acquire => scoped!($scope, $m!($($args)* ".acquire")),
            RmwOrder::Release => scoped!($scope, $m!($($args)* ".release")),
            RmwOrder::AcqRel => scoped!($scope, $m!($($args)* ".acq_rel")),
        }
    };
}

macro_rules! word_impl {
    ($t:ty, $reg:ident, $u:literal, $b:literal, $load:ident, $store:ident, $add:ident, $exch:ident, $cas:ident, $max:ident, $red:ident) => {
        #[inline(always)]
        pub(super) unsafe fn $load(p: *const $t, o: LoadOrder, s: Scope) -> $t {
            match o {
                LoadOrder::Relaxed => scoped!(s, ld!(p, $u, $reg, ".relaxed")),
                LoadOrder::Acquire => scoped!(s, ld!(p, $u, $reg, ".acquire")),
            }
        }
        #[inline(always)]
        pub(super) unsafe fn $store(p: *mut $t, v: $t, o: StoreOrder, s: Scope) {
            match o {
                StoreOrder::Relaxed => scoped!(s, st!(p, v, $u, $reg, ".relaxed")),
                StoreOrder::Release => scoped!(s, st!(p, v, $u, $reg, ".release")),
            }
        }
        #[inline(always)]
        pub(super) unsafe fn $add(p: *mut $t, v: $t, o: RmwOrder, s: Scope) -> $t {
            rmw_orders!(o, s, rmw!(p, v, "add", $u, $reg,))
        }
        #[inline(always)]
        pub(super) unsafe fn $exch(p: *mut $t, v: $t, o: RmwOrder, s: Scope) -> $t {
            rmw_orders!(o, s, rmw!(p, v, "exch", $b, $reg,))
        }
        #[inline(always)]
        pub(super) unsafe fn $cas(p: *mut $t, c: $t, n: $t, o: RmwOrder, s: Scope) -> $t {
            rmw_orders!(o, s, cas!(p, c, n, $b, $reg,))
        }
        #[inline(always)]
        pub(super) unsafe fn $max(p: *mut $t, v: $t, o: RmwOrder, s: Scope) -> $t {
            rmw_orders!(o, s, rmw!(p, v, "max", $u, $reg,))
        }
        #[inline(always)]
        pub(super) unsafe fn $red(p: *mut $t, v: $t, o: StoreOrder, s: Scope) {
            match o {
                StoreOrder::Relaxed => scoped!(s, red!(p, v, $u, $reg, ".relaxed")),
                StoreOrder::Release => scoped!(s, red!(p, v, $u, $reg, ".release")),
            }
        }
    };
}

word_impl!(u32, reg32, "u32", "b32", load_u32, store_u32, add_u32, exch_u32, cas_u32, max_u32, red_u32);
word_impl!(u64, reg64, "u64", "b64", load_u64, store_u64, add_u64, exch_u64, cas_u64, max_u64, red_u64);

macro_rules! red_f32x4 {
    ($p:ident, $v:ident, $scope:literal) => {
        // SAFETY: the caller guarantees `p` is 16-byte aligned global memory
        // (arch::atomic::red_add_f32x4); `cvta.to.global` turns its generic address into the
        // global one the vector form needs.
        unsafe {
            asm!(
                concat!("{{ .reg .b64 %ga; cvta.to.global.u64 %ga, {p}; red.relaxed", $scope,
                    ".global.add.v4.f32 [%ga], {{{a}, {b}, {c}, {d}}}; }}"),
                p = in(reg64) $p, a = in(reg32) $v[0], b = in(reg32) $v[1], c = in(reg32) $v[2], d = in(reg32) $v[3],
                options(nostack)
            )
        }
    };
}

#[inline(always)]
pub(super) unsafe fn red_add_f32x4(p: *mut f32, v: [f32; 4], s: Scope) {
    match s {
        Scope::Cta => red_f32x4!(p, v, ".cta"),
        Scope::Gpu => red_f32x4!(p, v, ".gpu"),
        Scope::Sys => red_f32x4!(p, v, ".sys"),
    }
}

#[inline(always)]
pub(super) fn fence(o: FenceOrder, s: Scope) {
    match o {
        FenceOrder::Acquire => scoped!(s, fence_asm!(".acquire")),
        FenceOrder::Release => scoped!(s, fence_asm!(".release")),
        FenceOrder::AcqRel => scoped!(s, fence_asm!(".acq_rel")),
        FenceOrder::SeqCst => scoped!(s, fence_asm!(".sc")),
    }
}

macro_rules! ld_u64x2 {
    ($p:ident, $scope:literal) => {{
        let (a, b): (u64, u64);
        // SAFETY: the caller guarantees 16 valid, aligned bytes (arch::atomic::load_u64x2_relaxed).
        unsafe {
            asm!(concat!("ld.relaxed", $scope, ".v2.u64 {{{a}, {b}}}, [{p}];"),
                a = out(reg64) a, b = out(reg64) b, p = in(reg64) $p, options(nostack))
        };
        [a, b]
    }};
}
macro_rules! st_u64x2 {
    ($p:ident, $v:ident, $scope:literal) => {
        // SAFETY: the caller guarantees 16 valid, aligned bytes (arch::atomic::store_u64x2_relaxed).
        unsafe {
            asm!(concat!("st.relaxed", $scope, ".v2.u64 [{p}], {{{a}, {b}}};"),
                a = in(reg64) $v[0], b = in(reg64) $v[1], p = in(reg64) $p, options(nostack))
        }
    };
}

#[inline(always)]
pub(super) unsafe fn load_u64x2_relaxed(p: *const [u64; 2], s: Scope) -> [u64; 2] {
    scoped!(s, ld_u64x2!(p,))
}

#[inline(always)]
pub(super) unsafe fn store_u64x2_relaxed(p: *mut [u64; 2], v: [u64; 2], s: Scope) {
    scoped!(s, st_u64x2!(p, v,))
}

// ---- vector memory ---------------------------------------------------------------------

#[inline(always)]
pub(super) unsafe fn load_v4(p: *const U32x4) -> U32x4 {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees 16 valid, aligned global bytes at `p`.
    unsafe {
        asm!("ld.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg64) p, options(nostack, readonly))
    };
    U32x4([a, b, c, d])
}

#[inline(always)]
pub(super) unsafe fn load_v4_volatile(p: *const U32x4) -> U32x4 {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees 16 valid, aligned global bytes at `p`.
    unsafe {
        asm!("ld.volatile.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg64) p, options(nostack, readonly))
    };
    U32x4([a, b, c, d])
}

#[inline(always)]
pub(super) unsafe fn load_param_v2(address: u64) -> [u64; 2] {
    let (a, b): (u64, u64);
    // SAFETY: the caller guarantees 16 bytes of the kernel's parameters at `address` (a
    // parameter-space address), 8-byte aligned; parameters never change during a launch.
    unsafe {
        asm!("ld.param.v2.b64 {{{a}, {b}}}, [{p}];",
            a = out(reg64) a, b = out(reg64) b, p = in(reg64) address, options(nostack, readonly, pure))
    };
    [a, b]
}

#[inline(always)]
pub(super) unsafe fn load_v4_nc(p: *const U32x4) -> U32x4 {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees 16 valid, aligned, read-only global bytes at `p`.
    unsafe {
        asm!("ld.global.nc.L1::no_allocate.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg64) p, options(nostack, readonly, pure))
    };
    U32x4([a, b, c, d])
}

#[inline(always)]
pub(super) unsafe fn load_v4_nc_l2_256(p: *const U32x4) -> U32x4 {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees 16 valid, aligned, read-only global bytes at `p`.
    unsafe {
        asm!("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg64) p, options(nostack, readonly, pure))
    };
    U32x4([a, b, c, d])
}

#[inline(always)]
pub(super) unsafe fn store_v4(p: *mut U32x4, v: U32x4) {
    let [a, b, c, d] = v.0;
    // SAFETY: the caller guarantees 16 valid, aligned global bytes at `p`.
    unsafe {
        asm!("st.global.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
            a = in(reg32) a, b = in(reg32) b, c = in(reg32) c, d = in(reg32) d,
            p = in(reg64) p, options(nostack))
    }
}

#[inline(always)]
pub(super) unsafe fn store_v4_cs(p: *mut U32x4, v: U32x4) {
    let [a, b, c, d] = v.0;
    // SAFETY: the caller guarantees 16 valid, aligned global bytes at `p`.
    unsafe {
        asm!("st.global.cs.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
            a = in(reg32) a, b = in(reg32) b, c = in(reg32) c, d = in(reg32) d,
            p = in(reg64) p, options(nostack))
    }
}

#[inline(always)]
pub(super) fn dynamic_shared_mem<T>() -> *mut T {
    // The intrinsic gives the `.extern .shared` array sized by the launch.
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<U32x4>().cast()
}

// ---- warp ------------------------------------------------------------------------------

pub(super) enum ShflMode {
    Idx,
    Down,
    Up,
    Xor,
}

macro_rules! shfl_asm {
    ($mode:literal, $clamp:literal, $mask:ident, $v:ident, $b:ident) => {{
        let r: u32;
        // SAFETY: a warp shuffle; the caller's lanes in `mask` converge here
        // (contract of arch::warp).
        unsafe {
            asm!(concat!("shfl.sync.", $mode, ".b32 {r}, {v}, {b}, ", $clamp, ", {m};"),
                r = out(reg32) r, v = in(reg32) $v, b = in(reg32) $b, m = in(reg32) $mask,
                options(nostack, nomem))
        };
        r
    }};
}

#[inline(always)]
pub(super) fn shfl(mode: ShflMode, mask: u32, v: u32, b: u32) -> u32 {
    match mode {
        ShflMode::Idx => shfl_asm!("idx", "0x1f", mask, v, b),
        ShflMode::Down => shfl_asm!("down", "0x1f", mask, v, b),
        ShflMode::Up => shfl_asm!("up", "0x0", mask, v, b),
        ShflMode::Xor => shfl_asm!("bfly", "0x1f", mask, v, b),
    }
}

#[inline(always)]
pub(super) fn ballot(mask: u32, predicate: bool) -> u32 {
    let r: u32;
    let p = predicate as u32;
    // SAFETY: a warp vote; lanes in `mask` converge here (contract of arch::warp).
    unsafe {
        asm!("{{ .reg .pred %bp; setp.ne.u32 %bp, {p}, 0; vote.sync.ballot.b32 {r}, %bp, {m}; }}",
            r = out(reg32) r, p = in(reg32) p, m = in(reg32) mask, options(nostack, nomem))
    };
    r
}

#[inline(always)]
pub(super) fn active_mask() -> u32 {
    let r: u32;
    // SAFETY: reads the mask of converged lanes; no memory effects.
    unsafe { asm!("activemask.b32 {r};", r = out(reg32) r, options(nostack, nomem)) };
    r
}

#[inline(always)]
pub(super) fn sync_warp(mask: u32) {
    // SAFETY: a warp barrier; lanes in `mask` converge here. Orders memory among them.
    unsafe { asm!("bar.warp.sync {m};", m = in(reg32) mask, options(nostack)) }
}
