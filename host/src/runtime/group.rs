//! Group launches: the policy that keeps a half-launched group of ranks from deadlocking
//! against context-wide driver calls.
//!
//! Several ranks on one GPU share its primary context. A driver call that waits for the
//! whole context (module load or unload, VMM map or unmap, freeing pinned host memory) made
//! while another thread has launched only some ranks of a group can wait for kernels that
//! spin until the rest of the group is launched, while the driver holds a context lock that
//! stalls those launches: a deadlock (seen on the H200 with concurrent tests). Group launches
//! ([`crate::launch_all`]) hold [`GROUP_LOCK`] exclusively; context-wide calls hold it shared,
//! so they never interleave with a half-launched group. The CUDA backend decides which of
//! its calls are context-wide; the CPU backend needs none of this.

use std::cell::Cell;
use std::sync::RwLock;

static GROUP_LOCK: RwLock<()> = RwLock::new(());

thread_local! {
    /// Set while this thread holds `GROUP_LOCK` exclusively (its own context-wide calls inside
    /// the group launch must not try to take it again).
    static IN_GROUP_LAUNCH: Cell<bool> = const { Cell::new(false) };
}

/// Runs a driver call that may block on the whole context outside any half-launched group.
/// `what` names it in the `ferrolink::runtime` trace (a call that never ends is the last
/// one begun there).
pub(crate) fn context_wide<R>(what: &'static str, f: impl FnOnce() -> R) -> R {
    tracing::trace!(target: "ferrolink::runtime", what, "context-wide driver call begins");
    let r = if IN_GROUP_LAUNCH.get() {
        f()
    } else {
        let _shared = GROUP_LOCK.read().unwrap_or_else(|e| e.into_inner());
        f()
    };
    tracing::trace!(target: "ferrolink::runtime", what, "context-wide driver call ended");
    r
}

/// Whether the calling thread is inside [`group_launch`] (where a host wait for a kernel
/// could wait for ranks launched later: a deadlock).
pub(crate) fn in_group_launch() -> bool {
    IN_GROUP_LAUNCH.get()
}

/// Runs `f` (which launches every rank of a group) with the group lock held exclusively.
pub(crate) fn group_launch<R>(f: impl FnOnce() -> R) -> R {
    if IN_GROUP_LAUNCH.get() {
        return f();
    }
    let _exclusive = GROUP_LOCK.write().unwrap_or_else(|e| e.into_inner());
    IN_GROUP_LAUNCH.set(true);
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_GROUP_LAUNCH.set(false);
        }
    }
    let _reset = Reset;
    f()
}
