//! File-descriptor exchange between the processes of one machine: how a rank hands another
//! rank the fd of a memory allocation (a CUDA VMM allocation exported as a POSIX fd, or the
//! emulator's memfd) so that the peer can map it into its window.
//!
//! Each rank's [`FdExchange`] listens on a Linux *abstract* Unix stream socket named
//! `ferrolink-<job as 16 hex digits>-<rank>` (no file to create or clean up; the name goes
//! away with the socket). [`FdExchange::send_fd`] connects to the peer's socket, checks with
//! `SO_PEERCRED` that it belongs to this user, and sends a 28-byte header
//! (`"FLFD"`, job, sender's rank, key; little-endian) with the fd as `SCM_RIGHTS` ancillary
//! data, then waits for a one-byte ack. The listener's accept thread refuses connections of
//! other users (`SO_PEERCRED`), and headers of another job or of a bad magic, with a warning
//! on the `ferrolink::comm` target; the exchange goes on. [`FdExchange::recv_fd`] takes the fd
//! stored under `(from rank, key)`, waiting for it up to the exchange's timeout.
//!
//! # Who owns each fd, and when
//!
//! * **Sender.** The fd is only borrowed for the `sendmsg` call: the kernel takes its own
//!   reference to the open file at that moment and keeps it while the message is in flight,
//!   so the caller may close its fd as soon as [`FdExchange::send_fd`] returns, whatever it
//!   returns.
//! * **Receiver.** `recvmsg` installs the passed fds in this process with `MSG_CMSG_CLOEXEC`
//!   (a child process never inherits them), and each is wrapped in an [`OwnedFd`] right
//!   there, before the header is even looked at. From then on Rust closes each exactly once on
//!   every path: a refused message drops them, extra fds beyond the first are dropped, and the
//!   one kept is moved into the exchange's map. The control buffer has room for the kernel's
//!   maximum of fds per message (`SCM_MAX_FD`), so the kernel never truncates it (a truncated
//!   buffer could not be read, and its fds would leak). A connection that dies with a message
//!   unread leaves the fds to the kernel, which closes them.
//! * **The map** owns the fds until [`FdExchange::recv_fd`] moves one out to its caller;
//!   dropping the exchange closes the ones never claimed.
//! * **Ordering.** The receiver writes the ack and then puts the fd into the map, both under
//!   the map's lock; an fd whose ack could not be written is closed instead. So when
//!   `send_fd` returns `Ok` the receiver holds the fd (and with it the memory) and a
//!   `recv_fd` for it succeeds without waiting; and a `recv_fd` returns an fd only once its
//!   ack is in the sender's socket, where it stays even if the receiver drops its exchange or
//!   exits at once. An `Err` from `send_fd`
//!   (a timeout racing the ack) does not say whether the fd arrived.
//! * **Teardown.** Dropping the exchange raises a stop flag and connects to its own socket to
//!   wake the accept thread, which shuts down the connections still being read (waking their
//!   handler threads), joins them and closes the listener: after the drop no thread of the
//!   exchange runs and its socket name is free again.

use crate::{Error, Result};
use nix::errno::Errno;
use nix::sys::socket::sockopt::PeerCredentials;
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, UnixCredentials, getsockopt, recvmsg, sendmsg,
};
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::io::{IoSlice, IoSliceMut, Read};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The first bytes of every message.
const MAGIC: [u8; 4] = *b"FLFD";
/// Magic, job, sender's rank, key.
const HEADER_LEN: usize = 4 + 8 + 8 + 8;
/// The kernel's limit on fds in one `SCM_RIGHTS` message (`SCM_MAX_FD`).
const SCM_MAX_FD: usize = 253;
/// The ack byte: the fd is stored.
const ACK_STORED: u8 = 1;
/// The ack byte: refused, an fd from this sender under this key waits unclaimed already.
const ACK_DUPLICATE: u8 = 2;

/// The abstract socket name of a rank of a job.
fn socket_name(job: u64, rank: usize) -> String {
    format!("ferrolink-{job:016x}-{rank}")
}

fn socket_addr(job: u64, rank: usize) -> std::io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(socket_name(job, rank).as_bytes())
}

