//! The gRPC layer: crustd's error → gRPC status, and one structured log
//! line per call (the methods themselves, protobuf ↔ plain types, are
//! `methods`' list). Each call's work (blocking QMP and agent
//! I/O) runs through `calls` (a thread of its own, bounded per sandbox,
//! joined by the same call made again), so calls for different volumes and
//! sandboxes proceed at once; `volumes` serializes what must be.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tonic::{Request, Status};

use crate::calls::{Call, Calls};
use crate::error::{Error, Result};
use crate::pb::runtime_capability::rpc::Type as Cap;
use crate::volumes::{self, Crustd};

/// What crustd advertises: what works end to end through it with the guest
/// this project builds, and nothing a call would refuse (no SUBPATH or
/// SELINUX_RELABEL: CRUST has no call for them here; BLOCK_VOLUME only with
/// `volumes::BLOCK_VOLUMES`). SELINUX_RELABEL_ON_MOUNT: the guest loads no
/// SELinux policy, so the agent leaves kubelet's context= options out of the
/// mount and says so, the no-op configuration KEP-2857 lets a runtime
/// declare as supported (a guest with SELinux gets them as given).
pub fn capabilities() -> Vec<Cap> {
    let mut caps = vec![
        Cap::FsGroupChangePolicyAlways,
        Cap::FsGroupChangePolicyRootMismatch,
        Cap::SelinuxRelabelOnMount,
        Cap::VolumeStats,
        Cap::VolumeResize,
        Cap::VolumeCondition,
        Cap::Freeze,
        Cap::Trim,
        Cap::VolumeHealth,
    ];
    if volumes::BLOCK_VOLUMES {
        caps.push(Cap::BlockVolume);
    }
    caps
}

/// The tonic service around a [`Crustd`].
#[derive(Clone)]
pub struct Service {
    calls: Arc<Calls>,
}

impl Service {
    pub fn new(inner: Arc<Crustd>) -> Service {
        Service {
            calls: Arc::new(Calls::new(inner)),
        }
    }

    /// Makes the call `what` for a caller whose deadline is `at`, and logs it.
    pub(crate) async fn run<C: Call>(
        &self,
        what: C,
        at: Option<Instant>,
    ) -> std::result::Result<C::Answer, Status> {
        let t0 = Instant::now();
        let out = self.calls.call(what.clone(), at).await;
        let (sandbox, host_volume) = what.subject();
        let group = what.group(out.as_ref().ok());
        log(C::METHOD, sandbox, host_volume, group, &out, t0);
        out.map_err(to_status)
    }
}

/// One line: the call, what it named (`group`: a freeze's id, "" for
/// none), its code, how long it took, and its error.
pub(crate) fn log<T>(
    method: &str,
    sandbox: &str,
    host_volume: &str,
    group: &str,
    out: &Result<T>,
    t0: Instant,
) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let mut line = json!({
        "ts": (now * 1000.0).round() / 1000.0,
        "method": method,
        "sandbox": sandbox,
        "host_volume": host_volume,
        "code": out.as_ref().map_or_else(|e| e.code().name(), |_| "OK"),
        "ms": (t0.elapsed().as_secs_f64() * 1e5).round() / 100.0,
    });
    if !group.is_empty() {
        line["freeze_id"] = group.into();
    }
    if let Err(e) = out {
        line["error"] = e.to_string().clone().into();
    }
    // One write per line, so lines from calls at once never interleave.
    let mut text = line.to_string();
    text.push('\n');
    let _ = std::io::Write::write_all(&mut std::io::stderr(), text.as_bytes());
}

/// When the caller gives up: now plus its `grpc-timeout` header, if it sent
/// one that parses (gRPC over HTTP/2: at most 8 digits and a unit, `H`, `M`,
/// `S`, `m`, `u` or `n`). kubelet sets one on every call.
pub fn caller_deadline<T>(req: &Request<T>) -> Option<Instant> {
    let value = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    Instant::now().checked_add(grpc_timeout(value)?)
}

/// A `grpc-timeout` value as a duration.
pub fn grpc_timeout(value: &str) -> Option<Duration> {
    let unit = value.chars().last()?;
    let digits = &value[..value.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// crustd's error as a gRPC status (the codes share gRPC's numbers).
pub fn to_status(e: Error) -> Status {
    Status::new(tonic::Code::from_i32(e.code().number()), e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_as_the_spec_writes_them() {
        let table = [
            ("2S", Some(Duration::from_secs(2))),
            ("120S", Some(Duration::from_secs(120))),
            ("1999m", Some(Duration::from_millis(1999))),
            ("5M", Some(Duration::from_secs(300))),
            ("1H", Some(Duration::from_secs(3600))),
            ("99999999u", Some(Duration::from_micros(99_999_999))),
            ("7n", Some(Duration::from_nanos(7))),
            ("0m", Some(Duration::ZERO)),
            // Nine digits, no digits, no unit, an unknown unit, a sign, spaces.
            ("123456789S", None),
            ("S", None),
            ("10", None),
            ("10s", None),
            ("-1S", None),
            (" 1S", None),
            ("", None),
            ("1é", None),
        ];
        for (v, want) in table {
            assert_eq!(grpc_timeout(v), want, "{v:?}");
        }
    }

    #[test]
    fn the_caller_deadline_comes_from_the_header() {
        let mut req = Request::new(());
        assert_eq!(caller_deadline(&req), None);
        req.set_timeout(Duration::from_secs(120));
        let d = caller_deadline(&req).unwrap();
        let left = d.saturating_duration_since(Instant::now());
        assert!(
            left > Duration::from_secs(119) && left <= Duration::from_secs(120),
            "{left:?}"
        );
    }
}
