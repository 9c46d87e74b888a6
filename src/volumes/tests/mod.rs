//! The table's tests through its façade, `Volumes`: what each operation
//! does to the records, the maps and the mounts, one file an operation.
//! They live apart from the operations' own files, which the façade
//! imports, so that no test closes an import circle through it.

mod bind;
mod block;
mod encrypted;
mod freeze;
mod idmap;
mod owners;
mod publish;
mod recover;
pub(crate) mod testkit;
mod trim_schedule;
mod unpublish;
