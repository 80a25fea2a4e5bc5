//! The copy-engine transport: for peers whose memory is mapped on this rank's GPU (LSA peers
//! reached through the proxy). A put is a driver copy into the peer's slot of this rank's flat
//! window mapping; a signal is a stream-ordered write of the slot's new total
//! (`cuStreamWriteValue64`) after the copy, on the same stream. The rank's one copy stream
//! (`GinRank::copies`, made with its GIN) keeps everything to a peer in order, across contexts
//! (so a slot's totals only grow); one stream, not one per peer, so that the rank adds one
//! stream to the driver's hardware queues, not one per peer (see [`crate::gin::STREAM_QUEUES_VAR`]).

use super::{Payload, Request, Transport};
use crate::gin::GinRank;
use crate::mem::window::Window;
use crate::runtime::lifetime::Completion;
use crate::runtime::stream::Stream;
use crate::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// A request the copy engine has queued: its ring and ticket, the completion of its work,
/// and the window it writes (kept alive until then).
type InFlight = (usize, u64, Completion, Option<Window>);

/// Polls between two looks at the streams' failure (a driver call each): a failed stream
/// also shows as a finished completion, which makes the proxy look at once.
const FAILURE_CHECK_POLLS: u32 = 1024;

pub(crate) struct CopyEngine {
    gin: Arc<GinRank>,
    /// Per peer: the total this rank has added to each of the peer's `[signal][me]` slots.
    sent: HashMap<(usize, u32), u64>,
    /// Requests in flight per peer, in order, with the windows they use (kept alive).
    pending: HashMap<usize, VecDeque<InFlight>>,
    polls: u32,
}

impl CopyEngine {
    pub(crate) fn new(gin: Arc<GinRank>) -> CopyEngine {
        CopyEngine { gin, sent: HashMap::new(), pending: HashMap::new(), polls: 0 }
    }
}

impl Transport for CopyEngine {
    fn name(&self) -> &'static str {
        "copy engine"
    }

    fn submit(&mut self, req: &Request) -> Result<()> {
        let g = self.gin.clone();
        let lsa_peer = u32::try_from(req.peer % g.lsa_size).expect("small");
        if req.peer / g.lsa_size != g.rank / g.lsa_size {
            return Err(Error::InvalidArgument(format!(
                "rank {} is not mapped here (not in this rank's LSA domain): use the TCP transport",
                req.peer
            )));
        }
        let stream = g.copies.as_ref().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "rank {}: the copy-engine transport was not set up with this rank's GIN",
                g.rank
            ))
        })?;
        // What goes on the stream: the data (a copy, or a value written by the GPU's front
        // end), then the signal's new total; one completion for both.
        let mut copy = None;
        let mut writes: [(u64, u64, u32); 2] = [(0, 0, 0); 2];
        let mut n = 0;
        let mut keep = None;
        let mut target = |dst: super::RemoteLocation, bytes: u64| -> Result<u64> {
            let w =
                g.window(dst.window).ok_or_else(|| Error::InvalidArgument(format!("window {} is gone", dst.window)))?;
            let dw = w.dev_window();
            if dst.offset.checked_add(bytes).is_none_or(|e| e > dw.size) {
                return Err(Error::InvalidArgument(format!("a write past the end of window {}", dst.window)));
            }
            let to = dw.lsa_ptr::<u8>(dst.offset as usize, lsa_peer) as u64;
            keep = Some(w);
            Ok(to)
        };
        match req.payload {
            Payload::Put { src, bytes, dst, .. } => {
                let to = target(dst, bytes as u64)?;
                if bytes > 0 {
                    copy = Some((to, src, bytes));
                }
            }
            Payload::PutValue { value, bytes, dst } => {
                writes[n] = (target(dst, u64::from(bytes))?, value, bytes);
                n += 1;
            }
            Payload::None => {}
        }
        if let Some((id, inc)) = req.signal {
            let total = self.sent.entry((req.peer, id)).or_insert(0);
            *total = total.wrapping_add(inc);
            let sw = g.signals.dev_window();
            let slot = sw.lsa_ptr::<u64>((id as usize * g.nranks + g.rank) * 8, lsa_peer) as u64;
            writes[n] = (slot, *total, 8);
            n += 1;
        }
        // SAFETY: the copy's target and each value's lie in the peer's slot of this GPU's
        // mapping of their window (checked above), the source in this rank's source window
        // (checked by the proxy, which keeps it alive until this request completes); `keep`
        // holds the target window and `g.signals` the signal window until then. The signal
        // slot `[id][me]` is only written by this rank, after the data on this stream; the
        // GIN contract keeps others off the ranges; the device checked the values' alignment.
        let done = unsafe { stream.copy_then_write_raw(copy, &writes[..n])? };
        self.pending.entry(req.peer).or_default().push_back((req.ring, req.ticket, done, keep));
        Ok(())
    }

    fn poll(&mut self, done: &mut Vec<(usize, u64)>) -> Result<()> {
        let before = done.len();
        for q in self.pending.values_mut() {
            while q.front().is_some_and(|(_, _, c, _)| c.finished()) {
                let (ring, ticket, _, _) = q.pop_front().expect("front exists");
                done.push((ring, ticket));
            }
        }
        self.polls = self.polls.wrapping_add(1);
        if (done.len() > before || self.polls.is_multiple_of(FAILURE_CHECK_POLLS))
            && let Some(e) = self.gin.copies.as_ref().and_then(Stream::failure)
        {
            return Err(e);
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.pending.values().map(VecDeque::len).sum()
    }
}
