//! The proxy's side: [`VerbsTransport`] turns requests into work requests and posts them, in
//! order per queue pair, parking the ones that wait for a window's key or for room in the send
//! queue; `poll` reports requests whose last work request has completed.

use super::plan::{self, Keys};
use super::wire::{Control, RemoteWindow};
use super::{SQ_DEPTH, Shared, registered, setup_error};
use crate::gin::GinRank;
use crate::gin::transport::{Payload, Request, Transport};
use crate::mem::window::Window;
use crate::runtime::lifetime::lock;
use crate::{Error, Result};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long a peer may take to answer for a window's key.
const KEY_TIMEOUT: Duration = Duration::from_secs(60);

/// A request posted and not yet reported.
struct Posted {
    ring: usize,
    ticket: u64,
    /// The id of its last work request.
    last: u64,
    /// Its source window, kept alive until the NIC has read it.
    _keep: Option<Window>,
}

#[derive(Default)]
struct Queue {
    posted: VecDeque<Posted>,
    /// Requests not posted yet, in order (nothing behind a parked request is posted).
    parked: VecDeque<Request>,
}

/// The verbs transport of a rank's proxy (module docs of [`super`]).
pub(crate) struct VerbsTransport {
    shared: Arc<Shared>,
    gin: Arc<GinRank>,
    queues: Vec<Queue>,
    /// Keys asked for and not answered yet, with when.
    asked: HashMap<(usize, u32), Instant>,
    /// Window ids this rank's requests named (the same on every rank).
    seen_windows: BTreeSet<u32>,
}

impl VerbsTransport {
    /// The transport of `gin`'s rank, on the connections its `setup` made.
    pub(crate) fn new(gin: &Arc<GinRank>) -> Result<VerbsTransport> {
        let shared = registered(gin).ok_or_else(|| {
            setup_error(format!(
                "rank {} has no verbs connections (gin::create did not call verbs::setup, or they are shut down)",
                gin.rank
            ))
        })?;
        shared.transports.fetch_add(1, Ordering::SeqCst);
        let queues = (0..shared.conns.len()).map(|_| Queue::default()).collect();
        Ok(VerbsTransport { shared, gin: gin.clone(), queues, asked: HashMap::new(), seen_windows: BTreeSet::new() })
    }

    fn check(&self) -> Result<()> {
        match self.shared.failure() {
            Some(why) => Err(Error::Aborted(format!("GIN verbs transport: {why}"))),
            None => Ok(()),
        }
    }

    /// Posts what it can of connection `ci`'s parked requests, in order.
    fn advance(&mut self, ci: usize) -> Result<()> {
        while let Some(req) = self.queues[ci].parked.front().copied() {
            match self.try_post(ci, &req)? {
                Some(p) => {
                    self.queues[ci].parked.pop_front();
                    self.queues[ci].posted.push_back(p);
                }
                None => break,
            }
        }
        Ok(())
    }

    /// Posts `req` if its keys are known and the send queue has room.
    fn try_post(&mut self, ci: usize, req: &Request) -> Result<Option<Posted>> {
        let dst = match req.payload {
            Payload::Put { dst, .. } | Payload::PutValue { dst, .. } => {
                self.seen_windows.insert(dst.window);
                match self.remote_key(ci, req.peer, dst.window)? {
                    Some(k) => Some(k),
                    None => return Ok(None),
                }
            }
            Payload::None => None,
        };
        let (src_lkey, keep) = match req.payload {
            Payload::Put { src, bytes, .. } if bytes > 0 => {
                let (lkey, w) = self.source(req, src, bytes)?;
                (Some(lkey), Some(w))
            }
            _ => (None, None),
        };
        let keys =
            Keys { me: self.shared.rank, src_lkey, dst, max_msg: self.shared.nic.max_msg, sink: self.shared.sinks[ci] };
        let wrs = plan::plan_request(req, &self.shared.codec, &keys)
            .map_err(|e| Error::InvalidArgument(format!("a GIN request to rank {}: {e}", req.peer)))?;
        if wrs.len() > SQ_DEPTH as usize {
            return Err(Error::InvalidArgument(format!(
                "a GIN put of {} work requests is more than a send queue holds ({SQ_DEPTH})",
                wrs.len()
            )));
        }
        let last = self.shared.post(ci, &wrs).map_err(|e| Error::Aborted(format!("GIN verbs transport: {e}")))?;
        Ok(last.map(|last| Posted { ring: req.ring, ticket: req.ticket, last, _keep: keep }))
    }

