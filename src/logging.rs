//! The agent's log: one line per event on stderr (the console in a guest),
//! as text or JSON, through slog. No terminal or serde machinery: the agent
//! stays small, and a line is written with a single write so threads do not
//! interleave. Values often come from clients (volume ids, paths, error
//! texts quoting them): control and line-breaking characters are escaped in
//! both formats, so a value cannot start a line of its own, and each message
//! and value is cut at [`MAX_FIELD`] bytes, so one request cannot write a
//! megabyte to the console.

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use slog::{Drain, Level, Never, OwnedKVList, Record, KV};

/// How lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `2026-11-22T03:49:16.123Z INFO message key=value …`
    Text,
    /// `{"ts":"…","level":"INFO","msg":"…","key":"value",…}`
    Json,
}

impl Format {
    /// Parses "text" or "json".
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "text" => Some(Format::Text),
            "json" => Some(Format::Json),
            _ => None,
        }
    }
}

/// Parses a level name as the flags and kernel command line give it.
pub fn parse_level(s: &str) -> Option<Level> {
    match s {
        "error" => Some(Level::Error),
        "warn" | "warning" => Some(Level::Warning),
        "info" => Some(Level::Info),
        "debug" => Some(Level::Debug),
        "trace" => Some(Level::Trace),
        _ => None,
    }
}

/// A drain writing whole lines to stderr.
pub struct StderrDrain {
    format: Format,
    level: Level,
}

/// Builds the root logger.
pub fn logger(format: Format, level: Level) -> slog::Logger {
    slog::Logger::root(StderrDrain { format, level }.fuse(), slog::o!())
}

/// A logger that drops everything, for tests and library callers.
pub fn discard() -> slog::Logger {
    slog::Logger::root(slog::Discard, slog::o!())
}

impl Drain for StderrDrain {
    type Ok = ();
    type Err = Never;

    fn log(&self, record: &Record, values: &OwnedKVList) -> Result<(), Never> {
        if !record.level().is_at_least(self.level) {
            return Ok(());
        }
        let line = format_line(self.format, &timestamp(SystemTime::now()), record, values);
        // A failed write to the console cannot be reported anywhere; dropping it is all there is.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        Ok(())
    }
}

/// The most bytes of one message or value written; the rest is cut, and
/// the cut says how many bytes it left out.
pub const MAX_FIELD: usize = 1024;

/// `s`, cut at [`MAX_FIELD`] bytes (on a character boundary) with a note.
fn capped(s: &str) -> Cow<'_, str> {
    if s.len() <= MAX_FIELD {
        return Cow::Borrowed(s);
    }
    let mut end = MAX_FIELD;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}…[{} more bytes]", &s[..end], s.len() - end))
}

/// Characters that would break a line or mislead its reader: controls
/// (C0, DEL, C1), the Unicode line and paragraph separators, and the
/// bidirectional overrides that reorder what a terminal shows.
fn hazardous(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Text format: backslash escapes for hazards and backslashes; quotes too
/// when `quoted` (inside a quoted value).
fn text_escape(out: &mut String, s: &str, quoted: bool) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' if quoted => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\0' => out.push_str("\\0"),
            c if hazardous(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
}

/// Whether a text-format value needs quotes to read back as one value.
fn needs_quotes(v: &str) -> bool {
    v.is_empty()
        || v.chars()
            .any(|c| matches!(c, ' ' | '"' | '=' | '\\') || hazardous(c))
}

fn format_line(format: Format, ts: &str, record: &Record, values: &OwnedKVList) -> String {
    // slog hands key-values over last-first; collect and reverse so lines read as written.
    let mut rec = Pairs(Vec::new());
    let _ = record.kv().serialize(record, &mut rec);
    rec.0.reverse();
    let mut ctx = Pairs(Vec::new());
    let _ = values.serialize(record, &mut ctx);
    ctx.0.reverse();
    let level = level_name(record.level());
    let msg = record.msg().to_string();
    let mut out = String::new();
    match format {
        Format::Text => {
            let _ = write!(out, "{ts} {level} ");
            text_escape(&mut out, &capped(&msg), false);
            for (k, v) in rec.0.iter().chain(ctx.0.iter()) {
                out.push(' ');
                text_escape(&mut out, &capped(k), false);
                out.push('=');
                let v = capped(v);
                if needs_quotes(&v) {
                    out.push('"');
                    text_escape(&mut out, &v, true);
                    out.push('"');
                } else {
                    out.push_str(&v);
                }
            }
        }
        Format::Json => {
            out.push_str("{\"ts\":\"");
            json_escape(&mut out, ts);
            let _ = write!(out, "\",\"level\":\"{level}\",\"msg\":\"");
            json_escape(&mut out, &capped(&msg));
            out.push('"');
            for (k, v) in rec.0.iter().chain(ctx.0.iter()) {
                out.push_str(",\"");
                json_escape(&mut out, &capped(k));
                out.push_str("\":\"");
                json_escape(&mut out, &capped(v));
                out.push('"');
            }
            out.push('}');
        }
    }
    out.push('\n');
    out
}

fn level_name(l: Level) -> &'static str {
    match l {
        Level::Critical => "CRIT",
        Level::Error => "ERROR",
        Level::Warning => "WARN",
        Level::Info => "INFO",
        Level::Debug => "DEBUG",
        Level::Trace => "TRACE",
    }
}

