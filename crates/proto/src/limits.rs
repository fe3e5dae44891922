//! Every size and count the wire format accepts. A decoder rejects anything past these
//! before allocating for it, so a hostile peer can cost us at most one frame of memory.

/// Largest frame body (after the 4-byte length prefix). Sized so a 16 MiB value plus
/// headroom fits, while one connection can never pin more than this much buffer.
pub const FRAME_BYTES_MAX: usize = 64 << 20;
/// Not a limit but the frame size batching clients aim for: bulk bytes (WRITE and PUT
/// payloads sent, READ data asked for) past which they start a new frame, although one
/// frame could carry up to [`FRAME_BYTES_MAX`]. Both ends build, buffer and parse a whole
/// frame before acting on it, so one 40 MB frame costs fresh 40 MB buffers on each side
/// (page faults: glibc maps allocations past 32 MiB anew every time) and leaves the server
/// idle until the last byte arrives; frames of this size are pipelined instead, each end
/// reuses buffers of about this size, and the server executes one frame while the next
/// is on the wire. Kept below the server's buffer-keeping size (4 MiB) so those buffers
/// are reused rather than replaced. Requests larger than this travel alone in a frame.
pub const FRAME_BYTES_TARGET: usize = 2 << 20;
/// Largest number of requests (or responses) in one frame.
pub const BATCH_OPS_MAX: usize = 4096;
/// Largest single READ or WRITE payload.
pub const IO_BYTES_MAX: usize = 32 << 20;
/// Largest region a single ALLOC may ask for.
pub const REGION_BYTES_MAX: u64 = 64 << 30;
/// Region sizes are rounded up to this granule (the memory server's "page").
pub const REGION_PAGE_BYTES: u64 = 4096;
/// Longest region name (a tag a restarted client uses to find its region again).
pub const NAME_BYTES_MAX: usize = 255;
/// Longest cluster token.
pub const TOKEN_BYTES_MAX: usize = 255;
/// Longest principal name a client may give in HELLO. Short: it is a name, kept per
/// region and per quota entry, and it bounds the HELLO a server accepts before
/// authentication.
pub const PRINCIPAL_BYTES_MAX: usize = 64;
/// Longest human-readable error message carried on the wire.
pub const MESSAGE_BYTES_MAX: usize = 1024;
/// Most regions one LIST reply carries.
pub const LIST_ENTRIES_MAX: usize = 65_536;
/// Most counters one STATS reply carries, and the longest counter name.
pub const STATS_ENTRIES_MAX: usize = 256;
pub const STAT_NAME_BYTES_MAX: usize = 64;
/// Longest object key. Keys are names, not payloads; YCSB's are about 23 bytes.
pub const KEY_BYTES_MAX: usize = 1024;
/// Largest object value. 16 MiB values must work (the issue), 1 MB is a seed workload.
pub const VALUE_BYTES_MAX: usize = 32 << 20;
/// Most objects one SCAN returns.
pub const SCAN_ITEMS_MAX: usize = 4096;
/// Not a limit but where a SCAN_PARTITIONS page ends: once its items reach this many
/// bytes the page goes, although a frame could carry fifteen times more. A mover applies
/// one page while the next is scanned, so one page of a whole move left both ends idle
/// in turn, and cost each side a fresh buffer the size of the move. Not smaller: pages
/// of 1 KiB records end at their item count near here, as before this target, and with
/// 2 MiB pages the load fell more than 250 ms behind at a move's start more often
/// (`bench cluster expand --replication 2`: 9 runs of 18, against 4 of 30 without;
/// BENCHMARKS.md, twelfth session).
pub const SCAN_PAGE_BYTES_TARGET: usize = 4 << 20;
/// Most keys one SCAN_PARTITIONS examines (matching or not): it bounds how long a page
/// holds the server's shard locks, whatever the filter lets through.
pub const SCAN_EXAMINE_MAX: usize = 16_384;
/// Most partitions a SCAN_PARTITIONS mask describes (the mask is a bit per partition).
pub const SCAN_PARTITIONS_MAX: u32 = 65_536;

// The relations between these limits, checked by the compiler rather than stated in prose.
// A frame can carry the biggest single READ/WRITE payload or value with room for headers.
const _: () = assert!(IO_BYTES_MAX < FRAME_BYTES_MAX);
const _: () = assert!(VALUE_BYTES_MAX + KEY_BYTES_MAX < FRAME_BYTES_MAX);
// Batching aims below the hard limit, so a target-sized frame is always legal.
const _: () = assert!(FRAME_BYTES_TARGET < FRAME_BYTES_MAX);
// A response frame counts its items in 16 bits.
const _: () = assert!(BATCH_OPS_MAX <= u16::MAX as usize);
const _: () = assert!(SCAN_ITEMS_MAX <= BATCH_OPS_MAX);
const _: () = assert!(SCAN_ITEMS_MAX <= SCAN_EXAMINE_MAX);
// Region sizes are whole pages, and the biggest region is a whole number of them.
const _: () = assert!(REGION_PAGE_BYTES.is_power_of_two());
const _: () = assert!(REGION_BYTES_MAX & (REGION_PAGE_BYTES - 1) == 0);
// Names, tokens and keys are length-prefixed with one byte (names, tokens) or two (keys).
const _: () = assert!(NAME_BYTES_MAX <= u8::MAX as usize);
const _: () = assert!(TOKEN_BYTES_MAX <= u8::MAX as usize);
const _: () = assert!(PRINCIPAL_BYTES_MAX <= u8::MAX as usize);
const _: () = assert!(KEY_BYTES_MAX <= u16::MAX as usize);
// STATS replies count their entries in 16 bits; error messages carry a 16-bit length.
const _: () = assert!(STATS_ENTRIES_MAX <= u16::MAX as usize);
const _: () = assert!(MESSAGE_BYTES_MAX <= u16::MAX as usize);
