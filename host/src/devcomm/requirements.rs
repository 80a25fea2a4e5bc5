//! What a device communicator must provide (NCCL's `ncclDevCommRequirements`), and the
//! resources a library asks for beside the user's.

use crate::gin::GinMode;
use crate::gin::transport::TransportKind;
use ferrolink_device::LsaBarrierHandle;

/// A resource a library (or the user) asks the device communicator for, beside the default
/// ones, so that its kernels never collide with others' (NCCL's per-library
/// `ncclDevResourceRequirements`). Each request gives a [`ResourceId`]; after creation,
/// [`crate::DevCommHandle::resource`] turns it into the handle kernels use.
///
/// ```
/// use ferrolink::{DevCommRequirements, ResourceRequest};
/// let mut reqs = DevCommRequirements::default();
/// reqs.request(ResourceRequest::LsaBarriers { count: 4 });
/// assert_eq!(reqs.resources, [ResourceRequest::LsaBarriers { count: 4 }]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResourceRequest {
    /// A set of `count` LSA barriers of its own.
    LsaBarriers {
        /// Barriers in the set.
        count: u32,
    },
}

/// Names one [`ResourceRequest`] of a [`DevCommRequirements`].
///
/// ```
/// use ferrolink::{DevCommRequirements, ResourceRequest};
/// let mut reqs = DevCommRequirements::default();
/// let a = reqs.request(ResourceRequest::LsaBarriers { count: 4 });
/// let b = reqs.request(ResourceRequest::LsaBarriers { count: 4 });
/// assert_ne!(a, b); // one id per request, even for equal requests
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ResourceId(pub(crate) usize);

/// A created resource, as kernels receive it.
///
/// ```
/// # use ferrolink::{Communicator, DevCommRequirements, DevResource, Device, ResourceRequest};
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
/// let mut reqs = DevCommRequirements { lsa_barrier_count: 8, ..Default::default() };
/// let id = reqs.request(ResourceRequest::LsaBarriers { count: 2 });
/// let handles = ferrolink::create_dev_comms(&comms, &reqs)?;
/// match handles[0].resource(id)? {
///     DevResource::LsaBarriers(set) => assert_eq!((set.first, set.count), (8, 2)),
///     other => unreachable!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DevResource {
    /// A set of LSA barriers: pass it to kernels and open sessions with
    /// `LsaBarrierSession::with_set(coop, &comm, handle, index)`.
    LsaBarriers(LsaBarrierHandle),
}

/// What the kernels using a device communicator need (NCCL's `ncclDevCommRequirements`).
///
/// ```
/// use ferrolink::{DevCommRequirements, ResourceRequest};
/// let mut reqs = DevCommRequirements { lsa_barrier_count: 16, ..Default::default() };
/// // A library's own barriers, disjoint from the user's 16:
/// let lib_barriers = reqs.request(ResourceRequest::LsaBarriers { count: 8 });
/// # let _ = lib_barriers;
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevCommRequirements {
    /// LSA barriers of the default set ([`ferrolink_device::DevComm::lsa_barrier`]): one per
    /// CTA that synchronizes at a time; at least 1.
    pub lsa_barrier_count: u32,
    /// Windows the device-side window table can hold ([`crate::DevCommHandle::add_window`]).
    pub window_capacity: u32,
    /// Further resources, in request order ([`DevCommRequirements::request`]).
    pub resources: Vec<ResourceRequest>,
    /// GIN contexts (NCCL's `ginContextCount`): independent queues to every peer; order holds
    /// only within one. GIN resources exist when any `gin_*` count is set, or `gin_mode` or
    /// `gin_transport` is chosen; 0 then means 1.
    pub gin_context_count: u32,
    /// GIN signals (`ginSignalCount`): ids `0..gin_signal_count` for
    /// `RemoteAction::SignalInc`/`SignalAdd` and `Gin::wait_signal`.
    pub gin_signal_count: u32,
    /// GIN counters (`ginCounterCount`): ids for `LocalAction::CounterInc`.
    pub gin_counter_count: u32,
    /// Descriptors per proxy queue (one queue per context and peer); rounded up to a power of
    /// two; 0: 64. A full queue makes the posting thread wait for the proxy (back-pressure).
    pub gin_queue_depth: u32,
    /// GIN barriers (`GinBarrierSession` and the hybrid barrier's GIN part): one per CTA that
    /// synchronizes across LSA domains at a time.
    pub gin_barrier_count: u32,
    /// How GIN reaches peers; `None`: `FERROLINK_GIN`, else [`GinMode::Auto`].
    pub gin_mode: Option<GinMode>,
    /// The proxy's transport; `None`: `FERROLINK_GIN_TRANSPORT`, else by topology (the copy
    /// engine where the peer's memory is mapped here, TCP elsewhere).
    pub gin_transport: Option<TransportKind>,
}

impl Default for DevCommRequirements {
    /// 32 barriers (up to 32 synchronizing CTAs per rank), 16 windows, no GIN, nothing else.
    fn default() -> Self {
        DevCommRequirements {
            lsa_barrier_count: 32,
            window_capacity: 16,
            resources: Vec::new(),
            gin_context_count: 0,
            gin_signal_count: 0,
            gin_counter_count: 0,
            gin_queue_depth: 0,
            gin_barrier_count: 0,
            gin_mode: None,
            gin_transport: None,
        }
    }
}

impl DevCommRequirements {
    /// Adds a request; the id names its resource once the device communicator exists.
    ///
    /// ```
    /// # use ferrolink::{Communicator, DevCommRequirements, Device, ResourceRequest};
    /// # fn main() -> ferrolink::Result<()> {
    /// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
    /// # let comms = Communicator::init_all(&[dev.clone(), dev])?;
    /// let mut reqs = DevCommRequirements { lsa_barrier_count: 4, ..Default::default() };
    /// let lib = reqs.request(ResourceRequest::LsaBarriers { count: 3 });
    /// let handles = ferrolink::create_dev_comms(&comms, &reqs)?;
    /// let set = handles[1].lsa_barriers(lib)?; // after the default set's 4
    /// assert_eq!((set.first, set.count), (4, 3));
    /// assert_eq!(handles[1].dev_comm().lsa_barrier_total, 7);
    /// # Ok(()) }
    /// ```
    pub fn request(&mut self, r: ResourceRequest) -> ResourceId {
        self.resources.push(r);
        ResourceId(self.resources.len() - 1)
    }

    /// Whether GIN resources are asked for: any `gin_*` count set, or a GIN mode or transport
    /// chosen (choosing how GIN reaches peers asks for GIN).
    ///
    /// ```
    /// use ferrolink::DevCommRequirements;
    /// assert!(!DevCommRequirements::default().wants_gin());
    /// assert!(DevCommRequirements { gin_signal_count: 1, ..Default::default() }.wants_gin());
    /// assert!(DevCommRequirements { gin_mode: Some(ferrolink::GinMode::Proxy), ..Default::default() }.wants_gin());
    /// ```
    pub fn wants_gin(&self) -> bool {
        self.gin_context_count > 0
            || self.gin_signal_count > 0
            || self.gin_counter_count > 0
            || self.gin_barrier_count > 0
            || self.gin_queue_depth > 0
            || self.gin_mode.is_some()
            || self.gin_transport.is_some()
    }
}
