//! Collectives over LSA, written on the public primitives (windows, coops, LSA barriers):
//! all-reduce (one-shot and two-shot), reduce-scatter, all-gather, broadcast, reduce and
//! all-to-all, for every element type and reduction of [`DataType`] and [`RedOp`]; across LSA
//! domains the same collectives one-shot through GIN ([`run_gin`]). Small calls inside one
//! domain may use the LL protocol instead ([`ll`]: the flag in the data word, no barrier).
//!
//! One kernel, [`crate::kernels::coll::coll_lsa`], runs them all from a [`CollArgs`]. Every
//! algorithm has the same shape: CTA `b` of every rank meets the others at LSA barrier `b`
//! (every rank's inputs are complete: its stream reached the kernel), works on part `b` of the
//! data (the same cut on every rank), and meets them again (no rank leaves, and so overwrites
//! its inputs or reads its outputs, while a peer may still read or write them).
//!
//! # Ordering
//! The barriers are acquire-release at system scope (see [`crate::barrier`]): each CTA's
//! reads of peers' inputs come after the first barrier, which acquires what the peers' earlier
//! work released; each CTA's writes (its own output, or its peers' for two-shot) are
//! released by the second barrier, which the CTA of the same index on every peer acquires.
//! A rank's part `b` is written only by CTAs `b` (the cut is the same everywhere), so when
//! every CTA of a rank has passed its second barrier, every write into that rank's output
//! is visible to it.
//!
//! Results are the same bitwise on every rank: sources are reduced in LSA rank order
//! (0, 1, …) whoever computes them.

use crate::arch::{self, U32x4};
use crate::barrier::LsaBarrierSession;
use crate::comm::{DevComm, error_code};
use crate::coop::{Coop, CoopCta};
use crate::gin::{Gin, LocalAction, RemoteAction};
use crate::lsa;
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

pub mod ll;
pub use ll::proto;

/// Element types (NCCL's `ncclDataType_t`, the subset we support).
///
/// ```
/// use ferrolink_device::coll::DataType;
/// let t = DataType::Bf16;
/// assert_eq!(DataType::from_code(t as u32), Some(t)); // `CollArgs::dtype` carries the code
/// assert_eq!((t.size(), t.name()), (2, "bfloat16"));
/// ```
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    /// `f32`.
    F32 = 0,
    /// IEEE half (`half::f16`).
    F16 = 1,
    /// bfloat16 (`half::bf16`).
    Bf16 = 2,
    /// `f64`.
    F64 = 3,
    /// `i32`.
    I32 = 4,
    /// `i64`.
    I64 = 5,
    /// `u8`.
    U8 = 6,
    /// `u32`.
    U32 = 7,
}

impl DataType {
    /// Every type, in code order.
    ///
    /// ```
    /// use ferrolink_device::coll::DataType;
    /// assert!(DataType::ALL.iter().enumerate().all(|(code, &t)| t as usize == code));
    /// ```
    pub const ALL: [DataType; 8] = [
        DataType::F32,
        DataType::F16,
        DataType::Bf16,
        DataType::F64,
        DataType::I32,
        DataType::I64,
        DataType::U8,
        DataType::U32,
    ];

    /// The type of code `code` (`DataType as u32`).
    ///
    /// ```
    /// use ferrolink_device::coll::DataType;
    /// assert_eq!(DataType::from_code(3), Some(DataType::F64));
    /// assert_eq!(DataType::from_code(8), None);
    /// ```
    pub fn from_code(code: u32) -> Option<DataType> {
        DataType::ALL.get(code as usize).copied()
    }

    /// Bytes per element.
    ///
    /// ```
    /// use ferrolink_device::coll::DataType;
    /// assert_eq!(DataType::F16.size(), 2);
    /// assert_eq!(1000 * DataType::I64.size(), 8000); // bytes of 1000 elements
    /// ```
    pub const fn size(self) -> usize {
        match self {
            DataType::F32 | DataType::I32 | DataType::U32 => 4,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::F64 | DataType::I64 => 8,
            DataType::U8 => 1,
        }
    }

    /// Its name as nccl-tests prints it.
    ///
    /// ```
    /// use ferrolink_device::coll::DataType;
    /// assert_eq!(DataType::F32.name(), "float");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            DataType::F32 => "float",
            DataType::F16 => "half",
            DataType::Bf16 => "bfloat16",
            DataType::F64 => "double",
            DataType::I32 => "int32",
            DataType::I64 => "int64",
            DataType::U8 => "uint8",
            DataType::U32 => "uint32",
        }
    }
}

/// Reductions (NCCL's `ncclRedOp_t`), with NCCL 2.28's semantics: `Avg` of floats multiplies
/// every input by `1 / nranks` (rounded to the element type) and sums; of integers, sums
/// (wrapping) and divides, rounding toward zero. `Min` and `Max` of floats ignore a NaN
/// beside a number (as `fminf` / `fmaxf`): NaN only when both are NaN. Sum and product
/// propagate NaN.
///
/// ```
/// use ferrolink_device::coll::RedOp;
/// let op = RedOp::Avg;
/// assert_eq!(RedOp::from_code(op as u32), Some(op)); // `CollArgs::op` carries the code
/// assert_eq!(op.name(), "avg");
/// ```
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RedOp {
    /// Sum (integers wrap).
    Sum = 0,
    /// Product (integers wrap).
    Prod = 1,
    /// Minimum.
    Min = 2,
    /// Maximum.
    Max = 3,
    /// Average.
    Avg = 4,
}

impl RedOp {
    /// Every reduction, in code order.
    ///
    /// ```
    /// use ferrolink_device::coll::RedOp;
    /// assert!(RedOp::ALL.iter().enumerate().all(|(code, &op)| op as usize == code));
    /// ```
    pub const ALL: [RedOp; 5] = [RedOp::Sum, RedOp::Prod, RedOp::Min, RedOp::Max, RedOp::Avg];

    /// The reduction of code `code` (`RedOp as u32`).
    ///
    /// ```
    /// use ferrolink_device::coll::RedOp;
    /// assert_eq!(RedOp::from_code(2), Some(RedOp::Min));
    /// assert_eq!(RedOp::from_code(5), None);
    /// ```
    pub fn from_code(code: u32) -> Option<RedOp> {
        RedOp::ALL.get(code as usize).copied()
    }

    /// Its name as nccl-tests prints it.
    ///
    /// ```
    /// use ferrolink_device::coll::RedOp;
    /// assert_eq!(RedOp::Prod.name(), "prod");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Prod => "prod",
            RedOp::Min => "min",
            RedOp::Max => "max",
            RedOp::Avg => "avg",
        }
    }
}

/// Which collective a [`CollArgs`] runs. Counts follow NCCL: see [`CollArgs::count`].
///
/// ```
/// use ferrolink_device::coll::{CollArgs, CollKind};
/// let args = CollArgs { kind: CollKind::ReduceScatter as u32, count: 256, ..CollArgs::default() };
/// assert_eq!(CollKind::from_code(args.kind), Some(CollKind::ReduceScatter));
/// ```
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollKind {
    /// Every rank gets the reduction of every rank's `count` elements.
    AllReduce = 0,
    /// Rank `r` gets the reduction of elements `[r * count, (r + 1) * count)` of every rank.
    ReduceScatter = 1,
    /// Every rank gets every rank's `count` elements, rank `p`'s at `p * count`.
    AllGather = 2,
    /// Every rank gets the root's `count` elements.
    Broadcast = 3,
    /// The root gets the reduction of every rank's `count` elements.
    Reduce = 4,
    /// Rank `r` gets block `r` (`count` elements) of every rank `p`, at `p * count`.
    AllToAll = 5,
}

impl CollKind {
    /// Every collective, in code order.
    ///
    /// ```
    /// use ferrolink_device::coll::CollKind;
    /// assert!(CollKind::ALL.iter().enumerate().all(|(code, &k)| k as usize == code));
    /// ```
    pub const ALL: [CollKind; 6] = [
        CollKind::AllReduce,
        CollKind::ReduceScatter,
        CollKind::AllGather,
        CollKind::Broadcast,
        CollKind::Reduce,
        CollKind::AllToAll,
    ];

    /// The collective of code `code`.
    ///
    /// ```
    /// use ferrolink_device::coll::CollKind;
    /// assert_eq!(CollKind::from_code(5), Some(CollKind::AllToAll));
    /// assert_eq!(CollKind::from_code(6), None);
    /// ```
    pub fn from_code(code: u32) -> Option<CollKind> {
        CollKind::ALL.get(code as usize).copied()
    }
}

/// Collective algorithms ([`CollArgs::algo`]): over LSA inside one domain, over GIN across domains.
pub mod algo {
    /// Every rank reads every peer's whole input and reduces it into its own output: one
    /// pass, `nranks` reads per element per rank. Best for small messages.
    ///
    /// ```
    /// use ferrolink_device::coll::{CollArgs, algo};
    /// assert_eq!(CollArgs::default().algo, algo::ONE_SHOT);
    /// ```
    pub const ONE_SHOT: u32 = 0;
    /// Rank `r` reduces part `r` of every peer's input and writes the result into every
    /// peer's output (reduce-scatter then all-gather in one kernel): each element is read
    /// `nranks` times in all. Best for large messages. Needs the output in a window.
    ///
    /// ```
    /// use ferrolink_device::coll::{CollArgs, CollKind, algo};
    /// // Peers write the output: into every rank's slot of `recv_win` at `recv_offset`.
    /// let args = CollArgs { kind: CollKind::AllReduce as u32, algo: algo::TWO_SHOT, recv_offset: 0, ..CollArgs::default() };
    /// assert_eq!(algo::NAMES[args.algo as usize], "two_shot");
    /// ```
    pub const TWO_SHOT: u32 = 1;
    /// Across LSA domains ([`super::run_gin`]), all-reduce, reduce-scatter and all-gather: a
    /// ring. Each rank puts only to the next rank, `nranks - 1` steps of one `1/nranks` chunk
    /// each per phase (reduce-scatter, then all-gather): `2 (nranks - 1) / nranks` of the
    /// data out of every rank for all-reduce, against `nranks - 1` times it one-shot. Inside
    /// one domain the tuner's algorithm runs instead.
    ///
    /// ```
    /// use ferrolink_device::coll::algo;
    /// assert_eq!(algo::from_name("ring"), Some(algo::RING));
    /// ```
    pub const RING: u32 = 2;
    /// Across LSA domains ([`super::run_gin`]), all-reduce: a binary tree over the ranks
    /// (rank `r`'s children are `2r + 1` and `2r + 2`). Partial results climb to rank 0, the
    /// result comes back down: `2 log2(nranks)` steps, each rank sending the data at most
    /// three times. Inside one domain, and for other collectives, the tuner's algorithm
    /// runs instead.
    ///
    /// ```
    /// use ferrolink_device::coll::algo;
    /// assert_eq!(algo::from_name("tree"), Some(algo::TREE));
    /// ```
    pub const TREE: u32 = 3;
    /// Across LSA domains ([`super::run_gin`]), all-reduce, reduce-scatter and all-gather
    /// when every domain holds two ranks or more: LSA inside the domains, GIN across them only
    /// among the ranks of one LSA rank (the rail). All-reduce: LSA reduce-scatter inside each
    /// domain (LSA rank `l` reduces piece `l` of `L`, reading the peers' inputs in place),
    /// piece `l` all-reduced across the rail (one GIN put of the piece to each other domain),
    /// LSA all-gather: each rank sends `(domains - 1) / L` of the data across domains, against
    /// `nranks - L` times it one-shot. Reduce-scatter: each rank reduces, over its domain, the
    /// blocks of its rail and puts each to its owner; all-gather: each rank puts its input
    /// along its rail, then copies every block from its domain peers: `domains - 1` blocks
    /// across domains per rank, against `nranks - L` one-shot. Elsewhere the tuner's
    /// algorithm runs instead.
    ///
    /// ```
    /// use ferrolink_device::coll::algo;
    /// assert_eq!(algo::NAMES[algo::HIERARCHICAL as usize], "hierarchical");
    /// ```
    pub const HIERARCHICAL: u32 = 4;
    /// The highest algorithm code.
    ///
    /// ```
    /// use ferrolink_device::coll::algo;
    /// assert_eq!(algo::NAMES.len(), algo::LAST as usize + 1);
    /// ```
    pub const LAST: u32 = HIERARCHICAL;
    /// Each algorithm's name, by code: how `FERROLINK_ALGO` and `ferrolink-perf --algo`
    /// spell it.
    ///
    /// ```
    /// use ferrolink_device::coll::algo;
    /// assert_eq!(algo::NAMES[algo::ONE_SHOT as usize], "one_shot");
    /// ```
    pub const NAMES: [&str; LAST as usize + 1] = ["one_shot", "two_shot", "ring", "tree", "hierarchical"];

    /// The code of the algorithm named `name` ([`NAMES`]), or `None`.
    ///
    /// ```
    /// use ferrolink_device::coll::algo;
    /// assert_eq!(algo::from_name("two_shot"), Some(algo::TWO_SHOT));
    /// assert_eq!(algo::from_name("two-shot"), None);
    /// ```
    pub fn from_name(name: &str) -> Option<u32> {
        NAMES.iter().position(|&n| n == name).map(|i| i as u32)
    }
}

/// What [`crate::kernels::coll::coll_lsa`] runs: the same on every rank. Plain numbers: the
/// windows are separate kernel parameters (so that the host tracks them).
///
/// ```
/// use ferrolink_device::coll::{CollArgs, CollKind, DataType, RedOp, algo, proto};
/// // A one-shot f32 sum all-reduce of 1024 elements per rank: every rank's input at offset 0
/// // of its slot of the send window, CTA `b` on LSA barrier `b`. The same on every rank.
/// let args = CollArgs {
///     kind: CollKind::AllReduce as u32,
///     algo: algo::ONE_SHOT,
///     dtype: DataType::F32 as u32,
///     op: RedOp::Sum as u32,
///     count: 1024,
///     send_offset: 0,
///     barrier: 0,
///     ..CollArgs::default()
/// };
/// assert_eq!((args.proto, args.input), (proto::SIMPLE, 0)); // simple protocol, nothing to stage
/// assert_eq!(args.count as usize * DataType::F32.size(), 4096); // bytes of each rank's input
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CollArgs {
    /// [`CollKind`] code.
    pub kind: u32,
    /// [`algo`] code: all-reduce inside one LSA domain; all-reduce, reduce-scatter and
    /// all-gather across domains ([`run_gin`]: ring, tree); ignored elsewhere.
    pub algo: u32,
    /// [`DataType`] code.
    pub dtype: u32,
    /// [`RedOp`] code (reductions only).
    pub op: u32,
    /// The root's LSA rank (broadcast, reduce).
    pub root: u32,
    /// The first of the grid's LSA barriers: CTA `b` uses `barrier + b`.
    pub barrier: u32,
    /// [`proto`] code: [`proto::LL`] runs the call with the LL protocol ([`ll`]: inside one
    /// LSA domain, the kinds of [`ll::applies_to`]; the input at [`CollArgs::input`], the LL buffer in `recv_win`
    /// at [`CollArgs::recv_offset`]); [`proto::SIMPLE`] (0) otherwise.
    pub proto: u32,
    /// Unused (alignment).
    pub reserved: u32,
    /// Elements: of each rank's input for all-reduce, broadcast and reduce; of each rank's
    /// output for reduce-scatter; of each rank's input for all-gather; per peer for
    /// all-to-all (NCCL's counts).
    pub count: u64,
    /// Byte offset of the inputs in the send window (every rank's at this offset of its slot).
    pub send_offset: u64,
    /// Byte offset of the outputs in the receive window (two-shot all-reduce only: peers write
    /// them; otherwise the kernel's `recv` pointer is the output); with [`proto::LL`], of the
    /// LL buffer.
    pub recv_offset: u64,
    /// Where this rank's input is (any device memory), for the kernel to stage it into its
    /// slot of the send window at `send_offset` before the first barrier ([`run_lsa`]: each
    /// CTA copies exactly the bytes that the same CTA of every rank reads after the barrier);
    /// 0: the input is there already. One launch fewer per call than a staging copy. Over
    /// LSA only: [`run_gin`] takes 0. With [`proto::LL`] the input itself, never staged.
    pub input: u64,
}

