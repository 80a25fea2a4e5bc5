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
        error_code::GIN_ABSENT => format!(
            "{at}: a kernel used GIN on a device communicator created without GIN resources: set gin_signal_count \
             (or another gin_* count) in DevCommRequirements"
        ),
        error_code::GIN_SIGNAL_ID => format!(
            "{at}: GIN signal id {} is out of range: the device communicator has {} signals; raise \
             DevCommRequirements::gin_signal_count",
            r.a, r.b
        ),
        error_code::GIN_COUNTER_ID => format!(
            "{at}: GIN counter id {} is out of range: the device communicator has {} counters; raise \
             DevCommRequirements::gin_counter_count",
            r.a, r.b
        ),
        error_code::GIN_PEER => {
            format!("{at}: GIN peer {} is outside its team of {} ranks", r.a, r.b)
        }
        error_code::GIN_RANGE => {
            let (window, size) = (r.b >> 48, r.b & ((1 << 48) - 1));
            if r.b < 16 {
                format!(
                    "{at}: a GIN put_value of {} bytes at offset {}: use 1, 2, 4 or 8 bytes, naturally aligned",
                    r.b, r.a
                )
            } else {
                format!("{at}: a GIN transfer at offset {} runs past the end of window {window} ({size} bytes)", r.a)
            }
        }
        error_code::GIN_BARRIER_INDEX => format!(
            "{at}: GIN barrier index {} is out of range: the device communicator has {} GIN barriers; raise \
             DevCommRequirements::gin_barrier_count",
            r.a, r.b
        ),
        error_code::COLL_ARGS => format!(
            "{at}: collective arguments the kernel does not know: kind {}, algorithm {}, type {}, op {} \
             (or a root outside the LSA domain); use the host API (Communicator::collective), which checks them",
            r.a >> 32,
            r.a & 0xffff_ffff,
            r.b >> 32,
            r.b & 0xffff_ffff
        ),
        error_code::P2P_ARGS => format!(
            "{at}: point-to-point arguments the kernel cannot use (a = {:#x}, b = {:#x}); use the host API \
             (Communicator::group, send, recv), which builds them",
            r.a, r.b
        ),
        error_code::MOE_ARGS if r.a >> 32 == 0 => format!(
            "{at}: MoE routing names expert {} at entry {} of topk_idx (row-major [tokens, top_k]); every \
             entry must be -1 (none) or an expert below num_experts",
            r.b as i32, r.a
        ),
        error_code::MOE_ARGS => format!(
            "{at}: MoE arguments the kernels cannot use (experts {}, hidden {}, chunk {}, grid {}); use the host \
             API (Communicator::moe), which checks them",
            r.a >> 32,
            r.a & 0xffff_ffff,
            r.b >> 32,
            r.b & 0xffff_ffff
        ),
        error_code::MOE_FUSED_PATH => format!(
            "{at}: the fused MoE combine's finish needs return rows of {} bytes for results from ranks not reached \
             directly, and was given {} bytes; use Moe::finish_fused, which passes them",
            r.a, r.b
        ),
        error_code::MOE_CAPACITY => format!(
            "{at}: low-latency MoE: more than max_tokens ({}) entries of this rank to expert {} in one call; each \
             token must name distinct experts (or raise max_tokens)",
            r.b, r.a
        ),
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

    #[test]
    fn gin_faults_name_the_id_the_limit_and_the_requirement() {
        let r = DevErrorRecord { code: error_code::GIN_SIGNAL_ID, rank: 1, cta: 0, thread: 0, a: 9, b: 4 };
        let s = describe_fault(&r);
        assert!(s.contains("signal id 9 is out of range") && s.contains("has 4 signals"), "{s}");
        assert!(s.contains("gin_signal_count"), "{s}");
        let r =
            DevErrorRecord { code: error_code::GIN_RANGE, rank: 1, cta: 0, thread: 0, a: 4096, b: (3 << 48) | 4096 };
        let s = describe_fault(&r);
        assert!(s.contains("offset 4096") && s.contains("window 3 (4096 bytes)"), "{s}");
        let r = DevErrorRecord { code: error_code::GIN_RANGE, rank: 1, cta: 0, thread: 0, a: 3, b: 4 };
        assert!(describe_fault(&r).contains("put_value of 4 bytes at offset 3"));
    }

    #[test]
    fn fused_moe_path_faults_name_the_return_rows() {
        let r = DevErrorRecord { code: error_code::MOE_FUSED_PATH, rank: 0, cta: 0, thread: 0, a: 4096, b: 0 };
        let s = describe_fault(&r);
        assert!(s.contains("return rows of 4096 bytes") && s.contains("given 0 bytes"), "{s}");
    }
}
