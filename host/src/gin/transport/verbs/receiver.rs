//! The progress thread: reaps the completion queue of a rank's queue pairs. Send completions
//! advance each queue pair's completed id (the proxy's `poll` reads it); receives are signals
//! (flushed, then applied through [`Deliver::signal`]) and control messages (window keys,
//! answered or recorded); every receive buffer is posted again once read.

use super::ffi::{self, ibv_wc};
use super::plan;
use super::wire::{self, Control, Incoming};
use super::{RQ_DEPTH, Shared};
use crate::gin::GinRank;
use crate::gin::transport::Deliver;
use crate::runtime::lifetime::lock;
use crate::{Error, Result};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long the thread spins without work before it sleeps between looks.
const SPIN: Duration = Duration::from_millis(5);
/// Its sleep when idle for longer.
const IDLE_SLEEP: Duration = Duration::from_micros(50);
/// How often it deregisters the buffers of windows that are gone.
const PRUNE_EVERY: Duration = Duration::from_secs(1);
/// How long a flush may take (the queue pair's own retries fail it sooner).
const FLUSH_LIMIT: Duration = Duration::from_secs(30);

/// Starts the progress thread of a rank's verbs connections.
pub(super) fn start(shared: Arc<Shared>, gin: Weak<GinRank>) -> Result<()> {
    let rank = shared.rank;
    std::thread::Builder::new()
        .name(format!("ferrolink-gin-verbs-{rank}"))
        .spawn(move || run(&shared, &gin))
        .map_err(|e| Error::InvalidArgument(format!("could not start the GIN verbs progress thread: {e}")))?;
    Ok(())
}

/// What the thread carries from one look to the next.
#[derive(Default)]
struct Progress {
    /// Signals reaped in this look, applied after the flush.
    signals: Vec<(usize, u32, u64)>,
    /// Answers waiting for room in their send queue: (connection, message).
    answers: VecDeque<(usize, Control)>,
}

fn run(shared: &Shared, gin: &Weak<GinRank>) {
    let mut wcs = vec![ibv_wc::default(); 64];
    let mut st = Progress::default();
    let mut last_work = Instant::now();
    let mut last_prune = Instant::now();
    loop {
        let idle_owner = shared.stop.load(Ordering::SeqCst) || gin.strong_count() == 0;
        if idle_owner && shared.transports.load(Ordering::SeqCst) == 0 {
            return;
        }
        match look(shared, gin, &mut wcs, &mut st) {
            Ok(true) => last_work = Instant::now(),
            Ok(false) => {}
            Err(why) => {
                shared.fail(&why);
                if shared.stop.load(Ordering::SeqCst) {
                    // The rank's GIN is being dropped: a peer that tore its queue pairs down
                    // first is not a reason to abort the communicator.
                    let rank = shared.rank;
                    tracing::warn!(target: "ferrolink::gin", rank, "GIN verbs transport, stopping: {why}");
                } else if let Some(g) = gin.upgrade() {
                    Deliver::fail(&*g, format!("GIN verbs transport: {why}"));
                }
                return;
            }
        }
        if last_prune.elapsed() > PRUNE_EVERY {
            last_prune = Instant::now();
            if let Some(g) = gin.upgrade() {
                lock(&shared.local_mrs).retain(|&id, _| g.window(id).is_some());
            }
        }
        if last_work.elapsed() < SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(IDLE_SLEEP);
        }
    }
}

