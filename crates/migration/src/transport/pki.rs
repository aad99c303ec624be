//! The migration CA and each side's certificate and key: making them, loading them, checking a certificate's role.

use super::*;

/// Which side of a migration a peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that sends the guest.
    Source,
    /// The side that receives it.
    Destination,
}

impl Role {
    /// The name in the role's certificate (and of its files in a credentials directory).
    pub fn name(self) -> &'static str {
        match self {
            Role::Source => SOURCE_NAME,
            Role::Destination => DESTINATION_NAME,
        }
    }

    /// The role on the other end.
    pub fn peer(self) -> Role {
        match self {
            Role::Source => Role::Destination,
            Role::Destination => Role::Source,
        }
    }

    pub(super) fn word(self) -> &'static str {
        match self {
            Role::Source => "source",
            Role::Destination => "destination",
        }
    }
}

/// Whether `cert` names `role` (the peer's role, or our own).
pub(super) fn names_role(cert: &CertificateDer<'_>, role: Role) -> std::result::Result<(), String> {
    let ee = webpki::EndEntityCert::try_from(cert)
        .map_err(|e| format!("the certificate does not parse: {e}"))?;
    let name = |r: Role| ServerName::try_from(r.name()).expect("a valid DNS name");
    if ee.verify_is_valid_for_subject_name(&name(role)).is_ok() {
        return Ok(());
    }
    let other = role.peer();
    if ee.verify_is_valid_for_subject_name(&name(other)).is_ok() {
        return Err(format!(
            "it is a {} certificate ({}), where a {} one ({}) is required",
            other.word(),
            other.name(),
            role.word(),
            role.name()
        ));
    }
    Err(format!(
        "it names neither role, where a {} certificate ({}) is required",
        role.word(),
        role.name()
    ))
}

/// A PEM file that failed to load: unreadable (its I/O error as the source), or not holding
/// a `what`.
pub(super) fn pem_error(
    path: PathBuf,
    what: &str,
    e: rustls::pki_types::pem::Error,
) -> TransportError {
    match e {
        rustls::pki_types::pem::Error::Io(source) => {
            TransportError::CredentialsUnreadable { path, source }
        }
        e => TransportError::Credentials {
            path,
            reason: format!("not a PEM {what}: {e}"),
        },
    }
}

/// One peer's credentials: the migration CA's certificate and its own certificate and key, read
/// from `DIR/ca.pem`, `DIR/<role>.pem` and `DIR/<role>.key`.
#[derive(Debug)]
pub struct Credentials {
    ca: CertificateDer<'static>,
    pub(super) cert: CertificateDer<'static>,
    pub(super) key: PrivateKeyDer<'static>,
    pub(super) role: Role,
    /// What is wrong with our own certificate, if anything (see [`Credentials::load`]).
    pub(super) problem: Option<String>,
}

impl Credentials {
    /// Reads the credentials and checks our own certificate as the peer will: signed by the CA,
    /// valid now, and of `role`. A problem is warned about at once, and named again in the
    /// error of any handshake that fails; the peer has the last word (its clock may differ), and
    /// says why it refuses, so that both sides tell why the handshake failed.
    pub fn load(dir: &Path, role: Role) -> Result<Credentials> {
        let mut creds = Credentials::load_unchecked(dir, role)?;
        if let Err(reason) = creds.check_own() {
            let problem = format!(
                "this {}'s own certificate {} is unusable: {reason}",
                role.word(),
                dir.join(format!("{}.pem", role.name())).display()
            );
            tracing::warn!("{problem}; the peer will refuse it");
            creds.problem = Some(problem);
        }
        Ok(creds)
    }

    /// What is wrong with our own certificate (expired, not yet valid, of the other role, not
    /// signed by the CA), if anything.
    pub fn problem(&self) -> Option<&str> {
        self.problem.as_deref()
    }

    /// [`Credentials::load`] without the check of our own certificate: for tests of what the
    /// peer does with a bad one.
    #[doc(hidden)]
    pub fn load_unchecked(dir: &Path, role: Role) -> Result<Credentials> {
        let cert_path = |name: &str| dir.join(format!("{name}.pem"));
        let read_cert = |path: PathBuf| {
            CertificateDer::from_pem_file(&path).map_err(|e| pem_error(path, "certificate", e))
        };
        let key_path = dir.join(format!("{}.key", role.name()));
        let key = PrivateKeyDer::from_pem_file(&key_path)
            .map_err(|e| pem_error(key_path.clone(), "private key", e))?;
        Ok(Credentials {
            ca: read_cert(cert_path("ca"))?,
            cert: read_cert(cert_path(role.name()))?,
            key,
            role,
            problem: None,
        })
    }

    fn check_own(&self) -> std::result::Result<(), String> {
        names_role(&self.cert, self.role)?;
        let roots = self.roots().map_err(|e| e.to_string())?;
        let now = UnixTime::now();
        let checked = match self.role {
            Role::Source => WebPkiClientVerifier::builder_with_provider(roots, provider())
                .build()
                .map_err(|e| e.to_string())?
                .verify_client_cert(&self.cert, &[], now)
                .map(|_| ()),
            Role::Destination => WebPkiServerVerifier::builder_with_provider(roots, provider())
                .build()
                .map_err(|e| e.to_string())?
                .verify_server_cert(
                    &self.cert,
                    &[],
                    &ServerName::try_from(DESTINATION_NAME).expect("a valid DNS name"),
                    &[],
                    now,
                )
                .map(|_| ()),
        };
        checked.map_err(|e| e.to_string())
    }

