//! The RDMA verbs transport (cargo feature `verbs`, `FERROLINK_GIN_TRANSPORT=verbs`): the GIN
//! proxy reaches peers through an InfiniBand or RoCE NIC, writing straight into their windows.
//!
//! **This transport has never run on hardware.** It builds everywhere (libibverbs is loaded at
//! run time; nothing of rdma-core is needed to build), and what can run without a NIC is
//! unit-tested: the wire formats (fuzzed), the work-request plan, the queue-pair transitions,
//! the ranks' agreement during set-up and its failures, the C struct layouts (checked against
//! rdma-core 44's `verbs.h`), and the errors when libibverbs or a device is missing. Against a
//! real libibverbs with no device, every symbol resolves and set-up reports "no RDMA device".
//! Nothing has exercised a queue pair reaching RTS, a byte crossing a wire, `ibv_reg_mr` on
//! GPU memory, the flush, RNR and retries, or completions under load. Until it has run on a
//! NIC, treat it as a reviewed design with code, not as a working transport.
//!
//! # Design
//! The code is split as the rest of the crate is: a sans-IO core ([`wire`]: immediate data,
//! control and connection messages; [`plan`]: work requests, queue-pair transitions, device
//! and GID choice), a thin unsafe layer ([`ffi`]: the library, hand-written `#[repr(C)]`
//! declarations, owners of the verbs objects), and the transport on top (this module's
//! set-up, `sender` for the proxy, `receiver` for the progress thread).
//!
//! * **Connections.** One RC queue pair per (context, peer), i.e. per proxy ring, so the
//!   order GIN promises within a context is a queue pair's order. [`setup`] (collective,
//!   during `gin::create`): each rank opens its NIC ([`nic`]), creates its queue pairs (to
//!   INIT, receives posted), sends each verbs peer its [`ConnInfo`] (QP numbers, first PSNs,
//!   LID, GID, MTU, sink word) through the communicator's bootstrap (`all_to_all`), and moves
//!   its queue pairs to RTR and RTS ([`plan::to_init`], [`plan::to_rtr`], [`plan::to_rts`]).
//!   A final `all_gather` makes every rank agree that every rank succeeded: a rank that fails
//!   (no library, no device, a refused registration) tells the others why, and all of them
//!   fail with that reason instead of waiting on a peer that never connects.
//! * **Data.** A put is RDMA WRITEs from the source window to the peer's buffer of the
//!   destination window, cut at the port's largest message (`max_msg_sz`, at most 1 GiB); a
//!   value is one inline WRITE ([`plan::plan_request`]). Window buffers are registered with
//!   **`ibv_reg_mr` on their address**: GPU memory through the **nvidia-peermem** kernel
//!   module (on the CPU emulator, plain host memory, which Soft-RoCE could carry), lazily, on
//!   first use. `ibv_reg_dmabuf_mr`, which needs no kernel module, wants the buffer's dma-buf
//!   fd from `cuMemGetHandleForAddressRange`, in the CUDA runtime layer: the next step, not
//!   done. Either way a VMM allocation is reachable by a NIC only if it was created with
//!   `CUmemAllocationProp::allocFlags.gpuDirectRDMACapable = 1`.
//! * **Window keys.** A window's id is the same on every rank (registration is collective);
//!   its address and rkey are not, and windows come and go after `gin::create`, so keys are
//!   asked for in-band, once per (peer, window): the sender posts a
//!   [`Control::WindowRequest`](wire::Control) (a SEND_WITH_IMM) and parks the requests that
//!   need the key (and those behind them on that queue pair); the peer's progress thread
//!   registers its buffer if needed and answers with its address, size and rkey, or "gone".
//!   A window's region is deregistered once the window is gone on its rank.
//! * **Signals.** A signal is the last work request of its request, on the data's queue
//!   pair. An increment of 1 (SignalInc, barriers: the common case) is a zero-length RDMA
//!   WRITE_WITH_IMM (aimed at the peer's sink word, so that its address and key are valid);
//!   its 32-bit immediate data carries the kind, the sender and the signal id
//!   ([`wire::ImmCodec`]: the sender takes the bits `nranks` needs, the id the rest, checked
//!   against the signal count at set-up). Any other increment is a SEND_WITH_IMM with the
//!   same immediate data and the increment as 8 inline bytes. The receiver's progress thread
//!   reaps the receive completion and applies the signal with
//!   [`Deliver::signal`](crate::gin::transport::Deliver::signal)`(from, id, inc)`, the TCP
//!   transport's path (the slot is written whole with the running total, so it only grows).
//!
//!   *Why a SEND carries the increment*, rather than a WRITE of it into a per-sender staging
//!   slot before the WRITE_WITH_IMM, or a FETCH_AND_ADD: a SEND lands in the buffer of the
//!   receive it consumes, which nothing can overwrite before the receiver has read it and
//!   posted it again. A staging slot shared by successive signals can be overwritten by the
//!   next signal's write before the receiver reads it; making that safe takes a slot per
//!   (sender, context, signal) holding running totals (`contexts ×` the signal window, in
//!   host memory) or credits flowing back, or reliance on when a responder checks for a
//!   posted receive (RNR), which nothing here can test. A NIC atomic on the signal slot
//!   itself would bypass the receiver, and with it the `received` totals that keep TCP and
//!   verbs deliveries to one slot consistent, and the flush below.
//! * **Local completion.** Every request's last work request is signaled. An RC send queue
//!   completes in order, so a completion with id `k` means every work request up to `k` has
//!   completed, i.e. was acknowledged by the peer (its source may be reused). The progress
//!   thread records `k` per queue pair; the proxy's `poll` reports the requests whose last
//!   id is at most `k`, in order, keeping each put's source window alive until then.
//! * **Threads.** The proxy thread plans and posts ([`VerbsTransport`]). One progress thread
//!   per rank, started by [`setup`], reaps the completion queue that all the rank's queue
//!   pairs share: send completions, signals, control messages. It lives until the rank's GIN
//!   is dropped *and* the proxy's transport is gone (the proxy drains after that drop and
//!   needs the completions). It spins for 5 ms after work, then sleeps 50 µs between looks.
//!
//! # Ordering: why a signal is visible only after its data
//! 1. A request's data WRITEs and its signal are posted in that order on one RC queue pair.
//!    The responder executes a queue pair's requests in order, and the receive completion of
//!    a WRITE_WITH_IMM or SEND is generated after the data of the WRITEs before it on that
//!    queue pair has been placed: the guarantee NCCL's IB transport also builds on (data
//!    WRITEs, then a WRITE_WITH_IMM that the receiver polls for).
//! 2. "Placed" is the NIC's view. The data went to GPU memory over PCIe peer-to-peer, the
//!    completion to host memory by another path, so the CPU can see the completion while the
//!    data is still on its way to the GPU. Before applying a batch of signals the progress
//!    thread therefore **flushes**: an RDMA READ, on a queue pair connected to itself, of a
//!    word of this rank's signal window in GPU memory. PCIe does not let the read pass the
//!    posted writes ahead of it on the path to the GPU, so when the read completes, every
//!    write the NIC made to this GPU before it has landed (NCCL's GDR flush does the same).
//!    One flush covers every signal reaped in the batch.
//! 3. Only then does `Deliver::signal` write the signal's slot (a synchronous host-to-device
//!    write): a kernel that sees the slot's new value sees the data.
//!
//! Regions are registered without relaxed ordering. Across contexts (queue pairs) there is
//! no order, as GIN promises none.
//!
//! # Not done
//! The NIC nearest each GPU (until then `FERROLINK_IB_HCA=mlx5_0,mlx5_1,…` lists one device
//! per local rank; `FERROLINK_IB_GID_INDEX` forces a GID), dma-buf registration, completion
//! channels instead of spinning, fewer signaled completions, requests that carry their source
//! window's id (until then a put's source window is found among the windows already
//! registered or named by this rank's requests), and anything learned by running it.

