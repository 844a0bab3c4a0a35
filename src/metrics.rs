//! Prometheus metrics, named as vLLM names them (`vllm:*`) where vLLM has the same quantity so
//! existing dashboards fit, `llama_relay_*` for the rest. Served at `/metrics` in text format.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub requests_running: IntGauge,
    pub requests_waiting: IntGauge,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub prefill_tokens: IntCounter,
    pub preemptions: IntCounter,
    pub itl_target_misses: IntCounter,
    pub fairness_holds: IntCounter,
    pub ttft_deadline_steps: IntCounter,
    pub spec_draft_tokens: IntCounter,
    pub spec_accepted_tokens: IntCounter,
    /// Drafts kept by their position in the step's drafts (0: the first).
    pub spec_accepted_per_pos: IntCounterVec,
    pub kv_blocks_used: IntGauge,
    pub kv_blocks_total: IntGauge,
    pub kv_blocks_cached_free: IntGauge,
    pub kv_blocks_held: IntGauge,
    pub kv_blocks_free: IntGauge,
    pub kv_evictions: IntCounter,
    pub prefix_queries: IntCounter,
    pub prefix_hits: IntCounter,
    pub errors: IntCounterVec,
    pub slow_readers: IntCounterVec,
    pub drafts: IntCounterVec,
    pub sessions: IntGauge,
    pub engine_failures: IntCounter,
    pub grammar_compile: Histogram,
    pub grammar_cache_hits: IntCounter,
    pub grammar_mask: Histogram,
}

fn buckets(v: &[f64]) -> Vec<f64> {
    v.to_vec()
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let gauge = |n: &str, h: &str| {
            let g = IntGauge::new(n, h).expect("valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let counter = |n: &str, h: &str| {
            let c = IntCounter::new(n, h).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let hist = |n: &str, h: &str, b: &[f64]| {
            let x = Histogram::with_opts(HistogramOpts::new(n, h).buckets(buckets(b)))
                .expect("valid metric");
            registry
                .register(Box::new(x.clone()))
                .expect("unique metric");
            x
        };
        let latency = [
            0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
        ];
        let errors = IntCounterVec::new(
            Opts::new(
                "llama_relay_errors_total",
                "Errors sent to clients, by error_type",
            ),
            &["error_type"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(errors.clone()))
            .expect("unique metric");
        let slow_readers = IntCounterVec::new(
            Opts::new(
                "llama_relay_slow_readers_total",
                "Clients that stopped reading: replies cancelled (server.max_queued_frames) and connections reset (server.write_timeout_s)",
            ),
            &["action"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(slow_readers.clone()))
            .expect("unique metric");
        let drafts = IntCounterVec::new(
            Opts::new(
                "llama_relay_drafts_total",
                "Type-ahead drafts by how they ended: prefilled whole, used by the chat that followed, replaced by a newer draft, yielded to waiting requests, or ended with the session",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(drafts.clone()))
            .expect("unique metric");
        let spec_accepted_per_pos = IntCounterVec::new(
            Opts::new(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Speculative draft tokens kept, by position among the step's drafts (0: the first; at most scheduler.speculate_tokens positions)",
            ),
            &["position"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(spec_accepted_per_pos.clone()))
            .expect("unique metric");
        Metrics {
            slow_readers,
            drafts,
            spec_accepted_per_pos,
            requests_running: gauge("vllm:num_requests_running", "Requests in the running batch"),
            requests_waiting: gauge(
                "vllm:num_requests_waiting",
                "Requests waiting for admission",
            ),
            ttft: hist(
                "vllm:time_to_first_token_seconds",
                "Time from submission to the first token",
                &latency,
            ),
            inter_token: hist(
                "vllm:time_per_output_token_seconds",
                "Time between consecutive tokens of a request",
                &[
                    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                ],
            ),
            e2e: hist(
                "vllm:e2e_request_latency_seconds",
                "Time from submission to the end of a request",
                &latency,
            ),
            queue_time: hist(
                "vllm:request_queue_time_seconds",
                "Time from submission to the first scheduled step",
                &latency,
            ),
            prompt_tokens: counter("vllm:prompt_tokens_total", "Prompt tokens processed"),
            generation_tokens: counter("vllm:generation_tokens_total", "Tokens generated"),
            prefill_tokens: counter(
                "llama_relay_prefill_tokens_total",
                "Prompt tokens computed by forward passes (those not found in the KV cache)",
            ),
            preemptions: counter(
                "vllm:num_preemptions_total",
                "Sequences preempted for lack of KV blocks",
            ),
            itl_target_misses: counter(
                "llama_relay_itl_target_misses_total",
                "Steps with streaming replies predicted over scheduler.itl_target_ms even with the smallest prefill chunk",
            ),
            fairness_holds: counter(
                "llama_relay_fairness_holds_total",
                "Steps in which tenants over their share of running slots sat out for another tenant's first chunk",
            ),
            ttft_deadline_steps: counter(
                "llama_relay_ttft_deadline_steps_total",
                "Steps that ran past scheduler.itl_target_ms so that queued turns meet scheduler.ttft_target_ms",
            ),
            spec_draft_tokens: counter(
                "vllm:spec_decode_num_draft_tokens_total",
                "Speculative draft tokens run (scheduler.speculation)",
            ),
            spec_accepted_tokens: counter(
                "vllm:spec_decode_num_accepted_tokens_total",
                "Speculative draft tokens the model's own choices agreed with (each a token gained)",
            ),
            kv_blocks_used: gauge("llama_relay_kv_blocks_used", "KV cache blocks in use"),
            kv_blocks_total: gauge("llama_relay_kv_blocks_total", "KV cache blocks in all"),
            kv_blocks_held: gauge(
                "llama_relay_kv_blocks_held",
                "KV blocks held between requests (session leases, pinned prefixes): the idle level of used",
            ),
            kv_blocks_cached_free: gauge(
                "llama_relay_kv_blocks_cached_free",
                "Free KV blocks still holding a cached prefix",
            ),
            kv_blocks_free: gauge(
                "llama_relay_kv_blocks_free",
                "Free KV blocks holding nothing",
            ),
            kv_evictions: counter(
                "llama_relay_kv_evictions_total",
                "Cached KV blocks reused for other content",
            ),
            prefix_queries: counter(
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache",
            ),
            prefix_hits: counter(
                "vllm:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache",
            ),
            sessions: gauge("llama_relay_websocket_sessions", "Open WebSocket sessions"),
            engine_failures: counter(
                "llama_relay_engine_failures_total",
                "Times the engine failed for good (a panic, or repeated failed steps); the server then exits",
            ),
            grammar_compile: hist(
                "llama_relay_grammar_compile_seconds",
                "Time to compile a response format's grammar (those not found in the principal's cache)",
                &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5],
            ),
            grammar_cache_hits: counter(
                "llama_relay_grammar_cache_hits_total",
                "Response formats found compiled in the principal's cache",
            ),
            grammar_mask: hist(
                "llama_relay_grammar_mask_seconds",
                "Time to compute one constrained sequence's token mask (on a second thread, while the forward pass runs)",
                &[0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025],
            ),
            errors,
            registry,
        }
    }

    pub fn error(&self, error_type: &str) {
        self.errors.with_label_values(&[error_type]).inc();
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
