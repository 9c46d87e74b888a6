//! Where a volume's key comes from, as the request names it: the passphrase
//! itself, a file in the guest (`file:///path`), or a KBS resource fetched
//! by the Confidential Data Hub (`kbs:///repository/type/tag`). Checked here
//! lexically, before anything is opened or asked; what needs the guest (is
//! the file there, does the CDH answer) is judged where it is read.

use std::fmt;
use std::path::PathBuf;

use zeroize::Zeroizing;

use crate::validate::{fits_the_kernel, Invalid, NAME_MAX, PATH_MAX};

/// The most bytes a key may have, whichever source it comes from.
///
/// cryptsetup reads up to 8 MiB from a key file; the agent takes 64 KiB.
/// The passphrase of a request cannot be larger anyway (a request is at
/// most 64 KiB, `rpc::limits`), and one bound for every source means a key
/// that works from one works from the others. It is 16 times the 4096-byte
/// random keys Confidential Containers makes for LUKS volumes, and it bounds
/// what one publish holds in the guest's memory.
pub const MAX_KEY_LEN: usize = 64 << 10;

/// The longest `key_uri`: a `file://` path must be shorter than PATH_MAX.
const MAX_URI_LEN: usize = PATH_MAX + "file://".len() - 1;

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

/// `uri` for a message: quoted, and cut to 80 bytes.
fn shown(uri: &str) -> String {
    let mut end = uri.len().min(80);
    while !uri.is_char_boundary(end) {
        end -= 1;
    }
    let more = if end < uri.len() { "…" } else { "" };
    format!("{:?}{more}", &uri[..end])
}

/// `key_uri`: `file:///absolute/path` or `kbs:///repository/type/tag`.
fn parse_uri(uri: &str) -> Result<KeySource, Invalid> {
    let bad = |why: &str| Invalid(format!("encryption.key_uri {} {why}", shown(uri)));
    if uri.is_empty() {
        return Err(Invalid(
            "encryption.key_uri is empty; name file:///absolute/path or kbs:///repository/type/tag"
                .into(),
        ));
    }
    if uri.len() > MAX_URI_LEN {
        return Err(bad(&format!(
            "is {} bytes long; at most {MAX_URI_LEN}",
            uri.len()
        )));
    }
    if uri.contains('\0') {
        return Err(bad("holds a NUL byte"));
    }
    if uri.chars().any(char::is_control) {
        return Err(bad("holds a control character"));
    }
    match uri.split_once("://") {
        Some(("file", rest)) => file_uri(rest).map_err(|why| bad(&why)),
        Some(("kbs", rest)) => kbs_uri(rest)
            .map(|()| KeySource::Cdh {
                resource: uri.to_string(),
            })
            .map_err(|why| bad(&why)),
        Some((scheme, _)) if scheme.starts_with("kbs+") => Err(bad(
            "names a KBS plugin; the agent takes keys from the KBS's resource plugin \
             only: write kbs:///repository/type/tag",
        )),
        _ => Err(bad(
            "is not a key URI the agent takes: file:///absolute/path (a file in the guest) \
             or kbs:///repository/type/tag (a KBS resource, through the Confidential Data Hub)",
        )),
    }
}

/// What follows `file://`: an empty host, then an absolute path with no
/// `.`, `..` or empty component, taken as it is written (nothing is
/// percent-decoded, so `%`, `?` and `#`, which a URI reader would, are refused).
fn file_uri(rest: &str) -> Result<KeySource, String> {
    if !rest.starts_with('/') {
        return Err(
            "names a host or a relative path; the agent reads only its own files, by absolute \
             path: write file:///absolute/path"
                .into(),
        );
    }
    if let Some(c) = rest.chars().find(|c| matches!(c, '%' | '?' | '#')) {
        return Err(format!(
            "holds {c:?}, which the agent does not decode as a URI reader would: name a path \
             without %, ? or #"
        ));
    }
    let components: Vec<&str> = rest[1..].split('/').collect();
    if components.iter().any(|c| c.is_empty()) {
        return Err("has an empty path component (a trailing or a doubled /): name a file".into());
    }
    if components.iter().any(|c| *c == "." || *c == "..") {
        return Err("has a . or .. component: name the file by its plain absolute path".into());
    }
    fits_the_kernel("names a path that", rest).map_err(|e| e.0)?;
    Ok(KeySource::File(PathBuf::from(rest)))
}

/// What follows `kbs://`: an empty host (the CDH asks the KBS it was
/// configured with and ignores one named here, so naming one would mislead),
/// then exactly `repository/type/tag`, each as the KBS's resource plugin
/// takes it: `[A-Za-z0-9_-][A-Za-z0-9_.-]*`, so never `.`, `..` or empty;
/// no query and no fragment (the CDH's URI reader would drop a fragment).
fn kbs_uri(rest: &str) -> Result<(), String> {
    let Some(path) = rest.strip_prefix('/') else {
        return Err(
            "names a KBS host; the Confidential Data Hub ignores it and asks the KBS it was \
             configured with: write kbs:///repository/type/tag"
                .into(),
        );
    };
    if let Some(c) = path.chars().find(|c| matches!(c, '?' | '#')) {
        return Err(format!(
            "holds {c:?}: a KBS resource URI takes no query or fragment here"
        ));
    }
    let segments: Vec<&str> = path.split('/').collect();
    if segments.len() != 3 {
        return Err(format!(
            "has {} path segments; a KBS resource is named by three: kbs:///repository/type/tag",
            segments.len()
        ));
    }
    for (name, s) in ["repository", "type", "tag"].iter().zip(&segments) {
        let ok = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-');
        match s.as_bytes() {
            [] => return Err(format!("has an empty {name}")),
            b if b.len() > NAME_MAX => {
                return Err(format!(
                    "has a {name} of {} bytes; at most {NAME_MAX}",
                    b.len()
                ))
            }
            [first, ..] if !ok(*first) => {
                return Err(format!(
                    "has a {name} starting with {:?}; each of repository, type and tag starts \
                     with a letter, a digit, _ or -",
                    char::from(*first)
                ))
            }
            b if !b.iter().all(|&c| ok(c) || c == b'.') => {
                return Err(format!(
                    "has a {name} with a character other than letters, digits, _, - and ."
                ))
            }
            _ => {}
        }
    }
    Ok(())
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
