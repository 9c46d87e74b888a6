//! The leases' records on disk, `<root>/state/freezes/<id>.freeze`
//! (record.rs's format): one file a freeze, written atomically through the
//! directory's fd (state.rs's `Store`, by way of `<id>.freeze.tmp`), read
//! back whole at start. The suffix keeps every record's name apart from
//! every temp file's, whatever ids callers choose. A record that does not
//! decode is set aside (`<name>.bad`) for a human, as a volume's is.

use slog::{warn, Logger};

use super::record::{self, BadRecord, Record};
use crate::sys::beneath::Root;
use crate::sys::error::SysError;
use crate::validate::FREEZES_DIR;
use crate::volumes::state::Store;

const SUFFIX: &str = ".freeze";

fn file(freeze: &str) -> String {
    format!("{freeze}{SUFFIX}")
}

/// The freezes' state directory.
pub(crate) struct Ledger {
    dir: Store,
}

impl Ledger {
    /// Opens `<root>/state/freezes` (made 0700 if missing).
    pub(crate) fn open(root: &Root) -> Result<Ledger, SysError> {
        Ok(Ledger {
            dir: Store::open_dir(root, FREEZES_DIR)?,
        })
    }

    /// Writes a lease's record, atomically.
    pub(crate) fn write(&self, r: &Record) -> crate::error::Result<()> {
        self.dir.write(&file(&r.freeze), &record::encode(r))
    }

    /// Removes a lease's record; a missing one is fine.
    pub(crate) fn remove(&self, freeze: &str) -> crate::error::Result<()> {
        self.dir.unlink(&file(freeze))
    }

    /// Every record that decodes; the rest are set aside and said on `log`,
    /// half-written temp files removed.
    pub(crate) fn load(&self, log: &Logger) -> Vec<Record> {
        let names = match self.dir.names() {
            Ok(n) => n,
            Err(e) => {
                warn!(log, "could not list the freezes' records; freezes a previous run left are not thawed"; "error" => %e);
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for raw in names {
            if raw.ends_with(b".tmp") {
                if let Ok(name) = std::str::from_utf8(&raw) {
                    let _ = self.dir.unlink(name);
                }
                continue;
            }
            let Some(id) = raw.strip_suffix(SUFFIX.as_bytes()) else {
                continue;
            };
            let decoded = match std::str::from_utf8(id) {
                Err(_) => Err(BadRecord::NameNotUtf8),
                Ok(id) => match self.dir.read(&raw, record::MAX_BYTES) {
                    Err(e) => Err(BadRecord::Unreadable(e)),
                    Ok(text) => record::decode(&text, id),
                },
            };
            match decoded {
                Ok(r) => out.push(r),
                Err(why) => {
                    let bad = self.dir.set_aside(&raw);
                    warn!(log, "set aside a freeze record that does not decode; the volumes it names are not thawed by it";
                          "record" => %bad.display(), "why" => %why);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volumes::lease::record::Said;

    #[test]
    fn records_come_back_and_bad_ones_are_set_aside() {
        let d = tempfile::tempdir().unwrap();
        let root = Root::open(d.path()).unwrap();
        let l = Ledger::open(&root).unwrap();
        let r = Record {
            freeze: "f-1".into(),
            timeout_ms: 1000,
            thaw_at_unix_ms: 5,
            parts: vec![("v1".into(), Said::Pending)],
        };
        l.write(&r).unwrap();
        let dir = d.path().join(FREEZES_DIR);
        assert!(dir.join("f-1.freeze").exists());
        std::fs::write(dir.join("f-2.freeze"), "version=1\nfreeze=f-3\n").unwrap();
        std::fs::write(dir.join("f-4.freeze.tmp"), "half").unwrap();
        std::fs::write(dir.join("stray"), "not a record").unwrap();
        assert_eq!(l.load(&crate::logging::discard()), vec![r]);
        assert!(dir.join("f-2.freeze.bad").exists() && !dir.join("f-2.freeze").exists());
        assert!(!dir.join("f-4.freeze.tmp").exists() && dir.join("stray").exists());
        l.remove("f-1").unwrap();
        l.remove("f-1").unwrap();
        assert!(l.load(&crate::logging::discard()).is_empty());
    }
}
