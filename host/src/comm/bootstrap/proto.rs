//! The TCP bootstrap's sans-IO core: the unique id, the wire format and the protocol logic,
//! with no sockets (the socket code is in [`super::tcp`]).
//!
//! * Frames: a fixed [`HEADER_LEN`]-byte header `{magic u64, kind u8, from u32, tag u64, len
//!   u32}` (little-endian) and `len` bytes of payload; [`encode`] and [`encode_msg`] write
//!   them, the incremental [`Decoder`] reads them from any cut of the byte stream, never
//!   panics and never buffers more than its cap ([`MAX_PAYLOAD`] unless told otherwise),
//!   whatever it is fed.
//! * The handshake: [`check_hello`] and [`check_peer_hello`] (magic, then the secret in
//!   constant time).
//! * The root's rendezvous: [`Rendezvous`] collects every rank's [`Hello`], refuses duplicates,
//!   ranks outside the job and ranks of another size, and yields the address table.
//!
//! The exchange: every rank connects to the root and sends [`Frame::Hello`]; the root answers
//! [`Frame::Table`] once all ranks are in, or [`Frame::Refuse`] (a reason). Ranks then open
//! one connection per peer they send to, start it with [`Frame::PeerHello`] and send
//! [`Frame::Msg`]s on it; [`Frame::Bye`] says the sender is closing.

use super::ranks_phrase;
use crate::{Error, Result};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;
use subtle::ConstantTimeEq;

/// What every rank of a job needs to find the others (NCCL's `ncclUniqueId`): the root's
/// address, a random 64-bit magic that tags every message of the job, and a random 128-bit
/// secret that every connection must present. One rank creates it ([`UniqueId::new`]) and the
/// program hands it to the others: as 128 bytes ([`UniqueId::to_bytes`]), or as text
/// ([`fmt::Display`] / [`str::parse`], for an environment variable or a file). Anyone holding
/// it can join the job: pass it only over channels you trust.
///
/// ```
/// # fn main() -> ferrolink::Result<()> {
/// use ferrolink::UniqueId;
/// let id = UniqueId::new("127.0.0.1:29500".parse().unwrap())?;
/// // Rank 0 publishes the text form; every other rank parses it back.
/// let text = id.to_string();
/// assert!(text.starts_with("ferrolink-id-v1:"));
/// assert_eq!(text.parse::<UniqueId>()?, id);
/// // Its Debug form never shows the secret.
/// assert!(!format!("{id:?}").contains("secret"));
/// # Ok(()) }
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    root: SocketAddr,
    magic: u64,
    secret: [u8; 16],
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the secret.
        f.debug_struct("UniqueId")
            .field("root", &self.root)
            .field("magic", &format_args!("{:#018x}", self.magic))
            .finish()
    }
}

/// The text form's prefix (and a version).
const TEXT_PREFIX: &str = "ferrolink-id-v1:";
/// The binary form's first 8 bytes.
const BYTES_TAG: [u8; 8] = *b"FLUID\x01\0\0";

impl UniqueId {
    /// Size of the binary form.
    ///
    /// ```
    /// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 1, [7; 16]);
    /// assert_eq!(id.to_bytes().len(), ferrolink::UniqueId::BYTES);
    /// ```
    pub const BYTES: usize = 128;

    /// A new id for a job whose root listens at `root`, with a fresh random magic and secret
    /// (from the operating system's generator).
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::UniqueId;
    /// let root = "127.0.0.1:29500".parse().unwrap();
    /// let (a, b) = (UniqueId::new(root)?, UniqueId::new(root)?);
    /// assert_eq!(a.root(), root);
    /// assert_ne!(a.magic(), b.magic(), "each id gets a fresh random magic");
    /// # Ok(()) }
    /// ```
    pub fn new(root: SocketAddr) -> Result<UniqueId> {
        let mut random = [0u8; 24];
        getrandom::fill(&mut random)
            .map_err(|e| Error::Bootstrap(format!("no random numbers for a unique id: {e}")))?;
        let magic = u64::from_le_bytes(random[..8].try_into().expect("8 bytes"));
        let secret = random[8..24].try_into().expect("16 bytes");
        Ok(UniqueId { root, magic, secret })
    }

    /// An id with a given magic and secret (for launchers that derive them, and tests).
    ///
    /// ```
    /// let id = ferrolink::UniqueId::from_parts("10.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// assert_eq!(id.magic(), 0x5eed);
    /// assert!(id.secret_matches(&[7; 16]));
    /// ```
    pub fn from_parts(root: SocketAddr, magic: u64, secret: [u8; 16]) -> UniqueId {
        UniqueId { root, magic, secret }
    }

    /// The root's address.
    ///
    /// ```
    /// let id = ferrolink::UniqueId::from_parts("10.0.0.1:29500".parse().unwrap(), 1, [7; 16]);
    /// assert_eq!(id.root(), "10.0.0.1:29500".parse().unwrap());
    /// ```
    pub fn root(&self) -> SocketAddr {
        self.root
    }

    /// The job's magic.
    ///
    /// ```
    /// let id = ferrolink::UniqueId::from_parts("10.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// assert_eq!(id.magic(), 0x5eed);
    /// ```
    pub fn magic(&self) -> u64 {
        self.magic
    }

    /// The secret (for the handshake).
    pub(crate) fn secret(&self) -> &[u8; 16] {
        &self.secret
    }

    /// Whether `secret` is this id's, compared in constant time.
    ///
    /// ```
    /// let id = ferrolink::UniqueId::from_parts("10.0.0.1:29500".parse().unwrap(), 1, [7; 16]);
    /// assert!(id.secret_matches(&[7; 16]));
    /// assert!(!id.secret_matches(&[8; 16]));
    /// assert!(!id.secret_matches(&[7; 15]), "a secret of another length never matches");
    /// ```
    pub fn secret_matches(&self, secret: &[u8]) -> bool {
        secret.len() == 16 && bool::from(self.secret.ct_eq(secret))
    }

