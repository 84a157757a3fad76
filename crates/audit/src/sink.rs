//! The append-only JSON Lines file sink: one event per line, fsync per batch, size-based
//! rotation, and the recovery that truncates a torn last line and reads the file's tail.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One delivered event, as a line of the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// The event's position in the outbox (ascending within a subject).
    pub seq: i64,
    /// The producer's stable event id (unique).
    pub event_id: String,
    /// What the event is about (a record key, a schedule, a paused item, a family).
    pub subject: String,
    /// What happened (`record.applied`, `pause.resolved`, ...).
    pub kind: String,
    /// Who did it.
    pub actor: String,
    /// When the producer's transaction wrote it, in milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// The event's JSON body.
    pub body: serde_json::Value,
}

/// Where and how the file sink writes.
#[derive(Debug, Clone)]
pub struct JsonlSink {
    path: PathBuf,
    max_bytes: u64,
    keep: usize,
}

impl JsonlSink {
    /// A sink appending to `path`, rotating at 64 MiB and keeping 4 rotated files by default.
    #[must_use]
    pub fn new(path: impl Into<PathBuf>) -> Self {
        JsonlSink {
            path: path.into(),
            max_bytes: 64 << 20,
            keep: 4,
        }
    }

    /// Rotates when the file has reached `bytes` (at least 1 KiB) before a batch is written.
    #[must_use]
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes.max(1024);
        self
    }

    /// How many rotated files (`PATH.1` newest .. `PATH.N`) are kept (at least 1).
    #[must_use]
    pub fn keep(mut self, n: usize) -> Self {
        self.keep = n.max(1);
        self
    }

    /// The file written.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The rotated file `n` (1 is the newest).
    #[must_use]
    pub fn rotated(&self, n: usize) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(format!(".{n}"));
        PathBuf::from(p)
    }

    /// Checks that the file can be opened for appending (its directory exists and is
    /// writable): a start-up check, so a bad path is a clear error before any delivery.
    ///
    /// # Errors
    ///
    /// The path and the system's reason.
    pub fn check(&self) -> Result<(), String> {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map(drop)
            .map_err(|e| format!("cannot open audit file {}: {e}", self.path.display()))
    }

    /// Recovery before this process writes: truncates a torn last line (a crash while
    /// writing; that batch was never marked delivered) and returns the event ids of the last
    /// `n` complete lines. Only the last batch a crashed holder wrote can be in the file and not
    /// marked delivered, and it is at the end.
    pub(crate) fn recover(&self, n: usize) -> io::Result<Vec<String>> {
        let mut f = match OpenOptions::new().read(true).write(true).open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let len = f.metadata()?.len();
        // Read backwards in blocks until n + 1 newlines are seen (or the start).
        let mut tail: Vec<u8> = Vec::new();
        let mut pos = len;
        const BLOCK: u64 = 64 * 1024;
        while pos > 0 && tail.iter().filter(|b| **b == b'\n').count() <= n {
            let start = pos.saturating_sub(BLOCK);
            let mut buf = vec![0u8; (pos - start) as usize];
            f.seek(SeekFrom::Start(start))?;
            f.read_exact(&mut buf)?;
            buf.extend_from_slice(&tail);
            tail = buf;
            pos = start;
        }
        // A torn last line: everything after the last newline.
        let complete = tail.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        if complete < tail.len() {
            let keep = pos + complete as u64;
            f.set_len(keep)?;
            f.sync_data()?;
            tail.truncate(complete);
        }
        let text = String::from_utf8_lossy(&tail);
        let mut lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if pos > 0 && !lines.is_empty() {
            // The first line read may be a fragment of a longer one.
            lines.remove(0);
        }
        let from = lines.len().saturating_sub(n);
        Ok(lines[from..]
            .iter()
            .filter_map(|l| serde_json::from_str::<Line>(l).ok())
            .map(|l| l.event_id)
            .collect())
    }

    /// Appends `lines` and fsyncs, rotating first when the file is full.
    pub(crate) fn append(&self, lines: &[Line]) -> io::Result<()> {
        if lines.is_empty() {
            return Ok(());
        }
        self.rotate_if_full()?;
        let mut out = Vec::with_capacity(lines.len() * 256);
        for l in lines {
            serde_json::to_writer(&mut out, l).map_err(io::Error::other)?;
            out.push(b'\n');
        }
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        f.write_all(&out)?;
        f.sync_data()
    }

    /// Rotation happens only before a write, after recovery: every line of a rotated file was
    /// marked delivered.
    fn rotate_if_full(&self) -> io::Result<()> {
        let len = match fs::metadata(&self.path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        if len < self.max_bytes {
            return Ok(());
        }
        let _ = fs::remove_file(self.rotated(self.keep));
        for n in (1..self.keep).rev() {
            let from = self.rotated(n);
            if from.exists() {
                fs::rename(&from, self.rotated(n + 1))?;
            }
        }
        fs::rename(&self.path, self.rotated(1))?;
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // The renames are durable before the next batch is written.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

/// Every line of the file at `path` and its rotated files, oldest first (a torn last line is
/// skipped). For `audit tail` and the tests.
///
/// # Errors
///
/// A file that cannot be read, or a complete line that is not an event.
pub fn read_lines(sink: &JsonlSink) -> io::Result<Vec<Line>> {
    let mut files: Vec<PathBuf> = (1..=sink.keep).rev().map(|n| sink.rotated(n)).collect();
    files.push(sink.path.clone());
    let mut out = Vec::new();
    for p in files {
        let f = match File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        let mut reader = BufReader::new(f);
        let mut buf = String::new();
        loop {
            buf.clear();
            if reader.read_line(&mut buf)? == 0 {
                break;
            }
            if !buf.ends_with('\n') {
                break; // torn: never delivered
            }
            let line: Line = serde_json::from_str(buf.trim_end()).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: not an audit event line: {e}", p.display()),
                )
            })?;
            out.push(line);
        }
    }
    Ok(out)
}
