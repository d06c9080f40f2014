//! Streams and events for the CPU backend, with CUDA's semantics: work enqueued on a
//! stream runs in order on that stream's own thread; `record` marks a point in a stream;
//! `wait` makes a stream (or the host) hold until the most recent record *at the time of
//! the wait* has been reached. A failure poisons the stream, and every event it records
//! afterwards carries the error (a [`Fault`], typed, so an abandoned collective stays one),
//! so whoever waits on it learns of the failure instead of hanging.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::fault::Fault;

/// Work for a stream; an `Err` poisons the stream with its fault.
pub type Work = Box<dyn FnOnce() -> Result<(), Fault> + Send>;

#[derive(Default)]
struct EventState {
    recorded: u64,
    completed: u64,
    error: Option<Fault>,
}

/// A completion marker shared between streams and the host.
#[derive(Clone, Default)]
pub struct Event(Arc<(Mutex<EventState>, Condvar)>);

impl Event {
    pub fn new() -> Self {
        Self::default()
    }

    /// Claims the next generation (host side, at enqueue time).
    fn next_generation(&self) -> u64 {
        let mut s = self.0 .0.lock().expect("event lock");
        s.recorded += 1;
        s.recorded
    }

    /// The generation a wait enqueued now must reach.
    fn target(&self) -> u64 {
        self.0 .0.lock().expect("event lock").recorded
    }

    fn complete(&self, generation: u64, error: Option<Fault>) {
        let mut s = self.0 .0.lock().expect("event lock");
        s.completed = s.completed.max(generation);
        if error.is_some() && s.error.is_none() {
            s.error = error;
        }
        self.0 .1.notify_all();
    }

    /// Marks the event reached at once (for work the host has already finished).
    pub fn record_now(&self) {
        let g = self.next_generation();
        self.complete(g, None);
    }

    /// Blocks until generation `target` has completed; returns the time spent blocked.
    fn wait_for(&self, target: u64, timeout: Duration) -> Result<Duration, Fault> {
        let start = Instant::now();
        let mut s = self.0 .0.lock().expect("event lock");
        loop {
            if let Some(e) = &s.error {
                return Err(e.clone());
            }
            if s.completed >= target {
                return Ok(start.elapsed());
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(Fault::Failed(format!(
                    "no progress for {timeout:?} (stalled stream or rank)"
                )));
            }
            s = self.0 .1.wait_timeout(s, left).expect("event lock").0;
        }
    }

    /// Host blocks until the most recent record has been reached.
    pub fn synchronize(&self, timeout: Duration) -> Result<Duration, Fault> {
        self.wait_for(self.target(), timeout)
    }

    /// Fails the event and wakes its waiters (used when a peer or a watchdog gives up).
    pub fn fail(&self, error: Fault) {
        let mut s = self.0 .0.lock().expect("event lock");
        s.error.get_or_insert(error);
        self.0 .1.notify_all();
    }
}

/// Transfer streams stand in for a GPU's copy engines, which take nothing from compute.
/// On a CPU they do take cycles, so they run at a lower scheduling priority than the rank
/// threads: they fill the cores' idle moments (single-threaded ops, gemm tails) instead of
/// preempting the math. They still make progress, and compute waits on them when it must.
fn lower_priority() {
    // SAFETY: setpriority on this thread's own id takes no pointers; failure (e.g. a
    // sandbox that forbids it) only leaves the default priority.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10);
    }
}

enum Cmd {
    Run(Work),
    Record(Event, u64),
    Wait(Event, u64),
}

/// An in-order queue of work served by one thread.
pub struct CpuStream {
    name: String,
    tx: Option<Sender<Cmd>>,
    thread: Option<JoinHandle<()>>,
}

impl CpuStream {
    /// Starts a stream; `timeout` bounds every wait so a dead peer cannot hang it.
    pub fn new(name: impl Into<String>, timeout: Duration) -> std::io::Result<Self> {
        let name = name.into();
        let (tx, rx) = channel::<Cmd>();
        let span = tracing::Span::current();
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let _g = span.enter();
                lower_priority();
                let mut poisoned: Option<Fault> = None;
                for cmd in rx {
                    match cmd {
                        Cmd::Run(work) => {
                            if poisoned.is_none() {
                                if let Err(e) = work() {
                                    poisoned = Some(e);
                                }
                            }
                        }
                        Cmd::Record(ev, g) => ev.complete(g, poisoned.clone()),
                        Cmd::Wait(ev, g) => {
                            if poisoned.is_none() {
                                if let Err(e) = ev.wait_for(g, timeout) {
                                    poisoned = Some(e);
                                }
                            }
                        }
                    }
                }
            })?;
        Ok(CpuStream {
            name,
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    fn send(&self, cmd: Cmd) {
        // The worker only exits when `tx` is dropped, so sending cannot fail while we live.
        let _ = self.tx.as_ref().expect("stream open").send(cmd);
    }

    pub fn enqueue(&self, work: Work) {
        self.send(Cmd::Run(work));
    }

    pub fn record(&self, ev: &Event) {
        let g = ev.next_generation();
        self.send(Cmd::Record(ev.clone(), g));
    }

    pub fn wait(&self, ev: &Event) {
        let g = ev.target();
        self.send(Cmd::Wait(ev.clone(), g));
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for CpuStream {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn wait_orders_work_across_streams() {
        let a = CpuStream::new("a", T).unwrap();
        let b = CpuStream::new("b", T).unwrap();
        let ev = Event::new();
        let x = Arc::new(AtomicU64::new(0));
        let x1 = x.clone();
        a.enqueue(Box::new(move || {
            std::thread::sleep(Duration::from_millis(50));
            x1.store(1, Ordering::SeqCst);
            Ok(())
        }));
        a.record(&ev);
        b.wait(&ev);
        let seen = Arc::new(AtomicU64::new(99));
        let (x2, s2) = (x.clone(), seen.clone());
        b.enqueue(Box::new(move || {
            s2.store(x2.load(Ordering::SeqCst), Ordering::SeqCst);
            Ok(())
        }));
        let done = Event::new();
        b.record(&done);
        done.synchronize(T).unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn failure_reaches_waiters() {
        let a = CpuStream::new("a", T).unwrap();
        let ev = Event::new();
        a.enqueue(Box::new(|| Err(Fault::Failed("disk on fire".into()))));
        a.record(&ev);
        let e = ev.synchronize(T).unwrap_err();
        assert_eq!(e, Fault::Failed("disk on fire".into()));
    }

    #[test]
    fn wait_times_out_instead_of_hanging() {
        let ev = Event::new();
        ev.next_generation();
        let e = ev.synchronize(Duration::from_millis(20)).unwrap_err();
        assert!(e.to_string().contains("no progress"), "{e}");
    }
}
