//! The native WebSocket dialect: its wire format (`protocol`), the per-connection session actor
//! (`session`, the only place that touches actix-web-actors, so a move to actix-ws stays small),
//! sessions parked for `resume` (`parked`) and the seals that let a client `restore` a
//! conversation (`seal`).

pub mod dispatch;
pub mod parked;
pub mod protocol;
pub mod seal;
pub mod session;
