//! The verbs transport's decisions, free of I/O: the work requests that carry one GIN request
//! ([`plan_request`]), the attributes of each queue-pair transition (RESET → INIT → RTR →
//! RTS: [`to_init`], [`to_rtr`], [`to_rts`]), and which device, port and GID a rank uses
//! ([`parse_hca_list`], [`choose_gid`]).

use super::wire::{ConnInfo, ControlBytes, Imm, ImmCodec, ImmKind, LinkLayer, QpEndpoint, RemoteWindow};
use crate::gin::transport::{Payload, Request};

/// One work request, as planned (the FFI layer turns it into an `ibv_send_wr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wr {
    /// RDMA WRITE of `len` bytes from registered local memory to remote memory.
    Write { local: u64, lkey: u32, len: u32, remote: u64, rkey: u32 },
    /// RDMA WRITE of the first `len` (≤ 8) of `bytes`, inline.
    WriteInline { bytes: [u8; 8], len: u8, remote: u64, rkey: u32 },
    /// Add 1 to a signal: a zero-length RDMA WRITE_WITH_IMM (at the peer's sink word).
    SignalOne { imm: u32, remote: u64, rkey: u32 },
    /// Add `inc` to a signal: a SEND_WITH_IMM of 8 inline bytes.
    SignalAdd { imm: u32, inc: u64 },
    /// A control message: a SEND_WITH_IMM of its inline bytes.
    Control { imm: u32, msg: ControlBytes },
    /// RDMA READ (the receiver's flush).
    Read { local: u64, lkey: u32, len: u32, remote: u64, rkey: u32 },
}

/// What a request's work requests need besides the request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Keys {
    /// This rank's world rank (the sender in immediate data).
    pub(crate) me: usize,
    /// The key of the local region holding a put's source.
    pub(crate) src_lkey: Option<u32>,
    /// The peer's buffer of the destination window.
    pub(crate) dst: Option<RemoteWindow>,
    /// The largest message the device takes (`ibv_port_attr::max_msg_sz`, capped).
    pub(crate) max_msg: u32,
    /// The peer's sink word (address, rkey), where zero-length writes point.
    pub(crate) sink: (u64, u32),
}

/// The work requests that carry `req` on its queue pair, in order: the data (a put cut into
/// writes of at most `max_msg` bytes, or one inline write of a value), then the signal. The
/// queue pair keeps them in that order, which is what makes the signal follow the data
/// (module docs).
pub(crate) fn plan_request(req: &Request, codec: &ImmCodec, k: &Keys) -> Result<Vec<Wr>, String> {
    let mut wrs = Vec::new();
    let dst_of = |offset: u64, bytes: u64| -> Result<(u64, u32), String> {
        let w = k.dst.ok_or("no key for the destination window")?;
        if offset.checked_add(bytes).is_none_or(|end| end > w.len) {
            return Err(format!("{bytes} bytes at offset {offset} are past the end of the {}-byte window", w.len));
        }
        Ok((w.addr + offset, w.rkey))
    };
    match req.payload {
        Payload::Put { src, bytes, dst, .. } => {
            let (remote, rkey) = dst_of(dst.offset, bytes as u64)?;
            if bytes > 0 {
                let lkey = k.src_lkey.ok_or("no key for the source window")?;
                let chunk = u64::from(k.max_msg.max(1));
                let mut done = 0u64;
                while done < bytes as u64 {
                    let len = chunk.min(bytes as u64 - done);
                    wrs.push(Wr::Write { local: src + done, lkey, len: len as u32, remote: remote + done, rkey });
                    done += len;
                }
            }
        }
        Payload::PutValue { value, bytes, dst } => {
            if !matches!(bytes, 1 | 2 | 4 | 8) {
                return Err(format!("a value of {bytes} bytes"));
            }
            let (remote, rkey) = dst_of(dst.offset, u64::from(bytes))?;
            wrs.push(Wr::WriteInline { bytes: value.to_le_bytes(), len: bytes as u8, remote, rkey });
        }
        Payload::None => {}
    }
    if let Some((id, inc)) = req.signal {
        let kind = if inc == 1 { ImmKind::SignalOne } else { ImmKind::SignalAdd };
        let imm = codec.encode(Imm { kind, sender: k.me, id })?;
        wrs.push(if inc == 1 {
            Wr::SignalOne { imm, remote: k.sink.0, rkey: k.sink.1 }
        } else {
            Wr::SignalAdd { imm, inc }
        });
    }
    Ok(wrs)
}

