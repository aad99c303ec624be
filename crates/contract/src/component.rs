//! What a VMM plugs into guestmem's snapshot and migration driver: its VM core (a
//! [`Machine`]: guest memory, dirty tracking, vCPUs) and any number of [`Component`]s (devices,
//! or anything else with state that moves with the guest).
//!
//! The shape follows Cloud Hypervisor's `Pausable` / `Snapshottable` / `Migratable`
//! (vm-migration) and Firecracker's `Persist`, folded into one trait per role:
//!
//! - pause and resume: the driver stops every component before it saves anything and before the
//!   last harvest of the dirty log, and resumes them when the guest goes on (or, on a failed
//!   migration, on the source);
//! - save and restore of opaque state: a component's state is a blob only it understands,
//!   carried under its [`Component::name`] ([`ComponentState`]) in the migration's State frame
//!   and in a snapshot's `state.json`, and handed back to the component of the same name on the
//!   restoring side;
//! - pages written outside KVM's dirty log: a device that writes guest memory through
//!   [`guestmem_memory::GuestMemory`] or its vm-memory view
//!   ([`guestmem_memory::vmm_compat`]) is tracked already (those writes mark the region's
//!   VMM-side dirty marks, which every harvest merges). A component that writes by other means
//!   (raw host pointers, another process sharing the memory) reports what it wrote in
//!   [`Component::dirty_log`], and the driver marks those pages before every harvest.
//!
//! The receiving side (a migration's destination, a restore) is the mirror, after Cloud
//! Hypervisor's destination (which builds its VM from the configuration the source sends, then
//! restores the state the source saved): a [`MachineBuilder`] builds the VM from the
//! [`VmConfig`] the source sends or the snapshot records, or refuses it; that VM is a
//! [`TargetMachine`], whose guest memory the pages land in (copied, mapped, or paged in by
//! guestmem's pagers), which takes the state [`Machine::save`] gave and runs once the memory
//! is in place.
//!
//! guestmem's own VM and its payload is one implementation: [`PayloadVm`] is a [`Machine`],
//! guestmem's `Vm` a [`TargetMachine`] that [`VmBuilder`] builds.

use std::collections::HashSet;
use std::sync::Arc;

use guestmem_memory::GuestMemory;
use guestmem_tracking::Tracker;
use guestmem_vm::VmConfig;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};
#[cfg(doc)]
use crate::{MachineBuilder, PayloadVm, TargetMachine, VmBuilder};

/// What a component's own operations fail with: its error, boxed (the driver adds the
/// component's name and the operation, see [`Error::Component`]).
pub type ComponentError = Box<dyn std::error::Error + Send + Sync>;

/// A piece of a VMM whose state moves with the guest: pausable, with opaque state to save and
/// restore, and the guest pages it wrote by means guestmem does not see.
pub trait Component {
    /// The name its state travels under; unique among the components of one VM, and the same
    /// on the restoring side.
    fn name(&self) -> &str;

    /// Stops touching guest memory and changing state until [`Component::resume`].
    fn pause(&mut self) -> std::result::Result<(), ComponentError>;

    /// Goes on after a pause or a restore.
    fn resume(&mut self) -> std::result::Result<(), ComponentError>;

    /// The component's state, while paused: any bytes, handed back to [`Component::restore`].
    fn save(&mut self) -> std::result::Result<Vec<u8>, ComponentError>;

    /// Takes the state [`Component::save`] gave on the other side (or before the snapshot),
    /// while paused.
    fn restore(&mut self, state: &[u8]) -> std::result::Result<(), ComponentError>;

    /// The guest ranges `(gpa, bytes)` written since the last call by means that neither KVM's
    /// dirty log nor guestmem's VMM-side marks see (raw host pointers, another process).
    /// Writes through [`GuestMemory`] or its vm-memory view are tracked already and need not
    /// be listed. Called before every harvest of the dirty log.
    fn dirty_log(&mut self) -> std::result::Result<Vec<(u64, u64)>, ComponentError> {
        Ok(Vec::new())
    }
}

/// One component's saved state, named. Format: it travels in a snapshot's `state.json` and in
/// the migration's State; a change bumps the flat snapshot's and the store manifest's
/// `VERSION` and the migration's `PROTOCOL`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComponentState {
    /// The component's [`Component::name`].
    pub name: String,
    /// What its [`Component::save`] returned (hex in JSON).
    #[serde(with = "hex_bytes")]
    pub data: Vec<u8>,
}

/// A VM's component set, as the driver uses it.
pub struct Components<'c> {
    list: Vec<&'c mut dyn Component>,
}

impl std::fmt::Debug for Components<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.list.iter().map(|c| c.name()).collect();
        f.debug_struct("Components").field("names", &names).finish()
    }
}

