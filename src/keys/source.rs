//! Where a volume's key comes from, as the request names it: the passphrase
//! itself, a file in the guest (`file:///path`), or a KBS resource fetched
//! by the Confidential Data Hub (`kbs:///repository/type/tag`). Checked here
//! lexically, before anything is opened or asked; what needs the guest (is
//! the file there, does the CDH answer) is judged where it is read.

use std::fmt;
use std::path::PathBuf;

use zeroize::Zeroizing;

use crust_protocols::key_uri::{self, KeyUri, Refused};

use crate::validate::Invalid;

/// The most bytes a key may have, whichever source it comes from.
///
/// cryptsetup reads up to 8 MiB from a key file; the agent takes 64 KiB.
/// The passphrase of a request cannot be larger anyway (a request is at
/// most 64 KiB, `rpc::limits`), and one bound for every source means a key
/// that works from one works from the others. It is 16 times the 4096-byte
/// random keys Confidential Containers makes for LUKS volumes, and it bounds
/// what one publish holds in the guest's memory.
pub const MAX_KEY_LEN: usize = 64 << 10;

/// The request's `key` oneof, in plain terms: what the wire layer hands
/// [`KeySource::from_request`].
pub enum RequestKey {
    /// `Encryption.passphrase`.
    Passphrase(Zeroizing<Vec<u8>>),
    /// `Encryption.key_uri`.
    Uri(String),
}

/// Where the key of an encrypted volume comes from. Its Debug and Display
/// never show a passphrase's bytes (only their count); a file's path and a
/// KBS resource's name are not secret and are shown.
pub enum KeySource {
    /// The passphrase itself, from the request: 1 to [`MAX_KEY_LEN`] bytes.
    Passphrase(Zeroizing<Vec<u8>>),
    /// A file in the guest, by its absolute path (`file:///path`).
    File(PathBuf),
    /// A resource of the KBS, fetched by the Confidential Data Hub.
    Cdh {
        /// The whole URI, `kbs:///repository/type/tag`, as the CDH's
        /// GetResource takes it.
        resource: String,
    },
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Passphrase(p) => write!(f, "Passphrase({} bytes, redacted)", p.len()),
            KeySource::File(path) => f.debug_tuple("File").field(path).finish(),
            KeySource::Cdh { resource } => {
                f.debug_struct("Cdh").field("resource", resource).finish()
            }
        }
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Passphrase(p) => write!(f, "the request's passphrase of {} bytes", p.len()),
            KeySource::File(path) => write!(f, "the key file {}", path.display()),
            KeySource::Cdh { resource } => write!(f, "the KBS resource {resource}"),
        }
    }
}

impl KeySource {
    /// The key source a request names, or why the request is malformed
    /// (INVALID_ARGUMENT). `None`: the request names no key.
    pub fn from_request(key: Option<RequestKey>) -> Result<KeySource, Invalid> {
        match key {
            None => Err(Invalid(
                "encryption names no key: set encryption.passphrase, or encryption.key_uri \
                 (file:///path or kbs:///repository/type/tag)"
                    .into(),
            )),
            Some(RequestKey::Passphrase(p)) => passphrase(p),
            Some(RequestKey::Uri(uri)) => parse_uri(&uri),
        }
    }
}

fn passphrase(p: Zeroizing<Vec<u8>>) -> Result<KeySource, Invalid> {
    if p.is_empty() {
        return Err(Invalid(
            "encryption.passphrase is empty; a LUKS2 keyslot needs a passphrase of 1 to 65536 bytes"
                .into(),
        ));
    }
    if p.len() > MAX_KEY_LEN {
        return Err(Invalid(format!(
            "encryption.passphrase is {} bytes; at most {MAX_KEY_LEN}",
            p.len()
        )));
    }
    Ok(KeySource::Passphrase(p))
}

/// `key_uri`: `file:///absolute/path` or `kbs:///repository/type/tag`, by
/// the rule crustd holds a direct-volume record's `encryptionKey` to
/// (`crust_protocols::key_uri`), in the same words.
fn parse_uri(uri: &str) -> Result<KeySource, Invalid> {
    match key_uri::parse(uri) {
        Ok(KeyUri::File(path)) => Ok(KeySource::File(PathBuf::from(path))),
        Ok(KeyUri::Kbs(resource)) => Ok(KeySource::Cdh {
            resource: resource.to_string(),
        }),
        Err(Refused::Empty) => Err(Invalid(format!("encryption.key_uri {}", Refused::Empty))),
        Err(why) => Err(Invalid(format!(
            "encryption.key_uri {} {why}",
            key_uri::shown(uri)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(s: &str) -> Result<KeySource, Invalid> {
        KeySource::from_request(Some(RequestKey::Uri(s.to_string())))
    }

    /// The rule itself is `crust_protocols::key_uri`'s, tested there; here,
    /// what the agent makes of it: the source, and the field named in a refusal.
    #[test]
    fn key_uris_become_sources_or_refusals_naming_the_field() {
        match uri("file:///run/crust/keys/vol-1") {
            Ok(KeySource::File(p)) => assert_eq!(p, PathBuf::from("/run/crust/keys/vol-1")),
            other => panic!("{other:?}"),
        }
        match uri("kbs:///default/key/1") {
            Ok(KeySource::Cdh { resource }) => assert_eq!(resource, "kbs:///default/key/1"),
            other => panic!("{other:?}"),
        }
        for (u, said) in [
            ("", "encryption.key_uri is empty"),
            (
                "http://kbs/a/b/c",
                "encryption.key_uri \"http://kbs/a/b/c\" is not a key URI",
            ),
            ("kbs:///a/b", "has 2 path segments"),
        ] {
            let e = uri(u).unwrap_err();
            assert!(e.0.contains(said), "{u:?}: {}", e.0);
        }
    }

    #[test]
    fn a_passphrase_is_bounded_and_never_shown() {
        let secret = b"correct horse battery staple".to_vec();
        let s =
            KeySource::from_request(Some(RequestKey::Passphrase(Zeroizing::new(secret.clone()))))
                .unwrap();
        for text in [format!("{s:?}"), format!("{s}"), format!("{s:#?}")] {
            assert!(!text.contains("horse"), "{text}");
            assert!(text.contains("28 bytes"), "{text}");
        }
        let max = Zeroizing::new(vec![7u8; MAX_KEY_LEN]);
        assert!(KeySource::from_request(Some(RequestKey::Passphrase(max))).is_ok());
        let over = Zeroizing::new(vec![7u8; MAX_KEY_LEN + 1]);
        let e = KeySource::from_request(Some(RequestKey::Passphrase(over))).unwrap_err();
        assert!(e.0.contains("65537 bytes"), "{e}");
        let e = KeySource::from_request(Some(RequestKey::Passphrase(Zeroizing::new(vec![]))))
            .unwrap_err();
        assert!(e.0.contains("is empty"), "{e}");
        let e = KeySource::from_request(None).unwrap_err();
        assert!(e.0.contains("names no key"), "{e}");
    }

    #[test]
    fn paths_and_resources_are_shown() {
        let f = uri("file:///etc/keys/k").unwrap();
        assert_eq!(format!("{f}"), "the key file /etc/keys/k");
        assert_eq!(format!("{f:?}"), "File(\"/etc/keys/k\")");
        let c = uri("kbs:///default/key/1").unwrap();
        assert_eq!(format!("{c}"), "the KBS resource kbs:///default/key/1");
        assert_eq!(
            format!("{c:?}"),
            "Cdh { resource: \"kbs:///default/key/1\" }"
        );
    }
}
