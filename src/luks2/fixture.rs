//! Headers built and edited by hand for the tests beside the logic: a copy
//! laid out as cryptsetup lays it out, its checksum, and the JSON
//! cryptsetup writes for a PBKDF2 keyslot, ready to be edited. Imports
//! nothing of the module it serves, so that any of its files can use it.

use sha2::{Digest as _, Sha256};

/// Writes one copy of a header at `offset` of `img` (grown as needed): the
/// binary header as cryptsetup lays it out, `json` NUL-padded to the area,
/// and the checksum over both.
pub(crate) fn write_copy(img: &mut Vec<u8>, offset: u64, hdr_size: u64, seqid: u64, json: &[u8]) {
    let (at, size) = (
        usize::try_from(offset).unwrap(),
        usize::try_from(hdr_size).unwrap(),
    );
    if img.len() < at + size {
        img.resize(at + size, 0);
    }
    let h = &mut img[at..at + size];
    h.fill(0);
    h[..6].copy_from_slice(if offset == 0 {
        b"LUKS\xba\xbe"
    } else {
        b"SKUL\xba\xbe"
    });
    h[6..8].copy_from_slice(&2u16.to_be_bytes());
    h[8..16].copy_from_slice(&hdr_size.to_be_bytes());
    h[16..24].copy_from_slice(&seqid.to_be_bytes());
    h[72..78].copy_from_slice(b"sha256");
    h[168..204].copy_from_slice(b"1bf7a5b2-0000-4000-8000-000000000000");
    h[256..264].copy_from_slice(&offset.to_be_bytes());
    h[4096..4096 + json.len()].copy_from_slice(json);
    rechecksum(img, offset, hdr_size);
}

/// Recomputes the checksum of the copy at `offset`, after an edit.
pub(crate) fn rechecksum(img: &mut [u8], offset: u64, hdr_size: u64) {
    let (at, size) = (
        usize::try_from(offset).unwrap(),
        usize::try_from(hdr_size).unwrap(),
    );
    img[at + 448..at + 512].fill(0);
    let sum = Sha256::digest(&img[at..at + size]);
    img[at + 448..at + 480].copy_from_slice(&sum);
}

/// The JSON of a 16 KiB header with one PBKDF2 keyslot, one crypt segment
/// from 16 MiB and one digest, as cryptsetup writes it; `edit` changes the
/// text before it is written.
pub(crate) fn json(edit: impl Fn(String) -> String) -> Vec<u8> {
    let salt = "2l3gRScdV3fYdPjlkSaf2cMmUhlnQrgrJqou/QUsS+0=";
    edit(format!(
        concat!(
            r#"{{"keyslots":{{"0":{{"type":"luks2","key_size":64,"af":{{"type":"luks1","stripes":4000,"hash":"sha256"}},"#,
            r#""area":{{"type":"raw","offset":"32768","size":"258048","encryption":"aes-xts-plain64","key_size":64}},"#,
            r#""kdf":{{"type":"pbkdf2","hash":"sha256","iterations":1000,"salt":"{salt}"}}}}}},"tokens":{{}},"#,
            r#""segments":{{"0":{{"type":"crypt","offset":"16777216","size":"dynamic","iv_tweak":"0","encryption":"aes-xts-plain64","sector_size":4096}}}},"#,
            r#""digests":{{"0":{{"type":"pbkdf2","keyslots":["0"],"segments":["0"],"hash":"sha256","iterations":1000,"salt":"{salt}","digest":"{salt}"}}}},"#,
            r#""config":{{"json_size":"12288","keyslots_size":"16744448"}}}}"#
        ),
        salt = salt
    ))
    .into_bytes()
}

/// A 32 MiB device (as far as the reader knows: only the headers are
/// held) with both copies of a 16 KiB header carrying `json`.
pub(crate) fn image(json: &[u8]) -> Vec<u8> {
    let mut img = Vec::new();
    write_copy(&mut img, 0, 16384, 3, json);
    write_copy(&mut img, 16384, 16384, 3, json);
    img
}

/// The device size [`image`] stands for.
pub(crate) const DEVICE: u64 = 32 << 20;