/// An element type the collectives reduce.
///
/// ```
/// use ferrolink_device::coll::{CollElem, DataType};
/// assert_eq!(<half::bf16 as CollElem>::DTYPE, DataType::Bf16);
/// assert_eq!(<u8 as CollElem>::sum(250, 10), 4); // integers wrap
/// assert_eq!(<f32 as CollElem>::min(f32::NAN, 2.0), 2.0); // a NaN beside a number
/// // Avg over 4 ranks: floats scale each input before the sum, integers divide the sum.
/// assert_eq!(<f32 as CollElem>::avg_pre(8.0, 4), 2.0);
/// assert_eq!(<i32 as CollElem>::avg_post(-7, 2), -3); // toward zero
/// // Bit casts to and from the low bytes of a word.
/// assert_eq!(<half::f16 as CollElem>::from_bits64(0x3c00), half::f16::ONE);
/// assert_eq!(<i32 as CollElem>::to_bits64(-1), 0xffff_ffff);
/// ```
pub trait CollElem: Copy + Pod {
    /// Its [`DataType`].
    const DTYPE: DataType;
    /// `a + b` (integers wrap).
    fn sum(a: Self, b: Self) -> Self;
    /// `a * b` (integers wrap).
    fn prod(a: Self, b: Self) -> Self;
    /// The smaller (a NaN beside a number gives the number).
    fn min(a: Self, b: Self) -> Self;
    /// The larger (a NaN beside a number gives the number).
    fn max(a: Self, b: Self) -> Self;
    /// Avg's step before the sum: floats times `1 / n` (rounded to the type); integers as is.
    fn avg_pre(self, n: u32) -> Self;
    /// Avg's step after the sum: integers divided by `n` (toward zero); floats as is.
    fn avg_post(self, n: u32) -> Self;
    /// The element from the low `size_of::<Self>()` bytes of `w` (a bit cast).
    fn from_bits64(w: u64) -> Self;
    /// The element's bits, zero-extended (a bit cast).
    fn to_bits64(self) -> u64;
}

macro_rules! float_elem {
    ($t:ty, $code:expr) => {
        impl CollElem for $t {
            const DTYPE: DataType = $code;
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                a * b
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if b.is_nan() || a < b { a } else { b }
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if b.is_nan() || a > b { a } else { b }
            }
            #[inline(always)]
            fn avg_pre(self, n: u32) -> Self {
                self * ((1.0f64 / n as f64) as $t)
            }
            #[inline(always)]
            fn avg_post(self, _n: u32) -> Self {
                self
            }
            #[inline(always)]
            fn from_bits64(w: u64) -> Self {
                <$t>::from_bits(w as _)
            }
            #[inline(always)]
            fn to_bits64(self) -> u64 {
                self.to_bits() as u64
            }
        }
    };
}
float_elem!(f32, DataType::F32);
float_elem!(f64, DataType::F64);

macro_rules! int_elem {
    ($t:ty, $code:expr) => {
        impl CollElem for $t {
            const DTYPE: DataType = $code;
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if a < b { a } else { b }
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if a > b { a } else { b }
            }
            #[inline(always)]
            fn avg_pre(self, _n: u32) -> Self {
                self
            }
            #[inline(always)]
            fn avg_post(self, n: u32) -> Self {
                // NCCL divides the wrapped sum as is (unsigned types) or its magnitude
                // (signed), rounding toward zero: what `/` does.
                self / (n as $t)
            }
            #[inline(always)]
            fn from_bits64(w: u64) -> Self {
                w as $t
            }
            #[inline(always)]
            fn to_bits64(self) -> u64 {
                // Zero-extended: only the low bytes are used.
                (self as u64) & (u64::MAX >> (64 - 8 * core::mem::size_of::<$t>()))
            }
        }
    };
}
int_elem!(i32, DataType::I32);
int_elem!(i64, DataType::I64);
int_elem!(u8, DataType::U8);
int_elem!(u32, DataType::U32);

macro_rules! half_elem {
    ($t:ty, $code:expr) => {
        // Each operation in f32, rounded once to the type: the correctly rounded result, as
        // native half arithmetic gives.
        impl CollElem for $t {
            const DTYPE: DataType = $code;
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() + b.to_f32())
            }
            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                <$t>::from_f32(a.to_f32() * b.to_f32())
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if b.is_nan() || a.to_f32() < b.to_f32() { a } else { b }
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if b.is_nan() || a.to_f32() > b.to_f32() { a } else { b }
            }
            #[inline(always)]
            fn avg_pre(self, n: u32) -> Self {
                // The scale rounded to the type first, then the product rounded: as NCCL.
                let scale = <$t>::from_f32(1.0 / n as f32);
                <$t>::from_f32(self.to_f32() * scale.to_f32())
            }
            #[inline(always)]
            fn avg_post(self, _n: u32) -> Self {
                self
            }
            #[inline(always)]
            fn from_bits64(w: u64) -> Self {
                <$t>::from_bits(w as u16)
            }
            #[inline(always)]
            fn to_bits64(self) -> u64 {
                u64::from(self.to_bits())
            }
        }
    };
}
half_elem!(half::f16, DataType::F16);
half_elem!(half::bf16, DataType::Bf16);

/// A reduction as a type, so that the inner loops are specialized.
///
/// ```
/// use ferrolink_device::coll::{CollElem, MaxOp, Op, ProdOp};
/// fn fold<O: Op, T: CollElem>(xs: &[T]) -> T {
///     xs[1..].iter().fold(xs[0], |acc, &x| O::apply(acc, x))
/// }
/// assert_eq!(fold::<ProdOp, u32>(&[2, 3, 4]), 24);
/// assert_eq!(fold::<MaxOp, f64>(&[1.0, f64::NAN, 3.0]), 3.0);
/// ```
pub trait Op {
    /// `a ∘ b`.
    fn apply<T: CollElem>(a: T, b: T) -> T;
}

/// [`RedOp::Sum`] (and [`RedOp::Avg`] before its division).
///
/// ```
/// use ferrolink_device::coll::{Op, SumOp};
/// assert_eq!(SumOp::apply(2.5f32, 0.5), 3.0);
/// assert_eq!(SumOp::apply(i32::MAX, 1), i32::MIN); // integers wrap
/// ```
pub struct SumOp;
/// [`RedOp::Prod`].
///
/// ```
/// use ferrolink_device::coll::{Op, ProdOp};
/// assert_eq!(ProdOp::apply(6u8, 7), 42);
/// ```
pub struct ProdOp;
/// [`RedOp::Min`].
///
/// ```
/// use ferrolink_device::coll::{MinOp, Op};
/// assert_eq!(MinOp::apply(-3i64, 2), -3);
/// assert_eq!(MinOp::apply(f32::NAN, 1.0), 1.0); // as `fminf`
/// ```
pub struct MinOp;
/// [`RedOp::Max`].
///
/// ```
/// use ferrolink_device::coll::{MaxOp, Op};
/// assert_eq!(MaxOp::apply(half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)).to_f32(), 1.5);
/// ```
pub struct MaxOp;

impl Op for SumOp {
    #[inline(always)]
    fn apply<T: CollElem>(a: T, b: T) -> T {
        T::sum(a, b)
    }
}
impl Op for ProdOp {
    #[inline(always)]
    fn apply<T: CollElem>(a: T, b: T) -> T {
        T::prod(a, b)
    }
}
impl Op for MinOp {
    #[inline(always)]
    fn apply<T: CollElem>(a: T, b: T) -> T {
        T::min(a, b)
    }
}
impl Op for MaxOp {
    #[inline(always)]
    fn apply<T: CollElem>(a: T, b: T) -> T {
        T::max(a, b)
    }
}

/// `f` on each of the `16 / size_of::<T>()` lanes of two 16-byte vectors, lanes taken from
/// the 32-bit words by shifts (the size is a constant per type, so one arm remains).
#[inline(always)]
fn lanes<T: CollElem>(a: U32x4, b: U32x4, f: impl Fn(T, T) -> T) -> U32x4 {
    let mut r = [0u32; 4];
    match core::mem::size_of::<T>() {
        8 => {
            for k in 0..2 {
                let w = |v: U32x4| u64::from(v.0[2 * k]) | (u64::from(v.0[2 * k + 1]) << 32);
                let x = f(T::from_bits64(w(a)), T::from_bits64(w(b))).to_bits64();
                r[2 * k] = x as u32;
                r[2 * k + 1] = (x >> 32) as u32;
            }
        }
        4 => {
            for k in 0..4 {
                r[k] = f(T::from_bits64(u64::from(a.0[k])), T::from_bits64(u64::from(b.0[k]))).to_bits64() as u32;
            }
        }
        2 => {
            for k in 0..4 {
                let (x, y) = (a.0[k], b.0[k]);
                let lo = f(T::from_bits64(u64::from(x & 0xffff)), T::from_bits64(u64::from(y & 0xffff))).to_bits64();
                let hi = f(T::from_bits64(u64::from(x >> 16)), T::from_bits64(u64::from(y >> 16))).to_bits64();
                r[k] = (lo as u32 & 0xffff) | ((hi as u32) << 16);
            }
        }
        _ => {
            for k in 0..4 {
                let (x, y) = (a.0[k], b.0[k]);
                let mut out = 0u32;
                for j in 0..4 {
                    let e = f(
                        T::from_bits64(u64::from((x >> (8 * j)) & 0xff)),
                        T::from_bits64(u64::from((y >> (8 * j)) & 0xff)),
                    );
                    out |= ((e.to_bits64() as u32) & 0xff) << (8 * j);
                }
                r[k] = out;
            }
        }
    }
    U32x4(r)
}

/// Element-wise `O` of `nsrcs` sources (`src(s)`, in order, each element `x` of source `s`
/// through `pre(s, x)` first), then `finish`, into every
/// pointer of `dsts`, over `count` elements: part `part` of `parts` (cut at 16-byte
/// multiples), split among the coop's threads. 16-byte vectors where every pointer allows.
///
/// # Safety
/// Every source valid for reads and every destination for writes of `count` elements of `T`,
/// aligned to `T`; a destination overlaps no source or is one exactly (each element is read,
/// then written, by one thread); nothing else writes them meanwhile; every thread of the coop
/// calls with the same arguments.
///
/// ```
/// use ferrolink_device::coll::{self, SumOp};
/// use ferrolink_device::CoopCta;
/// use ferrolink_device::emulator::{self, LaunchSpec};
/// use std::time::Duration;
///
/// // Every thread of one CTA: out = a + b over `n` elements (the whole range: part 0 of 1).
/// unsafe fn add(args: (*const f32, *const f32, *mut f32, usize)) {
///     let (a, b, out, n) = args;
///     let src = |s: usize| if s == 0 { a } else { b };
///     // SAFETY: the launch passes `n` valid elements at each pointer; `out` overlaps no source.
///     unsafe { coll::reduce::<f32, SumOp, _>(CoopCta, 1, |_| out, 2, src, n, 0, 1, |_, x| x, |x| x) };
/// }
/// let a = vec![1.0f32; 37];
/// let b: Vec<f32> = (0..37).map(|i| i as f32).collect();
/// let mut out = vec![0.0f32; 37];
/// let spec = LaunchSpec { name: "add", grid: [1, 1, 1], block: [4, 1, 1], shared_mem_bytes: 0,
///     timeout: Duration::from_secs(10) };
/// // SAFETY: the buffers outlive the launch.
/// unsafe { emulator::launch(&spec, add, (a.as_ptr(), b.as_ptr(), out.as_mut_ptr(), 37)) }.unwrap();
/// assert!(out.iter().enumerate().all(|(i, &x)| x == 1.0 + i as f32));
/// ```
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn reduce<T: CollElem, O: Op, C: Coop>(
    coop: C,
    ndsts: usize,
    dst: impl Fn(usize) -> *mut T,
    nsrcs: usize,
    src: impl Fn(usize) -> *const T,
    count: usize,
    part: usize,
    parts: usize,
    pre: impl Fn(usize, T) -> T,
    finish: impl Fn(T) -> T,
) {
    let size = core::mem::size_of::<T>();
    let (start_b, len_b) = lsa::split_16(count * size, part, parts);
    let (start, n) = (start_b / size, len_b / size);
    let aligned = (0..nsrcs).all(|s| (src(s) as usize + start_b) & 15 == 0)
        && (0..ndsts).all(|d| (dst(d) as usize + start_b) & 15 == 0);
    let (rank, nthreads) = (coop.thread_rank(), coop.size());
    let per_vec = 16 / size;
    let vectors = if aligned { n / per_vec } else { 0 };
    // SAFETY: every access is at an element index in [start, start + n) of the caller's
    // ranges; the vector path runs only when all pointers are 16-byte aligned there.
    unsafe {
        let mut v = rank;
        while v < vectors {
            let off = start + v * per_vec;
            let load = |s: usize| {
                let v = arch::load_v4(src(s).add(off) as *const U32x4);
                lanes::<T>(v, v, |a, _| pre(s, a))
            };
            let mut acc = load(0);
            for s in 1..nsrcs {
                acc = lanes::<T>(acc, load(s), O::apply);
            }
            acc = lanes::<T>(acc, acc, |a, _| finish(a));
            for d in 0..ndsts {
                arch::store_v4(dst(d).add(off) as *mut U32x4, acc);
            }
            v += nthreads;
        }
        let mut i = vectors * per_vec + rank;
        while i < n {
            let off = start + i;
            let mut acc = pre(0, src(0).add(off).read());
            for s in 1..nsrcs {
                acc = O::apply(acc, pre(s, src(s).add(off).read()));
            }
            let acc = finish(acc);
            for d in 0..ndsts {
                dst(d).add(off).write(acc);
            }
            i += nthreads;
        }
    }
}

