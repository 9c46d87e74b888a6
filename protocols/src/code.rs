//! The gRPC status codes, by the numbers and upper-case names gRPC gives
//! them: the one table the agent (what it answers), crust-client (what it
//! hears), crustd (what it answers and passes on) and crustd-ctl share;
//! and [`coded_errors!`](crate::coded_errors), with which the agent's and
//! crustd's error enums say each variant's message and code in one place.

use std::fmt;

/// A gRPC status code; its discriminant is its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Code {
    Ok = 0,
    Cancelled = 1,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    AlreadyExists = 6,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    OutOfRange = 11,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    DataLoss = 15,
    Unauthenticated = 16,
}

/// Every code, in the order of their numbers.
const CODES: [Code; 17] = [
    Code::Ok,
    Code::Cancelled,
    Code::Unknown,
    Code::InvalidArgument,
    Code::DeadlineExceeded,
    Code::NotFound,
    Code::AlreadyExists,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::FailedPrecondition,
    Code::Aborted,
    Code::OutOfRange,
    Code::Unimplemented,
    Code::Internal,
    Code::Unavailable,
    Code::DataLoss,
    Code::Unauthenticated,
];

/// Their names, in the same order.
const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

impl Code {
    /// The canonical upper-case name, as gRPC and crustctl print it (`NOT_FOUND`).
    pub fn name(self) -> &'static str {
        NAMES
            .get(usize::try_from(self.number()).unwrap_or(2))
            .copied()
            .unwrap_or("UNKNOWN")
    }

    /// The code's number on the wire.
    pub fn number(self) -> i32 {
        self as i32
    }

    /// The code numbered `n`, if gRPC has one.
    pub fn from_number(n: i32) -> Option<Code> {
        usize::try_from(n).ok().and_then(|i| CODES.get(i)).copied()
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A code compares equal to its name, so tests and logs can say `"NOT_FOUND"`.
impl PartialEq<&str> for Code {
    fn eq(&self, other: &&str) -> bool {
        self.name() == *other
    }
}

/// An error enum whose every variant says its message and its code in one
/// place: `#[code(...)]` beside thiserror's `#[error(...)]`. The macro
/// writes the enum as given (its derives included) and its `code()`. A
/// variant's code is one of:
///
/// - `#[code(NotFound)]`: a [`Code`];
/// - `#[code(inner)]`: a one-field tuple variant whose field says its own
///   (`field.code()`);
/// - `#[code(field => expr)]`: computed from one field of a struct variant.
///
/// Each variant is written as docs (optional), `#[code]`, then `#[error]`.
/// The enum's own derives (thiserror's among them) are the caller's.
#[macro_export]
macro_rules! coded_errors {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $(
                $(#[doc = $doc:literal])*
                #[code($($code:tt)+)]
                #[error($($msg:tt)+)]
                $variant:ident
                $(( $($tuple:tt)* ))?
                $({ $($fields:tt)* })?
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $(
                $(#[doc = $doc])*
                #[error($($msg)+)]
                $variant $(( $($tuple)* ))? $({ $($fields)* })?,
            )+
        }

        impl $name {
            /// The wire code of this error.
            pub fn code(&self) -> $crate::code::Code {
                match self {
                    $(
                        $crate::coded_errors!(
                            @pat $name $variant [e] [$($code)+] $(( $($tuple)* ))? $({ $($fields)* })?
                        )
                            => $crate::coded_errors!(@code [e] [$($code)+]),
                    )+
                }
            }
        }
    };
    // The pattern of one variant, binding what its code needs.
    (@pat $name:ident $v:ident [$e:ident] [inner] ($($b:tt)*)) => { $name::$v($e) };
    (@pat $name:ident $v:ident [$e:ident] [$f:ident => $($x:tt)+] {$($b:tt)*}) => {
        $name::$v { $f, .. }
    };
    (@pat $name:ident $v:ident [$e:ident] [$($c:tt)+] ($($b:tt)*)) => { $name::$v(..) };
    (@pat $name:ident $v:ident [$e:ident] [$($c:tt)+] {$($b:tt)*}) => { $name::$v { .. } };
    (@pat $name:ident $v:ident [$e:ident] [$($c:tt)+]) => { $name::$v };
    // Its code.
    (@code [$e:ident] [inner]) => { $e.code() };
    (@code [$e:ident] [$f:ident => $($x:tt)+]) => { $($x)+ };
    (@code [$e:ident] [$c:ident]) => { $crate::code::Code::$c };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_names_are_grpcs() {
        for (i, (c, n)) in CODES.iter().zip(NAMES).enumerate() {
            assert_eq!(c.number(), i32::try_from(i).unwrap());
            assert_eq!(Code::from_number(c.number()), Some(*c));
            assert_eq!(c.name(), n);
            assert_eq!(c.to_string(), n);
        }
        assert_eq!(Code::NotFound.number(), 5);
        assert_eq!(Code::Unauthenticated.number(), 16);
        assert_eq!(Code::from_number(17), None);
        assert_eq!(Code::from_number(-1), None);
        assert!(Code::FailedPrecondition == "FAILED_PRECONDITION");
        // The same table as ttrpc's (and so gRPC's) own.
        for c in CODES {
            let t = <ttrpc::Code as protobuf::Enum>::from_i32(c.number()).unwrap();
            assert_eq!(format!("{t:?}"), c.name());
        }
    }

    crate::coded_errors! {
    #[derive(Debug, thiserror::Error)]
    enum Inner {
        #[code(NotFound)]
        #[error("no {0}")]
        Missing(String),
    }
    }

    crate::coded_errors! {
    #[derive(Debug, thiserror::Error)]
    enum Outer {
        /// Each form of `#[code]`.
        #[code(Unavailable)]
        #[error("gone")]
        Gone,
        #[code(inner)]
        #[error(transparent)]
        Inner(#[from] Inner),
        #[code(code => *code)]
        #[error("{message}")]
        Passed { code: Code, message: String },
    }
    }

    #[test]
    fn a_variant_says_its_message_and_its_code_in_one_place() {
        assert_eq!(Outer::Gone.code(), Code::Unavailable);
        let e = Outer::from(Inner::Missing("x".into()));
        assert_eq!((e.code(), e.to_string()), (Code::NotFound, "no x".into()));
        let e = Outer::Passed {
            code: Code::Aborted,
            message: "m".into(),
        };
        assert_eq!((e.code(), e.to_string()), (Code::Aborted, "m".into()));
    }
}
