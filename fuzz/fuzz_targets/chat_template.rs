//! Arbitrary messages through the chat template and the tokenizer
//! (`llama_relay::fuzz_harness::chat_template`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    llama_relay::fuzz_harness::chat_template(llama_relay_fuzz::tokenizer(), data)
});
