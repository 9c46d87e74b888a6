//! A LUKS2 keyslot unlocked: the agent's own header read and unlock
//! (`crust_agent::luks2`, in this process, from opening the image to the
//! volume key) beside `cryptsetup open --test-passphrase` (a process: its
//! start is part of its figure) on the same image, so the same KDF costs,
//! alternating who goes first. The images are made by `cryptsetup
//! luksFormat` with the costs forced, so both sides do the same work:
//!
//! - PBKDF2-SHA256, 1,000,000 iterations;
//! - Argon2id, 256 MiB, 4 passes, 4 lanes (what cryptsetup writes on a
//!   host with 4 CPUs or more). Both run the lanes on threads, one a CPU
//!   at most (the agent's crust-argon2, cryptsetup's libargon2); measured
//!   2026-11-28 on 2 CPUs: 0.70–0.92x, median of nine runs 0.78x.

use std::path::Path;
use std::time::Instant;

use crust_agent::luks2::{header, unlock};
use serde_json::json;
use zeroize::Zeroizing;

use crate::report::{fmt_secs, Figure, Verdict};
use crate::sys::{self, median, secs, R};

const PASSPHRASE: &[u8] = b"crust bench";
const TARGET: &str = "≤ 1.1x cryptsetup open --test-passphrase";

/// The keys, titles and targets of this section.
pub fn keys() -> Vec<(&'static str, &'static str, &'static str)> {
    vec![
        (
            "luks2_unlock_pbkdf2",
            "LUKS2 keyslot unlock, PBKDF2-SHA256 1M iterations",
            TARGET,
        ),
        (
            "luks2_unlock_argon2id",
            "LUKS2 keyslot unlock, Argon2id 256 MiB × 4 passes, 4 lanes",
            TARGET,
        ),
    ]
}

/// The section's figures, each from `runs` alternating pairs.
pub fn figures(work: &Path, runs: usize) -> Vec<Figure> {
    let kdfs: [(&str, &[&str]); 2] = [
        (
            "luks2_unlock_pbkdf2",
            &[
                "--pbkdf",
                "pbkdf2",
                "--hash",
                "sha256",
                "--pbkdf-force-iterations",
                "1000000",
            ],
        ),
        (
            "luks2_unlock_argon2id",
            &[
                "--pbkdf",
                "argon2id",
                "--pbkdf-memory",
                "262144",
                "--pbkdf-parallel",
                "4",
                "--pbkdf-force-iterations",
                "4",
            ],
        ),
    ];
    kdfs.iter()
        .map(|(key, args)| {
            let (_, title, target) = keys().into_iter().find(|k| k.0 == *key).unwrap_or_default();
            match measure(work, key, args, runs) {
                Ok(f) => f,
                Err(why) => Figure::not_measured(key, title, target, why),
            }
        })
        .collect()
}

fn measure(work: &Path, key: &str, args: &[&str], runs: usize) -> R<Figure> {
    std::fs::create_dir_all(work).map_err(|e| e.to_string())?;
    let img = work.join(format!("{key}.img"));
    let pass = work.join("luks2-passphrase");
    std::fs::write(&pass, PASSPHRASE).map_err(|e| e.to_string())?;
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(32 << 20))
        .map_err(|e| e.to_string())?;
    let (img_s, pass_s) = (img.to_string_lossy(), pass.to_string_lossy());
    let mut format = vec![
        "luksFormat",
        "--type",
        "luks2",
        "--batch-mode",
        "--key-file",
        &pass_s,
    ];
    format.extend_from_slice(args);
    format.push(&img_s);
    sys::run("cryptsetup", &format)?;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for i in 0..runs {
        for first in [i % 2 == 0, i % 2 != 0] {
            if first {
                ours.push(agent(&img)?);
            } else {
                let t = Instant::now();
                sys::run(
                    "cryptsetup",
                    &["open", "--test-passphrase", "--key-file", &pass_s, &img_s],
                )?;
                theirs.push(secs(t.elapsed()));
            }
        }
    }
    let _ = std::fs::remove_file(&img);
    let (_, title, target) = keys().into_iter().find(|k| k.0 == key).unwrap_or_default();
    let (o, b) = (median(&ours), median(&theirs));
    Ok(Figure {
        key: key.into(),
        title: title.into(),
        ours: fmt_secs(o),
        baseline: format!("cryptsetup {}", fmt_secs(b)),
        ratio: format!("{:.2}x", o / b),
        target: target.into(),
        verdict: Verdict::from(o <= b * 1.1),
        data: json!({ "crust_s": ours, "cryptsetup_s": theirs, "median_crust_s": o,
                      "median_cryptsetup_s": b, "format_args": args }),
    })
}

/// The agent's unlock, from opening the image to the volume key.
fn agent(img: &Path) -> R<f64> {
    let t = Instant::now();
    let f = std::fs::File::open(img).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    let h = header::read(&f, len).map_err(|e| e.to_string())?;
    let limits = unlock::Limits {
        argon2_memory_kib: 1 << 20,
        argon2_passes: 64,
        pbkdf2_iterations: 100_000_000,
    };
    let pass = Zeroizing::new(PASSPHRASE.to_vec());
    let u = unlock::unlock(&f, &h, &pass, limits, None).map_err(|e| e.to_string())?;
    let d = secs(t.elapsed());
    if u.volume_key.bytes().len() != 64 {
        return Err(format!("a {}-byte volume key", u.volume_key.bytes().len()));
    }
    Ok(d)
}
