//! Which accelerator QEMU uses: KVM when a probe boot shows that a guest
//! really runs there, else TCG (on some hosts /dev/kvm exists but a guest
//! never runs).

use std::fs;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Which accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Software emulation: works everywhere, slower.
    Tcg,
    /// Hardware virtualization through /dev/kvm.
    Kvm,
}

impl Accel {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }
}

/// Picks the accelerator: `CRUST_VM_ACCEL=tcg|kvm`, else KVM when a probe
/// boot prints on the console within a few seconds, else TCG. (On some hosts
/// /dev/kvm exists but a guest never runs; the probe catches that.)
pub fn choose_accel(kernel: &Path) -> Accel {
    match std::env::var("CRUST_VM_ACCEL").as_deref() {
        Ok("kvm") => return Accel::Kvm,
        Ok("tcg") => return Accel::Tcg,
        _ => {}
    }
    if fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return Accel::Tcg;
    }
    // One probe per host boot.
    let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let cache = std::env::temp_dir().join(format!("crust-vm-kvm-probe-{}", boot_id.trim()));
    if let Ok(v) = fs::read_to_string(&cache) {
        return if v.trim() == "kvm" {
            Accel::Kvm
        } else {
            Accel::Tcg
        };
    }
    let accel = if kvm_probe(kernel) {
        Accel::Kvm
    } else {
        Accel::Tcg
    };
    let _ = fs::write(&cache, accel.name());
    accel
}

fn kvm_probe(kernel: &Path) -> bool {
    let child = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-m",
            "128",
            "-nodefaults",
            "-no-user-config",
        ])
        .args([
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            "stdio",
            "-kernel",
        ])
        .arg(kernel)
        .args([
            "-append",
            "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else { return false };
    let Some(mut out) = child.stdout.take() else {
        return false;
    };
    // The real-mode boot stub prints ("Probing EDD") even where KVM then
    // hangs; only the kernel's own banner proves that the guest runs.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut b = [0u8; 256];
        while let Ok(n) = out.read(&mut b) {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&b[..n]);
            if seen.windows(13).any(|w| w == b"Linux version") {
                let _ = tx.send(());
                break;
            }
        }
    });
    let ok = rx.recv_timeout(Duration::from_secs(3)).is_ok();
    let _ = child.kill();
    let _ = child.wait();
    ok
}
