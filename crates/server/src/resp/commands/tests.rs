//! The command table and its handlers, run without sockets.

use super::*;
use crate::budget::MemoryBudget;

struct Harness {
    state: ServerState,
    token: Option<Vec<u8>>,
    session: Session,
}

impl Harness {
    fn new(cap_bytes: u64, token: Option<&str>) -> Self {
        Harness {
            state: ServerState::new(MemoryBudget::new(cap_bytes), 0),
            token: token.map(|t| t.as_bytes().to_vec()),
            session: Session::default(),
        }
    }

    fn run(&mut self, line: &str) -> String {
        let args: Vec<&[u8]> = line.split_whitespace().map(str::as_bytes).collect();
        self.run_args(&args)
    }

    fn run_args(&mut self, args: &[&[u8]]) -> String {
        let ctx = Ctx {
            state: &self.state,
            token: self.token.as_deref(),
        };
        let mut out = BytesMut::new();
        execute(&ctx, &mut self.session, args, Instant::now(), &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }
}

#[test]
fn strings_behave_like_redis() {
    let mut h = Harness::new(1 << 20, None);
    assert_eq!(h.run("PING"), "+PONG\r\n");
    assert_eq!(h.run("get k"), "$-1\r\n");
    assert_eq!(h.run("SET k hello"), "+OK\r\n");
    assert_eq!(h.run("set k x NX"), "$-1\r\n");
    assert_eq!(h.run("set other x XX"), "$-1\r\n");
    assert_eq!(h.run("GET k"), "$5\r\nhello\r\n");
    assert_eq!(h.run("APPEND k !!"), ":7\r\n");
    assert_eq!(h.run("STRLEN k"), ":7\r\n");
    assert_eq!(h.run("INCR n"), ":1\r\n");
    assert_eq!(h.run("INCRBY n 41"), ":42\r\n");
    assert_eq!(h.run("DECR n"), ":41\r\n");
    assert_eq!(
        h.run("INCR k"),
        "-ERR value is not an integer or out of range\r\n"
    );
    assert_eq!(h.run("MSET a 1 b 2"), "+OK\r\n");
    assert_eq!(
        h.run("MGET a nope b"),
        "*3\r\n$1\r\n1\r\n$-1\r\n$1\r\n2\r\n"
    );
    assert_eq!(h.run("EXISTS a b nope"), ":2\r\n");
    assert_eq!(h.run("DEL a nope"), ":1\r\n");
    assert_eq!(h.run("DBSIZE"), ":3\r\n");
    assert_eq!(h.run("SET e v EX 100"), "+OK\r\n");
    assert_eq!(h.run("TTL e"), ":100\r\n");
    assert_eq!(
        h.run("SET e v EX 0"),
        "-ERR invalid expire time in 'set' command\r\n"
    );
    assert_eq!(h.run("SET e v BOGUS"), "-ERR syntax error\r\n");
    assert_eq!(h.run("SELECT 0"), "+OK\r\n");
    assert_eq!(
        h.run("CONFIG GET appendonly"),
        "*2\r\n$10\r\nappendonly\r\n$2\r\nno\r\n"
    );
    assert_eq!(h.run("CONFIG GET nosuch"), "*0\r\n");
    assert_eq!(h.run("SELECT 1"), "-ERR DB index is out of range\r\n");
    assert_eq!(h.run("FLUSHALL"), "+OK\r\n");
    assert_eq!(h.run("DBSIZE"), ":0\r\n");
    assert_eq!(h.state.budget().used(), 0);
}

#[test]
fn errors_have_redis_shapes() {
    let mut h = Harness::new(1 << 20, None);
    assert_eq!(
        h.run("GET"),
        "-ERR wrong number of arguments for 'get' command\r\n"
    );
    assert_eq!(
        h.run("FROB a b"),
        "-ERR unknown command 'FROB', with args beginning with: 'a' 'b' \r\n"
    );
    h.run("HSET h f v");
    assert_eq!(h.run("GET h"), format!("-{WRONG_TYPE}\r\n"));
    assert_eq!(h.run("ZADD h 1 m"), format!("-{WRONG_TYPE}\r\n"));
    assert_eq!(
        h.run("ZADD z notanumber m"),
        "-ERR value is not a valid float\r\n"
    );
    assert_eq!(
        h.run("HSET h f"),
        "-ERR wrong number of arguments for 'hset' command\r\n"
    );
}

#[test]
fn hashes_and_sorted_sets() {
    let mut h = Harness::new(1 << 20, None);
    assert_eq!(h.run("HSET u f1 a f2 b"), ":2\r\n");
    assert_eq!(h.run("HSET u f1 c"), ":0\r\n");
    assert_eq!(h.run("HMSET u f3 d"), "+OK\r\n");
    assert_eq!(h.run("HGET u f1"), "$1\r\nc\r\n");
    assert_eq!(h.run("HMGET u f2 zz"), "*2\r\n$1\r\nb\r\n$-1\r\n");
    assert_eq!(h.run("HLEN u"), ":3\r\n");
    assert!(h.run("HGETALL u").starts_with("*6\r\n"));
    assert_eq!(h.run("HDEL u f1 f2 f3"), ":3\r\n");
    assert_eq!(h.run("EXISTS u"), ":0\r\n");
    assert_eq!(h.run("ZADD idx 3 c 1 a 2 b"), ":3\r\n");
    assert_eq!(h.run("ZADD idx 1.5 a"), ":0\r\n");
    assert_eq!(h.run("ZSCORE idx a"), "$3\r\n1.5\r\n");
    assert_eq!(h.run("ZCARD idx"), ":3\r\n");
    assert_eq!(
        h.run("ZRANGEBYSCORE idx (1.5 +inf LIMIT 0 1"),
        "*1\r\n$1\r\nb\r\n"
    );
    assert_eq!(
        h.run("ZRANGEBYSCORE idx -inf 2 WITHSCORES"),
        "*4\r\n$1\r\na\r\n$3\r\n1.5\r\n$1\r\nb\r\n$1\r\n2\r\n"
    );
    assert_eq!(h.run("ZREM idx a nope"), ":1\r\n");
    assert_eq!(h.run("TYPE idx"), "+zset\r\n");
}

#[test]
fn versioned_commands_expose_versions_and_conflicts() {
    let mut h = Harness::new(1 << 20, None);
    assert_eq!(h.run("CAMELOT.GET k"), "$-1\r\n");
    let v1: i64 = h.run("CAMELOT.PUT k one")[1..].trim().parse().unwrap();
    assert_eq!(
        h.run("CAMELOT.GET k"),
        format!("*2\r\n:{v1}\r\n$3\r\none\r\n")
    );
    assert_eq!(h.run(&format!("CAMELOT.CAS k {} two", v1 + 100)), "$-1\r\n");
    assert_eq!(h.run("CAMELOT.CAS k 0 two"), "$-1\r\n");
    let v2: i64 = h.run(&format!("CAMELOT.CAS k {v1} two"))[1..]
        .trim()
        .parse()
        .unwrap();
    assert!(v2 > v1);
    h.run("CAMELOT.PUT j x");
    assert_eq!(
        h.run("CAMELOT.SCAN a 10"),
        format!(
            "*6\r\n$1\r\nj\r\n:{}\r\n$1\r\nx\r\n$1\r\nk\r\n:{v2}\r\n$3\r\ntwo\r\n",
            v2 + 1
        )
    );
    assert_eq!(h.run("CAMELOT.DEL k"), format!(":{v2}\r\n"));
    assert_eq!(h.run("CAMELOT.DEL k"), "$-1\r\n");
}

#[test]
fn a_token_requires_auth() {
    let mut h = Harness::new(1 << 20, Some("s3cret"));
    assert_eq!(h.run("GET k"), "-NOAUTH Authentication required.\r\n");
    assert!(h.run("AUTH wrong").starts_with("-WRONGPASS"));
    assert_eq!(h.run("AUTH s3cret"), "+OK\r\n");
    assert_eq!(h.run("GET k"), "$-1\r\n");
}

#[test]
fn a_full_server_answers_oom_and_keeps_its_data() {
    let mut h = Harness::new(4096, None);
    assert_eq!(h.run("SET keep v"), "+OK\r\n");
    let big = "x".repeat(5000);
    assert!(h.run(&format!("SET big {big}")).starts_with("-OOM"));
    assert!(h.run(&format!("HSET hh f {big}")).starts_with("-OOM"));
    assert_eq!(h.run("GET keep"), "$1\r\nv\r\n");
    assert!(h.state.budget().used() <= 4096);
}

#[test]
fn the_table_is_sorted_lower_case_and_unique() {
    for pair in COMMANDS.windows(2) {
        assert!(
            pair[0].name < pair[1].name,
            "{} before {}",
            pair[0].name,
            pair[1].name
        );
    }
    for c in COMMANDS {
        assert_eq!(c.name, c.name.to_ascii_lowercase());
        assert!(c.name.len() <= COMMAND_NAME_BYTES_MAX);
        assert!(std::ptr::eq(
            lookup(c.name.to_ascii_uppercase().as_bytes()).unwrap(),
            c
        ));
    }
    assert!(lookup(b"nosuch").is_none());
    assert!(lookup(&[b'g'; 100]).is_none());
}

#[test]
fn integers_follow_redis_string2ll() {
    let mut h = Harness::new(1 << 20, None);
    // What Redis 7 rejects and the old parser took.
    for bad in [
        "042",
        "-0",
        "+1",
        "01",
        "00",
        "1.0",
        "9223372036854775808",
        "-",
    ] {
        h.run("SET n 5");
        assert_eq!(
            h.run(&format!("INCRBY n {bad}")),
            format!("-{NOT_INTEGER}\r\n"),
            "{bad}"
        );
        h.run(&format!("SET n {bad}"));
        assert_eq!(h.run("INCR n"), format!("-{NOT_INTEGER}\r\n"), "{bad}");
    }
    assert_eq!(h.run("SET n 9223372036854775807"), "+OK\r\n");
    assert_eq!(
        h.run("INCR n"),
        "-ERR increment or decrement would overflow\r\n"
    );
    assert_eq!(h.run("SET n -9223372036854775808"), "+OK\r\n");
    assert_eq!(
        h.run("DECR n"),
        "-ERR increment or decrement would overflow\r\n"
    );
    assert_eq!(
        h.run("DECRBY n -9223372036854775808"),
        "-ERR decrement would overflow\r\n"
    );
    assert_eq!(h.run("INCRBY n 0"), ":-9223372036854775808\r\n");
    assert_eq!(h.run("SET n 0"), "+OK\r\n");
    assert_eq!(h.run("INCRBY n -42"), ":-42\r\n");
    assert_eq!(h.run("LRANGE l 01 2"), format!("-{NOT_INTEGER}\r\n"));
    assert_eq!(h.run("EXPIRE n +5"), format!("-{NOT_INTEGER}\r\n"));
    assert_eq!(h.run("SET k v EX 010"), format!("-{NOT_INTEGER}\r\n"));
    assert_eq!(h.run("GETRANGE n -0 1"), format!("-{NOT_INTEGER}\r\n"));
}

proptest::proptest! {
    /// A string is an integer to Redis iff it is the canonical decimal form of an i64.
    #[test]
    fn parse_int_is_the_round_trip_rule(s in "[-+ 0-9a]{0,21}|-?[0-9]{1,20}") {
        let canonical = s.parse::<i64>().ok().filter(|n| n.to_string() == s);
        proptest::prop_assert_eq!(parse_int(s.as_bytes()), canonical);
    }

    #[test]
    fn every_i64_reads_back(n in proptest::prelude::any::<i64>()) {
        proptest::prop_assert_eq!(parse_int(n.to_string().as_bytes()), Some(n));
    }
}

#[test]
fn clients_can_say_hello_and_name_themselves() {
    let mut h = Harness::new(1 << 20, None);
    let hello = h.run("HELLO");
    assert!(
        hello.starts_with("*14\r\n$6\r\nserver\r\n$5\r\nredis\r\n"),
        "{hello}"
    );
    assert!(hello.contains("$5\r\nproto\r\n:2\r\n"));
    assert_eq!(
        h.run("HELLO 4"),
        "-NOPROTO unsupported protocol version\r\n"
    );
    assert_eq!(
        h.run("HELLO x"),
        "-ERR Protocol version is not an integer or out of range\r\n"
    );
    assert_eq!(
        h.run("HELLO 2 foo"),
        "-ERR Syntax error in HELLO option 'foo'\r\n"
    );
    assert!(h.run("HELLO 2 SETNAME app").starts_with("*14\r\n"));
    assert!(h.run("HELLO 2 AUTH default any").starts_with("*14\r\n"));
    assert_eq!(h.run("CLIENT GETNAME"), "$3\r\napp\r\n");
    assert_eq!(h.run("CLIENT SETINFO LIB-NAME redis-py"), "+OK\r\n");
    assert_eq!(h.run("CLIENT SETINFO lib-ver 5.0.0"), "+OK\r\n");
    assert_eq!(h.run("CLIENT SETNAME other"), "+OK\r\n");
    assert_eq!(h.run("CLIENT GETNAME"), "$5\r\nother\r\n");
    assert_eq!(h.run("CLIENT ID"), format!(":{}\r\n", h.session.id));
    assert_eq!(
        h.run("CLIENT SETNAME"),
        "-ERR wrong number of arguments for 'client|setname' command\r\n"
    );
    assert_eq!(
        h.run("CLIENT foo"),
        "-ERR unknown subcommand 'foo'. Try CLIENT HELP.\r\n"
    );
    // With a token, HELLO can authenticate.
    let mut h = Harness::new(1 << 20, Some("tok"));
    assert!(h.run("HELLO 2").starts_with("-NOAUTH HELLO must be called"));
    assert!(h.run("HELLO 2 AUTH default nope").starts_with("-WRONGPASS"));
    assert!(h.run("HELLO 2 AUTH default tok").starts_with("*14\r\n"));
    assert_eq!(h.run("GET k"), "$-1\r\n");
}

#[test]
fn hello_3_switches_to_resp3_shapes() {
    let mut h = Harness::new(1 << 20, None);
    h.run("HSET h f v");
    h.run("SADD s m");
    h.run("ZADD z 1.5 a");
    assert_eq!(h.run("HGETALL h"), "*2\r\n$1\r\nf\r\n$1\r\nv\r\n");
    assert!(h.run("HELLO 3").starts_with("%7\r\n$6\r\nserver\r\n"));
    assert_eq!(h.run("GET nosuch"), "_\r\n");
    assert_eq!(h.run("LPOP nosuch 1"), "_\r\n");
    assert_eq!(h.run("HGETALL h"), "%1\r\n$1\r\nf\r\n$1\r\nv\r\n");
    assert_eq!(h.run("HGETALL nosuch"), "%0\r\n");
    assert_eq!(h.run("SMEMBERS s"), "~1\r\n$1\r\nm\r\n");
    assert_eq!(h.run("ZSCORE z a"), ",1.5\r\n");
    assert_eq!(
        h.run("ZRANGE z 0 -1 WITHSCORES"),
        "*1\r\n*2\r\n$1\r\na\r\n,1.5\r\n"
    );
    assert!(h.run("HELLO 2").starts_with("*14\r\n"));
    assert_eq!(h.run("GET nosuch"), "$-1\r\n");
}

#[test]
fn strings_ranges_and_expiries() {
    let mut h = Harness::new(1 << 20, None);
    assert_eq!(h.run("SETRANGE s 3 ab"), ":5\r\n");
    assert_eq!(h.run("GET s"), "$5\r\n\0\0\0ab\r\n");
    assert_eq!(h.run("GETRANGE s -2 -1"), "$2\r\nab\r\n");
    assert_eq!(h.run("GETRANGE s 10 20"), "$0\r\n\r\n");
    assert_eq!(h.run("SETRANGE s -1 x"), "-ERR offset is out of range\r\n");
    assert_eq!(h.run("SETRANGE s 536870912 x"), format!("-{TOO_BIG}\r\n"));
    assert_eq!(h.run("STRLEN s"), ":5\r\n");
    assert_eq!(h.run("TTL s"), ":-1\r\n");
    assert_eq!(h.run("EXPIRE s 100"), ":1\r\n");
    assert_eq!(h.run("TTL s"), ":100\r\n");
    assert_eq!(h.run("EXPIRE s 50 GT"), ":0\r\n");
    assert_eq!(h.run("EXPIRE s 50 LT"), ":1\r\n");
    assert_eq!(h.run("EXPIRE s 50 NX"), ":0\r\n");
    assert_eq!(
        h.run("EXPIRE s 50 NX XX"),
        "-ERR NX and XX, GT or LT options at the same time are not compatible\r\n"
    );
    assert_eq!(h.run("PERSIST s"), ":1\r\n");
    assert_eq!(h.run("PERSIST s"), ":0\r\n");
    assert_eq!(h.run("PEXPIRE s 100000"), ":1\r\n");
    let pttl: i64 = h.run("PTTL s")[1..].trim().parse().unwrap();
    assert!((99_000..=100_000).contains(&pttl), "{pttl}");
    assert_eq!(h.run("EXPIREAT s 1"), ":1\r\n");
    assert_eq!(h.run("EXISTS s"), ":0\r\n");
    assert_eq!(h.run("EXPIRE nosuch 10"), ":0\r\n");
    assert_eq!(
        h.run("EXPIRE s 99999999999999999"),
        "-ERR invalid expire time in 'expire' command\r\n"
    );
    assert_eq!(h.run("SET k v GET"), "$-1\r\n");
    assert_eq!(h.run("SET k w GET"), "$1\r\nv\r\n");
    assert_eq!(h.run("SET k v EX 10 KEEPTTL"), "-ERR syntax error\r\n");
}

#[test]
fn floats_follow_redis_strtod_rules() {
    assert_eq!(parse_float(b"1.5"), Some(1.5));
    assert_eq!(parse_float(b"-inf"), Some(f64::NEG_INFINITY));
    assert_eq!(parse_float(b"1e3"), Some(1000.0));
    assert_eq!(parse_float(b"0e5"), Some(0.0));
    for bad in [&b"1e999"[..], b"1e-999", b" 1", b"", b"nan", b"1x"] {
        assert_eq!(parse_float(bad), None, "{bad:?}");
    }
}

#[test]
fn lists_and_sets() {
    let mut h = Harness::new(1 << 20, None);
    assert_eq!(h.run("RPUSH l a b c"), ":3\r\n");
    assert_eq!(h.run("LPUSH l z"), ":4\r\n");
    assert_eq!(
        h.run("LRANGE l 0 -1"),
        "*4\r\n$1\r\nz\r\n$1\r\na\r\n$1\r\nb\r\n$1\r\nc\r\n"
    );
    assert_eq!(h.run("LRANGE l -2 99"), "*2\r\n$1\r\nb\r\n$1\r\nc\r\n");
    assert_eq!(h.run("LLEN l"), ":4\r\n");
    assert_eq!(h.run("LPOP l"), "$1\r\nz\r\n");
    assert_eq!(h.run("RPOP l 2"), "*2\r\n$1\r\nc\r\n$1\r\nb\r\n");
    assert_eq!(h.run("LPOP l 0"), "*0\r\n");
    assert_eq!(h.run("LPOP nosuch 2"), "*-1\r\n");
    assert_eq!(
        h.run("LPOP l -1"),
        "-ERR value is out of range, must be positive\r\n"
    );
    assert_eq!(h.run("RPOP l"), "$1\r\na\r\n");
    assert_eq!(h.run("TYPE l"), "+none\r\n");
    assert_eq!(h.run("SADD s a b a"), ":2\r\n");
    assert_eq!(h.run("SISMEMBER s a"), ":1\r\n");
    assert_eq!(h.run("SCARD s"), ":2\r\n");
    assert_eq!(h.run("SREM s a x"), ":1\r\n");
    assert_eq!(h.run("SMEMBERS s"), "*1\r\n$1\r\nb\r\n");
    assert_eq!(h.run("TYPE s"), "+set\r\n");
    assert_eq!(h.run("LPUSH s x"), format!("-{WRONG_TYPE}\r\n"));
    assert_eq!(h.run("SADD l2 x"), ":1\r\n");
    assert_eq!(h.run("DEL s l2"), ":2\r\n");
    assert_eq!(h.run("FLUSHALL"), "+OK\r\n");
    assert_eq!(h.state.budget().used(), 0);
}

#[test]
fn sorted_set_ranges_and_ranks() {
    let mut h = Harness::new(1 << 20, None);
    assert_eq!(h.run("ZADD z 1 a 2 b 3 c 1.1 d"), ":4\r\n");
    assert_eq!(h.run("ZRANGE z 0 1"), "*2\r\n$1\r\na\r\n$1\r\nd\r\n");
    assert_eq!(
        h.run("ZRANGE z 0 0 WITHSCORES REV"),
        "*2\r\n$1\r\nc\r\n$1\r\n3\r\n"
    );
    assert_eq!(h.run("ZREVRANGE z 0 0"), "*1\r\n$1\r\nc\r\n");
    assert_eq!(h.run("ZRANK z b"), ":2\r\n");
    assert_eq!(h.run("ZRANK z nope"), "$-1\r\n");
    assert_eq!(h.run("ZSCORE z d"), "$18\r\n1.1000000000000001\r\n");
    assert_eq!(
        h.run("ZRANGE z (1 3 BYSCORE LIMIT 1 1"),
        "*1\r\n$1\r\nb\r\n"
    );
    assert_eq!(
        h.run("ZRANGE z 3 2 BYSCORE REV"),
        "*2\r\n$1\r\nc\r\n$1\r\nb\r\n"
    );
    assert_eq!(
        h.run("ZRANGE z 0 1 LIMIT 0 1"),
        "-ERR syntax error, LIMIT is only supported in combination with either BYSCORE or BYLEX\r\n"
    );
    assert_eq!(h.run("ZADD z GT 0 a"), ":0\r\n");
    assert_eq!(h.run("ZSCORE z a"), "$1\r\n1\r\n");
}

#[test]
fn keys_globs_scan_info_and_command_count() {
    let mut h = Harness::new(1 << 20, None);
    for k in ["user:1", "user:2", "user:10", "order:1", "a*b"] {
        h.run(&format!("SET {k} v"));
    }
    assert_eq!(
        h.run("KEYS user:?"),
        "*2\r\n$6\r\nuser:1\r\n$6\r\nuser:2\r\n"
    );
    assert_eq!(
        h.run("KEYS *:1*"),
        "*3\r\n$7\r\norder:1\r\n$6\r\nuser:1\r\n$7\r\nuser:10\r\n"
    );
    assert_eq!(
        h.run("KEYS [ou]*:[^2]"),
        "*2\r\n$7\r\norder:1\r\n$6\r\nuser:1\r\n"
    );
    assert_eq!(h.run("KEYS a\\*b"), "*1\r\n$3\r\na*b\r\n");
    // A full SCAN walk sees every key exactly once, whatever COUNT is.
    for count in [1, 2, 100] {
        let mut seen = Vec::new();
        let mut cursor = "0".to_owned();
        for _ in 0..100 {
            let r = h.run(&format!("SCAN {cursor} COUNT {count} MATCH user:*"));
            let lines: Vec<&str> = r.split("\r\n").collect();
            cursor = lines[2].to_owned();
            seen.extend(lines[4..].iter().skip(1).step_by(2).map(|s| s.to_string()));
            if cursor == "0" {
                break;
            }
        }
        seen.retain(|s| !s.is_empty());
        seen.sort();
        assert_eq!(seen, ["user:1", "user:10", "user:2"], "count {count}");
    }
    assert_eq!(h.run("SCAN x"), "-ERR invalid cursor\r\n");
    assert_eq!(h.run("SCAN 0 COUNT 0"), "-ERR syntax error\r\n");
    let keyspace = h.run("INFO keyspace");
    assert!(
        keyspace.contains("# Keyspace") && !keyspace.contains("# Server"),
        "{keyspace}"
    );
    assert!(h.run("INFO").contains("# Server"));
    let memory = h.run("INFO memory");
    let field = |name: &str| {
        memory
            .split("\r\n")
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.parse::<u64>().ok())
    };
    assert!(field("maxmemory").is_some_and(|b| b > 0), "{memory}");
    assert!(
        field("camelot_connection_buffers_max").is_some_and(|b| b > 0),
        "{memory}"
    );
    assert!(field("mem_clients_normal").is_some(), "{memory}");
    assert_eq!(h.run("INFO nosuch"), "$0\r\n\r\n");
    let count = COMMANDS.iter().filter(|c| !c.is_refused()).count();
    assert!(count > 60);
    assert_eq!(h.run("COMMAND COUNT"), format!(":{count}\r\n"));
}

