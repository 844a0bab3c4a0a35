//! Any bytes as a `/v1/realtime` connection's events and the session's frames, through the
//! Realtime dialect's dispatch (`llama_relay::fuzz_harness::realtime`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| llama_relay::fuzz_harness::realtime(data));
