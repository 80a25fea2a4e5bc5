//! Point-to-point sends and receives (NCCL's `ncclSend` / `ncclRecv` in a group), written on
//! the public GIN API: one kernel runs a group's operations together, so that a rank may send
//! to and receive from any peers in one group without deadlock.
//!
//! # Channels, slots and sequence numbers
//! Every ordered pair of ranks (sender, receiver) has `channels` independent channels. The
//! receiver keeps, in its receive window, a region per sender of `slots` slots of `chunk`
//! bytes; channel `ch` owns part `ch` of every slot (`chunk / channels` bytes). A message of
//! `bytes` bytes travels as `ceil(bytes / chunk)` chunks; chunk `k` of the pair's life (its
//! sequence number, counted by both sides' hosts, which pass each operation's first one in
//! [`P2pOp::seq`]) uses slot `k % slots` on every channel.
//!
//! Channel `ch` of a pair has two signals: `data + ch` on the receiver (the sender's part of
//! it, [`Gin::read_signal_from`], counts chunks delivered) and `ack + ch` on the sender (the
//! receiver's part counts chunks consumed). The sender writes chunk `k` only once `ack`
//! reaches `k + 1 - slots` (the slot's previous chunk is consumed), then raises `data`; the
//! receiver copies chunk `k` out once `data` reaches `k + 1`, then raises `ack`. Nothing is
//! ever reset: the counts grow for the communicator's life (64-bit, they do not wrap).
//!
//! # Ordering
//! * Data: the sender's coop writes its part of the slot (through the LSA mapping for a
//!   direct peer; into its own staging window, then a GIN put, for a proxy peer), meets
//!   (`sync`, CTA scope), and one thread raises `data` with a release at system scope
//!   ([`Gin::signal`] / [`Gin::put`]'s remote action: cumulative, so every thread's stores
//!   are published; the proxy writes the signal after the data). The receiver's thread 0
//!   reads `data` relaxed, then [`Gin::acquire`] (a system-scope acquire fence), then the
//!   coop meets before any thread reads the slot.
//! * Slot reuse: the receiver's coop reads the slot, meets, and one thread raises `ack` with a
//!   release (ordering the reads before it); the sender's thread 0 sees `ack`, acquires, and
//!   the coop meets before writing the slot again. A proxy peer's staging slot is reused
//!   under the same rule: the receiver consumed the chunk, so the put that read it is done.
//!
//! # Progress
//! Each CTA owns some (operation, channel) units and visits them in turn, moving every one
//! that can move and never waiting on a single one: a group that sends to B and receives from
//! B, on both sides, makes progress however the units fall on CTAs. A CTA whose units cannot
//! move after a while tells the watchdog which peer it waits for
//! ([`Gin::note_slow_wait`]); it gives up when the communicator is aborted.

use crate::arch::{self, LoadOrder, Scope, StoreOrder, atomic};
use crate::comm::{DevComm, error_code};
use crate::coop::{Coop, CoopCta};
use crate::gin::{Gin, LocalAction, RemoteAction};
use crate::kernels::copy::copy_bytes;
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

/// Values of [`P2pOp::kind`].
pub mod op_kind {
    /// Send `bytes` bytes from `buf` to `peer`.
    ///
    /// ```
    /// # use ferrolink_device::p2p::{op_kind, P2pOp};
    /// // Send 4096 bytes at device address 0x7000_0000 to world rank 1.
    /// let op = P2pOp { kind: op_kind::SEND, peer: 1, buf: 0x7000_0000, bytes: 4096, ..Default::default() };
    /// assert_eq!(op.kind, op_kind::SEND);
    /// ```
    pub const SEND: u32 = 0;
    /// Receive `bytes` bytes from `peer` into `buf`.
    ///
    /// ```
    /// # use ferrolink_device::p2p::{op_kind, P2pOp};
    /// // Receive 4096 bytes from world rank 0 into device address 0x7000_0000.
    /// let op = P2pOp { kind: op_kind::RECV, peer: 0, buf: 0x7000_0000, bytes: 4096, ..Default::default() };
    /// assert_eq!(op.kind, op_kind::RECV);
    /// ```
    pub const RECV: u32 = 1;
}

