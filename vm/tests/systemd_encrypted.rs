//! Encrypted volumes the agent made, checked by tools that share none of
//! its code, in the systemd guest (`make guest-image`, which has
//! cryptsetup): two blank disks are published with `format_if_blank`, one
//! with a passphrase the host gives, one with a key a stand-in Confidential
//! Data Hub serves from inside the guest (`cdh-standin`, on the CDH's own
//! socket and ttrpc API), which the guest made at boot and the host never
//! has. A guest unit writes a file through each mapping; once unpublished,
//! the guest's own cryptsetup opens both disks (the second with the file the
//! CDH serves) and reads the files back; the disk published again with the
//! CDH's key opens as it was. On the host, cryptsetup and testkit's
//! independent AES-XTS read the first disk; the second opens with no guess,
//! and neither the key nor its hex form is anywhere on the console, which
//! carries the agent's log; the guest finds it nowhere in its journal.
//! Run with `make test-vm` (root, `make initrd` and `make guest-image`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crust_protocols::crust as pb;
use crust_protocols::crust_ttrpc::AgentClient;
use crust_protocols::protobuf::MessageField;
use crust_testkit::agent::{code, message, serial_publish_req, unpublish_req};
use crust_testkit::vm::{blank, ctx};
use crust_testkit::{cdh, guest, luks, run};
use crust_vm::Vm;
use sha2::{Digest, Sha256};

const PASS: &[u8] = b"the passphrase the host gives for vol-p";
/// What the guest writes into each volume, followed by the volume's id.
const PROOF: &str = "written in the guest through the agent's mapping:";
const KBS_KEY: &str = "kbs:///default/key/vol";
/// The guest's key: 48 random bytes in base64, 64 characters, printable so
/// that a log line carrying it as text carries it whole.
const KEY_LEN: usize = 64;
const KEY_B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Makes the KBS resource default/key/vol at boot, in /run (memory), for
/// root only, and says its SHA-256, never the key.
const KEY_SCRIPT: &str = r#"#!/bin/sh
set -eu
umask 077
mkdir -p /run/kbs/default/key
printf %s "$(head -c 48 /dev/urandom | base64 -w0)" > /run/kbs/default/key/vol
echo "CRUST-TEST key sha256 $(sha256sum < /run/kbs/default/key/vol | cut -d' ' -f1)"
"#;

const CDH_UNIT: &str =
    "[Unit]\nDescription=A stand-in for the Confidential Data Hub\nBefore=crust-agent.service\n\
[Service]\nExecStartPre=/usr/local/bin/crust-test-key\n\
ExecStart=/usr/local/bin/cdh-standin /run/confidential-containers/cdh.sock /run/kbs\n\
StandardOutput=journal+console\n[Install]\nWantedBy=multi-user.target\n";

const TEST_UNIT: &str = "[Unit]\nAfter=crust-agent.service cdh-standin.service\n\
[Service]\nType=oneshot\nExecStart=/usr/local/bin/crust-test\nStandardOutput=journal+console\n\
[Install]\nWantedBy=multi-user.target\n";

/// The guest's side, paced by the host's calls: a file through each
/// mapping; once the agent let both disks go, the guest's cryptsetup opens
/// them; then the kbs-keyed volume published again is read; last, the
/// journal is searched for the key as text, hex and a list of bytes (the
/// search first shown to find each form where it is planted).
const TEST_SCRIPT: &str = r#"#!/bin/sh
say() { echo "CRUST-TEST $*"; }
vols=/run/crust/volumes
key=/run/kbs/default/key/vol
until_true() {
    i=0
    until eval "$1"; do
        i=$((i + 1)); [ $i -gt 1200 ] && { say "never: $1"; exit 1; }
        sleep 0.5
    done
}
disk() { for d in /sys/block/vd*; do [ "$(cat "$d/serial" 2>/dev/null)" = "$1" ] && echo "/dev/${d##*/}"; done; }
mappings() { ls /sys/block | grep -c '^dm-'; }
check() {
    dev=$(disk "$2")
    cryptsetup luksDump "$dev" | tr -s ' \t' ' ' | while read -r l; do say "dump-$3: $l"; done
    mkdir -p "/mnt/$3"
    cryptsetup open --key-file "$1" "$dev" "check-$3" && mount -o ro "/dev/mapper/check-$3" "/mnt/$3" &&
        say "read-$3: $(cat "/mnt/$3/proof")"
    umount "/mnt/$3"; cryptsetup close "check-$3"
}

