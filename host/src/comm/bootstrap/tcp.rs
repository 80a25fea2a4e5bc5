//! The TCP bootstrap: one rank per process, on any machines, from a [`UniqueId`].
//!
//! * Every rank listens on an ephemeral port of the local address that reaches the root (for
//!   a loopback root, 127.0.0.1).
//! * Rank 0 also runs the root: a thread listening at the id's address that collects every
//!   rank's hello (magic and secret checked; strangers, a wrong secret, garbage bytes,
//!   duplicates, ranks outside the job and jobs of another size are refused with a log line
//!   and the connection closed, while the job goes on), sends everyone the table of listen
//!   addresses once all ranks are in, and ends. If the timeout passes first, every connected
//!   rank is told which ranks never came, and its `init` fails saying so.
//! * Every rank connects to the root (retrying while it is not up yet: ranks may start before
//!   rank 0), says hello, and gets the table or the refusal.
//! * Messages: a rank's first [`Bootstrap::send`] to a peer opens one connection to it, which
//!   starts with a handshake the peer checks; Msg frames follow, one writer lock per peer.
//!   Every accepted connection has a reader thread that decodes frames into a mailbox keyed by
//!   (sender, tag); [`Bootstrap::recv`] waits on it at most the timeout, and fails at once
//!   ("rank 3's connection closed") when the sender's connection has closed.
//! * Dropping a rank says Bye on its connections, closes them and its listener, and joins its
//!   threads.
//!
//! The protocol's logic (frames, handshake checks, rendezvous) is the sans-IO core in
//! [`super::proto`]; this module only moves bytes. Every wait is bounded by the timeout.

