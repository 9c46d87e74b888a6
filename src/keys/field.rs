//! One length-delimited field of a protobuf message, read in place: how the
//! CDH's answer gives up its resource without protobuf copying the key into
//! buffers of its own (which would be freed unzeroed). A singular field
//! that appears more than once takes its last value, as protobuf reads it;
//! unknown fields are skipped; groups and truncated fields are refused.

/// Protobuf's wire types.
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;
const FIXED32: u64 = 5;

/// The value of length-delimited field `number` of `msg` (its last
/// occurrence), `None` if absent; `Err` saying why `msg` is not a protobuf
/// message.
pub(crate) fn bytes(msg: &[u8], number: u64) -> Result<Option<&[u8]>, &'static str> {
    let mut found = None;
    let mut rest = msg;
    while !rest.is_empty() {
        let (tag, after) = varint(rest).ok_or("a field's tag is cut or too long")?;
        let (field, wire) = (tag >> 3, tag & 7);
        if field == 0 {
            return Err("a field is numbered 0");
        }
        rest = match wire {
            VARINT => varint(after).ok_or("a varint is cut or too long")?.1,
            FIXED64 => after.get(8..).ok_or("a 64-bit field is cut")?,
            FIXED32 => after.get(4..).ok_or("a 32-bit field is cut")?,
            LEN => {
                let (len, after) = varint(after).ok_or("a length is cut or too long")?;
                let len = usize::try_from(len).map_err(|_| "a length is too large")?;
                let value = after.get(..len).ok_or("a length-delimited field is cut")?;
                if field == number {
                    found = Some(value);
                }
                &after[len..]
            }
            _ => {
                return Err("a field has a wire type other than varint, fixed or length-delimited")
            }
        };
    }
    Ok(found)
}

/// A varint at the start of `b` (at most 10 bytes), and what follows it.
fn varint(b: &[u8]) -> Option<(u64, &[u8])> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
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
    use crust_protocols::cdh::GetResourceResponse;
    use crust_protocols::protobuf::Message;
    use crust_protocols::ttrpc;

    fn response(payload: &[u8], status: Option<(ttrpc::Code, &str)>) -> Vec<u8> {
        let mut r = ttrpc::Response::new();
        r.payload = payload.to_vec();
        if let Some((code, msg)) = status {
            r.status = crust_protocols::protobuf::MessageField::some(ttrpc::get_status(code, msg));
        }
        r.write_to_bytes().unwrap()
    }

    fn resource(bytes: &[u8]) -> Vec<u8> {
        let mut r = GetResourceResponse::new();
        r.Resource = bytes.to_vec();
        r.write_to_bytes().unwrap()
    }

    #[test]
    fn fields_are_read_where_protobuf_reads_them() {
        let inner = resource(b"key\0\n\xff");
        let outer = response(&inner, None);
        assert_eq!(bytes(&outer, 2), Ok(Some(&inner[..])));
        assert_eq!(bytes(&inner, 1), Ok(Some(&b"key\0\n\xff"[..])));
        // An empty resource is not written at all (proto3): absent.
        assert_eq!(bytes(&resource(b""), 1), Ok(None));
        let refused = response(b"", Some((ttrpc::Code::NOT_FOUND, "no such resource")));
        let status = bytes(&refused, 1).unwrap().unwrap();
        let status = ttrpc::Status::parse_from_bytes(status).unwrap();
        assert_eq!(status.message, "no such resource");
        assert_eq!(bytes(&refused, 2), Ok(None));
        // Unknown fields of every wire type are skipped; the last of a
        // repeated field wins, as in protobuf.
        let mut odd = vec![
            0x18, 0x96, 0x01, 0x21, 1, 2, 3, 4, 5, 6, 7, 8, 0x2d, 1, 2, 3, 4,
        ];
        odd.extend([0x0a, 0x01, b'a']);
        odd.extend([0x3a, 0x02, b'z', b'z']);
        odd.extend([0x0a, 0x02, b'b', b'c']);
        assert_eq!(bytes(&odd, 1), Ok(Some(&b"bc"[..])));
        let parsed = GetResourceResponse::parse_from_bytes(&odd).unwrap();
        assert_eq!(parsed.Resource, b"bc");
    }

    #[test]
    fn what_protobuf_refuses_is_refused() {
        for bad in [
            &[0x0a][..],
            &[0x0a, 0x05, b'a'],
            &[0x0a, 0x80],
            &[0x08],
            &[0x09, 1, 2],
            &[0x0d, 1],
            &[0x00, 0x00],
            &[0xff; 11],
        ] {
            assert!(bytes(bad, 1).is_err(), "{bad:?}");
            assert!(
                GetResourceResponse::parse_from_bytes(bad).is_err(),
                "{bad:?}"
            );
        }
        // Groups, which no proto3 message has, are refused outright.
        assert!(bytes(&[0x0b, 0x0c], 1).is_err());
    }

    /// Over every prefix and every one-byte change of an answer, where the
    /// reader finds a resource protobuf finds the same.
    #[test]
    fn it_never_disagrees_with_protobuf() {
        let seed = resource(b"a resource of some length\n");
        let mut tried = 0;
        let mut check = |m: &[u8]| {
            if let Ok(found) = bytes(m, 1) {
                if let Ok(p) = GetResourceResponse::parse_from_bytes(m) {
                    assert_eq!(found.unwrap_or_default(), &p.Resource[..], "{m:?}");
                }
            }
            tried += 1;
        };
        for end in 0..=seed.len() {
            check(&seed[..end]);
        }
        for i in 0..seed.len() {
            for b in 0..=255u8 {
                let mut m = seed.clone();
                m[i] = b;
                check(&m);
            }
        }
        assert!(tried > 5_000);
    }
}
