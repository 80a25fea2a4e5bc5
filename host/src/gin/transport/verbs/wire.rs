//! What the verbs transport puts on the wire, free of I/O: the 32-bit immediate data of its
//! messages ([`ImmCodec`]), its control messages ([`Control`]: a window's address and key,
//! asked and answered), what a receive completion means ([`classify`]), and the connection
//! information ranks exchange through the bootstrap ([`ConnMsg`]). Every decoder here takes
//! bytes from another process: it checks everything and never panics (fuzzed below).

/// The link layer of a port (`IBV_LINK_LAYER_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkLayer {
    /// InfiniBand: ports are addressed by LID.
    Infiniband = 1,
    /// Ethernet (RoCE): ports are addressed by GID, every packet carries a GRH.
    Ethernet = 2,
}

impl LinkLayer {
    /// From `ibv_port_attr::link_layer` (0, unspecified, is InfiniBand: old drivers).
    pub(crate) fn from_raw(v: u8) -> Option<LinkLayer> {
        match v {
            0 | 1 => Some(LinkLayer::Infiniband),
            2 => Some(LinkLayer::Ethernet),
            _ => None,
        }
    }
}

// ---- immediate data ----------------------------------------------------------------------------

/// What a message carrying immediate data is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ImmKind {
    /// Add 1 to a signal: a zero-length RDMA WRITE_WITH_IMM.
    SignalOne = 0,
    /// Add the 8-byte little-endian payload to a signal: a SEND_WITH_IMM.
    SignalAdd = 1,
    /// A [`Control`] message in the payload of a SEND_WITH_IMM (`id` is 0).
    Control = 2,
}

/// Decoded immediate data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Imm {
    pub(crate) kind: ImmKind,
    /// The sending world rank (checked against the queue pair it came on).
    pub(crate) sender: usize,
    /// The signal id.
    pub(crate) id: u32,
}

/// The layout of immediate data in a job of `nranks` ranks: the kind in bits 31–30, the
/// sender in the next `sender_bits` bits (as many as `nranks - 1` needs, at least 1), the
/// signal id in the rest. 8 ranks leave 27 bits of signal id; 65 536 ranks leave 14.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ImmCodec {
    nranks: usize,
    sender_bits: u32,
}

impl ImmCodec {
    pub(crate) fn new(nranks: usize) -> Result<ImmCodec, String> {
        if nranks == 0 || nranks > 1 << 29 {
            return Err(format!("{nranks} ranks do not fit the verbs transport's immediate data"));
        }
        let sender_bits = (usize::BITS - (nranks - 1).leading_zeros()).max(1);
        Ok(ImmCodec { nranks, sender_bits })
    }

    fn id_bits(&self) -> u32 {
        30 - self.sender_bits
    }

    /// Signal ids below this fit.
    pub(crate) fn id_limit(&self) -> u64 {
        1 << self.id_bits()
    }

    pub(crate) fn encode(&self, imm: Imm) -> Result<u32, String> {
        if imm.sender >= self.nranks {
            return Err(format!("rank {} is not in a job of {} ranks", imm.sender, self.nranks));
        }
        if u64::from(imm.id) >= self.id_limit() {
            return Err(format!(
                "signal {} does not fit the verbs transport's immediate data (at most {} signals with {} ranks)",
                imm.id,
                self.id_limit(),
                self.nranks
            ));
        }
        Ok((imm.kind as u32) << 30 | (imm.sender as u32) << self.id_bits() | imm.id)
    }

    pub(crate) fn decode(&self, raw: u32) -> Result<Imm, String> {
        let kind = match raw >> 30 {
            0 => ImmKind::SignalOne,
            1 => ImmKind::SignalAdd,
            2 => ImmKind::Control,
            _ => return Err(format!("immediate data {raw:#010x} has an unknown kind")),
        };
        let sender = ((raw >> self.id_bits()) & ((1 << self.sender_bits) - 1)) as usize;
        if sender >= self.nranks {
            return Err(format!("immediate data {raw:#010x} names rank {sender} of {}", self.nranks));
        }
        Ok(Imm { kind, sender, id: raw & ((1 << self.id_bits()) - 1) })
    }
}

// ---- control messages --------------------------------------------------------------------------

/// Where a rank's buffer of a window is, for the NIC of a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RemoteWindow {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) rkey: u32,
}

