//! The house rules clippy cannot check, checked by reading the source. For
//! every crate of the workspace (the agent's `src/`, crustd, crust-client,
//! crust-vm, crust-kubelet, crust-protocols, crust-argon2, the bench,
//! crust-fuzz, the test kit) and for their integration tests:
//!
//! - no import cycle among files: an edge runs from file A to file B when A
//!   names (by `use` or by a path, `crate::`, `super::`, `self::`,
//!   `crust_agent::`, or through a name A imported) an item or module defined
//!   in B; a `mod b;` declaration alone is not an edge, but a parent that
//!   re-exports or uses a child is;
//! - no file outside the tests holds more than 800 lines of code (not blank,
//!   not only a comment) outside its `#[cfg(test)]` items;
//! - no `too_many_arguments` allowance in its sources or its manifest.
//!
//! Function length is clippy's (`too_many_lines`, denied for the workspace
//! in Cargo.toml, 100 lines in clippy.toml), test code included.
//!
//! And for the agent's `src/`: every file sits in a layer (the table below,
//! as lib.rs and the README draw it) and names only files of lower layers,
//! or of its own layer where that layer allows it; capabilities never name
//! one another.
//!
//! Test code counts for edges: a capability's tests that reached into the
//! table would still tie the capability to it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Most lines of code a file may hold outside its tests.
const MAX_CODE_LINES: usize = 800;

/// One crate of the workspace, or its integration tests: its name in paths,
/// its source directory (relative to the workspace root) and its root
/// files, each with the module path its `crate::` means (`<bin…>` for a
/// binary, its own crate).
struct Spec {
    name: &'static str,
    dir: &'static str,
    roots: &'static [(&'static str, &'static str)],
    /// Directories (relative to `dir`, "" for `dir` itself) whose every
    /// `.rs` file is a crate root of its own, `<stem>`: tests, fuzz targets.
    root_dirs: &'static [&'static str],
    /// Integration tests: held to the import rules, not to the file length.
    tests: bool,
    /// Its manifest, relative to the workspace root.
    manifest: &'static str,
}

/// A crate's integration tests in `dir` (each file its own crate), named
/// after the crate with `manifest`.
const fn tests_in(dir: &'static str, manifest: &'static str) -> Spec {
    Spec {
        // Never a path's first segment: `crust_agent::` in a test names
        // the library, not a test file.
        name: "<tests>",
        dir,
        roots: &[],
        root_dirs: &[""],
        tests: true,
        manifest,
    }
}

/// Every crate held to the rules.
const CRATES: &[Spec] = &[
    Spec {
        name: "crust_agent",
        dir: "src",
        roots: &[("lib.rs", ""), ("main.rs", "<bin>")],
        root_dirs: &[],
        tests: false,
        manifest: "Cargo.toml",
    },
    Spec {
        name: "crustd",
        dir: "crustd/src",
        roots: &[
            ("lib.rs", ""),
            ("main.rs", "<bin>"),
            ("bin/crustd-ctl.rs", "<bin2>"),
        ],
        root_dirs: &[],
        tests: false,
        manifest: "crustd/Cargo.toml",
    },
    Spec {
        name: "crust_client",
        dir: "client/src",
        roots: &[("lib.rs", ""), ("bin/crustctl/main.rs", "<bin>")],
        root_dirs: &[],
        tests: false,
        manifest: "client/Cargo.toml",
    },
    Spec {
        name: "crust_vm",
        dir: "vm/src",
        roots: &[("lib.rs", ""), ("main.rs", "<bin>")],
        root_dirs: &[],
        tests: false,
        manifest: "vm/Cargo.toml",
    },
    Spec {
        name: "crust_kubelet",
        dir: "kubelet/src",
        roots: &[("lib.rs", "")],
        root_dirs: &[],
        tests: false,
        manifest: "kubelet/Cargo.toml",
    },
    Spec {
        name: "crust_protocols",
        dir: "protocols/src",
        roots: &[("lib.rs", "")],
        root_dirs: &[],
        tests: false,
        manifest: "protocols/Cargo.toml",
    },
    Spec {
        name: "crust_bench",
        dir: "bench/src",
        roots: &[("main.rs", "<bin>")],
        root_dirs: &[],
        tests: false,
        manifest: "bench/Cargo.toml",
    },
    Spec {
        name: "crust_argon2",
        dir: "argon2/src",
        roots: &[("lib.rs", "")],
        root_dirs: &[],
        tests: false,
        manifest: "argon2/Cargo.toml",
    },
    Spec {
        name: "crust_testkit",
        dir: "testkit/src",
        roots: &[("lib.rs", "")],
        root_dirs: &[],
        tests: false,
        manifest: "testkit/Cargo.toml",
    },
    Spec {
        name: "crust_fuzz",
        dir: "fuzz",
        roots: &[("src/lib.rs", "")],
        root_dirs: &["fuzz_targets"],
        tests: false,
        manifest: "fuzz/Cargo.toml",
    },
    tests_in("tests", "Cargo.toml"),
    tests_in("crustd/tests", "crustd/Cargo.toml"),
    tests_in("client/tests", "client/Cargo.toml"),
    tests_in("vm/tests", "vm/Cargo.toml"),
    tests_in("fuzz/tests", "fuzz/Cargo.toml"),
];

