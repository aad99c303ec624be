//! The versions of guestmem's records: a `schema` field names the record and its version
//! (`guestmem.progress/1`), and a reader refuses a version it cannot read with an error
//! naming both.

/// The progress records' schema ([`crate::Event`]); docs/schemas/progress-v1.schema.json.
///
/// Bumped (to `/2`) by any change a reader of `/1` could misread: a field removed or renamed, a
/// unit changed. Additive changes (a new optional field, a new [`crate::Status`]) keep `/1`:
/// readers ignore fields they do not know and treat an unknown status as work still going on.
pub const PROGRESS_SCHEMA: &str = "guestmem.progress/1";

/// A record of a schema this reader cannot read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    /// The schema the reader reads.
    pub expected: String,
    /// The schema the record said (empty when it said none).
    pub found: String,
}

impl std::fmt::Display for SchemaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.found.is_empty() {
            write!(
                f,
                "the record names no schema; this reader reads {}",
                self.expected
            )
        } else {
            write!(
                f,
                "the record is {}, this reader reads {}",
                self.found, self.expected
            )
        }
    }
}

impl std::error::Error for SchemaError {}

/// Checks that `value` (a parsed record) says `expected`'s name and major version in its
/// `schema` field: `guestmem.progress/1` reads `guestmem.progress/1`, and refuses
/// `guestmem.progress/2` or a record of another name, naming both.
pub fn check_schema(value: &serde_json::Value, expected: &str) -> Result<(), SchemaError> {
    let found = value
        .get("schema")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("");
    if found == expected {
        Ok(())
    } else {
        Err(SchemaError {
            expected: expected.to_string(),
            found: found.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_version_is_refused_naming_both() {
        let v = serde_json::json!({ "schema": "guestmem.progress/2" });
        let e = check_schema(&v, PROGRESS_SCHEMA).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the record is guestmem.progress/2, this reader reads guestmem.progress/1"
        );
        let none = check_schema(&serde_json::json!({}), PROGRESS_SCHEMA).unwrap_err();
        assert!(none.to_string().contains("names no schema"), "{none}");
        let ok = serde_json::json!({ "schema": PROGRESS_SCHEMA });
        assert_eq!(check_schema(&ok, PROGRESS_SCHEMA), Ok(()));
    }
}
