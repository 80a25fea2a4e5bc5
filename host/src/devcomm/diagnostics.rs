//! Turning what kernels leave in the control block into messages.

use ferrolink_device::DevErrorRecord;
use ferrolink_device::comm::error_code;

/// A fault record as a sentence that names the fix.
pub(crate) fn describe_fault(r: &DevErrorRecord) -> String {
    let at = format!("rank {} CTA {} thread {}", r.rank, r.cta, r.thread);
    let set = |v: u64| ((v >> 32) as u32, v as u32);
    match r.code {
        error_code::LSA_BARRIER_INDEX => {
            let (first, count) = set(r.b);
            format!(
                "{at}: LSA barrier index {} is outside its barrier set of {count} barriers (the communicator's \
                 barriers {first}..{}); give every CTA that synchronizes its own index below {count}: launch fewer \
                 CTAs, or raise DevCommRequirements::lsa_barrier_count (or the set's requested count)",
                r.a,
                first + count
            )
        }
        error_code::LSA_BARRIER_SET => {
            let (first, count) = set(r.a);
            format!(
                "{at}: the LSA barrier set {first}..{} is outside the communicator's {} barriers: the handle does \
                 not come from this device communicator",
                first + count,
                r.b
            )
        }
        code => format!("{at}: device fault code {code} (a = {:#x}, b = {:#x})", r.a, r.b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn barrier_index_faults_name_the_index_the_set_and_the_fix() {
        let r = DevErrorRecord { code: error_code::LSA_BARRIER_INDEX, rank: 2, cta: 40, thread: 0, a: 40, b: 32 };
        let s = describe_fault(&r);
        assert!(s.contains("rank 2 CTA 40"), "{s}");
        assert!(s.contains("index 40 is outside its barrier set of 32"), "{s}");
        assert!(s.contains("lsa_barrier_count"), "{s}");
    }
}
