//! device-mapper's encodings, checked on any host: the layouts against the
//! kernel's uapi (`linux/dm-ioctl.h`, mirrored here field by field), the
//! requests and the `crypt` lines byte by byte, answers built by hand as the
//! kernel's `list_devices` and `retrieve_status` write them, and the error
//! where there is no device-mapper.

use std::mem::{offset_of, size_of};

use super::*;
use crate::code::Code;

/// `struct dm_ioctl`, as the uapi declares it.
#[allow(dead_code)]
#[repr(C)]
struct DmIoctl {
    version: [u32; 3],
    data_size: u32,
    data_start: u32,
    target_count: u32,
    open_count: i32,
    flags: u32,
    event_nr: u32,
    padding: u32,
    dev: u64,
    name: [u8; 128],
    uuid: [u8; 129],
    data: [u8; 7],
}

/// `struct dm_target_spec`.
#[allow(dead_code)]
#[repr(C)]
struct DmTargetSpec {
    sector_start: u64,
    length: u64,
    status: i32,
    next: u32,
    target_type: [u8; 16],
}

/// `struct dm_name_list` (its name is a flexible array).
#[allow(dead_code)]
#[repr(C)]
struct DmNameList {
    dev: u64,
    next: u32,
    name: [u8; 0],
}

#[test]
fn the_layouts_are_the_kernels() {
    assert_eq!(size_of::<DmIoctl>(), HEADER_LEN);
    assert_eq!(offset_of!(DmIoctl, version), at::VERSION);
    assert_eq!(offset_of!(DmIoctl, data_size), at::DATA_SIZE);
    assert_eq!(offset_of!(DmIoctl, data_start), at::DATA_START);
    assert_eq!(offset_of!(DmIoctl, target_count), at::TARGET_COUNT);
    assert_eq!(offset_of!(DmIoctl, open_count), at::OPEN_COUNT);
    assert_eq!(offset_of!(DmIoctl, flags), at::FLAGS);
    assert_eq!(offset_of!(DmIoctl, event_nr), at::EVENT_NR);
    assert_eq!(offset_of!(DmIoctl, dev), at::DEV);
    assert_eq!(offset_of!(DmIoctl, name), at::NAME);
    assert_eq!(offset_of!(DmIoctl, uuid), at::UUID);
    assert_eq!(at::UUID - at::NAME, NAME_LEN);
    assert_eq!(offset_of!(DmIoctl, data), at::UUID + UUID_LEN);

    assert_eq!(size_of::<DmTargetSpec>(), SPEC_LEN);
    assert_eq!(offset_of!(DmTargetSpec, length), 8);
    assert_eq!(offset_of!(DmTargetSpec, status), 16);
    assert_eq!(offset_of!(DmTargetSpec, next), 20);
    assert_eq!(offset_of!(DmTargetSpec, target_type), 24);
    assert_eq!(SPEC_LEN - 24, TYPE_LEN);

    assert_eq!(offset_of!(DmNameList, next), 8);
    assert_eq!(offset_of!(DmNameList, name), 12);
}

#[test]
fn the_ioctl_numbers_are_iowr_0xfd_with_the_header_size() {
    // As strace prints them for dmsetup on x86_64.
    assert_eq!(Cmd::Version.opcode(), 0xc138_fd00);
    assert_eq!(Cmd::ListDevices.opcode(), 0xc138_fd02);
    assert_eq!(Cmd::DevCreate.opcode(), 0xc138_fd03);
    assert_eq!(Cmd::DevRemove.opcode(), 0xc138_fd04);
    assert_eq!(Cmd::DevSuspend.opcode(), 0xc138_fd06);
    assert_eq!(Cmd::DevStatus.opcode(), 0xc138_fd07);
    assert_eq!(Cmd::TableLoad.opcode(), 0xc138_fd09);
    assert_eq!(Cmd::TableStatus.opcode(), 0xc138_fd0c);
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(b[at..at + 4].try_into().unwrap())
}

