//! The stores a YCSB run can drive, each through the binding YCSB itself would use:
//! Camelot's native client (a record is one value), Redis's protocol as YCSB's Redis
//! binding speaks it (a record is a hash, plus a sorted set `_indices` for scans; used
//! for both redis-server and Camelot's RESP port), and memcached's text protocol (a
//! record is one value; no scans).

use super::memcached::Memcached;
use super::record::{check_blob, check_fields, fill_record, record_blob, record_fields, Mismatch};
use crate::BenchError;
use bytes::BytesMut;
use camelot_client::{Client, ClientConfig, ClusterMap};
use redis::Commands;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

/// The sorted set YCSB's Redis binding keeps every key in, scored by the key's Java
/// `hashCode`, so scans can find a starting point.
const REDIS_INDEX_KEY: &str = "_indices";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Most addresses a `camelot://` URL may list.
const URL_NODES_MAX: usize = 64;

/// What a read found: nothing, or a record that did or did not check out.
pub type ReadOutcome = Option<Result<u64, Mismatch>>;

/// Record layout, shared by every binding.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub fields: usize,
    pub field_bytes: usize,
}

/// One client thread's connection to a store.
pub trait Db: Send {
    fn write(&mut self, key: &str, version: u64, insert: bool) -> Result<(), String>;
    fn read(&mut self, key: &str, newest_acknowledged: u64) -> Result<ReadOutcome, String>;
    /// Up to `count` records from `start` on, each checked.
    fn scan(&mut self, start: &str, count: usize) -> Result<Vec<Result<u64, Mismatch>>, String>;
}

/// A cluster token. Its `Debug` hides it, because a target's `Debug` is what ycsb.json
/// records.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(pub String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<hidden>)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetKind {
    /// Camelot's native protocol, over one or more nodes, with the cluster token if
    /// they want one.
    Camelot {
        addrs: Vec<SocketAddr>,
        token: Option<Token>,
    },
    /// Camelot through its Redis-protocol port.
    Resp(SocketAddr),
    Redis(SocketAddr),
    Memcached(SocketAddr),
}

impl TargetKind {
    /// `camelot://[:TOKEN@]h:p[,h:p…]`, `resp://h:p`, `redis://h:p`, `memcached://h:p`.
    pub fn parse(url: &str) -> Result<TargetKind, BenchError> {
        let bad = |why: &str| BenchError::InvalidConfig(format!("target {url:?}: {why}"));
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected scheme://host:port"))?;
        let rest = rest.trim_end_matches('/');
        let resolve = |hp: &str| -> Result<SocketAddr, BenchError> {
            hp.to_socket_addrs()
                .map_err(|e| bad(&format!("{hp}: {e}")))?
                .next()
                .ok_or_else(|| bad(&format!("{hp} resolves to nothing")))
        };
        Ok(match scheme {
            "camelot" => {
                // Host names never hold an '@', so the last one ends the token, which
                // may itself contain any byte but that one's absence of meaning.
                let (token, hosts) = match rest.rsplit_once('@') {
                    None => (None, rest),
                    Some((userinfo, hosts)) => match userinfo.split_once(':') {
                        Some(("", token)) if !token.is_empty() => {
                            (Some(Token(token.to_owned())), hosts)
                        }
                        _ => return Err(bad("a token is given as camelot://:TOKEN@host:port")),
                    },
                };
                let addrs = hosts
                    .split(',')
                    .map(resolve)
                    .collect::<Result<Vec<_>, _>>()?;
                if addrs.is_empty() || addrs.len() > URL_NODES_MAX {
                    return Err(bad(&format!("1 to {URL_NODES_MAX} addresses")));
                }
                TargetKind::Camelot { addrs, token }
            }
            "resp" => TargetKind::Resp(resolve(rest)?),
            "redis" => TargetKind::Redis(resolve(rest)?),
            "memcached" => TargetKind::Memcached(resolve(rest)?),
            _ => return Err(bad("scheme must be camelot, resp, redis or memcached")),
        })
    }

    /// A Camelot target that names no token of its own takes `token` (`--token`); a token
    /// in the URL wins. Other targets are returned as they are.
    pub fn with_default_token(self, token: Option<&str>) -> TargetKind {
        match (self, token) {
            (TargetKind::Camelot { addrs, token: None }, Some(t)) => TargetKind::Camelot {
                addrs,
                token: Some(Token(t.to_owned())),
            },
            (kind, _) => kind,
        }
    }

