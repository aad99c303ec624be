//! Where things are in guest physical memory. The "sys" region (anonymous memory, created by the
//! VM itself) holds the payload, the page tables and one control block plus stack per vCPU; guest
//! RAM regions go anywhere above it. Everything is identity-mapped (GVA = GPA) with 2 MiB pages.
//! The addresses the payload itself relies on are defined once, in build.rs's table.

use crate::payload;

/// The sys region: [SYS_GPA, SYS_GPA + SYS_SIZE). Starts at 1 MiB, clear of legacy PC areas, so
/// that other VMMs can load the same image at the same address.
pub const SYS_GPA: u64 = payload::SYS_GPA;
/// The sys region's bytes.
pub const SYS_SIZE: u64 = payload::SYS_SIZE;
/// The payload image is loaded here; its entry point is its first byte.
pub const PAYLOAD_GPA: u64 = payload::PAYLOAD_GPA;
/// The most bytes the payload image may take.
pub const PAYLOAD_MAX: u64 = 0x1_0000;
/// Page-table root (PML4) and the one PDPT (512 GiB of address space).
pub const PML4_GPA: u64 = payload::PML4_GPA;
/// The PDPT.
pub const PDPT_GPA: u64 = payload::PDPT_GPA;
/// Page directories, one per GiB mapped: [PD_GPA, PD_GPA + 512 * 4 KiB).
pub const PD_GPA: u64 = payload::PD_GPA;
/// Per-vCPU blocks: a control page then a stack page.
pub const VCPU_BLOCKS_GPA: u64 = payload::VCPU_BLOCKS_GPA;
/// Bytes of one vCPU's block.
pub const VCPU_BLOCK_SIZE: u64 = payload::VCPU_BLOCK_SIZE;
/// Highest guest address the identity map can cover.
pub const MAX_GUEST_ADDR: u64 = 512 << 30;
/// Where the CLI places guest RAM by default.
pub const RAM_GPA: u64 = payload::RAM_GPA;

/// The most vCPUs whose blocks fit in the sys region.
pub const MAX_VCPUS: usize = ((SYS_GPA + SYS_SIZE - VCPU_BLOCKS_GPA) / VCPU_BLOCK_SIZE) as usize;

/// The control block of vCPU `i`.
pub fn control_gpa(vcpu: usize) -> u64 {
    VCPU_BLOCKS_GPA + vcpu as u64 * VCPU_BLOCK_SIZE
}

/// The initial stack pointer of vCPU `i` (top of its stack page).
pub fn stack_top(vcpu: usize) -> u64 {
    control_gpa(vcpu) + VCPU_BLOCK_SIZE
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every vCPU's control block and stack lie inside the sys region, one after another,
    /// above the page tables; guest RAM starts above the sys region.
    #[test]
    fn vcpu_blocks_fit_the_sys_region() {
        const {
            assert!(MAX_VCPUS >= 1);
            assert!(PD_GPA + (MAX_GUEST_ADDR >> 30) * 0x1000 <= VCPU_BLOCKS_GPA);
            assert!(PAYLOAD_GPA + PAYLOAD_MAX <= PML4_GPA);
            assert!(RAM_GPA >= SYS_GPA + SYS_SIZE);
        }
        assert_eq!(control_gpa(0), VCPU_BLOCKS_GPA);
        assert_eq!(stack_top(0), control_gpa(1));
        assert!(stack_top(MAX_VCPUS - 1) <= SYS_GPA + SYS_SIZE);
        assert!(stack_top(MAX_VCPUS) > SYS_GPA + SYS_SIZE);
    }
}