#[test]
fn a_request_has_the_header_the_kernel_checks() {
    let uuid = "CRYPT-LUKS2-0123456789abcdef0123456789abcdef-pvc-1";
    let req = request(Some("pvc-1"), Some(uuid), flag::READONLY, 2, b"xyz", 0).unwrap();
    assert_eq!(req.len(), HEADER_LEN + 3);
    assert_eq!(u32_at(&req, 0), 4, "version major");
    assert_eq!((u32_at(&req, 4), u32_at(&req, 8)), (0, 0), "minor, patch");
    assert_eq!(u32_at(&req, at::DATA_SIZE), 315);
    assert_eq!(u32_at(&req, at::DATA_START), 312);
    assert_eq!(u32_at(&req, at::TARGET_COUNT), 2);
    assert_eq!(u32_at(&req, at::FLAGS), flag::READONLY);
    assert_eq!(&req[at::NAME..at::NAME + 6], b"pvc-1\0");
    assert!(req[at::NAME + 5..at::UUID].iter().all(|&b| b == 0));
    assert_eq!(&req[at::UUID..at::UUID + uuid.len()], uuid.as_bytes());
    assert_eq!(req[at::UUID + uuid.len()], 0);
    assert_eq!(&req[HEADER_LEN..], b"xyz");
    // Room for an answer: the size covers it, the data start stays.
    let req = request(None, None, 0, 0, &[], 4096).unwrap();
    assert_eq!(u32_at(&req, at::DATA_SIZE) as usize, HEADER_LEN + 4096);
    assert_eq!(req.len(), HEADER_LEN + 4096);
    // Larger than the bound: refused before any allocation.
    let e = request(None, None, 0, 0, &[], MAX_DATA + 1).unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    // And the reply header reads back what was written.
    let info = decode_header(
        Cmd::DevStatus,
        &request(Some("a"), Some("b"), 0, 0, &[], 0).unwrap(),
    )
    .unwrap();
    assert_eq!((info.name.as_str(), info.uuid.as_str()), ("a", "b"));
}

#[test]
fn names_and_uuids_that_do_not_fit_are_refused_not_cut() {
    let long = "n".repeat(127);
    check_name(&long).unwrap();
    for bad in ["", ".", "..", "a/b", "a b", "a\nb", &"n".repeat(128)] {
        let e = check_name(bad).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}: {e}");
    }
    check_uuid(&"u".repeat(128)).unwrap();
    assert!(check_uuid(&"u".repeat(129)).is_err());
    assert!(check_uuid("a b").is_err());
    assert!(request(Some("a/b"), None, 0, 0, &[], 0).is_err());
}

#[test]
fn the_crypt_uuid_is_cryptsetups() {
    let u = crypt_uuid("1b4e28ba-2fa1-11d2-883f-0016d3cca427", "pvc-1").unwrap();
    assert_eq!(u, "CRYPT-LUKS2-1b4e28ba2fa111d2883f0016d3cca427-pvc-1");
    assert_eq!(
        parse_crypt_uuid(&u),
        Some(("LUKS2", "1b4e28ba2fa111d2883f0016d3cca427", "pvc-1"))
    );
    // A name with dashes stays whole: the uuid has none once written.
    let u = crypt_uuid("1b4e28ba-2fa1-11d2-883f-0016d3cca427", "a-b-c").unwrap();
    assert_eq!(parse_crypt_uuid(&u).unwrap().2, "a-b-c");
    // What is not a LUKS mapping of cryptsetup's is not one.
    for other in [
        "CRYPT-PLAIN-x",
        "LVM-abc",
        "CRYPT-LUKS2--x",
        "CRYPT-LUKS2-zz-x",
        "CRYPT-LUKS2-abc-",
        "CRYPT-SUBDEV-abc-x",
    ] {
        assert_eq!(parse_crypt_uuid(other), None, "{other}");
    }
    // 128 bytes at most: 12 + 32 + 1 + 83 fits, one more does not.
    let uuid = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";
    assert_eq!(crypt_uuid(uuid, &"n".repeat(83)).unwrap().len(), 128);
    assert!(crypt_uuid(uuid, &"n".repeat(84)).is_err());
    assert!(crypt_uuid("", "x").is_err());
    assert!(crypt_uuid("1b4e/28ba", "x").is_err());
    assert!(crypt_uuid(uuid, "a/b").is_err());
}

