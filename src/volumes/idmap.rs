//! An idmapped bind's part of its volume's record (state.rs): after the
//! `bind=` lines, one line per idmapped bind,
//! `bind_idmap=<target>\t<uids>\t<gids>`, each list `inside:outside:length`
//! ranges joined by `,`, checked as a request's (validate::id_map). The
//! bind lines keep their shape, so an older agent, which skips a key it
//! does not know, reads the bind as a plain one (the mount stays idmapped
//! in the kernel: it cannot change once attached); a record it rewrites
//! then says plain, and the next agent takes that bind down as drifted
//! (recover.rs).
//!
//! Also the bound on how many ranges one volume's binds may hold: each
//! bind may carry the kernel's 340 per list, and the record, read whole at
//! start (at most 1 MiB), must stay small.

use std::path::{Path, PathBuf};

use super::error::Error;
use super::volume::{Bind, Volume};
use crate::model::{IdMap, IdRange};
use crate::validate::{self, Invalid};

/// The most uid and gid ranges, together, one volume's binds may have
/// (a pod's binds have two each): 4096 ranges write at most ~140 KiB.
pub const MAX_VOLUME_RANGES: usize = 4096;

/// A `bind_idmap=` line that is not as the agent writes it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Bad {
    #[error("bind_idmap {0:?} is not a target, uid ranges and gid ranges")]
    Shape(String),
    #[error("bind_idmap range {0:?} is not inside:outside:length")]
    Range(String),
    #[error("bind_idmap for {0:?}, which no bind of the record has")]
    NoSuchBind(PathBuf),
    #[error("two bind_idmap lines for {0:?}")]
    Twice(PathBuf),
    #[error("bind_idmap for {0:?} names no mappings")]
    Empty(PathBuf),
    #[error("bind_idmap for a bind of a block volume")]
    Block,
    #[error(transparent)]
    Invalid(#[from] Invalid),
}

fn ranges_text(ranges: &[IdRange]) -> String {
    let each: Vec<String> = ranges
        .iter()
        .map(|r| format!("{}:{}:{}", r.container_id, r.host_id, r.length))
        .collect();
    each.join(",")
}

/// The `bind_idmap=` line of `b` (`esc` escapes its target as the record's
/// paths are), or nothing for a plain bind.
pub(crate) fn encode(b: &Bind, esc: impl Fn(&Path) -> String) -> String {
    match &b.idmap {
        None => String::new(),
        Some(m) => format!(
            "bind_idmap={}\t{}\t{}\n",
            esc(&b.target),
            ranges_text(&m.uids),
            ranges_text(&m.gids)
        ),
    }
}

fn ranges(v: &str) -> Result<Vec<IdRange>, Bad> {
    if v.is_empty() {
        return Ok(Vec::new());
    }
    v.split(',')
        .take(validate::MAX_ID_RANGES + 1)
        .map(|r| {
            let n: Vec<Option<u32>> = r.split(':').map(|x| x.parse().ok()).collect();
            match n.as_slice() {
                [Some(c), Some(h), Some(l)] => Ok(IdRange {
                    container_id: *c,
                    host_id: *h,
                    length: *l,
                }),
                _ => Err(Bad::Range(r.to_string())),
            }
        })
        .collect()
}

/// A `bind_idmap=` value: the bind's target (`unesc` reads it back) and
/// its mappings, checked as a request's.
pub(crate) fn decode(v: &str, unesc: impl Fn(&str) -> PathBuf) -> Result<(PathBuf, IdMap), Bad> {
    let f: Vec<&str> = v.split('\t').collect();
    let [target, uids, gids] = f.as_slice() else {
        return Err(Bad::Shape(v.to_string()));
    };
    let target = unesc(target);
    match validate::id_map(ranges(uids)?, ranges(gids)?)? {
        Some(m) => Ok((target, m)),
        None => Err(Bad::Empty(target)),
    }
}

/// Gives each of `binds` the mappings its `bind_idmap=` line says; a line
/// for no bind, or two for one, refuses the record.
pub(crate) fn attach(
    binds: &mut [Bind],
    lines: Vec<(PathBuf, IdMap)>,
    block: bool,
) -> Result<(), Bad> {
    if block && !lines.is_empty() {
        return Err(Bad::Block);
    }
    for (target, map) in lines {
        let b = binds
            .iter_mut()
            .find(|b| b.target == target)
            .ok_or_else(|| Bad::NoSuchBind(target.clone()))?;
        if b.idmap.is_some() {
            return Err(Bad::Twice(target));
        }
        b.idmap = Some(map);
    }
    Ok(())
}

