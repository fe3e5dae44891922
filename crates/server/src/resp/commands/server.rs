//! Connection and server commands: PING, ECHO, SELECT, AUTH, HELLO, CLIENT, QUIT, INFO,
//! DBSIZE, FLUSHALL/FLUSHDB, COMMAND, CONFIG GET.

use super::{is, parse_int, Call, Reply, COMMANDS, NOT_INTEGER, SYNTAX};
use crate::conn::tokens_match;
use bytes::Bytes;

/// The Redis version the port speaks (its replies and errors are this version's).
const REDIS_VERSION: &str = "7.0.15";
const WRONGPASS: &str = "WRONGPASS invalid username-password pair or user is disabled.";

pub(super) fn ping(c: &mut Call<'_>) {
    match c.args.len() {
        1 => c.out.simple("PONG"),
        2 => c.out.bulk(c.args[1]),
        _ => c.arity("ping"),
    }
}

pub(super) fn echo(c: &mut Call<'_>) {
    c.out.bulk(c.args[1]);
}

pub(super) fn select(c: &mut Call<'_>) {
    match parse_int(c.args[1]) {
        Some(0) => c.out.simple("OK"),
        Some(_) => c.error("ERR DB index is out of range"),
        None => c.error(NOT_INTEGER),
    }
}

pub(super) fn quit(c: &mut Call<'_>) {
    c.out.simple("OK");
    c.session.quit = true;
}

pub(super) fn dbsize(c: &mut Call<'_>) {
    let n = c.objects().len();
    c.out.integer(n as i64);
}

pub(super) fn flushall(c: &mut Call<'_>) {
    let ok = match c.args.len() {
        1 => true,
        2 => is(c.args[1], "async") || is(c.args[1], "sync"),
        _ => false,
    };
    if !ok {
        c.error(SYNTAX);
        return;
    }
    c.objects().clear();
    c.out.simple("OK");
}

