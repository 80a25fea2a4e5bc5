//! Abort, asynchronous errors and fault reports of a communicator.
//!
//! A `CommControl` is shared by all ranks' handles of one communicator in this process. It
//! holds the communicator's first asynchronous error and its abort state, and reaches every
//! rank's device-side control block through the `ControlSource`s the device communicators
//! register. Aborting raises the abort flag in each control block: every device wait of the
//! communicator that is past its fast spin phase sees it and returns
//! (`ferrolink_device::barrier`). The watchdog (`super::watchdog`) calls
//! `CommControl::tick` periodically: it turns failed streams, device fault reports and
//! waits that never end into an abort with an error that says who waits on whom.

use crate::runtime::lifetime::lock;
use crate::runtime::stream::{StreamCore, StreamObserver};
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, Weak};
use std::time::{Duration, Instant};

/// Watchdog settings of a communicator.
///
/// ```
/// # use ferrolink::{CommConfig, Communicator, Device, LsaMode};
/// # use std::time::Duration;
/// # fn main() -> ferrolink::Result<()> {
/// # let dev = Device::open_with(ferrolink::Backend::Cpu, 0)?;
/// // No timeout, a progress line every 30 s.
/// let config = CommConfig { timeout: None, progress_interval: Duration::from_secs(30), lsa: LsaMode::Node };
/// let comms = Communicator::init_all_with(&[dev.clone(), dev], config)?;
/// assert_eq!(comms[0].config(), config);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CommConfig {
    /// How long a device wait may go on before the watchdog reports it and aborts the
    /// communicator; `None`: never. Default: `FERROLINK_TIMEOUT` (seconds; `0` turns it off),
    /// else 600 s on CUDA and 60 s on the CPU emulator (under the emulator's own 120 s launch
    /// limit, so that the watchdog's report comes first).
    pub timeout: Option<Duration>,
    /// A wait logs a progress line (who waits on whom) each time it has waited this long.
    /// Default: `FERROLINK_PROGRESS_SECS`, else 10 s.
    pub progress_interval: Duration,
    /// How LSA domains are chosen; every rank of a job must use the same. Default:
    /// `FERROLINK_LSA` (`node`, `process` or a number of ranks per domain), else
    /// [`LsaMode::Node`](crate::comm::topology::LsaMode::Node).
    pub lsa: crate::comm::topology::LsaMode,
}

impl CommConfig {
    /// The defaults for `backend`, with the environment's overrides: `FERROLINK_TIMEOUT`,
    /// `FERROLINK_PROGRESS_SECS` and `FERROLINK_LSA`. A value that is not what the variable
    /// takes is an error naming it (a typo must not silently leave a 600 s timeout).
    ///
    /// ```
    /// use ferrolink::{Backend, CommConfig};
    /// use std::time::Duration;
    /// let cpu = CommConfig::from_env(Backend::Cpu)?;
    /// if std::env::var_os("FERROLINK_TIMEOUT").is_none() {
    ///     assert_eq!(cpu.timeout, Some(Duration::from_secs(60)));
    ///     assert_eq!(CommConfig::from_env(Backend::Cuda)?.timeout, Some(Duration::from_secs(600)));
    /// }
    /// // SAFETY: no other thread of this program reads or writes the environment meanwhile.
    /// unsafe { std::env::set_var("FERROLINK_TIMEOUT", "10s") };
    /// let err = CommConfig::from_env(Backend::Cpu).unwrap_err().to_string();
    /// assert!(err.contains("FERROLINK_TIMEOUT=\"10s\""), "{err}");
    /// # Ok::<(), ferrolink::Error>(())
    /// ```
    pub fn from_env(backend: crate::Backend) -> Result<CommConfig> {
        let default_timeout = crate::runtime::backend::launch_profile(backend).default_timeout_secs;
        let timeout = match env_secs("FERROLINK_TIMEOUT", "a number of seconds, 0 for none")? {
            None => Some(Duration::from_secs_f64(default_timeout)),
            Some(t) if t > 0.0 => Some(Duration::from_secs_f64(t)),
            Some(_) => None,
        };
        let progress = match env_secs("FERROLINK_PROGRESS_SECS", "a number of seconds above 0")? {
            Some(p) if p <= 0.0 => {
                return Err(env_error("FERROLINK_PROGRESS_SECS", &p.to_string(), "a number of seconds above 0"));
            }
            p => p.unwrap_or(10.0),
        };
        let progress_interval = Duration::from_secs_f64(progress.max(0.01));
        let lsa = crate::comm::topology::LsaMode::from_env()?;
        Ok(CommConfig { timeout, progress_interval, lsa })
    }
}