fn crypt(key: CryptKey<'_>) -> Crypt<'_> {
    Crypt {
        cipher: "aes-xts-plain64",
        key,
        iv_offset: 0,
        device: (254, 16),
        offset: 32768,
        sector_size: 512,
        allow_discards: false,
        aead_tag: None,
    }
}

#[test]
fn a_crypt_line_is_what_dm_crypt_parses() {
    let key: Vec<u8> = (0..64).collect();
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let line = crypt(CryptKey::Hex(&key)).params().unwrap();
    assert_eq!(*line, format!("aes-xts-plain64 {hex} 0 254:16 32768"));

    let mut c = crypt(CryptKey::Logon {
        size: 64,
        description: "cryptsetup:1b4e28ba-2fa1-11d2-883f-0016d3cca427-d0",
    });
    c.iv_offset = 8;
    c.sector_size = 4096;
    c.allow_discards = true;
    assert_eq!(
        *c.params().unwrap(),
        "aes-xts-plain64 :64:logon:cryptsetup:1b4e28ba-2fa1-11d2-883f-0016d3cca427-d0 8 254:16 32768 \
         2 allow_discards sector_size:4096"
    );
    c.allow_discards = false;
    assert!(c.params().unwrap().ends_with(" 32768 1 sector_size:4096"));

    for (cipher, sector) in [
        ("aes xts", 512),
        ("", 512),
        ("aes-xts-plain64", 1024 + 512),
        ("aes-xts-plain64", 8192),
    ] {
        let mut c = crypt(CryptKey::Hex(&key));
        c.cipher = cipher;
        c.sector_size = sector;
        let e = c.params().unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{cipher} {sector}: {e}");
    }
    assert!(crypt(CryptKey::Hex(&[])).params().is_err());
    let spaced = crypt(CryptKey::Logon {
        size: 64,
        description: "a b",
    });
    assert!(spaced.params().is_err());
}

/// Reads a DM_TABLE_LOAD payload as the kernel's `populate_table` does:
/// `next` from the previous spec (the first from the header, at data_start).
fn populate_table(param: &[u8], count: u32) -> Vec<(u64, u64, String, String)> {
    let mut out = Vec::new();
    let mut spec = 0usize;
    let mut next = u32_at(param, at::DATA_START) as usize;
    for _ in 0..count {
        spec += next;
        let s = &param[spec..];
        let kind = c_str(&s[24..40]).unwrap();
        let params = c_str(&s[40..]).unwrap();
        out.push((get_u64(s, 0).unwrap(), get_u64(s, 8).unwrap(), kind, params));
        assert_eq!(spec % 8, 0, "specs are 8-aligned");
        next = u32_at(s, 20) as usize;
    }
    out
}

#[test]
fn a_table_is_laid_out_as_populate_table_reads_it() {
    let t = |start, length, params: &str| Target {
        start,
        length,
        kind: "crypt",
        params: Zeroizing::new(params.to_string()),
    };
    let targets = [
        t(0, 2048, "aes-xts-plain64 :64:logon:k 0 8:0 4096"),
        t(2048, 8, "x"),
    ];
    let data = encode_targets(&targets).unwrap();
    assert_eq!(data.len() % 8, 0);
    let req = request(Some("v"), None, flag::SECURE_DATA, 2, &data, 0).unwrap();
    let read = populate_table(&req, 2);
    assert_eq!(
        read,
        vec![
            (
                0,
                2048,
                "crypt".into(),
                "aes-xts-plain64 :64:logon:k 0 8:0 4096".into()
            ),
            (2048, 8, "crypt".into(), "x".into()),
        ]
    );
    // The status field is zero.
    assert_eq!(u32_at(&data, 16), 0);

    let bad_kind = Target {
        kind: "a-target-type-too-long",
        ..t(0, 1, "x")
    };
    assert!(encode_targets(&[bad_kind]).is_err());
    assert!(encode_targets(&[t(0, 1, "a\0b")]).is_err());
    let huge = t(0, 1, &"x".repeat(MAX_DATA));
    assert!(matches!(
        encode_targets(&[huge]),
        Err(Error::TooLarge { .. })
    ));
}

/// A reply buffer: a header (version 4, data at 312, `flags`,
/// `target_count`) and `data`.
fn reply(flags: u32, target_count: u32, data: &[u8]) -> Vec<u8> {
    let mut b = request(
        Some("v"),
        Some("CRYPT-LUKS2-ab-v"),
        flags,
        target_count,
        data,
        0,
    )
    .unwrap()
    .to_vec();
    b[4..8].copy_from_slice(&47u32.to_ne_bytes());
    b
}

/// One `struct dm_name_list` entry as `list_devices` writes it since 5.14.
fn name_entry(dev: u64, name: &str, uuid: Option<&str>) -> Vec<u8> {
    let mut e = Vec::new();
    e.extend_from_slice(&dev.to_ne_bytes());
    e.extend_from_slice(&0u32.to_ne_bytes()); // next, set by the caller
    e.extend_from_slice(name.as_bytes());
    e.push(0);
    e.resize(e.len().next_multiple_of(8), 0);
    e.extend_from_slice(&7u32.to_ne_bytes()); // event_nr
    e.extend_from_slice(&(if uuid.is_some() { 1u32 } else { 2 }).to_ne_bytes());
    if let Some(u) = uuid {
        e.extend_from_slice(u.as_bytes());
        e.push(0);
    }
    e.resize(e.len().next_multiple_of(8), 0);
    e
}

fn chain(entries: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let mut e = e.clone();
        if i + 1 < entries.len() {
            let next = u32::try_from(e.len()).unwrap();
            e[8..12].copy_from_slice(&next.to_ne_bytes());
        }
        out.extend_from_slice(&e);
    }
    out
}

