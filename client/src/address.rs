//! Where the agent listens: `unix:///path`, `vsock://CID:PORT` or
//! `hvsock://PATH:PORT` (the hybrid vsock of Firecracker, Cloud Hypervisor and
//! vhost-user-vsock). Parsing and printing only; connecting lives in `connect`.

use std::{fmt, path::PathBuf, str::FromStr};

use thiserror::Error;

/// `VMADDR_CID_ANY`, written `-1` in addresses: any CID, for listeners only.
pub const VSOCK_CID_ANY: u32 = u32::MAX;

/// The longest path a `sockaddr_un` holds (108 bytes with the terminating NUL).
const MAX_UNIX_PATH: usize = 107;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A Unix stream socket, e.g. for an agent run on the host in tests.
    Unix(PathBuf),
    /// AF_VSOCK; `cid` may be [`VSOCK_CID_ANY`] (`-1`) when listening.
    Vsock {
        /// The guest's context id (3 and up), or [`VSOCK_CID_ANY`].
        cid: u32,
        /// The port the agent listens on (1024 by default).
        port: u32,
    },
    /// The VMM's Unix socket at `path`, then `CONNECT port\n` to reach the guest.
    Hvsock {
        /// The VMM's Unix socket, e.g. Firecracker's `uds_path`.
        path: PathBuf,
        /// The guest port to ask for in `CONNECT`.
        port: u32,
    },
}

/// Why a string is not an agent address.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AddressError {
    #[error(
        "'{0}' is not an agent address: use unix:///PATH, vsock://CID:PORT or hvsock://PATH:PORT"
    )]
    NoScheme(String),
    #[error("'{addr}' has the unknown scheme '{scheme}': use unix:///PATH, vsock://CID:PORT or hvsock://PATH:PORT")]
    UnknownScheme { addr: String, scheme: String },
    #[error("'{0}' needs an absolute socket path after the scheme, as in unix:///run/crust.sock or hvsock:///run/vm/vsock.sock:1024")]
    RelativePath(String),
    #[error("'{addr}' names a socket path of {len} bytes; a Unix socket address holds at most {MAX_UNIX_PATH}: use a shorter path")]
    PathTooLong { addr: String, len: usize },
    #[error("'{0}' contains a NUL byte, which no socket path can hold")]
    NulInPath(String),
    #[error("'{0}' lacks a port: write it as {1}")]
    MissingPort(String, &'static str),
    #[error("'{addr}' has the port '{port}', which is not a number from 0 to 4294967294")]
    BadPort { addr: String, port: String },
    #[error("'{addr}' has the CID '{cid}', which is neither -1 nor a number from 0 to 4294967294")]
    BadCid { addr: String, cid: String },
    #[error("'{0}' uses CID -1 (any), which only a listener can use: give the guest's CID, as in vsock://3:1024")]
    AnyCidForConnect(String),
}

/// [`crust_protocols::DEFAULT_PORT`], as an address would spell it.
const DEFAULT_PORT_TEXT: &str = "2857";
const _: () = assert!(crust_protocols::DEFAULT_PORT == 2857);

impl Address {
    /// Checks that a client can connect here (a listener can use more, e.g. CID -1).
    pub fn check_connectable(&self) -> Result<(), AddressError> {
        match self {
            Address::Vsock {
                cid: VSOCK_CID_ANY, ..
            } => Err(AddressError::AnyCidForConnect(self.to_string())),
            _ => Ok(()),
        }
    }
}

impl FromStr for Address {
    type Err = AddressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some((scheme, rest)) = s.split_once("://") else {
            return Err(AddressError::NoScheme(s.to_string()));
        };
        match scheme {
            "unix" => Ok(Address::Unix(socket_path(s, rest)?)),
            "vsock" => {
                // No port: the agent's default one.
                let (cid, port) = rest.rsplit_once(':').unwrap_or((rest, DEFAULT_PORT_TEXT));
                let cid = match cid {
                    "-1" => VSOCK_CID_ANY,
                    _ => number(cid).ok_or_else(|| AddressError::BadCid {
                        addr: s.to_string(),
                        cid: cid.to_string(),
                    })?,
                };
                Ok(Address::Vsock {
                    cid,
                    port: port_number(s, port)?,
                })
            }
            "hvsock" => {
                // The path may itself contain ':', the port never does (nor
                // a '/'): no ':' after the path's last '/' means no port,
                // and the agent's default one.
                let (path, port) = match rest.rsplit_once(':') {
                    Some((path, port)) if !port.contains('/') => (path, port),
                    _ => (rest, DEFAULT_PORT_TEXT),
                };
                let port = port_number(s, port)?;
                Ok(Address::Hvsock {
                    path: socket_path(s, path)?,
                    port,
                })
            }
            _ => Err(AddressError::UnknownScheme {
                addr: s.to_string(),
                scheme: scheme.to_string(),
            }),
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Unix(path) => write!(f, "unix://{}", path.display()),
            Address::Vsock {
                cid: VSOCK_CID_ANY,
                port,
            } => write!(f, "vsock://-1:{port}"),
            Address::Vsock { cid, port } => write!(f, "vsock://{cid}:{port}"),
            Address::Hvsock { path, port } => write!(f, "hvsock://{}:{port}", path.display()),
        }
    }
}

