//! Admission of connections that hold state (WebSocket sessions, OpenAI API requests) before any
//! of it exists: a cap in all (`server.max_connections`), per client address
//! (`server.max_connections_per_address`) and per tenant (`[[tenants]] max_connections`). Past a
//! cap the upgrade or request gets 503 with `Retry-After`, never an accept error, so a flood of
//! sockets from one address cannot take the file descriptors every other client needs. A
//! `Permit` holds the place and gives it back when dropped (the session actor or the request
//! ends). Written here because the caps are about identities the server decides (tenants), not
//! about TCP connections, which actix-server can only stop accepting.
//!
//! A session whose connection dropped keeps its place while its reply runs (it is parked for a
//! resume, `ws::parked`). So that its own client can come back even when that place was its
//! last under a cap, an address holding parked places may open as many connections past the
//! caps, each with a `Ticket` instead of a permit: such a connection may only resume, and takes
//! over the parked session's place when it does.
//!
//! The process's soft file limit is raised to its hard limit at start, and the total cap is
//! sized under it (`fit_to_file_limit`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// File descriptors kept for everything that is not a client socket: listeners, model and
/// tokenizer files, the runtime's own, connections refused with 503 while they are answered.
pub const RESERVED_FDS: u64 = 256;

/// The caps.
#[derive(Debug, Clone, Default)]
pub struct Caps {
    pub total: usize,
    pub per_address: usize,
    pub per_tenant: HashMap<String, usize>,
}

/// Which cap refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Full {
    Total(usize),
    Address(usize),
    Tenant(String, usize),
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Full::Total(n) => write!(
                f,
                "the server holds its maximum of {n} connections (server.max_connections); try again shortly"
            ),
            Full::Address(n) => write!(
                f,
                "this address holds its maximum of {n} connections (server.max_connections_per_address)"
            ),
            Full::Tenant(t, n) => write!(
                f,
                "tenant `{t}` holds its maximum of {n} connections (max_connections)"
            ),
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
    by_tenant: HashMap<String, usize>,
    /// Places held by parked sessions, and tickets handed out against them, by address.
    parked: HashMap<IpAddr, usize>,
    tickets: HashMap<IpAddr, usize>,
}

fn dec(map: &mut HashMap<IpAddr, usize>, key: &IpAddr) {
    if let Some(n) = map.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            map.remove(key);
        }
    }
}

/// The live counts behind the caps (shared by every worker).
#[derive(Debug, Clone)]
pub struct Admission {
    caps: Arc<Caps>,
    counts: Arc<Mutex<Counts>>,
}

/// A connection's place; dropping it gives the place back.
#[derive(Debug)]
pub struct Permit {
    counts: Arc<Mutex<Counts>>,
    address: IpAddr,
    tenant: String,
    parked: bool,
}

/// A connection let in past the caps to resume a parked session of its address (see the
/// module doc); dropping it gives the allowance back.
#[derive(Debug)]
pub struct Ticket {
    counts: Arc<Mutex<Counts>>,
    address: IpAddr,
}

/// What an admitted connection holds.
#[derive(Debug)]
pub enum Place {
    Permit(Permit),
    Ticket(Ticket),
}

impl Admission {
    pub fn new(caps: Caps) -> Self {
        Admission {
            caps: Arc::new(caps),
            counts: Arc::new(Mutex::new(Counts::default())),
        }
    }

    pub fn caps(&self) -> &Caps {
        &self.caps
    }

    /// A place for a connection from `address` of `tenant`, or the cap that is full.
    pub fn admit(&self, address: IpAddr, tenant: &str) -> Result<Permit, Full> {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if c.total >= self.caps.total {
            return Err(Full::Total(self.caps.total));
        }
        let at_address = c.by_address.get(&address).copied().unwrap_or(0);
        if at_address >= self.caps.per_address {
            return Err(Full::Address(self.caps.per_address));
        }
        if let Some(&cap) = self.caps.per_tenant.get(tenant) {
            if c.by_tenant.get(tenant).copied().unwrap_or(0) >= cap {
                return Err(Full::Tenant(tenant.into(), cap));
            }
        }
        c.total += 1;
        *c.by_address.entry(address).or_default() += 1;
        *c.by_tenant.entry(tenant.to_string()).or_default() += 1;
        Ok(Permit {
            counts: self.counts.clone(),
            address,
            tenant: tenant.into(),
            parked: false,
        })
    }

