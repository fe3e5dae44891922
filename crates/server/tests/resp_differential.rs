//! The Redis port against the real thing: seeded random sequences of the supported
//! commands (empty strings, binary values, negative and huge integers, non-canonical
//! integers, missing keys, wrong types, expiries) go to a real `redis-server` and to
//! Camelot's port through the stock `redis` crate, and every reply must be the same.
//!
//! Bounded: [`SEEDS`] × [`COMMANDS_PER_SEED`] commands (30 800), each with a network
//! timeout. On a mismatch the test names the seed, the command number, the command and
//! the commands before it; `CAMELOT_DIFF_SEED=n` runs one seed alone to replay it (and
//! `CAMELOT_DIFF_RESP3=1` in RESP3). Five seeds speak RESP2, two RESP3.
//!
//! Where Redis itself leaves something unspecified the comparison normalises it: the
//! order of SMEMBERS, HGETALL and KEYS replies (hash-table order), SCAN's cursors (only a
//! full walk's key set is compared), and TTL/PTTL (the two servers read their clocks at
//! different moments: equal when negative, within a second otherwise).

use camelot_server::{ServerConfig, ServerHandle};
use camelot_testkit::RedisServer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::{Cmd, ConnectionLike, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// (seed, RESP3?): most in RESP2, the protocol every client speaks; two in RESP3, which
/// redis-py 8 asks for by default (maps, sets, doubles and nulls of its own).
const SEEDS: [(u64, bool); 7] = [
    (1, false),
    (2, false),
    (3, false),
    (4, false),
    (5, false),
    (6, true),
    (7, true),
];
const COMMANDS_PER_SEED: usize = 4_400;
/// Bound on every reply; loopback answers in microseconds.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on the whole run (it takes seconds in a debug build).
const RUN_TIME_MAX: Duration = Duration::from_secs(240);
/// Commands shown before a mismatching one.
const HISTORY_SHOWN: usize = 15;

const KEYS: [&[u8]; 8] = [
    b"k0",
    b"k1",
    b"k2",
    b"k3",
    b"",
    b"bin\x00\xff",
    b"user:1",
    b"user:22",
];
const INTS: [&str; 16] = [
    "0",
    "1",
    "-1",
    "42",
    "042",
    "-0",
    "+1",
    " 1",
    "1 ",
    "01",
    "9223372036854775807",
    "-9223372036854775808",
    "9223372036854775808",
    "-9223372036854775809",
    "1.5",
    "",
];
const FLOATS: [&str; 14] = [
    "0", "1", "-2.25", "1.5", "0.1", "3", "1e3", "inf", "-inf", "+inf", "abc", "1e-5", "1e999",
    "1e-999",
];
const BOUNDS: [&str; 10] = [
    "-inf", "+inf", "0", "(0", "1", "(1.5", "3", "(3", "x", "1e3",
];
const PATTERNS: [&str; 10] = [
    "*", "k*", "k?", "user:*", "*1*", "[ku]*", "[^k]*", "k[0-1]", "\\k0", "nomatch",
];

/// Commands whose reply inside EXEC's array cannot be compared as sent (their order is
/// sorted away or their value drifts with the clock only outside EXEC) or that are more
/// than one command (SCAN walks): not generated between MULTI and EXEC.
const NOT_IN_MULTI: [&str; 6] = ["SCAN", "TTL", "PTTL", "SMEMBERS", "KEYS", "HGETALL"];

struct Gen {
    rng: StdRng,
    /// A MULTI was sent and no EXEC or DISCARD since.
    in_multi: bool,
}

impl Gen {
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.rng.gen_range(0..xs.len())]
    }

    fn key(&mut self) -> Vec<u8> {
        self.pick(&KEYS).to_vec()
    }

    fn int(&mut self) -> Vec<u8> {
        match self.rng.gen_range(0..4) {
            0 => self.rng.gen_range(-1000i64..1000).to_string().into_bytes(),
            1 => self.rng.gen::<i64>().to_string().into_bytes(),
            _ => self.pick(&INTS).as_bytes().to_vec(),
        }
    }

    fn small_index(&mut self) -> Vec<u8> {
        match self.rng.gen_range(0..10) {
            0 => self.int(),
            _ => self.rng.gen_range(-6i64..8).to_string().into_bytes(),
        }
    }

    fn value(&mut self) -> Vec<u8> {
        match self.rng.gen_range(0..8) {
            0 => Vec::new(),
            1 => (0..self.rng.gen_range(1..40))
                .map(|_| self.rng.gen())
                .collect(),
            2 => self.int(),
            3 => vec![b'x'; self.rng.gen_range(100..3000)],
            _ => format!("v{}", self.rng.gen_range(0..20)).into_bytes(),
        }
    }

    fn member(&mut self) -> Vec<u8> {
        match self.rng.gen_range(0..10) {
            0 => Vec::new(),
            1 => vec![0, 255, b'm'],
            _ => format!("m{}", self.rng.gen_range(0..12)).into_bytes(),
        }
    }

    /// A far-off expiry in seconds, or one that deletes at once, or not a number.
    fn expiry(&mut self, millis: bool) -> Vec<u8> {
        let scale = if millis { 1000 } else { 1 };
        match self.rng.gen_range(0..10) {
            0 => b"0".to_vec(),
            1 => b"-5".to_vec(),
            // Every odd integer, but no short positive expiry: the two servers would
            // each see it run out at a slightly different moment (Redis rounds to the
            // millisecond), which is a race, not a difference.
            2 => {
                let i = self.pick(&INTS);
                if matches!(i, "1" | "42") { "-1" } else { i }
                    .as_bytes()
                    .to_vec()
            }
            _ => (self.rng.gen_range(1_000i64..10_000_000) * scale)
                .to_string()
                .into_bytes(),
        }
    }

    fn words(
        &mut self,
        n: std::ops::Range<usize>,
        f: impl Fn(&mut Gen) -> Vec<u8>,
    ) -> Vec<Vec<u8>> {
        let n = self.rng.gen_range(n);
        (0..n).map(|_| f(self)).collect()
    }

    fn command(&mut self) -> Vec<Vec<u8>> {
        if self.rng.gen_bool(0.04) {
            return self.transaction_command();
        }
        loop {
            let c = self.plain_command();
            let name = String::from_utf8_lossy(&c[0]).to_ascii_uppercase();
            if !self.in_multi || !NOT_IN_MULTI.contains(&name.as_str()) {
                return c;
            }
        }
    }

    /// MULTI, EXEC, DISCARD, WATCH, UNWATCH, in and out of order (nested MULTI, EXEC
    /// without MULTI, WATCH inside MULTI all have their own errors).
    fn transaction_command(&mut self) -> Vec<Vec<u8>> {
        let w = |s: &str| s.as_bytes().to_vec();
        let c = match self.rng.gen_range(0..7) {
            0 | 1 => vec![w("MULTI")],
            2 | 3 => vec![w("EXEC")],
            4 => vec![w("DISCARD")],
            5 => [vec![w("WATCH")], self.words(1..3, Gen::key)].concat(),
            _ => vec![w("UNWATCH")],
        };
        match &c[0][..] {
            b"MULTI" => self.in_multi = true,
            b"EXEC" | b"DISCARD" => self.in_multi = false,
            _ => {}
        }
        c
    }

    fn plain_command(&mut self) -> Vec<Vec<u8>> {
        let w = |s: &str| s.as_bytes().to_vec();
        let mut c: Vec<Vec<u8>>;
        match self.rng.gen_range(0..62) {
            0..=2 => c = vec![w("GET"), self.key()],
            3..=5 => {
                c = vec![w("SET"), self.key(), self.value()];
                for _ in 0..self.rng.gen_range(0..3) {
                    match self.rng.gen_range(0..7) {
                        0 => c.push(w("NX")),
                        1 => c.push(w("XX")),
                        2 => c.push(w("GET")),
                        3 => c.push(w("KEEPTTL")),
                        4 => c.extend([w("EX"), self.expiry(false)]),
                        5 => c.extend([w("PX"), self.expiry(true)]),
                        _ => c.push(w("BOGUS")),
                    }
                }
            }
            6 => c = [vec![w("MGET")], self.words(1..4, Gen::key)].concat(),
            7 => {
                c = vec![w("MSET")];
                for _ in 0..self.rng.gen_range(1..3) {
                    c.extend([self.key(), self.value()]);
                }
                if self.rng.gen_bool(0.1) {
                    c.push(self.key());
                }
            }
            8 | 9 => c = vec![w(self.pick(&["INCR", "DECR"])), self.key()],
            10 | 11 => c = vec![w(self.pick(&["INCRBY", "DECRBY"])), self.key(), self.int()],
            12 => c = vec![w("APPEND"), self.key(), self.value()],
            13 => c = vec![w("STRLEN"), self.key()],
            14 => {
                c = vec![
                    w("GETRANGE"),
                    self.key(),
                    self.small_index(),
                    self.small_index(),
                ]
            }
            15 => {
                let offset = match self.rng.gen_range(0..6) {
                    0 => self.int(),
                    _ => self.rng.gen_range(0..40).to_string().into_bytes(),
                };
                c = vec![w("SETRANGE"), self.key(), offset, self.value()]
            }
            16 => c = [vec![w("DEL")], self.words(1..3, Gen::key)].concat(),
            17 => c = [vec![w("EXISTS")], self.words(1..4, Gen::key)].concat(),
            18 => c = vec![w("TYPE"), self.key()],
            19 | 20 => {
                let (name, millis) = self.pick(&[("EXPIRE", false), ("PEXPIRE", true)]);
                c = vec![w(name), self.key(), self.expiry(millis)];
                if self.rng.gen_bool(0.3) {
                    c.push(w(self.pick(&["NX", "XX", "GT", "LT", "nx", "BAD"])));
                }
            }
            21 => {
                let at = match self.rng.gen_range(0..3) {
                    0 => w("1"),
                    1 => w("4102444800"),
                    _ => self.int(),
                };
                c = vec![w("EXPIREAT"), self.key(), at];
            }
            22 => c = vec![w("PERSIST"), self.key()],
            23 => c = vec![w(self.pick(&["TTL", "PTTL"])), self.key()],
            24..=26 => {
                let name = self.pick(&["LPUSH", "RPUSH"]);
                c = [vec![w(name), self.key()], self.words(1..4, Gen::member)].concat();
            }
            27 | 28 => {
                c = vec![w(self.pick(&["LPOP", "RPOP"])), self.key()];
                if self.rng.gen_bool(0.4) {
                    c.push(self.small_index());
                }
            }
            29 | 30 => {
                c = vec![
                    w("LRANGE"),
                    self.key(),
                    self.small_index(),
                    self.small_index(),
                ]
            }
            31 => c = vec![w("LLEN"), self.key()],
            32..=34 => c = [vec![w("SADD"), self.key()], self.words(1..4, Gen::member)].concat(),
            35 => c = [vec![w("SREM"), self.key()], self.words(1..3, Gen::member)].concat(),
            36 => c = vec![w("SMEMBERS"), self.key()],
            37 => c = vec![w("SISMEMBER"), self.key(), self.member()],
            38 => c = vec![w("SCARD"), self.key()],
            39..=41 => {
                c = vec![w("ZADD"), self.key()];
                if self.rng.gen_bool(0.3) {
                    c.push(w(self.pick(&["NX", "XX", "CH", "GT", "LT"])));
                }
                for _ in 0..self.rng.gen_range(1..3) {
                    c.extend([w(self.pick(&FLOATS)), self.member()]);
                }
                if self.rng.gen_bool(0.05) {
                    c.push(self.member());
                }
            }
            42 => {
                c = vec![
                    w("ZRANGE"),
                    self.key(),
                    self.small_index(),
                    self.small_index(),
                ];
                if self.rng.gen_bool(0.3) {
                    c.push(w("REV"));
                }
                if self.rng.gen_bool(0.4) {
                    c.push(w("WITHSCORES"));
                }
            }
            43 => {
                c = vec![
                    w("ZRANGE"),
                    self.key(),
                    w(self.pick(&BOUNDS)),
                    w(self.pick(&BOUNDS)),
                    w("BYSCORE"),
                ];
                if self.rng.gen_bool(0.3) {
                    c.push(w("REV"));
                }
                if self.rng.gen_bool(0.4) {
                    c.extend([w("LIMIT"), self.small_index(), self.small_index()]);
                }
                if self.rng.gen_bool(0.3) {
                    c.push(w("WITHSCORES"));
                }
            }
            44 => {
                c = vec![
                    w("ZREVRANGE"),
                    self.key(),
                    self.small_index(),
                    self.small_index(),
                ];
                if self.rng.gen_bool(0.4) {
                    c.push(w("WITHSCORES"));
                }
            }
            45 => {
                c = vec![
                    w("ZRANGEBYSCORE"),
                    self.key(),
                    w(self.pick(&BOUNDS)),
                    w(self.pick(&BOUNDS)),
                ];
                if self.rng.gen_bool(0.4) {
                    c.push(w("WITHSCORES"));
                }
                if self.rng.gen_bool(0.4) {
                    c.extend([w("LIMIT"), self.small_index(), self.small_index()]);
                }
            }
            46 => c = vec![w("ZRANK"), self.key(), self.member()],
            47 => c = vec![w("ZSCORE"), self.key(), self.member()],
            48 => c = vec![w("ZCARD"), self.key()],
            49 => c = [vec![w("ZREM"), self.key()], self.words(1..3, Gen::member)].concat(),
            50 | 51 => {
                c = vec![w("HSET"), self.key()];
                for _ in 0..self.rng.gen_range(1..3) {
                    c.extend([self.member(), self.value()]);
                }
            }
            52 => c = vec![w("HGET"), self.key(), self.member()],
            53 => c = vec![w("HGETALL"), self.key()],
            54 => c = [vec![w("HDEL"), self.key()], self.words(1..3, Gen::member)].concat(),
            55 => c = vec![w("DBSIZE")],
            56 => c = vec![w("KEYS"), w(self.pick(&PATTERNS))],
            57 => c = vec![w("SCAN")],
            58 => {
                // Unknown commands, wrong arities, odd letter case.
                c = match self.rng.gen_range(0..5) {
                    0 => vec![w("NOSUCHCMD"), w("a"), self.member()],
                    1 => vec![w("get")],
                    2 => vec![w("Set"), self.key()],
                    3 => vec![w("LPOP"), self.key(), w("1"), w("2")],
                    _ => vec![w("ZADD"), self.key(), w("1")],
                };
            }
            59 => c = vec![w(self.pick(&["PING", "ECHO"])), self.value()],
            60 => c = vec![w("CLIENT"), w("SETNAME"), w(self.pick(&["app", "a b", ""]))],
            _ => {
                c = if self.rng.gen_bool(0.02) {
                    vec![w("FLUSHALL")]
                } else {
                    vec![w("CLIENT"), w("GETNAME")]
                }
            }
        }
        c
    }
}