#[test]
fn commands_are_counted_by_group() {
    let mut h = Harness::new(1 << 20, None);
    h.run("SET a 1");
    h.run("GET a");
    h.run("ZADD z 1 m");
    h.run("NOSUCH");
    let ops = h.session.take_ops();
    assert_eq!(ops[Group::Strings.index()], 2);
    assert_eq!(ops[Group::SortedSets.index()], 1);
    assert_eq!(ops.iter().sum::<u64>(), 3);
    assert_eq!(h.session.take_ops().iter().sum::<u64>(), 0);
}

#[test]
fn unknown_commands_get_redis_text() {
    let mut h = Harness::new(1 << 20, None);
    let long = "x".repeat(200);
    assert_eq!(
        h.run(&format!("FROB {long} b")),
        format!(
            "-ERR unknown command 'FROB', with args beginning with: '{}' \r\n",
            &long[..128]
        )
    );
    assert_eq!(
        h.run("frob"),
        "-ERR unknown command 'frob', with args beginning with: \r\n"
    );
}

#[test]
fn transactions_answer_as_redis_7_does() {
    let mut h = Harness::new(1 << 20, None);
    assert_eq!(h.run("EXEC"), "-ERR EXEC without MULTI\r\n");
    assert_eq!(h.run("DISCARD"), "-ERR DISCARD without MULTI\r\n");
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run("MULTI"), "-ERR MULTI calls can not be nested\r\n");
    assert_eq!(
        h.run("WATCH a"),
        "-ERR WATCH inside MULTI is not allowed\r\n"
    );
    assert_eq!(h.run("SET a 1"), "+QUEUED\r\n");
    assert_eq!(h.run("INCR a"), "+QUEUED\r\n");
    assert_eq!(h.run("LPUSH a x"), "+QUEUED\r\n");
    assert_eq!(h.run("GET a"), "+QUEUED\r\n");
    // Nothing ran before EXEC; then all of it, a failing command's error in its slot.
    assert_eq!(
        h.run("EXEC"),
        "*4\r\n+OK\r\n:2\r\n-WRONGTYPE Operation against a key holding the wrong kind of value\r\n$1\r\n2\r\n"
    );
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run("SET a 5"), "+QUEUED\r\n");
    assert_eq!(h.run("DISCARD"), "+OK\r\n");
    assert_eq!(h.run("GET a"), "$1\r\n2\r\n");
    // A command refused while queuing aborts the whole transaction.
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run("SET a 6"), "+QUEUED\r\n");
    assert_eq!(
        h.run("GET"),
        "-ERR wrong number of arguments for 'get' command\r\n"
    );
    assert_eq!(
        h.run("EXEC"),
        "-EXECABORT Transaction discarded because of previous errors.\r\n"
    );
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert!(h.run("NOPE x").starts_with("-ERR unknown command 'NOPE'"));
    assert_eq!(
        h.run("EXEC"),
        "-EXECABORT Transaction discarded because of previous errors.\r\n"
    );
    assert_eq!(h.run("GET a"), "$1\r\n2\r\n");
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run("EXEC"), "*0\r\n");
}