/// A control message (in a SEND_WITH_IMM of kind [`ImmKind::Control`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Control {
    /// "Where is your buffer of window `window`?"
    WindowRequest { window: u32 },
    /// The answer: `None` when the window is not registered there (any more).
    WindowAnswer { window: u32, found: Option<RemoteWindow> },
}

/// A control message's bytes (at most 32: sent inline).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ControlBytes {
    buf: [u8; 32],
    len: u8,
}

impl ControlBytes {
    pub(crate) fn from_slice(b: &[u8]) -> ControlBytes {
        let mut buf = [0; 32];
        buf[..b.len()].copy_from_slice(b);
        ControlBytes { buf, len: b.len() as u8 }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

const CONTROL_REQUEST: u8 = 1;
const CONTROL_FOUND: u8 = 2;
const CONTROL_GONE: u8 = 3;

impl Control {
    pub(crate) fn encode(&self) -> ControlBytes {
        let mut v = Vec::with_capacity(32);
        match *self {
            Control::WindowRequest { window } => {
                v.push(CONTROL_REQUEST);
                v.extend_from_slice(&window.to_le_bytes());
            }
            Control::WindowAnswer { window, found: Some(w) } => {
                v.push(CONTROL_FOUND);
                v.extend_from_slice(&window.to_le_bytes());
                v.extend_from_slice(&w.addr.to_le_bytes());
                v.extend_from_slice(&w.len.to_le_bytes());
                v.extend_from_slice(&w.rkey.to_le_bytes());
            }
            Control::WindowAnswer { window, found: None } => {
                v.push(CONTROL_GONE);
                v.extend_from_slice(&window.to_le_bytes());
            }
        }
        ControlBytes::from_slice(&v)
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Control, String> {
        let mut r = Reader(b);
        let c = match r.u8()? {
            CONTROL_REQUEST => Control::WindowRequest { window: r.u32()? },
            CONTROL_FOUND => {
                let window = r.u32()?;
                let (addr, len, rkey) = (r.u64()?, r.u64()?, r.u32()?);
                Control::WindowAnswer { window, found: Some(RemoteWindow { addr, len, rkey }) }
            }
            CONTROL_GONE => Control::WindowAnswer { window: r.u32()?, found: None },
            t => return Err(format!("unknown control message {t}")),
        };
        r.end()?;
        Ok(c)
    }
}

/// What a receive completion carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Incoming {
    /// Add `inc` to signal `id` of sender `from`.
    Signal { from: usize, id: u32, inc: u64 },
    /// A control message from `from`.
    Control { from: usize, msg: Control },
}

/// Decodes a receive completion on the connection to `peer`: `rdma_write` when it completed
/// an RDMA WRITE_WITH_IMM (else a SEND), its immediate data if any, and the bytes received.
pub(crate) fn classify(
    codec: &ImmCodec,
    peer: usize,
    rdma_write: bool,
    imm: Option<u32>,
    payload: &[u8],
) -> Result<Incoming, String> {
    let imm = codec.decode(imm.ok_or("a message without immediate data")?)?;
    if imm.sender != peer {
        return Err(format!("a message from rank {} on the connection to rank {peer}", imm.sender));
    }
    match (imm.kind, rdma_write) {
        (ImmKind::SignalOne, true) if payload.is_empty() => Ok(Incoming::Signal { from: peer, id: imm.id, inc: 1 }),
        (ImmKind::SignalAdd, false) => {
            let inc: [u8; 8] =
                payload.try_into().map_err(|_| format!("a signal increment of {} bytes", payload.len()))?;
            Ok(Incoming::Signal { from: peer, id: imm.id, inc: u64::from_le_bytes(inc) })
        }
        (ImmKind::Control, false) if imm.id == 0 => {
            Ok(Incoming::Control { from: peer, msg: Control::decode(payload)? })
        }
        (kind, _) => Err(format!(
            "a {kind:?} message as {} with {} bytes",
            if rdma_write { "an RDMA write" } else { "a send" },
            payload.len()
        )),
    }
}

// ---- connection information (bootstrap) -------------------------------------------------------

/// One queue pair's end: its number and its first packet sequence number (24 bits each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QpEndpoint {
    pub(crate) qpn: u32,
    pub(crate) psn: u32,
}

/// What a rank tells a peer it reaches through verbs: how to address its port, and its queue
/// pair for that peer in each context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ConnInfo {
    pub(crate) rank: u32,
    pub(crate) link_layer: LinkLayer,
    /// The port's active MTU (`enum ibv_mtu`: 1 = 256 bytes … 5 = 4096).
    pub(crate) mtu: u8,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    /// Where zero-length writes (signals of 1) point: a registered word of the sender's that
    /// nothing reads, so that no responder ever sees an invalid address or key.
    pub(crate) sink_addr: u64,
    pub(crate) sink_rkey: u32,
    /// Indexed by context.
    pub(crate) qps: Vec<QpEndpoint>,
}