/// What is compared: a reply with the order Redis leaves open sorted away, or the error.
#[derive(Debug, PartialEq)]
enum Reply {
    Value(Value),
    Error(String),
    /// TTL/PTTL: compared with [`Reply::close_to`].
    Ttl(i64),
}

impl Reply {
    fn close_to(&self, other: &Reply, tolerance: i64) -> bool {
        match (self, other) {
            (Reply::Ttl(a), Reply::Ttl(b)) if *a < 0 || *b < 0 => a == b,
            (Reply::Ttl(a), Reply::Ttl(b)) => (a - b).abs() <= tolerance,
            (a, b) => a == b,
        }
    }
}

fn sorted(v: Value, pairs: bool) -> Value {
    match v {
        Value::Map(mut entries) => {
            entries.sort_by_key(|e| format!("{e:?}"));
            Value::Map(entries)
        }
        Value::Set(mut items) => {
            items.sort_by_key(|i| format!("{i:?}"));
            Value::Set(items)
        }
        Value::Array(items) if pairs => {
            let mut chunks: Vec<Vec<Value>> = items.chunks(2).map(<[Value]>::to_vec).collect();
            chunks.sort_by_key(|c| format!("{c:?}"));
            Value::Array(chunks.concat())
        }
        Value::Array(mut items) => {
            items.sort_by_key(|i| format!("{i:?}"));
            Value::Array(items)
        }
        other => other,
    }
}

