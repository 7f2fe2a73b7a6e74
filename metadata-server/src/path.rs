//! Namespace paths: strict normalisation, and where a path stands relative to `/jobs`.
//!
//! Paths are absolute and '/'-separated. There is exactly one spelling of each path, so that the
//! namespace can compare them as strings: no empty components, no "." or "..", no NUL. A trailing
//! '/' is tolerated ("/a/b/" is "/a/b") because shells and humans add one.

use crate::error::{invalid, Refusal};

/// Longest path accepted, in bytes (Linux's PATH_MAX).
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest component accepted, in bytes (Linux's NAME_MAX).
pub const MAX_NAME_BYTES: usize = 255;
/// The directory holding one directory per live job.
pub const JOBS_DIR: &str = "/jobs";

/// The canonical form of `raw`, or why it is not a valid path.
pub fn normalize(raw: &str) -> Result<String, Refusal> {
    if raw.len() > MAX_PATH_BYTES {
        return Err(invalid(format!("path is {} bytes, longer than {MAX_PATH_BYTES}", raw.len())));
    }
    if raw == "/" {
        return Ok(raw.to_string());
    }
    let body = raw.strip_suffix('/').unwrap_or(raw);
    let Some(rest) = body.strip_prefix('/') else {
        return Err(invalid("path must be absolute (start with '/')"));
    };
    if raw.contains('\0') {
        return Err(invalid("path contains a NUL byte"));
    }
    for component in rest.split('/') {
        match component {
            "" => return Err(invalid("path has an empty component ('//')")),
            "." | ".." => return Err(invalid(format!("path has a {component:?} component"))),
            name if name.len() > MAX_NAME_BYTES => {
                return Err(invalid(format!("path component is {} bytes, longer than {MAX_NAME_BYTES}", name.len())))
            }
            _ => {}
        }
    }
    Ok(body.to_string())
}

/// The components of a normalised path; none for "/".
pub fn components(path: &str) -> impl Iterator<Item = &str> {
    path.split('/').filter(|c| !c.is_empty())
}

/// The parent directory and last component of a normalised path; `None` for "/".
pub fn split_last(path: &str) -> Option<(&str, &str)> {
    let (parent, name) = path.rsplit_once('/')?;
    if name.is_empty() {
        return None;
    }
    Some((if parent.is_empty() { "/" } else { parent }, name))
}

/// `dir/name` for a normalised directory path.
pub fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// True when `path` is `ancestor` or lies below it (both normalised).
pub fn is_within(path: &str, ancestor: &str) -> bool {
    ancestor == "/"
        || path == ancestor
        || (path.len() > ancestor.len() && path.starts_with(ancestor) && path.as_bytes()[ancestor.len()] == b'/')
}

/// The root directory of job `job`.
pub fn job_root(job: &str) -> String {
    join(JOBS_DIR, job)
}

/// Where a normalised path stands relative to the jobs tree, which has rules of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place<'a> {
    /// Not under `/jobs`.
    Outside,
    /// `/jobs` itself.
    JobsDir,
    /// `/jobs/<job>`: made by RegisterJob, removed by EndJob.
    JobRoot(&'a str),
    /// Below `/jobs/<job>/`: belongs to that job.
    InJob(&'a str),
}

impl<'a> Place<'a> {
    pub fn of(path: &'a str) -> Place<'a> {
        let mut parts = components(path);
        if parts.next() != Some("jobs") {
            return Place::Outside;
        }
        match (parts.next(), parts.next()) {
            (None, _) => Place::JobsDir,
            (Some(job), None) => Place::JobRoot(job),
            (Some(job), Some(_)) => Place::InJob(job),
        }
    }

    /// The job owning entries at this place, if any.
    pub fn job(self) -> Option<&'a str> {
        match self {
            Place::JobRoot(job) | Place::InJob(job) => Some(job),
            Place::Outside | Place::JobsDir => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_strictly() {
        assert_eq!(normalize("/").unwrap(), "/");
        assert_eq!(normalize("/a/b").unwrap(), "/a/b");
        assert_eq!(normalize("/a/b/").unwrap(), "/a/b");
        for bad in ["", "a/b", "//", "/a//b", "/a/./b", "/a/..", "/a\0b", "/a/b//"] {
            let refusal = normalize(bad).unwrap_err();
            assert_eq!(refusal.kind, tern_proto::ErrorKind::Invalid, "{bad:?}");
        }
        let long_name = format!("/{}", "x".repeat(MAX_NAME_BYTES + 1));
        assert!(normalize(&long_name).unwrap_err().reason.contains("component"));
        assert!(normalize(&format!("/{}", "x".repeat(MAX_NAME_BYTES))).is_ok());
        let long_path = "/abc".repeat(MAX_PATH_BYTES / 4 + 1);
        assert!(normalize(&long_path).unwrap_err().reason.contains("longer than"));
    }

    #[test]
    fn splits_and_joins() {
        assert_eq!(split_last("/"), None);
        assert_eq!(split_last("/a"), Some(("/", "a")));
        assert_eq!(split_last("/a/b"), Some(("/a", "b")));
        assert_eq!(join("/", "a"), "/a");
        assert_eq!(join("/a", "b"), "/a/b");
        assert_eq!(components("/").count(), 0);
        assert_eq!(components("/a/b").collect::<Vec<_>>(), ["a", "b"]);
    }

    #[test]
    fn within() {
        assert!(is_within("/a/b", "/a"));
        assert!(is_within("/a", "/a"));
        assert!(is_within("/a", "/"));
        assert!(!is_within("/ab", "/a"));
        assert!(!is_within("/a", "/a/b"));
    }

    #[test]
    fn places() {
        assert_eq!(Place::of("/"), Place::Outside);
        assert_eq!(Place::of("/jobsx/a"), Place::Outside);
        assert_eq!(Place::of("/jobs"), Place::JobsDir);
        assert_eq!(Place::of("/jobs/j1"), Place::JobRoot("j1"));
        assert_eq!(Place::of("/jobs/j1/a/b"), Place::InJob("j1"));
        assert_eq!(Place::of("/jobs/j1/a").job(), Some("j1"));
        assert_eq!(Place::of("/data/x").job(), None);
    }
}
