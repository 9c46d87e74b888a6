//! The kernel keyring, for one job: a `logon` key that dm-crypt reads by its
//! description while a table loads (`:<size>:logon:<description>` in the
//! `crypt` line, see `sys::dm::CryptKey::Logon`). A logon key can be used by
//! the kernel but never read back by user space, root included, so the
//! volume key is in no table readback and no keyctl answer. Only add_key and
//! the keyctl calls that link, unlink and revoke are wrapped.

use crate::sys::error::SysError;

/// A keyring named by its special id (`KEY_SPEC_*` in `linux/keyctl.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keyring {
    /// The calling thread's: found by a DM_TABLE_LOAD made on that thread only.
    Thread = -1,
    /// The calling process's: gone when the process ends.
    Process = -2,
    /// The user's (uid 0 for the agent): outlives the agent, until the kernel
    /// ends or the key is unlinked.
    User = -4,
}

/// `KEYCTL_*` operations (`linux/keyctl.h`).
const KEYCTL_REVOKE: libc::c_long = 3;
const KEYCTL_LINK: libc::c_long = 8;
const KEYCTL_UNLINK: libc::c_long = 9;
const KEYCTL_SEARCH: libc::c_long = 10;
#[cfg(test)]
const KEYCTL_READ: libc::c_long = 11;

/// A key's serial number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySerial(pub i32);

/// Checks a logon key's description: the kernel wants "<service>:<rest>"
/// (a prefix before a colon), and a `crypt` line wants no whitespace.
pub fn check_description(description: &str) -> Result<(), &'static str> {
    match description.split_once(':') {
        Some((service, rest)) if !service.is_empty() && !rest.is_empty() => {}
        _ => return Err("a logon key's description is <service>:<name>"),
    }
    if !description.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("a logon key's description is printable ASCII without spaces");
    }
    Ok(())
}

