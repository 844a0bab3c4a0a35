//! One integration test binary; each scenario is a module. Tests that run a model take
//! `common::model_lock()` so that two models never compete for the two cores.

mod abuse;
mod browser;
mod common;
mod conversation;
mod detokenizer;
mod fuzz_corpus;
mod gateway;
mod gpu;
mod kquants;
mod layers;
mod loading;
mod openai;
mod perplexity;
mod prefix_cache;
mod realtime;
mod replicas;
mod security;
mod smollm2;
mod startup;
mod structured;
mod tiny_llama3;
mod tokenizers_fixtures;
