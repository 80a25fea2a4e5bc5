//! The LL ("low latency") protocol: small collectives inside one LSA domain with the flag in
//! the data word, so that no barrier separates a rank's data from its peers' reads of it.
//!
//! # The lines
//! A sender writes each 8 bytes of payload (a *unit*) into the receiver's LL buffer as two
//! 8-byte *lines*, each holding 4 bytes of data in its low half and the call's flag in its
//! high half. Both lines go in one instruction (`st.relaxed.sys.v2.u64`), each of them a
//! single-copy-atomic 8-byte store. A receiver polls a unit's lines from every sender (up to
//! [`SENDERS_AT_ONCE`] of them per round trip, one `ld.relaxed.sys.v2.u64` each) until
//! both lines of each carry this call's flag, then uses their data. One pass over
//! NVLink, no fence, no barrier round trip; half of every line is flag, so the protocol is
//! for small messages ([`MAX_BYTES`] per sender at most; the host's tuner picks it below a
//! threshold, `FERROLINK_PROTO` forces it).
//!
//! # Buffers and flags
//! Each rank's buffer (a window, [`CollArgs::recv_offset`] of the kernel's `recv_win`) has
//! a region per (parity, CTA index, sender) of [`UNITS_PER_CTA`] units: CTA `b` of every
//! rank handles units `b * UNITS_PER_CTA ..` of the payload and writes only the regions of
//! index `b`. The flag of CTA `b` is the epoch that its LSA barrier `args.barrier + b`
//! reaches by the call's arrival (every rank's barrier `b` advances alike: by two per
//! simple-protocol call, by one per LL call), and the parity is the flag's low bit. So the
//! flag needs no state of its own, and a call captured into a CUDA graph and replayed gets
//! a new flag each time.
//!
//! # Ordering
//! * *Data*: a receiver that loads a line (relaxed, system scope) and finds this call's
//!   flag reads the data of the same store: one 8-byte location, written whole (PTX
//!   single-copy atomicity and coherence). No other memory is published through a line.
//!   The paired loads and stores change nothing here: PTX treats a vector access as one
//!   access per element, so each line is still loaded and stored atomically on its own, and
//!   a receiver checks each line's flag (never one line's flag for the other's data).
//! * *Reuse*: lines of parity `q` of CTA index `b` are rewritten by the call whose flag has
//!   the same parity next, at least two flags later. Between two LL calls of consecutive
//!   flags `f`, `f + 1` nothing is reused. For flag `f + 2`, a sender `A` writes receiver
//!   `P`'s region only after its own call `f + 1` ended on CTA `b`, which needed `P`'s lines
//!   of flag `f + 1` (every rank receives from every other: [`applies_to`]), which `P`'s
//!   CTA `b` wrote only in its kernel of call `f + 1`, after its kernel of call `f` (which
//!   read every line of call `f`) had ended: stream order. (A shared launch that carries
//!   several calls, `super::group::serve_launch`, does so only when every rank of the LSA
//!   domain is in that launch, on one GPU, and meets at a grid barrier between the calls,
//!   which orders them at GPU scope, the scope of every access between those ranks, as the
//!   end of one kernel and the start of the next would; or, for LL calls of one CTA per rank,
//!   goes on without the grid barrier: `P`'s call `f + 1` then starts after the CTA barrier
//!   that ended its call `f` in the same CTA, which serves in place of the kernel's end. In
//!   persistent mode, `super::group::serve`, the kernel of each GPU starts an operation only once every one of
//!   its CTAs has ended the previous one, which thread 0 of each CTA acquires from the
//!   completion word at system scope before its CTA goes on: it stands for the end of `P`'s
//!   kernel of call `f`, and each operation's CTA `b` uses barrier `b` of the kernel's device
//!   communicator, whose LL buffer is the kernel's alone.) A simple-protocol call in
//!   between adds two to the flag and keeps the parity alternating; its barriers order
//!   everything before it anyway.
//! * *Freshness*: a line not written in this call holds the flag of an earlier call of the
//!   same CTA index (or 0, never written), which differs from this call's flag until the
//!   32-bit epoch wraps (2^32 arrivals on one index). The host never lets it: it counts an
//!   upper bound of the epochs (two per call, one per LL call), and an LL call that could
//!   take it to 2^31 first renews the device communicator and the LL buffer (fresh barriers
//!   from epoch 0, zeroed lines), on every rank in the same call. Replays of a captured
//!   graph are not counted (a known limit: 2^31 replays of LL calls). `recover` resets the
//!   epochs, so the host zeroes every LL buffer then (a captured graph may replay a call on
//!   an old one).
//! * *Diagnosis*: after its stores each sender arrives at barrier `b` (relaxed: it publishes
//!   nothing: it is the index's only arrival in this call, and earlier rounds' writes were
//!   performed when their kernels ended, or ordered by a shared launch's grid barrier, see
//!   `crate::barrier`). A receiver whose data is
//!   slow writes the barrier's wait record, so the host's watchdog names the senders that
//!   have not arrived, and looks at the abort flag between polls: an abort ends the wait
//!   (the output is then undefined).
//!
//! Reduce and broadcast are not run this way ([`applies_to`]).
//!
//! Results are bitwise those of the simple protocol's one-shot: sources reduced in LSA rank
//! order, with `Avg`'s steps where it takes them.