mod ffi;
mod nic;
mod plan;
mod receiver;
mod sender;
mod wire;

pub(crate) use sender::VerbsTransport;

use crate::comm::Communicator;
use crate::comm::bootstrap::Bootstrap;
use crate::gin::GinRank;
use crate::mem::window::Window;
use crate::runtime::lifetime::lock;
use crate::{Error, Result};
use ffi::{Cq, HostRegion, Mr, Qp, QpCaps, setup_error};
use plan::Wr;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use wire::{ConnInfo, ConnMsg, ImmCodec, QpEndpoint, RemoteWindow};

/// Work requests a queue pair's send queue holds.
const SQ_DEPTH: u32 = 128;
/// Receives posted per queue pair (signals and control messages in flight from the peer
/// before the receiver reaps them; more wait in RNR retries).
const RQ_DEPTH: u32 = 64;
/// Inline bytes a queue pair is created for (control messages are at most 32).
const MAX_INLINE: u32 = 64;

/// What `setup` needs from the rank (its communicator and GIN), so that the agreement between
/// ranks can be tested without either.
struct Params {
    rank: usize,
    nranks: usize,
    lsa_rank: usize,
    contexts: u32,
    signal_count: u32,
    /// The memory the flush reads a word of: this rank's signal window's buffer (address,
    /// bytes), on its GPU.
    flush_target: Option<(u64, usize)>,
}

