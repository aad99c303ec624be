//! The final reports `--json` prints, versioned: each carries a `schema` field naming its format
//! and version ("guestmem.migrate-send/1"), and each format has a JSON Schema file in
//! docs/schemas/ (`<name>-v<version>.schema.json`), so that scripts reading them survive
//! upgrades. An additive change (a new field, optional or with a default) keeps the version;
//! removing, renaming or retyping a field bumps the constant here and gets a new schema file.

use serde::Serialize;

/// `migrate send --json` (guestmem_migration::Report).
pub const MIGRATE_SEND: &str = "guestmem.migrate-send/1";
/// `migrate receive --json` (crate::migrate::Received).
pub const MIGRATE_RECEIVE: &str = "guestmem.migrate-receive/1";
/// `migrate receive --linux --json` (crate::linux_migrate::LinuxReceived).
pub const MIGRATE_RECEIVE_LINUX: &str = "guestmem.migrate-receive-linux/1";
/// `snapshot --json` of a paused guest into a flat snapshot directory.
pub const SNAPSHOT: &str = "guestmem.snapshot/1";
/// `snapshot --json` of a paused guest into a chunk store.
pub const SNAPSHOT_STORE: &str = "guestmem.snapshot-store/1";
/// `snapshot --live --json`, flat or into a store.
pub const SNAPSHOT_LIVE: &str = "guestmem.snapshot-live/1";
/// `restore --json` of a flat snapshot.
pub const RESTORE: &str = "guestmem.restore/1";
/// `restore --json` of a snapshot in a chunk store.
pub const RESTORE_STORE: &str = "guestmem.restore-store/1";

/// Every final report's schema, for the check that each has its file.
#[cfg(test)]
const ALL: [&str; 8] = [
    MIGRATE_SEND,
    MIGRATE_RECEIVE,
    MIGRATE_RECEIVE_LINUX,
    SNAPSHOT,
    SNAPSHOT_STORE,
    SNAPSHOT_LIVE,
    RESTORE,
    RESTORE_STORE,
];

/// A report with its `schema` field first, its own fields beside it (flattened, so the fields a
/// report had before it was versioned stay where they were).
#[derive(Serialize)]
struct Versioned<'a, T: Serialize> {
    schema: &'static str,
    #[serde(flatten)]
    report: &'a T,
}

/// `report` as its versioned JSON text, pretty or on one line.
pub fn json<T: Serialize>(
    schema: &'static str,
    report: &T,
    pretty: bool,
) -> serde_json::Result<String> {
    let v = Versioned { schema, report };
    if pretty {
        serde_json::to_string_pretty(&v)
    } else {
        serde_json::to_string(&v)
    }
}

/// The file in docs/schemas/ describing `schema` ("guestmem.restore/1" is restore-v1.schema.json).
#[cfg(test)]
fn schema_file(schema: &str) -> String {
    let name = schema.trim_start_matches("guestmem.");
    let (name, version) = name.split_once('/').unwrap_or((name, "0"));
    format!("{name}-v{version}.schema.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_report_schema_has_its_file_naming_it() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/schemas");
        for schema in ALL {
            let path = dir.join(schema_file(schema));
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                v["properties"]["schema"]["const"],
                schema,
                "{}",
                path.display()
            );
            let required = v["required"].as_array().unwrap();
            assert!(required.contains(&"schema".into()), "{}", path.display());
        }
    }

    #[test]
    fn the_schema_field_comes_first_beside_the_report_fields() {
        #[derive(Serialize)]
        struct R {
            a: u32,
        }
        assert_eq!(
            json(RESTORE, &R { a: 1 }, false).unwrap(),
            r#"{"schema":"guestmem.restore/1","a":1}"#
        );
        assert_eq!(schema_file(MIGRATE_SEND), "migrate-send-v1.schema.json");
    }
}
