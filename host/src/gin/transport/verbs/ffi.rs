//! The thin, unsafe layer: libibverbs loaded at run time, the few C declarations the transport
//! uses, and RAII owners of the verbs objects ([`Context`], [`Pd`], [`Cq`], [`Qp`], [`Mr`],
//! [`HostRegion`]) whose methods check return codes and nothing more.
//!
//! The declarations are written here, not generated: each `#[repr(C)]` struct follows
//! rdma-core's `infiniband/verbs.h` (checked against rdma-core 44, whose ABI has been stable
//! since libibverbs 1.1), and the `layout_matches_rdma_core_verbs_h` test pins every size and
//! offset the transport relies on. Where the transport only reads a prefix of a C struct
//! (`ibv_context`, `ibv_cq`, `ibv_qp`), only that prefix is declared: such structs are only
//! ever reached through pointers that libibverbs hands out.
//!
//! `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` are `static inline` in `verbs.h`: they
//! call through the function table `context->ops` (a field of `struct ibv_context`, at the
//! same place in every provider), so that table is declared too and called the same way.
//! Everything else is an exported symbol of `libibverbs.so.1`, looked up by name.

#![allow(non_camel_case_types)] // The C names, so that they read like verbs.h.

use super::plan::{self, QpAttrs, Wr};
use crate::{Error, Result};
use std::cell::UnsafeCell;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

/// The library's file name (the SONAME of every libibverbs since 2006).
pub(crate) const LIBRARY: &str = "libibverbs.so.1";

// ---- declarations (verbs.h) ----------------------------------------------------------------

/// `struct ibv_device`: opaque.
#[repr(C)]
pub(crate) struct ibv_device {
    _opaque: [u8; 0],
}

/// `struct ibv_pd`: opaque here.
#[repr(C)]
pub(crate) struct ibv_pd {
    _opaque: [u8; 0],
}

/// `struct ibv_context_ops`: 32 function pointers; the three the `static inline` data-path
/// verbs call are named, the others are kept as padding.
#[repr(C)]
pub(crate) struct ibv_context_ops {
    /// `_compat_query_device` … `_compat_create_cq` (indices 0–10).
    _before_poll_cq: [*const c_void; 11],
    pub(crate) poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    /// `req_notify_cq` … `_compat_destroy_qp` (indices 12–24).
    _before_post_send: [*const c_void; 13],
    pub(crate) post_send: Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub(crate) post_recv: Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    /// `_compat_create_ah` … `_compat_async_event` (indices 27–31).
    _after_post_recv: [*const c_void; 5],
}

/// `struct ibv_context`, up to its ops table (the fields after it are never read here).
#[repr(C)]
pub(crate) struct ibv_context {
    pub(crate) device: *mut ibv_device,
    pub(crate) ops: ibv_context_ops,
}

/// `struct ibv_cq`, up to its context.
#[repr(C)]
pub(crate) struct ibv_cq {
    pub(crate) context: *mut ibv_context,
}

/// `struct ibv_qp`, up to its type.
#[repr(C)]
pub(crate) struct ibv_qp {
    pub(crate) context: *mut ibv_context,
    pub(crate) qp_context: *mut c_void,
    pub(crate) pd: *mut ibv_pd,
    pub(crate) send_cq: *mut ibv_cq,
    pub(crate) recv_cq: *mut ibv_cq,
    pub(crate) srq: *mut c_void,
    pub(crate) handle: u32,
    pub(crate) qp_num: u32,
    pub(crate) state: c_int,
    pub(crate) qp_type: c_int,
}

/// `struct ibv_mr`.
#[repr(C)]
pub(crate) struct ibv_mr {
    pub(crate) context: *mut ibv_context,
    pub(crate) pd: *mut ibv_pd,
    pub(crate) addr: *mut c_void,
    pub(crate) length: usize,
    pub(crate) handle: u32,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
}

/// `union ibv_gid` (16 bytes, 8-byte aligned: its other member is two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct ibv_gid {
    pub(crate) raw: [u8; 16],
}