#[test]
fn a_device_list_is_read_with_its_uuids() {
    let data = chain(&[
        name_entry(253 << 8, "pvc-1", Some("CRYPT-LUKS2-ab-pvc-1")),
        name_entry((253 << 8) | 1, "other", None),
        // Minor 300: its high bits sit above the major's.
        name_entry(
            (253 << 8) | (300 & 0xff) | ((300 & !0xff) << 12),
            "big",
            Some("LVM-x"),
        ),
    ]);
    let buf = reply(0, 0, &data);
    let listed = decode_list(reply_data(Cmd::ListDevices, &buf).unwrap()).unwrap();
    assert_eq!(
        listed,
        vec![
            Listed {
                name: "pvc-1".into(),
                dev: (253, 0),
                uuid: Some("CRYPT-LUKS2-ab-pvc-1".into())
            },
            Listed {
                name: "other".into(),
                dev: (253, 1),
                uuid: None
            },
            Listed {
                name: "big".into(),
                dev: (253, 300),
                uuid: Some("LVM-x".into())
            },
        ]
    );
    // No devices: data_size leaves no data (the kernel's dev 0 lies past it).
    assert_eq!(decode_list(&[]).unwrap(), vec![]);
    assert_eq!(decode_list(&[0u8; 16]).unwrap(), vec![]);
    // A kernel before the uuids: the name, then nothing.
    let mut old = Vec::new();
    old.extend_from_slice(&(253u64 << 8).to_ne_bytes());
    old.extend_from_slice(&0u32.to_ne_bytes());
    old.extend_from_slice(b"pvc-1\0\0\0\0\0\0\0");
    assert_eq!(decode_list(&old).unwrap()[0].uuid, None);
}

#[test]
fn a_hostile_device_list_is_refused_not_followed() {
    let one = name_entry(253 << 8, "a", Some("u"));
    // next past the end of the data.
    let mut e = one.clone();
    e[8..12].copy_from_slice(&4096u32.to_ne_bytes());
    assert!(decode_list(&e).is_err());
    // next that does not move past the entry's own header.
    let mut e = one.clone();
    e[8..12].copy_from_slice(&4u32.to_ne_bytes());
    assert!(decode_list(&e).is_err());
    // A name without its NUL.
    let mut cut = Vec::new();
    cut.extend_from_slice(&(253u64 << 8).to_ne_bytes());
    cut.extend_from_slice(&0u32.to_ne_bytes());
    cut.extend_from_slice(b"abc");
    assert!(decode_list(&cut).is_err());
    // An entry shorter than its header.
    assert!(decode_list(&[1, 0, 0]).is_err());
    // A reply whose data size runs past the buffer.
    let mut buf = reply(0, 0, &one);
    buf[at::DATA_SIZE..at::DATA_SIZE + 4].copy_from_slice(&100_000u32.to_ne_bytes());
    assert!(reply_data(Cmd::ListDevices, &buf).is_err());
    let mut buf = reply(0, 0, &one);
    buf[at::DATA_START..at::DATA_START + 4].copy_from_slice(&8u32.to_ne_bytes());
    assert!(reply_data(Cmd::ListDevices, &buf).is_err());
}

/// DM_TABLE_STATUS's data as `retrieve_status` writes it: `next` from the
/// start of the data.
fn status_data(lines: &[(u64, u64, &str, &str)]) -> Vec<u8> {
    let mut out: Vec<u8> = Vec::new();
    for (start, length, kind, text) in lines {
        let at = out.len();
        out.extend_from_slice(&start.to_ne_bytes());
        out.extend_from_slice(&length.to_ne_bytes());
        out.extend_from_slice(&[0; 8]);
        let mut ty = [0u8; 16];
        ty[..kind.len()].copy_from_slice(kind.as_bytes());
        out.extend_from_slice(&ty);
        out.extend_from_slice(text.as_bytes());
        out.push(0);
        out.resize(out.len().next_multiple_of(8), 0);
        let next = u32::try_from(out.len()).unwrap();
        out[at + 20..at + 24].copy_from_slice(&next.to_ne_bytes());
    }
    out
}

