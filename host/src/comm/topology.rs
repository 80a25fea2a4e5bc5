//! Which ranks can load and store each other's memory (the LSA domain), across processes and
//! machines: every rank describes itself ([`PeerInfo`]), every rank says which others it can
//! map, and every rank then computes the same domains from the same gathered data.

use crate::runtime::device::Device;
use crate::{Backend, Error, Result};

/// What a rank tells the others about where it runs.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::{Backend, Device, comm::topology::PeerInfo};
/// let dev = Device::open_with(Backend::Cpu, 0)?;
/// // Two virtual ranks on one device: one process, one device identity.
/// let (a, b) = (PeerInfo::local(&dev), PeerInfo::local(&dev));
/// assert_eq!(a, b);
/// assert_eq!((a.backend, a.ordinal), (Backend::Cpu, 0));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The machine: host name and boot id (`/proc/sys/kernel/random/boot_id`), so that two
    /// machines with one name, or one machine rebooted, differ.
    pub node: String,
    /// The process.
    pub pid: u32,
    /// The backend of its device.
    pub backend: Backend,
    /// Its device's identity: the GPU's UUID on CUDA; on the emulator, the process and the
    /// device's number.
    pub uuid: [u8; 16],
    /// Its device's ordinal in its process.
    pub ordinal: u32,
    /// Whether kernels of several processes may share its device (on CUDA: MPS is running).
    pub multi_process_ok: bool,
}

/// This machine's identity: host name and boot id.
///
/// ```
/// use ferrolink::comm::topology::node_identity;
/// let me = node_identity();
/// assert!(me.contains('/'), "host name / boot id: {me}");
/// assert_eq!(node_identity(), me);
/// ```
pub fn node_identity() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    let host = read("/proc/sys/kernel/hostname");
    let boot = read("/proc/sys/kernel/random/boot_id");
    format!("{host}/{boot}")
}

impl PeerInfo {
    /// This process's rank on `dev`.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::{Backend, Device, comm::topology::{PeerInfo, node_identity}};
    /// let a = PeerInfo::local(&Device::open_with(Backend::Cpu, 0)?);
    /// let b = PeerInfo::local(&Device::open_with(Backend::Cpu, 1)?);
    /// assert_eq!((a.backend, a.pid, a.node.as_str()), (Backend::Cpu, std::process::id(), &*node_identity()));
    /// assert!(a.same_process(&b));
    /// assert_ne!(a.uuid, b.uuid, "two emulated devices");
    /// # Ok(()) }
    /// ```
    pub fn local(dev: &Device) -> PeerInfo {
        let b = dev.backend_device();
        PeerInfo {
            node: node_identity(),
            pid: std::process::id(),
            backend: dev.backend(),
            uuid: b.uuid(),
            ordinal: dev.ordinal() as u32,
            multi_process_ok: b.check_multi_process().is_ok(),
        }
    }

    /// Whether `other` runs in the same process on the same machine.
    ///
    /// ```
    /// # use ferrolink::comm::topology::*;
    /// # fn info(node: &str, pid: u32, dev: u8) -> PeerInfo {
    /// #     let (backend, uuid, ordinal, multi_process_ok) = (ferrolink::Backend::Cuda, [dev; 16], dev.into(), false);
    /// #     PeerInfo { node: node.into(), pid, backend, uuid, ordinal, multi_process_ok }
    /// # }
    /// assert!(info("a", 1, 0).same_process(&info("a", 1, 1)));
    /// assert!(!info("a", 1, 0).same_process(&info("a", 2, 0)));
    /// assert!(!info("a", 1, 0).same_process(&info("b", 1, 0)), "one pid on two machines");
    /// ```
    pub fn same_process(&self, other: &PeerInfo) -> bool {
        self.pid == other.pid && self.node == other.node
    }

