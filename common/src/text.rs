//! Counts in messages: "1 storage server", "3 directories", never "1 storage servers".

/// "1 file", "2 files", "3 directories": `n` and the noun, plural unless `n` is one.
pub fn count(n: u64, noun: &str) -> String {
    let consonant_y = noun.strip_suffix('y').filter(|stem| !stem.ends_with(['a', 'e', 'i', 'o', 'u']));
    match (n, consonant_y) {
        (1, _) => format!("1 {noun}"),
        (_, Some(stem)) => format!("{n} {stem}ies"),
        _ => format!("{n} {noun}s"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn counts_say_one_or_many() {
        use super::count;
        assert_eq!(count(1, "storage server"), "1 storage server");
        assert_eq!(count(0, "file"), "0 files");
        assert_eq!(count(3, "directory"), "3 directories");
        assert_eq!(count(1, "directory"), "1 directory");
        assert_eq!(count(2, "day"), "2 days");
    }
}