/// One connection: this rank's queue pair for (context, peer).
struct Conn {
    qp: Qp,
    peer: usize,
    context: u32,
    psn: u32,
    /// The id of the last work request posted (ids count from 1), under the lock that orders
    /// posts on this queue pair (the proxy's requests, the progress thread's answers).
    posted: Mutex<u64>,
    /// The id of the last send completion: every work request up to it has completed.
    completed: AtomicU64,
}

/// The flush: a queue pair connected to itself, reading a word of GPU memory.
struct Flush {
    qp: Qp,
    cq: Arc<Cq>,
    target: Mr,
    target_addr: u64,
    landing: HostRegion,
    next_id: AtomicU64,
}

/// A window buffer of this rank, registered.
struct LocalMr {
    mr: Mr,
    addr: u64,
    len: u64,
}

/// A rank's verbs state, shared by the proxy's transport and the progress thread. Fields drop
/// in declaration order: the queue pairs go before the memory they receive into.
pub(crate) struct Shared {
    conns: Vec<Conn>,
    flush: Flush,
    recv: HostRegion,
    local_mrs: Mutex<HashMap<u32, LocalMr>>,
    cq: Arc<Cq>,
    nic: nic::Nic,
    /// Proxy ring (`context * nranks + peer`) → connection.
    by_ring: Vec<Option<usize>>,
    /// Queue-pair number → connection.
    by_qpn: HashMap<u32, usize>,
    /// Per connection: the peer's sink word (address, rkey), where zero-length writes point.
    sinks: Vec<(u64, u32)>,
    /// Peers' window buffers by (peer, window): `None` when the peer said it has none.
    remote: Mutex<HashMap<(usize, u32), Option<RemoteWindow>>>,
    /// The first fatal failure (a completion in error, a broken message).
    failure: Mutex<Option<String>>,
    /// Set when the rank's GIN is dropped.
    stop: AtomicBool,
    /// Live [`VerbsTransport`]s (the proxy's).
    transports: AtomicUsize,
    codec: ImmCodec,
    rank: usize,
    signal_count: u32,
}

impl Shared {
    /// Posts `wrs` on connection `ci`, the last one signaled, if the send queue has room for
    /// all of them. Returns the id of the last one (the current last id when `wrs` is empty),
    /// or `None` when the queue is too full now.
    fn post(&self, ci: usize, wrs: &[Wr]) -> Result<Option<u64>, String> {
        let c = &self.conns[ci];
        let mut posted = lock(&c.posted);
        if wrs.is_empty() {
            return Ok(Some(*posted));
        }
        let busy = posted.saturating_sub(c.completed.load(Ordering::Acquire));
        if busy + wrs.len() as u64 > u64::from(SQ_DEPTH) {
            return Ok(None);
        }
        c.qp.post_send(wrs, *posted + 1, true)
            .map_err(|e| format!("{e} (to rank {}, context {})", c.peer, c.context))?;
        *posted += wrs.len() as u64;
        Ok(Some(*posted))
    }