/// The control message `msg` from rank `me`.
pub(crate) fn plan_control(codec: &ImmCodec, me: usize, msg: ControlBytes) -> Result<Wr, String> {
    Ok(Wr::Control { imm: codec.encode(Imm { kind: ImmKind::Control, sender: me, id: 0 })?, msg })
}

// ---- queue-pair transitions ----------------------------------------------------------------------

/// `enum ibv_qp_state`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum QpState {
    #[default]
    Reset = 0,
    Init = 1,
    Rtr = 2,
    Rts = 3,
}

/// `enum ibv_qp_attr_mask`: which attributes a transition sets.
pub(crate) mod mask {
    pub(crate) const STATE: u32 = 1 << 0;
    pub(crate) const ACCESS_FLAGS: u32 = 1 << 3;
    pub(crate) const PKEY_INDEX: u32 = 1 << 4;
    pub(crate) const PORT: u32 = 1 << 5;
    pub(crate) const AV: u32 = 1 << 7;
    pub(crate) const PATH_MTU: u32 = 1 << 8;
    pub(crate) const TIMEOUT: u32 = 1 << 9;
    pub(crate) const RETRY_CNT: u32 = 1 << 10;
    pub(crate) const RNR_RETRY: u32 = 1 << 11;
    pub(crate) const RQ_PSN: u32 = 1 << 12;
    pub(crate) const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub(crate) const MIN_RNR_TIMER: u32 = 1 << 15;
    pub(crate) const SQ_PSN: u32 = 1 << 16;
    pub(crate) const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub(crate) const DEST_QPN: u32 = 1 << 20;
}

/// `enum ibv_access_flags`.
pub(crate) mod access {
    pub(crate) const LOCAL_WRITE: u32 = 1;
    pub(crate) const REMOTE_WRITE: u32 = 1 << 1;
    pub(crate) const REMOTE_READ: u32 = 1 << 2;
}

/// Ack timeout: 4.096 µs × 2^18 ≈ 1.07 s per try (NCCL uses 2^20).
pub(crate) const TIMEOUT: u8 = 18;
/// Retries of a lost packet before the queue pair fails.
pub(crate) const RETRY_CNT: u8 = 7;
/// 7: retry forever while the receiver has no receive posted (it reposts as it reaps).
pub(crate) const RNR_RETRY: u8 = 7;
/// The receiver-not-ready delay asked of a sender: code 12 is 0.64 ms.
pub(crate) const MIN_RNR_TIMER: u8 = 12;
/// RDMA READs in flight per queue pair (the flush reads; nothing else reads).
pub(crate) const RD_ATOMIC: u8 = 1;
/// The GRH hop limit on RoCE (routable).
pub(crate) const HOP_LIMIT: u8 = 255;

/// A global route header (RoCE, or IB across subnets).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Grh {
    pub(crate) dgid: [u8; 16],
    pub(crate) sgid_index: u8,
    pub(crate) hop_limit: u8,
    pub(crate) traffic_class: u8,
    pub(crate) flow_label: u32,
}

/// The remote end's address (`ibv_ah_attr`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct AddressVector {
    pub(crate) dlid: u16,
    pub(crate) sl: u8,
    pub(crate) port: u8,
    pub(crate) grh: Option<Grh>,
}

/// One transition's attributes; `mask` names the ones `ibv_modify_qp` reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct QpAttrs {
    pub(crate) state: QpState,
    pub(crate) mask: u32,
    pub(crate) port: u8,
    pub(crate) pkey_index: u16,
    pub(crate) access: u32,
    pub(crate) path_mtu: u8,
    pub(crate) dest_qpn: u32,
    pub(crate) rq_psn: u32,
    pub(crate) sq_psn: u32,
    pub(crate) max_dest_rd_atomic: u8,
    pub(crate) max_rd_atomic: u8,
    pub(crate) min_rnr_timer: u8,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) av: Option<AddressVector>,
}

