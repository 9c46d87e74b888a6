//! A stand-in QEMU monitor for the tests of this module: serves sessions
//! one after another (as QEMU does), greets, and answers each command with
//! a test's script, which may send events before its reply.
#![cfg(test)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

/// What the fake answers: (events to send first, the reply).
pub(crate) type Script = dyn FnMut(&str, &Value) -> (Vec<Value>, Value) + Send;

/// A stand-in QEMU monitor: serves sessions at `path` one after another
/// (as QEMU does), greets, answers each command with `script`'s reply
/// and can send events before it. Every command but qmp_capabilities is
/// logged as `"cmd"` or `"cmd ARGS"`.
pub(crate) fn serve(path: &Path, mut script: Box<Script>) -> Arc<Mutex<Vec<String>>> {
    let l = UnixListener::bind(path).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            let mut w = s.try_clone().unwrap();
            let r = BufReader::new(s);
            if writeln!(w, "{}", json!({"QMP": {"version": {}, "capabilities": []}})).is_err() {
                continue;
            }
            for line in r.lines() {
                let Ok(line) = line else { break };
                let m: Value = serde_json::from_str(&line).unwrap();
                let cmd = m["execute"].as_str().unwrap().to_string();
                let args = m.get("arguments").cloned().unwrap_or(Value::Null);
                if cmd != "qmp_capabilities" {
                    let entry = if args.is_null() {
                        cmd.clone()
                    } else {
                        format!("{cmd} {args}")
                    };
                    log2.lock().unwrap().push(entry);
                }
                let (events, reply) = if cmd == "qmp_capabilities" {
                    (vec![], json!({"return": {}}))
                } else {
                    script(&cmd, &args)
                };
                for e in events {
                    let _ = writeln!(w, "{e}");
                }
                let _ = writeln!(w, "{reply}");
            }
        }
    });
    log
}
