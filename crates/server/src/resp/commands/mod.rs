//! The Redis commands the port understands, executed against the server's objects. Pure:
//! a command's arguments in, its reply appended to a buffer. Error texts are Redis 7's,
//! word for word, because client libraries match on them.
//!
//! [`COMMANDS`] is the one list of what the port supports: one row per command with its
//! name, arity, flags, group and handler. Dispatch, arity checks, `COMMAND COUNT` and the
//! README's command list ([`commands_markdown`]) are all read from it, so they cannot
//! disagree. The handlers live in one module per group.

mod camelot;
mod hashes;
mod keys;
mod lists;
mod reply;
mod server;
mod sets;
mod strings;
mod transactions;
mod zsets;

use crate::objects::ObjectStore;
use crate::state::{ServerState, RESP_GROUPS};
use bytes::{Bytes, BytesMut};
use camelot_proto::{ErrorCode, ErrorReply};
pub use reply::Reply;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Longest command name we know, with room to spare; longer names are unknown commands.
const COMMAND_NAME_BYTES_MAX: usize = 32;

pub(crate) const WRONG_TYPE: &str =
    "WRONGTYPE Operation against a key holding the wrong kind of value";
pub(crate) const NOT_INTEGER: &str = "ERR value is not an integer or out of range";
pub(crate) const NOT_FLOAT: &str = "ERR value is not a valid float";
pub(crate) const SYNTAX: &str = "ERR syntax error";
pub(crate) const TOO_BIG: &str = "ERR string exceeds maximum allowed size (proto-max-bulk-len)";

/// The command groups, each a module of handlers and a counter in the server's stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Strings,
    Hashes,
    Lists,
    Sets,
    SortedSets,
    Keys,
    Server,
    Camelot,
}

impl Group {
    pub const ALL: [Group; RESP_GROUPS.len()] = [
        Group::Strings,
        Group::Hashes,
        Group::Lists,
        Group::Sets,
        Group::SortedSets,
        Group::Keys,
        Group::Server,
        Group::Camelot,
    ];

    /// The name in stats (`ops_resp_<name>`) and in the README.
    pub fn name(self) -> &'static str {
        RESP_GROUPS[self.index()]
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Command flags (a bit set, as Redis's command table has).
pub mod flags {
    /// Changes data.
    pub const WRITE: u8 = 1;
    /// Only reads data.
    pub const READONLY: u8 = 2;
    /// Runs before AUTH (AUTH, HELLO, QUIT).
    pub const NO_AUTH: u8 = 4;
    /// Known to Redis but refused here with a clear error (none at present).
    pub const REFUSED: u8 = 8;
    /// Runs at once between MULTI and EXEC instead of being queued.
    pub const NO_QUEUE: u8 = 16;
    /// Takes the object store to itself (EXEC), so must not run inside its shared gate.
    pub const EXCLUSIVE: u8 = 32;
}

/// Per-connection state.
#[derive(Debug)]
pub struct Session {
    pub authenticated: bool,
    /// Set by QUIT: reply, flush, close.
    pub quit: bool,
    /// CLIENT ID: unique for the life of the process, as in Redis.
    pub id: u64,
    /// CLIENT SETNAME / HELLO SETNAME.
    pub name: Option<Bytes>,
    /// The connection asked for RESP3 (`HELLO 3`).
    pub resp3: bool,
    /// Commands run since the last [`Session::take_ops`], by [`Group`]; folded into the
    /// shared counters once per socket read, not per command.
    ops: [u64; RESP_GROUPS.len()],
    /// MULTI's queue and the WATCHed keys.
    tx: transactions::TxState,
}

pub use transactions::{QUEUED_BYTES_MAX, QUEUED_COMMANDS_MAX, WATCHED_KEYS_MAX};

static NEXT_CLIENT_ID: AtomicU64 = AtomicU64::new(1);

impl Default for Session {
    fn default() -> Self {
        Session {
            authenticated: false,
            quit: false,
            id: NEXT_CLIENT_ID.fetch_add(1, Ordering::Relaxed),
            name: None,
            resp3: false,
            ops: [0; RESP_GROUPS.len()],
            tx: transactions::TxState::default(),
        }
    }
}

impl Session {
    /// The per-group command counts since the last call, reset to zero.
    pub fn take_ops(&mut self) -> [u64; RESP_GROUPS.len()] {
        std::mem::take(&mut self.ops)
    }
}

pub struct Ctx<'a> {
    pub state: &'a ServerState,
    pub token: Option<&'a [u8]>,
}

/// One command being run: what a handler gets.
pub struct Call<'c> {
    pub ctx: &'c Ctx<'c>,
    pub session: &'c mut Session,
    pub args: &'c [&'c [u8]],
    /// The time expiries are judged against (one reading per socket read).
    pub now: Instant,
    pub out: &'c mut Reply<'c>,
}