/// A decoded message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    job: u64,
    from: u64,
    key: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..12].copy_from_slice(&self.job.to_le_bytes());
        b[12..20].copy_from_slice(&self.from.to_le_bytes());
        b[20..28].copy_from_slice(&self.key.to_le_bytes());
        b
    }

    /// The header, or why it is not one.
    fn decode(b: &[u8; HEADER_LEN]) -> std::result::Result<Header, String> {
        if b[..4] != MAGIC {
            return Err(format!("bad magic {:02x?} (not a ferrolink fd exchange)", &b[..4]));
        }
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Ok(Header { job: word(4), from: word(12), key: word(20) })
    }
}

/// What the exchange's threads share.
struct Shared {
    job: u64,
    rank: usize,
    timeout: Duration,
    /// This process's user: the only one whose connections are accepted.
    uid: u32,
    stop: AtomicBool,
    /// Received fds not yet claimed, by (sender's rank, key).
    fds: Mutex<HashMap<(usize, u64), OwnedFd>>,
    arrived: Condvar,
}

impl Shared {
    fn fds(&self) -> MutexGuard<'_, HashMap<(usize, u64), OwnedFd>> {
        self.fds.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One rank's end of the fd exchange of a job on this machine (see the [module](self) docs).
///
/// Create one per rank and process; ranks of one job must share `job` (e.g. the unique id's
/// magic), and one `(job, rank)` may exist only once per machine at a time.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::comm::fdpass::FdExchange;
/// use std::io::{Read, Write};
/// use std::os::fd::AsFd;
/// use std::time::Duration;
/// // Two ranks of one job: normally two processes of one machine, here one.
/// let job = u64::from(std::process::id()) << 8 | 1;
/// let r0 = FdExchange::new(job, 0, Duration::from_secs(10))?;
/// let r1 = FdExchange::new(job, 1, Duration::from_secs(10))?;
/// let (reader, mut writer) = std::io::pipe().unwrap();
/// r0.send_fd(1, 7, reader.as_fd())?;
/// drop(reader); // rank 1 holds the pipe's read end now
/// let reader = r1.recv_fd(0, 7)?;
/// writer.write_all(b"hello rank 1").unwrap();
/// drop(writer);
/// let mut got = String::new();
/// std::fs::File::from(reader).read_to_string(&mut got).unwrap();
/// assert_eq!(got, "hello rank 1");
/// # Ok(()) }
/// ```
pub struct FdExchange {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept_thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for FdExchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdExchange")
            .field("job", &format_args!("{:016x}", self.shared.job))
            .field("rank", &self.shared.rank)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

impl FdExchange {
    /// Listens as rank `rank` of job `job` (on the abstract socket
    /// `ferrolink-<job as 16 hex digits>-<rank>`) and starts the thread that accepts peers.
    /// `timeout` bounds every wait of [`FdExchange::send_fd`] and [`FdExchange::recv_fd`].
    ///
    /// Fails with [`Error::Bootstrap`] when that name is taken (this rank exists already on
    /// this machine, in this process or another).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::comm::fdpass::FdExchange;
    /// # use std::time::Duration;
    /// let job = u64::from(std::process::id()) << 8 | 2;
    /// let rank0 = FdExchange::new(job, 0, Duration::from_secs(1))?;
    /// let err = FdExchange::new(job, 0, Duration::from_secs(1)).unwrap_err();
    /// assert!(err.to_string().contains("exists already"), "{err}");
    /// drop(rank0);
    /// assert!(FdExchange::new(job, 0, Duration::from_secs(1)).is_ok(), "the name is free again");
    /// # Ok(()) }
    /// ```
    pub fn new(job: u64, rank: usize, timeout: Duration) -> Result<FdExchange> {
        let name = socket_name(job, rank);
        let fail = |what: &str, e: std::io::Error| {
            Error::Bootstrap(format!("fd exchange: rank {rank} could not {what} the abstract socket `{name}`: {e}"))
        };
        let addr = socket_addr(job, rank).map_err(|e| fail("name", e))?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                Error::Bootstrap(format!(
                    "fd exchange: the abstract socket `{name}` is taken: rank {rank} of job {job:016x} exists already \
                     on this machine (a duplicate rank, or a job id used twice)"
                ))
            } else {
                fail("listen on", e)
            }
        })?;
        let shared = Arc::new(Shared {
            job,
            rank,
            timeout,
            uid: UnixCredentials::new().uid(),
            stop: AtomicBool::new(false),
            fds: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        });
        let accept_shared = shared.clone();
        let accept_thread = std::thread::Builder::new()
            .name(format!("ferrolink-fdpass-{rank}"))
            .spawn(move || accept_loop(&accept_shared, listener))
            .map_err(|e| fail("start the accept thread of", e))?;
        tracing::debug!(target: "ferrolink::comm", job = %format_args!("{job:016x}"), rank, "fd exchange listening on `{name}`");
        Ok(FdExchange { shared, addr, accept_thread: Some(accept_thread) })
    }

    /// This rank.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::comm::fdpass::FdExchange;
    /// # use std::time::Duration;
    /// let ex = FdExchange::new(u64::from(std::process::id()) << 8 | 3, 2, Duration::from_secs(1))?;
    /// assert_eq!(ex.rank(), 2);
    /// # Ok(()) }
    /// ```
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The job.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::comm::fdpass::FdExchange;
    /// # use std::time::Duration;
    /// let job = u64::from(std::process::id()) << 8 | 4;
    /// assert_eq!(FdExchange::new(job, 0, Duration::from_secs(1))?.job(), job);
    /// # Ok(()) }
    /// ```
    pub fn job(&self) -> u64 {
        self.shared.job
    }

    /// The limit of every wait.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::comm::fdpass::FdExchange;
    /// # use std::time::Duration;
    /// let ex = FdExchange::new(u64::from(std::process::id()) << 8 | 5, 0, Duration::from_secs(3))?;
    /// assert_eq!(ex.timeout(), Duration::from_secs(3));
    /// # Ok(()) }
    /// ```
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Sends `fd` to rank `to_rank` under `key` (the receiver asks for it with
    /// `recv_fd(this rank, key)`), and waits until it holds it. Connecting is retried until
    /// the timeout, since the peer may not listen yet. `fd` may be closed as soon as this
    /// returns.
    ///
    /// Fails with [`Error::Bootstrap`] naming both ranks and the key when the peer does not
    /// listen within the timeout, its socket belongs to another user, it refuses the message
    /// (another job; or an fd from this rank under this key is still unclaimed there), or it
    /// does not ack within the timeout. After an error the fd may or may not have arrived.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::comm::fdpass::FdExchange;
    /// # use std::time::Duration;
    /// # use std::os::fd::AsFd;
    /// let ex = FdExchange::new(u64::from(std::process::id()) << 8 | 6, 0, Duration::from_millis(20))?;
    /// let (reader, _writer) = std::io::pipe().unwrap();
    /// // No rank 1 listens: the send gives up after the timeout.
    /// let err = ex.send_fd(1, 7, reader.as_fd()).unwrap_err();
    /// assert!(err.to_string().contains("rank 1 did not listen"), "{err}");
    /// # Ok(()) }
    /// ```
    pub fn send_fd(&self, to_rank: usize, key: u64, fd: BorrowedFd<'_>) -> Result<()> {
        let s = &self.shared;
        let fail = |why: String| {
            Error::Bootstrap(format!(
                "fd exchange of job {:016x}: rank {} could not send key {key:#x} to rank {to_rank}: {why}",
                s.job, s.rank
            ))
        };
        let deadline = Instant::now() + s.timeout;
        let addr = socket_addr(s.job, to_rank).map_err(|e| fail(format!("bad socket name: {e}")))?;
        let mut pause = Duration::from_millis(1);
        let stream = loop {
            match UnixStream::connect_addr(&addr) {
                Ok(stream) => break stream,
                Err(e) if is_retryable(&e) && Instant::now() < deadline => {
                    std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err(e) => {
                    return Err(fail(format!(
                        "rank {to_rank} did not listen within {:?} (last error: {e}); is it running, with the same \
                         job id?",
                        s.timeout
                    )));
                }
            }
        };
        let peer = getsockopt(&stream, PeerCredentials).map_err(|e| fail(format!("SO_PEERCRED failed: {e}")))?;
        if peer.uid() != s.uid {
            return Err(fail(format!(
                "its socket belongs to process {} of uid {}, not to this user (uid {}): not sending an fd to it",
                peer.pid(),
                peer.uid(),
                s.uid
            )));
        }
        let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        stream
            .set_write_timeout(Some(remaining))
            .and_then(|()| stream.set_read_timeout(Some(remaining)))
            .map_err(|e| fail(format!("could not set the socket's timeouts: {e}")))?;
        let header = Header { job: s.job, from: s.rank as u64, key }.encode();
        send_all(&stream, &header, &[fd.as_raw_fd()]).map_err(|e| fail(format!("sendmsg failed: {e}")))?;
        let mut ack = [0u8; 1];
        match (&stream).read(&mut ack) {
            Ok(1) if ack[0] == ACK_STORED => Ok(()),
            Ok(1) if ack[0] == ACK_DUPLICATE => {
                Err(fail(format!("rank {to_rank} still holds an unclaimed fd from rank {} under this key", s.rank)))
            }
            Ok(1) => Err(fail(format!("rank {to_rank} answered {:#04x}, not an ack", ack[0]))),
            Ok(_) => Err(fail(format!(
                "rank {to_rank} closed the connection without an ack: it refused the message (see its log: \
                 another job or user?)"
            ))),
            Err(e) if is_timeout(&e) => Err(fail(format!("rank {to_rank} did not ack within {:?}", s.timeout))),
            Err(e) => Err(fail(format!("reading the ack failed: {e}"))),
        }
    }

    /// The fd rank `from_rank` sent under `key`, waiting for it up to the timeout. Each sent fd
    /// is returned once; the caller owns it.
    ///
    /// Fails with [`Error::Bootstrap`] naming the rank and the key when it has not arrived
    /// within the timeout.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::comm::fdpass::FdExchange;
    /// # use std::time::Duration;
    /// # use std::os::fd::AsFd;
    /// # let job = u64::from(std::process::id()) << 8 | 7;
    /// let r0 = FdExchange::new(job, 0, Duration::from_secs(10))?;
    /// let r1 = FdExchange::new(job, 1, Duration::from_millis(50))?;
    /// let (reader, _writer) = std::io::pipe().unwrap();
    /// r0.send_fd(1, 9, reader.as_fd())?;
    /// let _fd = r1.recv_fd(0, 9)?; // arrived: no wait
    /// assert!(r1.recv_fd(0, 9).is_err(), "each fd is returned once");
    /// # Ok(()) }
    /// ```
    pub fn recv_fd(&self, from_rank: usize, key: u64) -> Result<OwnedFd> {
        let s = &self.shared;
        let deadline = Instant::now() + s.timeout;
        let mut fds = s.fds();
        loop {
            if let Some(fd) = fds.remove(&(from_rank, key)) {
                return Ok(fd);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Bootstrap(format!(
                    "fd exchange of job {:016x}: rank {} received no fd from rank {from_rank} under key {key:#x} \
                     within {:?} (rank {from_rank} never sent it, or sent it under another key)",
                    s.job, s.rank, s.timeout
                )));
            }
            fds = s.arrived.wait_timeout(fds, deadline - now).unwrap_or_else(PoisonError::into_inner).0;
        }
    }
}