/// `struct ibv_port_attr`, with room for the fields newer libibverbs append (the exported
/// `ibv_query_port` fills the prefix it knows).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_port_attr {
    pub(crate) state: c_int,
    pub(crate) max_mtu: c_int,
    pub(crate) active_mtu: c_int,
    pub(crate) gid_tbl_len: c_int,
    pub(crate) port_cap_flags: u32,
    pub(crate) max_msg_sz: u32,
    pub(crate) bad_pkey_cntr: u32,
    pub(crate) qkey_viol_cntr: u32,
    pub(crate) pkey_tbl_len: u16,
    pub(crate) lid: u16,
    pub(crate) sm_lid: u16,
    pub(crate) lmc: u8,
    pub(crate) max_vl_num: u8,
    pub(crate) sm_sl: u8,
    pub(crate) subnet_timeout: u8,
    pub(crate) init_type_reply: u8,
    pub(crate) active_width: u8,
    pub(crate) active_speed: u8,
    pub(crate) phys_state: u8,
    pub(crate) link_layer: u8,
    pub(crate) flags: u8,
    pub(crate) port_cap_flags2: u16,
    _newer_fields: [u32; 8],
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_qp_cap {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) max_send_sge: u32,
    pub(crate) max_recv_sge: u32,
    pub(crate) max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub(crate) struct ibv_qp_init_attr {
    pub(crate) qp_context: *mut c_void,
    pub(crate) send_cq: *mut ibv_cq,
    pub(crate) recv_cq: *mut ibv_cq,
    pub(crate) srq: *mut c_void,
    pub(crate) cap: ibv_qp_cap,
    pub(crate) qp_type: c_int,
    pub(crate) sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_global_route {
    pub(crate) dgid: ibv_gid,
    pub(crate) flow_label: u32,
    pub(crate) sgid_index: u8,
    pub(crate) hop_limit: u8,
    pub(crate) traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_ah_attr {
    pub(crate) grh: ibv_global_route,
    pub(crate) dlid: u16,
    pub(crate) sl: u8,
    pub(crate) src_path_bits: u8,
    pub(crate) static_rate: u8,
    pub(crate) is_global: u8,
    pub(crate) port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_qp_attr {
    pub(crate) qp_state: c_int,
    pub(crate) cur_qp_state: c_int,
    pub(crate) path_mtu: c_int,
    pub(crate) path_mig_state: c_int,
    pub(crate) qkey: u32,
    pub(crate) rq_psn: u32,
    pub(crate) sq_psn: u32,
    pub(crate) dest_qp_num: u32,
    pub(crate) qp_access_flags: u32,
    pub(crate) cap: ibv_qp_cap,
    pub(crate) ah_attr: ibv_ah_attr,
    pub(crate) alt_ah_attr: ibv_ah_attr,
    pub(crate) pkey_index: u16,
    pub(crate) alt_pkey_index: u16,
    pub(crate) en_sqd_async_notify: u8,
    pub(crate) sq_draining: u8,
    pub(crate) max_rd_atomic: u8,
    pub(crate) max_dest_rd_atomic: u8,
    pub(crate) min_rnr_timer: u8,
    pub(crate) port_num: u8,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) alt_port_num: u8,
    pub(crate) alt_timeout: u8,
    pub(crate) rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_sge {
    pub(crate) addr: u64,
    pub(crate) length: u32,
    pub(crate) lkey: u32,
}

/// The `rdma` member of `ibv_send_wr`'s `wr` union.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_send_wr_rdma {
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
}

/// The `atomic` member of `ibv_send_wr`'s `wr` union (the largest: it sizes the union).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_send_wr_atomic {
    pub(crate) remote_addr: u64,
    pub(crate) compare_add: u64,
    pub(crate) swap: u64,
    pub(crate) rkey: u32,
}

/// `ibv_send_wr`'s `wr` union (its `ud` member is smaller than `atomic` and unused here).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union ibv_send_wr_wr {
    pub(crate) rdma: ibv_send_wr_rdma,
    pub(crate) atomic: ibv_send_wr_atomic,
}

/// `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_send_wr {
    pub(crate) wr_id: u64,
    pub(crate) next: *mut ibv_send_wr,
    pub(crate) sg_list: *mut ibv_sge,
    pub(crate) num_sge: c_int,
    pub(crate) opcode: c_int,
    pub(crate) send_flags: u32,
    /// Network byte order.
    pub(crate) imm_data: u32,
    pub(crate) wr: ibv_send_wr_wr,
    /// The `qp_type` union (`xrc.remote_srqn`).
    pub(crate) remote_srqn: u32,
    /// The trailing `bind_mw` / `tso` union (48 bytes, unused here).
    _bind_mw_or_tso: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub(crate) struct ibv_recv_wr {
    pub(crate) wr_id: u64,
    pub(crate) next: *mut ibv_recv_wr,
    pub(crate) sg_list: *mut ibv_sge,
    pub(crate) num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct ibv_wc {
    pub(crate) wr_id: u64,
    pub(crate) status: c_int,
    pub(crate) opcode: c_int,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
    /// Network byte order.
    pub(crate) imm_data: u32,
    pub(crate) qp_num: u32,
    pub(crate) src_qp: u32,
    pub(crate) wc_flags: u32,
    pub(crate) pkey_index: u16,
    pub(crate) slid: u16,
    pub(crate) sl: u8,
    pub(crate) dlid_path_bits: u8,
}

// Enumerations and flags (verbs.h values).
/// `IBV_QPT_RC`.
pub(crate) const IBV_QPT_RC: c_int = 2;
/// `IBV_PORT_ACTIVE`.
pub(crate) const IBV_PORT_ACTIVE: c_int = 4;
/// `enum ibv_wr_opcode`.
pub(crate) const IBV_WR_RDMA_WRITE: c_int = 0;
pub(crate) const IBV_WR_RDMA_WRITE_WITH_IMM: c_int = 1;
pub(crate) const IBV_WR_SEND_WITH_IMM: c_int = 3;
pub(crate) const IBV_WR_RDMA_READ: c_int = 4;
/// `enum ibv_send_flags`.
pub(crate) const IBV_SEND_SIGNALED: u32 = 1 << 1;
pub(crate) const IBV_SEND_INLINE: u32 = 1 << 3;
/// `enum ibv_wc_opcode`: receive completions have this bit.
pub(crate) const IBV_WC_RECV: c_int = 1 << 7;
pub(crate) const IBV_WC_RECV_RDMA_WITH_IMM: c_int = IBV_WC_RECV + 1;
/// `enum ibv_wc_flags`.
pub(crate) const IBV_WC_WITH_IMM: u32 = 1 << 1;
/// `IBV_WC_SUCCESS`.
pub(crate) const IBV_WC_SUCCESS: c_int = 0;

// ---- the library -----------------------------------------------------------------------------

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut ibv_device);
type GetDeviceName = unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
type OpenDevice = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
type CloseDevice = unsafe extern "C" fn(*mut ibv_context) -> c_int;
type QueryPort = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
type QueryGid = unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
type AllocPd = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
type DeallocPd = unsafe extern "C" fn(*mut ibv_pd) -> c_int;
type RegMr = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
type DeregMr = unsafe extern "C" fn(*mut ibv_mr) -> c_int;
type CreateCq = unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut c_void, c_int) -> *mut ibv_cq;
type DestroyCq = unsafe extern "C" fn(*mut ibv_cq) -> c_int;
type CreateQp = unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
type ModifyQp = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
type DestroyQp = unsafe extern "C" fn(*mut ibv_qp) -> c_int;
type WcStatusStr = unsafe extern "C" fn(c_int) -> *const c_char;

