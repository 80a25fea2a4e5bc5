//! The GIN TCP transport's wire format, sans IO: [`encode`] writes a frame's header, the
//! incremental [`Decoder`] reads frames back from any cut of the byte stream. No sockets here
//! (they are in [`super::tcp`]).
//!
//! # Frames
//! Every frame is a one-byte tag and fixed little-endian fields; a put's data follows its
//! header. Data is addressed by window id and offset, never by address.
//!
//! | tag | frame      | fields after the tag                                         | bytes |
//! |-----|------------|--------------------------------------------------------------|-------|
//! | 1   | `Hello`    | magic `u32` ("FLGT"), version `u16`, job `u64`, rank `u32`, context `u32` | 23 |
//! | 2   | `Put`      | window `u32`, offset `u64`, len `u64`, then `len` data bytes | 21 + len |
//! | 3   | `PutValue` | window `u32`, offset `u64`, value `u64`, bytes `u8` (1, 2, 4, 8) | 22 |
//! | 4   | `Signal`   | id `u32`, inc `u64`                                          | 13 |
//! | 5   | `Bye`      | none                                                         | 1 |
//!
//! A connection starts with one `Hello` (the sender's job, world rank and context); the rest
//! are `Put`, `PutValue` and `Signal` frames in the order the sender's proxy took them. A
//! sender that ends in order (its proxy stopped after draining) says `Bye` last, then closes;
//! a connection that closes without it lost its sender. Nothing may follow a `Bye`: the
//! decoder refuses any byte after it ([`WireError::AfterBye`]).
//!
//! # Limits
//! The decoder never allocates: it buffers at most one header ([`MAX_HEADER`] bytes) and
//! hands a put's data back as slices of what it is fed ([`Item::PutData`]), so whatever a
//! stranger sends costs no memory. A put's length is capped at [`MAX_PUT`], a value's width
//! must be 1, 2, 4 or 8, and `offset + len` must not overflow; anything else is a
//! [`WireError`], never a panic.

use super::RemoteLocation;

/// The `Hello` frame's magic: "FLGT" (ferrolink GIN over TCP).
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"FLGT");
/// The wire format's version (2: the `Bye` frame).
pub(crate) const VERSION: u16 = 2;
/// The largest put one frame carries (1 TiB): more is an error.
pub(crate) const MAX_PUT: u64 = 1 << 40;
/// The longest header (`Hello`).
pub(crate) const MAX_HEADER: usize = 23;
/// Bytes of a `Hello` frame.
pub(crate) const HELLO_HEADER: usize = 23;
/// Bytes of a `Put` frame's header.
pub(crate) const PUT_HEADER: usize = 21;
/// Bytes of a `PutValue` frame.
pub(crate) const PUT_VALUE_HEADER: usize = 22;
/// Bytes of a `Signal` frame.
pub(crate) const SIGNAL_HEADER: usize = 13;
/// Bytes of a `Bye` frame.
pub(crate) const BYE_HEADER: usize = 1;

const TAG_HELLO: u8 = 1;
const TAG_PUT: u8 = 2;
const TAG_PUT_VALUE: u8 = 3;
const TAG_SIGNAL: u8 = 4;
const TAG_BYE: u8 = 5;

/// A frame's header (a put's data is not part of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    /// The first frame of a connection: who sends on it.
    Hello {
        /// The job (communicator) id: a receiver closes connections of other jobs.
        job: u64,
        /// The sender's world rank.
        rank: u32,
        /// The context (queue) the connection carries.
        context: u32,
    },
    /// `len` bytes of data, which follow, for `dst`.
    Put {
        /// Where the data goes.
        dst: RemoteLocation,
        /// How many data bytes follow.
        len: u64,
    },
    /// Store the low `bytes` bytes of `value` at `dst`.
    PutValue {
        /// Where the value goes.
        dst: RemoteLocation,
        /// The value.
        value: u64,
        /// Its width: 1, 2, 4 or 8.
        bytes: u8,
    },
    /// Add `inc` to signal `id` (for the sender's slot), after everything before it.
    Signal {
        /// The signal.
        id: u32,
        /// What to add.
        inc: u64,
    },
    /// The sender's goodbye: it ends in order, and nothing follows on this connection.
    Bye,
}