    /// The binary form: tag, magic, secret, address family, port, address; zero-padded.
    ///
    /// ```
    /// let id = ferrolink::UniqueId::from_parts("10.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// let b = id.to_bytes();
    /// assert_eq!(&b[..5], b"FLUID");
    /// assert_eq!(b[8..16], 0x5eed_u64.to_le_bytes());
    /// ```
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
    ///
    /// ```
    /// # fn main() -> ferrolink::Result<()> {
    /// use ferrolink::UniqueId;
    /// let id = UniqueId::new("[::1]:29500".parse().unwrap())?;
    /// assert_eq!(UniqueId::from_bytes(&id.to_bytes())?, id);
    /// assert!(UniqueId::from_bytes(&[0; UniqueId::BYTES]).is_err());
    /// assert!(UniqueId::from_bytes(&id.to_bytes()[..64]).is_err());
    /// # Ok(()) }
    /// ```
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
        let hex = s
            .trim()
            .strip_prefix(TEXT_PREFIX)
            .ok_or_else(|| Error::InvalidArgument(format!("a ferrolink unique id starts with {TEXT_PREFIX:?}")))?;
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

// ---------------------------------------------------------------------------------------------
// Frames
// ---------------------------------------------------------------------------------------------

/// Size of a frame's header: magic (8), kind (1), from (4), tag (8), payload length (4).
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # fn main() -> ferrolink::Result<()> {
/// assert_eq!(encode(0x5eed, &Frame::Bye)?.len(), HEADER_LEN);
/// assert_eq!(encode_msg(0x5eed, 0, 1, b"abc")?.len(), HEADER_LEN + 3);
/// # Ok(()) }
/// ```
pub const HEADER_LEN: usize = 25;

/// The largest payload a [`Decoder`] accepts by default (and so the largest bootstrap
/// message): 64 MiB.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # fn main() -> ferrolink::Result<()> {
/// // A header announcing one byte more than the cap is refused before any payload arrives.
/// let mut head = encode(0x5eed, &Frame::Bye)?;
/// head[21..25].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
/// let mut dec = Decoder::new(0x5eed);
/// assert_eq!(
///     dec.decode(&mut &head[..]),
///     Err(DecodeError::TooLong { len: MAX_PAYLOAD as u64 + 1, max: MAX_PAYLOAD })
/// );
/// # Ok(()) }
/// ```
pub const MAX_PAYLOAD: usize = 64 << 20;

/// The cap for a connection that has not completed its handshake yet: a hello is well under
/// 100 bytes, so a stranger cannot make a listener buffer more than this.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # fn main() -> ferrolink::Result<()> {
/// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
/// let hello = encode(id.magic(), &Frame::Hello(Hello::new(&id, 1, 4, "[::1]:40001".parse().unwrap())))?;
/// assert!(hello.len() - HEADER_LEN <= HANDSHAKE_MAX_PAYLOAD);
/// // A stranger's oversized first frame is refused at its header.
/// let big = encode_msg(id.magic(), 1, 0, &[0; HANDSHAKE_MAX_PAYLOAD + 1])?;
/// let mut dec = Decoder::with_max_payload(id.magic(), HANDSHAKE_MAX_PAYLOAD);
/// assert!(matches!(dec.decode(&mut &big[..]), Err(DecodeError::TooLong { .. })));
/// # Ok(()) }
/// ```
pub const HANDSHAKE_MAX_PAYLOAD: usize = 1024;

/// What a frame is (the header's `kind` byte).
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # fn main() -> ferrolink::Result<()> {
/// let bytes = encode(0x5eed, &Frame::Bye)?;
/// assert_eq!(bytes[8], Kind::Bye as u8); // the header's kind byte
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A rank's handshake to the root.
    Hello = 1,
    /// The root's answer: every rank's listen address.
    Table = 2,
    /// The root refuses a rank (or the job): a reason.
    Refuse = 3,
    /// The handshake of a connection between ranks.
    PeerHello = 4,
    /// A tagged message.
    Msg = 5,
    /// The sender closes the connection.
    Bye = 6,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Table,
            3 => Kind::Refuse,
            4 => Kind::PeerHello,
            5 => Kind::Msg,
            6 => Kind::Bye,
            _ => return None,
        })
    }
}

/// A rank's handshake to the root. (`PartialEq` compares the secret in variable time: for
/// tests; the handshake itself uses [`check_hello`].)
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
/// let hello = Hello::new(&id, 1, 4, "10.0.0.2:40001".parse().unwrap());
/// assert_eq!(check_hello(&id, &hello), Ok(()));
/// // Its Debug form leaves the secret out.
/// assert!(!format!("{hello:?}").contains("secret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Hello {
    /// The job's magic, as the rank knows it.
    pub magic: u64,
    /// The job's secret, as the rank knows it.
    pub secret: [u8; 16],
    /// The rank.
    pub rank: u32,
    /// How many ranks the rank believes the job has.
    pub nranks: u32,
    /// Where the rank listens for its peers.
    pub listen: SocketAddr,
}

impl Hello {
    /// Rank `rank`'s hello for the job of `id`.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// let hello = Hello::new(&id, 1, 4, "10.0.0.2:40001".parse().unwrap());
    /// assert_eq!((hello.magic, hello.rank, hello.nranks), (id.magic(), 1, 4));
    /// ```
    pub fn new(id: &UniqueId, rank: u32, nranks: u32, listen: SocketAddr) -> Hello {
        Hello { magic: id.magic(), secret: *id.secret(), rank, nranks, listen }
    }
}

impl fmt::Debug for Hello {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hello")
            .field("magic", &format_args!("{:#018x}", self.magic))
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

/// The handshake of a connection between two ranks: the connecting rank says who it is.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
/// let hello = PeerHello::new(&id, 3);
/// assert_eq!(check_peer_hello(&id, &hello, 4), Ok(3));
/// assert!(!format!("{hello:?}").contains("secret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct PeerHello {
    /// The job's magic, as the connecting rank knows it.
    pub magic: u64,
    /// The job's secret, as the connecting rank knows it.
    pub secret: [u8; 16],
    /// The connecting rank.
    pub from: u32,
}

impl PeerHello {
    /// Rank `from`'s handshake for the job of `id`.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// let hello = PeerHello::new(&id, 3);
    /// assert_eq!((hello.magic, hello.from), (id.magic(), 3));
    /// ```
    pub fn new(id: &UniqueId, from: u32) -> PeerHello {
        PeerHello { magic: id.magic(), secret: *id.secret(), from }
    }
}

impl fmt::Debug for PeerHello {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerHello")
            .field("magic", &format_args!("{:#018x}", self.magic))
            .field("from", &self.from)
            .finish_non_exhaustive()
    }
}

/// One decoded frame.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # fn main() -> ferrolink::Result<()> {
/// let frames = [
///     Frame::Table(vec!["10.0.0.1:40000".parse().unwrap(), "10.0.0.2:40001".parse().unwrap()]),
///     Frame::Msg { from: 1, tag: 7, data: b"hi".to_vec() },
///     Frame::Bye,
/// ];
/// let mut stream = Vec::new();
/// for f in &frames {
///     stream.extend(encode(0x5eed, f)?);
/// }
/// let mut dec = Decoder::new(0x5eed);
/// let mut input = &stream[..];
/// let mut got = Vec::new();
/// while let Some(f) = dec.decode(&mut input).unwrap() {
///     got.push(f);
/// }
/// assert_eq!(got, frames);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A rank's handshake to the root.
    Hello(Hello),
    /// The root's answer: element `r` is rank `r`'s listen address.
    Table(Vec<SocketAddr>),
    /// The root refuses: why.
    Refuse(String),
    /// A connection's handshake between ranks.
    PeerHello(PeerHello),
    /// A tagged message from rank `from`.
    Msg {
        /// The sender.
        from: u32,
        /// The message's tag.
        tag: u64,
        /// The message.
        data: Vec<u8>,
    },
    /// The sender closes the connection.
    Bye,
}

impl Frame {
    /// The frame's kind.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// assert_eq!(Frame::Refuse("rank 3 joined twice".into()).kind(), Kind::Refuse);
    /// assert_eq!(Frame::Msg { from: 0, tag: 0, data: vec![] }.kind(), Kind::Msg);
    /// ```
    pub fn kind(&self) -> Kind {
        match self {
            Frame::Hello(_) => Kind::Hello,
            Frame::Table(_) => Kind::Table,
            Frame::Refuse(_) => Kind::Refuse,
            Frame::PeerHello(_) => Kind::PeerHello,
            Frame::Msg { .. } => Kind::Msg,
            Frame::Bye => Kind::Bye,
        }
    }
}

