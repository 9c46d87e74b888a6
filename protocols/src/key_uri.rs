//! A volume key named by reference, as crust.v1's `Encryption.key_uri`
//! carries it: a file in the guest (`file:///path`) or a resource of the
//! KBS that the Confidential Data Hub fetches (`kbs:///repository/type/tag`).
//! Lexical only: whether the file is there, or the CDH answers, is judged
//! in the guest when the key is read. crustd holds a direct-volume record's
//! `encryptionKey` to it before anything is plugged; the agent's
//! `keys::source` applies the same rule, in the same words, to a request.

/// The kernel's PATH_MAX, its terminating NUL included.
pub const PATH_MAX: usize = 4096;
/// The kernel's NAME_MAX: the longest path component, and the longest KBS
/// repository, type or tag.
pub const NAME_MAX: usize = 255;
/// The longest key URI: a `file://` path is then shorter than PATH_MAX.
pub const MAX_URI_LEN: usize = PATH_MAX + "file://".len() - 1;

/// Where a key comes from, borrowed from the URI that names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUri<'a> {
    /// A file in the guest, by its absolute path.
    File(&'a str),
    /// A resource of the KBS: the whole URI, as the CDH's GetResource takes it.
    Kbs(&'a str),
}

/// Why a key URI is refused; each sentence follows the URI it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("is empty; name file:///absolute/path or kbs:///repository/type/tag")]
    Empty,
    #[error("is {0} bytes long; at most {MAX_URI_LEN}")]
    TooLong(usize),
    #[error("holds a NUL byte")]
    Nul,
    #[error("holds a control character")]
    Control,
    #[error("names a KBS plugin; the agent takes keys from the KBS's resource plugin only: write kbs:///repository/type/tag")]
    KbsPlugin,
    #[error("is not a key URI the agent takes: file:///absolute/path (a file in the guest) or kbs:///repository/type/tag (a KBS resource, through the Confidential Data Hub)")]
    NotKeyUri,
    #[error("names a host or a relative path; the agent reads only its own files, by absolute path: write file:///absolute/path")]
    FileHost,
    #[error("holds {0:?}, which the agent does not decode as a URI reader would: name a path without %, ? or #")]
    FileEscape(char),
    #[error("has an empty path component (a trailing or a doubled /): name a file")]
    EmptyComponent,
    #[error("has a . or .. component: name the file by its plain absolute path")]
    DotComponent,
    #[error("names a path with a component of {0} bytes; each may be at most {NAME_MAX}")]
    LongComponent(usize),
    #[error("names a KBS host; the Confidential Data Hub ignores it and asks the KBS it was configured with: write kbs:///repository/type/tag")]
    KbsHost,
    #[error("holds {0:?}: a KBS resource URI takes no query or fragment here")]
    KbsQuery(char),
    #[error("has {0} path segments; a KBS resource is named by three: kbs:///repository/type/tag")]
    Segments(usize),
    #[error("has an empty {0}")]
    EmptySegment(&'static str),
    #[error("has a {0} of {1} bytes; at most {NAME_MAX}")]
    LongSegment(&'static str, usize),
    #[error("has a {0} starting with {1:?}; each of repository, type and tag starts with a letter, a digit, _ or -")]
    SegmentStart(&'static str, char),
    #[error("has a {0} with a character other than letters, digits, _, - and .")]
    SegmentChar(&'static str),
}

/// `uri` for a message: quoted, and cut to 80 bytes.
pub fn shown(uri: &str) -> String {
    let mut end = uri.len().min(80);
    while !uri.is_char_boundary(end) {
        end -= 1;
    }
    let more = if end < uri.len() { "…" } else { "" };
    format!("{:?}{more}", &uri[..end])
}

/// `file:///absolute/path` or `kbs:///repository/type/tag`, or why not.
pub fn parse(uri: &str) -> Result<KeyUri<'_>, Refused> {
    if uri.is_empty() {
        return Err(Refused::Empty);
    }
    if uri.len() > MAX_URI_LEN {
        return Err(Refused::TooLong(uri.len()));
    }
    if uri.contains('\0') {
        return Err(Refused::Nul);
    }
    if uri.chars().any(char::is_control) {
        return Err(Refused::Control);
    }
    match uri.split_once("://") {
        Some(("file", rest)) => file(rest).map(KeyUri::File),
        Some(("kbs", rest)) => kbs(rest).map(|()| KeyUri::Kbs(uri)),
        Some((scheme, _)) if scheme.starts_with("kbs+") => Err(Refused::KbsPlugin),
        _ => Err(Refused::NotKeyUri),
    }
}

/// What follows `file://`: an empty host, then an absolute path with no
/// `.`, `..` or empty component, taken as it is written (nothing is
/// percent-decoded, so `%`, `?` and `#`, which a URI reader would, are refused).
fn file(rest: &str) -> Result<&str, Refused> {
    if !rest.starts_with('/') {
        return Err(Refused::FileHost);
    }
    if let Some(c) = rest.chars().find(|c| matches!(c, '%' | '?' | '#')) {
        return Err(Refused::FileEscape(c));
    }
    let components: Vec<&str> = rest[1..].split('/').collect();
    if components.iter().any(|c| c.is_empty()) {
        return Err(Refused::EmptyComponent);
    }
    if components.iter().any(|c| *c == "." || *c == "..") {
        return Err(Refused::DotComponent);
    }
    if let Some(long) = components.iter().find(|c| c.len() > NAME_MAX) {
        return Err(Refused::LongComponent(long.len()));
    }
    Ok(rest)
}

/// What follows `kbs://`: an empty host (the CDH asks the KBS it was
/// configured with and ignores one named here, so naming one would mislead),
/// then exactly `repository/type/tag`, each as the KBS's resource plugin
/// takes it: `[A-Za-z0-9_-][A-Za-z0-9_.-]*`, so never `.`, `..` or empty;
/// no query and no fragment (the CDH's URI reader would drop a fragment).
fn kbs(rest: &str) -> Result<(), Refused> {
    let Some(path) = rest.strip_prefix('/') else {
        return Err(Refused::KbsHost);
    };
    if let Some(c) = path.chars().find(|c| matches!(c, '?' | '#')) {
        return Err(Refused::KbsQuery(c));
    }
    let segments: Vec<&str> = path.split('/').collect();
    if segments.len() != 3 {
        return Err(Refused::Segments(segments.len()));
    }
    let ok = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-');
    for (name, s) in ["repository", "type", "tag"].into_iter().zip(&segments) {
        match s.as_bytes() {
            [] => return Err(Refused::EmptySegment(name)),
            b if b.len() > NAME_MAX => return Err(Refused::LongSegment(name, b.len())),
            [first, ..] if !ok(*first) => {
                return Err(Refused::SegmentStart(name, char::from(*first)))
            }
            b if !b.iter().all(|&c| ok(c) || c == b'.') => return Err(Refused::SegmentChar(name)),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
            assert_eq!(parse(u), Ok(KeyUri::File(path)), "{u}");
        }
        let long = format!("file:///{}/{}", "a".repeat(255), "b".repeat(200));
        assert!(matches!(parse(&long), Ok(KeyUri::File(_))));
        let longest = format!(
            "file:///{}{}",
            format!("{}/", "a".repeat(200)).repeat(20),
            "a".repeat(74)
        );
        assert_eq!(longest.len(), MAX_URI_LEN);
        assert!(matches!(parse(&longest), Ok(KeyUri::File(_))));
        let over = format!("{longest}a");
        assert_eq!(parse(&over), Err(Refused::TooLong(MAX_URI_LEN + 1)));
    }

    #[test]
    fn kbs_uris_name_three_segments_as_the_kbs_takes_them() {
        for u in [
            "kbs:///default/key/1",
            "kbs:///alice/cosign-key/213",
            "kbs:///123--_default/1Abff-_/___-afds44BC",
            "kbs:///1.ok/2ok./3...",
        ] {
            assert_eq!(parse(u), Ok(KeyUri::Kbs(u)), "{u}");
        }
    }

    #[test]
    fn bad_uris_are_refused_with_their_reason() {
        use Refused::*;
        let table: &[(&str, Refused)] = &[
            ("", Empty),
            ("/etc/key", NotKeyUri),
            ("key", NotKeyUri),
            ("http://kbs/a/b/c", NotKeyUri),
            ("File:///etc/key", NotKeyUri),
            ("file:/etc/key", NotKeyUri),
            ("file://etc/key", FileHost),
            ("file://host/etc/key", FileHost),
            ("file://", FileHost),
            ("file:///", EmptyComponent),
            ("file:///etc/keys/", EmptyComponent),
            ("file:///etc//key", EmptyComponent),
            ("file:///etc/../key", DotComponent),
            ("file:///etc/./key", DotComponent),
            ("file:///..", DotComponent),
            ("file:///etc/my%20key", FileEscape('%')),
            ("file:///etc/key?x", FileEscape('?')),
            ("file:///etc/key#x", FileEscape('#')),
            ("file:///etc/key\0", Nul),
            ("file:///etc/key\n", Control),
            ("kbs:///a/b/c\0", Nul),
            ("kbs://kbs.example:8080/a/b/c", KbsHost),
            ("kbs://a/b/c", KbsHost),
            ("kbs:///a/b", Segments(2)),
            ("kbs:///a/b/c/d", Segments(4)),
            ("kbs:///", Segments(1)),
            ("kbs:///a//c", EmptySegment("type")),
            ("kbs:///a/b/", EmptySegment("tag")),
            ("kbs:///../b/c", SegmentStart("repository", '.')),
            ("kbs:///a/../c", SegmentStart("type", '.')),
            ("kbs:///a/b/.hidden", SegmentStart("tag", '.')),
            ("kbs:///a/b/c d", SegmentChar("tag")),
            ("kbs:///a/b/c%2f", SegmentChar("tag")),
            ("kbs:///a/b/c?x=1", KbsQuery('?')),
            ("kbs:///a/b/c#f", KbsQuery('#')),
            ("kbs+pkcs11:///a/b/c", KbsPlugin),
        ];
        for (u, why) in table {
            assert_eq!(parse(u).as_ref(), Err(why), "{u:?}");
        }
        let long_name = format!("file:///{}", "a".repeat(256));
        assert_eq!(parse(&long_name), Err(LongComponent(256)));
        let long_tag = format!("kbs:///a/b/{}", "t".repeat(256));
        assert_eq!(parse(&long_tag), Err(LongSegment("tag", 256)));
    }

    #[test]
    fn the_sentences_say_what_to_write() {
        assert_eq!(
            Refused::KbsHost.to_string(),
            "names a KBS host; the Confidential Data Hub ignores it and asks the KBS it was \
             configured with: write kbs:///repository/type/tag"
        );
        assert_eq!(
            Refused::Segments(2).to_string(),
            "has 2 path segments; a KBS resource is named by three: kbs:///repository/type/tag"
        );
        assert_eq!(
            Refused::SegmentStart("tag", '.').to_string(),
            "has a tag starting with '.'; each of repository, type and tag starts with a \
             letter, a digit, _ or -"
        );
    }

    #[test]
    fn a_uri_is_shown_cut() {
        assert_eq!(shown("kbs:///a/b/c"), "\"kbs:///a/b/c\"");
        let s = shown(&format!("gopher://{}", "é".repeat(100)));
        assert!(s.ends_with('…') && s.len() < 100, "{s}");
    }
}