impl<'c> Components<'c> {
    /// The set `list`; names must be unique.
    pub fn new(list: Vec<&'c mut dyn Component>) -> Result<Components<'c>> {
        let mut seen = HashSet::new();
        if let Some(c) = list.iter().find(|c| !seen.insert(c.name().to_string())) {
            return Err(Error::DuplicateComponent {
                name: c.name().to_string(),
            });
        }
        Ok(Components { list })
    }

    /// No components (guestmem's own VM alone).
    pub fn none() -> Components<'c> {
        Components { list: Vec::new() }
    }

    /// How many components there are.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    fn each(
        &mut self,
        op: &'static str,
        mut f: impl FnMut(&mut dyn Component) -> std::result::Result<(), ComponentError>,
    ) -> Result<()> {
        for c in &mut self.list {
            f(&mut **c).map_err(|source| Error::Component {
                name: c.name().to_string(),
                op,
                source,
            })?;
        }
        Ok(())
    }

    /// Pauses every component, in order.
    pub fn pause(&mut self) -> Result<()> {
        self.each("pause", |c| c.pause())
    }

    /// Resumes every component, in order.
    pub fn resume(&mut self) -> Result<()> {
        self.each("resume", |c| c.resume())
    }

    /// Every component's state (each must be paused).
    pub fn save(&mut self) -> Result<Vec<ComponentState>> {
        let mut states = Vec::with_capacity(self.list.len());
        self.each("save", |c| {
            states.push(ComponentState {
                name: c.name().to_string(),
                data: c.save()?,
            });
            Ok(())
        })?;
        Ok(states)
    }

    /// Hands each component its state from `states`, by name. A state with no component of its
    /// name here, or a component with no state, is refused before any is restored.
    pub fn restore(&mut self, states: &[ComponentState]) -> Result<()> {
        if let Some(s) = states
            .iter()
            .find(|s| !self.list.iter().any(|c| c.name() == s.name))
        {
            return Err(Error::UnknownComponent {
                name: s.name.clone(),
            });
        }
        if let Some(c) = self
            .list
            .iter()
            .find(|c| !states.iter().any(|s| s.name == c.name()))
        {
            return Err(Error::MissingComponentState {
                name: c.name().to_string(),
            });
        }
        self.each("restore", |c| {
            let state = states.iter().find(|s| s.name == c.name());
            c.restore(&state.expect("checked above").data)
        })
    }

    /// Marks in `memory`'s VMM-side dirty marks the pages every component reports it wrote
    /// outside guestmem's view ([`Component::dirty_log`]), so the next harvest has them.
    pub fn mark_dirty(&mut self, memory: &GuestMemory) -> Result<()> {
        let mut ranges = Vec::new();
        self.each("dirty_log", |c| {
            ranges.extend(c.dirty_log()?);
            Ok(())
        })?;
        for (gpa, len) in ranges {
            let (region, _) = memory.find(gpa, len)?;
            region.vmm_dirty().mark(gpa - region.gpa(), len);
        }
        Ok(())
    }
}

/// The VM core a migration moves: guest memory registered in a KVM VM, its dirty tracking,
/// and vCPUs that pause, resume and throttle, with their state as an opaque blob.
pub trait Machine {
    /// The guest memory (memslot `i` is region `i`).
    fn memory(&self) -> &Arc<GuestMemory>;

    /// The VM the destination builds to receive it (vCPUs and RAM regions).
    fn config(&self) -> &VmConfig;

    /// Starts dirty tracking of every memslot in `mode` ([`Tracker::start_on`] over the VMM's
    /// VM fd, memory and dirty rings).
    fn start_tracking(&self, mode: guestmem_tracking::Mode) -> Result<Tracker>;

    /// Stops the vCPUs where they are.
    fn pause(&mut self) -> Result<()>;

    /// Lets the vCPUs go on.
    fn resume(&mut self) -> Result<()>;

    /// The vCPUs' and VM's state, while paused.
    fn save(&mut self) -> Result<Vec<u8>>;

    /// Throttles the vCPUs to spend `percent` % of their time out of the guest
    /// (auto-converge); a VMM that cannot throttle ignores it.
    fn set_throttle(&mut self, percent: u64) -> Result<()> {
        let _ = percent;
        Ok(())
    }

    /// The current throttle, in percent.
    fn throttle(&self) -> u64 {
        0
    }
}

