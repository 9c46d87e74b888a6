//! A request's ttrpc envelope (`Request`: service, method, payload,
//! deadline, metadata) read in place, for the shape nearly every client
//! writes: each of the first four fields at most once, no metadata, nothing
//! else. Such an envelope decodes to exactly what protobuf would decode it
//! to, without copying its names or building the message; any other shape
//! (metadata, unknown fields, repeated fields, long varints, names that are
//! not UTF-8, a truncated field) is left to protobuf, which also words the
//! refusal of a malformed one.

/// The fields of a plain envelope, borrowed from the frame.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Plain<'a> {
    /// `Request.service` (field 1).
    pub(crate) service: &'a str,
    /// `Request.method` (field 2).
    pub(crate) method: &'a str,
    /// `Request.payload` (field 3).
    pub(crate) payload: &'a [u8],
    /// `Request.timeout_nano` (field 4).
    pub(crate) timeout_nano: i64,
}

/// Field tags (number << 3 | wire type) of the plain fields.
const SERVICE: u8 = 1 << 3 | 2;
const METHOD: u8 = 2 << 3 | 2;
const PAYLOAD: u8 = 3 << 3 | 2;
const TIMEOUT: u8 = 4 << 3;

/// `body` read as a plain envelope; `None` when it is not one (protobuf
/// must decide what it is).
pub(crate) fn plain(body: &[u8]) -> Option<Plain<'_>> {
    let mut p = Plain {
        service: "",
        method: "",
        payload: &[],
        timeout_nano: 0,
    };
    let mut seen = 0u8;
    let mut rest = body;
    while let Some((&tag, after)) = rest.split_first() {
        // Each field once: a repeated one takes protobuf's last-wins rule.
        let bit = match tag {
            SERVICE => 1,
            METHOD => 2,
            PAYLOAD => 4,
            TIMEOUT => 8,
            _ => return None,
        };
        if seen & bit != 0 {
            return None;
        }
        seen |= bit;
        if tag == TIMEOUT {
            let (v, after) = varint(after, 9)?;
            p.timeout_nano = i64::from_ne_bytes(v.to_ne_bytes());
            rest = after;
            continue;
        }
        let (len, after) = varint(after, 4)?;
        let len = usize::try_from(len).ok()?;
        let field = after.get(..len)?;
        rest = &after[len..];
        match tag {
            SERVICE => p.service = std::str::from_utf8(field).ok()?,
            METHOD => p.method = std::str::from_utf8(field).ok()?,
            _ => p.payload = field,
        }
    }
    Some(p)
}

/// A varint of at most `most` bytes at the start of `b`, and what follows.
/// Within 9 bytes a varint's value is the same however it is read, so no
/// other reader can disagree about it.
fn varint(b: &[u8], most: usize) -> Option<(u64, &[u8])> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(most) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, &b[i + 1..]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crust_protocols::protobuf::Message;
    use crust_protocols::ttrpc;

    /// What protobuf makes of `body`, in the terms of a plain envelope, if
    /// it decodes it to one.
    fn by_protobuf(body: &[u8]) -> Option<(String, String, Vec<u8>, i64)> {
        let r = ttrpc::Request::parse_from_bytes(body).ok()?;
        Some((r.service, r.method, r.payload, r.timeout_nano))
    }

    fn agrees(body: &[u8]) -> bool {
        match plain(body) {
            None => true,
            Some(p) => {
                by_protobuf(body)
                    == Some((
                        p.service.to_string(),
                        p.method.to_string(),
                        p.payload.to_vec(),
                        p.timeout_nano,
                    ))
            }
        }
    }

    fn request(service: &str, method: &str, payload: &[u8], timeout: i64) -> Vec<u8> {
        let mut r = ttrpc::Request::new();
        r.service = service.into();
        r.method = method.into();
        r.payload = payload.to_vec();
        r.timeout_nano = timeout;
        r.write_to_bytes().unwrap()
    }

    #[test]
    fn what_clients_write_is_read_in_place() {
        for (payload, timeout) in [
            (&b""[..], 0),
            (&b"\x0a\x03vol"[..], 10_000_000_000),
            (&[7u8; 300][..], 1),
            (&b""[..], i64::MAX >> 2),
        ] {
            let body = request("crust.v1.Agent", "PublishVolume", payload, timeout);
            let p = plain(&body).expect("a plain envelope");
            assert_eq!(
                (p.service, p.method, p.payload, p.timeout_nano),
                ("crust.v1.Agent", "PublishVolume", payload, timeout)
            );
        }
        // Fields in another order, and none at all.
        let mut body = request("", "", b"", 5);
        body.extend(request("s", "m", b"", 0));
        assert_eq!(
            plain(&body),
            Some(Plain {
                service: "s",
                method: "m",
                payload: b"",
                timeout_nano: 5
            })
        );
        assert!(plain(b"").is_some());
    }

    #[test]
    fn every_other_shape_is_left_to_protobuf() {
        let mut with_metadata = ttrpc::Request::new();
        with_metadata.service = "s".into();
        let mut kv = ttrpc::proto::KeyValue::new();
        (kv.key, kv.value) = ("k".into(), "v".into());
        with_metadata.metadata = vec![kv];
        let base = request("s", "m", b"p", 5);
        let cases: Vec<Vec<u8>> = vec![
            with_metadata.write_to_bytes().unwrap(),
            // A field twice (protobuf: the last wins).
            [base.clone(), request("t", "", b"", 0)].concat(),
            // An unknown field; a known field with another wire type.
            [&base[..], &[0x30, 0x01]].concat(),
            [&base[..], &[0x22, 0x00]].concat(),
            // A negative deadline (a 10-byte varint).
            request("s", "m", b"", -1),
            // A name that is not UTF-8.
            vec![0x0a, 0x02, 0xc3, 0x28],
            // Cut inside a length, a name, a varint.
            vec![0x0a, 0x05, b'a'],
            vec![0x0a],
            vec![0x20, 0x80],
            // A length of five varint bytes.
            vec![0x0a, 0x81, 0x80, 0x80, 0x80, 0x00, b'a'],
        ];
        for body in cases {
            assert_eq!(plain(&body), None, "{body:?}");
        }
    }

    /// Wherever the reader answers, protobuf reads the same: over every
    /// prefix and every one-byte change of a few envelopes.
    #[test]
    fn it_never_disagrees_with_protobuf() {
        let seeds = [
            request("crust.v1.Agent", "GetCapabilities", b"", 10_000_000_000),
            request("a", "b", &[0x80, 0x01, 0xff], 300),
            request("", "", b"", 0),
        ];
        let mut tried = 0;
        for seed in seeds {
            for end in 0..=seed.len() {
                assert!(agrees(&seed[..end]), "{:?}", &seed[..end]);
            }
            for i in 0..seed.len() {
                for b in 0..=255u8 {
                    let mut m = seed.clone();
                    m[i] = b;
                    assert!(agrees(&m), "{m:?}");
                    tried += 1;
                }
            }
        }
        assert!(tried > 10_000);
    }
}