#[test]
fn watch_aborts_exec_when_a_watched_key_changed() {
    let mut h = Harness::new(1 << 20, None);
    let mut other = Session::default();
    let run_other = |h: &Harness, other: &mut Session, line: &str| {
        let args: Vec<&[u8]> = line.split_whitespace().map(str::as_bytes).collect();
        let ctx = Ctx {
            state: &h.state,
            token: None,
        };
        let mut out = BytesMut::new();
        execute(&ctx, other, &args, Instant::now(), &mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    assert_eq!(h.run("SET epoch 1"), "+OK\r\n");
    // Unchanged: EXEC runs.
    assert_eq!(h.run("WATCH epoch"), "+OK\r\n");
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run("SET v a"), "+QUEUED\r\n");
    assert_eq!(h.run("EXEC"), "*1\r\n+OK\r\n");
    // Another connection's change between WATCH and EXEC: nil, nothing ran.
    for change in [
        "INCR epoch",
        "SETRANGE epoch 0 9",
        "DEL epoch",
        "SET epoch 1",
    ] {
        assert_eq!(h.run("WATCH epoch"), "+OK\r\n");
        assert!(!run_other(&h, &mut other, change).starts_with('-'));
        assert_eq!(h.run("MULTI"), "+OK\r\n");
        assert_eq!(h.run("SET v b"), "+QUEUED\r\n");
        assert_eq!(h.run("EXEC"), "*-1\r\n", "after {change}");
        assert_eq!(h.run("GET v"), "$1\r\na\r\n", "after {change}");
    }
    // A watched absent key that appears aborts too; EXEC and UNWATCH forget the watch.
    assert_eq!(h.run("WATCH fresh"), "+OK\r\n");
    assert_eq!(run_other(&h, &mut other, "SET fresh 1"), "+OK\r\n");
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run("EXEC"), "*-1\r\n");
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run("EXEC"), "*0\r\n");
    assert_eq!(h.run("WATCH fresh"), "+OK\r\n");
    assert_eq!(h.run("UNWATCH"), "+OK\r\n");
    assert_eq!(run_other(&h, &mut other, "SET fresh 2"), "+OK\r\n");
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run("EXEC"), "*0\r\n");
    h.session.resp3 = true;
    assert_eq!(h.run("WATCH fresh"), "+OK\r\n");
    assert_eq!(run_other(&h, &mut other, "SET fresh 3"), "+OK\r\n");
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run("EXEC"), "_\r\n");
}

