//! Signed keys and hashed keys: pure Rust, no pgrx.
//!
//! A signed key is `<key>.<secret id>.<signature>`, the signature being the unpadded base64url
//! HMAC-SHA256 (RFC 2104) of `<secret id>.<key>` under the server secret with that id. The key
//! itself may contain dots: the last two dot-separated fields are the id and the signature.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// Length of an encoded signature: 32 bytes in unpadded base64url.
pub const SIGNATURE_CHARS: usize = 43;

/// HMAC-SHA256 of `message` under `secret`, as a MAC in progress (the `hmac` crate).
fn mac(secret: &[u8], message: &[u8]) -> HmacSha256 {
    // HMAC takes a key of any length (a longer one is hashed first): this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(secret).expect("HMAC accepts any key length");
    mac.update(message);
    mac
}

/// HMAC-SHA256 of `message` under `secret`.
pub fn hmac_sha256(secret: &[u8], message: &[u8]) -> [u8; 32] {
    mac(secret, message).finalize().into_bytes().into()
}

/// Unpadded base64url (RFC 4648 section 5).
pub fn b64url(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// Decodes unpadded base64url; None for any other character, padding or a dangling length.
/// Non-canonical encodings (stray low bits in the last character) are refused too (the
/// engine's default), so each signature has exactly one spelling.
pub fn b64url_decode(s: &str) -> Option<Vec<u8>> {
    URL_SAFE_NO_PAD.decode(s).ok()
}

/// What is signed: `<kid>.<key>`, and for a session with a scope prefix (a tenant) also a NUL
/// and the prefix, so a key signed for one tenant does not verify for another. A key holds no
/// NUL (PostgreSQL text cannot), so the message reads back unambiguously; with no prefix it is
/// the message of release 0.2.0, whose signed keys keep verifying.
fn signed_message(kid: i32, key: &str, prefix: &str) -> Vec<u8> {
    let mut m = format!("{kid}.{key}").into_bytes();
    if !prefix.is_empty() {
        m.push(0);
        m.extend_from_slice(prefix.as_bytes());
    }
    m
}

/// Signs `key` with the secret `kid`, for the tenant with scope prefix `prefix` ("" for none).
pub fn sign(key: &str, kid: i32, secret: &[u8], prefix: &str) -> String {
    let mac = hmac_sha256(secret, &signed_message(kid, key, prefix));
    format!("{key}.{kid}.{}", b64url(&mac))
}

/// The parts of a signed key: the key, the secret id and the signature bytes; None when the
/// text does not have the shape of a signed key.
pub fn parse(signed: &str) -> Option<(&str, i32, Vec<u8>)> {
    let (rest, sig) = signed.rsplit_once('.')?;
    let (key, kid) = rest.rsplit_once('.')?;
    if key.is_empty() || sig.len() != SIGNATURE_CHARS {
        return None;
    }
    // A key longer than any key can be is refused before any MAC is computed.
    if key.len() > crate::arguments::MAX_KEY_CHARS
        && key.chars().count() > crate::arguments::MAX_KEY_CHARS
    {
        return None;
    }
    // Only the canonical decimal spelling of a positive id: "07" or "+7" would sign alike.
    if kid.is_empty() || kid.starts_with('0') || !kid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let kid: i32 = kid.parse().ok()?;
    Some((key, kid, b64url_decode(sig)?))
}

/// Whether `signature` is the signature of `key` under secret `kid` for the tenant with scope
/// prefix `prefix`, compared in constant time.
pub fn verify(key: &str, kid: i32, signature: &[u8], secret: &[u8], prefix: &str) -> bool {
    mac(secret, &signed_message(kid, key, prefix))
        .verify_slice(signature)
        .is_ok()
}

/// The stored form of a key when the store keeps keys hashed: the lowercase hex HMAC-SHA256,
/// under the store's secret, of the key's SHA-256. A plain SHA-256 of an e-mail address or an
/// order number is reversed with a dictionary; without the secret (kept in the server) this is
/// not. Hashing the SHA-256 rather than the key lets release 0.2.0's stored form (the hex
/// SHA-256) be rewritten into this one without the keys ([`rekeyed`]).
pub fn hashed_key(key: &str, secret: &[u8]) -> String {
    rekeyed(&Sha256::digest(key.as_bytes()), secret)
}

/// The stored form of a key whose SHA-256 is `digest`.
pub fn rekeyed(digest: &[u8], secret: &[u8]) -> String {
    format!("{:x}", mac(secret, digest).finalize().into_bytes())
}

/// What messages show of a stored hashed key: `(hashed)`, nothing of its stored form.
pub fn hash_label(_stored: &str) -> String {
    // Nothing of the stored form: a prefix of the hash, shown for a key the caller chose, would
    // let any role that may call the functions match keys against a copy of the table.
    "(hashed)".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn hmac_matches_rfc4231() {
        // Test cases 1, 2 and 6 (a key longer than the block) of RFC 4231.
        let cases: [(&[u8], &[u8], &str); 3] = [
            (
                &[0x0b; 20],
                b"Hi There",
                "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
            ),
            (
                b"Jefe",
                b"what do ya want for nothing?",
                "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
            ),
            (
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First",
                "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
            ),
        ];
        for (key, msg, mac) in cases {
            assert_eq!(hmac_sha256(key, msg).to_vec(), unhex(mac));
        }
    }

    #[test]
    fn base64url_matches_rfc4648_vectors() {
        for (plain, enc) in [
            ("", ""),
            ("f", "Zg"),
            ("fo", "Zm8"),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg"),
            ("fooba", "Zm9vYmE"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(b64url(plain.as_bytes()), enc);
            assert_eq!(b64url_decode(enc).unwrap(), plain.as_bytes());
        }
        assert_eq!(b64url(&[0xfb, 0xff]), "-_8");
        for bad in ["Z", "Zg=", "Zh", "Zm9=", "Zm+v", "Zm/v"] {
            assert_eq!(b64url_decode(bad), None, "{bad}");
        }
    }

    #[test]
    fn sign_then_verify() {
        let s = sign("order.42", 3, b"secret", "");
        let (key, kid, sig) = parse(&s).unwrap();
        assert_eq!((key, kid), ("order.42", 3));
        assert!(verify(key, kid, &sig, b"secret", ""));
        assert!(!verify(key, kid, &sig, b"other secret", ""));
        assert!(!verify("order.43", kid, &sig, b"secret", ""));
        assert!(!verify(key, 4, &sig, b"secret", ""));
    }

    #[test]
    fn a_key_signed_for_one_tenant_does_not_verify_for_another() {
        let s = sign("checkout-1", 1, b"secret", "shop_b:");
        let (key, kid, sig) = parse(&s).unwrap();
        assert!(verify(key, kid, &sig, b"secret", "shop_b:"));
        assert!(!verify(key, kid, &sig, b"secret", "shop_a:"));
        assert!(!verify(key, kid, &sig, b"secret", ""));
        // Without a prefix the message is release 0.2.0's: its signed keys still verify.
        let old = format!("k.1.{}", b64url(&hmac_sha256(b"secret", b"1.k")));
        let (key, kid, sig) = parse(&old).unwrap();
        assert!(verify(key, kid, &sig, b"secret", ""));
    }

    #[test]
    fn keyed_hashes_need_the_secret_and_rekey_sha256_digests() {
        let a = hashed_key("alice@example.com", b"secret one");
        assert_eq!(a.len(), 64);
        assert_ne!(a, hashed_key("alice@example.com", b"secret two"));
        assert_ne!(
            a,
            crate::derivation::hex(&Sha256::digest(b"alice@example.com"))
        );
        // Release 0.2.0 stored the plain SHA-256: it is rewritten without the key.
        assert_eq!(
            rekeyed(&Sha256::digest(b"alice@example.com"), b"secret one"),
            a
        );
    }

    #[test]
    fn an_overlong_signed_key_is_refused_before_any_mac() {
        let sig = "A".repeat(SIGNATURE_CHARS);
        assert!(parse(&format!("{}.1.{sig}", "k".repeat(256))).is_none());
        assert!(parse(&format!("{}.1.{sig}", "k".repeat(255))).is_some());
    }

    #[test]
    fn malformed_signed_keys_do_not_parse() {
        let s = sign("k", 1, b"x", "");
        let sig = s.rsplit_once('.').unwrap().1;
        for bad in [
            "k".to_string(),
            "k.1".to_string(),
            format!(".1.{sig}"),
            format!("k..{sig}"),
            format!("k.01.{sig}"),
            format!("k.+1.{sig}"),
            format!("k.-1.{sig}"),
            format!("k.99999999999.{sig}"),
            format!("k.1.{}", &sig[..42]),
            format!("k.1.{sig}A"),
        ] {
            assert!(parse(&bad).is_none(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn any_single_bit_flip_is_refused(key in "[a-z0-9:.-]{1,40}", kid in 1i32..1000, bit in 0usize..10_000) {
            let secret = b"a server secret";
            let signed = sign(&key, kid, secret, "");
            let mut bytes = signed.clone().into_bytes();
            let i = bit % (bytes.len() * 8);
            bytes[i / 8] ^= 1 << (i % 8);
            if let Ok(tampered) = String::from_utf8(bytes) {
                let accepted = parse(&tampered)
                    .is_some_and(|(k, id, sig)| verify(k, id, &sig, secret, ""));
                prop_assert!(!accepted, "{tampered} accepted");
            }
        }

        #[test]
        fn base64url_round_trips(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            prop_assert_eq!(b64url_decode(&b64url(&bytes)).unwrap(), bytes);
        }
    }
}
