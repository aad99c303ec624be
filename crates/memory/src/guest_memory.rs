//! A VM's guest memory: its regions, checked against each other, and registered as memslots.

use guestmem_sys::to_usize;
use std::sync::{Arc, OnceLock};

use kvm_ioctls::VmFd;

use guestmem_sys::uapi::{KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY};

use crate::{Error, MemslotManager, Region, RegionSpec, Result, SlotFlags, UserfaultRouter};

/// Starting value of [`digest_bytes`] (the FNV-1a 64-bit offset basis).
pub const DIGEST_SEED: u64 = 0xcbf2_9ce4_8422_2325;
const DIGEST_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The digest the guest payload's `verify` workload computes: FNV-1a over little-endian 64-bit
/// words (`h = (h ^ word) * 0x100000001b3`), starting from `h`. `bytes.len()` must be a
/// multiple of 8.
pub fn digest_bytes(mut h: u64, bytes: &[u8]) -> u64 {
    for word in bytes.chunks_exact(8) {
        h = digest_word(
            h,
            u64::from_le_bytes(word.try_into().expect("8-byte chunk")),
        );
    }
    h
}

/// One step of [`digest_bytes`].
fn digest_word(h: u64, word: u64) -> u64 {
    (h ^ word).wrapping_mul(DIGEST_PRIME)
}

/// The regions of one VM. Regions never overlap and their names are unique.
#[derive(Debug, Default)]
pub struct GuestMemory {
    regions: Vec<Arc<Region>>,
    memslots: OnceLock<Arc<MemslotManager>>,
    userfault: UserfaultRouter,
}

impl GuestMemory {
    /// Checks the specs against each other, then creates every region (guest_memfd regions on
    /// `vm`). Nothing is created when any spec is wrong.
    pub fn new(specs: &[RegionSpec], vm: Option<&VmFd>) -> Result<GuestMemory> {
        GuestMemory::new_on(specs, vm, &mut Default::default())
    }