fn run(con: &mut redis::Connection, cmd: &[Vec<u8>]) -> Reply {
    let mut c = Cmd::new();
    for a in cmd {
        c.arg(a.as_slice());
    }
    let name = String::from_utf8_lossy(&cmd[0]).to_ascii_uppercase();
    match con.req_command(&c) {
        Err(e) => Reply::Error(format!("{:?} {:?} {:?}", e.kind(), e.code(), e.detail())),
        Ok(Value::Int(n)) if name == "TTL" || name == "PTTL" => Reply::Ttl(n),
        Ok(v) => Reply::Value(match name.as_str() {
            "SMEMBERS" | "KEYS" => sorted(v, false),
            "HGETALL" => sorted(v, true),
            _ => v,
        }),
    }
}

/// A whole SCAN walk (COUNT varied), as a sorted key list.
fn scan_all(
    con: &mut redis::Connection,
    count: usize,
    pattern: &str,
) -> Result<Vec<Vec<u8>>, String> {
    let mut cursor = b"0".to_vec();
    let mut keys = Vec::new();
    for _ in 0..10_000 {
        let mut c = Cmd::new();
        c.arg("SCAN")
            .arg(cursor.as_slice())
            .arg("COUNT")
            .arg(count)
            .arg("MATCH")
            .arg(pattern);
        let v = con.req_command(&c).map_err(|e| e.to_string())?;
        let Value::Array(parts) = v else {
            return Err(format!("SCAN answered {v:?}"));
        };
        let [Value::BulkString(next), Value::Array(found)] = parts.as_slice() else {
            return Err(format!("SCAN answered {parts:?}"));
        };
        for k in found {
            let Value::BulkString(k) = k else {
                return Err(format!("SCAN listed {k:?}"));
            };
            keys.push(k.clone());
        }
        if next.as_slice() == b"0" {
            keys.sort();
            keys.dedup();
            return Ok(keys);
        }
        cursor = next.clone();
    }
    Err("SCAN never finished".into())
}

