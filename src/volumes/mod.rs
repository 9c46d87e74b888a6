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
//! The table is rooms that own their state, and operations that borrow
//! the rooms they need, named in their fields; `Volumes` (`table`) is the
//! façade that owns the rooms, takes a volume's slot and wires each
//! operation. Everything the table asks of the kernel goes through one
//! trait, `Kernel`: the agent runs on `Linux`, the table's tests on a fake.
//!
//! The rooms:
//!
//! - `slots`: one slot per volume, its lock taken in turn;
//! - `state`: the records; `claims`: the devices (and sectors) volumes
//!   hold; `targets`: the bind targets, and how many binds a volume may
//!   have; `listing`: what ListVolumes answers; `lease/`: the freezes, each
//!   a lease; `failures`: the bounded record of failed publishes; `stop`:
//!   Shutdown's flag and token. `held` is what claims and targets share (a
//!   key held for an operation in flight).
//!
//! The operations:
//!
//! - `publish` (`Publisher`): the one publish, filesystem and block alike,
//!   as a table of steps with one undo list (`rollback`);
//! - `unpublish` (`Unpublisher`), which takes a volume's mounts down
//!   through `takedown`, as the end of a failed walk does;
//! - `bind` (`Binder`): binds and unmounts; `query` (`Query`): stats,
//!   expand, the list; `freeze` and `trim`: freezing for a snapshot through
//!   the leases, and free space given back; `trimming/`: trims on a
//!   schedule, one runner thread for the agent, one trim at a time;
//!   `health`: CSI's volume health;
//! - `block`: what only a block volume does (its prepare and attach steps,
//!   its release, stats and expand);
//! - `mounts`: the guest node a publish makes and the one check of "is this
//!   our mount" every operation makes;
//! - `walking/`: a publish's fsGroup walk, owned by the volume, not the
//!   call: the job (`job`) and its lifecycle (`lifecycle`), finished by the
//!   table under the volume's slot;
//! - `recover`: a restart.
//!
//! And what they share: `volume` and `phase` (what a volume is, and how far
//! its publish got), `request` (what is asked and answered), `error` (what
//! the table refuses), `kernel` (the seam; `fake` is the tests' kernel,
//! and `tests/` the table's tests through its façade).

pub mod bind;
pub mod block;
pub(crate) mod claims;
pub(crate) mod encrypted;
pub mod error;
pub(crate) mod failures;
#[cfg(test)]
pub(crate) mod fake;
pub mod freeze;
pub mod health;
pub(crate) mod held;
pub(crate) mod idmap;
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
pub(crate) mod trimming;
pub(crate) mod unlocks;
pub mod unpublish;
pub mod volume;
pub mod walking;
