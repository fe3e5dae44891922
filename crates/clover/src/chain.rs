//! The chain logic as pure state machines: each operation says which one-sided access it
//! needs next and is resumed with the answer. The network driver (`store`) and the
//! in-memory model the tests interleave (`sim`) run the very same machines.
//!
//! Why reads and writes are linearizable:
//! - Nodes are immutable once linked except for their next word, and one READ of a node is
//!   atomic against WRITE and CAS on the server (region lock), so a node read whole is
//!   one consistent snapshot.
//! - A read returns the value of a node whose next word it saw hold a tail marker: at the
//!   instant of that READ the node was the chain's last, i.e. the current version.
//! - A write takes effect at its successful CAS of the tail's next word from the tail's
//!   marker to its node's address; a conditional write compares the value of the node it
//!   then CASes, so the comparison holds at the CAS.
//! - Reclaimed nodes are recognised rather than prevented: every node is checked against
//!   the (key id, sequence number) the walk expects (a cached hint or predecessor + 1), and
//!   a CAS expects a marker naming key and sequence number. A node reused since cannot
//!   pass either (a key's sequence numbers only grow), so the walk restarts from the head
//!   the metadata service keeps.
//! - A middlebox may answer a READ of an old version with the bytes of the newest linked
//!   version it knows, marked `FLAG_REDIRECTED` (see `layout`). The walk takes such an
//!   answer only for its own key at a newer version, and goes on from the node its own
//!   address word names: that is a later node of the same chain, so the walk reaches
//!   the same tail, sooner. The mark is the middlebox's word that the node is linked (an
//!   unmarked node with a newer version may be a writer's, not yet linked, and restarts).

use crate::layout::{self, decode_node, tail_marker, Geometry, Next, NodeAddr, HEADER_BYTES};
use bytes::Bytes;

/// Where a walk starts: a linked node and the version it must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Hint {
    pub addr: NodeAddr,
    pub seq: u64,
}

/// Bounds on one operation's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainLimits {
    /// Nodes followed through next pointers.
    pub hops_max: u32,
    /// Lost CASes before a write gives up.
    pub cas_retries_max: u32,
    /// Walks restarted from the head after meeting a reclaimed node.
    pub restarts_max: u32,
}

impl Default for ChainLimits {
    fn default() -> Self {
        ChainLimits {
            hops_max: 100_000,
            cas_retries_max: 10_000,
            restarts_max: 64,
        }
    }
}

/// One-sided accesses (plus asking the metadata service for a key's head).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    Read {
        addr: NodeAddr,
        len: u32,
    },
    /// Writes `data` at the node's start.
    Write {
        addr: NodeAddr,
        data: Bytes,
    },
    /// CAS on the node's next word.
    Cas {
        addr: NodeAddr,
        expected: u64,
        new: u64,
    },
    Head,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Data(Bytes),
    Done,
    /// The word before a CAS.
    Word(u64),
    Head(Hint),
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub hops: u32,
    /// Walks a middlebox sent straight to a newer version (hops saved).
    pub jumps: u32,
    pub cas_failures: u32,
    pub restarts: u32,
    /// CASes a middlebox re-aimed at the real tail and won (each a retry saved).
    pub relinked: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("gave up after following {0} nodes")]
    TooManyHops(u32),
    #[error("gave up after {0} lost CASes")]
    TooManyCasRetries(u32),
    #[error("gave up after {0} restarts from the head")]
    TooManyRestarts(u32),
    #[error("a middlebox answered a CAS it had no right to re-aim: {0:#x}")]
    Relinked(u64),
    #[error("answer {0:?} does not fit the access asked for")]
    UnexpectedAnswer(Answer),
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
}

#[derive(Debug)]
pub enum Step<T> {
    Issue(Access),
    Finished(T),
}

/// Walks from a hint to the tail.
#[derive(Debug, Clone)]
struct Walker {
    key_id: u64,
    cur: Hint,
    read_len: u32,
    limits: ChainLimits,
    counters: Counters,
}

enum Walked {
    Go(Access),
    Tail(Hint, Option<Bytes>),
}

impl Walker {
    fn visit(&self) -> Access {
        Access::Read {
            addr: self.cur.addr,
            len: self.read_len,
        }
    }

    fn restart(&mut self) -> Result<Walked, ChainError> {
        self.counters.restarts += 1;
        if self.counters.restarts > self.limits.restarts_max {
            return Err(ChainError::TooManyRestarts(self.counters.restarts - 1));
        }
        Ok(Walked::Go(Access::Head))
    }