#[test]
fn a_table_status_is_read_target_by_target() {
    let data = status_data(&[
        (
            0,
            2048,
            "crypt",
            "aes-xts-plain64 :64:logon:cryptsetup:x-d0 0 254:16 32768",
        ),
        (2048, 8, "error", ""),
    ]);
    let buf = reply(flag::ACTIVE_PRESENT, 2, &data);
    let info = decode_header(Cmd::TableStatus, &buf).unwrap();
    assert_eq!(info.target_count, 2);
    assert!(info.has_live_table() && !info.suspended());
    let lines = decode_targets(reply_data(Cmd::TableStatus, &buf).unwrap(), 2).unwrap();
    assert_eq!(
        (lines[0].start, lines[0].length, lines[0].kind.as_str()),
        (0, 2048, "crypt")
    );
    assert!(lines[0].text.starts_with("aes-xts-plain64 :64:logon:"));
    assert_eq!(
        (
            lines[1].start,
            lines[1].kind.as_str(),
            lines[1].text.as_str()
        ),
        (2048, "error", "")
    );
    // Debug never shows the line (a hex key would be in it).
    assert!(!format!("{:?}", lines[0]).contains("aes"));

    // More targets than data, a next that goes back, a string without NUL.
    assert!(decode_targets(&data, 3).is_err());
    let mut back = data.clone();
    back[20..24].copy_from_slice(&0u32.to_ne_bytes());
    assert!(decode_targets(&back, 2).is_err());
    let mut open = status_data(&[(0, 1, "crypt", "abc")]);
    open.truncate(SPEC_LEN + 3);
    assert!(decode_targets(&open, 1).is_err());
    assert_eq!(decode_targets(&[], 0).unwrap().len(), 0);
    // A string that runs into the next spec is cut there, so refused.
    let mut runs = data.clone();
    let first_end = u32_at(&data, 20) as usize;
    runs[SPEC_LEN..first_end].fill(b'a');
    assert!(decode_targets(&runs, 2).is_err());
}

#[test]
fn a_reply_header_is_checked() {
    let mut buf = reply(flag::SUSPEND | flag::INACTIVE_PRESENT, 1, &[]);
    buf[at::DEV..at::DEV + 8].copy_from_slice(&((253u64 << 8) | 5).to_ne_bytes());
    buf[at::OPEN_COUNT..at::OPEN_COUNT + 4].copy_from_slice(&2i32.to_ne_bytes());
    let info = decode_header(Cmd::DevStatus, &buf).unwrap();
    assert_eq!(info.dev, (253, 5));
    assert_eq!(info.open_count, 2);
    assert!(info.suspended() && !info.has_live_table());
    assert_eq!(info.uuid, "CRYPT-LUKS2-ab-v");

    assert!(decode_header(Cmd::DevStatus, &buf[..HEADER_LEN - 1]).is_err());
    let mut v5 = buf.clone();
    v5[0..4].copy_from_slice(&5u32.to_ne_bytes());
    assert!(decode_header(Cmd::DevStatus, &v5).is_err());
    let mut no_nul = buf.clone();
    no_nul[at::NAME..at::UUID].fill(b'a');
    assert!(decode_header(Cmd::DevStatus, &no_nul).is_err());
}

#[test]
fn without_device_mapper_the_error_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let e = Control::open_at(&dir.path().join("control")).err().unwrap();
    assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    assert_eq!(e.code(), Code::FailedPrecondition);
    let msg = e.to_string();
    assert!(msg.starts_with("device-mapper is not available: "), "{msg}");
    assert!(
        msg.contains("does not exist") && msg.contains("dm-mod"),
        "{msg}"
    );

    // A node that is not device-mapper's: DM_VERSION is refused with ENOTTY.
    let file = dir.path().join("not-control");
    std::fs::write(&file, b"").unwrap();
    let e = Control::open_at(&file).err().unwrap();
    assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("is not device-mapper's control node"),
        "{e}"
    );

    // And on this host, whichever it is, never a bare errno.
    match Control::open() {
        Ok(c) => assert_eq!(c.version.major, 4),
        Err(e) => assert!(
            matches!(e, Error::Unavailable { .. } | Error::Sys(_)),
            "{e}"
        ),
    }
}
