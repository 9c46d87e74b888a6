//! A key read from a file in the guest, as `cryptsetup --key-file` reads
//! it: every byte as it is, a trailing newline included, so that the
//! operator's `cryptsetup open --key-file FILE` opens the same volume.
//! Symlinks are followed, as cryptsetup follows them (a Kubernetes Secret
//! mounted in the guest is a chain of them). Only a regular file is read:
//! it is opened without blocking (a FIFO's open would wait for a writer)
//! and checked before any read, and at most [`MAX_KEY_LEN`] bytes are taken.

use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;
use zeroize::Zeroizing;

use super::error::Error;
use super::source::MAX_KEY_LEN;
use crate::cancel::Cancel;

/// The key in the regular file at `path`: 1 to [`MAX_KEY_LEN`] bytes.
pub(crate) fn read(path: &Path, cancel: &Cancel) -> Result<Zeroizing<Vec<u8>>, Error> {
    cancel.check(|| format!("reading the key file {}", path.display()))?;
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    let fd = loop {
        match rustix::fs::open(path, flags, Mode::empty()) {
            Ok(fd) => break fd,
            Err(Errno::INTR) => continue,
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
    // Room for one byte more than the file said it held: a file that grew
    // past the bound is seen to have, and the buffer never grows (growing
    // would leave a copy of the key behind, unzeroed).
    let room = usize::try_from(size).unwrap_or(MAX_KEY_LEN) + 1;
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

    fn read_at(path: &Path) -> Result<Zeroizing<Vec<u8>>, Error> {
        read(path, &Cancel::never())
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
            (dir.path(), Code::FailedPrecondition, "is a directory"),
            (
                Path::new("/dev/null"),
                Code::FailedPrecondition,
                "a character device",
            ),
            (&sock, Code::FailedPrecondition, "cannot be opened"),
            (
                &dir.path().join("loop"),
                Code::FailedPrecondition,
                "symbolic links",
            ),
        ];
        for (path, code, text) in cases {
            let e = read_at(path).unwrap_err();
            assert_eq!(e.code(), *code, "{}: {e}", path.display());
            let msg = e.to_string();
            assert!(msg.contains(text), "{msg}");
            assert!(msg.contains(&path.display().to_string()), "{msg}");
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
        let e = read(&p, &past).unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded);
    }
}
