//! Parsing of sizes like `512M`, `1G`, `64K`, `4096`, and of durations in seconds.

use std::time::Duration;

/// The longest duration a flag takes: longer ones are refused rather than overflow a clock.
pub const MAX_SECONDS: f64 = 30.0 * 24.0 * 3600.0;

/// `s` seconds given to `flag` as a duration: a positive, finite number of seconds up to
/// [`MAX_SECONDS`] (NaN, infinities, zero, negative and absurdly large values are refused,
/// naming the flag).
pub fn seconds(s: f64, flag: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero() && s <= MAX_SECONDS)
        .ok_or_else(|| {
            format!("{flag} must be a positive number of seconds up to {MAX_SECONDS}, not {s:?}")
        })
}

/// Parses a byte size with an optional K/M/G/T suffix (binary units, optional trailing `iB`/`B`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 4096, 64K, 512M, 1G)"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size '{s}' is too large"))
}

#[cfg(test)]
mod tests {
    use super::{parse_size, seconds};
    use std::time::Duration;

    #[test]
    fn durations() {
        assert_eq!(seconds(1.5, "--x").unwrap(), Duration::from_millis(1500));
        for bad in [0.0, -1.0, 1e300, f64::NAN, f64::INFINITY, 1e9] {
            let e = seconds(bad, "--duration").unwrap_err();
            assert!(
                e.contains("--duration") && e.contains("positive"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert!(parse_size("1X").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