/// add_key("logon", `description`, `key`, `into`): the key, held by the
/// kernel and unreadable from user space. Adding a key with a description
/// already in `into` replaces its payload and keeps its serial.
pub fn add_logon(description: &str, key: &[u8], into: Keyring) -> Result<KeySerial, SysError> {
    let fail = |e: std::io::Error| SysError::new("add_key", format!("logon key {description}"), e);
    check_description(description)
        .map_err(|why| fail(std::io::Error::new(std::io::ErrorKind::InvalidInput, why)))?;
    let desc = std::ffi::CString::new(description)
        .map_err(|_| fail(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
    // SAFETY: add_key reads the NUL-terminated type and description, and
    // `key.len()` bytes from `key`, all live for the call; it writes nothing
    // back into our memory. It copies the payload into the kernel.
    let r = unsafe {
        libc::syscall(
            libc::SYS_add_key,
            c"logon".as_ptr(),
            desc.as_ptr(),
            key.as_ptr(),
            key.len(),
            into as libc::c_int,
        )
    };
    if r < 0 {
        return Err(fail(std::io::Error::last_os_error()));
    }
    i32::try_from(r)
        .map(KeySerial)
        .map_err(|_| fail(std::io::Error::from(std::io::ErrorKind::InvalidData)))
}

/// KEYCTL_SEARCH for a logon key described `description` in `keyring`
/// (and the keyrings linked from it): its serial, or None when there is none.
pub fn search_logon(keyring: Keyring, description: &str) -> Result<Option<KeySerial>, SysError> {
    let fail =
        |e: std::io::Error| SysError::new("KEYCTL_SEARCH", format!("logon key {description}"), e);
    let desc = std::ffi::CString::new(description)
        .map_err(|_| fail(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
    // SAFETY: KEYCTL_SEARCH reads the NUL-terminated type and description,
    // both live for the call, and writes nothing into our memory (the
    // destination keyring, 0, is none).
    let r = unsafe {
        libc::syscall(
            libc::SYS_keyctl,
            KEYCTL_SEARCH,
            keyring as libc::c_int,
            c"logon".as_ptr(),
            desc.as_ptr(),
            0 as libc::c_int,
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOKEY | libc::EKEYREVOKED | libc::EKEYEXPIRED) => Ok(None),
            _ => Err(fail(e)),
        };
    }
    i32::try_from(r)
        .map(|s| Some(KeySerial(s)))
        .map_err(|_| fail(std::io::Error::from(std::io::ErrorKind::InvalidData)))
}

/// keyctl with integer arguments only.
fn keyctl(op: libc::c_long, a: libc::c_long, b: libc::c_long) -> std::io::Result<libc::c_long> {
    // SAFETY: the operations used here (revoke, link, unlink) take key
    // serials as integers and no pointers; nothing of ours is read or written.
    let r = unsafe { libc::syscall(libc::SYS_keyctl, op, a, b) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

/// KEYCTL_REVOKE: the key is unusable at once, wherever it is linked (a
/// table already loaded keeps its own copy in dm-crypt).
pub fn revoke(key: KeySerial) -> Result<(), SysError> {
    keyctl(KEYCTL_REVOKE, key.0.into(), 0)
        .map(drop)
        .map_err(|e| SysError::new("KEYCTL_REVOKE", format!("key {}", key.0), e))
}

/// KEYCTL_UNLINK: `key` no longer in `from` (the kernel frees it once no
/// keyring holds it).
pub fn unlink(key: KeySerial, from: Keyring) -> Result<(), SysError> {
    keyctl(KEYCTL_UNLINK, key.0.into(), (from as i32).into())
        .map(drop)
        .map_err(|e| SysError::new("KEYCTL_UNLINK", format!("key {} from {from:?}", key.0), e))
}

/// KEYCTL_LINK: `keyring` linked into `into`, so that a search of `into`
/// (dm-crypt's, from the agent's thread) also finds its keys. E.g. the user
/// keyring into the process keyring of an agent that systemd gave a private
/// session keyring.
pub fn link(keyring: Keyring, into: Keyring) -> Result<(), SysError> {
    keyctl(KEYCTL_LINK, (keyring as i32).into(), (into as i32).into())
        .map(drop)
        .map_err(|e| SysError::new("KEYCTL_LINK", format!("{keyring:?} into {into:?}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// KEYCTL_READ into a buffer: what user space could get back.
    fn read(key: KeySerial) -> std::io::Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        // SAFETY: KEYCTL_READ writes at most `buf.len()` bytes into `buf`,
        // which lives for the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_keyctl,
                KEYCTL_READ,
                libc::c_long::from(key.0),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        buf.truncate(usize::try_from(r).unwrap().min(256));
        Ok(buf)
    }

    #[test]
    fn a_logon_key_is_added_never_read_back_and_revoked() {
        let desc = format!(
            "crust-test:dm-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        );
        let desc: String = desc.chars().filter(|c| !c.is_whitespace()).collect();
        let key = KeySerial(add_logon(&desc, &[7u8; 64], Keyring::Thread).unwrap().0);
        // The kernel holds it; user space, root included, cannot read it.
        let e = read(key).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP), "{e}");
        // The same description again: the same key, its payload replaced.
        assert_eq!(add_logon(&desc, &[8u8; 64], Keyring::Thread).unwrap(), key);
        revoke(key).unwrap();
        // Revoked: no longer usable, not even to revoke again.
        assert_eq!(revoke(key).unwrap_err().errno(), Some(libc::EKEYREVOKED));
        unlink(key, Keyring::Thread).unwrap();
    }

    #[test]
    fn a_description_the_kernel_would_refuse_is_refused_here() {
        for bad in ["nocolon", ":x", "x:", "a b:c", "a:b c"] {
            assert!(check_description(bad).is_err(), "{bad}");
            let e = add_logon(bad, &[1; 32], Keyring::Thread).unwrap_err();
            assert_eq!(e.call, "add_key");
        }
        check_description("cryptsetup:1b4e28ba-2fa1-11d2-883f-0016d3cca427-d0").unwrap();
    }
}
