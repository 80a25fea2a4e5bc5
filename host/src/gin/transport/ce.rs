//! The copy-engine transport: for peers whose memory is mapped on this rank's GPU (LSA peers
//! reached through the proxy). A put is a driver copy into the peer's slot of this rank's flat
//! window mapping; a signal is a stream-ordered write of the slot's new total
//! (`cuStreamWriteValue64`) after the copy, on the same stream. One stream per peer keeps
//! everything to a peer in order, across contexts (so a slot's totals only grow).

use super::{Payload, Request, Transport};
use crate::gin::GinRank;
use crate::mem::window::Window;
use crate::runtime::stream::{Event, Stream};
use crate::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// A request the copy engine has queued: its ring and ticket, the event after its work, and
/// the windows it writes (kept alive until the event).
type InFlight = (usize, u64, Event, Vec<Window>);

pub(crate) struct CopyEngine {
    gin: Arc<GinRank>,
    streams: HashMap<usize, Stream>,
    /// Per peer: the total this rank has added to each of the peer's `[signal][me]` slots.
    sent: HashMap<(usize, u32), u64>,
    /// Requests in flight per peer, in order, with the windows they use (kept alive).
    pending: HashMap<usize, VecDeque<InFlight>>,
}

impl CopyEngine {
    pub(crate) fn new(gin: Arc<GinRank>) -> CopyEngine {
        CopyEngine { gin, streams: HashMap::new(), sent: HashMap::new(), pending: HashMap::new() }
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
        let stream = match self.streams.entry(req.peer) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(g.device.create_stream()?),
        };
        let mut keep = Vec::new();
        match req.payload {
            Payload::Put { src, bytes, dst, .. } => {
                let w = g
                    .window(dst.window)
                    .ok_or_else(|| Error::InvalidArgument(format!("window {} is gone", dst.window)))?;
                let dw = w.dev_window();
                if dst.offset.checked_add(bytes as u64).is_none_or(|e| e > dw.size) {
                    return Err(Error::InvalidArgument(format!("a put past the end of window {}", dst.window)));
                }
                let to = dw.lsa_ptr::<u8>(dst.offset as usize, lsa_peer) as u64;
                if bytes > 0 {
                    // SAFETY: `to` lies in the peer's slot of this GPU's mapping of window `w`
                    // (checked), `src` in this rank's source window (checked by the proxy);
                    // `keep` holds both windows until the copy has run; the GIN contract keeps
                    // others off the ranges.
                    unsafe { stream.copy_raw(to, src, bytes)? };
                }
                keep.push(w);
            }
            Payload::PutValue { value, bytes, dst } => {
                let w = g
                    .window(dst.window)
                    .ok_or_else(|| Error::InvalidArgument(format!("window {} is gone", dst.window)))?;
                let dw = w.dev_window();
                if dst.offset.checked_add(u64::from(bytes)).is_none_or(|e| e > dw.size) {
                    return Err(Error::InvalidArgument(format!("a value past the end of window {}", dst.window)));
                }
                let to = dw.lsa_ptr::<u8>(dst.offset as usize, lsa_peer) as u64;
                // SAFETY: as above; the device checked the alignment.
                unsafe { stream.write_value_raw(to, value, bytes)? };
                keep.push(w);
            }
            Payload::None => {}
        }
        if let Some((id, inc)) = req.signal {
            let total = self.sent.entry((req.peer, id)).or_insert(0);
            *total = total.wrapping_add(inc);
            let sw = g.signals.dev_window();
            let slot = sw.lsa_ptr::<u64>((id as usize * g.nranks + g.rank) * 8, lsa_peer) as u64;
            // SAFETY: the peer's slot `[id][me]` of this GPU's mapping of the signal window
            // (`g.signals` keeps it); only this rank writes it; after the data on this stream.
            unsafe { stream.write_value_raw(slot, *total, 8)? };
        }
        let event = stream.record_event()?;
        self.pending.entry(req.peer).or_default().push_back((req.ring, req.ticket, event, keep));
        Ok(())
    }

    fn poll(&mut self, done: &mut Vec<(usize, u64)>) -> Result<()> {
        for q in self.pending.values_mut() {
            while q.front().is_some_and(|(_, _, e, _)| e.is_reached()) {
                let (ring, ticket, _, _) = q.pop_front().expect("front exists");
                done.push((ring, ticket));
            }
        }
        for s in self.streams.values() {
            if let Some(e) = s.failure() {
                return Err(e);
            }
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.pending.values().map(VecDeque::len).sum()
    }
}