/// One operation of a group, as the host writes it into the descriptor table
/// ([`P2P_OP_WORDS`] words).
///
/// ```
/// use ferrolink_device::p2p::{op_kind, P2pArgs, P2pOp};
/// let args = P2pArgs { channels: 2, slots: 4, chunk: 64 * 1024, ..Default::default() };
/// // Two sends to rank 1 in one group, the pair's first chunks: the second comes after the
/// // first (`after` = 1 + its index) and continues its sequence numbers.
/// let first = P2pOp { kind: op_kind::SEND, peer: 1, buf: 0x7000_0000, bytes: 100_000, seq: 0, after: 0, _pad: 0 };
/// let second = P2pOp { buf: 0x7100_0000, bytes: 16, seq: first.seq + args.chunks(first.bytes), after: 1, ..first };
/// assert_eq!(second.seq, 2);
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct P2pOp {
    /// One of [`op_kind`].
    pub kind: u32,
    /// The other rank (world rank).
    pub peer: u32,
    /// Device address of the data (read for a send, written for a receive).
    pub buf: u64,
    /// Bytes to move.
    pub bytes: u64,
    /// Sequence number of the operation's first chunk on its (sender, receiver) pair.
    pub seq: u64,
    /// 1 + the index of the group's previous operation of the same kind with the same peer
    /// (0: none). Its channels must finish before this one's start: chunks of a pair's
    /// channel travel in sequence order (the counts say "chunk `k` has arrived").
    pub after: u32,
    /// Zero.
    pub _pad: u32,
}

/// Words of one [`P2pOp`].
///
/// ```
/// use ferrolink_device::p2p::{P2pOp, P2P_OP_WORDS};
/// // The host writes a group's operations into the kernel's table as words.
/// let ops = [P2pOp::default(); 3];
/// let words: Vec<u64> = ops.iter().flat_map(|o| bytemuck::cast::<P2pOp, [u64; P2P_OP_WORDS]>(*o)).collect();
/// assert_eq!(words.len(), 3 * P2P_OP_WORDS);
/// ```
pub const P2P_OP_WORDS: usize = core::mem::size_of::<P2pOp>() / 8;

/// A group's size and the channels' layout (the kernel's scalar argument).
///
/// ```
/// use ferrolink_device::p2p::P2pArgs;
/// // A group of 2 operations over 2 channels of 4 slots of 64 KiB; signals 0 and 1 count
/// // the channels' data, signals 2 and 3 their acknowledgements.
/// let args = P2pArgs { nops: 2, channels: 2, slots: 4, chunk: 64 * 1024, data_signal: 0, ack_signal: 2, generation: 1, _pad: 0 };
/// assert_eq!(args.chunk % (16 * args.channels), 0); // what the kernel checks
/// assert_eq!(args.region_bytes(), 256 * 1024);
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct P2pArgs {
    /// Operations in the group.
    pub nops: u32,
    /// Channels per pair (the same on every rank).
    pub channels: u32,
    /// Slots per sender region.
    pub slots: u32,
    /// Bytes per slot: a multiple of `16 * channels`.
    pub chunk: u32,
    /// Signal of channel 0's data counts (channel `ch`: `data_signal + ch`).
    pub data_signal: u32,
    /// Signal of channel 0's acknowledgements.
    pub ack_signal: u32,
    /// This launch's number (the host counts its groups): a unit's progress word is
    /// `generation << 32 | chunks done`, so that words left by earlier launches read as 0
    /// without being cleared (a CTA may read another CTA's unit before that one starts).
    pub generation: u32,
    /// Zero.
    pub _pad: u32,
}

impl P2pArgs {
    /// Bytes of one sender's region in a receive (or staging) window.
    ///
    /// ```
    /// # use ferrolink_device::p2p::P2pArgs;
    /// let args = P2pArgs { channels: 1, slots: 8, chunk: 4096, ..Default::default() };
    /// // A receive window holds a region per sender: 4 ranks need 128 KiB on every rank.
    /// assert_eq!(4 * args.region_bytes(), 128 * 1024);
    /// ```
    pub const fn region_bytes(&self) -> usize {
        self.slots as usize * self.chunk as usize
    }

    /// Chunks of a message of `bytes` bytes.
    ///
    /// ```
    /// # use ferrolink_device::p2p::P2pArgs;
    /// let args = P2pArgs { channels: 1, slots: 8, chunk: 4096, ..Default::default() };
    /// assert_eq!(args.chunks(10_000), 3);
    /// assert_eq!(args.chunks(0), 0);
    /// ```
    pub const fn chunks(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.chunk as u64)
    }
}

/// Sweeps without progress before a CTA tells the watchdog what it waits for (and checks for
/// an abort between sweeps).
const SLOW_SWEEPS: u32 = if cfg!(target_arch = "nvptx64") { 4096 } else { 64 };

