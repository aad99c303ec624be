//! Admission: each connection's handshake, its certificate's role and its Hello on a thread of
//! its own, one migration at a time (the others are told the destination is busy), and the
//! collection of a migration's connections (or of its resumption's).

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::negotiate::Negotiated;
use crate::protocol::{read_hello, write_frame, ChannelRole, Hello, Links, Mode};
use crate::stream::Frame;
use crate::transport::{Accepted, Connection, Listener, Role, Timeouts};
use crate::{error_chain, Error, MigrationError, Result};

/// Connections in their handshake at once, at most: more are dropped as they come (a flood of
/// junk connections costs a thread each for at most the handshake timeout).
const MAX_HANDSHAKES: usize = 64;

/// The destination's admission of connections on a listener. Each accepted socket's TLS
/// handshake and Hello run in a thread of their own, bounded by the handshake timeout, so a
/// silent or junk connection holds nobody up and ends nothing but itself (it is refused, and
/// the refusal logged). The first pages connection of a new migration claims the destination;
/// connections of any other migration are answered Abort (the destination is busy) until the
/// claim ends with the migration.
pub(crate) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
    handshakes: AtomicUsize,
}

#[derive(Default)]
struct GateState {
    /// The migration this destination serves.
    current: Option<u64>,
    /// Connections of it, taken in (their Hello answered), not collected yet.
    arrived: Vec<Arrival>,
}

struct Arrival {
    conn: Connection,
    hello: Hello,
    /// What its Hello and the answer agreed on.
    negotiated: Negotiated,
    at: Instant,
}

/// A migration's hold on the destination, released when dropped.
pub(crate) struct Claim {
    gate: Arc<Gate>,
    migration: u64,
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut st = self.gate.lock();
        if st.current == Some(self.migration) {
            st.current = None;
        }
        st.arrived.retain(|a| a.hello.migration != self.migration);
    }
}

impl Gate {
    /// The listener's gate, started (with its accepting thread) on first use.
    pub(crate) fn of(listener: &Arc<Listener>) -> Arc<Gate> {
        listener
            .gate
            .get_or_init(|| {
                let gate = Arc::new(Gate {
                    state: Mutex::new(GateState::default()),
                    changed: Condvar::new(),
                    handshakes: AtomicUsize::new(0),
                });
                let (g, l) = (gate.clone(), listener.clone());
                std::thread::Builder::new()
                    .name("migrate-accept".into())
                    .spawn(move || g.accept_loop(&l))
                    .expect("spawning the accepting thread");
                gate
            })
            .clone()
            .downcast::<Gate>()
            .expect("only a Gate admits a listener's connections")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn accept_loop(self: &Arc<Self>, listener: &Listener) {
        loop {
            let accepted = match listener.accept_socket() {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(
                        "accepting a migration connection: {}",
                        error_chain(&e, ": ")
                    );
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            if self.handshakes.fetch_add(1, Ordering::SeqCst) >= MAX_HANDSHAKES {
                self.handshakes.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!(
                    "refused a connection from {}: {MAX_HANDSHAKES} connections are in their \
                     handshake already",
                    accepted.peer()
                );
                continue;
            }
            let gate = self.clone();
            let spawned = std::thread::Builder::new()
                .name("migrate-admit".into())
                .spawn(move || {
                    gate.admit(accepted);
                    gate.handshakes.fetch_sub(1, Ordering::SeqCst);
                });
            if let Err(e) = spawned {
                self.handshakes.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("refused a migration connection: no thread for it: {e}");
            }
        }
    }

    /// One connection: its handshake, its certificate's role, its Hello, and whether this
    /// destination takes it.
    fn admit(&self, accepted: Accepted) {
        let handshake = accepted.timeouts();
        let mut conn = match accepted.handshake() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("refused a migration connection: {}", error_chain(&e, ": "));
                return;
            }
        };
        if let Err(why) = conn.check_peer_role(Role::Source) {
            return refuse(&mut conn, why);
        }
        // The Hello is part of the connection's establishment: bounded as the handshake.
        let _ = conn.set_idle_timeout(Some(handshake.handshake));
        let hello = match read_hello(&mut conn) {
            Ok(h) => h,
            Err(e) => {
                let why = format!(
                    "{} sent no valid Hello: {}",
                    conn.peer(),
                    error_chain(&e, ": ")
                );
                return refuse(&mut conn, why);
            }
        };
        let _ = conn.set_idle_timeout(Some(handshake.idle));
        // A source outside this build's window is refused before it claims anything.
        let source = hello
            .guestmem
            .clone()
            .unwrap_or_else(|| hello.guestmem_version.clone());
        let (answer, negotiated) =
            match crate::negotiate::choose(&source, hello.protocols, hello.features.as_deref()) {
                Ok(chosen) => chosen,
                Err(why) => return refuse(&mut conn, why),
            };
        let verdict = {
            let mut st = self.lock();
            match st.current {
                Some(id) if id == hello.migration => Ok(()),
                Some(id) => Err(format!(
                    "the destination is busy with another migration ({id:#x}); migration {:#x} \
                     is refused (try again once that one is over)",
                    hello.migration
                )),
                None if hello.resume => Err(format!(
                    "the source resumes migration {:#x}, which this destination is not running",
                    hello.migration
                )),
                None if hello.channel != ChannelRole::Pages(0) => Err(format!(
                    "connection {:?} of migration {:#x} came before its first pages connection",
                    hello.channel, hello.migration
                )),
                None => {
                    st.current = Some(hello.migration);
                    Ok(())
                }
            }
        };
        if let Err(why) = verdict {
            return refuse(&mut conn, why);
        }
        // Before the answer: the source opens its next connection only once it has it.
        let at = Instant::now();
        let answer = serde_json::to_vec(&answer).expect("an answer serializes");
        if let Err(e) = write_frame(
            &mut conn,
            &Frame::Hello {
                config_json: answer,
            },
        ) {
            tracing::warn!(
                "a migration connection broke as it was taken in: {}",
                error_chain(&e, ": ")
            );
        }
        self.lock().arrived.push(Arrival {
            conn,
            hello,
            negotiated,
            at,
        });
        self.changed.notify_all();
    }