/// MULTI, EXEC, DISCARD, WATCH, UNWATCH: Camelot has no transactions. A clear refusal
/// beats pretending: a client that queued commands after a fake MULTI would see them run
/// one by one.
/// Checks a password against the cluster token; `Err` holds the error text to send.
fn check_password(c: &Call<'_>, user: Option<&[u8]>, password: &[u8]) -> Result<(), &'static str> {
    let Some(token) = c.ctx.token else {
        return Err(
            "ERR AUTH <password> called without any password configured for the \
                    default user. Are you sure your configuration is correct?",
        );
    };
    if user.is_some_and(|u| u != b"default") || !tokens_match(token, password) {
        return Err(WRONGPASS);
    }
    Ok(())
}

/// `AUTH password` or `AUTH default password`.
pub(super) fn auth(c: &mut Call<'_>) {
    let (user, password) = match c.args.len() {
        2 => (None, c.args[1]),
        3 => (Some(c.args[1]), c.args[2]),
        _ => {
            c.error(SYNTAX);
            return;
        }
    };
    match check_password(c, user, password) {
        Ok(()) => {
            c.session.authenticated = true;
            c.out.simple("OK");
        }
        Err(msg) => c.error(msg),
    }
}

/// Longest client name a connection keeps (Redis has no limit; a name is a label, and
/// one of megabytes would be memory no budget counts, on every connection).
pub const CLIENT_NAME_BYTES_MAX: usize = 1024;

/// Redis's rule for client names (and library names): printable ASCII, no spaces.
fn valid_name(name: &[u8]) -> bool {
    name.iter().all(|b| (b'!'..=b'~').contains(b))
}

/// Stores `name` as the connection's name, or answers why not; false when refused.
fn set_name(c: &mut Call<'_>, name: &[u8]) -> bool {
    if !valid_name(name) {
        c.error("ERR Client names cannot contain spaces, newlines or special characters.");
        return false;
    }
    if name.len() > CLIENT_NAME_BYTES_MAX {
        c.error(&format!(
            "ERR client names are at most {CLIENT_NAME_BYTES_MAX} bytes here"
        ));
        return false;
    }
    c.session.name = (!name.is_empty()).then(|| Bytes::copy_from_slice(name));
    true
}

/// `HELLO [protover [AUTH user pass] [SETNAME name]]`: RESP2 or RESP3 (what redis-py 8
/// asks for by default, and does not fall back from); other versions get NOPROTO.
pub(super) fn hello(c: &mut Call<'_>) {
    let args = c.args;
    let mut j = 1;
    let mut protocol = None;
    if args.len() >= 2 {
        let Some(version) = parse_int(args[1]) else {
            c.error("ERR Protocol version is not an integer or out of range");
            return;
        };
        if version != 2 && version != 3 {
            c.error("NOPROTO unsupported protocol version");
            return;
        }
        protocol = Some(version == 3);
        j = 2;
    }
    let mut credentials = None;
    let mut name = None;
    while j < args.len() {
        let more = args.len() - 1 - j;
        if is(args[j], "auth") && more >= 2 {
            credentials = Some((args[j + 1], args[j + 2]));
            j += 2;
        } else if is(args[j], "setname") && more >= 1 {
            name = Some(args[j + 1]);
            j += 1;
        } else {
            let msg = format!(
                "ERR Syntax error in HELLO option '{}'",
                String::from_utf8_lossy(args[j])
            );
            c.error(&msg);
            return;
        }
        j += 1;
    }
    // Without a token every client is in, as Redis's passwordless default user
    // accepts any password given through HELLO.
    if let (Some((user, password)), Some(_)) = (credentials, c.ctx.token) {
        if let Err(msg) = check_password(c, Some(user), password) {
            c.error(msg);
            return;
        }
        c.session.authenticated = true;
    }
    if c.ctx.token.is_some() && !c.session.authenticated {
        c.error(
            "NOAUTH HELLO must be called with the client already authenticated, otherwise \
             the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the \
             client and select the RESP protocol version at the same time",
        );
        return;
    }
    if let Some(name) = name {
        if !set_name(c, name) {
            return;
        }
    }
    if let Some(resp3) = protocol {
        c.session.resp3 = resp3;
        c.out.set_resp3(resp3);
    }
    c.out.map_header(7);
    for (k, v) in [("server", "redis"), ("version", REDIS_VERSION)] {
        c.out.bulk(k.as_bytes());
        c.out.bulk(v.as_bytes());
    }
    c.out.bulk(b"proto");
    c.out.integer(if c.session.resp3 { 3 } else { 2 });
    c.out.bulk(b"id");
    c.out.integer(c.session.id as i64);
    for (k, v) in [("mode", "standalone"), ("role", "master")] {
        c.out.bulk(k.as_bytes());
        c.out.bulk(v.as_bytes());
    }
    c.out.bulk(b"modules");
    c.out.array_header(0);
}

/// `CLIENT ID | SETNAME name | GETNAME | SETINFO LIB-NAME|LIB-VER value`.
pub(super) fn client(c: &mut Call<'_>) {
    let sub = c.args[1];
    let n = c.args.len();
    let (name, arity) = if is(sub, "id") {
        ("id", 2)
    } else if is(sub, "setname") {
        ("setname", 3)
    } else if is(sub, "getname") {
        ("getname", 2)
    } else if is(sub, "setinfo") {
        ("setinfo", 4)
    } else {
        let msg = format!(
            "ERR unknown subcommand '{}'. Try CLIENT HELP.",
            String::from_utf8_lossy(sub)
        );
        c.error(&msg);
        return;
    };
    if n != arity {
        c.arity(&format!("client|{name}"));
        return;
    }
    match name {
        "id" => c.out.integer(c.session.id as i64),
        "setname" => {
            if set_name(c, c.args[2]) {
                c.out.simple("OK");
            }
        }
        "getname" => match &c.session.name {
            Some(name) => c.out.bulk(name),
            None => c.out.null(),
        },
        _ => {
            // Client libraries announce themselves; nothing here uses it yet.
            let attr = c.args[2];
            let attr_name = if is(attr, "lib-name") {
                "lib-name"
            } else if is(attr, "lib-ver") {
                "lib-ver"
            } else {
                let msg = format!(
                    "ERR Unrecognized option '{}'",
                    String::from_utf8_lossy(attr)
                );
                c.error(&msg);
                return;
            };
            if !valid_name(c.args[3]) {
                let msg = format!(
                    "ERR {attr_name} cannot contain spaces, newlines or special characters."
                );
                c.error(&msg);
                return;
            }
            c.out.simple("OK");
        }
    }
}

/// `COMMAND` (name, arity, flags of every supported command), `COMMAND COUNT`,
/// `COMMAND INFO name…`, `COMMAND LIST`, `COMMAND DOCS` (empty: no docs are kept), all
/// read from the command table.
pub(super) fn command(c: &mut Call<'_>) {
    let supported = || COMMANDS.iter().filter(|cmd| !cmd.is_refused());
    let info = |out: &mut Reply<'_>, cmd: &super::Command| {
        out.array_header(3);
        out.bulk(cmd.name.as_bytes());
        out.integer(i64::from(cmd.arity));
        let mut names = Vec::new();
        if cmd.flags & super::flags::WRITE != 0 {
            names.push("write");
        }
        if cmd.flags & super::flags::READONLY != 0 {
            names.push("readonly");
        }
        if cmd.flags & super::flags::NO_AUTH != 0 {
            names.push("no_auth");
        }
        out.array_header(names.len());
        for f in names {
            out.simple(f);
        }
    };
    if c.args.len() == 1 {
        c.out.array_header(supported().count());
        for cmd in supported() {
            info(c.out, cmd);
        }
        return;
    }
    let sub = c.args[1];
    if is(sub, "count") {
        c.out.integer(supported().count() as i64);
    } else if is(sub, "list") {
        c.out.array_header(supported().count());
        for cmd in supported() {
            c.out.bulk(cmd.name.as_bytes());
        }
    } else if is(sub, "info") {
        c.out.array_header(c.args.len() - 2);
        for name in &c.args[2..] {
            match super::lookup(name).filter(|cmd| !cmd.is_refused()) {
                Some(cmd) => info(c.out, cmd),
                None => c.out.null_array(),
            }
        }
    } else if is(sub, "docs") {
        c.out.array_header(0);
    } else {
        let msg = format!(
            "ERR unknown subcommand '{}'. Try COMMAND HELP.",
            String::from_utf8_lossy(sub)
        );
        c.error(&msg);
    }
}