    /// This rank's registered buffer of window `id` (`w`): registers it on first use.
    fn local_mr(&self, id: u32, w: &Window) -> Result<(RemoteWindow, u32)> {
        let mut mrs = lock(&self.local_mrs);
        if let Some(m) = mrs.get(&id) {
            return Ok((RemoteWindow { addr: m.addr, len: m.len, rkey: m.mr.rkey() }, m.mr.lkey()));
        }
        let len = w.size();
        let addr = w.local_addr(0, len)?;
        // SAFETY: this rank's live buffer of window `id`. It stays allocated while the window
        // lives; the region is deregistered by the progress thread once the window is gone,
        // and until then, if the buffer is freed, nvidia-peermem invalidates the region (GPU
        // memory) or its pages stay pinned (host memory): the NIC never writes memory that
        // has been handed to someone else.
        let mr = unsafe { Mr::register(&self.nic.pd, addr, len.max(1), &format!("window {id}"))? };
        let out = (RemoteWindow { addr, len: len as u64, rkey: mr.rkey() }, mr.lkey());
        mrs.insert(id, LocalMr { mr, addr, len: len as u64 });
        Ok(out)
    }

    /// The registered window buffer holding `bytes` at `addr`, if any: (window id, lkey).
    fn local_mr_holding(&self, addr: u64, bytes: usize) -> Option<(u32, u32)> {
        lock(&self.local_mrs)
            .iter()
            .find(|(_, m)| addr >= m.addr && addr.checked_add(bytes as u64).is_some_and(|e| e <= m.addr + m.len))
            .map(|(&id, m)| (id, m.mr.lkey()))
    }

    fn fail(&self, why: &str) {
        lock(&self.failure).get_or_insert_with(|| why.to_string());
    }

    fn failure(&self) -> Option<String> {
        lock(&self.failure).clone()
    }
}

/// A rank's verbs connections, from [`setup`]: keep it with the rank's GIN, and drop it when
/// the GIN is dropped (`GinOwner::drop`). Dropping it lets the progress thread end once the
/// proxy's transport is gone too.
pub(crate) struct VerbsSetup {
    shared: Option<Arc<Shared>>,
}

impl Drop for VerbsSetup {
    fn drop(&mut self) {
        if let Some(s) = &self.shared {
            s.stop.store(true, Ordering::SeqCst);
        }
    }
}

/// Every rank's verbs state, by its GIN: how [`VerbsTransport::new`] finds its rank's.
type Registry = Mutex<Vec<(Weak<GinRank>, Weak<Shared>)>>;

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Vec::new()))
}

fn registered(gin: &Arc<GinRank>) -> Option<Arc<Shared>> {
    lock(registry())
        .iter()
        .find(|(g, _)| g.upgrade().is_some_and(|g| Arc::ptr_eq(&g, gin)))
        .and_then(|(_, s)| s.upgrade())
}

/// Connects this rank's verbs queue pairs. **Collective** over `comm`: every rank calls it
/// during `gin::create`, after its `GinRank` exists and before the proxy starts, whether or
/// not it uses verbs (it makes two bootstrap collectives). `verbs_peers[p]` says whether this
/// rank reaches rank `p` through verbs (`kinds[p] == Some(TransportKind::Verbs)`); it must be
/// symmetric (rank `p` says the same of this rank), or every rank concerned fails with an
/// error that says so. A rank with no verbs peers opens nothing and needs no libibverbs.
/// When any rank fails, every rank returns an error that names it and why; none hangs.
pub(crate) fn setup(comm: &Communicator, gin: &Arc<GinRank>, verbs_peers: &[bool]) -> Result<VerbsSetup> {
    let signals = &gin.signals;
    // (Never `None`: the signal window has at least one slot. Checked in `prepare`, so that
    // this rank still takes part in the collectives if it were.)
    let flush_target = signals.local_addr(0, 8).ok().map(|a| (a, signals.size()));
    let params = Params {
        rank: comm.rank(),
        nranks: comm.nranks(),
        lsa_rank: comm.lsa_rank(),
        contexts: gin.contexts,
        signal_count: gin.signal_count,
        flush_target,
    };
    let Some(shared) = connect(comm.bootstrap().as_ref(), &params, verbs_peers, nic::open)? else {
        return Ok(VerbsSetup { shared: None });
    };
    {
        let mut reg = lock(registry());
        reg.retain(|(g, s)| g.strong_count() > 0 && s.strong_count() > 0);
        reg.push((Arc::downgrade(gin), Arc::downgrade(&shared)));
    }
    receiver::start(shared.clone(), Arc::downgrade(gin))?;
    Ok(VerbsSetup { shared: Some(shared) })
}