impl Call<'_> {
    fn objects(&self) -> &ObjectStore {
        self.ctx.state.objects()
    }
    fn error(&mut self, msg: &str) {
        self.out.error(msg);
    }
    /// Redis's arity error, for subcommands and commands whose arity depends on options.
    fn arity(&mut self, name: &str) {
        arity_error(self.out, name);
    }
    /// Maps a store error to the reply Redis would give.
    fn store_error(&mut self, e: &ErrorReply) {
        self.out.store_error(e);
    }
    /// Argument `i` as an integer, or Redis's not-an-integer reply and `None`.
    fn int_arg(&mut self, i: usize) -> Option<i64> {
        let v = parse_int(self.args[i]);
        if v.is_none() {
            self.error(NOT_INTEGER);
        }
        v
    }
}

type Handler = fn(&mut Call<'_>);

/// One row of the command table.
pub struct Command {
    /// Lower case, as Redis lists it.
    pub name: &'static str,
    /// As Redis declares it: positive = exactly this many words (the name included),
    /// negative = at least that many.
    pub arity: i32,
    pub flags: u8,
    pub group: Group,
    handler: Handler,
}

impl Command {
    fn arity_ok(&self, words: usize) -> bool {
        if self.arity >= 0 {
            words == self.arity as usize
        } else {
            words >= self.arity.unsigned_abs() as usize
        }
    }

    pub fn is_refused(&self) -> bool {
        self.flags & flags::REFUSED != 0
    }
}

const fn row(name: &'static str, arity: i32, flags: u8, group: Group, handler: Handler) -> Command {
    Command {
        name,
        arity,
        flags,
        group,
        handler,
    }
}

use flags::{EXCLUSIVE, NO_AUTH, NO_QUEUE as NQ, READONLY as R, WRITE as W};
use Group::{Camelot as C, Hashes as H, Keys as K, Lists as L, Server as S, Sets as T};
use Group::{SortedSets as Z, Strings as Str};

/// Every command, sorted by name (a test checks), looked up by binary search.
pub static COMMANDS: &[Command] = &[
    row("append", 3, W, Str, strings::append),
    row("auth", -2, NO_AUTH, S, server::auth),
    row("camelot.cas", 4, W, C, camelot::cas),
    row("camelot.del", 2, W, C, camelot::del),
    row("camelot.get", 2, R, C, camelot::get),
    row("camelot.put", 3, W, C, camelot::put),
    row("camelot.scan", 3, R, C, camelot::scan),
    row("client", -2, 0, S, server::client),
    row("command", -1, 0, S, server::command),
    row("config", -2, 0, S, server::config),
    row("dbsize", 1, R, S, server::dbsize),
    row("decr", 2, W, Str, strings::decr),
    row("decrby", 3, W, Str, strings::decrby),
    row("del", -2, W, K, keys::del),
    row("discard", 1, NQ, S, transactions::discard),
    row("echo", 2, 0, S, server::echo),
    row("exec", 1, NQ | EXCLUSIVE, S, transactions::exec),
    row("exists", -2, R, K, keys::exists),
    row("expire", -3, W, K, keys::expire),
    row("expireat", -3, W, K, keys::expireat),
    row("flushall", -1, W, S, server::flushall),
    row("flushdb", -1, W, S, server::flushall),
    row("get", 2, R, Str, strings::get),
    row("getrange", 4, R, Str, strings::getrange),
    row("hdel", -3, W, H, hashes::hdel),
    row("hello", -1, NO_AUTH, S, server::hello),
    row("hget", 3, R, H, hashes::hget),
    row("hgetall", 2, R, H, hashes::hgetall),
    row("hlen", 2, R, H, hashes::hlen),
    row("hmget", -3, R, H, hashes::hmget),
    row("hmset", -4, W, H, hashes::hmset),
    row("hset", -4, W, H, hashes::hset),
    row("incr", 2, W, Str, strings::incr),
    row("incrby", 3, W, Str, strings::incrby),
    row("info", -1, 0, S, server::info),
    row("keys", 2, R, K, keys::keys),
    row("llen", 2, R, L, lists::llen),
    row("lpop", -2, W, L, lists::lpop),
    row("lpush", -3, W, L, lists::lpush),
    row("lrange", 4, R, L, lists::lrange),
    row("mget", -2, R, Str, strings::mget),
    row("mset", -3, W, Str, strings::mset),
    row("multi", 1, NQ, S, transactions::multi),
    row("persist", 2, W, K, keys::persist),
    row("pexpire", -3, W, K, keys::pexpire),
    row("pexpireat", -3, W, K, keys::pexpireat),
    row("ping", -1, 0, S, server::ping),
    row("pttl", 2, R, K, keys::pttl),
    row("quit", -1, NO_AUTH | NQ, S, server::quit),
    row("rpop", -2, W, L, lists::rpop),
    row("rpush", -3, W, L, lists::rpush),
    row("sadd", -3, W, T, sets::sadd),
    row("scan", -2, R, K, keys::scan),
    row("scard", 2, R, T, sets::scard),
    row("select", 2, 0, S, server::select),
    row("set", -3, W, Str, strings::set),
    row("setrange", 4, W, Str, strings::setrange),
    row("sismember", 3, R, T, sets::sismember),
    row("smembers", 2, R, T, sets::smembers),
    row("srem", -3, W, T, sets::srem),
    row("strlen", 2, R, Str, strings::strlen),
    row("ttl", 2, R, K, keys::ttl),
    row("type", 2, R, K, keys::type_),
    row("unwatch", 1, 0, S, transactions::unwatch),
    row("watch", -2, NQ, S, transactions::watch),
    row("zadd", -4, W, Z, zsets::zadd),
    row("zcard", 2, R, Z, zsets::zcard),
    row("zrange", -4, R, Z, zsets::zrange),
    row("zrangebyscore", -4, R, Z, zsets::zrangebyscore),
    row("zrank", 3, R, Z, zsets::zrank),
    row("zrem", -3, W, Z, zsets::zrem),
    row("zrevrange", -4, R, Z, zsets::zrevrange),
    row("zscore", 3, R, Z, zsets::zscore),
];

/// The row for a command name, in any letter case.
pub fn lookup(name: &[u8]) -> Option<&'static Command> {
    if name.len() > COMMAND_NAME_BYTES_MAX {
        return None;
    }
    // Lower-cased on the stack: this runs for every command.
    let mut buf = [0u8; COMMAND_NAME_BYTES_MAX];
    let lower = &mut buf[..name.len()];
    lower.copy_from_slice(name);
    lower.make_ascii_lowercase();
    COMMANDS
        .binary_search_by(|c| c.name.as_bytes().cmp(lower))
        .ok()
        .map(|i| &COMMANDS[i])
}

