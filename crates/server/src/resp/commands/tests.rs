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
        let ctx = Ctx {
            state: &self.state,
            token: self.token.as_deref(),
        };
        let mut out = BytesMut::new();
        execute(&ctx, &mut self.session, &args, Instant::now(), &mut out);
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
