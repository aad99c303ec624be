//! Item 3: KVM Userfault, found by trying it on a memslot.

use kvm_ioctls::VmFd;
use libc::c_void;
use vmm_sys_util::ioctl::ioctl_with_ref;

use super::gmem_write::PAGE_4K;
use super::util::{errno_name, last_errno};
use super::KvmUserfault;
use crate::uapi::{self, kvm_userspace_memory_region2};

pub(super) const SLOT_SIZE_BYTES: usize = 2 << 20;

/// Tries a memslot with `KVM_MEM_USERFAULT` (candidate bit 3) and a userfault bitmap on `vm`,
/// after checking that the same memslot with flags 0 is accepted.
pub fn kvm_userfault(vm: &VmFd) -> Result<KvmUserfault, String> {
    let map = AnonMap::new(SLOT_SIZE_BYTES)
        .map_err(|e| format!("mmap of {SLOT_SIZE_BYTES} bytes failed: {}", errno_name(e)))?;
    // One bit per 4 KiB page of the slot, all clear (no page is a userfault yet).
    let bitmap = vec![0u64; SLOT_SIZE_BYTES / PAGE_4K / 64];
    let result = try_userfault_slots(vm, &map, &bitmap);
    match &result {
        // Every slot added was deleted again: the memory may go.
        Ok(_) => drop((bitmap, map)),
        // A slot may still point at the memory: leak it (2 MiB, never in practice) rather than
        // leave KVM a stale address.
        Err(_) => std::mem::forget((bitmap, map)),
    }
    result
}

pub(super) fn try_userfault_slots(
    vm: &VmFd,
    map: &AnonMap,
    bitmap: &[u64],
) -> Result<KvmUserfault, String> {
    let flag = uapi::KVM_MEM_USERFAULT_CANDIDATE;
    let mut region = kvm_userspace_memory_region2 {
        slot: 0,
        flags: 0,
        guest_phys_addr: 0,
        memory_size: SLOT_SIZE_BYTES as u64,
        userspace_addr: map.addr as u64,
        ..Default::default()
    };
    set_region2(vm, &region).map_err(|e| {
        format!(
            "KVM_SET_USER_MEMORY_REGION2 with flags 0 failed: {}",
            errno_name(e)
        )
    })?;
    delete_slot(vm, &mut region)?;

    // Layout of `struct kvm_userspace_memory_region2` (160 bytes): slot u32 @0, flags u32 @4,
    // guest_phys_addr @8, memory_size @16, userspace_addr @24, guest_memfd_offset @32,
    // guest_memfd u32 @40, pad1 u32 @44, pad2 [u64; 14] @48. The KVM Userfault series adds
    // `__u64 userfault_bitmap` right after guest_memfd + pad1, i.e. at offset 48 = `pad2[0]`
    // (`pad1` is only a u32 here, so it cannot hold the pointer).
    const _: () = assert!(std::mem::offset_of!(kvm_userspace_memory_region2, pad2) == 48);
    region.flags = flag;
    region.memory_size = SLOT_SIZE_BYTES as u64;
    region.pad2[0] = bitmap.as_ptr() as u64;
    let errno = match set_region2(vm, &region) {
        Ok(()) => {
            delete_slot(vm, &mut region)?;
            return Ok(KvmUserfault {
                present: true,
                detail: format!("memslot with flags {flag:#x} and a userfault bitmap accepted"),
            });
        }
        Err(errno) => errno,
    };
    // Was it the flag or the pointer in the padding? Try the pointer alone.
    region.flags = 0;
    region.memory_size = SLOT_SIZE_BYTES as u64;
    let padding = match set_region2(vm, &region) {
        Ok(()) => {
            delete_slot(vm, &mut region)?;
            "a bitmap pointer alone is accepted".to_string()
        }
        Err(e) => format!("a bitmap pointer alone gives {}", errno_name(e)),
    };
    let why = if errno == libc::EINVAL {
        ""
    } else {
        "unexpected; "
    };
    Ok(KvmUserfault {
        present: false,
        detail: format!(
            "memslot flags {flag:#x} refused with {} ({why}flags 0 accepted, {padding})",
            errno_name(errno)
        ),
    })
}

pub(super) fn delete_slot(
    vm: &VmFd,
    region: &mut kvm_userspace_memory_region2,
) -> Result<(), String> {
    region.memory_size = 0;
    set_region2(vm, region)
        .map_err(|e| format!("deleting memslot {} failed: {}", region.slot, errno_name(e)))
}

pub(super) fn set_region2(vm: &VmFd, region: &kvm_userspace_memory_region2) -> Result<(), i32> {
    // SAFETY: `region` is a valid `kvm_userspace_memory_region2` the kernel only reads. The
    // memory it names (`userspace_addr`, and a bitmap pointer in `pad2[0]` if any) is owned by
    // the caller and outlives the memslot, which the caller deletes before freeing it; no vCPU
    // ever runs in this VM, so the guest never touches that memory.
    let ret = unsafe { ioctl_with_ref(vm, uapi::KVM_SET_USER_MEMORY_REGION2(), region) };
    if ret < 0 {
        Err(last_errno())
    } else {
        Ok(())
    }
}

/// An anonymous private mapping, unmapped on drop.
pub(super) struct AnonMap {
    addr: *mut c_void,
    len: usize,
}

impl AnonMap {
    fn new(len: usize) -> Result<Self, i32> {
        // SAFETY: a fresh anonymous mapping at an address the kernel chooses; it aliases
        // nothing in this process.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            Err(last_errno())
        } else {
            Ok(AnonMap { addr, len })
        }
    }
}

impl Drop for AnonMap {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are exactly the mapping made in `new`, and no reference into it
        // escapes this type.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}
