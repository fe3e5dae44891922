//! Any bytes a Redis client can send to the RESP port: parsing must never panic or loop,
//! and every command that parses must run against a small, real store without panicking
//! (hostile arguments get error replies).
#![no_main]
use bytes::BytesMut;
use camelot_server::resp::codec::parse_command;
use camelot_server::resp::commands::{execute, Ctx, Session};
use camelot_server::{MemoryBudget, ServerState};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let state = ServerState::new(MemoryBudget::new(1 << 20), 0);
    let ctx = Ctx {
        state: &state,
        token: None,
    };
    let mut session = Session::default();
    let mut buf = BytesMut::from(data);
    let mut out = BytesMut::new();
    while let Ok(Some(args)) = parse_command(&mut buf) {
        execute(&ctx, &mut session, &args, &mut out);
        if session.quit {
            break;
        }
    }
    assert!(state.budget().used() <= state.budget().cap());
});
