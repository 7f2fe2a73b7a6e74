//! Durations on the command line and in config: one parser for every flag that takes one.
//!
//! humantime's grammar ("500ms", "60s", "2m", "1h", "1.5m", "1h 30m", "2days", ...), plus a bare
//! number, which is seconds ("3", "0.5"), as Tern's flags have always taken.

use std::time::Duration;

/// Parses a duration such as `500ms`, `60s`, `2m`, `1.5m` or `1h`; a bare number is seconds.
pub fn parse_duration(text: &str) -> anyhow::Result<Duration> {
    let text = text.trim();
    let bare_number = !text.is_empty() && text.chars().all(|c| c.is_ascii_digit() || c == '.');
    let parsed =
        if bare_number { humantime::parse_duration(&format!("{text}s")) } else { humantime::parse_duration(text) };
    parsed.map_err(|e| match e {
        humantime::DurationError::UnknownUnit { unit, .. } if !unit.is_empty() => {
            anyhow::anyhow!("{text:?}: unknown unit {unit:?} (use ms, s, m or h)")
        }
        e => anyhow::anyhow!("{text:?} is not a duration such as 60s, 500ms or 2m: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::parse_duration;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("60s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("2min").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1.5m").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration(" 5 m ").unwrap(), Duration::from_secs(300));
    }

    #[test]
    fn a_bare_number_is_seconds() {
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("0.5").unwrap(), Duration::from_millis(500));
    }

    #[test]
    fn nonsense_is_refused_with_a_reason() {
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration(".").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("5 fortnights").unwrap_err().to_string().contains("unknown unit"));
        assert!(parse_duration("1 fortnight").unwrap_err().to_string().contains("unknown unit"));
    }
}
