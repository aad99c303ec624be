/// What the VM's operations return.
pub type Result<T> = std::result::Result<T, Error>;

/// Why a VM operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// /dev/kvm cannot be opened.
    #[error("cannot open /dev/kvm")]
    Kvm(#[source] kvm_ioctls::Error),
    /// A KVM ioctl failed.
    #[error("{op} failed")]
    Ioctl {
        /// The operation that failed.
        op: &'static str,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory failed.
    #[error(transparent)]
    Memory(#[from] guestmem_memory::Error),
    /// A VM configuration that cannot be built.
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// A vCPU exited for a reason the payload never gives.
    #[error("vCPU {vcpu} stopped unexpectedly: exit {exit} at RIP {rip:#x}")]
    UnexpectedExit {
        /// The vCPU.
        vcpu: usize,
        /// The exit.
        exit: String,
        /// Its instruction pointer.
        rip: u64,
    },
    /// A vCPU made no progress for the stall timeout.
    #[error("vCPU {vcpu} made no progress for {secs:.1} s (RIP {rip:#x}, {pages} pages done); the run was stopped")]
    Stalled {
        /// The vCPU.
        vcpu: usize,
        /// Seconds without progress.
        secs: f64,
        /// Its instruction pointer.
        rip: u64,
        /// Pages it had done.
        pages: u64,
    },
    /// The payload did not recognise a workload.
    #[error(
        "vCPU {vcpu}: the payload did not recognise its workload (control block state {state})"
    )]
    BadWorkload {
        /// The vCPU.
        vcpu: usize,
        /// The control block's state.
        state: u64,
    },
    /// The run was stopped by an [`crate::AbortHandle`].
    #[error("the run was stopped: {0}")]
    Aborted(String),
    /// A vCPU thread could not start, or panicked.
    #[error("vCPU {vcpu} thread: {reason}")]
    Thread {
        /// The vCPU.
        vcpu: usize,
        /// Why.
        reason: String,
    },
}

impl Error {
    pub(crate) fn ioctl(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
        move |source| Error::Ioctl { op, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ioctl's error names the ioctl and keeps the kernel's error as its source; a stall
    /// names the vCPU, its progress and where it was.
    #[test]
    fn errors_name_what_failed() {
        let e = Error::ioctl("KVM_SET_REGS")(kvm_ioctls::Error::new(libc::EINVAL));
        assert_eq!(e.to_string(), "KVM_SET_REGS failed");
        let source = std::error::Error::source(&e)
            .expect("the cause")
            .to_string();
        assert!(source.contains("os error 22"), "{source}");
        let e = Error::Stalled {
            vcpu: 1,
            secs: 2.26,
            rip: 0x10_0040,
            pages: 7,
        };
        assert_eq!(
            e.to_string(),
            "vCPU 1 made no progress for 2.3 s (RIP 0x100040, 7 pages done); the run was stopped"
        );
    }
}
