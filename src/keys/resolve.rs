//! A key source turned into the key's bytes, in the guest: the passphrase
//! as the request gave it, a key file read as cryptsetup reads one, or a
//! KBS resource asked of the Confidential Data Hub. Every key leaves in a
//! buffer zeroed when dropped; none is logged or put in an error.

use std::path::PathBuf;
use std::time::Duration;

use zeroize::Zeroizing;

use super::error::Error;
use super::source::KeySource;
use super::{cdh, file};
use crate::cancel::Cancel;

/// The CDH's socket where Confidential Containers puts it (its
/// `DEFAULT_CDH_SOCKET_ADDR`, `unix:///run/confidential-containers/cdh.sock`).
pub const DEFAULT_CDH_SOCKET: &str = "/run/confidential-containers/cdh.sock";

/// How long the agent waits for the CDH when its caller allows longer: the
/// 50 s Confidential Containers' own clients of GetResource wait.
pub const DEFAULT_CDH_TIMEOUT: Duration = Duration::from_secs(50);

/// What resolving a key needs from the agent's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The CDH's ttrpc socket (`--cdh-socket`, `crust.cdh_socket=`).
    pub cdh_socket: PathBuf,
    /// The longest wait for the CDH's answer.
    pub cdh_timeout: Duration,
    /// The only directory `file:///` keys are read from (`--key-dir`,
    /// `crust.key_dir=`), so that a key_uri tells the host nothing of the
    /// guest's other files.
    pub key_dir: PathBuf,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            cdh_socket: PathBuf::from(DEFAULT_CDH_SOCKET),
            cdh_timeout: DEFAULT_CDH_TIMEOUT,
            key_dir: PathBuf::from(DEFAULT_KEY_DIR),
        }
    }
}

pub use super::file::DEFAULT_KEY_DIR;

/// `value` as the key directory: an absolute path.
pub fn key_dir(value: &str) -> Result<PathBuf, String> {
    if !value.starts_with('/') || value.contains('\0') {
        return Err(format!("key-dir {value:?} must be an absolute path"));
    }
    Ok(PathBuf::from(value))
}

/// The longest path a unix socket address holds (`sun_path`, less its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// `value` as the CDH's socket path: absolute, and short enough to connect to.
pub fn cdh_socket(value: &str) -> Result<PathBuf, String> {
    let path = value.strip_prefix("unix://").unwrap_or(value);
    if !path.starts_with('/') {
        return Err(format!("cdh-socket {value:?} must be an absolute path"));
    }
    if path.len() > MAX_SOCKET_PATH || path.contains('\0') {
        return Err(format!(
            "cdh-socket {value:?} cannot name a unix socket: at most {MAX_SOCKET_PATH} bytes, no NUL"
        ));
    }
    Ok(PathBuf::from(path))
}

/// The key `source` names: 1 to `MAX_KEY_LEN` bytes, or why it cannot be
/// had. Waits (for the CDH) end when `cancel` says so: its deadline is the
/// caller's.
pub fn resolve(
    source: &KeySource,
    config: &Config,
    cancel: &Cancel,
) -> Result<Zeroizing<Vec<u8>>, Error> {
    match source {
        KeySource::Passphrase(p) => Ok(Zeroizing::new(p.to_vec())),
        KeySource::File(path) => file::read(&config.key_dir, path, cancel),
        KeySource::Cdh { resource } => {
            cdh::get_resource(&config.cdh_socket, resource, config.cdh_timeout, cancel)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::source::RequestKey;

    #[test]
    fn the_socket_setting_is_an_absolute_path_a_socket_can_have() {
        assert_eq!(
            Config::default().cdh_socket,
            PathBuf::from(DEFAULT_CDH_SOCKET)
        );
        assert_eq!(
            cdh_socket("/run/cdh.sock"),
            Ok(PathBuf::from("/run/cdh.sock"))
        );
        // CoCo's own spelling of the same.
        assert_eq!(
            cdh_socket("unix:///run/confidential-containers/cdh.sock"),
            Ok(PathBuf::from(DEFAULT_CDH_SOCKET))
        );
        for bad in [
            "",
            "cdh.sock",
            "unix://cdh.sock",
            "/a\0b",
            &format!("/{}", "s".repeat(107)),
        ] {
            assert!(cdh_socket(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_passphrase_resolves_to_itself() {
        let s = KeySource::from_request(Some(RequestKey::Passphrase(Zeroizing::new(
            b"pw\n".to_vec(),
        ))))
        .unwrap();
        let key = resolve(&s, &Config::default(), &Cancel::never()).unwrap();
        assert_eq!(*key, b"pw\n");
    }
}