/// The kind, type and reduction of `args`, checked: an unknown code, an unknown algorithm,
/// or a root at or above `ranks` (the ranks the call spans) is a fault (reported with the
/// codes, then a trap).
#[inline(always)]
fn parse_args(comm: &DevComm, args: &CollArgs, ranks: u32) -> (CollKind, DataType, RedOp) {
    match (CollKind::from_code(args.kind), DataType::from_code(args.dtype), RedOp::from_code(args.op)) {
        (Some(kind), Some(dtype), Some(op))
            if args.algo <= algo::LAST && args.proto <= proto::LAST && args.root < ranks =>
        {
            (kind, dtype, op)
        }
        _ => comm.fail(
            error_code::COLL_ARGS,
            u64::from(args.kind) << 32 | u64::from(args.algo),
            u64::from(args.dtype) << 32 | u64::from(args.op),
        ),
    }
}

/// Runs `args` as CTA `part` of `parts` of this rank (see the module docs): the body of
/// [`crate::kernels::coll::coll_lsa`]. `recv` is this rank's output (any device memory)
/// for every algorithm but two-shot all-reduce.
///
/// # Safety
/// Every rank of the LSA domain calls it with the same `args` (but `recv` and `input`) and
/// grid; every rank's input lies at `args.send_offset` of its slot of `send_win` (or, with
/// `args.input` set, is staged there from `args.input`, which holds it: see
/// `stage_input`) and is not written until every rank's call has ended; `recv` (or, for
/// two-shot, every slot of `recv_win` at `args.recv_offset`) holds the output, overlaps no
/// input in `send_win`, and is not touched by others meanwhile; it may hold `args.input`
/// (in place) for all-reduce, all-gather, broadcast and reduce, whose CTA `b` writes of the
/// input's bytes only those it staged itself; LSA barriers `args.barrier .. args.barrier +
/// parts` are this call's.
///
/// ```no_run
/// use ferrolink_device::coll::{self, CollArgs};
/// use ferrolink_device::{DevComm, DevWindow, arch, kernel};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// As the built-in `coll_lsa`: CTA `b` of the grid runs part `b` of `args`.
///     pub unsafe fn my_coll(comm: DevComm, send: DevWindow, recv_win: DevWindow, args: CollArgs, recv: *mut u8) {
///         // SAFETY: every rank launches this with the same `args` and grid, and LSA barriers
///         // `args.barrier .. args.barrier + grid` are this call's (the kernel's contract).
///         unsafe { coll::run_lsa(&comm, &send, &recv_win, &args, recv, arch::block_idx_x(), arch::grid_dim_x()) }
///     }
/// }
/// ```
pub unsafe fn run_lsa(
    comm: &DevComm,
    send_win: &DevWindow,
    recv_win: &DevWindow,
    args: &CollArgs,
    recv: *mut u8,
    part: usize,
    parts: usize,
) {
    let coop = CoopCta;
    let (kind, dtype, op) = parse_args(comm, args, comm.lsa_size);
    if args.proto == proto::LL {
        // SAFETY: forwarded contract (`ll::run`'s is this one's with the LL buffer).
        unsafe { ll::run(comm, recv_win, args, kind, dtype, op, recv, part, parts) };
        return;
    }
    if args.input != 0 {
        // SAFETY: the input and this rank's slot hold the call's input bytes (contract).
        unsafe { stage_input(comm, send_win, args, kind, dtype, part, parts) };
    }
    // SAFETY: barrier `args.barrier + part` is this CTA's (contract).
    let mut bar = unsafe { LsaBarrierSession::new(coop, comm, args.barrier + part as u32) };
    // Releases this CTA's staging copy (its threads' writes, ordered before the arrival by
    // the CTA barrier that opens it) to the same CTA of every peer, which reads just those
    // bytes after its wait (acquire).
    bar.sync();
    let (me, n) = (comm.lsa_rank as usize, comm.lsa_size as usize);
    let count = args.count as usize;
    let size = dtype.size();
    let send = |p: usize, elem: usize| send_win.lsa_ptr::<u8>(args.send_offset as usize + elem * size, p as u32);
    // SAFETY: (all arms) the ranges are the ones the contract describes; parts of them are
    // cut the same way on every rank.
    unsafe {
        match kind {
            CollKind::AllGather => {
                for p in 0..n {
                    lsa::copy(coop, recv.add(p * count * size), send(p, 0), count * size, part, parts);
                }
            }
            CollKind::AllToAll => {
                for p in 0..n {
                    lsa::copy(coop, recv.add(p * count * size), send(p, me * count), count * size, part, parts);
                }
            }
            CollKind::Broadcast => {
                lsa::copy(coop, recv, send(args.root as usize, 0), count * size, part, parts);
            }
            CollKind::Reduce if me != args.root as usize => {}
            CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce => {
                reduce_lsa(comm, send_win, recv_win, args, kind, dtype, op, recv, part, parts);
            }
        }
    }
    bar.sync();
}

/// Runs `args`, an LL call ([`proto::LL`]), as CTA `part` of `parts` of this rank: the body
/// of [`crate::kernels::coll::coll_ll`], [`run_lsa`]'s LL path alone. A kernel with only
/// this path is a small fraction of the one that runs every algorithm (on the H200 that one
/// took 255 registers and its executed path was spread over megabytes of code); small calls,
/// bound by the kernel's instructions, run it. Anything but an LL call is a fault.
///
/// # Safety
/// As [`run_lsa`] with `recv_win` the LL buffer (see [`ll`]'s `run`).
///
/// ```no_run
/// use ferrolink_device::coll::{self, CollArgs};
/// use ferrolink_device::{DevComm, DevWindow, arch, kernel};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// An LL call (`args.proto == proto::LL`, the input at `args.input`), launched with
///     /// `coll::ll::grid(count * size)` CTAs; `ll_win` at `args.recv_offset` is the LL buffer.
///     pub unsafe fn my_ll(comm: DevComm, ll_win: DevWindow, args: CollArgs, recv: *mut u8) {
///         // SAFETY: every rank launches this with the same `args` and grid; the LL buffer is
///         // this communicator's, written only by LL calls of this stream (the kernel's contract).
///         unsafe { coll::run_lsa_ll(&comm, &ll_win, &args, recv, arch::block_idx_x(), arch::grid_dim_x()) }
///     }
/// }
/// ```
#[inline(always)] // (so that the kernels read the call's fields where they lie, see `ll::run`)
pub unsafe fn run_lsa_ll(
    comm: &DevComm,
    ll_win: &DevWindow,
    args: &CollArgs,
    recv: *mut u8,
    part: usize,
    parts: usize,
) {
    let (kind, dtype, op) = parse_args(comm, args, comm.lsa_size);
    if args.proto != proto::LL {
        comm.fail(error_code::COLL_ARGS, u64::from(args.kind) << 32 | u64::from(args.algo), u64::from(args.proto));
    }
    // SAFETY: forwarded contract.
    unsafe { ll::run(comm, ll_win, args, kind, dtype, op, recv, part, parts) };
}

/// Copies this CTA's share of the input from `args.input` into this rank's slot of
/// `send_win` at `args.send_offset`: the bytes that CTA `part` of every rank reads from this
/// rank's slot in [`run_lsa`], cut as it cuts them ([`lsa::split_16`] of each piece the
/// reads are cut within: the whole input; each rank's block for reduce-scatter and
/// all-to-all; each rank's share for two-shot all-reduce). So the CTA's barrier alone orders
/// the copy before every read of it.
///
/// # Safety
/// `args.input` holds this rank's input (`count` elements, `nranks * count` for
/// reduce-scatter and all-to-all) and overlaps no byte another CTA of this call writes
/// before this CTA's first barrier; the slot holds it too (as [`run_lsa`]'s contract).
#[inline(always)]
unsafe fn stage_input(
    comm: &DevComm,
    send_win: &DevWindow,
    args: &CollArgs,
    kind: CollKind,
    dtype: DataType,
    part: usize,
    parts: usize,
) {
    let coop = CoopCta;
    let n = comm.lsa_size as usize;
    let block = args.count as usize * dtype.size();
    let src = args.input as *const u8;
    let dst = send_win.lsa_ptr::<u8>(args.send_offset as usize, comm.lsa_rank);
    // The pieces: (first byte, bytes).
    let piece = |i: usize| match kind {
        CollKind::ReduceScatter | CollKind::AllToAll => (i * block, block),
        CollKind::AllReduce if args.algo == algo::TWO_SHOT => lsa::split_16(block, i, n),
        _ => (0, block),
    };
    let pieces = match kind {
        CollKind::ReduceScatter | CollKind::AllToAll => n,
        CollKind::AllReduce if args.algo == algo::TWO_SHOT => n,
        _ => 1,
    };
    for i in 0..pieces {
        let (first, bytes) = piece(i);
        // SAFETY: the piece lies inside the input and the slot (contract).
        unsafe { lsa::copy(coop, dst.add(first), src.add(first), bytes, part, parts) };
    }
}

/// Which steps of `Avg` a [`reduce_any`] does: its pre-step on sources `pre_from..` (the
/// others are partial results that had it), its post-step on the result or not (a partial
/// result). Every other reduction ignores it.
#[derive(Clone, Copy)]
struct AvgSteps {
    pre_from: usize,
    post: bool,
}

impl AvgSteps {
    /// A whole reduction: every source is an input, the result is final.
    const ALL: AvgSteps = AvgSteps { pre_from: 0, post: true };
}

/// A loop over elements of one type with one reduction, run by [`with_reduction`].
pub(crate) trait ReductionBody {
    /// Runs with elements of `T` and reduction `O`; `avg`: the call's reduction is `Avg`
    /// (`O` is then [`SumOp`], and `Avg`'s steps are the body's to take).
    ///
    /// # Safety
    /// The caller's contract for the body.
    unsafe fn run<T: CollElem, O: Op>(self, avg: bool);
}

/// Runs `body` with the element type `dtype` and the reduction `op` made static (one
/// specialized loop each).
///
/// # Safety
/// `body`'s contract.
#[inline(always)]
pub(crate) unsafe fn with_reduction<B: ReductionBody>(dtype: DataType, op: RedOp, body: B) {
    macro_rules! by_op {
        ($t:ty) => {
            match op {
                RedOp::Sum => body.run::<$t, SumOp>(false),
                RedOp::Avg => body.run::<$t, SumOp>(true),
                RedOp::Prod => body.run::<$t, ProdOp>(false),
                RedOp::Min => body.run::<$t, MinOp>(false),
                RedOp::Max => body.run::<$t, MaxOp>(false),
            }
        };
    }
    // SAFETY: forwarded contract.
    unsafe {
        match dtype {
            DataType::F32 => by_op!(f32),
            DataType::F16 => by_op!(half::f16),
            DataType::Bf16 => by_op!(half::bf16),
            DataType::F64 => by_op!(f64),
            DataType::I32 => by_op!(i32),
            DataType::I64 => by_op!(i64),
            DataType::U8 => by_op!(u8),
            DataType::U32 => by_op!(u32),
        }
    }
}

/// [`reduce_any`]'s arguments, as a [`ReductionBody`].
struct ReduceAny<C, D, S> {
    coop: C,
    avg: AvgSteps,
    nranks: u32,
    ndsts: usize,
    dst: D,
    nsrcs: usize,
    src: S,
    count: usize,
    part: usize,
    parts: usize,
}

impl<C: Coop, D: Fn(usize) -> *mut u8, S: Fn(usize) -> *const u8> ReductionBody for ReduceAny<C, D, S> {
    #[inline(always)]
    unsafe fn run<T: CollElem, O: Op>(self, avg: bool) {
        let (dst, src) = (|d| (self.dst)(d) as *mut T, |s| (self.src)(s) as *const T);
        let (steps, n) = (self.avg, self.nranks);
        // SAFETY: forwarded contract. Avg's steps only where asked: the other reductions'
        // loops carry no branch for them.
        unsafe {
            if avg {
                reduce::<T, O, C>(
                    self.coop,
                    self.ndsts,
                    dst,
                    self.nsrcs,
                    src,
                    self.count,
                    self.part,
                    self.parts,
                    |s: usize, x: T| if s >= steps.pre_from { x.avg_pre(n) } else { x },
                    |x: T| if steps.post { x.avg_post(n) } else { x },
                )
            } else {
                reduce::<T, O, C>(
                    self.coop,
                    self.ndsts,
                    dst,
                    self.nsrcs,
                    src,
                    self.count,
                    self.part,
                    self.parts,
                    |_, x: T| x,
                    |x: T| x,
                )
            }
        }
    }
}

/// [`reduce`] with the element type `dtype` and the reduction `op` made static (one
/// specialized loop each): `nsrcs` sources `src(s)` and `ndsts` destinations `dst(d)` (byte
/// addresses of `count` elements each), part `part` of `parts`; `Avg` averages over `nranks`.
///
/// # Safety
/// As [`reduce`], for elements of `dtype`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn reduce_any<C: Coop>(
    coop: C,
    dtype: DataType,
    op: RedOp,
    avg: AvgSteps,
    nranks: u32,
    ndsts: usize,
    dst: impl Fn(usize) -> *mut u8,
    nsrcs: usize,
    src: impl Fn(usize) -> *const u8,
    count: usize,
    part: usize,
    parts: usize,
) {
    let body = ReduceAny { coop, avg, nranks, ndsts, dst, nsrcs, src, count, part, parts };
    // SAFETY: forwarded contract.
    unsafe { with_reduction(dtype, op, body) }
}

/// The reductions of [`run_lsa`].
///
/// # Safety
/// As [`run_lsa`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn reduce_lsa(
    comm: &DevComm,
    send_win: &DevWindow,
    recv_win: &DevWindow,
    args: &CollArgs,
    kind: CollKind,
    dtype: DataType,
    op: RedOp,
    recv: *mut u8,
    part: usize,
    parts: usize,
) {
    let coop = CoopCta;
    let (me, n) = (comm.lsa_rank as usize, comm.lsa_size as usize);
    let (count, size) = (args.count as usize, dtype.size());
    let send = |first: usize| {
        move |p: usize| send_win.lsa_ptr::<u8>(args.send_offset as usize + first * size, p as u32) as *const u8
    };
    // SAFETY: forwarded contract: every range below is one the contract describes.
    unsafe {
        match kind {
            CollKind::AllReduce if args.algo == algo::TWO_SHOT => {
                // This rank's share of the elements, cut at 16-byte multiples, and within it
                // this CTA's part; the result goes to every rank's output.
                let (first_b, len_b) = lsa::split_16(count * size, me, n);
                let dst = |p: usize| recv_win.lsa_ptr::<u8>(args.recv_offset as usize + first_b, p as u32);
                reduce_any(
                    coop,
                    dtype,
                    op,
                    AvgSteps::ALL,
                    n as u32,
                    n,
                    dst,
                    n,
                    send(first_b / size),
                    len_b / size,
                    part,
                    parts,
                );
            }
            CollKind::AllReduce | CollKind::Reduce => {
                reduce_any(coop, dtype, op, AvgSteps::ALL, n as u32, 1, |_| recv, n, send(0), count, part, parts);
            }
            _ => reduce_any(
                coop,
                dtype,
                op,
                AvgSteps::ALL,
                n as u32,
                1,
                |_| recv,
                n,
                send(me * count),
                count,
                part,
                parts,
            ),
        }
    }
}

