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
    /// No session with a sandbox's monitor.
    #[code(error => error.code())]
    #[error("{error}; sandbox {sandbox}")]
    Session {
        sandbox: String,
        error: crate::monitor::Error,
    },
    /// A code and its sentence, not yet typed.
    #[code(code => *code)]
    #[error("{message}")]
    Legacy { code: Code, message: String },
}
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error::Legacy {
            code,
            message: message.into(),
        }
    }
    pub fn invalid(m: impl Into<String>) -> Error {
        Error::new(Code::InvalidArgument, m)
    }
    pub fn not_found(m: impl Into<String>) -> Error {
        Error::new(Code::NotFound, m)
    }
    pub fn precondition(m: impl Into<String>) -> Error {
        Error::new(Code::FailedPrecondition, m)
    }
    pub fn unavailable(m: impl Into<String>) -> Error {
        Error::new(Code::Unavailable, m)
    }
    pub fn internal(m: impl Into<String>) -> Error {
        Error::new(Code::Internal, m)
    }

    /// The same error with `more` appended to its message.
    pub fn and(self, more: impl std::fmt::Display) -> Error {
        Error::new(self.code(), format!("{self}; {more}"))
    }

    /// The error as "CODE: message", as another error's sentence quotes it.
    pub fn coded(&self) -> Coded<'_> {
        Coded(self)
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