thread_local! {
    /// The crate being read on this thread (the agent unless a check says otherwise).
    static CURRENT: std::cell::Cell<&'static Spec> = const { std::cell::Cell::new(&CRATES[0]) };
}

/// Runs `f` with `spec` as the crate being read.
fn in_crate<T>(spec: &'static Spec, f: impl FnOnce() -> T) -> T {
    CURRENT.with(|c| c.set(spec));
    let out = f();
    CURRENT.with(|c| c.set(&CRATES[0]));
    out
}

fn spec() -> &'static Spec {
    CURRENT.with(|c| c.get())
}

/// File → the files it names → where (line, the name).
type Graph = BTreeMap<String, BTreeMap<String, Vec<(usize, String)>>>;

/// The layers, lowest first. A file names only files in lower layers, and
/// files of its own layer only where `same_layer` says so (a group of files
/// that is one thing split for reading, e.g. a capability's directory).
const LAYERS: &[(&str, &[&str])] = &[
    (
        "leaves",
        &[
            "code.rs",
            "sys/",
            "model.rs",
            "superblock.rs",
            "cancel.rs",
            "validate.rs",
            "logging.rs",
            "system.rs",
        ],
    ),
    (
        "capabilities",
        &[
            "device.rs",
            "probe/",
            "mount/",
            "ownership/",
            "stats/",
            "grow.rs",
            "quiesce.rs",
            "luks2/",
            "keys/",
            "mkfs.rs",
        ],
    ),
    ("table", &["volumes/", "error.rs"]),
    ("wire", &["server/", "rpc/"]),
    (
        "process",
        &[
            "init.rs",
            "instance.rs",
            "embed.rs",
            "notify.rs",
            "fuzz.rs",
            "main.rs",
            "lib.rs",
        ],
    ),
];

/// The layer a file (relative to src/) belongs to, and the group within it
/// (a directory, or the file itself).
fn place(file: &str) -> Option<(usize, String)> {
    for (i, (_, members)) in LAYERS.iter().enumerate() {
        for m in *members {
            if let Some(dir) = m.strip_suffix('/') {
                if file.starts_with(m) || file == format!("{dir}.rs") {
                    return Some((i, dir.to_string()));
                }
            } else if file == *m {
                return Some((i, m.trim_end_matches(".rs").to_string()));
            }
        }
    }
    None
}

/// Whether files of different groups in one layer may name each other
/// (acyclically): leaves and the process may; two capabilities, or the
/// table's parts and the joined error in the wrong direction, may not; the
/// server may use rpc, never the reverse.
fn same_layer_allowed(layer: usize, from: &str, to: &str) -> bool {
    match LAYERS[layer].0 {
        "leaves" | "process" => true,
        "table" => from == "volumes" && to == "error" || from == "error" && to == "volumes",
        "wire" => from == "server" && to == "rpc",
        _ => false,
    }
}

// ---------------------------------------------------------------- tokens --

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
    /// A string literal's contents (attributes need `#[path = "…"]`).
    Str(String),
}

/// The tokens of a Rust file with their line numbers; comments dropped,
/// literals kept only as strings.
fn tokens(src: &str) -> Vec<(Tok, usize)> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i = skip_block_comment(b, i, &mut line);
        } else if let Some((len, hashes)) = raw_string_start(&b[i..]) {
            // r"…", r#"…"#, br"…", cr"…"
            let (body, end) = raw_string(b, i + len, hashes, &mut line);
            out.push((Tok::Str(body), line));
            i = end;
        } else if c == b'"' || (c == b'b' || c == b'c') && b.get(i + 1) == Some(&b'"') {
            let (body, end) = string(b, if c == b'"' { i } else { i + 1 }, &mut line);
            out.push((Tok::Str(body), line));
            i = end;
        } else if c == b'\'' || c == b'b' && b.get(i + 1) == Some(&b'\'') {
            i = skip_char_or_lifetime(b, if c == b'b' { i + 1 } else { i });
        } else if ident_start(c) {
            let s = i;
            if b[i..].starts_with(b"r#") {
                i += 2;
            }
            while i < b.len() && ident_cont(b[i]) {
                i += 1;
            }
            let word = String::from_utf8_lossy(&b[s..i])
                .trim_start_matches("r#")
                .to_string();
            out.push((Tok::Ident(word), line));
        } else if c.is_ascii_digit() {
            while i < b.len()
                && (ident_cont(b[i])
                    || b[i] == b'.' && b.get(i + 1).is_some_and(|d| d.is_ascii_digit()))
            {
                i += 1;
            }
        } else if b[i..].starts_with(b"::") {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(c as char), line));
            i += 1;
        }
    }
    out
}