/// Whether rank `from` sends its data to rank `to` in collective `kind` across LSA domains
/// ([`run_gin`]): to every other rank, but for reduce (only to the root) and broadcast (only
/// from the root).
#[inline(always)]
fn gin_sends(kind: CollKind, from: usize, to: usize, root: usize) -> bool {
    from != to
        && match kind {
            CollKind::Reduce => to == root,
            CollKind::Broadcast => from == root,
            _ => true,
        }
}

/// Runs `args` over every rank of the communicator, across LSA domains, as CTA `part` of
/// `parts` of this rank: the body of [`crate::kernels::coll::coll_gin`].
///
/// With `args.algo` [`algo::RING`], all-reduce, reduce-scatter and all-gather run as a ring
/// (`ring_gin`: each rank puts only to the next one); with [`algo::TREE`], all-reduce runs as
/// a binary tree (`tree_gin`); with [`algo::HIERARCHICAL`], all-reduce, reduce-scatter and
/// all-gather over domains of two ranks or more run LSA inside the domains and GIN across
/// them (`hierarchical_gin`);
/// everything else runs one-shot (`one_shot_gin`: each rank puts
/// its data straight to every rank that needs it). Either
/// way each CTA then resets its signal and meets every rank at the hybrid barrier `part`
/// (LSA barrier, then GIN barrier across domains). GIN takes each peer's path: direct stores
/// to LSA peers, the proxy to the others.
///
/// # Ordering
/// A put's signal is raised after its data, and after the data of every earlier put of the
/// same CTA to the same peer on the same context, has landed (GIN's strong signals), and
/// [`Gin::wait_signal`] acquires it: a CTA whose signal has reached `k` reads the data of the
/// first `k` puts made to it. Every region of `gather` is written by one put per call (the
/// hierarchical algorithms also write regions of their own locally and read their domain
/// peers' over LSA, after an LSA barrier: see `hierarchical_gin`); the
/// hybrid barrier at the end (acquire-release at system scope) is passed by no rank before
/// every rank has read what it received and computed its output, so the next call's puts
/// find the regions read. The signal is reset before that barrier, after the wait that
/// consumed this call's raises, and the next call's raises come after the barrier. Every
/// put's source (an input, or a region of `gather` written earlier in the call) is read by
/// the put before its receiver's wait ends, hence before the barrier: the caller may rewrite
/// the inputs after the call.
///
/// # Safety
/// Every rank of the communicator calls it with the same `args` (but `recv`) and grid; its
/// input lies at `args.send_offset` of its slot of `send_win` and is not written until the
/// call has ended on every rank; `gather` holds `nranks * count` elements per rank and is
/// used by nothing else meanwhile; `recv` holds the output, overlaps no input, and is not
/// touched by others meanwhile; GIN context 0, signals `0..parts` and hybrid barriers
/// `0..parts` (LSA and GIN barriers of those indices) are this call's.
///
/// ```no_run
/// use ferrolink_device::coll::{self, CollArgs};
/// use ferrolink_device::{DevComm, DevWindow, arch, kernel};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// As the built-in `coll_gin`: CTA `b` uses signal `b` and hybrid barrier `b`; `gather`
///     /// holds `nranks * count` elements per rank.
///     pub unsafe fn my_coll_gin(comm: DevComm, send: DevWindow, gather: DevWindow, args: CollArgs, recv: *mut u8) {
///         // SAFETY: every rank of the communicator launches this with the same `args` (with
///         // `input` 0: staged by the host) and grid (the kernel's contract).
///         unsafe { coll::run_gin(&comm, &send, &gather, &args, recv, arch::block_idx_x(), arch::grid_dim_x()) }
///     }
/// }
/// ```
pub unsafe fn run_gin(
    comm: &DevComm,
    send_win: &DevWindow,
    gather: &DevWindow,
    args: &CollArgs,
    recv: *mut u8,
    part: usize,
    parts: usize,
) {
    let coop = CoopCta;
    let (kind, dtype, op) = parse_args(comm, args, comm.nranks);
    if args.input != 0 || args.proto != proto::SIMPLE {
        // Staging and LL are LSA's (their cuts are `run_lsa`'s): the host stages for GIN.
        comm.fail(error_code::COLL_ARGS, u64::from(args.kind) << 32 | u64::from(args.algo), args.input);
    }
    let gin = Gin::new(comm, 0);
    let call = GinCall { comm, gin: &gin, send_win, gather, args, kind, dtype, op, recv, part, parts };
    let ring = args.algo == algo::RING
        && comm.nranks > 1
        && matches!(kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::AllGather);
    let tree = args.algo == algo::TREE && comm.nranks > 1 && kind == CollKind::AllReduce;
    let hierarchical = args.algo == algo::HIERARCHICAL
        && comm.lsa_size > 1
        && comm.nranks > comm.lsa_size
        && matches!(kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::AllGather);
    // SAFETY: forwarded contract.
    let finished = unsafe {
        if ring {
            ring_gin(&call)
        } else if hierarchical {
            hierarchical_gin(&call)
        } else if tree {
            tree_gin(&call)
        } else {
            one_shot_gin(&call)
        }
    };
    if !finished {
        // Aborted: the host reports it.
        return;
    }
    coop.sync();
    if coop.thread_rank() == 0 {
        // Every raise of this call has been consumed by this CTA's last wait (or none was
        // made: then the reset changes nothing).
        gin.reset_signal(part as u32);
    }
    // SAFETY: hybrid barrier `part` is this call's (contract). An abort ends it early: the
    // host reports it.
    let _ = unsafe { crate::gin::hybrid_sync(coop, comm, 0, part as u32) };
}

/// A rank's place among the LSA domains: its LSA rank `l` of `lsa_n` in domain `domain` of
/// `domains` (its rail: the ranks of LSA rank `l`, one per domain).
struct Rail {
    l: usize,
    lsa_n: usize,
    domain: usize,
    domains: usize,
}

/// One CTA's share of a [`run_gin`] call, as its algorithms read it.
struct GinCall<'a> {
    comm: &'a DevComm,
    gin: &'a Gin<'a>,
    send_win: &'a DevWindow,
    gather: &'a DevWindow,
    args: &'a CollArgs,
    kind: CollKind,
    dtype: DataType,
    op: RedOp,
    recv: *mut u8,
    part: usize,
    parts: usize,
}

impl GinCall<'_> {
    /// Puts `bytes` from `src_offset` of `src` to `dst_offset` of `peer`'s `gather`, raising
    /// this CTA's signal there (nothing for 0 bytes: the receiver expects nothing then).
    ///
    /// # Safety
    /// As [`run_gin`]: the source is this call's and unchanged until the receiver's wait
    /// ends; the destination region is written by nobody else in this call.
    unsafe fn put(&self, peer: usize, dst_offset: usize, src: &DevWindow, src_offset: usize, bytes: usize) {
        if bytes > 0 {
            // SAFETY: forwarded contract; both windows are this communicator's.
            unsafe {
                self.gin.put(
                    CoopCta,
                    self.comm.world(),
                    peer as u32,
                    *self.gather,
                    dst_offset,
                    *src,
                    src_offset,
                    bytes,
                    RemoteAction::SignalInc(self.part as u32),
                    LocalAction::None,
                )
            };
        }
    }

    /// This rank's place among the LSA domains ([`DevComm::rail`]).
    fn rail(&self) -> Rail {
        let (rail, lsa) = (self.comm.rail(), self.comm.lsa());
        Rail { l: lsa.rank as usize, lsa_n: lsa.size as usize, domain: rail.rank as usize, domains: rail.size as usize }
    }

    /// The world rank of this rank's rail in domain `k`.
    fn rail_peer(&self, k: usize) -> usize {
        self.comm.team_rank_to_world(self.comm.rail(), k as u32) as usize
    }

    /// Waits until this CTA's signal reaches `raises` (true), or an abort (false).
    fn wait(&self, raises: u64) -> bool {
        raises == 0 || self.gin.wait_signal(CoopCta, self.part as u32, raises).is_ok()
    }
}

/// The one-shot algorithm of [`run_gin`]: each rank puts the `count` elements each peer
/// needs from it (its input; block `peer` of it for reduce-scatter and all-to-all) into slot
/// `rank` of the peer's `gather` window (`count` elements per slot), CTA `b` putting part `b`
/// and raising signal `b`; each CTA waits for its part from every rank that sends to it, then
/// computes its part of the output from its own input and those copies (reducing in rank
/// order, so that every rank gets the same bits). False on an abort.
///
/// # Safety
/// As [`run_gin`].
#[inline(always)]
unsafe fn one_shot_gin(c: &GinCall) -> bool {
    let coop = CoopCta;
    let (comm, args, kind, recv, part, parts) = (c.comm, c.args, c.kind, c.recv, c.part, c.parts);
    let (me, n, root) = (comm.rank as usize, comm.nranks as usize, args.root as usize);
    let (count, size) = (args.count as usize, c.dtype.size());
    let bytes = count * size;
    let block = |to: usize| if matches!(kind, CollKind::ReduceScatter | CollKind::AllToAll) { to * bytes } else { 0 };
    let (start, len) = lsa::split_16(bytes, part, parts);
    for q in (0..n).filter(|&q| gin_sends(kind, me, q, root)) {
        // SAFETY: the source range is this rank's input (unchanged until every rank's call
        // ended: contract), the destination is slot `me` of the peer's gather window,
        // written by nobody else (contract).
        unsafe { c.put(q, me * bytes + start, c.send_win, args.send_offset as usize + block(q) + start, len) };
    }
    let senders = (0..n).filter(|&s| gin_sends(kind, s, me, root)).count() as u64;
    if len > 0 && !c.wait(senders) {
        return false;
    }
    let src = |p: usize| -> *const u8 {
        if p == me {
            c.send_win.local_ptr::<u8>(args.send_offset as usize + block(me))
        } else {
            c.gather.local_ptr::<u8>(p * bytes)
        }
    };
    // SAFETY: (all arms) the ranges the contract describes, this CTA's part of each (cut the
    // same way as the puts: `lsa::split_16` of the same bytes).
    unsafe {
        match kind {
            CollKind::AllGather | CollKind::AllToAll => {
                for p in 0..n {
                    lsa::copy(coop, recv.add(p * bytes), src(p), bytes, part, parts);
                }
            }
            CollKind::Broadcast => lsa::copy(coop, recv, src(root), bytes, part, parts),
            CollKind::Reduce if me != root => {}
            CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce => {
                reduce_any(coop, c.dtype, c.op, AvgSteps::ALL, n as u32, 1, |_| recv, n, src, count, part, parts)
            }
        }
    }
    true
}

/// The ring algorithm of [`run_gin`] (all-reduce, reduce-scatter, all-gather; two ranks or
/// more). The *data* is the input for all-reduce and reduce-scatter, the output for
/// all-gather; it is cut into `nranks` chunks (all-reduce: at 16-byte multiples; otherwise
/// block `c` is chunk `c`), and CTA `b` handles part `b` of every chunk (its *piece*).
///
/// Reduce-scatter phase (all-reduce, reduce-scatter): at step `s` (`0 .. nranks - 1`) rank
/// `r` puts its partial result of chunk `r - 1 - s` (its input at step 0) to the next rank,
/// into the chunk's place in the *partial* region of its `gather` (offset 0, the data's
/// size), and reduces the chunk `r - 2 - s` it receives with its own input into that place,
/// in place (the last step's result is final: chunk `r`, reduced in the order `r + 1, r + 2,
/// …, r` of the ranks, all indices modulo `nranks`). All-gather phase (all-reduce,
/// all-gather): at step `t` rank `r` puts the final chunk `r - t` (its own at step 0) to the
/// next rank, into the chunk's place in the *gathered* region (after the partial region for
/// all-reduce, at 0 for all-gather), and copies the chunk `r - 1 - t` it receives to its
/// output. Every place is written once per call, so no step waits for room; CTA `b`'s
/// signal counts the non-empty pieces it has received, the same count on both sides. False
/// on an abort.
///
/// # Safety
/// As [`run_gin`] (with `nranks >= 2`, so that both regions fit for all-reduce).
#[inline(always)]
unsafe fn ring_gin(c: &GinCall) -> bool {
    let coop = CoopCta;
    let (comm, args, kind, recv) = (c.comm, c.args, c.kind, c.recv);
    let (me, n) = (comm.rank as usize, comm.nranks as usize);
    let next = (me + 1) % n;
    let (count, size) = (args.count as usize, c.dtype.size());
    let bytes = count * size;
    let all_reduce = kind == CollKind::AllReduce;
    // This CTA's piece of chunk `i`: (offset in the data, bytes).
    let piece = |i: usize| {
        let (first, len) = if all_reduce { lsa::split_16(bytes, i, n) } else { (i * bytes, bytes) };
        let (start, len) = lsa::split_16(len, c.part, c.parts);
        (first + start, len)
    };
    // Where this rank's own block lies in the data (reduce-scatter's output, all-gather's
    // input); all-reduce's input and output are the whole data.
    let own_block = if all_reduce { 0 } else { me * bytes };
    let send_offset = args.send_offset as usize;
    let gathered = if all_reduce { bytes } else { 0 };
    let mut raises = 0u64;
    if kind != CollKind::AllGather {
        for s in 0..n - 1 {
            let last = s == n - 2;
            let (at, len) = piece((me + 2 * n - 1 - s) % n);
            let (src, src_offset) = if s == 0 { (c.send_win, send_offset + at) } else { (c.gather, at) };
            // SAFETY: the input (contract) or this rank's partial result of the chunk,
            // written at the previous step and not again in this call; the destination is
            // the chunk's place in the next rank's partial region, which only this rank
            // writes, once.
            unsafe { c.put(next, at, src, src_offset, len) };
            let (at, len) = piece((me + 2 * n - 2 - s) % n);
            raises += u64::from(len > 0);
            if len > 0 && !c.wait(raises) {
                return false;
            }
            let partial = c.gather.local_ptr::<u8>(at);
            let input = c.send_win.local_ptr::<u8>(send_offset + at) as *const u8;
            let dst = |d: usize| match (last, all_reduce, d) {
                (false, ..) => partial,
                (true, true, 0) => c.gather.local_ptr::<u8>(gathered + at),
                // SAFETY: the output holds the data (all-reduce) or this rank's block of it
                // (reduce-scatter: the last step's chunk is `me`).
                _ => unsafe { recv.add(at - own_block) },
            };
            let ndsts = if last && all_reduce { 2 } else { 1 };
            let avg = AvgSteps { pre_from: if s == 0 { 0 } else { 1 }, post: last };
            // SAFETY: the received partial result (landed: the wait) and this rank's input
            // of the same piece, reduced into the partial's place (exactly a source), or at
            // the last step into the gathered region's place of chunk `me` (which only this
            // rank writes) and the output.
            unsafe {
                reduce_any(
                    coop,
                    c.dtype,
                    c.op,
                    avg,
                    n as u32,
                    ndsts,
                    dst,
                    2,
                    |i| if i == 0 { partial } else { input },
                    len / size,
                    0,
                    1,
                )
            };
        }
    }
    if kind != CollKind::ReduceScatter {
        if kind == CollKind::AllGather {
            let (at, len) = piece(me);
            // SAFETY: this rank's input, to its block of the output.
            unsafe {
                lsa::copy(coop, recv.add(at), c.send_win.local_ptr::<u8>(send_offset + at - own_block), len, 0, 1)
            };
        }
        for t in 0..n - 1 {
            let (at, len) = piece((me + n - t) % n);
            let (src, src_offset) = if t == 0 && kind == CollKind::AllGather {
                (c.send_win, send_offset + at - own_block)
            } else {
                (c.gather, gathered + at)
            };
            // SAFETY: the input (contract) or the final chunk in the gathered region, written
            // earlier in this call and not again; the destination is the chunk's place in
            // the next rank's gathered region, which only this rank writes, once.
            unsafe { c.put(next, gathered + at, src, src_offset, len) };
            let (at, len) = piece((me + 2 * n - 1 - t) % n);
            raises += u64::from(len > 0);
            if len > 0 && !c.wait(raises) {
                return false;
            }
            // SAFETY: the received chunk (landed: the wait) to its place in the output.
            unsafe { lsa::copy(coop, recv.add(at), c.gather.local_ptr::<u8>(gathered + at), len, 0, 1) };
        }
    }
    true
}