/// This rank's port, as its queue pairs use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LocalPort {
    pub(crate) port: u8,
    pub(crate) link_layer: LinkLayer,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    pub(crate) gid_index: u8,
    /// `enum ibv_mtu`.
    pub(crate) mtu: u8,
}

/// RESET → INIT: the port, partition key 0, and what the peer may do to this rank's memory
/// through this queue pair (write, and read for the flush).
pub(crate) fn to_init(port: u8) -> QpAttrs {
    QpAttrs {
        state: QpState::Init,
        mask: mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS,
        port,
        pkey_index: 0,
        access: access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ,
        ..QpAttrs::default()
    }
}

/// INIT → RTR: where the peer's queue pair `remote_qp` is, the path MTU both ports take, and
/// the first PSN to expect (the peer's).
pub(crate) fn to_rtr(local: &LocalPort, remote: &ConnInfo, remote_qp: QpEndpoint) -> Result<QpAttrs, String> {
    if local.link_layer != remote.link_layer {
        return Err(format!(
            "this rank's port is {:?} and rank {}'s is {:?}: they cannot connect",
            local.link_layer, remote.rank, remote.link_layer
        ));
    }
    let grh = match local.link_layer {
        LinkLayer::Ethernet => Some(Grh {
            dgid: remote.gid,
            sgid_index: local.gid_index,
            hop_limit: HOP_LIMIT,
            traffic_class: 0,
            flow_label: 0,
        }),
        LinkLayer::Infiniband => None,
    };
    let dlid = if grh.is_some() { 0 } else { remote.lid };
    Ok(QpAttrs {
        state: QpState::Rtr,
        mask: mask::STATE
            | mask::AV
            | mask::PATH_MTU
            | mask::DEST_QPN
            | mask::RQ_PSN
            | mask::MAX_DEST_RD_ATOMIC
            | mask::MIN_RNR_TIMER,
        path_mtu: local.mtu.min(remote.mtu),
        dest_qpn: remote_qp.qpn,
        rq_psn: remote_qp.psn,
        max_dest_rd_atomic: RD_ATOMIC,
        min_rnr_timer: MIN_RNR_TIMER,
        av: Some(AddressVector { dlid, sl: 0, port: local.port, grh }),
        ..QpAttrs::default()
    })
}

/// RTR → RTS: this end's first PSN, and how long and how often to retry.
pub(crate) fn to_rts(local_psn: u32) -> QpAttrs {
    QpAttrs {
        state: QpState::Rts,
        mask: mask::STATE | mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC,
        sq_psn: local_psn,
        timeout: TIMEOUT,
        retry_cnt: RETRY_CNT,
        rnr_retry: RNR_RETRY,
        max_rd_atomic: RD_ATOMIC,
        ..QpAttrs::default()
    }
}

// ---- device, port and GID ------------------------------------------------------------------------

/// `FERROLINK_IB_HCA`: comma-separated `device[:port]` entries (`mlx5_0:1,mlx5_1`); a rank
/// takes entry `lsa_rank % len` (one NIC per GPU of a node, listed in GPU order).
pub(crate) fn parse_hca_list(s: &str) -> Result<Vec<(String, Option<u8>)>, String> {
    let mut out = Vec::new();
    for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (name, port) = match entry.split_once(':') {
            Some((n, p)) => {
                let port: u8 = p.parse().map_err(|_| format!("FERROLINK_IB_HCA entry {entry:?}: bad port {p:?}"))?;
                if port == 0 {
                    return Err(format!("FERROLINK_IB_HCA entry {entry:?}: ports count from 1"));
                }
                (n, Some(port))
            }
            None => (entry, None),
        };
        if name.is_empty() {
            return Err(format!("FERROLINK_IB_HCA entry {entry:?} has no device name"));
        }
        out.push((name.to_string(), port));
    }
    if out.is_empty() {
        return Err(format!("FERROLINK_IB_HCA={s:?} names no device"));
    }
    Ok(out)
}

