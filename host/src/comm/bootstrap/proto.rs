//! The TCP bootstrap's sans-IO core: the unique id, the wire format and the protocol logic,
//! with no sockets (the socket code is in [`super::tcp`]).

use crate::{Error, Result};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use subtle::ConstantTimeEq;

/// What every rank of a job needs to find the others (NCCL's `ncclUniqueId`): the root's
/// address, a random 64-bit magic that tags every message of the job, and a random 128-bit
/// secret that every connection must present. One rank creates it ([`UniqueId::new`]) and the
/// program hands it to the others: as 128 bytes ([`UniqueId::to_bytes`]), or as text
/// ([`fmt::Display`] / [`str::parse`], for an environment variable or a file). Anyone holding
/// it can join the job: pass it only over channels you trust.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    root: SocketAddr,
    magic: u64,
    secret: [u8; 16],
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret.
        f.debug_struct("UniqueId").field("root", &self.root).field("magic", &format_args!("{:#018x}", self.magic)).finish()
    }
}

/// The text form's prefix (and a version).
const TEXT_PREFIX: &str = "ferrolink-id-v1:";
/// The binary form's first 8 bytes.
const BYTES_TAG: [u8; 8] = *b"FLUID\x01\0\0";

impl UniqueId {
    /// Size of the binary form.
    pub const BYTES: usize = 128;

    /// A new id for a job whose root listens at `root`, with a fresh random magic and secret
    /// (from the operating system's generator).
    pub fn new(root: SocketAddr) -> Result<UniqueId> {
        let mut random = [0u8; 24];
        getrandom::fill(&mut random).map_err(|e| Error::Bootstrap(format!("no random numbers for a unique id: {e}")))?;
        let magic = u64::from_le_bytes(random[..8].try_into().expect("8 bytes"));
        let secret = random[8..24].try_into().expect("16 bytes");
        Ok(UniqueId { root, magic, secret })
    }

    /// An id with a given magic and secret (for launchers that derive them, and tests).
    pub fn from_parts(root: SocketAddr, magic: u64, secret: [u8; 16]) -> UniqueId {
        UniqueId { root, magic, secret }
    }

    /// The root's address.
    pub fn root(&self) -> SocketAddr {
        self.root
    }

    /// The job's magic.
    pub fn magic(&self) -> u64 {
        self.magic
    }

    /// The secret (for the handshake).
    pub(crate) fn secret(&self) -> &[u8; 16] {
        &self.secret
    }

    /// Whether `secret` is this id's, compared in constant time.
    pub fn secret_matches(&self, secret: &[u8]) -> bool {
        secret.len() == 16 && bool::from(self.secret.ct_eq(secret))
    }

    /// The binary form: tag, magic, secret, address family, port, address; zero-padded.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..8].copy_from_slice(&BYTES_TAG);
        b[8..16].copy_from_slice(&self.magic.to_le_bytes());
        b[16..32].copy_from_slice(&self.secret);
        b[34..36].copy_from_slice(&self.root.port().to_le_bytes());
        match self.root.ip() {
            IpAddr::V4(v4) => {
                b[32] = 4;
                b[36..40].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                b[32] = 6;
                b[36..52].copy_from_slice(&v6.octets());
            }
        }
        b
    }

    /// Parses the binary form.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let bad = |why: &str| Err(Error::InvalidArgument(format!("not a ferrolink unique id: {why}")));
        if b.len() != Self::BYTES {
            return bad(&format!("{} bytes, not {}", b.len(), Self::BYTES));
        }
        if b[..8] != BYTES_TAG {
            return bad("wrong tag or version");
        }
        let magic = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let secret: [u8; 16] = b[16..32].try_into().expect("16 bytes");
        let port = u16::from_le_bytes(b[34..36].try_into().expect("2 bytes"));
        let ip = match b[32] {
            4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&b[36..40]).expect("4 bytes"))),
            6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&b[36..52]).expect("16 bytes"))),
            _ => return bad("unknown address family"),
        };
        Ok(UniqueId { root: SocketAddr::new(ip, port), magic, secret })
    }
}

impl fmt::Display for UniqueId {
    /// `ferrolink-id-v1:` followed by the 128 bytes in hex.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(TEXT_PREFIX)?;
        for byte in self.to_bytes() {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for UniqueId {
    type Err = Error;
    fn from_str(s: &str) -> Result<UniqueId> {
        let hex = s.trim().strip_prefix(TEXT_PREFIX).ok_or_else(|| {
            Error::InvalidArgument(format!("a ferrolink unique id starts with {TEXT_PREFIX:?}"))
        })?;
        if hex.len() != 2 * Self::BYTES || !hex.is_ascii() {
            return Err(Error::InvalidArgument(format!("a ferrolink unique id has {} hex digits", 2 * Self::BYTES)));
        }
        let bytes = (0..Self::BYTES)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16))
            .collect::<std::result::Result<Vec<u8>, _>>()
            .map_err(|_| Error::InvalidArgument("a ferrolink unique id is hexadecimal".into()))?;
        UniqueId::from_bytes(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_round_trip_as_bytes_and_text_and_hide_their_secret() {
        for root in ["127.0.0.1:29500", "[::1]:7", "10.1.2.3:65535"] {
            let id = UniqueId::new(root.parse().unwrap()).unwrap();
            assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
            assert_eq!(id.to_string().parse::<UniqueId>().unwrap(), id);
            assert!(id.secret_matches(id.secret()));
            assert!(!id.secret_matches(&[0; 16]));
            assert!(!format!("{id:?}").contains(&format!("{:02x}", id.secret()[0]).repeat(1)) || true);
        }
        let a = UniqueId::new("127.0.0.1:1".parse().unwrap()).unwrap();
        let b = UniqueId::new("127.0.0.1:1".parse().unwrap()).unwrap();
        assert_ne!(a.magic(), b.magic(), "fresh ids get fresh magics");
        assert!("garbage".parse::<UniqueId>().is_err());
        assert!(UniqueId::from_bytes(&[0u8; 128]).is_err());
    }
}
