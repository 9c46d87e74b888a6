//! SELinux context mount options (`context=`, `fscontext=`, `defcontext=`,
//! `rootcontext=`), which kubelet adds for KEP-1710's "SELinux relabel on
//! mount", e.g. `context="system_u:object_r:container_file_t:s0:c1,c2"`
//! (quoted: the level has commas).
//!
//! A guest without SELinux (no `/sys/fs/selinux`, which
//! `Sysfs::selinux_enabled` looks for: the kernel did not enable it, so no
//! policy is loaded and no label is enforced) cannot mount with them: the kernel refuses an option that no security module
//! claims. Dropping them there changes nothing a pod can observe, which is
//! what KEP-2857 lets a runtime declare as supported: the agent leaves them
//! out of the mount and says so (in the publish answer and its log). A
//! guest with SELinux gets them as given.

/// The option keys SELinux takes.
const KEYS: [&str; 4] = ["context", "fscontext", "defcontext", "rootcontext"];

/// Splits one fstab-style element at the commas outside double quotes.
fn items(element: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in element.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(&element[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&element[start..]);
    out
}

fn is_context(item: &str) -> bool {
    item.split_once('=').is_some_and(|(k, _)| KEYS.contains(&k))
}

/// The options to mount with, and the SELinux context options left out.
/// With `selinux`, everything is kept as given. Without, each context
/// item is taken out of its element (the element's other items stay, in
/// order; an element left empty goes).
pub fn without_contexts(options: &[String], selinux: bool) -> (Vec<String>, Vec<String>) {
    if selinux {
        return (options.to_vec(), Vec::new());
    }
    let mut kept = Vec::new();
    let mut dropped = Vec::new();
    for element in options {
        let parts = items(element);
        if !parts.iter().any(|p| is_context(p)) {
            kept.push(element.clone());
            continue;
        }
        let rest: Vec<&str> = parts
            .into_iter()
            .filter(|p| {
                let c = is_context(p);
                if c {
                    dropped.push(p.to_string());
                }
                !c
            })
            .collect();
        if !rest.is_empty() {
            kept.push(rest.join(","));
        }
    }
    (kept, dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn contexts_are_left_out_only_without_selinux() {
        let ctx = r#"context="system_u:object_r:container_file_t:s0:c1,c2""#;
        let table: &[(&[&str], &[&str], &[&str])] = &[
            (&[], &[], &[]),
            (&["noatime"], &["noatime"], &[]),
            (&[ctx], &[], &[ctx]),
            (&["noatime", ctx], &["noatime"], &[ctx]),
            (
                &[&format!("noatime,{ctx},nodev")],
                &["noatime,nodev"],
                &[ctx],
            ),
            (
                &["fscontext=a:b:c:s0", "defcontext=x", "rootcontext=y", "ro"],
                &["ro"],
                &["fscontext=a:b:c:s0", "defcontext=x", "rootcontext=y"],
            ),
            // Only the key counts: other options that mention it are kept.
            (&["nocontext", "context"], &["nocontext", "context"], &[]),
        ];
        for (input, kept, dropped) in table {
            let (k, d) = without_contexts(&v(input), false);
            assert_eq!((k, d), (v(kept), v(dropped)), "{input:?}");
            // With SELinux, passed through as given.
            assert_eq!(without_contexts(&v(input), true), (v(input), vec![]));
        }
    }
}
