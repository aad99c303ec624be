pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open /dev/kvm: {0}")]
    Kvm(#[source] kvm_ioctls::Error),
    #[error("{op} failed: {source}")]
    Ioctl {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error(transparent)]
    Memory(#[from] guestmem_memory::Error),
    #[error("invalid VM configuration: {0}")]
    Config(String),
    #[error("vCPU {vcpu} stopped unexpectedly: exit {exit} at RIP {rip:#x}")]
    UnexpectedExit { vcpu: usize, exit: String, rip: u64 },
    #[error("vCPU {vcpu} made no progress for {secs:.1} s (RIP {rip:#x}, {pages} pages done); the run was stopped")]
    Stalled {
        vcpu: usize,
        secs: f64,
        rip: u64,
        pages: u64,
    },
    #[error(
        "vCPU {vcpu}: the payload did not recognise its workload (control block state {state})"
    )]
    BadWorkload { vcpu: usize, state: u64 },
    #[error("the run was stopped: {0}")]
    Aborted(String),
    #[error("vCPU {vcpu} thread: {reason}")]
    Thread { vcpu: usize, reason: String },
}

impl Error {
    pub(crate) fn ioctl(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
        move |source| Error::Ioctl { op, source }
    }
}