    pub fn supports_scan(&self) -> bool {
        !matches!(self, TargetKind::Memcached(_))
    }
}

/// A target ready to hand out per-thread connections.
pub enum Target {
    Camelot { client: Client },
    Redis { url: String },
    Memcached { addr: SocketAddr },
}

impl Target {
    pub fn open(kind: &TargetKind) -> Result<Target, BenchError> {
        Ok(match kind {
            TargetKind::Camelot { addrs, token } => {
                let config = ClientConfig {
                    token: token.as_ref().map(|t| t.0.clone().into_bytes()),
                    request_timeout: REQUEST_TIMEOUT,
                    // YCSB threads each keep one request outstanding: see frames_ahead.
                    frames_ahead: 4,
                    ..ClientConfig::default()
                };
                let client = Client::connect(ClusterMap::from_addrs(addrs), config)
                    .map_err(|e| BenchError::InvalidConfig(format!("camelot target: {e}")))?;
                Target::Camelot { client }
            }
            TargetKind::Resp(a) | TargetKind::Redis(a) => Target::Redis {
                url: format!("redis://{a}/"),
            },
            TargetKind::Memcached(a) => Target::Memcached { addr: *a },
        })
    }

    pub fn connect(&self, shape: Shape) -> Result<Box<dyn Db>, String> {
        Ok(match self {
            Target::Camelot { client } => Box::new(CamelotDb {
                client: client.clone(),
                shape,
                record: BytesMut::new(),
            }),
            Target::Redis { url } => {
                let c = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
                let con = c
                    .get_connection_with_timeout(CONNECT_TIMEOUT)
                    .map_err(|e| e.to_string())?;
                con.set_read_timeout(Some(REQUEST_TIMEOUT))
                    .map_err(|e| e.to_string())?;
                Box::new(RedisDb { con, shape })
            }
            Target::Memcached { addr } => Box::new(MemcachedDb {
                con: Memcached::connect(*addr, REQUEST_TIMEOUT)?,
                shape,
            }),
        })
    }
}

struct CamelotDb {
    client: Client,
    shape: Shape,
    /// Records are built here and split off for the client, which lets go of them
    /// once sent, so the next write reuses the allocation.
    record: BytesMut,
}

impl Db for CamelotDb {
    fn write(&mut self, key: &str, version: u64, _insert: bool) -> Result<(), String> {
        fill_record(
            &mut self.record,
            key,
            self.shape.fields,
            self.shape.field_bytes,
            version,
        );
        self.client
            .put(key.as_bytes(), self.record.split().freeze())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn read(&mut self, key: &str, newest: u64) -> Result<ReadOutcome, String> {
        let got = self.client.get(key.as_bytes()).map_err(|e| e.to_string())?;
        Ok(got.map(|v| {
            check_blob(
                key,
                &v.value,
                self.shape.fields,
                self.shape.field_bytes,
                newest,
            )
        }))
    }

    fn scan(&mut self, start: &str, count: usize) -> Result<Vec<Result<u64, Mismatch>>, String> {
        let items = self
            .client
            .scan(start.as_bytes(), count)
            .map_err(|e| e.to_string())?;
        Ok(items
            .iter()
            .map(|it| match std::str::from_utf8(&it.key) {
                Ok(k) => check_blob(k, &it.value, self.shape.fields, self.shape.field_bytes, 0),
                Err(_) => Err(Mismatch::Shape("key is not UTF-8".into())),
            })
            .collect())
    }
}

/// Java's `String.hashCode`, which YCSB's Redis binding (through Jedis) scores keys by.
pub fn java_string_hash(s: &str) -> i32 {
    s.encode_utf16()
        .fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)))
}

struct RedisDb {
    con: redis::Connection,
    shape: Shape,
}

