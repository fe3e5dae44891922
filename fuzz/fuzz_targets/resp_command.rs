//! Any bytes a Redis client can send to the RESP port: parsing must never panic or loop,
//! and every command that parses must run against a small, real store without panicking
//! (hostile arguments get error replies).
#![no_main]
use bytes::BytesMut;
use camelot_server::resp::codec::{parse_command, Parsed};
use camelot_server::resp::commands::{execute, Ctx, Session};
use camelot_server::{MemoryBudget, ServerState};
use libfuzzer_sys::fuzz_target;
use std::time::Instant;

fuzz_target!(|data: &[u8]| {
    let state = ServerState::new(MemoryBudget::new(1 << 20), 0);
    let ctx = Ctx {
        state: &state,
        token: None,
    };
    let mut session = Session::default();
    let mut out = BytesMut::new();
    let mut args = Vec::new();
    let mut at = 0;
    while let Ok(Parsed::Command(len)) = parse_command(&data[at..], &mut args) {
        // Every command takes at least one byte, so this loop ends.
        assert!(len > 0 && at + len <= data.len());
        at += len;
        execute(&ctx, &mut session, &args, Instant::now(), &mut out);
        if session.quit {
            break;
        }
    }
    assert!(state.budget().used() <= state.budget().cap());
});
