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

    #[test]
    fn file_uris_name_absolute_paths_as_written() {
        for (u, path) in [
            ("file:///etc/keys/vol-1", "/etc/keys/vol-1"),
            ("file:///k", "/k"),
            (
                "file:///run/secrets/a b/key.bin",
                "/run/secrets/a b/key.bin",
            ),
            ("file:///x/..y/.z/y..", "/x/..y/.z/y.."),
        ] {
            match uri(u) {
                Ok(KeySource::File(p)) => assert_eq!(p, PathBuf::from(path), "{u}"),
                other => panic!("{u}: {other:?}"),
            }
        }
        let long = format!("file:///{}/{}", "a".repeat(255), "b".repeat(200));
        assert!(matches!(uri(&long), Ok(KeySource::File(_))));
    }

    #[test]
    fn kbs_uris_name_three_segments_as_the_kbs_takes_them() {
        for u in [
            "kbs:///default/key/1",
            "kbs:///alice/cosign-key/213",
            "kbs:///123--_default/1Abff-_/___-afds44BC",
            "kbs:///1.ok/2ok./3...",
        ] {
            match uri(u) {
                Ok(KeySource::Cdh { resource }) => assert_eq!(resource, u),
                other => panic!("{u}: {other:?}"),
            }
        }
    }

    #[test]
    fn bad_uris_are_refused_with_a_sentence() {
        let table: &[(&str, &str)] = &[
            ("", "is empty"),
            ("/etc/key", "is not a key URI"),
            ("key", "is not a key URI"),
            ("http://kbs/a/b/c", "is not a key URI"),
            ("File:///etc/key", "is not a key URI"),
            ("file:/etc/key", "is not a key URI"),
            ("file://etc/key", "names a host or a relative path"),
            ("file://host/etc/key", "names a host or a relative path"),
            ("file://", "names a host or a relative path"),
            ("file:///", "empty path component"),
            ("file:///etc/keys/", "empty path component"),
            ("file:///etc//key", "empty path component"),
            ("file:///etc/../key", ". or .. component"),
            ("file:///etc/./key", ". or .. component"),
            ("file:///..", ". or .. component"),
            ("file:///etc/my%20key", "'%'"),
            ("file:///etc/key?x", "'?'"),
            ("file:///etc/key#x", "'#'"),
            ("file:///etc/key\0", "NUL"),
            ("file:///etc/key\n", "control character"),
            ("kbs:///a/b/c\0", "NUL"),
            ("kbs://kbs.example:8080/a/b/c", "names a KBS host"),
            ("kbs://a/b/c", "names a KBS host"),
            ("kbs:///a/b", "2 path segments"),
            ("kbs:///a/b/c/d", "4 path segments"),
            ("kbs:///", "1 path segments"),
            ("kbs:///a//c", "empty type"),
            ("kbs:///a/b/", "empty tag"),
            ("kbs:///../b/c", "repository starting with '.'"),
            ("kbs:///a/../c", "type starting with '.'"),
            ("kbs:///a/b/.hidden", "tag starting with '.'"),
            ("kbs:///a/b/c d", "character other than"),
            ("kbs:///a/b/c%2f", "character other than"),
            ("kbs:///a/b/c?x=1", "no query or fragment"),
            ("kbs:///a/b/c#f", "no query or fragment"),
            ("kbs+pkcs11:///a/b/c", "names a KBS plugin"),
        ];
        for (u, why) in table {
            let e = uri(u).expect_err(u);
            assert!(e.0.starts_with("encryption.key_uri"), "{u}: {e}");
            assert!(e.0.contains(why), "{u}: {e} (wanted {why:?})");
        }
        let long_path = format!("file:///{}", "a/".repeat(2100));
        assert!(uri(&long_path).unwrap_err().0.contains("bytes long"));
        let long_name = format!("file:///{}", "a".repeat(256));
        assert!(uri(&long_name)
            .unwrap_err()
            .0
            .contains("component of 256 bytes"));
        let long_tag = format!("kbs:///a/b/{}", "t".repeat(256));
        assert!(uri(&long_tag).unwrap_err().0.contains("tag of 256 bytes"));
        // A long URI is cut in the message, never echoed whole.
        let e = uri(&format!("gopher://{}", "x".repeat(1000))).unwrap_err();
        assert!(e.0.len() < 400, "{}", e.0.len());
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