fn socket_path(addr: &str, path: &str) -> Result<PathBuf, AddressError> {
    if !path.starts_with('/') || path.len() < 2 {
        return Err(AddressError::RelativePath(addr.to_string()));
    }
    if path.contains('\0') {
        return Err(AddressError::NulInPath(addr.to_string()));
    }
    if path.len() > MAX_UNIX_PATH {
        return Err(AddressError::PathTooLong {
            addr: addr.to_string(),
            len: path.len(),
        });
    }
    Ok(PathBuf::from(path))
}

/// A decimal u32 below u32::MAX (which vsock reserves as "any"); no sign, no spaces.
fn number(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse::<u32>().ok().filter(|&n| n != u32::MAX)
}

fn port_number(addr: &str, port: &str) -> Result<u32, AddressError> {
    if port.is_empty() {
        let form = if addr.starts_with("vsock") {
            "vsock://CID:PORT"
        } else {
            "hvsock://PATH:PORT"
        };
        return Err(AddressError::MissingPort(addr.to_string(), form));
    }
    number(port).ok_or_else(|| AddressError::BadPort {
        addr: addr.to_string(),
        port: port.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_addresses_parse_and_print_back() {
        let table: &[(&str, Address)] = &[
            (
                "unix:///run/crust.sock",
                Address::Unix("/run/crust.sock".into()),
            ),
            ("unix:///a", Address::Unix("/a".into())),
            (
                "unix:///tmp/with:colon",
                Address::Unix("/tmp/with:colon".into()),
            ),
            ("vsock://3:1024", Address::Vsock { cid: 3, port: 1024 }),
            (
                "vsock://-1:1024",
                Address::Vsock {
                    cid: VSOCK_CID_ANY,
                    port: 1024,
                },
            ),
            ("vsock://0:0", Address::Vsock { cid: 0, port: 0 }),
            (
                "vsock://4294967294:4294967294",
                Address::Vsock {
                    cid: u32::MAX - 1,
                    port: u32::MAX - 1,
                },
            ),
            (
                "hvsock:///run/vm/vsock.sock:1024",
                Address::Hvsock {
                    path: "/run/vm/vsock.sock".into(),
                    port: 1024,
                },
            ),
            (
                "hvsock:///run/a:b/v.sock:52",
                Address::Hvsock {
                    path: "/run/a:b/v.sock".into(),
                    port: 52,
                },
            ),
        ];
        for (text, want) in table {
            let got: Address = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(&got, want, "{text}");
            assert_eq!(got.to_string(), *text, "round trip of {text}");
        }
    }

    #[test]
    fn an_address_without_a_port_has_the_agents_default_port() {
        let d = crust_protocols::DEFAULT_PORT;
        assert_eq!(
            "vsock://3".parse::<Address>().unwrap(),
            Address::Vsock { cid: 3, port: d }
        );
        assert_eq!(
            "hvsock:///run/a:b/vsock.sock".parse::<Address>().unwrap(),
            Address::Hvsock {
                path: "/run/a:b/vsock.sock".into(),
                port: d
            }
        );
        assert_eq!(
            "hvsock:///run/v.sock"
                .parse::<Address>()
                .unwrap()
                .to_string(),
            format!("hvsock:///run/v.sock:{d}")
        );
    }

    #[test]
    fn bad_addresses_are_refused_with_the_reason() {
        let long = format!("unix:///{}", "x".repeat(107));
        let table: &[(&str, &str)] = &[
            ("", "is not an agent address"),
            ("/run/crust.sock", "is not an agent address"),
            ("tcp://1.2.3.4:5", "unknown scheme 'tcp'"),
            ("UNIX:///x", "unknown scheme 'UNIX'"),
            ("unix://", "absolute socket path"),
            ("unix:///", "absolute socket path"),
            ("unix://run/crust.sock", "absolute socket path"),
            ("unix:///a\0b", "NUL byte"),
            (&long, "at most 107"),
            ("vsock://3:", "lacks a port"),
            ("vsock://:1024", "CID ''"),
            ("vsock://x:1024", "CID 'x'"),
            ("vsock://-2:1024", "CID '-2'"),
            ("vsock://+3:1024", "CID '+3'"),
            ("vsock://4294967295:1", "CID '4294967295'"),
            ("vsock://3:port", "port 'port'"),
            ("vsock://3:-1", "port '-1'"),
            ("vsock://3:4294967296", "port '4294967296'"),
            ("vsock://3:1 ", "port '1 '"),
            ("vsock://1:2:3", "CID '1:2'"),
            ("hvsock:///run/v.sock:", "lacks a port"),
            ("hvsock://v.sock:1024", "absolute socket path"),
            ("hvsock://:1024", "absolute socket path"),
            ("hvsock:///run/v.sock:x", "port 'x'"),
        ];
        for (text, want) in table {
            match text.parse::<Address>() {
                Ok(a) => panic!("{text:?} parsed as {a:?}"),
                Err(e) => assert!(
                    e.to_string().contains(want),
                    "{text:?}: {e} (want {want:?})"
                ),
            }
        }
    }

    #[test]
    fn any_cid_is_for_listeners_only() {
        let any: Address = "vsock://-1:1024".parse().unwrap();
        let err = any.check_connectable().unwrap_err();
        assert!(err.to_string().contains("only a listener"), "{err}");
        for ok in ["vsock://3:1024", "unix:///x", "hvsock:///x:1"] {
            ok.parse::<Address>().unwrap().check_connectable().unwrap();
        }
    }
}