/// Runs one command and appends its reply to `out`.
/// `now` is the time expiries are judged against.
pub fn execute(
    ctx: &Ctx<'_>,
    session: &mut Session,
    args: &[&[u8]],
    now: Instant,
    out: &mut BytesMut,
) {
    let out = &mut Reply::new(out, session.resp3);
    run(ctx, session, args, now, out);
}

/// Runs (or, between MULTI and EXEC, queues) one command, its reply going to `out`.
fn run(ctx: &Ctx<'_>, session: &mut Session, args: &[&[u8]], now: Instant, out: &mut Reply<'_>) {
    let Some(name) = args.first() else {
        return;
    };
    // Redis's order: unknown command, then arity, then authentication.
    let Some(cmd) = lookup(name) else {
        unknown_command(out, args);
        session.tx.flag_error();
        return;
    };
    if !cmd.arity_ok(args.len()) {
        arity_error(out, cmd.name);
        session.tx.flag_error();
        return;
    }
    if ctx.token.is_some() && !session.authenticated && cmd.flags & NO_AUTH == 0 {
        out.error("NOAUTH Authentication required.");
        session.tx.flag_error();
        return;
    }
    if session.tx.in_multi() && cmd.flags & NQ == 0 {
        match session.tx.enqueue(args, ctx.state.connection_buffers()) {
            Ok(()) => out.simple("QUEUED"),
            Err(e) => out.error(&e),
        }
        return;
    }
    session.ops[cmd.group.index()] += 1;
    // A command's store operations run as one step with respect to EXEC (MGET never
    // sees half a transaction); inside EXEC this is free.
    let _gate = (cmd.flags & EXCLUSIVE == 0).then(|| ctx.state.objects().gate());
    let out = &mut out.reborrow();
    let mut call = Call {
        ctx,
        session,
        args,
        now,
        out,
    };
    (cmd.handler)(&mut call);
}

