//! Where a peer listens: a TCP address or a Unix socket path.

use super::*;

/// Where a peer listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp:HOST:PORT`.
    Tcp(String),
    /// `unix:PATH`.
    Unix(PathBuf),
}

impl FromStr for Endpoint {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<Endpoint> {
        match s.split_once(':') {
            Some(("tcp", addr))
                if addr
                    .rsplit_once(':')
                    .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()) =>
            {
                Ok(Endpoint::Tcp(addr.to_string()))
            }
            Some(("unix", path)) if !path.is_empty() => Ok(Endpoint::Unix(PathBuf::from(path))),
            _ => Err(TransportError::BadEndpoint(s.to_string())),
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An endpoint prints as it is written and parses back to itself, IPv6 and host names
    /// included.
    #[test]
    fn endpoints_print_as_they_parse() {
        for text in [
            "tcp:127.0.0.1:7000",
            "tcp:[::1]:7000",
            "tcp:host.example:1",
            "unix:/run/m.sock",
        ] {
            let e: Endpoint = text.parse().unwrap();
            assert_eq!(e.to_string(), text);
        }
        assert_eq!(
            "tcp:[::1]:7000".parse::<Endpoint>().unwrap(),
            Endpoint::Tcp("[::1]:7000".into())
        );
        assert_eq!(
            "tcp:[::1]:".parse::<Endpoint>().unwrap_err().to_string(),
            "'tcp:[::1]:' is not an endpoint (expected tcp:HOST:PORT or unix:PATH)"
        );
    }
}