/// A [`ComponentState`]'s bytes as a hex string in JSON.
pub mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `bytes` as a hex string.
    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(bytes.len() * 2);
        for &b in bytes {
            out.push(DIGITS[usize::from(b >> 4)] as char);
            out.push(DIGITS[usize::from(b & 15)] as char);
        }
        s.serialize_str(&out)
    }

    /// Reads a hex string's bytes.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        decode(s.as_bytes()).map_err(serde::de::Error::custom)
    }

    /// The bytes `hex` spells (lower or upper case), two digits each.
    pub fn decode(hex: &[u8]) -> Result<Vec<u8>, &'static str> {
        if !hex.len().is_multiple_of(2) {
            return Err("odd number of hex digits");
        }
        let digit = |c: u8| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err("not a hex digit"),
        };
        hex.chunks_exact(2)
            .map(|pair| Ok(digit(pair[0])? << 4 | digit(pair[1])?))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counter {
        name: String,
        value: u64,
        paused: bool,
        wrote: Vec<(u64, u64)>,
    }

    impl Component for Counter {
        fn name(&self) -> &str {
            &self.name
        }
        fn pause(&mut self) -> std::result::Result<(), ComponentError> {
            self.paused = true;
            Ok(())
        }
        fn resume(&mut self) -> std::result::Result<(), ComponentError> {
            self.paused = false;
            Ok(())
        }
        fn save(&mut self) -> std::result::Result<Vec<u8>, ComponentError> {
            if !self.paused {
                return Err("saved while running".into());
            }
            Ok(self.value.to_le_bytes().to_vec())
        }
        fn restore(&mut self, state: &[u8]) -> std::result::Result<(), ComponentError> {
            self.value = u64::from_le_bytes(state.try_into()?);
            Ok(())
        }
        fn dirty_log(&mut self) -> std::result::Result<Vec<(u64, u64)>, ComponentError> {
            Ok(std::mem::take(&mut self.wrote))
        }
    }

    fn counter(name: &str, value: u64) -> Counter {
        Counter {
            name: name.into(),
            value,
            paused: false,
            wrote: Vec::new(),
        }
    }

    #[test]
    fn states_travel_by_name_and_as_hex() {
        let (mut a, mut b) = (counter("a", 7), counter("b", 0x0102));
        let mut set = Components::new(vec![&mut a, &mut b]).unwrap();
        assert!(
            matches!(set.save(), Err(Error::Component { op: "save", ref name, .. }) if name == "a")
        );
        set.pause().unwrap();
        let states = set.save().unwrap();
        let json = serde_json::to_string(&states).unwrap();
        assert!(json.contains(r#""data":"0201000000000000""#), "{json}");
        let back: Vec<ComponentState> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, states);

        // Restored by name, whatever the order.
        let (mut b2, mut a2) = (counter("b", 0), counter("a", 0));
        let mut there = Components::new(vec![&mut b2, &mut a2]).unwrap();
        there.restore(&back).unwrap();
        drop(there);
        assert_eq!((a2.value, b2.value), (7, 0x0102));
    }

    #[test]
    fn hex_decodes_either_case_and_refuses_what_is_not_hex() {
        assert_eq!(
            hex_bytes::decode(b"00ff7Fa0").unwrap(),
            [0, 0xff, 0x7f, 0xa0]
        );
        assert_eq!(hex_bytes::decode(b"abc"), Err("odd number of hex digits"));
        assert_eq!(hex_bytes::decode(b"0g"), Err("not a hex digit"));
        let all: Vec<u8> = (0..=255).collect();
        let json = serde_json::to_string(&ComponentState {
            name: "all".into(),
            data: all.clone(),
        })
        .unwrap();
        let back: ComponentState = serde_json::from_str(&json).unwrap();
        assert_eq!(back.data, all);
    }

    #[test]
    fn unknown_missing_and_duplicate_components_are_refused() {
        let (mut a, mut a_again, mut b) = (counter("a", 1), counter("a", 2), counter("b", 3));
        assert!(matches!(
            Components::new(vec![&mut a, &mut a_again]),
            Err(Error::DuplicateComponent { name }) if name == "a"
        ));
        let states = vec![ComponentState {
            name: "c".into(),
            data: vec![],
        }];
        let mut set = Components::new(vec![&mut b]).unwrap();
        assert!(
            matches!(set.restore(&states), Err(Error::UnknownComponent { name }) if name == "c")
        );
        assert!(
            matches!(set.restore(&[]), Err(Error::MissingComponentState { name }) if name == "b")
        );
    }

    #[test]
    fn reported_writes_are_marked_for_the_next_harvest() {
        use guestmem_memory::{Backend, RegionSpec, PAGE_SIZE};
        let memory = GuestMemory::new(
            &[RegionSpec::new("ram", 1 << 30, 1 << 20, Backend::Anon)],
            None,
        )
        .unwrap();
        let mut dev = counter("dma", 0);
        dev.wrote = vec![((1 << 30) + 3 * PAGE_SIZE + 10, 2 * PAGE_SIZE)];
        let mut set = Components::new(vec![&mut dev]).unwrap();
        set.mark_dirty(&memory).unwrap();
        let mut marked = Vec::new();
        memory.regions()[0]
            .vmm_dirty()
            .take_each(|w, bits| marked.push((w, bits)));
        // Pages 3, 4 and 5 (the range's end spills into page 5).
        assert_eq!(marked, [(0, 0b111000)]);
        drop(set);
        // Outside guest memory: refused, not dropped.
        dev.wrote = vec![(0, PAGE_SIZE)];
        let mut set = Components::new(vec![&mut dev]).unwrap();
        assert!(matches!(set.mark_dirty(&memory), Err(Error::Memory(_))));
    }
}
