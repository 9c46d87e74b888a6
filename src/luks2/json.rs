//! A bounded JSON reader for the LUKS2 JSON area, and the base64 its salts
//! and digests are written in (read, and written for a new header). The area is the disk's, so untrusted: the
//! reader holds nesting to [`MAX_DEPTH`] and the values it builds to
//! [`MAX_VALUES`] (what it keeps is then bounded too, whatever the area's
//! size), refuses duplicate keys (cryptsetup never writes them, and two
//! readers could pick different ones) and anything after the value, and
//! answers integers as integers. Why not serde_json: see the module doc.

/// How deep arrays and objects may nest (json-c's default, which cryptsetup reads with).
pub const MAX_DEPTH: usize = 32;

/// How many values (of any kind, keys not counted) one area may hold. A
/// header cryptsetup writes holds a few hundred; tokens add a few each.
pub const MAX_VALUES: usize = 1 << 16;

/// A JSON value. Numbers keep only what LUKS2 reads: an integer that fits
/// an `i64`, or that it was some other number.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    /// An integer in `i64`'s range.
    Int(i64),
    /// A fraction, an exponent or an integer out of range.
    OtherNumber,
    Str(String),
    Array(Vec<Value>),
    /// Members in the order written; keys are unique.
    Object(Vec<(String, Value)>),
}

impl Value {
    /// The member `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Object(members) => members.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// What kind of value this is, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Int(_) | Value::OtherNumber => "a number",
            Value::Str(_) => "a string",
            Value::Array(_) => "an array",
            Value::Object(_) => "an object",
        }
    }
}

