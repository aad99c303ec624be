//! Kernel TLS: once rustls has completed a TCP connection's handshake (certificates, roles, the
//! keys agreed), its record layer moves into the kernel (`TCP_ULP` "tls", `TLS_TX`, `TLS_RX`),
//! where the kernel has it (found by trying: `CONFIG_TLS`, the `tls` module) with AES-GCM of the
//! CPU's instructions (`aesni_intel`; the kernel's generic AES-GCM would cost many times rustls's:
//! see `guestmem_sys::probe::kernel_tls`). A read then decrypts straight out of the socket into the
//! reader's buffer, and a write encrypts on its way into the socket: no copy of the records through
//! rustls's buffers, no allocation per record, no read ahead — what the destination's receive
//! spends above decompression and the copy into guest memory.
//!
//! Only the record layer moves: the handshake, and with it who may connect, stays rustls's.
//! The move needs nothing of the stream to be held in user space past the handshake: during it a
//! TCP socket is read one TLS record at a time, never past a record's end ([`super::Wire`]), the
//! destination sends no session tickets, and a connection whose first application data came with
//! the handshake (or that negotiated another cipher than AES-GCM) stays with rustls. A kernel
//! without TLS, a Unix socket, or `GUESTMEM_KERNEL_TLS=off` keep rustls for the whole
//! connection; both kinds of peers talk to each other (the bytes on the wire are the same TLS
//! 1.3 records). The kernel does not renew the keys (TLS 1.3's key update): a peer asking for a
//! renewal is refused with an error naming it (guestmem's peers never ask).

use super::*;
use std::cell::Cell;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use rustls::crypto::cipher::{AeadKey, Iv};
use rustls::{ConnectionTrafficSecrets, ExtractedSecrets};

/// TLS record content types (RFC 8446, 5.1).
const ALERT: u8 = 21;
const HANDSHAKE: u8 = 22;
const APPLICATION_DATA: u8 = 23;

thread_local! {
    /// [`with_kernel_tls`]'s choice for connections made on this thread.
    static ON_THIS_THREAD: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Whether connections try kernel TLS: yes unless `GUESTMEM_KERNEL_TLS=off`, or
/// [`with_kernel_tls`] says otherwise on this thread.
fn wanted() -> bool {
    static DEFAULT: OnceLock<bool> = OnceLock::new();
    ON_THIS_THREAD.get().unwrap_or_else(|| {
        *DEFAULT.get_or_init(|| std::env::var("GUESTMEM_KERNEL_TLS").map_or(true, |v| v != "off"))
    })
}

/// Runs `f` with kernel TLS tried (`true`) or not (`false`) for the connections it makes or
/// accepts on this thread: for benches and tests that compare the two, or one of each end.
pub fn with_kernel_tls<T>(on: bool, f: impl FnOnce() -> T) -> T {
    let before = ON_THIS_THREAD.replace(Some(on));
    let out = f();
    ON_THIS_THREAD.set(before);
    out
}

/// A connection's TLS after its handshake.
pub(super) enum Moved<S> {
    /// The kernel's: read and write the socket.
    Kernel(KernelTls),
    /// rustls's, and why (`None`: not tried — a Unix socket, or turned off).
    Rustls(S, Option<String>),
}

/// A rustls connection whose traffic secrets can be taken (client or server).
pub(super) trait IntoSecrets {
    fn into_secrets(self) -> std::result::Result<ExtractedSecrets, rustls::Error>;
}

impl IntoSecrets for ClientConnection {
    fn into_secrets(self) -> std::result::Result<ExtractedSecrets, rustls::Error> {
        self.dangerous_extract_secrets()
    }
}

impl IntoSecrets for ServerConnection {
    fn into_secrets(self) -> std::result::Result<ExtractedSecrets, rustls::Error> {
        self.dangerous_extract_secrets()
    }
}

/// Moves a connection whose handshake is complete into the kernel's TLS where it can; else
/// gives it back. An error only once the move has begun (the socket is then unusable).
pub(super) fn try_move<C, D>(
    mut stream: StreamOwned<C, Wire>,
) -> std::result::Result<Moved<StreamOwned<C, Wire>>, String>
where
    C: IntoSecrets + std::ops::DerefMut + std::ops::Deref<Target = rustls::ConnectionCommon<D>>,
    D: rustls::SideData,
{
    if !matches!(stream.sock.socket, Socket::Tcp(_)) || !wanted() {
        return Ok(Moved::Rustls(stream, None));
    }
    if let Err(why) = kernel_has_tls() {
        return Ok(Moved::Rustls(stream, Some(why)));
    }
    if let Some(why) = stays_in_user_space(&mut stream.conn) {
        return Ok(Moved::Rustls(stream, Some(why)));
    }
    // Attaches the kernel's TLS to the socket (the probe above did the same on its own).
    let ulp = guestmem_sys::setsockopt(
        tcp_fd(&stream.sock.socket),
        libc::SOL_TCP,
        libc::TCP_ULP,
        b"tls",
    );
    if let Err(e) = ulp {
        let why = format!("setsockopt TCP_ULP \"tls\": {e}");
        return Ok(Moved::Rustls(stream, Some(why)));
    }
    let StreamOwned { conn, sock } = stream;
    let fd = tcp_fd(&sock.socket);
    let secrets = conn
        .into_secrets()
        .map_err(|e| format!("taking the TLS keys for kernel TLS: {e}"))?;
    set_keys(fd, libc::TLS_TX, secrets.tx)
        .map_err(|e| format!("kernel TLS: setting the sending key (TLS_TX): {e}"))?;
    set_keys(fd, libc::TLS_RX, secrets.rx)
        .map_err(|e| format!("kernel TLS: setting the receiving key (TLS_RX): {e}"))?;
    // Records come unpadded from every TLS 1.3 peer guestmem talks to: the kernel may decrypt
    // into the reader's buffer at once (it checks, and decrypts again if one was padded).
    let _ = guestmem_sys::setsockopt(
        fd,
        libc::SOL_TLS,
        libc::TLS_RX_EXPECT_NO_PAD,
        &1 as &libc::c_int,
    );
    Ok(Moved::Kernel(KernelTls {
        socket: sock.socket,
        closed: false,
    }))
}

/// The descriptor of a TCP socket (kernel TLS runs on nothing else).
fn tcp_fd(socket: &Socket) -> BorrowedFd<'_> {
    match socket {
        Socket::Tcp(s) => s.as_fd(),
        Socket::Unix(_) => unreachable!("kernel TLS runs on TCP sockets only"),
    }
}

