//! Agents sharing one guest, on one fake kernel (one device-mapper, one
//! mount table), each with its own root: each makes, sweeps and closes
//! only the mappings its owner's tag marks, and the untagged ones its own
//! records name (left by agents before owners).

use std::path::Path;

use zeroize::Zeroizing;

use super::testkit::{fake_table, mapping_name, open_at, reopen, request};
use crate::cancel::Cancel;
use crate::model::{Device, FsType};
use crate::validate::STATE_DIR;
use crate::volumes::fake::{Call, Fake};
use crate::volumes::kernel::Kernel;
use crate::volumes::request::{Encryption, PublishRequest};

const PASS: &[u8] = b"correct horse battery staple";

/// A publish of `disk` as encrypted ext4 volume `id`.
fn encrypted(id: &str, disk: &Device) -> PublishRequest {
    let mut r = request(id, disk, false, false);
    r.spec.encryption = Some(Encryption {
        allow_discards: false,
        format_if_blank: false,
        integrity: None,
    });
    r.key = Some(crate::keys::source::KeySource::Passphrase(Zeroizing::new(
        PASS.to_vec(),
    )));
    r
}

fn sorted(mut names: Vec<String>) -> Vec<String> {
    names.sort();
    names
}

/// A mapping opened as a publish opens it, with no record after it (the
/// publish killed in between).
fn open_stray(fake: &Fake, disk: &Device, name: &str) {
    let key = Zeroizing::new(PASS.to_vec());
    fake.open_mapping(disk, name, false, &key).unwrap();
}

/// Agent B starting in the guest (and restarting) while agent A is between
/// opening a volume's mapping and mounting it, and asked meanwhile to
/// unpublish the id A is publishing, leaves A's mapping alone: A's publish
/// completes on it, and A's unpublish removes it.
#[test]
fn an_agent_starting_beside_another_mid_publish_leaves_its_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let (a, fake) = fake_table(dir.path());
    let d = fake.luks_disk(dir.path(), "fkc", PASS, Some(FsType::Ext4));
    let (tx, rx) = std::sync::mpsc::channel();
    let (f, p) = (fake.clone(), dir.path().to_path_buf());
    fake.before(Call::Mount, 1, move || {
        let open = f.mappings();
        let b = open_at(&p, &f, "root-b");
        let gone = b
            .unpublish("e", &Cancel::never())
            .map_err(|e| e.to_string());
        drop(b);
        drop(open_at(&p, &f, "root-b"));
        tx.send((open, gone, f.mappings())).unwrap();
    });
    a.publish(&encrypted("e", &d), &Cancel::never()).unwrap();
    let (open, gone, after) = rx.recv().unwrap();
    let name = mapping_name(a.root(), "e");
    assert_eq!(
        open,
        [name.as_str()],
        "A's mapping, made and not yet mounted"
    );
    assert_eq!(gone, Ok(false), "B has no volume e");
    assert_eq!(after, open, "B's start, unpublish and restart left it");
    assert_eq!(a.list()[0].encryption.as_ref().unwrap().mapping, name);
    assert!(a.unpublish("e", &Cancel::never()).unwrap());
    assert!(fake.mappings().is_empty());
}

/// Two agents publish one volume id, each on its own disk: each has a
/// mapping (and so a key) of its own name. B's restart sweeps a stray of
/// its own and keeps both volumes; each one's unpublish removes its own.
#[test]
fn two_agents_with_one_volume_id_each_keep_their_own_mapping() {
    let dir = tempfile::tempdir().unwrap();
    let (a, fake) = fake_table(dir.path());
    let b = open_at(dir.path(), &fake, "root-b");
    let da = fake.luks_disk(dir.path(), "fka", PASS, Some(FsType::Ext4));
    let db = fake.luks_disk(dir.path(), "fkb", PASS, Some(FsType::Ext4));
    let ds = fake.luks_disk(dir.path(), "fks", PASS, Some(FsType::Ext4));
    a.publish(&encrypted("e", &da), &Cancel::never()).unwrap();
    b.publish(&encrypted("e", &db), &Cancel::never()).unwrap();
    let (na, nb) = (mapping_name(a.root(), "e"), mapping_name(b.root(), "e"));
    assert_ne!(na, nb);
    let both = sorted(vec![na.clone(), nb.clone()]);
    assert_eq!(sorted(fake.mappings()), both);

    open_stray(&fake, &ds, &mapping_name(b.root(), "s"));
    drop(b);
    let b = open_at(dir.path(), &fake, "root-b");
    assert_eq!(sorted(fake.mappings()), both, "B's stray alone removed");
    assert_eq!(b.list()[0].encryption.as_ref().unwrap().mapping, nb);
    assert!(b.unpublish("e", &Cancel::never()).unwrap());
    assert_eq!(fake.mappings(), [na.as_str()]);
    drop(a);
    let a = reopen(dir.path(), &fake);
    assert_eq!(a.list()[0].encryption.as_ref().unwrap().mapping, na);
    assert!(a.unpublish("e", &Cancel::never()).unwrap());
    assert!(fake.mappings().is_empty());
}

/// Makes volume `id` on `root` what an agent before owners left: its
/// mapping, and the record's name for it, untagged.
fn untag(fake: &Fake, root: &Path, id: &str) {
    let (tagged, legacy) = (mapping_name(root, id), format!("crust-{id}"));
    fake.rename_mapping(&tagged, &legacy);
    let record = root.join(STATE_DIR).join(format!("{id}.vol"));
    let text = std::fs::read_to_string(&record).unwrap();
    assert!(text.contains(&format!("mapping={tagged}\t")), "{text}");
    std::fs::write(&record, text.replace(&tagged, &legacy)).unwrap();
}

/// An agent before owners left records naming untagged mappings. A
/// restart adopts the one still mounted (its unpublish removes it), removes
/// the one whose volume is gone (its record names it), and leaves an
/// untagged mapping no record names, at start and at an Unpublish of its
/// id alike: it may be an older agent's, mid-publish.
#[test]
fn untagged_mappings_are_the_agents_only_where_its_records_name_them() {
    let dir = tempfile::tempdir().unwrap();
    let (v, fake) = fake_table(dir.path());
    let root = v.root().to_path_buf();
    for (id, disk) in [("e", "fke"), ("g", "fkg")] {
        let d = fake.luks_disk(dir.path(), disk, PASS, Some(FsType::Ext4));
        v.publish(&encrypted(id, &d), &Cancel::never()).unwrap();
        untag(&fake, &root, id);
    }
    let s = fake.luks_disk(dir.path(), "fks", PASS, Some(FsType::Ext4));
    open_stray(&fake, &s, "crust-s");
    drop(v);
    fake.unmount_behind(&root.join("volumes/g"));
    let v = reopen(dir.path(), &fake);
    assert_eq!(sorted(fake.mappings()), ["crust-e", "crust-s"]);
    let listed = v.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].encryption.as_ref().unwrap().mapping, "crust-e");
    assert!(v.unpublish("e", &Cancel::never()).unwrap());
    assert!(!v.unpublish("s", &Cancel::never()).unwrap());
    assert_eq!(fake.mappings(), ["crust-s"]);
}
