//! What reading a LUKS2 header, unlocking a keyslot and formatting a new
//! volume refuse, each with its code: the disk's refusals are
//! FAILED_PRECONDITION, a passphrase that opens no keyslot
//! PERMISSION_DENIED, a format's cost outside cryptsetup's bounds
//! INVALID_ARGUMENT, a failed read or random source INTERNAL. No message
//! carries key material or the passphrase: none of these errors holds any.

use crate::sys::error::SysError;

crate::code::coded_errors! {
/// What can go wrong reading a LUKS2 header, unlocking one of its keyslots,
/// or formatting a new one.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[code(FailedPrecondition)]
    #[error("the disk holds no LUKS header: no LUKS magic at its start, nor a LUKS2 secondary header at any offset cryptsetup puts one")]
    NotLuks,
    #[code(FailedPrecondition)]
    #[error("the disk holds a LUKS1 header, which the agent does not open: convert it to LUKS2 on the host (cryptsetup convert --type luks2)")]
    Luks1,
    #[code(FailedPrecondition)]
    #[error("the disk's LUKS2 header is refused: {what}; check it on the host (cryptsetup luksDump, cryptsetup repair)")]
    Corrupt {
        /// What is wrong, with each copy of the header where both are.
        what: String,
    },
    #[code(FailedPrecondition)]
    #[error("the LUKS2 volume needs {what}, which the agent does not support; it opens crypt segments whose keyslots use aes-xts-plain64, PBKDF2 (sha1, sha256, sha384, sha512), Argon2i or Argon2id")]
    Unsupported {
        /// The cipher, KDF, hash or requirement, named as the header names it.
        what: String,
    },
    #[code(FailedPrecondition)]
    #[error("the LUKS2 volume has integrity {what}, which the agent does not open; it opens hmac(sha256) and hmac(sha512) over aes-xts-plain64 or aes-xts-random, and aead over aes-gcm-random, with no journal encryption or MAC")]
    IntegrityUnsupported {
        /// The kind, cipher, key size or journal refused, as the header says it.
        what: String,
    },
    #[code(FailedPrecondition)]
    #[error("the disk's LUKS2 volume has integrity {has} where the request asks {asked}; it is not opened: ask the integrity it was made with, or publish it without format_if_blank and its header decides")]
    IntegrityDiffers {
        /// What the request asks: "none", or "hmac-sha256 (hmac(sha256))".
        asked: String,
        /// What the header's data segment has: "none", or its kind.
        has: String,
    },
    #[code(Internal)]
    #[error("the new volume's dm-integrity superblock was not made: {why}; nothing is mapped, and the next publish with format_if_blank makes it again")]
    IntegrityFormat {
        /// What the kernel wrote instead.
        why: String,
    },
    #[code(inner)]
    #[error(transparent)]
    Stopped(#[from] crate::cancel::Stopped),
    #[code(FailedPrecondition)]
    #[error("{what} of a LUKS2 volume with integrity is not supported: {why}")]
    NotWithIntegrity {
        /// "growing mapping \"crust-x\"", "discards".
        what: String,
        why: &'static str,
    },
    #[code(FailedPrecondition)]
    #[error("keyslot {keyslot} asks Argon2 for {cost_kib} KiB of memory but the agent may use {limit_kib} KiB; add a keyslot with a lower cost on the host (cryptsetup luksAddKey --pbkdf-memory) or give the guest more memory")]
    MemoryOverLimit {
        /// The keyslot's number.
        keyslot: u32,
        /// Its Argon2 memory cost.
        cost_kib: u64,
        /// What the caller allows.
        limit_kib: u64,
    },
    #[code(FailedPrecondition)]
    #[error("{whose} of the LUKS2 header asks for {cost} {what} but the agent allows {limit}; add a keyslot with a lower cost on the host (cryptsetup luksAddKey --pbkdf-force-iterations)")]
    CostOverLimit {
        /// "keyslot 3", "the digest".
        whose: String,
        /// "PBKDF2 iterations", "Argon2 passes".
        what: &'static str,
        /// What the header asks.
        cost: u64,
        /// What the caller allows.
        limit: u64,
    },
    #[code(FailedPrecondition)]
    #[error("no keyslot of the LUKS2 header {what}")]
    NoKeyslot {
        /// "opens its data segment", "is numbered 5", ….
        what: String,
    },
    #[code(PermissionDenied)]
    #[error("the passphrase opens no keyslot of the LUKS2 header")]
    WrongPassphrase,
    #[code(ResourceExhausted)]
    #[error("the agent could not allocate the {bytes} bytes that keyslot {keyslot} needs")]
    OutOfMemory {
        /// The keyslot's number.
        keyslot: u32,
        /// What was asked for.
        bytes: u64,
    },
    #[code(inner)]
    #[error(transparent)]
    Dm(#[from] crate::sys::dm::Error),
    #[code(inner)]
    #[error(transparent)]
    NotBlank(#[from] super::blank::NotBlank),
    #[code(FailedPrecondition)]
    #[error("the disk has {device_bytes} bytes, too few for a LUKS2 volume: its header and keyslots take the first 16 MiB and its data at least {data} after them, {needs} bytes in all; nothing was written")]
    TooSmall {
        /// The device's size.
        device_bytes: u64,
        /// What the data needs: "one 512-byte sector", "4 MiB (dm-integrity's journal and tags)".
        data: String,
        /// The least it needs.
        needs: u64,
    },
    #[code(FailedPrecondition)]
    #[error("the disk has {device_bytes} bytes, not a whole number of {sector_size}-byte sectors after its 16 MiB header, which dm-crypt cannot map; format it with 512-byte sectors, or give it a size that is a multiple of {sector_size}; nothing was written")]
    Misaligned {
        /// The device's size.
        device_bytes: u64,
        /// The data segment's sector size.
        sector_size: u32,
    },
    #[code(InvalidArgument)]
    #[error("a LUKS2 keyslot is not made with {what}: cryptsetup makes {bounds}")]
    FormatCost {
        /// The cost asked, in words ("Argon2 memory of 16 KiB").
        what: String,
        /// cryptsetup's bounds for it.
        bounds: &'static str,
    },
    #[code(Internal)]
    #[error(transparent)]
    Sys(#[from] SysError),
}
}

impl Error {
    /// A refusal of the header saying `what`.
    pub(crate) fn corrupt(what: impl Into<String>) -> Self {
        Error::Corrupt { what: what.into() }
    }

    /// A refusal of something the header needs, named as the header names it.
    pub(crate) fn unsupported(what: impl Into<String>) -> Self {
        Error::Unsupported { what: what.into() }
    }
}
