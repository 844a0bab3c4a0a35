//! Any bytes as a WebSocket client frame and as OpenAI request bodies, through parsing and
//! validation (`llama_relay::fuzz_harness::client_frame`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| llama_relay::fuzz_harness::client_frame(data));
