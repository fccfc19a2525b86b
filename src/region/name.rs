//! Region names: the prefix every name has, the namespace of a process
//! (`SHMBRIDGE_NAMESPACE`), canonical and random names.

use crate::error::{Error, Result};
use crate::os;

use crate::control::SOCKET_SUFFIX;

/// Every region name starts with this, so `ls` and `gc` can find them.
pub const PREFIX: &str = "shmbridge-";
/// The environment variable that names the region namespace of a process: with
/// `SHMBRIDGE_NAMESPACE=ns`, the names it makes are `shmbridge-ns-…`, and its sweep, `ls`
/// and `gc` look only at those (docs/protocol.md 1.1). Unset or empty: the default
/// namespace, `shmbridge-…`, whose sweep looks at every `shmbridge-*` name.
pub const NAMESPACE_ENV: &str = "SHMBRIDGE_NAMESPACE";
/// The longest namespace: a region name still fits a socket address (1.6, 95 bytes).
const MAX_NAMESPACE: usize = 40;

/// The region namespace of this process ([`NAMESPACE_ENV`]), `None` for the default one.
pub fn namespace() -> Result<Option<String>> {
    namespace_from(std::env::var_os(NAMESPACE_ENV))
}

/// A namespace is 1..=40 characters from `[A-Za-z0-9_]`: no `-`, so no namespace's prefix
/// (`shmbridge-ns-`) is the start of another's. Empty is the default namespace.
fn namespace_from(value: Option<std::ffi::OsString>) -> Result<Option<String>> {
    const WHY: &str = "SHMBRIDGE_NAMESPACE: use 1..40 characters from [A-Za-z0-9_]";
    let Some(ns) = value else {
        return Ok(None);
    };
    let ns = ns.into_string().map_err(|ns| Error::InvalidName {
        name: ns.to_string_lossy().into_owned(),
        reason: WHY,
    })?;
    if ns.is_empty() {
        return Ok(None);
    }
    if ns.len() > MAX_NAMESPACE || !ns.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(Error::InvalidName {
            name: ns,
            reason: WHY,
        });
    }
    Ok(Some(ns))
}

/// What every name of this process's namespace starts with: `shmbridge-ns-`, or
/// [`PREFIX`] in the default namespace (which therefore holds every `shmbridge-*` name).
pub fn namespace_prefix() -> Result<String> {
    Ok(prefix_of(namespace()?.as_deref()))
}

fn prefix_of(namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) => format!("{PREFIX}{ns}-"),
        None => PREFIX.to_string(),
    }
}

/// Turns a user-given name into a region name: a name that starts with [`PREFIX`] is
/// whole already (an engine printed it; it reaches the region from any namespace); any
/// other gets this process's [`namespace_prefix`]. Checks the characters (the name
/// becomes a file in /dev/shm).
pub fn canonical_name(name: &str) -> Result<String> {
    canonical_name_in(name, &namespace_prefix()?)
}

fn canonical_name_in(name: &str, prefix: &str) -> Result<String> {
    let name = name.strip_prefix('/').unwrap_or(name);
    let (full, prefix_len) = if name.starts_with(PREFIX) {
        (name.to_string(), PREFIX.len())
    } else {
        (format!("{prefix}{name}"), prefix.len())
    };
    let ok = full.len() <= 200
        && full.len() > prefix_len
        && full
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if !ok {
        return Err(Error::InvalidName {
            name: name.to_string(),
            reason: "use 1..190 characters from [A-Za-z0-9._-]",
        });
    }
    if full.ends_with(SOCKET_SUFFIX) {
        return Err(Error::InvalidName {
            name: name.to_string(),
            reason: "names ending in .fd are the fd sockets' (`<region>.fd`)",
        });
    }
    Ok(full)
}

/// A fresh random name in this process's namespace: 128 bits, so two engines never
/// collide.
pub fn random_name() -> Result<String> {
    Ok(format!("{}{}", namespace_prefix()?, os::random_hex128()?))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn names_are_canonicalised_and_checked() {
        // In the default namespace.
        let canonical_name = |n: &str| canonical_name_in(n, PREFIX);
        assert_eq!(canonical_name("abc").unwrap(), "shmbridge-abc");
        assert_eq!(canonical_name("/shmbridge-abc").unwrap(), "shmbridge-abc");
        assert!(canonical_name("a/b").is_err());
        assert!(canonical_name("").is_err());
        assert!(canonical_name("shmbridge-").is_err());
        assert!(canonical_name(&"x".repeat(300)).is_err());
        let r = random_name().unwrap();
        assert_eq!(canonical_name(&r).unwrap(), r);
    }

    #[test]
    fn a_namespace_prefixes_short_names_and_leaves_whole_ones() {
        let ns = |v: &str| namespace_from(Some(v.into()));
        assert_eq!(ns("").unwrap(), None);
        assert_eq!(namespace_from(None).unwrap(), None);
        assert_eq!(ns("run_7").unwrap().as_deref(), Some("run_7"));
        for bad in ["a-b", "a/b", "a.b", &"x".repeat(41)] {
            assert!(matches!(ns(bad), Err(Error::InvalidName { .. })), "{bad:?}");
        }
        let p = prefix_of(Some("run_7"));
        assert_eq!(p, "shmbridge-run_7-");
        assert_eq!(prefix_of(None), PREFIX);
        assert_eq!(canonical_name_in("abc", &p).unwrap(), "shmbridge-run_7-abc");
        // A whole name (an engine printed it) reaches its region from any namespace.
        assert_eq!(
            canonical_name_in("shmbridge-other-abc", &p).unwrap(),
            "shmbridge-other-abc"
        );
        assert!(canonical_name_in("", &p).is_err());
    }
}
