//! How the GIN proxy moves a descriptor's data and signal to a peer: one [`Transport`] per
//! kind, chosen per peer ([`TransportKind`]). Every transport keeps the order of what it is
//! given for one peer: a signal is applied after the data submitted before it.

pub(crate) mod ce;
pub(crate) mod tcp;
pub(crate) mod tcp_wire;
#[cfg(feature = "verbs")]
pub(crate) mod verbs;

use crate::Result;

/// Where a descriptor's data goes on the receiving rank: a window by its id, never an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RemoteLocation {
    /// The window's id ([`ferrolink_device::DevWindow::id`]).
    pub(crate) window: u32,
    /// The byte offset in the receiving rank's buffer.
    pub(crate) offset: u64,
}

/// What one descriptor asks a transport to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Payload {
    /// Copy `bytes` from this rank's device address `src` (in window `src_window`) to `dst`.
    Put { src: u64, src_window: u32, bytes: usize, dst: RemoteLocation },
    /// Store the low `bytes` bytes of `value` at `dst`.
    PutValue { value: u64, bytes: u32, dst: RemoteLocation },
    /// Nothing but the signal.
    None,
}

/// One request: a descriptor of ring `ring` (context × peer), ticket `ticket`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    /// The ring (`context * nranks + peer`).
    pub(crate) ring: usize,
    /// The descriptor's ticket on its ring.
    pub(crate) ticket: u64,
    /// The context.
    pub(crate) context: u32,
    /// The destination world rank.
    pub(crate) peer: usize,
    /// What to move.
    pub(crate) payload: Payload,
    /// The remote action: add `.1` to signal `.0` once the payload has landed.
    pub(crate) signal: Option<(u32, u64)>,
}

/// A way to reach peers. `submit` starts a request; `poll` reports requests whose source may
/// be reused (local completion), in submission order per ring.
pub(crate) trait Transport: Send {
    /// A short name for logs and errors.
    fn name(&self) -> &'static str;
    /// Starts `req` (in order after everything submitted before for the same peer).
    fn submit(&mut self, req: &Request) -> Result<()>;
    /// Appends `(ring, ticket)` of requests completed locally since the last call.
    fn poll(&mut self, done: &mut Vec<(usize, u64)>) -> Result<()>;
    /// Requests submitted and not yet reported by `poll`.
    fn in_flight(&self) -> usize;
}

/// One operation a receiver applies, from a buffer of received bytes
/// ([`Deliver::deliver`]).
#[derive(Clone, Debug)]
pub(crate) enum Delivery {
    /// `buf[range]` goes at `dst`.
    Put { dst: RemoteLocation, range: std::ops::Range<usize> },
    /// The first `bytes` of `le` (a value's little-endian bytes) go at `dst`.
    PutValue { dst: RemoteLocation, le: [u8; 8], bytes: u8 },
    /// Add `inc` to signal `id`.
    Signal { id: u32, inc: u64 },
}

/// What a receiving rank does with what arrives for it (the TCP transport's receiver side).
/// Implemented by the rank's GIN state.
pub(crate) trait Deliver: Send + Sync {
    /// Aborts the communicator: what arrives is broken (a peer died mid-transfer).
    fn fail(&self, why: String);
    /// Writes `data` at `dst` of this rank's window, sent by world rank `from`; done when it
    /// returns.
    fn put(&self, from: usize, dst: RemoteLocation, data: &[u8]) -> Result<()>;
    /// Stores the low `bytes` bytes of `value` at `dst`.
    fn put_value(&self, from: usize, dst: RemoteLocation, value: u64, bytes: u32) -> Result<()>;
    /// Adds `inc` to signal `id` for sender `from`: written after everything `from`
    /// delivered before on this connection.
    fn signal(&self, from: usize, id: u32, inc: u64) -> Result<()>;
    /// Applies `ops`, sent by world rank `from`, in order (a put's data is `buf[range]`): a
    /// signal is written after the data before it. Everything it applied has landed when it
    /// returns, also when it fails; then the operations before the failed one were applied
    /// and none after it. `buf_device`: the device address of `buf` where it lies in pinned
    /// memory of the device ([`Deliver::staging`]). This default applies them one by one;
    /// the rank's GIN queues them all and waits once.
    fn deliver(&self, from: usize, buf: &[u8], buf_device: Option<u64>, ops: &[Delivery]) -> Result<()> {
        let _ = buf_device;
        for op in ops {
            match op {
                Delivery::Put { dst, range } => self.put(from, *dst, &buf[range.clone()])?,
                Delivery::PutValue { dst, le, bytes } => {
                    self.put_value(from, *dst, u64::from_le_bytes(*le), u32::from(*bytes))?
                }
                Delivery::Signal { id, inc } => self.signal(from, *id, *inc)?,
            }
        }
        Ok(())
    }
    /// Rank `from`'s connection ended without its goodbye (its process died, or exited before
    /// its proxy said goodbye). Not an error by itself: the rank may have had nothing more
    /// to send. Waits that are stalled while a peer is lost abort the communicator.
    fn peer_lost(&self, from: usize, why: String);
    /// Host memory of at least `bytes` bytes to receive data into before [`Deliver::put`]
    /// copies it to the device: a block of the rank's staging pool, pinned where the device
    /// has it (the copy then runs at full speed), which goes back to the pool when dropped.
    /// Never allocates pinned memory (that may wait for running kernels). `None` (no pool, the
    /// pool is empty, or `bytes` is more than a block): the receiver uses ordinary memory.
    fn staging(&self, bytes: usize) -> Option<crate::gin::staging::StagingBlock> {
        let _ = bytes;
        None
    }
}