/// A rank's message to one peer during set-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ConnMsg {
    /// This rank does not reach the peer through verbs.
    Absent,
    /// This rank wanted to but could not set verbs up (why).
    Failed(String),
    /// This rank's end of the connection.
    Info(ConnInfo),
}

const MAGIC: [u8; 4] = *b"FLvb";
const VERSION: u8 = 1;
/// The most contexts a message may describe (NCCL allows 4; the decoder's allocation cap).
pub(crate) const MAX_CONTEXTS: usize = 1024;
/// The longest failure reason sent.
const MAX_REASON: usize = 2048;

impl ConnMsg {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&MAGIC);
        v.push(VERSION);
        match self {
            ConnMsg::Absent => v.push(0),
            ConnMsg::Failed(why) => {
                v.push(1);
                let mut end = why.len().min(MAX_REASON);
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                v.extend_from_slice(&(end as u16).to_le_bytes());
                v.extend_from_slice(&why.as_bytes()[..end]);
            }
            ConnMsg::Info(i) => {
                v.push(2);
                v.extend_from_slice(&i.rank.to_le_bytes());
                v.push(i.link_layer as u8);
                v.push(i.mtu);
                v.extend_from_slice(&i.lid.to_le_bytes());
                v.extend_from_slice(&i.gid);
                v.extend_from_slice(&i.sink_addr.to_le_bytes());
                v.extend_from_slice(&i.sink_rkey.to_le_bytes());
                v.extend_from_slice(&(i.qps.len() as u16).to_le_bytes());
                for q in &i.qps {
                    v.extend_from_slice(&q.qpn.to_le_bytes());
                    v.extend_from_slice(&q.psn.to_le_bytes());
                }
            }
        }
        v
    }

    pub(crate) fn decode(b: &[u8]) -> Result<ConnMsg, String> {
        let mut r = Reader(b);
        if r.take(4)? != MAGIC {
            return Err("not a verbs connection message".into());
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(format!("version {version} of the verbs connection message (this build speaks {VERSION})"));
        }
        let msg = match r.u8()? {
            0 => ConnMsg::Absent,
            1 => {
                let len = r.u16()? as usize;
                if len > MAX_REASON {
                    return Err(format!("a failure reason of {len} bytes"));
                }
                ConnMsg::Failed(String::from_utf8_lossy(r.take(len)?).into_owned())
            }
            2 => {
                let rank = r.u32()?;
                let link_layer = match r.u8()? {
                    1 => LinkLayer::Infiniband,
                    2 => LinkLayer::Ethernet,
                    l => return Err(format!("unknown link layer {l}")),
                };
                let mtu = r.u8()?;
                if !(1..=5).contains(&mtu) {
                    return Err(format!("unknown MTU code {mtu}"));
                }
                let lid = r.u16()?;
                let gid: [u8; 16] = r.take(16)?.try_into().expect("16 bytes");
                let (sink_addr, sink_rkey) = (r.u64()?, r.u32()?);
                let n = r.u16()? as usize;
                if n == 0 || n > MAX_CONTEXTS || r.0.len() != n * 8 {
                    return Err(format!("{n} queue pairs in a message of {} more bytes", r.0.len()));
                }
                let mut qps = Vec::with_capacity(n);
                for _ in 0..n {
                    let (qpn, psn) = (r.u32()?, r.u32()?);
                    if qpn >= 1 << 24 || psn >= 1 << 24 {
                        return Err(format!("queue pair number {qpn:#x} or PSN {psn:#x} is over 24 bits"));
                    }
                    qps.push(QpEndpoint { qpn, psn });
                }
                ConnMsg::Info(ConnInfo { rank, link_layer, mtu, lid, gid, sink_addr, sink_rkey, qps })
            }
            t => return Err(format!("unknown verbs connection message kind {t}")),
        };
        r.end()?;
        Ok(msg)
    }
}