fn connect(addr: SocketAddr, resp3: bool) -> redis::Connection {
    let protocol = if resp3 { "?protocol=resp3" } else { "" };
    let client = redis::Client::open(format!("redis://{addr}/{protocol}")).expect("a redis URL");
    let con = client
        .get_connection_with_timeout(IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("cannot connect to {addr}: {e}"));
    con.set_read_timeout(Some(IO_TIMEOUT))
        .expect("read timeout");
    con.set_write_timeout(Some(IO_TIMEOUT))
        .expect("write timeout");
    con
}

fn show(cmd: &[Vec<u8>]) -> String {
    cmd.iter()
        .map(|a| {
            let s = String::from_utf8_lossy(a);
            if a.len() > 40 {
                format!("{:?}…({} bytes)", &s[..s.len().min(20)], a.len())
            } else {
                format!("{s:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs one seed's commands on both servers; the first mismatch, described, as `Err`.
fn run_seed(
    seed: u64,
    redis: &mut redis::Connection,
    camelot: &mut redis::Connection,
    started: Instant,
) -> Result<usize, String> {
    let mut gen = Gen {
        rng: StdRng::seed_from_u64(seed),
        in_multi: false,
    };
    // A MULTI the previous seed left open would queue the FLUSHALL.
    let discard = vec![b"DISCARD".to_vec()];
    run(redis, &discard);
    run(camelot, &discard);
    let flush = vec![b"FLUSHALL".to_vec()];
    run(redis, &flush);
    run(camelot, &flush);
    let mut history: Vec<String> = Vec::new();
    for i in 0..COMMANDS_PER_SEED {
        if started.elapsed() > RUN_TIME_MAX {
            return Err(format!(
                "seed {seed}: over {RUN_TIME_MAX:?} after {i} commands"
            ));
        }
        let cmd = gen.command();
        let context = |history: &[String], what: String| {
            format!(
                "seed {seed} (replay with CAMELOT_DIFF_SEED={seed}), command #{i}: {}\n{what}\n\
                 the commands before it:\n  {}",
                show(&cmd),
                history.join("\n  ")
            )
        };
        if cmd[0] == b"SCAN" {
            let count = gen.rng.gen_range(1..20);
            let pattern = gen.pick(&PATTERNS);
            let want = scan_all(redis, count, pattern);
            let got = scan_all(camelot, count, pattern);
            if want != got {
                return Err(context(
                    &history,
                    format!("redis-server: {want:?}\ncamelot:      {got:?}"),
                ));
            }
        } else {
            let want = run(redis, &cmd);
            let got = run(camelot, &cmd);
            let tolerance = if cmd[0].eq_ignore_ascii_case(b"PTTL") {
                1000
            } else {
                1
            };
            if !want.close_to(&got, tolerance) {
                return Err(context(
                    &history,
                    format!("redis-server: {want:?}\ncamelot:      {got:?}"),
                ));
            }
        }
        history.push(show(&cmd));
        if history.len() > HISTORY_SHOWN {
            history.remove(0);
        }
    }
    Ok(COMMANDS_PER_SEED)
}

#[test]
fn the_redis_port_answers_like_redis_server() {
    let reference = RedisServer::start().expect("redis-server starts");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), 256 << 20);
    config.resp_listen = Some("127.0.0.1:0".parse().unwrap());
    let server = runtime
        .block_on(async { tokio::time::timeout(IO_TIMEOUT, ServerHandle::start(config)).await })
        .expect("start timed out")
        .expect("the server starts");
    let resp_addr = server.resp_addr().expect("a RESP port");
    let seeds: Vec<(u64, bool)> = match std::env::var("CAMELOT_DIFF_SEED") {
        Ok(s) => {
            let seed = s.parse().expect("CAMELOT_DIFF_SEED is a number");
            let resp3 = std::env::var_os("CAMELOT_DIFF_RESP3").is_some();
            vec![(seed, resp3)]
        }
        Err(_) => SEEDS.to_vec(),
    };
    let started = Instant::now();
    let mut compared = 0;
    for (seed, resp3) in seeds {
        let mut redis = connect(reference.addr(), resp3);
        let mut camelot = connect(resp_addr, resp3);
        match run_seed(seed, &mut redis, &mut camelot, started) {
            Ok(n) => compared += n,
            Err(mismatch) => {
                let protocol = if resp3 {
                    "RESP3: replay with CAMELOT_DIFF_RESP3=1 too"
                } else {
                    "RESP2"
                };
                panic!("the replies differ after {compared} agreeing commands ({protocol}):\n{mismatch}")
            }
        }
    }
    eprintln!(
        "{compared} commands, identical replies, in {:?}",
        started.elapsed()
    );
    if std::env::var("CAMELOT_DIFF_SEED").is_err() {
        assert!(compared >= 20_000, "only {compared} commands compared");
    }
    runtime
        .block_on(async { tokio::time::timeout(IO_TIMEOUT, server.shutdown()).await })
        .expect("shutdown timed out")
        .expect("shutdown is clean");
}
