//! Logging through `tracing`, like `NCCL_DEBUG` and `NCCL_DEBUG_SUBSYS`.
//!
//! ferrolink logs under these targets (subsystems):
//!
//! | target | what |
//! | --- | --- |
//! | `ferrolink::runtime` | devices, streams, launches, retirement of memory, backend errors met in `Drop` |
//! | `ferrolink::comm` | communicators, aborts, the watchdog's progress lines and reports |
//! | `ferrolink::mem` | symmetric memory and windows |
//! | `ferrolink::devcomm` | device communicators and their resources |
//!
//! The first [`crate::Device`] opened installs a subscriber that writes to standard error,
//! filtered by `FERROLINK_LOG` in `tracing-subscriber`'s `EnvFilter` syntax (as `RUST_LOG`):
//! `FERROLINK_LOG=debug` for everything at debug level, `FERROLINK_LOG=warn,ferrolink::comm=trace`
//! for one subsystem in detail, `FERROLINK_LOG=off` for nothing. Unset, it is `warn`: errors
//! met in `Drop`, watchdog progress lines and aborts are always shown. If the program has
//! installed its own global subscriber, ferrolink leaves it alone and logs through it.

use std::io::IsTerminal;
use std::sync::Once;

/// Installs the `FERROLINK_LOG` subscriber unless a global one exists (idempotent).
///
/// ```
/// ferrolink::log::init(); // the first `Device::open_with` calls it too
/// ferrolink::log::init(); // idempotent
/// assert!(tracing::dispatcher::has_been_set());
/// ```
pub fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let spec = std::env::var("FERROLINK_LOG").unwrap_or_else(|_| "warn".into());
        let filter = match tracing_subscriber::EnvFilter::try_new(&spec) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("ferrolink: FERROLINK_LOG={spec:?} is not a valid filter ({e}); using `warn`");
                tracing_subscriber::EnvFilter::new("warn")
            }
        };
        // `try_init` fails when the program already installed a global subscriber: keep theirs.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .try_init();
    });
}
