//! The gate: who may connect and how much. API keys and origins (`access`), tenants, their roles
//! and quotas (`tenants`), connection places (`admission`), frame rates (`rate`), and the
//! slow-reader rule (`outbox`) over the TCP peer it watches (`peer`). Nothing here knows a
//! dialect or a request's shape.

pub mod access;
pub mod admission;
pub mod credentials;
pub mod outbox;
pub mod peer;
pub mod rate;
pub mod tenants;
