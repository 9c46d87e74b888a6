//! The crustd process under test: started from the binary cargo built,
//! killed with SIGKILL and started again on the same socket and registry.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crustd_ctl::Kubelet;

/// A crustd process serving `socket` for the registry `reg`.
pub struct Crustd {
    child: Child,
    pub socket: PathBuf,
    reg: PathBuf,
    extra: Vec<String>,
}

impl Crustd {
    pub fn start(reg: &Path, extra: &[&str]) -> Crustd {
        let socket = reg.parent().unwrap().join("crustd.sock");
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let child = spawn(&socket, reg, &extra);
        wait_for(&socket);
        Crustd {
            child,
            socket,
            reg: reg.to_path_buf(),
            extra,
        }
    }

    pub fn client(&self) -> Kubelet {
        Kubelet::connect(&self.socket, Duration::from_secs(60)).unwrap()
    }

    /// SIGKILL (no chance to tidy up), then a fresh crustd on the same socket and registry.
    pub fn kill_and_restart(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.child = spawn(&self.socket, &self.reg, &self.extra);
        wait_for(&self.socket);
    }
}

fn spawn(socket: &Path, reg: &Path, extra: &[String]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_crustd"))
        .arg("--socket")
        .arg(socket)
        .arg("--sandboxes")
        .arg(reg)
        .args(extra)
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

fn wait_for(socket: &Path) {
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "crustd did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Crustd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
