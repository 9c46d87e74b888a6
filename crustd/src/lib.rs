//! crustd: the host half of KEP-2857 (CRUST). One daemon per node serves
//! kubelet's `RuntimeAssistedStorageManagement` gRPC service on a unix socket
//! for every sandbox, and turns each call into QMP (hot-plug, resize, unplug)
//! plus crust.v1 calls to the crust-agent inside that sandbox's VM.
//!
//! The flow of a call: `methods` (the one list of CRUST methods, held to
//! the .proto: each request made a call, each call's answer its response)
//! → `service` (error → status, one log line) → `calls` (each call's work
//! on a thread of its own, bounded per sandbox, joined by the same call
//! made again, ended by the caller's `deadline`) → `volumes` (each call's
//! steps, locks and undo, a file for each group of calls: publish,
//! takeout, freeze, thaw, usage, snapshot) →
//! `registry` (where the sandbox's QMP socket and agent are), `monitor` (the
//! QMP socket found anew and its process proved the sandbox's hypervisor on
//! every connection), `state` (what
//! crustd plugged, on disk), `devices` (the one owner of whether a host
//! device is free: claims, exclusive holds, and the rule that frees one),
//! `hostdev` (the host block device: where its bytes lie, whether the host
//! uses it, who has it open), `files` (reading and writing in directories
//! others write), `locks` (keyed locks whose waits end), `hotplug` (QEMU,
//! over crust-client's QMP session), `agent` (crust-agent, over
//! crust-client, its answers checked), `freezes` (the groups frozen across
//! sandboxes: each a lease ended only by its id, its records, the host's
//! timer); `direct` (the direct-volume records CSI drivers write for Kata)
//! and `mkfs` (createFilesystem on a provably blank device).
//!
//! `ctl` is the `crustd-ctl` command (kubelet's calls from a shell, and
//! Kata's `direct-volume` verbs on the records `direct` reads), here beside
//! the record code it shares; its CRUST client is the crust-kubelet crate's,
//! generated apart from crustd's server half, so crustd depends on it and
//! nothing depends back on crustd.

pub mod agent;
pub mod calls;
pub mod ctl;
pub mod deadline;
pub mod devices;
pub mod direct;
pub mod error;
pub mod files;
pub mod freezes;
pub mod hostdev;
pub mod hotplug;
pub mod hypervisor;
pub mod kata;
pub mod locks;
pub mod methods;
pub mod mkfs;
pub mod monitor;
pub mod registry;
pub mod service;
pub mod state;
pub mod volumes;

/// The generated crust.runtime.v1alpha1 messages and server stubs.
#[allow(clippy::all, clippy::pedantic, clippy::restriction, missing_docs)]
pub mod pb {
    tonic::include_proto!("crust.runtime.v1alpha1");
}
