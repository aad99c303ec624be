//! `guestmem snapshot info DIR|store:…|s3://…`: a snapshot's format, its version, the guestmem
//! that wrote it, and whether this guestmem restores it (README, "Compatibility").

use std::path::Path;

use guestmem_store::location::Location;
use guestmem_sys::release::{Writer, LONG_VERSION};
use serde::Serialize;

use super::is_store;

/// What `snapshot info` prints.
#[derive(Debug, Serialize)]
struct Info {
    /// The manifest's format name.
    format: String,
    /// Its version.
    version: u64,
    /// The guestmem that wrote it, as the manifest names it (`None`: guestmem 0.1.0).
    writer: Option<Writer>,
    /// The versions of this format this guestmem reads.
    reads: (u32, u32),
    /// Whether this guestmem reads it: `None`, or why not.
    refused: Option<String>,
    /// The machine's saved state: its kind and version (its envelope), if it could be read.
    machine_state: Option<String>,
    /// This guestmem.
    this_guestmem: &'static str,
}

#[derive(serde::Deserialize)]
struct Head {
    format: Option<String>,
    version: Option<u64>,
    writer: Option<Writer>,
}

pub(super) fn info(snapshot: &str, json: bool) -> crate::Result<()> {
    let (bytes, reads, refused, state) = if is_store(Path::new(snapshot)) {
        let at = Location::parse(snapshot)?;
        let objects = at.store.open()?;
        let key = guestmem_store::manifest::manifest_key(&at.name);
        let bytes = objects.get(&key)?;
        let state = objects
            .get(&guestmem_store::manifest::state_key(&at.name))
            .ok();
        let refused = guestmem_store::manifest::StoreManifest::parse(
            &bytes,
            &objects.describe(),
            &key,
            &at.name,
        )
        .err();
        let reads = (
            guestmem_store::manifest::MIN_VERSION,
            guestmem_store::manifest::VERSION,
        );
        (bytes, reads, refused.map(|e| crate::error_text(&e)), state)
    } else {
        let path = Path::new(snapshot).join("manifest.json");
        let state = std::fs::read(Path::new(snapshot).join("state.json")).ok();
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let refused = guestmem_snapshot::Manifest::parse(&bytes, &path).err();
        let reads = (guestmem_snapshot::MIN_VERSION, guestmem_snapshot::VERSION);
        (bytes, reads, refused.map(|e| crate::error_text(&e)), state)
    };
    let head: Head = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{snapshot}: not a guestmem snapshot manifest: {e}"))?;
    let info = Info {
        format: head.format.unwrap_or_else(|| "none".into()),
        version: head.version.unwrap_or(0),
        writer: head.writer,
        reads,
        refused,
        machine_state: state.as_deref().and_then(machine_state),
        this_guestmem: LONG_VERSION,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&info)?);
        return Ok(());
    }
    println!("{snapshot}");
    println!("  format:  {} version {}", info.format, info.version);
    println!("  written by: {}", Writer::describe(info.writer.as_ref()));
    if let Some(state) = &info.machine_state {
        println!("  machine state: {state}");
    }
    let verdict = match &info.refused {
        None => "restores it".to_string(),
        Some(why) => format!("does not restore it: {why}"),
    };
    println!(
        "  this guestmem ({LONG_VERSION}) reads versions {} to {}: {verdict}",
        info.reads.0, info.reads.1
    );
    Ok(())
}

/// The machine state held by a snapshot's state file (`{"machine": HEX, ...}`; a store
/// snapshot of version 1 held the bare state itself), described.
fn machine_state(file: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(file).ok()?;
    let Some(hex) = v.get("machine").and_then(serde_json::Value::as_str) else {
        return Some(guestmem_contract::envelope::describe(file));
    };
    let blob: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect();
    Some(guestmem_contract::envelope::describe(&blob?))
}