/// What is wrong with a byte stream (or a frame to encode).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum WireError {
    /// A tag that is not a frame's.
    #[error("unknown GIN frame tag {0}")]
    UnknownTag(u8),
    /// A `Hello` without the magic: not a ferrolink GIN connection.
    #[error("not a ferrolink GIN connection (magic {0:#010x})")]
    BadMagic(u32),
    /// A `Hello` of another wire version.
    #[error("GIN wire version {0}, this build speaks version {VERSION}")]
    BadVersion(u16),
    /// A put longer than [`MAX_PUT`], or whose end overflows.
    #[error("a GIN put of {len} bytes at offset {offset} is too long (at most {MAX_PUT} bytes)")]
    TooLong {
        /// The offset.
        offset: u64,
        /// The length.
        len: u64,
    },
    /// A value of a width other than 1, 2, 4 or 8.
    #[error("a GIN value of {0} bytes (1, 2, 4 or 8)")]
    BadWidth(u8),
    /// Bytes after the sender's `Bye`.
    #[error("bytes after its goodbye (Bye frame)")]
    AfterBye,
}

/// An encoded header: up to [`MAX_HEADER`] bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Header {
    bytes: [u8; MAX_HEADER],
    len: usize,
}

impl Header {
    /// The header's bytes.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Bytes of the header a frame with tag `tag` has (the tag included), if it is a tag.
fn header_len(tag: u8) -> Option<usize> {
    match tag {
        TAG_HELLO => Some(HELLO_HEADER),
        TAG_PUT => Some(PUT_HEADER),
        TAG_PUT_VALUE => Some(PUT_VALUE_HEADER),
        TAG_SIGNAL => Some(SIGNAL_HEADER),
        TAG_BYE => Some(BYE_HEADER),
        _ => None,
    }
}

fn check_put(dst: RemoteLocation, len: u64) -> Result<(), WireError> {
    if len > MAX_PUT || dst.offset.checked_add(len).is_none() {
        return Err(WireError::TooLong { offset: dst.offset, len });
    }
    Ok(())
}

fn check_width(bytes: u8) -> Result<(), WireError> {
    match bytes {
        1 | 2 | 4 | 8 => Ok(()),
        other => Err(WireError::BadWidth(other)),
    }
}

/// Appends little-endian fields to a fixed header.
struct Writer {
    h: Header,
}

impl Writer {
    fn new(tag: u8) -> Writer {
        let mut h = Header { bytes: [0; MAX_HEADER], len: 1 };
        h.bytes[0] = tag;
        Writer { h }
    }
    fn put(mut self, b: &[u8]) -> Writer {
        self.h.bytes[self.h.len..self.h.len + b.len()].copy_from_slice(b);
        self.h.len += b.len();
        self
    }
}

/// The header of `frame` (a put's data is sent after it). Errors for frames a decoder would
/// refuse (a put over [`MAX_PUT`], a value of another width than 1, 2, 4 or 8).
pub(crate) fn encode(frame: &Frame) -> Result<Header, WireError> {
    let w = match *frame {
        Frame::Hello { job, rank, context } => Writer::new(TAG_HELLO)
            .put(&MAGIC.to_le_bytes())
            .put(&VERSION.to_le_bytes())
            .put(&job.to_le_bytes())
            .put(&rank.to_le_bytes())
            .put(&context.to_le_bytes()),
        Frame::Put { dst, len } => {
            check_put(dst, len)?;
            Writer::new(TAG_PUT).put(&dst.window.to_le_bytes()).put(&dst.offset.to_le_bytes()).put(&len.to_le_bytes())
        }
        Frame::PutValue { dst, value, bytes } => {
            check_width(bytes)?;
            Writer::new(TAG_PUT_VALUE)
                .put(&dst.window.to_le_bytes())
                .put(&dst.offset.to_le_bytes())
                .put(&value.to_le_bytes())
                .put(&[bytes])
        }
        Frame::Signal { id, inc } => Writer::new(TAG_SIGNAL).put(&id.to_le_bytes()).put(&inc.to_le_bytes()),
        Frame::Bye => Writer::new(TAG_BYE),
    };
    debug_assert_eq!(Some(w.h.len), header_len(w.h.bytes[0]));
    Ok(w.h)
}

/// Appends the header of `frame` to `out`.
#[cfg(test)]
pub(crate) fn encode_to(frame: &Frame, out: &mut Vec<u8>) -> Result<(), WireError> {
    out.extend_from_slice(encode(frame)?.as_bytes());
    Ok(())
}

/// What the decoder read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Item<'a> {
    /// A `Hello`.
    Hello {
        /// The sender's job.
        job: u64,
        /// The sender's world rank.
        rank: u32,
        /// The connection's context.
        context: u32,
    },
    /// A piece of a put's data: `data` goes at `dst` (the put's offset plus what came before).
    /// A put yields one or more pieces (one empty piece for an empty put); `last` marks its
    /// final one.
    PutData {
        /// Where this piece goes.
        dst: RemoteLocation,
        /// The piece: a slice of the decoder's input.
        data: &'a [u8],
        /// Whether the put is complete with this piece.
        last: bool,
    },
    /// A `PutValue`.
    PutValue {
        /// Where the value goes.
        dst: RemoteLocation,
        /// The value.
        value: u64,
        /// Its width (1, 2, 4 or 8).
        bytes: u8,
    },
    /// A `Signal`.
    Signal {
        /// The signal.
        id: u32,
        /// What to add.
        inc: u64,
    },
    /// The sender's `Bye`: the stream must end here.
    Bye,
}