/// Whether the kernel has TLS with AES-GCM of the CPU's instructions
/// ([`guestmem_sys::probe::kernel_tls`]), asked once per process.
fn kernel_has_tls() -> std::result::Result<(), String> {
    static ANSWER: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    ANSWER.get_or_init(guestmem_sys::probe::kernel_tls).clone()
}

/// Why a connection must keep rustls although the kernel may have TLS: a cipher the kernel is
/// not given here, or application data rustls already holds.
fn stays_in_user_space<D>(conn: &mut rustls::ConnectionCommon<D>) -> Option<String> {
    use rustls::CipherSuite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384};
    match conn.negotiated_cipher_suite().map(|s| s.suite()) {
        Some(TLS13_AES_128_GCM_SHA256 | TLS13_AES_256_GCM_SHA384) => {}
        other => {
            return Some(format!(
                "kernel TLS is not used with cipher suite {other:?}"
            ))
        }
    }
    match conn.process_new_packets() {
        Ok(state) if state.plaintext_bytes_to_read() == 0 => None,
        Ok(_) => Some("application data came with the handshake".into()),
        Err(e) => Some(format!("TLS after the handshake: {e}")),
    }
}

/// Hands one direction's key, IV and record sequence number to the kernel (`TLS_TX` or
/// `TLS_RX`): TLS 1.3's 12-byte IV is the uapi's 4-byte salt and 8-byte IV.
fn set_keys(
    fd: BorrowedFd<'_>,
    direction: libc::c_int,
    (seq, secrets): (u64, ConnectionTrafficSecrets),
) -> io::Result<()> {
    fn fill<const K: usize>(
        key: &AeadKey,
        iv: &Iv,
        seq: u64,
        out_key: &mut [u8; K],
        salt: &mut [u8; 4],
        out_iv: &mut [u8; 8],
        rec_seq: &mut [u8; 8],
    ) {
        out_key.copy_from_slice(key.as_ref());
        salt.copy_from_slice(&iv.as_ref()[..4]);
        out_iv.copy_from_slice(&iv.as_ref()[4..]);
        *rec_seq = seq.to_be_bytes();
    }
    // The uapi struct of one AES-GCM key size, filled, handed over, and wiped.
    macro_rules! aes_gcm {
        ($info:ty, $cipher:expr, $key:expr, $iv:expr) => {{
            // SAFETY: the uapi struct is plain old data: all zeroes is a valid value.
            let mut info: $info = unsafe { std::mem::zeroed() };
            info.info.version = libc::TLS_1_3_VERSION;
            info.info.cipher_type = $cipher;
            let i = &mut info;
            fill(
                $key,
                $iv,
                seq,
                &mut i.key,
                &mut i.salt,
                &mut i.iv,
                &mut i.rec_seq,
            );
            let r = guestmem_sys::setsockopt(fd, libc::SOL_TLS, direction, &info);
            wipe(&mut info);
            r
        }};
    }
    match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv } => aes_gcm!(
            libc::tls12_crypto_info_aes_gcm_128,
            libc::TLS_CIPHER_AES_GCM_128,
            &key,
            &iv
        ),
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => aes_gcm!(
            libc::tls12_crypto_info_aes_gcm_256,
            libc::TLS_CIPHER_AES_GCM_256,
            &key,
            &iv
        ),
        _ => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "a cipher other than AES-GCM",
        )),
    }
}