fn put_addr(out: &mut Vec<u8>, a: &SocketAddr) {
    match a.ip() {
        IpAddr::V4(v4) => {
            out.push(4);
            out.extend_from_slice(&a.port().to_le_bytes());
            out.extend_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            out.push(6);
            out.extend_from_slice(&a.port().to_le_bytes());
            out.extend_from_slice(&v6.octets());
        }
    }
}

/// The smallest encoded address (family, port, IPv4).
const MIN_ADDR_LEN: usize = 7;

fn header(out: &mut Vec<u8>, magic: u64, kind: Kind, from: u32, tag: u64, len: usize) -> Result<()> {
    let len32 = u32::try_from(len).ok().filter(|&l| l as usize <= MAX_PAYLOAD).ok_or_else(|| {
        Error::InvalidArgument(format!("a bootstrap frame of {len} bytes is over the {} MiB limit", MAX_PAYLOAD >> 20))
    })?;
    out.extend_from_slice(&magic.to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(&from.to_le_bytes());
    out.extend_from_slice(&tag.to_le_bytes());
    out.extend_from_slice(&len32.to_le_bytes());
    Ok(())
}

/// A [`Frame::Msg`] of `data` from rank `from` under `tag`, for the job of `magic`, encoded
/// without copying the data twice. Fails if `data` is over [`MAX_PAYLOAD`].
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # fn main() -> ferrolink::Result<()> {
/// let msg = Frame::Msg { from: 9, tag: 77, data: b"abc".to_vec() };
/// assert_eq!(encode_msg(0x5eed, 9, 77, b"abc")?, encode(0x5eed, &msg)?);
/// # Ok(()) }
/// ```
pub fn encode_msg(magic: u64, from: u32, tag: u64, data: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(HEADER_LEN + data.len());
    header(&mut out, magic, Kind::Msg, from, tag, data.len())?;
    out.extend_from_slice(data);
    Ok(out)
}

/// `frame` encoded for the job of `magic`. Fails if its payload is over [`MAX_PAYLOAD`].
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # fn main() -> ferrolink::Result<()> {
/// let frame = Frame::Refuse("rank 3 joined twice".into());
/// let bytes = encode(0x5eed, &frame)?;
/// assert_eq!(bytes.len(), HEADER_LEN + "rank 3 joined twice".len());
/// assert_eq!(Decoder::new(0x5eed).decode(&mut &bytes[..]), Ok(Some(frame)));
/// # Ok(()) }
/// ```
pub fn encode(magic: u64, frame: &Frame) -> Result<Vec<u8>> {
    let mut payload = Vec::new();
    let mut from = 0;
    match frame {
        Frame::Msg { from, tag, data } => return encode_msg(magic, *from, *tag, data),
        Frame::Hello(h) => {
            from = h.rank;
            payload.extend_from_slice(&h.magic.to_le_bytes());
            payload.extend_from_slice(&h.secret);
            payload.extend_from_slice(&h.rank.to_le_bytes());
            payload.extend_from_slice(&h.nranks.to_le_bytes());
            put_addr(&mut payload, &h.listen);
        }
        Frame::Table(addrs) => {
            let n = u32::try_from(addrs.len())
                .map_err(|_| Error::InvalidArgument(format!("a table of {} ranks", addrs.len())))?;
            payload.extend_from_slice(&n.to_le_bytes());
            for a in addrs {
                put_addr(&mut payload, a);
            }
        }
        Frame::Refuse(why) => payload.extend_from_slice(why.as_bytes()),
        Frame::PeerHello(p) => {
            from = p.from;
            payload.extend_from_slice(&p.magic.to_le_bytes());
            payload.extend_from_slice(&p.secret);
            payload.extend_from_slice(&p.from.to_le_bytes());
        }
        Frame::Bye => {}
    }
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    header(&mut out, magic, frame.kind(), from, 0, payload.len())?;
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Why a byte stream is not a valid frame sequence. After one, the [`Decoder`] stays failed:
/// the connection is to be closed.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # fn main() -> ferrolink::Result<()> {
/// let theirs = encode(0x0bad, &Frame::Bye)?;
/// let mut dec = Decoder::new(0x5eed);
/// let err = dec.decode(&mut &theirs[..]).unwrap_err();
/// assert_eq!(err, DecodeError::WrongMagic { got: 0x0bad });
/// // The decoder stays failed, even on this job's frames.
/// assert_eq!(dec.decode(&mut &encode(0x5eed, &Frame::Bye)?[..]), Err(err));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The header's magic is not the job's: a stranger, or garbage.
    WrongMagic {
        /// The magic found.
        got: u64,
    },
    /// The header's kind byte names no frame kind.
    UnknownKind(u8),
    /// The header announces a payload over the decoder's cap.
    TooLong {
        /// The announced length.
        len: u64,
        /// The cap.
        max: usize,
    },
    /// The payload does not encode a frame of its kind: truncated, overlong, or a bad field.
    Malformed {
        /// The frame's kind.
        kind: Kind,
        /// What is wrong.
        why: &'static str,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::WrongMagic { got } => write!(f, "wrong magic {got:#018x} (not this job's frames)"),
            DecodeError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            DecodeError::TooLong { len, max } => write!(f, "a frame of {len} bytes announced, over the {max}-byte cap"),
            DecodeError::Malformed { kind, why } => write!(f, "malformed {kind:?} frame: {why}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// A bootstrap frame that could not be decoded is a bootstrap failure (so `?` works in
/// functions returning [`crate::Result`]).
///
/// ```
/// use ferrolink::comm::bootstrap::proto::DecodeError;
/// let e: ferrolink::Error = DecodeError::UnknownKind(99).into();
/// assert!(matches!(e, ferrolink::Error::Bootstrap(ref m) if m.contains("unknown frame kind 99")));
/// ```
impl From<DecodeError> for crate::Error {
    fn from(e: DecodeError) -> Self {
        crate::Error::Bootstrap(format!("bootstrap frame: {e}"))
    }
}

/// Reads fields from a payload; any shortfall is an error, never a panic.
struct Fields<'a> {
    buf: &'a [u8],
    kind: Kind,
}

impl<'a> Fields<'a> {
    fn bad(&self, why: &'static str) -> DecodeError {
        DecodeError::Malformed { kind: self.kind, why }
    }
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(self.bad("truncated"));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> std::result::Result<[u8; N], DecodeError> {
        let b = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }
    fn u32(&mut self) -> std::result::Result<u32, DecodeError> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> std::result::Result<u64, DecodeError> {
        self.array().map(u64::from_le_bytes)
    }
    fn addr(&mut self) -> std::result::Result<SocketAddr, DecodeError> {
        let [family] = self.array()?;
        let port = u16::from_le_bytes(self.array()?);
        let ip = match family {
            4 => IpAddr::V4(Ipv4Addr::from(self.array::<4>()?)),
            6 => IpAddr::V6(Ipv6Addr::from(self.array::<16>()?)),
            _ => return Err(self.bad("unknown address family")),
        };
        Ok(SocketAddr::new(ip, port))
    }
    fn end(self) -> std::result::Result<(), DecodeError> {
        if self.buf.is_empty() { Ok(()) } else { Err(self.bad("overlong (bytes after the last field)")) }
    }
}

#[derive(Clone, Copy, Debug)]
struct Header {
    kind: Kind,
    from: u32,
    tag: u64,
    len: usize,
}

fn parse_payload(h: Header, payload: Vec<u8>) -> std::result::Result<Frame, DecodeError> {
    let mut f = Fields { buf: &payload, kind: h.kind };
    let frame = match h.kind {
        Kind::Msg => {
            return Ok(Frame::Msg { from: h.from, tag: h.tag, data: payload });
        }
        Kind::Hello => {
            let magic = f.u64()?;
            let secret = f.array()?;
            let rank = f.u32()?;
            let nranks = f.u32()?;
            let listen = f.addr()?;
            Frame::Hello(Hello { magic, secret, rank, nranks, listen })
        }
        Kind::Table => {
            let n = f.u32()? as usize;
            // Checked before allocating: each address takes at least MIN_ADDR_LEN bytes.
            if n > f.buf.len() / MIN_ADDR_LEN {
                return Err(f.bad("more addresses announced than the payload holds"));
            }
            let mut addrs = Vec::with_capacity(n);
            for _ in 0..n {
                addrs.push(f.addr()?);
            }
            Frame::Table(addrs)
        }
        Kind::Refuse => {
            let why = std::str::from_utf8(f.buf).map_err(|_| f.bad("the reason is not UTF-8"))?.to_owned();
            f.buf = &[];
            Frame::Refuse(why)
        }
        Kind::PeerHello => {
            let magic = f.u64()?;
            let secret = f.array()?;
            let from = f.u32()?;
            Frame::PeerHello(PeerHello { magic, secret, from })
        }
        Kind::Bye => Frame::Bye,
    };
    f.end()?;
    Ok(frame)
}

/// The incremental frame decoder of one connection, for one job (its magic). Feed it the bytes
/// as they come, in any cuts ([`Decoder::decode`]); it yields whole frames. Whatever it is
/// fed, it never panics and never holds a payload buffer larger than its cap: the header is
/// checked (magic, kind, length against the cap) before any payload byte is stored, and the
/// buffer grows with the bytes that actually arrive.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # fn main() -> ferrolink::Result<()> {
/// let bytes = encode_msg(0x5eed, 2, 7, b"hello")?;
/// let mut dec = Decoder::new(0x5eed);
/// // Fed one byte at a time: nothing until the last byte of the frame.
/// for b in &bytes[..bytes.len() - 1] {
///     assert_eq!(dec.decode(&mut &[*b][..]), Ok(None));
/// }
/// let last = dec.decode(&mut &bytes[bytes.len() - 1..]).unwrap();
/// assert_eq!(last, Some(Frame::Msg { from: 2, tag: 7, data: b"hello".to_vec() }));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Decoder {
    magic: u64,
    max_payload: usize,
    head: [u8; HEADER_LEN],
    head_len: usize,
    current: Option<Header>,
    payload: Vec<u8>,
    failed: Option<DecodeError>,
}

/// The first allocation for a payload; it then doubles as bytes arrive, up to the announced
/// length.
const FIRST_CHUNK: usize = 16 << 10;

impl Decoder {
    /// A decoder for the job of `magic`, accepting payloads up to [`MAX_PAYLOAD`].
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// assert_eq!(Decoder::new(0x5eed).max_payload(), MAX_PAYLOAD);
    /// ```
    pub fn new(magic: u64) -> Decoder {
        Decoder::with_max_payload(magic, MAX_PAYLOAD)
    }

    /// A decoder accepting payloads up to `max_payload` bytes (a listener uses
    /// [`HANDSHAKE_MAX_PAYLOAD`] until the handshake is done; tests use small caps).
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # fn main() -> ferrolink::Result<()> {
    /// let mut dec = Decoder::with_max_payload(0x5eed, 10);
    /// let msg = encode_msg(0x5eed, 0, 0, &[0; 11])?;
    /// // Refused at the header: the payload is never buffered.
    /// let err = dec.decode(&mut &msg[..HEADER_LEN]).unwrap_err();
    /// assert_eq!(err, DecodeError::TooLong { len: 11, max: 10 });
    /// # Ok(()) }
    /// ```
    pub fn with_max_payload(magic: u64, max_payload: usize) -> Decoder {
        Decoder {
            magic,
            max_payload,
            head: [0; HEADER_LEN],
            head_len: 0,
            current: None,
            payload: Vec::new(),
            failed: None,
        }
    }

    /// Changes the cap, for the frames whose header has not been read yet (after a handshake).
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # fn main() -> ferrolink::Result<()> {
    /// let mut dec = Decoder::with_max_payload(0x5eed, HANDSHAKE_MAX_PAYLOAD);
    /// // ... the handshake is done: accept full-size messages.
    /// dec.set_max_payload(MAX_PAYLOAD);
    /// let msg = encode_msg(0x5eed, 1, 0, &[1; 2048])?;
    /// assert!(matches!(dec.decode(&mut &msg[..]), Ok(Some(Frame::Msg { .. }))));
    /// # Ok(()) }
    /// ```
    pub fn set_max_payload(&mut self, max_payload: usize) {
        self.max_payload = max_payload;
    }

    /// The cap.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// assert_eq!(Decoder::with_max_payload(0x5eed, 100).max_payload(), 100);
    /// ```
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// The bytes the decoder holds allocated for a payload now (never over the cap).
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # fn main() -> ferrolink::Result<()> {
    /// let mut dec = Decoder::with_max_payload(0x5eed, 1024);
    /// assert_eq!(dec.buffered_capacity(), 0);
    /// let msg = encode_msg(0x5eed, 0, 0, &[1; 100])?;
    /// assert_eq!(dec.decode(&mut &msg[..HEADER_LEN + 10]), Ok(None)); // a frame half in
    /// assert!(dec.buffered_capacity() >= 10 && dec.buffered_capacity() <= dec.max_payload());
    /// # Ok(()) }
    /// ```
    pub fn buffered_capacity(&self) -> usize {
        self.payload.capacity()
    }

    /// Whether a frame has been started and not finished (bytes were consumed that belong to
    /// a frame still incomplete): at the end of a stream, that is a truncated frame.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # fn main() -> ferrolink::Result<()> {
    /// let bytes = encode(0x5eed, &Frame::Bye)?;
    /// let mut dec = Decoder::new(0x5eed);
    /// assert_eq!(dec.decode(&mut &bytes[..10]), Ok(None));
    /// assert!(dec.in_frame(), "a stream ending here is truncated");
    /// assert_eq!(dec.decode(&mut &bytes[10..]), Ok(Some(Frame::Bye)));
    /// assert!(!dec.in_frame());
    /// # Ok(()) }
    /// ```
    pub fn in_frame(&self) -> bool {
        self.head_len > 0 || self.current.is_some()
    }

    fn fail(&mut self, e: DecodeError) -> std::result::Result<Option<Frame>, DecodeError> {
        self.payload = Vec::new();
        self.current = None;
        self.failed = Some(e.clone());
        Err(e)
    }

    /// Consumes bytes from the front of `input` up to the end of the next frame, and returns
    /// that frame; `Ok(None)` when `input` ran out first (all of it consumed and kept). Call
    /// it again while `input` is not empty. An error is final: every later call returns it.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # fn main() -> ferrolink::Result<()> {
    /// // Two frames and the start of a third arrive in one read.
    /// let mut bytes = encode_msg(0x5eed, 1, 0, b"a")?;
    /// bytes.extend(encode_msg(0x5eed, 1, 0, b"b")?);
    /// bytes.extend(&encode(0x5eed, &Frame::Bye)?[..3]);
    /// let mut dec = Decoder::new(0x5eed);
    /// let mut input = &bytes[..];
    /// assert!(matches!(dec.decode(&mut input), Ok(Some(Frame::Msg { .. }))));
    /// assert!(matches!(dec.decode(&mut input), Ok(Some(Frame::Msg { .. }))));
    /// assert_eq!(dec.decode(&mut input), Ok(None)); // the rest is kept for the next call
    /// assert!(input.is_empty() && dec.in_frame());
    /// # Ok(()) }
    /// ```
    pub fn decode(&mut self, input: &mut &[u8]) -> std::result::Result<Option<Frame>, DecodeError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        loop {
            let Some(h) = self.current else {
                let take = (HEADER_LEN - self.head_len).min(input.len());
                self.head[self.head_len..self.head_len + take].copy_from_slice(&input[..take]);
                self.head_len += take;
                *input = &input[take..];
                if self.head_len < HEADER_LEN {
                    return Ok(None);
                }
                self.head_len = 0;
                let b = &self.head;
                let magic = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
                if magic != self.magic {
                    return self.fail(DecodeError::WrongMagic { got: magic });
                }
                let Some(kind) = Kind::from_u8(b[8]) else {
                    return self.fail(DecodeError::UnknownKind(b[8]));
                };
                let from = u32::from_le_bytes(b[9..13].try_into().expect("4 bytes"));
                let tag = u64::from_le_bytes(b[13..21].try_into().expect("8 bytes"));
                let len = u32::from_le_bytes(b[21..25].try_into().expect("4 bytes"));
                if len as usize > self.max_payload {
                    return self.fail(DecodeError::TooLong { len: len.into(), max: self.max_payload });
                }
                let len = len as usize;
                self.payload = Vec::with_capacity(len.min(FIRST_CHUNK));
                self.current = Some(Header { kind, from, tag, len });
                continue;
            };
            let want = h.len - self.payload.len();
            let take = want.min(input.len());
            if take > 0 {
                let need = self.payload.len() + take;
                if need > self.payload.capacity() {
                    // Double, but never past the announced length (itself within the cap).
                    let target = need.max(self.payload.capacity().saturating_mul(2)).min(h.len);
                    self.payload.reserve_exact(target - self.payload.len());
                }
                self.payload.extend_from_slice(&input[..take]);
                *input = &input[take..];
            }
            if self.payload.len() < h.len {
                return Ok(None);
            }
            self.current = None;
            let payload = std::mem::take(&mut self.payload);
            return match parse_payload(h, payload) {
                Ok(f) => Ok(Some(f)),
                Err(e) => self.fail(e),
            };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Handshake and rendezvous
// ---------------------------------------------------------------------------------------------

/// Why a rank or a connection was refused; the text goes to the refused rank in a
/// [`Frame::Refuse`] and to the log.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
/// let mut hello = Hello::new(&id, 1, 4, "10.0.0.2:40001".parse().unwrap());
/// hello.secret[0] ^= 1;
/// let refusal = check_hello(&id, &hello).unwrap_err();
/// assert_eq!(refusal.to_string(), "wrong secret");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal(pub String);

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn check_credentials(id: &UniqueId, magic: u64, secret: &[u8; 16]) -> std::result::Result<(), Refusal> {
    if magic != id.magic() {
        return Err(Refusal(format!("wrong magic {magic:#018x}: a connection of another job")));
    }
    if !id.secret_matches(secret) {
        return Err(Refusal("wrong secret".into()));
    }
    Ok(())
}

/// The root's check of a [`Hello`]: the magic, then the secret in constant time.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
/// let hello = Hello::new(&id, 1, 4, "10.0.0.2:40001".parse().unwrap());
/// assert_eq!(check_hello(&id, &hello), Ok(()));
/// let stranger = ferrolink::UniqueId::from_parts(id.root(), id.magic(), [8; 16]);
/// let forged = Hello::new(&stranger, 1, 4, "10.0.0.2:40001".parse().unwrap());
/// assert_eq!(check_hello(&id, &forged), Err(Refusal("wrong secret".into())));
/// ```
pub fn check_hello(id: &UniqueId, hello: &Hello) -> std::result::Result<(), Refusal> {
    check_credentials(id, hello.magic, &hello.secret)
}

/// A rank's check of an incoming connection's [`PeerHello`] in a job of `nranks` ranks:
/// magic, secret (constant time), and a sender inside the job. Returns the sender.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
/// assert_eq!(check_peer_hello(&id, &PeerHello::new(&id, 3), 4), Ok(3));
/// assert_eq!(
///     check_peer_hello(&id, &PeerHello::new(&id, 4), 4),
///     Err(Refusal("rank 4 is outside 0..4".into()))
/// );
/// ```
pub fn check_peer_hello(id: &UniqueId, hello: &PeerHello, nranks: usize) -> std::result::Result<usize, Refusal> {
    check_credentials(id, hello.magic, &hello.secret)?;
    let from = hello.from as usize;
    if from >= nranks {
        return Err(Refusal(format!("rank {from} is outside 0..{nranks}")));
    }
    Ok(from)
}

/// The root's rendezvous, sans IO: which ranks have said hello, where they listen, and the
/// table once everyone is in. A refused hello changes nothing: the job goes on.
///
/// ```
/// # use ferrolink::comm::bootstrap::proto::*;
/// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
/// let addr = |r: u16| std::net::SocketAddr::from(([10, 0, 0, 1], 40_000 + r));
/// let mut rv = Rendezvous::new(2);
/// // Hellos come in any order; the table is ready once every rank is in.
/// rv.on_hello(&Hello::new(&id, 1, 2, addr(1))).unwrap();
/// assert_eq!(rv.table(), None);
/// rv.on_hello(&Hello::new(&id, 0, 2, addr(0))).unwrap();
/// assert_eq!(rv.table(), Some(vec![addr(0), addr(1)]));
/// ```
#[derive(Clone, Debug)]
pub struct Rendezvous {
    addrs: Vec<Option<SocketAddr>>,
}

impl Rendezvous {
    /// A rendezvous for a job of `nranks` ranks.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// let rv = Rendezvous::new(4);
    /// assert_eq!(rv.missing(), [0, 1, 2, 3]);
    /// ```
    pub fn new(nranks: usize) -> Rendezvous {
        Rendezvous { addrs: vec![None; nranks] }
    }

    /// Ranks in the job.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// assert_eq!(Rendezvous::new(4).nranks(), 4);
    /// ```
    pub fn nranks(&self) -> usize {
        self.addrs.len()
    }

    /// Takes a hello (already checked by [`check_hello`]). Refuses a rank of a job of
    /// another size, a rank outside the job, and a rank that already joined.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// let listen = "10.0.0.2:40001".parse().unwrap();
    /// let mut rv = Rendezvous::new(4);
    /// assert_eq!(rv.on_hello(&Hello::new(&id, 1, 4, listen)), Ok(()));
    /// assert_eq!(rv.on_hello(&Hello::new(&id, 1, 4, listen)), Err(Refusal("rank 1 joined twice".into())));
    /// let wrong_size = rv.on_hello(&Hello::new(&id, 2, 8, listen)).unwrap_err();
    /// assert_eq!(wrong_size.0, "rank 2 says this job has 8 ranks, the root expects 4");
    /// ```
    pub fn on_hello(&mut self, hello: &Hello) -> std::result::Result<(), Refusal> {
        let n = self.addrs.len();
        let rank = hello.rank as usize;
        if hello.nranks as usize != n {
            return Err(Refusal(format!("rank {rank} says this job has {} ranks, the root expects {n}", hello.nranks)));
        }
        if rank >= n {
            return Err(Refusal(format!("rank {rank} is outside 0..{n}")));
        }
        if self.addrs[rank].is_some() {
            return Err(Refusal(format!("rank {rank} joined twice")));
        }
        self.addrs[rank] = Some(hello.listen);
        Ok(())
    }

    /// Rank `rank`'s connection to the root closed before the table was sent: it is missing
    /// again.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// let mut rv = Rendezvous::new(2);
    /// rv.on_hello(&Hello::new(&id, 1, 2, "10.0.0.2:40001".parse().unwrap())).unwrap();
    /// rv.on_leave(1);
    /// assert!(!rv.has_joined(1));
    /// ```
    pub fn on_leave(&mut self, rank: usize) {
        if let Some(a) = self.addrs.get_mut(rank) {
            *a = None;
        }
    }

    /// Whether rank `rank` has joined.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// let mut rv = Rendezvous::new(2);
    /// rv.on_hello(&Hello::new(&id, 1, 2, "10.0.0.2:40001".parse().unwrap())).unwrap();
    /// assert!(rv.has_joined(1) && !rv.has_joined(0) && !rv.has_joined(5));
    /// ```
    pub fn has_joined(&self, rank: usize) -> bool {
        self.addrs.get(rank).is_some_and(Option::is_some)
    }

    /// The ranks not in yet, in order.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// let mut rv = Rendezvous::new(3);
    /// rv.on_hello(&Hello::new(&id, 1, 3, "10.0.0.2:40001".parse().unwrap())).unwrap();
    /// assert_eq!(rv.missing(), [0, 2]);
    /// ```
    pub fn missing(&self) -> Vec<usize> {
        (0..self.addrs.len()).filter(|&r| self.addrs[r].is_none()).collect()
    }

    /// Every rank's listen address, once all are in.
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// let listen = "10.0.0.1:40000".parse().unwrap();
    /// let mut rv = Rendezvous::new(1);
    /// assert_eq!(rv.table(), None);
    /// rv.on_hello(&Hello::new(&id, 0, 1, listen)).unwrap();
    /// assert_eq!(rv.table(), Some(vec![listen]));
    /// ```
    pub fn table(&self) -> Option<Vec<SocketAddr>> {
        self.addrs.iter().copied().collect()
    }

    /// The refusal sent to everyone when `timeout` passed before all ranks came: "ranks 2
    /// and 5 never joined within 30s".
    ///
    /// ```
    /// # use ferrolink::comm::bootstrap::proto::*;
    /// # let id = ferrolink::UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), 0x5eed, [7; 16]);
    /// let mut rv = Rendezvous::new(6);
    /// for r in [0, 1, 3, 4] {
    ///     rv.on_hello(&Hello::new(&id, r, 6, std::net::SocketAddr::from(([10, 0, 0, 1], 40_000)))).unwrap();
    /// }
    /// let refusal = rv.timed_out(std::time::Duration::from_secs(30));
    /// assert_eq!(refusal.0, "ranks 2 and 5 never joined within 30s");
    /// ```
    pub fn timed_out(&self, timeout: Duration) -> Refusal {
        Refusal(format!("{} never joined within {timeout:?}", ranks_phrase(&self.missing())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn unique_ids_round_trip_as_bytes_and_text_and_hide_their_secret() {
        for root in ["127.0.0.1:29500", "[::1]:7", "10.1.2.3:65535"] {
            let id = UniqueId::new(root.parse().unwrap()).unwrap();
            assert_eq!(UniqueId::from_bytes(&id.to_bytes()).unwrap(), id);
            assert_eq!(id.to_string().parse::<UniqueId>().unwrap(), id);
            assert!(id.secret_matches(id.secret()));
            assert!(!id.secret_matches(&[0; 16]));
            let shown = format!("{id:?}");
            assert!(!shown.contains("secret") && !shown.contains(&format!("{:?}", id.secret())), "{shown}");
        }
        let a = UniqueId::new("127.0.0.1:1".parse().unwrap()).unwrap();
        let b = UniqueId::new("127.0.0.1:1".parse().unwrap()).unwrap();
        assert_ne!(a.magic(), b.magic(), "fresh ids get fresh magics");
        assert!("garbage".parse::<UniqueId>().is_err());
        assert!(UniqueId::from_bytes(&[0u8; 128]).is_err());
    }

    const MAGIC: u64 = 0x5EED_F00D_0123_4567;

    fn id() -> UniqueId {
        UniqueId::from_parts("127.0.0.1:29500".parse().unwrap(), MAGIC, [7; 16])
    }

    fn addr(i: usize) -> SocketAddr {
        if i % 3 == 2 {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, i as u16)), 40_000 + i as u16)
        } else {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, (i >> 8) as u8, i as u8)), 40_000 + i as u16)
        }
    }

    fn samples() -> Vec<Frame> {
        let id = id();
        vec![
            Frame::Hello(Hello::new(&id, 3, 8, addr(3))),
            Frame::Hello(Hello::new(&id, 2, 8, addr(2))),
            Frame::Table((0..9).map(addr).collect()),
            Frame::Table(Vec::new()),
            Frame::Refuse("rank 3 joined twice".into()),
            Frame::Refuse(String::new()),
            Frame::PeerHello(PeerHello::new(&id, 5)),
            Frame::Msg { from: 1, tag: u64::MAX, data: (0..=255).collect() },
            Frame::Msg { from: 0, tag: 0, data: Vec::new() },
            Frame::Bye,
        ]
    }

    /// Decodes all of `bytes` fed in pieces of `step` bytes; the frames, or the first error.
    fn decode_all(dec: &mut Decoder, bytes: &[u8], step: usize) -> std::result::Result<Vec<Frame>, DecodeError> {
        let mut out = Vec::new();
        for chunk in bytes.chunks(step.max(1)) {
            let mut input = chunk;
            while let Some(f) = dec.decode(&mut input)? {
                out.push(f);
            }
            assert!(input.is_empty(), "Ok(None) means every byte was taken");
        }
        Ok(out)
    }

    #[test]
    fn every_frame_round_trips_in_any_cut() {
        let frames = samples();
        let mut stream = Vec::new();
        for f in &frames {
            stream.extend(encode(MAGIC, f).unwrap());
        }
        for step in [1, 2, 3, 7, 25, 26, 100, stream.len()] {
            let mut dec = Decoder::new(MAGIC);
            assert_eq!(decode_all(&mut dec, &stream, step).unwrap(), frames, "pieces of {step}");
            assert!(!dec.in_frame());
        }
        // encode_msg is encode of a Msg.
        let msg = Frame::Msg { from: 9, tag: 77, data: b"abc".to_vec() };
        assert_eq!(encode_msg(MAGIC, 9, 77, b"abc").unwrap(), encode(MAGIC, &msg).unwrap());
    }

    #[test]
    fn the_secret_is_never_printed() {
        let h = Hello::new(&id(), 1, 2, addr(1));
        let p = PeerHello::new(&id(), 1);
        for text in [format!("{h:?}"), format!("{p:?}"), format!("{:?}", Frame::Hello(h.clone()))] {
            assert!(!text.contains("secret") && !text.contains("[7, 7"), "{text}");
        }
    }

    fn with_header(kind: u8, from: u32, tag: u64, payload: &[u8]) -> Vec<u8> {
        let mut v = MAGIC.to_le_bytes().to_vec();
        v.push(kind);
        v.extend_from_slice(&from.to_le_bytes());
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn bad_streams_are_rejected_and_the_decoder_stays_failed() {
        let hello = encode(MAGIC, &Frame::Hello(Hello::new(&id(), 1, 4, addr(1)))).unwrap();
        let peer = encode(MAGIC, &Frame::PeerHello(PeerHello::new(&id(), 1))).unwrap();
        let table = encode(MAGIC, &Frame::Table(vec![addr(0), addr(1)])).unwrap();
        let mut wrong_magic = hello.clone();
        wrong_magic[0] ^= 1;
        let mut huge = with_header(5, 0, 0, &[]);
        huge[21..25].copy_from_slice(&u32::MAX.to_le_bytes());
        let truncated_hello = with_header(1, 1, 0, &hello[HEADER_LEN..hello.len() - 1]);
        let overlong_peer = with_header(4, 1, 0, &[&peer[HEADER_LEN..], &[0][..]].concat());
        let mut bad_family = hello.clone();
        bad_family[HEADER_LEN + 32] = 5;
        let mut table_lies = table.clone();
        table_lies[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&1000u32.to_le_bytes());
        let mut table_short = table.clone();
        table_short[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&3u32.to_le_bytes());
        type Case = (&'static str, Vec<u8>, fn(&DecodeError) -> bool);
        let cases: Vec<Case> = vec![
            ("wrong magic", wrong_magic, |e| matches!(e, DecodeError::WrongMagic { .. })),
            ("unknown kind", with_header(0, 0, 0, &[]), |e| matches!(e, DecodeError::UnknownKind(0))),
            ("unknown kind 200", with_header(200, 0, 0, &[]), |e| matches!(e, DecodeError::UnknownKind(200))),
            ("oversized", huge, |e| matches!(e, DecodeError::TooLong { .. })),
            ("truncated hello", truncated_hello, |e| {
                matches!(e, DecodeError::Malformed { kind: Kind::Hello, why: "truncated" })
            }),
            ("overlong peer hello", overlong_peer, |e| {
                matches!(e, DecodeError::Malformed { kind: Kind::PeerHello, .. })
            }),
            ("bad address family", bad_family, |e| matches!(e, DecodeError::Malformed { kind: Kind::Hello, .. })),
            ("table count past the payload", table_lies, |e| {
                matches!(e, DecodeError::Malformed { kind: Kind::Table, .. })
            }),
            ("table count past its addresses", table_short, |e| {
                matches!(e, DecodeError::Malformed { kind: Kind::Table, .. })
            }),
            ("bye with a payload", with_header(6, 0, 0, &[1]), |e| {
                matches!(e, DecodeError::Malformed { kind: Kind::Bye, .. })
            }),
            ("reason not utf-8", with_header(3, 0, 0, &[0xff, 0xfe]), |e| {
                matches!(e, DecodeError::Malformed { kind: Kind::Refuse, .. })
            }),
        ];
        for (what, bytes, is) in cases {
            let mut dec = Decoder::new(MAGIC);
            let e = decode_all(&mut dec, &bytes, 1).expect_err(what);
            assert!(is(&e), "{what}: {e}");
            assert!(!e.to_string().is_empty());
            // Final: even valid bytes now fail with the same error.
            assert_eq!(dec.decode(&mut &peer[..]).unwrap_err(), e, "{what}");
            assert_eq!(dec.buffered_capacity(), 0);
        }
        // A cap: a Msg one byte over it is refused at its header, before any payload byte.
        let mut dec = Decoder::with_max_payload(MAGIC, 10);
        let e = dec.decode(&mut &encode_msg(MAGIC, 0, 0, &[0; 11]).unwrap()[..HEADER_LEN]).unwrap_err();
        assert_eq!(e, DecodeError::TooLong { len: 11, max: 10 });
        let mut dec = Decoder::with_max_payload(MAGIC, 10);
        assert_eq!(decode_all(&mut dec, &encode_msg(MAGIC, 0, 0, &[1; 10]).unwrap(), 3).unwrap().len(), 1);
        // Encoding refuses what no decoder would take.
        assert!(encode_msg(MAGIC, 0, 0, &vec![0; MAX_PAYLOAD + 1]).is_err());
    }

    #[test]
    fn a_big_payload_buffer_grows_with_the_bytes_that_arrive() {
        let mut dec = Decoder::new(MAGIC);
        let mut head = with_header(5, 0, 0, &[]);
        head[21..25].copy_from_slice(&(MAX_PAYLOAD as u32).to_le_bytes());
        assert_eq!(dec.decode(&mut &head[..]).unwrap(), None);
        assert!(dec.in_frame());
        assert!(dec.buffered_capacity() <= FIRST_CHUNK, "{} allocated for 0 bytes received", dec.buffered_capacity());
        dec.decode(&mut &[0u8; 100_000][..]).unwrap();
        assert!(dec.buffered_capacity() <= 2 * 100_000 + FIRST_CHUNK, "{}", dec.buffered_capacity());
    }

    #[test]
    fn the_handshake_checks_magic_secret_and_sender() {
        let id = id();
        let good = Hello::new(&id, 1, 4, addr(1));
        assert_eq!(check_hello(&id, &good), Ok(()));
        let mut bad = good.clone();
        bad.secret[15] ^= 0x80;
        assert_eq!(check_hello(&id, &bad), Err(Refusal("wrong secret".into())));
        let mut other_job = good.clone();
        other_job.magic ^= 1;
        assert!(check_hello(&id, &other_job).unwrap_err().0.contains("wrong magic"));
        assert_eq!(check_peer_hello(&id, &PeerHello::new(&id, 3), 4), Ok(3));
        assert_eq!(check_peer_hello(&id, &PeerHello::new(&id, 4), 4), Err(Refusal("rank 4 is outside 0..4".into())));
        let stranger = UniqueId::from_parts(id.root(), MAGIC, [8; 16]);
        assert_eq!(check_peer_hello(&id, &PeerHello::new(&stranger, 0), 4), Err(Refusal("wrong secret".into())));
    }

    /// xorshift64*, for reproducible shuffles without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Simulated peers: for 1..9 ranks, every rank's hello in a random order, with bad hellos
    /// (strangers, duplicates, other sizes, ranks past the end) mixed in at random places.
    #[test]
    fn rendezvous_of_simulated_peers_in_random_orders() {
        let id = id();
        for n in 1..=9usize {
            for seed in 1..=200u64 {
                let mut rng = Rng(seed * 0x9E37_79B9 + n as u64);
                let mut events: Vec<Hello> = (0..n).map(|r| Hello::new(&id, r as u32, n as u32, addr(r))).collect();
                for i in (1..events.len()).rev() {
                    events.swap(i, rng.below(i + 1));
                }
                // Ranks that leave (their connection closes) and come back later.
                let leaver = (seed % 4 == 0).then(|| rng.below(n));
                let mut rv = Rendezvous::new(n);
                let mut joined = vec![false; n];
                let mut bad_left = 1 + rng.below(4);
                let mut i = 0;
                while i < events.len() || bad_left > 0 {
                    if bad_left > 0 && (i == events.len() || rng.below(3) == 0) {
                        bad_left -= 1;
                        let r = rng.below(n + 3);
                        let (hello, want): (Hello, String) = match rng.below(4) {
                            0 => {
                                let mut h = Hello::new(&id, r as u32, n as u32, addr(99));
                                h.secret[0] ^= 1;
                                assert_eq!(check_hello(&id, &h), Err(Refusal("wrong secret".into())));
                                continue;
                            }
                            1 => (
                                Hello::new(&id, r as u32, n as u32 + 1, addr(99)),
                                format!("rank {r} says this job has {} ranks, the root expects {n}", n + 1),
                            ),
                            2 => (
                                Hello::new(&id, (n + r) as u32, n as u32, addr(99)),
                                format!("rank {} is outside 0..{n}", n + r),
                            ),
                            _ => {
                                // A duplicate of a rank already in, if any.
                                let Some(dup) = (0..n).find(|&k| joined[k]) else { continue };
                                (Hello::new(&id, dup as u32, n as u32, addr(99)), format!("rank {dup} joined twice"))
                            }
                        };
                        assert_eq!(check_hello(&id, &hello), Ok(()));
                        assert_eq!(rv.on_hello(&hello), Err(Refusal(want)), "n={n} seed={seed}");
                    } else {
                        let h = &events[i];
                        i += 1;
                        assert_eq!(rv.on_hello(h), Ok(()), "n={n} seed={seed}");
                        joined[h.rank as usize] = true;
                        if leaver == Some(h.rank as usize) && rng.below(2) == 0 && i < events.len() {
                            rv.on_leave(h.rank as usize);
                            joined[h.rank as usize] = false;
                            events.push(h.clone());
                        }
                    }
                    let missing: Vec<usize> = (0..n).filter(|&r| !joined[r]).collect();
                    assert_eq!(rv.missing(), missing, "n={n} seed={seed}");
                    assert_eq!(rv.table().is_some(), missing.is_empty());
                    for r in 0..n {
                        assert_eq!(rv.has_joined(r), joined[r]);
                    }
                }
                assert_eq!(rv.table(), Some((0..n).map(addr).collect::<Vec<_>>()), "n={n} seed={seed}");
            }
        }
        let mut rv = Rendezvous::new(6);
        for r in [0, 1, 3, 4] {
            rv.on_hello(&Hello::new(&id, r, 6, addr(r as usize))).unwrap();
        }
        assert_eq!(rv.timed_out(Duration::from_secs(30)).0, "ranks 2 and 5 never joined within 30s");
    }

    // --- Fuzzing of the decoder ------------------------------------------------------------

    fn any_addr() -> impl Strategy<Value = SocketAddr> {
        prop_oneof![
            (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::new(IpAddr::V4(ip.into()), port)),
            (any::<[u8; 16]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::new(IpAddr::V6(ip.into()), port)),
        ]
    }

    fn any_frame() -> impl Strategy<Value = Frame> {
        prop_oneof![
            (any::<u64>(), any::<[u8; 16]>(), any::<u32>(), any::<u32>(), any_addr()).prop_map(
                |(magic, secret, rank, nranks, listen)| Frame::Hello(Hello { magic, secret, rank, nranks, listen })
            ),
            proptest::collection::vec(any_addr(), 0..12).prop_map(Frame::Table),
            proptest::collection::vec(any::<char>(), 0..40).prop_map(|c| Frame::Refuse(c.into_iter().collect())),
            (any::<u64>(), any::<[u8; 16]>(), any::<u32>())
                .prop_map(|(magic, secret, from)| Frame::PeerHello(PeerHello { magic, secret, from })),
            (any::<u32>(), any::<u64>(), proptest::collection::vec(any::<u8>(), 0..600))
                .prop_map(|(from, tag, data)| Frame::Msg { from, tag, data }),
            Just(Frame::Bye),
        ]
    }

    /// Feeds `bytes` cut at `cuts`, checking after each call that the buffer stays within the
    /// cap; returns the frames decoded and whether it ended in an error.
    fn feed_checked(dec: &mut Decoder, bytes: &[u8], cuts: &[usize]) -> (Vec<Frame>, Option<DecodeError>) {
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        points.push(0);
        points.push(bytes.len());
        points.sort_unstable();
        let mut frames = Vec::new();
        for w in points.windows(2) {
            let mut input = &bytes[w[0]..w[1]];
            loop {
                let r = dec.decode(&mut input);
                assert!(
                    dec.buffered_capacity() <= dec.max_payload(),
                    "{} > cap {}",
                    dec.buffered_capacity(),
                    dec.max_payload()
                );
                match r {
                    Ok(Some(f)) => frames.push(f),
                    Ok(None) => {
                        assert!(input.is_empty());
                        break;
                    }
                    Err(e) => return (frames, Some(e)),
                }
            }
        }
        (frames, None)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

        /// Random bytes: never a panic, never a buffer over the cap.
        #[test]
        fn random_bytes_never_panic_nor_overallocate(
            bytes in proptest::collection::vec(any::<u8>(), 0..4096),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
            cap in 0usize..2048,
        ) {
            let mut dec = Decoder::with_max_payload(MAGIC, cap);
            let _ = feed_checked(&mut dec, &bytes, &cuts);
            // Random bytes with the right magic in front: reach the kind/length/payload checks.
            let mut framed = MAGIC.to_le_bytes().to_vec();
            framed.extend_from_slice(&bytes);
            let mut dec = Decoder::with_max_payload(MAGIC, cap);
            let _ = feed_checked(&mut dec, &framed, &cuts);
        }

        /// Valid frames, concatenated and cut at random points, decode back equal.
        #[test]
        fn valid_frames_cut_anywhere_decode_back_equal(
            frames in proptest::collection::vec(any_frame(), 0..8),
            cuts in proptest::collection::vec(any::<usize>(), 0..16),
        ) {
            let mut bytes = Vec::new();
            for f in &frames {
                bytes.extend(encode(MAGIC, f).unwrap());
            }
            let mut dec = Decoder::with_max_payload(MAGIC, 1024);
            let (got, err) = feed_checked(&mut dec, &bytes, &cuts);
            prop_assert_eq!(err, None);
            prop_assert_eq!(got, frames);
            prop_assert!(!dec.in_frame());
        }

        /// Valid frames with random bits flipped: an error or some frames, never a panic or a
        /// buffer over the cap; the frames before the first flipped byte come back intact.
        #[test]
        fn bit_flips_never_panic(
            frames in proptest::collection::vec(any_frame(), 1..6),
            flips in proptest::collection::vec((any::<usize>(), 0u8..8), 1..6),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let mut bytes = Vec::new();
            let mut ends = Vec::new();
            for f in &frames {
                bytes.extend(encode(MAGIC, f).unwrap());
                ends.push(bytes.len());
            }
            let mut first = usize::MAX;
            for (at, bit) in flips {
                let at = at % bytes.len();
                bytes[at] ^= 1 << bit;
                first = first.min(at);
            }
            let intact = ends.iter().filter(|&&e| e <= first).count();
            let mut dec = Decoder::with_max_payload(MAGIC, 1024);
            let (got, _) = feed_checked(&mut dec, &bytes, &cuts);
            prop_assert!(got.len() >= intact);
            prop_assert_eq!(&got[..intact], &frames[..intact]);
        }
    }
}
