//! The frames: their header, payload and CRC-32, encoding and reading them (Pages frames'
//! own encoding is in `pages_frame`).

use std::io::{Read, Write};

use super::*;

/// One frame of the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// First frame each way: who speaks, and (from the source) the VM configuration as JSON.
    Hello {
        /// The JSON.
        config_json: Vec<u8>,
    },
    /// `pages.len() / 4096` guest pages starting at `gpa`; `fresh`: the receiver's memory
    /// there still holds zeros (see [`FRESH`]).
    Pages {
        /// The first page's guest address.
        gpa: u64,
        /// The pages' bytes.
        pages: Vec<u8>,
        /// The receiver's memory there still holds zeros.
        fresh: bool,
    },
    /// `count` guest pages starting at `gpa` are all zero (sent only where the destination may
    /// hold older, non-zero contents).
    Zero {
        /// The first page's guest address.
        gpa: u64,
        /// How many pages.
        count: u64,
    },
    /// The switch-over state (JSON: the machine's and the components' states, the memory
    /// digest, post-copy's stale chunks): the source's vCPUs are stopped.
    State {
        /// The JSON.
        state_json: Vec<u8>,
    },
    /// Destination to source (post-copy): send the `len` bytes (whole pages, at most
    /// [`MAX_REQUEST`]) at `gpa` now; the answer is one Pages or Zero frame for exactly them.
    Request {
        /// The guest address.
        gpa: u64,
        /// The bytes asked for.
        len: u32,
    },
    /// The end of round `round` (counted from 1) on this connection; `last`: no more pages
    /// will come on it before the State.
    EndOfRound {
        /// The round.
        round: u32,
        /// No more pages before the State.
        last: bool,
    },
    /// Destination to source: the destination has everything it needs from the source (pre-copy:
    /// it runs the VM; post-copy: all memory is resident), so the source may let go; with the
    /// destination's own figures (JSON).
    Complete {
        /// The destination's report (JSON).
        report_json: Vec<u8>,
    },
    /// The sender gives up, and says why.
    Abort {
        /// Why.
        reason: String,
    },
    /// Destination to source, after the State: memory and vCPU state are in place (and the
    /// memory digest matched, when the source sent one); waiting for Go.
    Ready,
    /// Source to destination: the source has stopped the VM for good; run it.
    Go,
    /// Destination to source: the vCPUs are running here (the end of the downtime).
    Running,
    /// `count` guest pages at `gpa`, each whole or as a delta against the receiver's copy:
    /// `body` is the PagesD payload after its header (sizes, then bodies; see the module
    /// docs), checked when decoded. Apply it with [`Frame::apply_delta`].
    Delta {
        /// The first page's guest address.
        gpa: u64,
        /// How many pages.
        count: u32,
        /// The PagesD payload after its header.
        body: Vec<u8>,
    },
}

/// What a frame does to the slice [`Frame::read_into`]'s `place` lends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lend {
    /// A Pages frame writes its pages there: every byte, or with `fresh` only the non-zero
    /// lines (the slice must then hold zeros elsewhere).
    Pages {
        /// The frame's FRESH flag: its zero lines are left unwritten.
        fresh: bool,
    },
    /// A PagesD frame patches the versions already there.
    Patch,
}