/// Runs part `cta` of `ctas` of a group: the units `cta, cta + ctas, …` of
/// `args.nops * args.channels`, unit `u` being channel `u % channels` of operation
/// `u / channels` of `ops`. `progress` (`nops * channels` words, the kernel's scratch) counts
/// each unit's chunks, tagged with `args.generation` (never cleared). Returns when they are all done, or the communicator is aborted.
///
/// # Safety
/// `ops` holds `nops` live operations and `progress` `nops * channels` words, used by this
/// launch only; every send's and receive's `buf` holds `bytes` bytes of
/// device memory that nothing else touches until the kernel ends; `recv_win` and `send_win`
/// are this communicator's windows holding `nranks` regions of [`P2pArgs::region_bytes`] on
/// every rank, used by point-to-point kernels only, one at a time per rank (the stream orders
/// them); every rank uses the same `channels`, `slots`, `chunk` and signals; `comm` has GIN
/// with `channels` contexts and signals `data_signal .. ack_signal + channels`.
///
/// # Examples
///
/// ```no_run
/// use ferrolink_device::p2p::{self, P2pArgs, P2pOp};
/// use ferrolink_device::{arch, kernel, DevComm, DevWindow};
/// // Needs a DevComm made by the host crate (ferrolink::create_dev_comms): compile-only here.
/// kernel! {
///     /// Runs one group of sends and receives; CTA `b` of the grid takes part `b`.
///     ///
///     /// # Safety
///     /// As [`p2p::run`] (`ops` holds `args.nops` operations as words).
///     pub unsafe fn p2p_group(comm: DevComm, send_win: DevWindow, recv_win: DevWindow, args: P2pArgs, ops: *const u64, progress: *mut u64) {
///         // SAFETY: the kernel's contract.
///         unsafe {
///             p2p::run(&comm, &send_win, &recv_win, &args, ops as *const P2pOp, progress, arch::block_idx_x(), arch::grid_dim_x())
///         }
///     }
/// }
/// ```
#[allow(clippy::too_many_arguments)]
pub unsafe fn run(
    comm: &DevComm,
    send_win: &DevWindow,
    recv_win: &DevWindow,
    args: &P2pArgs,
    ops: *const P2pOp,
    progress: *mut u64,
    cta: usize,
    ctas: usize,
) {
    let coop = CoopCta;
    let channels = args.channels as usize;
    if channels == 0 || args.slots == 0 || !(args.chunk as usize).is_multiple_of(16 * channels) {
        comm.fail(error_code::P2P_ARGS, u64::from(args.channels) << 32 | u64::from(args.slots), u64::from(args.chunk));
    }
    let units = args.nops as usize * channels;
    let part = args.chunk as usize / channels;
    let region = args.region_bytes();
    let me = comm.rank;
    let generation = u64::from(args.generation) << 32;
    // Chunks done by unit `u` in this launch (0 for a word an earlier launch left).
    let done_of = |u: usize, order: LoadOrder| {
        // SAFETY: callers pass units inside the scratch (contract, and the checks below).
        let w = unsafe { atomic::load(progress.add(u), order, Scope::Gpu) };
        if w & !0xffff_ffff == generation { w & 0xffff_ffff } else { 0 }
    };
    let mut idle = 0u32;
    let mut noted: Option<u32> = None;
    loop {
        let mut pending = false;
        let mut moved = false;
        // The first unit that could not move (for the watchdog): (signal, peer, target).
        let mut blocked: Option<(u32, u32, u64)> = None;
        let mut u = cta;
        while u < units {
            // SAFETY: unit `u` is inside the table and the scratch (contract).
            let op = unsafe { ops.add(u / channels).read_volatile() };
            let ch = (u % channels) as u32;
            let gin = Gin::new(comm, ch);
            if op.peer >= comm.nranks || op.kind > op_kind::RECV {
                comm.fail(error_code::P2P_ARGS, u64::from(op.kind) << 32 | u64::from(op.peer), op.bytes);
            }
            let total = args.chunks(op.bytes);
            if total > 0xffff_ffff {
                comm.fail(error_code::P2P_ARGS, u64::from(op.kind) << 32 | u64::from(op.peer), op.bytes);
            }
            // The previous operation with this peer and kind must be done on this channel.
            let prev_done = |coop: CoopCta| {
                let before = op.after as usize;
                if before == 0 {
                    return true;
                }
                if before > u / channels {
                    comm.fail(error_code::P2P_ARGS, u64::from(op.after), (u / channels) as u64);
                }
                // SAFETY: an earlier operation's unit (checked): inside the table and scratch.
                let prev = unsafe { ops.add(before - 1).read_volatile() };
                // Acquire at GPU scope: the other CTA's signals for that unit come before its
                // count (released below), so this unit's signals come after them.
                let here = coop.thread_rank() == 0
                    && done_of((before - 1) * channels + ch as usize, LoadOrder::Acquire) >= args.chunks(prev.bytes);
                coop.sync_any(here)
            };
            loop {
                // This CTA's unit: thread 0 wrote it before the last `sync`.
                let done = done_of(u, LoadOrder::Relaxed);
                if done >= total {
                    break;
                }
                pending = true;
                if done == 0 && !prev_done(coop) {
                    break;
                }
                let seq = op.seq + done;
                let (id, target) = if op.kind == op_kind::SEND {
                    // Slot `seq % slots` is free once chunk `seq - slots` is consumed.
                    (args.ack_signal + ch, (seq + 1).saturating_sub(u64::from(args.slots)))
                } else {
                    (args.data_signal + ch, seq + 1)
                };
                let ready_here = coop.thread_rank() == 0 && gin.read_signal_from(id, op.peer) >= target;
                if ready_here {
                    gin.acquire();
                }
                if !coop.sync_any(ready_here) {
                    if blocked.is_none() {
                        blocked = Some((id, op.peer, target));
                    }
                    break;
                }
                // This channel's part of the chunk.
                let at = done as usize * args.chunk as usize + ch as usize * part;
                let len = (op.bytes as usize).saturating_sub(at).min(part);
                let slot = (seq % u64::from(args.slots)) as usize * args.chunk as usize + ch as usize * part;
                let world = comm.world();
                if op.kind == op_kind::SEND {
                    let src = (op.buf as *const u8).wrapping_add(at);
                    let dst_off = me as usize * region + slot;
                    if gin.is_direct(op.peer) {
                        let dst: *mut u8 = recv_win.lsa_ptr(dst_off, op.peer % comm.lsa_size);
                        // SAFETY: the slot is free (acknowledged above) and inside the peer's
                        // region for this rank; `src` holds `len` bytes (contract).
                        unsafe { copy_bytes(dst, src, len, coop.thread_rank(), coop.size()) };
                        gin.signal(coop, world, op.peer, RemoteAction::SignalInc(args.data_signal + ch));
                    } else {
                        let stage_off = op.peer as usize * region + slot;
                        // SAFETY: this rank's staging slot for the peer, free under the same
                        // acknowledgement (the put that read it has landed).
                        unsafe {
                            copy_bytes(send_win.local_ptr(stage_off), src, len, coop.thread_rank(), coop.size());
                            gin.put(
                                coop,
                                world,
                                op.peer,
                                *recv_win,
                                dst_off,
                                *send_win,
                                stage_off,
                                len,
                                RemoteAction::SignalInc(args.data_signal + ch),
                                LocalAction::None,
                            )
                        };
                    }
                } else {
                    let src: *const u8 = recv_win.local_ptr(op.peer as usize * region + slot);
                    // SAFETY: the chunk is delivered (signal acquired above) and stays until
                    // this rank acknowledges it; `buf` holds `bytes` bytes (contract).
                    unsafe {
                        copy_bytes((op.buf as *mut u8).wrapping_add(at), src, len, coop.thread_rank(), coop.size())
                    };
                    gin.signal(coop, world, op.peer, RemoteAction::SignalInc(args.ack_signal + ch));
                }
                if coop.thread_rank() == 0 {
                    // Release at GPU scope: a later operation's unit on another CTA acquires it.
                    // SAFETY: as the read above.
                    unsafe { atomic::store(progress.add(u), generation | (done + 1), StoreOrder::Release, Scope::Gpu) };
                }
                coop.sync();
                moved = true;
            }
            u += ctas;
        }
        if !pending {
            break;
        }
        if moved {
            idle = 0;
            continue;
        }
        idle = idle.saturating_add(1);
        if idle == SLOW_SWEEPS
            && coop.thread_rank() == 0
            && let Some((id, peer, target)) = blocked
        {
            Gin::new(comm, 0).note_slow_wait(id, peer, target);
            noted = Some(id);
        }
        if idle >= SLOW_SWEEPS {
            if idle.is_multiple_of(32) && coop.sync_any(coop.thread_rank() == 0 && comm.abort_requested()) {
                break;
            }
            arch::spin_wait_hint(100);
        }
    }
    if let Some(id) = noted {
        Gin::new(comm, 0).clear_slow_wait(id);
    }
}
