//! Forwarding a rank's stdout and stderr, each line prefixed with `[rank i] `.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::mpsc;
use std::thread;

/// A line longer than this is forwarded in pieces of this size, each as a line of its own
/// (so that a rank that never writes a newline cannot make the launcher hold unbounded memory).
const MAX_LINE: usize = 1 << 20;

/// Where forwarded lines go.
#[derive(Clone, Copy, Debug)]
pub enum Sink {
    /// The launcher's stdout.
    Stdout,
    /// The launcher's stderr.
    Stderr,
}

impl Sink {
    /// Writes one whole line under the stream's lock, so that lines of different ranks (and
    /// the launcher's own messages) never mix. Errors (a closed pipe) are ignored: the rank's
    /// output is still read, so that the rank never blocks on a full pipe.
    fn write_line(self, line: &[u8]) {
        let _ = match self {
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(line).and_then(|()| out.flush())
            }
            Sink::Stderr => {
                let mut err = io::stderr().lock();
                err.write_all(line).and_then(|()| err.flush())
            }
        };
    }
}

/// Starts a thread that copies `pipe` to `sink` line by line, each line prefixed with
/// `[rank {rank}] `; a last line without a newline gets one. `done` is dropped at end of file.
pub fn forward(rank: usize, pipe: impl Read + Send + 'static, sink: Sink, done: mpsc::Sender<()>) {
    let name = format!("rank-{rank}-{}", if matches!(sink, Sink::Stdout) { "out" } else { "err" });
    thread::Builder::new()
        .name(name)
        .spawn(move || {
            copy_lines(rank, pipe, |line| sink.write_line(line));
            drop(done);
        })
        .expect("a thread to forward a rank's output");
}

/// Reads `pipe` to its end and hands each prefixed line (with its newline) to `emit`.
fn copy_lines(rank: usize, pipe: impl Read, mut emit: impl FnMut(&[u8])) {
    let prefix = format!("[rank {rank}] ");
    let mut reader = BufReader::with_capacity(64 * 1024, pipe);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        line.extend_from_slice(prefix.as_bytes());
        match (&mut reader).take(MAX_LINE as u64).read_until(b'\n', &mut line) {
            Ok(0) => return,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                emit(&line);
            }
            // read_until retries EINTR itself: anything else ends the stream.
            Err(_) => {
                if line.len() > prefix.len() {
                    line.push(b'\n');
                    emit(&line);
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        copy_lines(3, input, |l| out.extend_from_slice(l));
        out
    }

    #[test]
    fn every_line_is_prefixed_and_a_partial_last_line_is_ended() {
        assert_eq!(lines(b""), b"");
        assert_eq!(lines(b"a\nb\n"), b"[rank 3] a\n[rank 3] b\n");
        assert_eq!(lines(b"a\n\npartial"), b"[rank 3] a\n[rank 3] \n[rank 3] partial\n");
        assert_eq!(lines(b"\xff\xfe bytes\n"), b"[rank 3] \xff\xfe bytes\n");
    }

    #[test]
    fn overlong_lines_are_split() {
        let input = vec![b'x'; MAX_LINE + 10];
        let out = lines(&input);
        let pieces: Vec<&[u8]> = out.split(|&b| b == b'\n').filter(|p| !p.is_empty()).collect();
        assert_eq!(pieces.len(), 2);
        assert_eq!(pieces[0].len(), "[rank 3] ".len() + MAX_LINE);
        assert_eq!(pieces[1], b"[rank 3] xxxxxxxxxx");
    }
}