use super::proto::{
    self, Decoder, Frame, HANDSHAKE_MAX_PAYLOAD, Hello, MAX_PAYLOAD, PeerHello, Refusal, Rendezvous, check_hello,
    check_peer_hello,
};
use super::{Bootstrap, UniqueId};
use crate::runtime::lifetime::lock;
use crate::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Stack of the connection reader threads (they decode frames into the mailbox; a job of n
/// ranks has n - 1 of them per rank).
const READER_STACK: usize = 256 << 10;
/// A reader's read buffer.
const READ_BUF: usize = 8 << 10;
/// How long the root's loop sleeps when nothing happened: 1 ms while ranks are arriving, up
/// to 16 ms after a quiet second (a root waiting long for a late rank does not spin).
const ROOT_POLL: Duration = Duration::from_millis(1);
const ROOT_POLL_IDLE: Duration = Duration::from_millis(16);
/// How often a rank retries connecting to a root that is not up yet.
const CONNECT_RETRY: Duration = Duration::from_millis(10);
/// Frames up to this size are written together with a new connection's handshake.
const COALESCE: usize = 64 << 10;

/// What the reader threads and the rank share.
struct Shared {
    id: UniqueId,
    rank: usize,
    nranks: usize,
    timeout: Duration,
    /// Set when the rank is dropped: the accept thread stops.
    closing: AtomicBool,
    state: Mutex<State>,
    arrived: Condvar,
    /// Threads of this rank still running (the accept thread and the readers).
    live: AtomicUsize,
}

/// Counts a thread in [`Shared::live`] while it runs.
struct Live(Arc<Shared>);

impl Live {
    fn new(shared: &Arc<Shared>) -> Live {
        shared.live.fetch_add(1, Ordering::AcqRel);
        Live(shared.clone())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

struct State {
    /// (from, tag) → messages in arrival order.
    mail: HashMap<(usize, u64), VecDeque<Vec<u8>>>,
    /// Per peer: why its connection to this rank is gone (set once, never cleared).
    gone: Vec<Option<String>>,
    /// Per peer: whether its connection to this rank completed its handshake.
    incoming: Vec<bool>,
    /// A clone of every accepted connection, shut down on drop so that its reader ends.
    /// Every accepted connection still open (a clone, by connection number), shut down on
    /// drop so that its reader ends; a reader removes its own when it ends.
    conns: HashMap<u64, TcpStream>,
    /// Numbers the accepted connections.
    next_conn: u64,
    /// The reader threads (finished ones are joined as new connections come).
    readers: Vec<JoinHandle<()>>,
}

impl Shared {
    fn deliver(&self, from: usize, tag: u64, data: Vec<u8>) {
        lock(&self.state).mail.entry((from, tag)).or_default().push_back(data);
        self.arrived.notify_all();
    }

    fn mark_gone(&self, peer: usize, why: String) {
        let mut st = lock(&self.state);
        if st.gone[peer].is_none() {
            st.gone[peer] = Some(why);
        }
        drop(st);
        self.arrived.notify_all();
    }

    fn closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }
}

/// One rank of a job whose ranks find each other over TCP (see the module docs).
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::UniqueId;
/// use ferrolink::comm::bootstrap::{Bootstrap, tcp::TcpBootstrap};
/// use std::time::Duration;
/// // A free loopback port for the root.
/// let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
/// let id = UniqueId::new(([127, 0, 0, 1], port).into())?;
/// // Two ranks as threads of this process (normally one process each, on any machines).
/// let gathered = std::thread::scope(|s| {
///     let ranks: Vec<_> = (0..2)
///         .map(|r| {
///             let id = &id;
///             s.spawn(move || TcpBootstrap::init(id, r, 2, Duration::from_secs(20))?.all_gather(&[r as u8]))
///         })
///         .collect();
///     ranks.into_iter().map(|h| h.join().unwrap()).collect::<ferrolink::Result<Vec<_>>>()
/// })?;
/// assert_eq!(gathered, vec![vec![vec![0], vec![1]]; 2]);
/// # Ok(()) }
/// ```
pub struct TcpBootstrap {
    shared: Arc<Shared>,
    /// Where this rank listens for its peers.
    listen: SocketAddr,
    /// Every rank's listen address (the root's table).
    peers: Vec<SocketAddr>,
    /// Per peer: this rank's connection to it, opened by the first send.
    writers: Vec<Mutex<Option<TcpStream>>>,
    accept_thread: Option<JoinHandle<()>>,
    seq: AtomicU64,
}

impl TcpBootstrap {
    /// Joins the job of `id` as rank `rank` of `nranks`: listens for peers, starts the root if
    /// `rank` is 0, says hello to the root and waits for every rank's address. Fails when the
    /// root refuses this rank (the error says why: a duplicate rank, another job size, …),
    /// when ranks did not all join within `timeout` (the error names them), or when the root
    /// cannot be reached within `timeout`.
    ///
    /// ```
    /// use ferrolink::comm::bootstrap::tcp::TcpBootstrap;
    /// use std::time::Duration;
    /// let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 1, [7; 16]);
    /// // Bad arguments are refused before any socket is opened.
    /// let err = TcpBootstrap::init(&id, 4, 4, Duration::from_secs(1)).err().unwrap();
    /// assert!(err.to_string().contains("rank 4 is outside 0..4"), "{err}");
    /// ```
    pub fn init(id: &UniqueId, rank: usize, nranks: usize, timeout: Duration) -> Result<Arc<TcpBootstrap>> {
        if nranks == 0 || u32::try_from(nranks).is_err() {
            return Err(Error::InvalidArgument(format!("a TCP bootstrap of {nranks} ranks")));
        }
        if rank >= nranks {
            return Err(Error::InvalidArgument(format!("rank {rank} is outside 0..{nranks}")));
        }
        if timeout.is_zero() {
            return Err(Error::InvalidArgument("a TCP bootstrap needs a non-zero timeout".into()));
        }
        // Refusals are logged: make sure FERROLINK_LOG's subscriber is there (a bootstrap may
        // come before any device is opened).
        crate::log::init();
        let deadline = Instant::now() + timeout;
        let ip = local_ip_towards(id.root());
        let listener = listen_for_peers(ip, id.root(), rank)?;
        let listen = listener
            .local_addr()
            .map_err(|e| Error::Bootstrap(format!("rank {rank}: its listener has no address: {e}")))?;
        let shared = Arc::new(Shared {
            id: id.clone(),
            rank,
            nranks,
            timeout,
            closing: AtomicBool::new(false),
            state: Mutex::new(State {
                mail: HashMap::new(),
                gone: vec![None; nranks],
                incoming: vec![false; nranks],
                conns: HashMap::new(),
                next_conn: 0,
                readers: Vec::new(),
            }),
            arrived: Condvar::new(),
            live: AtomicUsize::new(0),
        });
        let accept_thread = {
            let live = Live::new(&shared);
            thread::Builder::new()
                .name(format!("fl-boot-accept-{rank}"))
                .stack_size(READER_STACK)
                .spawn(move || accept_loop(live, listener))
                .map_err(|e| Error::Bootstrap(format!("rank {rank}: cannot start its accept thread: {e}")))?
        };
        // From here on, dropping `me` (an error) closes the listener and joins the threads.
        let mut me = TcpBootstrap {
            shared,
            listen,
            peers: Vec::new(),
            writers: (0..nranks).map(|_| Mutex::new(None)).collect(),
            accept_thread: Some(accept_thread),
            seq: AtomicU64::new(0),
        };
        let root = if rank == 0 { Some(Root::start(id, nranks, timeout, deadline)?) } else { None };
        let table = me.join_root(deadline);
        // Stops the root if this rank failed; otherwise it has sent the table and ends.
        drop(root);
        let table = table?;
        if table.len() != nranks || table[rank] != listen {
            return Err(Error::Bootstrap(format!(
                "rank {rank}: the root's table ({} ranks, this rank at {:?}) does not match this rank ({nranks} ranks, at {listen})",
                table.len(),
                table.get(rank)
            )));
        }
        me.peers = table;
        Ok(Arc::new(me))
    }

    /// Where this rank listens for its peers.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::comm::bootstrap::tcp::TcpBootstrap;
    /// # let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    /// let id = ferrolink::UniqueId::new(([127, 0, 0, 1], port).into())?;
    /// let b = TcpBootstrap::init(&id, 0, 1, std::time::Duration::from_secs(10))?;
    /// // A loopback root: the rank listens on loopback too, on a port of its own.
    /// assert!(b.listen_addr().ip().is_loopback());
    /// assert_ne!(b.listen_addr(), id.root());
    /// # Ok(()) }
    /// ```
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen
    }

    /// Connects to the root, says hello, and returns the root's table.
    fn join_root(&self, deadline: Instant) -> Result<Vec<SocketAddr>> {
        let (me, n, timeout) = (self.shared.rank, self.shared.nranks, self.shared.timeout);
        let id = &self.shared.id;
        let root = id.root();
        let fail = |what: String| Error::Bootstrap(format!("rank {me}: {what} ({})", self.describe()));
        let mut stream = loop {
            let now = Instant::now();
            let last = match TcpStream::connect_timeout(&root, deadline.saturating_duration_since(now).max(ms(1))) {
                Ok(s) => break s,
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(fail(format!(
                    "could not reach the root at {root} within {timeout:?}: {last} (is rank 0 running with the same unique id?)"
                )));
            }
            thread::sleep(CONNECT_RETRY.min(deadline - now));
        };
        let _ = stream.set_nodelay(true);
        let hello = proto::encode(id.magic(), &Frame::Hello(Hello::new(id, me as u32, n as u32, self.listen)))?;
        stream
            .set_write_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(ms(1))))
            .and_then(|()| stream.write_all(&hello))
            .map_err(|e| fail(format!("cannot send its hello to the root at {root}: {e}")))?;
        // The root answers when every rank is in, or at its own deadline (rank 0's start plus
        // the timeout) with the ranks that never came: wait a little past ours for that answer.
        let answer_by = deadline + (timeout / 4).clamp(ms(100), Duration::from_secs(5));
        let mut dec = Decoder::new(id.magic());
        let mut buf = vec![0u8; READ_BUF];
        loop {
            let left = answer_by.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(fail(format!(
                    "no table from the root at {root} within {timeout:?}: not every rank joined (rank 0's error names those that did not)"
                )));
            }
            let n = match stream.set_read_timeout(Some(left)).and_then(|()| stream.read(&mut buf)) {
                Ok(0) => return Err(fail(format!("the root at {root} closed the connection without an answer"))),
                Ok(n) => n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
                    ) =>
                {
                    continue;
                }
                Err(e) => return Err(fail(format!("lost the connection to the root at {root}: {e}"))),
            };
            let mut input = &buf[..n];
            match dec.decode(&mut input) {
                Ok(None) => {}
                Ok(Some(Frame::Table(table))) => return Ok(table),
                Ok(Some(Frame::Refuse(why))) => return Err(fail(format!("refused by the root at {root}: {why}"))),
                Ok(Some(other)) => {
                    return Err(fail(format!("the root at {root} answered with a {:?} frame", other.kind())));
                }
                Err(e) => return Err(fail(format!("the root at {root} sent a malformed answer: {e}"))),
            }
        }
    }

    /// Opens this rank's connection to `to` and writes its handshake (with `first`, a small
    /// frame, in the same write).
    fn connect(&self, to: usize, first: &[u8]) -> Result<TcpStream> {
        let (me, id, timeout) = (self.shared.rank, &self.shared.id, self.shared.timeout);
        let addr = self.peers[to];
        let fail = |e: io::Error| {
            Error::Bootstrap(format!("rank {me}: cannot connect to rank {to} at {addr}: {e} ({})", self.describe()))
        };
        let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(fail)?;
        let _ = s.set_nodelay(true);
        s.set_write_timeout(Some(timeout)).map_err(fail)?;
        let mut hello = proto::encode(id.magic(), &Frame::PeerHello(PeerHello::new(id, me as u32)))?;
        if first.len() <= COALESCE {
            hello.extend_from_slice(first);
            s.write_all(&hello).map_err(fail)?;
        } else {
            s.write_all(&hello).and_then(|()| s.write_all(first)).map_err(fail)?;
        }
        Ok(s)
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The local address that reaches `root` (the one the kernel would route from), or loopback.
/// A listener on an ephemeral port of `ip` that is not the root's port: a launcher picks the
/// root's port free and releases it, and the operating system may hand that very port to a
/// rank's ephemeral bind before rank 0 binds the root there (seen on the H200 machine: the
/// ranks' Hellos then reached a rank's listener). Such a port is kept while another is bound,
/// then released.
fn listen_for_peers(ip: IpAddr, root: SocketAddr, rank: usize) -> Result<TcpListener> {
    let mut held = Vec::new();
    for _ in 0..16 {
        let l = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::Bootstrap(format!("rank {rank}: cannot listen on {ip} for its peers: {e}")))?;
        let port = l.local_addr().map(|a| a.port()).unwrap_or(0);
        if port != root.port() {
            return Ok(l);
        }
        held.push(l);
    }
    Err(Error::Bootstrap(format!("rank {rank}: every port it was given on {ip} was the root's")))
}

