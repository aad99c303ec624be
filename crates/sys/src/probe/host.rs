//! Item 7: the host (kernel release, page size, memory, kernel TLS).

use std::ffi::CStr;

use libc::c_int;

use super::util::{errno_name, last_errno};
use super::Host;

/// Kernel release, page size, online CPUs and kernel TLS.
pub fn host() -> Host {
    Host {
        kernel_release: kernel_release(),
        page_size_bytes: sysconf(libc::_SC_PAGESIZE, "_SC_PAGESIZE"),
        online_cpus: sysconf(libc::_SC_NPROCESSORS_ONLN, "_SC_NPROCESSORS_ONLN"),
        kernel_tls: kernel_tls(),
    }
}

/// Whether this kernel takes TLS on a TCP socket (`setsockopt(TCP_ULP, "tls")` on a loopback
/// connection, which loads the `tls` module where it must) with AES-GCM done by the CPU's AES
/// instructions ([`accelerated_aes_gcm`]), or why not: migration connections hand their records
/// to it after the handshake where it does. Without the second, the kernel's AES-GCM is its
/// generic C code, many times slower than rustls's.
pub fn kernel_tls() -> Result<(), String> {
    tcp_ulp_tls()?;
    let crypto = std::fs::read_to_string("/proc/crypto")
        .map_err(|e| format!("reading /proc/crypto: {e}"))?;
    accelerated_aes_gcm(&crypto)
}

/// Whether `/proc/crypto` (its text: blocks of `key : value` lines) lists an AES-GCM AEAD of
/// the CPU's instructions (such as aesni_intel's `generic-gcm-aesni` or `generic-gcm-vaes-avx2`),
/// not the generic template (`gcm_base(ctr(aes-generic),ghash-generic)`) or an internal helper.
fn accelerated_aes_gcm(crypto: &str) -> Result<(), String> {
    let found = crypto.split("\n\n").any(|block| {
        let field = |key: &str| {
            block.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == key).then(|| v.trim())
            })
        };
        field("name") == Some("gcm(aes)")
            && field("type") == Some("aead")
            && field("internal") != Some("yes")
            && field("driver").is_some_and(|d| !d.starts_with("gcm_base("))
    });
    if found {
        Ok(())
    } else {
        Err(
            "the kernel's AES-GCM is not accelerated (no gcm(aes) of the CPU's AES \
             instructions in /proc/crypto: is aesni_intel loaded?)"
                .into(),
        )
    }
}

/// Whether a TCP socket takes the kernel's TLS as its upper layer, and TLS 1.3 AES-128-GCM keys
/// for both directions (a throw-away key on a loopback connection): what a migration
/// connection's move into the kernel asks, so that a kernel refusing any of it keeps rustls.
fn tcp_ulp_tls() -> Result<(), String> {
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("listen: {e}"))?;
    let addr = listener.local_addr().map_err(|e| format!("listen: {e}"))?;
    let client = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    let _server = listener.accept().map_err(|e| format!("accept: {e}"))?;
    let fd = client.as_fd();
    set_opt(fd, libc::SOL_TCP, libc::TCP_ULP, b"tls", "TCP_ULP \"tls\"")?;
    // SAFETY: the uapi struct is plain old data: all zeroes is a valid value.
    let mut info: libc::tls12_crypto_info_aes_gcm_128 = unsafe { std::mem::zeroed() };
    info.info.version = libc::TLS_1_3_VERSION;
    info.info.cipher_type = libc::TLS_CIPHER_AES_GCM_128;
    set_opt(
        fd,
        libc::SOL_TLS,
        libc::TLS_TX,
        &info,
        "TLS_TX (TLS 1.3, AES-128-GCM)",
    )?;
    set_opt(
        fd,
        libc::SOL_TLS,
        libc::TLS_RX,
        &info,
        "TLS_RX (TLS 1.3, AES-128-GCM)",
    )
}

/// [`crate::setsockopt`], or an error naming `what` and the errno.
fn set_opt<T: ?Sized>(
    fd: std::os::fd::BorrowedFd<'_>,
    level: c_int,
    name: c_int,
    v: &T,
    what: &str,
) -> Result<(), String> {
    crate::setsockopt(fd, level, name, v).map_err(|e| {
        format!(
            "setsockopt {what}: {}",
            errno_name(e.raw_os_error().unwrap_or(0))
        )
    })
}

pub(super) fn kernel_release() -> Result<String, String> {
    // SAFETY: `utsname` is plain old data (arrays of c_char); all-zero is a valid value.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a valid, writable `utsname` that lives across the call.
    if unsafe { libc::uname(&raw mut uts) } != 0 {
        return Err(format!("uname: {}", errno_name(last_errno())));
    }
    // SAFETY: on success the kernel filled `release` with a NUL-terminated string that fits in
    // the array (and the array was zeroed, so a NUL is there in any case).
    let release = unsafe { CStr::from_ptr(uts.release.as_ptr()) };
    Ok(release.to_string_lossy().into_owned())
}

pub(super) fn sysconf(name: c_int, what: &str) -> Result<u64, String> {
    // SAFETY: sysconf only reads its integer argument.
    let v = unsafe { libc::sysconf(name) };
    if v <= 0 {
        Err(format!("sysconf({what}) = {v}"))
    } else {
        Ok(v as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The release is the kernel's; the page size is x86-64's; a name sysconf does not know
    /// is an error naming it.
    #[test]
    fn the_host_answers_and_names_a_refusal() {
        let proc_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        assert_eq!(kernel_release().unwrap(), proc_release.trim());
        assert_eq!(sysconf(libc::_SC_PAGESIZE, "_SC_PAGESIZE"), Ok(4096));
        assert_eq!(sysconf(-1, "BOGUS"), Err("sysconf(BOGUS) = -1".to_string()));
        assert!(host().online_cpus.unwrap() >= 1);
    }

    /// AES-GCM counts as accelerated only from a driver of the CPU's instructions: the generic
    /// template and the internal helpers do not.
    #[test]
    fn only_an_accelerated_aes_gcm_counts() {
        let block = |name: &str, driver: &str, internal: &str| {
            format!(
                "name         : {name}\ndriver       : {driver}\nmodule       : m\n\
                 priority     : 400\ninternal     : {internal}\ntype         : aead\n\
                 ivsize       : 12\n"
            )
        };
        let generic = block("gcm(aes)", "gcm_base(ctr(aes-generic),ghash-generic)", "no");
        let helper = block("__gcm(aes)", "__generic-gcm-aesni", "yes");
        let hidden = block("gcm(aes)", "__generic-gcm-aesni", "yes");
        let aesni = block("gcm(aes)", "generic-gcm-vaes-avx2", "no");
        let other = block("rfc4106(gcm(aes))", "rfc4106-gcm-aesni", "no");
        for text in [&generic, &helper, &hidden, &other] {
            assert!(accelerated_aes_gcm(text)
                .unwrap_err()
                .contains("not accelerated"));
        }
        let all = [generic, helper, other, aesni].join("\n");
        assert_eq!(accelerated_aes_gcm(&all), Ok(()));
        assert!(accelerated_aes_gcm("").is_err());
    }
}