/// The tree algorithm of [`run_gin`] (all-reduce; two ranks or more). Rank `r`'s parent is
/// `(r - 1) / 2`, its children `2r + 1` and `2r + 2` (those below `nranks`); CTA `b` handles
/// part `b` of the data. Up: rank `r` waits for its children's partial results (each put into
/// the child's own region of `r`'s `gather`: child `k` of `r` at `k * size` bytes), reduces
/// them and then its input (`partial(c1), partial(c2), input(r)`, in that order) and puts the
/// result into its region at its parent; rank 0's result is final, and the same bits reach
/// every rank. Down: each rank but 0 waits for the result from its parent (in the result
/// region, after the child regions), copies it to its output and puts it to its children.
/// CTA `b`'s signal counts the pieces received: the children's (up) come before the parent's
/// (down), which depends on them. False on an abort.
///
/// # Safety
/// As [`run_gin`] (with `nranks >= 2`, so that the regions fit: `min(nranks - 1, 2) + 1`
/// times the data).
#[inline(always)]
unsafe fn tree_gin(c: &GinCall) -> bool {
    let coop = CoopCta;
    let (comm, args, recv) = (c.comm, c.args, c.recv);
    let (me, n) = (comm.rank as usize, comm.nranks as usize);
    let (count, size) = (args.count as usize, c.dtype.size());
    let bytes = count * size;
    let (at, len) = lsa::split_16(bytes, c.part, c.parts);
    if len == 0 {
        return true;
    }
    let children = (1..=2).map(|k| 2 * me + k).filter(|&ch| ch < n).count();
    let result_region = (n - 1).min(2) * bytes;
    let input = c.send_win.local_ptr::<u8>(args.send_offset as usize + at) as *const u8;
    let child = |k: usize| c.gather.local_ptr::<u8>(k * bytes + at) as *const u8;
    if !c.wait(children as u64) {
        return false;
    }
    // The reduction lands in this rank's result region (rank 0: the result, also into its
    // output; the others: their partial, then put to the parent). Nobody else writes that
    // region until the parent's result lands there, which needs this partial first.
    let result = c.gather.local_ptr::<u8>(result_region + at);
    let dst = |d: usize| if d == 0 { result } else { recv.wrapping_add(at) };
    let avg = AvgSteps { pre_from: children, post: me == 0 };
    let src = |i: usize| if i < children { child(i) } else { input };
    let ndsts = if me == 0 { 2 } else { 1 };
    // SAFETY: the children's pieces (landed: the wait) and this rank's input piece, into the
    // result region (no source: the child regions lie before it) and, on rank 0, the output.
    unsafe { reduce_any(coop, c.dtype, c.op, avg, n as u32, ndsts, dst, children + 1, src, len / size, 0, 1) };
    if me > 0 {
        let parent = (me - 1) / 2;
        let region = (me - 1) % 2 * bytes;
        // SAFETY: this rank's partial (the reduce above; the put meets the coop first) into
        // its own region at the parent, written by nobody else in this call.
        unsafe { c.put(parent, region + at, c.gather, result_region + at, len) };
        // The result from the parent lands in the result region: the put above has read the
        // partial there before the parent's wait for it ended, hence before the parent's
        // result was put.
        if !c.wait(children as u64 + 1) {
            return false;
        }
        // SAFETY: the result's piece (landed: the wait) to this rank's output.
        unsafe { lsa::copy(coop, recv.add(at), result, len, 0, 1) };
    }
    for ch in (1..=2).map(|k| 2 * me + k).filter(|&ch| ch < n) {
        // SAFETY: the result's piece (computed or landed above, not rewritten in this call)
        // into the child's result region, which only this rank writes, once per call.
        unsafe { c.put(ch, result_region + at, c.gather, result_region + at, len) };
    }
    true
}

/// The hierarchical algorithms of [`run_gin`] ([`algo::HIERARCHICAL`]: all-reduce,
/// reduce-scatter, all-gather over `L = lsa_size >= 2` ranks per domain and
/// `D = nranks / L >= 2` domains): LSA inside each domain, GIN across it only between ranks
/// of the same LSA rank (the rail). False on an abort.
///
/// # Safety
/// As [`run_gin`] (with `lsa_size >= 2` and `nranks > lsa_size`; LSA barriers `0..parts` are
/// this call's: the hybrid barriers' LSA halves).
#[inline(always)]
unsafe fn hierarchical_gin(c: &GinCall) -> bool {
    // SAFETY: forwarded contract.
    unsafe {
        match c.kind {
            CollKind::ReduceScatter => hierarchical_reduce_scatter(c),
            CollKind::AllGather => hierarchical_all_gather(c),
            _ => hierarchical_all_reduce(c),
        }
    }
}

/// The hierarchical reduce-scatter of [`run_gin`]: block `t` of the output goes to world rank
/// `t = d * L + l`. `gather` holds `2D` regions of a block's size: region `k < D` the partial
/// of this rank's block from domain `k`, region `D + k` this rank's partial of the block of
/// the rank of its LSA rank in domain `k`. CTA `b` handles part `b` of every block.
///
/// 1. LSA barrier `part` (the domain's inputs are complete), then for every domain `k` rank
///    `l` reduces block `k * L + l` of its domain's `L` inputs (read in place, in LSA rank
///    order): its own block into region `d`, the others into region `D + k`.
/// 2. It puts region `D + k` to the rank of LSA rank `l` in domain `k`, into region `d`
///    there (only this rank writes it), waits for the `D - 1` partials of its own block, and
///    reduces the `D` regions in domain order into its output.
///
/// The result is the inputs reduced domain by domain, then across domains in order, as
/// [`hierarchical_all_reduce`]'s.
///
/// # Ordering
/// As [`hierarchical_all_reduce`]'s first two steps.
///
/// # Safety
/// As [`hierarchical_gin`] (`2D <= nranks` regions fit in `gather`).
#[inline(always)]
unsafe fn hierarchical_reduce_scatter(c: &GinCall) -> bool {
    let coop = CoopCta;
    let (comm, args) = (c.comm, c.args);
    let Rail { l, lsa_n, domain, domains } = c.rail();
    let (n, size) = (comm.nranks, c.dtype.size());
    let bytes = args.count as usize * size;
    let (at, len) = lsa::split_16(bytes, c.part, c.parts);
    // SAFETY: LSA barrier `part` is this call's (contract).
    let mut barrier = unsafe { crate::LsaBarrierSession::new(coop, comm, c.part as u32) };
    if barrier.try_sync().is_err() {
        return false;
    }
    let region = |k: usize| c.gather.local_ptr::<u8>(k * bytes + at);
    let pre_only = AvgSteps { pre_from: 0, post: false };
    for k in 0..domains {
        let block = k * lsa_n + l;
        let dst = if k == domain { region(domain) } else { region(domains + k) };
        let input =
            |p: usize| c.send_win.lsa_ptr::<u8>(args.send_offset as usize + block * bytes + at, p as u32) as *const u8;
        // SAFETY: every domain peer's part of block `block` (complete: the barrier;
        // unchanged until the closing barrier: contract) into a region of this rank's gather
        // window that nobody else writes in this call.
        unsafe { reduce_any(coop, c.dtype, c.op, pre_only, n, 1, |_| dst, lsa_n, input, len / size, 0, 1) };
    }
    for k in (0..domains).filter(|&k| k != domain) {
        // SAFETY: the partial just reduced (the put meets the coop first), unchanged in this
        // call, into region `domain` of the rail peer's gather window, which only this rank
        // writes.
        unsafe { c.put(c.rail_peer(k), domain * bytes + at, c.gather, (domains + k) * bytes + at, len) };
    }
    if len > 0 && !c.wait(domains as u64 - 1) {
        return false;
    }
    let post_only = AvgSteps { pre_from: domains, post: true };
    let partials = |k: usize| region(k) as *const u8;
    // SAFETY: the `D` partials of this rank's block (its own, and the others' landed: the
    // wait) into its output.
    unsafe {
        reduce_any(
            coop,
            c.dtype,
            c.op,
            post_only,
            n,
            1,
            |_| c.recv.wrapping_add(at),
            domains,
            partials,
            len / size,
            0,
            1,
        )
    };
    true
}

/// The hierarchical all-gather of [`run_gin`]: `gather` holds `D` regions of a block's size,
/// region `k` the input of the rank of this rank's LSA rank in domain `k` (region `d`
/// unused: the input is read where it lies). CTA `b` handles part `b` of every block.
///
/// 1. Rank `l` puts its input to the rank of LSA rank `l` in every other domain, into region
///    `d` there (only this rank writes it), and waits for the `D - 1` inputs of its rail.
/// 2. LSA barrier `part` (every domain peer holds its rail's inputs), then it copies every
///    block to its output: block `k * L + p` from peer `p`'s region `k` (its input for
///    `k = d`).
///
/// # Ordering
/// The rail's inputs land before their strong signal, which the receiving CTA's wait
/// acquires; its arrival at the LSA barrier then releases them (cumulatively) to the same CTA
/// of every domain peer, which acquires them at the barrier and reads exactly that CTA's
/// part. The inputs read in place are the peers' own: the barrier orders them as in
/// [`run_lsa`]. [`run_gin`]'s closing hybrid barrier keeps every region and input unchanged
/// until every rank has read it.
///
/// # Safety
/// As [`hierarchical_gin`] (`D <= nranks` regions fit in `gather`).
#[inline(always)]
unsafe fn hierarchical_all_gather(c: &GinCall) -> bool {
    let coop = CoopCta;
    let (comm, args) = (c.comm, c.args);
    let Rail { lsa_n, domain, domains, .. } = c.rail();
    let bytes = args.count as usize * c.dtype.size();
    let send_offset = args.send_offset as usize;
    let (at, len) = lsa::split_16(bytes, c.part, c.parts);
    for k in (0..domains).filter(|&k| k != domain) {
        // SAFETY: this rank's input (unchanged until every rank's call ended: contract) into
        // region `domain` of the rail peer's gather window, which only this rank writes.
        unsafe { c.put(c.rail_peer(k), domain * bytes + at, c.send_win, send_offset + at, len) };
    }
    if len > 0 && !c.wait(domains as u64 - 1) {
        return false;
    }
    // SAFETY: LSA barrier `part` is this call's (contract).
    let mut barrier = unsafe { crate::LsaBarrierSession::new(coop, comm, c.part as u32) };
    if barrier.try_sync().is_err() {
        return false;
    }
    for k in 0..domains {
        for p in 0..lsa_n {
            let src = if k == domain {
                c.send_win.lsa_ptr::<u8>(send_offset + at, p as u32)
            } else {
                c.gather.lsa_ptr::<u8>(k * bytes + at, p as u32)
            };
            // SAFETY: peer `p`'s input or a rail input it received (complete: the barrier)
            // to block `k * L + p` of this rank's output.
            unsafe { lsa::copy(coop, c.recv.add((k * lsa_n + p) * bytes + at), src, len, 0, 1) };
        }
    }
    true
}

/// The hierarchical all-reduce of [`run_gin`] ([`algo::HIERARCHICAL`]; `L = lsa_size >= 2`
/// ranks per domain, `D = nranks / L >= 2` domains). The data is cut into `L` pieces at
/// 16-byte multiples; LSA rank `l` owns piece `l`, and CTA `b` handles part `b` of every
/// piece. `gather` holds `D + 1` regions of the data's size: region `d` the partial result
/// of domain `d`, region `D` the final result; a piece keeps its offset in every region.
///
/// 1. LSA barrier `part` (the domain's inputs are complete), then rank `l` reduces its piece
///    of the `L` inputs of its domain (read in place, in LSA rank order) into its domain's
///    region.
/// 2. It puts that partial to the rank of LSA rank `l` in every other domain (into the same
///    region there: only this rank writes it), waits for theirs, and reduces the `D`
///    partials in domain order into the final region and its output: the same bits on the
///    `D` ranks of the rail.
/// 3. LSA barrier `part` again (every piece's final result is complete), then it copies the
///    other `L - 1` pieces from its domain peers' final regions to its output.
///
/// The result is the inputs reduced domain by domain (each in LSA rank order), then across
/// domains in order. False on an abort.
///
/// # Ordering
/// The peers' inputs were written before their kernels started (stream order: the host
/// stages them by a copy, or they lie in a window written earlier), so the first barrier
/// (acquire-release at the LSA scope), whose arrivals come after them, makes them visible.
/// The partials travel as in [`one_shot_gin`] (a strong
/// signal acquired by the wait). The second barrier releases each rank's final region,
/// written by this CTA before it arrives, to the same CTA of every domain peer, which reads
/// exactly the part this CTA wrote (the same cut on every rank). [`run_gin`]'s closing
/// hybrid barrier keeps every region and input unchanged until every rank has read it.
///
/// # Safety
/// As [`run_gin`] (with `lsa_size >= 2` and `nranks > lsa_size`, so that `D + 1 <= nranks`
/// regions fit in `gather`; LSA barriers `0..parts` are this call's: the hybrid barriers'
/// LSA halves).
#[inline(always)]
unsafe fn hierarchical_all_reduce(c: &GinCall) -> bool {
    let coop = CoopCta;
    let (comm, args) = (c.comm, c.args);
    let Rail { l, lsa_n, domain, domains } = c.rail();
    let (n, size) = (comm.nranks, c.dtype.size());
    let bytes = args.count as usize * size;
    let send_offset = args.send_offset as usize;
    // This CTA's part of piece `p`: (offset in the data, bytes).
    let part_of = |p: usize| {
        let (first, len) = lsa::split_16(bytes, p, lsa_n);
        let (start, len) = lsa::split_16(len, c.part, c.parts);
        (first + start, len)
    };
    let (at, len) = part_of(l);
    let final_region = domains * bytes;
    // SAFETY: LSA barrier `part` is this call's (contract).
    let mut barrier = unsafe { crate::LsaBarrierSession::new(coop, comm, c.part as u32) };
    if barrier.try_sync().is_err() {
        return false;
    }
    let partial = c.gather.local_ptr::<u8>(domain * bytes + at);
    let input = |p: usize| c.send_win.lsa_ptr::<u8>(send_offset + at, p as u32) as *const u8;
    let pre_only = AvgSteps { pre_from: 0, post: false };
    // SAFETY: every domain peer's input piece (complete: the barrier; unchanged until the
    // closing barrier: contract) into this domain's region of this rank's gather window,
    // which nobody else writes in this call.
    unsafe { reduce_any(coop, c.dtype, c.op, pre_only, n, 1, |_| partial, lsa_n, input, len / size, 0, 1) };
    for d in (0..domains).filter(|&d| d != domain) {
        // SAFETY: the partial just reduced (the put meets the coop first), unchanged in this
        // call, into region `domain` of the rail peer's gather window, which only this rank
        // writes.
        unsafe { c.put(c.rail_peer(d), domain * bytes + at, c.gather, domain * bytes + at, len) };
    }
    if len > 0 && !c.wait(domains as u64 - 1) {
        return false;
    }
    let result = c.gather.local_ptr::<u8>(final_region + at);
    let dst = |d: usize| if d == 0 { result } else { c.recv.wrapping_add(at) };
    let partials = |d: usize| c.gather.local_ptr::<u8>(d * bytes + at) as *const u8;
    let post_only = AvgSteps { pre_from: domains, post: true };
    // SAFETY: the `D` partials (this rank's, and the others' landed: the wait) into the final
    // region (after every partial region) and this rank's output.
    unsafe { reduce_any(coop, c.dtype, c.op, post_only, n, 2, dst, domains, partials, len / size, 0, 1) };
    if barrier.try_sync().is_err() {
        return false;
    }
    for p in (0..lsa_n).filter(|&p| p != l) {
        let (at, len) = part_of(p);
        let src = c.gather.lsa_ptr::<u8>(final_region + at, p as u32) as *const u8;
        // SAFETY: peer `p`'s final result of this part (complete: the barrier) to its place
        // in this rank's output.
        unsafe { lsa::copy(coop, c.recv.add(at), src, len, 0, 1) };
    }
    true
}

