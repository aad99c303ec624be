//! The post-copy servers: the source answers the destination's fetches from its memory.

use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use guestmem_memory::{GuestMemory, PAGE_SIZE};
use guestmem_paging::affinity::CpuSet;
use guestmem_vm::layout;

use crate::compress::Compressor;
use crate::protocol::{link_error, read_frame, write_frame, Links};
use crate::stream::{compress_pages, Codec, Encoding, Frame, StreamError};
use crate::transport::{AnswerGauge, Connection, Cutter};
use crate::{Error, MigrationError, Result};

use super::{thread_failed, unexpected};

/// The post-copy servers: a thread per connection (its urgent ones pinned to
/// [`SendOptions::fault_cpus`] and real-time), started before the switch-over and handed the
/// urgent connections then. The destination's first faults come as soon as its vCPUs run,
/// sooner than a thread starts on a busy host: servers started or handed their connections
/// after the switch-over made those faults wait.
pub(super) struct PostcopyServers {
    /// A connection to serve, for each thread (pages connections, then urgent ones).
    jobs: Vec<SyncSender<(Connection, Arc<Vec<Cutter>>)>>,
    /// Each thread's connection back when it is done with it: its index, the connection, and
    /// the destination's report or why it broke.
    done: Receiver<(usize, Connection, Result<Vec<u8>>)>,
    threads: Vec<JoinHandle<()>>,
    pub(super) counters: Arc<ServeCounters>,
    /// The connections being served: their cutters (all of them, also those not handed over
    /// yet), how many are pages connections, and how many were handed over.
    cutters: Option<Arc<Vec<Cutter>>>,
    pages: usize,
    handed: usize,
}

/// What the post-copy servers sent: requests answered, their page bytes, and their bytes on
/// the wire.
#[derive(Default)]
pub(super) struct ServeCounters {
    pub(super) requests: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) wire: AtomicU64,
    /// The server whose connection broke first (`usize::MAX`: none): its error is the
    /// break's, the others' follow from the cut.
    pub(super) first_failed: AtomicUsize,
}

impl PostcopyServers {
    pub(super) fn spawn(
        pages: usize,
        urgent: usize,
        memory: &Arc<GuestMemory>,
        fault_cpus: Option<CpuSet>,
        compressor: Arc<Compressor>,
    ) -> Result<PostcopyServers> {
        let counters = Arc::new(ServeCounters {
            first_failed: AtomicUsize::new(usize::MAX),
            ..Default::default()
        });
        let (done_tx, done) = std::sync::mpsc::channel();
        let mut jobs = Vec::new();
        let mut threads = Vec::new();
        for i in 0..pages + urgent {
            let (tx, rx) = sync_channel::<(Connection, Arc<Vec<Cutter>>)>(1);
            let (memory, counters, done_tx) = (memory.clone(), counters.clone(), done_tx.clone());
            let compressor = compressor.clone();
            let is_urgent = i >= pages;
            let thread = std::thread::Builder::new()
                .name(format!(
                    "postcopy-{}{i}",
                    if is_urgent { "urgent" } else { "pages" }
                ))
                .spawn(move || {
                    if is_urgent {
                        if let Some(cpus) = fault_cpus {
                            if let Err(e) = cpus.pin_current_thread() {
                                tracing::warn!("fault server not pinned to {cpus:?}: {e}");
                            }
                        }
                        // A vCPU of the destination waits for every answer here: run ahead of
                        // the background fetches' server and of other tasks, as the
                        // destination's fault handlers do.
                        guestmem_paging::priority::make_realtime();
                    }
                    for (mut conn, cutters) in rx {
                        let answers = Answers {
                            compressor: &compressor,
                            urgent: is_urgent,
                        };
                        let r = serve(&mut conn, &memory, &counters, &answers);
                        if r.is_err() {
                            let _ = counters.first_failed.compare_exchange(
                                usize::MAX,
                                i,
                                Ordering::SeqCst,
                                Ordering::SeqCst,
                            );
                            // One connection broke: cut the others so that all of them are
                            // re-established together.
                            cutters.iter().for_each(Cutter::cut);
                        }
                        if done_tx.send((i, conn, r)).is_err() {
                            return;
                        }
                    }
                })
                .map_err(|e| link_error("starting a post-copy server", e))?;
            jobs.push(tx);
            threads.push(thread);
        }
        Ok(PostcopyServers {
            jobs,
            done,
            threads,
            counters,
            cutters: None,
            pages: 0,
            handed: 0,
        })
    }

    /// Hands the servers the urgent connections of `links` and, unless `urgent_only`, its pages
    /// connections too (taking them out of `links`).
    pub(super) fn hand(&mut self, links: &mut Links, urgent_only: bool) -> Result<()> {
        let cutters = match &self.cutters {
            Some(c) => c.clone(),
            None => {
                if links.pages.len() + links.urgent.len() != self.jobs.len() {
                    return Err(MigrationError::Thread {
                        what: format!(
                            "{} + {} connections for {} post-copy servers",
                            links.pages.len(),
                            links.urgent.len(),
                            self.jobs.len()
                        ),
                    }
                    .into());
                }
                self.pages = links.pages.len();
                self.cutters.insert(Arc::new(links.cutters()?)).clone()
            }
        };
        let urgent = std::mem::take(&mut links.urgent)
            .into_iter()
            .enumerate()
            .map(|(j, conn)| (self.pages + j, conn));
        let pages = if urgent_only {
            Vec::new()
        } else {
            std::mem::take(&mut links.pages)
        };
        for (i, conn) in urgent.chain(pages.into_iter().enumerate()) {
            self.jobs[i]
                .send((conn, cutters.clone()))
                .map_err(|_| thread_failed("a post-copy server thread ended"))?;
            self.handed += 1;
        }
        Ok(())
    }