/// Parses one JSON value filling `text` (whitespace around it allowed).
/// The error says what is wrong and at which byte.
pub fn parse(text: &[u8]) -> Result<Value, String> {
    let mut p = Parser {
        s: text,
        pos: 0,
        values: 0,
    };
    let v = p.value(0)?;
    p.space();
    if p.pos != text.len() {
        return Err(p.err("data after the JSON value"));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    pos: usize,
    values: usize,
}

impl Parser<'_> {
    fn err(&self, what: &str) -> String {
        format!("{what} at byte {} of the JSON area", self.pos)
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn bump(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Some(b)
    }

    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn expect(&mut self, word: &[u8]) -> Result<(), String> {
        if self.s.get(self.pos..).is_some_and(|r| r.starts_with(word)) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.err("an unknown word"))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, String> {
        self.values += 1;
        if self.values > MAX_VALUES {
            return Err(self.err(&format!("more than {MAX_VALUES} values")));
        }
        self.space();
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().map(Value::Str),
            Some(b't') => self.expect(b"true").map(|()| Value::Bool(true)),
            Some(b'f') => self.expect(b"false").map(|()| Value::Bool(false)),
            Some(b'n') => self.expect(b"null").map(|()| Value::Null),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.err("an unexpected byte")),
            None => Err(self.err("the end of the text where a value was due")),
        }
    }

    fn nest(&mut self, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err(self.err(&format!("nesting deeper than {MAX_DEPTH}")));
        }
        self.pos += 1;
        Ok(())
    }

    fn object(&mut self, depth: usize) -> Result<Value, String> {
        self.nest(depth)?;
        let mut members: Vec<(String, Value)> = Vec::new();
        self.space();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Object(members));
        }
        loop {
            self.space();
            if self.peek() != Some(b'"') {
                return Err(self.err("an object key that is not a string"));
            }
            let key = self.string()?;
            if members.iter().any(|(k, _)| *k == key) {
                return Err(self.err(&format!("the key {key:?} twice in one object")));
            }
            self.space();
            if self.bump() != Some(b':') {
                return Err(self.err("a key without ':'"));
            }
            let v = self.value(depth)?;
            members.push((key, v));
            self.space();
            match self.bump() {
                Some(b',') => {}
                Some(b'}') => return Ok(Value::Object(members)),
                _ => return Err(self.err("an object not closed by '}'")),
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, String> {
        self.nest(depth)?;
        let mut items = Vec::new();
        self.space();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.value(depth)?);
            self.space();
            match self.bump() {
                Some(b',') => {}
                Some(b']') => return Ok(Value::Array(items)),
                _ => return Err(self.err("an array not closed by ']'")),
            }
        }
    }

    fn number(&mut self) -> Result<Value, String> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        let digits = |p: &mut Self| {
            let from = p.pos;
            while matches!(p.peek(), Some(b'0'..=b'9')) {
                p.pos += 1;
            }
            p.pos - from
        };
        let int_start = self.pos;
        let n = digits(self);
        if n == 0 || (n > 1 && self.s.get(int_start) == Some(&b'0')) {
            return Err(self.err("a malformed number"));
        }
        let mut integer = true;
        if self.peek() == Some(b'.') {
            self.pos += 1;
            integer = false;
            if digits(self) == 0 {
                return Err(self.err("a malformed number"));
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            integer = false;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if digits(self) == 0 {
                return Err(self.err("a malformed number"));
            }
        }
        let text = std::str::from_utf8(&self.s[start..self.pos]).unwrap_or("x");
        Ok(match (integer, text.parse::<i64>()) {
            (true, Ok(i)) => Value::Int(i),
            _ => Value::OtherNumber,
        })
    }

    fn hex4(&mut self) -> Result<u32, String> {
        let mut v = 0u32;
        for _ in 0..4 {
            let d = self
                .bump()
                .and_then(|b| char::from(b).to_digit(16))
                .ok_or_else(|| self.err("a malformed \\u escape"))?;
            v = v << 4 | d;
        }
        Ok(v)
    }

    fn string(&mut self) -> Result<String, String> {
        self.pos += 1; // the opening quote
        let mut out = Vec::new();
        loop {
            let start = self.pos;
            while matches!(self.peek(), Some(b) if b != b'"' && b != b'\\' && b >= 0x20) {
                self.pos += 1;
            }
            out.extend_from_slice(&self.s[start..self.pos]);
            match self.bump() {
                Some(b'"') => break,
                Some(b'\\') => {}
                Some(_) => return Err(self.err("a control character in a string")),
                None => return Err(self.err("a string not closed")),
            }
            let c = match self.bump() {
                Some(b'"') => '"',
                Some(b'\\') => '\\',
                Some(b'/') => '/',
                Some(b'b') => '\u{8}',
                Some(b'f') => '\u{c}',
                Some(b'n') => '\n',
                Some(b'r') => '\r',
                Some(b't') => '\t',
                Some(b'u') => self.unicode()?,
                _ => return Err(self.err("an unknown escape")),
            };
            out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
        }
        String::from_utf8(out).map_err(|_| self.err("a string that is not UTF-8"))
    }

    /// The character of a `\u` escape (the `\u` read), a surrogate pair whole.
    fn unicode(&mut self) -> Result<char, String> {
        let hi = self.hex4()?;
        let code = if (0xd800..0xdc00).contains(&hi) {
            if self.bump() != Some(b'\\') || self.bump() != Some(b'u') {
                return Err(self.err("a lone surrogate"));
            }
            let lo = self.hex4()?;
            if !(0xdc00..0xe000).contains(&lo) {
                return Err(self.err("a lone surrogate"));
            }
            0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00)
        } else {
            hi
        };
        char::from_u32(code).ok_or_else(|| self.err("a lone surrogate"))
    }
}