    fn follow(&mut self, addr: NodeAddr) -> Result<Walked, ChainError> {
        self.counters.hops += 1;
        if self.counters.hops > self.limits.hops_max {
            return Err(ChainError::TooManyHops(self.counters.hops - 1));
        }
        self.cur = Hint {
            addr,
            seq: self.cur.seq + 1,
        };
        Ok(Walked::Go(self.visit()))
    }

    fn on_answer(&mut self, answer: Answer) -> Result<Walked, ChainError> {
        match answer {
            Answer::Head(h) => {
                self.cur = h;
                Ok(Walked::Go(self.visit()))
            }
            Answer::Data(bytes) => {
                let Ok((header, value)) = decode_node(&bytes) else {
                    // Reuse by a larger value's writer can leave any bytes here.
                    return self.restart();
                };
                if header.flags & layout::FLAG_REDIRECTED != 0
                    && header.key_id == self.key_id
                    && header.seq > self.cur.seq
                {
                    let Next::Node(addr) = Next::decode(header.self_word) else {
                        return self.restart();
                    };
                    self.counters.jumps += 1;
                    self.cur = Hint {
                        addr,
                        seq: header.seq,
                    };
                }
                if header.key_id != self.key_id || header.seq != self.cur.seq {
                    return self.restart();
                }
                match Next::decode(header.next) {
                    Next::Node(a) => self.follow(a),
                    Next::Tail(m) if m == tail_marker(self.key_id, self.cur.seq) => {
                        Ok(Walked::Tail(self.cur, value))
                    }
                    _ => self.restart(),
                }
            }
            other => Err(ChainError::UnexpectedAnswer(other)),
        }
    }
}

/// What a read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDone {
    pub value: Option<Bytes>,
    /// The tail it read: the next operation's best hint.
    pub tail: Hint,
    pub counters: Counters,
}

/// A read: follow next pointers from the hint to the tail; its value is the answer.
#[derive(Debug, Clone)]
pub struct ReadOp {
    walker: Walker,
}

impl ReadOp {
    pub fn new(geometry: &Geometry, key_id: u64, hint: Hint, limits: ChainLimits) -> ReadOp {
        ReadOp {
            walker: Walker {
                key_id,
                cur: hint,
                read_len: geometry.node_bytes(),
                limits,
                counters: Counters::default(),
            },
        }
    }

    pub fn start(&mut self) -> Access {
        self.walker.visit()
    }

    pub fn resume(&mut self, answer: Answer) -> Result<Step<ReadDone>, ChainError> {
        Ok(match self.walker.on_answer(answer)? {
            Walked::Go(a) => Step::Issue(a),
            Walked::Tail(tail, value) => Step::Finished(ReadDone {
                value,
                tail,
                counters: self.walker.counters,
            }),
        })
    }
}

/// What a write did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteDone {
    /// Linked (false only when a condition did not hold).
    pub applied: bool,
    /// The tail after it: its own node if applied, else the tail whose value failed the
    /// condition.
    pub tail: Hint,
    /// When the condition failed, the value found.
    pub found: Option<Bytes>,
    pub counters: Counters,
}

#[derive(Debug, Clone)]
enum WriteState {
    Walking,
    Writing { tail: Hint },
    Cassing { tail: Hint, expected: u64 },
}

/// A write: walk to the tail, write the new version into its own node, CAS the tail's
/// next word from its marker to the node; a lost CAS returns the new next, which the walk
/// follows before trying again.
#[derive(Debug, Clone)]
pub struct WriteOp {
    walker: Walker,
    geometry: Geometry,
    node: NodeAddr,
    value: Option<Bytes>,
    /// `Some(expected)`: only if the current value is `expected`.
    condition: Option<Option<Bytes>>,
    state: WriteState,
    /// The node's value is in place; later attempts rewrite only its header.
    body_written: bool,
}