    /// The peer's buffer of `window`, or `None` while its key is being asked for.
    fn remote_key(&mut self, ci: usize, peer: usize, window: u32) -> Result<Option<RemoteWindow>> {
        if let Some(k) = lock(&self.shared.remote).get(&(peer, window)) {
            return k.map(Some).ok_or_else(|| {
                Error::InvalidArgument(format!("rank {peer} has no window {window} (not registered there, or gone)"))
            });
        }
        if !self.asked.contains_key(&(peer, window)) {
            let msg = Control::WindowRequest { window }.encode();
            let wr = plan::plan_control(&self.shared.codec, self.shared.rank, msg).map_err(setup_error)?;
            match self.shared.post(ci, &[wr]).map_err(|e| Error::Aborted(format!("GIN verbs transport: {e}")))? {
                Some(_) => {
                    self.asked.insert((peer, window), Instant::now());
                }
                None => return Ok(None), // The send queue is full: ask on a later look.
            }
        }
        Ok(None)
    }

    /// The lkey of the registered source window holding `bytes` at `src`, and that window.
    fn source(&mut self, req: &Request, src: u64, bytes: usize) -> Result<(u32, Window)> {
        let holds =
            |w: &Window| w.local_addr(0, w.size()).is_ok_and(|a| src >= a && src + bytes as u64 <= a + w.size() as u64);
        if let Some(id) = source_window(req) {
            let w = self.gin.window(id).ok_or_else(|| Error::InvalidArgument(format!("source window {id} is gone")))?;
            let (_, lkey) = self.shared.local_mr(id, &w)?;
            return Ok((lkey, w));
        }
        // Without the id: a window already registered, else one this rank's requests named.
        if let Some((id, lkey)) = self.shared.local_mr_holding(src, bytes)
            && let Some(w) = self.gin.window(id)
        {
            return Ok((lkey, w));
        }
        for &id in &self.seen_windows {
            if let Some(w) = self.gin.window(id)
                && holds(&w)
            {
                let (_, lkey) = self.shared.local_mr(id, &w)?;
                return Ok((lkey, w));
            }
        }
        Err(Error::InvalidArgument(format!(
            "the verbs transport cannot find the window holding the source of a put ({bytes} bytes at {src:#x}): \
             requests do not carry their source window's id yet"
        )))
    }
}

/// The id of the window a request's source lies in, when the request says.
fn source_window(req: &Request) -> Option<u32> {
    match req.payload {
        Payload::Put { src_window, .. } => Some(src_window),
        _ => None,
    }
}

impl Transport for VerbsTransport {
    fn name(&self) -> &'static str {
        "RDMA verbs"
    }

    fn submit(&mut self, req: &Request) -> Result<()> {
        self.check()?;
        let ci = self.shared.by_ring.get(req.ring).copied().flatten().ok_or_else(|| {
            Error::InvalidArgument(format!("rank {} is not reached through verbs from this rank", req.peer))
        })?;
        self.queues[ci].parked.push_back(*req);
        self.advance(ci)
    }

    fn poll(&mut self, done: &mut Vec<(usize, u64)>) -> Result<()> {
        self.check()?;
        for ci in 0..self.queues.len() {
            self.advance(ci)?;
            let completed = self.shared.conns[ci].completed.load(Ordering::Acquire);
            let q = &mut self.queues[ci].posted;
            while q.front().is_some_and(|p| p.last <= completed) {
                let p = q.pop_front().expect("front exists");
                done.push((p.ring, p.ticket));
            }
        }
        if !self.asked.is_empty() {
            let remote = lock(&self.shared.remote);
            self.asked.retain(|k, _| !remote.contains_key(k));
            if let Some(((peer, window), _)) = self.asked.iter().find(|(_, t)| t.elapsed() > KEY_TIMEOUT) {
                return Err(Error::Aborted(format!(
                    "GIN verbs transport: rank {peer} did not answer for window {window} within {KEY_TIMEOUT:?}"
                )));
            }
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.queues.iter().map(|q| q.posted.len() + q.parked.len()).sum()
    }
}

impl Drop for VerbsTransport {
    fn drop(&mut self) {
        self.shared.transports.fetch_sub(1, Ordering::SeqCst);
    }
}
