//! The freezes crustd made across sandboxes, and the host's own timer for
//! each: a group's timeout runs in every guest (the agent thaws by itself)
//! and here, [`HOST_SLACK`] later, so a group whose guest lost its timer
//! (an agent replaced mid-freeze, a guest clock stopped) is thawed all the
//! same. A volume whose group ended by the host's timer is remembered until
//! it is thawed or frozen again: its thaw answers ABORTED, as the agent's
//! does. Bounded: [`MAX_GROUPS`] groups of at most 64 volumes.
//!
//! The mutex is a leaf: taken for one lookup or update, never across a
//! call to a guest; the timer thread calls the guests with it let go.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crust_client::Address;

/// Groups frozen at once on the node.
pub const MAX_GROUPS: usize = 64;
/// How long after a group's timeout the host thaws it, so that the guest's
/// own timer (which the thaw's ABORTED reports) normally comes first.
pub const HOST_SLACK: Duration = Duration::from_secs(1);

/// Milliseconds since the epoch, now.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// One frozen volume of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub sandbox: String,
    pub host_volume: String,
    /// The agent's volume id.
    pub volume_id: String,
    /// Where the sandbox's agent listens.
    pub agent: Address,
}

/// A freeze that ended by the host's timer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub freeze_id: String,
    pub at_unix_ms: u64,
}

struct Group {
    members: Vec<Member>,
    deadline: Instant,
}

#[derive(Default)]
struct Inner {
    groups: HashMap<String, Group>,
    /// By (sandbox, host volume).
    ended: HashMap<(String, String), Ended>,
    timer: bool,
    seq: u64,
}

/// The groups (the module doc).
#[derive(Default)]
pub struct Freezes {
    inner: Mutex<Inner>,
    wake: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Freezes {
    /// Whether another group fits.
    pub fn has_room(&self) -> bool {
        lock(&self.inner).groups.len() < MAX_GROUPS
    }

    /// Notes a group frozen until `timeout` (+ [`HOST_SLACK`]) from now;
    /// answers its name and whether the timer thread must be started.
    pub fn add(&self, members: Vec<Member>, timeout: Duration) -> (String, bool) {
        let mut g = lock(&self.inner);
        g.seq += 1;
        let id = format!("group-{}-{}", unix_ms() / 1000, g.seq);
        for m in &members {
            g.ended.remove(&(m.sandbox.clone(), m.host_volume.clone()));
        }
        g.groups.insert(
            id.clone(),
            Group {
                members,
                deadline: Instant::now() + timeout + HOST_SLACK,
            },
        );
        self.wake.notify_all();
        let start = !std::mem::replace(&mut g.timer, true);
        (id, start)
    }

    /// Takes `(sandbox, host volume)` out of its group (it is being
    /// thawed); answers how a host timer ended its freeze, if one did.
    pub fn release(&self, sandbox: &str, host_volume: &str) -> Option<Ended> {
        let mut g = lock(&self.inner);
        for group in g.groups.values_mut() {
            group
                .members
                .retain(|m| !(m.sandbox == sandbox && m.host_volume == host_volume));
        }
        g.groups.retain(|_, group| !group.members.is_empty());
        self.wake.notify_all();
        g.ended
            .remove(&(sandbox.to_string(), host_volume.to_string()))
    }

    /// Forgets what is known of a volume (it is unpublished).
    pub fn forget(&self, sandbox: &str, host_volume: &str) {
        self.release(sandbox, host_volume);
    }

    /// Waits for the next group to pass its deadline and takes it out,
    /// noting its members ended; None once no group is left (the timer
    /// thread then ends).
    pub fn next_expired(&self) -> Option<(String, Vec<Member>)> {
        let mut g = lock(&self.inner);
        loop {
            let Some((id, deadline)) = g
                .groups
                .iter()
                .min_by_key(|(_, gr)| gr.deadline)
                .map(|(id, gr)| (id.clone(), gr.deadline))
            else {
                g.timer = false;
                return None;
            };
            let now = Instant::now();
            if deadline <= now {
                let group = g.groups.remove(&id)?;
                let at_unix_ms = unix_ms();
                for m in &group.members {
                    g.ended.insert(
                        (m.sandbox.clone(), m.host_volume.clone()),
                        Ended {
                            freeze_id: id.clone(),
                            at_unix_ms,
                        },
                    );
                }
                return Some((id, group.members));
            }
            g = self
                .wake
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// How many groups and ended volumes are kept (a bound tests check).
    pub fn len(&self) -> (usize, usize) {
        let g = lock(&self.inner);
        (g.groups.len(), g.ended.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(v: &str) -> Member {
        Member {
            sandbox: "pod".into(),
            host_volume: v.into(),
            volume_id: format!("crustd-{v}"),
            agent: "unix:///nowhere".parse().unwrap(),
        }
    }

    #[test]
    fn a_group_nobody_thaws_ends_at_its_deadline_and_its_volumes_say_so() {
        let f = Freezes::default();
        let (id, start) = f.add(vec![member("/dev/a"), member("/dev/b")], Duration::ZERO);
        assert!(start);
        let (ended, members) = f.next_expired().unwrap();
        assert_eq!((ended.as_str(), members.len()), (id.as_str(), 2));
        assert_eq!(f.release("pod", "/dev/a").unwrap().freeze_id, id);
        assert_eq!(f.release("pod", "/dev/a"), None, "said once");
        assert!(
            f.next_expired().is_none(),
            "the timer ends when nothing is frozen"
        );
        // A new freeze clears what an old one left.
        f.add(vec![member("/dev/b")], Duration::from_secs(60));
        assert_eq!(f.release("pod", "/dev/b"), None);
        assert_eq!(f.len(), (0, 0));
    }
}
