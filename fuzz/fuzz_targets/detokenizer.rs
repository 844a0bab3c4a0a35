//! Arbitrary token ids and stop strings through the incremental detokenizer and the stop-string
//! scanner (`llama_relay::fuzz_harness::detokenizer`).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    llama_relay::fuzz_harness::detokenizer(llama_relay_fuzz::tokenizer(), data)
});