/// The ranks of one communicator that share a GPU in one process (a *GPU group*, issue 12)
/// run their collectives in one kernel: CTA `b` of its grid serves part `b % ctas_per_rank`
/// of rank `b / ctas_per_rank`'s operation (its [`RankOp`](group::RankOp): the operation
/// and the rank's device communicator), which the CTA reads into shared memory. Without
/// persistent mode the group launches a kernel per operation (one launch for the GPU
/// instead of one per rank) that carries the entries in its parameter ([`group::GroupLaunch`]);
/// in persistent mode the kernel is long-lived and takes operations in order from a ring of
/// slots in device memory and a sequence word, which one stream of the group writes.
pub mod group {
    use super::{CollArgs, run_gin, run_lsa};
    use crate::arch::{self, LoadOrder, RmwOrder, Scope, StoreOrder, U32x4, atomic};
    use crate::comm::DevComm;
    use crate::coop::{Coop, CoopCta};
    use crate::window::DevWindow;
    use bytemuck::{Pod, Zeroable};

    /// [`CollArgs::kind`] of the operation that ends the persistent kernel.
    ///
    /// ```
    /// use ferrolink_device::coll::{CollArgs, CollKind, group::{CollOp, SHUTDOWN}};
    /// let stop = CollOp { args: CollArgs { kind: SHUTDOWN, ..CollArgs::default() }, ..CollOp::default() };
    /// assert_eq!(CollKind::from_code(stop.args.kind), None); // no collective's code
    /// ```
    pub const SHUTDOWN: u32 = 0xffff;

    /// What the completion word reads after an abort: every waiter's target is below it.
    ///
    /// ```
    /// use ferrolink_device::coll::group::ABORTED;
    /// // A stream waits for operation `seq` until the completion word is at least `seq`.
    /// let released = |completed: u64, seq: u64| completed >= seq;
    /// assert!(released(ABORTED, 1 << 40));
    /// ```
    pub const ABORTED: u64 = u64::MAX >> 1;

    /// One collective of one rank, as its kernel part runs it.
    ///
    /// ```
    /// use ferrolink_device::DevWindow;
    /// use ferrolink_device::coll::{CollArgs, CollKind, DataType, RedOp, group::CollOp};
    /// # let (send, recv_win) = (DevWindow::default(), DevWindow::default());
    /// # let out: u64 = 0;
    /// let op = CollOp {
    ///     args: CollArgs {
    ///         kind: CollKind::AllReduce as u32,
    ///         dtype: DataType::F32 as u32,
    ///         op: RedOp::Sum as u32,
    ///         count: 1024,
    ///         ..CollArgs::default()
    ///     },
    ///     send,     // the window of the inputs
    ///     recv_win, // two-shot outputs
    ///     recv: out, // this rank's output (a device address)
    ///     ..CollOp::default() // `gather`: unused inside one LSA domain
    /// };
    /// assert_eq!(op.args.barrier, 0); // ignored: CTA `b` of the rank's part uses barrier `b`
    /// ```
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct CollOp {
        /// What to run (`barrier` is ignored: CTA `b` of a rank's part uses barrier `b`).
        pub args: CollArgs,
        /// The window holding the inputs.
        pub send: DevWindow,
        /// The window of two-shot outputs (see [`CollArgs::recv_offset`]).
        pub recv_win: DevWindow,
        /// The output (this rank's).
        pub recv: u64,
        /// Across LSA domains, where peers' data lands ([`run_gin`]'s `gather`); unused
        /// inside one domain.
        pub gather: DevWindow,
    }

    /// One rank's entry of a ring slot: its operation and its device communicator.
    ///
    /// ```
    /// use ferrolink_device::DevComm;
    /// use ferrolink_device::coll::group::{CollOp, RANK_OP_STRIDE, RankOp};
    /// # let (op, comm) = (CollOp::default(), DevComm::default());
    /// let entry = RankOp { op, comm }; // `comm`: the rank's device communicator, from the host
    /// assert_eq!(core::mem::size_of_val(&entry), RANK_OP_STRIDE);
    /// ```
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct RankOp {
        /// The operation.
        pub op: CollOp,
        /// The rank's device communicator.
        pub comm: DevComm,
    }

    /// Bytes between consecutive [`RankOp`]s in the ring (its size rounded up to 16, so that
    /// each entry is read with 16-byte loads); also the dynamic shared memory a CTA of the
    /// kernel needs.
    ///
    /// ```
    /// use ferrolink_device::coll::group::{RANK_OP_STRIDE, RankOp};
    /// assert_eq!(RANK_OP_STRIDE % 16, 0);
    /// assert!(RANK_OP_STRIDE >= core::mem::size_of::<RankOp>());
    /// // Slot `s`'s entry of part `p` in a ring of `count` parts per slot:
    /// let at = |s: usize, p: usize, count: usize| (s * count + p) * RANK_OP_STRIDE;
    /// assert_eq!(at(1, 0, 2), 2 * RANK_OP_STRIDE);
    /// ```
    pub const RANK_OP_STRIDE: usize = core::mem::size_of::<RankOp>().div_ceil(16) * 16;
    // `serve_own_ll` reads a `RankOp` parameter in 16-byte chunks: none past its end.
    const _: () = assert!(core::mem::size_of::<RankOp>() == RANK_OP_STRIDE);

    /// The persistent kernel's words, in device memory: the sequence number of the last
    /// operation handed to it (written by a stream), a count of that operation's CTAs done,
    /// and the completion word that stream waits on.
    ///
    /// ```
    /// use ferrolink_device::coll::group::GroupSync;
    /// let sync = GroupSync::default(); // zeroed when made: nothing handed over, nothing completed
    /// assert_eq!((sync.seq, sync.completed), (0, 0));
    /// assert_eq!(core::mem::size_of::<GroupSync>(), 64);
    /// ```
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct GroupSync {
        /// The sequence number of the last operation handed over (1, 2, …).
        pub seq: u64,
        /// CTAs of the running operation that finished their part (back to 0 at its end).
        pub ctas_done: u64,
        /// The sequence number of the last finished operation ([`ABORTED`] after an abort).
        pub completed: u64,
        /// Operations CTA 0 has run (with the times below).
        pub ops: u64,
        /// Nanoseconds CTA 0 waited for operations to be handed over (and for the previous
        /// one to end), summed over `ops` (diagnostics: the host logs the means at stop).
        pub waiting_ns: u64,
        /// Nanoseconds CTA 0 took to read its ring entries (device memory), summed.
        pub reading_ns: u64,
        /// Nanoseconds CTA 0's parts of the operations took, summed.
        pub running_ns: u64,
        /// CTAs that left on an abort: the last of them publishes [`ABORTED`] (before that,
        /// another CTA may still be running an operation whose memory the waiting stream's
        /// release would let the host free).
        pub aborted_ctas: u64,
    }

    /// Byte offsets of [`GroupSync`]'s words.
    ///
    /// ```
    /// use ferrolink_device::coll::group::{COMPLETED_OFFSET, SEQ_OFFSET};
    /// // The host hands operation `seq` over by writing `sync + SEQ_OFFSET`, and waits on
    /// // `sync + COMPLETED_OFFSET` for it to complete.
    /// assert_eq!((SEQ_OFFSET, COMPLETED_OFFSET), (0, 16));
    /// ```
    pub const SEQ_OFFSET: usize = core::mem::offset_of!(GroupSync, seq);
    /// See [`SEQ_OFFSET`].
    ///
    /// ```
    /// use ferrolink_device::coll::group::{COMPLETED_OFFSET, GroupSync};
    /// assert_eq!(COMPLETED_OFFSET, core::mem::offset_of!(GroupSync, completed));
    /// ```
    pub const COMPLETED_OFFSET: usize = core::mem::offset_of!(GroupSync, completed);

    /// The most ranks of one GPU that one kernel serves.
    ///
    /// ```
    /// use ferrolink_device::coll::group::{LocalRanks, MAX_LOCAL_RANKS};
    /// assert_eq!(LocalRanks::default().controls.len(), MAX_LOCAL_RANKS); // a control block per rank
    /// ```
    pub const MAX_LOCAL_RANKS: usize = 16;

    /// Entries of a shared launch's parameter ([`GroupLaunch::ops`]): one per served rank and
    /// operation, so a launch carries up to `MAX_LAUNCH_ENTRIES / ranks` operations (2 at 8
    /// ranks). Every launch passes the whole parameter: with 64 entries (30 KB) a launch of
    /// one call took 2–3 times as long on the H200 as with 16 (7 KB), which more calls per
    /// launch did not make up for (PERF.md, issue 12 twentieth part).
    ///
    /// ```
    /// use ferrolink_device::coll::group::{GroupLaunch, MAX_LAUNCH_ENTRIES};
    /// assert_eq!(GroupLaunch::default().ops.len(), MAX_LAUNCH_ENTRIES);
    /// assert_eq!(MAX_LAUNCH_ENTRIES / 8, 2); // operations per launch at 8 ranks, in the parameter
    /// ```
    pub const MAX_LAUNCH_ENTRIES: usize = 16;

    /// The most operations one shared launch runs when its entries lie in device memory
    /// ([`GroupLaunch::entries`]): the launcher thread puts more calls in one launch than the
    /// parameter holds that way (at 8 ranks its 16 entries are 2 calls).
    ///
    /// ```
    /// use ferrolink_device::coll::group::{MAX_LAUNCH_ENTRIES, MAX_LAUNCH_OPERATIONS};
    /// // At 8 ranks: 2 operations in the parameter, up to 16 with the entries in device memory.
    /// assert_eq!((MAX_LAUNCH_ENTRIES / 8, MAX_LAUNCH_OPERATIONS), (2, 16));
    /// ```
    pub const MAX_LAUNCH_OPERATIONS: usize = 16;

    /// The kernel's parameter: where the ring is and how the grid is cut.
    ///
    /// ```
    /// use ferrolink_device::coll::group::LocalRanks;
    /// # let (ring, sync): (u64, u64) = (0, 0);
    /// // Two ranks of one GPU, 4 CTAs each, a ring of 8 slots; rank 1's part is served elsewhere.
    /// let ranks = LocalRanks { ring, sync, slots: 8, count: 2, ctas_per_rank: 4, skip: 1 << 1, ..LocalRanks::default() };
    /// let grid = ranks.count * ranks.ctas_per_rank; // CTAs of the kernel
    /// // CTA `b` serves part `b / ctas_per_rank`:
    /// assert_eq!((5 / ranks.ctas_per_rank, grid), (1, 8));
    /// ```
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct LocalRanks {
        /// The ring (device memory, 16-byte aligned; a stream copies each slot in): `slots`
        /// slots of `count` [`RankOp`]s each, [`RANK_OP_STRIDE`] bytes apart; operation `s`
        /// uses slot `s % slots`.
        pub ring: u64,
        /// The persistent kernel's [`GroupSync`] (device memory); 0 for a launch per
        /// operation.
        pub sync: u64,
        /// Each rank's control block ([`DevComm::control`]): where a waiting CTA of the
        /// persistent kernel looks for an abort.
        pub controls: [u64; MAX_LOCAL_RANKS],
        /// Slots of the ring.
        pub slots: u32,
        /// Ranks served (parts of every slot).
        pub count: u32,
        /// CTAs per rank (every rank's part of an operation has as many).
        pub ctas_per_rank: u32,
        /// Bit `p` set: part `p` is not served by this launch (its rank runs the operation
        /// otherwise: a launch of its own, being captured into a graph).
        pub skip: u32,
    }

    /// The parameter of a shared launch (no persistent kernel): the grid's cut and every
    /// served rank's entry of one operation, or of several run one after the other, carried
    /// by the launch itself, so that no CTA reads host memory (a read of host memory from an
    /// SM took about 18 µs on the H200).
    ///
    /// ```
    /// use ferrolink_device::coll::group::{GroupLaunch, RankOp};
    /// # let (rank0, rank1) = (RankOp::default(), RankOp::default());
    /// // One operation of two ranks, 2 CTAs each, carried in the parameter.
    /// let mut launch = GroupLaunch { count: 2, ctas_per_rank: 2, operations: 1, ..GroupLaunch::default() };
    /// launch.set(0, &rank0);
    /// launch.set(1, &rank1);
    /// assert!(core::mem::size_of::<GroupLaunch>() <= 32764); // a kernel parameter's limit
    /// ```
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
    pub struct GroupLaunch {
        /// Ranks served (parts).
        pub count: u32,
        /// CTAs per rank.
        pub ctas_per_rank: u32,
        /// Bit `p` set: part `p` is not served (as [`LocalRanks::skip`]).
        pub skip: u32,
        /// Operations the launch runs, one after the other (0 counts as 1): operation `j`'s
        /// entry of part `p` is entry `j * count + p` (of `ops`, or of `entries`).
        pub operations: u32,
        /// With more than one operation: the launch's [`GridSync`] (device memory), where
        /// every CTA meets between operations; or 0 in a launch of LL calls alone
        /// ([`serve_launch`]'s `LL_ONLY`) with one CTA per rank, whose CTAs then go from one
        /// call to the next without meeting ([`serve_launch`] says why that is enough).
        pub grid_sync: u64,
        /// 0: the entries are `ops` (at most [`MAX_LAUNCH_ENTRIES`]). Else the device address
        /// (16-byte aligned) of `operations * count` entries, [`RANK_OP_STRIDE`] bytes apart
        /// ([`MAX_LAUNCH_OPERATIONS`] operations at most), which a copy on the launch's stream
        /// wrote before the launch; `ops` is then unused.
        pub entries: u64,
        /// The entries: a [`RankOp`] in the first bytes of each ([`RANK_OP_STRIDE`] bytes
        /// apart).
        pub ops: [[u64; RANK_OP_STRIDE / 8]; MAX_LAUNCH_ENTRIES],
    }