/// Key-value pairs of one line, as strings.
struct Pairs(Vec<(String, String)>);

impl slog::Serializer for Pairs {
    fn emit_arguments(&mut self, key: slog::Key, val: &fmt::Arguments) -> slog::Result {
        self.0.push((key.to_string(), val.to_string()));
        Ok(())
    }
}

fn json_escape(out: &mut String, s: &str) {
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if hazardous(c) => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
}

/// RFC 3339 UTC with milliseconds, computed without a date library
/// (days-from-civil inverse, Howard Hinnant's algorithm).
pub fn timestamp(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps() {
        let at = |s: u64, ms: u64| timestamp(UNIX_EPOCH + Duration::from_millis(s * 1000 + ms));
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400, 5), "2000-02-29T00:00:00.005Z");
        assert_eq!(at(1_795_319_356, 123), "2026-11-22T03:49:16.123Z");
        assert_eq!(at(4_102_444_799, 999), "2099-12-31T23:59:59.999Z");
    }

    #[test]
    fn levels_and_formats() {
        assert_eq!(parse_level("debug"), Some(Level::Debug));
        assert_eq!(parse_level("warn"), Some(Level::Warning));
        assert_eq!(parse_level("loud"), None);
        assert_eq!(Format::parse("json"), Some(Format::Json));
        assert_eq!(Format::parse("yaml"), None);
    }

    #[test]
    fn lines_in_both_formats() {
        let kv = slog::o!("method" => "PublishVolume", "volume" => "vol 1", "code" => "OK");
        let values = OwnedKVList::from(kv);
        let msg = "request \"done\"";
        let text = format_record(Format::Text, Level::Info, msg, &values);
        assert_eq!(
            text,
            "T INFO request \"done\" method=PublishVolume volume=\"vol 1\" code=OK\n"
        );
        let json = format_record(Format::Json, Level::Info, msg, &values);
        assert_eq!(
            json,
            "{\"ts\":\"T\",\"level\":\"INFO\",\"msg\":\"request \\\"done\\\"\",\"method\":\"PublishVolume\",\"volume\":\"vol 1\",\"code\":\"OK\"}\n"
        );
    }

    /// A record of `level` saying `msg` with `values`, as `format` at time "T".
    fn format_record(format: Format, level: Level, msg: &str, values: &OwnedKVList) -> String {
        let rs = slog::RecordStatic {
            location: &slog::RecordLocation {
                file: "",
                line: 0,
                column: 0,
                function: "",
                module: "",
            },
            tag: "",
            level,
        };
        let args = format_args!("{}", msg);
        let rec = Record::new(&rs, &args, slog::b!());
        format_line(format, "T", &rec, values)
    }

    fn line(format: Format, msg: &str, volume: &str) -> String {
        let values = OwnedKVList::from(slog::o!("volume" => volume.to_string()));
        format_record(format, Level::Warning, msg, &values)
    }

    #[test]
    fn values_cannot_forge_lines() {
        let evil = "v\n2026-11-22T00:00:00.000Z INFO forged code=OK\r\0\u{1b}[2J\u{7f}\u{85}\u{2028}\u{202e}";
        for format in [Format::Text, Format::Json] {
            let l = line(format, evil, evil);
            // One line, and nothing in it a terminal would act on.
            assert_eq!(l.matches('\n').count(), 1, "{l}");
            assert!(l.ends_with('\n'));
            assert!(!l.trim_end_matches('\n').chars().any(hazardous), "{l:?}");
        }
        assert_eq!(
            line(Format::Text, "m", "a\nb\0c"),
            "T WARN m volume=\"a\\nb\\0c\"\n"
        );
        assert_eq!(line(Format::Text, "a\nb", "v"), "T WARN a\\nb volume=v\n");
        assert_eq!(
            line(Format::Text, "m", "back\\slash \"q\""),
            "T WARN m volume=\"back\\\\slash \\\"q\\\"\"\n"
        );
        assert_eq!(
            line(Format::Json, "m", "a\u{85}\u{2028}"),
            "{\"ts\":\"T\",\"level\":\"WARN\",\"msg\":\"m\",\"volume\":\"a\\u0085\\u2028\"}\n"
        );
    }

    #[test]
    fn long_values_and_messages_are_cut_and_say_so() {
        let big = "x".repeat(4 << 20);
        for format in [Format::Text, Format::Json] {
            let l = line(format, &big, &big);
            assert!(l.len() < 3 * MAX_FIELD, "{} bytes", l.len());
            assert!(
                l.contains(&format!("…[{} more bytes]", (4 << 20) - MAX_FIELD)),
                "{l}"
            );
        }
        // Cut on a character boundary.
        let wide = "é".repeat(MAX_FIELD);
        let c = capped(&wide);
        assert!(c.starts_with(&"é".repeat(MAX_FIELD / 2)));
        assert!(c.ends_with(&format!("…[{} more bytes]", 2 * MAX_FIELD - MAX_FIELD)));
        assert_eq!(capped("short"), "short");
    }
}