/// A cursor over untrusted bytes.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!("a message cut short ({} bytes missing)", n - self.0.len()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn end(&self) -> Result<(), String> {
        if self.0.is_empty() { Ok(()) } else { Err(format!("{} bytes after the message", self.0.len())) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info(contexts: usize) -> ConnInfo {
        ConnInfo {
            rank: 3,
            link_layer: LinkLayer::Ethernet,
            mtu: 5,
            lid: 0,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7],
            sink_addr: 0x7f00_0000_1000,
            sink_rkey: 0x55,
            qps: (0..contexts as u32).map(|c| QpEndpoint { qpn: 0x100 + c, psn: 0xabc + c }).collect(),
        }
    }

    #[test]
    fn immediate_data_gives_the_sender_the_bits_it_needs_and_the_id_the_rest() {
        let c = ImmCodec::new(8).unwrap();
        assert_eq!(c.id_limit(), 1 << 27);
        let c1 = ImmCodec::new(1).unwrap();
        assert_eq!(c1.id_limit(), 1 << 29);
        assert_eq!(ImmCodec::new(65_536).unwrap().id_limit(), 1 << 14);
        assert_eq!(ImmCodec::new(65_537).unwrap().id_limit(), 1 << 13);
        assert!(ImmCodec::new(0).is_err());
        let raw = c.encode(Imm { kind: ImmKind::SignalAdd, sender: 5, id: 9 }).unwrap();
        assert_eq!(raw, 1 << 30 | 5 << 27 | 9);
        assert_eq!(c.decode(raw).unwrap(), Imm { kind: ImmKind::SignalAdd, sender: 5, id: 9 });
    }

    #[test]
    fn immediate_data_refuses_what_does_not_fit() {
        let c = ImmCodec::new(6).unwrap();
        assert!(c.encode(Imm { kind: ImmKind::SignalOne, sender: 6, id: 0 }).is_err());
        assert!(c.encode(Imm { kind: ImmKind::SignalOne, sender: 0, id: 1 << 27 }).is_err());
        // Kind 3 is reserved; sender 7 is not a rank of 6.
        assert!(c.decode(3 << 30).is_err());
        assert!(c.decode(7 << 27).is_err());
    }

    #[test]
    fn control_messages_round_trip_and_reject_garbage() {
        for m in [
            Control::WindowRequest { window: 7 },
            Control::WindowAnswer {
                window: u32::MAX,
                found: Some(RemoteWindow { addr: 1 << 47, len: 4096, rkey: 0xdead }),
            },
            Control::WindowAnswer { window: 0, found: None },
        ] {
            let b = m.encode();
            assert!(b.as_slice().len() <= 32);
            assert_eq!(Control::decode(b.as_slice()).unwrap(), m);
            let cut = &b.as_slice()[..b.as_slice().len() - 1];
            assert!(Control::decode(cut).is_err());
            let mut long = b.as_slice().to_vec();
            long.push(0);
            assert!(Control::decode(&long).is_err());
        }
        assert!(Control::decode(&[]).is_err());
        assert!(Control::decode(&[9, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn receive_completions_decode_to_signals_and_control_messages() {
        let c = ImmCodec::new(4).unwrap();
        let imm = |kind, sender, id| Some(c.encode(Imm { kind, sender, id }).unwrap());
        assert_eq!(
            classify(&c, 2, true, imm(ImmKind::SignalOne, 2, 5), &[]),
            Ok(Incoming::Signal { from: 2, id: 5, inc: 1 })
        );
        assert_eq!(
            classify(&c, 2, false, imm(ImmKind::SignalAdd, 2, 5), &40u64.to_le_bytes()),
            Ok(Incoming::Signal { from: 2, id: 5, inc: 40 })
        );
        let req = Control::WindowRequest { window: 3 };
        assert_eq!(
            classify(&c, 1, false, imm(ImmKind::Control, 1, 0), req.encode().as_slice()),
            Ok(Incoming::Control { from: 1, msg: req })
        );
        // The sender must be the connection's peer; kinds must come with their verb.
        assert!(classify(&c, 1, true, imm(ImmKind::SignalOne, 2, 5), &[]).is_err());
        assert!(classify(&c, 2, false, imm(ImmKind::SignalOne, 2, 5), &[]).is_err());
        assert!(classify(&c, 2, true, imm(ImmKind::SignalAdd, 2, 5), &[0; 8]).is_err());
        assert!(classify(&c, 2, false, imm(ImmKind::SignalAdd, 2, 5), &[0; 7]).is_err());
        assert!(classify(&c, 2, false, None, &[0; 8]).is_err());
    }

    #[test]
    fn connection_messages_round_trip() {
        for m in [ConnMsg::Absent, ConnMsg::Failed("no RDMA device".into()), ConnMsg::Info(info(4))] {
            assert_eq!(ConnMsg::decode(&m.encode()).unwrap(), m);
        }
        let long = "é".repeat(MAX_REASON);
        match ConnMsg::decode(&ConnMsg::Failed(long).encode()).unwrap() {
            ConnMsg::Failed(s) => assert!(s.len() <= MAX_REASON && s.chars().all(|c| c == 'é')),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn connection_messages_reject_what_a_well_behaved_rank_never_sends() {
        let good = ConnMsg::Info(info(2)).encode();
        let mut bad_qpn = good.clone();
        let at = good.len() - 16;
        bad_qpn[at..at + 4].copy_from_slice(&(1u32 << 24).to_le_bytes());
        assert!(ConnMsg::decode(&bad_qpn).is_err());
        let mut bad_mtu = good.clone();
        bad_mtu[11] = 6;
        assert!(ConnMsg::decode(&bad_mtu).is_err());
        let mut bad_version = good.clone();
        bad_version[4] = 2;
        assert!(ConnMsg::decode(&bad_version).unwrap_err().contains("version 2"));
        assert!(ConnMsg::decode(b"HTTP/1.1 200 OK").is_err());
    }

    proptest! {
        #[test]
        fn connection_message_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = ConnMsg::decode(&bytes);
            let mut framed = MAGIC.to_vec();
            framed.push(VERSION);
            framed.extend_from_slice(&bytes);
            let _ = ConnMsg::decode(&framed);
        }

        #[test]
        fn connection_messages_round_trip_and_every_cut_is_an_error(
            rank in any::<u32>(),
            ethernet in any::<bool>(),
            mtu in 1u8..=5,
            lid in any::<u16>(),
            gid in any::<[u8; 16]>(),
            sink in any::<(u64, u32)>(),
            qps in proptest::collection::vec((0u32..1 << 24, 0u32..1 << 24), 1..8),
            flip in any::<(usize, u8)>(),
        ) {
            let m = ConnMsg::Info(ConnInfo {
                rank,
                link_layer: if ethernet { LinkLayer::Ethernet } else { LinkLayer::Infiniband },
                mtu,
                lid,
                gid,
                sink_addr: sink.0,
                sink_rkey: sink.1,
                qps: qps.into_iter().map(|(qpn, psn)| QpEndpoint { qpn, psn }).collect(),
            });
            let b = m.encode();
            prop_assert_eq!(ConnMsg::decode(&b).unwrap(), m.clone());
            for cut in 0..b.len() {
                prop_assert!(ConnMsg::decode(&b[..cut]).is_err());
            }
            // A flipped bit decodes to an error or to some valid message; it never panics.
            let mut f = b.clone();
            let i = flip.0 % f.len();
            f[i] ^= flip.1 | 1;
            if let Ok(ConnMsg::Info(i)) = ConnMsg::decode(&f) {
                prop_assert!(i.qps.iter().all(|q| q.qpn < 1 << 24 && q.psn < 1 << 24));
            }
        }

        #[test]
        fn control_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(m) = Control::decode(&bytes) {
                let again = m.encode();
                prop_assert_eq!(again.as_slice(), &bytes[..]);
            }
        }

        #[test]
        fn immediate_data_round_trips_and_decodes_any_word_safely(
            nranks in 1usize..100_000,
            sender in any::<usize>(),
            id in any::<u32>(),
            kind in 0u8..3,
            raw in any::<u32>(),
        ) {
            let c = ImmCodec::new(nranks).unwrap();
            let kind = [ImmKind::SignalOne, ImmKind::SignalAdd, ImmKind::Control][kind as usize];
            let imm = Imm { kind, sender: sender % nranks, id: (u64::from(id) % c.id_limit()) as u32 };
            prop_assert_eq!(c.decode(c.encode(imm).unwrap()).unwrap(), imm);
            if let Ok(d) = c.decode(raw) {
                prop_assert!(d.sender < nranks && u64::from(d.id) < c.id_limit());
                prop_assert_eq!(c.encode(d).unwrap(), raw);
            }
        }
    }
}