    /// Where the CTAs of a shared launch of several operations meet between them
    /// ([`GroupLaunch::grid_sync`]): zeroed when made, and back to zero arrivals after
    /// every meeting, so one serves every launch of a group in turn (launches of a group run
    /// one at a time, on its launch stream).
    ///
    /// ```
    /// use ferrolink_device::coll::group::GridSync;
    /// let fresh = GridSync::default(); // zeroed: what a launch's `grid_sync` must point at
    /// assert_eq!((fresh.arrived, fresh.generation), (0, 0));
    /// ```
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
    pub struct GridSync {
        /// CTAs arrived at the current meeting.
        pub arrived: u64,
        /// Meetings over (each one's last CTA raises it).
        pub generation: u64,
    }

    impl Default for GroupLaunch {
        fn default() -> Self {
            Zeroable::zeroed()
        }
    }

    impl GroupLaunch {
        /// Puts `op` as entry `index` (part `index % count` of operation `index / count`).
        ///
        /// ```
        /// use ferrolink_device::coll::group::{GroupLaunch, RankOp};
        /// let mut launch = GroupLaunch { count: 2, operations: 2, ..GroupLaunch::default() };
        /// let mut op = RankOp::default();
        /// op.op.args.count = 7;
        /// launch.set(3, &op); // part 1 of operation 1
        /// assert_eq!(launch.entry(3).op.args.count, 7);
        /// ```
        pub fn set(&mut self, index: usize, op: &RankOp) {
            let words = &mut self.ops[index];
            bytemuck::cast_slice_mut::<u64, u8>(words)[..core::mem::size_of::<RankOp>()]
                .copy_from_slice(bytemuck::bytes_of(op));
        }

        /// Entry `index` of `ops` (as [`GroupLaunch::set`] put it), where it lies.
        ///
        /// ```
        /// use ferrolink_device::coll::group::{GroupLaunch, RankOp};
        /// let mut launch = GroupLaunch { count: 1, ..GroupLaunch::default() };
        /// let mut op = RankOp::default();
        /// op.comm.rank = 5;
        /// launch.set(0, &op);
        /// assert_eq!(*launch.entry(0), op);
        /// ```
        pub fn entry(&self, index: usize) -> &RankOp {
            // (RankOp's alignment, 8, is the words'.)
            bytemuck::from_bytes(&bytemuck::cast_slice::<u64, u8>(&self.ops[index])[..core::mem::size_of::<RankOp>()])
        }

        /// Whether every served entry in `ops` is an LL call inside one LSA domain: then
        /// [`crate::kernels::coll::coll_ll_group_launch`] runs them.
        ///
        /// ```
        /// use ferrolink_device::coll::{group::{GroupLaunch, RankOp}, proto};
        /// let entry = |proto: u32, lsa_size: u32, nranks: u32| {
        ///     let mut e = RankOp::default();
        ///     (e.op.args.proto, e.comm.lsa_size, e.comm.nranks) = (proto, lsa_size, nranks);
        ///     e
        /// };
        /// let mut launch = GroupLaunch { count: 2, ctas_per_rank: 1, ..GroupLaunch::default() };
        /// launch.set(0, &entry(proto::LL, 2, 2));
        /// launch.set(1, &entry(proto::LL, 2, 2));
        /// assert!(launch.ll_only());
        /// launch.set(1, &entry(proto::LL, 1, 2)); // across LSA domains: not the LL kernel's
        /// assert!(!launch.ll_only());
        /// ```
        pub fn ll_only(&self) -> bool {
            let count = self.count as usize;
            let entries = (self.operations.max(1) as usize * count).min(MAX_LAUNCH_ENTRIES);
            (0..entries).filter(|&i| count > 0 && self.skip & (1 << (i % count)) == 0).all(|i| {
                let e = self.entry(i);
                e.op.args.proto == super::proto::LL && e.comm.lsa_size == e.comm.nranks
            })
        }
    }

    // A kernel's parameters take at most 32764 bytes (sm_70 and later, CUDA 12.1 and later).
    const _: () = assert!(core::mem::size_of::<GroupLaunch>() <= 32764);

    /// Byte offset of [`GroupLaunch::ops`].
    ///
    /// ```
    /// use ferrolink_device::coll::group::{GROUP_LAUNCH_OPS_OFFSET, RANK_OP_STRIDE};
    /// // Entry `i` lies at `param + GROUP_LAUNCH_OPS_OFFSET + i * RANK_OP_STRIDE`, read 16 bytes at
    /// // a time: both are multiples of 16.
    /// assert_eq!(GROUP_LAUNCH_OPS_OFFSET % 16, 0);
    /// assert_eq!(RANK_OP_STRIDE % 16, 0);
    /// ```
    pub const GROUP_LAUNCH_OPS_OFFSET: usize = core::mem::offset_of!(GroupLaunch, ops);
    // Each entry is read with 16-byte parameter loads, which must be 16-byte aligned.
    const _: () = assert!(GROUP_LAUNCH_OPS_OFFSET.is_multiple_of(16) && RANK_OP_STRIDE.is_multiple_of(16));

    /// Runs the operations of a shared launch: for each, CTA `block` runs part `block %
    /// ctas_per_rank` of its rank's entry, read 16 bytes per thread from the kernel's
    /// parameter at `ops` (the parameter-space address of [`GroupLaunch::ops`]) into shared
    /// memory; between operations every CTA of the grid meets at `grid_sync` (as between two
    /// launches: an operation may read the previous one's outputs, and its LL lines and
    /// barriers follow the previous one's).
    ///
    /// # Safety
    /// `ops` is the address of the launch's [`GroupLaunch::ops`] and `entries` its
    /// [`GroupLaunch::entries`]; the served entries (of `operations` operations, `count *
    /// operations <= MAX_LAUNCH_ENTRIES` in `ops`, or `operations <= MAX_LAUNCH_OPERATIONS`
    /// at `entries`) follow [`serve`]'s contract for the ring's, in order; the grid has `count * ctas_per_rank` CTAs, all
    /// resident at once, each with [`RANK_OP_STRIDE`] bytes of dynamic shared memory; with
    /// more than one operation, `grid_sync` is a live [`GridSync`] that only this launch uses
    /// while it runs, with no arrival counted, every part is served (`skip` 0: a CTA with no
    /// entry has no control block to see an abort by), and every rank of each entry's LSA
    /// domain is served by this grid (the grid barrier orders the operations at GPU scope
    /// only). With `LL_ONLY`, every entry is an LL call inside one LSA domain (anything else
    /// is a fault): the kernel then holds that path alone ([`super::run_lsa_ll`]); and with
    /// one CTA per rank as well, `grid_sync` may be 0: the CTAs then do not meet between
    /// the operations.
    ///
    /// # Ordering without the grid meetings
    /// LL calls with one CTA per rank need none. Each rank's calls run in its one CTA, in
    /// order, with a CTA barrier between them, so a call's reads of its input follow the
    /// previous call's writes of its output (in place, or a caller chaining them), and its
    /// barrier session reads the epoch the previous one stored (the flag: every rank's CTA
    /// advances it by one per LL call, so the ranks' flags agree call by call). No rank reads
    /// another rank's input or output in an LL call; what ranks share is their LL lines, whose
    /// reuse is argued in [`super::ll`] (*Reuse*): a sender writes lines of flag `f + 2`
    /// into a peer only after it has received that peer's lines of flag `f + 1`, which the
    /// peer's CTA stores only after the CTA barrier that ends its call `f`, in which each of
    /// its threads had loaded every line of flag `f` it waited for and found the flag there
    /// (the value returned before the thread left its poll loop), so no load of call `f` can
    /// see call `f + 2`'s lines. An abort ends each call's waits, as in a launch of one call.
    /// Without the meetings, a rank's CTA runs at most one call ahead of a peer that has not
    /// sent it the current one: the grid is no longer in lock step.
    ///
    /// Inlined into the kernel: `ops` is read with `ld.param`, which in a called function
    /// would read that function's own parameters ([`arch::load_param_v2`]).
    ///
    /// ```no_run
    /// use ferrolink_device::coll::group::{self, GROUP_LAUNCH_OPS_OFFSET, GroupLaunch};
    /// use ferrolink_device::{arch, kernel, kernel_param_address};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// As the built-in `coll_gpu_group_launch`; `RANK_OP_STRIDE` bytes of dynamic shared
    ///     /// memory per CTA, `count * ctas_per_rank` CTAs.
    ///     pub unsafe fn my_group_launch(launch: GroupLaunch) {
    ///         // The parameter's address, in the kernel's own body (the call is inlined into it).
    ///         let ops = kernel_param_address!(my_group_launch, 0, launch) + GROUP_LAUNCH_OPS_OFFSET as u64;
    ///         // SAFETY: the served entries follow `serve`'s contract (the kernel's contract).
    ///         unsafe {
    ///             group::serve_launch::<false>(
    ///                 launch.count,
    ///                 launch.ctas_per_rank,
    ///                 launch.skip,
    ///                 launch.operations,
    ///                 launch.grid_sync,
    ///                 launch.entries,
    ///                 ops,
    ///                 arch::block_idx_x(),
    ///                 arch::grid_dim_x(),
    ///             )
    ///         }
    ///     }
    /// }
    /// ```
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub unsafe fn serve_launch<const LL_ONLY: bool>(
        count: u32,
        ctas_per_rank: u32,
        skip: u32,
        operations: u32,
        grid_sync: u64,
        entries: u64,
        ops: u64,
        block: usize,
        grid: usize,
    ) {
        let coop = CoopCta;
        let per = ctas_per_rank.max(1) as usize;
        let (part, cta) = (block / per, block % per);
        let count = (count as usize).min(MAX_LOCAL_RANKS);
        let served = part < count && skip & (1 << part) == 0;
        let most = if entries != 0 { MAX_LAUNCH_OPERATIONS } else { MAX_LAUNCH_ENTRIES / count.max(1) };
        let operations = (operations.max(1) as usize).min(most);
        // LL calls of one CTA per rank go on without meeting when the host asks (see the
        // ordering note above); anything else meets.
        let meet = !(LL_ONLY && per == 1 && grid_sync == 0);
        // Where a CTA waiting between operations looks for an abort (its rank's).
        let mut control = 0u64;
        // Chunk `c` of this CTA's entry of operation `j` in device memory.
        let device_chunk = |j: usize, c: usize| {
            let at = ((j * count + part) * RANK_OP_STRIDE + 16 * c) as u64;
            // SAFETY: the chunk lies inside the entry, 16-byte aligned (the stride is a
            // multiple of 16, `entries` aligned: contract), in device memory that the copy
            // before the launch wrote (stream order: visible to the kernel's loads) and that
            // nothing writes while the kernel runs.
            unsafe { ((entries + at) as *const [u64; 2]).read() }
        };
        // LL calls take a few microseconds, a read of device memory a good part of one: with
        // device entries, the LL kernel's threads load their chunk of the next operation's
        // entry before they run the current one, so that the load's latency is not between
        // the two calls (the CTA waited for it at the barrier after the entry's copy into
        // shared memory: ncu's most sampled stall of the 8-rank kernel, PERF.md call 15).
        // Only there: the general kernel has no registers to spare (255, with spills).
        let prefetch = LL_ONLY && entries != 0;
        let mine = coop.thread_rank();
        let chunks = RANK_OP_STRIDE / 16;
        let mut next = if prefetch && served && mine < chunks { device_chunk(0, mine) } else { [0; 2] };
        for j in 0..operations {
            if j > 0 && meet {
                // SAFETY: `grid_sync` is this launch's (contract); every CTA of the grid
                // comes here once per operation boundary.
                unsafe { grid_meeting(grid_sync as *mut GridSync, grid, control) };
            }
            if served {
                let at = ((j * count + part) * RANK_OP_STRIDE) as u64;
                // SAFETY: each 16-byte chunk lies inside the entry, 16-byte aligned (the
                // entries' offset and stride are multiples of 16, checked above; `entries` is
                // aligned, contract), in the parameter or in device memory as `device_chunk`
                // says.
                let entry = unsafe {
                    if prefetch {
                        // This thread's chunk `mine` of operation `j`, loaded one call ahead.
                        let held = next;
                        if j + 1 < operations && mine < chunks {
                            next = device_chunk(j + 1, mine);
                        }
                        read_entry(|c| if c == mine { held } else { device_chunk(j, c) })
                    } else if entries != 0 {
                        read_entry(|c| device_chunk(j, c))
                    } else {
                        read_entry(|c| arch::load_param_v2(ops + at + 16 * c as u64))
                    }
                };
                control = entry.comm.control;
                if LL_ONLY {
                    run_entry_ll(entry, cta, per);
                } else {
                    run_entry(entry, cta, per);
                }
                // Every thread is done with the entry before the next one is written.
                coop.sync();
            }
        }
    }

    /// Every CTA of the grid (`grid` of them) meets here: returns once all have arrived, or
    /// on an abort of the communicator whose control block is `control` (0: none to look
    /// at). A CTA's arrival follows all its threads' work (a CTA barrier).
    ///
    /// # Ordering
    /// Thread 0 reads the generation, then adds its arrival with acquire-release at GPU
    /// scope (releasing its CTA's work, which the CTA barrier before made its own); the
    /// adds form one release sequence, so the last adder (arrivals `grid - 1` before it)
    /// has acquired every CTA's work; it sets the arrivals back to 0 (relaxed: no CTA adds
    /// again before it sees the new generation) and raises the generation with a release.
    /// The others wait for the generation to change (acquire), and then the CTA barrier
    /// hands that to every thread. The generation read before the add is the current one:
    /// it changes only after every CTA, this one included, has added.
    ///
    /// # Safety
    /// `sync` is a live [`GridSync`] used only by this grid's CTAs while it runs, every one
    /// of which calls this the same number of times; the CTAs are resident at once.
    unsafe fn grid_meeting(sync: *mut GridSync, grid: usize, control: u64) {
        let coop = CoopCta;
        coop.sync();
        if coop.thread_rank() == 0 {
            let arrived = sync.wrapping_byte_add(core::mem::offset_of!(GridSync, arrived)) as *mut u64;
            let generation = sync.wrapping_byte_add(core::mem::offset_of!(GridSync, generation)) as *mut u64;
            // SAFETY: the words of a live GridSync, accessed atomically only (contract).
            unsafe {
                let now = atomic::load(generation, LoadOrder::Relaxed, Scope::Gpu);
                let before = atomic::fetch_add(arrived, 1, RmwOrder::AcqRel, Scope::Gpu);
                if before + 1 == grid as u64 {
                    atomic::store(arrived, 0, StoreOrder::Relaxed, Scope::Gpu);
                    atomic::store(generation, now.wrapping_add(1), StoreOrder::Release, Scope::Gpu);
                } else {
                    let mut polls = 0u32;
                    while atomic::load(generation, LoadOrder::Acquire, Scope::Gpu) == now {
                        polls = polls.wrapping_add(1);
                        if polls.is_multiple_of(ABORT_POLLS)
                            && control != 0
                            && atomic::load(control as *const u32, LoadOrder::Relaxed, Scope::Sys) != 0
                        {
                            break;
                        }
                        arch::spin_wait_hint(64);
                    }
                }
            }
        }
        coop.sync();
    }