/// `name` as seconds: `None` when unset or empty; an error when it is not a finite number of
/// seconds, at least 0 (`takes` says what it takes, for the message).
pub(crate) fn env_secs(name: &str, takes: &str) -> Result<Option<f64>> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(env_error(name, &v.to_string_lossy(), takes)),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if (0.0..1e9).contains(&s) => Ok(Some(s)),
            _ => Err(env_error(name, &v, takes)),
        },
    }
}

fn env_error(name: &str, value: &str, takes: &str) -> Error {
    Error::InvalidArgument(format!("{name}={value:?}: it takes {takes}"))
}

/// A device wait that has not finished, as the watchdog sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StalledWait {
    /// World rank of the waiter.
    pub(crate) rank: usize,
    /// Linear CTA index of the waiter.
    pub(crate) cta: u32,
    /// What it waits for.
    pub(crate) on: WaitOn,
    /// World ranks it waits on that have not done their part.
    pub(crate) missing: Vec<usize>,
}

/// What a stalled wait waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WaitOn {
    /// LSA barrier `barrier` (among the communicator's) to reach `epoch`.
    LsaBarrier { barrier: u32, epoch: u32 },
    /// GIN barrier `index` to reach `epoch`.
    GinBarrier { index: u32, epoch: u32 },
    /// GIN signal `signal` to reach `target`; it is `value`, with `from` what each sender
    /// has added (senders with nothing left out).
    GinSignal { signal: u32, target: u64, value: u64, from: Vec<(usize, u64)> },
    /// The rank's GIN proxy waits for its stream copy `id`, `what` for, running for
    /// `running`; `queues`: the device's hardware queues for streams and their setting.
    ProxyCopy {
        id: u64,
        what: crate::gin::copy_watch::CopyFor,
        running: std::time::Duration,
        queues: Option<(usize, &'static str)>,
    },
}

impl StalledWait {
    /// What identifies one wait across the watchdog's looks.
    pub(crate) fn key(&self) -> (usize, u8, u32, u64) {
        match self.on {
            WaitOn::LsaBarrier { barrier, epoch } => (self.rank, 0, barrier, u64::from(epoch)),
            WaitOn::GinBarrier { index, epoch } => (self.rank, 1, index, u64::from(epoch)),
            WaitOn::GinSignal { signal, target, .. } => (self.rank, 2, signal, target),
            WaitOn::ProxyCopy { id, .. } => (self.rank, 3, 0, id),
        }
    }

    /// "rank 3 CTA 5 waits at LSA barrier 5 for epoch 17: ranks 1 and 6 have not arrived".
    pub(crate) fn describe(&self) -> String {
        let who = match self.missing.as_slice() {
            [] => "every rank has arrived".to_string(),
            [one] => format!("rank {one} has not arrived"),
            many => {
                let (last, rest) = many.split_last().expect("non-empty");
                let rest: Vec<String> = rest.iter().map(usize::to_string).collect();
                format!("ranks {} and {last} have not arrived", rest.join(", "))
            }
        };
        let (rank, cta) = (self.rank, self.cta);
        match &self.on {
            WaitOn::LsaBarrier { barrier, epoch } => {
                format!("rank {rank} CTA {cta} waits at LSA barrier {barrier} for epoch {epoch}: {who}")
            }
            WaitOn::GinBarrier { index, epoch } => {
                format!("rank {rank} CTA {cta} waits at GIN barrier {index} for epoch {epoch}: {who}")
            }
            WaitOn::ProxyCopy { what, running, queues, .. } => {
                use crate::gin::copy_watch::CopyFor;
                let copy = match what {
                    CopyFor::DeliveryFrom(p) => format!("its copy of what rank {p} sent into this rank's memory"),
                    CopyFor::StagingTo(p) => format!("its copy of a put's source to rank {p} into staging"),
                };
                let why = match queues {
                    Some((q, setting)) if *q < 32 => format!(
                        ": the device's streams share {q} hardware queues ({setting}={q}), and a copy whose queue \
                         holds a kernel waiting for it never runs; set {setting}=32 before the process first uses \
                         CUDA"
                    ),
                    Some((q, setting)) => format!(
                        ": the device's streams share {q} hardware queues ({setting}={q}); with more streams than \
                         queues, a copy whose queue holds a kernel waiting for it never runs"
                    ),
                    None => String::new(),
                };
                format!("rank {rank}'s GIN proxy waits for {copy}, running for {running:.1?}{why}")
            }
            WaitOn::GinSignal { signal, target, value, from } => {
                let senders = if from.is_empty() {
                    "no rank has signalled it".to_string()
                } else {
                    let parts: Vec<String> = from.iter().map(|(r, v)| format!("{v} from rank {r}")).collect();
                    parts.join(", ")
                };
                match self.missing.as_slice() {
                    [peer] => format!(
                        "rank {rank} CTA {cta} waits for rank {peer}: its part of GIN signal {signal} is {value}, \
                         {target} needed (a point-to-point channel: rank {peer} has not sent or received its side)"
                    ),
                    _ => format!(
                        "rank {rank} CTA {cta} waits for GIN signal {signal} to reach {target}: it is {value} ({senders})"
                    ),
                }
            }
        }
    }
}

