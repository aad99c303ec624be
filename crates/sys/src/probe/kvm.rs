//! Item 1: KVM's capabilities, asked of a throw-away VM.

use kvm_ioctls::{Kvm, VmFd};
use libc::c_ulong;

use super::util::{errno_name, last_errno};
use super::{BitFlags, CapAnswer, KvmCaps};
use crate::uapi::{self};

/// Opens `/dev/kvm` and creates a throw-away VM to ask VM-scoped capabilities on.
pub(super) fn throwaway_vm() -> Result<(Kvm, VmFd), String> {
    let kvm =
        Kvm::new().map_err(|e| format!("/dev/kvm does not open: {}", errno_name(e.errno())))?;
    let vm = kvm
        .create_vm()
        .map_err(|e| format!("KVM_CREATE_VM failed: {}", errno_name(e.errno())))?;
    Ok((kvm, vm))
}

pub(super) const GUEST_MEMFD_FLAG_NAMES: &[(u64, &str)] = &[
    (uapi::GUEST_MEMFD_FLAG_MMAP, "MMAP"),
    (uapi::GUEST_MEMFD_FLAG_INIT_SHARED, "INIT_SHARED"),
    (uapi::GUEST_MEMFD_FLAG_WRITE_CANDIDATE, "WRITE"),
];

pub(super) const MANUAL_DIRTY_LOG_NAMES: &[(u64, &str)] = &[
    (
        uapi::KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE as u64,
        "MANUAL_PROTECT_ENABLE",
    ),
    (uapi::KVM_DIRTY_LOG_INITIALLY_SET as u64, "INITIALLY_SET"),
];

/// Asks every KVM capability [`KvmCaps`] holds, on the VM fd `vm`.
pub fn kvm_caps(kvm: &Kvm, vm: &VmFd) -> KvmCaps {
    let unknown_caps_answering = (245u32..=260)
        .filter_map(|nr| {
            let answer = i64::from(vm.check_extension_raw(c_ulong::from(nr)));
            (answer != 0).then_some(CapAnswer { cap: nr, answer })
        })
        .collect();
    KvmCaps {
        api_version: kvm.get_api_version(),
        nr_memslots: cap(vm, uapi::KVM_CAP_NR_MEMSLOTS),
        user_memory2: cap(vm, uapi::KVM_CAP_USER_MEMORY2),
        guest_memfd: cap(vm, uapi::KVM_CAP_GUEST_MEMFD),
        guest_memfd_flags: cap(vm, uapi::KVM_CAP_GUEST_MEMFD_FLAGS)
            .map(|v| BitFlags::decode(v, GUEST_MEMFD_FLAG_NAMES)),
        manual_dirty_log_protect2: cap(vm, uapi::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2)
            .map(|v| BitFlags::decode(v, MANUAL_DIRTY_LOG_NAMES)),
        dirty_log_ring_max_bytes: cap(vm, uapi::KVM_CAP_DIRTY_LOG_RING),
        dirty_log_ring_acq_rel_max_bytes: cap(vm, uapi::KVM_CAP_DIRTY_LOG_RING_ACQ_REL),
        pre_fault_memory: cap(vm, uapi::KVM_CAP_PRE_FAULT_MEMORY),
        unknown_caps_answering,
    }
}

/// `KVM_CHECK_EXTENSION(nr)` on the VM fd; `Err` only if the ioctl itself failed.
pub(super) fn cap(vm: &VmFd, nr: u32) -> Result<u64, String> {
    let answer = vm.check_extension_raw(c_ulong::from(nr));
    if answer < 0 {
        Err(format!(
            "KVM_CHECK_EXTENSION({nr}) failed: {}",
            errno_name(last_errno())
        ))
    } else {
        Ok(answer as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A capability's answer is read as is (0: absent); the caps' flags are decoded by name.
    #[test]
    fn capabilities_are_read_and_decoded() {
        let (kvm, vm) = throwaway_vm().unwrap();
        assert!(cap(&vm, uapi::KVM_CAP_NR_MEMSLOTS).unwrap() >= 32);
        assert_eq!(cap(&vm, 100_000), Ok(0), "an unknown capability is absent");
        let caps = kvm_caps(&kvm, &vm);
        assert_eq!(caps.api_version, 12);
        let manual = caps.manual_dirty_log_protect2.unwrap();
        assert_eq!(manual.raw & !3, 0, "{manual:?}");
        assert_eq!(manual.has("MANUAL_PROTECT_ENABLE"), manual.raw & 1 != 0);
    }
}