use super::{CollArgs, CollElem, CollKind, DataType, Op, RedOp, ReductionBody, with_reduction};
use crate::arch::{self, Scope, atomic};
use crate::barrier::{BACKOFFS_PER_ABORT_CHECK, BarrierOrder, LsaBarrierSession, SPINS_BEFORE_BACKOFF};
use crate::comm::{DevComm, error_code};
use crate::coop::{Coop, CoopCta};
use crate::window::DevWindow;

/// Protocol codes ([`CollArgs::proto`]).
pub mod proto {
    /// Data first, then barriers: every algorithm.
    ///
    /// ```
    /// use ferrolink_device::coll::{CollArgs, proto};
    /// assert_eq!(CollArgs::default().proto, proto::SIMPLE); // unless the tuner picks LL
    /// ```
    pub const SIMPLE: u32 = 0;
    /// The flag in the data word ([`super`]): one-shot inside one LSA domain, small messages,
    /// all-reduce, reduce-scatter, all-gather and all-to-all ([`super::applies_to`]).
    ///
    /// ```
    /// use ferrolink_device::coll::{CollArgs, CollKind, DataType, RedOp, ll, proto};
    /// // A 4 KiB f32 all-reduce with LL: the input itself at `input`, the LL buffer at
    /// // `recv_offset` of the kernel's `recv_win`, `ll::grid(bytes)` CTAs.
    /// let input: u64 = 0x7f00_0000_0000; // this rank's input (any device memory)
    /// let args = CollArgs {
    ///     kind: CollKind::AllReduce as u32,
    ///     dtype: DataType::F32 as u32,
    ///     op: RedOp::Sum as u32,
    ///     proto: proto::LL,
    ///     count: 1024,
    ///     input,
    ///     ..CollArgs::default()
    /// };
    /// assert!(ll::applies_to(CollKind::AllReduce));
    /// assert_eq!(ll::grid(args.count as usize * DataType::F32.size()), 1);
    /// ```
    pub const LL: u32 = 1;
    /// The highest protocol code.
    ///
    /// ```
    /// use ferrolink_device::coll::proto;
    /// assert_eq!(proto::NAMES.len(), proto::LAST as usize + 1);
    /// ```
    pub const LAST: u32 = LL;
    /// Each protocol's name, by code: how `FERROLINK_PROTO` and `ferrolink-perf --proto`
    /// spell it.
    ///
    /// ```
    /// use ferrolink_device::coll::proto;
    /// assert_eq!(proto::NAMES[proto::LL as usize], "ll");
    /// ```
    pub const NAMES: [&str; LAST as usize + 1] = ["simple", "ll"];

    /// The code of the protocol named `name` ([`NAMES`]), or `None`.
    ///
    /// ```
    /// use ferrolink_device::coll::proto;
    /// assert_eq!(proto::from_name("simple"), Some(proto::SIMPLE));
    /// assert_eq!(proto::from_name("LL"), None); // names are lower case
    /// ```
    pub fn from_name(name: &str) -> Option<u32> {
        NAMES.iter().position(|&n| n == name).map(|i| i as u32)
    }
}

