//! The watchdog: one thread per process that looks at every live communicator a few times
//! per second ([`CommControl::tick`]). It starts with the first communicator.

use super::control::CommControl;
use crate::runtime::lifetime::lock;
use std::sync::{Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// How often the watchdog looks.
const INTERVAL: Duration = Duration::from_millis(50);

fn registry() -> &'static Mutex<Vec<Weak<CommControl>>> {
    static R: OnceLock<Mutex<Vec<Weak<CommControl>>>> = OnceLock::new();
    R.get_or_init(|| {
        std::thread::Builder::new()
            .name("ferrolink-watchdog".into())
            .spawn(run)
            .expect("starting ferrolink's watchdog thread");
        Mutex::new(Vec::new())
    })
}

/// Watches `control` while it lives.
pub(crate) fn watch(control: Weak<CommControl>) {
    let mut r = lock(registry());
    r.retain(|w| w.strong_count() > 0);
    r.push(control);
}

fn run() {
    loop {
        std::thread::sleep(INTERVAL);
        let live: Vec<_> = {
            let mut r = lock(registry());
            r.retain(|w| w.strong_count() > 0);
            r.iter().filter_map(Weak::upgrade).collect()
        };
        let now = Instant::now();
        for c in live {
            c.tick(now);
        }
    }
}
