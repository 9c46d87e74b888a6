//! dm-integrity as a layer under dm-crypt, as
//! `Documentation/admin-guide/device-mapper/dm-integrity.rst` (Linux 6.1)
//! describes it: the superblock that formatting left at the start of the
//! device's area (read here, bounded and checked), the `integrity` table
//! line over it, and the target's status (its count of mismatches). What
//! the tags are for (an AEAD's tags, written by dm-crypt) is not known
//! here.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use super::dm::Error;

/// `SB_MAGIC`: "integrt" and its NUL.
pub const MAGIC: &[u8; 8] = b"integrt\0";
/// The bytes of `struct superblock` the agent reads (up to and with its salt).
pub const SUPERBLOCK_LEN: usize = 64;
/// The newest superblock version Linux 6.1 knows (`SB_VERSION_5`).
pub const VERSION_MAX: u8 = 5;

/// `SB_FLAG_*`: what a superblock's flags say.
pub mod sb_flag {
    /// The journal is authenticated with a key (`journal_mac`).
    pub const HAVE_JOURNAL_MAC: u32 = 0x1;
    /// An internal hash is being recomputed.
    pub const RECALCULATING: u32 = 0x2;
    /// Bitmap mode left blocks whose tags may be stale.
    pub const DIRTY_BITMAP: u32 = 0x4;
    /// The tag area uses the smaller padding (`fix_padding`).
    pub const FIXED_PADDING: u32 = 0x8;
    /// The salt is mixed into the journal's MAC (`fix_hmac`).
    pub const FIXED_HMAC: u32 = 0x10;
    /// Tags inline in the device's own metadata (after 6.1).
    pub const INLINE: u32 = 0x20;
}

/// The fields of a dm-integrity superblock the agent needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub version: u8,
    /// log2 of the sectors of data between two tag areas.
    pub log2_interleave_sectors: i8,
    /// Bytes of tag per block.
    pub tag_size: u16,
    pub journal_sections: u32,
    /// The sectors the device offers above it: the mapping's length.
    pub provided_data_sectors: u64,
    pub flags: u32,
    /// log2 of the 512-byte sectors per block.
    pub log2_sectors_per_block: u8,
}

impl Superblock {
    /// Reads `struct superblock` from the first bytes of `b`; None when `b`
    /// is too short or has no dm-integrity magic.
    pub fn parse(b: &[u8]) -> Option<Superblock> {
        let b = b.get(..SUPERBLOCK_LEN)?;
        if b.get(..8)? != MAGIC {
            return None;
        }
        let u16_at = |at: usize| Some(u16::from_le_bytes(b.get(at..)?.get(..2)?.try_into().ok()?));
        let u32_at = |at: usize| Some(u32::from_le_bytes(b.get(at..)?.get(..4)?.try_into().ok()?));
        let u64_at = |at: usize| Some(u64::from_le_bytes(b.get(at..)?.get(..8)?.try_into().ok()?));
        Some(Superblock {
            version: b[8],
            log2_interleave_sectors: i8::from_le_bytes([b[9]]),
            tag_size: u16_at(10)?,
            journal_sections: u32_at(12)?,
            provided_data_sectors: u64_at(16)?,
            flags: u32_at(24)?,
            log2_sectors_per_block: b[28],
        })
    }

    /// The block size in bytes, when its log2 is one Linux takes (512 to 4096).
    pub fn block_bytes(&self) -> Option<u32> {
        match self.log2_sectors_per_block {
            0 => Some(512),
            1 => Some(1024),
            2 => Some(2048),
            3 => Some(4096),
            _ => None,
        }
    }
}

/// How dm-integrity journals writes (the line's mode letter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// 'J': writes go through the journal; a crash tears no block from its tag.
    Journal,
    /// 'D': no journal; a crash may leave a block and its tag apart.
    Direct,
}

/// One `integrity` target as cryptsetup loads it under dm-crypt:
/// `<device> <offset> <tag_size> <mode> <#opt> block_size:<n> [fix_padding] [fix_hmac]`,
/// with no internal hash (the tags are dm-crypt's) and the rest of the
/// geometry (journal, interleave, buffers) read by the kernel from the superblock.
#[derive(Clone, Copy, Debug)]
pub struct Integrity {
    /// The device under it, by number.
    pub device: (u32, u32),
    /// Where its superblock is, in 512-byte sectors.
    pub offset: u64,
    /// The superblock read there.
    pub superblock: Superblock,
    pub mode: Mode,
}