/// Payload bytes per unit (two lines).
///
/// ```
/// use ferrolink_device::coll::ll::{UNIT_BYTES, UNIT_LINE_BYTES};
/// // A unit's 8 payload bytes travel as two 8-byte lines, 4 data bytes low and the call's
/// // flag high in each (as a sender stores them):
/// let (unit, flag) = (0x1122_3344_5566_7788u64, 7u32);
/// let f = u64::from(flag) << 32;
/// let lines = [(unit & 0xffff_ffff) | f, (unit >> 32) | f];
/// assert_eq!(core::mem::size_of_val(&unit), UNIT_BYTES);
/// assert_eq!(core::mem::size_of_val(&lines), UNIT_LINE_BYTES);
/// // A receiver takes the unit once both lines carry this call's flag.
/// assert!(lines.iter().all(|l| (l >> 32) as u32 == flag));
/// assert_eq!((lines[0] & 0xffff_ffff) | (lines[1] << 32), unit);
/// ```
pub const UNIT_BYTES: usize = 8;
/// Bytes of a unit's two lines in the buffer.
///
/// ```
/// use ferrolink_device::coll::ll::{UNIT_BYTES, UNIT_LINE_BYTES};
/// assert_eq!(UNIT_LINE_BYTES, 2 * UNIT_BYTES); // half of every line is flag
/// ```
pub const UNIT_LINE_BYTES: usize = 16;
/// Units each CTA carries per sender: the call's grid is the payload's units over this.
///
/// ```
/// use ferrolink_device::coll::ll::{UNIT_BYTES, UNITS_PER_CTA, grid};
/// assert_eq!(grid(UNITS_PER_CTA * UNIT_BYTES), 1);
/// assert_eq!(grid(UNITS_PER_CTA * UNIT_BYTES + 1), 2);
/// ```
pub const UNITS_PER_CTA: usize = 512;
/// The most CTAs of an LL call (regions per parity and sender).
///
/// ```
/// use ferrolink_device::coll::ll::{MAX_BYTES, MAX_CTAS, grid};
/// assert_eq!(grid(MAX_BYTES), MAX_CTAS);
/// ```
pub const MAX_CTAS: usize = 16;
/// The most payload bytes per sender of an LL call: `count * size` (the whole input for
/// all-reduce and all-gather; one block for reduce-scatter and all-to-all).
///
/// ```
/// use ferrolink_device::coll::{DataType, ll::MAX_BYTES};
/// assert_eq!(MAX_BYTES, 64 * 1024);
/// // An f32 all-reduce of 16 Ki elements per rank is the largest LL all-reduce of f32.
/// assert_eq!(MAX_BYTES / DataType::F32.size(), 16 * 1024);
/// ```
pub const MAX_BYTES: usize = MAX_CTAS * UNITS_PER_CTA * UNIT_BYTES;

/// Whether the protocol runs collective `kind`: those in which every rank receives from
/// every other (all-reduce, reduce-scatter, all-gather, all-to-all). The buffer's reuse rests
/// on it (module docs, *Reuse*): in a reduce or a broadcast a sender waits for nobody, so it
/// could run two calls ahead of a slow receiver and overwrite lines not yet read.
///
/// ```
/// use ferrolink_device::coll::{CollKind, ll::applies_to};
/// assert!(applies_to(CollKind::AllReduce) && applies_to(CollKind::AllToAll));
/// assert!(!applies_to(CollKind::Broadcast) && !applies_to(CollKind::Reduce));
/// ```
pub const fn applies_to(kind: CollKind) -> bool {
    matches!(kind, CollKind::AllReduce | CollKind::ReduceScatter | CollKind::AllGather | CollKind::AllToAll)
}

/// Bytes of the LL buffer each rank of an LSA domain of `lsa_size` ranks needs.
///
/// ```
/// use ferrolink_device::coll::ll::buffer_bytes;
/// assert_eq!(buffer_bytes(8), 2 << 20); // 2 MiB per rank for 8 ranks
/// ```
pub const fn buffer_bytes(lsa_size: usize) -> usize {
    2 * MAX_CTAS * lsa_size * UNITS_PER_CTA * UNIT_LINE_BYTES
}

/// CTAs of an LL call with `bytes` of payload per sender (at least one).
///
/// ```
/// use ferrolink_device::coll::ll::grid;
/// assert_eq!(grid(0), 1);
/// assert_eq!(grid(4096), 1); // 512 units of 8 bytes: one CTA's share
/// assert_eq!(grid(4097), 2);
/// ```
pub const fn grid(bytes: usize) -> usize {
    let ctas = bytes.div_ceil(UNITS_PER_CTA * UNIT_BYTES);
    if ctas == 0 { 1 } else { ctas }
}

