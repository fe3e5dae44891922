//! The NBD protocol's fixed-newstyle handshake and simple-reply transmission phase, as pure
//! code: decoders of what a client sends (every length checked against a named limit
//! before anything is allocated), encoders of what the server answers, and the choice of
//! answer to each option. No I/O: `nbd` moves the bytes.
//!
//! Only what stock clients (libnbd's `nbdinfo`/`nbdcopy`, the kernel's `nbd-client`,
//! qemu) need is spoken: options EXPORT_NAME, ABORT, LIST, INFO and GO (everything else,
//! structured replies included, is answered "unsupported", which every client falls back
//! from), and commands READ, WRITE, DISC, FLUSH, TRIM and WRITE_ZEROES with simple replies.

/// "NBDMAGIC": the server's greeting starts with it.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": follows the greeting, and starts every option a client sends.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Starts every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Starts every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Starts every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flags the server sends.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags (the client's answer to the greeting).
pub const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

/// Information types inside REP_INFO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command types.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Error numbers in simple replies (the protocol's own values, Linux's errno numbers).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;

/// Bytes of the greeting: NBDMAGIC, IHAVEOPT, handshake flags.
pub const GREETING_BYTES: usize = 18;
/// Bytes of an option's header: IHAVEOPT, option, data length.
pub const OPTION_HEADER_BYTES: usize = 16;
/// Bytes of a request's header: magic, flags, type, handle, offset, length.
pub const REQUEST_HEADER_BYTES: usize = 28;
/// Bytes of a simple reply's header: magic, error, handle.
pub const SIMPLE_REPLY_HEADER_BYTES: usize = 16;
/// Zero bytes after an EXPORT_NAME reply, unless the client asked for none.
pub const EXPORT_NAME_ZEROES: usize = 124;

/// Longest export name accepted (the protocol's own ceiling on any string).
pub const EXPORT_NAME_BYTES_MAX: usize = 4096;
/// Most information requests one INFO/GO may carry (there are four kinds defined).
pub const INFO_REQUESTS_MAX: usize = 64;
/// Largest option data read: a name at its ceiling plus its length, the request count
/// and the requests. A longer option ends the connection before anything is read.
pub const OPTION_DATA_BYTES_MAX: u32 =
    (4 + EXPORT_NAME_BYTES_MAX + 2 + 2 * INFO_REQUESTS_MAX) as u32;
/// Most options one handshake may send before the server gives up on it.
pub const OPTIONS_PER_HANDSHAKE_MAX: usize = 64;
/// Largest READ or WRITE (and the maximum block size the server advertises): the payload
/// is the only thing the server allocates per request, so this bounds it.
pub const REQUEST_BYTES_MAX: u32 = 32 << 20;

/// What a client sent that cannot be answered: the connection ends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NbdDecodeError {
    #[error("bad magic {found:#x} where {what} was expected")]
    BadMagic { what: &'static str, found: u64 },
    #[error("client flags {0:#x}: unknown bits, or no fixed-newstyle")]
    ClientFlags(u32),
    #[error("option data of {0} bytes is over the {OPTION_DATA_BYTES_MAX}-byte limit")]
    OptionTooLong(u32),
    #[error("a write of {0} bytes is over the {REQUEST_BYTES_MAX}-byte limit")]
    WriteTooLong(u32),
    #[error("export name is not UTF-8 or holds a NUL")]
    BadName,
}

/// The client's answer to the greeting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags {
    pub no_zeroes: bool,
}

pub fn decode_client_flags(bytes: [u8; 4]) -> Result<ClientFlags, NbdDecodeError> {
    let flags = u32::from_be_bytes(bytes);
    let known = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;
    // Without fixed newstyle a client cannot be told "unsupported" and must be dropped on
    // any option it does not know; every client in use speaks fixed newstyle.
    if flags & !known != 0 || flags & CLIENT_FLAG_FIXED_NEWSTYLE == 0 {
        return Err(NbdDecodeError::ClientFlags(flags));
    }
    Ok(ClientFlags {
        no_zeroes: flags & CLIENT_FLAG_NO_ZEROES != 0,
    })
}

