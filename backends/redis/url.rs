//! `remote.url` for Redis / Valkey: parsing and a printable form without the password.

use std::fmt;

use crate::error::{Error, Result};

/// The setting every URL error names.
const SETTING: &str = "remote.url";

/// Redis's default port.
pub const DEFAULT_PORT: u16 = 6379;

/// The longest host name in a Redis URL (a DNS name's limit).
pub const MAX_HOST_LEN: usize = 253;

/// A parsed Redis / Valkey URL:
///
/// * `redis://[user:pass@]host[:port][/db]` — one server (standalone or a primary);
/// * `rediss://…` — the same over TLS (rustls, the system's root certificates);
/// * `redis+cluster://[user:pass@]h1:p1,h2:p2,…` (and `rediss+cluster://…`) — a Redis Cluster
///   given by seed nodes (any reachable one is enough to learn the slot map; database 0 only).
///
/// The port defaults to 6379; a host may be a name, an IPv4 address or a bracketed IPv6 address
/// (`[::1]:6379`); user and password may be percent-encoded (`%40` for `@`). `Debug` and
/// `Display` never show the password.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl {
    /// TLS (`rediss`).
    pub tls: bool,
    /// A cluster (`+cluster`).
    pub cluster: bool,
    /// `(host, port)`: one for a standalone server, the seeds of a cluster.
    pub nodes: Vec<(String, u16)>,
    /// ACL user name (`None`: the default user).
    pub username: Option<String>,
    password: Option<String>,
    /// Database number (standalone only; 0 in a cluster).
    pub db: i64,
}

impl RedisUrl {
    /// Parses `url`; an error is [`crate::ErrorKind::InvalidConfig`] naming `remote.url`, the URL
    /// without its password, and what was wrong.
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |why: String| Error::invalid_config(SETTING, redact(url), why);
        let url = url.trim();
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            bad(
                "no scheme: expected redis://, rediss://, redis+cluster:// or rediss+cluster://"
                    .into(),
            )
        })?;
        let (tls, cluster) = scheme_flags(scheme).map_err(bad)?;
        if rest.contains(['?', '#']) {
            return Err(bad(
                "query parameters and fragments are not supported".into()
            ));
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let (userinfo, hosts) = match authority.rfind('@') {
            Some(i) => (Some(&authority[..i]), &authority[i + 1..]),
            None => (None, authority),
        };
        let (username, password) = credentials(userinfo).map_err(bad)?;
        let nodes = parse_nodes(hosts, cluster).map_err(bad)?;
        let db = parse_db(path, cluster).map_err(bad)?;
        Ok(Self {
            tls,
            cluster,
            nodes,
            username,
            password,
            db,
        })
    }

    /// The password, if any.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }
}

/// `(tls, cluster)` of a scheme (any case): redis, rediss, redis+cluster or rediss+cluster.
fn scheme_flags(scheme: &str) -> std::result::Result<(bool, bool), String> {
    match scheme.to_ascii_lowercase().as_str() {
        "redis" => Ok((false, false)),
        "rediss" => Ok((true, false)),
        "redis+cluster" => Ok((false, true)),
        "rediss+cluster" => Ok((true, true)),
        other => Err(format!(
            "unknown scheme `{other}`: expected redis, rediss, redis+cluster or rediss+cluster"
        )),
    }
}

/// The user name and password of `user:password` (percent-decoded, an empty one as none); a
/// user name without a password is refused.
fn credentials(
    userinfo: Option<&str>,
) -> std::result::Result<(Option<String>, Option<String>), String> {
    let (username, password) = match userinfo {
        None => (None, None),
        Some(info) => {
            let (user, pass) = match info.split_once(':') {
                Some((u, p)) => (u, Some(p)),
                None => (info, None),
            };
            let user = percent_decode(user).map_err(|e| format!("user name: {e}"))?;
            let pass = pass
                .map(percent_decode)
                .transpose()
                .map_err(|e| format!("password: {e}"))?;
            (
                Some(user).filter(|u| !u.is_empty()),
                pass.filter(|p| !p.is_empty()),
            )
        }
    };
    if username.is_some() && password.is_none() {
        return Err("a user name needs a password (user:password@host)".into());
    }
    Ok((username, password))
}

/// The comma-separated `host:port` list (errors name the host by its place, from 1); more than
/// one needs the cluster scheme.
fn parse_nodes(hosts: &str, cluster: bool) -> std::result::Result<Vec<(String, u16)>, String> {
    let mut nodes = Vec::new();
    for (i, node) in hosts.split(',').enumerate() {
        nodes.push(parse_node(node).map_err(|e| format!("host {}: {e}", i + 1))?);
    }
    if nodes.len() > 1 && !cluster {
        return Err(format!(
            "{} hosts listed: a list of seed nodes needs the cluster scheme (redis+cluster:// or rediss+cluster://)",
            nodes.len()
        ));
    }
    Ok(nodes)
}

/// The database number of the URL's path (a trailing `/` dropped; empty: 0), 0 to 99999 and 0
/// only in a cluster.
fn parse_db(path: &str, cluster: bool) -> std::result::Result<i64, String> {
    let path = path.strip_suffix('/').unwrap_or(path);
    let db = if path.is_empty() {
        0
    } else {
        if path.len() > 5 || !path.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("database `{path}` is not a number from 0 to 99999"));
        }
        path.parse::<i64>()
            .map_err(|e| format!("database `{path}`: {e}"))?
    };
    if cluster && db != 0 {
        return Err(format!(
            "database {db}: a Redis Cluster has database 0 only"
        ));
    }
    Ok(db)
}

