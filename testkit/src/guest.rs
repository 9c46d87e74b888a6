//! The systemd guest: a copy of the cached Debian image (`make
//! guest-image`) with the release agent, the repository's
//! `guest/crust-agent.service` and a drop-in that copies the agent's log to
//! the console (where crust-vm sees it listen), plus what a test puts in
//! it; and the options that boot it with crust-vm.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crust_vm::{default_build_dir, Vm, VmOptions};

use crate::disks::{run, Mounted};

/// A copy of the guest image, loop-mounted while a test adds to it.
pub struct Image {
    path: PathBuf,
    mounted: Mounted,
}

impl Image {
    /// `dir/root.img`: the cached image with the agent installed as a
    /// service, enabled.
    #[track_caller]
    pub fn new(dir: &Path) -> Image {
        let base = default_build_dir().join("guest/root.img");
        assert!(
            base.is_file(),
            "run `make guest-image` first ({} missing)",
            base.display()
        );
        let path = dir.join("root.img");
        run(
            "cp",
            &[
                "--sparse=always",
                base.to_str().unwrap(),
                path.to_str().unwrap(),
            ],
        );
        let agent = release_agent();
        assert!(
            agent.is_file(),
            "build the release agent first (make initrd): {} missing",
            agent.display()
        );
        let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest/crust-agent.service");
        let image = Image {
            mounted: Mounted::new(&path, "ext4", "loop"),
            path,
        };
        image.put(
            "usr/local/bin/crust-agent",
            &std::fs::read(&agent).unwrap(),
            0o755,
        );
        image.unit(
            "crust-agent.service",
            &std::fs::read_to_string(&unit).unwrap(),
        );
        image.put(
            "etc/systemd/system/crust-agent.service.d/console.conf",
            b"[Service]\nStandardError=journal+console\n",
            0o644,
        );
        image
    }

    /// The image's root directory, while it is mounted.
    pub fn root(&self) -> &Path {
        &self.mounted.path
    }