/// Byte offset, from the buffer's start, of unit `unit` (of CTA index `cta`'s share) from
/// sender `sender` in calls of parity `parity`.
#[inline(always)]
const fn line_offset(parity: usize, cta: usize, lsa_size: usize, sender: usize, unit: usize) -> usize {
    (((parity * MAX_CTAS + cta) * lsa_size + sender) * UNITS_PER_CTA + unit) * UNIT_LINE_BYTES
}

/// The payload unit `unit` of the `block` bytes at `base` (elements of `size` bytes, `base`
/// aligned to `size`); bytes past the block read as 0.
///
/// # Safety
/// `base` is valid for reads of `block` bytes, which nothing writes meanwhile.
#[inline(always)]
unsafe fn load_unit(base: *const u8, block: usize, unit: usize, size: usize) -> u64 {
    let first = unit * UNIT_BYTES;
    let bytes = (block - first).min(UNIT_BYTES);
    // SAFETY: every read lies in [first, first + bytes) of the block, aligned to its width.
    unsafe {
        let p = base.add(first);
        if bytes == UNIT_BYTES && (p as usize) & 7 == 0 {
            return (p as *const u64).read();
        }
        let mut v = 0u64;
        let mut i = 0;
        while i < bytes {
            let e = match size {
                1 => u64::from(p.add(i).read()),
                2 => u64::from((p.add(i) as *const u16).read()),
                4 => u64::from((p.add(i) as *const u32).read()),
                _ => (p.add(i) as *const u64).read(),
            };
            v |= e << (8 * i);
            i += size;
        }
        v
    }
}

/// Writes payload unit `unit` of the `block` bytes at `base` (as [`load_unit`] reads it):
/// only the bytes inside the block.
///
/// # Safety
/// `base` is valid for writes of `block` bytes, which nobody else accesses meanwhile.
#[inline(always)]
unsafe fn store_unit(base: *mut u8, block: usize, unit: usize, size: usize, v: u64) {
    let first = unit * UNIT_BYTES;
    let bytes = (block - first).min(UNIT_BYTES);
    // SAFETY: every write lies in [first, first + bytes) of the block, aligned to its width.
    unsafe {
        let p = base.add(first);
        if bytes == UNIT_BYTES && (p as usize) & 7 == 0 {
            (p as *mut u64).write(v);
            return;
        }
        let mut i = 0;
        while i < bytes {
            let e = v >> (8 * i);
            match size {
                1 => p.add(i).write(e as u8),
                2 => (p.add(i) as *mut u16).write(e as u16),
                4 => (p.add(i) as *mut u32).write(e as u32),
                _ => (p.add(i) as *mut u64).write(e),
            }
            i += size;
        }
    }
}

/// `f` on each of the `8 / size_of::<T>()` lanes of two units.
#[inline(always)]
fn lanes64<T: CollElem>(a: u64, b: u64, f: impl Fn(T, T) -> T) -> u64 {
    let size = core::mem::size_of::<T>();
    let bits = 8 * size;
    let mask = if size == 8 { u64::MAX } else { (1u64 << bits) - 1 };
    let mut r = 0u64;
    for k in 0..UNIT_BYTES / size {
        let (x, y) = ((a >> (bits * k)) & mask, (b >> (bits * k)) & mask);
        r |= (f(T::from_bits64(x), T::from_bits64(y)).to_bits64() & mask) << (bits * k);
    }
    r
}

/// Senders whose lines of one unit a thread loads together (`Waits::wait_units`): one
/// round trip to memory for up to this many (an LSA domain of 8 GPUs, or 8 virtual ranks,
/// in one), where a unit at a time paid one per sender (on the H200, the warps of the 8
/// virtual ranks' 4 KiB all-reduce kernel stalled mostly on those serial loads: PERF.md,
/// issue 12 fourteenth part).
///
/// ```
/// use ferrolink_device::coll::ll::SENDERS_AT_ONCE;
/// // Round trips per unit a receiver of an LSA domain of `n` ranks pays (its own unit counted):
/// let round_trips = |n: usize| n.div_ceil(SENDERS_AT_ONCE);
/// assert_eq!((round_trips(8), round_trips(16)), (1, 2));
/// ```
pub const SENDERS_AT_ONCE: usize = 8;