/// One rank's device-side control block, as the communicator reaches it (implemented by the
/// device communicator's resources).
pub(crate) trait ControlSource: Send + Sync {
    /// The rank whose block it is.
    fn rank(&self) -> usize;
    /// Raises the abort flag kernels poll.
    fn raise_abort(&self);
    /// The fault a kernel reported, decoded, if any.
    fn fault(&self) -> Option<String>;
    /// Waits that went slow and have not finished (missing peers read from the inboxes).
    fn stalled_waits(&self) -> Result<Vec<StalledWait>>;
    /// Returns the barriers, the abort flag and the fault record to their initial state.
    /// Nothing may run that uses them.
    fn reset(&self) -> Result<()>;
}

/// [`CommControl`]'s stored timeout for "none".
const NO_TIMEOUT: u64 = u64::MAX;

fn timeout_to_ns(timeout: Option<Duration>) -> u64 {
    timeout.map_or(NO_TIMEOUT, |t| u64::try_from(t.as_nanos()).unwrap_or(NO_TIMEOUT - 1).min(NO_TIMEOUT - 1))
}

/// A stalled wait's key: (rank, kind, barrier or signal, epoch or target).
type StallKey = (usize, u8, u32, u64);

/// When the watchdog first saw a stalled wait, and how many progress lines it has logged.
type StallSeen = (Instant, u32);

/// Abort state, asynchronous error and watchdog bookkeeping of one communicator.
pub(crate) struct CommControl {
    pub(crate) comm_id: u64,
    config: CommConfig,
    /// The timeout in nanoseconds ([`NO_TIMEOUT`]: none), which [`CommControl::set_timeout`]
    /// may change; `config.timeout` is not read.
    timeout_ns: AtomicU64,
    aborted: AtomicBool,
    error: Mutex<Option<Error>>,
    sources: Mutex<Vec<Weak<dyn ControlSource>>>,
    /// The streams watched for failures (each rank's, each GPU group's launch stream), with
    /// what names them.
    streams: Mutex<Vec<(String, Weak<StreamCore>)>>,
    /// When the watchdog first saw each stalled wait, keyed by (rank, barrier, epoch), and
    /// how many progress lines it has logged for it.
    stalls: Mutex<HashMap<StallKey, StallSeen>>,
    /// What this process's ranks of the communicator computed once for all of them: every
    /// rank's description, and the LSA layout (the same inputs give the same result on every
    /// rank; a thousand virtual ranks must not each decode and check a thousand others).
    pub(crate) peers: std::sync::OnceLock<std::sync::Arc<Vec<super::topology::PeerInfo>>>,
    pub(crate) layout: std::sync::OnceLock<super::topology::LsaLayout>,
}