    /// Writes `rel` (relative to the root) with `mode`, making its directories.
    pub fn put(&self, rel: &str, text: &[u8], mode: u32) {
        let p = self.root().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// Installs the unit `name` and enables it in multi-user.target, as
    /// `systemctl enable` would.
    pub fn unit(&self, name: &str, text: &str) {
        self.put(
            &format!("etc/systemd/system/{name}"),
            text.as_bytes(),
            0o644,
        );
        let wants = self
            .root()
            .join("etc/systemd/system/multi-user.target.wants");
        std::fs::create_dir_all(&wants).unwrap();
        std::os::unix::fs::symlink(format!("/etc/systemd/system/{name}"), wants.join(name))
            .unwrap();
    }

    /// Installs `script` as the test's oneshot unit `crust-test.service`,
    /// run after the agent, its output on the console.
    pub fn test_unit(&self, script: &str) {
        self.put("usr/local/bin/crust-test", script.as_bytes(), 0o755);
        self.unit(
            "crust-test.service",
            "[Unit]\nAfter=crust-agent.service\n[Service]\nType=oneshot\nExecStart=/usr/local/bin/crust-test\nStandardOutput=journal+console\n[Install]\nWantedBy=multi-user.target\n",
        );
    }

    /// Writes the OCI bundle `var/lib/crust-test/bundle` for crun to run
    /// `c`: a read-only rootfs that shares the guest's /usr, with `bin`,
    /// `lib`, `lib64` and `sbin` linked into it and a mount point for each
    /// bind.
    pub fn bundle(&self, c: &Container) {
        let bundle = "var/lib/crust-test/bundle";
        let config = c.config().to_string();
        self.put(&format!("{bundle}/config.json"), config.as_bytes(), 0o644);
        let rootfs = self.root().join(bundle).join("rootfs");
        let dirs = c.binds.iter().map(|b| b.0.trim_start_matches('/'));
        for d in ["usr", "proc", "dev", "tmp"].into_iter().chain(dirs) {
            std::fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        for (link, to) in [
            ("bin", "usr/bin"),
            ("lib", "usr/lib"),
            ("lib64", "usr/lib64"),
            ("sbin", "usr/sbin"),
        ] {
            std::os::unix::fs::symlink(to, rootfs.join(link)).unwrap();
        }
    }

    /// Unmounts the copy: its path, to boot.
    pub fn done(self) -> PathBuf {
        let Image { path, mounted } = self;
        drop(mounted);
        path
    }
}

/// The release agent `make initrd` built, in this build's target directory
/// (`<target>/<triple>/release/`, beside this test's profile).
pub fn release_agent() -> PathBuf {
    let profile = crate::build::profile_dir();
    profile.parent().unwrap().join("release/crust-agent")
}

/// Options that boot the image `root` as sandbox `dir`: the image's own
/// kernel and initramfs, `memory_mib`, no readiness notice (the agent
/// answering is the sign), five minutes to boot under TCG.
pub fn options(dir: PathBuf, root: PathBuf, memory_mib: u32) -> VmOptions {
    let build = default_build_dir();
    let mut opts = VmOptions::new(dir);
    opts.kernel = build.join("guest/vmlinuz");
    opts.initrd = build.join("guest/initrd.img");
    opts.root_disk = Some(root);
    opts.memory_mib = memory_mib;
    opts.notify = false;
    opts.boot_timeout = Duration::from_secs(300);
    opts
}

/// Waits until the console shows `what`: the console then, or a failure
/// showing its end.
#[track_caller]
pub fn console_until(vm: &Vm, what: &str, limit: Duration) -> String {
    crate::vm::console_until(vm, limit, |text| text.contains(what)).unwrap_or_else(|text| {
        panic!(
            "the console never showed {what:?}; its end:\n{}",
            crate::vm::tail(&text, 4000)
        )
    })
}

/// The console's `CRUST-TEST` lines (what the test's guest units said),
/// one a line.
pub fn said(text: &str) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("CRUST-TEST")).collect();
    lines.join("\n")
}

/// A container for the guest's crun: who it runs as, what it runs, the
/// binds it gets (`destination`, `source` in the guest, read-only), and,
/// for a user-namespace pod, its one range (`container_id`, `host_id`,
/// `length`), the same for uids and gids.
pub struct Container<'a> {
    pub uid: u32,
    pub gid: u32,
    pub script: &'a str,
    pub binds: &'a [(&'a str, &'a str, bool)],
    pub userns: Option<(u32, u32, u32)>,
}

impl Container<'_> {
    /// Its OCI config.json.
    fn config(&self) -> serde_json::Value {
        use serde_json::json;
        let mut mounts = vec![
            json!({"destination": "/proc", "type": "proc", "source": "proc"}),
            json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                   "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
            json!({"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}),
        ];
        for (to, from, ro) in self.binds {
            let mode = if *ro { "ro" } else { "rw" };
            mounts.push(json!({"destination": to, "type": "bind", "source": from,
                               "options": ["rbind", mode]}));
        }
        let mut linux = json!({"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                                             {"type": "mount"}]});
        if let Some((container, host, size)) = self.userns {
            let map = json!([{"containerID": container, "hostID": host, "size": size}]);
            linux["namespaces"]
                .as_array_mut()
                .unwrap()
                .push(json!({"type": "user"}));
            linux["uidMappings"] = map.clone();
            linux["gidMappings"] = map;
        }
        json!({
            "ociVersion": "1.0.2",
            "process": {
                "terminal": false,
                "user": {"uid": self.uid, "gid": self.gid},
                "args": ["/bin/sh", "-c", self.script],
                "env": ["PATH=/usr/bin:/bin"],
                "cwd": "/",
                "noNewPrivileges": true
            },
            "root": {"path": "rootfs", "readonly": true},
            "hostname": "crust-test",
            "mounts": mounts,
            "linux": linux
        })
    }
}
