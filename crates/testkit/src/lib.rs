//! Real programs for tests and benchmarks: `redis-server`, `memcached`, `etcd`, `iperf3`
//! and `camelot server` itself, each started on a free loopback port in a private
//! directory, waited for until it is ready, and killed and reaped when its handle drops.
//!
//! Any crate's tests may depend on this one (the rvm tests need Redis, the cluster's will
//! need etcd); so may the benches, which start the peers they compare against and Camelot
//! the same way. It depends on no other Camelot crate. Its one `unsafe` block is in
//! [`lifeline`] (a child's parent-death signal, set between fork and exec).
#![deny(unsafe_code)]

pub mod error;
pub mod lifeline;
pub mod process;
pub mod servers;

pub use error::TestkitError;
pub use process::{cpu_seconds, ServerProcess};
pub use servers::{
    CamelotServer, CamelotServerOptions, EtcdServer, Iperf3Server, MemcachedServer, RedisServer,
};