impl Integrity {
    /// The target's parameter string; refused for a superblock Linux 6.1
    /// would refuse or that needs keys or options the line does not carry.
    pub fn params(&self) -> Result<String, Error> {
        let sb = &self.superblock;
        let invalid = |why| Error::Invalid {
            what: "dm-integrity superblock",
            value: format!(
                "version {}, tag size {}, flags {:#x}, log2 sectors per block {}",
                sb.version, sb.tag_size, sb.flags, sb.log2_sectors_per_block
            ),
            why,
        };
        if sb.version == 0 || sb.version > VERSION_MAX {
            return Err(invalid("its version is not one Linux 6.1 opens (1 to 5)"));
        }
        if sb.tag_size == 0 {
            return Err(invalid("it keeps no tags"));
        }
        let Some(block) = sb.block_bytes() else {
            return Err(invalid("its block size is not 512 to 4096 bytes"));
        };
        let needs_more = sb_flag::HAVE_JOURNAL_MAC
            | sb_flag::RECALCULATING
            | sb_flag::DIRTY_BITMAP
            | sb_flag::INLINE;
        if sb.flags & needs_more != 0 {
            return Err(invalid(
                "it needs a journal key, an internal hash or inline tags, which a LUKS2 volume does not use",
            ));
        }
        let mut opts = vec![format!("block_size:{block}")];
        if sb.flags & sb_flag::FIXED_PADDING != 0 {
            opts.push("fix_padding".into());
        }
        if sb.flags & sb_flag::FIXED_HMAC != 0 {
            opts.push("fix_hmac".into());
        }
        let mode = match self.mode {
            Mode::Journal => 'J',
            Mode::Direct => 'D',
        };
        let (maj, min) = self.device;
        Ok(format!(
            "{maj}:{min} {} {} {mode} {} {}",
            self.offset,
            sb.tag_size,
            opts.len(),
            opts.join(" ")
        ))
    }
}

/// The sectors of the short-lived device whose table makes the kernel
/// write a superblock (cryptsetup's `INTEGRITY_format`: one 4 KiB block).
pub const FORMAT_SECTORS: u64 = 8;

/// The `integrity` line that formats a device whose superblock sector is
/// zeros, as cryptsetup 2.6 loads it over Linux 6.1 for a LUKS2 segment:
/// `<device> <offset> <tag_size> J 3 block_size:<n> fix_padding fix_hmac`.
/// The kernel sizes the journal and the tag area from the device and
/// writes the superblock as it loads the table. `fix_hmac` marks nothing
/// without a journal MAC, and is given as cryptsetup gives it.
pub fn format_params(
    device: (u32, u32),
    offset: u64,
    tag_size: u16,
    block_size: u32,
) -> Result<String, Error> {
    if tag_size == 0 || !matches!(block_size, 512 | 1024 | 2048 | 4096) {
        return Err(Error::Invalid {
            what: "dm-integrity format",
            value: format!("tag size {tag_size}, block size {block_size}"),
            why: "it needs tags and a block of 512 to 4096 bytes",
        });
    }
    let (maj, min) = device;
    Ok(format!(
        "{maj}:{min} {offset} {tag_size} J 3 block_size:{block_size} fix_padding fix_hmac"
    ))
}

/// The name cryptsetup gives the dm-integrity device under mapping `name`.
pub fn subdevice_name(name: &str) -> String {
    format!("{name}_dif")
}

/// The dm uuid cryptsetup (2.7) gives the dm-integrity device under the
/// LUKS2 mapping `name` of the volume whose LUKS2 uuid is `luks_uuid`:
/// `CRYPT-SUBDEV-<uuid without dashes>-<name>_dif`. cryptsetup 2.6 named it
/// `CRYPT-LUKS2-…` and both versions tell it by its uuid's middle part.
pub fn subdevice_uuid(luks_uuid: &str, name: &str) -> Result<String, Error> {
    let top = super::dm::crypt_uuid(luks_uuid, name)?;
    let rest = top.strip_prefix("CRYPT-LUKS2-").unwrap_or(&top);
    let uuid = format!("CRYPT-SUBDEV-{rest}_dif");
    super::dm::check_name(&subdevice_name(name))?;
    super::dm::check_uuid(&uuid)?;
    Ok(uuid)
}

