//! What a dynamically linked x86-64 ELF file asks of the loader: its
//! interpreter (`PT_INTERP`) and the libraries it needs (`DT_NEEDED`), read
//! from the program headers and the dynamic section. Enough to ship a
//! program with exactly its libraries; nothing else of ELF is read.
//!
//! A reader of its own rather than `ldd`, which runs the loader on the file
//! and prints the build host's paths in a format meant for people, and
//! rather than the `object` or `goblin` crates, which are not in the build:
//! this is about a hundred lines over fixed layouts, each read checked.

/// What the loader needs for one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Needs {
    /// The interpreter's path (`/lib64/ld-linux-x86-64.so.2`), for a program.
    pub interpreter: Option<String>,
    /// The `DT_NEEDED` names, in order (`libc.so.6`).
    pub libraries: Vec<String>,
}

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const PT_INTERP: u32 = 3;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_STRTAB: u64 = 5;
/// Bytes of one program header and one dynamic entry of ELF64.
const PHDR_SIZE: usize = 56;
const DYN_SIZE: usize = 16;

/// One program header's fields that matter here.
struct Segment {
    kind: u32,
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

/// Reads what `file` (an ELF64 little-endian file's bytes) needs, or says
/// why it cannot: not ELF64 LE, or a header pointing outside the file.
pub fn needs(file: &[u8]) -> Result<Needs, String> {
    if file.get(..4) != Some(b"\x7fELF") {
        return Err("not an ELF file".into());
    }
    if file.get(4) != Some(&2) || file.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let phoff = u64_at(file, 0x20)?;
    let phentsize = usize::from(u16_at(file, 0x36)?);
    let phnum = usize::from(u16_at(file, 0x38)?);
    if phentsize < PHDR_SIZE {
        return Err(format!("program headers of {phentsize} bytes"));
    }
    let segments = (0..phnum)
        .map(|i| {
            let at = offset(phoff)?
                .checked_add(i.checked_mul(phentsize).ok_or("too many program headers")?)
                .ok_or("program headers past the end")?;
            Ok(Segment {
                kind: u32_at(file, at)?,
                offset: u64_at(file, at + 8)?,
                vaddr: u64_at(file, at + 16)?,
                filesz: u64_at(file, at + 32)?,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let interpreter = match segments.iter().find(|s| s.kind == PT_INTERP) {
        Some(s) => Some(c_str(bytes(file, s.offset, s.filesz)?, 0)?),
        None => None,
    };
    let libraries = match segments.iter().find(|s| s.kind == PT_DYNAMIC) {
        Some(d) => needed(file, &segments, bytes(file, d.offset, d.filesz)?)?,
        None => Vec::new(),
    };
    Ok(Needs {
        interpreter,
        libraries,
    })
}

/// The `DT_NEEDED` names of the dynamic section `dynamic`, from the string
/// table `DT_STRTAB` points at (an address, found in a `PT_LOAD` segment).
fn needed(file: &[u8], segments: &[Segment], dynamic: &[u8]) -> Result<Vec<String>, String> {
    let mut strtab = None;
    let mut names = Vec::new();
    for entry in dynamic.chunks_exact(DYN_SIZE) {
        let tag = u64_at(entry, 0)?;
        let val = u64_at(entry, 8)?;
        match tag {
            DT_NULL => break,
            DT_NEEDED => names.push(val),
            DT_STRTAB => strtab = Some(val),
            _ => {}
        }
    }
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let addr = strtab.ok_or("DT_NEEDED without DT_STRTAB")?;
    let load = segments
        .iter()
        .find(|s| s.kind == PT_LOAD && s.vaddr <= addr && addr - s.vaddr < s.filesz)
        .ok_or("DT_STRTAB outside every loaded segment")?;
    let table = offset(
        load.offset
            .checked_add(addr - load.vaddr)
            .ok_or("DT_STRTAB past the end")?,
    )?;
    names
        .into_iter()
        .map(|n| {
            c_str(
                file,
                table.checked_add(offset(n)?).ok_or("string past the end")?,
            )
        })
        .collect()
}

fn offset(v: u64) -> Result<usize, String> {
    usize::try_from(v).map_err(|_| format!("offset {v} past the address space"))
}

/// `len` bytes at `off`.
fn bytes(file: &[u8], off: u64, len: u64) -> Result<&[u8], String> {
    let start = offset(off)?;
    let end = start
        .checked_add(offset(len)?)
        .ok_or("a segment past the end")?;
    file.get(start..end)
        .ok_or_else(|| format!("bytes {start}..{end} past the file's {}", file.len()))
}

/// The NUL-terminated UTF-8 string at `at`.
fn c_str(file: &[u8], at: usize) -> Result<String, String> {
    let rest = file.get(at..).ok_or("a string past the end")?;
    let len = rest
        .iter()
        .position(|&b| b == 0)
        .ok_or("a string without its NUL")?;
    String::from_utf8(rest[..len].to_vec()).map_err(|_| "a name that is not UTF-8".into())
}

fn array<const N: usize>(b: &[u8], at: usize) -> Result<[u8; N], String> {
    at.checked_add(N)
        .and_then(|end| b.get(at..end))
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| format!("a field at {at} past the end"))
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, String> {
    array(b, at).map(u16::from_le_bytes)
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, String> {
    array(b, at).map(u32::from_le_bytes)
}

fn u64_at(b: &[u8], at: usize) -> Result<u64, String> {
    array(b, at).map(u64::from_le_bytes)
}

/// Builds small ELF files for tests: an interpreter and DT_NEEDED names.
#[cfg(test)]
pub(crate) fn fake(interpreter: Option<&str>, libraries: &[&str]) -> Vec<u8> {
    // Layout: ELF header (64), 3 program headers, the interpreter string,
    // the string table, the dynamic section.
    let phoff = 64usize;
    let data = phoff + 3 * PHDR_SIZE;
    let interp = interpreter.map(|s| format!("{s}\0")).unwrap_or_default();
    let mut strtab = vec![0u8];
    let mut offsets = Vec::new();
    for l in libraries {
        offsets.push(strtab.len() as u64);
        strtab.extend_from_slice(l.as_bytes());
        strtab.push(0);
    }
    let strtab_at = data + interp.len();
    let dyn_at = strtab_at + strtab.len();
    // The string table's address differs from its offset, as in real files.
    let vbase = 0x40_0000u64;
    let mut dynamic = Vec::new();
    for o in &offsets {
        dynamic.extend(DT_NEEDED.to_le_bytes().into_iter().chain(o.to_le_bytes()));
    }
    dynamic.extend(
        DT_STRTAB
            .to_le_bytes()
            .into_iter()
            .chain((vbase + strtab_at as u64).to_le_bytes()),
    );
    dynamic.extend([0u8; DYN_SIZE]);
    let end = dyn_at + dynamic.len();

    let mut f = vec![0u8; 64];
    f[..6].copy_from_slice(b"\x7fELF\x02\x01");
    f[0x20..0x28].copy_from_slice(&(phoff as u64).to_le_bytes());
    f[0x36..0x38].copy_from_slice(&u16::try_from(PHDR_SIZE).unwrap().to_le_bytes());
    f[0x38..0x3a].copy_from_slice(&3u16.to_le_bytes());
    let mut phdr = |kind: u32, off: usize, vaddr: u64, len: usize| {
        let mut h = vec![0u8; PHDR_SIZE];
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&(off as u64).to_le_bytes());
        h[16..24].copy_from_slice(&vaddr.to_le_bytes());
        h[32..40].copy_from_slice(&(len as u64).to_le_bytes());
        f.extend(h);
    };
    let (ik, dk) = (
        if interpreter.is_some() { PT_INTERP } else { 0 },
        if libraries.is_empty() { 0 } else { PT_DYNAMIC },
    );
    phdr(PT_LOAD, 0, vbase, end);
    phdr(ik, data, vbase + data as u64, interp.len());
    phdr(dk, dyn_at, vbase + dyn_at as u64, dynamic.len());
    f.extend(interp.bytes());
    f.extend(strtab);
    f.extend(dynamic);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_interpreter_and_the_needed_libraries() {
        let f = fake(
            Some("/lib64/ld-linux-x86-64.so.2"),
            &["libext2fs.so.2", "libc.so.6"],
        );
        assert_eq!(
            needs(&f).unwrap(),
            Needs {
                interpreter: Some("/lib64/ld-linux-x86-64.so.2".into()),
                libraries: vec!["libext2fs.so.2".into(), "libc.so.6".into()],
            }
        );
        assert_eq!(
            needs(&fake(None, &["libc.so.6"])).unwrap().interpreter,
            None
        );
        assert_eq!(
            needs(&fake(Some("/ld"), &[])).unwrap().libraries,
            Vec::<String>::new()
        );
    }

    #[test]
    fn damaged_files_are_refused_not_read_past() {
        let good = fake(Some("/ld"), &["liba.so"]);
        // Every truncation is an error or, cut after all that matters, the same answer.
        for len in 0..good.len() {
            if let Ok(n) = needs(&good[..len]) {
                assert_eq!(n, needs(&good).unwrap(), "cut at {len}");
            }
        }
        assert_eq!(needs(b"#!/bin/sh\n").unwrap_err(), "not an ELF file");
        let mut f = good.clone();
        f[4] = 1;
        assert_eq!(
            needs(&f).unwrap_err(),
            "not a 64-bit little-endian ELF file"
        );
        let mut f = good.clone();
        f[0x20..0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(needs(&f).is_err());
    }

    /// The build host's own mke2fs.
    #[test]
    #[ignore = "needs e2fsprogs: make test runs it"]
    fn reads_the_build_hosts_mke2fs() {
        let Ok(f) = std::fs::read("/usr/sbin/mke2fs").or_else(|_| std::fs::read("/sbin/mke2fs"))
        else {
            crust_testkit::needs::missing(
                "it reads the build host's mke2fs (apt-get install e2fsprogs)",
            );
        };
        let n = needs(&f).unwrap();
        assert_eq!(
            n.interpreter.as_deref(),
            Some("/lib64/ld-linux-x86-64.so.2")
        );
        assert!(n.libraries.contains(&"libext2fs.so.2".to_string()), "{n:?}");
        assert!(n.libraries.contains(&"libc.so.6".to_string()), "{n:?}");
    }
}
