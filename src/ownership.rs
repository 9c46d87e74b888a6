//! (ownership: to be written)

use crate::errors::Code;

/// What can go wrong in ownership.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Placeholder until the module is written.
    #[error("ownership is not written yet")]
    NotWritten,
}

impl Error {
    /// The wire code of this error.
    pub fn code(&self) -> Code {
        Code::Unimplemented
    }
}