/// One thread's view of the call's waits: the flag they look for and whether it has
/// written the barrier's wait record.
struct Waits<'s, 'c> {
    bar: &'s LsaBarrierSession<'c, CoopCta>,
    comm: &'c DevComm,
    flag: u32,
    published: bool,
    /// The units of the last [`Waits::wait_units`]. Here, not returned: one array for every
    /// element type and reduction the call's code has (returned, each of the 35 reduction
    /// bodies kept an array of its own in the kernels' stack frames, about 2 KB more).
    units: [u64; SENDERS_AT_ONCE],
}

impl Waits<'_, '_> {
    /// Puts the units from senders `from .. from + SENDERS_AT_ONCE` (those below `to`,
    /// except `skip`, whose entries are left as they are) into `self.units`, once both lines
    /// of each carry the flag; false if the communicator was aborted meanwhile. `lines(s)`
    /// is sender `s`'s two lines of the unit in this rank's buffer. Every poll loads the
    /// lines still awaited, all of them before it looks at any, so that their round trips
    /// overlap.
    ///
    /// # Safety
    /// Each `lines(s)` is a unit of this rank's LL buffer, written by senders only with
    /// [`send_unit`]'s atomic stores.
    #[inline(always)]
    unsafe fn wait_units(
        &mut self,
        lines: impl Fn(usize) -> *const [u64; 2],
        from: usize,
        to: usize,
        skip: usize,
    ) -> bool {
        // Bit k: sender `from + k` still awaited. (32-bit: ranks fit, and each 64-bit
        // comparison is two instructions on the GPU.)
        let (from32, to32, skip32) = (from as u32, to as u32, skip as u32);
        let mut awaited = 0u32;
        for k in 0..SENDERS_AT_ONCE as u32 {
            if from32 + k < to32 && from32 + k != skip32 {
                awaited |= 1 << k;
            }
        }
        let mut polls = 0u32;
        loop {
            let mut seen = [[0u64; 2]; SENDERS_AT_ONCE];
            for (k, pair) in seen.iter_mut().enumerate() {
                if awaited & (1 << k) != 0 {
                    // SAFETY: the sender's lines in this rank's buffer, accessed atomically
                    // only (contract); 16-byte aligned (units are 16 bytes from an aligned base).
                    *pair = unsafe { atomic::load_u64x2_relaxed(lines(from + k), Scope::Sys) };
                }
            }
            for (k, &[lo, hi]) in seen.iter().enumerate() {
                if awaited & (1 << k) != 0 && (lo >> 32) as u32 == self.flag && (hi >> 32) as u32 == self.flag {
                    self.units[k] = (lo & 0xffff_ffff) | (hi << 32);
                    awaited &= !(1 << k);
                }
            }
            if awaited == 0 {
                return true;
            }
            // Wrapping (see the barrier's poll loop): abort checks go on however long it waits.
            polls = polls.wrapping_add(1);
            if polls >= SPINS_BEFORE_BACKOFF {
                // (Once published, the record stays: a wrapped count republishes nothing.)
                if !self.published {
                    self.published = true;
                    self.bar.publish_wait();
                }
                if (polls - SPINS_BEFORE_BACKOFF).is_multiple_of(BACKOFFS_PER_ABORT_CHECK)
                    && self.comm.abort_requested()
                {
                    return false;
                }
                arch::spin_wait_hint(64);
            }
        }
    }
}

impl Waits<'_, '_> {
    /// Hands `each(s, unit)` every sender's unit, `s` in `0..n` in rank order, waiting for
    /// [`SENDERS_AT_ONCE`] of them at a time ([`Waits::wait_units`]); for `me` (this rank, whose
    /// unit is not in the buffer) `unit` is meaningless. False if the communicator was
    /// aborted meanwhile (then `each` may have seen only some senders).
    ///
    /// # Safety
    /// As [`Waits::wait_units`], for every `lines(s)`.
    #[inline(always)]
    unsafe fn each_unit(
        &mut self,
        lines: impl Fn(usize) -> *const [u64; 2],
        n: usize,
        me: usize,
        mut each: impl FnMut(usize, u64),
    ) -> bool {
        let mut from = 0;
        while from < n {
            // SAFETY: forwarded contract.
            if !unsafe { self.wait_units(&lines, from, n, me) } {
                return false;
            }
            for (k, &unit) in self.units.iter().enumerate() {
                if from + k >= n {
                    break;
                }
                each(from + k, unit);
            }
            from += SENDERS_AT_ONCE;
        }
        true
    }
}