    /// Waits for the first pages connection of a new migration (`resume_of` `None`: the one
    /// that claimed the destination) or of the resumption of `resume_of`, then for its other
    /// connections, which must all come within the handshake timeout of the first. `None` when
    /// `stop` says so first.
    pub(crate) fn collect(
        self: &Arc<Self>,
        resume_of: Option<u64>,
        timeouts: Timeouts,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<(Links, Option<Claim>)>> {
        let resume = resume_of.is_some();
        let Some(first) = self.wait_first(resume_of, stop) else {
            return Ok(None);
        };
        let id = first.hello.migration;
        // A resumption goes on under the claim of the migration it resumes.
        let claim = (!resume).then(|| Claim {
            gate: self.clone(),
            migration: id,
        });
        let (pages, urgent) = (first.hello.pages, first.hello.urgent);
        let negotiated = first.negotiated;
        let mut main = first.conn;
        if pages == 0 || pages > 64 || urgent > 64 {
            return Err(abort_collection(
                &mut main,
                format!("{pages} pages and {urgent} urgent connections announced"),
            ));
        }
        let mut slots = Slots {
            slots: (0..pages + urgent).map(|_| None).collect(),
            id,
            pages,
            urgent,
            resume,
        };
        slots.slots[0] = Some(main);
        self.gather(&mut slots, timeouts.handshake)?;
        tracing::info!(
            protocol = negotiated.protocol,
            peer = %negotiated.peer,
            features = %negotiated.features.join(","),
            "migration negotiated"
        );
        Ok(Some((slots.into_links(negotiated), claim)))
    }

    /// The first pages connection of migration `resume_of` (a resumption's), or of the one
    /// the destination serves, once it arrives; `None` when `stop` says so first. Older
    /// arrivals of a resumption belong to an attempt that was given up: they are dropped.
    fn wait_first(&self, resume_of: Option<u64>, stop: &dyn Fn() -> bool) -> Option<Arrival> {
        let resume = resume_of.is_some();
        let mut st = self.lock();
        let first = loop {
            if stop() {
                return None;
            }
            let want = resume_of.or(st.current);
            if let Some(id) = want {
                if let Some(i) = st.arrived.iter().rposition(|a| {
                    a.hello.migration == id
                        && a.hello.channel == ChannelRole::Pages(0)
                        && a.hello.resume == resume
                }) {
                    break st.arrived.remove(i);
                }
            }
            st = self
                .changed
                .wait_timeout(st, Duration::from_millis(200))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        };
        if resume {
            let id = first.hello.migration;
            st.arrived
                .retain(|a| a.hello.migration != id || a.at >= first.at);
        }
        Some(first)
    }

    /// Fills `slots` with the migration's other connections as they arrive, up to `within`
    /// from now; one missing then, out of range or twice refuses the migration.
    fn gather(&self, slots: &mut Slots, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        let mut st = self.lock();
        while slots.slots.iter().any(Option::is_none) {
            let next = st
                .arrived
                .iter()
                .position(|a| a.hello.migration == slots.id);
            let Some(i) = next else {
                let now = Instant::now();
                if now >= deadline {
                    drop(st);
                    let why = slots.late(within);
                    return Err(abort_collection(slots.main(), why));
                }
                st = self
                    .changed
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
                continue;
            };
            let Arrival { conn, hello: h, .. } = st.arrived.remove(i);
            match slots.slot_of(&h) {
                Ok(s) => slots.slots[s] = Some(conn),
                Err(why) => {
                    drop(st);
                    return Err(abort_collection(slots.main(), why));
                }
            }
        }
        Ok(())
    }
}

/// A migration's connections being collected: pages connections first, then urgent ones.
struct Slots {
    slots: Vec<Option<Connection>>,
    id: u64,
    pages: usize,
    urgent: usize,
    resume: bool,
}

impl Slots {
    /// The first connection, which carries refusals.
    fn main(&mut self) -> &mut Connection {
        self.slots[0].as_mut().expect("the first connection")
    }

