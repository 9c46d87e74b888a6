//! LUKS2 images made and read on the host with cryptsetup, the oracle the
//! agent's encrypted volumes are held to: an image holding a filesystem
//! with known files, encrypted in place by `cryptsetup reencrypt --encrypt`
//! (which needs no device-mapper, which this host lacks); and the plaintext
//! of any LUKS2 image decrypted on the host with the volume key cryptsetup
//! dumps and AES-XTS from python3-cryptography, so a filesystem the agent
//! wrote through its own mapping is checked by tools that share none of its
//! code.

use std::path::{Path, PathBuf};

use crate::disks::run;
use crate::needs;

/// How a keyslot's passphrase is stretched.
#[derive(Clone, Copy, Debug)]
pub enum Kdf {
    /// PBKDF2-SHA256 with this many iterations.
    Pbkdf2(u32),
    /// Argon2id with this much memory (KiB), passes and lanes.
    Argon2id {
        memory_kib: u32,
        passes: u32,
        lanes: u32,
    },
}

impl Kdf {
    fn args(self) -> Vec<String> {
        match self {
            Kdf::Pbkdf2(n) => vec![
                "--pbkdf".into(),
                "pbkdf2".into(),
                "--pbkdf-force-iterations".into(),
                n.to_string(),
            ],
            Kdf::Argon2id {
                memory_kib,
                passes,
                lanes,
            } => vec![
                "--pbkdf".into(),
                "argon2id".into(),
                "--pbkdf-memory".into(),
                memory_kib.to_string(),
                "--pbkdf-force-iterations".into(),
                passes.to_string(),
                "--pbkdf-parallel".into(),
                lanes.to_string(),
            ],
        }
    }
}

/// The tools the images need: cryptsetup, python3 with cryptography.
#[track_caller]
pub fn tools() {
    needs::tools(
        &["cryptsetup", "python3"],
        "apt-get install cryptsetup-bin python3-cryptography",
    );
}

/// The header room `luks_image` asks cryptsetup to make: the data moves
/// 16 MiB down, and the LUKS2 data segment starts 8 MiB in.
pub const REDUCE_MIB: u64 = 16;

/// An image `dir/name` of `mib` MiB whose filesystem `fs` ("ext4" or
/// "xfs", of `mib - 16` MiB, filled by `fill` while loop-mounted on the
/// host) is then encrypted in place as LUKS2 with `kdf` and the passphrase
/// in `pass_file`, `sector` bytes a sector.
#[track_caller]
pub fn luks_image(
    dir: &Path,
    name: &str,
    fs: &str,
    mib: u64,
    (kdf, sector): (Kdf, u32),
    pass_file: &Path,
    fill: impl FnOnce(&Path),
) -> PathBuf {
    tools();
    let img = crate::vm::blank(dir, name, mib);
    let i = img.to_str().unwrap();
    let fs_mib = format!("{}M", mib - REDUCE_MIB);
    match fs {
        "ext4" => run("mkfs.ext4", &["-q", "-F", i, &fs_mib]),
        // Its sectors no smaller than the encryption's, as cryptsetup asks.
        _ => run(
            "mkfs.xfs",
            &[
                "-q",
                "-f",
                "-s",
                &format!("size={sector}"),
                "-d",
                &format!("size={}m", mib - REDUCE_MIB),
                i,
            ],
        ),
    };
    let m = dir.join(format!("{name}.mnt"));
    std::fs::create_dir_all(&m).unwrap();
    run("mount", &["-o", "loop", i, m.to_str().unwrap()]);
    fill(&m);
    run("umount", &[m.to_str().unwrap()]);
    let mut args: Vec<String> = [
        "reencrypt",
        "-q",
        "--encrypt",
        "--type",
        "luks2",
        "--cipher",
        "aes-xts-plain64",
        "--key-size",
        "512",
        "--reduce-device-size",
        "16M",
        "--sector-size",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(sector.to_string());
    args.extend(kdf.args());
    args.extend([
        "--key-file".into(),
        pass_file.to_str().unwrap().into(),
        i.into(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run("cryptsetup", &args);
    img
}

/// Whether cryptsetup opens `img`'s keyslot with the passphrase in `pass_file`.
pub fn opens(img: &Path, pass_file: &Path) -> bool {
    std::process::Command::new("cryptsetup")
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(pass_file)
        .arg(img)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// `cryptsetup luksDump` of `img`.
pub fn dump(img: &Path) -> String {
    run("cryptsetup", &["luksDump", img.to_str().unwrap()])
}

/// The plaintext of `img`'s data segment, decrypted on the host into
/// `img.plain` with the volume key cryptsetup dumps for `pass_file`.
#[track_caller]
pub fn plaintext(img: &Path, pass_file: &Path) -> PathBuf {
    tools();
    let out = img.with_extension("plain");
    run(
        "python3",
        &[
            "-c",
            DECRYPT,
            img.to_str().unwrap(),
            pass_file.to_str().unwrap(),
            out.to_str().unwrap(),
        ],
    );
    out
}

/// Whether `needle` appears anywhere in the file `img`.
pub fn contains(img: &Path, needle: &[u8]) -> bool {
    let data = std::fs::read(img).unwrap();
    data.windows(needle.len()).any(|w| w == needle)
}

/// Decrypts a LUKS2 image's data segment (aes-xts-plain64, IVs counted in
/// 512-byte sectors from the segment's iv_tweak) with the volume key
/// `cryptsetup luksDump --dump-volume-key` prints.
const DECRYPT: &str = r#"
import re, subprocess, sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
img, pw, out = sys.argv[1:4]
dump = subprocess.run(["cryptsetup", "luksDump", img], check=True, capture_output=True, text=True).stdout
seg = dump.split("Data segments:")[1].split("Keyslots:")[0]
offset = int(re.search(r"offset: (\d+) \[bytes\]", seg).group(1))
sector = int(re.search(r"sector: (\d+) \[bytes\]", seg).group(1))
assert "aes-xts-plain64" in seg, seg
mk = subprocess.run(["cryptsetup", "luksDump", "--dump-volume-key", "--batch-mode", "--key-file", pw, img],
                    check=True, capture_output=True, text=True).stdout.split("MK dump:")[1]
key = bytes.fromhex("".join(re.findall(r"\b[0-9a-f]{2}\b", mk)))
assert len(key) in (32, 64), len(key)
with open(img, "rb") as f, open(out, "wb") as o:
    f.seek(offset)
    n = 0
    while True:
        block = f.read(sector)
        if len(block) < sector:
            break
        iv = (n * sector // 512).to_bytes(16, "little")
        d = Cipher(algorithms.AES(key), modes.XTS(iv)).decryptor()
        o.write(d.update(block) + d.finalize())
        n += 1
"#;