until_true 'mountpoint -q $vols/vol-p && mountpoint -q $vols/vol-k'
for v in vol-p vol-k; do echo "@PROOF@ $v" > "$vols/$v/proof"; done
sync
say wrote
until_true '! mountpoint -q $vols/vol-p && ! mountpoint -q $vols/vol-k && [ $(mappings) = 0 ]'
check /etc/crust-test/pass ser-p p
check $key ser-k k
say "mappings left: $(mappings)"
say checked
until_true 'mountpoint -q $vols/vol-k'
say "again: $(cat $vols/vol-k/proof), mappings: $(mappings)"
hex=$(od -An -v -tx1 $key | tr -d ' \n')
dec=$(od -An -v -tu1 $key | tr -s ' \n' ' ' | sed 's/^ //; s/ $//; s/ /, /g')
forms() { grep -a -i -c -F -e "$(cat $key)" -e "$hex" -e "$dec"; }
say "key forms found where planted: $(printf '%s\n' "a$(cat $key)b" "a${hex}b" "[$dec]" | forms)"
say "key in the journal: $(journalctl -b -o export | forms)"
say done
"#;

/// A copy of the guest image with the stand-in CDH, its key's maker, the
/// host's passphrase for vol-p, and the test's unit.
fn guest_image(dir: &Path) -> PathBuf {
    let image = guest::Image::new(dir);
    let standin = std::fs::read(cdh::program()).unwrap();
    image.put("usr/local/bin/cdh-standin", &standin, 0o755);
    image.put("usr/local/bin/crust-test-key", KEY_SCRIPT.as_bytes(), 0o755);
    image.unit("cdh-standin.service", CDH_UNIT);
    image.put("etc/crust-test/pass", PASS, 0o600);
    let script = TEST_SCRIPT.replace("@PROOF@", PROOF);
    image.put("usr/local/bin/crust-test", script.as_bytes(), 0o755);
    image.unit("crust-test.service", TEST_UNIT);
    image.done()
}

/// A publish of the blank disk `serial` as `id`, LUKS2 made if blank, ext4.
fn encrypted(id: &str, serial: &str, key: pb::encryption::Key) -> pb::PublishVolumeRequest {
    let mut r = serial_publish_req(id, serial, "ext4", None);
    let mut e = pb::Encryption::new();
    e.kind = pb::encryption::Kind::LUKS2.into();
    e.key = Some(key);
    e.format_if_blank = true;
    r.encryption = MessageField::some(e);
    r
}

fn kbs(uri: &str) -> pb::encryption::Key {
    pb::encryption::Key::KeyUri(uri.into())
}

fn listed(c: &AgentClient, id: &str) -> bool {
    let l = c
        .list_volumes(ctx(), &pb::ListVolumesRequest::new())
        .unwrap();
    l.volumes.iter().any(|v| v.volume_id == id)
}

fn unpublish(c: &AgentClient, id: &str) {
    let r = c.unpublish_volume(ctx(), &unpublish_req(id)).unwrap();
    assert!(r.was_published, "{id}");
}

/// What the guest's cryptsetup said of the two disks once the agent let
/// them go: LUKS2 as the agent makes it, finished (no `crust-unfinished`
/// label), and each file read back.
fn checked_in_guest(said: &str) {
    for (n, id) in [("p", "vol-p"), ("k", "vol-k")] {
        for line in [
            "Version: 2",
            "Label: (no label)",
            "Cipher: aes-xts-plain64",
            "Cipher key: 512 bits",
            "PBKDF: argon2id",
        ] {
            assert!(
                said.contains(&format!("dump-{n}: {line}")),
                "{n}: {line}\n{said}"
            );
        }
        assert!(
            said.contains(&format!("read-{n}: {PROOF} {id}")),
            "the guest's cryptsetup reads {id}\n{said}"
        );
    }
    assert!(said.contains("mappings left: 0"), "{said}");
}

/// The key's SHA-256, as the guest said it.
fn key_hash(said: &str) -> [u8; 32] {
    let hex = said
        .lines()
        .find_map(|l| l.split("CRUST-TEST key sha256 ").nth(1))
        .unwrap_or_else(|| panic!("no key hash on the console\n{said}"));
    decode_hex(hex.trim().as_bytes()).try_into().unwrap()
}

fn decode_hex(hex: &[u8]) -> Vec<u8> {
    let digit = |c: u8| {
        let d = char::from(c).to_digit(16).unwrap();
        u8::try_from(d).unwrap()
    };
    hex.chunks(2)
        .map(|p| (digit(p[0]) << 4) | digit(p[1]))
        .collect()
}

/// Whether any text in `hay` hashes to `hash` as the key: 64 characters of
/// base64's alphabet as they are, or 128 hex digits decoded.
fn holds_key(hay: &[u8], hash: &[u8; 32]) -> bool {
    let is = |k: &[u8]| Sha256::digest(k).as_slice() == hash;
    let raw = hay
        .windows(KEY_LEN)
        .filter(|w| w.iter().all(|c| KEY_B64.contains(c)))
        .any(is);
    let hex = hay
        .windows(2 * KEY_LEN)
        .filter(|w| w.iter().all(u8::is_ascii_hexdigit))
        .any(|w| is(&decode_hex(w)));
    raw || hex
}

