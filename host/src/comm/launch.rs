//! Launcher environments: what `Communicator::from_env` reads.
//!
//! | launcher | rank | ranks | local rank | local ranks |
//! | --- | --- | --- | --- | --- |
//! | torchrun (and `ferrolink-run`) | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `LOCAL_WORLD_SIZE` |
//! | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
//! | Slurm (`srun`) | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | `SLURM_NTASKS_PER_NODE` |
//! | override | `FERROLINK_RANK` | `FERROLINK_NRANKS` | `FERROLINK_LOCAL_RANK` | `FERROLINK_LOCAL_NRANKS` |
//!
//! The `FERROLINK_*` variables win over a launcher's. How the ranks find the bootstrap's root:
//! * `FERROLINK_UNIQUE_ID`: a unique id in its text form (`ferrolink-run` sets it): the root's
//!   address, the job's magic and a real secret;
//! * else `FERROLINK_ROOT` (`host:port`), else `MASTER_ADDR` with port `FERROLINK_BOOTSTRAP_PORT`
//!   or `MASTER_PORT + 1` (torchrun's own store listens on `MASTER_PORT`). The magic and the
//!   secret are then derived from the address, the job's size and the launcher's job id, so
//!   every rank computes the same; they are not secret, only a guard against stray
//!   connections. Pass a `FERROLINK_UNIQUE_ID` where that matters.
//!
//! The device: `FERROLINK_DEVICE` (an ordinal), else the local rank, else 0.

use super::bootstrap::UniqueId;
use crate::{Error, Result};
use std::net::{SocketAddr, ToSocketAddrs};

/// A launcher's description of this process's rank.
///
/// ```
/// # use ferrolink::comm::launch::LaunchEnv;
/// # fn env(vars: &[(&str, &str)]) -> Option<LaunchEnv> {
/// #     LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap()
/// # }
/// // torchrun's variables, for the second of four ranks.
/// let e = env(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")]).unwrap();
/// assert_eq!((e.launcher, e.rank, e.nranks), ("torchrun", 1, 4));
/// assert_eq!((e.local_rank, e.local_nranks), (Some(1), Some(2)));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Which launcher's variables were read ("torchrun", "Open MPI", "Slurm", "ferrolink").
    pub launcher: &'static str,
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub nranks: usize,
    /// This rank's index among the ranks of its machine, if the launcher says.
    pub local_rank: Option<usize>,
    /// Ranks on this machine, if the launcher says.
    pub local_nranks: Option<usize>,
    /// `FERROLINK_DEVICE`, if set.
    device: Option<usize>,
    /// How to reach the root.
    root: RootSource,
    /// The launcher's job id, if any (mixed into a derived magic).
    job: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum RootSource {
    Id(String),
    Address(String),
    Missing,
}

