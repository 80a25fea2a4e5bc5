//! Opening this rank's NIC: the library, the device (`FERROLINK_IB_HCA`, else the first with
//! an active port), its port and GID (`FERROLINK_IB_GID_INDEX`), and a protection domain.

use super::ffi::{self, Context, Lib, Pd, setup_error};
use super::plan::{self, GidEntry, LocalPort};
use super::wire::LinkLayer;
use crate::Result;
use std::sync::Arc;

/// The largest message planned, whatever the port allows (1 GiB: a put of more is cut).
const MAX_CHUNK: u32 = 1 << 30;
/// GID table entries looked at.
const MAX_GIDS: i32 = 256;

/// This rank's opened NIC.
pub(crate) struct Nic {
    pub(crate) pd: Arc<Pd>,
    pub(crate) ctx: Arc<Context>,
    pub(crate) port: LocalPort,
    /// The largest message a work request carries here.
    pub(crate) max_msg: u32,
}

/// Opens the NIC of the rank with index `lsa_rank` on its node.
pub(crate) fn open(lsa_rank: usize) -> Result<Nic> {
    let lib = Lib::open()?;
    open_with(&lib, lsa_rank, std::env::var("FERROLINK_IB_HCA").ok(), std::env::var("FERROLINK_IB_GID_INDEX").ok())
}

fn open_with(lib: &Arc<Lib>, lsa_rank: usize, hca: Option<String>, gid_index: Option<String>) -> Result<Nic> {
    let names = lib.device_names()?;
    if names.is_empty() {
        return Err(setup_error(format!(
            "no RDMA device ({} found none: is the NIC's kernel driver loaded, and its provider library \
             installed?)",
            ffi::LIBRARY
        )));
    }
    let forced_gid = match gid_index.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(s) => {
            Some(s.parse::<u32>().map_err(|_| setup_error(format!("FERROLINK_IB_GID_INDEX={s:?}: not a number")))?)
        }
    };
    let (ctx, port_num, attr) = match hca.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
        Some(list) => {
            let list = plan::parse_hca_list(list).map_err(setup_error)?;
            let (name, port) = list[lsa_rank % list.len()].clone();
            if !names.contains(&name) {
                return Err(setup_error(format!(
                    "FERROLINK_IB_HCA names {name:?}, but the RDMA devices are {names:?}"
                )));
            }
            let ctx = Context::open(lib, &name)?;
            let port = port.unwrap_or(1);
            let attr = ctx.query_port(port)?;
            if attr.state != ffi::IBV_PORT_ACTIVE {
                return Err(setup_error(format!("port {port} of {name} is not active (state {})", attr.state)));
            }
            (ctx, port, attr)
        }
        None => {
            // The first device whose port 1 is active. (Nearest to the GPU would be better:
            // until then, FERROLINK_IB_HCA lists one device per GPU.)
            let mut found = None;
            let mut seen = Vec::new();
            for name in &names {
                let ctx = Context::open(lib, name)?;
                match ctx.query_port(1) {
                    Ok(attr) if attr.state == ffi::IBV_PORT_ACTIVE => {
                        found = Some((ctx, 1, attr));
                        break;
                    }
                    Ok(attr) => seen.push(format!("{name}: port 1 state {}", attr.state)),
                    Err(e) => seen.push(format!("{name}: {e}")),
                }
            }
            found.ok_or_else(|| setup_error(format!("no RDMA device has an active port 1 ({})", seen.join("; "))))?
        }
    };
    let link_layer = LinkLayer::from_raw(attr.link_layer)
        .ok_or_else(|| setup_error(format!("{}: unknown link layer {}", ctx.name, attr.link_layer)))?;
    let mut gids = Vec::new();
    for index in 0..attr.gid_tbl_len.clamp(0, MAX_GIDS) as u32 {
        let Ok(gid) = ctx.query_gid(port_num, index) else { continue };
        let roce_v2 = std::fs::read_to_string(format!(
            "/sys/class/infiniband/{}/ports/{port_num}/gid_attrs/types/{index}",
            ctx.name
        ))
        .ok()
        .map(|t| t.trim().eq_ignore_ascii_case("RoCE v2"));
        gids.push(GidEntry { index, gid, roce_v2 });
    }
    let gid_index = plan::choose_gid(link_layer, &gids, forced_gid).map_err(setup_error)?;
    let gid = gids.iter().find(|g| g.index == gid_index).map(|g| g.gid).unwrap_or([0; 16]);
    let mtu = u8::try_from(attr.active_mtu).ok().filter(|m| (1..=5).contains(m)).unwrap_or(3);
    let pd = Pd::new(&ctx)?;
    tracing::info!(
        target: "ferrolink::gin",
        device = %ctx.name, port = port_num, ?link_layer, lid = attr.lid, gid_index, mtu,
        "GIN verbs transport: NIC opened"
    );
    Ok(Nic {
        pd,
        max_msg: attr.max_msg_sz.clamp(1, MAX_CHUNK),
        port: LocalPort {
            port: port_num,
            link_layer,
            lid: attr.lid,
            gid,
            gid_index: u8::try_from(gid_index).map_err(|_| setup_error(format!("GID index {gid_index}")))?,
            mtu,
        },
        ctx,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opening the NIC here (no libibverbs, or no device) fails with a message that says
    /// which; on a machine with an RDMA device it succeeds.
    #[test]
    fn opening_without_a_nic_says_what_is_missing() {
        match open(0) {
            Ok(nic) => println!("an RDMA device is present: {}", nic.ctx.name),
            Err(e) => {
                let text = e.to_string();
                assert!(text.contains("FERROLINK_GIN_TRANSPORT=verbs"), "{text}");
                assert!(text.contains("libibverbs.so.1 not found") || text.contains("no RDMA device"), "{text}");
            }
        }
    }
}
