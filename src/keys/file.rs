//! A key read from a file in the guest's key directory (`--key-dir`,
//! default /run/crust/keys), as `cryptsetup --key-file` reads it: every byte as it is, a trailing newline included, so that the
//! operator's `cryptsetup open --key-file FILE` opens the same volume.
//! Symlinks are followed, as cryptsetup follows them (a Kubernetes Secret
//! mounted in the guest is a chain of them), but never out of the key
//! directory: a path elsewhere is refused saying only that, so that a
//! key_uri tells the host nothing of the guest's other files, and the
//! agent's answers are no oracle on their bytes. Only a regular file is read:
//! it is opened without blocking (a FIFO's open would wait for a writer)
//! and checked before any read, and at most [`MAX_KEY_LEN`] bytes are taken.

use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use zeroize::Zeroizing;

use super::error::Error;
use super::source::MAX_KEY_LEN;
use crate::cancel::Cancel;

/// Where `file:///` keys are read from unless told otherwise.
pub const DEFAULT_KEY_DIR: &str = "/run/crust/keys";

/// The key in the regular file at `path`, beneath `key_dir`: 1 to
/// [`MAX_KEY_LEN`] bytes.
pub(crate) fn read(
    key_dir: &Path,
    path: &Path,
    cancel: &Cancel,
) -> Result<Zeroizing<Vec<u8>>, Error> {
    cancel.check(|| format!("reading the key file {}", path.display()))?;
    let outside = || Error::OutsideKeyDir {
        dir: key_dir.to_path_buf(),
    };
    let rel = path.strip_prefix(key_dir).map_err(|_| outside())?;
    if rel.as_os_str().is_empty() {
        return Err(outside());
    }
    let dir = loop {
        match rustix::fs::open(
            key_dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => break fd,
            Err(Errno::INTR) => continue,
            Err(errno) => {
                return Err(Error::FileOpen {
                    path: key_dir.to_path_buf(),
                    errno,
                })
            }
        }
    };
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    let beneath = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    let fd = loop {
        match rustix::fs::openat2(&dir, rel, flags, Mode::empty(), beneath) {
            Ok(fd) => break fd,
            Err(Errno::INTR | Errno::AGAIN) => continue,
            Err(Errno::XDEV) => return Err(outside()),
            Err(errno) => {
                return Err(Error::FileOpen {
                    path: path.to_path_buf(),
                    errno,
                })
            }
        }
    };
    let read_error = |errno| Error::FileRead {
        path: path.to_path_buf(),
        errno,
    };
    let st = rustix::fs::fstat(&fd).map_err(read_error)?;
    let kind = FileType::from_raw_mode(st.st_mode);
    if kind != FileType::RegularFile {
        return Err(Error::NotRegular {
            path: path.to_path_buf(),
            kind: kind_name(kind),
        });
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    let too_large = |size: u64| Error::TooLarge {
        from: format!("the key file {}", path.display()),
        size,
    };
    if size > MAX_KEY_LEN as u64 {
        return Err(too_large(size));
    }
    // Room for one byte more than a key may hold, whatever the file says
    // it holds (a pseudo-file says 0): one that grew past the bound is
    // seen to, and the buffer never grows (growing would leave a copy of
    // the key behind, unzeroed).
    let room = MAX_KEY_LEN + 1;
    let mut key = Zeroizing::new(vec![0u8; room]);
    let mut got = 0;
    while got < room {
        match rustix::io::read(&fd, &mut key[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::INTR) => continue,
            Err(errno) => return Err(read_error(errno)),
        }
    }
    if got > MAX_KEY_LEN {
        return Err(too_large(got as u64));
    }
    if got == 0 {
        return Err(Error::Empty {
            from: format!("the key file {}", path.display()),
        });
    }
    key.truncate(got);
    Ok(key)
}

/// A file type as a message names it.
fn kind_name(kind: FileType) -> &'static str {
    match kind {
        FileType::Directory => "a directory",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Symlink => "a symlink",
        _ => "not a file the agent knows",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::code::Code;
    use std::time::{Duration, Instant};

    /// `path` read with its own directory as the key directory.
    fn read_at(path: &Path) -> Result<Zeroizing<Vec<u8>>, Error> {
        let dir = path.parent().unwrap_or(Path::new("/"));
        read(dir, path, &Cancel::never())
    }

    #[test]
    fn a_regular_file_is_read_byte_for_byte_newline_included() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("key");
        let bytes = b"pass\0word\xff\n".to_vec();
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(*read_at(&p).unwrap(), bytes);
        // Through a chain of symlinks, as a Kubernetes Secret is mounted.
        std::fs::create_dir(dir.path().join("..data")).unwrap();
        std::fs::write(dir.path().join("..data/key"), b"k").unwrap();
        std::os::unix::fs::symlink("..data/key", dir.path().join("link1")).unwrap();
        std::os::unix::fs::symlink("link1", dir.path().join("link2")).unwrap();
        assert_eq!(*read_at(&dir.path().join("link2")).unwrap(), b"k");
        // Exactly the bound is taken.
        std::fs::write(&p, vec![1u8; MAX_KEY_LEN]).unwrap();
        assert_eq!(read_at(&p).unwrap().len(), MAX_KEY_LEN);
    }

    #[test]
    fn a_fifo_is_refused_at_once_without_waiting_for_a_writer() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &p,
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let start = Instant::now();
        let e = read_at(&p).unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            e.to_string().contains("is a FIFO, not a regular file"),
            "{e}"
        );
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
    }

    #[test]
    fn what_is_not_a_readable_regular_file_is_refused_by_code() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        std::os::unix::fs::symlink("nowhere", dir.path().join("dangling")).unwrap();
        std::os::unix::fs::symlink("loop", dir.path().join("loop")).unwrap();
        std::fs::write(dir.path().join("file"), b"x").unwrap();
        let cases: &[(&Path, Code, &str)] = &[
            (
                &dir.path().join("missing"),
                Code::NotFound,
                "put the key there",
            ),
            (&dir.path().join("dangling"), Code::NotFound, "No such file"),
            (
                &dir.path().join("file/below"),
                Code::NotFound,
                "Not a directory",
            ),
            (
                &dir.path().join("sub"),
                Code::FailedPrecondition,
                "is a directory",
            ),
            // Outside the key directory, or the directory itself: said as
            // only that, naming nothing of what is there.
            (dir.path(), Code::InvalidArgument, "not beneath"),
            (Path::new("/dev/null"), Code::InvalidArgument, "not beneath"),
            (&sock, Code::FailedPrecondition, "cannot be opened"),
            (
                &dir.path().join("loop"),
                Code::FailedPrecondition,
                "symbolic links",
            ),
        ];
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        for (path, code, text) in cases {
            let e = read(dir.path(), path, &Cancel::never()).unwrap_err();
            assert_eq!(e.code(), *code, "{}: {e}", path.display());
            let msg = e.to_string();
            assert!(msg.contains(text), "{msg}");
            if *code != Code::InvalidArgument {
                assert!(msg.contains(&path.display().to_string()), "{msg}");
            }
        }
    }

    #[test]
    fn a_file_too_large_or_empty_is_refused_without_its_content_shown() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big");
        let mut big = b"SECRET".repeat(MAX_KEY_LEN / 6 + 1);
        big.truncate(MAX_KEY_LEN + 1);
        std::fs::write(&p, &big).unwrap();
        let e = read_at(&p).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        let (msg, debug) = (e.to_string(), format!("{e:?}"));
        assert!(msg.contains("65537 bytes, more than the 65536"), "{msg}");
        assert!(
            !msg.contains("SECRET") && !debug.contains("SECRET"),
            "{debug}"
        );
        std::fs::write(&p, b"").unwrap();
        let e = read_at(&p).unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            e.to_string()
                .ends_with("is empty; a key has at least one byte"),
            "{e}"
        );
    }

    #[test]
    fn a_stopped_caller_reads_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("key");
        std::fs::write(&p, b"k").unwrap();
        let past = Cancel::never().with_deadline(Instant::now());
        let e = read(dir.path(), &p, &past).unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded);
    }

    /// key_uri file:// names any path of the guest (no directory it is
    /// confined to), and the answer to the host says what is there: that
    /// a path exists or not, its type, and a large file's exact size. With
    /// a header of its own making (32 keyslots of guessed passphrases),
    /// OK vs PERMISSION_DENIED is also a guess oracle on a small file's
    /// bytes, and on the first byte of any /proc file (st_size 0: one byte
    /// read).
    #[test]
    fn a_key_file_answer_says_nothing_of_other_guest_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("db.sqlite");
        std::fs::write(&p, vec![0u8; 123_457]).unwrap();
        let keys = std::path::Path::new(DEFAULT_KEY_DIR);
        let read_at = |p: &Path| read(keys, p, &Cancel::never());
        let big = read_at(&p).unwrap_err().to_string();
        let gone = read_at(&dir.path().join("nope")).unwrap_err().to_string();
        let isdir = read_at(dir.path()).unwrap_err().to_string();
        let environ = read_at(std::path::Path::new("/proc/self/environ")).map(|k| k.len());
        // Beneath the key directory, a symlink out of it is refused the same way.
        let kd = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&p, kd.path().join("out")).unwrap();
        let e = read(kd.path(), &kd.path().join("out"), &Cancel::never()).unwrap_err();
        assert!(e.to_string().contains("not beneath"), "{e}");
        assert!(
            big == gone && gone == isdir && !big.contains("123457") && environ.is_err(),
            "the host learns: {big:?} / {gone:?} / {isdir:?}; /proc/self/environ read as a key of {environ:?} bytes"
        );
    }
}