pub fn greeting() -> [u8; GREETING_BYTES] {
    let mut g = [0u8; GREETING_BYTES];
    g[..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    g[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    g[16..].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    g
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    /// Checked: at most `OPTION_DATA_BYTES_MAX`.
    pub length: u32,
}

pub fn decode_option_header(
    bytes: &[u8; OPTION_HEADER_BYTES],
) -> Result<OptionHeader, NbdDecodeError> {
    let magic = u64::from_be_bytes(arr(&bytes[..8]));
    if magic != IHAVEOPT {
        return Err(NbdDecodeError::BadMagic {
            what: "IHAVEOPT",
            found: magic,
        });
    }
    let option = u32::from_be_bytes(arr(&bytes[8..12]));
    let length = u32::from_be_bytes(arr(&bytes[12..16]));
    if length > OPTION_DATA_BYTES_MAX {
        return Err(NbdDecodeError::OptionTooLong(length));
    }
    Ok(OptionHeader { option, length })
}

/// One option, its data decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    /// The old way into transmission; a wrong name can only be answered by hanging up.
    ExportName(String),
    Abort,
    List,
    Info(InfoRequest),
    Go(InfoRequest),
    /// Well-formed header, data that does not parse: answered ERR_INVALID.
    Invalid {
        option: u32,
        why: &'static str,
    },
    /// Any other option: answered ERR_UNSUP.
    Unsupported(u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

/// Decodes an option's data (`data.len()` is the header's checked length).
pub fn decode_option(option: u32, data: &[u8]) -> Result<ClientOption, NbdDecodeError> {
    Ok(match option {
        OPT_EXPORT_NAME => ClientOption::ExportName(decode_name(data)?),
        OPT_ABORT if data.is_empty() => ClientOption::Abort,
        OPT_LIST if data.is_empty() => ClientOption::List,
        OPT_ABORT | OPT_LIST => ClientOption::Invalid {
            option,
            why: "carries data it must not",
        },
        OPT_INFO | OPT_GO => match decode_info_request(data) {
            Ok(req) if option == OPT_GO => ClientOption::Go(req),
            Ok(req) => ClientOption::Info(req),
            Err(why) => ClientOption::Invalid { option, why },
        },
        other => ClientOption::Unsupported(other),
    })
}

fn decode_name(bytes: &[u8]) -> Result<String, NbdDecodeError> {
    if bytes.len() > EXPORT_NAME_BYTES_MAX || bytes.contains(&0) {
        return Err(NbdDecodeError::BadName);
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| NbdDecodeError::BadName)
}

fn decode_info_request(data: &[u8]) -> Result<InfoRequest, &'static str> {
    let name_len = data.get(..4).ok_or("shorter than a name length")?;
    let name_len = u32::from_be_bytes(arr(name_len)) as usize;
    // Checked against what is there before the name is copied.
    if name_len > EXPORT_NAME_BYTES_MAX || name_len > data.len() - 4 {
        return Err("name length runs past the data");
    }
    let name = decode_name(&data[4..4 + name_len]).map_err(|_| "name is not a string")?;
    let rest = &data[4 + name_len..];
    let count = rest.get(..2).ok_or("no request count")?;
    let count = u16::from_be_bytes(arr(count)) as usize;
    if count > INFO_REQUESTS_MAX || rest.len() - 2 != 2 * count {
        return Err("request count does not match the data");
    }
    let requests = rest[2..]
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes(arr(c)))
        .collect();
    Ok(InfoRequest { name, requests })
}

/// What the server exports, as the handshake describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub size_bytes: u64,
    pub read_only: bool,
    /// Advertised as the preferred block size: a power of two (the volume's chunk).
    pub preferred_block_bytes: u32,
}

impl ExportInfo {
    /// The export answers to its name, and to the empty name (the default export, which
    /// `nbd://host:port` asks for).
    pub fn answers_to(&self, name: &str) -> bool {
        name.is_empty() || name == self.name
    }

    pub fn transmission_flags(&self) -> u16 {
        // Every write is acknowledged by the memory servers before it is answered, so
        // FLUSH and FUA have nothing left to do, and a flush on any connection covers
        // every connection's completed writes: multi-conn is safe to offer.
        let mut flags = TFLAG_HAS_FLAGS
            | TFLAG_SEND_FLUSH
            | TFLAG_SEND_FUA
            | TFLAG_SEND_TRIM
            | TFLAG_SEND_WRITE_ZEROES
            | TFLAG_CAN_MULTI_CONN;
        if self.read_only {
            flags |= TFLAG_READ_ONLY;
        }
        flags
    }
}

/// What to do after answering an option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Read the next option.
    Option,
    /// The handshake is over: transmission starts.
    Transmit,
    /// Hang up.
    Close,
}

