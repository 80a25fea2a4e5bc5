//! Which ranks can load and store each other's memory (the LSA domain).

use crate::runtime::device::Device;
use crate::{Backend, Result};

/// The size of the LSA domains of a single-process job whose rank `r` runs on `devices[r]`:
/// every rank when all pairs of distinct devices have peer access (always on one GPU or on
/// the emulator); else the ranks of one GPU when every GPU holds the same number of
/// consecutive ranks; else each rank alone. Peer access is asked once per pair of distinct
/// devices, so a thousand virtual ranks on one GPU cost one query.
pub(crate) fn lsa_domain_size(devices: &[Device]) -> Result<usize> {
    let n = devices.len();
    if devices.iter().all(|d| d.backend() == Backend::Cpu) {
        return Ok(n); // the emulator: all host memory is shared
    }
    let mut distinct: Vec<&Device> = Vec::new();
    for d in devices {
        if !distinct.iter().any(|x| x.same_as(d)) {
            distinct.push(d);
        }
    }
    let mut all_pairs = true;
    for a in &distinct {
        for b in &distinct {
            all_pairs &= a.backend_device().can_access_peer(&**b.backend_device())?;
        }
    }
    if all_pairs {
        return Ok(n);
    }
    // Ranks of one GPU only: consecutive and equally many per GPU.
    let per_gpu = devices.iter().take_while(|d| d.same_as(&devices[0])).count();
    let grouped = n.is_multiple_of(per_gpu) && devices.chunks(per_gpu).all(|c| c.iter().all(|d| d.same_as(&c[0])));
    Ok(if grouped { per_gpu } else { 1 })
}
