//! A lease's record, `<root>/state/freezes/<freeze id>`: `key=value` lines,
//! written before its first FIFREEZE and again at each end, so that a
//! restarted agent thaws what a dead one may have left frozen and still
//! answers a late thaw with how its freeze ended. A record is not trusted:
//! it is decoded by the rules a request follows, and refused whole otherwise.
//!
//! ```text
//! version=1
//! freeze=freeze-1764262083000-9f2c04d1a6b3e870
//! timeout_ms=60000
//! thaw_at_unix_ms=1764262143000
//! volume=pvc-1→pending
//! volume=pvc-4→waiting
//! volume=pvc-2→ended→timeout→1764262143004
//! volume=pvc-3→skipped
//! ```

use crust_protocols::freeze::{check_id, MAX_TIMEOUT_MS, MAX_VOLUMES};

use super::end::{End, How};
use crate::validate;

/// The largest record read: 64 volumes of 128 bytes each need far less.
pub(crate) const MAX_BYTES: u64 = 64 << 10;

/// Why a freeze's record is refused whole (the ledger sets it aside).
#[derive(Debug, thiserror::Error)]
pub(crate) enum BadRecord {
    #[error("its name is not UTF-8")]
    NameNotUtf8,
    #[error("unreadable: {0}")]
    Unreadable(std::io::Error),
    #[error("it is not UTF-8")]
    NotUtf8,
    #[error("line {0:?} has no '='")]
    NoEquals(String),
    #[error("version {0:?} is not one this agent reads")]
    Version(String),
    #[error("key {0:?} is not one a record holds")]
    Key(String),
    #[error("{what} {value:?} is not a number")]
    NotNumber {
        /// Which number.
        what: &'static str,
        /// What the record holds.
        value: String,
    },
    #[error("{0:?} is no way a freeze ends")]
    How(String),
    #[error("volume line {0:?} is not one a record holds")]
    VolumeLine(String),
    #[error("it names volume {0} twice")]
    Twice(String),
    #[error("it names more than {MAX_VOLUMES} volumes")]
    TooManyVolumes,
    #[error("it has no version")]
    NoVersion,
    /// The freeze id breaks the rule for one.
    #[error("{0}")]
    FreezeId(String),
    #[error("it names freeze {named}, not {file}")]
    OtherFreeze {
        /// The freeze the record names.
        named: String,
        /// The freeze its file name says.
        file: String,
    },
    #[error("timeout_ms {0} is not a freeze's")]
    Timeout(u64),
    #[error("it names no volume")]
    NoVolume,
    /// A volume id a request would have had refused.
    #[error(transparent)]
    Invalid(#[from] validate::Invalid),
}

/// A part of a lease as its record says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Said {
    /// Its freeze call had not reached it: never frozen by this lease, so
    /// a restarted agent leaves its filesystem alone.
    Waiting,
    /// It may be frozen (its FIFREEZE was about to be made, or made): a
    /// restarted agent thaws it.
    Pending,
    /// Its freeze call stopped before it: never frozen.
    Skipped,
    Ended(End),
}

/// A lease as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) freeze: String,
    pub(crate) timeout_ms: u64,
    pub(crate) thaw_at_unix_ms: u64,
    /// Its volumes, in the order its freeze named them.
    pub(crate) parts: Vec<(String, Said)>,
}

impl Record {
    /// When its last part ended; 0 while one may be frozen.
    pub(crate) fn ended_at(&self) -> u64 {
        let mut last = 0;
        for (_, said) in &self.parts {
            match said {
                Said::Pending | Said::Waiting => return 0,
                Said::Skipped => {}
                Said::Ended(e) => last = last.max(e.at_unix_ms),
            }
        }
        last
    }
}

/// The record's text.
pub(crate) fn encode(r: &Record) -> String {
    let mut o = format!(
        "version=1\nfreeze={}\ntimeout_ms={}\nthaw_at_unix_ms={}\n",
        r.freeze, r.timeout_ms, r.thaw_at_unix_ms
    );
    for (vol, said) in &r.parts {
        match said {
            Said::Waiting => o += &format!("volume={vol}\twaiting\n"),
            Said::Pending => o += &format!("volume={vol}\tpending\n"),
            Said::Skipped => o += &format!("volume={vol}\tskipped\n"),
            Said::Ended(e) => {
                o += &format!("volume={vol}\tended\t{}\t{}\n", e.how.name(), e.at_unix_ms)
            }
        }
    }
    o
}

fn number(v: &str, what: &'static str) -> Result<u64, BadRecord> {
    v.parse().map_err(|_| BadRecord::NotNumber {
        what,
        value: v.to_string(),
    })
}

/// One `volume=` line's value.
fn part(v: &str) -> Result<(String, Said), BadRecord> {
    let fields: Vec<&str> = v.split('\t').collect();
    let vol = fields[0];
    validate::volume_id(vol)?;
    let said = match fields[1..] {
        ["waiting"] => Said::Waiting,
        ["pending"] => Said::Pending,
        ["skipped"] => Said::Skipped,
        ["ended", how, at] => Said::Ended(End {
            how: How::parse(how).ok_or_else(|| BadRecord::How(how.to_string()))?,
            at_unix_ms: number(at, "the end's time")?,
        }),
        _ => return Err(BadRecord::VolumeLine(v.to_string())),
    };
    Ok((vol.to_string(), said))
}