/// The server's answer to one option: the bytes to send, then what follows.
pub fn answer_option(
    opt: &ClientOption,
    export: &ExportInfo,
    flags: ClientFlags,
) -> (Vec<u8>, Next) {
    let mut out = Vec::new();
    let next = match opt {
        ClientOption::ExportName(name) => {
            if !export.answers_to(name) {
                // The protocol leaves no way to say "unknown" here.
                return (out, Next::Close);
            }
            out.extend_from_slice(&export.size_bytes.to_be_bytes());
            out.extend_from_slice(&export.transmission_flags().to_be_bytes());
            if !flags.no_zeroes {
                out.extend_from_slice(&[0u8; EXPORT_NAME_ZEROES]);
            }
            Next::Transmit
        }
        ClientOption::Abort => {
            option_reply(&mut out, OPT_ABORT, REP_ACK, &[]);
            Next::Close
        }
        ClientOption::List => {
            let mut data = Vec::with_capacity(4 + export.name.len());
            data.extend_from_slice(&(export.name.len() as u32).to_be_bytes());
            data.extend_from_slice(export.name.as_bytes());
            option_reply(&mut out, OPT_LIST, REP_SERVER, &data);
            option_reply(&mut out, OPT_LIST, REP_ACK, &[]);
            Next::Option
        }
        ClientOption::Info(req) | ClientOption::Go(req) => {
            let option = if matches!(opt, ClientOption::Go(_)) {
                OPT_GO
            } else {
                OPT_INFO
            };
            if !export.answers_to(&req.name) {
                option_reply(&mut out, option, REP_ERR_UNKNOWN, b"no such export");
                return (out, Next::Option);
            }
            let mut info = Vec::with_capacity(12);
            info.extend_from_slice(&INFO_EXPORT.to_be_bytes());
            info.extend_from_slice(&export.size_bytes.to_be_bytes());
            info.extend_from_slice(&export.transmission_flags().to_be_bytes());
            option_reply(&mut out, option, REP_INFO, &info);
            // Sent whether asked for or not (the protocol allows it): the maximum is the
            // limit a request is held to, so a client that reads it never meets it.
            let mut sizes = Vec::with_capacity(14);
            sizes.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
            sizes.extend_from_slice(&1u32.to_be_bytes());
            let preferred = export
                .preferred_block_bytes
                .clamp(4096, REQUEST_BYTES_MAX)
                .next_power_of_two()
                .min(REQUEST_BYTES_MAX);
            sizes.extend_from_slice(&preferred.to_be_bytes());
            sizes.extend_from_slice(&REQUEST_BYTES_MAX.to_be_bytes());
            option_reply(&mut out, option, REP_INFO, &sizes);
            option_reply(&mut out, option, REP_ACK, &[]);
            if option == OPT_GO {
                Next::Transmit
            } else {
                Next::Option
            }
        }
        ClientOption::Invalid { option, why } => {
            option_reply(&mut out, *option, REP_ERR_INVALID, why.as_bytes());
            Next::Option
        }
        ClientOption::Unsupported(option) => {
            option_reply(&mut out, *option, REP_ERR_UNSUP, &[]);
            Next::Option
        }
    };
    (out, next)
}

fn option_reply(out: &mut Vec<u8>, option: u32, kind: u32, data: &[u8]) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: u16,
    pub handle: u64,
    pub offset: u64,
    /// For a WRITE, checked: at most `REQUEST_BYTES_MAX` payload bytes follow.
    pub length: u32,
}

pub fn decode_request_header(
    bytes: &[u8; REQUEST_HEADER_BYTES],
) -> Result<RequestHeader, NbdDecodeError> {
    let magic = u32::from_be_bytes(arr(&bytes[..4]));
    if magic != REQUEST_MAGIC {
        return Err(NbdDecodeError::BadMagic {
            what: "the request magic",
            found: magic as u64,
        });
    }
    let h = RequestHeader {
        flags: u16::from_be_bytes(arr(&bytes[4..6])),
        command: u16::from_be_bytes(arr(&bytes[6..8])),
        handle: u64::from_be_bytes(arr(&bytes[8..16])),
        offset: u64::from_be_bytes(arr(&bytes[16..24])),
        length: u32::from_be_bytes(arr(&bytes[24..28])),
    };
    // A payload too long to take cannot be skipped without reading it either: the stream
    // is lost, so the connection ends before anything is allocated.
    if h.command == CMD_WRITE && h.length > REQUEST_BYTES_MAX {
        return Err(NbdDecodeError::WriteTooLong(h.length));
    }
    Ok(h)
}