/// Before the exchange: this rank's NIC, queue pairs (in INIT, receives posted) and flush.
struct Local {
    nic: nic::Nic,
    cq: Arc<Cq>,
    conns: Vec<Conn>,
    flush: Flush,
    recv: HostRegion,
    by_ring: Vec<Option<usize>>,
    codec: ImmCodec,
}

impl Local {
    fn info_for(&self, rank: usize, peer: usize, contexts: u32) -> ConnInfo {
        let p = &self.nic.port;
        let nranks = self.by_ring.len() / contexts as usize;
        let qps = (0..contexts)
            .map(|c| {
                let conn = &self.conns
                    [self.by_ring[c as usize * nranks + peer].expect("a connection per context to each verbs peer")];
                QpEndpoint { qpn: conn.qp.qp_num(), psn: conn.psn }
            })
            .collect();
        ConnInfo {
            rank: rank as u32,
            link_layer: p.link_layer,
            mtu: p.mtu,
            lid: p.lid,
            gid: p.gid,
            sink_addr: self.flush.landing.addr(0),
            sink_rkey: self.flush.landing.rkey(),
            qps,
        }
    }
}

/// An error as another rank reads it (without this rank's "invalid argument:
/// FERROLINK_GIN_TRANSPORT=verbs:" prefix, which the reader adds again).
fn reason(e: &Error) -> String {
    match e {
        Error::InvalidArgument(m) => m.strip_prefix("FERROLINK_GIN_TRANSPORT=verbs: ").unwrap_or(m).to_string(),
        other => other.to_string(),
    }
}

/// A random 24-bit packet sequence number.
fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    let _ = getrandom::fill(&mut b);
    u32::from_le_bytes(b) & 0xff_ffff
}

/// Opens the NIC and makes everything the exchange describes.
fn prepare(p: &Params, verbs_peers: &[bool], open: impl FnOnce(usize) -> Result<nic::Nic>) -> Result<Local> {
    let codec = ImmCodec::new(p.nranks).map_err(setup_error)?;
    if u64::from(p.signal_count) > codec.id_limit() {
        return Err(setup_error(format!(
            "{} GIN signals do not fit the immediate data of a job of {} ranks (at most {})",
            p.signal_count,
            p.nranks,
            codec.id_limit()
        )));
    }
    let nic = open(p.lsa_rank)?;
    let peers: Vec<usize> = (0..p.nranks).filter(|&q| verbs_peers[q]).collect();
    let nconn = peers.len() * p.contexts as usize;
    let cq = Cq::new(&nic.ctx, nconn * (SQ_DEPTH + RQ_DEPTH) as usize + 16)?;
    let recv = HostRegion::new(&nic.pd, nconn * RQ_DEPTH as usize, "the receive buffers")?;
    let caps = QpCaps { send: SQ_DEPTH, recv: RQ_DEPTH, inline: MAX_INLINE };
    let mut conns = Vec::with_capacity(nconn);
    let mut by_ring = vec![None; p.contexts as usize * p.nranks];
    for context in 0..p.contexts {
        for &peer in &peers {
            let qp = Qp::new(&nic.pd, &cq, caps)?;
            qp.modify(&plan::to_init(nic.port.port))?;
            let ci = conns.len();
            for s in 0..RQ_DEPTH as usize {
                let slot = ci * RQ_DEPTH as usize + s;
                qp.post_recv(slot as u64, recv.addr(slot), 64, recv.lkey()).map_err(setup_error)?;
            }
            by_ring[context as usize * p.nranks + peer] = Some(ci);
            conns.push(Conn {
                qp,
                peer,
                context,
                psn: random_psn(),
                posted: Mutex::new(0),
                completed: AtomicU64::new(0),
            });
        }
    }
    let flush_cq = Cq::new(&nic.ctx, 4)?;
    let flush_qp = Qp::new(&nic.pd, &flush_cq, QpCaps { send: 2, recv: 1, inline: 0 })?;
    flush_qp.modify(&plan::to_init(nic.port.port))?;
    let (target_addr, target_len) =
        p.flush_target.ok_or_else(|| setup_error("this rank's GIN signal window has no word to flush through"))?;
    // SAFETY: this rank's signal window buffer, which lives as long as its GIN, and so as
    // long as `Shared` (the GIN owns the setup; the progress thread ends before the window).
    let target = unsafe { Mr::register(&nic.pd, target_addr, target_len.max(8), "the GIN signal window")? };
    let landing = HostRegion::new(&nic.pd, 1, "the flush landing")?;
    let flush = Flush { qp: flush_qp, cq: flush_cq, target, target_addr, landing, next_id: AtomicU64::new(1) };
    Ok(Local { nic, cq, conns, flush, recv, by_ring, codec })
}