    /// Copies a [`RankOp`] into shared memory, `load(c)` giving its 16-byte chunk `c` (one
    /// per thread, all at once), and returns it there: every thread of the CTA reads it in
    /// place. (A copy per thread, `ptr::read` of the 432-byte entry, became byte-wise shared
    /// loads and local stores, about 1400 instructions per thread before any work; removing
    /// it did not measurably shorten the call on the H200: PERF.md, issue 12 thirteenth part.)
    ///
    /// # Safety
    /// `load` is safe to call for chunks `0..RANK_OP_STRIDE / 16`; the CTA has
    /// [`RANK_OP_STRIDE`] bytes of dynamic shared memory; every thread calls this. The entry
    /// is valid until the CTA's shared memory is written again: every thread must be done
    /// with it (a CTA barrier) before the next call.
    #[inline(always)]
    unsafe fn read_entry<'s>(load: impl Fn(usize) -> [u64; 2]) -> &'s RankOp {
        let coop = CoopCta;
        let shared = arch::dynamic_shared_mem::<u64>();
        let mut c = coop.thread_rank();
        while c < RANK_OP_STRIDE / 16 {
            let [a, b] = load(c);
            // SAFETY: the shared memory holds RANK_OP_STRIDE bytes (contract), 8-byte aligned.
            unsafe {
                shared.add(2 * c).write(a);
                shared.add(2 * c + 1).write(b);
            }
            c += coop.size();
        }
        // Orders every thread's chunk before every thread's reads of the entry.
        coop.sync();
        // SAFETY: the words written above, 8-byte aligned (RankOp is Pod: any bytes are a
        // value), not written again while the reference is used (contract).
        unsafe { &*(shared as *const RankOp) }
    }

    /// Runs part `cta` of `per` of `entry`'s operation, unless it is a [`SHUTDOWN`]; returns
    /// whether it was. The entry's parts are passed by reference where they lie.
    #[inline(always)]
    fn run_entry(entry: &RankOp, cta: usize, per: usize) -> bool {
        let (op, comm) = (&entry.op, &entry.comm);
        if op.args.kind == SHUTDOWN {
            return true;
        }
        let args = CollArgs { barrier: 0, ..op.args };
        if comm.lsa_size < comm.nranks {
            // SAFETY: the operation follows `run_gin`'s contract (the callers' contracts).
            unsafe { run_gin(comm, &op.send, &op.gather, &args, op.recv as *mut u8, cta, per) };
        } else {
            // SAFETY: the operation follows `run_lsa`'s contract (the callers' contracts).
            unsafe { run_lsa(comm, &op.send, &op.recv_win, &args, op.recv as *mut u8, cta, per) };
        }
        false
    }

    /// Runs an LL call inside one LSA domain (else a fault) passed as the kernel's parameter
    /// at `param` (its parameter-space address), as CTA `cta` of `per`: the entry is read
    /// into shared memory (as a shared launch's, so that every thread reads it in place, not
    /// a copy of its own in local memory: on the H200 the copy made a 512-thread CTA of one
    /// rank's 4 KiB LL all-reduce 1.8 µs slower, PERF.md, issue 12 twentieth part).
    ///
    /// # Safety
    /// `param` is the address of a kernel parameter holding a [`RankOp`] that follows
    /// [`super::run_lsa_ll`]'s contract; the CTA has [`RANK_OP_STRIDE`] bytes of dynamic
    /// shared memory; every thread of the CTA calls this, inlined into the kernel whose
    /// parameter `param` is (as [`serve_launch`]).
    ///
    /// ```no_run
    /// use ferrolink_device::coll::group::{self, RankOp};
    /// use ferrolink_device::{arch, kernel, kernel_param_address};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// As the built-in `coll_ll`: one rank's LL call, read in place from the parameter;
    ///     /// `RANK_OP_STRIDE` bytes of dynamic shared memory per CTA.
    ///     pub unsafe fn my_ll(entry: RankOp) {
    ///         let param = kernel_param_address!(my_ll, 0, entry);
    ///         // SAFETY: `entry` is an LL call inside one LSA domain (the kernel's contract).
    ///         unsafe { group::serve_own_ll(param, arch::block_idx_x(), arch::grid_dim_x()) }
    ///     }
    /// }
    /// ```
    #[inline(always)]
    pub unsafe fn serve_own_ll(param: u64, cta: usize, per: usize) {
        // SAFETY: each 16-byte chunk lies inside the parameter (a RankOp is RANK_OP_STRIDE
        // bytes, checked above), 16-byte aligned (contract).
        let entry = unsafe { read_entry(|c| arch::load_param_v2(param + 16 * c as u64)) };
        run_entry_ll(entry, cta, per);
    }

    /// Runs part `cta` of `per` of `entry`'s operation, an LL call inside one LSA domain
    /// (else a fault), by [`super::run_lsa_ll`].
    #[inline(always)]
    fn run_entry_ll(entry: &RankOp, cta: usize, per: usize) {
        let (op, comm) = (&entry.op, &entry.comm);
        if comm.lsa_size < comm.nranks {
            comm.fail(crate::comm::error_code::COLL_ARGS, u64::from(op.args.kind) << 32, u64::from(op.args.proto));
        }
        let args = CollArgs { barrier: 0, ..op.args };
        // SAFETY: the operation follows `run_lsa_ll`'s contract (the callers' contracts).
        unsafe { super::run_lsa_ll(comm, &op.recv_win, &args, op.recv as *mut u8, cta, per) };
    }

    /// Polls between looks at the abort flag.
    const ABORT_POLLS: u32 = 1024;

    /// The persistent kernel: serves the ranks of `ranks` from its ring. CTA `block` runs
    /// part `block % ctas_per_rank` of its rank's operations with LSA barrier `block %
    /// ctas_per_rank` of the rank's communicator ([`run_lsa`]), from operation `first` on, each once `sync.seq` has reached its number, counts its CTAs done, and the
    /// last CTA of the grid publishes the number in `sync.completed`; it returns after a
    /// [`SHUTDOWN`], or on an abort (the last CTA to leave stores [`ABORTED`] there).
    ///
    /// # Ordering
    /// The host writes operation `s`'s slot entries (plain stores to host memory) before it
    /// hands the operation over; the stream that hands it over, submitted after the stores,
    /// copies the slot into the ring (device memory) and then writes `seq`, a stream write
    /// that is a system-scope memory barrier for the copy before it. Thread 0 reads `seq`
    /// relaxed at system scope, and (after the first operation) `completed` relaxed at GPU
    /// scope until it shows the previous operation done, then fences with acquire at system
    /// scope (acquiring the last CTA's release of `completed`, hence every CTA's part of that
    /// operation: no operation overlaps the previous one, whose outputs it may read); the
    /// CTA's threads then read the entry (volatile: never from a stale cache line) into
    /// shared memory and meet at the CTA barrier. Each CTA's part ends with `run_lsa`'s exit barrier; then
    /// thread 0 adds to `ctas_done` with acquire-release at GPU scope, so the last adder has
    /// acquired every CTA's part (and their reads of the slot); it stores 0 into `ctas_done`
    /// and then `completed` with a release at system scope, which the stream's wait observes.
    /// A stream may write the next `seq` before that (a rank alone on its GPU hands several
    /// operations over before waiting), but no CTA starts the next operation before
    /// `completed` shows this one, so the next operation's adds see the reset count; the
    /// host rewrites a slot only after the operation that used it has completed (a stream
    /// event after the wait for it).
    ///
    /// # Safety
    /// The ring holds, for every operation the kernel runs, each served part's [`RankOp`]:
    /// a live communicator (whose control block is in `controls`) and an operation following
    /// [`run_lsa`]'s contract, unchanged until the operation completes; `sync`, if set, is a
    /// live [`GroupSync`] written only as above (none: the kernel returns at once); every rank of the communicator runs the same
    /// operations in the same order with the same `ctas_per_rank`; LSA barriers
    /// `0..ctas_per_rank` of each rank's communicator are this kernel's; the grid has `count *
    /// ctas_per_rank` CTAs, each with `RANK_OP_STRIDE` bytes of dynamic shared memory; the
    /// ring's entries are `RANK_OP_STRIDE` bytes apart from a 16-byte aligned base.
    ///
    /// ```no_run
    /// use ferrolink_device::coll::group::{self, LocalRanks};
    /// use ferrolink_device::{arch, kernel};
    /// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
    /// kernel! {
    ///     /// As the built-in `coll_gpu_group`: `count * ctas_per_rank` CTAs, `RANK_OP_STRIDE`
    ///     /// bytes of dynamic shared memory each; runs until a `SHUTDOWN` or an abort.
    ///     pub unsafe fn my_persistent(ranks: LocalRanks, first: u64) {
    ///         // SAFETY: the ring and `sync` follow `serve`'s contract (the kernel's contract).
    ///         unsafe { group::serve(&ranks, first, arch::block_idx_x()) }
    ///     }
    /// }
    /// ```
    pub unsafe fn serve(ranks: &LocalRanks, first: u64, block: usize) {
        let per = ranks.ctas_per_rank.max(1) as usize;
        let (part, cta) = (block / per, block % per);
        let count = (ranks.count as usize).min(MAX_LOCAL_RANKS);
        if part >= count || ranks.skip & (1 << part) != 0 {
            return;
        }
        let coop = CoopCta;
        let sync = ranks.sync as *mut GroupSync;
        if sync.is_null() {
            return;
        }
        let control = ranks.controls[part];
        let abort_requested = || {
            // SAFETY: `control` is the rank's live control block (contract); the host and
            // kernels access `abort` only atomically.
            control != 0 && unsafe { atomic::load(control as *const u32, LoadOrder::Relaxed, Scope::Sys) } != 0
        };
        // CTA 0's thread 0 times its steps (see `GroupSync`).
        let timing = block == 0 && coop.thread_rank() == 0;
        let stamp = |offset: usize, t0: u64, t1: u64| {
            if timing {
                let word = sync.wrapping_byte_add(offset) as *mut u64;
                // SAFETY: `sync` is live; these words are written only by this thread.
                unsafe { word.write_volatile(word.read_volatile() + t1.saturating_sub(t0)) };
            }
        };
        let (seq_word, completed_word) =
            (sync.wrapping_byte_add(SEQ_OFFSET) as *const u64, sync.wrapping_byte_add(COMPLETED_OFFSET) as *const u64);
        let mut next = first;
        loop {
            let t_wait = arch::global_timer_ns();
            let mut aborted = false;
            if coop.thread_rank() == 0 {
                let mut polls = 0u32;
                // Operation `next` is handed over, and (after the first) its predecessor
                // has completed on every CTA: a stream may hand operations over before the
                // previous ones complete, and operations run one at a time.
                // SAFETY: `sync` is live (contract); a stream writes `seq` atomically, the
                // kernel `completed`.
                let ready = || unsafe {
                    atomic::load(seq_word, LoadOrder::Relaxed, Scope::Sys) >= next
                        && (next == first || atomic::load(completed_word, LoadOrder::Relaxed, Scope::Gpu) + 1 >= next)
                };
                while !ready() {
                    polls = polls.wrapping_add(1);
                    if polls.is_multiple_of(ABORT_POLLS) && abort_requested() {
                        aborted = true;
                        break;
                    }
                    arch::spin_wait_hint(64);
                }
                arch::atomic::fence(arch::FenceOrder::Acquire, Scope::Sys);
            }
            if coop.sync_any(aborted) {
                if coop.thread_rank() == 0 {
                    // The last CTA to leave releases the stream waiting for an operation
                    // that will not run (every CTA has stopped touching operations' memory:
                    // each one's add is a release, acquired by the last).
                    let left = sync.wrapping_byte_add(core::mem::offset_of!(GroupSync, aborted_ctas)) as *mut u64;
                    // SAFETY: as above; `aborted_ctas` is changed only by these CTAs.
                    let before = unsafe { atomic::fetch_add(left, 1, RmwOrder::AcqRel, Scope::Gpu) };
                    if before + 1 == (count * per) as u64 {
                        // SAFETY: as above.
                        unsafe {
                            atomic::store(
                                sync.wrapping_byte_add(COMPLETED_OFFSET) as *mut u64,
                                ABORTED,
                                StoreOrder::Release,
                                Scope::Sys,
                            )
                        };
                    }
                }
                return;
            }
            let t_ready = arch::global_timer_ns();
            // This rank's entry of the slot: one 16-byte volatile load per thread, all at once
            // (device memory: the stream copied the slot there before handing it over).
            let slot = (next % u64::from(ranks.slots.max(1))) as usize;
            let entry = (ranks.ring as *const U32x4).wrapping_byte_add((slot * count + part) * RANK_OP_STRIDE);
            // SAFETY: the entry is live, 16-byte aligned and unchanged until the operation
            // completes (contract); the shared memory holds RANK_OP_STRIDE bytes (contract).
            let entry = unsafe {
                read_entry(|c| {
                    let v = arch::load_v4_volatile(entry.wrapping_add(c)).0;
                    [u64::from(v[0]) | u64::from(v[1]) << 32, u64::from(v[2]) | u64::from(v[3]) << 32]
                })
            };
            let t_read = arch::global_timer_ns();
            let shutdown = run_entry(entry, cta, per);
            // Every thread is done with the entry before the next one is written.
            coop.sync();
            if timing && !shutdown {
                stamp(core::mem::offset_of!(GroupSync, waiting_ns), t_wait, t_ready);
                stamp(core::mem::offset_of!(GroupSync, reading_ns), t_ready, t_read);
                stamp(core::mem::offset_of!(GroupSync, running_ns), t_read, arch::global_timer_ns());
                stamp(core::mem::offset_of!(GroupSync, ops), 0, 1);
            }
            if coop.thread_rank() == 0 {
                let done_word = sync.wrapping_byte_add(core::mem::offset_of!(GroupSync, ctas_done)) as *mut u64;
                // SAFETY: `sync` is live; `ctas_done` is changed only by these CTAs.
                let before = unsafe { atomic::fetch_add(done_word, 1, RmwOrder::AcqRel, Scope::Gpu) };
                if before + 1 == (count * per) as u64 {
                    // SAFETY: as above.
                    unsafe {
                        atomic::store(done_word, 0, StoreOrder::Relaxed, Scope::Gpu);
                        atomic::store(
                            sync.wrapping_byte_add(COMPLETED_OFFSET) as *mut u64,
                            next,
                            StoreOrder::Release,
                            Scope::Sys,
                        );
                    }
                }
            }
            if shutdown {
                return;
            }
            next += 1;
        }
    }
}
