//! What resolving a key can end in, each with its code. No variant holds
//! key material: only a file's path, a KBS resource's name, sizes, errnos,
//! and what the Confidential Data Hub said when it refused.

use std::path::PathBuf;

use rustix::io::Errno;

use super::source::MAX_KEY_LEN;
use crate::cancel::Stopped;
use crate::code::Code;

crate::code::coded_errors! {
/// What can go wrong getting a key from a file or from the CDH.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(errno => open_code(*errno))]
    #[error("the key file {} cannot be opened in the guest: {errno}{}", path.display(), open_hint(*errno))]
    FileOpen {
        path: PathBuf,
        errno: Errno,
    },
    #[code(InvalidArgument)]
    #[error("encryption.key_uri names a file that is not beneath the agent's key directory {}; the agent reads file:/// keys only there (--key-dir, crust.key_dir=)", dir.display())]
    OutsideKeyDir { dir: PathBuf },
    #[code(FailedPrecondition)]
    #[error("the key file {} is {kind}, not a regular file; the agent reads a key only from a regular file (a FIFO or a device could block or never end)", path.display())]
    NotRegular {
        path: PathBuf,
        /// "a FIFO", "a directory", ….
        kind: &'static str,
    },
    #[code(Internal)]
    #[error("reading the key file {} failed: {errno}", path.display())]
    FileRead {
        path: PathBuf,
        errno: Errno,
    },
    #[code(FailedPrecondition)]
    #[error("{from} holds {size} bytes, more than the {MAX_KEY_LEN} a key may have (docs/encryption.md)")]
    TooLarge {
        /// The key source, as its Display says it.
        from: String,
        /// The size seen (a file that grows while read: what was read).
        size: u64,
    },
    #[code(FailedPrecondition)]
    #[error("{from} is empty; a key has at least one byte")]
    Empty {
        /// The key source, as its Display says it.
        from: String,
    },
    #[code(Unavailable)]
    #[error("the Confidential Data Hub is not running at {} ({errno}): start it, or point the agent at its socket (--cdh-socket, crust.cdh_socket=), and retry", socket.display())]
    CdhNotRunning {
        socket: PathBuf,
        errno: Errno,
    },
    #[code(Unavailable)]
    #[error("cannot connect to the Confidential Data Hub at {}: {errno}", socket.display())]
    CdhConnect {
        socket: PathBuf,
        errno: Errno,
    },
    #[code(Unavailable)]
    #[error("the connection to the Confidential Data Hub at {} failed while {during}: {errno}; retry", socket.display())]
    CdhIo {
        socket: PathBuf,
        /// "sending the request", "reading the answer".
        during: &'static str,
        errno: Errno,
    },
    #[code(Unavailable)]
    #[error("the Confidential Data Hub at {} closed the connection before it answered (did it restart?); retry", socket.display())]
    CdhClosed {
        socket: PathBuf,
    },
    #[code(Unavailable)]
    #[error("the Confidential Data Hub at {} did not answer for {resource} within {seconds} s; retry once the guest is attested and the CDH reaches its KBS", socket.display())]
    CdhSilent {
        socket: PathBuf,
        resource: String,
        /// How long the agent waited.
        seconds: u64,
    },
    #[code(FailedPrecondition)]
    #[error("the Confidential Data Hub at {} answered {len} bytes for {resource}, more than a key of at most {MAX_KEY_LEN} bytes needs; none of it was read", socket.display())]
    CdhAnswerTooLarge {
        socket: PathBuf,
        resource: String,
        /// The answer's length, as its frame announced it.
        len: u32,
    },
    #[code(FailedPrecondition)]
    #[error("what listens at {} does not answer as the Confidential Data Hub does ({what}); is it the CDH's ttrpc socket?", socket.display())]
    CdhProtocol {
        socket: PathBuf,
        /// What was wrong with the answer.
        what: String,
    },
    #[code(status => refused_code(*status))]
    #[error("the Confidential Data Hub at {} could not get {resource}: it answered {status}: {message}", socket.display())]
    CdhRefused {
        socket: PathBuf,
        resource: String,
        /// The code of the CDH's ttrpc status.
        status: Code,
        /// Its message, cut to a length a log line can carry.
        message: String,
    },
    #[code(inner)]
    #[error(transparent)]
    Stopped(#[from] Stopped),
}
}