    /// The wire form.
    ///
    /// ```
    /// # use ferrolink::comm::topology::*;
    /// # fn info(node: &str, pid: u32, dev: u8) -> PeerInfo {
    /// #     let (backend, uuid, ordinal, multi_process_ok) = (ferrolink::Backend::Cuda, [dev; 16], dev.into(), false);
    /// #     PeerInfo { node: node.into(), pid, backend, uuid, ordinal, multi_process_ok }
    /// # }
    /// // Every rank all-gathers its description in this form.
    /// let me = info("node-a/boot", 42, 3);
    /// assert_eq!(PeerInfo::decode(&me.encode()).unwrap(), me);
    /// ```
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(32 + self.node.len());
        v.push(self.backend.wire_code());
        v.push(u8::from(self.multi_process_ok));
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.ordinal.to_le_bytes());
        v.extend_from_slice(&self.uuid);
        v.extend_from_slice(self.node.as_bytes());
        v
    }

    /// Parses [`PeerInfo::encode`]'s form.
    ///
    /// ```
    /// # use ferrolink::comm::topology::*;
    /// # fn info(node: &str, pid: u32, dev: u8) -> PeerInfo {
    /// #     let (backend, uuid, ordinal, multi_process_ok) = (ferrolink::Backend::Cuda, [dev; 16], dev.into(), false);
    /// #     PeerInfo { node: node.into(), pid, backend, uuid, ordinal, multi_process_ok }
    /// # }
    /// let bytes = info("node-a/boot", 42, 3).encode();
    /// assert_eq!(PeerInfo::decode(&bytes).unwrap().pid, 42);
    /// assert!(PeerInfo::decode(&bytes[..20]).is_err(), "truncated");
    /// ```
    pub fn decode(b: &[u8]) -> Result<PeerInfo> {
        let bad = || Error::Bootstrap(format!("a rank's description is malformed ({} bytes)", b.len()));
        if b.len() < 26 {
            return Err(bad());
        }
        let backend = Backend::from_wire_code(b[0]).ok_or_else(bad)?;
        Ok(PeerInfo {
            backend,
            multi_process_ok: b[1] != 0,
            pid: u32::from_le_bytes(b[2..6].try_into().map_err(|_| bad())?),
            ordinal: u32::from_le_bytes(b[6..10].try_into().map_err(|_| bad())?),
            uuid: b[10..26].try_into().map_err(|_| bad())?,
            node: String::from_utf8(b[26..].to_vec()).map_err(|_| bad())?,
        })
    }
}

/// How LSA domains are chosen (`FERROLINK_LSA`).
///
/// ```
/// # use ferrolink::comm::topology::*;
/// # fn info(node: &str, pid: u32, dev: u8) -> PeerInfo {
/// #     let (backend, uuid, ordinal, multi_process_ok) = (ferrolink::Backend::Cuda, [dev; 16], dev.into(), false);
/// #     PeerInfo { node: node.into(), pid, backend, uuid, ordinal, multi_process_ok }
/// # }
/// // Four virtual ranks: one process, one device.
/// let infos = vec![info("a", 1, 0); 4];
/// let reach = vec![vec![true; 4]; 4];
/// assert_eq!(lsa_layout(&infos, &reach, LsaMode::Node).size, 4);
/// assert_eq!(lsa_layout(&infos, &reach, LsaMode::Process).size, 4);
/// assert_eq!(lsa_layout(&infos, &reach, LsaMode::Size(2)).size, 2);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LsaMode {
    /// Ranks of one machine whose devices can map each other (the default).
    Node,
    /// Ranks of one process only: makes every process its own LSA domain, so that the paths
    /// between domains (GIN, hybrid barriers) run on one machine.
    Process,
    /// Domains of this many consecutive ranks, inside the domains [`LsaMode::Node`] finds
    /// (it must divide their size): tests and benchmarks of the paths between domains with
    /// ranks of one process.
    Size(usize),
}

impl LsaMode {
    /// `FERROLINK_LSA`: `node` (default), `process`, or a domain size.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::LsaMode;
    /// let mode = LsaMode::from_env()?;
    /// if std::env::var("FERROLINK_LSA").map_or(true, |v| v.is_empty() || v == "node") {
    ///     assert_eq!(mode, LsaMode::Node);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn from_env() -> Result<LsaMode> {
        match std::env::var("FERROLINK_LSA").as_deref() {
            Err(_) | Ok("") | Ok("node") => Ok(LsaMode::Node),
            Ok("process") => Ok(LsaMode::Process),
            Ok(other) => match other.trim().parse::<usize>() {
                Ok(k) if k > 0 => Ok(LsaMode::Size(k)),
                _ => Err(Error::InvalidArgument(format!(
                    "FERROLINK_LSA={other:?}: use `node`, `process` or a number of ranks per domain"
                ))),
            },
        }
    }
}