/// Decodes standard base64 with padding, as cryptsetup writes salts and
/// digests. Refuses anything else, including bits left over in the last
/// character (two spellings of one value).
pub fn base64(text: &str) -> Option<Vec<u8>> {
    fn sextet(c: u8) -> Option<u32> {
        Some(u32::from(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        }))
    }
    let b = text.as_bytes();
    if !b.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(b.len() / 4 * 3);
    for (i, quad) in b.chunks(4).enumerate() {
        let last = i + 1 == b.len() / 4;
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut v = 0u32;
        for &c in &quad[..4 - pad] {
            v = v << 6 | sextet(c)?;
        }
        v <<= 6 * pad;
        let bytes = v.to_be_bytes();
        let keep = 3 - pad;
        if bytes[1 + keep..].iter().any(|&x| x != 0) {
            return None;
        }
        out.extend_from_slice(&bytes[1..1 + keep]);
    }
    Some(out)
}

/// Encodes `bytes` as standard base64 with padding, as cryptsetup writes
/// salts and digests: what [`base64`] reads back.
pub fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let mut three = [0u8; 3];
        three[..group.len()].copy_from_slice(group);
        let v = u32::from_be_bytes([0, three[0], three[1], three[2]]);
        for i in 0..4 {
            if i <= group.len() {
                let sextet = (v >> (18 - 6 * i)) & 63;
                out.push(char::from(ALPHABET[sextet as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_cryptsetup_writes() {
        let v =
            parse(br#" {"a":{"b":[1,"x\"\/\u00e9\ud83d\ude00",true,null,-7,1.5,1e3]},"c":{}} "#)
                .unwrap();
        let arr = v.get("a").and_then(|a| a.get("b")).unwrap();
        assert_eq!(
            *arr,
            Value::Array(vec![
                Value::Int(1),
                Value::Str("x\"/é😀".into()),
                Value::Bool(true),
                Value::Null,
                Value::Int(-7),
                Value::OtherNumber,
                Value::OtherNumber,
            ])
        );
        assert_eq!(v.get("c"), Some(&Value::Object(vec![])));
        assert_eq!(parse(b"99999999999999999999").unwrap(), Value::OtherNumber);
    }

    #[test]
    fn refuses_what_is_not_one_json_value() {
        for bad in [
            &b""[..],
            b"{",
            b"{\"a\":1,\"a\":2}",
            b"{\"a\":1} x",
            b"{\"a\":1}{}",
            b"[1,]",
            b"01",
            b"-",
            b"1.",
            b"\"\x01\"",
            b"\"\\ud800\"",
            b"\"\\q\"",
            b"\"\xff\"",
            b"{a:1}",
            b"tru",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn nesting_and_counts_are_bounded() {
        let deep = |n| [vec![b'['; n], vec![b']'; n]].concat();
        assert!(parse(&deep(MAX_DEPTH)).is_ok());
        let e = parse(&deep(MAX_DEPTH + 1)).unwrap_err();
        assert!(e.contains("nesting deeper than 32"), "{e}");
        // A deep text costs no stack beyond the bound.
        assert!(parse(&deep(1 << 20)).is_err());
        let many = format!("[{}0]", "0,".repeat(MAX_VALUES));
        let e = parse(many.as_bytes()).unwrap_err();
        assert!(e.contains("more than 65536 values"), "{e}");
    }

    #[test]
    fn base64_is_strict() {
        assert_eq!(base64("").unwrap(), b"");
        assert_eq!(base64("Zm9vYmFy").unwrap(), b"foobar");
        assert_eq!(base64("Zm9vYg==").unwrap(), b"foob");
        assert_eq!(base64("Zm9vYmE=").unwrap(), b"fooba");
        for bad in [
            "Zm9",
            "Zm9vYh==",
            "Zg=a",
            "Zg==Zg==",
            "Z===",
            "Zm9v YmFy",
            "Zm9\u{e9}",
        ] {
            assert!(base64(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn base64_encode_writes_what_base64_reads() {
        for (bytes, text) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foobar", "Zm9vYmFy"),
            (b"\xff\xfe\x00", "//4A"),
        ] {
            assert_eq!(base64_encode(bytes), text);
        }
        let all: Vec<u8> = (0..=255).collect();
        for n in 0..all.len() {
            assert_eq!(base64(&base64_encode(&all[..n])).unwrap(), &all[..n]);
        }
    }
}