fn ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c >= 0x80
}

fn ident_cont(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80
}

/// Past the (nested) block comment starting at `i`, counting its lines.
fn skip_block_comment(b: &[u8], mut i: usize, line: &mut usize) -> usize {
    let mut depth = 0;
    while i < b.len() {
        if b[i..].starts_with(b"/*") {
            depth += 1;
            i += 2;
        } else if b[i..].starts_with(b"*/") {
            depth -= 1;
            i += 2;
            if depth == 0 {
                break;
            }
        } else {
            if b[i] == b'\n' {
                *line += 1;
            }
            i += 1;
        }
    }
    i
}

/// A raw string's body starting at `i` (past its opening) and the index
/// past its closing quote and `hashes`.
fn raw_string(b: &[u8], mut i: usize, hashes: usize, line: &mut usize) -> (String, usize) {
    let close: Vec<u8> = std::iter::once(b'"')
        .chain(std::iter::repeat_n(b'#', hashes))
        .collect();
    let body_start = i;
    while i < b.len() && !b[i..].starts_with(&close) {
        if b[i] == b'\n' {
            *line += 1;
        }
        i += 1;
    }
    let body = String::from_utf8_lossy(&b[body_start..i.min(b.len())]).into_owned();
    (body, i + close.len())
}

/// A string literal's body, its opening quote at `i`, and the index past
/// its closing quote.
fn string(b: &[u8], mut i: usize, line: &mut usize) -> (String, usize) {
    i += 1;
    let mut body = Vec::new();
    while i < b.len() && b[i] != b'"' {
        if b[i] == b'\\' {
            body.push(b[i]);
            i += 1;
        }
        if i < b.len() {
            if b[i] == b'\n' {
                *line += 1;
            }
            body.push(b[i]);
        }
        i += 1;
    }
    (String::from_utf8_lossy(&body).into_owned(), i + 1)
}

/// Past a char literal ('a', '\n', '\u{1F}', b'x') whose quote is at `q`,
/// or past the quote of a lifetime or label ('a), whose name follows as an
/// ident.
fn skip_char_or_lifetime(b: &[u8], q: usize) -> usize {
    if b.get(q + 1) == Some(&b'\\') {
        let mut j = q + 2;
        while j < b.len() && b[j] != b'\'' {
            j += 1;
        }
        j + 1
    } else if b.get(q + 2) == Some(&b'\'') {
        q + 3
    } else if b.len() > q + 1 && b[q + 1] >= 0x80 {
        // A multi-byte char literal.
        let mut j = q + 1;
        while j < b.len() && b[j] != b'\'' {
            j += 1;
        }
        j + 1
    } else {
        q + 1
    }
}

/// The length of a raw string's opening (`r#"`) and its number of hashes.
fn raw_string_start(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    if b.first() == Some(&b'b') || b.first() == Some(&b'c') {
        i += 1;
    }
    if b.get(i) != Some(&b'r') {
        return None;
    }
    i += 1;
    let mut hashes = 0;
    while b.get(i) == Some(&b'#') {
        hashes += 1;
        i += 1;
    }
    (b.get(i) == Some(&b'"')).then_some((i + 1, hashes))
}

// ---------------------------------------------------------------- modules --

/// One module of the crate: where its code is, and its children.
#[derive(Debug, Default)]
struct Module {
    /// The file its items are in (inline modules share their parent's).
    file: String,
    children: BTreeMap<String, Vec<String>>,
}

/// Every module of the library (and, apart, of the binary), by path
/// (`["volumes", "state"]`), read by following `mod` declarations from the
/// crate roots.
struct Crate {
    modules: BTreeMap<Vec<String>, Module>,
    /// The test-only files (`#[cfg(test)] mod x;`).
    test_files: BTreeSet<String>,
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(spec().dir)
}

fn rel(p: &Path) -> String {
    p.strip_prefix(src_dir())
        .map(|r| r.to_string_lossy().into_owned())
        .unwrap_or_else(|_| p.to_string_lossy().into_owned())
}

/// Reads the module tree below `path` (a module declared in `file`).
fn load(krate: &mut Crate, file: &Path, path: Vec<String>, test_only: bool) {
    let src = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let toks = tokens(&src);
    let name = rel(file);
    if test_only {
        krate.test_files.insert(name.clone());
    }
    krate.modules.entry(path.clone()).or_default().file = name;
    // Where child files of this module live.
    let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
    // A crate root's children are beside it, whatever its name.
    let root = path.is_empty() || path.len() == 1 && path[0].starts_with('<');
    let base = if root || matches!(stem.as_str(), "lib" | "main" | "mod") {
        file.parent().unwrap().to_path_buf()
    } else {
        file.parent().unwrap().join(&stem)
    };
    walk_mods(krate, file, &toks, &path, &base, test_only);
}

