//! The names the contracts carry, and the one place their rules are written:
//! a disk's virtio-blk serial (crust.v1's `serial`: the agent finds the disk
//! by it, crust-vm and crustd set it on the disk) and a pod sandbox's id
//! (CRUST's `sandbox_id`: crustd's registry directory `DIR/<id>`). Every
//! crate that takes or makes such a name checks it here, so the agent, the
//! harness and the daemon can never disagree on what is valid.
//!
//! Both are ASCII letters, digits, `.`, `_` and `-`: bytes that need no
//! quoting in a path, a QMP argument, a log line or a kernel command line.

/// The longest virtio-blk serial: `VIRTIO_BLK_ID_BYTES`, the serial's field
/// in the device's config space (a longer one is cut by QEMU, so the guest
/// would see another name).
pub const SERIAL_MAX: usize = 20;
/// The longest sandbox id (CRI's are 64 hex digits).
pub const SANDBOX_ID_MAX: usize = 128;

/// Why a name is refused; the message names the field and says what is
/// allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadName(String);

/// Whether `b` may appear in a name: `[A-Za-z0-9._-]`.
pub fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

/// The first character of `s` that may not appear in a name.
fn stray(s: &str) -> Option<char> {
    s.chars()
        .find(|c| !u8::try_from(*c).is_ok_and(is_name_byte))
}

/// A virtio-blk serial: 1 to [`SERIAL_MAX`] bytes of `[A-Za-z0-9._-]`.
pub fn serial(s: &str) -> Result<(), BadName> {
    if s.is_empty() {
        return Err(BadName(
            "serial is empty; give the virtio-blk serial the host set on the disk".into(),
        ));
    }
    if s.len() > SERIAL_MAX {
        return Err(BadName(format!(
            "serial {s:?} is {} bytes long; virtio-blk serials hold at most {SERIAL_MAX} bytes",
            s.len()
        )));
    }
    if let Some(c) = stray(s) {
        return Err(BadName(format!(
            "serial {s:?} contains {c:?}; only [A-Za-z0-9._-] are allowed"
        )));
    }
    Ok(())
}

/// A sandbox id: 1 to [`SANDBOX_ID_MAX`] bytes of `[A-Za-z0-9._-]`, not `.`
/// or `..`, so that it names exactly one directory beneath the registry.
pub fn sandbox_id(id: &str) -> Result<(), BadName> {
    if id.is_empty() {
        return Err(BadName(
            "sandbox_id is empty: give the pod sandbox's id".into(),
        ));
    }
    if id.len() > SANDBOX_ID_MAX || id == "." || id == ".." || stray(id).is_some() {
        return Err(BadName(format!(
            "sandbox_id {id:?} is not 1-{SANDBOX_ID_MAX} characters of [A-Za-z0-9._-] (and not . or ..)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials() {
        for good in [
            "vol-0123456789abcdef",
            "a",
            "A.b_c-9",
            "cr-0123456789abcdef",
            "..",
            "-",
        ] {
            assert_eq!(serial(good), Ok(()), "{good}");
        }
        for (bad, says) in [
            ("", "serial is empty"),
            (
                "vol-0123456789abcdefg",
                "21 bytes long; virtio-blk serials hold at most 20",
            ),
            ("has space", "contains ' '"),
            ("comma,x", "contains ','"),
            ("é", "contains 'é'"),
            ("nul\0", "contains '\\0'"),
            ("a/b", "contains '/'"),
        ] {
            let e = serial(bad).expect_err(bad).to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn sandbox_ids() {
        let cri = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        for good in ["a", cri, "pod_1.x-y", "...", &"x".repeat(128)] {
            assert_eq!(sandbox_id(good), Ok(()), "{good}");
        }
        assert!(sandbox_id("")
            .unwrap_err()
            .to_string()
            .contains("sandbox_id is empty"));
        for bad in [
            ".",
            "..",
            "a/b",
            "../etc",
            "has space",
            "é",
            &"x".repeat(129),
        ] {
            let e = sandbox_id(bad).expect_err(bad).to_string();
            assert!(
                e.contains("sandbox_id") && e.contains("[A-Za-z0-9._-]"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn the_charset_is_exactly_letters_digits_dot_underscore_dash() {
        let allowed: Vec<u8> = (0..=255u8).filter(|b| is_name_byte(*b)).collect();
        let want: Vec<u8> = (b'0'..=b'9')
            .chain(b'A'..=b'Z')
            .chain(b'a'..=b'z')
            .chain([b'.', b'_', b'-'])
            .collect();
        let mut want = want;
        want.sort_unstable();
        assert_eq!(allowed, want);
    }
}