/// The LSA domains of a job, as every rank computes them.
///
/// ```
/// # use ferrolink::comm::topology::*;
/// # fn info(node: &str, pid: u32, dev: u8) -> PeerInfo {
/// #     let (backend, uuid, ordinal, multi_process_ok) = (ferrolink::Backend::Cuda, [dev; 16], dev.into(), false);
/// #     PeerInfo { node: node.into(), pid, backend, uuid, ordinal, multi_process_ok }
/// # }
/// let infos = vec![info("a", 1, 0); 4];
/// let layout = lsa_layout(&infos, &vec![vec![true; 4]; 4], LsaMode::Size(2));
/// assert_eq!(layout, LsaLayout { size: 2 });
/// let domain_of = |rank: usize| rank / layout.size;
/// assert_eq!((domain_of(1), domain_of(2)), (0, 1));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LsaLayout {
    /// Ranks per domain; domains are consecutive blocks of world ranks.
    pub size: usize,
}

/// The domains from every rank's description and reach (`reach[r][s]`: rank `r` can map rank
/// `s`'s device and runs on its machine). The first domain is the longest prefix of ranks that
/// all reach each other (and share a process, in [`LsaMode::Process`]); when every block of
/// that size is such a clique, that is the size, else every rank is its own domain (which is
/// always valid), with a warning.
///
/// ```
/// # use ferrolink::comm::topology::*;
/// # fn info(node: &str, pid: u32, dev: u8) -> PeerInfo {
/// #     let (backend, uuid, ordinal, multi_process_ok) = (ferrolink::Backend::Cuda, [dev; 16], dev.into(), false);
/// #     PeerInfo { node: node.into(), pid, backend, uuid, ordinal, multi_process_ok }
/// # }
/// // Two machines of two GPUs, one process per GPU; the GPUs of a machine reach each other.
/// let infos = vec![info("a", 1, 0), info("a", 2, 1), info("b", 1, 0), info("b", 2, 1)];
/// let reach = vec![vec![true; 4]; 4];
/// assert_eq!(lsa_layout(&infos, &reach, LsaMode::Node).size, 2);
/// assert_eq!(lsa_layout(&infos, &reach, LsaMode::Process).size, 1);
/// ```
pub fn lsa_layout(infos: &[PeerInfo], reach: &[Vec<bool>], mode: LsaMode) -> LsaLayout {
    let n = infos.len();
    // Small integers for the machines and processes, so that the checks below compare
    // numbers: this runs for every rank of a thousand-rank job.
    let mut nodes: Vec<&str> = Vec::new();
    let mut procs: Vec<(&str, u32)> = Vec::new();
    let mut node_of = Vec::with_capacity(n);
    let mut proc_of = Vec::with_capacity(n);
    for i in infos {
        let node = nodes.iter().position(|x| *x == i.node).unwrap_or_else(|| {
            nodes.push(&i.node);
            nodes.len() - 1
        });
        let proc = procs.iter().position(|x| *x == (i.node.as_str(), i.pid)).unwrap_or_else(|| {
            procs.push((&i.node, i.pid));
            procs.len() - 1
        });
        node_of.push(node);
        proc_of.push(proc);
    }
    let linked = |a: usize, b: usize| {
        reach[a][b] && reach[b][a] && node_of[a] == node_of[b] && (mode != LsaMode::Process || proc_of[a] == proc_of[b])
    };
    // The first block: grow it while the next rank links to every rank in it.
    let mut k = 1;
    while k < n && (0..k).all(|a| linked(a, k)) {
        k += 1;
    }
    let clique = |start: usize| (start..start + k).all(|a| (a + 1..start + k).all(|b| linked(a, b)));
    if n.is_multiple_of(k) && (k..n).step_by(k).all(clique) {
        match mode {
            LsaMode::Size(want) if k.is_multiple_of(want) => LsaLayout { size: want },
            LsaMode::Size(want) => {
                tracing::warn!(
                    target: "ferrolink::comm",
                    "FERROLINK_LSA={want} does not divide the natural LSA domain of {k} ranks: every rank is its own \
                     LSA domain"
                );
                LsaLayout { size: 1 }
            }
            _ => LsaLayout { size: k },
        }
    } else {
        tracing::warn!(
            target: "ferrolink::comm",
            "the ranks that can map each other do not form equal consecutive blocks (first block: {k} of {n} \
             ranks): every rank is its own LSA domain"
        );
        LsaLayout { size: 1 }
    }
}