    /// Like [`GuestMemory::new`], but the regions named in `shared` take over those backing
    /// files (see [`Region::create_on`]) instead of creating their own.
    pub fn new_on(
        specs: &[RegionSpec],
        vm: Option<&VmFd>,
        shared: &mut std::collections::HashMap<String, std::os::fd::OwnedFd>,
    ) -> Result<GuestMemory> {
        check_layout(specs)?;
        let regions = specs
            .iter()
            .map(|spec| {
                Region::create_on(spec.clone(), vm, shared.remove(&spec.name)).map(Arc::new)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(GuestMemory {
            regions,
            memslots: OnceLock::new(),
            userfault: UserfaultRouter::default(),
        })
    }

    /// Where the vCPU loop hands KVM Userfault exits: the pagers of userfault memslots add
    /// their ranges to it (see [`UserfaultRouter`]).
    pub fn userfault_router(&self) -> &UserfaultRouter {
        &self.userfault
    }

    /// The regions, in guest address order (memslot `i` is region `i`).
    pub fn regions(&self) -> &[Arc<Region>] {
        &self.regions
    }

    /// The region named `name`.
    pub fn region(&self, name: &str) -> Option<&Region> {
        self.regions.iter().find(|r| r.name() == name).map(|r| &**r)
    }

    /// Total guest memory in bytes.
    pub fn size(&self) -> u64 {
        self.regions.iter().map(|r| r.size()).sum()
    }

    /// The end of the highest region.
    pub fn end(&self) -> u64 {
        self.regions
            .iter()
            .map(|r| r.spec().end())
            .max()
            .unwrap_or(0)
    }

    /// The region holding all of `[gpa, gpa + len)`.
    pub fn find(&self, gpa: u64, len: u64) -> Result<(&Region, *mut u8)> {
        self.regions
            .iter()
            .find_map(|r| r.host_range(gpa, len).map(|p| (&**r, p)))
            .ok_or(Error::NotMapped { gpa, len })
    }

    /// Copies guest memory at `gpa` into `buf`.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<()> {
        let (_, src) = self.find(gpa, buf.len() as u64)?;
        // SAFETY: `find` checked that `buf.len()` bytes at `src` lie inside a live mapping; `buf`
        // is a distinct host buffer, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// Copies `data` into guest memory at `gpa`, marking the pages VMM-dirty.
    pub fn write(&self, gpa: u64, data: &[u8]) -> Result<()> {
        let (region, dst) = self.find(gpa, data.len() as u64)?;
        region
            .vmm_dirty()
            .mark(gpa - region.gpa(), data.len() as u64);
        // SAFETY: as in `read`, with the roles swapped.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Writes `data` at `gpa` with `pwrite` into the region's file instead of through its
    /// mapping (guest_memfd `write()`: no host page tables built, no fault per page), marking
    /// the range VMM-dirty as [`Self::write`] does. An error (a guest_memfd created without
    /// `GUEST_MEMFD_FLAG_WRITE`, a region without a file) leaves the memory unchanged; the
    /// caller then writes through the mapping.
    pub fn write_file(&self, gpa: u64, data: &[u8]) -> std::io::Result<()> {
        let (region, _) = self
            .find(gpa, data.len() as u64)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let offset = gpa - region.gpa();
        crate::populate::pwrite_all(region, offset, data)?;
        region.vmm_dirty().mark(offset, data.len() as u64);
        Ok(())
    }

    /// The `len` bytes of guest memory at `gpa` as a slice to read, without a copy: for a
    /// writer of a paused VM's memory (a snapshot) that hashes and compresses it in place.
    ///
    /// # Safety
    /// Nothing may write the range while the slice lives: no vCPU runs and no other thread of
    /// the VMM writes it.
    pub unsafe fn bytes(&self, gpa: u64, len: u64) -> Result<&[u8]> {
        let (_, src) = self.find(gpa, len)?;
        // SAFETY: `find` checked that `len` bytes at `src` lie inside a live mapping that lasts
        // as long as `self`; the caller guarantees nothing writes them meanwhile.
        Ok(unsafe { std::slice::from_raw_parts(src, to_usize(len)) })
    }

    /// The `len` bytes of guest memory at `gpa` as a slice to write into, the pages marked
    /// VMM-dirty: for a receiver that reads pages straight from a socket into guest memory.
    ///
    /// # Safety
    /// Nothing else may read or write the range while the slice lives: no vCPU runs on it and
    /// no other thread of the VMM touches it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, gpa: u64, len: u64) -> Result<&mut [u8]> {
        let (region, dst) = self.find(gpa, len)?;
        region.vmm_dirty().mark(gpa - region.gpa(), len);
        // SAFETY: `find` checked that `len` bytes at `dst` lie inside a live mapping that lasts
        // as long as `self`; the caller guarantees nothing else accesses them meanwhile.
        Ok(unsafe { std::slice::from_raw_parts_mut(dst, to_usize(len)) })
    }

    /// Reads one little-endian u64 at `gpa` (volatile: the guest may be writing it).
    pub fn read_u64(&self, gpa: u64) -> Result<u64> {
        let (_, p) = self.find(gpa, 8)?;
        // SAFETY: 8 bytes at `p` are inside a live mapping; a [u8; 8] read needs no alignment.
        Ok(u64::from_le_bytes(unsafe {
            std::ptr::read_volatile(p as *const [u8; 8])
        }))
    }

    /// Writes one little-endian u64 at `gpa` (volatile: the guest may be reading it), marking
    /// the page VMM-dirty.
    pub fn write_u64(&self, gpa: u64, value: u64) -> Result<()> {
        let (region, p) = self.find(gpa, 8)?;
        region.vmm_dirty().mark(gpa - region.gpa(), 8);
        // SAFETY: 8 bytes at `p` are inside a live mapping.
        unsafe { std::ptr::write_volatile(p.cast::<[u8; 8]>(), value.to_le_bytes()) };
        Ok(())
    }

    /// The [`digest_bytes`] of `[gpa, gpa + len)`, computed the way the guest's `verify` does.
    /// It reads guest memory in place (no copy: the digest check at a migration's switch-over
    /// is downtime).
    pub fn digest(&self, gpa: u64, len: u64) -> Result<u64> {
        const CHUNK: u64 = 1 << 20;
        let mut h = DIGEST_SEED;
        let mut done = 0u64;
        while done < len {
            let n = CHUNK.min(len - done);
            let (_, src) = self.find(gpa + done, n)?;
            let aligned = (src as usize).is_multiple_of(8);
            for i in 0..(n / 8) as usize {
                // SAFETY: `find` checked that `n` bytes at `src` lie inside a live mapping, and
                // word `i` ends within them; read as a u64 only where aligned (a `[u8; 8]`
                // needs no alignment, but is read a byte at a time). Volatile: a vCPU may
                // write the word meanwhile (that only changes the digest).
                let word = unsafe {
                    let p = src.add(i * 8);
                    if aligned {
                        u64::from_le(std::ptr::read_volatile(p as *const u64))
                    } else {
                        u64::from_le_bytes(std::ptr::read_volatile(p as *const [u8; 8]))
                    }
                };
                h = digest_word(h, word);
            }
            done += n;
        }
        Ok(h)
    }

    /// Registers every region as a KVM memslot, slot `i` for region `i`, through a new
    /// [`MemslotManager`] that owns the VM's memslots from then on (see [`Self::memslots`]).
    pub fn register(&self, vm: &VmFd) -> Result<()> {
        let manager = MemslotManager::new(vm)?;
        for region in &self.regions {
            manager.add(region, 0, region.size(), region.gpa(), SlotFlags::default())?;
        }
        self.memslots
            .set(Arc::new(manager))
            .map_err(|_| Error::AlreadyRegistered)
    }

    /// The VM's memslot manager, once [`Self::register`]ed. Memslot changes made through it
    /// (move, remove, resize) are not reflected in this struct's accessors, which address the
    /// regions where they were created; device code uses the manager's handles.
    pub fn memslots(&self) -> Option<&Arc<MemslotManager>> {
        self.memslots.get()
    }

    /// Sets the flags of region `slot`'s memslot (slot `i` = region `i`), through the memslot
    /// manager: `KVM_MEM_LOG_DIRTY_PAGES` starts dirty logging, 0 stops it.
    pub fn set_slot_flags(&self, _vm: &VmFd, slot: usize, flags: u32) -> Result<()> {
        let slots = self.regions.len();
        let manager = self
            .memslots()
            .filter(|_| slot < slots)
            .ok_or(Error::NoSuchSlot { slot, slots })?;
        let flags = SlotFlags {
            log_dirty_pages: flags & KVM_MEM_LOG_DIRTY_PAGES != 0,
            read_only: flags & KVM_MEM_READONLY != 0,
        };
        manager.set_flags(u32::try_from(slot).expect("memslot ids are u32"), flags)
    }
}

/// Refuses duplicate names, bad sizes/alignments and overlaps, naming the regions involved.
fn check_layout(specs: &[RegionSpec]) -> Result<()> {
    for (i, spec) in specs.iter().enumerate() {
        spec.validate()?;
        for other in &specs[..i] {
            if other.name == spec.name {
                return Err(Error::DuplicateName(spec.name.clone()));
            }
            if spec.gpa < other.end() && other.gpa < spec.end() {
                return Err(Error::Overlap {
                    region: spec.name.clone(),
                    gpa: spec.gpa,
                    end: spec.end(),
                    other: other.name.clone(),
                    other_gpa: other.gpa,
                    other_end: other.end(),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;

    fn spec(name: &str, gpa: u64, size: u64, backend: Backend) -> RegionSpec {
        RegionSpec::new(name, gpa, size, backend)
    }

    #[test]
    fn layout_errors_name_the_region() {
        let e = check_layout(&[spec("a", 0, 0, Backend::Anon)]).unwrap_err();
        assert_eq!(e.to_string(), "region 'a': size is zero");
        let e = check_layout(&[spec("b", 0, 4097, Backend::Anon)]).unwrap_err();
        assert!(e.to_string().contains("region 'b': size 0x1001"), "{e}");
        let e = check_layout(&[spec("h", 0, 4096, Backend::Hugetlbfs)]).unwrap_err();
        assert!(
            e.to_string().contains("region 'h'") && e.to_string().contains("0x200000"),
            "{e}"
        );
        let e = check_layout(&[spec("g", 0x1000_0800, 4096, Backend::Memfd)]).unwrap_err();
        assert!(e.to_string().contains("guest address"), "{e}");
        let e = check_layout(&[
            spec("lo", 0, 0x2000, Backend::Anon),
            spec("hi", 0x1000, 0x2000, Backend::Anon),
        ])
        .unwrap_err();
        assert!(
            matches!(e, Error::Overlap { ref region, ref other, .. } if region == "hi" && other == "lo")
        );
        let e = check_layout(&[
            spec("x", 0, 0x1000, Backend::Anon),
            spec("x", 0x1000, 0x1000, Backend::Anon),
        ])
        .unwrap_err();
        assert!(matches!(e, Error::DuplicateName(ref n) if n == "x"));
        check_layout(&[
            spec("lo", 0, 0x2000, Backend::Anon),
            spec("hi", 0x4000, 0x2000, Backend::Anon),
        ])
        .unwrap();
    }

    #[test]
    fn digest_is_fnv1a_over_words() {
        assert_eq!(digest_bytes(DIGEST_SEED, &[]), DIGEST_SEED);
        let one = digest_bytes(DIGEST_SEED, &1u64.to_le_bytes());
        assert_eq!(one, (DIGEST_SEED ^ 1).wrapping_mul(DIGEST_PRIME));
        assert_ne!(
            digest_bytes(DIGEST_SEED, &[0; 16]),
            digest_bytes(DIGEST_SEED, &[0; 8])
        );
    }

    #[test]
    #[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
    fn memory_digest_is_digest_bytes_of_what_is_read() {
        // Over two 1 MiB pieces and a tail that is not a whole word (left out).
        let len = (2 << 20) + 12;
        let mem = GuestMemory::new(&[spec("r", 0x10000, 3 << 20, Backend::Anon)], None).unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        mem.write(0x10000, &data).unwrap();
        let mut back = vec![0u8; len];
        mem.read(0x10000, &mut back).unwrap();
        assert_eq!(
            mem.digest(0x10000, len as u64).unwrap(),
            digest_bytes(DIGEST_SEED, &back[..len - 4])
        );
        assert_ne!(
            mem.digest(0x10000, len as u64).unwrap(),
            mem.digest(0x10008, len as u64 - 8).unwrap()
        );
        // Not word-aligned in guest memory: the same words as read.
        assert_eq!(
            mem.digest(0x10003, 4096).unwrap(),
            digest_bytes(DIGEST_SEED, &back[3..4099])
        );
    }

    #[test]
    fn host_reads_what_it_wrote() {
        let mem = GuestMemory::new(&[spec("r", 0x10000, 0x4000, Backend::Memfd)], None).unwrap();
        mem.write(0x10ff8, &[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
        let mut back = [0u8; 9];
        mem.read(0x10ff8, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(
            mem.read_u64(0x10ff8).unwrap(),
            u64::from_le_bytes([1, 2, 3, 4, 5, 6, 7, 8])
        );
        assert!(matches!(
            mem.read(0x13ffc, &mut [0; 8]),
            Err(Error::NotMapped { .. })
        ));
    }
}