impl WriteOp {
    /// `node` is a free node the writer owns; `value` `None` writes "absent" (delete).
    pub fn new(
        geometry: &Geometry,
        key_id: u64,
        hint: Hint,
        node: NodeAddr,
        value: Option<Bytes>,
        condition: Option<Option<Bytes>>,
        limits: ChainLimits,
    ) -> Result<WriteOp, ChainError> {
        let len = value.as_ref().map_or(0, Bytes::len);
        if len > geometry.value_bytes_max as usize {
            return Err(layout::LayoutError::ValueTooLarge {
                len,
                max: geometry.value_bytes_max,
            }
            .into());
        }
        // An unconditional write needs only the tail's header to learn its sequence
        // number; a conditional one compares the value too.
        let read_len = if condition.is_some() {
            geometry.node_bytes()
        } else {
            HEADER_BYTES
        };
        Ok(WriteOp {
            walker: Walker {
                key_id,
                cur: hint,
                read_len,
                limits,
                counters: Counters::default(),
            },
            geometry: *geometry,
            node,
            value,
            condition,
            state: WriteState::Walking,
            body_written: false,
        })
    }

    pub fn start(&mut self) -> Access {
        self.walker.visit()
    }

    fn at_tail(&mut self, tail: Hint, found: Option<Bytes>) -> Result<Step<WriteDone>, ChainError> {
        if let Some(expected) = &self.condition {
            if *expected != found {
                return Ok(Step::Finished(WriteDone {
                    applied: false,
                    tail,
                    found,
                    counters: self.walker.counters,
                }));
            }
        }
        let key_id = self.walker.key_id;
        let data = if self.body_written {
            layout::encode_relink(key_id, tail.seq + 1)
        } else {
            layout::encode_node(
                &self.geometry,
                self.node,
                key_id,
                tail.seq + 1,
                self.value.as_deref(),
                self.condition.is_none(),
            )?
        };
        self.state = WriteState::Writing { tail };
        Ok(Step::Issue(Access::Write {
            addr: self.node,
            data,
        }))
    }