/// One look at the completion queue. Whether anything happened.
fn look(shared: &Shared, gin: &Weak<GinRank>, wcs: &mut [ibv_wc], st: &mut Progress) -> Result<bool, String> {
    let n = shared.cq.poll(wcs)?;
    for wc in &wcs[..n] {
        let ci = shared.by_qpn.get(&wc.qp_num).copied();
        let conn_name = |ci: Option<usize>| match ci {
            Some(i) => format!("rank {}, context {}", shared.conns[i].peer, shared.conns[i].context),
            None => format!("unknown QP {:#x}", wc.qp_num),
        };
        if wc.status != ffi::IBV_WC_SUCCESS {
            return Err(format!(
                "a work request on the connection to {} failed: {} (vendor error {:#x})",
                conn_name(ci),
                shared.cq.lib().status_str(wc.status),
                wc.vendor_err
            ));
        }
        let Some(ci) = ci else { return Err(format!("a completion for {}", conn_name(None))) };
        if wc.opcode & ffi::IBV_WC_RECV == 0 {
            shared.conns[ci].completed.fetch_max(wc.wr_id, Ordering::Release);
            continue;
        }
        let slot = wc.wr_id as usize;
        if slot / RQ_DEPTH as usize != ci {
            return Err(format!("receive {slot} completed on the connection to {}", conn_name(Some(ci))));
        }
        let rdma_write = wc.opcode == ffi::IBV_WC_RECV_RDMA_WITH_IMM;
        let imm = (wc.wc_flags & ffi::IBV_WC_WITH_IMM != 0).then(|| u32::from_be(wc.imm_data));
        let payload = if rdma_write {
            Vec::new()
        } else {
            // SAFETY: this slot's receive has completed and it is not posted again until
            // below.
            unsafe { shared.recv.read(slot, wc.byte_len as usize) }
        };
        let conn = &shared.conns[ci];
        let incoming = wire::classify(&shared.codec, conn.peer, rdma_write, imm, &payload)
            .map_err(|e| format!("from {}: {e}", conn_name(Some(ci))))?;
        conn.qp.post_recv(slot as u64, shared.recv.addr(slot), 64, shared.recv.lkey())?;
        match incoming {
            Incoming::Signal { from, id, inc } => {
                if id >= shared.signal_count {
                    return Err(format!("signal {id} from rank {from} is out of range ({})", shared.signal_count));
                }
                st.signals.push((from, id, inc));
            }
            Incoming::Control { msg: Control::WindowRequest { window }, .. } => {
                let Some(g) = gin.upgrade() else { continue };
                let found = match g.window(window) {
                    None => None,
                    Some(w) => Some(shared.local_mr(window, &w).map_err(|e| e.to_string())?.0),
                };
                st.answers.push_back((ci, Control::WindowAnswer { window, found }));
            }
            Incoming::Control { from, msg: Control::WindowAnswer { window, found } } => {
                lock(&shared.remote).insert((from, window), found);
            }
        }
    }
    if !st.signals.is_empty() {
        flush(shared)?;
        let g = gin.upgrade();
        for (from, id, inc) in st.signals.drain(..) {
            if let Some(g) = &g {
                Deliver::signal(&**g, from, id, inc).map_err(|e| e.to_string())?;
            }
        }
    }
    while let Some(&(ci, msg)) = st.answers.front() {
        let wr = plan::plan_control(&shared.codec, shared.rank, msg.encode())?;
        match shared.post(ci, &[wr])? {
            Some(_) => {
                st.answers.pop_front();
            }
            None => break,
        }
    }
    Ok(n > 0)
}

/// Waits until every write the NIC made to this rank's GPU before now has landed: an RDMA
/// READ of a word of the GPU's memory, through the queue pair connected to itself (module
/// docs, "Ordering").
fn flush(shared: &Shared) -> Result<(), String> {
    let f = &shared.flush;
    let id = f.next_id.fetch_add(1, Ordering::Relaxed);
    let read = plan::Wr::Read {
        local: f.landing.addr(0),
        lkey: f.landing.lkey(),
        len: 8,
        remote: f.target_addr,
        rkey: f.target.rkey(),
    };
    f.qp.post_send(&[read], id, true).map_err(|e| format!("flush: {e}"))?;
    let mut wc = [ibv_wc::default()];
    let start = Instant::now();
    loop {
        if f.cq.poll(&mut wc)? == 1 {
            if wc[0].status != ffi::IBV_WC_SUCCESS {
                return Err(format!("the flush read failed: {}", f.cq.lib().status_str(wc[0].status)));
            }
            return Ok(());
        }
        if start.elapsed() > FLUSH_LIMIT {
            return Err(format!("the flush read did not complete within {FLUSH_LIMIT:?}"));
        }
        std::hint::spin_loop();
    }
}