/// The client's side, for tests and tools: a request header.
pub fn encode_request_header(h: &RequestHeader) -> [u8; REQUEST_HEADER_BYTES] {
    let mut b = [0u8; REQUEST_HEADER_BYTES];
    b[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&h.flags.to_be_bytes());
    b[6..8].copy_from_slice(&h.command.to_be_bytes());
    b[8..16].copy_from_slice(&h.handle.to_be_bytes());
    b[16..24].copy_from_slice(&h.offset.to_be_bytes());
    b[24..28].copy_from_slice(&h.length.to_be_bytes());
    b
}

/// What the server does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Read {
        offset: u64,
        length: u32,
    },
    Write {
        offset: u64,
        length: u32,
    },
    WriteZeroes {
        offset: u64,
        length: u32,
    },
    /// Nothing to do but say so (FLUSH, TRIM: writes are already on the members, and a
    /// trimmed range may read back as anything, so it keeps its data).
    Done,
    /// Answer with this error. A WRITE's payload is still read and dropped first.
    Fail(u32),
    Disconnect,
}

/// Checks a request against the export (bounds, flags, read-only) and says what to do.
/// Pure, so every refusal is decided without a socket.
pub fn plan_request(h: &RequestHeader, export: &ExportInfo) -> Action {
    let known_flags = CMD_FLAG_FUA | CMD_FLAG_NO_HOLE;
    if h.flags & !known_flags != 0 {
        return Action::Fail(EINVAL);
    }
    let in_bounds = h
        .offset
        .checked_add(h.length as u64)
        .is_some_and(|end| end <= export.size_bytes);
    let writes = matches!(h.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && export.read_only {
        return Action::Fail(EPERM);
    }
    match h.command {
        CMD_DISC => Action::Disconnect,
        CMD_FLUSH => Action::Done,
        CMD_READ if h.length > REQUEST_BYTES_MAX => Action::Fail(EINVAL),
        CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES if !in_bounds => {
            Action::Fail(if writes { ENOSPC } else { EINVAL })
        }
        CMD_READ => Action::Read {
            offset: h.offset,
            length: h.length,
        },
        CMD_WRITE => Action::Write {
            offset: h.offset,
            length: h.length,
        },
        CMD_WRITE_ZEROES => Action::WriteZeroes {
            offset: h.offset,
            length: h.length,
        },
        CMD_TRIM => Action::Done,
        _ => Action::Fail(EINVAL),
    }
}

pub fn simple_reply_header(error: u32, handle: u64) -> [u8; SIMPLE_REPLY_HEADER_BYTES] {
    let mut b = [0u8; SIMPLE_REPLY_HEADER_BYTES];
    b[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..].copy_from_slice(&handle.to_be_bytes());
    b
}

/// A fixed-size array from a slice the caller has already sized.
fn arr<const N: usize>(s: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&s[..N]);
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn export() -> ExportInfo {
        ExportInfo {
            name: "vol".into(),
            size_bytes: 1 << 20,
            read_only: false,
            preferred_block_bytes: 65536,
        }
    }

    fn info_data(name: &str, requests: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(requests.len() as u16).to_be_bytes());
        for r in requests {
            d.extend_from_slice(&r.to_be_bytes());
        }
        d
    }

    /// Splits option replies into (option, type, data), checking each magic.
    fn replies(mut out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut v = Vec::new();
        while !out.is_empty() {
            assert_eq!(u64::from_be_bytes(arr(&out[..8])), OPTION_REPLY_MAGIC);
            let opt = u32::from_be_bytes(arr(&out[8..12]));
            let kind = u32::from_be_bytes(arr(&out[12..16]));
            let len = u32::from_be_bytes(arr(&out[16..20])) as usize;
            v.push((opt, kind, out[20..20 + len].to_vec()));
            out = &out[20 + len..];
        }
        v
    }

    #[test]
    fn go_answers_size_flags_and_block_sizes_then_transmits() {
        let opt = decode_option(OPT_GO, &info_data("vol", &[INFO_BLOCK_SIZE])).unwrap();
        let (out, next) = answer_option(&opt, &export(), ClientFlags { no_zeroes: true });
        assert_eq!(next, Next::Transmit);
        let r = replies(&out);
        assert_eq!(r.len(), 3);
        assert_eq!((r[0].0, r[0].1), (OPT_GO, REP_INFO));
        assert_eq!(u16::from_be_bytes(arr(&r[0].2[..2])), INFO_EXPORT);
        assert_eq!(u64::from_be_bytes(arr(&r[0].2[2..10])), 1 << 20);
        let tflags = u16::from_be_bytes(arr(&r[0].2[10..12]));
        assert_eq!(tflags & TFLAG_READ_ONLY, 0);
        assert_ne!(tflags & TFLAG_CAN_MULTI_CONN, 0);
        assert_eq!(u16::from_be_bytes(arr(&r[1].2[..2])), INFO_BLOCK_SIZE);
        assert_eq!(u32::from_be_bytes(arr(&r[1].2[6..10])), 65536);
        assert_eq!(u32::from_be_bytes(arr(&r[1].2[10..14])), REQUEST_BYTES_MAX);
        assert_eq!(r[2].1, REP_ACK);
    }

    #[test]
    fn info_on_an_unknown_name_is_err_unknown_and_the_handshake_goes_on() {
        let opt = decode_option(OPT_INFO, &info_data("other", &[])).unwrap();
        let (out, next) = answer_option(&opt, &export(), ClientFlags { no_zeroes: false });
        assert_eq!(next, Next::Option);
        assert_eq!(replies(&out)[0].1, REP_ERR_UNKNOWN);
        // The empty name is the default export.
        let opt = decode_option(OPT_INFO, &info_data("", &[])).unwrap();
        let (out, next) = answer_option(&opt, &export(), ClientFlags { no_zeroes: false });
        assert_eq!(next, Next::Option);
        assert_eq!(replies(&out).last().unwrap().1, REP_ACK);
    }

    #[test]
    fn export_name_sends_size_flags_and_zeroes_unless_declined() {
        let opt = decode_option(OPT_EXPORT_NAME, b"vol").unwrap();
        let (out, next) = answer_option(&opt, &export(), ClientFlags { no_zeroes: false });
        assert_eq!(next, Next::Transmit);
        assert_eq!(out.len(), 8 + 2 + EXPORT_NAME_ZEROES);
        let (out, _) = answer_option(&opt, &export(), ClientFlags { no_zeroes: true });
        assert_eq!(out.len(), 10);
        let opt = decode_option(OPT_EXPORT_NAME, b"nope").unwrap();
        assert_eq!(
            answer_option(&opt, &export(), ClientFlags { no_zeroes: true }),
            (vec![], Next::Close)
        );
    }

    #[test]
    fn list_names_the_export_abort_acks_and_closes_others_are_unsupported() {
        let (out, next) = answer_option(
            &decode_option(OPT_LIST, &[]).unwrap(),
            &export(),
            ClientFlags { no_zeroes: true },
        );
        assert_eq!(next, Next::Option);
        let r = replies(&out);
        assert_eq!((r[0].1, &r[0].2[4..]), (REP_SERVER, &b"vol"[..]));
        assert_eq!(r[1].1, REP_ACK);
        let (out, next) = answer_option(
            &decode_option(OPT_ABORT, &[]).unwrap(),
            &export(),
            ClientFlags { no_zeroes: true },
        );
        assert_eq!((replies(&out)[0].1, next), (REP_ACK, Next::Close));
        // STRUCTURED_REPLY (8): clients fall back to simple replies.
        let (out, next) = answer_option(
            &decode_option(8, &[]).unwrap(),
            &export(),
            ClientFlags { no_zeroes: true },
        );
        assert_eq!((replies(&out)[0].1, next), (REP_ERR_UNSUP, Next::Option));
        assert!(matches!(
            decode_option(OPT_LIST, &[1]).unwrap(),
            ClientOption::Invalid { .. }
        ));
    }

    #[test]
    fn client_flags_need_fixed_newstyle_and_no_unknown_bits() {
        assert!(decode_client_flags(1u32.to_be_bytes()).is_ok());
        assert!(decode_client_flags(3u32.to_be_bytes()).unwrap().no_zeroes);
        assert!(decode_client_flags(0u32.to_be_bytes()).is_err());
        assert!(decode_client_flags(5u32.to_be_bytes()).is_err());
    }

    #[test]
    fn a_write_over_the_limit_is_refused_at_the_header() {
        let h = RequestHeader {
            flags: 0,
            command: CMD_WRITE,
            handle: 7,
            offset: 0,
            length: REQUEST_BYTES_MAX + 1,
        };
        assert_eq!(
            decode_request_header(&encode_request_header(&h)),
            Err(NbdDecodeError::WriteTooLong(REQUEST_BYTES_MAX + 1))
        );
        // A read that long carries no payload: the stream survives, the request fails.
        let h = RequestHeader {
            command: CMD_READ,
            ..h
        };
        let decoded = decode_request_header(&encode_request_header(&h)).unwrap();
        assert_eq!(plan_request(&decoded, &export()), Action::Fail(EINVAL));
    }

    #[test]
    fn read_only_refuses_writes_and_bounds_are_checked_without_overflow() {
        let ro = ExportInfo {
            read_only: true,
            ..export()
        };
        let h = |command, offset, length| RequestHeader {
            flags: 0,
            command,
            handle: 1,
            offset,
            length,
        };
        assert_eq!(plan_request(&h(CMD_WRITE, 0, 1), &ro), Action::Fail(EPERM));
        assert_eq!(
            plan_request(&h(CMD_READ, 0, 1), &ro),
            Action::Read {
                offset: 0,
                length: 1
            }
        );
        let e = export();
        assert_eq!(
            plan_request(&h(CMD_READ, u64::MAX, 2), &e),
            Action::Fail(EINVAL)
        );
        assert_eq!(
            plan_request(&h(CMD_WRITE, (1 << 20) - 1, 2), &e),
            Action::Fail(ENOSPC)
        );
        assert_eq!(
            plan_request(&h(CMD_WRITE, (1 << 20) - 2, 2), &e),
            Action::Write {
                offset: (1 << 20) - 2,
                length: 2
            }
        );
        assert_eq!(plan_request(&h(CMD_DISC, 0, 0), &e), Action::Disconnect);
        assert_eq!(plan_request(&h(99, 0, 0), &e), Action::Fail(EINVAL));
    }

    proptest! {
        #[test]
        fn request_headers_round_trip(
            flags in any::<u16>(), command in any::<u16>(), handle in any::<u64>(),
            offset in any::<u64>(), length in 0..=REQUEST_BYTES_MAX,
        ) {
            let h = RequestHeader { flags, command, handle, offset, length };
            prop_assert_eq!(decode_request_header(&encode_request_header(&h)), Ok(h));
        }

        #[test]
        fn info_requests_round_trip(
            name in "[a-z0-9._-]{0,64}",
            requests in proptest::collection::vec(any::<u16>(), 0..=INFO_REQUESTS_MAX),
        ) {
            let data = info_data(&name, &requests);
            prop_assert_eq!(
                decode_option(OPT_GO, &data),
                Ok(ClientOption::Go(InfoRequest { name, requests }))
            );
        }

        #[test]
        fn arbitrary_option_data_never_panics_and_answers_stay_framed(
            option in 0u32..16,
            data in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            if let Ok(opt) = decode_option(option, &data) {
                let (out, _) = answer_option(&opt, &export(), ClientFlags { no_zeroes: true });
                if option != OPT_EXPORT_NAME {
                    // Every byte belongs to a well-formed reply to this option.
                    for (opt, _, _) in replies(&out) {
                        prop_assert_eq!(opt, option);
                    }
                }
            }
        }

        #[test]
        fn arbitrary_headers_decode_or_fail_cleanly(
            bytes in proptest::array::uniform28(any::<u8>()),
            magic in any::<bool>(),
        ) {
            let mut bytes = bytes;
            if magic {
                bytes[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
            }
            match decode_request_header(&bytes) {
                Ok(h) => {
                    prop_assert!(h.command != CMD_WRITE || h.length <= REQUEST_BYTES_MAX);
                    match plan_request(&h, &export()) {
                        Action::Read { offset, length } | Action::Write { offset, length }
                        | Action::WriteZeroes { offset, length } => {
                            prop_assert!(offset + length as u64 <= 1 << 20);
                        }
                        _ => {}
                    }
                }
                Err(_) => prop_assert!(
                    !magic || (bytes[6..8] == CMD_WRITE.to_be_bytes())
                ),
            }
            let mut opt = [0u8; OPTION_HEADER_BYTES];
            opt.copy_from_slice(&bytes[..OPTION_HEADER_BYTES]);
            if let Ok(h) = decode_option_header(&opt) {
                prop_assert!(h.length <= OPTION_DATA_BYTES_MAX);
            }
        }
    }
}