/// Reads every rank's message to this one: for each peer, its end of the connection when
/// both ranks reach each other through verbs, else `None`. Errors when a rank failed, a
/// message is malformed, or two ranks disagree on whether they use verbs.
fn pair_up(rank: usize, verbs_peers: &[bool], contexts: u32, received: &[Vec<u8>]) -> Result<Vec<Option<ConnInfo>>> {
    let mut out = Vec::with_capacity(received.len());
    for (peer, bytes) in received.iter().enumerate() {
        let msg = ConnMsg::decode(bytes)
            .map_err(|e| Error::Bootstrap(format!("rank {peer}'s verbs connection message is malformed: {e}")))?;
        let asym = |who_uses: usize, who_not: usize| {
            setup_error(format!(
                "rank {who_uses} reaches rank {who_not} through verbs but rank {who_not} does not reach rank \
                 {who_uses} through verbs: set FERROLINK_GIN and FERROLINK_GIN_TRANSPORT alike on every rank"
            ))
        };
        out.push(match (verbs_peers[peer], msg) {
            (_, ConnMsg::Failed(why)) => {
                return Err(setup_error(format!("rank {peer} could not set up its RDMA NIC: {why}")));
            }
            (false, ConnMsg::Absent) => None,
            (true, ConnMsg::Absent) => return Err(asym(rank, peer)),
            (false, ConnMsg::Info(_)) => return Err(asym(peer, rank)),
            (true, ConnMsg::Info(info)) => {
                if info.rank as usize != peer || info.qps.len() != contexts as usize {
                    return Err(Error::Bootstrap(format!(
                        "rank {peer}'s verbs connection message says rank {} with {} contexts (expected {contexts})",
                        info.rank,
                        info.qps.len()
                    )));
                }
                Some(info)
            }
        });
    }
    Ok(out)
}

/// Moves every queue pair to RTS, given each peer's end.
fn go_live(local: Local, remote: Vec<Option<ConnInfo>>, p: &Params) -> Result<Shared> {
    let port = &local.nic.port;
    for c in &local.conns {
        let info = remote[c.peer].as_ref().expect("paired");
        let ep = info.qps[c.context as usize];
        let rtr = plan::to_rtr(port, info, ep).map_err(setup_error)?;
        c.qp.modify(&rtr)?;
        c.qp.modify(&plan::to_rts(c.psn))?;
    }
    // The flush queue pair talks to itself.
    let me = ConnInfo {
        rank: p.rank as u32,
        link_layer: port.link_layer,
        mtu: port.mtu,
        lid: port.lid,
        gid: port.gid,
        sink_addr: 0,
        sink_rkey: 0,
        qps: Vec::new(),
    };
    let psn = random_psn();
    let ep = QpEndpoint { qpn: local.flush.qp.qp_num(), psn };
    local.flush.qp.modify(&plan::to_rtr(port, &me, ep).map_err(setup_error)?)?;
    local.flush.qp.modify(&plan::to_rts(psn))?;
    let by_qpn = local.conns.iter().enumerate().map(|(i, c)| (c.qp.qp_num(), i)).collect();
    let sinks = local
        .conns
        .iter()
        .map(|c| {
            let info = remote[c.peer].as_ref().expect("paired");
            (info.sink_addr, info.sink_rkey)
        })
        .collect();
    Ok(Shared {
        conns: local.conns,
        flush: local.flush,
        recv: local.recv,
        local_mrs: Mutex::new(HashMap::new()),
        cq: local.cq,
        nic: local.nic,
        by_ring: local.by_ring,
        by_qpn,
        sinks,
        remote: Mutex::new(HashMap::new()),
        failure: Mutex::new(None),
        stop: AtomicBool::new(false),
        transports: AtomicUsize::new(0),
        codec: local.codec,
        rank: p.rank,
        signal_count: p.signal_count,
    })
}