    pub fn resume(&mut self, answer: Answer) -> Result<Step<WriteDone>, ChainError> {
        match (self.state.clone(), answer) {
            (WriteState::Walking, answer) => match self.walker.on_answer(answer)? {
                Walked::Go(a) => Ok(Step::Issue(a)),
                Walked::Tail(tail, value) => self.at_tail(tail, value),
            },
            (WriteState::Writing { tail }, Answer::Done) => {
                self.body_written = true;
                let expected = tail_marker(self.walker.key_id, tail.seq);
                self.state = WriteState::Cassing { tail, expected };
                Ok(Step::Issue(Access::Cas {
                    addr: tail.addr,
                    expected,
                    new: self.node.encode(),
                }))
            }
            (WriteState::Cassing { tail, expected }, Answer::Word(before)) => {
                if before == expected {
                    return Ok(Step::Finished(WriteDone {
                        applied: true,
                        tail: Hint {
                            addr: self.node,
                            seq: tail.seq + 1,
                        },
                        found: None,
                        counters: self.walker.counters,
                    }));
                }
                // A middlebox linked the node after the real tail itself (only ever for a
                // node written relinkable, i.e. without a condition, and only later on).
                if let Some(seq) = layout::relinked_seq(before) {
                    if self.condition.is_some() || seq <= tail.seq {
                        // A middlebox linked a node it must not have: the node may be
                        // in the chain, so it is neither reused nor linked again.
                        return Err(ChainError::Relinked(before));
                    }
                    self.walker.counters.relinked += 1;
                    return Ok(Step::Finished(WriteDone {
                        applied: true,
                        tail: Hint {
                            addr: self.node,
                            seq,
                        },
                        found: None,
                        counters: self.walker.counters,
                    }));
                }
                self.walker.counters.cas_failures += 1;
                let failures = self.walker.counters.cas_failures;
                if failures > self.walker.limits.cas_retries_max {
                    return Err(ChainError::TooManyCasRetries(failures - 1));
                }
                self.state = WriteState::Walking;
                let walked = match Next::decode(before) {
                    // Someone linked first: the walk goes on from their node.
                    Next::Node(a) => {
                        self.walker.cur = tail;
                        self.walker.follow(a)?
                    }
                    // The node we aimed at is no longer that version's tail.
                    _ => self.walker.restart()?,
                };
                match walked {
                    Walked::Go(a) => Ok(Step::Issue(a)),
                    Walked::Tail(t, v) => self.at_tail(t, v),
                }
            }
            (_, other) => Err(ChainError::UnexpectedAnswer(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{encode_node, relinked_word};

    fn tail_bytes(g: &Geometry, addr: NodeAddr, key: u64, seq: u64) -> Bytes {
        encode_node(g, addr, key, seq, Some(b"old"), false).unwrap()
    }

    /// Drives a write to its CAS (hint = the tail at version 3) and answers that CAS.
    fn write_answered(condition: Option<Option<Bytes>>, cas_answer: u64) -> Step<WriteDone> {
        write_answered_result(condition, cas_answer).unwrap()
    }

    fn write_answered_result(
        condition: Option<Option<Bytes>>,
        cas_answer: u64,
    ) -> Result<Step<WriteDone>, ChainError> {
        let g = Geometry::new(8, 16).unwrap();
        let tail = NodeAddr { block: 0, slot: 1 };
        let node = NodeAddr { block: 0, slot: 2 };
        let hint = Hint { addr: tail, seq: 3 };
        let mut op = WriteOp::new(
            &g,
            9,
            hint,
            node,
            Some(Bytes::from_static(b"new")),
            condition,
            ChainLimits::default(),
        )
        .unwrap();
        assert!(matches!(op.start(), Access::Read { .. }));
        let Step::Issue(Access::Write { .. }) =
            op.resume(Answer::Data(tail_bytes(&g, tail, 9, 3))).unwrap()
        else {
            panic!("expected the node's WRITE");
        };
        let Step::Issue(Access::Cas { expected, .. }) = op.resume(Answer::Done).unwrap() else {
            panic!("expected the CAS");
        };
        assert_eq!(expected, tail_marker(9, 3));
        op.resume(Answer::Word(cas_answer))
    }

    #[test]
    fn a_relinked_answer_finishes_an_unconditional_write_at_that_version() {
        let Step::Finished(done) = write_answered(None, relinked_word(7)) else {
            panic!("not finished");
        };
        assert!(done.applied);
        assert_eq!(done.tail.seq, 7);
        assert_eq!(done.tail.addr, NodeAddr { block: 0, slot: 2 });
        assert_eq!((done.counters.relinked, done.counters.cas_failures), (1, 0));
    }

    #[test]
    fn a_relinked_answer_never_finishes_a_conditional_write() {
        // Conditional nodes are never written relinkable, so such an answer is a broken
        // middlebox: an error (the store then never reuses the node).
        let r = write_answered_result(Some(Some(Bytes::from_static(b"old"))), relinked_word(7));
        assert_eq!(r.unwrap_err(), ChainError::Relinked(relinked_word(7)));
        // Nor is a relinked word naming no later version believed.
        let r = write_answered_result(None, relinked_word(3));
        assert_eq!(r.unwrap_err(), ChainError::Relinked(relinked_word(3)));
    }

    fn marked(g: &Geometry, addr: NodeAddr, key: u64, seq: u64, redirected: bool) -> Bytes {
        let mut b = encode_node(g, addr, key, seq, Some(b"new"), true)
            .unwrap()
            .to_vec();
        if redirected {
            let flags = u32::from_le_bytes(b[28..32].try_into().unwrap()) | layout::FLAG_REDIRECTED;
            b[28..32].copy_from_slice(&flags.to_le_bytes());
        }
        Bytes::from(b)
    }

    fn read_answered(answer: Bytes) -> Step<ReadDone> {
        let g = Geometry::new(8, 16).unwrap();
        let hint = Hint {
            addr: NodeAddr { block: 0, slot: 1 },
            seq: 3,
        };
        let mut op = ReadOp::new(&g, 9, hint, ChainLimits::default());
        op.start();
        op.resume(Answer::Data(answer)).unwrap()
    }

    #[test]
    fn a_redirected_answer_jumps_only_forward_on_its_own_key() {
        let g = Geometry::new(8, 16).unwrap();
        let tail = NodeAddr { block: 2, slot: 7 };
        // Marked, same key, newer: the read ends there, at that node.
        let Step::Finished(done) = read_answered(marked(&g, tail, 9, 8, true)) else {
            panic!("not finished");
        };
        assert_eq!(done.tail, Hint { addr: tail, seq: 8 });
        assert_eq!(done.value.as_deref(), Some(&b"new"[..]));
        assert_eq!((done.counters.jumps, done.counters.restarts), (1, 0));
        // Unmarked newer version (a reused node, perhaps not linked): restart.
        assert!(matches!(
            read_answered(marked(&g, tail, 9, 8, false)),
            Step::Issue(Access::Head)
        ));
        // Marked but older, or another key's: restart.
        assert!(matches!(
            read_answered(marked(&g, tail, 9, 2, true)),
            Step::Issue(Access::Head)
        ));
        assert!(matches!(
            read_answered(marked(&g, tail, 10, 8, true)),
            Step::Issue(Access::Head)
        ));
    }
}
