//! Where a sandbox is: `DIR/<sandbox>/sandbox.json`, written by whoever
//! starts the VM (`crust-vm up` does), holding the VM's QMP socket and the
//! agent's address:
//!
//! ```json
//! {"qmp": "/run/vm/qmp.sock", "agent": "hvsock:///run/vm/vsock.sock:1024"}
//! ```
//!
//! `agent` is any address crust-client accepts. A relative `qmp` path is taken
//! relative to the sandbox's directory. Other keys are ignored, so the file
//! can carry more for other readers. Nothing else about the VM is assumed.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crust_client::Address;
use serde::Deserialize;

use crate::error::{Error, Result};

/// The file name of the registry entry inside a sandbox's directory.
pub const SANDBOX_FILE: &str = "sandbox.json";
/// The longest sandbox id accepted (CRI's are 64 hex digits).
const MAX_ID: usize = 128;

/// What `sandbox.json` holds.
#[derive(Debug, Deserialize)]
struct Entry {
    /// QEMU's QMP unix socket.
    qmp: String,
    /// The agent's address.
    agent: String,
}

/// One sandbox, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandbox {
    /// The sandbox id, as kubelet sent it.
    pub id: String,
    /// `DIR/<id>`: where sandbox.json and crustd's own state live.
    pub dir: PathBuf,
    /// QEMU's QMP socket.
    pub qmp: PathBuf,
    /// The agent's address.
    pub agent: Address,
}

/// Checks a sandbox id: 1–128 characters of `[A-Za-z0-9._-]`, not `.` or `..`,
/// so that it names exactly one directory beneath DIR.
pub fn check_id(id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(Error::invalid(
            "sandbox_id is empty: give the pod sandbox's id",
        ));
    }
    let ok = id.len() <= MAX_ID
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "sandbox_id {id:?} is not 1-{MAX_ID} characters of [A-Za-z0-9._-]"
        )))
    }
}

/// Reads sandbox `id` from the registry `dir`.
/// Unknown sandbox: NOT_FOUND; a file that is not as documented: FAILED_PRECONDITION.
pub fn open(dir: &Path, id: &str) -> Result<Sandbox> {
    check_id(id)?;
    let sdir = dir.join(id);
    let path = sdir.join(SANDBOX_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(Error::not_found(format!(
                "no sandbox {id}: {} does not exist (whoever starts the VM writes it; crust-vm up --dir {} does)",
                path.display(),
                sdir.display()
            )))
        }
        Err(e) => {
            return Err(Error::internal(format!(
                "cannot read {}: {e}",
                path.display()
            )))
        }
    };
    parse(id, &sdir, &text)
}

/// Parses the text of `DIR/<id>/sandbox.json`.
pub fn parse(id: &str, sdir: &Path, text: &str) -> Result<Sandbox> {
    let path = sdir.join(SANDBOX_FILE);
    let bad = |why: String| {
        Error::precondition(format!(
            "{} is not a valid sandbox entry: {why}; it must be {{\"qmp\": \"/path/qmp.sock\", \"agent\": \"hvsock:///path/vsock.sock:1024\"}}",
            path.display()
        ))
    };
    let entry: Entry = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    if entry.qmp.is_empty() {
        return Err(bad("qmp is empty".into()));
    }
    let agent: Address = entry
        .agent
        .parse()
        .map_err(|e: crust_client::AddressError| bad(format!("agent: {e}")))?;
    agent
        .check_connectable()
        .map_err(|e| bad(format!("agent: {e}")))?;
    Ok(Sandbox {
        id: id.to_string(),
        dir: sdir.to_path_buf(),
        qmp: sdir.join(entry.qmp),
        agent,
    })
}

/// The ids of every sandbox directory in `dir` (for the one-device-one-sandbox check).
pub fn all_ids(dir: &Path) -> Vec<String> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|id| check_id(id).is_ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;

    #[test]
    fn ids() {
        for (id, ok) in [
            ("a", true),
            (
                "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                true,
            ),
            ("pod_1.x-y", true),
            ("", false),
            (".", false),
            ("..", false),
            ("a/b", false),
            ("../etc", false),
            ("has space", false),
            (&"x".repeat(129), false),
        ] {
            let r = check_id(id);
            assert_eq!(r.is_ok(), ok, "{id:?}");
            if !ok {
                assert_eq!(r.unwrap_err().code, Code::InvalidArgument);
            }
        }
    }

    #[test]
    fn entries() {
        let d = Path::new("/reg/s1");
        let s = parse(
            "s1",
            d,
            r#"{"qmp": "/vm/qmp.sock", "agent": "hvsock:///vm/vsock.sock:1024", "extra": 1}"#,
        )
        .unwrap();
        assert_eq!(s.qmp, Path::new("/vm/qmp.sock"));
        assert_eq!(s.agent.to_string(), "hvsock:///vm/vsock.sock:1024");
        let s = parse("s1", d, r#"{"qmp": "qmp.sock", "agent": "vsock://3:1024"}"#).unwrap();
        assert_eq!(s.qmp, Path::new("/reg/s1/qmp.sock"));
        for bad in [
            "",
            "{",
            "[]",
            r#"{"qmp": "/q"}"#,
            r#"{"agent": "vsock://3:1024"}"#,
            r#"{"qmp": "", "agent": "vsock://3:1024"}"#,
            r#"{"qmp": "/q", "agent": "tcp://1.2.3.4:5"}"#,
            r#"{"qmp": "/q", "agent": "vsock://-1:1024"}"#,
            r#"{"qmp": 7, "agent": "vsock://3:1024"}"#,
        ] {
            let e = parse("s1", d, bad).unwrap_err();
            assert_eq!(e.code, Code::FailedPrecondition, "{bad}: {e}");
            assert!(e.message.contains("/reg/s1/sandbox.json"), "{e}");
        }
    }

    #[test]
    fn open_unknown_and_malformed() {
        let t = tempfile::tempdir().unwrap();
        let e = open(t.path(), "nope").unwrap_err();
        assert_eq!(e.code, Code::NotFound);
        assert!(e.message.contains("no sandbox nope"), "{e}");
        fs::create_dir(t.path().join("s")).unwrap();
        fs::write(t.path().join("s/sandbox.json"), "not json").unwrap();
        assert_eq!(
            open(t.path(), "s").unwrap_err().code,
            Code::FailedPrecondition
        );
        assert_eq!(
            open(t.path(), "../x").unwrap_err().code,
            Code::InvalidArgument
        );
        assert_eq!(all_ids(t.path()), vec!["s".to_string()]);
    }
}