    /// Serves every connection of `links` until each is done (they are back in `links` then):
    /// what each ended with, pages connections first.
    pub(super) fn serve(&mut self, links: &mut Links) -> Result<Vec<Result<Vec<u8>>>> {
        self.hand(links, false)?;
        let mut ended: Vec<Option<(Connection, Result<Vec<u8>>)>> =
            (0..self.jobs.len()).map(|_| None).collect();
        while self.handed > 0 {
            let (i, conn, r) = self
                .done
                .recv()
                .map_err(|_| thread_failed("a post-copy server thread panicked"))?;
            ended[i] = Some((conn, r));
            self.handed -= 1;
        }
        self.cutters = None;
        let (conns, results): (Vec<Connection>, Vec<_>) = ended.into_iter().flatten().unzip();
        let mut conns = conns.into_iter();
        links.pages = conns.by_ref().take(self.pages).collect();
        links.urgent = conns.collect();
        Ok(results)
    }
}

impl Drop for PostcopyServers {
    fn drop(&mut self) {
        // Servers still reading (a switch-over that failed after the urgent connections were
        // handed over): unblock them.
        if self.handed > 0 {
            for c in self.cutters.iter().flat_map(|c| c.iter()) {
                c.cut();
            }
        }
        self.jobs.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How a server compresses its answers: as the migration's compressor chooses, except that a
/// fault's answer (an urgent connection's) never takes zstd, whose CPU time a vCPU would wait
/// out (LZ4 instead: at 1 Gbit/s it halves a 32 KiB answer's 0.27 ms on the wire for about
/// 20 us of CPU).
pub(super) struct Answers<'a> {
    pub(super) compressor: &'a Compressor,
    pub(super) urgent: bool,
}

impl Answers<'_> {
    fn codec(&self) -> Codec {
        match self.compressor.choose() {
            Codec::Zstd(_) if self.urgent => Codec::Lz4,
            codec => codec,
        }
    }
}

/// Answers Requests from guest memory until the destination's Complete (its report JSON),
/// counting the page bytes it sends and what they take on the wire.
pub(super) fn serve(
    conn: &mut Connection,
    memory: &GuestMemory,
    counters: &ServeCounters,
    answers: &Answers<'_>,
) -> Result<Vec<u8>> {
    let ServeCounters {
        requests,
        bytes,
        wire,
        ..
    } = counters;
    let mut out = Vec::with_capacity(crate::stream::MAX_REQUEST as usize + 64);
    let mut scratch = Vec::new();
    // A fault's answer (an urgent connection's) is small and waited for: it would not measure
    // the link, and the gauge would add a syscall to every fault.
    let gauged = !answers.urgent;
    let mut gauge = AnswerGauge::default();
    loop {
        match read_frame(conn)? {
            Frame::Request { gpa, len } => {
                let link = if gauged { gauge.requested(conn) } else { None };
                let mut frame_out = std::mem::take(&mut out);
                // The answer lands in the destination pager's buffer: not fresh.
                let lines = Frame::encode_pages_with(
                    &mut frame_out,
                    gpa,
                    len as usize,
                    false,
                    // The channel (TLS) authenticates the answer's bytes.
                    Encoding {
                        whole_pages: false,
                        no_crc: true,
                    },
                    |at, piece| {
                        memory.read(gpa + at as u64, piece).map_err(|e| {
                            StreamError::Malformed(format!(
                                "request outside guest memory: {}",
                                crate::error_chain(&e, ": ")
                            ))
                        })
                    },
                )
                .map_err(Error::Stream)?;
                if lines == 0 {
                    write_frame(
                        conn,
                        &Frame::Zero {
                            gpa,
                            count: u64::from(len) / PAGE_SIZE,
                        },
                    )?;
                } else {
                    let codec = answers.codec();
                    let (encoded, t) = (frame_out.len(), Instant::now());
                    compress_pages(&mut frame_out, codec, &mut scratch).map_err(Error::Stream)?;
                    let compress_time = t.elapsed();
                    conn.write_all(&frame_out)
                        .and_then(|()| conn.flush())
                        .map_err(|e| Error::Stream(e.into()))?;
                    answers
                        .compressor
                        .record(codec, encoded, frame_out.len(), compress_time, link);
                    if gpa != layout::SYS_GPA {
                        bytes.fetch_add(u64::from(len), Ordering::Relaxed);
                        wire.fetch_add(frame_out.len() as u64, Ordering::Relaxed);
                    }
                }
                out = frame_out;
                // The destination's heartbeat (a page of the sys region, which post-copy never
                // fetches otherwise) is not a transfer.
                if gpa != layout::SYS_GPA {
                    requests.fetch_add(1, Ordering::Relaxed);
                }
            }
            Frame::Complete { report_json } => return Ok(report_json),
            other => return Err(unexpected(&other, "Request or Complete")),
        }
    }
}