/// An `integrity` target's status: `<mismatches> <provided_data_sectors> <recalc sector or ->`.
/// The count of mismatches, or None for any other form.
pub fn mismatches(status: &str) -> Option<u64> {
    let mut words = status.split_ascii_whitespace();
    let count = words.next()?.parse().ok()?;
    let _provided: u64 = words.next()?.parse().ok()?;
    Some(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A superblock as Linux 6.1 writes one under a 4096-byte-sector
    /// LUKS2 volume with hmac(sha256): tag 32, fix_padding.
    fn written() -> Vec<u8> {
        let mut b = vec![0u8; 512];
        b[..8].copy_from_slice(MAGIC);
        b[8] = 4;
        b[9] = 15;
        b[10..12].copy_from_slice(&32u16.to_le_bytes());
        b[12..16].copy_from_slice(&34u32.to_le_bytes());
        b[16..24].copy_from_slice(&55_632u64.to_le_bytes());
        b[24..28].copy_from_slice(&sb_flag::FIXED_PADDING.to_le_bytes());
        b[28] = 3;
        b
    }

    #[test]
    fn a_superblock_reads_as_written_and_nothing_else_does() {
        let sb = Superblock::parse(&written()).unwrap();
        assert_eq!(
            sb,
            Superblock {
                version: 4,
                log2_interleave_sectors: 15,
                tag_size: 32,
                journal_sections: 34,
                provided_data_sectors: 55_632,
                flags: sb_flag::FIXED_PADDING,
                log2_sectors_per_block: 3,
            }
        );
        assert_eq!(sb.block_bytes(), Some(4096));
        assert!(Superblock::parse(&written()[..63]).is_none());
        assert!(Superblock::parse(&[0u8; 512]).is_none(), "a wiped area");
        let mut other = written();
        other[6] = b'x';
        assert!(Superblock::parse(&other).is_none());
    }

    #[test]
    fn the_line_is_cryptsetups() {
        let sb = Superblock::parse(&written()).unwrap();
        let line = |superblock, mode| {
            Integrity {
                device: (254, 16),
                offset: 32768,
                superblock,
                mode,
            }
            .params()
        };
        assert_eq!(
            line(sb, Mode::Journal).unwrap(),
            "254:16 32768 32 J 2 block_size:4096 fix_padding"
        );
        let old = Superblock {
            flags: sb_flag::FIXED_HMAC,
            log2_sectors_per_block: 0,
            ..sb
        };
        assert_eq!(
            line(old, Mode::Direct).unwrap(),
            "254:16 32768 32 D 2 block_size:512 fix_hmac"
        );
        for bad in [
            Superblock { version: 6, ..sb },
            Superblock { version: 0, ..sb },
            Superblock { tag_size: 0, ..sb },
            Superblock {
                log2_sectors_per_block: 4,
                ..sb
            },
            Superblock {
                flags: sb_flag::HAVE_JOURNAL_MAC,
                ..sb
            },
            Superblock {
                flags: sb_flag::RECALCULATING | sb_flag::FIXED_PADDING,
                ..sb
            },
            Superblock {
                flags: sb_flag::INLINE,
                ..sb
            },
        ] {
            let e = line(bad, Mode::Journal).unwrap_err();
            assert!(matches!(e, Error::Invalid { .. }), "{bad:?}: {e}");
        }
    }

    #[test]
    fn the_format_line_is_cryptsetups() {
        assert_eq!(
            format_params((254, 16), 32768, 32, 4096).unwrap(),
            "254:16 32768 32 J 3 block_size:4096 fix_padding fix_hmac"
        );
        assert!(format_params((254, 16), 32768, 0, 4096).is_err());
        assert!(format_params((254, 16), 32768, 32, 8192).is_err());
    }

    #[test]
    fn the_subdevice_is_named_as_cryptsetup_names_it() {
        let uuid = subdevice_uuid("1b4e28ba-2fa1-11d2-883f-0016d3cca427", "crust-v").unwrap();
        assert_eq!(
            uuid,
            "CRYPT-SUBDEV-1b4e28ba2fa111d2883f0016d3cca427-crust-v_dif"
        );
        assert_eq!(subdevice_name("crust-v"), "crust-v_dif");
        // The longest mapping name luks2::mapping gives a volume.
        let longest = format!("crust-{}", "y".repeat(64));
        assert!(subdevice_uuid("1b4e28ba-2fa1-11d2-883f-0016d3cca427", &longest).is_ok());
    }

    #[test]
    fn the_status_says_its_mismatches() {
        assert_eq!(mismatches("0 55632 -"), Some(0));
        assert_eq!(mismatches("3 55632 -"), Some(3));
        assert_eq!(mismatches("7 55632 1024"), Some(7));
        assert_eq!(mismatches(""), None);
        assert_eq!(mismatches("x 1 -"), None);
        assert_eq!(mismatches("1"), None);
    }
}