/// Finds `mod` declarations in `toks` (a module's items, inline modules
/// included) and loads the files they name.
fn walk_mods(
    krate: &mut Crate,
    file: &Path,
    toks: &[(Tok, usize)],
    path: &[String],
    base: &Path,
    test_only: bool,
) {
    let mut i = 0;
    let mut attrs: Vec<String> = Vec::new();
    let mut depth = 0usize;
    while i < toks.len() {
        match &toks[i].0 {
            Tok::Punct('#') if depth == 0 => {
                let end = attr_end(toks, i);
                attrs.push(attr_text(&toks[i..end]));
                i = end;
                continue;
            }
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth = depth.saturating_sub(1),
            Tok::Ident(w) if w == "mod" && depth == 0 => {
                let Some((Tok::Ident(child), _)) = toks.get(i + 1) else {
                    i += 1;
                    continue;
                };
                let child = child.clone();
                let test_child = test_only
                    || attrs
                        .iter()
                        .any(|a| a.starts_with("cfg(test") || a == "cfg(any(test,fuzzing))");
                let explicit = attrs
                    .iter()
                    .find_map(|a| a.strip_prefix("path=").map(str::to_string));
                let mut child_path = path.to_vec();
                child_path.push(child.clone());
                match toks.get(i + 2).map(|t| &t.0) {
                    Some(Tok::Punct(';')) => {
                        let f = match explicit {
                            Some(p) => file.parent().unwrap().join(p.trim_matches('"')),
                            None => {
                                let a = base.join(format!("{child}.rs"));
                                if a.exists() {
                                    a
                                } else {
                                    base.join(&child).join("mod.rs")
                                }
                            }
                        };
                        krate
                            .modules
                            .entry(path.to_vec())
                            .or_default()
                            .children
                            .insert(child.clone(), child_path.clone());
                        if f.starts_with(src_dir()) {
                            load(krate, &f, child_path, test_child);
                        }
                        i += 3;
                    }
                    Some(Tok::Punct('{')) => {
                        let close = matching(toks, i + 2);
                        krate
                            .modules
                            .entry(path.to_vec())
                            .or_default()
                            .children
                            .insert(child.clone(), child_path.clone());
                        krate.modules.entry(child_path.clone()).or_default().file = rel(file);
                        walk_mods(
                            krate,
                            file,
                            &toks[i + 3..close],
                            &child_path,
                            &base.join(&child),
                            test_child,
                        );
                        i = close + 1;
                    }
                    _ => i += 1,
                }
                attrs.clear();
                continue;
            }
            Tok::Punct(';') if depth == 0 => attrs.clear(),
            _ => {}
        }
        if !matches!(toks[i].0, Tok::Ident(_)) || depth != 0 {
            // keep attributes across `pub`, `pub(crate)` and the like
        }
        if matches!(toks[i].0, Tok::Punct('{') | Tok::Punct('}')) {
            attrs.clear();
        }
        i += 1;
    }
}

/// The index just past an attribute starting at `#`.
fn attr_end(toks: &[(Tok, usize)], i: usize) -> usize {
    let mut j = i + 1;
    if toks.get(j).map(|t| &t.0) == Some(&Tok::Punct('!')) {
        j += 1;
    }
    if toks.get(j).map(|t| &t.0) == Some(&Tok::Punct('[')) {
        matching(toks, j) + 1
    } else {
        i + 1
    }
}

/// An attribute's tokens as compact text: `cfg(test)`, `path="x.rs"`.
fn attr_text(toks: &[(Tok, usize)]) -> String {
    let mut s = String::new();
    for (t, _) in toks
        .iter()
        .skip_while(|(t, _)| *t != Tok::Punct('['))
        .skip(1)
    {
        match t {
            Tok::Ident(w) => s.push_str(w),
            Tok::Path => s.push_str("::"),
            Tok::Punct(c) => s.push(*c),
            Tok::Str(v) => s.push_str(&format!("\"{v}\"")),
        }
    }
    s.pop(); // the closing ]
    s
}

/// The index of the bracket closing the one at `open`.
fn matching(toks: &[(Tok, usize)], open: usize) -> usize {
    let (o, c) = match toks[open].0 {
        Tok::Punct('{') => ('{', '}'),
        Tok::Punct('[') => ('[', ']'),
        Tok::Punct('(') => ('(', ')'),
        _ => return open,
    };
    let mut depth = 0;
    for (j, (t, _)) in toks.iter().enumerate().skip(open) {
        if *t == Tok::Punct(o) {
            depth += 1;
        } else if *t == Tok::Punct(c) {
            depth -= 1;
            if depth == 0 {
                return j;
            }
        }
    }
    toks.len() - 1
}

// ---------------------------------------------------------------- edges --

