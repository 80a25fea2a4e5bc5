//! The device communicator and teams: `#[repr(C)]` values the host creates and passes to
//! kernels by value (defined once, here, and used by the host crate).

use crate::arch::Scope;
use crate::window::DevWindow;
use bytemuck::{Pod, Zeroable};

/// A set of ranks `{rank, size, stride}` (NCCL's `ncclTeam`): team rank `r` is world rank
/// `world_rank + (r - rank) * stride` of the calling rank. World and LSA teams have stride 1;
/// the rail team (same LSA rank on every LSA domain) has stride `lsa_size`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Team {
    /// This rank's index in the team.
    pub rank: u32,
    /// Ranks in the team.
    pub size: u32,
    /// World-rank distance between consecutive team ranks.
    pub stride: u32,
}

/// What a kernel knows about its communicator (NCCL's `ncclDevComm`): who it is, its LSA
/// domain, the registered windows and the barrier resources. Created on the host by
/// `ferrolink::DevCommHandle` and passed to kernels by value; valid while that handle lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DevComm {
    /// World rank.
    pub rank: u32,
    /// World size.
    pub nranks: u32,
    /// Rank within the LSA domain (ranks that can load/store each other's memory).
    pub lsa_rank: u32,
    /// Ranks in the LSA domain.
    pub lsa_size: u32,
    /// Scope at which LSA peers synchronize, as a [`Scope::code`]: `.gpu` when every
    /// LSA peer runs on this GPU (virtual ranks), `.sys` when peers are on other GPUs.
    pub lsa_scope_code: u32,
    /// Barrier indices available to [`crate::barrier::LsaBarrierSession`] (one per CTA).
    pub lsa_barrier_count: u32,
    /// The symmetric window holding the barrier inboxes.
    pub barrier_window: DevWindow,
    /// Device address of this rank's `lsa_barrier_count` epoch words (local memory).
    pub barrier_epochs: u64,
    /// Device address of the window table (`window_capacity` [`DevWindow`]s).
    pub windows: u64,
    /// Windows registered in the table.
    pub window_count: u32,
    /// Padding (keeps the layout explicit).
    pub _reserved: u32,
}

impl DevComm {
    /// The world team: all ranks.
    #[inline(always)]
    pub fn world(&self) -> Team {
        Team { rank: self.rank, size: self.nranks, stride: 1 }
    }

    /// The LSA team: the ranks whose windows this rank can load from and store to.
    #[inline(always)]
    pub fn lsa(&self) -> Team {
        Team { rank: self.lsa_rank, size: self.lsa_size, stride: 1 }
    }

    /// The rail team: the ranks with this rank's LSA rank in every LSA domain.
    #[inline(always)]
    pub fn rail(&self) -> Team {
        Team { rank: self.rank / self.lsa_size, size: self.nranks / self.lsa_size, stride: self.lsa_size }
    }

    /// The scope LSA synchronization uses (see [`DevComm::lsa_scope_code`]).
    #[inline(always)]
    pub fn lsa_scope(&self) -> Scope {
        Scope::from_code(self.lsa_scope_code)
    }

    /// World rank of team rank `r` of `team` (which must contain this rank).
    #[inline(always)]
    pub fn team_rank_to_world(&self, team: Team, r: u32) -> u32 {
        (self.rank as i64 + (r as i64 - team.rank as i64) * team.stride as i64) as u32
    }

    /// Team rank of world rank `world` in `team`, or `None` if it is not a member.
    #[inline(always)]
    pub fn world_rank_to_team(&self, team: Team, world: u32) -> Option<u32> {
        let first = self.rank as i64 - team.rank as i64 * team.stride as i64;
        let d = world as i64 - first;
        if d < 0 || d % team.stride as i64 != 0 || d / team.stride as i64 >= team.size as i64 {
            None
        } else {
            Some((d / team.stride as i64) as u32)
        }
    }

    /// Registered window `i` of the window table, or `None` past the registered count.
    ///
    /// # Safety
    /// The `DevCommHandle` this value came from must still be alive.
    #[inline(always)]
    pub unsafe fn window(&self, i: u32) -> Option<DevWindow> {
        if i >= self.window_count {
            return None;
        }
        // SAFETY: the table holds `window_count` initialized entries (caller: handle alive).
        Some(unsafe { (self.windows as *const DevWindow).add(i as usize).read() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comm(rank: u32, nranks: u32, lsa_size: u32) -> DevComm {
        DevComm { rank, nranks, lsa_rank: rank % lsa_size, lsa_size, ..DevComm::default() }
    }

    #[test]
    fn teams_translate_ranks_both_ways() {
        // 8 ranks in 2 LSA domains of 4: rank 6 is LSA rank 2 of the second domain.
        let c = comm(6, 8, 4);
        assert_eq!(c.lsa(), Team { rank: 2, size: 4, stride: 1 });
        assert_eq!(c.rail(), Team { rank: 1, size: 2, stride: 4 });
        assert_eq!(c.team_rank_to_world(c.lsa(), 0), 4);
        assert_eq!(c.team_rank_to_world(c.rail(), 0), 2);
        assert_eq!(c.world_rank_to_team(c.lsa(), 5), Some(1));
        assert_eq!(c.world_rank_to_team(c.lsa(), 3), None);
        assert_eq!(c.world_rank_to_team(c.rail(), 2), Some(0));
        assert_eq!(c.world_rank_to_team(c.rail(), 3), None);
        assert_eq!(c.world_rank_to_team(c.world(), 7), Some(7));
        for r in 0..4 {
            assert_eq!(c.world_rank_to_team(c.lsa(), c.team_rank_to_world(c.lsa(), r)), Some(r));
        }
    }

    #[test]
    fn dev_comm_layout_is_stable() {
        // Host and device share this layout; a change must be deliberate.
        assert_eq!(core::mem::size_of::<DevComm>(), 24 + core::mem::size_of::<DevWindow>() + 24);
        assert_eq!(core::mem::align_of::<DevComm>(), 8);
    }
}