impl fmt::Display for RedisUrl {
    /// The URL with the password replaced by `***`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match (self.tls, self.cluster) {
            (false, false) => "redis",
            (true, false) => "rediss",
            (false, true) => "redis+cluster",
            (true, true) => "rediss+cluster",
        };
        write!(f, "{scheme}://")?;
        match (&self.username, &self.password) {
            (Some(u), _) => write!(f, "{u}:***@")?,
            (None, Some(_)) => write!(f, ":***@")?,
            (None, None) => {}
        }
        for (i, (host, port)) in self.nodes.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            if host.contains(':') {
                write!(f, "[{host}]:{port}")?;
            } else {
                write!(f, "{host}:{port}")?;
            }
        }
        if !self.cluster {
            write!(f, "/{}", self.db)?;
        }
        Ok(())
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedisUrl({self})")
    }
}

/// `url` with whatever sits between `://` and the last `@` of the authority shown as `***`
/// (the user name is kept when a `:` separates it from the password): printable in errors even
/// when it does not parse.
pub fn redact(url: &str) -> String {
    let Some(start) = url.find("://").map(|i| i + 3) else {
        // Not even a scheme: nothing can be told apart; show no more than its shape.
        return if url.contains('@') {
            "***@…".into()
        } else {
            url.into()
        };
    };
    let rest = &url[start..];
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..end].rfind('@') else {
        return url.into();
    };
    let user = match rest[..at].split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".into(),
    };
    format!("{}{user}{}", &url[..start], &rest[at..])
}

fn parse_node(node: &str) -> std::result::Result<(String, u16), String> {
    if node.is_empty() {
        return Err("empty (expected host[:port])".into());
    }
    let (host, port) = if let Some(v6) = node.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or_else(|| format!("`{node}`: an IPv6 address needs its closing `]`"))?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("`{host}` is not an IPv6 address"));
        }
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| format!("`{node}`: expected `:port` after `]`"))?,
            ),
        };
        (host, port)
    } else {
        match node.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (node, None),
        }
    };
    if host.is_empty() {
        return Err(format!("`{node}`: no host name"));
    }
    if host.len() > MAX_HOST_LEN {
        // A DNS name has at most 253 characters (an IPv6 literal fewer); not quoted whole.
        return Err(format!(
            "a host name has at most {MAX_HOST_LEN} characters; this one has {}",
            host.len()
        ));
    }
    if !host.contains(':')
        && !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    {
        return Err(format!("`{host}` is not a host name or address"));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(0) | Err(_) => return Err(format!("port `{p}` is not a number from 1 to 65535")),
            Ok(p) => p,
        },
    };
    Ok((host.to_owned(), port))
}

fn percent_decode(s: &str) -> std::result::Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| "a `%` not followed by two hex digits".to_string())?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "not UTF-8 once percent-decoded".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn forms() {
        let u = RedisUrl::parse("redis://localhost").unwrap();
        assert_eq!((u.tls, u.cluster, u.db), (false, false, 0));
        assert_eq!(u.nodes, vec![("localhost".to_string(), 6379)]);
        assert_eq!(u.to_string(), "redis://localhost:6379/0");

        let u = RedisUrl::parse("rediss://kvbm:p%40ss@cache.example:6380/3").unwrap();
        assert!(u.tls && !u.cluster);
        assert_eq!(u.username.as_deref(), Some("kvbm"));
        assert_eq!(u.password(), Some("p@ss"));
        assert_eq!(u.db, 3);
        assert_eq!(u.to_string(), "rediss://kvbm:***@cache.example:6380/3");

        let u = RedisUrl::parse("redis://:secret@127.0.0.1:7000/").unwrap();
        assert_eq!(
            (u.username.as_deref(), u.password()),
            (None, Some("secret"))
        );
        assert!(!format!("{u:?}").contains("secret"));

        let u = RedisUrl::parse("redis+cluster://a:1,b:2,[::1]:3").unwrap();
        assert!(u.cluster && !u.tls);
        assert_eq!(u.nodes.len(), 3);
        assert_eq!(u.nodes[2], ("::1".to_string(), 3));
        assert_eq!(u.to_string(), "redis+cluster://a:1,b:2,[::1]:3");
        assert!(RedisUrl::parse("rediss+cluster://u:p@a:1").unwrap().tls);
    }

    #[test]
    fn errors_name_the_part_and_hide_the_password() {
        for (url, part) in [
            ("localhost:6379", "no scheme"),
            ("http://h:1", "unknown scheme"),
            ("redis://h:0", "port `0`"),
            ("redis://h:99999", "port `99999`"),
            ("redis://h:x", "port `x`"),
            ("redis://:topsecret@:1", "no host"),
            ("redis://h 1", "not a host"),
            ("redis://a:1,b:2", "cluster scheme"),
            ("redis://h/db", "database `db`"),
            ("redis://h/1234567", "database"),
            ("redis+cluster://a:1/2", "database 0 only"),
            ("redis://h?x=1", "query"),
            ("redis://[::1:1", "closing"),
            ("redis://u:%zz@h", "password"),
            ("redis://kvbm@h", "needs a password"),
            ("redis+cluster://a:1,,b:2", "host 2"),
        ] {
            let e = RedisUrl::parse(url).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{url}");
            let text = e.to_string();
            assert!(text.contains(part), "{url}: {text}");
            assert!(text.contains("remote.url"), "{url}: {text}");
            assert!(!text.contains("topsecret"), "{url}: {text}");
        }
    }

    #[test]
    fn redaction() {
        assert_eq!(redact("redis://u:pw@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("redis://pw@h"), "redis://***@h");
        assert_eq!(redact("redis://h:1/a@b"), "redis://h:1/a@b");
        assert_eq!(redact("u:pw@h"), "***@…");
    }
}