fn local_ip_towards(root: SocketAddr) -> IpAddr {
    let (any, loopback): (SocketAddr, IpAddr) = match root {
        SocketAddr::V4(_) => ((Ipv4Addr::UNSPECIFIED, 0).into(), Ipv4Addr::LOCALHOST.into()),
        SocketAddr::V6(_) => ((Ipv6Addr::UNSPECIFIED, 0).into(), Ipv6Addr::LOCALHOST.into()),
    };
    UdpSocket::bind(any)
        .and_then(|s| {
            s.connect(root)?;
            s.local_addr()
        })
        .map(|a| a.ip())
        .ok()
        .filter(|ip| !ip.is_unspecified())
        .unwrap_or(loopback)
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn nranks(&self) -> usize {
        self.shared.nranks
    }

    fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn send(&self, to: usize, tag: u64, data: &[u8]) -> Result<()> {
        let (me, n) = (self.shared.rank, self.shared.nranks);
        if to >= n {
            return Err(Error::InvalidArgument(format!("send to rank {to} of {n}")));
        }
        if data.len() > MAX_PAYLOAD {
            return Err(Error::InvalidArgument(format!(
                "a bootstrap message of {} bytes is over the {} MiB limit",
                data.len(),
                MAX_PAYLOAD >> 20
            )));
        }
        if to == me {
            self.shared.deliver(me, tag, data.to_vec());
            return Ok(());
        }
        let frame = proto::encode_msg(self.shared.id.magic(), me as u32, tag, data)?;
        let mut writer = lock(&self.writers[to]);
        if let Some(why) = lock(&self.shared.state).gone[to].clone() {
            return Err(Error::Bootstrap(format!("rank {me}: cannot send to rank {to}: {why} ({})", self.describe())));
        }
        let result = match writer.as_mut() {
            Some(s) => s.write_all(&frame),
            None => {
                *writer = Some(self.connect(to, &frame)?);
                Ok(())
            }
        };
        if let Err(e) = result {
            // A write that failed may have left part of a frame: the connection is unusable.
            if let Some(s) = writer.take() {
                let _ = s.shutdown(Shutdown::Both);
            }
            let why = format!("rank {to}'s connection closed ({e})");
            self.shared.mark_gone(to, why.clone());
            return Err(Error::Bootstrap(format!(
                "rank {me}: sending to rank {to} failed: {why} ({})",
                self.describe()
            )));
        }
        Ok(())
    }

    fn recv(&self, from: usize, tag: u64) -> Result<Vec<u8>> {
        let (me, n, timeout) = (self.shared.rank, self.shared.nranks, self.shared.timeout);
        if from >= n {
            return Err(Error::InvalidArgument(format!("receive from rank {from} of {n}")));
        }
        let key = (from, tag);
        let deadline = Instant::now() + timeout;
        let mut st = lock(&self.shared.state);
        loop {
            if let Some(q) = st.mail.get_mut(&key)
                && let Some(m) = q.pop_front()
            {
                if q.is_empty() {
                    st.mail.remove(&key);
                }
                return Ok(m);
            }
            if let Some(why) = &st.gone[from] {
                return Err(Error::Bootstrap(format!(
                    "rank {me}: no message from rank {from}: {why} ({})",
                    self.describe()
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Bootstrap(format!(
                    "rank {me}: no message from rank {from} within {timeout:?} ({})",
                    self.describe()
                )));
            }
            st = self.shared.arrived.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn next_tag(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn describe(&self) -> String {
        format!("TCP bootstrap, root {}", self.shared.id.root())
    }
}

impl Drop for TcpBootstrap {
    fn drop(&mut self) {
        let rank = self.shared.rank;
        self.shared.closing.store(true, Ordering::Release);
        // Say Bye on this rank's connections and close them.
        let bye = proto::encode(self.shared.id.magic(), &Frame::Bye).unwrap_or_default();
        for w in &self.writers {
            if let Some(mut s) = lock(w).take() {
                let _ = s.set_write_timeout(Some(ms(100)));
                let _ = s.write_all(&bye);
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        // Wake the accept thread (blocked in accept) with a connection of our own; it sees
        // `closing` and ends, closing the listener.
        if let Some(t) = self.accept_thread.take() {
            match TcpStream::connect_timeout(&self.listen, Duration::from_secs(1)) {
                Ok(_) => {
                    let _ = t.join();
                }
                Err(e) => tracing::warn!(
                    target: "ferrolink::comm",
                    rank,
                    error = %e,
                    "could not wake the bootstrap's accept thread; it ends with the process"
                ),
            }
        }
        // Close the accepted connections: their readers see the end and return.
        let (conns, readers) = {
            let mut st = lock(&self.shared.state);
            (std::mem::take(&mut st.conns), std::mem::take(&mut st.readers))
        };
        for s in conns.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for r in readers {
            let _ = r.join();
        }
    }
}

/// Accepts connections from peers until the rank closes; each gets a reader thread.
fn accept_loop(live: Live, listener: TcpListener) {
    let shared = &live.0;
    let rank = shared.rank;
    loop {
        let accepted = listener.accept();
        if shared.closing() {
            return;
        }
        let (stream, addr) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(target: "ferrolink::comm", rank, error = %e, "bootstrap: accepting a connection failed");
                // E.g. out of file descriptors: do not spin.
                thread::sleep(ms(10));
                continue;
            }
        };
        let clone = match stream.try_clone() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(target: "ferrolink::comm", rank, %addr, error = %e, "bootstrap: dropped a connection");
                continue;
            }
        };
        // Registered before its reader starts, so that the reader's removal always finds it.
        let conn = {
            let mut st = lock(&shared.state);
            let (done, running): (Vec<_>, Vec<_>) =
                std::mem::take(&mut st.readers).into_iter().partition(|h| h.is_finished());
            st.readers = running;
            drop(st);
            for h in done {
                let _ = h.join();
            }
            let mut st = lock(&shared.state);
            let conn = st.next_conn;
            st.next_conn += 1;
            st.conns.insert(conn, clone);
            conn
        };
        let reader = Live::new(shared);
        match thread::Builder::new()
            .name(format!("fl-boot-read-{rank}"))
            .stack_size(READER_STACK)
            .spawn(move || serve(reader, stream, addr, conn))
        {
            Ok(h) => lock(&shared.state).readers.push(h),
            Err(e) => {
                lock(&shared.state).conns.remove(&conn);
                tracing::warn!(target: "ferrolink::comm", rank, %addr, error = %e, "bootstrap: no thread for a connection");
            }
        }
    }
}

/// A reader thread: checks the connection's handshake, then decodes its messages into the
/// mailbox until it closes; then closes it (connection number `conn`).
fn serve(live: Live, stream: TcpStream, addr: SocketAddr, conn: u64) {
    serve_connection(&live.0, stream, addr);
    if let Some(s) = lock(&live.0.state).conns.remove(&conn) {
        let _ = s.shutdown(Shutdown::Both);
    }
}

fn serve_connection(shared: &Shared, mut stream: TcpStream, addr: SocketAddr) {
    let me = shared.rank;
    let mut dec = Decoder::with_max_payload(shared.id.magic(), HANDSHAKE_MAX_PAYLOAD);
    let mut buf = vec![0u8; READ_BUF];
    let refuse = |why: &dyn std::fmt::Display| {
        if !shared.closing() {
            tracing::warn!(target: "ferrolink::comm", rank = me, %addr, "bootstrap: refused a connection: {why}");
        }
    };
    let _ = stream.set_read_timeout(Some(shared.timeout));
    let (from, rest) = loop {
        let n = match stream.read(&mut buf) {
            Ok(0) => return refuse(&"it closed before its handshake"),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return refuse(&format_args!("no handshake ({e})")),
        };
        let mut input = &buf[..n];
        match dec.decode(&mut input) {
            Ok(None) => {}
            Ok(Some(Frame::PeerHello(h))) => match check_peer_hello(&shared.id, &h, shared.nranks) {
                Ok(from) => break (from, n - input.len()..n),
                Err(r) => return refuse(&r),
            },
            Ok(Some(other)) => return refuse(&format_args!("a {:?} frame instead of a handshake", other.kind())),
            Err(e) => return refuse(&e),
        }
    };
    {
        let mut st = lock(&shared.state);
        if st.incoming[from] {
            drop(st);
            return refuse(&format_args!("rank {from} connected twice"));
        }
        st.incoming[from] = true;
    }
    dec.set_max_payload(MAX_PAYLOAD);
    let _ = stream.set_read_timeout(None);
    let why = pump(shared, &mut stream, &mut dec, &mut buf, rest, from);
    if !shared.closing() && why.1 {
        tracing::warn!(target: "ferrolink::comm", rank = me, peer = from, %addr, "bootstrap: {}", why.0);
    }
    shared.mark_gone(from, why.0);
}

/// Decodes rank `from`'s messages (starting with `buf[rest]`) into the mailbox until the
/// connection ends; returns why it ended, and whether that is worth a warning.
fn pump(
    shared: &Shared,
    stream: &mut TcpStream,
    dec: &mut Decoder,
    buf: &mut [u8],
    mut rest: Range<usize>,
    from: usize,
) -> (String, bool) {
    loop {
        let mut input = &buf[rest.clone()];
        loop {
            match dec.decode(&mut input) {
                Ok(None) => break,
                Ok(Some(Frame::Msg { from: f, tag, data })) if f as usize == from => shared.deliver(from, tag, data),
                Ok(Some(Frame::Msg { from: f, .. })) => {
                    return (format!("rank {from}'s connection closed: it sent a message as rank {f}"), true);
                }
                Ok(Some(Frame::Bye)) => {
                    return (format!("rank {from}'s connection closed (it ended its bootstrap)"), false);
                }
                Ok(Some(other)) => {
                    return (
                        format!("rank {from}'s connection closed: it sent an unexpected {:?} frame", other.kind()),
                        true,
                    );
                }
                Err(e) => return (format!("rank {from}'s connection closed: it sent a malformed frame ({e})"), true),
            }
        }
        rest = match stream.read(buf) {
            Ok(0) if dec.in_frame() => {
                return (format!("rank {from}'s connection closed in the middle of a message"), true);
            }
            Ok(0) => return (format!("rank {from}'s connection closed"), false),
            Ok(n) => 0..n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => 0..0,
            Err(e) => return (format!("rank {from}'s connection closed ({e})"), !shared.closing()),
        };
    }
}

// ---------------------------------------------------------------------------------------------
// The root
// ---------------------------------------------------------------------------------------------

/// Rank 0's root thread; dropping it stops the rendezvous if it has not finished (every
/// connected rank is then refused) and waits for the thread.
struct Root {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Root {
    fn start(id: &UniqueId, nranks: usize, timeout: Duration, deadline: Instant) -> Result<Root> {
        let at = id.root();
        let listener = TcpListener::bind(at).map_err(|e| {
            Error::Bootstrap(format!(
                "rank 0 cannot listen at {at} for the bootstrap root: {e} (the unique id's address must be this \
                 machine's, with a free port)"
            ))
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Bootstrap(format!("rank 0: the bootstrap root's listener at {at}: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (id, stop2) = (id.clone(), stop.clone());
        let thread = thread::Builder::new()
            .name("fl-boot-root".into())
            .spawn(move || run_root(listener, id, nranks, timeout, deadline, stop2))
            .map_err(|e| Error::Bootstrap(format!("rank 0: cannot start the bootstrap root's thread: {e}")))?;
        Ok(Root { stop, thread: Some(thread) })
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A connection to the root.
struct RootConn {
    stream: TcpStream,
    addr: SocketAddr,
    dec: Decoder,
}

enum HelloPoll {
    Waiting,
    Hello(Hello),
    Refused(String),
}

/// Reads what a new connection has sent so far (non-blocking): its hello, nothing yet, or
/// why it is refused.
fn poll_hello(c: &mut RootConn, buf: &mut [u8]) -> HelloPoll {
    loop {
        let n = match c.stream.read(buf) {
            Ok(0) if c.dec.in_frame() => return HelloPoll::Refused("it closed in the middle of its hello".into()),
            Ok(0) => return HelloPoll::Refused("it closed without a hello".into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return HelloPoll::Waiting,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return HelloPoll::Refused(e.to_string()),
        };
        let mut input = &buf[..n];
        match c.dec.decode(&mut input) {
            Ok(None) => {}
            Ok(Some(Frame::Hello(h))) if input.is_empty() => return HelloPoll::Hello(h),
            Ok(Some(Frame::Hello(_))) => return HelloPoll::Refused("it sent bytes after its hello".into()),
            Ok(Some(other)) => return HelloPoll::Refused(format!("a {:?} frame instead of a hello", other.kind())),
            Err(e) => return HelloPoll::Refused(e.to_string()),
        }
    }
}

/// Whether a joined rank's connection (non-blocking, silent until the table) has closed.
fn has_left(stream: &mut TcpStream) -> Option<String> {
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => Some("its connection closed".into()),
        Ok(_) => Some("it sent bytes after its hello".into()),
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => None,
        Err(e) => Some(format!("its connection failed ({e})")),
    }
}

/// Writes one frame to a connection of the root (blocking, bounded).
fn root_write(stream: &mut TcpStream, frame: &[u8]) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(frame)
}

fn run_root(
    listener: TcpListener,
    id: UniqueId,
    nranks: usize,
    timeout: Duration,
    deadline: Instant,
    stop: Arc<AtomicBool>,
) {
    let magic = id.magic();
    let warn = |addr: SocketAddr, why: &dyn std::fmt::Display| {
        tracing::warn!(target: "ferrolink::comm", root = %id.root(), %addr, "bootstrap root: refused a connection: {why}");
    };
    let mut pending: Vec<RootConn> = Vec::new();
    let mut joined: Vec<Option<RootConn>> = (0..nranks).map(|_| None).collect();
    let mut rv = Rendezvous::new(nranks);
    let mut buf = [0u8; 512];
    let mut last_busy = Instant::now();
    let outcome: std::result::Result<Vec<SocketAddr>, Refusal> = loop {
        let mut busy = false;
        loop {
            match listener.accept() {
                Ok((stream, addr)) => {
                    busy = true;
                    match stream.set_nonblocking(true) {
                        Ok(()) => pending.push(RootConn {
                            stream,
                            addr,
                            dec: Decoder::with_max_payload(magic, HANDSHAKE_MAX_PAYLOAD),
                        }),
                        Err(e) => warn(addr, &e),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!(target: "ferrolink::comm", root = %id.root(), error = %e, "bootstrap root: accept failed");
                    break;
                }
            }
        }
        let mut i = 0;
        while i < pending.len() {
            match poll_hello(&mut pending[i], &mut buf) {
                HelloPoll::Waiting => i += 1,
                HelloPoll::Refused(why) => {
                    busy = true;
                    let c = pending.swap_remove(i);
                    warn(c.addr, &why);
                }
                HelloPoll::Hello(h) => {
                    busy = true;
                    let mut c = pending.swap_remove(i);
                    match check_hello(&id, &h).and_then(|()| rv.on_hello(&h)) {
                        Ok(()) => joined[h.rank as usize] = Some(c),
                        Err(r) => {
                            warn(c.addr, &format_args!("{r} (a hello as rank {} of {})", h.rank, h.nranks));
                            if let Ok(f) = proto::encode(magic, &Frame::Refuse(r.0)) {
                                let _ = root_write(&mut c.stream, &f);
                            }
                        }
                    }
                }
            }
        }
        for r in 0..nranks {
            if let Some(c) = &mut joined[r]
                && let Some(why) = has_left(&mut c.stream)
            {
                tracing::warn!(target: "ferrolink::comm", root = %id.root(), addr = %c.addr, "bootstrap root: rank {r} left before the job started: {why}");
                joined[r] = None;
                rv.on_leave(r);
                busy = true;
            }
        }
        if let Some(table) = rv.table() {
            break Ok(table);
        }
        if stop.load(Ordering::Acquire) {
            break Err(Refusal("rank 0 failed before the job started".into()));
        }
        if Instant::now() >= deadline {
            break Err(rv.timed_out(timeout));
        }
        if busy {
            last_busy = Instant::now();
        } else {
            thread::sleep(if last_busy.elapsed() < Duration::from_secs(1) { ROOT_POLL } else { ROOT_POLL_IDLE });
        }
    };
    let frame = match &outcome {
        Ok(table) => proto::encode(magic, &Frame::Table(table.clone())),
        Err(r) => {
            tracing::warn!(target: "ferrolink::comm", root = %id.root(), "bootstrap root: {r}");
            proto::encode(magic, &Frame::Refuse(r.0.clone()))
        }
    };
    let Ok(frame) = frame else { return };
    for (r, c) in joined.iter_mut().enumerate() {
        if let Some(c) = c
            && let Err(e) = root_write(&mut c.stream, &frame)
        {
            tracing::warn!(target: "ferrolink::comm", root = %id.root(), addr = %c.addr, error = %e, "bootstrap root: cannot answer rank {r}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The benchmark
// ---------------------------------------------------------------------------------------------

/// Times a bootstrap of `nranks` ranks as threads of this process over TCP loopback: every
/// rank's [`TcpBootstrap::init`], then one all-gather (checked) and one barrier. Returns the
/// wall time from before the first `init` to the end of the last rank's barrier (the
/// teardown is not counted). Every rank connects to every other, so this needs about 2·n²
/// file descriptors (8 200 for 64 ranks): the soft limit is raised to the hard one if that is
/// too low, and an error says so if even that is not enough.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::comm::bootstrap::tcp::bootstrap_bench;
/// let elapsed = bootstrap_bench(2)?;
/// assert!(elapsed > std::time::Duration::ZERO);
/// assert!(bootstrap_bench(0).is_err());
/// # Ok(()) }
/// ```
pub fn bootstrap_bench(nranks: usize) -> Result<Duration> {
    if nranks == 0 {
        return Err(Error::InvalidArgument("a bootstrap of 0 ranks".into()));
    }
    ensure_open_files((2 * nranks * nranks + 8 * nranks + 64) as u64)?;
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::Bootstrap(format!("no free loopback port for the root: {e}")))?
        .port();
    let id = UniqueId::new(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))?;
    let timeout = Duration::from_secs(60);
    let start = Instant::now();
    let ranks: Vec<Result<Arc<TcpBootstrap>>> = thread::scope(|s| {
        let handles: Vec<_> = (0..nranks)
            .map(|r| {
                let id = &id;
                thread::Builder::new().name(format!("fl-bench-rank-{r}")).spawn_scoped(s, move || {
                    let b = TcpBootstrap::init(id, r, nranks, timeout)?;
                    let all = b.all_gather(&(r as u64).to_le_bytes())?;
                    if all.iter().enumerate().any(|(k, d)| d[..] != (k as u64).to_le_bytes()) {
                        return Err(Error::Bootstrap(format!("rank {r}: the all-gather returned wrong data")));
                    }
                    b.barrier()?;
                    Ok(b)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join().unwrap_or_else(|_| Err(Error::Bootstrap("a rank thread panicked".into()))),
                Err(e) => Err(Error::Bootstrap(format!("cannot start a rank thread: {e}"))),
            })
            .collect()
    });
    let elapsed = start.elapsed();
    let ranks = ranks.into_iter().collect::<Result<Vec<_>>>()?;
    drop(ranks);
    Ok(elapsed)
}

/// Raises the soft limit on open files to `need` (up to the hard limit) if it is lower.
fn ensure_open_files(need: u64) -> Result<()> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` into `lim`, a valid local that outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur >= need {
        return Ok(());
    }
    if lim.rlim_max < need {
        return Err(Error::Bootstrap(format!(
            "a bootstrap of this many ranks in one process needs about {need} open files, over the hard limit of {} \
             (raise it: ulimit -Hn)",
            lim.rlim_max
        )));
    }
    let raised = libc::rlimit { rlim_cur: need, rlim_max: lim.rlim_max };
    // SAFETY: setrlimit only reads `raised`, a valid local; a soft limit up to the hard one
    // needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(Error::Bootstrap(format!(
            "cannot raise the open-file limit from {} to {need}: {}",
            lim.rlim_cur,
            io::Error::last_os_error()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_root() -> UniqueId {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
        UniqueId::new(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).unwrap()
    }

    /// Dropping a rank joins its threads: none is left running, none spins.
    #[test]
    fn dropping_the_ranks_ends_their_threads() {
        let id = free_root();
        let n = 4;
        let ranks: Vec<Arc<TcpBootstrap>> = thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let id = &id;
                    s.spawn(move || {
                        let b = TcpBootstrap::init(id, r, n, Duration::from_secs(20)).unwrap();
                        assert_eq!(b.describe(), format!("TCP bootstrap, root {}", id.root()));
                        assert_eq!(
                            b.all_gather(&[r as u8]).unwrap(),
                            (0..n).map(|k| vec![k as u8]).collect::<Vec<_>>()
                        );
                        b.barrier().unwrap();
                        b
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let shared: Vec<Arc<Shared>> = ranks.iter().map(|b| b.shared.clone()).collect();
        // The accept thread and one reader per peer.
        for sh in &shared {
            assert_eq!(sh.live.load(Ordering::Acquire), n);
        }
        drop(ranks);
        for sh in &shared {
            assert_eq!(sh.live.load(Ordering::Acquire), 0, "rank {}'s threads still run after its drop", sh.rank);
        }
    }

    #[test]
    fn bad_arguments_are_refused_before_any_socket() {
        let id = free_root();
        let t = Duration::from_secs(1);
        for (rank, n, want) in [(9, 4, "rank 9 is outside 0..4"), (0, 0, "0 ranks")] {
            let e = TcpBootstrap::init(&id, rank, n, t).err().expect("refused").to_string();
            assert!(e.contains(want), "{e}");
        }
        assert!(TcpBootstrap::init(&id, 0, 1, Duration::ZERO).is_err());
    }
}