/// Decodes the record in file `name`: every line known, the freeze id its
/// file's name, each volume once, 1 to 64 of them.
pub(crate) fn decode(text: &[u8], name: &str) -> Result<Record, BadRecord> {
    let text = std::str::from_utf8(text).map_err(|_| BadRecord::NotUtf8)?;
    let mut r = Record {
        freeze: String::new(),
        timeout_ms: 0,
        thaw_at_unix_ms: 0,
        parts: Vec::new(),
    };
    let mut version = false;
    for line in text.lines() {
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| BadRecord::NoEquals(line.to_string()))?;
        match k {
            "version" if v == "1" => version = true,
            "version" => return Err(BadRecord::Version(v.to_string())),
            "freeze" => r.freeze = v.to_string(),
            "timeout_ms" => r.timeout_ms = number(v, "timeout_ms")?,
            "thaw_at_unix_ms" => r.thaw_at_unix_ms = number(v, "thaw_at_unix_ms")?,
            "volume" => {
                let p = part(v)?;
                if r.parts.iter().any(|(vol, _)| *vol == p.0) {
                    return Err(BadRecord::Twice(p.0));
                }
                if r.parts.len() == MAX_VOLUMES {
                    return Err(BadRecord::TooManyVolumes);
                }
                r.parts.push(p);
            }
            _ => return Err(BadRecord::Key(k.to_string())),
        }
    }
    if !version {
        return Err(BadRecord::NoVersion);
    }
    check_id(&r.freeze).map_err(BadRecord::FreezeId)?;
    if r.freeze != name {
        return Err(BadRecord::OtherFreeze {
            named: r.freeze,
            file: name.to_string(),
        });
    }
    if r.timeout_ms == 0 || r.timeout_ms > u64::from(MAX_TIMEOUT_MS) {
        return Err(BadRecord::Timeout(r.timeout_ms));
    }
    if r.parts.is_empty() {
        return Err(BadRecord::NoVolume);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            freeze: "freeze-1-00000000000000ab".into(),
            timeout_ms: 60_000,
            thaw_at_unix_ms: 61_000,
            parts: vec![
                ("pvc-1".into(), Said::Pending),
                ("pvc-4".into(), Said::Waiting),
                (
                    "pvc-2".into(),
                    Said::Ended(End {
                        how: How::Timeout,
                        at_unix_ms: 61_004,
                    }),
                ),
                ("pvc-3".into(), Said::Skipped),
            ],
        }
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let r = sample();
        let text = encode(&r);
        assert_eq!(decode(text.as_bytes(), &r.freeze).ok(), Some(r.clone()));
        assert_eq!(r.ended_at(), 0, "a pending part keeps it open");
        let mut over = r;
        over.parts[0].1 = Said::Ended(End {
            how: How::Thawed,
            at_unix_ms: 70_000,
        });
        assert_eq!(over.ended_at(), 0, "a waiting part keeps it open too");
        over.parts[1].1 = Said::Skipped;
        assert_eq!(over.ended_at(), 70_000);
    }

    #[test]
    fn a_record_that_breaks_a_rule_is_refused_whole() {
        let good = encode(&sample());
        let name = "freeze-1-00000000000000ab";
        let cases: Vec<(String, &str, &str)> = vec![
            (
                good.replace("version=1", "version=2"),
                name,
                "version \"2\"",
            ),
            (good.replace("version=1\n", ""), name, "no version"),
            (good.clone(), "freeze-other", "not freeze-other"),
            (
                good.replace("pvc-3\tskipped", "pvc-1\tskipped"),
                name,
                "twice",
            ),
            (
                good.replace("pvc-3\tskipped", "../x\tskipped"),
                name,
                "../x",
            ),
            (
                good.replace("pvc-3\tskipped", "pvc-3\tmaybe"),
                name,
                "not one a record holds",
            ),
            (
                good.replace("timeout\t", "melted\t"),
                name,
                "no way a freeze ends",
            ),
            (
                good.replace("timeout_ms=60000", "timeout_ms=600001"),
                name,
                "is not a freeze's",
            ),
            (
                good.replace("timeout_ms=60000", "timeout_ms=x"),
                name,
                "not a number",
            ),
            (good.clone() + "extra=1\n", name, "key \"extra\""),
            (good.clone() + "no equals\n", name, "has no '='"),
        ];
        for (text, n, why) in cases {
            let e = decode(text.as_bytes(), n).unwrap_err().to_string();
            assert!(e.contains(why), "{e} (wanted {why:?})");
        }
        let many: String = (0..=MAX_VOLUMES)
            .map(|i| format!("volume=v{i}\tpending\n"))
            .collect();
        let text = format!("version=1\nfreeze={name}\ntimeout_ms=1\nthaw_at_unix_ms=1\n{many}");
        assert!(matches!(
            decode(text.as_bytes(), name),
            Err(BadRecord::TooManyVolumes)
        ));
        assert!(matches!(decode(b"\xff", name), Err(BadRecord::NotUtf8)));
        let none = format!("version=1\nfreeze={name}\ntimeout_ms=1\nthaw_at_unix_ms=1\n");
        assert!(matches!(
            decode(none.as_bytes(), name),
            Err(BadRecord::NoVolume)
        ));
    }
}