impl CommControl {
    pub(crate) fn new(comm_id: u64, config: CommConfig) -> CommControl {
        CommControl {
            comm_id,
            config,
            timeout_ns: AtomicU64::new(timeout_to_ns(config.timeout)),
            aborted: AtomicBool::new(false),
            error: Mutex::new(None),
            sources: Mutex::new(Vec::new()),
            streams: Mutex::new(Vec::new()),
            stalls: Mutex::new(HashMap::new()),
            peers: std::sync::OnceLock::new(),
            layout: std::sync::OnceLock::new(),
        }
    }

    pub(crate) fn config(&self) -> CommConfig {
        let ns = self.timeout_ns.load(Ordering::Relaxed);
        CommConfig { timeout: (ns != NO_TIMEOUT).then(|| Duration::from_nanos(ns)), ..self.config }
    }

    /// Changes the timeout of every wait of this process's ranks from now on (the next look
    /// of a wait in progress sees it).
    pub(crate) fn set_timeout(&self, timeout: Option<Duration>) {
        self.timeout_ns.store(timeout_to_ns(timeout), Ordering::Relaxed);
    }

    pub(crate) fn add_source(&self, s: Weak<dyn ControlSource>) {
        let mut list = lock(&self.sources);
        list.retain(|w| w.strong_count() > 0);
        list.push(s);
        drop(list);
        if self.aborted.load(Ordering::SeqCst) {
            self.raise_all();
        }
    }

    /// Watches `s` for failures; `whose` names it in the abort's message ("rank 3's stream").
    pub(crate) fn watch_stream(&self, whose: String, s: Weak<StreamCore>) {
        lock(&self.streams).push((whose, s));
    }

    fn sources(&self) -> Vec<std::sync::Arc<dyn ControlSource>> {
        lock(&self.sources).iter().filter_map(Weak::upgrade).collect()
    }

    fn raise_all(&self) {
        for s in self.sources() {
            s.raise_abort();
        }
    }

    /// Whether the communicator is aborted.
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// The first asynchronous error.
    pub(crate) fn error(&self) -> Option<Error> {
        lock(&self.error).clone()
    }

    /// Aborts the communicator with `why` (kept as its asynchronous error unless it already
    /// has one). Callable from any thread; returns at once.
    pub(crate) fn abort(&self, why: Error) {
        {
            let mut e = lock(&self.error);
            if e.is_none() {
                tracing::error!(target: "ferrolink::comm", comm = self.comm_id, error = %why, "aborting the communicator");
                *e = Some(why);
            }
        }
        self.aborted.store(true, Ordering::SeqCst);
        self.raise_all();
    }

    /// Forgets the abort and the asynchronous error (after the sources were reset).
    pub(crate) fn clear(&self) {
        *lock(&self.error) = None;
        lock(&self.stalls).clear();
        self.aborted.store(false, Ordering::SeqCst);
    }

    /// Resets rank `rank`'s control blocks (recovery).
    pub(crate) fn reset_sources_of(&self, rank: usize) -> Result<()> {
        self.sources().iter().filter(|s| s.rank() == rank).try_for_each(|s| s.reset())
    }

    /// The control shared by this process's ranks of communicator `comm_id` (created with
    /// `config` by the first of them).
    pub(crate) fn for_comm(comm_id: u64, config: CommConfig) -> std::sync::Arc<CommControl> {
        static LIVE: std::sync::OnceLock<Mutex<HashMap<u64, Weak<CommControl>>>> = std::sync::OnceLock::new();
        let mut live = lock(LIVE.get_or_init(|| Mutex::new(HashMap::new())));
        live.retain(|_, w| w.strong_count() > 0);
        if let Some(c) = live.get(&comm_id).and_then(Weak::upgrade) {
            return c;
        }
        let c = std::sync::Arc::new(CommControl::new(comm_id, config));
        live.insert(comm_id, std::sync::Arc::downgrade(&c));
        super::watchdog::watch(std::sync::Arc::downgrade(&c));
        c
    }

