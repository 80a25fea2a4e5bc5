//! The launcher's own SIGINT and SIGTERM: noted by a handler, acted on by the supervisor.

use std::sync::atomic::{AtomicI32, Ordering};

/// The last signal received and not yet taken (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // An atomic store is async-signal-safe.
    RECEIVED.store(sig, Ordering::SeqCst);
}

/// Installs the handler for SIGINT and SIGTERM (handlers are reset to the default in the ranks
/// at exec).
pub fn install() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is a valid value (empty mask, no flags) that is filled in
        // before use; the handler only stores to an atomic, which is async-signal-safe; the
        // pointers passed to sigemptyset and sigaction are to live locals or null.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(sig, &action, std::ptr::null_mut()) != 0 {
                eprintln!("ferrolink-run: cannot handle {}: {}", name(sig), std::io::Error::last_os_error());
            }
        }
    }
}

/// The signal received since the last call, if any.
pub fn take() -> Option<i32> {
    match RECEIVED.swap(0, Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    }
}

/// A signal's name, for messages.
pub fn name(sig: i32) -> String {
    let known = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        _ => return format!("signal {sig}"),
    };
    known.to_string()
}