impl RedisDb {
    fn check_hash(
        &self,
        key: &str,
        mut pairs: Vec<(String, Vec<u8>)>,
        newest: u64,
    ) -> Result<u64, Mismatch> {
        // HGETALL has no order; put fields back in field-number order.
        let mut indexed = Vec::with_capacity(pairs.len());
        for (name, value) in pairs.drain(..) {
            let Some(i) = name
                .strip_prefix("field")
                .and_then(|n| n.parse::<usize>().ok())
            else {
                return Err(Mismatch::Shape(format!("unexpected field {name:?}")));
            };
            indexed.push((i, value));
        }
        indexed.sort_by_key(|(i, _)| *i);
        if indexed.iter().enumerate().any(|(pos, (i, _))| pos != *i) {
            return Err(Mismatch::Shape("fields missing or repeated".into()));
        }
        check_fields(
            key,
            indexed.iter().map(|(_, v)| v.as_slice()),
            self.shape.fields,
            newest,
        )
    }
}

impl Db for RedisDb {
    fn write(&mut self, key: &str, version: u64, insert: bool) -> Result<(), String> {
        let fields = record_fields(key, self.shape.fields, self.shape.field_bytes, version);
        let mut cmd = redis::cmd("HMSET");
        cmd.arg(key);
        for (f, v) in &fields {
            cmd.arg(f).arg(v);
        }
        cmd.query::<()>(&mut self.con).map_err(|e| e.to_string())?;
        if insert {
            // As YCSB's binding: the index entry follows the record, in a second request.
            self.con
                .zadd::<_, _, _, ()>(REDIS_INDEX_KEY, key, java_string_hash(key))
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn read(&mut self, key: &str, newest: u64) -> Result<ReadOutcome, String> {
        let pairs: Vec<(String, Vec<u8>)> = self.con.hgetall(key).map_err(|e| e.to_string())?;
        if pairs.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.check_hash(key, pairs, newest)))
    }

    fn scan(&mut self, start: &str, count: usize) -> Result<Vec<Result<u64, Mismatch>>, String> {
        let keys: Vec<String> = redis::cmd("ZRANGEBYSCORE")
            .arg(REDIS_INDEX_KEY)
            .arg(java_string_hash(start))
            .arg("+inf")
            .arg("LIMIT")
            .arg(0)
            .arg(count)
            .query(&mut self.con)
            .map_err(|e| e.to_string())?;
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let pairs: Vec<(String, Vec<u8>)> = self.con.hgetall(&k).map_err(|e| e.to_string())?;
            out.push(self.check_hash(&k, pairs, 0));
        }
        Ok(out)
    }
}

struct MemcachedDb {
    con: Memcached,
    shape: Shape,
}

impl Db for MemcachedDb {
    fn write(&mut self, key: &str, version: u64, _insert: bool) -> Result<(), String> {
        let blob = record_blob(key, self.shape.fields, self.shape.field_bytes, version);
        self.con.set(key, &blob)
    }

    fn read(&mut self, key: &str, newest: u64) -> Result<ReadOutcome, String> {
        Ok(self
            .con
            .get(key)?
            .map(|v| check_blob(key, &v, self.shape.fields, self.shape.field_bytes, newest)))
    }

    fn scan(&mut self, _start: &str, _count: usize) -> Result<Vec<Result<u64, Mismatch>>, String> {
        Err("memcached has no scan".into())
    }
}

/// Keys one round of a native clear scans and deletes.
const CLEAR_BATCH_KEYS: usize = 1000;
/// Rounds a native clear may take: enough for `RECORDS_MAX` plus inserts, and a bound if
/// something keeps writing.
const CLEAR_ROUNDS_MAX: u64 = 2 * super::RECORDS_MAX / CLEAR_BATCH_KEYS as u64;

/// Empties a target before a load, so a run never reads another run's records and every
/// store starts from the same empty state.
pub fn clear(kind: &TargetKind) -> Result<(), String> {
    match kind {
        TargetKind::Camelot { addrs, token } => clear_camelot(addrs, token.as_ref()),
        TargetKind::Resp(a) | TargetKind::Redis(a) => {
            let c = redis::Client::open(format!("redis://{a}/")).map_err(|e| e.to_string())?;
            let mut con = c
                .get_connection_with_timeout(CONNECT_TIMEOUT)
                .map_err(|e| e.to_string())?;
            redis::cmd("FLUSHALL")
                .query::<()>(&mut con)
                .map_err(|e| e.to_string())
        }
        TargetKind::Memcached(a) => Memcached::connect(*a, CONNECT_TIMEOUT)?.flush_all(),
    }
}