    /// A ticket past the caps for `address`, while it holds more parked places than tickets.
    pub fn admit_to_resume(&self, address: IpAddr) -> Option<Ticket> {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let parked = c.parked.get(&address).copied().unwrap_or(0);
        let tickets = c.tickets.entry(address).or_default();
        if *tickets >= parked {
            if *tickets == 0 {
                c.tickets.remove(&address);
            }
            return None;
        }
        *tickets += 1;
        Some(Ticket {
            counts: self.counts.clone(),
            address,
        })
    }

    /// Connections held now.
    pub fn held(&self) -> usize {
        self.counts.lock().unwrap_or_else(|e| e.into_inner()).total
    }

    /// The counts agree with each other and with the caps (tests).
    pub fn check(&self) -> Result<(), String> {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let by_addr: usize = c.by_address.values().sum();
        let by_tenant: usize = c.by_tenant.values().sum();
        if by_addr != c.total || by_tenant != c.total {
            return Err(format!(
                "total {} but {by_addr} by address and {by_tenant} by tenant",
                c.total
            ));
        }
        if c.by_address.values().any(|&n| n == 0) || c.by_tenant.values().any(|&n| n == 0) {
            return Err("an empty count is kept".into());
        }
        if c.total > self.caps.total || c.by_address.values().any(|&n| n > self.caps.per_address) {
            return Err("a cap is exceeded".into());
        }
        for (a, &n) in &c.parked {
            if n == 0 || n > c.by_address.get(a).copied().unwrap_or(0) {
                return Err(format!("{n} parked places at {a} it does not hold"));
            }
        }
        // Tickets may outnumber parked places for a moment (a parked session expired while
        // its client was reconnecting); they are only handed out below them.
        if c.tickets.values().any(|&n| n == 0) {
            return Err("an empty ticket count is kept".into());
        }
        Ok(())
    }
}

impl Permit {
    /// The place is now held by a parked session (true) or by a connection again (false).
    pub fn set_parked(&mut self, parked: bool) {
        if self.parked == parked {
            return;
        }
        self.parked = parked;
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if parked {
            *c.parked.entry(self.address).or_default() += 1;
        } else {
            dec(&mut c.parked, &self.address);
        }
    }
}

impl Ticket {
    pub fn address(&self) -> IpAddr {
        self.address
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        dec(&mut c.tickets, &self.address);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        // A parked place goes before its tickets' allowance would outlive it.
        self.set_parked(false);
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.total -= 1;
        dec(&mut c.by_address, &self.address);
        if let Some(n) = c.by_tenant.get_mut(&self.tenant) {
            *n -= 1;
            if *n == 0 {
                c.by_tenant.remove(&self.tenant);
            }
        }
    }
}

/// Raises the soft limit on open files to the hard limit; returns the soft limit now in force.
pub fn raise_file_limit() -> std::io::Result<u64> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the struct given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if l.rlim_cur < l.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: l.rlim_max,
            rlim_max: l.rlim_max,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            l.rlim_cur = l.rlim_max;
        }
    }
    Ok(l.rlim_cur)
}

