//! The GIN proxy: one thread per rank that reads the rank's rings in host memory and executes
//! their descriptors through the transports.
//!
//! # Ordering on the host side
//! A ring's slot for ticket `t` is ready when its sequence word reads `t + 1`: the GPU wrote
//! the other words first and the sequence word last with a release at system scope, and the
//! proxy reads the sequence word with an acquire load before the others, so it sees the whole
//! descriptor (and the source data the coop wrote before posting). The proxy takes tickets of
//! a ring in order and gives them to one transport, which keeps their order to the peer.
//! When a transport reports a request complete locally (its source may be reused), the proxy
//! raises the request's counter, then stores `ticket + 1` into the ring's consumed word with a
//! release: a kernel that sees the consumed word (flush, or the credit of a full ring) may
//! reuse the source and the slot.

use super::GinRank;
use super::transport::{Payload, RemoteLocation, Request, Transport, TransportKind};
use crate::Result;
use crate::mem::window::Window;
use ferrolink_device::gin::{GinDescriptor, desc_flags, op};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use std::time::{Duration, Instant};

/// Starts the proxy thread of `gin`'s rank (it ends when the rank's GIN is dropped).
pub(crate) fn start(gin: &Arc<GinRank>) -> Result<()> {
    let weak = Arc::downgrade(gin);
    let rank = gin.rank;
    std::thread::Builder::new()
        .name(format!("ferrolink-gin-proxy-{rank}"))
        .spawn(move || run(weak))
        .map_err(|e| crate::Error::InvalidArgument(format!("could not start the GIN proxy thread: {e}")))?;
    Ok(())
}

/// How long the proxy spins without work before it starts to sleep between looks.
const SPIN: Duration = Duration::from_millis(5);
/// Its sleep when idle for longer.
const IDLE_SLEEP: Duration = Duration::from_micros(200);

/// How long a stopping proxy waits for its transports' last requests before it gives up
/// on them (and leaks their memory rather than free it under a copy).
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// The proxy's own state (only its thread touches it).
struct Proxy {
    transports: HashMap<TransportKind, Box<dyn Transport>>,
    /// Per ring, the next ticket to execute.
    next: Vec<u64>,
    /// What `(ring, ticket)` leaves to do or hold until it completes locally: the counter to
    /// raise, and the source window, kept alive while a transport may still read it (the
    /// kernel may have ended, and its windows been dropped, before the proxy ran the put).
    holds: HashMap<(usize, u64), (Option<u32>, Option<Window>)>,
    done: Vec<(usize, u64)>,
}

fn run(weak: Weak<GinRank>) {
    let mut p = Proxy { transports: HashMap::new(), next: Vec::new(), holds: HashMap::new(), done: Vec::new() };
    let mut last_work = Instant::now();
    let mut stopping_since: Option<Instant> = None;
    loop {
        let Some(gin) = weak.upgrade() else { return };
        let stop = gin.stop.load(Ordering::SeqCst);
        let worked = match p.sweep(&gin).and_then(|a| Ok(a | p.progress(&gin)?)) {
            Ok(w) => w,
            Err(why) => {
                gin.fail(why);
                return;
            }
        };
        if stop {
            // Every kernel that used this GIN has ended (the owner is dropped after them):
            // what the rings hold is all there will be. End once it has all completed.
            let since = *stopping_since.get_or_insert_with(Instant::now);
            let in_flight: usize = p.transports.values().map(|t| t.in_flight()).sum();
            if !worked && in_flight == 0 {
                return;
            }
            if since.elapsed() > DRAIN_LIMIT {
                tracing::error!(target: "ferrolink::gin", rank = gin.rank, in_flight, "the GIN proxy stops with requests in flight; their memory is leaked");
                std::mem::forget(std::mem::take(&mut p.transports));
                std::mem::forget(std::mem::take(&mut p.holds));
                return;
            }
        }
        drop(gin);
        if worked {
            last_work = Instant::now();
        } else if last_work.elapsed() < SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(IDLE_SLEEP);
        }
    }
}