/// Redis 7's answer to a command it does not know: the name and the first arguments,
/// each cut so the list stays near 128 bytes, as `processCommand` formats them (a C
/// string, so each stops at a NUL byte).
fn unknown_command(out: &mut Reply<'_>, args: &[&[u8]]) {
    const SHOWN_BYTES_MAX: usize = 128;
    let c_str = |b: &[u8]| -> Vec<u8> { b.split(|&c| c == 0).next().unwrap_or(b).to_vec() };
    let mut shown: Vec<u8> = Vec::new();
    for a in &args[1..] {
        if shown.len() >= SHOWN_BYTES_MAX {
            break;
        }
        let room = SHOWN_BYTES_MAX - shown.len();
        let a = c_str(a);
        shown.push(b'\'');
        shown.extend_from_slice(&a[..a.len().min(room)]);
        shown.extend_from_slice(b"' ");
    }
    let name = c_str(args[0]);
    let mut msg = b"ERR unknown command '".to_vec();
    msg.extend_from_slice(&name[..name.len().min(SHOWN_BYTES_MAX)]);
    msg.extend_from_slice(b"', with args beginning with: ");
    msg.extend_from_slice(&shown);
    out.error_bytes(&msg);
}

pub(crate) fn arity_error(out: &mut Reply<'_>, name: &str) {
    out.error(&format!(
        "ERR wrong number of arguments for '{name}' command"
    ));
}

impl Reply<'_> {
    /// Maps a store error to the reply Redis would give.
    pub(crate) fn store_error(&mut self, e: &ErrorReply) {
        match e.code {
            ErrorCode::WrongType => self.error(WRONG_TYPE),
            ErrorCode::OutOfMemory => {
                self.error("OOM command not allowed when used memory > 'maxmemory'.")
            }
            // Handlers that build a Redis reply text themselves pass it through whole.
            ErrorCode::BadRequest if e.message.starts_with("ERR ") => self.error(&e.message),
            _ => self.error(&format!("ERR {}", e.message)),
        }
    }
}

/// A Redis error text carried out of an [`ObjectStore::modify`] closure.
pub(crate) fn redis_error(msg: &str) -> ErrorReply {
    ErrorReply::new(ErrorCode::BadRequest, msg)
}

/// An integer as Redis's `string2ll` reads one: exactly the canonical decimal form of an
/// i64 — an optional `-`, no `+`, no leading zeros (`0` alone is fine, `-0` is not), no
/// spaces, nothing after the digits. So a string is an integer iff printing the number
/// gives the string back, which the property test checks.
pub fn parse_int(b: &[u8]) -> Option<i64> {
    let (negative, digits) = match b.split_first()? {
        (b'-', rest) => (true, rest),
        _ => (false, b),
    };
    match digits {
        [b'0'] if !negative => return Some(0),
        [b'1'..=b'9', ..] if digits.len() <= 19 => {}
        _ => return None,
    }
    let mut magnitude: u64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        magnitude = magnitude
            .checked_mul(10)?
            .checked_add(u64::from(d - b'0'))?;
    }
    if negative {
        0i64.checked_sub_unsigned(magnitude)
    } else {
        i64::try_from(magnitude).ok()
    }
}

/// A float as Redis's `getDoubleFromObject` reads one (`strtod` of the whole string, no
/// spaces, no NaN).
pub(crate) fn parse_float(b: &[u8]) -> Option<f64> {
    let s = std::str::from_utf8(b).ok()?;
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_whitespace()) {
        return None;
    }
    let x = match s.to_ascii_lowercase().as_str() {
        "inf" | "+inf" | "infinity" | "+infinity" => f64::INFINITY,
        "-inf" | "-infinity" => f64::NEG_INFINITY,
        t if t.contains("inf") || t.contains("nan") => return None,
        t => {
            let x: f64 = t.parse().ok()?;
            // strtod's ERANGE, which Redis refuses: overflow to infinity, or underflow
            // of a non-zero number to zero.
            let mantissa = t.split(['e', 'E']).next().unwrap_or("");
            let underflow = x == 0.0 && mantissa.bytes().any(|b| (b'1'..=b'9').contains(&b));
            if x.is_infinite() || underflow {
                return None;
            }
            x
        }
    };
    (!x.is_nan()).then_some(x)
}

pub(crate) fn is(arg: &[u8], word: &str) -> bool {
    arg.eq_ignore_ascii_case(word.as_bytes())
}

/// Redis's glob (`stringmatchlen`): `*`, `?`, `[abc]`, `[^a]`, `[a-z]` (either way
/// round), and `\` quoting the next byte; byte-wise, case-sensitive.
pub fn glob_match(pattern: &[u8], s: &[u8]) -> bool {
    glob_at(pattern, s, 0, &mut false)
}