impl Crate {
    fn read() -> Crate {
        let mut krate = Crate {
            modules: BTreeMap::new(),
            test_files: BTreeSet::new(),
        };
        // Each binary is its own crate; its `crate::` is its `<bin…>` module.
        for (file, module) in spec().roots {
            let path = if module.is_empty() {
                vec![]
            } else {
                vec![module.to_string()]
            };
            load(&mut krate, &src_dir().join(file), path, false);
        }
        for dir in spec().root_dirs {
            let mut roots: Vec<PathBuf> = fs::read_dir(src_dir().join(dir))
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "rs"))
                .collect();
            roots.sort();
            for file in roots {
                let stem = file.file_stem().unwrap().to_string_lossy();
                load(&mut krate, &file, vec![format!("<{stem}>")], false);
            }
        }
        krate
    }

    fn file_of(&self, path: &[String]) -> Option<&str> {
        self.modules.get(path).map(|m| m.file.as_str())
    }

    fn is_module(&self, path: &[String]) -> bool {
        self.modules.contains_key(path)
    }

    /// The file a path (already made absolute) names: the deepest module it
    /// walks through, the file of the item it ends in.
    fn resolve(&self, abs: &[String]) -> Option<String> {
        let mut m: Vec<String> = Vec::new();
        if let Some(bin) = abs.first().filter(|f| f.starts_with('<')) {
            m.push(bin.clone());
        }
        let start = m.len();
        for seg in &abs[start..] {
            let mut next = m.clone();
            next.push(seg.clone());
            if self.is_module(&next) {
                m = next;
            } else {
                break;
            }
        }
        self.file_of(&m).map(str::to_string)
    }

    /// Every module path whose file is `file`, with its tokens' range in
    /// the file (inline modules nest).
    fn modules_in(&self, file: &str) -> Vec<Vec<String>> {
        self.modules
            .iter()
            .filter(|(_, m)| m.file == file)
            .map(|(p, _)| p.clone())
            .collect()
    }
}

/// What a file's paths resolve against: the crate, the file's crate root
/// (`<bin…>` or the library's) and the modules it imported by name.
struct Names<'a> {
    krate: &'a Crate,
    root: Vec<String>,
    /// Names this file imports, by the module they resolve to (for paths
    /// that start with an imported module's name, e.g. `state::Record`).
    aliases: BTreeMap<String, Vec<String>>,
}