impl Proxy {
    /// Submits every ready descriptor of every ring. Whether there was one.
    fn sweep(&mut self, gin: &Arc<GinRank>) -> std::result::Result<bool, String> {
        let rings = gin.contexts as usize * gin.nranks;
        if self.next.len() != rings {
            self.next = vec![0; rings];
        }
        let mut worked = false;
        for ring in 0..rings {
            let peer = ring % gin.nranks;
            let Some(kind) = gin.kinds[peer] else { continue };
            loop {
                let t = self.next[ring];
                let slot = t % u64::from(gin.depth);
                if gin.ring_word(ring, slot, 0).load(Ordering::Acquire) != t + 1 {
                    break;
                }
                let mut words = [0u64; 8];
                for (w, word) in words.iter_mut().enumerate().skip(1) {
                    *word = gin.ring_word(ring, slot, w).load(Ordering::Relaxed);
                }
                let d: GinDescriptor = bytemuck::cast(words);
                self.next[ring] = t + 1;
                worked = true;
                let (req, source) = request(gin, ring, t, &d)
                    .map_err(|e| format!("bad descriptor on the ring to rank {peer}: {e} (ticket {t}: {d:?})"))?;
                let counter = (d.flags() & desc_flags::LOCAL_COUNTER_INC != 0).then_some(d.counter_id);
                if counter.is_some() || source.is_some() {
                    self.holds.insert((ring, t), (counter, source));
                }
                let tr = match self.transports.entry(kind) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(make(kind, gin).map_err(|e| format!("cannot start the {kind:?} transport: {e}"))?)
                    }
                };
                tr.submit(&req).map_err(|e| format!("{} transport to rank {}: {e}", tr.name(), req.peer))?;
                // Give the ring's slots back as soon as possible: at most `depth` per look.
                if self.next[ring].is_multiple_of(u64::from(gin.depth)) {
                    break;
                }
            }
        }
        Ok(worked)
    }

    /// Reports local completions: raises their counters, then gives their slots back.
    fn progress(&mut self, gin: &GinRank) -> std::result::Result<bool, String> {
        let mut worked = false;
        for tr in self.transports.values_mut() {
            self.done.clear();
            tr.poll(&mut self.done).map_err(|e| format!("{} transport: {e}", tr.name()))?;
            for &(ring, ticket) in &self.done {
                if let Some((Some(id), _source)) = self.holds.remove(&(ring, ticket))
                    && id < gin.counter_count
                {
                    gin.counter(id).fetch_add(1, Ordering::Release);
                }
                // Release: a kernel that acquires this word may reuse the source and the slot.
                gin.consumed(ring).store(ticket + 1, Ordering::Release);
            }
            worked |= !self.done.is_empty();
        }
        Ok(worked)
    }
}

fn make(kind: TransportKind, gin: &Arc<GinRank>) -> Result<Box<dyn Transport>> {
    Ok(match kind {
        TransportKind::CopyEngine => Box::new(super::transport::ce::CopyEngine::new(gin.clone())),
        TransportKind::Tcp => Box::new(super::transport::tcp::TcpTransport::new(gin)?),
        #[cfg(feature = "verbs")]
        TransportKind::Verbs => Box::new(super::transport::verbs::VerbsTransport::new(gin)?),
    })
}

/// The request a descriptor describes, with its source resolved to a device address here,
/// and the source window (a put's) to keep alive until the request completes locally.
fn request(gin: &GinRank, ring: usize, ticket: u64, d: &GinDescriptor) -> Result<(Request, Option<Window>)> {
    let peer = ring % gin.nranks;
    let context = (ring / gin.nranks) as u32;
    if d.peer as usize != peer {
        return Err(crate::Error::InvalidArgument(format!(
            "a descriptor for rank {} on the ring to rank {peer}",
            d.peer
        )));
    }
    let dst = RemoteLocation { window: d.dst_window, offset: d.dst_offset };
    let mut source = None;
    let payload = match d.op() {
        op::PUT => {
            let bytes = d.bytes_or_value as usize;
            let src_window = gin.window(d.src_window).ok_or_else(|| {
                crate::Error::InvalidArgument(format!("source window {} is not registered", d.src_window))
            })?;
            let src = src_window.local_addr(d.src_offset as usize, bytes)?;
            source = Some(src_window);
            Payload::Put { src, src_window: d.src_window, bytes, dst }
        }
        op::PUT_VALUE => Payload::PutValue { value: d.bytes_or_value, bytes: d.value_bytes(), dst },
        op::SIGNAL => Payload::None,
        other => return Err(crate::Error::InvalidArgument(format!("unknown GIN operation {other}"))),
    };
    let signal = match d.flags() & desc_flags::REMOTE_MASK {
        desc_flags::REMOTE_SIGNAL_INC => Some((d.signal_id, 1)),
        desc_flags::REMOTE_SIGNAL_ADD => Some((d.signal_id, d.signal_value)),
        _ => None,
    };
    Ok((Request { ring, ticket, context, peer, payload, signal }, source))
}