/// Nesting bound for `*`: Redis stops at 1000 levels too.
const GLOB_NESTING_MAX: usize = 1000;

/// `give_up` is Redis's `skipLongerMatches`: once a `*` has tried every tail of the
/// string and failed, no outer `*` can do better, which keeps `*a*a*a*b` linear-ish
/// instead of exponential.
fn glob_at(mut p: &[u8], mut s: &[u8], nesting: usize, give_up: &mut bool) -> bool {
    if nesting > GLOB_NESTING_MAX {
        return false;
    }
    while let Some(&c) = p.first() {
        match c {
            b'*' => {
                while p.get(1) == Some(&b'*') {
                    p = &p[1..];
                }
                if p.len() == 1 {
                    return true;
                }
                while !s.is_empty() {
                    if glob_at(&p[1..], s, nesting + 1, give_up) {
                        return true;
                    }
                    if *give_up {
                        return false;
                    }
                    s = &s[1..];
                }
                *give_up = true;
                return false;
            }
            b'?' => {
                if s.is_empty() {
                    return false;
                }
                s = &s[1..];
            }
            b'[' => {
                let Some(&sc) = s.first() else {
                    return false;
                };
                p = &p[1..];
                let not = p.first() == Some(&b'^');
                if not {
                    p = &p[1..];
                }
                let mut matched = false;
                loop {
                    match p {
                        [b'\\', q, ..] => {
                            matched |= *q == sc;
                            p = &p[2..];
                        }
                        [b']', ..] => break,
                        [] => {
                            // Unterminated: Redis treats the end as the close.
                            p = &p[..0];
                            break;
                        }
                        [lo, b'-', hi, ..] => {
                            let (lo, hi) = if lo <= hi { (*lo, *hi) } else { (*hi, *lo) };
                            matched |= (lo..=hi).contains(&sc);
                            p = &p[3..];
                        }
                        [q, ..] => {
                            matched |= *q == sc;
                            p = &p[1..];
                        }
                    }
                }
                if not {
                    matched = !matched;
                }
                if !matched {
                    return false;
                }
                s = &s[1..];
                if p.is_empty() {
                    // The unterminated class was the pattern's end.
                    return s.is_empty();
                }
            }
            b'\\' if p.len() >= 2 => {
                p = &p[1..];
                if s.first() != p.first() {
                    return false;
                }
                s = &s[1..];
            }
            _ => {
                if s.first() != Some(&c) {
                    return false;
                }
                s = &s[1..];
            }
        }
        p = &p[1..];
    }
    s.is_empty()
}

/// The README's list of supported commands, generated from [`COMMANDS`]. The README
/// holds it between the markers below; a test checks it is current, and
/// `CAMELOT_BLESS=1 cargo test -p camelot-server --test readme_commands` rewrites it.
pub fn commands_markdown() -> String {
    let mut md = String::new();
    md.push_str("| group | commands |\n|---|---|\n");
    for group in Group::ALL {
        let names: Vec<String> = COMMANDS
            .iter()
            .filter(|c| c.group == group && !c.is_refused())
            .map(|c| format!("`{}`", c.name.to_ascii_uppercase()))
            .collect();
        if !names.is_empty() {
            md.push_str(&format!("| {} | {} |\n", group.name(), names.join(" ")));
        }
    }
    let refused: Vec<String> = COMMANDS
        .iter()
        .filter(|c| c.is_refused())
        .map(|c| format!("`{}`", c.name.to_ascii_uppercase()))
        .collect();
    md.push('\n');
    if !refused.is_empty() {
        md.push_str(&format!(
            "Known but refused with `-ERR ... not supported by Camelot`: {}. ",
            refused.join(" ")
        ));
    }
    md.push_str(&format!(
        "Every other command gets Redis's own `-ERR unknown command '…', with args \
         beginning with: …` reply. MULTI/EXEC/WATCH behave as Redis's: EXEC runs its queue \
         with no other command of any connection in between (at most {QUEUED_COMMANDS_MAX} \
         commands and {} MiB of arguments queued, {WATCHED_KEYS_MAX} keys watched per \
         connection).\n",
        QUEUED_BYTES_MAX >> 20
    ));
    md
}

pub const README_BEGIN: &str = "<!-- resp-commands:begin (generated from the command table) -->";
pub const README_END: &str = "<!-- resp-commands:end -->";

#[cfg(test)]
mod tests;