    pub(super) fn roots(&self) -> Result<Arc<RootCertStore>> {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.ca.clone())
            .map_err(|e| TransportError::Setup(format!("the CA certificate is unusable: {e}")))?;
        Ok(Arc::new(roots))
    }
}

/// Writes a fresh migration CA and a certificate and key for each role into `dir`.
pub fn generate_credentials(dir: &Path) -> Result<()> {
    write_credentials(dir, |_, _| {})
}

/// [`generate_credentials`], with `tweak` applied to each role's certificate parameters (tests
/// make expired certificates with it).
#[doc(hidden)]
pub fn write_credentials(
    dir: &Path,
    tweak: impl Fn(Role, &mut rcgen::CertificateParams),
) -> Result<()> {
    let tls = |e: rcgen::Error| TransportError::Setup(format!("generating credentials: {e}"));
    std::fs::create_dir_all(dir).map_err(io_err(format!("{}: create", dir.display())))?;
    let ca_key = rcgen::KeyPair::generate().map_err(tls)?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(tls)?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "guestmem migration CA");
    let ca_cert = ca_params.self_signed(&ca_key).map_err(tls)?;
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    // `mode`: a private key is for its owner's eyes only (0600, also when a file was there),
    // certificates are public (0644).
    let write = |name: &str, contents: String, mode: u32| {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let path = dir.join(name);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&path)
            .and_then(|f| {
                f.set_permissions(std::fs::Permissions::from_mode(mode))?;
                Ok(f)
            })
            .map_err(io_err(format!("{}: write", path.display())))?;
        file.write_all(contents.as_bytes())
            .map_err(io_err(format!("{}: write", path.display())))
    };
    write("ca.pem", ca_cert.pem(), 0o644)?;
    for role in [Role::Source, Role::Destination] {
        let key = rcgen::KeyPair::generate().map_err(tls)?;
        let mut params =
            rcgen::CertificateParams::new(vec![role.name().to_string()]).map_err(tls)?;
        tweak(role, &mut params);
        let cert = params.signed_by(&key, &issuer).map_err(tls)?;
        write(&format!("{}.pem", role.name()), cert.pem(), 0o644)?;
        write(&format!("{}.key", role.name()), key.serialize_pem(), 0o600)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("guestmem-pki-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// Each role names itself and its peer.
    #[test]
    fn roles_name_themselves_and_their_peer() {
        assert_eq!(Role::Source.name(), "guestmem-source");
        assert_eq!(Role::Destination.name(), "guestmem-destination");
        assert_eq!(Role::Source.peer(), Role::Destination);
        assert_eq!(Role::Destination.peer(), Role::Source);
        assert_eq!(
            (Role::Source.word(), Role::Destination.word()),
            ("source", "destination")
        );
    }

    /// The private keys are readable by their owner only, even over files that were there;
    /// the certificates by anyone.
    #[test]
    fn private_keys_are_for_their_owner_only() {
        let dir = temp_dir("modes");
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("guestmem-source.key");
        std::fs::write(&key, "old").unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o666)).unwrap();
        generate_credentials(&dir).unwrap();
        let mode = |name: &str| {
            std::fs::metadata(dir.join(name))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode("guestmem-source.key"), 0o600);
        assert_eq!(mode("guestmem-destination.key"), 0o600);
        for cert in ["ca.pem", "guestmem-source.pem", "guestmem-destination.pem"] {
            assert_eq!(mode(cert), 0o644, "{cert}");
        }
        assert!(Credentials::load(&dir, Role::Source)
            .unwrap()
            .problem()
            .is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A certificate for neither role is named as such, and said to be unusable when loaded;
    /// a certificate file that holds no certificate is refused naming the file.
    #[test]
    fn a_certificate_of_neither_role_is_named() {
        let dir = temp_dir("neither");
        write_credentials(&dir, |role, params| {
            if role == Role::Source {
                params.subject_alt_names =
                    vec![rcgen::SanType::DnsName("elsewhere".try_into().unwrap())];
            }
        })
        .unwrap();
        let creds = Credentials::load(&dir, Role::Source).unwrap();
        assert_eq!(
            names_role(&creds.cert, Role::Source).unwrap_err(),
            "it names neither role, where a source certificate (guestmem-source) is required"
        );
        let problem = creds.problem().expect("unusable");
        assert!(
            problem.starts_with("this source's own certificate ")
                && problem.ends_with("is unusable: it names neither role, where a source certificate (guestmem-source) is required"),
            "{problem}"
        );
        std::fs::write(dir.join("ca.pem"), "no certificate here\n").unwrap();
        match Credentials::load(&dir, Role::Destination) {
            Err(TransportError::Credentials { path, reason }) => {
                assert_eq!(path, dir.join("ca.pem"));
                assert!(reason.starts_with("not a PEM certificate"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
