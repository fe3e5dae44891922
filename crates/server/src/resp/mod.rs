//! The Redis-protocol port (`camelot server --resp-listen`): RESP2 over the server's own
//! objects, so Redis tools and client libraries work against Camelot unchanged.

pub mod codec;
pub mod commands;
mod conn;
mod spin;

pub use conn::UNAUTHENTICATED_INPUT_BYTES_MAX;
pub(crate) use conn::{refuse, serve, RespShared};
pub(crate) use spin::spin_loop;
pub use spin::{SPIN_IDLE_DEFAULT, SPIN_IDLE_MAX};