/// Stores `v` as the two lines at `lines` (a peer's buffer) with `flag`, in one instruction
/// (each line atomic on its own).
///
/// # Safety
/// `lines` is a unit of a peer's LL buffer that no one else writes in this call.
#[inline(always)]
unsafe fn send_unit(lines: *mut [u64; 2], v: u64, flag: u32) {
    let f = u64::from(flag) << 32;
    // SAFETY: forwarded contract; 16-byte aligned (units are 16 bytes from an aligned base).
    unsafe { atomic::store_u64x2_relaxed(lines, [(v & 0xffff_ffff) | f, (v >> 32) | f], Scope::Sys) };
}

/// The receiving side of a reduction: for each of this thread's units, the sources in LSA
/// rank order (this rank's own block from its input, the others from the lines), reduced
/// into the output. An abort ends it early.
struct ReceiveReduction<'a, 's, 'c, L> {
    waits: &'a mut Waits<'s, 'c>,
    /// This rank's block of the input.
    own: *const u8,
    /// Line address of a unit from a sender: `lines(sender, unit)`.
    lines: L,
    out: *mut u8,
    block: usize,
    /// This CTA's units: `first..last`.
    units: (usize, usize),
    me: usize,
    n: usize,
}

impl<L: Fn(usize, usize) -> *const [u64; 2]> ReductionBody for ReceiveReduction<'_, '_, '_, L> {
    #[inline(always)]
    unsafe fn run<T: CollElem, O: Op>(self, avg: bool) {
        let size = core::mem::size_of::<T>();
        let coop = CoopCta;
        let n = self.n;
        let mut u = self.units.0 + coop.thread_rank();
        while u < self.units.1 {
            let mut acc = 0u64;
            let (own, block, me, lines) = (self.own, self.block, self.me, &self.lines);
            let each = |s: usize, unit: u64| {
                let v = if s == me {
                    // SAFETY: the input's block holds `block` bytes (caller's contract).
                    unsafe { load_unit(own, block, u, size) }
                } else {
                    unit
                };
                let v = if avg { lanes64::<T>(v, v, |x, _| x.avg_pre(n as u32)) } else { v };
                acc = if s == 0 { v } else { lanes64::<T>(acc, v, O::apply) };
            };
            // SAFETY: the senders' lines of this unit in this rank's buffer.
            if !unsafe { self.waits.each_unit(|s| lines(s, u), n, me, each) } {
                // Aborted: the host reports it.
                return;
            }
            if avg {
                acc = lanes64::<T>(acc, acc, |x, _| x.avg_post(n as u32));
            }
            // SAFETY: the output holds `block` bytes; this thread alone writes unit `u`.
            unsafe { store_unit(self.out, self.block, u, size, acc) };
            u += coop.size();
        }
    }
}

