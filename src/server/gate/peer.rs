//! A connection's TCP socket as the server watches it: keepalive, the send buffer's size, whether
//! the client has gone, and how much of what was sent it has acknowledged (`TCP_INFO`), which
//! the slow-reader rule (`outbox`) reads.

/// A connection's socket, kept with the connection (`HttpRequest::conn_data`) so that a handler
/// waiting on the batcher can tell that its client has gone: actix-web drops a handler only when
/// it next writes (actix-web issue #1313), and an answer that is not streamed writes nothing
/// until it is complete. The descriptor stays open as long as the connection, which outlives the
/// handler.
#[derive(Debug, Clone, Copy)]
pub struct Peer(std::os::fd::RawFd);

/// Idle seconds before the first keepalive probe, and between probes.
const KEEPALIVE_IDLE_S: libc::c_int = 30;
const KEEPALIVE_INTERVAL_S: libc::c_int = 10;

impl Peer {
    /// Records an accepted connection's socket, with keepalive on and its send buffer set to
    /// `send_buffer` bytes (0: the kernel's autotuning).
    pub(crate) fn record(
        send_buffer: usize,
        conn: &dyn std::any::Any,
        ext: &mut actix_web::dev::Extensions,
    ) {
        use std::os::fd::AsRawFd;
        if let Some(s) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
            let p = Peer(s.as_raw_fd());
            if let Err(e) = p.keepalive() {
                tracing::debug!(error = %e, "cannot turn on TCP keepalive");
            }
            if send_buffer > 0 {
                let v = send_buffer.min(libc::c_int::MAX as usize) as libc::c_int;
                if let Err(e) = p.set(libc::SOL_SOCKET, libc::SO_SNDBUF, v) {
                    tracing::debug!(error = %e, "cannot set the socket's send buffer");
                }
            }
            ext.insert(p);
        }
    }

    fn set(
        &self,
        level: libc::c_int,
        name: libc::c_int,
        value: libc::c_int,
    ) -> std::io::Result<()> {
        // SAFETY: setsockopt reads an int from a live descriptor's option.
        let rc = unsafe {
            libc::setsockopt(
                self.0,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// TCP keepalive: a peer that vanished without a FIN (a dropped mobile link, a crashed
    /// host) is found after `KEEPALIVE_IDLE_S` idle seconds plus three probes, even for a
    /// connection the server is not writing to.
    fn keepalive(&self) -> std::io::Result<()> {
        let set = |level, name, value| self.set(level, name, value);
        set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, KEEPALIVE_IDLE_S)?;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)?;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)
    }

    /// Resets the connection (a client that reads nothing): the socket is shut down both ways,
    /// which fails the dispatcher's pending write so it drops the connection, and with linger 0
    /// its close discards the unread bytes and sends RST instead of waiting on a zero window.
    pub fn abort(&self) {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt reads a linger struct, shutdown takes the descriptor; the caller
        // guarantees the descriptor is still the connection's (see `outbox::watch`).
        unsafe {
            libc::setsockopt(
                self.0,
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            );
            libc::shutdown(self.0, libc::SHUT_RDWR);
        }
    }

    /// How far the client has taken what was written: the bytes it acknowledged so far and
    /// whether bytes wait (unsent, or sent and not acknowledged), from the kernel's TCP_INFO.
    /// `None` where the kernel does not tell. A client that reads nothing fills its receive
    /// window, after which nothing more is acknowledged, however much the send buffer still takes.
    pub fn send_progress(&self) -> Option<SendProgress> {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: an all-zero tcp_info is valid (plain integers); getsockopt fills at most
            // `len` bytes of it from a live descriptor (see `outbox::watch`).
            let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
            let rc = unsafe {
                libc::getsockopt(
                    self.0,
                    libc::IPPROTO_TCP,
                    libc::TCP_INFO,
                    (&mut info as *mut libc::tcp_info).cast(),
                    &mut len,
                )
            };
            // Kernels before 4.6 end the struct before the fields read here.
            let needed = std::mem::offset_of!(libc::tcp_info, tcpi_notsent_bytes) + 4;
            if rc != 0 || (len as usize) < needed {
                return None;
            }
            Some(SendProgress {
                acked: info.tcpi_bytes_acked,
                waiting: info.tcpi_unacked > 0 || info.tcpi_notsent_bytes > 0,
            })
        }
        #[cfg(not(target_os = "linux"))]
        {
            None
        }
    }

    /// The client closed or reset the connection (a peek finds end of stream or an error; a
    /// pipelined request waiting to be read is data, so the client is still there).
    pub fn gone(&self) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: a peek into a one-byte buffer on a descriptor the connection keeps open.
        let n = unsafe {
            libc::recv(
                self.0,
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => true,
            n if n > 0 => false,
            _ => {
                let e = std::io::Error::last_os_error();
                !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                )
            }
        }
    }
}

/// What `Peer::send_progress` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendProgress {
    /// Bytes the client has acknowledged since the connection began.
    pub acked: u64,
    /// Bytes wait in the socket: not sent yet, or sent and not acknowledged.
    pub waiting: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn get(fd: i32, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes an int into `v`.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                level,
                name,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0);
        v
    }

    #[test]
    fn accepted_sockets_keep_alive_and_a_closed_peer_is_gone() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        let p = Peer(server.as_raw_fd());
        p.keepalive().unwrap();
        assert_eq!(get(p.0, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(
            get(p.0, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
            KEEPALIVE_IDLE_S
        );
        assert!(!p.gone());
        drop(client);
        let t0 = std::time::Instant::now();
        while !p.gone() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}
