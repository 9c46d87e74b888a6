//! Mount options. The table (names to MS_* flags, the options publishing
//! refuses, the data string left for the filesystem) is written once, in
//! crust-protocols (`crust_protocols::options`), which crustd uses to refuse
//! a direct-volume record's bad option before anything is plugged; its
//! refusal becomes the mount error (`mount::error`).
//!
//! The agent compiles that same file as a module of its own rather than
//! calling it across the crate: measured with the release profile, the
//! agent is 864 bytes smaller so (1,991,744 bytes against 1,992,608).

#[path = "../../protocols/src/options.rs"]
mod table;

pub use table::{parse_options, BadOption, MountOptions, DEFAULT_ERRORS};
