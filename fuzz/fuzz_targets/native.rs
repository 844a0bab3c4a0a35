//! Any bytes as a `/ws` connection's frames and the session's side of its replies, through the
//! native dialect's dispatch (`llama_relay::fuzz_harness::native`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| llama_relay::fuzz_harness::native(data));
