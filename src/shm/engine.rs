//! The thread of one shm connection. It notices the peer leaving (its socket's end of file)
//! and the user's disconnect, moves data while nobody else does - always with
//! [`Progress::Thread`](crate::Progress::Thread), and with
//! [`Progress::Caller`](crate::Progress::Caller) only while somebody sleeps on the completion
//! queue or watches its descriptor - and tears the connection down. The busy path, posting and
//! polling, never waits for it.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::cq::Opcode;
use crate::shm::conn::Shared;
use crate::shm::flow::{BYE, End, send_packet};
use crate::sys;

/// How long the thread spins on an idle connection before it sleeps, while it moves data.
const SPIN: Duration = Duration::from_micros(50);
/// Longest single sleep; each wake-up re-checks everything.
const MAX_SLEEP: Duration = Duration::from_millis(500);
/// How long the pollers may leave the connection alone before its thread assists them.
const IDLE: Duration = Duration::from_millis(10);

pub(crate) struct Engine {
    sh: Arc<Shared>,
    sock: OwnedFd,
    peer_said_bye: bool,
    /// The pollers' count of polls when this thread last looked.
    seen_polls: u64,
}

impl Engine {
    pub(crate) fn new(sh: Arc<Shared>, sock: OwnedFd) -> Engine {
        Engine {
            sh,
            sock,
            peer_said_bye: false,
            seen_polls: u64::MAX,
        }
    }

    /// Runs until the connection ends, then completes everything and reports the disconnect.
    pub(crate) fn run(mut self) {
        let end = crate::panic::catch(|| self.main_loop()).unwrap_or(End::Protocol);
        self.teardown(end);
    }

    /// Whether this thread moves data now (rather than the pollers of the queue).
    fn drives(&self) -> bool {
        !self.sh.caller_polls || self.sh.report.cq.watched()
    }

    fn main_loop(&mut self) -> End {
        let mut idle_since: Option<Instant> = None;
        loop {
            if self.sh.stop.load(Ordering::SeqCst) {
                return End::Local;
            }
            if !self.drives() {
                // The pollers drive, and no doorbell from the peer is needed while they do.
                // When they stop (no poll for IDLE) this thread assists: it asks the peer for
                // doorbells and moves what they announce - messages into the posted receives,
                // sends that waited for a credit or ring space - so that nothing waits for this
                // side to poll again. The same for sends that wait, at once.
                idle_since = None;
                let polls = self.sh.report.cq.polls();
                let assist = polls == self.seen_polls;
                self.seen_polls = polls;
                let work = {
                    let mut flow = self.sh.lock();
                    let help = assist || flow.blocked();
                    if help {
                        let cq = &self.sh.report.cq;
                        flow.step(&self.sh.report, &mut |c| cq.push(c));
                    }
                    if let Some(end) = flow.failed {
                        return end;
                    }
                    let help = assist || flow.blocked();
                    flow.set_sleeping(help);
                    help && flow.has_work()
                };
                let nap = if work {
                    Duration::ZERO
                } else if assist {
                    MAX_SLEEP
                } else {
                    IDLE
                };
                if let Err(end) = self.sleep(nap) {
                    return end;
                }
                continue;
            }
            let moved = {
                let mut flow = self.sh.lock();
                let cq = &self.sh.report.cq;
                let moved = flow.step(&self.sh.report, &mut |c| cq.push(c));
                if let Some(end) = flow.failed {
                    return end;
                }
                moved
            };
            if moved {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            // Ask the peer for a doorbell, then look once more before sleeping (Dekker with
            // the peer's `ring_peer` and our posters' `kick`).
            self.sh.engine_sleeping.store(true, Ordering::SeqCst);
            let work = {
                let flow = self.sh.lock();
                flow.set_sleeping(true);
                flow.has_work()
            };
            let r = self.sleep(if work { Duration::ZERO } else { MAX_SLEEP });
            self.sh.engine_sleeping.store(false, Ordering::SeqCst);
            if let Err(end) = r {
                return end;
            }
            idle_since = None;
        }
    }

    /// Sleeps until the peer rings or hangs up, a poster or the user wakes us, or `timeout`.
    fn sleep(&mut self, timeout: Duration) -> std::result::Result<(), End> {
        let mut fds = [
            libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.sh.wake.raw(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let polled = sys::poll(&mut fds, Some(timeout));
        if polled.is_err() {
            return Err(End::Peer { clean: false });
        }
        if fds[1].revents != 0 {
            self.sh.wake.clear();
        }
        if fds[0].revents != 0 {
            self.drain_socket()?;
        }
        Ok(())
    }

    /// Reads doorbell packets; an end of file means the peer is gone.
    fn drain_socket(&mut self) -> std::result::Result<(), End> {
        let mut buf = [0u8; 64];
        loop {
            // SAFETY: receives into a live local buffer of the given length.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            match n {
                0 => {
                    return Err(End::Peer {
                        clean: self.peer_said_bye,
                    });
                }
                n if n > 0 => {
                    if buf[..n as usize].contains(&BYE) {
                        self.peer_said_bye = true;
                    }
                }
                _ => {
                    let e = std::io::Error::last_os_error();
                    return match e.kind() {
                        std::io::ErrorKind::WouldBlock => Ok(()),
                        std::io::ErrorKind::Interrupted => continue,
                        // A peer that closes with doorbells of ours still unread makes the
                        // kernel report a reset before the packets it sent first - its goodbye
                        // among them. The report is consumed by reading it: read on, and the
                        // goodbye (if it said one) and the end of file follow.
                        std::io::ErrorKind::ConnectionReset => continue,
                        _ => Err(End::Peer { clean: false }),
                    };
                }
            }
        }
    }

    /// Ends the connection: tells the peer, takes what it delivered, completes everything else
    /// as flushed, and reports the disconnect as this connection's last completion.
    fn teardown(&mut self, end: End) {
        if end == End::Local {
            send_packet(self.sock.as_raw_fd(), BYE);
        }
        // SAFETY: plain syscall on our own socket; the peer sees end of file at once.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
        // Pollers no longer drive the connection; from here this thread alone completes it.
        let cq = &self.sh.report.cq;
        cq.remove_source(self.sh.info.id);
        let status = self
            .sh
            .lock()
            .close(end, &self.sh.report, &mut |c| cq.push(c));
        self.sh
            .report
            .complete(0, Opcode::Disconnected, status, 0, None);
    }
}
