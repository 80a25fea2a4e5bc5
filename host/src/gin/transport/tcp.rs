//! The TCP transport: the GIN proxy's way to peers whose memory is not mapped here (another
//! LSA domain, another node), or every peer under `FERROLINK_GIN_TRANSPORT=tcp`.
//!
//! # Connections
//! Every rank that uses TCP runs a [`TcpReceiver`]: a listener (on `127.0.0.1`, or on the IP
//! in `FERROLINK_GIN_TCP_ADDR`) whose address every rank learns at GIN creation. A sender opens
//! one connection per ring, that is per (context, peer), lazily on the ring's first request,
//! and starts it with a `Hello` frame (job id, its world rank, the context). The receiver
//! closes connections whose first frame is not a `Hello` of its job, without complaint: a
//! stranger is not a peer. When the transport is dropped (the proxy stopped after draining),
//! each connection's thread sends what is queued, then a `Bye` frame, and closes: an orderly
//! end. The frames are in [`super::tcp_wire`]; data is named by window id and offset, never
//! by address.
//!
//! # Threads
//! * Sender: one thread per connection, fed requests in ticket order by [`TcpTransport::submit`]
//!   through a channel (so the proxy never blocks on a socket). It copies a put's source from
//!   device memory into pinned host staging on its own stream, in chunks of up to [`CHUNK`]
//!   bytes. Small requests queued together (puts up to [`SMALL`] bytes, values, signals) are
//!   laid out as frames in one staging block, their data copied into place between the
//!   headers, and sent with one wait and one write. Two staging blocks make a pipeline: the
//!   next piece of work (a chunk, or the requests queued behind) is copied while the current
//!   one is written to the socket. Once a request's last byte is in host memory its source
//!   may be reused: the thread reports it (local completion), in order, and
//!   [`TcpTransport::poll`] hands it to the proxy.
//! * Receiver: an accept thread; per connection a reader thread that reads into buffers
//!   (up to [`RECV_MAX`] bytes, [`RECV_BUFFERS`] of them) and decodes them, and a writer
//!   thread that applies each buffer's decoded frames, in order, through
//!   [`Deliver::deliver`] (the rank queues a buffer's copies and signal writes on its
//!   delivery stream and waits once per buffer, not once per frame), so that writing one
//!   buffer to the device overlaps receiving the next. The buffers are the rank's staging
//!   memory ([`Deliver::staging`]: pinned on CUDA, so that the copies to the device run at
//!   full speed), or ordinary memory where it has none. A connection's
//!   `Hello` is read into ordinary memory: a stranger costs no pinned memory.
//! * Pinned memory: neither side ever allocates or frees it. On CUDA that may wait for the
//!   device's running kernels, which spin on signals that these very threads deliver (a
//!   deadlock, seen on two H200s). Both take [`STAGING_BLOCK`]-byte blocks from the rank's
//!   [`StagingPool`], made with the device communicator (see [`staging_blocks`] for its
//!   size), and a block goes back to the pool when dropped, at the connection's end. So a
//!   sender's staging is fixed: a chunk, or a batch of small requests of up to [`CHUNK`]
//!   bytes of frames, fits one block. When the pool is empty, a side uses pageable memory
//!   instead, without waiting: the sender reads the source with a synchronous copy on its
//!   copy stream (slower: it no longer overlaps the socket write, but it waits for no
//!   kernel; it takes a pool block again as soon as one is free), the receiver reads into a
//!   `Vec`. Waiting for a block would gain little: the blocks are held for their
//!   connections' lives, so one may not come back while the kernels run.
//! * No shared stream: a receiver writes into device memory on its rank's delivery stream
//!   ([`GinRank::deliveries`](crate::gin::GinRank)), a sender reads on its connection's copy
//!   stream; never on the device's shared copy stream, where a fill of a fresh allocation
//!   (which, as we read the H200's stacks, waits for an SM) may be queued while the running
//!   kernels, which hold every SM, wait for these threads (four ranks on one GPU deadlocked).
//!
//! # Ordering: why a signal is visible only after its data
//! The proxy gives a ring's requests to one sender thread in ticket order; the thread writes
//! each request's data frame, then its signal frame, on the ring's one connection, and TCP
//! delivers the bytes in order. The reader decodes them in order and hands them to the
//! writer thread in order, through a FIFO channel; the writer hands a buffer's frames to
//! [`Deliver::deliver`] only after the buffer before has landed (it returns once all it
//! applied is in device memory), and inside a buffer the rank queues the frames in order on
//! its one delivery stream, a signal as a stream write after the copies before it (the
//! stream runs them in order; the write comes after a memory barrier). So when the signal's
//! slot is written, every put sent before the signal on that (context, peer) has landed.
//! Nothing is ordered across connections (contexts are independent), which is the GIN
//! contract. Local completion says only that the source has been copied out (into staging);
//! it says nothing about delivery, which only the signal does.
//!
//! # Failures
//! A connection that ends inside a frame, a read error, a malformed frame after the `Hello`
//! (any byte after a `Bye` included), or data [`Deliver`] refuses calls [`Deliver::fail`]
//! naming the sending rank (which aborts the communicator). A clean end at a frame boundary
//! after the sender's `Bye` is a normal close. A clean end at a frame boundary without it
//! means the sending process died or exited before its proxy finished: once everything it
//! sent has been applied, the receiver calls [`Deliver::peer_lost`], which is no error by
//! itself (the rank may have had nothing more to send; the rank aborts only a wait that is
//! stalled while a peer is lost). A connection closed by this side (by its writer after a
//! failure it reported, or by the receiver's drop) reports nothing more. On the sending side,
//! a connect or write error (the peer died: `EPIPE`, `ECONNRESET`) ends the connection's
//! thread, and [`TcpTransport::poll`] and later [`TcpTransport::submit`] return it as an
//! error naming the peer; such a thread says no goodbye.
//!
//! Socket buffers are left to the kernel's autotuning (setting `SO_RCVBUF` turns it off and
//! is capped by `net.core.rmem_max`, often far below what autotuning reaches).

use super::tcp_wire::{self, Decoder, Frame, Item};
use super::{Deliver, Delivery, Payload, Request, Transport};
use crate::gin::GinRank;
use crate::gin::copy_watch::{CopyFor, CopyWatch};
use crate::gin::staging::{StagingBlock, StagingPool};
use crate::runtime::backend::{EventBackend, StreamBackend};
use crate::runtime::lifetime::lock;
use crate::{Error, Result};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::thread;
use std::time::Duration;

/// A sender's staging chunk: the most it copies from the device (and writes) at once.
pub(crate) const CHUNK: usize = 2 << 20;
/// Puts up to this size are sent with their queued neighbours, in one write.
pub(crate) const SMALL: usize = 64 << 10;
/// At most this many requests are batched into one write.
const MAX_BATCH: usize = 256;
/// Room before a staging chunk for frame headers (the data after it stays aligned).
const PREFIX: usize = 64;
/// Room after a staging chunk for the signal frame.
const SUFFIX: usize = 64;
/// The size of a staging block: a chunk with room for its headers before and the signal
/// frame after. The rank's [`StagingPool`] holds blocks of this size, for senders and
/// receivers alike.
pub(crate) const STAGING_BLOCK: usize = PREFIX + CHUNK + SUFFIX;
/// A receive buffer's first size where it is ordinary memory; it doubles while puts fill it,
/// up to [`RECV_MAX`]. (A pool block is taken whole.)
pub(crate) const RECV_MIN: usize = 64 << 10;
/// A receive buffer's largest size: a pool block's.
pub(crate) const RECV_MAX: usize = STAGING_BLOCK;
/// Receive buffers per connection (one being read into, the others being written out).
pub(crate) const RECV_BUFFERS: usize = 3;
/// How long a sender waits for a peer's receiver to accept its connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a receiver waits for a new connection's `Hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// The blocks of the staging pool of a rank with `rings` TCP rings (contexts × peers reached
/// by TCP): three per ring, at least 4, at most 32.
///
/// A ring has, on this rank, a sender using two blocks (the pipeline: one being filled, one
/// being written) and, from the same peer and context, usually a receiving connection using
/// up to [`RECV_BUFFERS`]; three per ring gives every sender its two and each receiving
/// connection one. At least 4 (one ring: its sender's two, two receive buffers); at most 32
/// blocks, that is about 64 MiB of page-locked memory per rank, which is scarce (it is the
/// whole system's, and pinning much of it slows the machine). Past that, connections share:
/// whoever finds the pool empty uses pageable memory (see the module's docs), never waits.
pub(crate) fn staging_blocks(rings: usize) -> usize {
    rings.saturating_mul(3).clamp(4, 32)
}

/// The address a receiver listens on: `FERROLINK_GIN_TCP_ADDR` (an IP that peers can reach),
/// else `127.0.0.1` (one machine).
fn listen_ip() -> Result<IpAddr> {
    match std::env::var("FERROLINK_GIN_TCP_ADDR").as_deref() {
        Err(_) | Ok("") => Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        Ok(s) => {
            let ip: IpAddr = s.trim().parse().map_err(|e| {
                Error::InvalidArgument(format!(
                    "FERROLINK_GIN_TCP_ADDR={s:?} is not an IP address ({e}): give this rank's address that \
                     the other ranks can reach, without a port"
                ))
            })?;
            if ip.is_unspecified() {
                return Err(Error::InvalidArgument(format!(
                    "FERROLINK_GIN_TCP_ADDR={s:?}: the other ranks connect to this address, so give one they \
                     can reach (this machine's address on their network), not the unspecified address"
                )));
            }
            Ok(ip)
        }
    }
}

// ---------------------------------------------------------------------------------------
// Receiver
// ---------------------------------------------------------------------------------------

/// This rank's TCP receiver: a listener and the threads of its connections. Dropping it
/// closes the listener and every connection without waiting for their threads (they see
/// their sockets closed and end).
pub(crate) struct TcpReceiver {
    shared: Arc<RecvShared>,
}

struct RecvShared {
    job: u64,
    rank: usize,
    listener: TcpListener,
    deliver: Weak<dyn Deliver>,
    /// Set (under `conns`' lock) when the receiver is dropped.
    stopping: AtomicBool,
    conns: Mutex<Conns>,
}

#[derive(Default)]
struct Conns {
    next: u64,
    open: HashMap<u64, TcpStream>,
}