/// The transports (`FERROLINK_GIN_TRANSPORT`).
///
/// ```
/// # use ferrolink::{CommConfig, Communicator, DevCommRequirements, Device, LsaMode, TransportKind};
/// # fn main() -> ferrolink::Result<()> {
/// let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// // Two LSA domains of one rank each: neither rank's memory is mapped on the other's side.
/// let config = CommConfig { lsa: LsaMode::Size(1), ..CommConfig::from_env(dev.backend())? };
/// let comms = Communicator::init_all_with(&[dev.clone(), dev], config)?;
/// let ce = Some(TransportKind::CopyEngine);
/// let reqs = DevCommRequirements { gin_signal_count: 1, gin_transport: ce, ..Default::default() };
/// let err = ferrolink::run_ranks(&comms, |c| c.create_dev_comm(&reqs)).unwrap_err();
/// assert!(err.to_string().contains("cannot reach rank")); // the copy engine needs a mapping
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// The copy engine into the peer's memory mapped here (LSA peers reached through the
    /// proxy).
    CopyEngine,
    /// TCP: one ordered connection per (context, peer); the receiver writes the data, then the
    /// signal.
    Tcp,
    /// RDMA verbs (cargo feature `verbs`): one RC queue pair per (context, peer), RDMA WRITEs
    /// into the peer's window, then the signal on the same queue pair. Never run on hardware.
    #[cfg(feature = "verbs")]
    Verbs,
}

impl TransportKind {
    /// `FERROLINK_GIN_TRANSPORT`: `ce`, `tcp` (`verbs` with the cargo feature `verbs`), or
    /// `auto` or unset (the copy engine where the peer's memory is mapped here, else TCP).
    ///
    /// ```
    /// use ferrolink::TransportKind;
    /// // SAFETY: no other thread of this program reads or writes the environment meanwhile.
    /// unsafe { std::env::set_var("FERROLINK_GIN_TRANSPORT", "tcp") };
    /// assert_eq!(TransportKind::from_env()?, Some(TransportKind::Tcp));
    /// // SAFETY: as above.
    /// unsafe { std::env::remove_var("FERROLINK_GIN_TRANSPORT") };
    /// assert_eq!(TransportKind::from_env()?, None); // chosen per peer
    /// # Ok::<(), ferrolink::Error>(())
    /// ```
    pub fn from_env() -> Result<Option<TransportKind>> {
        match std::env::var("FERROLINK_GIN_TRANSPORT").as_deref() {
            Err(_) | Ok("") | Ok("auto") => Ok(None),
            Ok("ce") => Ok(Some(TransportKind::CopyEngine)),
            Ok("tcp") => Ok(Some(TransportKind::Tcp)),
            #[cfg(feature = "verbs")]
            Ok("verbs") => Ok(Some(TransportKind::Verbs)),
            #[cfg(not(feature = "verbs"))]
            Ok("verbs") => Err(crate::Error::InvalidArgument(
                "FERROLINK_GIN_TRANSPORT=verbs: the RDMA transport is not built in (cargo feature `verbs`)".into(),
            )),
            Ok(other) => Err(crate::Error::InvalidArgument(format!(
                "FERROLINK_GIN_TRANSPORT={other:?}: use `ce`, `tcp` or `auto`"
            ))),
        }
    }
}