    /// One watchdog pass: failed streams, fault reports, stalled waits.
    pub(crate) fn tick(&self, now: Instant) {
        if self.is_aborted() {
            return;
        }
        let streams: Vec<(String, std::sync::Arc<StreamCore>)> =
            lock(&self.streams).iter().filter_map(|(r, w)| w.upgrade().map(|s| (r.clone(), s))).collect();
        for (whose, s) in streams {
            if let Some(e) = s.failure() {
                self.abort(Error::Aborted(format!("{whose} failed: {e}")));
                return;
            }
        }
        let sources = self.sources();
        for s in &sources {
            if let Some(f) = s.fault() {
                self.abort(Error::Aborted(format!("a kernel of rank {} reported a fault: {f}", s.rank())));
                return;
            }
        }
        let mut seen = Vec::new();
        for s in &sources {
            match s.stalled_waits() {
                Ok(w) => seen.extend(w),
                Err(e) => {
                    tracing::debug!(target: "ferrolink::comm", error = %e, "watchdog could not read wait records")
                }
            }
        }
        let config = self.config();
        let mut stalls = lock(&self.stalls);
        stalls.retain(|k, _| seen.iter().any(|w| w.key() == *k));
        let mut expired = None;
        for w in &seen {
            let entry = stalls.entry(w.key()).or_insert((now, 0));
            let waited = now.saturating_duration_since(entry.0);
            if config.timeout.is_some_and(|t| waited >= t) {
                expired.get_or_insert((w.clone(), waited));
            } else if waited >= config.progress_interval * (entry.1 + 1) {
                entry.1 += 1;
                tracing::warn!(target: "ferrolink::comm", comm = self.comm_id, "{} (waiting for {:.0?})", w.describe(), waited);
            }
        }
        drop(stalls);
        if let Some((w, waited)) = expired {
            // A proxy copy that does not finish is likely why the others wait: say so too.
            let copies: Vec<String> = seen
                .iter()
                .filter(|c| matches!(c.on, WaitOn::ProxyCopy { .. }) && c.key() != w.key())
                .map(StalledWait::describe)
                .collect();
            let also = if copies.is_empty() { String::new() } else { format!("; meanwhile {}", copies.join("; ")) };
            self.abort(Error::WaitTimeout(format!(
                "{} (waited {:.1?}, over the communicator's timeout; FERROLINK_TIMEOUT sets it){also}",
                w.describe(),
                waited
            )));
        }
    }
}

impl StreamObserver for CommControl {
    fn explain_failure(&self, _err: &Error) -> Option<Error> {
        None
    }

    fn external_error(&self) -> Option<Error> {
        if self.is_aborted() { Some(self.error().unwrap_or_else(|| Error::Aborted("aborted".into()))) } else { None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gin::copy_watch::CopyFor;

    /// A rank whose kernel waits at a GIN barrier while its proxy waits for a copy.
    struct Stalled;

    impl ControlSource for Stalled {
        fn rank(&self) -> usize {
            2
        }
        fn raise_abort(&self) {}
        fn fault(&self) -> Option<String> {
            None
        }
        fn stalled_waits(&self) -> Result<Vec<StalledWait>> {
            Ok(vec![
                StalledWait { rank: 2, cta: 0, on: WaitOn::GinBarrier { index: 0, epoch: 5 }, missing: vec![4] },
                StalledWait {
                    rank: 2,
                    cta: 0,
                    on: WaitOn::ProxyCopy {
                        id: 9,
                        what: CopyFor::DeliveryFrom(4),
                        running: Duration::from_secs(3),
                        queues: Some((8, "QUEUES")),
                    },
                    missing: Vec::new(),
                },
            ])
        }
        fn reset(&self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_timed_out_wait_names_the_proxy_copy_that_does_not_finish() {
        let config = CommConfig {
            timeout: Some(Duration::from_secs(5)),
            progress_interval: Duration::from_secs(1),
            ..CommConfig::from_env(crate::Backend::Cpu).unwrap()
        };
        let control = CommControl::new(1, config);
        let source: std::sync::Arc<dyn ControlSource> = std::sync::Arc::new(Stalled);
        control.add_source(std::sync::Arc::downgrade(&source));
        let t0 = Instant::now();
        control.tick(t0);
        assert!(!control.is_aborted(), "not before the timeout");
        control.tick(t0 + Duration::from_secs(6));
        let text = control.error().expect("aborted at the timeout").to_string();
        assert!(text.contains("GIN barrier 0 for epoch 5: rank 4 has not arrived"), "{text}");
        assert!(text.contains("meanwhile rank 2's GIN proxy waits for its copy of what rank 4 sent"), "{text}");
        assert!(text.contains("QUEUES=8"), "{text}");
    }
}