/// The console (the agent's log, the stand-in's, the kernel's) never holds
/// the key: checked by its hash, with the check itself shown to find a key
/// that is there, as text and as hex.
fn key_never_on(console: &[u8], hash: &[u8; 32]) {
    let probe = &KEY_B64[..KEY_LEN];
    let probe_hash: [u8; 32] = Sha256::digest(probe).into();
    let hex: String = probe.iter().map(|b| format!("{b:02X}")).collect();
    for planted in [probe.to_vec(), hex.into_bytes()] {
        let hay = [b"x=".as_slice(), &planted, b"\n"].concat();
        assert!(holds_key(&hay, &probe_hash));
    }
    assert!(!holds_key(console, hash), "the key is on the console");
}

/// On the host: cryptsetup and an independent AES-XTS read vol-p's file
/// from a clean ext4; vol-k, LUKS2 too, opens with no guess the host has.
fn checked_on_host(dir: &Path, p: &Path, k: &Path, hash: &[u8; 32]) {
    let pass = dir.join("pass");
    std::fs::write(&pass, PASS).unwrap();
    let dump = luks::dump(p);
    assert!(
        dump.contains("aes-xts-plain64") && dump.contains("argon2id"),
        "{dump}"
    );
    assert!(luks::opens(p, &pass));
    assert!(
        !luks::contains(p, PROOF.as_bytes()),
        "plaintext in the image"
    );
    let plain = luks::plaintext(p, &pass);
    run("e2fsck", &["-f", "-n", plain.to_str().unwrap()]);
    let m = crust_testkit::Mounted::new(&plain, "ext4", "loop,ro");
    let read = std::fs::read_to_string(m.path.join("proof")).unwrap();
    assert_eq!(read, format!("{PROOF} vol-p\n"));

    assert!(luks::dump(k).contains("argon2id"));
    let hash_hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    for (i, guess) in [PASS, hash_hex.as_bytes(), b"vol"].iter().enumerate() {
        let f = dir.join(format!("guess{i}"));
        std::fs::write(&f, guess).unwrap();
        assert!(!luks::opens(k, &f), "guess {i} opens the CDH's volume");
    }
}

#[test]
#[ignore = "needs a VM: make test-vm runs it"]
fn the_guests_cryptsetup_opens_what_the_agent_made_with_a_key_the_host_never_had() {
    luks::tools();
    let t = tempfile::tempdir().unwrap();
    let (p, k) = (blank(t.path(), "p.img", 64), blank(t.path(), "k.img", 64));
    let root = guest_image(t.path());
    let t0 = Instant::now();
    let mut vm = Vm::up(guest::options(t.path().join("vm"), root, 512))
        .expect("the systemd guest boots and the agent answers");
    eprintln!("systemd guest: agent answering after {:?}", t0.elapsed());
    let c = vm.agent().unwrap();
    vm.hotplug(&p, "ser-p", false).unwrap();
    vm.hotplug(&k, "ser-k", false).unwrap();
    let pass = pb::encryption::Key::Passphrase(PASS.to_vec());
    for r in [
        encrypted("vol-p", "ser-p", pass),
        encrypted("vol-k", "ser-k", kbs(KBS_KEY)),
    ] {
        let t = Instant::now();
        let out = c.publish_volume(ctx(), &r).unwrap();
        eprintln!(
            "{}: blank, made LUKS2 and ext4, published in {:?}",
            r.volume_id,
            t.elapsed()
        );
        assert!(out.device.starts_with("/dev/dm-"), "{out:?}");
    }
    let wait = Duration::from_secs(600);
    guest::console_until(&vm, "CRUST-TEST wrote", wait);
    unpublish(&c, "vol-p");
    unpublish(&c, "vol-k");
    let said = guest::said(&guest::console_until(&vm, "CRUST-TEST checked", wait));
    checked_in_guest(&said);
    let hash = key_hash(&said);

    // A resource the CDH does not have: its refusal, and the disk left as it was.
    let missing = c.publish_volume(
        ctx(),
        &encrypted("vol-k", "ser-k", kbs("kbs:///default/key/missing")),
    );
    let why = code(missing.clone());
    assert!(
        why == "NOT_FOUND" || why == "FAILED_PRECONDITION",
        "{missing:?}"
    );
    assert!(message(missing).contains("default/key/missing"));
    assert!(!listed(&c, "vol-k"));

    // The CDH's key again opens the disk, not formatted anew.
    let again = c
        .publish_volume(ctx(), &encrypted("vol-k", "ser-k", kbs(KBS_KEY)))
        .unwrap();
    assert!(!again.already_published);
    let said = guest::said(&guest::console_until(&vm, "CRUST-TEST done", wait));
    assert!(
        said.contains(&format!("again: {PROOF} vol-k, mappings: 1")),
        "{said}"
    );
    assert!(said.contains("key forms found where planted: 3"), "{said}");
    assert!(said.contains("key in the journal: 0"), "{said}");
    let how = vm.down().unwrap();
    assert!(how.contains("1 volumes unmounted"), "{how}");
    eprintln!("systemd guest, encrypted: {:?} in all", t0.elapsed());

    key_never_on(&std::fs::read(vm.console_log()).unwrap(), &hash);
    checked_on_host(t.path(), &p, &k, &hash);
}
