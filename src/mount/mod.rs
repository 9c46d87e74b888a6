//! Mounting a volume's filesystem on a directory fd, and the pieces around
//! it, one idea a file: the option table (`options`, `selinux`), the mount
//! itself (`filesystem`), binds (`bind`), and unmounting by identity
//! (`unmount`); what each refuses is in `error`. Paths are resolved from
//! directory fds beneath their roots (`crate::sys::beneath`), never trusted
//! as strings.

pub mod bind;
pub mod error;
pub mod filesystem;
pub mod options;
pub mod selinux;
#[cfg(test)]
mod testkit;
pub mod unmount;
