//! The error classes of the wire contract (api.md §2): every error the agent
//! answers says one of these. The bottom of the house: it imports nothing of
//! the agent's, and every capability names its own errors' codes with it.
//! The table itself (numbers and names) is crust-protocols', the one the
//! host crates read the agent's answers with.

/// The gRPC status codes. The agent answers INVALID_ARGUMENT, NOT_FOUND,
/// ALREADY_EXISTS, FAILED_PRECONDITION, DEADLINE_EXCEEDED, OUT_OF_RANGE,
/// INTERNAL, UNIMPLEMENTED, CANCELLED and RESOURCE_EXHAUSTED (api.md §2).
pub use crust_protocols::code::Code;

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
                        $crate::code::coded_errors!(
                            @pat $name $variant [e] [$($code)+] $(( $($tuple)* ))? $({ $($fields)* })?
                        )
                            => $crate::code::coded_errors!(@code [e] [$($code)+]),
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

pub(crate) use coded_errors;