impl Drop for FdExchange {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let Some(thread) = self.accept_thread.take() else { return };
        // The accept thread checks the flag after each accept: one connection wakes it.
        match UnixStream::connect_addr(&self.addr) {
            Ok(_wake) => {
                if thread.join().is_err() {
                    tracing::warn!(target: "ferrolink::comm", rank = self.shared.rank, "fd exchange: the accept thread panicked");
                }
            }
            Err(e) => tracing::warn!(
                target: "ferrolink::comm",
                rank = self.shared.rank,
                "fd exchange: could not wake the accept thread to stop it ({e}); it stays until its next connection"
            ),
        }
    }
}

fn is_retryable(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    // ECONNREFUSED: nobody listens on the name (yet); EAGAIN: its backlog is full.
    matches!(e.kind(), ConnectionRefused | NotFound | WouldBlock | Interrupted)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
}

/// Sends all of `bytes`, with `fds` attached to the first chunk.
fn send_all(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        let rights = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage<'_>] = if sent == 0 && !fds.is_empty() { &rights } else { &[] };
        match sendmsg::<UnixAddr>(
            stream.as_raw_fd(),
            &[IoSlice::new(&bytes[sent..])],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads one message: the header and every fd attached to it, each already owned.
fn recv_message(stream: &UnixStream) -> std::result::Result<([u8; HEADER_LEN], Vec<OwnedFd>), String> {
    let mut header = [0u8; HEADER_LEN];
    let mut cmsg_buf = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
    let mut fds = Vec::new();
    let (got, truncated) = loop {
        let mut iov = [IoSliceMut::new(&mut header)];
        match recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut cmsg_buf), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let truncated = match msg.cmsgs() {
                    Ok(cmsgs) => {
                        for cmsg in cmsgs {
                            if let ControlMessageOwned::ScmRights(raw) = cmsg {
                                fds.extend(raw.into_iter().map(|fd| {
                                    // SAFETY: recvmsg has just installed `fd` in this process
                                    // for us (SCM_RIGHTS); nothing else knows it, so this is its
                                    // only owner and it is closed exactly once, when dropped.
                                    unsafe { OwnedFd::from_raw_fd(fd) }
                                }));
                            }
                        }
                        false
                    }
                    Err(_) => true,
                };
                break (msg.bytes, truncated);
            }
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => return Err("it sent nothing within the timeout".into()),
            Err(e) => return Err(format!("recvmsg failed: {e}")),
        }
    };
    if truncated {
        // Cannot happen: the buffer holds SCM_MAX_FD fds, the most one message carries.
        return Err("its control data was truncated".into());
    }
    if got == 0 {
        return Err("it closed the connection without sending a header".into());
    }
    (&*stream).read_exact(&mut header[got..]).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            format!("it sent a short header ({got} of {HEADER_LEN} bytes at least) and closed the connection")
        } else {
            format!("reading the rest of its header failed: {e}")
        }
    })?;
    Ok((header, fds))
}