/// The incremental decoder: feed it the stream's bytes as they come, cut anywhere.
#[derive(Clone, Debug, Default)]
pub(crate) struct Decoder {
    /// The header read so far.
    hdr: [u8; MAX_HEADER],
    have: usize,
    /// Inside a put's data: where the next byte goes and how many remain.
    data: Option<(RemoteLocation, u64)>,
    /// A `Bye` was read: nothing may follow.
    bye: bool,
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

impl Decoder {
    /// A decoder at the start of a stream.
    pub(crate) fn new() -> Decoder {
        Decoder::default()
    }

    /// Whether the stream read so far ends at a frame boundary (a clean place to close).
    pub(crate) fn at_boundary(&self) -> bool {
        self.have == 0 && self.data.is_none()
    }

    /// Whether the decoder is inside a put's data (more data bytes must follow).
    pub(crate) fn in_data(&self) -> bool {
        self.data.is_some()
    }

    /// Whether the stream said `Bye` (it may only end now).
    pub(crate) fn said_bye(&self) -> bool {
        self.bye
    }

    /// Reads from the front of `input` (advancing it) until it has an item or `input` is
    /// empty (`Ok(None)`). After an error the stream is broken: stop feeding it.
    pub(crate) fn decode<'a>(&mut self, input: &mut &'a [u8]) -> Result<Option<Item<'a>>, WireError> {
        if let Some((dst, remaining)) = self.data {
            return Ok(self.data_piece(input, dst, remaining));
        }
        if self.bye {
            return if input.is_empty() { Ok(None) } else { Err(WireError::AfterBye) };
        }
        let tag = if self.have == 0 { input.first().copied() } else { Some(self.hdr[0]) };
        let Some(tag) = tag else { return Ok(None) };
        let need = header_len(tag).ok_or(WireError::UnknownTag(tag))?;
        let take = (need - self.have).min(input.len());
        self.hdr[self.have..self.have + take].copy_from_slice(&input[..take]);
        self.have += take;
        *input = &input[take..];
        if self.have < need {
            return Ok(None);
        }
        self.have = 0;
        let h = &self.hdr[1..need];
        let item = match tag {
            TAG_HELLO => {
                let magic = le_u32(h);
                if magic != MAGIC {
                    return Err(WireError::BadMagic(magic));
                }
                let version = u16::from_le_bytes([h[4], h[5]]);
                if version != VERSION {
                    return Err(WireError::BadVersion(version));
                }
                Item::Hello { job: le_u64(&h[6..]), rank: le_u32(&h[14..]), context: le_u32(&h[18..]) }
            }
            TAG_PUT => {
                let dst = RemoteLocation { window: le_u32(h), offset: le_u64(&h[4..]) };
                let len = le_u64(&h[12..]);
                check_put(dst, len)?;
                if len == 0 {
                    return Ok(Some(Item::PutData { dst, data: &[], last: true }));
                }
                self.data = Some((dst, len));
                return Ok(self.data_piece(input, dst, len));
            }
            TAG_PUT_VALUE => {
                let dst = RemoteLocation { window: le_u32(h), offset: le_u64(&h[4..]) };
                let bytes = h[20];
                check_width(bytes)?;
                Item::PutValue { dst, value: le_u64(&h[12..]), bytes }
            }
            TAG_SIGNAL => Item::Signal { id: le_u32(h), inc: le_u64(&h[4..]) },
            TAG_BYE => {
                self.bye = true;
                Item::Bye
            }
            _ => unreachable!("header_len accepted the tag"),
        };
        Ok(Some(item))
    }

    /// The next piece of the current put's data from `input`, if it has any.
    fn data_piece<'a>(&mut self, input: &mut &'a [u8], dst: RemoteLocation, remaining: u64) -> Option<Item<'a>> {
        let n = usize::try_from(remaining).unwrap_or(usize::MAX).min(input.len());
        if n == 0 {
            return None;
        }
        let (data, rest) = input.split_at(n);
        *input = rest;
        let left = remaining - n as u64;
        self.data = (left > 0).then(|| (RemoteLocation { window: dst.window, offset: dst.offset + n as u64 }, left));
        Some(Item::PutData { dst, data, last: left == 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A whole frame: the header and, for a put, its data.
    #[derive(Clone, Debug, PartialEq, Eq)]
    enum Whole {
        Hello { job: u64, rank: u32, context: u32 },
        Put { dst: RemoteLocation, data: Vec<u8> },
        PutValue { dst: RemoteLocation, value: u64, bytes: u8 },
        Signal { id: u32, inc: u64 },
        Bye,
    }

    fn bytes_of(w: &Whole) -> Vec<u8> {
        let mut out = Vec::new();
        match w {
            Whole::Hello { job, rank, context } => {
                encode_to(&Frame::Hello { job: *job, rank: *rank, context: *context }, &mut out).unwrap()
            }
            Whole::Put { dst, data } => {
                encode_to(&Frame::Put { dst: *dst, len: data.len() as u64 }, &mut out).unwrap();
                out.extend_from_slice(data);
            }
            Whole::PutValue { dst, value, bytes } => {
                encode_to(&Frame::PutValue { dst: *dst, value: *value, bytes: *bytes }, &mut out).unwrap()
            }
            Whole::Signal { id, inc } => encode_to(&Frame::Signal { id: *id, inc: *inc }, &mut out).unwrap(),
            Whole::Bye => encode_to(&Frame::Bye, &mut out).unwrap(),
        }
        out
    }

    /// Feeds `bytes` cut at `cuts`; returns the whole frames decoded (put pieces joined, their
    /// offsets checked) and the error that ended it, if any.
    fn feed(dec: &mut Decoder, bytes: &[u8], cuts: &[usize]) -> (Vec<Whole>, Option<WireError>) {
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        points.push(0);
        points.push(bytes.len());
        points.sort_unstable();
        let mut frames = Vec::new();
        let mut put: Option<(RemoteLocation, Vec<u8>)> = None;
        for w in points.windows(2) {
            let mut input = &bytes[w[0]..w[1]];
            loop {
                match dec.decode(&mut input) {
                    Ok(Some(Item::PutData { dst, data, last })) => {
                        let (start, buf) = put.get_or_insert_with(|| (dst, Vec::new()));
                        assert_eq!(dst.window, start.window);
                        assert_eq!(dst.offset, start.offset + buf.len() as u64, "pieces are contiguous");
                        assert!(!data.is_empty() || last, "only an empty put yields an empty piece");
                        buf.extend_from_slice(data);
                        if last {
                            let (dst, data) = put.take().expect("a put in progress");
                            frames.push(Whole::Put { dst, data });
                        }
                    }
                    Ok(Some(Item::Hello { job, rank, context })) => frames.push(Whole::Hello { job, rank, context }),
                    Ok(Some(Item::PutValue { dst, value, bytes })) => {
                        frames.push(Whole::PutValue { dst, value, bytes })
                    }
                    Ok(Some(Item::Signal { id, inc })) => frames.push(Whole::Signal { id, inc }),
                    Ok(Some(Item::Bye)) => frames.push(Whole::Bye),
                    Ok(None) => {
                        assert!(input.is_empty(), "Ok(None) only once the input is used up");
                        break;
                    }
                    Err(e) => return (frames, Some(e)),
                }
            }
        }
        (frames, None)
    }

    fn any_dst() -> impl Strategy<Value = RemoteLocation> {
        (any::<u32>(), 0u64..(1 << 50)).prop_map(|(window, offset)| RemoteLocation { window, offset })
    }

    /// Any frame but `Bye` (which only ends a stream).
    fn any_whole() -> impl Strategy<Value = Whole> {
        prop_oneof![
            (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(job, rank, context)| Whole::Hello {
                job,
                rank,
                context
            }),
            (any_dst(), proptest::collection::vec(any::<u8>(), 0..600))
                .prop_map(|(dst, data)| Whole::Put { dst, data }),
            (any_dst(), any::<u64>(), prop_oneof![Just(1u8), Just(2), Just(4), Just(8)])
                .prop_map(|(dst, value, bytes)| Whole::PutValue { dst, value, bytes }),
            (any::<u32>(), any::<u64>()).prop_map(|(id, inc)| Whole::Signal { id, inc }),
        ]
    }

    /// A stream's frames: `min..max` frames, then a `Bye` or not (as a sender that ends in
    /// order, or one that died).
    fn any_stream(min: usize, max: usize) -> impl Strategy<Value = Vec<Whole>> {
        (proptest::collection::vec(any_whole(), min..max), any::<bool>()).prop_map(|(mut frames, bye)| {
            if bye {
                frames.push(Whole::Bye);
            }
            frames
        })
    }

    #[test]
    fn every_frame_round_trips_in_one_piece() {
        let dst = RemoteLocation { window: 7, offset: 4096 };
        let frames = vec![
            Whole::Hello { job: 0xfeed, rank: 3, context: 1 },
            Whole::Put { dst, data: (0..=255).collect() },
            Whole::Put { dst, data: Vec::new() },
            Whole::PutValue { dst, value: u64::MAX, bytes: 2 },
            Whole::Signal { id: 9, inc: 1 << 40 },
            Whole::Bye,
        ];
        let bytes: Vec<u8> = frames.iter().flat_map(bytes_of).collect();
        let mut dec = Decoder::new();
        assert_eq!(feed(&mut dec, &bytes, &[]), (frames, None));
        assert!(dec.at_boundary());
        assert!(dec.said_bye());
    }

    #[test]
    fn nothing_may_follow_a_bye() {
        let mut bytes = bytes_of(&Whole::Signal { id: 1, inc: 2 });
        bytes.extend(bytes_of(&Whole::Bye));
        let mut dec = Decoder::new();
        assert_eq!(feed(&mut dec, &bytes, &[]), (vec![Whole::Signal { id: 1, inc: 2 }, Whole::Bye], None));
        assert!(dec.said_bye() && dec.at_boundary());
        // The end of the stream (no more input) is fine; any further byte is not.
        assert_eq!(dec.decode(&mut &[][..]), Ok(None));
        for next in [bytes_of(&Whole::Bye), bytes_of(&Whole::Signal { id: 1, inc: 2 }), vec![0u8]] {
            assert_eq!(dec.clone().decode(&mut &next[..]), Err(WireError::AfterBye));
        }
        // Bytes after a Bye in the same read are refused too.
        bytes.push(TAG_SIGNAL);
        assert_eq!(feed(&mut Decoder::new(), &bytes, &[]).1, Some(WireError::AfterBye));
        // A stream without a Bye has not said one.
        let mut dec = Decoder::new();
        feed(&mut dec, &bytes_of(&Whole::Signal { id: 1, inc: 2 }), &[]);
        assert!(!dec.said_bye());
    }

    #[test]
    fn headers_have_their_documented_lengths() {
        let dst = RemoteLocation { window: 1, offset: 2 };
        assert_eq!(encode(&Frame::Hello { job: 1, rank: 2, context: 3 }).unwrap().as_bytes().len(), 23);
        assert_eq!(encode(&Frame::Put { dst, len: 5 }).unwrap().as_bytes().len(), 21);
        assert_eq!(encode(&Frame::PutValue { dst, value: 5, bytes: 4 }).unwrap().as_bytes().len(), 22);
        assert_eq!(encode(&Frame::Signal { id: 1, inc: 1 }).unwrap().as_bytes().len(), 13);
        assert_eq!(encode(&Frame::Bye).unwrap().as_bytes(), &[5]);
    }

    #[test]
    fn encode_refuses_what_a_decoder_would_refuse() {
        let dst = RemoteLocation { window: 1, offset: 0 };
        assert!(matches!(encode(&Frame::Put { dst, len: MAX_PUT + 1 }), Err(WireError::TooLong { .. })));
        let end = RemoteLocation { window: 1, offset: u64::MAX };
        assert!(matches!(encode(&Frame::Put { dst: end, len: 1 }), Err(WireError::TooLong { .. })));
        assert_eq!(encode(&Frame::PutValue { dst, value: 0, bytes: 3 }).unwrap_err(), WireError::BadWidth(3));
    }

    #[test]
    fn decoder_refuses_malformed_headers() {
        let mut dec = Decoder::new();
        assert_eq!(dec.decode(&mut &[0u8][..]), Err(WireError::UnknownTag(0)));
        let mut hello = encode(&Frame::Hello { job: 1, rank: 0, context: 0 }).unwrap().as_bytes().to_vec();
        hello[1] ^= 1;
        assert!(matches!(Decoder::new().decode(&mut &hello[..]), Err(WireError::BadMagic(_))));
        let mut hello = encode(&Frame::Hello { job: 1, rank: 0, context: 0 }).unwrap().as_bytes().to_vec();
        hello[5] = 9;
        assert_eq!(Decoder::new().decode(&mut &hello[..]), Err(WireError::BadVersion(9)));
        // A put header claiming more than the cap: refused before any data is awaited.
        let mut put = encode(&Frame::Put { dst: RemoteLocation { window: 0, offset: 0 }, len: 1 }).unwrap();
        put.bytes[13..21].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(Decoder::new().decode(&mut put.as_bytes()), Err(WireError::TooLong { .. })));
    }

    #[test]
    fn a_cut_stream_is_not_at_a_boundary() {
        let dst = RemoteLocation { window: 0, offset: 0 };
        let bytes = bytes_of(&Whole::Put { dst, data: vec![1; 10] });
        for cut in 1..bytes.len() {
            let mut dec = Decoder::new();
            let (_, err) = feed(&mut dec, &bytes[..cut], &[]);
            assert_eq!(err, None);
            assert!(!dec.at_boundary(), "cut at {cut}");
            assert_eq!(dec.in_data(), cut >= 21);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

        /// Random bytes, alone or behind each valid tag: never a panic.
        #[test]
        fn random_bytes_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..4096),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
            tag in 0u8..7,
        ) {
            let _ = feed(&mut Decoder::new(), &bytes, &cuts);
            let mut tagged = vec![tag];
            tagged.extend_from_slice(&bytes);
            let _ = feed(&mut Decoder::new(), &tagged, &cuts);
            let mut hello = encode(&Frame::Hello { job: 1, rank: 2, context: 3 }).unwrap().as_bytes().to_vec();
            hello.extend_from_slice(&bytes);
            let _ = feed(&mut Decoder::new(), &hello, &cuts);
        }

        /// Valid frames, concatenated and cut at random points, decode back equal.
        #[test]
        fn valid_frames_cut_anywhere_decode_back_equal(
            frames in any_stream(0, 8),
            cuts in proptest::collection::vec(any::<usize>(), 0..16),
        ) {
            let bytes: Vec<u8> = frames.iter().flat_map(bytes_of).collect();
            let mut dec = Decoder::new();
            let (got, err) = feed(&mut dec, &bytes, &cuts);
            prop_assert_eq!(err, None);
            prop_assert_eq!(dec.said_bye(), frames.last() == Some(&Whole::Bye));
            prop_assert_eq!(got, frames);
            prop_assert!(dec.at_boundary());
        }

        /// Valid frames truncated anywhere: no error, the whole frames before the cut come
        /// back, and the decoder knows whether it stopped at a boundary.
        #[test]
        fn truncated_frames_decode_their_prefix(
            frames in any_stream(1, 6),
            cut in any::<usize>(),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let mut bytes = Vec::new();
            let mut ends = Vec::new();
            for f in &frames {
                bytes.extend(bytes_of(f));
                ends.push(bytes.len());
            }
            let cut = cut % (bytes.len() + 1);
            let mut dec = Decoder::new();
            let (got, err) = feed(&mut dec, &bytes[..cut], &cuts);
            prop_assert_eq!(err, None);
            let whole = ends.iter().filter(|&&e| e <= cut).count();
            prop_assert_eq!(&got[..], &frames[..whole]);
            prop_assert_eq!(dec.at_boundary(), cut == 0 || ends.contains(&cut));
        }

        /// Valid frames with random bits flipped: an error or some frames, never a panic; the
        /// frames before the first flipped byte come back intact.
        #[test]
        fn bit_flips_never_panic(
            frames in any_stream(1, 6),
            flips in proptest::collection::vec((any::<usize>(), 0u8..8), 1..6),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let mut bytes = Vec::new();
            let mut ends = Vec::new();
            for f in &frames {
                bytes.extend(bytes_of(f));
                ends.push(bytes.len());
            }
            let mut first = usize::MAX;
            for (at, bit) in flips {
                let at = at % bytes.len();
                bytes[at] ^= 1 << bit;
                first = first.min(at);
            }
            let (got, _) = feed(&mut Decoder::new(), &bytes, &cuts);
            let intact = ends.iter().filter(|&&e| e <= first).count();
            prop_assert!(got.len() >= intact);
            prop_assert_eq!(&got[..intact], &frames[..intact]);
        }
    }
}
