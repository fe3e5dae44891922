//! Connection and server commands: PING, ECHO, SELECT, AUTH, HELLO, CLIENT, QUIT, INFO,
//! DBSIZE, FLUSHALL/FLUSHDB, COMMAND, CONFIG GET, and the refused transaction commands.

use super::{is, parse_int, Call, COMMANDS, NOT_INTEGER, SYNTAX};
use crate::conn::tokens_match;
use crate::resp::codec::{array_header, bulk, integer, null_bulk, simple};
use bytes::Bytes;

/// The Redis version the port speaks (its replies and errors are this version's).
const REDIS_VERSION: &str = "7.0.15";
const WRONGPASS: &str = "WRONGPASS invalid username-password pair or user is disabled.";

pub(super) fn ping(c: &mut Call<'_>) {
    match c.args.len() {
        1 => simple(c.out, "PONG"),
        2 => bulk(c.out, c.args[1]),
        _ => c.arity("ping"),
    }
}

pub(super) fn echo(c: &mut Call<'_>) {
    bulk(c.out, c.args[1]);
}

pub(super) fn select(c: &mut Call<'_>) {
    match parse_int(c.args[1]) {
        Some(0) => simple(c.out, "OK"),
        Some(_) => c.error("ERR DB index is out of range"),
        None => c.error(NOT_INTEGER),
    }
}

pub(super) fn quit(c: &mut Call<'_>) {
    simple(c.out, "OK");
    c.session.quit = true;
}

pub(super) fn dbsize(c: &mut Call<'_>) {
    let n = c.objects().len();
    integer(c.out, n as i64);
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
    simple(c.out, "OK");
}

/// MULTI, EXEC, DISCARD, WATCH, UNWATCH: Camelot has no transactions. A clear refusal
/// beats pretending: a client that queued commands after a fake MULTI would see them run
/// one by one.
pub(super) fn refused(c: &mut Call<'_>) {
    let name = String::from_utf8_lossy(c.args[0]).to_ascii_uppercase();
    c.error(&format!(
        "ERR {name} is not supported by Camelot: it has no transactions"
    ));
}

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
            simple(c.out, "OK");
        }
        Err(msg) => c.error(msg),
    }
}

/// Redis's rule for client names (and library names): printable ASCII, no spaces.
fn valid_name(name: &[u8]) -> bool {
    name.iter().all(|b| (b'!'..=b'~').contains(b))
}

/// `HELLO [protover [AUTH user pass] [SETNAME name]]`. Only RESP2 is spoken: HELLO 3 gets
/// the NOPROTO error Redis gives for a version it does not support, and clients that
/// try RESP3 first (redis-py 5+, Lettuce, go-redis) fall back to RESP2.
pub(super) fn hello(c: &mut Call<'_>) {
    let args = c.args;
    let mut j = 1;
    if args.len() >= 2 {
        let Some(version) = parse_int(args[1]) else {
            c.error("ERR Protocol version is not an integer or out of range");
            return;
        };
        if version != 2 {
            c.error("NOPROTO unsupported protocol version");
            return;
        }
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
    if let Some((user, password)) = credentials {
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
        if !valid_name(name) {
            c.error("ERR Client names cannot contain spaces, newlines or special characters.");
            return;
        }
        c.session.name = (!name.is_empty()).then(|| Bytes::copy_from_slice(name));
    }
    array_header(c.out, 14);
    for (k, v) in [("server", "redis"), ("version", REDIS_VERSION)] {
        bulk(c.out, k.as_bytes());
        bulk(c.out, v.as_bytes());
    }
    bulk(c.out, b"proto");
    integer(c.out, 2);
    bulk(c.out, b"id");
    integer(c.out, c.session.id as i64);
    for (k, v) in [("mode", "standalone"), ("role", "master")] {
        bulk(c.out, k.as_bytes());
        bulk(c.out, v.as_bytes());
    }
    bulk(c.out, b"modules");
    array_header(c.out, 0);
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
        "id" => integer(c.out, c.session.id as i64),
        "setname" => {
            let new = c.args[2];
            if !valid_name(new) {
                c.error("ERR Client names cannot contain spaces, newlines or special characters.");
                return;
            }
            c.session.name = (!new.is_empty()).then(|| Bytes::copy_from_slice(new));
            simple(c.out, "OK");
        }
        "getname" => match &c.session.name {
            Some(name) => bulk(c.out, name),
            None => null_bulk(c.out),
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
            simple(c.out, "OK");
        }
    }
}

/// `COMMAND` (name, arity, flags of every supported command), `COMMAND COUNT`,
/// `COMMAND INFO name…`, `COMMAND LIST`, `COMMAND DOCS` (empty: no docs are kept), all
/// read from the command table.
pub(super) fn command(c: &mut Call<'_>) {
    let supported = || COMMANDS.iter().filter(|cmd| !cmd.is_refused());
    let info = |out: &mut bytes::BytesMut, cmd: &super::Command| {
        array_header(out, 3);
        bulk(out, cmd.name.as_bytes());
        integer(out, i64::from(cmd.arity));
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
        array_header(out, names.len());
        for f in names {
            simple(out, f);
        }
    };
    if c.args.len() == 1 {
        array_header(c.out, supported().count());
        for cmd in supported() {
            info(c.out, cmd);
        }
        return;
    }
    let sub = c.args[1];
    if is(sub, "count") {
        integer(c.out, supported().count() as i64);
    } else if is(sub, "list") {
        array_header(c.out, supported().count());
        for cmd in supported() {
            bulk(c.out, cmd.name.as_bytes());
        }
    } else if is(sub, "info") {
        array_header(c.out, c.args.len() - 2);
        for name in &c.args[2..] {
            match super::lookup(name).filter(|cmd| !cmd.is_refused()) {
                Some(cmd) => info(c.out, cmd),
                None => c.out.extend_from_slice(b"*-1\r\n"),
            }
        }
    } else if is(sub, "docs") {
        array_header(c.out, 0);
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
    array_header(c.out, 2 * matched.len());
    for (name, value) in matched {
        bulk(c.out, name.as_bytes());
        bulk(c.out, value.as_bytes());
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
                "# Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\n",
                get("memory_used_bytes"),
                get("memory_cap_bytes")
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
    bulk(c.out, text.join("\r\n").as_bytes());
}