/// The id a file owned on disk by `id` shows through a bind of `ranges`
/// (container side to host side); None where they leave it out.
pub(crate) fn shown(ranges: &[IdRange], id: u32) -> Option<u32> {
    ranges.iter().find_map(|r| {
        let k = id.checked_sub(r.container_id)?;
        (k < r.length).then(|| r.host_id + k)
    })
}

/// Refuses a bind of `vol` with `map` when the volume's binds would hold
/// more than [`MAX_VOLUME_RANGES`] ranges.
pub(crate) fn room_for(vol: &Volume, map: Option<&IdMap>) -> Result<(), Error> {
    let count = |m: &IdMap| m.uids.len() + m.gids.len();
    let held: usize = vol
        .binds
        .iter()
        .filter_map(|b| b.idmap.as_ref())
        .map(count)
        .sum();
    let asked = map.map_or(0, count);
    if asked > 0 && held + asked > MAX_VOLUME_RANGES {
        return Err(Error::TooManyIdRanges {
            id: vol.id().to_string(),
            held,
            max: MAX_VOLUME_RANGES,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map() -> IdMap {
        let r = |c, h, l| IdRange {
            container_id: c,
            host_id: h,
            length: l,
        };
        IdMap {
            uids: vec![r(0, 100000, 65536)],
            gids: vec![r(0, 200000, 1000), r(1000, 1000, 1)],
        }
    }

    #[test]
    fn lines_round_trip() {
        let mut b = crate::volumes::volume::tests::sample().binds.remove(0);
        assert_eq!(encode(&b, |p| p.display().to_string()), "");
        b.idmap = Some(map());
        let line = encode(&b, |p| p.display().to_string());
        assert_eq!(
            line,
            "bind_idmap=/r/pods/a b\t0:100000:65536\t0:200000:1000,1000:1000:1\n"
        );
        let v = line.trim_end().strip_prefix("bind_idmap=").unwrap();
        let (t, m) = decode(v, |t: &str| PathBuf::from(t)).unwrap();
        assert_eq!((t, m), (b.target.clone(), map()));
        let mut binds = vec![Bind {
            idmap: None,
            ..b.clone()
        }];
        attach(&mut binds, vec![(b.target.clone(), map())], false).unwrap();
        assert_eq!(binds[0], b);
    }

    /// An owner on disk as a bind shows it: mapped where a range holds
    /// it, at both ends of a range; left out elsewhere.
    #[test]
    fn owners_are_shown_through_the_ranges() {
        let m = map();
        assert_eq!(shown(&m.uids, 0), Some(100000));
        assert_eq!(shown(&m.uids, 65535), Some(165535));
        assert_eq!(shown(&m.uids, 65536), None);
        assert_eq!(shown(&m.gids, 999), Some(200999));
        assert_eq!(shown(&m.gids, 1000), Some(1000));
        assert_eq!(shown(&m.gids, 1001), None);
        let last = IdRange {
            container_id: 4294967290,
            host_id: 10,
            length: 5,
        };
        assert_eq!(shown(&[last], 4294967294), Some(14));
        assert_eq!(shown(&[last], 4294967295), None);
    }

    /// A line is checked as a request: a bad range, half a map, an overlap,
    /// a line for no bind or twice for one, or on a block volume.
    #[test]
    fn bad_lines_are_refused() {
        for v in [
            "/r/x\t0:1:1",
            "/r/x\t0:1\t0:1:1",
            "/r/x\t0:1:1\t",
            "/r/x\t\t",
            "/r/x\t0:1:0\t0:1:1",
            "/r/x\t0:1:10,5:100:1\t0:1:1",
            "/r/x\t0:4294967295:1\t0:1:1",
            "/r/x\ta:1:1\t0:1:1",
        ] {
            assert!(decode(v, |t: &str| PathBuf::from(t)).is_err(), "{v:?}");
        }
        let b = crate::volumes::volume::tests::sample().binds.remove(0);
        let mut binds = vec![b.clone()];
        let other = vec![(PathBuf::from("/r/other"), map())];
        assert!(attach(&mut binds, other, false).is_err());
        let twice = vec![(b.target.clone(), map()), (b.target.clone(), map())];
        assert!(attach(&mut binds.clone(), twice, false).is_err());
        assert!(attach(&mut binds, vec![(b.target.clone(), map())], true).is_err());
    }
}