#[test]
fn transaction_queue_and_watches_are_bounded() {
    let mut h = Harness::new(64 << 20, None);
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    for _ in 0..QUEUED_COMMANDS_MAX {
        assert_eq!(h.run("INCR n"), "+QUEUED\r\n");
    }
    assert!(h.run("INCR n").starts_with("-ERR transaction too large"));
    assert_eq!(
        h.run("EXEC"),
        "-EXECABORT Transaction discarded because of previous errors.\r\n"
    );
    assert_eq!(h.run("GET n"), "$-1\r\n");
    let big = "x".repeat(1 << 20);
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    let mut refused = false;
    for _ in 0..=QUEUED_BYTES_MAX >> 20 {
        let r = h.run(&format!("SET k {big}"));
        if r.starts_with("-ERR transaction too large") {
            refused = true;
            break;
        }
        assert_eq!(r, "+QUEUED\r\n");
    }
    assert!(refused, "more than {QUEUED_BYTES_MAX} bytes were queued");
    assert!(h.run("EXEC").starts_with("-EXECABORT"));
    let keys: Vec<String> = (0..=WATCHED_KEYS_MAX).map(|i| format!("k{i}")).collect();
    assert!(h
        .run(&format!("WATCH {}", keys.join(" ")))
        .starts_with("-ERR too many watched keys"));
    assert_eq!(
        h.run(&format!("WATCH {}", keys[..WATCHED_KEYS_MAX].join(" "))),
        "+OK\r\n"
    );
}