/// libibverbs, loaded, with the exported functions the transport calls.
pub(crate) struct Lib {
    get_device_list: GetDeviceList,
    free_device_list: FreeDeviceList,
    get_device_name: GetDeviceName,
    open_device: OpenDevice,
    close_device: CloseDevice,
    query_port: QueryPort,
    query_gid: QueryGid,
    alloc_pd: AllocPd,
    dealloc_pd: DeallocPd,
    reg_mr: RegMr,
    dereg_mr: DeregMr,
    create_cq: CreateCq,
    destroy_cq: DestroyCq,
    create_qp: CreateQp,
    modify_qp: ModifyQp,
    destroy_qp: DestroyQp,
    wc_status_str: WcStatusStr,
    /// Keeps the code the pointers above point into loaded (last: dropped after them).
    _library: libloading::Library,
}

/// An error of the verbs transport's set-up, as the user sees it.
pub(crate) fn setup_error(what: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("FERROLINK_GIN_TRANSPORT=verbs: {what}"))
}

/// An error and its sources ("dlopen failed: libnl-3.so.200: cannot open shared object file").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text
}

/// `what` failed with the calling thread's `errno`.
fn errno_error(what: &str) -> Error {
    setup_error(format!("{what} failed: {}", std::io::Error::last_os_error()))
}

/// `what` returned the error number `rc` (verbs that return an errno rather than set it).
fn rc_error(what: &str, rc: c_int) -> Error {
    setup_error(format!("{what} failed: {}", std::io::Error::from_raw_os_error(rc)))
}

impl Lib {
    /// Loads [`LIBRARY`].
    pub(crate) fn open() -> Result<Arc<Lib>> {
        Lib::open_named(LIBRARY)
    }