/// The job's problem with processes that share a device, if any: a sentence for the error.
/// (One pass over the ranks: it runs on every rank of jobs of thousands.)
///
/// ```
/// # use ferrolink::comm::topology::*;
/// # fn info(node: &str, pid: u32, dev: u8) -> PeerInfo {
/// #     let (backend, uuid, ordinal, multi_process_ok) = (ferrolink::Backend::Cuda, [dev; 16], dev.into(), false);
/// #     PeerInfo { node: node.into(), pid, backend, uuid, ordinal, multi_process_ok }
/// # }
/// // Two processes on one GPU, without MPS.
/// let mut infos = vec![info("a", 1, 0), info("a", 2, 0)];
/// assert!(shared_device_problem(&infos).unwrap().contains("MPS"));
/// infos.iter_mut().for_each(|i| i.multi_process_ok = true);
/// assert_eq!(shared_device_problem(&infos), None);
/// ```
pub fn shared_device_problem(infos: &[PeerInfo]) -> Option<String> {
    let mut first_on: std::collections::HashMap<(&str, [u8; 16]), usize> = std::collections::HashMap::new();
    for (b, y) in infos.iter().enumerate() {
        let a = *first_on.entry((y.node.as_str(), y.uuid)).or_insert(b);
        let x = &infos[a];
        if x.pid != y.pid && !(x.multi_process_ok && y.multi_process_ok) {
            return Some(format!(
                "ranks {a} and {b} run in different processes on one device (ordinal {} of {}): their kernels \
                 can only run at the same time under MPS, which is not running. Start the MPS control daemon \
                 (`nvidia-cuda-mps-control -d`), or give each process its own GPU",
                x.ordinal, x.node
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(node: &str, pid: u32, dev: u8) -> PeerInfo {
        PeerInfo {
            node: node.into(),
            pid,
            backend: Backend::Cuda,
            uuid: [dev; 16],
            ordinal: u32::from(dev),
            multi_process_ok: false,
        }
    }

    #[test]
    fn peer_infos_round_trip() {
        let i = info("host/boot", 42, 3);
        assert_eq!(PeerInfo::decode(&i.encode()).unwrap(), i);
        assert!(PeerInfo::decode(&[9; 30]).is_err());
        assert!(PeerInfo::decode(&[1; 3]).is_err());
    }

    #[test]
    fn domains_are_equal_consecutive_cliques_or_single_ranks() {
        // Two machines of two GPUs, one process per GPU, all peers reachable on a machine.
        let infos = vec![info("a", 1, 0), info("a", 2, 1), info("b", 1, 0), info("b", 2, 1)];
        let all = vec![vec![true; 4]; 4];
        assert_eq!(lsa_layout(&infos, &all, LsaMode::Node).size, 2);
        assert_eq!(lsa_layout(&infos, &all, LsaMode::Process).size, 1);
        // One machine, no peer access between the GPUs.
        let one = vec![info("a", 1, 0), info("a", 2, 1)];
        let none = vec![vec![true, false], vec![false, true]];
        assert_eq!(lsa_layout(&one, &none, LsaMode::Node).size, 1);
        // Uneven blocks (3 ranks on a machine, 1 on another): every rank alone.
        let uneven = vec![info("a", 1, 0), info("a", 2, 1), info("a", 3, 2), info("b", 1, 0)];
        assert_eq!(lsa_layout(&uneven, &all, LsaMode::Node).size, 1);
        // Virtual ranks: one process, one GPU.
        let virt = vec![info("a", 1, 0); 8];
        assert_eq!(lsa_layout(&virt, &vec![vec![true; 8]; 8], LsaMode::Process).size, 8);
        assert_eq!(lsa_layout(&virt, &vec![vec![true; 8]; 8], LsaMode::Size(2)).size, 2);
        assert_eq!(lsa_layout(&virt, &vec![vec![true; 8]; 8], LsaMode::Size(3)).size, 1);
    }

    #[test]
    fn processes_sharing_a_gpu_need_mps() {
        let mut infos = vec![info("a", 1, 0), info("a", 2, 0)];
        assert!(shared_device_problem(&infos).unwrap().contains("MPS"));
        infos.iter_mut().for_each(|i| i.multi_process_ok = true);
        assert!(shared_device_problem(&infos).is_none());
        assert!(shared_device_problem(&[info("a", 1, 0), info("a", 1, 0)]).is_none(), "one process: fine");
    }
}
