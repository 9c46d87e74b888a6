//! The volume table: publish, unpublish, stats, expand, bind and unmount as
//! steps over the capability modules, one lock per volume so operations on
//! one volume are serialized while different volumes proceed in parallel.
//!
//! Everything the table acts on is beneath the agent's root and reached from
//! its fds (`crate::sys::beneath`): a volume is mounted on the directory fd
//! of `<root>/volumes/<id>`, binds and unmounts resolve their targets with no
//! symlinks, and mounts are recognised by their mount id and device, never
//! by their spelling. Bind targets are reserved atomically, so two binds
//! never share or nest. The table is mirrored in `<root>/state/` before
//! anything is mounted (`state`), so a restarted agent accounts for every
//! mount it made (`recover`): it takes back what it can and takes down what
//! it cannot.
//!
//! One idea a file:
//!
//! - `table`: the table itself and the lock order;
//! - `slots`: one slot per volume, its lock taken in turn;
//! - `index`: the side maps (device claims, bind targets, the list), kept in
//!   step with the volumes there alone;
//! - `publish`: the one publish, filesystem and block alike, as a table of
//!   steps with one undo list; `steps`: the guest node it makes and the one
//!   check of "is this our mount" every operation makes;
//! - `block`: what only a block volume does (its prepare and attach steps,
//!   its stats, expand and take-down);
//! - `bind`, `unpublish`, `query`: the other operations;
//! - `freeze` and `lease/`: freezing for a snapshot, and the room that
//!   holds each freeze as a lease (its id, its record, its timer); `trim`: free
//!   space given back; `health`: CSI's volume health, from the condition's
//!   problems, and `failures`: the bounded record of failed publishes it
//!   answers for;
//! - `rollback`: the one undo list a publish or a bind keeps;
//! - `walking/`: a publish's fsGroup walk, owned by the volume, not the
//!   call: the job (`job`) and its whole lifecycle (`lifecycle`);
//! - `volume`, `request`, `error`: what a volume is (the request's `Spec`,
//!   then what the agent found and did), what is asked and answered, what
//!   the table refuses;
//! - `state`, `recover`: the records, and a restart.

pub mod bind;
pub mod block;
pub(crate) mod claims;
pub mod error;
pub(crate) mod failures;
#[cfg(test)]
pub(crate) mod fake;
pub mod freeze;
pub mod health;
pub(crate) mod held;
pub mod kernel;
pub mod lease;
pub(crate) mod listing;
pub(crate) mod mounts;
pub(crate) mod phase;
pub mod publish;
pub mod query;
pub mod recover;
pub mod request;
pub mod rollback;
pub(crate) mod slots;
pub mod state;
pub(crate) mod stop;
pub mod table;
pub(crate) mod takedown;
pub(crate) mod targets;
#[cfg(test)]
mod tests;
pub mod trim;
pub mod unpublish;
pub mod volume;
pub mod walking;