/// The native face has no FLUSHALL: scan from the first key and delete what comes back
/// until a scan finds nothing, then check every node holds no object at all (a hash or
/// sorted set written through the Redis port is invisible to the native scan).
fn clear_camelot(addrs: &[SocketAddr], token: Option<&Token>) -> Result<(), String> {
    let config = ClientConfig {
        token: token.map(|t| t.0.clone().into_bytes()),
        request_timeout: REQUEST_TIMEOUT,
        ..ClientConfig::default()
    };
    let client =
        Client::connect(ClusterMap::from_addrs(addrs), config).map_err(|e| e.to_string())?;
    for _ in 0..CLEAR_ROUNDS_MAX {
        let items = client
            .scan(b"", CLEAR_BATCH_KEYS)
            .map_err(|e| e.to_string())?;
        if items.is_empty() {
            return check_camelot_empty(&client, addrs.len());
        }
        let keys: Vec<&[u8]> = items.iter().map(|i| i.key.as_ref()).collect();
        client.delete_many(&keys).map_err(|e| e.to_string())?;
    }
    Err(format!(
        "still not empty after {CLEAR_ROUNDS_MAX} rounds of {CLEAR_BATCH_KEYS} deletes: is something else writing?"
    ))
}

fn check_camelot_empty(client: &Client, nodes: usize) -> Result<(), String> {
    for node in 0..nodes {
        let node = u32::try_from(node).map_err(|_| "more nodes than a map can hold".to_string())?;
        let stats = client.stats(node).map_err(|e| e.to_string())?;
        let objects = stats
            .iter()
            .find(|(name, _)| name == "objects")
            .map_or(0, |(_, v)| *v);
        if objects > 0 {
            return Err(format!(
                "node {node} still holds {objects} objects the native face cannot delete \
                 (hashes or sorted sets from the Redis port): FLUSHALL it there"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn java_hash_matches_java() {
        // "hello".hashCode() == 99162322 and "user6284781860667377211".hashCode() in Java.
        assert_eq!(java_string_hash("hello"), 99_162_322);
        assert_eq!(java_string_hash(""), 0);
    }

    #[test]
    fn urls_parse() {
        let two: Vec<SocketAddr> = vec![
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        ];
        assert_eq!(
            TargetKind::parse("camelot://127.0.0.1:1,127.0.0.1:2").unwrap(),
            TargetKind::Camelot {
                addrs: two.clone(),
                token: None
            }
        );
        let tokened = TargetKind::parse("camelot://:s3cr@t,x@127.0.0.1:1,127.0.0.1:2/").unwrap();
        assert_eq!(
            tokened,
            TargetKind::Camelot {
                addrs: two.clone(),
                token: Some(Token("s3cr@t,x".into()))
            }
        );
        // ycsb.json records a target's Debug: the token must not be in it.
        assert!(!format!("{tokened:?}").contains("s3cr"), "{tokened:?}");
        for bad in [
            "camelot://s3cret@127.0.0.1:1",
            "camelot://:@127.0.0.1:1",
            "camelot://user:pw@127.0.0.1:1",
            "camelot://:tok@",
        ] {
            assert!(TargetKind::parse(bad).is_err(), "{bad}");
        }
        // --token fills in a token only where the URL has none.
        let plain = TargetKind::parse("camelot://127.0.0.1:1").unwrap();
        assert_eq!(
            plain.with_default_token(Some("flag")),
            TargetKind::Camelot {
                addrs: two[..1].to_vec(),
                token: Some(Token("flag".into()))
            }
        );
        let url_wins = TargetKind::parse("camelot://:url@127.0.0.1:1").unwrap();
        assert_eq!(url_wins.clone().with_default_token(Some("flag")), url_wins);
        assert_eq!(
            TargetKind::parse("redis://127.0.0.1:6379/").unwrap(),
            TargetKind::Redis("127.0.0.1:6379".parse().unwrap())
        );
        assert!(TargetKind::parse("http://x:1").is_err());
        assert!(TargetKind::parse("memcached").is_err());
        assert!(!TargetKind::parse("memcached://127.0.0.1:1")
            .unwrap()
            .supports_scan());
    }
}
