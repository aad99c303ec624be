//! Where progress records go: a callback or a channel a VMM passes in ([`Sink`]).

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::Event;

/// The interval between two records of the same status, unless the sink says otherwise.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// Receives an operation's progress records: a callback (called on the operation's threads:
/// it should return quickly), with the interval it wants them at.
#[derive(Clone)]
pub struct Sink {
    call: Arc<dyn Fn(&Event) + Send + Sync>,
    interval: Duration,
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sink")
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl Sink {
    /// Records go to `call`, every [`DEFAULT_INTERVAL`] and at every change of status.
    pub fn new(call: impl Fn(&Event) + Send + Sync + 'static) -> Sink {
        Sink {
            call: Arc::new(call),
            interval: DEFAULT_INTERVAL,
        }
    }

    /// Records go to `sender` (a receiver gone is ignored: the work goes on).
    pub fn sender(sender: Sender<Event>) -> Sink {
        let sender = Mutex::new(sender);
        Sink::new(move |e| {
            let _ = sender
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .send(e.clone());
        })
    }

    /// A sink whose records arrive on the returned receiver.
    pub fn channel() -> (Sink, Receiver<Event>) {
        let (tx, rx) = std::sync::mpsc::channel();
        (Sink::sender(tx), rx)
    }

    /// The same sink, with records of the same status at most every `interval` (at least 10
    /// ms: the records are sampled, and must cost nothing measurable).
    #[must_use]
    pub fn every(mut self, interval: Duration) -> Sink {
        self.interval = interval.max(Duration::from_millis(10));
        self
    }

    /// The interval between two records of the same status.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Hands `event` to the callback.
    pub fn send(&self, event: &Event) {
        (self.call)(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    #[test]
    fn a_channel_sink_delivers_and_survives_its_receiver() {
        let (sink, rx) = Sink::channel();
        sink.send(&Event::new(Status::Setup));
        assert_eq!(rx.recv().unwrap().status, Status::Setup);
        drop(rx);
        sink.send(&Event::new(Status::Completed));
        assert_eq!(
            sink.every(Duration::ZERO).interval(),
            Duration::from_millis(10)
        );
    }
}