/// The accept thread: checks each peer's user, then reads its message on a thread of its own
/// (a slow peer holds up no one else). Stops when the stop flag is up; then wakes and joins
/// the handlers still reading.
fn accept_loop(shared: &Arc<Shared>, listener: UnixListener) {
    let mut handlers: Vec<(UnixStream, JoinHandle<()>)> = Vec::new();
    loop {
        let conn = listener.accept();
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let stream = match conn {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Out of fds or memory: let it pass rather than spin.
                tracing::warn!(target: "ferrolink::comm", rank = shared.rank, "fd exchange: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        handlers.retain(|(_, h)| !h.is_finished());
        match getsockopt(&stream, PeerCredentials) {
            Ok(peer) if peer.uid() == shared.uid => {}
            Ok(peer) => {
                tracing::warn!(
                    target: "ferrolink::comm",
                    rank = shared.rank,
                    "fd exchange: refused a connection from process {} of uid {} (only uid {} may connect)",
                    peer.pid(),
                    peer.uid(),
                    shared.uid
                );
                continue;
            }
            Err(e) => {
                tracing::warn!(target: "ferrolink::comm", rank = shared.rank, "fd exchange: refused a connection: SO_PEERCRED failed: {e}");
                continue;
            }
        }
        let waker = match stream.try_clone() {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(target: "ferrolink::comm", rank = shared.rank, "fd exchange: dropped a connection: {e}");
                continue;
            }
        };
        let handler_shared = shared.clone();
        match std::thread::Builder::new()
            .name(format!("ferrolink-fdpass-{}-conn", shared.rank))
            .spawn(move || handle_connection(&handler_shared, stream))
        {
            Ok(h) => handlers.push((waker, h)),
            Err(e) => {
                tracing::warn!(target: "ferrolink::comm", rank = shared.rank, "fd exchange: dropped a connection: no thread for it: {e}")
            }
        }
    }
    for (waker, _) in &handlers {
        let _ = waker.shutdown(Shutdown::Both);
    }
    for (_, h) in handlers {
        let _ = h.join();
    }
}

/// Reads one peer's message, stores its fd and acks; or refuses it with a warning.
fn handle_connection(shared: &Shared, stream: UnixStream) {
    let peer_pid = getsockopt(&stream, PeerCredentials).map_or(0, |c| c.pid());
    let result = receive_into_map(shared, &stream);
    // The accept thread holds a duplicate of this socket (to wake us on drop): closing ours
    // alone would not end the connection, so the peer would wait for a refusal's EOF.
    let _ = stream.shutdown(Shutdown::Both);
    if let Err(why) = result
        && !shared.stop.load(Ordering::SeqCst)
    {
        tracing::warn!(
                target: "ferrolink::comm",
                rank = shared.rank,
                "fd exchange of job {:016x}: refused a message from process {peer_pid}: {why}",
                shared.job
        );
    }
}

fn receive_into_map(shared: &Shared, stream: &UnixStream) -> std::result::Result<(), String> {
    stream
        .set_read_timeout(Some(shared.timeout))
        .and_then(|()| stream.set_write_timeout(Some(shared.timeout)))
        .map_err(|e| format!("could not set the socket's timeouts: {e}"))?;
    // Every fd it sent is owned from here on: an early return closes them.
    let (bytes, mut fds) = recv_message(stream)?;
    let header = Header::decode(&bytes)?;
    if header.job != shared.job {
        return Err(format!("it belongs to job {:016x}, not {:016x}", header.job, shared.job));
    }
    let Ok(from) = usize::try_from(header.from) else {
        return Err(format!("impossible sender rank {}", header.from));
    };
    if fds.is_empty() {
        return Err(format!("rank {from}'s message for key {:#x} carried no fd", header.key));
    }
    if fds.len() > 1 {
        tracing::warn!(
            target: "ferrolink::comm",
            rank = shared.rank,
            "fd exchange: rank {from} sent {} fds under key {:#x}; keeping the first, closing the others",
            fds.len(),
            header.key
        );
        fds.truncate(1);
    }
    let fd = fds.pop().expect("one fd");
    // The ack goes out before the fd enters the map, under the map's lock: once a recv_fd can
    // return the fd, its ack already sits in the sender's socket, where it stays even if this
    // process drops the exchange or exits right after. (A one-byte write into a socket whose
    // peer only waits for it does not block.)
    let mut fds = shared.fds();
    let slot = match fds.entry((from, header.key)) {
        Entry::Occupied(_) => {
            tracing::warn!(
                target: "ferrolink::comm",
                rank = shared.rank,
                "fd exchange: rank {from} sent key {:#x} again while the first fd is unclaimed; refused",
                header.key
            );
            let _ = send_all(stream, &[ACK_DUPLICATE], &[]);
            return Ok(());
        }
        Entry::Vacant(slot) => slot,
    };
    // Not acked, not kept: the sender sees an error, and the fd is closed here.
    send_all(stream, &[ACK_STORED], &[]).map_err(|e| format!("could not ack key {:#x}: {e}", header.key))?;
    slot.insert(fd);
    drop(fds);
    shared.arrived.notify_all();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    const T: Duration = Duration::from_secs(10);

    /// A job id no other test (or test process) on this machine uses.
    fn job() -> u64 {
        getrandom::u64().expect("OS randomness")
    }

    /// An anonymous in-memory file holding `bytes`.
    fn memfd(bytes: &[u8]) -> File {
        // SAFETY: the name is a NUL-terminated string that outlives the call; memfd_create
        // returns a new fd or -1 and touches no memory of ours.
        let raw = unsafe { libc::memfd_create(c"ferrolink-fdpass-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a new fd that nothing else owns.
        let mut f = unsafe { File::from_raw_fd(raw) };
        f.write_all(bytes).unwrap();
        f
    }

    fn contents(fd: OwnedFd, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        File::from(fd).read_exact_at(&mut buf, 0).unwrap();
        buf
    }

    /// Connects to rank `rank` of `job` and sends a raw message; the ack byte, or `None` when
    /// the peer closed the connection without one.
    fn raw_send(job: u64, rank: usize, bytes: &[u8], fds: &[RawFd]) -> Option<u8> {
        let stream = UnixStream::connect_addr(&socket_addr(job, rank).unwrap()).unwrap();
        stream.set_read_timeout(Some(T)).unwrap();
        send_all(&stream, bytes, fds).unwrap();
        stream.shutdown(Shutdown::Write).unwrap();
        let mut ack = [0u8; 1];
        match (&stream).read(&mut ack).unwrap() {
            0 => None,
            _ => Some(ack[0]),
        }
    }

    /// Whether the other end of `probe` (sent away and dropped here) is closed everywhere.
    fn peer_closed(probe: &UnixStream) -> bool {
        probe.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        matches!((&*probe).read(&mut [0u8; 1]), Ok(0))
    }

    #[test]
    fn passes_a_memfd_between_two_ranks() {
        let job = job();
        let r0 = FdExchange::new(job, 0, T).unwrap();
        let r1 = FdExchange::new(job, 1, T).unwrap();
        let f = memfd(b"hello rank 1");
        r0.send_fd(1, 7, f.as_fd()).unwrap();
        drop(f);
        let got = r1.recv_fd(0, 7).unwrap();
        assert_eq!(contents(got, 12), b"hello rank 1");
        // Writes through the received fd reach the same file: a pipe, the other way round.
        let (reader, mut writer) = std::io::pipe().unwrap();
        r1.send_fd(0, 8, reader.as_fd()).unwrap();
        drop(reader);
        let reader = r0.recv_fd(1, 8).unwrap();
        writer.write_all(b"through the pipe").unwrap();
        drop(writer);
        let mut s = String::new();
        File::from(reader).read_to_string(&mut s).unwrap();
        assert_eq!(s, "through the pipe");
    }

    #[test]
    fn strangers_are_refused_and_their_fds_closed() {
        let job = job();
        let r0 = FdExchange::new(job, 0, T).unwrap();
        let r1 = FdExchange::new(job, 1, T).unwrap();

        // Another job's header: no ack, and the fd it carried is closed on the receiver.
        let (probe, sent) = UnixStream::pair().unwrap();
        let wrong = Header { job: job ^ 1, from: 1, key: 3 }.encode();
        assert_eq!(raw_send(job, 0, &wrong, &[sent.as_raw_fd()]), None);
        drop(sent);
        assert!(peer_closed(&probe), "the refused fd was not closed");

        // A bad magic, a short header, and a message without an fd: refused the same way.
        let mut bad = Header { job, from: 1, key: 3 }.encode();
        bad[0] = b'X';
        let f = memfd(b"x");
        assert_eq!(raw_send(job, 0, &bad, &[f.as_raw_fd()]), None);
        assert_eq!(raw_send(job, 0, b"FLF", &[f.as_raw_fd()]), None);
        assert_eq!(raw_send(job, 0, &Header { job, from: 1, key: 3 }.encode(), &[]), None);

        // Extra fds: the first is kept, the others closed.
        let (probe, extra) = UnixStream::pair().unwrap();
        let good = Header { job, from: 1, key: 4 }.encode();
        assert_eq!(raw_send(job, 0, &good, &[f.as_raw_fd(), extra.as_raw_fd()]), Some(ACK_STORED));
        drop(extra);
        assert!(peer_closed(&probe), "the extra fd was not closed");
        assert_eq!(contents(r0.recv_fd(1, 4).unwrap(), 1), b"x");

        // Nothing of it arrived, and the exchange still works.
        assert!(r0.shared.fds().is_empty());
        r1.send_fd(0, 3, f.as_fd()).unwrap();
        assert_eq!(contents(r0.recv_fd(1, 3).unwrap(), 1), b"x");
    }

    #[test]
    fn a_key_never_sent_times_out_naming_rank_and_key() {
        let job = job();
        let r0 = FdExchange::new(job, 0, Duration::from_millis(200)).unwrap();
        let start = Instant::now();
        let e = r0.recv_fd(1, 0xbeef).unwrap_err();
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(200) && took < Duration::from_secs(3), "{took:?}");
        let msg = e.to_string();
        assert!(matches!(e, Error::Bootstrap(_)), "{msg}");
        assert!(msg.contains("from rank 1") && msg.contains("key 0xbeef"), "{msg}");

        // Sending to a rank that never listens fails the same way.
        let f = memfd(b"");
        let start = Instant::now();
        let msg = r0.send_fd(5, 0xabc, f.as_fd()).unwrap_err().to_string();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(msg.contains("to rank 5") && msg.contains("key 0xabc") && msg.contains("did not listen"), "{msg}");
    }

    #[test]
    fn duplicates_and_names_in_use_are_refused() {
        let job = job();
        let r0 = FdExchange::new(job, 0, T).unwrap();
        let r1 = FdExchange::new(job, 1, T).unwrap();
        assert!(FdExchange::new(job, 1, T).unwrap_err().to_string().contains("exists already"));
        let f = memfd(b"1");
        r0.send_fd(1, 9, f.as_fd()).unwrap();
        let msg = r0.send_fd(1, 9, f.as_fd()).unwrap_err().to_string();
        assert!(msg.contains("unclaimed"), "{msg}");
        drop(r1.recv_fd(0, 9).unwrap());
        // Claimed: the key may be used again.
        r0.send_fd(1, 9, f.as_fd()).unwrap();
        drop(r1.recv_fd(0, 9).unwrap());
    }

    #[test]
    fn drop_stops_promptly_and_frees_the_name() {
        let job = job();
        let r0 = FdExchange::new(job, 0, T).unwrap();
        let (probe, unclaimed) = UnixStream::pair().unwrap();
        FdExchange::new(job, 1, T).unwrap().send_fd(0, 1, unclaimed.as_fd()).unwrap();
        drop(unclaimed);
        // A peer that connects and says nothing keeps a handler thread reading.
        let _silent = UnixStream::connect_addr(&socket_addr(job, 0).unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        drop(r0);
        assert!(start.elapsed() < Duration::from_secs(2), "drop took {:?}", start.elapsed());
        assert!(peer_closed(&probe), "the unclaimed fd was not closed");
        FdExchange::new(job, 0, T).unwrap();
    }

    #[test]
    fn many_keys_both_ways_concurrently() {
        const KEYS: u64 = 64;
        let job = job();
        let ex = [FdExchange::new(job, 0, T).unwrap(), FdExchange::new(job, 1, T).unwrap()];
        std::thread::scope(|scope| {
            for me in 0..2 {
                let ex = &ex;
                for part in 0..4 {
                    scope.spawn(move || {
                        for key in (part..KEYS).step_by(4) {
                            let f = memfd(&[me as u8, key as u8]);
                            ex[me].send_fd(1 - me, key, f.as_fd()).unwrap();
                        }
                    });
                    scope.spawn(move || {
                        for key in (part..KEYS).step_by(4).collect::<Vec<_>>().into_iter().rev() {
                            let from = 1 - me;
                            assert_eq!(contents(ex[me].recv_fd(from, key).unwrap(), 2), [from as u8, key as u8]);
                        }
                    });
                }
            }
        });
        assert!(ex.iter().all(|e| e.shared.fds().is_empty()));
    }

    /// Set in the child process of [`cross_process`]: the job id, in hex.
    const CHILD_ENV: &str = "FERROLINK_FDPASS_TEST_CHILD";

    #[test]
    fn cross_process() {
        if let Ok(job) = std::env::var(CHILD_ENV) {
            // The child: rank 1.
            let job = u64::from_str_radix(&job, 16).unwrap();
            let ex = FdExchange::new(job, 1, T).unwrap();
            let shared = File::from(ex.recv_fd(0, 2).unwrap());
            shared.write_all_at(format!("child {}", std::process::id()).as_bytes(), 0).unwrap();
            let mine = memfd(format!("memfd of pid {:>10}", std::process::id()).as_bytes());
            ex.send_fd(0, 1, mine.as_fd()).unwrap();
            return;
        }
        let job = job();
        let ex = FdExchange::new(job, 0, T).unwrap();
        let name = format!("{}::cross_process", module_path!().split_once("::").unwrap().1);
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, format!("{job:x}"))
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let shared = memfd(&[0u8; 32]);
        let sent = ex.send_fd(1, 2, shared.as_fd());
        let got = ex.recv_fd(1, 1);
        let status = child.wait().unwrap();
        sent.unwrap();
        let got = got.unwrap();
        assert!(status.success(), "child: {status}");
        let pid = child.id();
        assert_ne!(pid, std::process::id());
        // The child's memfd, read here; and the child's write into ours, seen here.
        let want = format!("memfd of pid {pid:>10}");
        assert_eq!(contents(got, want.len()), want.as_bytes());
        let want = format!("child {pid}");
        let mut buf = vec![0u8; want.len()];
        shared.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, want.as_bytes());
    }

    #[test]
    fn header_round_trips() {
        let h = Header { job: 0x0123_4567_89ab_cdef, from: 3, key: u64::MAX };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[3] = 0;
        assert!(Header::decode(&b).unwrap_err().contains("bad magic"));
        assert_eq!(socket_name(0xab, 12), "ferrolink-00000000000000ab-12");
    }
}