/// `CONFIG GET name`: the few settings tools ask about (redis-benchmark warns without
/// `save` and `appendonly`). Exact names or `*`; anything else is an empty answer, as
/// Redis gives for an unknown parameter.
pub(super) fn config(c: &mut Call<'_>) {
    if !is(c.args[1], "get") {
        c.error("ERR CONFIG subcommand not supported by Camelot");
        return;
    }
    if c.args.len() != 3 {
        c.arity("config|get");
        return;
    }
    let pattern = c.args[2];
    let maxmemory = c.ctx.state.budget().cap().to_string();
    let settings = [
        ("save", ""),
        ("appendonly", "no"),
        ("databases", "1"),
        ("maxmemory", maxmemory.as_str()),
    ];
    let matched: Vec<_> = settings
        .iter()
        .filter(|(name, _)| super::glob_match(&pattern.to_ascii_lowercase(), name.as_bytes()))
        .collect();
    c.out.map_header(matched.len());
    for (name, value) in matched {
        c.out.bulk(name.as_bytes());
        c.out.bulk(value.as_bytes());
    }
}

/// `INFO [section …]`: the sections Camelot can fill. No section, `default`, `all` or
/// `everything` give them all; a name Camelot lacks gives an empty reply, as Redis does
/// for an unknown section.
pub(super) fn info(c: &mut Call<'_>) {
    let stats = c.ctx.state.stats_snapshot();
    let get = |name: &str| stats.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v);
    let keys = c.objects().len();
    let sections: [(&str, String); 5] = [
        (
            "server",
            format!(
                "# Server\r\nredis_version:{REDIS_VERSION}\r\ncamelot_version:{}\r\n\
                 redis_mode:standalone\r\n",
                env!("CARGO_PKG_VERSION")
            ),
        ),
        (
            "clients",
            format!(
                "# Clients\r\nconnected_clients:{}\r\n",
                get("connections_current")
            ),
        ),
        (
            "memory",
            format!(
                // Objects and regions share maxmemory; connection buffers have a budget
                // of their own beside it, so a reader adding up what a server may hold
                // needs both. mem_clients_normal is Redis's name for the buffers' bytes.
                "# Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\nmem_clients_normal:{}\r\n\
                 camelot_connection_buffers_max:{}\r\n",
                get("memory_used_bytes"),
                get("memory_cap_bytes"),
                get("connection_buffers_used_bytes"),
                get("connection_buffers_cap_bytes")
            ),
        ),
        (
            "stats",
            format!(
                "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\n",
                get("connections_total"),
                get("resp_commands")
            ),
        ),
        (
            "keyspace",
            format!(
                "# Keyspace\r\n{}",
                if keys > 0 {
                    format!("db0:keys={keys},expires=0,avg_ttl=0\r\n")
                } else {
                    String::new()
                }
            ),
        ),
    ];
    let wanted = &c.args[1..];
    let all = wanted.is_empty()
        || wanted
            .iter()
            .any(|w| is(w, "all") || is(w, "everything") || is(w, "default"));
    let text: Vec<&str> = sections
        .iter()
        .filter(|(name, _)| all || wanted.iter().any(|w| is(w, name)))
        .map(|(_, body)| body.as_str())
        .collect();
    c.out.bulk(text.join("\r\n").as_bytes());
}