/// A frame read by [`Frame::read_into`]: Pages borrow the reader's buffer, or were placed.
#[derive(Debug, PartialEq)]
pub enum FrameRef<'b> {
    /// A Pages frame whose pages are in the reader's buffer.
    Pages {
        /// The first page's guest address.
        gpa: u64,
        /// The pages' bytes.
        pages: &'b [u8],
        /// The receiver's memory there still holds zeros.
        fresh: bool,
    },
    /// A Pages frame whose `len` bytes of pages were read into the slice `place` lent (its
    /// zero lines left unwritten when `fresh`).
    Placed {
        /// The first page's guest address.
        gpa: u64,
        /// The pages' bytes.
        len: usize,
        /// The zero lines were left unwritten.
        fresh: bool,
    },
    /// A PagesD frame applied to the slice `place` lent (its `len` bytes of pages at `gpa`).
    Patched {
        /// The first page's guest address.
        gpa: u64,
        /// The pages' bytes.
        len: usize,
    },
    /// Any other frame.
    Frame(Frame),
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => kind::HELLO,
            Frame::Pages { .. } => kind::PAGES,
            Frame::Zero { .. } => kind::ZERO,
            Frame::State { .. } => kind::STATE,
            Frame::Request { .. } => kind::REQUEST,
            Frame::EndOfRound { .. } => kind::END_OF_ROUND,
            Frame::Complete { .. } => kind::COMPLETE,
            Frame::Abort { .. } => kind::ABORT,
            Frame::Ready => kind::READY,
            Frame::Go => kind::GO,
            Frame::Running => kind::RUNNING,
            Frame::Delta { .. } => kind::PAGES_D,
        }
    }

    fn payload(&self) -> Vec<u8> {
        match self {
            Frame::Hello { config_json } => config_json.clone(),
            Frame::Pages { .. } => unreachable!("Pages are encoded by encode_pages_with"),
            Frame::Zero { gpa, count } => [gpa.to_le_bytes(), count.to_le_bytes()].concat(),
            Frame::State { state_json } => state_json.clone(),
            Frame::Request { gpa, len } => [&gpa.to_le_bytes()[..], &len.to_le_bytes()].concat(),
            Frame::EndOfRound { round, last } => {
                [&round.to_le_bytes()[..], &[u8::from(*last)]].concat()
            }
            Frame::Complete { report_json } => report_json.clone(),
            Frame::Ready | Frame::Go | Frame::Running => Vec::new(),
            Frame::Abort { reason } => reason.as_bytes().to_vec(),
            Frame::Delta { gpa, count, body } => {
                [&gpa.to_le_bytes()[..], &count.to_le_bytes(), &[0; 4], body].concat()
            }
        }
    }

    /// Encodes the frame. Fails (without writing) if it would exceed the largest Pages payload
    /// ([`MAX_PAYLOAD`] less the room only PagesZ frames get) or carries
    /// pages that are not whole.
    #[allow(clippy::cast_possible_truncation)] // frame lengths are bounded by MAX_PAYLOAD.
    pub fn encode(&self) -> Result<Vec<u8>, StreamError> {
        let mut out = Vec::new();
        if let Frame::Pages { gpa, pages, fresh } = self {
            Frame::encode_pages_with(
                &mut out,
                *gpa,
                pages.len(),
                *fresh,
                Encoding::default(),
                |at, piece| {
                    piece.copy_from_slice(&pages[at..at + piece.len()]);
                    Ok(())
                },
            )?;
            return Ok(out);
        }
        let payload = self.payload();
        if payload.len() > MAX_PAGES_PAYLOAD {
            return Err(StreamError::Malformed(format!(
                "payload of {} bytes exceeds {MAX_PAGES_PAYLOAD}",
                payload.len()
            )));
        }
        out.reserve(HEADER + payload.len() + 4);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&[self.kind(), 0, 0, 0]);
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&payload);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok(out)
    }

    /// Writes the frame (header, body, CRC-32) to `w`.
    pub fn write_to(&self, w: &mut impl Write) -> Result<(), StreamError> {
        w.write_all(&self.encode()?)?;
        Ok(())
    }

    /// Reads and checks one frame. A clean end of stream before a frame starts is
    /// [`StreamError::Closed`]; one in the middle of a frame is an I/O error.
    pub fn read_from(r: &mut impl Read) -> Result<Frame, StreamError> {
        let mut buf = Vec::new();
        Ok(match Frame::read_into(r, &mut buf, |_, _, _| None)? {
            FrameRef::Pages { gpa, pages, fresh } => Frame::Pages {
                gpa,
                pages: pages.to_vec(),
                fresh,
            },
            FrameRef::Placed { .. } | FrameRef::Patched { .. } => {
                unreachable!("nothing was lent to place pages in")
            }
            FrameRef::Frame(f) => f,
        })
    }

    /// Like [`Frame::read_from`], but reads into `buf` (kept for the next frame) and lends a
    /// Pages frame's pages from it: a receiver applying rounds of 2 MiB frames allocates, zeroes
    /// and frees nothing per frame.
    ///
    /// `place` may take a Pages frame's pages where they belong: asked with the frame's gpa,
    /// length and what the frame does there ([`Lend`]), it lends a slice of exactly that length (guest memory) or declines (`None`).
    /// Taken pages are written straight into it (runs of whole pages read there from `r`,
    /// saving a copy; a fresh frame's zero lines left unwritten), and come back as
    /// [`FrameRef::Placed`] once the CRC matched. A frame whose CRC does not match has already
    /// written its bytes there: only a receiver that throws that memory away on an error may
    /// place (a migration's destination before it runs the VM).
    ///
    /// A PagesD frame is checked whole first, then applied to the slice `place` lends
    /// ([`FrameRef::Patched`]), which must hold the versions its deltas were made against;
    /// declined, it comes back as a [`Frame::Delta`].
    pub fn read_into<'b>(
        r: &mut impl Read,
        buf: &'b mut Vec<u8>,
        place: impl FnOnce(u64, usize, Lend) -> Option<&'b mut [u8]>,
    ) -> Result<FrameRef<'b>, StreamError> {
        Frame::read_into_stream(r, buf, None, place)
    }

    /// [`Frame::read_into`] on a connection that may carry a zstd stream: PagesZ frames of the
    /// stream codec are decoded by `stream`, which must have seen every earlier one of the
    /// connection (without it, such a frame is [`StreamError::NoZstdStream`]).
    pub fn read_into_stream<'b>(
        r: &mut impl Read,
        buf: &'b mut Vec<u8>,
        stream: Option<&mut ZstdStreamDecoder>,
        place: impl FnOnce(u64, usize, Lend) -> Option<&'b mut [u8]>,
    ) -> Result<FrameRef<'b>, StreamError> {
        Frame::read_any(r, buf, stream, None, place)
    }

    /// [`Frame::read_into_stream`], but a Pages frame (plain, or the one a PagesZ frame holds)
    /// is read whole into `buf` (or decompressed into the thread's buffer), its CRC checked
    /// (unless it has none, [`NO_CRC`]: its channel checked the bytes), and only then handed
    /// to `land` from there ([`Land`]): runs of whole pages as they are, the pages with zero
    /// lines spread into `scratch` first (a multiple of the page size), zero lines written. It
    /// comes back as [`FrameRef::Placed`]; no byte of a frame found damaged is landed. `place`
    /// still takes PagesD frames.
    pub fn read_into_landing<'b>(
        r: &mut impl Read,
        buf: &'b mut Vec<u8>,
        stream: Option<&mut ZstdStreamDecoder>,
        (scratch, land): (&mut [u8], &mut Land<'_>),
        place: impl FnOnce(u64, usize, Lend) -> Option<&'b mut [u8]>,
    ) -> Result<FrameRef<'b>, StreamError> {
        Frame::read_any(r, buf, stream, Some((scratch, land)), place)
    }

    fn read_any<'b>(
        r: &mut impl Read,
        buf: &'b mut Vec<u8>,
        stream: Option<&mut ZstdStreamDecoder>,
        landing: Option<(&mut [u8], &mut Land<'_>)>,
        place: impl FnOnce(u64, usize, Lend) -> Option<&'b mut [u8]>,
    ) -> Result<FrameRef<'b>, StreamError> {
        let (header, len) = Frame::read_header(r)?;
        if header[4] == kind::PAGES_Z {
            return Frame::read_compressed(r, &header, len, buf, stream, landing, place);
        }

        if header[4] == kind::PAGES_D {
            return Frame::read_delta(r, &header, len, buf, place);
        }
        if header[4] != kind::PAGES {
            Frame::read_payload(r, &header, len, buf)?;
            return Frame::decode(header[4], &buf[..len]).map(FrameRef::Frame);
        }
        if let Some((scratch, land)) = landing {
            Frame::read_payload(r, &header, len, buf)?;
            return Frame::land_pages(&buf[..len], scratch, land);
        }
        Frame::read_pages(r, &header, len, buf, place)
    }

    /// Reads and checks a frame's header; returns it and the payload length.
    #[allow(clippy::cast_possible_truncation)] // MAX_PAGES_PAYLOAD is a few MiB.
    pub(super) fn read_header(r: &mut impl Read) -> Result<([u8; HEADER], usize), StreamError> {
        let mut header = [0u8; HEADER];
        let mut got = 0;
        while got < HEADER {
            match r.read(&mut header[got..]) {
                Ok(0) if got == 0 => return Err(StreamError::Closed),
                Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        let magic: [u8; 4] = header[..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(StreamError::Magic(magic));
        }
        if header[6..8] != [0, 0] {
            return Err(StreamError::Malformed(
                "reserved header bytes are not zero".into(),
            ));
        }
        let flags_allowed = match header[4] {
            kind::PAGES | kind::PAGES_Z => NO_CRC,
            _ => 0,
        };
        if header[5] & !flags_allowed != 0 {
            return Err(StreamError::Malformed(format!(
                "header flags {:#04x} on a frame of kind {}",
                header[5], header[4]
            )));
        }
        let len = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        // Only a PagesZ frame may exceed the largest Pages payload (see Z_SLACK).
        let max = if header[4] == kind::PAGES_Z {
            MAX_PAYLOAD
        } else {
            MAX_PAGES_PAYLOAD as u32
        };
        if len > max {
            return Err(StreamError::Malformed(format!(
                "payload length {len} exceeds {max}"
            )));
        }
        Ok((header, len as usize))
    }

    /// Reads the rest of a frame after its header: the payload lands at the start of `buf`
    /// (which only grows: its bytes are overwritten, not zeroed again), and the CRC over
    /// header and payload is checked (a frame flagged [`NO_CRC`] must have zero there).
    pub(super) fn read_payload(
        r: &mut impl Read,
        header: &[u8; HEADER],
        len: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), StreamError> {
        if buf.len() < len + 4 {
            buf.resize(len + 4, 0);
        }
        r.read_exact(&mut buf[..len + 4])?;
        let found = u32::from_le_bytes(buf[len..len + 4].try_into().expect("4 bytes"));
        if !has_crc(header) {
            return no_crc_field(found);
        }
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(header);
        hasher.update(&buf[..len]);
        check_crc(found, hasher.finalize())
    }

    #[allow(clippy::cast_possible_truncation)] // PAGE is 4096.
    pub(super) fn decode(kind: u8, p: &[u8]) -> Result<Frame, StreamError> {
        let malformed = |what: &str| StreamError::Malformed(format!("{what} ({} bytes)", p.len()));
        let u64_at = |at: usize| u64::from_le_bytes(p[at..at + 8].try_into().expect("8 bytes"));
        Ok(match kind {
            kind::HELLO => Frame::Hello {
                config_json: p.to_vec(),
            },
            kind::PAGES | kind::PAGES_D => unreachable!("read_into reads page frames itself"),
            kind::ZERO => {
                if p.len() != 16 {
                    return Err(malformed("a Zero frame holds a gpa and a count"));
                }
                let (gpa, count) = (u64_at(0), u64_at(8));
                if !gpa.is_multiple_of(PAGE as u64) || count == 0 {
                    return Err(StreamError::Malformed(format!(
                        "Zero frame {gpa:#x} x {count}"
                    )));
                }
                Frame::Zero { gpa, count }
            }
            kind::STATE => Frame::State {
                state_json: p.to_vec(),
            },
            kind::REQUEST => {
                if p.len() != 12 {
                    return Err(malformed("a Request frame holds a gpa and a length"));
                }
                let gpa = u64_at(0);
                let len = u32::from_le_bytes(p[8..12].try_into().expect("4 bytes"));
                if !gpa.is_multiple_of(PAGE as u64)
                    || len == 0
                    || !len.is_multiple_of(PAGE as u32)
                    || len > MAX_REQUEST
                {
                    return Err(StreamError::Malformed(format!(
                        "Request {gpa:#x}+{len:#x}: whole pages, at most {MAX_REQUEST:#x} bytes"
                    )));
                }
                Frame::Request { gpa, len }
            }
            kind::END_OF_ROUND => {
                if p.len() != 5 || p[4] > 1 {
                    return Err(malformed(
                        "an EndOfRound frame holds a round number and a last flag",
                    ));
                }
                Frame::EndOfRound {
                    round: u32::from_le_bytes(p[..4].try_into().expect("4 bytes")),
                    last: p[4] == 1,
                }
            }
            kind::COMPLETE => Frame::Complete {
                report_json: p.to_vec(),
            },
            kind::READY | kind::GO | kind::RUNNING => {
                if !p.is_empty() {
                    return Err(malformed("Ready, Go and Running frames are empty"));
                }
                match kind {
                    kind::READY => Frame::Ready,
                    kind::GO => Frame::Go,
                    _ => Frame::Running,
                }
            }
            kind::ABORT => Frame::Abort {
                reason: String::from_utf8_lossy(p).into_owned(),
            },
            other => {
                return Err(StreamError::Malformed(format!(
                    "unknown frame kind {other}"
                )))
            }
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// `count` pages of which page 1 is all zero and the others hold a few non-zero bytes
    /// (page 0 in its first and last lines, page 2 in one middle line).
    #[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
    pub(in crate::stream) fn sparse_pages(count: usize) -> Vec<u8> {
        let mut pages = vec![0u8; count * PAGE];
        for p in (0..count).filter(|p| p % 3 != 1) {
            let page = &mut pages[p * PAGE..(p + 1) * PAGE];
            if p % 3 == 0 {
                page[0] = 1 + p as u8;
                page[PAGE - 1] = 2;
            } else {
                page[33 * LINE + 5] = 9;
            }
        }
        pages
    }

    #[allow(clippy::cast_possible_truncation)] // test data: PAGE is 4096.
    fn samples() -> Vec<Frame> {
        vec![
            Frame::Hello {
                config_json: b"{}".to_vec(),
            },
            Frame::Pages {
                gpa: 0x4000_0000,
                pages: vec![7u8; 2 * PAGE],
                fresh: false,
            },
            Frame::Pages {
                gpa: 0x8000,
                pages: sparse_pages(3),
                fresh: true,
            },
            Frame::Zero {
                gpa: 0x1000,
                count: 3,
            },
            Frame::State {
                state_json: b"{\"vcpus\":[]}".to_vec(),
            },
            Frame::Request {
                gpa: 0x2000,
                len: 0x1000,
            },
            Frame::EndOfRound {
                round: 4,
                last: true,
            },
            Frame::Complete {
                report_json: b"{}".to_vec(),
            },
            Frame::Abort {
                reason: "source stopped".into(),
            },
            Frame::Ready,
            Frame::Go,
            Frame::Running,
            // One page whole, one as a delta (word 3 changed), one unchanged.
            Frame::Delta {
                gpa: 0x5000,
                count: 3,
                body: [
                    &(PAGE as u16).to_le_bytes()[..],
                    &10u16.to_le_bytes(),
                    &0u16.to_le_bytes(),
                    &[6u8; PAGE],
                    &[3, 1],
                    &[9u8; 8],
                ]
                .concat(),
            },
        ]
    }

    #[test]
    fn every_frame_round_trips() {
        let mut bytes = Vec::new();
        for f in samples() {
            f.write_to(&mut bytes).unwrap();
        }
        let mut r = &bytes[..];
        for f in samples() {
            assert_eq!(Frame::read_from(&mut r).unwrap(), f);
        }
        assert!(matches!(Frame::read_from(&mut r), Err(StreamError::Closed)));
    }

    /// `read_into` and `encode_pages_with` reuse their buffers across frames of different
    /// sizes and kinds, and read the same frames as `read_from`; a damaged frame read into a
    /// reused buffer is still an error.
    #[test]
    #[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
    fn reused_buffers_give_the_same_frames() {
        let mut bytes = Vec::new();
        let mut out = Vec::new();
        for (i, pages) in [3, 1, 2].into_iter().enumerate() {
            Frame::encode_pages_with(
                &mut out,
                0x1000 * i as u64,
                pages * PAGE,
                false,
                Encoding::default(),
                |_, buf| {
                    buf.fill(i as u8 + 1);
                    Ok(())
                },
            )
            .unwrap();
            bytes.extend_from_slice(&out);
        }
        for f in samples() {
            f.write_to(&mut bytes).unwrap();
        }
        let mut r = &bytes[..];
        let mut buf = Vec::new();
        for (i, pages) in [3, 1, 2].into_iter().enumerate() {
            match Frame::read_into(&mut r, &mut buf, |_, _, _| None).unwrap() {
                FrameRef::Pages { gpa, pages: p, .. } => {
                    assert_eq!(gpa, 0x1000 * i as u64);
                    assert_eq!(p, vec![i as u8 + 1; pages * PAGE]);
                }
                other => panic!("expected Pages, got {other:?}"),
            }
        }
        for f in samples() {
            let got = match Frame::read_into(&mut r, &mut buf, |_, _, _| None).unwrap() {
                FrameRef::Pages { gpa, pages, fresh } => Frame::Pages {
                    gpa,
                    pages: pages.to_vec(),
                    fresh,
                },
                FrameRef::Frame(f) => f,
                placed => panic!("nothing was placed, got {placed:?}"),
            };
            assert_eq!(got, f);
        }
        assert!(matches!(
            Frame::read_into(&mut r, &mut buf, |_, _, _| None),
            Err(StreamError::Closed)
        ));
        let mut bad = out.clone();
        bad[HEADER + 100] ^= 1;
        assert!(matches!(
            Frame::read_into(&mut &bad[..], &mut buf, |_, _, _| None),
            Err(StreamError::Checksum { .. })
        ));
    }

    #[test]
    fn damaged_frames_are_errors() {
        let good = Frame::Pages {
            gpa: 0x1000,
            pages: vec![1u8; PAGE],
            fresh: false,
        }
        .encode()
        .unwrap();
        // Any single flipped bit is caught (by the magic, the header checks or the CRC).
        for bit in (0..good.len() * 8).step_by(97) {
            let mut bad = good.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(Frame::read_from(&mut &bad[..]).is_err(), "bit {bit}");
        }
        // Every truncation is an error, not a short frame.
        for len in 1..good.len() {
            assert!(Frame::read_from(&mut &good[..len]).is_err(), "length {len}");
        }
        let mut wrong_version = good.clone();
        wrong_version[3] = b'9';
        let e = Frame::read_from(&mut &wrong_version[..]).unwrap_err();
        assert!(
            e.to_string()
                .contains("not a guestmem migration stream of this version"),
            "{e}"
        );
    }

    #[test]
    #[allow(clippy::cast_possible_truncation)] // test data: a short payload.
    fn oversized_and_ill_shaped_frames_are_refused() {
        // A header announcing 4 GiB is refused before anything is allocated.
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&[kind::PAGES, 0, 0, 0]);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        let e = Frame::read_from(&mut &huge[..]).unwrap_err();
        assert!(e.to_string().contains("exceeds"), "{e}");
        // Well-checksummed frames of the wrong shape.
        let pages_payload = |gpa: u64, count: u32, flags: u32, masks: &[u64], lines: usize| {
            let mut p = [
                &gpa.to_le_bytes()[..],
                &count.to_le_bytes(),
                &flags.to_le_bytes(),
            ]
            .concat();
            masks
                .iter()
                .for_each(|m| p.extend_from_slice(&m.to_le_bytes()));
            p.resize(p.len() + lines, 3);
            p
        };
        let forge = |kind: u8, payload: &[u8]| {
            let mut f = MAGIC.to_vec();
            f.extend_from_slice(&[kind, 0, 0, 0]);
            f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            f.extend_from_slice(payload);
            let crc = crc32fast::hash(&f);
            f.extend_from_slice(&crc.to_le_bytes());
            f
        };
        for (kind, payload) in [
            (kind::PAGES, vec![0u8; 8 + 100]),
            (kind::PAGES, pages_payload(0x1001, 1, 0, &[u64::MAX], PAGE)),
            (kind::PAGES, pages_payload(0x1000, 0, 0, &[], 0)),
            (kind::PAGES, pages_payload(0x1000, 1, 2, &[u64::MAX], PAGE)),
            (
                kind::PAGES,
                pages_payload(0, 513, 0, &[u64::MAX; 513], 513 * PAGE),
            ),
            // Masks announcing more (or fewer) lines than the frame carries.
            (kind::PAGES, pages_payload(0x1000, 1, 0, &[0b11], LINE)),
            (kind::PAGES, pages_payload(0x1000, 1, 0, &[0b1], 2 * LINE)),
            (kind::PAGES, pages_payload(0x1000, 2, 0, &[u64::MAX], PAGE)),
            (kind::ZERO, vec![0u8; 15]),
            (
                kind::ZERO,
                [0u64.to_le_bytes(), 0u64.to_le_bytes()].concat(),
            ),
            (kind::REQUEST, vec![]),
            (
                kind::REQUEST,
                [
                    &0x1000u64.to_le_bytes()[..],
                    &(MAX_REQUEST + 4096).to_le_bytes(),
                ]
                .concat(),
            ),
            (kind::GO, vec![0]),
            (kind::END_OF_ROUND, vec![1]),
            (kind::READY, vec![1]),
            (99, vec![]),
        ] {
            let e = Frame::read_from(&mut &forge(kind, &payload)[..]).unwrap_err();
            assert!(matches!(e, StreamError::Malformed(_)), "kind {kind}: {e}");
        }
        assert!(Frame::Pages {
            gpa: 0,
            pages: vec![0; 100],
            fresh: false,
        }
        .encode()
        .is_err());
        let mut out = Vec::new();
        Frame::encode_pages_with(
            &mut out,
            0x3000,
            2 * PAGE,
            false,
            Encoding::default(),
            |_, b| {
                b.fill(5);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(
            out,
            Frame::Pages {
                gpa: 0x3000,
                pages: vec![5u8; 2 * PAGE],
                fresh: false,
            }
            .encode()
            .unwrap()
        );
        for len in [100, 513 * PAGE] {
            assert!(Frame::encode_pages_with(
                &mut out,
                0,
                len,
                false,
                Encoding::default(),
                |_, _| Ok(())
            )
            .is_err());
        }
    }

    /// Random bytes never panic the decoder (the fuzz target in fuzz/ does this at scale).

    #[test]
    #[allow(clippy::cast_possible_truncation)] // test data: the low byte of a pattern.
    fn random_bytes_never_panic() {
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..2000 {
            let len = (next() % 64) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if next() % 2 == 0 && bytes.len() >= 4 {
                bytes[..4].copy_from_slice(&MAGIC);
            }
            let _ = Frame::read_from(&mut &bytes[..]);
        }
    }
}