/// Overwrites a struct that held a key with zeroes, a write the compiler keeps.
fn wipe<T>(v: &mut T) {
    // SAFETY: `v` is a live, writable T of plain old data, for which all zeroes is valid.
    unsafe { std::ptr::write_volatile(v, std::mem::zeroed()) };
}

/// A connection whose TLS records the kernel encrypts and decrypts.
#[derive(Debug)]
pub(super) struct KernelTls {
    socket: Socket,
    /// The peer's close_notify came: reads return 0 from now on.
    closed: bool,
}

impl KernelTls {
    /// One `recvmsg`: the bytes read and the content type of the record they came from.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<(usize, u8)> {
        let Socket::Tcp(s) = &self.socket else {
            unreachable!("kernel TLS runs on TCP sockets only")
        };
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut control = [0u64; 8];
        // SAFETY: msghdr is plain old data: all zeroes is a valid value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control);
        let n = loop {
            // SAFETY: `msg` points at `iov` (the live, writable `buf`) and `control` (64
            // writable bytes, u64-aligned as cmsghdr needs), all alive across the call; the fd
            // is the open socket `s` owns.
            let n = unsafe { libc::recvmsg(s.as_raw_fd(), &raw mut msg, 0) };
            if n >= 0 {
                break n.unsigned_abs();
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let mut kind = APPLICATION_DATA;
        // SAFETY: the kernel filled `msg`'s control buffer with well-formed cmsghdrs (within
        // msg_controllen); CMSG_FIRSTHDR/NXTHDR stay inside it and CMSG_DATA of a
        // TLS_GET_RECORD_TYPE message points at its one byte.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&raw const msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_TLS && (*c).cmsg_type == libc::TLS_GET_RECORD_TYPE {
                    kind = *libc::CMSG_DATA(c);
                }
                c = libc::CMSG_NXTHDR(&raw const msg, c);
            }
        }
        Ok((n, kind))
    }
}

impl KernelTls {
    /// The end of the reads at a close_notify (description 0), else the alert as an error.
    fn alert(&mut self, description: u8) -> io::Result<usize> {
        if description == 0 {
            self.closed = true;
            return Ok(0);
        }
        Err(tls_failure(rustls::Error::AlertReceived(
            rustls::AlertDescription::from(description),
        )))
    }
}

/// A TLS failure as rustls would report it, so that it is explained the same way.
fn tls_failure(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl Read for KernelTls {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() || self.closed {
            return Ok(0);
        }
        let (n, kind) = match self.recv(buf) {
            Ok(r) => r,
            // The record's tag did not check out: damaged or forged on the way.
            Err(e) if e.raw_os_error() == Some(libc::EBADMSG) => {
                return Err(tls_failure(rustls::Error::DecryptError))
            }
            Err(e) => return Err(e),
        };
        match kind {
            _ if n == 0 => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the connection without a TLS close_notify",
            )),
            APPLICATION_DATA => Ok(n),
            ALERT if n == 1 => {
                // A one-byte read took the alert's level; its description follows.
                let mut rest = [0u8; 1];
                match self.recv(&mut rest)? {
                    (1, ALERT) => self.alert(rest[0]),
                    _ => Err(tls_failure(rustls::Error::General(
                        "a TLS alert cut short".into(),
                    ))),
                }
            }
            ALERT => self.alert(buf[1]),
            HANDSHAKE => Err(tls_failure(rustls::Error::General(
                "the peer sent a TLS handshake message after the handshake (a key update?), \
                 which this connection's kernel TLS does not take"
                    .into(),
            ))),
            other => Err(tls_failure(rustls::Error::General(format!(
                "a TLS record of content type {other} ({n} bytes) where application data was due"
            )))),
        }
    }
}

impl Write for KernelTls {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.socket.write(buf)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.socket.write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