impl LaunchEnv {
    /// Reads this process's environment; `None` when no launcher variables are set.
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::comm::launch::LaunchEnv;
    /// match LaunchEnv::detect()? {
    ///     Some(env) => assert!(env.rank < env.nranks),
    ///     None => {} // not started by a launcher: e.g. `Communicator::init_all` on local devices
    /// }
    /// # Ok(()) }
    /// ```
    pub fn detect() -> Result<Option<LaunchEnv>> {
        LaunchEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`LaunchEnv::detect`] over any variable lookup (for tests and tools).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::comm::launch::LaunchEnv;
    /// let vars = [("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1")];
    /// let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
    /// let env = LaunchEnv::from_lookup(get)?.expect("Slurm's variables");
    /// assert_eq!((env.launcher, env.rank, env.nranks), ("Slurm", 5, 8));
    /// assert_eq!(LaunchEnv::from_lookup(|_| None)?, None);
    /// assert!(LaunchEnv::from_lookup(|k| (k == "RANK" || k == "WORLD_SIZE").then(|| "2".into())).is_err());
    /// # Ok(()) }
    /// ```
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
        let num =
            |k: &str| -> Result<Option<usize>> {
                match get(k) {
                    None => Ok(None),
                    Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
                        Error::InvalidArgument(format!("{k}={v:?} is not a number (launcher environment)"))
                    }),
                }
            };
        let launchers: [(&'static str, [&str; 4]); 4] = [
            ("ferrolink", ["FERROLINK_RANK", "FERROLINK_NRANKS", "FERROLINK_LOCAL_RANK", "FERROLINK_LOCAL_NRANKS"]),
            ("torchrun", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]),
            (
                "Open MPI",
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                ],
            ),
            ("Slurm", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"]),
        ];
        let mut found = None;
        for (name, [r, n, lr, ln]) in launchers {
            if let (Some(rank), Some(nranks)) = (num(r)?, num(n)?) {
                // The local size is only a hint, and Slurm writes it as a list where nodes
                // differ (SLURM_NTASKS_PER_NODE="4(x2),3"): one that is not a number is unknown.
                found = Some((name, rank, nranks, num(lr)?, num(ln).unwrap_or(None)));
                break;
            }
        }
        let Some((launcher, rank, nranks, local_rank, local_nranks)) = found else { return Ok(None) };
        if nranks == 0 || rank >= nranks {
            return Err(Error::InvalidArgument(format!("{launcher} environment: rank {rank} is outside 0..{nranks}")));
        }
        let root = if let Some(id) = get("FERROLINK_UNIQUE_ID") {
            RootSource::Id(id)
        } else if let Some(addr) = get("FERROLINK_ROOT") {
            RootSource::Address(addr)
        } else if let Some(host) = get("MASTER_ADDR") {
            let port = match num("FERROLINK_BOOTSTRAP_PORT")? {
                Some(p) => p,
                None => num("MASTER_PORT")?
                    .map(|p| p + 1)
                    .ok_or_else(|| Error::InvalidArgument("MASTER_ADDR is set but MASTER_PORT is not".into()))?,
            };
            RootSource::Address(format!("{host}:{port}"))
        } else {
            RootSource::Missing
        };
        let job = ["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMPI_MCA_ess_base_jobid"]
            .iter()
            .filter_map(|k| get(k))
            .collect::<Vec<_>>()
            .join("/");
        Ok(Some(LaunchEnv {
            launcher,
            rank,
            nranks,
            local_rank,
            local_nranks,
            device: num("FERROLINK_DEVICE")?,
            root,
            job,
        }))
    }

    /// The device ordinal this rank should use: `FERROLINK_DEVICE`, else the local rank, else 0.
    ///
    /// ```
    /// # use ferrolink::comm::launch::LaunchEnv;
    /// # fn env(vars: &[(&str, &str)]) -> Option<LaunchEnv> {
    /// #     LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap()
    /// # }
    /// assert_eq!(env(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")]).unwrap().device_ordinal(), 1);
    /// let pinned = env(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("FERROLINK_DEVICE", "0")]);
    /// assert_eq!(pinned.unwrap().device_ordinal(), 0);
    /// ```
    pub fn device_ordinal(&self) -> usize {
        self.device.or(self.local_rank).unwrap_or(0)
    }

    /// The bootstrap's unique id (see the [module docs](self)).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// # use ferrolink::comm::launch::LaunchEnv;
    /// # fn env(vars: &[(&str, &str)]) -> Option<LaunchEnv> {
    /// #     LaunchEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap()
    /// # }
    /// let master = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("WORLD_SIZE", "2")];
    /// let rank0 = env(&[master.as_slice(), &[("RANK", "0")]].concat()).unwrap();
    /// let rank1 = env(&[master.as_slice(), &[("RANK", "1")]].concat()).unwrap();
    /// // Every rank derives the same id; the root listens next to torchrun's store.
    /// assert_eq!(rank0.unique_id()?, rank1.unique_id()?);
    /// assert_eq!(rank0.unique_id()?.root().port(), 29501);
    /// # Ok(()) }
    /// ```
    pub fn unique_id(&self) -> Result<UniqueId> {
        match &self.root {
            RootSource::Id(text) => text.parse(),
            RootSource::Address(addr) => {
                let root: SocketAddr = addr
                    .to_socket_addrs()
                    .map_err(|e| Error::InvalidArgument(format!("the bootstrap root {addr:?} does not resolve: {e}")))?
                    .next()
                    .ok_or_else(|| Error::InvalidArgument(format!("the bootstrap root {addr:?} has no address")))?;
                let seed = format!("{root}|{}|{}", self.nranks, self.job);
                let magic = fnv1a(seed.as_bytes(), 0);
                let mut secret = [0u8; 16];
                secret[..8].copy_from_slice(&fnv1a(seed.as_bytes(), 1).to_le_bytes());
                secret[8..].copy_from_slice(&fnv1a(seed.as_bytes(), 2).to_le_bytes());
                Ok(UniqueId::from_parts(root, magic, secret))
            }
            RootSource::Missing => Err(Error::InvalidArgument(format!(
                "{} started this rank, but nothing says where the bootstrap's root is: set FERROLINK_UNIQUE_ID, \
                 FERROLINK_ROOT=host:port, or MASTER_ADDR and MASTER_PORT (under Slurm, for instance \
                 `export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29500`)",
                self.launcher
            ))),
        }
    }
}

/// FNV-1a over `bytes` with a salt: every rank derives the same value from the same text.
fn fnv1a(bytes: &[u8], salt: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        LaunchEnv::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn each_launchers_variables_are_read_and_ferrolinks_win() {
        assert_eq!(env(&[]).unwrap(), None);
        let t = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((t.launcher, t.rank, t.nranks, t.device_ordinal()), ("torchrun", 3, 8, 1));
        assert_eq!(t.unique_id().unwrap().root().port(), 29501, "torchrun's store keeps MASTER_PORT");
        let o = env(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("FERROLINK_ROOT", "127.0.0.1:4000"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((o.launcher, o.rank, o.nranks), ("Open MPI", 2, 4));
        assert_eq!(o.unique_id().unwrap().root().port(), 4000);
        let s = env(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "6"), ("SLURM_LOCALID", "1"), ("FERROLINK_DEVICE", "3")])
            .unwrap()
            .unwrap();
        assert_eq!((s.launcher, s.rank, s.device_ordinal()), ("Slurm", 5, 3));
        let err = s.unique_id().unwrap_err().to_string();
        assert!(err.contains("MASTER_ADDR") && err.contains("scontrol"), "{err}");
        let f = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("FERROLINK_RANK", "1"), ("FERROLINK_NRANKS", "2")])
            .unwrap()
            .unwrap();
        assert_eq!((f.launcher, f.rank), ("ferrolink", 1));
    }

    #[test]
    fn every_rank_derives_the_same_id_and_a_unique_id_variable_is_used_as_is() {
        let a = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "9")])
            .unwrap()
            .unwrap();
        let b = env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "9")])
            .unwrap()
            .unwrap();
        assert_eq!(a.unique_id().unwrap(), b.unique_id().unwrap());
        let id = UniqueId::new("127.0.0.1:5".parse().unwrap()).unwrap();
        let c = env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("FERROLINK_UNIQUE_ID", &id.to_string())]).unwrap().unwrap();
        assert_eq!(c.unique_id().unwrap(), id);
    }

    #[test]
    fn bad_values_are_clear_errors() {
        assert!(env(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err().to_string().contains("RANK"));
        assert!(env(&[("RANK", "2"), ("WORLD_SIZE", "2")]).unwrap_err().to_string().contains("outside 0..2"));
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]).unwrap_err().to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
    }
}