impl RecvShared {
    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Closes connection `id` (both ways) and forgets it.
    fn close(&self, id: u64) {
        if let Some(s) = lock(&self.conns).open.remove(&id) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Whether connection `id` is open (not closed by this side: by its writer after a
    /// failure it reported, or by the receiver's drop).
    fn is_open(&self, id: u64) -> bool {
        lock(&self.conns).open.contains_key(&id)
    }

    /// Reports a broken connection (unless the receiver is closing: then its own shutdown
    /// broke it).
    fn fail(&self, why: String) {
        if self.stopping() {
            tracing::debug!(target: "ferrolink::gin", rank = self.rank, "GIN TCP receiver closing: {why}");
            return;
        }
        if let Some(d) = self.deliver.upgrade() {
            d.fail(why);
        }
    }

    /// Reports that connection `id` from `from` ended without its goodbye (unless this side
    /// closed it: the receiver's drop, or its writer after a failure it reported).
    fn peer_lost(&self, id: u64, from: Peer) {
        if self.stopping() || !self.is_open(id) {
            return;
        }
        if let Some(d) = self.deliver.upgrade() {
            d.peer_lost(
                from.rank,
                format!(
                    "its GIN connection (context {}, {}) closed without a goodbye: the process died or exited \
                     before its proxy finished",
                    from.context, from.addr
                ),
            );
        }
    }

    /// A receive buffer of `bytes` bytes: the rank's staging memory where it has some, else
    /// ordinary memory.
    fn buffer(&self, bytes: usize) -> RecvBuf {
        match self.deliver.upgrade().and_then(|d| d.staging(bytes)) {
            Some(mem) if mem.len() >= bytes => RecvBuf::Staged(mem),
            _ => RecvBuf::Plain(vec![0u8; bytes]),
        }
    }
}

impl TcpReceiver {
    /// Starts rank `rank`'s receiver for job `job`, delivering through `deliver`; returns it
    /// and the address peers connect to.
    pub(crate) fn start(job: u64, rank: usize, deliver: Weak<dyn Deliver>) -> Result<(TcpReceiver, SocketAddr)> {
        let ip = listen_ip()?;
        let listener = TcpListener::bind((ip, 0)).map_err(|e| {
            Error::InvalidArgument(format!(
                "rank {rank}: the GIN TCP receiver cannot listen on {ip} ({e}); set FERROLINK_GIN_TCP_ADDR to an \
                 address of this machine"
            ))
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::InvalidArgument(format!("rank {rank}: the GIN TCP listener has no address: {e}")))?;
        let shared = Arc::new(RecvShared {
            job,
            rank,
            listener,
            deliver,
            stopping: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
        });
        let s = shared.clone();
        thread::Builder::new()
            .name(format!("fl-gin-accept-{rank}"))
            .spawn(move || accept_loop(s))
            .map_err(|e| Error::InvalidArgument(format!("rank {rank}: no thread for the GIN TCP receiver: {e}")))?;
        tracing::debug!(target: "ferrolink::gin", rank, %addr, "GIN TCP receiver listening");
        Ok((TcpReceiver { shared }, addr))
    }
}

impl Drop for TcpReceiver {
    fn drop(&mut self) {
        let sh = &self.shared;
        {
            let mut conns = lock(&sh.conns);
            sh.stopping.store(true, Ordering::Release);
            for (_, s) in conns.open.drain() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        // Shutting a listening socket down makes a blocked `accept` return (Linux); the
        // accept thread then sees `stopping` and ends, and the last reference closes it.
        if let Err(e) = nix::sys::socket::shutdown(sh.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both) {
            tracing::debug!(target: "ferrolink::gin", rank = sh.rank, error = %e, "shutting the GIN listener down; waking it with a connection");
            if let Ok(addr) = sh.listener.local_addr() {
                let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(100));
            }
        }
    }
}

fn accept_loop(sh: Arc<RecvShared>) {
    loop {
        let accepted = sh.listener.accept();
        if sh.stopping() {
            return;
        }
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // E.g. out of file descriptors: the peer's connect fails or is reset, and it
                // reports that; this rank goes on accepting.
                tracing::warn!(target: "ferrolink::gin", rank = sh.rank, error = %e, "GIN TCP receiver: accept failed");
                // A back-off, so that a persistent error (EMFILE) does not spin the thread.
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Ok(clone) = stream.try_clone() else { continue };
        let id = {
            let mut conns = lock(&sh.conns);
            if sh.stopping() {
                return;
            }
            let id = conns.next;
            conns.next += 1;
            conns.open.insert(id, clone);
            id
        };
        let s = sh.clone();
        let spawned =
            thread::Builder::new().name(format!("fl-gin-recv-{}", sh.rank)).spawn(move || serve(s, stream, peer, id));
        if let Err(e) = spawned {
            tracing::warn!(target: "ferrolink::gin", rank = sh.rank, error = %e, "GIN TCP receiver: no thread for a connection");
            sh.close(id);
        }
    }
}

/// A receive buffer: a block of the rank's staging pool ([`Deliver::staging`], pinned where
/// the device has it; back to the pool when dropped), or ordinary memory.
enum RecvBuf {
    Staged(StagingBlock),
    Plain(Vec<u8>),
}

impl Default for RecvBuf {
    fn default() -> RecvBuf {
        RecvBuf::Plain(Vec::new())
    }
}

impl RecvBuf {
    fn len(&self) -> usize {
        match self {
            RecvBuf::Staged(m) => m.len(),
            RecvBuf::Plain(v) => v.len(),
        }
    }

    /// The buffer's device address, where it is pinned memory of the device.
    fn device_addr(&self) -> Option<u64> {
        match self {
            RecvBuf::Staged(m) => Some(m.device_addr()),
            RecvBuf::Plain(_) => None,
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            // SAFETY: as in `as_mut_slice`; `&self` keeps writers off.
            RecvBuf::Staged(m) => unsafe { std::slice::from_raw_parts(m.host_ptr(), m.len()) },
            RecvBuf::Plain(v) => v,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            // SAFETY: the block is live while `m` is and spans `m.len()` bytes, initialized
            // (host-mapped memory is zeroed when allocated, and only bytes are written to it
            // after); this buffer owns it alone (taken from the pool, it is the reader's or,
            // in a batch, the writer's, never both; it returns to the pool only when dropped),
            // and the device touches it only inside `Deliver::deliver`'s copies, which are
            // done when it returns, so no device access is pending while the host holds a
            // mutable slice.
            RecvBuf::Staged(m) => unsafe { std::slice::from_raw_parts_mut(m.host_ptr(), m.len()) },
            RecvBuf::Plain(v) => v,
        }
    }
}

/// A filled receive buffer and what to do with it, in order.
struct Batch {
    buf: RecvBuf,
    ops: Vec<Delivery>,
}

/// How a connection's stream ended, when not broken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// After the sender's `Bye`: an orderly end.
    Goodbye,
    /// At a frame boundary without a `Bye`: the sender is gone.
    Lost,
    /// The writer stopped (it reported why, or the rank is gone).
    WriterStopped,
}

/// Who is on a connection (from its `Hello`).
#[derive(Clone, Copy, Debug)]
struct Peer {
    rank: usize,
    context: u32,
    addr: SocketAddr,
}

/// A reader thread: checks the handshake, then decodes the connection's frames into
/// batches for its writer thread until the connection ends.
fn serve(sh: Arc<RecvShared>, mut stream: TcpStream, addr: SocketAddr, id: u64) {
    let _ = stream.set_nodelay(true);
    let mut dec = Decoder::new();
    // The handshake reads into ordinary memory (a stranger costs no staging memory); what
    // came after the `Hello` moves into the first receive buffer.
    let mut hello = vec![0u8; RECV_MIN];
    let (from, filled, parsed) = match handshake(&sh, &mut stream, addr, &mut dec, &mut hello) {
        Some(h) => h,
        None => return sh.close(id),
    };
    let _ = stream.set_read_timeout(None);
    tracing::debug!(target: "ferrolink::gin", rank = sh.rank, from = from.rank, context = from.context, %addr, "GIN TCP connection");
    let mut buf = sh.buffer(RECV_MIN);
    let rest = &hello[parsed..filled];
    buf.as_mut_slice()[..rest.len()].copy_from_slice(rest);
    let filled = rest.len();
    drop(hello);
    let (batch_tx, batch_rx) = mpsc::channel::<Batch>();
    let (free_tx, free_rx) = mpsc::channel::<RecvBuf>();
    let w = sh.clone();
    let writer = match thread::Builder::new()
        .name(format!("fl-gin-write-{}", sh.rank))
        .spawn(move || write_loop(w, from, id, batch_rx, free_tx))
    {
        Ok(h) => h,
        Err(e) => {
            sh.fail(format!("no thread to receive GIN data from rank {} (context {}): {e}", from.rank, from.context));
            return sh.close(id);
        }
    };
    match read_loop(&sh, &mut stream, from, dec, buf, filled, batch_tx, free_rx) {
        Err(why) => {
            // Closed here (its writer failed and said why, or the receiver is dropped): no news.
            if sh.is_open(id) {
                sh.fail(why);
            }
        }
        Ok(end) => {
            // The reader dropped its end of the batch channel: the writer applies what is
            // queued and ends. The connection is closed (below) only after that, and a lost
            // sender is reported only once everything it sent has been applied.
            let _ = writer.join();
            if end == End::Lost {
                sh.peer_lost(id, from);
            }
        }
    }
    sh.close(id);
}

/// Reads until the first frame, a `Hello` of this job; returns the sender and how much of
/// `buf` was read and decoded. `None`: not a peer (logged), close it.
fn handshake(
    sh: &RecvShared,
    stream: &mut TcpStream,
    addr: SocketAddr,
    dec: &mut Decoder,
    buf: &mut [u8],
) -> Option<(Peer, usize, usize)> {
    let refuse = |why: &dyn std::fmt::Display| {
        if !sh.stopping() {
            tracing::warn!(target: "ferrolink::gin", rank = sh.rank, %addr, "GIN TCP receiver: refused a connection: {why}");
        }
    };
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let mut filled = 0;
    loop {
        let n = match stream.read(&mut buf[filled..]) {
            Ok(0) => {
                refuse(&"it closed before its Hello");
                return None;
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                refuse(&format_args!("reading its Hello: {e}"));
                return None;
            }
        };
        let start = filled;
        filled += n;
        let mut input = &buf[start..filled];
        match dec.decode(&mut input) {
            Ok(None) => continue,
            Ok(Some(Item::Hello { job, rank, context })) => {
                if job != sh.job {
                    refuse(&format_args!("it is of job {job:#x}, this receiver of job {:#x}", sh.job));
                    return None;
                }
                let parsed = filled - input.len();
                return Some((Peer { rank: rank as usize, context, addr }, filled, parsed));
            }
            Ok(Some(other)) => {
                refuse(&format_args!("its first frame is {other:?}, not a Hello"));
                return None;
            }
            Err(e) => {
                refuse(&e);
                return None;
            }
        }
    }
}

/// Appends `item` to `ops` (merging a put's piece with the previous one when they continue
/// each other); `at` is where the item's data starts in the buffer.
fn push_op(ops: &mut Vec<Delivery>, item: Item<'_>, at: usize) -> std::result::Result<(), &'static str> {
    match item {
        Item::Hello { .. } => return Err("a second Hello"),
        Item::PutData { dst, data, .. } => {
            if let Some(Delivery::Put { dst: d, range }) = ops.last_mut()
                && d.window == dst.window
                && d.offset + range.len() as u64 == dst.offset
                && range.end == at
            {
                range.end += data.len();
            } else {
                ops.push(Delivery::Put { dst, range: at..at + data.len() });
            }
        }
        Item::PutValue { dst, value, bytes } => ops.push(Delivery::PutValue { dst, le: value.to_le_bytes(), bytes }),
        Item::Signal { id, inc } => ops.push(Delivery::Signal { id, inc }),
        // The decoder refuses anything after it; the end of the stream tells the rest.
        Item::Bye => {}
    }
    Ok(())
}

/// Reads the connection into buffers and hands each, with its decoded operations, to the
/// writer. A buffer is handed over when the stream is at a frame boundary (or in a header:
/// the sender has sent all it has) or when it is full; inside a put's data it keeps reading,
/// so that large puts are written to the device in large pieces. `buf[..filled]` holds bytes
/// read but not yet decoded.
#[allow(clippy::too_many_arguments)]
fn read_loop(
    sh: &RecvShared,
    stream: &mut TcpStream,
    from: Peer,
    mut dec: Decoder,
    mut buf: RecvBuf,
    mut filled: usize,
    batches: mpsc::Sender<Batch>,
    free: mpsc::Receiver<RecvBuf>,
) -> std::result::Result<End, String> {
    let who = |what: &dyn std::fmt::Display| {
        format!("the GIN connection from rank {} (context {}, {}) {what}", from.rank, from.context, from.addr)
    };
    let mut ops = Vec::new();
    let mut want = RECV_MIN;
    let mut allocated = 1;
    let mut parsed = 0;
    loop {
        let mut input = &buf.as_slice()[parsed..filled];
        loop {
            match dec.decode(&mut input) {
                Ok(Some(item)) => {
                    // A put's piece is the tail of what the decoder just consumed.
                    let data_at = match item {
                        Item::PutData { data, .. } => filled - input.len() - data.len(),
                        _ => 0,
                    };
                    push_op(&mut ops, item, data_at).map_err(|e| who(&format_args!("sent {e}")))?;
                }
                Ok(None) => break,
                Err(e) => return Err(who(&format_args!("sent a malformed frame: {e}"))),
            }
        }
        parsed = filled;
        let full = filled == buf.len();
        if !ops.is_empty() && (full || !dec.in_data()) {
            if full && dec.in_data() {
                want = (want * 2).min(RECV_MAX);
            }
            let batch = Batch { buf: std::mem::take(&mut buf), ops: std::mem::take(&mut ops) };
            if batches.send(batch).is_err() {
                return Ok(End::WriterStopped); // it reported why
            }
            buf = match free.try_recv() {
                Ok(b) => b,
                Err(_) if allocated < RECV_BUFFERS => {
                    allocated += 1;
                    RecvBuf::default()
                }
                Err(_) => match free.recv() {
                    Ok(b) => b,
                    Err(_) => return Ok(End::WriterStopped),
                },
            };
            if buf.len() < want {
                // (Only ordinary memory is ever too small: a pool block is `RECV_MAX` bytes.)
                // The smaller one goes first: a connection holds at most `RECV_BUFFERS`.
                drop(std::mem::take(&mut buf));
                buf = sh.buffer(want);
            }
            filled = 0;
            parsed = 0;
        } else if full {
            // Only header bytes (kept by the decoder): the buffer may be reused.
            filled = 0;
            parsed = 0;
        }
        let n = loop {
            match stream.read(&mut buf.as_mut_slice()[filled..]) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(who(&format_args!("broke: {e}"))),
            }
        };
        if n == 0 {
            if !dec.at_boundary() {
                return Err(who(&"ended in the middle of a frame: the sending rank died or closed it early"));
            }
            if !ops.is_empty() && batches.send(Batch { buf, ops }).is_err() {
                return Ok(End::WriterStopped);
            }
            let bye = dec.said_bye();
            tracing::debug!(target: "ferrolink::gin", rank = sh.rank, from = from.rank, context = from.context, bye, "GIN TCP connection closed");
            return Ok(if bye { End::Goodbye } else { End::Lost });
        }
        filled += n;
    }
}

/// The writer thread: applies each batch's operations in order through [`Deliver::deliver`]
/// (a signal is written after the data before it; all has landed when it returns, so the
/// buffer may be reused).
fn write_loop(sh: Arc<RecvShared>, from: Peer, id: u64, batches: mpsc::Receiver<Batch>, free: mpsc::Sender<RecvBuf>) {
    for batch in batches {
        let Some(d) = sh.deliver.upgrade() else {
            // The rank's GIN is gone: nothing to deliver to.
            return sh.close(id);
        };
        // The whole batch at once: one wait for the device per batch, not per operation.
        if let Err(e) = d.deliver(from.rank, batch.buf.as_slice(), batch.buf.device_addr(), &batch.ops) {
            drop(d);
            sh.fail(format!("GIN data from rank {} (context {}) cannot be delivered: {e}", from.rank, from.context));
            // Nothing after a failed frame may be applied (a signal would announce data
            // that is not there): close, which ends the reader.
            return sh.close(id);
        }
        drop(d);
        let _ = free.send(batch.buf);
    }
}

// ---------------------------------------------------------------------------------------
// Sender
// ---------------------------------------------------------------------------------------

/// What a connection's thread tells the transport.
enum Report {
    /// The request `(ring, ticket)` completed locally.
    Done(usize, u64),
    /// The connection failed; nothing more comes from it.
    Failed(Error),
}

/// The proxy's TCP transport: a thread and a connection per ring it has used.
pub(crate) struct TcpTransport {
    /// The rank's staging pool (the senders' blocks come from it).
    pool: Weak<StagingPool>,
    job: u64,
    rank: usize,
    peers: Vec<Option<SocketAddr>>,
    /// Per ring: the channel to its connection's thread.
    conns: HashMap<usize, mpsc::Sender<Request>>,
    reports_tx: mpsc::Sender<Report>,
    reports: mpsc::Receiver<Report>,
    in_flight: usize,
    /// Completions taken from `reports` but not yet handed to `poll`.
    ready: Vec<(usize, u64)>,
    failure: Option<Error>,
}

impl TcpTransport {
    /// The transport of `gin`'s rank (its peers' addresses must be known: set at creation).
    pub(crate) fn new(gin: &Arc<GinRank>) -> Result<TcpTransport> {
        let peers = gin.tcp_peers.get().cloned().ok_or_else(|| {
            Error::InvalidArgument("the GIN TCP transport started before the ranks' addresses were exchanged".into())
        })?;
        let pool = gin.staging.as_ref().map(Arc::downgrade).unwrap_or_default();
        Ok(TcpTransport::with_peers(pool, gin.comm_id, gin.rank, peers))
    }

    /// A transport of world rank `rank` of job `job`, staging in blocks of `pool` (while it
    /// lives) on its streams, reaching rank `p` at `peers[p]`.
    pub(crate) fn with_peers(
        pool: Weak<StagingPool>,
        job: u64,
        rank: usize,
        peers: Vec<Option<SocketAddr>>,
    ) -> TcpTransport {
        let (reports_tx, reports) = mpsc::channel();
        TcpTransport {
            pool,
            job,
            rank,
            peers,
            conns: HashMap::new(),
            reports_tx,
            reports,
            in_flight: 0,
            ready: Vec::new(),
            failure: None,
        }
    }

    /// The channel to `req`'s connection thread, started on the ring's first request.
    fn connection(&mut self, req: &Request) -> Result<&mpsc::Sender<Request>> {
        if !self.conns.contains_key(&req.ring) {
            let addr = self.peers.get(req.peer).copied().flatten().ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "rank {} has no GIN TCP receiver (its GIN reaches no peer by TCP), so rank {} cannot send to it \
                     over TCP",
                    req.peer, self.rank
                ))
            })?;
            let (tx, rx) = mpsc::channel();
            let link = Link {
                pool: self.pool.clone(),
                job: self.job,
                rank: self.rank,
                peer: req.peer,
                context: req.context,
                addr,
            };
            let reports = self.reports_tx.clone();
            thread::Builder::new()
                .name(format!("fl-gin-send-{}-{}", self.rank, req.peer))
                .spawn(move || link.run(rx, reports))
                .map_err(|e| {
                    Error::InvalidArgument(format!("no thread for the GIN TCP connection to rank {}: {e}", req.peer))
                })?;
            self.conns.insert(req.ring, tx);
        }
        Ok(&self.conns[&req.ring])
    }

    /// Takes the reports that have come (completions into `ready`); returns the first
    /// failure.
    fn drain(&mut self, first: Option<Report>) -> Result<()> {
        let mut next = first;
        loop {
            match next.take().or_else(|| self.reports.try_recv().ok()) {
                Some(Report::Done(ring, ticket)) => self.ready.push((ring, ticket)),
                Some(Report::Failed(e)) => {
                    self.failure = Some(e.clone());
                    return Err(e);
                }
                None => return Ok(()),
            }
        }
    }

    /// As [`Transport::poll`], but waits up to `timeout` for the first report.
    #[cfg(test)]
    fn poll_wait(&mut self, done: &mut Vec<(usize, u64)>, timeout: Duration) -> Result<()> {
        if let Some(e) = &self.failure {
            return Err(e.clone());
        }
        let first = self.reports.recv_timeout(timeout).ok();
        self.drain(first)?;
        self.hand_over(done);
        Ok(())
    }

    /// Moves the completions taken so far to `done`.
    fn hand_over(&mut self, done: &mut Vec<(usize, u64)>) {
        self.in_flight -= self.ready.len();
        done.append(&mut self.ready);
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "TCP"
    }

    fn submit(&mut self, req: &Request) -> Result<()> {
        if let Some(e) = &self.failure {
            return Err(e.clone());
        }
        if self.connection(req)?.send(*req).is_err() {
            // The thread ended: it failed, and said why.
            self.drain(None)?;
            return Err(Error::Aborted(format!(
                "the GIN TCP connection to rank {} (context {}) has failed",
                req.peer, req.context
            )));
        }
        self.in_flight += 1;
        Ok(())
    }

    fn poll(&mut self, done: &mut Vec<(usize, u64)>) -> Result<()> {
        if let Some(e) = &self.failure {
            return Err(e.clone());
        }
        self.drain(None)?;
        self.hand_over(done);
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

/// One connection's sending side (its thread's state).
struct Link {
    /// Where its staging blocks come from.
    pool: Weak<StagingPool>,
    job: u64,
    rank: usize,
    peer: usize,
    context: u32,
    addr: SocketAddr,
}

/// A connection's host staging, [`STAGING_BLOCK`] bytes: `PREFIX` bytes of room for headers,
/// [`CHUNK`] data bytes, `SUFFIX` bytes of room for a signal frame.
enum Staging {
    /// A pinned block of the rank's pool: the copy stream fills it.
    Pinned(StagingBlock),
    /// Ordinary memory (the pool had no block): filled by synchronous reads on the
    /// connection's copy stream.
    Pageable(Vec<u8>),
}

impl Staging {
    /// `[PREFIX - before, PREFIX + len + after)` of the block.
    fn slice_mut(&mut self, before: usize, len: usize, after: usize) -> &mut [u8] {
        assert!(before <= PREFIX && after <= SUFFIX && len <= CHUNK);
        let (start, len) = (PREFIX - before, before + len + after);
        match self {
            Staging::Pinned(b) => {
                assert!(b.len() >= STAGING_BLOCK);
                // SAFETY: the range lies in the live block (at least `STAGING_BLOCK` bytes,
                // checked above), initialized (zeroed when allocated, only bytes written
                // since); no device copy into it is pending (callers wait for their copies
                // before they look), and `&mut self` keeps other host accesses off (the block
                // is this connection's until dropped).
                unsafe { std::slice::from_raw_parts_mut(b.host_ptr().add(start), len) }
            }
            Staging::Pageable(v) => &mut v[start..start + len],
        }
    }
}

/// A connection thread's working state.
struct Wire {
    sock: TcpStream,
    /// The stream that copies sources into staging. Raw (untracked): the thread waits for
    /// its copies before it reports a request, reuses a block, or drops one (returns it to
    /// the pool: see `Drop`).
    copy: Arc<dyn StreamBackend>,
    /// The rank's copies under way, where this thread notes its waits for `copy`.
    watch: Arc<CopyWatch>,
    staging: [Option<Staging>; 2],
}

impl Drop for Wire {
    fn drop(&mut self) {
        // After an error, copies into the staging blocks may still be queued: they must
        // be done before the blocks go back to the pool (dropped after this).
        let _ = self.copy.synchronize();
    }
}

/// Bytes request `r` takes on the wire.
fn framed_bytes(r: &Request) -> usize {
    let body = match r.payload {
        Payload::Put { bytes, .. } => tcp_wire::PUT_HEADER + bytes,
        Payload::PutValue { .. } => tcp_wire::PUT_VALUE_HEADER,
        Payload::None => 0,
    };
    body + if r.signal.is_some() { tcp_wire::SIGNAL_HEADER } else { 0 }
}

/// Writes `frame`'s header at `buf[*at..]` and moves `at` past it.
fn put_header(buf: &mut [u8], at: &mut usize, frame: &Frame) -> Result<()> {
    let h =
        tcp_wire::encode(frame).map_err(|e| Error::InvalidArgument(format!("a GIN request cannot be sent: {e}")))?;
    let h = h.as_bytes();
    buf[*at..*at + h.len()].copy_from_slice(h);
    *at += h.len();
    Ok(())
}

impl Link {
    fn describe(&self) -> String {
        format!("the GIN TCP connection to rank {} (context {}, {})", self.peer, self.context, self.addr)
    }

    fn run(self, jobs: mpsc::Receiver<Request>, reports: mpsc::Sender<Report>) {
        if let Err(e) = self.serve(&jobs, &reports) {
            tracing::warn!(target: "ferrolink::gin", rank = self.rank, peer = self.peer, context = self.context, "{e}");
            let _ = reports.send(Report::Failed(e));
        }
    }

    fn io_err(&self, what: &str, e: io::Error) -> Error {
        Error::Aborted(format!("{} {what}: {e}", self.describe()))
    }

    fn serve(&self, jobs: &mpsc::Receiver<Request>, reports: &mpsc::Sender<Report>) -> Result<()> {
        // The copy stream comes from the pool, made before any kernel ran: making one here
        // may wait for running kernels, which may be waiting for this connection.
        let (copy, watch) = self
            .pool
            .upgrade()
            .map(|p| (p.copy_stream(self.peer * 31 + self.context as usize), p.watch.clone()))
            .ok_or_else(|| Error::Aborted(format!("{}: the staging pool is gone", self.describe())))?;
        let mut sock =
            TcpStream::connect_timeout(&self.addr, CONNECT_TIMEOUT).map_err(|e| self.io_err("cannot connect", e))?;
        let hello = encode(&Frame::Hello { job: self.job, rank: self.rank as u32, context: self.context })?;
        sock.write_all(hello.as_bytes()).map_err(|e| self.io_err("broke", e))?;
        sock.set_nodelay(true).map_err(|e| self.io_err("cannot set TCP_NODELAY", e))?;
        let mut w = Wire { sock, copy, watch, staging: [None, None] };
        tracing::debug!(target: "ferrolink::gin", rank = self.rank, peer = self.peer, context = self.context, addr = %self.addr, "GIN TCP connection open");
        let mut plan = Plan { jobs, next: None, large: None, closed: false };
        // At most two pieces staged: the one being written and the next, in the other block.
        let mut staged: std::collections::VecDeque<Piece> = std::collections::VecDeque::with_capacity(2);
        let mut block = 0;
        loop {
            if staged.is_empty() {
                match self.plan(&mut w, &mut plan, block, true)? {
                    Some(p) => staged.push_back(p),
                    None => {
                        // The transport is gone (the proxy stopped after draining) and all
                        // it gave is sent: say goodbye, so that the receiver knows this end
                        // is orderly, and close. A peer gone already is no news here.
                        debug_assert!(plan.closed);
                        if let Err(e) = w.sock.write_all(encode(&Frame::Bye)?.as_bytes()) {
                            tracing::debug!(target: "ferrolink::gin", rank = self.rank, peer = self.peer, context = self.context, error = %e, "GIN TCP goodbye not sent");
                        }
                        let _ = w.sock.shutdown(Shutdown::Write);
                        return Ok(());
                    }
                }
                block ^= 1;
            }
            // Stage the next piece (if there is work queued already) before writing this one,
            // so that its copy runs while the socket takes this one.
            if staged.len() == 1
                && let Some(p) = self.plan(&mut w, &mut plan, block, false)?
            {
                staged.push_back(p);
                block ^= 1;
            }
            let p = staged.pop_front().expect("a staged piece");
            self.send(&mut w, p, reports)?;
        }
    }

    /// Stages the next piece of work into staging block `block`: the next chunk of a large
    /// put in progress, or the next requests (waiting for one if `wait`). `None`: no work
    /// (and with `wait`: the transport is gone).
    fn plan(&self, w: &mut Wire, plan: &mut Plan<'_>, block: usize, wait: bool) -> Result<Option<Piece>> {
        if plan.large.is_none() {
            let first = match plan.next.take() {
                Some(r) => r,
                None if wait => match plan.jobs.recv() {
                    Ok(r) => r,
                    Err(_) => {
                        plan.closed = true;
                        return Ok(None);
                    }
                },
                None => match plan.jobs.try_recv() {
                    Ok(r) => r,
                    Err(_) => return Ok(None),
                },
            };
            if !is_large(&first) {
                return self.plan_small(w, plan, block, first).map(Some);
            }
            plan.large = Some((first, 0));
        }
        let (r, i) = plan.large.expect("a large put in progress");
        let Payload::Put { src, bytes, dst, .. } = r.payload else { unreachable!("only puts are large") };
        let (off, len) = (i * CHUNK, CHUNK.min(bytes - i * CHUNK));
        let last = off + len == bytes;
        plan.large = if last { None } else { Some((r, i + 1)) };
        self.staging(w, block);
        let mut copies = Vec::with_capacity(1);
        self.stage(w, block, 0, src + off as u64, len, &mut copies)?;
        let event = self.queue_copies(w, &copies)?;
        let header = if i == 0 { Some(encode(&Frame::Put { dst, len: bytes as u64 })?) } else { None };
        let signal = match r.signal {
            Some((id, inc)) if last => Some(encode(&Frame::Signal { id, inc })?),
            _ => None,
        };
        let done = if last { vec![(r.ring, r.ticket)] } else { Vec::new() };
        Ok(Some(Piece { block, event, kind: PieceKind::Chunk { len, header, signal }, done }))
    }

    /// Stages `first` and the small requests queued behind it (up to [`CHUNK`] bytes of
    /// frames: one block) into block `block`: their frames laid out back to back, each put's
    /// data copied into place after its header.
    fn plan_small(&self, w: &mut Wire, plan: &mut Plan<'_>, block: usize, first: Request) -> Result<Piece> {
        let mut batch = vec![first];
        let mut total = framed_bytes(&first);
        while batch.len() < MAX_BATCH {
            let Ok(r) = plan.jobs.try_recv() else { break };
            let b = framed_bytes(&r);
            if is_large(&r) || total + b > CHUNK {
                plan.next = Some(r);
                break;
            }
            total += b;
            batch.push(r);
        }
        // The first fits (a small put with its headers is far below a chunk); the others
        // were taken only while the total fits.
        debug_assert!(total <= CHUNK);
        self.staging(w, block);
        let mut at = 0;
        let mut copies = Vec::with_capacity(batch.len());
        for r in &batch {
            if let Payload::Put { src, bytes, .. } = r.payload {
                self.stage(w, block, at + tcp_wire::PUT_HEADER, src, bytes, &mut copies)?;
            }
            at += framed_bytes(r);
        }
        let event = self.queue_copies(w, &copies)?;
        let done = batch.iter().map(|r| (r.ring, r.ticket)).collect();
        Ok(Piece { block, event, kind: PieceKind::Small { batch, len: total }, done })
    }

    /// Waits for a staged piece's copies, reports the requests it completes (their sources
    /// are in host memory: they may be reused), fills in its headers and writes it.
    fn send(&self, w: &mut Wire, p: Piece, reports: &mpsc::Sender<Report>) -> Result<()> {
        if let Some(e) = &p.event {
            let _under_way = w.watch.begin(CopyFor::StagingTo(self.peer));
            e.synchronize()?;
        }
        for &(ring, ticket) in &p.done {
            let _ = reports.send(Report::Done(ring, ticket));
        }
        let s = w.staging[p.block].as_mut().expect("staged");
        let frame = match &p.kind {
            PieceKind::Chunk { len, header, signal } => {
                let header = header.as_ref().map_or(&[][..], |h| h.as_bytes());
                let signal = signal.as_ref().map_or(&[][..], |h| h.as_bytes());
                let frame = s.slice_mut(header.len(), *len, signal.len());
                frame[..header.len()].copy_from_slice(header);
                frame[header.len() + len..].copy_from_slice(signal);
                frame
            }
            PieceKind::Small { batch, len } => {
                let buf = s.slice_mut(0, *len, 0);
                let mut at = 0;
                for r in batch {
                    match r.payload {
                        Payload::Put { bytes, dst, .. } => {
                            put_header(buf, &mut at, &Frame::Put { dst, len: bytes as u64 })?;
                            at += bytes;
                        }
                        Payload::PutValue { value, bytes, dst } => {
                            let bytes = u8::try_from(bytes).unwrap_or(0);
                            put_header(buf, &mut at, &Frame::PutValue { dst, value, bytes })?;
                        }
                        Payload::None => {}
                    }
                    if let Some((id, inc)) = r.signal {
                        put_header(buf, &mut at, &Frame::Signal { id, inc })?;
                    }
                }
                debug_assert_eq!(at, *len);
                buf
            }
        };
        w.sock.write_all(frame).map_err(|e| self.io_err("broke", e))
    }

    /// Readies staging block `i`: a block of the rank's pool where it has a free one, else
    /// ordinary memory (tried again at every piece, so the connection moves to a pinned
    /// block once one is free). Never allocates pinned memory.
    fn staging(&self, w: &mut Wire, i: usize) {
        if matches!(w.staging[i], Some(Staging::Pinned(_))) {
            return;
        }
        // (A block of another size, which no rank's pool has, goes straight back.)
        match StagingPool::take_from(&self.pool).filter(|b| b.len() >= STAGING_BLOCK) {
            // Replacing ordinary memory: its reads were synchronous, nothing is pending.
            Some(b) => w.staging[i] = Some(Staging::Pinned(b)),
            None if w.staging[i].is_none() => {
                tracing::debug!(target: "ferrolink::gin", rank = self.rank, peer = self.peer, context = self.context, "GIN TCP staging pool empty: staging in pageable memory");
                w.staging[i] = Some(Staging::Pageable(vec![0u8; STAGING_BLOCK]));
            }
            None => {}
        }
    }

    /// Copies `bytes` device bytes at `src` to data byte `at` of staging block `block`: for
    /// a pinned block, added to `copies` (for [`Link::queue_copies`]), or done when this
    /// returns for ordinary memory.
    fn stage(
        &self,
        w: &mut Wire,
        block: usize,
        at: usize,
        src: u64,
        bytes: usize,
        copies: &mut Vec<(u64, u64, usize)>,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        match w.staging[block].as_mut().expect("readied by `staging`") {
            Staging::Pinned(b) => {
                assert!(PREFIX + at + bytes <= b.len());
                copies.push((b.device_addr() + (PREFIX + at) as u64, src, bytes));
                Ok(())
            }
            Staging::Pageable(v) => {
                let dst = &mut v[PREFIX + at..PREFIX + at + bytes];
                let _under_way = w.watch.begin(CopyFor::StagingTo(self.peer));
                // SAFETY: `src` is this rank's source window range (resolved and
                // bounds-checked by the proxy), device memory of this device that no work
                // writes: the GIN contract keeps it alive and unwritten until the request is
                // reported complete, which this thread does only after this read has
                // returned (the copy is done then). On the connection's copy stream, not the
                // device's shared one, which may hold work waiting for an SM that kernels
                // waiting for this connection hold (`GinRank::deliveries`).
                unsafe { w.copy.read_sync(dst, src)? };
                Ok(())
            }
        }
    }

    /// Queues the staging copies of a piece on the copy stream, as one batch (one submission:
    /// each costs about 0.2 ms while the ranks' kernels hold every SM), and returns the event
    /// to wait for; `None` when there are none.
    fn queue_copies(&self, w: &mut Wire, copies: &[(u64, u64, usize)]) -> Result<Option<Arc<dyn EventBackend>>> {
        if copies.is_empty() {
            return Ok(None);
        }
        // SAFETY: each `src` is this rank's source window range (resolved and bounds-checked
        // by the proxy; the GIN contract keeps it alive and unwritten until the request is
        // reported complete, which this thread does only after the copies have run); each
        // `dst` is a range (checked by `stage`) of one of this thread's live staging blocks,
        // which no host code touches and which is not dropped (returned to the pool: `Wire`'s
        // drop waits) until the copies have run; the destinations are disjoint (a piece lays
        // its data out back to back) and do not overlap the sources (device memory and pinned
        // host memory).
        unsafe { w.copy.copy_batch(copies)? };
        Ok(Some(w.copy.record(false)?))
    }
}

/// What a connection thread has taken from its channel and not yet staged.
struct Plan<'a> {
    jobs: &'a mpsc::Receiver<Request>,
    /// A request taken but not yet staged (it did not fit the last batch).
    next: Option<Request>,
    /// A large put in progress and its next chunk.
    large: Option<(Request, usize)>,
    /// The channel has closed.
    closed: bool,
}