/// A key file that cannot be opened: missing is NOT_FOUND, forbidden
/// PERMISSION_DENIED, a path the kernel will not open as a file (a symlink
/// loop, a socket) FAILED_PRECONDITION, anything else INTERNAL.
fn open_code(errno: Errno) -> Code {
    match errno {
        Errno::NOENT | Errno::NOTDIR => Code::NotFound,
        Errno::ACCESS | Errno::PERM => Code::PermissionDenied,
        Errno::LOOP | Errno::NXIO | Errno::NODEV | Errno::NAMETOOLONG | Errno::OPNOTSUPP => {
            Code::FailedPrecondition
        }
        _ => Code::Internal,
    }
}

/// What to do about a key file that cannot be opened, where it is plain.
fn open_hint(errno: Errno) -> &'static str {
    match open_code(errno) {
        Code::NotFound => {
            "; put the key there before publishing, or name another encryption.key_uri"
        }
        _ => "",
    }
}

/// The agent's code for the CDH's refusal. A code that says what went
/// wrong in the caller's terms passes through; the rest, INTERNAL above all
/// (the CDH answers every failure of the KBS, of attestation or of its
/// policy with INTERNAL), is FAILED_PRECONDITION: the agent is not at
/// fault, and the key cannot be had until something outside it changes.
fn refused_code(status: Code) -> Code {
    match status {
        Code::InvalidArgument
        | Code::NotFound
        | Code::PermissionDenied
        | Code::Unauthenticated
        | Code::ResourceExhausted
        | Code::FailedPrecondition
        | Code::Aborted
        | Code::DeadlineExceeded
        | Code::Unavailable => status,
        _ => Code::FailedPrecondition,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_errors_say_what_the_caller_can_do() {
        let open = |errno| Error::FileOpen {
            path: "/k".into(),
            errno,
        };
        for (errno, code) in [
            (Errno::NOENT, Code::NotFound),
            (Errno::NOTDIR, Code::NotFound),
            (Errno::ACCESS, Code::PermissionDenied),
            (Errno::PERM, Code::PermissionDenied),
            (Errno::LOOP, Code::FailedPrecondition),
            (Errno::NXIO, Code::FailedPrecondition),
            (Errno::IO, Code::Internal),
        ] {
            assert_eq!(open(errno).code(), code, "{errno:?}");
        }
        let missing = open(Errno::NOENT).to_string();
        assert!(
            missing.starts_with("the key file /k cannot be opened")
                && missing.contains("put the key there"),
            "{missing}"
        );
        assert!(!open(Errno::ACCESS).to_string().contains("put the key"));
    }

    #[test]
    fn the_cdhs_refusals_map_to_the_callers_terms() {
        let refused = |status| Error::CdhRefused {
            socket: "/s".into(),
            resource: "kbs:///a/b/c".into(),
            status,
            message: "m".into(),
        };
        for (status, code) in [
            (Code::NotFound, Code::NotFound),
            (Code::PermissionDenied, Code::PermissionDenied),
            (Code::Unavailable, Code::Unavailable),
            (Code::Internal, Code::FailedPrecondition),
            (Code::Unknown, Code::FailedPrecondition),
            (Code::Unimplemented, Code::FailedPrecondition),
            (Code::Cancelled, Code::FailedPrecondition),
        ] {
            assert_eq!(refused(status).code(), code, "{status}");
        }
        assert_eq!(
            refused(Code::Internal).to_string(),
            "the Confidential Data Hub at /s could not get kbs:///a/b/c: it answered INTERNAL: m"
        );
    }
}