/// EXEC's commands run as one step: a reader on another thread never sees the first of
/// two queued SETs without the second.
#[test]
fn exec_is_atomic_to_other_threads() {
    // Run until the reader has overlapped this many transactions (or the time is up).
    const READS_MIN: u64 = 50_000;
    const DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);
    let reads_done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let state = std::sync::Arc::new(ServerState::new(MemoryBudget::new(1 << 24), 0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let state = std::sync::Arc::clone(&state);
        let stop = std::sync::Arc::clone(&stop);
        let reads_done = std::sync::Arc::clone(&reads_done);
        std::thread::spawn(move || {
            let mut torn = 0u64;
            let mut reads = 0u64;
            let mut session = Session::default();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let ctx = Ctx {
                    state: &state,
                    token: None,
                };
                let mut out = BytesMut::new();
                execute(
                    &ctx,
                    &mut session,
                    &[b"MGET", b"a", b"b"],
                    Instant::now(),
                    &mut out,
                );
                let text = String::from_utf8_lossy(&out).into_owned();
                let values: Vec<&str> = text
                    .split("\r\n")
                    .filter(|l| !l.starts_with(['*', '$']))
                    .collect();
                if values.len() >= 2 && values[0] != values[1] {
                    torn += 1;
                }
                reads += 1;
                reads_done.store(reads, std::sync::atomic::Ordering::Relaxed);
            }
            (torn, reads)
        })
    };
    let mut session = Session::default();
    let started = Instant::now();
    let mut i = 0u64;
    while reads_done.load(std::sync::atomic::Ordering::Relaxed) < READS_MIN
        && started.elapsed() < DEADLINE
    {
        i += 1;
        let v = i.to_string();
        for args in [
            vec![&b"MULTI"[..]],
            vec![b"SET", b"a", v.as_bytes()],
            vec![b"SET", b"b", v.as_bytes()],
            vec![b"EXEC"],
        ] {
            let ctx = Ctx {
                state: &state,
                token: None,
            };
            let mut out = BytesMut::new();
            execute(&ctx, &mut session, &args, Instant::now(), &mut out);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (torn, reads) = reader.join().expect("reader");
    assert!(reads > 0);
    assert_eq!(torn, 0, "{torn} of {reads} MGETs saw a half-applied EXEC");
}

/// Queued arguments are charged to the connection-buffer budget, refused past it (the
/// transaction then aborts), and given back by EXEC and DISCARD.
#[test]
fn queued_commands_are_charged_to_the_connection_budget() {
    let buffers = MemoryBudget::new(4_096);
    let mut h = Harness::new(1 << 20, None);
    h.state = ServerState::with_limits(
        MemoryBudget::new(1 << 20),
        std::sync::Arc::clone(&buffers),
        0,
        crate::store::Quota::UNLIMITED,
    );
    let value = "v".repeat(1_000);
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run(&format!("SET k {value}")), "+QUEUED\r\n");
    assert!(buffers.used() >= 1_000);
    assert_eq!(h.run("DISCARD"), "+OK\r\n");
    assert_eq!(buffers.used(), 0);
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    let mut refused = false;
    for _ in 0..5 {
        let r = h.run(&format!("SET k {value}"));
        if r.starts_with("-ERR connection buffer memory exhausted") {
            refused = true;
            break;
        }
        assert_eq!(r, "+QUEUED\r\n");
    }
    assert!(refused, "queued past a 4 KiB connection budget");
    assert_eq!(buffers.used(), 0, "an aborted queue still holds memory");
    assert!(h.run("EXEC").starts_with("-EXECABORT"));
    assert_eq!(h.run("MULTI"), "+OK\r\n");
    assert_eq!(h.run(&format!("SET k {value}")), "+QUEUED\r\n");
    assert_eq!(h.run("EXEC"), "*1\r\n+OK\r\n");
    assert_eq!(buffers.used(), 0);
}