/// Runs `args` with the LL protocol as CTA `part` of `parts` of this rank (see the module
/// docs): `ll_win` at `args.recv_offset` is the buffer, `args.input` this rank's input (any
/// device memory), `recv` its output. Called by [`super::run_lsa`] for
/// [`proto::LL`].
///
/// # Safety
/// As [`super::run_lsa`], but the input is read at `args.input` only (never from a window)
/// and may be written again once this rank's kernel ended; the buffer is this
/// communicator's LL buffer on every rank (at least [`buffer_bytes`] from `recv_offset`,
/// written only by LL calls of this stream, checked for size); in place, `recv` may hold the
/// input (all-reduce; all-gather at this rank's block), each unit read and then written by
/// one thread. `kind` is one of [`applies_to`]'s (else a fault).
// Inlined: called as a function, it took the communicator, windows and arguments through
// generic pointers (the entry lies in shared memory), each field a generic load, and kept its
// locals on the stack (PERF.md, issue 12 twentieth part).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn run(
    comm: &DevComm,
    ll_win: &DevWindow,
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
    let size = dtype.size();
    let block = args.count as usize * size;
    let base = args.recv_offset as usize;
    if !applies_to(kind)
        || parts > MAX_CTAS
        || parts < grid(block)
        || block > MAX_BYTES
        || args.input == 0
        || !base.is_multiple_of(16)
        || (ll_win.size as usize) < base.saturating_add(buffer_bytes(n))
    {
        comm.fail(
            error_code::COLL_ARGS,
            u64::from(args.kind) << 32 | u64::from(args.algo),
            (parts as u64) << 48 | (args.count & 0xffff_ffff_ffff),
        );
    }
    let units = block.div_ceil(UNIT_BYTES);
    let first = (part * UNITS_PER_CTA).min(units);
    let last = (first + UNITS_PER_CTA).min(units);
    let input = args.input as *const u8;
    // The block each peer gets from this rank (reduce-scatter, all-to-all: its own).
    let block_for = |p: usize| match kind {
        CollKind::ReduceScatter | CollKind::AllToAll => p * block,
        _ => 0,
    };
    // SAFETY: barrier `args.barrier + part` is this CTA's (contract).
    let mut bar = unsafe { LsaBarrierSession::new(coop, comm, args.barrier + part as u32) };
    let flag = bar.epoch().wrapping_add(1);
    let parity = (flag & 1) as usize;
    // This CTA's regions of the parity, sender after sender; offsets inside them in 32 bits
    // (a sender's region is 8 KiB), as the kernel's hot loops compute them per unit and sender.
    let regions = base + line_offset(parity, part, n, 0, 0);
    let at = |sender: usize, unit: usize| {
        regions + ((sender as u32 * UNITS_PER_CTA as u32 + (unit - first) as u32) * UNIT_LINE_BYTES as u32) as usize
    };
    // Send: each thread its units, to every peer that receives from this rank. Where every
    // peer gets the same block (all-reduce, all-gather) the unit is loaded once.
    let same_block = !matches!(kind, CollKind::ReduceScatter | CollKind::AllToAll);
    let mut u = first + coop.thread_rank();
    while u < last {
        // SAFETY: the input holds this rank's block (contract).
        let own_unit = if same_block { unsafe { load_unit(input, block, u, size) } } else { 0 };
        // The unit's lines in peer 0's buffer; each next peer's are a slot stride further.
        let mut lines = ll_win.lsa_ptr::<[u64; 2]>(at(me, u), 0);
        for p in 0..n as u32 {
            if p != me as u32 {
                // SAFETY: the input holds the peer's block (contract); the unit's lines in
                // peer p's buffer are this rank's, CTA `part`'s, this thread's.
                unsafe {
                    let v =
                        if same_block { own_unit } else { load_unit(input.add(block_for(p as usize)), block, u, size) };
                    send_unit(lines, v, flag);
                }
            }
            lines = lines.wrapping_byte_add(ll_win.stride as usize);
        }
        u += coop.size();
    }
    // Relaxed: the lines carry their own flags; the arrival only tells the watchdog.
    bar.arrive_with(BarrierOrder::Relaxed);
    let mut waits = Waits { bar: &bar, comm, flag, published: false, units: [0; SENDERS_AT_ONCE] };
    let lines = |s: usize, unit: usize| ll_win.local_ptr::<[u64; 2]>(at(s, unit)) as *const [u64; 2];
    match kind {
        CollKind::AllReduce | CollKind::ReduceScatter => {
            let body = ReceiveReduction {
                waits: &mut waits,
                // SAFETY: (the pointer) this rank's block lies in its input (contract).
                own: unsafe { input.add(block_for(me)) },
                lines,
                out: recv,
                block,
                units: (first, last),
                me,
                n,
            };
            // SAFETY: the body's contract is this function's.
            unsafe { with_reduction(dtype, op, body) };
        }
        _ => {
            // Where sender s's block goes in the output.
            // SAFETY: (the pointer) the output holds `n` blocks (contract).
            let dst = |s: usize| unsafe { recv.add(s * block) };
            let mut u = first + coop.thread_rank();
            while u < last {
                let each = |s: usize, v: u64| {
                    if s == me {
                        // This rank's own block, unless it is already there (in place).
                        // SAFETY: (the pointer) the input holds the block (contract).
                        let src = unsafe { input.add(block_for(me)) };
                        if !core::ptr::eq(src, dst(me)) {
                            // SAFETY: input and output hold the block; this thread alone
                            // reads and writes unit `u` of it.
                            unsafe { store_unit(dst(me), block, u, size, load_unit(src, block, u, size)) };
                        }
                    } else {
                        // SAFETY: the output holds sender s's block; this thread alone
                        // writes unit `u` of it.
                        unsafe { store_unit(dst(s), block, u, size, v) };
                    }
                };
                // SAFETY: the senders' lines of this unit in this rank's buffer.
                if !unsafe { waits.each_unit(|s| lines(s, u), n, me, each) } {
                    return;
                }
                u += coop.size();
            }
        }
    }
}