    /// The slot of the connection that said `h`, or why it is refused.
    fn slot_of(&self, h: &Hello) -> std::result::Result<usize, String> {
        let (pages, urgent) = (self.pages, self.urgent);
        let slot = match h.channel {
            ChannelRole::Pages(i) if i < pages => Some(i),
            ChannelRole::Urgent(i) if i < urgent => Some(pages + i),
            _ => None,
        };
        match slot {
            None => Err(format!(
                "connection {:?} is outside the {pages} + {urgent} announced",
                h.channel
            )),
            Some(s) if self.slots[s].is_some() || h.resume != self.resume => Err(format!(
                "connection {:?} of migration {:#x} came twice",
                h.channel, self.id
            )),
            Some(s) => Ok(s),
        }
    }

    /// Why the connections still missing are refused, `within` after the first came.
    fn late(&self, within: Duration) -> String {
        let missing: Vec<String> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_none())
            .map(|(i, _)| {
                if i < self.pages {
                    format!("pages connection {i}")
                } else {
                    format!("urgent connection {}", i - self.pages)
                }
            })
            .collect();
        let main = self.slots[0].as_ref().expect("the first connection");
        format!(
            "{} of migration {:#x} did not come within {} s of its first \
             connection (the handshake timeout; from {})",
            missing.join(", "),
            self.id,
            within.as_secs_f64(),
            main.peer()
        )
    }

    /// The links, every slot filled.
    fn into_links(self, negotiated: Negotiated) -> Links {
        let mut all = self
            .slots
            .into_iter()
            .map(|s| s.expect("every slot filled"));
        Links {
            pages: all.by_ref().take(self.pages).collect(),
            urgent: all.collect(),
            migration: self.id,
            mode: Mode::Precopy,
            negotiated,
        }
    }
}

/// Tells the source why its connections are refused (an Abort on the first), and returns it.
fn abort_collection(main: &mut Connection, reason: String) -> Error {
    let _ = write_frame(
        main,
        &Frame::Abort {
            reason: reason.clone(),
        },
    );
    Error::Migration(MigrationError::Connections { reason })
}

/// Tells a refused connection why (an Abort), and lets it read that before the socket closes
/// (closing with its data unread would reset the connection, and the Abort could be lost).
fn refuse(conn: &mut Connection, why: String) {
    tracing::warn!("refused a migration connection: {why}");
    if write_frame(conn, &Frame::Abort { reason: why }).is_ok() {
        let _ = conn.set_idle_timeout(Some(Duration::from_secs(2)));
        let mut sink = [0u8; 4096];
        while matches!(io::Read::read(conn, &mut sink), Ok(n) if n > 0) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages connections take the first slots and urgent ones the rest; a channel outside
    /// those announced, or one that comes twice (or of the other kind of attempt), is refused.
    #[test]
    fn each_connection_takes_its_own_slot_once() {
        let slots = Slots {
            slots: vec![None, None, None],
            id: 0x2a,
            pages: 2,
            urgent: 1,
            resume: false,
        };
        let hello = |channel, resume| Hello {
            guestmem_version: String::new(),
            guestmem: None,
            protocols: None,
            features: None,
            migration: 0x2a,
            channel,
            pages: 2,
            urgent: 1,
            resume,
        };
        assert_eq!(slots.slot_of(&hello(ChannelRole::Pages(1), false)), Ok(1));
        assert_eq!(slots.slot_of(&hello(ChannelRole::Urgent(0), false)), Ok(2));
        assert_eq!(
            slots.slot_of(&hello(ChannelRole::Urgent(1), false)),
            Err("connection Urgent(1) is outside the 2 + 1 announced".into())
        );
        assert_eq!(
            slots.slot_of(&hello(ChannelRole::Pages(1), true)),
            Err("connection Pages(1) of migration 0x2a came twice".into())
        );
    }
}