/// The collective part of [`setup`]: prepare, exchange, connect, agree. `Ok(None)` when this
/// rank has no verbs peers (and every rank succeeded).
fn connect(
    bootstrap: &dyn Bootstrap,
    p: &Params,
    verbs_peers: &[bool],
    open: impl FnOnce(usize) -> Result<nic::Nic>,
) -> Result<Option<Arc<Shared>>> {
    if verbs_peers.len() != p.nranks {
        return Err(Error::InvalidArgument(format!("verbs setup: {} peers for {} ranks", verbs_peers.len(), p.nranks)));
    }
    let wanted = verbs_peers.iter().any(|&v| v);
    let local = if wanted { prepare(p, verbs_peers, open).map(Some) } else { Ok(None) };
    let msgs = (0..p.nranks)
        .map(|q| {
            if !verbs_peers[q] {
                return ConnMsg::Absent.encode();
            }
            match &local {
                Err(e) => ConnMsg::Failed(reason(e)),
                Ok(l) => ConnMsg::Info(l.as_ref().expect("wanted").info_for(p.rank, q, p.contexts)),
            }
            .encode()
        })
        .collect();
    let received = bootstrap.all_to_all(msgs)?;
    let mine: Result<Option<Shared>> = local.and_then(|local| {
        let remote = pair_up(p.rank, verbs_peers, p.contexts, &received)?;
        match local {
            None => Ok(None),
            Some(l) => go_live(l, remote, p).map(Some),
        }
    });
    let status = match &mine {
        Ok(_) => Vec::new(),
        Err(e) => reason(e).into_bytes(),
    };
    let all = bootstrap.all_gather(&status)?;
    let mine = mine?;
    if let Some((r, why)) = all.iter().enumerate().find(|(_, s)| !s.is_empty()) {
        return Err(setup_error(format!(
            "rank {r} failed to connect its verbs queue pairs: {}",
            String::from_utf8_lossy(why)
        )));
    }
    Ok(mine.map(Arc::new))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::bootstrap::in_process::InProcessBootstrap;
    use std::time::Duration;
    use wire::LinkLayer;

    fn params(rank: usize, nranks: usize) -> Params {
        Params { rank, nranks, lsa_rank: rank, contexts: 2, signal_count: 8, flush_target: None }
    }

    fn info(rank: u32, contexts: u32) -> ConnInfo {
        ConnInfo {
            rank,
            link_layer: LinkLayer::Infiniband,
            mtu: 5,
            lid: 1 + rank as u16,
            gid: [0; 16],
            sink_addr: 0x1000,
            sink_rkey: 1,
            qps: (0..contexts).map(|c| QpEndpoint { qpn: 0x40 + c, psn: c }).collect(),
        }
    }

    #[test]
    fn pairing_keeps_the_peers_both_sides_reach_through_verbs() {
        let got = vec![ConnMsg::Absent.encode(), ConnMsg::Info(info(1, 2)).encode(), ConnMsg::Absent.encode()];
        let paired = pair_up(0, &[false, true, false], 2, &got).unwrap();
        assert_eq!(paired, vec![None, Some(info(1, 2)), None]);
    }

    #[test]
    fn pairing_fails_when_ranks_disagree_or_a_rank_failed() {
        let absent = ConnMsg::Absent.encode();
        let e = pair_up(0, &[false, true], 2, &[absent.clone(), absent.clone()]).unwrap_err().to_string();
        assert!(e.contains("rank 0 reaches rank 1 through verbs but rank 1 does not"), "{e}");
        let e = pair_up(0, &[false, false], 2, &[absent.clone(), ConnMsg::Info(info(1, 2)).encode()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1 reaches rank 0 through verbs but rank 0 does not"), "{e}");
        let failed = ConnMsg::Failed("no RDMA device".into()).encode();
        let e = pair_up(0, &[false, true], 2, &[absent.clone(), failed]).unwrap_err().to_string();
        assert!(e.contains("rank 1 could not set up its RDMA NIC: no RDMA device"), "{e}");
        let e = pair_up(0, &[false, true], 2, &[absent.clone(), ConnMsg::Info(info(1, 3)).encode()]).unwrap_err();
        assert!(e.to_string().contains("3 contexts (expected 2)"), "{e}");
        let e = pair_up(0, &[false, true], 2, &[absent.clone(), ConnMsg::Info(info(2, 2)).encode()]).unwrap_err();
        assert!(e.to_string().contains("says rank 2"), "{e}");
        assert!(pair_up(0, &[false, true], 2, &[absent, vec![1, 2, 3]]).is_err());
    }

    /// Runs `connect` on `n` in-process ranks whose NIC opening is `open(rank)`.
    fn run_ranks(
        n: usize,
        peers: impl Fn(usize) -> Vec<bool> + Sync,
        open: impl Fn(usize) -> Result<nic::Nic> + Sync,
    ) -> Vec<Result<bool>> {
        let group = InProcessBootstrap::group(n, Duration::from_secs(20));
        std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .enumerate()
                .map(|(r, b)| {
                    let (peers, open) = (&peers, &open);
                    s.spawn(move || connect(b.as_ref(), &params(r, n), &peers(r), open).map(|s| s.is_some()))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("no panic")).collect()
        })
    }

    #[test]
    fn a_rank_that_cannot_open_its_nic_fails_every_rank_with_its_reason_and_none_hangs() {
        // Ranks 1 and 2 reach each other through verbs and cannot open their NICs; rank 0
        // uses no verbs, and learns why the others failed in the final agreement.
        let results = run_ranks(
            3,
            |r| (0..3).map(|q| r != 0 && q != 0 && q != r).collect(),
            |l| Err(setup_error(format!("no RDMA device (test, rank {l})"))),
        );
        let text: Vec<String> = results.iter().map(|r| r.as_ref().expect_err("every rank fails").to_string()).collect();
        assert!(text[1].contains("no RDMA device (test, rank 1)"), "{}", text[1]);
        assert!(text[2].contains("no RDMA device (test, rank 2)"), "{}", text[2]);
        assert!(text[0].contains("rank 1 failed to connect"), "{}", text[0]);
        assert!(text[0].contains("no RDMA device (test, rank 1)"), "{}", text[0]);
        assert_eq!(text[0].matches("FERROLINK_GIN_TRANSPORT=verbs").count(), 1, "{}", text[0]);
    }

    #[test]
    fn ranks_without_verbs_peers_open_nothing_and_agree() {
        let results = run_ranks(2, |_| vec![false, false], |_| panic!("no NIC is opened without verbs peers"));
        assert!(results.iter().all(|r| matches!(r, Ok(false))), "{results:?}");
    }

    #[test]
    fn one_rank_using_verbs_to_a_rank_that_does_not_fails_both() {
        // Rank 0 would reach rank 1 through verbs, rank 1 not: whatever rank 0's NIC does,
        // both end with an error.
        let results = run_ranks(2, |r| vec![false, r == 0], |_| Err(setup_error("no RDMA device (test)")));
        assert!(results.iter().all(Result::is_err), "{results:?}");
        let e1 = results[1].as_ref().unwrap_err().to_string();
        assert!(e1.contains("rank 0"), "{e1}");
    }

    #[test]
    fn too_many_signals_for_the_immediate_data_is_a_set_up_error() {
        let p = Params { signal_count: 1 << 29, ..params(0, 8) };
        let e = prepare(&p, &[true; 8], |_| panic!("checked before opening")).err().unwrap().to_string();
        assert!(e.contains("do not fit the immediate data"), "{e}");
    }
}