impl Names<'_> {
    /// The absolute module path of `segs`, named in module `cur`: through
    /// `crate`, the crate's name, `self` or `super`, a child module, or an
    /// imported name; None for std and external crates.
    fn absolute(&self, cur: &[String], segs: &[String]) -> Option<Vec<String>> {
        let first = segs.first()?;
        let mut base = match first.as_str() {
            "crate" => self.root.clone(),
            name if name == spec().name => vec![],
            "self" => cur.to_vec(),
            "super" => {
                let mut p = cur.to_vec();
                p.pop();
                p
            }
            _ => {
                let mut m = child_module(self.krate, cur, first)
                    .or_else(|| self.aliases.get(first).cloned())?;
                m.extend(segs[1..].iter().cloned());
                return Some(m);
            }
        };
        let mut rest = &segs[1..];
        // super::super::x
        while rest.first().map(String::as_str) == Some("super") {
            base.pop();
            rest = &rest[1..];
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// Records what a `use` binds: an imported module's name, or a glob's
    /// child modules, become names here.
    fn import(&mut self, abs: &[String], alias: Option<&str>) {
        match alias {
            Some("*") if self.krate.is_module(abs) => {
                for (n, p) in &self.krate.modules[abs].children {
                    self.aliases.insert(n.clone(), p.clone());
                }
            }
            Some(a) if a != "*" && a != "_" && self.krate.is_module(abs) => {
                self.aliases.insert(a.to_string(), abs.to_vec());
            }
            _ => {}
        }
    }
}

/// The path starting at `toks[i]` (ident (:: ident)*), and the index past it.
fn path_at(toks: &[(Tok, usize)], i: usize) -> (Vec<String>, usize) {
    let mut segs = Vec::new();
    if let Tok::Ident(w) = &toks[i].0 {
        segs.push(w.clone());
    }
    let mut j = i + 1;
    while toks.get(j).map(|t| &t.0) == Some(&Tok::Path) {
        match toks.get(j + 1).map(|t| &t.0) {
            Some(Tok::Ident(s)) => {
                segs.push(s.clone());
                j += 2;
            }
            _ => break,
        }
    }
    (segs, j)
}

/// The files `file` names, each with where (line, the path). Inline
/// `mod x {` blocks are tracked, so that `self` and `super` inside them
/// mean what they mean.
fn edges_of(krate: &Crate, file: &str) -> BTreeMap<String, Vec<(usize, String)>> {
    let src = fs::read_to_string(src_dir().join(file)).unwrap();
    let toks = tokens(&src);
    let mut outer: Vec<Vec<String>> = krate.modules_in(file);
    outer.sort_by_key(Vec::len);
    let outer = outer.first().cloned().unwrap_or_default();
    let mut names = Names {
        krate,
        root: outer
            .first()
            .filter(|f| f.starts_with('<'))
            .map(|b| vec![b.clone()])
            .unwrap_or_default(),
        aliases: BTreeMap::new(),
    };
    let mut found: Vec<(usize, Vec<String>)> = Vec::new();

    // Pass over the tokens, tracking inline modules.
    let mut stack: Vec<(usize, Vec<String>)> = vec![(usize::MAX, outer.clone())];
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() {
        let cur = stack.last().unwrap().1.clone();
        match &toks[i].0 {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth -= 1;
                if stack.last().unwrap().0 == depth {
                    stack.pop();
                }
            }
            Tok::Ident(w) if w == "mod" => {
                if let (Some((Tok::Ident(name), _)), Some((Tok::Punct('{'), _))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    let mut p = cur.clone();
                    p.push(name.clone());
                    stack.push((depth, p));
                    depth += 1;
                    i += 3;
                    continue;
                }
            }
            Tok::Ident(w) if w == "use" => {
                let end = (i..toks.len())
                    .find(|&j| toks[j].0 == Tok::Punct(';'))
                    .unwrap_or(toks.len());
                let mut leaves = Vec::new();
                use_tree(&toks[i + 1..end], &[], &mut leaves);
                for (path, alias) in leaves {
                    let Some(abs) = names.absolute(&cur, &path) else {
                        continue; // std, an external crate
                    };
                    names.import(&abs, alias.as_deref());
                    found.push((toks[i].1, abs));
                }
                i = end + 1;
                continue;
            }
            // A path: ident (:: ident)*, not preceded by `::`.
            Tok::Ident(_)
                if (i == 0 || toks[i - 1].0 != Tok::Path)
                    && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path) =>
            {
                let (segs, j) = path_at(&toks, i);
                if let Some(abs) = names.absolute(&cur, &segs) {
                    found.push((toks[i].1, abs));
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }

    let mut edges: BTreeMap<String, Vec<(usize, String)>> = BTreeMap::new();
    for (line, abs) in found {
        if let Some(to) = krate.resolve(&abs) {
            if to != file && to.ends_with(".rs") {
                edges.entry(to).or_default().push((line, abs.join("::")));
            }
        }
    }
    edges
}

/// A child module `name` of `cur`, if declared.
fn child_module(krate: &Crate, cur: &[String], name: &str) -> Option<Vec<String>> {
    let mut p = cur.to_vec();
    p.push(name.to_string());
    krate.is_module(&p).then_some(p)
}

/// Flattens a use tree into (path, Some(name it binds) or Some("*")).
fn use_tree(
    toks: &[(Tok, usize)],
    prefix: &[String],
    out: &mut Vec<(Vec<String>, Option<String>)>,
) {
    let mut path = prefix.to_vec();
    let mut i = 0;
    // a leading `::` (2015-style absolute) or `pub` is not a segment
    while i < toks.len() {
        match &toks[i].0 {
            Tok::Ident(w) if w == "as" => {
                if let Some((Tok::Ident(a), _)) = toks.get(i + 1) {
                    out.push((path.clone(), Some(a.clone())));
                }
                return;
            }
            Tok::Ident(w) => path.push(w.clone()),
            Tok::Path => {}
            Tok::Punct('*') => {
                out.push((path.clone(), Some("*".into())));
                return;
            }
            Tok::Punct('{') => {
                let close = matching(toks, i);
                let inner = &toks[i + 1..close];
                let mut start = 0;
                let mut depth = 0;
                for (k, (t, _)) in inner.iter().enumerate() {
                    match t {
                        Tok::Punct('{') => depth += 1,
                        Tok::Punct('}') => depth -= 1,
                        Tok::Punct(',') if depth == 0 => {
                            use_tree(&inner[start..k], &path, out);
                            start = k + 1;
                        }
                        _ => {}
                    }
                }
                if start < inner.len() {
                    use_tree(&inner[start..], &path, out);
                }
                return;
            }
            _ => {}
        }
        i += 1;
    }
    if path.last().map(String::as_str) == Some("self") {
        path.pop();
    }
    if path.len() > prefix.len() || !path.is_empty() {
        let name = path.last().cloned();
        out.push((path, name));
    }
}

// ---------------------------------------------------------------- lines --

/// Lines of code outside `#[cfg(test)]` items: not blank, not only a comment.
fn code_lines(src: &str) -> usize {
    let toks = tokens(src);
    let mut test_lines: BTreeSet<usize> = BTreeSet::new();
    let mut i = 0;
    while i < toks.len() {
        if toks[i].0 == Tok::Punct('#') {
            let end = attr_end(&toks, i);
            let text = attr_text(&toks[i..end]);
            if text.starts_with("cfg(test") {
                // The item runs to its `;` or its closing brace.
                let first = toks[i].1;
                let mut j = end;
                let mut last = first;
                while j < toks.len() {
                    match toks[j].0 {
                        Tok::Punct(';') => {
                            last = toks[j].1;
                            break;
                        }
                        Tok::Punct('{') => {
                            let c = matching(&toks, j);
                            last = toks[c].1;
                            break;
                        }
                        _ => j += 1,
                    }
                }
                test_lines.extend(first..=last);
            }
            i = end;
            continue;
        }
        i += 1;
    }
    // A line counts when a token starts on it outside a test item.
    let mut code: BTreeSet<usize> = BTreeSet::new();
    for (_, line) in &toks {
        if !test_lines.contains(line) {
            code.insert(*line);
        }
    }
    code.len()
}

// ---------------------------------------------------------------- checks --

fn all_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            all_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every file's edges, from a fresh read of src/.
fn graph() -> (Crate, Graph) {
    let krate = Crate::read();
    let files: BTreeSet<String> = krate
        .modules
        .values()
        .map(|m| m.file.clone())
        .filter(|f| !f.starts_with('/') && !f.starts_with(".."))
        .collect();
    let g = files
        .iter()
        .map(|f| (f.clone(), edges_of(&krate, f)))
        .collect();
    (krate, g)
}

/// The strongly connected components with more than one file (Tarjan).
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        if let Some(es) = t.g.get(v) {
            for w in es.keys() {
                let w = w.as_str();
                if !t.g.contains_key(w) {
                    continue;
                }
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let l = t.low[v].min(t.low[w]);
                    t.low.insert(v, l);
                } else if t.on.contains(w) {
                    let l = t.low[v].min(t.index[w]);
                    t.low.insert(v, l);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: vec![],
        on: BTreeSet::new(),
        next: 0,
        out: vec![],
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// The import cycles of the crate being read, in words.
fn cycle_report() -> String {
    let (_, g) = graph();
    let mut report = String::new();
    for comp in &cycles(&g) {
        report.push_str(&format!(
            "{}: a cycle among {} files: {}\n",
            spec().dir,
            comp.len(),
            comp.join(", ")
        ));
        for a in comp {
            for (b, uses) in &g[a] {
                if comp.contains(b) {
                    let (line, path) = &uses[0];
                    report.push_str(&format!("  {a}:{line} -> {b} ({path})\n"));
                }
            }
        }
    }
    report
}

#[test]
fn no_file_imports_in_a_circle() {
    let report: String = CRATES.iter().map(|c| in_crate(c, cycle_report)).collect();
    assert!(report.is_empty(), "import cycles:\n{report}");
}

#[test]
fn layers_use_only_what_is_below_them() {
    print_map();
    let (krate, g) = graph();
    let mut report = String::new();
    for (from, es) in &g {
        if krate.test_files.contains(from) && from.ends_with("tests.rs") {
            // A test file sits with the module it tests.
        }
        let Some((lf, gf)) = place(from) else {
            report.push_str(&format!("{from} is in no layer: add it to LAYERS (tests/layers.rs), lib.rs and the README\n"));
            continue;
        };
        for (to, uses) in es {
            let Some((lt, gt)) = place(to) else { continue };
            let ok = lt < lf || gf == gt || lt == lf && same_layer_allowed(lf, &gf, &gt);
            if !ok {
                let (line, path) = &uses[0];
                report.push_str(&format!(
                    "{from}:{line} ({}) names {to} ({}): {path}\n",
                    LAYERS[lf].0, LAYERS[lt].0
                ));
            }
        }
    }
    assert!(report.is_empty(), "layering broken:\n{report}");
}

/// Every source file of the crate being read, but for those in a directory
/// that is another crate's (`fuzz/tests` inside `fuzz`).
fn crate_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    all_files(&src_dir(), &mut files);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let others: Vec<PathBuf> = CRATES
        .iter()
        .filter(|c| c.dir != spec().dir)
        .map(|c| root.join(c.dir))
        .filter(|d| d.starts_with(src_dir()))
        .collect();
    files.retain(|f| !others.iter().any(|d| f.starts_with(d)));
    files
}

#[test]
fn no_file_past_800_lines_of_code() {
    let mut over = Vec::new();
    for c in CRATES.iter().filter(|c| !c.tests) {
        in_crate(c, || {
            for f in crate_files() {
                let n = code_lines(&fs::read_to_string(&f).unwrap());
                if n > MAX_CODE_LINES {
                    over.push(format!(
                        "{}/{}: {n} lines of code outside tests",
                        spec().dir,
                        rel(&f)
                    ));
                }
            }
        });
    }
    assert!(
        over.is_empty(),
        "files past {MAX_CODE_LINES} lines of code:\n{}",
        over.join("\n")
    );
}

#[test]
fn no_too_many_arguments_allowance() {
    let mut found = Vec::new();
    for c in CRATES {
        let mut files = in_crate(c, crate_files);
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join(c.manifest);
        files.push(manifest);
        // This file names the lint it looks for.
        files.retain(|f| !f.ends_with(file!()));
        for f in files {
            if fs::read_to_string(&f)
                .unwrap()
                .contains("too_many_arguments")
            {
                found.push(f.display().to_string());
            }
        }
    }
    assert!(
        found.is_empty(),
        "too_many_arguments allowed in: {found:?}; put the arguments in a struct"
    );
}

/// The checker itself, on small sources.
#[test]
fn the_tokenizer_skips_comments_and_strings() {
    let t = tokens("use a::b; // crate::x\n/* super::y */ let s = \"crate::z\"; let c = '\"'; 'l: loop {} r#\"crate::q\"#;");
    let idents: Vec<String> = t
        .iter()
        .filter_map(|(t, _)| {
            if let Tok::Ident(w) = t {
                Some(w.clone())
            } else {
                None
            }
        })
        .collect();
    assert!(
        !idents.contains(&"x".to_string())
            && !idents.contains(&"y".to_string())
            && !idents.contains(&"z".to_string())
            && !idents.contains(&"q".to_string()),
        "{idents:?}"
    );
    assert_eq!(
        code_lines("fn a() {}\n\n// c\n#[cfg(test)]\nmod tests {\n fn b() {}\n}\n"),
        1
    );
    let mut out = Vec::new();
    use_tree(
        &tokens("crate::a::{b, c::{self, d as e}, f::*}"),
        &[],
        &mut out,
    );
    let paths: Vec<String> = out
        .iter()
        .map(|(p, a)| format!("{}={}", p.join("::"), a.clone().unwrap_or_default()))
        .collect();
    assert_eq!(
        paths,
        [
            "crate::a::b=b",
            "crate::a::c=c",
            "crate::a::c::d=e",
            "crate::a::f=*"
        ]
    );
}

/// A crate in `dir` (leaked: specs live for the whole run).
fn planted(
    dir: &Path,
    roots: &'static [(&'static str, &'static str)],
    tests: bool,
) -> &'static Spec {
    Box::leak(Box::new(Spec {
        name: "planted",
        dir: Box::leak(dir.to_string_lossy().into_owned().into_boxed_str()),
        roots,
        root_dirs: if tests { &[""] } else { &[] },
        tests,
        manifest: "Cargo.toml",
    }))
}

/// The cycle check itself fails on a cycle: two files of a library that
/// name each other, and a test file and its helper module that do.
#[test]
fn a_planted_cycle_is_found() {
    let lib = tempfile::tempdir().unwrap();
    let put = |dir: &Path, file: &str, text: &str| {
        fs::create_dir_all(dir.join(file).parent().unwrap()).unwrap();
        fs::write(dir.join(file), text).unwrap();
    };
    put(lib.path(), "lib.rs", "mod a;\nmod b;\n");
    put(lib.path(), "a.rs", "use crate::b::B;\npub struct A(B);\n");
    put(
        lib.path(),
        "b.rs",
        "pub struct B;\nfn f(_: super::a::A) {}\n",
    );
    let report = in_crate(planted(lib.path(), &[("lib.rs", "")], false), cycle_report);
    assert!(
        report.contains("a cycle among 2 files: a.rs, b.rs"),
        "{report}"
    );

    let tests = tempfile::tempdir().unwrap();
    put(
        tests.path(),
        "t.rs",
        "mod support;\nuse support::S;\npub struct T(S);\n",
    );
    put(
        tests.path(),
        "support/mod.rs",
        "pub struct S;\nfn f(_: crate::T) {}\n",
    );
    put(tests.path(), "u.rs", "mod support;\n");
    let report = in_crate(planted(tests.path(), &[], true), cycle_report);
    assert!(
        report.contains("a cycle among 2 files: support/mod.rs, t.rs"),
        "{report}"
    );
    // Without the edge back, no cycle.
    put(tests.path(), "support/mod.rs", "pub struct S;\n");
    assert_eq!(in_crate(planted(tests.path(), &[], true), cycle_report), "");
}

/// Prints every crate's graph, file by file, when `CRUST_LAYERS_MAP` is set
/// (`CRUST_LAYERS_MAP=1 cargo test --test layers layers_use -- --nocapture`).
fn print_map() {
    if std::env::var_os("CRUST_LAYERS_MAP").is_none() {
        return;
    }
    for c in CRATES {
        in_crate(c, || {
            let (_, g) = graph();
            for (f, es) in &g {
                let lines = code_lines(&fs::read_to_string(src_dir().join(f)).unwrap());
                println!(
                    "{}/{f} ({lines}): {}",
                    c.dir,
                    es.keys().cloned().collect::<Vec<_>>().join(" ")
                );
            }
        });
    }
}

/// The agent's one public API is `embed`: every other module of the crate's
/// root is `#[doc(hidden)]`, the way in for its binary, tests and bench.
#[test]
fn only_embed_is_documented_as_api() {
    let lib = fs::read_to_string(src_dir().join("lib.rs")).unwrap();
    let lines: Vec<&str> = lib.lines().map(str::trim).collect();
    let mut public = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(name) = l.strip_prefix("pub mod ").and_then(|r| r.strip_suffix(';')) else {
            continue;
        };
        let attrs = lines[..i].iter().rev().take_while(|a| a.starts_with("#["));
        if !attrs.into_iter().any(|a| *a == "#[doc(hidden)]") {
            public.push(name);
        }
    }
    assert_eq!(public, ["embed"], "modules documented as the crate's API");
}