/// One GID table entry: its index, value, and whether it is RoCE v2 (sysfs `gid_attrs/types`;
/// `None` when unknown).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GidEntry {
    pub(crate) index: u32,
    pub(crate) gid: [u8; 16],
    pub(crate) roce_v2: Option<bool>,
}

fn ipv4_mapped(g: &[u8; 16]) -> bool {
    g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff
}

fn link_local(g: &[u8; 16]) -> bool {
    g[0] == 0xfe && g[1] & 0xc0 == 0x80
}

/// The GID index a port uses: `forced` (`FERROLINK_IB_GID_INDEX`) when given, 0 on
/// InfiniBand (where only the LID is used), and on RoCE the first RoCE v2 entry with an IPv4
/// address, else the first routable RoCE v2 entry, else the first non-zero one.
pub(crate) fn choose_gid(link: LinkLayer, entries: &[GidEntry], forced: Option<u32>) -> Result<u32, String> {
    let nonzero = |e: &&GidEntry| e.gid != [0; 16];
    if let Some(i) = forced {
        return match entries.iter().find(|e| e.index == i) {
            Some(e) if nonzero(&e) => Ok(i),
            _ => Err(format!("FERROLINK_IB_GID_INDEX={i}: the port has no GID at that index")),
        };
    }
    if link == LinkLayer::Infiniband {
        return Ok(0);
    }
    let v2 = |e: &&GidEntry| e.roce_v2 == Some(true);
    entries
        .iter()
        .filter(nonzero)
        .find(|e| v2(e) && ipv4_mapped(&e.gid))
        .or_else(|| entries.iter().filter(nonzero).find(|e| v2(e) && !link_local(&e.gid)))
        .or_else(|| entries.iter().find(nonzero))
        .map(|e| e.index)
        .ok_or_else(|| "the RoCE port has no GID (is its network interface up with an address?)".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gin::transport::RemoteLocation;

    const CODEC_RANKS: usize = 4;

    fn req(payload: Payload, signal: Option<(u32, u64)>) -> Request {
        Request { ring: 1, ticket: 0, context: 0, peer: 1, payload, signal }
    }

    fn keys(max_msg: u32) -> Keys {
        Keys {
            me: 2,
            src_lkey: Some(11),
            dst: Some(RemoteWindow { addr: 0x10_0000, len: 1 << 20, rkey: 22 }),
            max_msg,
            sink: (0x9000, 33),
        }
    }

    fn codec() -> ImmCodec {
        ImmCodec::new(CODEC_RANKS).unwrap()
    }

    fn at(offset: u64) -> RemoteLocation {
        RemoteLocation { window: 5, offset }
    }

    #[test]
    fn a_put_is_cut_into_writes_of_the_largest_message_then_its_signal() {
        let r = req(Payload::Put { src: 0x5000, src_window: 0, bytes: 2500, dst: at(100) }, Some((7, 1)));
        let wrs = plan_request(&r, &codec(), &keys(1000)).unwrap();
        let imm = codec().encode(Imm { kind: ImmKind::SignalOne, sender: 2, id: 7 }).unwrap();
        assert_eq!(
            wrs,
            vec![
                Wr::Write { local: 0x5000, lkey: 11, len: 1000, remote: 0x10_0000 + 100, rkey: 22 },
                Wr::Write { local: 0x5000 + 1000, lkey: 11, len: 1000, remote: 0x10_0000 + 1100, rkey: 22 },
                Wr::Write { local: 0x5000 + 2000, lkey: 11, len: 500, remote: 0x10_0000 + 2100, rkey: 22 },
                Wr::SignalOne { imm, remote: 0x9000, rkey: 33 },
            ]
        );
    }

    #[test]
    fn a_put_of_exactly_the_largest_message_is_one_write() {
        let r = req(Payload::Put { src: 0, src_window: 0, bytes: 4096, dst: at(0) }, None);
        assert_eq!(plan_request(&r, &codec(), &keys(4096)).unwrap().len(), 1);
        let r = req(Payload::Put { src: 0, src_window: 0, bytes: 4097, dst: at(0) }, None);
        assert_eq!(plan_request(&r, &codec(), &keys(4096)).unwrap().len(), 2);
    }

    #[test]
    fn an_add_carries_its_increment_and_a_value_is_written_inline() {
        let r = req(Payload::PutValue { value: 0x1122_3344_5566_7788, bytes: 4, dst: at(8) }, Some((3, 40)));
        let wrs = plan_request(&r, &codec(), &keys(1 << 30)).unwrap();
        let imm = codec().encode(Imm { kind: ImmKind::SignalAdd, sender: 2, id: 3 }).unwrap();
        assert_eq!(
            wrs,
            vec![
                Wr::WriteInline { bytes: 0x1122_3344_5566_7788u64.to_le_bytes(), len: 4, remote: 0x10_0008, rkey: 22 },
                Wr::SignalAdd { imm, inc: 40 },
            ]
        );
    }

    #[test]
    fn a_signal_alone_and_an_empty_put_need_no_data_write() {
        let r = req(Payload::None, Some((1, 1)));
        assert!(matches!(plan_request(&r, &codec(), &keys(64)).unwrap()[..], [Wr::SignalOne { .. }]));
        let r = req(Payload::Put { src: 0, src_window: 0, bytes: 0, dst: at(0) }, None);
        assert!(plan_request(&r, &codec(), &Keys { src_lkey: None, ..keys(64) }).unwrap().is_empty());
        assert!(plan_request(&req(Payload::None, None), &codec(), &keys(64)).unwrap().is_empty());
    }

    #[test]
    fn writes_past_the_window_or_without_keys_are_refused() {
        let r = req(Payload::Put { src: 0, src_window: 0, bytes: 16, dst: at((1 << 20) - 8) }, None);
        assert!(plan_request(&r, &codec(), &keys(64)).unwrap_err().contains("past the end"));
        let r = req(Payload::Put { src: 0, src_window: 0, bytes: 1, dst: at(u64::MAX) }, None);
        assert!(plan_request(&r, &codec(), &keys(64)).is_err());
        let r = req(Payload::Put { src: 0, src_window: 0, bytes: 16, dst: at(0) }, None);
        assert!(plan_request(&r, &codec(), &Keys { src_lkey: None, ..keys(64) }).is_err());
        assert!(plan_request(&r, &codec(), &Keys { dst: None, ..keys(64) }).is_err());
        let r = req(Payload::PutValue { value: 0, bytes: 3, dst: at(0) }, None);
        assert!(plan_request(&r, &codec(), &keys(64)).is_err());
        let r = req(Payload::None, Some((1 << 28, 1)));
        assert!(plan_request(&r, &codec(), &keys(64)).is_err(), "a signal id over the immediate data's room");
    }

    fn port(link: LinkLayer, mtu: u8) -> LocalPort {
        LocalPort { port: 1, link_layer: link, lid: 4, gid: [1; 16], gid_index: 3, mtu }
    }

    fn remote(link: LinkLayer, mtu: u8) -> ConnInfo {
        ConnInfo {
            rank: 1,
            link_layer: link,
            mtu,
            lid: 9,
            gid: [2; 16],
            sink_addr: 0,
            sink_rkey: 0,
            qps: vec![QpEndpoint { qpn: 0x77, psn: 0x1234 }],
        }
    }

    #[test]
    fn init_sets_the_port_and_the_remote_access_and_nothing_else() {
        let a = to_init(2);
        assert_eq!(a.state, QpState::Init);
        assert_eq!(a.mask, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS);
        assert_eq!((a.port, a.pkey_index), (2, 0));
        assert_eq!(a.access, access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ);
    }

    #[test]
    fn rtr_points_at_the_peer_queue_pair_with_the_smaller_mtu() {
        let r = remote(LinkLayer::Infiniband, 4);
        let a = to_rtr(&port(LinkLayer::Infiniband, 5), &r, r.qps[0]).unwrap();
        assert_eq!(a.state, QpState::Rtr);
        for m in [mask::AV, mask::PATH_MTU, mask::DEST_QPN, mask::RQ_PSN, mask::MAX_DEST_RD_ATOMIC, mask::MIN_RNR_TIMER]
        {
            assert!(a.mask & m != 0, "mask {m:#x}");
        }
        assert_eq!(a.mask & (mask::SQ_PSN | mask::TIMEOUT | mask::ACCESS_FLAGS), 0);
        assert_eq!((a.path_mtu, a.dest_qpn, a.rq_psn), (4, 0x77, 0x1234));
        assert_eq!(a.av, Some(AddressVector { dlid: 9, sl: 0, port: 1, grh: None }), "InfiniBand: by LID");
    }

    #[test]
    fn rtr_on_roce_routes_by_gid() {
        let r = remote(LinkLayer::Ethernet, 5);
        let a = to_rtr(&port(LinkLayer::Ethernet, 3), &r, r.qps[0]).unwrap();
        let av = a.av.unwrap();
        assert_eq!(av.dlid, 0);
        assert_eq!(
            av.grh,
            Some(Grh { dgid: [2; 16], sgid_index: 3, hop_limit: HOP_LIMIT, traffic_class: 0, flow_label: 0 })
        );
        assert_eq!(a.path_mtu, 3);
        assert!(to_rtr(&port(LinkLayer::Infiniband, 3), &r, r.qps[0]).is_err(), "IB cannot reach RoCE");
    }

    #[test]
    fn rts_sets_this_end_psn_and_the_retry_policy() {
        let a = to_rts(0xabcdef);
        assert_eq!(a.state, QpState::Rts);
        assert_eq!(
            a.mask,
            mask::STATE | mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC
        );
        assert_eq!((a.sq_psn, a.timeout, a.retry_cnt, a.rnr_retry), (0xabcdef, TIMEOUT, RETRY_CNT, RNR_RETRY));
        assert_eq!(a.av, None);
    }

    #[test]
    fn hca_lists_parse_and_reject_nonsense() {
        assert_eq!(
            parse_hca_list("mlx5_0:1, mlx5_1").unwrap(),
            vec![("mlx5_0".to_string(), Some(1)), ("mlx5_1".to_string(), None)]
        );
        assert!(parse_hca_list("").is_err());
        assert!(parse_hca_list("mlx5_0:0").is_err());
        assert!(parse_hca_list("mlx5_0:x").is_err());
        assert!(parse_hca_list(":1").is_err());
    }

    #[test]
    fn roce_prefers_a_v2_gid_with_an_ipv4_address() {
        let mut v4 = [0u8; 16];
        v4[10..].copy_from_slice(&[0xff, 0xff, 10, 1, 2, 3]);
        let mut ll = [0u8; 16];
        ll[..2].copy_from_slice(&[0xfe, 0x80]);
        ll[15] = 1;
        let entries = [
            GidEntry { index: 0, gid: ll, roce_v2: Some(false) },
            GidEntry { index: 1, gid: ll, roce_v2: Some(true) },
            GidEntry { index: 2, gid: v4, roce_v2: Some(false) },
            GidEntry { index: 3, gid: v4, roce_v2: Some(true) },
        ];
        assert_eq!(choose_gid(LinkLayer::Ethernet, &entries, None), Ok(3));
        assert_eq!(choose_gid(LinkLayer::Ethernet, &entries[..3], None), Ok(0), "no routable v2: the first GID");
        assert_eq!(choose_gid(LinkLayer::Ethernet, &entries, Some(2)), Ok(2));
        assert!(choose_gid(LinkLayer::Ethernet, &entries, Some(9)).is_err());
        assert_eq!(choose_gid(LinkLayer::Infiniband, &entries, None), Ok(0));
        assert!(choose_gid(LinkLayer::Ethernet, &[GidEntry { index: 0, gid: [0; 16], roce_v2: None }], None).is_err());
    }
}
