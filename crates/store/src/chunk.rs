//! One chunk of memory as the store keeps it: the zstd frame of its bytes, named by the BLAKE3
//! hash of those bytes (so every fetch can be checked), stored in a pack (many chunks'
//! frames one after another in one object, read by ranges) or, as stores written before packs
//! keep them, as an object of its own.

use crate::{Error, Result};

/// The chunk size written (see the crate's README section on the measurement behind it).
pub const CHUNK_BYTES: u64 = 256 << 10;
/// The zstd level chunks are compressed at (fast enough to write over 1 GiB of guest memory
/// per second on two cores).
pub const ZSTD_LEVEL: i32 = 1;

/// A chunk's BLAKE3 hash.
pub type Hash = [u8; 32];

/// The hash of `bytes`.
pub fn hash(bytes: &[u8]) -> Hash {
    *blake3::hash(bytes).as_bytes()
}

/// Lower-case hex of a hash.
pub fn hex(hash: &Hash) -> String {
    blake3::Hash::from_bytes(*hash).to_hex().to_string()
}

/// Parses 64 hex digits.
pub fn parse_hex(text: &str) -> Option<Hash> {
    blake3::Hash::from_hex(text).ok().map(|h| *h.as_bytes())
}

/// Where a chunk's frame is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Loc {
    /// An object of its own, `chunks/HH/HASH` (stores written before packs).
    Object,
    /// In the pack `packs/HH/ID`, from byte `offset`.
    Pack {
        /// The pack's id.
        id: Hash,
        /// Where the chunk's frame starts in it.
        offset: u64,
    },
}

/// A stored chunk: its hash, its stored (compressed) bytes, and where they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stored {
    /// BLAKE3 of the chunk's bytes.
    pub hash: Hash,
    /// Its compressed bytes in the store.
    pub stored: u64,
    /// Where they are.
    pub loc: Loc,
}

impl Stored {
    /// The key of the object holding the chunk (its own, or its pack).
    pub fn object_key(&self) -> String {
        match &self.loc {
            Loc::Object => key(&self.hash),
            Loc::Pack { id, .. } => pack_key(id),
        }
    }

    /// Where its frame starts in that object.
    pub fn offset(&self) -> u64 {
        match self.loc {
            Loc::Object => 0,
            Loc::Pack { offset, .. } => offset,
        }
    }
}

/// The store key of the pack `id`.
pub fn pack_key(id: &Hash) -> String {
    let h = hex(id);
    format!("packs/{}/{h}", &h[..2])
}

/// The id a pack key names, if it is one.
pub fn pack_of_key(key: &str) -> Option<Hash> {
    let rest = key.strip_prefix("packs/")?;
    let (dir, name) = rest.split_once('/')?;
    let id = parse_hex(name)?;
    (dir == &name[..2]).then_some(id)
}

/// The store key of the chunk whose hash is `hash`, stored as an object of its own.
pub fn key(hash: &Hash) -> String {
    let h = hex(hash);
    format!("chunks/{}/{h}", &h[..2])
}

/// The hash a chunk key names, if it is one.
pub fn hash_of_key(key: &str) -> Option<Hash> {
    let rest = key.strip_prefix("chunks/")?;
    let (dir, name) = rest.split_once('/')?;
    let hash = parse_hex(name)?;
    (dir == &name[..2]).then_some(hash)
}

/// Whether every byte of `bytes` is zero.
pub fn is_zero(bytes: &[u8]) -> bool {
    let (head, words, tail) = {
        // SAFETY: u64 has no invalid bit patterns; align_to splits off the unaligned ends.
        unsafe { bytes.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// Decompresses the stored object `stored` of the chunk `hash` into `out` (exactly the chunk's
/// length) and checks its hash; `what` names the chunk in errors (snapshot, region, offset).
pub fn decode_into(stored: &[u8], hash: &Hash, out: &mut [u8], what: &str) -> Result<()> {
    thread_local! {
        // One decompression context per thread, not one per chunk.
        static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    let n = DECOMPRESSOR
        .with_borrow_mut(|d| {
            if d.is_none() {
                *d = Some(zstd::bulk::Decompressor::new()?);
            }
            d.as_mut()
                .expect("made above")
                .decompress_to_buffer(stored, out)
        })
        .map_err(|e| {
            Error::Corrupt(format!(
                "{what}: chunk {} does not decompress ({e}): damaged",
                hex(hash)
            ))
        })?;
    if n != out.len() {
        return Err(Error::Corrupt(format!(
            "{what}: chunk {} holds {n} bytes, the manifest's chunk has {}",
            hex(hash),
            out.len()
        )));
    }
    let found = self::hash(out);
    if found != *hash {
        return Err(Error::Corrupt(format!(
            "{what}: chunk {} does not match its hash (its bytes hash to {}): damaged or \
             replaced",
            hex(hash),
            hex(&found)
        )));
    }
    Ok(())
}

/// Compresses a chunk for storing.
pub fn encode(compressor: &mut zstd::bulk::Compressor<'_>, bytes: &[u8]) -> Vec<u8> {
    compressor
        .compress(bytes)
        .expect("zstd compresses into a growing buffer")
}

#[cfg(test)]
mod tests {
    use super::*;
    use guestmem_sys::to_usize;

    #[test]
    fn round_trip_and_refusals() {
        let mut data = vec![0u8; to_usize(CHUNK_BYTES)];
        data[5000] = 7;
        let h = hash(&data);
        assert_eq!(hash_of_key(&key(&h)), Some(h));
        assert_eq!(pack_of_key(&pack_key(&h)), Some(h));
        assert_eq!(pack_of_key(&key(&h)), None);
        let mut c = zstd::bulk::Compressor::new(ZSTD_LEVEL).unwrap();
        let stored = encode(&mut c, &data);
        let mut out = vec![0u8; data.len()];
        decode_into(&stored, &h, &mut out, "t").unwrap();
        assert_eq!(out, data);
        // Another chunk's bytes under this hash: refused, naming both hashes.
        data[5000] = 8;
        let other = encode(&mut c, &data);
        let e = decode_into(&other, &h, &mut out, "snap r0")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("snap r0") && e.contains(&hex(&h)) && e.contains("hash"),
            "{e}"
        );
        // A truncated object.
        let e = decode_into(&stored[..stored.len() / 2], &h, &mut out, "t").unwrap_err();
        assert!(e.to_string().contains("decompress"), "{e}");
        assert!(is_zero(&[0; 100]) && !is_zero(&data));
    }
}
