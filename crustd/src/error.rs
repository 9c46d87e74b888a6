//! crustd's one error: it joins the error of every module (each of which
//! owns its error, says its code and writes its sentence: what went wrong
//! and what to do), so that `service` has one thing to turn into a gRPC
//! status. Nothing below `volumes` imports it.

/// The gRPC status codes, one table for the agent, crust-client and crustd.
pub use crust_protocols::code::Code;

crust_protocols::coded_errors! {
/// Every error a call can end in.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[code(inner)]
    #[error(transparent)]
    HostDevice(#[from] crate::hostdev::Error),
    #[code(inner)]
    #[error(transparent)]
    Devices(#[from] crate::devices::Error),
    #[code(inner)]
    #[error(transparent)]
    State(#[from] crate::state::Error),
    #[code(inner)]
    #[error(transparent)]
    Qmp(#[from] crate::hotplug::Error),
    #[code(inner)]
    #[error(transparent)]
    Monitor(#[from] crate::monitor::Error),
    #[code(inner)]
    #[error(transparent)]
    Registry(#[from] crate::registry::Error),
    #[code(inner)]
    #[error(transparent)]
    Agent(#[from] crate::agent::Error),
    #[code(inner)]
    #[error(transparent)]
    Direct(#[from] crate::direct::Error),
    #[code(inner)]
    #[error(transparent)]
    Mkfs(#[from] crate::mkfs::Error),
    #[code(inner)]
    #[error(transparent)]
    Freeze(#[from] crate::freezes::FreezeError),
    #[code(inner)]
    #[error(transparent)]
    Volume(#[from] crate::volumes::error::Error),
    /// A sandbox's freeze failed, so the group's freeze was undone: the
    /// sandbox's error, with its code, and what may be left frozen.
    #[code(error => error.code())]
    #[error("sandbox {sandbox} could not freeze its volumes ({error}), so the group's freeze is undone: {left}")]
    FreezeRefused {
        sandbox: String,
        error: Box<Error>,
        left: crate::freezes::Leftover,
    },
    /// No session with a sandbox's monitor.
    #[code(error => error.code())]
    #[error("{error}; sandbox {sandbox}")]
    Session {
        sandbox: String,
        error: crate::monitor::Error,
    },
    /// The agent's publish outlived the caller's deadline and goes on in
    /// the guest: its words, as DEADLINE_EXCEEDED.
    #[code(DeadlineExceeded)]
    #[error(transparent)]
    Outlived(crate::agent::Error),
    /// A publish failed, and so did its undo: the record stays
    /// `unplugging` for RuntimeUnpublishVolume to finish.
    #[code(error => error.code())]
    #[error("{error}; undoing the publish failed too ({}); RuntimeUnpublishVolume will finish it", .undo.coded())]
    Undone { error: Box<Error>, undo: Box<Error> },
    /// A device claimed by a volume of a sandbox whose VM is gone, which
    /// could not be freed.
    #[code(claim => claim.code())]
    #[error("{claim}; {forget}")]
    Unfreed {
        claim: crate::devices::Error,
        forget: Box<Error>,
    },
    /// A forced thaw that some volumes refused: each one's error, the
    /// first one's code.
    #[code(failed => failed.first().map_or(Code::Internal, Error::code))]
    #[error("the forced thaw ended what it could, but not all: {}", Joined(.failed))]
    Unthawed { failed: Vec<Error> },
    #[code(DeadlineExceeded)]
    #[error("{method} was still at work at the caller's deadline: it goes on, and the same call made again joins it")]
    StillAtWork { method: &'static str },
    #[code(Internal)]
    #[error("{method} ended without an answer")]
    NoAnswer { method: &'static str },
    /// The sandbox's (or the node's) calls were all at work until the
    /// caller's deadline.
    #[code(ResourceExhausted)]
    #[error("sandbox {sandbox} has {per_sandbox} calls at work (its VM is slow to answer, or gone), or the node {node}: this {method} waited for a turn until its deadline and did nothing; retry")]
    NoTurn { sandbox: String, per_sandbox: usize, node: usize, method: &'static str },
    #[code(Internal)]
    #[error("{method} panicked; crustd goes on")]
    Panicked { method: &'static str },
}
}

impl Error {
    /// The error as "CODE: message", as another error's sentence quotes it.
    pub fn coded(&self) -> Coded<'_> {
        Coded(self)
    }
}

/// Errors shown one after another, "; " between them.
struct Joined<'a>(&'a [Error]);

impl std::fmt::Display for Joined<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// An error shown as "CODE: message" ([`Error::coded`]).
#[derive(Debug, Clone, Copy)]
pub struct Coded<'a>(&'a Error);

impl std::fmt::Display for Coded<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.0.code().name(), self.0)
    }
}

/// A sandbox id that breaks the rule is the registry's refusal.
impl From<crust_protocols::names::BadName> for Error {
    fn from(e: crust_protocols::names::BadName) -> Error {
        Error::Registry(e.into())
    }
}

/// Result with crustd's error.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::Key;
    use crate::volumes::error::Error as Refused;

    /// The errors that join others keep the words each had, and the code
    /// of the one the caller must act on.
    #[test]
    fn joined_errors_say_each_part() {
        let key = Key::new("pod-a", "/dev/loop3");
        let undone = Error::Undone {
            error: Box::new(Refused::LateToPlug(key.clone()).into()),
            undo: Box::new(Refused::VolumeBusy(key.clone()).into()),
        };
        assert_eq!(undone.code(), Code::DeadlineExceeded);
        assert_eq!(
            undone.to_string(),
            "the caller's deadline passed before host volume /dev/loop3 was plugged into sandbox pod-a: nothing was plugged; retry; undoing the publish failed too (DEADLINE_EXCEEDED: another call for host volume /dev/loop3 in sandbox pod-a was still running at the caller's deadline; nothing was done: retry); RuntimeUnpublishVolume will finish it"
        );
        let failed = Error::Unthawed {
            failed: vec![
                Refused::NotPublished(key.clone()).into(),
                Refused::NotPublished(Key::new("pod-b", "/dev/x")).into(),
            ],
        };
        assert_eq!(failed.code(), Code::NotFound);
        assert_eq!(
            failed.to_string(),
            "the forced thaw ended what it could, but not all: host volume /dev/loop3 is not published in sandbox pod-a; host volume /dev/x is not published in sandbox pod-b"
        );
    }
}