/// Work staged in a block, ready to be written once its copies are done.
struct Piece {
    block: usize,
    /// Reached when its copies are done (`None`: it has none).
    event: Option<Arc<dyn EventBackend>>,
    kind: PieceKind,
    /// The requests that complete locally once its copies are done.
    done: Vec<(usize, u64)>,
}

enum PieceKind {
    /// Small requests' frames, `len` bytes from the start of the block's data (headers
    /// filled in before the write).
    Small { batch: Vec<Request>, len: usize },
    /// A chunk of a large put: `len` data bytes, the put's header before the first, the
    /// signal after the last.
    Chunk { len: usize, header: Option<tcp_wire::Header>, signal: Option<tcp_wire::Header> },
}

/// Whether `r` is sent as a large put (chunked, not batched).
fn is_large(r: &Request) -> bool {
    matches!(r.payload, Payload::Put { bytes, .. } if bytes > SMALL)
}

fn encode(frame: &Frame) -> Result<tcp_wire::Header> {
    tcp_wire::encode(frame).map_err(|e| Error::InvalidArgument(format!("a GIN request cannot be sent: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;
    use crate::gin::transport::RemoteLocation;
    use crate::runtime::device::Device;
    use crate::runtime::host_mapped::HostMapped;
    use std::sync::Condvar;
    use std::time::Instant;

    /// What a mock [`Deliver`] was asked to do.
    #[derive(Clone, Debug, PartialEq, Eq)]
    enum Call {
        Put { from: usize, dst: RemoteLocation, data: Vec<u8> },
        Value { from: usize, dst: RemoteLocation, value: u64, bytes: u32 },
        Signal { from: usize, id: u32, inc: u64 },
        Fail(String),
        Lost { from: usize, why: String },
    }

    /// A [`Deliver`] that records its calls (puts of a window are written into a `Vec`, so
    /// chunked deliveries can be checked whole); window 99 refuses data. With `pool`, it
    /// hands out its blocks as staging memory (and counts them).
    #[derive(Default)]
    struct Mock {
        calls: Mutex<Vec<Call>>,
        cv: Condvar,
        pool: Option<Arc<StagingPool>>,
        staged: std::sync::atomic::AtomicUsize,
    }

    impl Mock {
        /// A mock that hands out the blocks of a staging pool (of 4) of a CPU device.
        fn staging() -> Mock {
            Mock { pool: Some(pool(&Device::open_with(Backend::Cpu, 0).unwrap(), 4)), ..Mock::default() }
        }

        /// Whether every block of its pool is back (none handed out).
        fn pool_is_full(&self) -> bool {
            self.pool.as_ref().is_none_or(|p| p.available() == p.count())
        }

        fn failed_or_lost(&self) -> Vec<Call> {
            self.calls().into_iter().filter(|c| matches!(c, Call::Fail(_) | Call::Lost { .. })).collect()
        }

        fn push(&self, c: Call) {
            lock(&self.calls).push(c);
            self.cv.notify_all();
        }

        /// Waits (up to 20 s) until `pred` holds for the calls; returns them.
        fn wait_for(&self, what: &str, pred: impl Fn(&[Call]) -> bool) -> Vec<Call> {
            let calls = lock(&self.calls);
            let (calls, t) = self
                .cv
                .wait_timeout_while(calls, Duration::from_secs(20), |c| !pred(c))
                .unwrap_or_else(|e| e.into_inner());
            assert!(!t.timed_out(), "timed out waiting for {what}; calls: {:?}", short(&calls));
            calls.clone()
        }

        fn calls(&self) -> Vec<Call> {
            lock(&self.calls).clone()
        }
    }

    fn short(calls: &[Call]) -> Vec<String> {
        calls
            .iter()
            .map(|c| match c {
                Call::Put { from, dst, data } => format!("put from {from} at {dst:?}: {} bytes", data.len()),
                other => format!("{other:?}"),
            })
            .collect()
    }

    impl Deliver for Mock {
        fn fail(&self, why: String) {
            self.push(Call::Fail(why));
        }
        fn put(&self, from: usize, dst: RemoteLocation, data: &[u8]) -> Result<()> {
            if dst.window == 99 {
                return Err(Error::InvalidArgument("window 99 is not registered".into()));
            }
            self.push(Call::Put { from, dst, data: data.to_vec() });
            Ok(())
        }
        fn put_value(&self, from: usize, dst: RemoteLocation, value: u64, bytes: u32) -> Result<()> {
            self.push(Call::Value { from, dst, value, bytes });
            Ok(())
        }
        fn signal(&self, from: usize, id: u32, inc: u64) -> Result<()> {
            self.push(Call::Signal { from, id, inc });
            Ok(())
        }
        fn peer_lost(&self, from: usize, why: String) {
            self.push(Call::Lost { from, why });
        }
        fn staging(&self, bytes: usize) -> Option<StagingBlock> {
            let pool = self.pool.as_ref()?;
            let block = if bytes <= pool.block_bytes() { pool.take()? } else { return None };
            self.staged.fetch_add(1, Ordering::Relaxed);
            Some(block)
        }
    }

    const JOB: u64 = 0x6a6f62;

    /// A staging pool of `blocks` blocks on `dev`, as a rank's.
    fn pool(dev: &Device, blocks: usize) -> Arc<StagingPool> {
        StagingPool::new(dev, blocks, STAGING_BLOCK, 2, Default::default()).unwrap()
    }

    /// Waits (up to 20 s) until `pool` has all its blocks back.
    fn wait_pool_full(pool: &StagingPool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while pool.available() != pool.count() {
            assert!(Instant::now() < deadline, "{} of {} blocks came back", pool.available(), pool.count());
            thread::sleep(Duration::from_millis(5));
        }
    }

    fn receiver(mock: &Arc<Mock>) -> (TcpReceiver, SocketAddr) {
        let d: Weak<dyn Deliver> = Arc::downgrade(&(mock.clone() as Arc<dyn Deliver>));
        TcpReceiver::start(JOB, 0, d).unwrap()
    }

    fn frame(f: Frame) -> Vec<u8> {
        tcp_wire::encode(&f).unwrap().as_bytes().to_vec()
    }

    fn hello(job: u64, rank: u32, context: u32) -> Vec<u8> {
        frame(Frame::Hello { job, rank, context })
    }

    fn put(window: u32, offset: u64, data: &[u8]) -> Vec<u8> {
        let mut v = frame(Frame::Put { dst: RemoteLocation { window, offset }, len: data.len() as u64 });
        v.extend_from_slice(data);
        v
    }

    fn bye() -> Vec<u8> {
        frame(Frame::Bye)
    }

    /// Ends the stream `s` from this side and waits until the receiver has closed its side
    /// (it has then applied and reported all it will).
    fn close_and_wait(mut s: TcpStream) {
        // (It may be closed already: after a failure the receiver closes it.)
        let _ = s.shutdown(Shutdown::Write);
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut buf = [0u8; 16];
        match s.read(&mut buf) {
            Ok(0) => {}
            Err(e) => assert_ne!(e.kind(), io::ErrorKind::WouldBlock, "the receiver did not close"),
            Ok(n) => panic!("the receiver sent {n} bytes"),
        }
    }

    /// Every rank's GIN of `comms` (created together, on threads), every peer through the
    /// proxy over TCP: `contexts` contexts, `signals` signals, one counter, depth 8.
    fn tcp_gins(comms: &[crate::Communicator], contexts: u32, signals: u32) -> Vec<crate::gin::GinOwner> {
        use crate::gin::transport::TransportKind;
        use crate::gin::{GinMode, GinShape};
        let shape = GinShape {
            contexts,
            signals,
            counters: 1,
            depth: 8,
            barriers: 0,
            mode: Some(GinMode::Proxy),
            transport: Some(TransportKind::Tcp),
        };
        thread::scope(|s| {
            let hs: Vec<_> = comms.iter().map(|c| s.spawn(move || crate::gin::create(c, shape))).collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap().1).collect()
        })
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    /// The data rank `from` put into `window`, reassembled from its pieces, in call order up
    /// to the first signal `id` of `from` (what a kernel woken by that signal would see).
    fn landed_before_signal(calls: &[Call], from: usize, window: u32, id: u32, len: usize) -> Vec<u8> {
        let mut mem = vec![0u8; len];
        for c in calls {
            match c {
                Call::Put { from: f, dst, data } if *f == from && dst.window == window => {
                    mem[dst.offset as usize..dst.offset as usize + data.len()].copy_from_slice(data)
                }
                Call::Signal { from: f, id: i, .. } if *f == from && *i == id => return mem,
                _ => {}
            }
        }
        panic!("no signal {id} from rank {from}");
    }

    #[test]
    fn receiver_writes_data_before_its_signal() {
        // Into the rank's staging memory (as pinned memory on CUDA).
        let mock = Arc::new(Mock::staging());
        let (_rx, addr) = receiver(&mock);
        let mut s = TcpStream::connect(addr).unwrap();
        let data = pattern(5 << 20, 7);
        let mut bytes = hello(JOB, 3, 0);
        bytes.extend(put(1, 0, &data));
        bytes.extend(frame(Frame::PutValue { dst: RemoteLocation { window: 1, offset: 8 }, value: 0xabcd, bytes: 2 }));
        bytes.extend(frame(Frame::Signal { id: 4, inc: 1 }));
        bytes.extend(bye());
        // Cut into odd pieces, as a network may.
        for piece in bytes.chunks(777_777) {
            s.write_all(piece).unwrap();
        }
        let calls = mock.wait_for("the signal", |c| c.iter().any(|c| matches!(c, Call::Signal { .. })));
        assert_eq!(landed_before_signal(&calls, 3, 1, 4, data.len()), data);
        let value_at = calls.iter().position(|c| matches!(c, Call::Value { .. })).unwrap();
        let signal_at = calls.iter().position(|c| matches!(c, Call::Signal { .. })).unwrap();
        assert!(value_at < signal_at);
        assert_eq!(calls[signal_at], Call::Signal { from: 3, id: 4, inc: 1 });
        // A large put arrives in large pieces, not one per read.
        let pieces = calls.iter().filter(|c| matches!(c, Call::Put { .. })).count();
        assert!(pieces < 64, "{pieces} pieces for 5 MiB");
        // The buffers were the rank's staging memory.
        assert!(mock.staged.load(Ordering::Relaxed) >= 1);
        // A close after the goodbye is neither a failure nor a lost peer.
        close_and_wait(s);
        assert_eq!(mock.failed_or_lost(), vec![]);
        // The connection is done: its buffers are back in the pool.
        assert!(mock.pool_is_full());
    }

    #[test]
    fn a_close_without_goodbye_reports_a_lost_peer_not_a_failure() {
        for staging in [false, true] {
            let mock = Arc::new(if staging { Mock::staging() } else { Mock::default() });
            let (_rx, addr) = receiver(&mock);
            // Closed at a frame boundary, without a Bye (the process died between frames).
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&[hello(JOB, 2, 5), put(1, 0, &[9; 1000]), frame(Frame::Signal { id: 0, inc: 1 })].concat())
                .unwrap();
            close_and_wait(s);
            let calls = mock.calls();
            let lost: Vec<_> = calls.iter().filter(|c| matches!(c, Call::Lost { .. })).collect();
            assert_eq!(lost.len(), 1, "{:?}", short(&calls));
            let Call::Lost { from, why } = lost[0] else { unreachable!() };
            assert_eq!(*from, 2);
            assert!(why.contains("context 5") && why.contains("without a goodbye"), "{why}");
            // Reported after everything it sent was applied, and no failure.
            let at = calls.iter().position(|c| matches!(c, Call::Lost { .. })).unwrap();
            assert!(matches!(calls[at - 1], Call::Signal { from: 2, id: 0, inc: 1 }), "{:?}", short(&calls));
            assert!(!calls.iter().any(|c| matches!(c, Call::Fail(_))));
            // A connection with nothing after its Hello, too.
            let mut t = TcpStream::connect(addr).unwrap();
            t.write_all(&hello(JOB, 4, 0)).unwrap();
            close_and_wait(t);
            assert!(mock.calls().iter().any(|c| matches!(c, Call::Lost { from: 4, .. })));
            assert_eq!(mock.staged.load(Ordering::Relaxed) > 0, staging);
            assert!(mock.pool_is_full());
        }
    }

    #[test]
    fn bytes_after_a_goodbye_fail() {
        let mock = Arc::new(Mock::default());
        let (_rx, addr) = receiver(&mock);
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&[hello(JOB, 8, 0), frame(Frame::Signal { id: 1, inc: 1 }), bye()].concat()).unwrap();
        mock.wait_for("the signal", |c| c.iter().any(|c| matches!(c, Call::Signal { .. })));
        // In a later read.
        s.write_all(&frame(Frame::Signal { id: 2, inc: 1 })).unwrap();
        let calls = mock.wait_for("the failure", |c| c.iter().any(|c| matches!(c, Call::Fail(_))));
        assert!(matches!(&calls[1], Call::Fail(w) if w.contains("rank 8") && w.contains("goodbye")), "{calls:?}");
        close_and_wait(s);
        // In the same read as the Bye: nothing after it is applied.
        let mut t = TcpStream::connect(addr).unwrap();
        t.write_all(&[hello(JOB, 9, 0), bye(), frame(Frame::Signal { id: 3, inc: 1 })].concat()).unwrap();
        close_and_wait(t);
        let calls = mock.calls();
        assert!(calls.iter().any(|c| matches!(c, Call::Fail(w) if w.contains("rank 9") && w.contains("goodbye"))));
        assert!(!calls.iter().any(|c| matches!(c, Call::Signal { from: 9, .. } | Call::Lost { .. })), "{calls:?}");
    }

    #[test]
    fn receiver_keeps_each_connections_order() {
        let mock = Arc::new(Mock::default());
        let (_rx, addr) = receiver(&mock);
        let rounds = 50u64;
        let senders: Vec<_> = (1..=3u32)
            .map(|rank| {
                thread::spawn(move || {
                    let mut s = TcpStream::connect(addr).unwrap();
                    s.write_all(&hello(JOB, rank, rank)).unwrap();
                    for i in 0..rounds {
                        let data = pattern(1000 + 4000 * i as usize, rank as u8);
                        let mut f = put(rank, i * 1_000_000, &data);
                        f.extend(frame(Frame::Signal { id: rank, inc: i + 1 }));
                        s.write_all(&f).unwrap();
                    }
                    s.write_all(&bye()).unwrap();
                    close_and_wait(s);
                })
            })
            .collect();
        for s in senders {
            s.join().unwrap();
        }
        let calls =
            mock.wait_for("every signal", |c| c.iter().filter(|c| matches!(c, Call::Signal { .. })).count() == 150);
        for rank in 1..=3usize {
            // Per sender: every put of round i lands before signal i, and signals come in order.
            let mut landed = vec![0usize; rounds as usize];
            let mut next = 0u64;
            for c in &calls {
                match c {
                    Call::Put { from, dst, data } if *from == rank => {
                        let round = (dst.offset / 1_000_000) as usize;
                        let start = (dst.offset % 1_000_000) as usize;
                        assert_eq!(start, landed[round], "pieces in order");
                        let want = pattern(1000 + 4000 * round, rank as u8);
                        assert_eq!(&data[..], &want[start..start + data.len()]);
                        landed[round] += data.len();
                    }
                    Call::Signal { from, id, inc } if *from == rank => {
                        assert_eq!(*id as usize, rank);
                        assert_eq!(*inc, next + 1, "signals in order");
                        assert_eq!(landed[next as usize], 1000 + 4000 * next as usize, "data before its signal");
                        next += 1;
                    }
                    Call::Fail(why) | Call::Lost { why, .. } => panic!("{why}"),
                    _ => {}
                }
            }
            assert_eq!(next, rounds);
        }
    }

    #[test]
    fn receiver_refuses_strangers_quietly() {
        let mock = Arc::new(Mock::default());
        let (_rx, addr) = receiver(&mock);
        let mut buf = [0u8; 16];
        for first in [hello(JOB + 1, 1, 0), frame(Frame::Signal { id: 0, inc: 1 }), b"GET / HTTP/1.1\r\n\r\n".to_vec()]
        {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut bytes = first;
            bytes.extend(put(1, 0, &[1, 2, 3]));
            bytes.extend(frame(Frame::Signal { id: 0, inc: 1 }));
            let _ = s.write_all(&bytes);
            // The receiver closes it: end of stream (or a reset), never a timeout.
            match s.read(&mut buf) {
                Ok(0) => {}
                Err(e) => assert_ne!(e.kind(), io::ErrorKind::WouldBlock, "the stranger was not closed"),
                Ok(n) => panic!("the receiver sent {n} bytes"),
            }
        }
        assert_eq!(mock.calls(), vec![], "no data, no signal, no failure from strangers");
    }

    #[test]
    fn sender_dying_mid_frame_fails_the_communicator() {
        let mock = Arc::new(Mock::default());
        let (_rx, addr) = receiver(&mock);
        let mut s = TcpStream::connect(addr).unwrap();
        let mut bytes = hello(JOB, 5, 2);
        let full = put(1, 0, &pattern(10_000, 1));
        bytes.extend_from_slice(&full[..5_000]);
        s.write_all(&bytes).unwrap();
        drop(s);
        let calls = mock.wait_for("the failure", |c| c.iter().any(|c| matches!(c, Call::Fail(_))));
        let why = calls.iter().find_map(|c| if let Call::Fail(w) = c { Some(w.clone()) } else { None }).unwrap();
        assert!(why.contains("rank 5") && why.contains("middle of a frame"), "{why}");
        assert!(!calls.iter().any(|c| matches!(c, Call::Signal { .. })));
    }

    #[test]
    fn malformed_or_undeliverable_frames_fail_and_stop_the_connection() {
        let mock = Arc::new(Mock::default());
        let (_rx, addr) = receiver(&mock);
        // A bad frame after the Hello.
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&[hello(JOB, 6, 0), vec![77u8; 30]].concat()).unwrap();
        let calls = mock.wait_for("the failure", |c| c.iter().any(|c| matches!(c, Call::Fail(_))));
        assert!(matches!(&calls[0], Call::Fail(w) if w.contains("rank 6") && w.contains("malformed")), "{calls:?}");
        // Data the rank refuses: failed, and the signal behind it is never applied.
        let mut t = TcpStream::connect(addr).unwrap();
        let bytes = [hello(JOB, 7, 0), put(99, 0, &[1; 100]), frame(Frame::Signal { id: 1, inc: 1 })].concat();
        t.write_all(&bytes).unwrap();
        let calls =
            mock.wait_for("the second failure", |c| c.iter().filter(|c| matches!(c, Call::Fail(_))).count() == 2);
        assert!(calls.iter().any(|c| matches!(c, Call::Fail(w) if w.contains("rank 7") && w.contains("window 99"))));
        let mut buf = [0u8; 1];
        t.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        assert!(matches!(t.read(&mut buf), Ok(0) | Err(_)));
        assert!(!mock.calls().iter().any(|c| matches!(c, Call::Signal { .. })));
    }

    #[test]
    fn dropping_the_receiver_closes_its_connections_without_failing() {
        let mock = Arc::new(Mock::default());
        let (rx, addr) = receiver(&mock);
        let mut s = TcpStream::connect(addr).unwrap();
        // In the middle of a frame: only the receiver's own close ends it.
        s.write_all(&[hello(JOB, 1, 0), put(1, 0, &[1; 100])[..50].to_vec()].concat()).unwrap();
        // At a frame boundary: its close is no lost peer either.
        let mut t = TcpStream::connect(addr).unwrap();
        t.write_all(&[hello(JOB, 2, 0), frame(Frame::Signal { id: 0, inc: 1 })].concat()).unwrap();
        mock.wait_for("the signal", |c| c.iter().any(|c| matches!(c, Call::Signal { .. })));
        let start = Instant::now();
        drop(rx);
        assert!(start.elapsed() < Duration::from_secs(5), "drop blocked");
        for mut s in [s, t] {
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut buf = [0u8; 1];
            assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));
        }
        // The readers see their sockets closed at once; give them time to (not) report.
        thread::sleep(Duration::from_millis(200));
        assert_eq!(mock.failed_or_lost(), vec![]);
    }

    #[test]
    fn receiver_stops_when_the_rank_is_gone() {
        let mock = Arc::new(Mock::default());
        let (_rx, addr) = receiver(&mock);
        drop(mock);
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&[hello(JOB, 1, 0), frame(Frame::Signal { id: 0, inc: 1 })].concat()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut buf = [0u8; 1];
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));
    }

    /// A CPU device, a staging pool on it of `blocks` blocks, and a transport of rank 1 that
    /// reaches rank 0 at `addr`, staging in the pool's blocks.
    fn transport_with(addr: SocketAddr, blocks: usize) -> (Device, Arc<StagingPool>, TcpTransport) {
        let dev = Device::open_with(Backend::Cpu, 0).unwrap();
        let pool = pool(&dev, blocks);
        let t = TcpTransport::with_peers(Arc::downgrade(&pool), JOB, 1, vec![Some(addr), None]);
        (dev, pool, t)
    }

    /// [`transport_with`] a pool of 4 blocks (two connections' worth).
    fn transport(addr: SocketAddr) -> (Device, Arc<StagingPool>, TcpTransport) {
        transport_with(addr, 4)
    }

    fn wait_done(t: &mut TcpTransport, n: usize) -> Result<Vec<(usize, u64)>> {
        let mut done = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while done.len() < n {
            assert!(Instant::now() < deadline, "only {} of {n} completions", done.len());
            t.poll_wait(&mut done, Duration::from_secs(1))?;
        }
        Ok(done)
    }

    #[test]
    fn transport_sends_puts_of_every_size_in_order_with_their_signals() {
        // Staging in pinned blocks (two per connection), in a pinned block and pageable
        // memory, in pageable memory only (the pool is empty).
        for blocks in [4, 1, 0] {
            sends_puts_of_every_size(blocks);
        }
    }

    fn sends_puts_of_every_size(blocks: usize) {
        let mock = Arc::new(Mock::default());
        let (_rx, addr) = receiver(&mock);
        let (dev, pool, mut t) = transport_with(addr, blocks);
        let allocs = HostMapped::allocs(&dev);
        let sizes = [0usize, 1, 4096, SMALL, SMALL + 1, CHUNK, 2 * CHUNK + 12345, 9 << 20];
        let total: usize = sizes.iter().sum();
        let src_data = pattern(total, 3);
        let src = dev.alloc_from(&src_data).unwrap();
        let mut expect = Vec::new();
        let mut off = 0;
        // Two contexts: rings 0 (context 0) and 2 (context 1) to rank 0 of 2 ranks.
        for (i, &bytes) in sizes.iter().enumerate() {
            let ring = 2 * (i % 2);
            let dst = RemoteLocation { window: 1, offset: off as u64 };
            let req = Request {
                ring,
                ticket: (i / 2) as u64,
                context: (ring / 2) as u32,
                peer: 0,
                payload: Payload::Put { src: src.addr() + off as u64, src_window: 0, bytes, dst },
                signal: Some((i as u32, 1)),
            };
            t.submit(&req).unwrap();
            expect.push((ring, (i / 2) as u64));
            off += bytes;
        }
        let vreq = Request {
            ring: 0,
            ticket: 4,
            context: 0,
            peer: 0,
            payload: Payload::PutValue { value: 0x1122_3344, bytes: 4, dst: RemoteLocation { window: 2, offset: 0 } },
            signal: Some((100, 7)),
        };
        t.submit(&vreq).unwrap();
        let sreq = Request { ticket: 5, payload: Payload::None, signal: Some((101, 1)), ..vreq };
        t.submit(&sreq).unwrap();
        assert_eq!(t.in_flight(), sizes.len() + 2);
        let done = wait_done(&mut t, sizes.len() + 2).unwrap();
        assert_eq!(t.in_flight(), 0);
        for ring in [0, 2] {
            let got: Vec<u64> = done.iter().filter(|d| d.0 == ring).map(|d| d.1).collect();
            let want: Vec<u64> = (0..got.len() as u64).collect();
            assert_eq!(got, want, "ring {ring} completes in order");
        }
        let calls =
            mock.wait_for("every signal", |c| c.iter().filter(|c| matches!(c, Call::Signal { .. })).count() == 10);
        let mut off = 0;
        for (i, &bytes) in sizes.iter().enumerate() {
            let mem = landed_before_signal(&calls, 1, 1, i as u32, total);
            assert_eq!(&mem[off..off + bytes], &src_data[off..off + bytes], "put {i} ({bytes} bytes)");
            off += bytes;
        }
        let v = calls.iter().position(|c| matches!(c, Call::Value { value: 0x1122_3344, bytes: 4, .. })).unwrap();
        let s100 = calls.iter().position(|c| *c == Call::Signal { from: 1, id: 100, inc: 7 }).unwrap();
        let s101 = calls.iter().position(|c| *c == Call::Signal { from: 1, id: 101, inc: 1 }).unwrap();
        assert!(v < s100 && s100 < s101);
        assert!(!calls.iter().any(|c| matches!(c, Call::Fail(_))));
        // The connections took the pool's blocks (each stages more than one piece: both of
        // its blocks), allocated no pinned memory, and give the blocks back when they end.
        assert_eq!(pool.available(), 0, "{blocks} blocks");
        assert_eq!(HostMapped::allocs(&dev), allocs);
        drop(t);
        wait_pool_full(&pool);
        assert_eq!(HostMapped::frees(&dev), 0);
    }

    #[test]
    fn transport_batches_many_small_puts() {
        for blocks in [2, 0] {
            batches_many_small_puts(blocks);
        }
    }

    fn batches_many_small_puts(blocks: usize) {
        let mock = Arc::new(Mock::default());
        let (_rx, addr) = receiver(&mock);
        let (dev, _pool, mut t) = transport_with(addr, blocks);
        let n = 2000usize;
        let src_data = pattern(n * 64, 9);
        let src = dev.alloc_from(&src_data).unwrap();
        for i in 0..n {
            let dst = RemoteLocation { window: 1, offset: (i * 64) as u64 };
            let payload = Payload::Put { src: src.addr() + (i * 64) as u64, src_window: 0, bytes: 64, dst };
            let signal = (i + 1 == n).then_some((0, 1));
            t.submit(&Request { ring: 0, ticket: i as u64, context: 0, peer: 0, payload, signal }).unwrap();
        }
        let done = wait_done(&mut t, n).unwrap();
        assert_eq!(done.iter().map(|d| d.1).collect::<Vec<_>>(), (0..n as u64).collect::<Vec<_>>());
        let calls = mock.wait_for("the signal", |c| c.iter().any(|c| matches!(c, Call::Signal { .. })));
        assert_eq!(landed_before_signal(&calls, 1, 1, 0, n * 64), src_data);
    }

    #[test]
    fn transport_says_goodbye_when_dropped() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (dev, _pool, mut t) = transport(addr);
        let src = dev.alloc_from(&pattern(100, 1)).unwrap();
        let payload =
            Payload::Put { src: src.addr(), src_window: 0, bytes: 100, dst: RemoteLocation { window: 1, offset: 0 } };
        t.submit(&Request { ring: 0, ticket: 0, context: 3, peer: 0, payload, signal: Some((0, 1)) }).unwrap();
        // Queued when the transport is dropped: still sent, before the goodbye.
        t.submit(&Request { ring: 0, ticket: 1, context: 3, peer: 0, payload: Payload::None, signal: Some((1, 1)) })
            .unwrap();
        drop(t);
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut bytes = Vec::new();
        s.read_to_end(&mut bytes).unwrap();
        let mut dec = Decoder::new();
        let mut input = &bytes[..];
        let mut items = Vec::new();
        while let Some(item) = dec.decode(&mut input).unwrap() {
            items.push(item);
        }
        assert!(dec.said_bye() && dec.at_boundary() && input.is_empty());
        let data = pattern(100, 1);
        let dst = RemoteLocation { window: 1, offset: 0 };
        assert_eq!(
            items,
            [
                Item::Hello { job: JOB, rank: 1, context: 3 },
                Item::PutData { dst, data: &data, last: true },
                Item::Signal { id: 0, inc: 1 },
                Item::Signal { id: 1, inc: 1 },
                Item::Bye,
            ]
        );
    }

    #[test]
    fn transport_reports_a_dead_peer() {
        // A "peer" that accepts, then dies (closes) at once.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let killer = thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            drop(s);
        });
        let (dev, _pool, mut t) = transport(addr);
        let bytes = 16 << 20;
        let src = dev.alloc::<u8>(bytes).unwrap();
        let start = Instant::now();
        let mut result = Ok(());
        for ticket in 0..8u64 {
            let payload =
                Payload::Put { src: src.addr(), src_window: 0, bytes, dst: RemoteLocation { window: 1, offset: 0 } };
            let req = Request { ring: 0, ticket, context: 0, peer: 0, payload, signal: Some((0, 1)) };
            if let Err(e) = t.submit(&req) {
                result = Err(e);
                break;
            }
        }
        killer.join().unwrap();
        if result.is_ok() {
            result = wait_done(&mut t, 8).map(|_| ());
        }
        let e = result.expect_err("writing to a dead peer fails");
        assert!(e.to_string().contains("rank 0"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(20));
        // And keeps failing.
        assert!(t.poll(&mut Vec::new()).is_err());
        let payload = Payload::None;
        assert!(t.submit(&Request { ring: 0, ticket: 9, context: 0, peer: 0, payload, signal: None }).is_err());
    }

    /// The whole path on real ranks (CPU backend): two ranks' GIN with TCP receivers, rank
    /// 1's transport putting from its window into rank 0's, then raising rank 0's signal.
    #[test]
    fn transport_delivers_into_a_ranks_window_then_its_signal() {
        let dev = Device::open_with(Backend::Cpu, 0).unwrap();
        let bytes = 6 << 20;
        let reqs = crate::DevCommRequirements::default();
        let (comms, windows, _handles) = crate::testing::virtual_job(&dev, 2, bytes, &reqs).unwrap();
        let owners = tcp_gins(&comms, 1, 2);
        let (g0, g1) = (&owners[0].0, &owners[1].0);
        let data = pattern(bytes - 4096, 5);
        windows[1].copy_from_host(0, &data).unwrap();
        let mut t = TcpTransport::new(g1).unwrap();
        let id = windows[0].dev_window().id;
        let src = windows[1].local_addr(0, data.len()).unwrap();
        let payload =
            Payload::Put { src, src_window: 0, bytes: data.len(), dst: RemoteLocation { window: id, offset: 4096 } };
        t.submit(&Request { ring: 0, ticket: 0, context: 0, peer: 0, payload, signal: Some((1, 3)) }).unwrap();
        let payload = Payload::PutValue { value: 0xdead_beef, bytes: 4, dst: RemoteLocation { window: id, offset: 8 } };
        t.submit(&Request { ring: 0, ticket: 1, context: 0, peer: 0, payload, signal: Some((1, 1)) }).unwrap();
        assert_eq!(wait_done(&mut t, 2).unwrap(), vec![(0, 0), (0, 1)]);
        // Slot [signal 1][from rank 1] of rank 0 reaches 4 once both have landed.
        let slot = (2 + 1) * 8;
        let deadline = Instant::now() + Duration::from_secs(30);
        while g0.signals.read::<u64>(slot, 1).unwrap()[0] != 4 {
            assert!(Instant::now() < deadline, "the signal never came");
            thread::yield_now();
        }
        assert_eq!(windows[0].read::<u8>(4096, data.len()).unwrap(), data);
        assert_eq!(windows[0].read::<u32>(8, 1).unwrap(), vec![0xdead_beef]);
        drop(t);
        drop(owners);
    }

    /// A rank's GIN applies a batch in order, queued and waited for once, from ordinary
    /// memory (a copy per put) and from pinned memory (the puts between signals as one batch
    /// of copies, cut where destinations overlap): the puts, the value and the signals before
    /// a refused put land, the later of two overlapping puts wins, nothing after the refused
    /// put lands, and the error names the window.
    #[test]
    fn a_ranks_batch_lands_in_order_up_to_the_first_refused_operation() {
        for pinned in [false, true] {
            let dev = Device::open_with(Backend::Cpu, 0).unwrap();
            let reqs = crate::DevCommRequirements::default();
            let (comms, windows, _handles) = crate::testing::virtual_job(&dev, 2, 1 << 20, &reqs).unwrap();
            let owners = tcp_gins(&comms, 1, 2);
            let g0 = &owners[0].0;
            let id = windows[0].dev_window().id;
            let data = pattern(3000, 9);
            let block = crate::runtime::host_mapped::HostMapped::alloc(&dev, data.len()).unwrap();
            // SAFETY: the block spans `data.len()` bytes and nothing else uses it yet.
            let host = unsafe { std::slice::from_raw_parts_mut(block.host_ptr(), data.len()) };
            host.copy_from_slice(&data);
            let (buf, buf_device): (&[u8], _) = if pinned { (host, Some(block.device_addr())) } else { (&data, None) };
            let at = |offset| RemoteLocation { window: id, offset };
            let ops = [
                Delivery::Put { dst: at(0), range: 0..1000 },
                Delivery::Put { dst: at(1000), range: 1000..3000 },
                // Overlaps the first: written after it.
                Delivery::Put { dst: at(500), range: 2000..2100 },
                Delivery::PutValue { dst: at(4096), le: 0x1234_5678u64.to_le_bytes(), bytes: 4 },
                Delivery::Signal { id: 0, inc: 2 },
                Delivery::Put { dst: at(6000), range: 0..16 },
                Delivery::Signal { id: 0, inc: 3 },
                Delivery::Put { dst: at(7000), range: 16..32 },
                Delivery::Put { dst: RemoteLocation { window: 99, offset: 0 }, range: 0..8 },
                Delivery::Put { dst: at(8192), range: 0..8 },
                Delivery::Signal { id: 1, inc: 7 },
            ];
            let err = Deliver::deliver(&**g0, 1, buf, buf_device, &ops).unwrap_err().to_string();
            assert!(err.contains("window 99"), "{err}");
            let mut want = data.clone();
            want[500..600].copy_from_slice(&data[2000..2100]);
            assert_eq!(windows[0].read::<u8>(0, 3000).unwrap(), want, "pinned {pinned}");
            assert_eq!(windows[0].read::<u32>(4096, 1).unwrap(), vec![0x1234_5678]);
            assert_eq!(windows[0].read::<u8>(6000, 16).unwrap(), data[..16]);
            assert_eq!(windows[0].read::<u8>(7000, 16).unwrap(), data[16..32], "before the refused put");
            assert_eq!(windows[0].read::<u8>(8192, 8).unwrap(), vec![0; 8], "after the refused put");
            // Slots [signal][from rank 1] of rank 0 (two ranks): signal 0 reached 5, signal 1 none.
            assert_eq!(g0.signals.read::<u64>(8, 1).unwrap(), vec![5]);
            assert_eq!(g0.signals.read::<u64>(3 * 8, 1).unwrap(), vec![0]);
            // A later batch goes on from the totals so far.
            Deliver::deliver(&**g0, 1, &[], None, &[Delivery::Signal { id: 0, inc: 1 }]).unwrap();
            assert_eq!(g0.signals.read::<u64>(8, 1).unwrap(), vec![6]);
            drop(owners);
        }
    }

    /// A rank's GIN with TCP makes all its pinned staging at creation: a full exchange both
    /// ways (large puts in chunks, batches of small puts, values, signals; two contexts)
    /// allocates and frees no pinned memory, and the connections give their blocks back when
    /// they end.
    #[test]
    fn a_tcp_gin_allocates_no_pinned_memory_after_creation() {
        let dev = Device::open_with(Backend::Cpu, 0).unwrap();
        let half = 5 << 20;
        let reqs = crate::DevCommRequirements::default();
        let (comms, windows, _handles) = crate::testing::virtual_job(&dev, 2, 2 * half + 4096, &reqs).unwrap();
        let owners = tcp_gins(&comms, 2, 1);
        // Two contexts × two peers reached by TCP (forced: the rank itself too): 12 blocks each.
        let blocks = staging_blocks(2 * 2);
        assert!(owners.iter().all(|o| o.0.kinds == [Some(crate::TransportKind::Tcp); 2]));
        let pools: Vec<Arc<StagingPool>> = owners.iter().map(|o| o.0.staging.clone().expect("a pool")).collect();
        assert!(pools.iter().all(|p| p.count() == blocks && p.block_bytes() == STAGING_BLOCK));
        let (allocs, frees) = (HostMapped::allocs(&dev), HostMapped::frees(&dev));
        // Each rank puts the first half of its window into the second half of the other's:
        // per context, a large put and then 64 small ones, a value (after both halves), and
        // the signal.
        let small = 4096;
        let data: Vec<Vec<u8>> = (0..2).map(|r| pattern(half, 11 + r as u8)).collect();
        for r in 0..2 {
            windows[r].copy_from_host(0, &data[r]).unwrap();
        }
        thread::scope(|s| {
            for r in 0..2 {
                let (gin, windows) = (&owners[r].0, &windows);
                s.spawn(move || {
                    let peer = 1 - r;
                    let id = windows[peer].dev_window().id;
                    let mut t = TcpTransport::new(gin).unwrap();
                    let mut n = 0;
                    for context in 0..2u32 {
                        let ring = context as usize * 2 + peer;
                        let mut ticket = 0;
                        let mut submit = |payload, signal| {
                            t.submit(&Request { ring, ticket, context, peer, payload, signal }).unwrap();
                            ticket += 1;
                            n += 1;
                        };
                        // Context c moves bytes [c * half / 2, (c + 1) * half / 2).
                        let (start, len) = (context as usize * half / 2, half / 2);
                        let large = len - 64 * small;
                        let src = windows[r].local_addr(start, large).unwrap();
                        let dst = RemoteLocation { window: id, offset: (half + start) as u64 };
                        submit(Payload::Put { src, src_window: 0, bytes: large, dst }, None);
                        for i in 0..64 {
                            let at = start + large + i * small;
                            let src = windows[r].local_addr(at, small).unwrap();
                            let dst = RemoteLocation { window: id, offset: (half + at) as u64 };
                            submit(Payload::Put { src, src_window: 0, bytes: small, dst }, None);
                        }
                        let dst = RemoteLocation { window: id, offset: (2 * half) as u64 + 8 * u64::from(context) };
                        submit(Payload::PutValue { value: 0xfeed_0000 + u64::from(context), bytes: 8, dst }, None);
                        submit(Payload::None, Some((0, 1)));
                    }
                    wait_done(&mut t, n).unwrap();
                });
            }
        });
        // Signal 0 from the peer reaches 2 (one per context) once everything has landed.
        for r in 0..2 {
            let slot = (1 - r) * 8;
            let deadline = Instant::now() + Duration::from_secs(30);
            while owners[r].0.signals.read::<u64>(slot, 1).unwrap()[0] != 2 {
                assert!(Instant::now() < deadline, "rank {r}: the signals never came");
                thread::yield_now();
            }
            assert_eq!(windows[r].read::<u8>(half, half).unwrap(), data[1 - r], "rank {r}");
            assert_eq!(windows[r].read::<u64>(2 * half, 2).unwrap(), vec![0xfeed_0000, 0xfeed_0001]);
        }
        assert_eq!(
            (HostMapped::allocs(&dev), HostMapped::frees(&dev)),
            (allocs, frees),
            "pinned memory after creation"
        );
        // The transports are gone: their connections end and every block goes back.
        for p in &pools {
            wait_pool_full(p);
        }
        assert_eq!((HostMapped::allocs(&dev), HostMapped::frees(&dev)), (allocs, frees));
        // The pools are freed with the ranks' GIN.
        drop(pools);
        drop(owners);
        let deadline = Instant::now() + Duration::from_secs(30);
        while HostMapped::frees(&dev) < frees + 2 * blocks {
            assert!(Instant::now() < deadline, "the pools were not freed");
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// A [`Deliver`] that copies puts into memory (as a device write would) and counts
    /// signals.
    struct Sink {
        mem: Mutex<Vec<u8>>,
        signals: Mutex<u64>,
        cv: Condvar,
    }

    impl Deliver for Sink {
        fn fail(&self, why: String) {
            panic!("{why}");
        }
        fn put(&self, _from: usize, dst: RemoteLocation, data: &[u8]) -> Result<()> {
            let mut m = lock(&self.mem);
            let o = dst.offset as usize;
            m[o..o + data.len()].copy_from_slice(data);
            Ok(())
        }
        fn put_value(&self, _: usize, _: RemoteLocation, _: u64, _: u32) -> Result<()> {
            Ok(())
        }
        fn signal(&self, _from: usize, _id: u32, inc: u64) -> Result<()> {
            *lock(&self.signals) += inc;
            self.cv.notify_all();
            Ok(())
        }
        fn peer_lost(&self, _from: usize, _why: String) {}
    }

    /// Throughput of puts through the transport (CPU backend: staging and delivery are host
    /// copies, which real devices do by DMA) against a plain TCP copy of the same bytes
    /// between two threads, each after a warm-up. Run with
    /// `cargo test --release -p ferrolink --lib tcp::tests::throughput -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement"]
    fn throughput_against_plain_tcp() {
        let dev = Device::open_with(Backend::Cpu, 0).unwrap();
        for size in [4usize << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20] {
            let count = ((1usize << 30) / size).max(4);
            // Plain: one thread writes `count` messages of `size`, the other reads them.
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let reader = thread::spawn(move || {
                let (mut s, _) = listener.accept().unwrap();
                let mut buf = vec![0u8; size.min(RECV_MAX)];
                let mut left = size * (count + 1);
                while left > 0 {
                    let n = s.read(&mut buf).unwrap();
                    assert!(n > 0);
                    left -= n;
                }
            });
            let src = vec![1u8; size];
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_nodelay(true).unwrap();
            s.write_all(&src).unwrap();
            let start = Instant::now();
            for _ in 0..count {
                s.write_all(&src).unwrap();
            }
            reader.join().unwrap();
            let plain = (size * count) as f64 / start.elapsed().as_secs_f64() / 1e9;
            // Through the transport: puts of `size` with a signal each, at most 64 in flight.
            let sink = Arc::new(Sink { mem: Mutex::new(vec![1u8; size]), signals: Mutex::new(0), cv: Condvar::new() });
            let d: Weak<dyn Deliver> = Arc::downgrade(&(sink.clone() as Arc<dyn Deliver>));
            let (_rx, addr) = TcpReceiver::start(JOB, 0, d).unwrap();
            let pool = pool(&dev, 2);
            let mut t = TcpTransport::with_peers(Arc::downgrade(&pool), JOB, 1, vec![Some(addr), None]);
            let buf = dev.alloc_from(&src).unwrap();
            let mut done = Vec::new();
            let mut start = Instant::now();
            for i in 0..=count {
                let payload = Payload::Put {
                    src: buf.addr(),
                    src_window: 0,
                    bytes: size,
                    dst: RemoteLocation { window: 0, offset: 0 },
                };
                let signal = Some((0, 1));
                t.submit(&Request { ring: 0, ticket: i as u64, context: 0, peer: 0, payload, signal }).unwrap();
                while t.in_flight() >= if i == 0 { 1 } else { 64 } {
                    t.poll_wait(&mut done, Duration::from_secs(10)).unwrap();
                }
                if i == 0 {
                    let signals = lock(&sink.signals);
                    drop(sink.cv.wait_while(signals, |s| *s < 1).unwrap());
                    start = Instant::now();
                }
            }
            let signals = lock(&sink.signals);
            drop(sink.cv.wait_while(signals, |s| *s < count as u64 + 1).unwrap());
            let gin = (size * count) as f64 / start.elapsed().as_secs_f64() / 1e9;
            println!(
                "{size:>10} B x {count:>6}: plain TCP {plain:6.2} GB/s, GIN TCP {gin:6.2} GB/s ({:.2}x)",
                gin / plain
            );
        }
    }

    #[test]
    fn transport_refuses_a_peer_without_a_receiver() {
        let (_dev, _pool, mut t) = transport("127.0.0.1:1".parse().unwrap());
        let req = Request { ring: 1, ticket: 0, context: 0, peer: 1, payload: Payload::None, signal: Some((0, 1)) };
        let e = t.submit(&req).unwrap_err();
        assert!(e.to_string().contains("rank 1 has no GIN TCP receiver"), "{e}");
    }
}
