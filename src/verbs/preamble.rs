//! How library peers recognise each other over RDMA CM: an 8-byte preamble in the private data
//! (magic, version, flags, length of the caller's data), the caller's data, then what the
//! flags announce (the credit extension of [`crate::verbs::credit`]). A peer without it is a
//! plain librdmacm program, whose private data passes through untouched.

use crate::verbs::credit::{FLAG_CREDITS, Remote};

const MAGIC: [u8; 4] = *b"RBRv";
/// Version 4: library peers speak credits (see [`crate::verbs::credit`]), their sends carry
/// the sender's count in the immediate, and a send that waits for a credit may go through the
/// peer's bounce area (the layout of the credit block is part of the version). A peer of
/// another version is treated as a plain librdmacm program, and treats this one as such:
/// plain RC both ways.
const PREAMBLE_VERSION: u8 = 4;
const PREAMBLE: usize = 8;

/// The private data of a library peer: magic, version, flags, length of the caller's data, the
/// caller's data, then `ext` (what the flags announce).
pub(super) fn with_preamble(user: &[u8], flags: u8, ext: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(PREAMBLE + user.len() + ext.len());
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&[PREAMBLE_VERSION, flags, user.len() as u8, 0]);
    v.extend_from_slice(user);
    v.extend_from_slice(ext);
    v
}

/// Whether a library peer's connect request offers receive credits (a client whose
/// receives come from a shared receive queue does not).
pub(super) fn offers_credits(data: &[u8]) -> bool {
    parse_preamble(data).0 && data[5] & FLAG_CREDITS != 0
}

/// The credit extension of a library peer's accept: the peer's credit word, if it offers one.
pub(super) fn parse_credit_ext(data: &[u8]) -> Option<Remote> {
    if !offers_credits(data) {
        return None;
    }
    let at = PREAMBLE + data[6] as usize;
    Remote::decode(data.get(at..)?)
}

/// Splits received private data into (is a library peer, the caller's data).
pub(super) fn parse_preamble(data: &[u8]) -> (bool, Vec<u8>) {
    if data.len() >= PREAMBLE && data[..4] == MAGIC && data[4] == PREAMBLE_VERSION {
        let len = data[6] as usize;
        if PREAMBLE + len <= data.len() {
            return (true, data[PREAMBLE..PREAMBLE + len].to_vec());
        }
    }
    (false, data.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_peer_round_trips_its_data() {
        let d = with_preamble(b"hello", 0, &[]);
        assert_eq!(parse_preamble(&d), (true, b"hello".to_vec()));
        assert!(
            parse_credit_ext(&d).is_none(),
            "no credit flag, no extension"
        );
    }

    #[test]
    fn plain_and_other_version_data_pass_through_untouched() {
        let plain = b"RBRx-not-ours".to_vec();
        assert_eq!(parse_preamble(&plain), (false, plain.clone()));
        // Earlier versions (2: credits without the count on sends; 3: without the bounce area)
        // and later ones are plain peers.
        for version in [1, 2, 3, 5] {
            let mut other = with_preamble(b"x", FLAG_CREDITS, &[]);
            other[4] = version;
            assert_eq!(parse_preamble(&other), (false, other.clone()));
        }
        // A length past the end is not a preamble either.
        let mut long = with_preamble(b"abc", 0, &[]);
        long[6] = 200;
        assert!(!parse_preamble(&long).0);
        assert_eq!(parse_preamble(&[]), (false, Vec::new()));
    }

    #[test]
    fn a_credit_flag_without_its_extension_yields_none() {
        let d = with_preamble(b"u", FLAG_CREDITS, &[]);
        assert!(parse_preamble(&d).0);
        assert!(parse_credit_ext(&d).is_none());
    }
}