/// The total cap that fits `file_limit` descriptors with `RESERVED_FDS` kept for the rest.
pub fn fit_to_file_limit(wanted: usize, file_limit: u64) -> usize {
    let room = file_limit.saturating_sub(RESERVED_FDS).max(1);
    wanted.min(usize::try_from(room).unwrap_or(usize::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    #[test]
    fn each_cap_refuses_in_its_turn_and_a_dropped_permit_frees_its_place() {
        let a = Admission::new(Caps {
            total: 4,
            per_address: 2,
            per_tenant: HashMap::from([("small".to_string(), 1)]),
        });
        let p1 = a.admit(ip(1), "default").unwrap();
        let _p2 = a.admit(ip(1), "default").unwrap();
        assert_eq!(a.admit(ip(1), "default").unwrap_err(), Full::Address(2));
        let _p3 = a.admit(ip(2), "small").unwrap();
        assert_eq!(
            a.admit(ip(3), "small").unwrap_err(),
            Full::Tenant("small".into(), 1)
        );
        let _p4 = a.admit(ip(3), "default").unwrap();
        assert_eq!(a.admit(ip(4), "default").unwrap_err(), Full::Total(4));
        drop(p1);
        assert_eq!(a.held(), 3);
        let _p5 = a.admit(ip(1), "default").unwrap();
        a.check().unwrap();
    }

    #[test]
    fn parked_places_let_as_many_tickets_past_the_caps_for_their_address_only() {
        let a = Admission::new(Caps {
            total: 2,
            per_address: 1,
            per_tenant: HashMap::new(),
        });
        let mut p1 = a.admit(ip(1), "default").unwrap();
        assert!(a.admit_to_resume(ip(1)).is_none(), "nothing parked");
        p1.set_parked(true);
        a.check().unwrap();
        assert!(a.admit(ip(1), "default").is_err(), "still a place held");
        let t = a.admit_to_resume(ip(1)).expect("one ticket");
        assert!(a.admit_to_resume(ip(1)).is_none(), "one per parked place");
        assert!(
            a.admit_to_resume(ip(2)).is_none(),
            "not for another address"
        );
        assert_eq!(t.address(), ip(1));
        // The resume takes the parked place over; the ticket goes.
        p1.set_parked(false);
        drop(t);
        a.check().unwrap();
        assert!(a.admit_to_resume(ip(1)).is_none());
        // A parked place that expires while its ticket is out leaves no count behind.
        p1.set_parked(true);
        let t = a.admit_to_resume(ip(1)).unwrap();
        drop(p1);
        a.check().unwrap();
        drop(t);
        a.check().unwrap();
        assert_eq!(a.held(), 0);
        let c = a.counts.lock().unwrap();
        assert!(c.parked.is_empty() && c.tickets.is_empty());
    }

    #[test]
    fn the_total_cap_fits_the_file_limit() {
        assert_eq!(
            fit_to_file_limit(10_000, 1024),
            1024 - RESERVED_FDS as usize
        );
        assert_eq!(fit_to_file_limit(10_000, 1 << 20), 10_000);
        assert_eq!(fit_to_file_limit(10, 100), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]
        /// Random admissions and releases: the counts always agree with a recount of the permits
        /// held, no cap is exceeded, and everything released leaves nothing counted.
        #[test]
        fn counts_match_the_permits_held(ops in proptest::collection::vec((0u8..4, 0u8..3, any::<bool>()), 1..200)) {
            let a = Admission::new(Caps {
                total: 6,
                per_address: 3,
                per_tenant: HashMap::from([("t0".to_string(), 2)]),
            });
            let mut held: Vec<(u8, u8, Permit)> = Vec::new();
            for (addr, tenant, release) in ops {
                if release && !held.is_empty() {
                    held.remove(addr as usize % held.len());
                } else {
                    let t = format!("t{tenant}");
                    let want_ok = held.len() < 6
                        && held.iter().filter(|h| h.0 == addr).count() < 3
                        && (tenant != 0 || held.iter().filter(|h| h.1 == 0).count() < 2);
                    match a.admit(ip(addr), &t) {
                        Ok(p) => { prop_assert!(want_ok); held.push((addr, tenant, p)); }
                        Err(_) => prop_assert!(!want_ok),
                    }
                }
                prop_assert_eq!(a.held(), held.len());
                prop_assert!(a.check().is_ok(), "{:?}", a.check());
            }
            held.clear();
            prop_assert_eq!(a.held(), 0);
            a.check().unwrap();
        }
    }
}