    /// Loads the library `name` (tests name one that does not exist).
    pub(crate) fn open_named(name: &str) -> Result<Arc<Lib>> {
        // SAFETY: loading libibverbs runs its initializers, which only set up its own state
        // (provider lookup happens later, in ibv_get_device_list); it has no preconditions on
        // the loading program.
        let library = unsafe { libloading::Library::new(name) }.map_err(|e| {
            setup_error(format!(
                "{name} not found ({}); install rdma-core's libibverbs and the NIC's provider (e.g. \
                 libmlx5), or use FERROLINK_GIN_TRANSPORT=tcp",
                error_chain(&e)
            ))
        })?;
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol is the libibverbs function of that name, whose C
                // signature (verbs.h) the type this is assigned to declares; the pointer is
                // used only while `_library` keeps the library loaded.
                let s = unsafe { library.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                    setup_error(format!("{name} lacks `{}` ({}): it is too old", $name, error_chain(&e)))
                })?;
                *s
            }};
        }
        Ok(Arc::new(Lib {
            get_device_list: sym!("ibv_get_device_list"),
            free_device_list: sym!("ibv_free_device_list"),
            get_device_name: sym!("ibv_get_device_name"),
            open_device: sym!("ibv_open_device"),
            close_device: sym!("ibv_close_device"),
            query_port: sym!("ibv_query_port"),
            query_gid: sym!("ibv_query_gid"),
            alloc_pd: sym!("ibv_alloc_pd"),
            dealloc_pd: sym!("ibv_dealloc_pd"),
            reg_mr: sym!("ibv_reg_mr"),
            dereg_mr: sym!("ibv_dereg_mr"),
            create_cq: sym!("ibv_create_cq"),
            destroy_cq: sym!("ibv_destroy_cq"),
            create_qp: sym!("ibv_create_qp"),
            modify_qp: sym!("ibv_modify_qp"),
            destroy_qp: sym!("ibv_destroy_qp"),
            wc_status_str: sym!("ibv_wc_status_str"),
            _library: library,
        }))
    }

    /// The names of the RDMA devices present, in libibverbs' order.
    pub(crate) fn device_names(self: &Arc<Lib>) -> Result<Vec<String>> {
        self.with_devices(|devs| devs.iter().map(|&d| self.device_name(d)).collect())
    }

    fn device_name(&self, d: *mut ibv_device) -> String {
        // SAFETY: `d` comes from the live device list; the name is a NUL-terminated string
        // owned by the device, copied out before the list is freed.
        let name = unsafe { (self.get_device_name)(d) };
        if name.is_null() {
            return "(unnamed)".into();
        }
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    }

    /// Runs `f` on the device list (freed after).
    fn with_devices<T>(&self, f: impl FnOnce(&[*mut ibv_device]) -> T) -> Result<T> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below.
        let list = unsafe { (self.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(setup_error(format!(
                "no RDMA device (ibv_get_device_list failed: {}; is the NIC's kernel driver loaded?)",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: libibverbs returned `n` valid device pointers at `list`.
        let devs = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
        let out = f(devs);
        // SAFETY: `list` came from ibv_get_device_list and is freed once; `devs` is not used
        // after.
        unsafe { (self.free_device_list)(list) };
        Ok(out)
    }

    /// The text of a work completion's status.
    pub(crate) fn status_str(&self, status: c_int) -> String {
        // SAFETY: ibv_wc_status_str accepts any value and returns a static string.
        let s = unsafe { (self.wc_status_str)(status) };
        if s.is_null() {
            return format!("status {status}");
        }
        // SAFETY: a static NUL-terminated string (above).
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

// ---- owners of the verbs objects ---------------------------------------------------------------

/// An open device (`ibv_context`); closed when the last owner drops it.
pub(crate) struct Context {
    pub(crate) lib: Arc<Lib>,
    ptr: NonNull<ibv_context>,
    pub(crate) name: String,
}

// SAFETY: libibverbs objects may be used from any thread ("all verbs are thread safe", rdma-core
// documentation); the pointer is owned and freed once.
unsafe impl Send for Context {}
// SAFETY: as above; shared use only calls thread-safe verbs.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the device named `name`.
    pub(crate) fn open(lib: &Arc<Lib>, name: &str) -> Result<Arc<Context>> {
        let opened = lib.with_devices(|devs| {
            let d = devs.iter().copied().find(|&d| lib.device_name(d) == name)?;
            // SAFETY: `d` is a device of the live list; the context it returns outlives the
            // list (libibverbs keeps devices referenced while a context is open).
            Some(unsafe { (lib.open_device)(d) })
        })?;
        match opened {
            None => Err(setup_error(format!("there is no RDMA device named {name:?}"))),
            Some(p) => match NonNull::new(p) {
                None => Err(errno_error(&format!("ibv_open_device({name})"))),
                Some(ptr) => Ok(Arc::new(Context { lib: lib.clone(), ptr, name: name.into() })),
            },
        }
    }

    /// `ibv_query_port`.
    pub(crate) fn query_port(&self, port: u8) -> Result<ibv_port_attr> {
        let mut attr = ibv_port_attr::default();
        // SAFETY: a live context; `attr` is a zeroed buffer at least as large as the struct
        // this libibverbs writes.
        let rc = unsafe { (self.lib.query_port)(self.ptr.as_ptr(), port, &mut attr) };
        if rc != 0 {
            return Err(rc_error(&format!("ibv_query_port({}, port {port})", self.name), rc));
        }
        Ok(attr)
    }

    /// `ibv_query_gid`.
    pub(crate) fn query_gid(&self, port: u8, index: u32) -> Result<[u8; 16]> {
        let mut gid = ibv_gid::default();
        // SAFETY: a live context; `gid` is a valid out-pointer.
        let rc = unsafe { (self.lib.query_gid)(self.ptr.as_ptr(), port, index as c_int, &mut gid) };
        if rc != 0 {
            return Err(errno_error(&format!("ibv_query_gid({}, port {port}, index {index})", self.name)));
        }
        Ok(gid.raw)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object made from this context holds an `Arc` to it, so they are gone.
        unsafe { (self.lib.close_device)(self.ptr.as_ptr()) };
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pub(crate) ctx: Arc<Context>,
    ptr: NonNull<ibv_pd>,
}

// SAFETY: as for `Context`.
unsafe impl Send for Pd {}
// SAFETY: as for `Context`.
unsafe impl Sync for Pd {}

impl Pd {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Arc<Pd>> {
        // SAFETY: a live context.
        let p = unsafe { (ctx.lib.alloc_pd)(ctx.ptr.as_ptr()) };
        let ptr = NonNull::new(p).ok_or_else(|| errno_error("ibv_alloc_pd"))?;
        Ok(Arc::new(Pd { ctx: ctx.clone(), ptr }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: the queue pairs and memory regions of this domain hold an `Arc` to it.
        unsafe { (self.ctx.lib.dealloc_pd)(self.ptr.as_ptr()) };
    }
}

/// A completion queue.
pub(crate) struct Cq {
    ctx: Arc<Context>,
    ptr: NonNull<ibv_cq>,
}

// SAFETY: as for `Context` (polling one CQ from several threads is allowed; the transport
// polls each from one thread).
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub(crate) fn new(ctx: &Arc<Context>, entries: usize) -> Result<Arc<Cq>> {
        let cqe = c_int::try_from(entries).map_err(|_| setup_error(format!("a CQ of {entries} entries")))?;
        // SAFETY: a live context; no channel, no user context.
        let p = unsafe { (ctx.lib.create_cq)(ctx.ptr.as_ptr(), cqe, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        let ptr = NonNull::new(p).ok_or_else(|| errno_error(&format!("ibv_create_cq({entries} entries)")))?;
        Ok(Arc::new(Cq { ctx: ctx.clone(), ptr }))
    }

    /// Reaps up to `wcs.len()` completions; returns how many.
    pub(crate) fn poll(&self, wcs: &mut [ibv_wc]) -> Result<usize, String> {
        let n = c_int::try_from(wcs.len()).unwrap_or(c_int::MAX);
        // SAFETY: `ptr` is a live CQ whose `context` is the live context it was made on;
        // `ops.poll_cq` is that context's provider function (what the static inline
        // ibv_poll_cq calls); `wcs` has room for `n` completions.
        let rc = unsafe {
            let ctx = (*self.ptr.as_ptr()).context;
            match (*ctx).ops.poll_cq {
                Some(f) => f(self.ptr.as_ptr(), n, wcs.as_mut_ptr()),
                None => return Err("the provider has no poll_cq".into()),
            }
        };
        if rc < 0 {
            return Err(format!("ibv_poll_cq failed ({rc})"));
        }
        Ok(rc as usize)
    }

    pub(crate) fn lib(&self) -> &Lib {
        &self.ctx.lib
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: the queue pairs using this CQ hold an `Arc` to it, so they are destroyed.
        unsafe { (self.ctx.lib.destroy_cq)(self.ptr.as_ptr()) };
    }
}

/// A memory region. The memory is the owner's to keep alive (see [`Mr::register`]).
pub(crate) struct Mr {
    pd: Arc<Pd>,
    ptr: NonNull<ibv_mr>,
}

// SAFETY: as for `Context`.
unsafe impl Send for Mr {}
// SAFETY: as for `Context`.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes at `addr` for local writes and remote reads and writes.
    ///
    /// # Safety
    /// The range must be memory of this process (host memory, or GPU memory that the NIC can
    /// reach through nvidia-peermem) that stays allocated while the NIC may still access it
    /// through this region: until the queue pairs that used it are quiet, or the region is
    /// deregistered. (With nvidia-peermem, freeing GPU memory invalidates the region instead.)
    pub(crate) unsafe fn register(pd: &Arc<Pd>, addr: u64, len: usize, what: &str) -> Result<Mr> {
        let access = (plan::access::LOCAL_WRITE | plan::access::REMOTE_WRITE | plan::access::REMOTE_READ) as c_int;
        // SAFETY: a live PD; the caller's contract for the range.
        let p = unsafe { (pd.ctx.lib.reg_mr)(pd.ptr.as_ptr(), addr as *mut c_void, len, access) };
        let ptr = NonNull::new(p).ok_or_else(|| {
            setup_error(format!(
                "ibv_reg_mr of {what} ({len} bytes at {addr:#x}) failed: {}. GPU memory needs the \
                 nvidia-peermem kernel module (modprobe nvidia-peermem) and allocations made GPUDirect \
                 RDMA capable",
                std::io::Error::last_os_error()
            ))
        })?;
        Ok(Mr { pd: pd.clone(), ptr })
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: a live region; its keys never change.
        unsafe { (*self.ptr.as_ptr()).lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.ptr.as_ptr()).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: a live region, deregistered once.
        unsafe { (self.pd.ctx.lib.dereg_mr)(self.ptr.as_ptr()) };
    }
}

/// One 64-byte slot of host memory that the NIC writes (receive buffers, flush landing).
#[repr(C, align(64))]
pub(crate) struct Slot(UnsafeCell<[u8; 64]>);

/// Host memory registered with the NIC: slots it writes into (receives) or reads from.
/// Fields drop in order: the region is deregistered before its memory is freed.
pub(crate) struct HostRegion {
    mr: Mr,
    slots: Box<[Slot]>,
}

// SAFETY: the slots are written by the NIC only while a receive is posted on them, and read by
// the thread that reaped that receive's completion, before it posts the slot again.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    pub(crate) fn new(pd: &Arc<Pd>, slots: usize, what: &str) -> Result<HostRegion> {
        let slots: Box<[Slot]> = (0..slots.max(1)).map(|_| Slot(UnsafeCell::new([0; 64]))).collect();
        let addr = slots.as_ptr() as u64;
        // SAFETY: the boxed slots are host memory of this process that `HostRegion` frees only
        // after deregistering (field order); the queue pairs that receive into them are
        // destroyed before the region (the owner's field order, see `Shared`).
        let mr = unsafe { Mr::register(pd, addr, slots.len() * 64, what)? };
        Ok(HostRegion { mr, slots })
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The address of slot `i`.
    pub(crate) fn addr(&self, i: usize) -> u64 {
        self.slots[i].0.get() as u64
    }

    /// Copies the first `len` bytes of slot `i` out.
    ///
    /// # Safety
    /// The NIC must not be writing slot `i`: its receive completed and it is not posted again.
    pub(crate) unsafe fn read(&self, i: usize, len: usize) -> Vec<u8> {
        let len = len.min(64);
        // SAFETY: the caller's contract: nothing writes the slot meanwhile; the completion was
        // reaped through the provider's poll, which orders the NIC's writes before it returns.
        unsafe { std::slice::from_raw_parts(self.slots[i].0.get() as *const u8, len) }.to_vec()
    }
}

/// The send queue depth, receive queue depth and inline size a queue pair is created with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QpCaps {
    pub(crate) send: u32,
    pub(crate) recv: u32,
    pub(crate) inline: u32,
}

/// A reliable-connected queue pair.
pub(crate) struct Qp {
    pd: Arc<Pd>,
    _cq: Arc<Cq>,
    ptr: NonNull<ibv_qp>,
}

// SAFETY: as for `Context` (libibverbs serializes posts on one QP internally).
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    /// Creates an RC queue pair whose send and receive completions go to `cq`.
    pub(crate) fn new(pd: &Arc<Pd>, cq: &Arc<Cq>, caps: QpCaps) -> Result<Qp> {
        let mut init = ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.ptr.as_ptr(),
            recv_cq: cq.ptr.as_ptr(),
            srq: std::ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: caps.send,
                max_recv_wr: caps.recv,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: caps.inline,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: a live PD and CQ (both kept by the QP); `init` is valid for the call.
        let p = unsafe { (pd.ctx.lib.create_qp)(pd.ptr.as_ptr(), &mut init) };
        let ptr = NonNull::new(p).ok_or_else(|| errno_error(&format!("ibv_create_qp({caps:?})")))?;
        Ok(Qp { pd: pd.clone(), _cq: cq.clone(), ptr })
    }

    pub(crate) fn qp_num(&self) -> u32 {
        // SAFETY: a live QP; its number never changes.
        unsafe { (*self.ptr.as_ptr()).qp_num }
    }

    /// `ibv_modify_qp` with the attributes of a planned transition.
    pub(crate) fn modify(&self, attrs: &QpAttrs) -> Result<()> {
        let mut raw = to_raw_attr(attrs);
        // SAFETY: a live QP; `raw` is valid for the call.
        let rc = unsafe { (self.pd.ctx.lib.modify_qp)(self.ptr.as_ptr(), &mut raw, attrs.mask as c_int) };
        if rc != 0 {
            return Err(rc_error(&format!("ibv_modify_qp(QP {:#x} to {:?})", self.qp_num(), attrs.state), rc));
        }
        Ok(())
    }

    /// Posts `wrs` as one chain, with ids `first_id`, `first_id + 1`, …; the last is signaled
    /// when `signal_last`. Inline data is copied by the provider before this returns.
    pub(crate) fn post_send(&self, wrs: &[Wr], first_id: u64, signal_last: bool) -> Result<(), String> {
        if wrs.is_empty() {
            return Ok(());
        }
        // Stable storage for the chain, its scatter entries and the inline bytes.
        let mut inline: Vec<[u8; 64]> = vec![[0; 64]; wrs.len()];
        let mut sges: Vec<ibv_sge> = vec![ibv_sge::default(); wrs.len()];
        let mut chain: Vec<ibv_send_wr> = Vec::with_capacity(wrs.len());
        for (i, wr) in wrs.iter().enumerate() {
            let raw = to_raw_send(wr, first_id + i as u64, &mut inline[i], &mut sges[i]);
            chain.push(raw);
        }
        if signal_last {
            chain.last_mut().expect("not empty").send_flags |= IBV_SEND_SIGNALED;
        }
        let base = chain.as_mut_ptr();
        for i in 0..chain.len() {
            // SAFETY: indices within `chain`, whose buffer is not reallocated from here on.
            unsafe {
                let w = &mut *base.add(i);
                if w.num_sge > 0 {
                    w.sg_list = sges.as_mut_ptr().add(i);
                    if w.send_flags & IBV_SEND_INLINE != 0 {
                        (*w.sg_list).addr = inline.as_ptr().add(i) as u64;
                    }
                }
                w.next = if i + 1 < chain.len() { base.add(i + 1) } else { std::ptr::null_mut() };
            }
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: a live QP whose `context` is the live context it was made on; `ops.post_send`
        // is what the static inline ibv_post_send calls; the chain, its scatter entries and the
        // inline bytes live until the call returns (the provider copies inline data, and
        // non-inline data is read from registered memory the caller keeps alive until the
        // completion).
        let rc = unsafe {
            let ctx = (*self.ptr.as_ptr()).context;
            match (*ctx).ops.post_send {
                Some(f) => f(self.ptr.as_ptr(), base, &mut bad),
                None => return Err("the provider has no post_send".into()),
            }
        };
        if rc != 0 {
            let at =
                if bad.is_null() { 0 } else { (bad as usize - base as usize) / std::mem::size_of::<ibv_send_wr>() };
            return Err(format!(
                "ibv_post_send failed at work request {at} of {}: {}",
                wrs.len(),
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        Ok(())
    }

    /// Posts one receive of `len` bytes at `addr` (registered with `lkey`), with id `wr_id`.
    pub(crate) fn post_recv(&self, wr_id: u64, addr: u64, len: u32, lkey: u32) -> Result<(), String> {
        let mut sge = ibv_sge { addr, length: len, lkey };
        let mut wr = ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: as in `post_send`, for `ops.post_recv`; `wr` and `sge` live through the call;
        // the buffer is registered memory the caller keeps until the QP is destroyed.
        let rc = unsafe {
            let ctx = (*self.ptr.as_ptr()).context;
            match (*ctx).ops.post_recv {
                Some(f) => f(self.ptr.as_ptr(), &mut wr, &mut bad),
                None => return Err("the provider has no post_recv".into()),
            }
        };
        if rc != 0 {
            return Err(format!("ibv_post_recv failed: {}", std::io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: a live QP, destroyed once; its PD and CQ outlive it (held above).
        unsafe { (self.pd.ctx.lib.destroy_qp)(self.ptr.as_ptr()) };
    }
}

/// The C attributes of a planned transition (only the fields its mask names matter).
pub(crate) fn to_raw_attr(a: &QpAttrs) -> ibv_qp_attr {
    let mut raw = ibv_qp_attr {
        qp_state: a.state as c_int,
        path_mtu: c_int::from(a.path_mtu),
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qpn,
        qp_access_flags: a.access,
        pkey_index: a.pkey_index,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        ..ibv_qp_attr::default()
    };
    if let Some(av) = &a.av {
        raw.ah_attr.dlid = av.dlid;
        raw.ah_attr.sl = av.sl;
        raw.ah_attr.port_num = av.port;
        if let Some(g) = &av.grh {
            raw.ah_attr.is_global = 1;
            raw.ah_attr.grh = ibv_global_route {
                dgid: ibv_gid { raw: g.dgid },
                flow_label: g.flow_label,
                sgid_index: g.sgid_index,
                hop_limit: g.hop_limit,
                traffic_class: g.traffic_class,
            };
        }
    }
    raw
}

/// The C work request for `wr`, with id `wr_id`. `inline` and `sge` are this request's
/// storage; the caller points `sg_list` (and an inline entry's address) at them.
fn to_raw_send(wr: &Wr, wr_id: u64, inline: &mut [u8; 64], sge: &mut ibv_sge) -> ibv_send_wr {
    let mut raw = ibv_send_wr {
        wr_id,
        next: std::ptr::null_mut(),
        sg_list: std::ptr::null_mut(),
        num_sge: 0,
        opcode: IBV_WR_RDMA_WRITE,
        send_flags: 0,
        imm_data: 0,
        wr: ibv_send_wr_wr { atomic: ibv_send_wr_atomic::default() },
        remote_srqn: 0,
        _bind_mw_or_tso: [0; 6],
    };
    let mut inline_bytes = |bytes: &[u8], raw: &mut ibv_send_wr| {
        inline[..bytes.len()].copy_from_slice(bytes);
        *sge = ibv_sge { addr: 0, length: bytes.len() as u32, lkey: 0 };
        raw.num_sge = 1;
        raw.send_flags |= IBV_SEND_INLINE;
    };
    match *wr {
        Wr::Write { local, lkey, len, remote, rkey } => {
            *sge = ibv_sge { addr: local, length: len, lkey };
            raw.num_sge = 1;
            raw.wr.rdma = ibv_send_wr_rdma { remote_addr: remote, rkey };
        }
        Wr::WriteInline { bytes, len, remote, rkey } => {
            inline_bytes(&bytes[..len as usize], &mut raw);
            raw.wr.rdma = ibv_send_wr_rdma { remote_addr: remote, rkey };
        }
        Wr::SignalOne { imm, remote, rkey } => {
            // A zero-length write: no scatter entry. Its address and key are the peer's sink
            // word, valid, though a responder need not check them for zero bytes.
            raw.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
            raw.imm_data = imm.to_be();
            raw.wr.rdma = ibv_send_wr_rdma { remote_addr: remote, rkey };
        }
        Wr::SignalAdd { imm, inc } => {
            raw.opcode = IBV_WR_SEND_WITH_IMM;
            raw.imm_data = imm.to_be();
            inline_bytes(&inc.to_le_bytes(), &mut raw);
        }
        Wr::Control { imm, ref msg } => {
            raw.opcode = IBV_WR_SEND_WITH_IMM;
            raw.imm_data = imm.to_be();
            inline_bytes(msg.as_slice(), &mut raw);
        }
        Wr::Read { local, lkey, len, remote, rkey } => {
            *sge = ibv_sge { addr: local, length: len, lkey };
            raw.num_sge = 1;
            raw.opcode = IBV_WR_RDMA_READ;
            raw.wr.rdma = ibv_send_wr_rdma { remote_addr: remote, rkey };
        }
    }
    raw
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gin::transport::verbs::plan::{AddressVector, Grh, QpState, mask};
    use crate::gin::transport::verbs::wire::ControlBytes;
    use std::mem::{align_of, offset_of, size_of};

    /// Sizes and offsets from rdma-core 44's verbs.h (x86_64 and aarch64 alike: LP64), printed
    /// by a C program compiled against it. The prefix-only declarations check the prefix.
    #[test]
    fn layout_matches_rdma_core_verbs_h() {
        assert_eq!(size_of::<ibv_context_ops>(), 32 * 8);
        assert_eq!(offset_of!(ibv_context, ops), 8);
        assert_eq!(offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, poll_cq), 96);
        assert_eq!(offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, post_send), 208);
        assert_eq!(offset_of!(ibv_context, ops) + offset_of!(ibv_context_ops, post_recv), 216);
        assert_eq!(offset_of!(ibv_cq, context), 0);
        assert_eq!(offset_of!(ibv_qp, context), 0);
        assert_eq!(offset_of!(ibv_qp, qp_num), 52);
        assert_eq!(offset_of!(ibv_qp, qp_type), 60);
        assert_eq!(size_of::<ibv_mr>(), 48);
        assert_eq!((offset_of!(ibv_mr, length), offset_of!(ibv_mr, lkey), offset_of!(ibv_mr, rkey)), (24, 36, 40));
        assert_eq!((size_of::<ibv_gid>(), align_of::<ibv_gid>()), (16, 8));
        assert_eq!(offset_of!(ibv_port_attr, max_msg_sz), 20);
        assert_eq!(offset_of!(ibv_port_attr, lid), 34);
        assert_eq!(offset_of!(ibv_port_attr, link_layer), 46);
        assert_eq!(offset_of!(ibv_port_attr, port_cap_flags2), 48);
        assert!(size_of::<ibv_port_attr>() >= 56);
        assert_eq!(size_of::<ibv_qp_cap>(), 20);
        assert_eq!(size_of::<ibv_qp_init_attr>(), 64);
        assert_eq!((offset_of!(ibv_qp_init_attr, cap), offset_of!(ibv_qp_init_attr, qp_type)), (32, 52));
        assert_eq!(size_of::<ibv_global_route>(), 24);
        assert_eq!(size_of::<ibv_ah_attr>(), 32);
        assert_eq!((offset_of!(ibv_ah_attr, dlid), offset_of!(ibv_ah_attr, is_global)), (24, 29));
        assert_eq!(size_of::<ibv_qp_attr>(), 144);
        assert_eq!(offset_of!(ibv_qp_attr, dest_qp_num), 28);
        assert_eq!(offset_of!(ibv_qp_attr, cap), 36);
        assert_eq!(offset_of!(ibv_qp_attr, ah_attr), 56);
        assert_eq!(offset_of!(ibv_qp_attr, alt_ah_attr), 88);
        assert_eq!(offset_of!(ibv_qp_attr, pkey_index), 120);
        assert_eq!(offset_of!(ibv_qp_attr, max_rd_atomic), 126);
        assert_eq!(offset_of!(ibv_qp_attr, min_rnr_timer), 128);
        assert_eq!(offset_of!(ibv_qp_attr, port_num), 129);
        assert_eq!(offset_of!(ibv_qp_attr, rnr_retry), 132);
        assert_eq!(offset_of!(ibv_qp_attr, rate_limit), 136);
        assert_eq!(size_of::<ibv_sge>(), 16);
        assert_eq!(size_of::<ibv_send_wr>(), 128);
        assert_eq!(offset_of!(ibv_send_wr, num_sge), 24);
        assert_eq!(offset_of!(ibv_send_wr, imm_data), 36);
        assert_eq!(offset_of!(ibv_send_wr, wr), 40);
        assert_eq!(offset_of!(ibv_send_wr, remote_srqn), 72);
        assert_eq!(size_of::<ibv_recv_wr>(), 32);
        assert_eq!(size_of::<ibv_wc>(), 48);
        assert_eq!(offset_of!(ibv_wc, imm_data), 24);
        assert_eq!(offset_of!(ibv_wc, qp_num), 28);
        assert_eq!(offset_of!(ibv_wc, wc_flags), 36);
    }

    #[test]
    fn a_missing_library_is_a_clear_error() {
        let err = Lib::open_named("libibverbs-ferrolink-test-absent.so.1").err().expect("no such library");
        let text = err.to_string();
        assert!(text.contains("FERROLINK_GIN_TRANSPORT=verbs"), "{text}");
        assert!(text.contains("libibverbs-ferrolink-test-absent.so.1 not found"), "{text}");
        assert!(text.contains("FERROLINK_GIN_TRANSPORT=tcp"), "{text}");
    }

    #[test]
    fn transitions_become_the_c_attributes_their_masks_name() {
        let rtr = QpAttrs {
            state: QpState::Rtr,
            mask: mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN,
            path_mtu: 5,
            dest_qpn: 0x12345,
            rq_psn: 77,
            av: Some(AddressVector {
                dlid: 0,
                sl: 0,
                port: 1,
                grh: Some(Grh { dgid: [7; 16], sgid_index: 3, hop_limit: 255, traffic_class: 0, flow_label: 0 }),
            }),
            ..QpAttrs::default()
        };
        let raw = to_raw_attr(&rtr);
        assert_eq!((raw.qp_state, raw.path_mtu, raw.dest_qp_num, raw.rq_psn), (2, 5, 0x12345, 77));
        assert_eq!((raw.ah_attr.is_global, raw.ah_attr.port_num, raw.ah_attr.grh.sgid_index), (1, 1, 3));
        assert_eq!(raw.ah_attr.grh.dgid.raw, [7; 16]);
        let ib = QpAttrs { av: Some(AddressVector { dlid: 9, sl: 0, port: 2, grh: None }), ..QpAttrs::default() };
        let raw = to_raw_attr(&ib);
        assert_eq!((raw.ah_attr.is_global, raw.ah_attr.dlid, raw.ah_attr.port_num), (0, 9, 2));
    }

    #[test]
    fn work_requests_become_the_c_requests_verbs_expects() {
        let mut inline = [0u8; 64];
        let mut sge = ibv_sge::default();
        let w = to_raw_send(
            &Wr::Write { local: 0x1000, lkey: 5, len: 64, remote: 0x2000, rkey: 6 },
            9,
            &mut inline,
            &mut sge,
        );
        // SAFETY: the `rdma` member was the one written.
        let rdma = unsafe { w.wr.rdma };
        assert_eq!((w.opcode, w.num_sge, w.send_flags, w.wr_id), (IBV_WR_RDMA_WRITE, 1, 0, 9));
        assert_eq!((sge.addr, sge.length, sge.lkey, rdma.remote_addr, rdma.rkey), (0x1000, 64, 5, 0x2000, 6));

        let w = to_raw_send(&Wr::SignalOne { imm: 0x0102_0304, remote: 0x80, rkey: 7 }, 1, &mut inline, &mut sge);
        assert_eq!((w.opcode, w.num_sge), (IBV_WR_RDMA_WRITE_WITH_IMM, 0));
        assert_eq!(u32::from_be(w.imm_data), 0x0102_0304);

        let w = to_raw_send(&Wr::SignalAdd { imm: 3, inc: 0x0807_0605_0403_0201 }, 1, &mut inline, &mut sge);
        assert_eq!((w.opcode, w.num_sge, w.send_flags & IBV_SEND_INLINE), (IBV_WR_SEND_WITH_IMM, 1, IBV_SEND_INLINE));
        assert_eq!((sge.length, &inline[..8]), (8, &[1u8, 2, 3, 4, 5, 6, 7, 8][..]));

        let msg = ControlBytes::from_slice(&[1, 2, 3]);
        let w = to_raw_send(&Wr::Control { imm: 4, msg }, 1, &mut inline, &mut sge);
        assert_eq!((w.opcode, sge.length, &inline[..3]), (IBV_WR_SEND_WITH_IMM, 3, &[1u8, 2, 3][..]));

        let w = to_raw_send(
            &Wr::WriteInline { bytes: [9, 8, 7, 6, 0, 0, 0, 0], len: 2, remote: 0x40, rkey: 1 },
            1,
            &mut inline,
            &mut sge,
        );
        assert_eq!((w.opcode, sge.length, &inline[..2]), (IBV_WR_RDMA_WRITE, 2, &[9u8, 8][..]));
    }
}