/// Arguments may be longer than anything stored may be (`proto-max-bulk-len`, 512 MiB):
/// an APPEND that would make a key too long is refused whether or not the key exists
/// (before, a missing key took any length, and a native GET of it then failed to encode
/// and closed the connection); a WATCH of a key no key can be is not kept; a client
/// name has a limit.
#[test]
fn arguments_longer_than_stored_things_may_be_are_not_kept() {
    use camelot_proto::limits::{KEY_BYTES_MAX, VALUE_BYTES_MAX};
    let mut h = Harness::new(256 << 20, None);
    let long = vec![b'x'; VALUE_BYTES_MAX + 1];
    assert_eq!(
        h.run_args(&[b"APPEND", b"fresh", &long]),
        format!("-{TOO_BIG}\r\n")
    );
    assert_eq!(h.run("EXISTS fresh"), ":0\r\n");
    assert_eq!(h.run("APPEND k ab"), ":2\r\n");
    assert_eq!(
        h.run_args(&[b"APPEND", b"k", &long[..VALUE_BYTES_MAX - 1]]),
        format!("-{TOO_BIG}\r\n")
    );

    // As many over-long keys as may be watched, then as many real ones: the second WATCH
    // is within the limit only if the first kept nothing.
    let huge: Vec<Vec<u8>> = (0..WATCHED_KEYS_MAX)
        .map(|i| format!("{i:0>width$}", width = KEY_BYTES_MAX + 1).into_bytes())
        .collect();
    let mut watch: Vec<&[u8]> = vec![b"WATCH"];
    watch.extend(huge.iter().map(Vec::as_slice));
    assert_eq!(h.run_args(&watch), "+OK\r\n");
    let keys: Vec<String> = (0..WATCHED_KEYS_MAX).map(|i| format!("w{i}")).collect();
    assert_eq!(h.run(&format!("WATCH {}", keys.join(" "))), "+OK\r\n");
    assert_eq!(h.run("UNWATCH"), "+OK\r\n");

    let name = vec![b'n'; super::server::CLIENT_NAME_BYTES_MAX + 1];
    assert!(h
        .run_args(&[b"CLIENT", b"SETNAME", &name])
        .starts_with("-ERR client names are at most"));
    assert_eq!(h.run("CLIENT GETNAME"), "$-1\r\n");
    assert!(h
        .run_args(&[b"HELLO", b"2", b"SETNAME", &name])
        .starts_with("-ERR client names are at most"));
    assert_eq!(h.run("CLIENT SETNAME ok"), "+OK\r\n");
    assert_eq!(h.run("CLIENT GETNAME"), "$2\r\nok\r\n");
}
