//! Settings: `config/default.toml` (every key, with a comment) is compiled in, `--config FILE`
//! layers on top, `LLAMA_RELAY__SECTION__KEY` environment variables override, CLI flags last.
//! `validate()` turns them into engine options or an error naming the key, the value and what is
//! allowed; the server refuses to start on a bad value.

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde::Deserialize;

use crate::engine::loaded::{CacheSize, EngineOptions};
use crate::error::{EngineError, Result};
use crate::model::loader::WeightMode;
use crate::model::AttentionImpl;

/// The shipped defaults, also the documentation of every key.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// Upper bound on a KV block: attention walks blocks slot by slot, and a block larger than
/// this wastes most of a sequence's last block.
const MAX_BLOCK_SIZE: usize = 256;
/// Upper bound on threads: more than the machine has only adds contention.
const MAX_THREADS: usize = 1024;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSettings {
    /// A .gguf file or a Hugging Face folder; empty = the embedded default model.
    pub path: String,
    /// A tokenizer.json to use instead of the model's own; empty = the model's.
    pub tokenizer: String,
    /// A smaller model with the same tokenizer that writes speculative drafts
    /// (`scheduler.draft_source = "model"`); empty = none.
    pub draft: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSettings {
    pub device: String,
    pub threads: usize,
    pub block_size: usize,
    pub cache_mib: usize,
    pub cache_tokens: usize,
    pub max_context: usize,
    pub attention: String,
    pub weights: String,
    pub kv_dtype: String,
    /// MiB of bf16 weight copies for Intel's tile units (AMX); 0 = none.
    pub amx_weights_mib: usize,
    /// The draft model's own KV cache, in MiB.
    pub draft_cache_mib: usize,
    pub malloc_tuning: bool,
    /// Run one prefill chunk and a few decode steps after loading, before the server is ready.
    pub warm_up: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    pub host: String,
    pub port: u16,
    pub workers: usize,
    pub static_dir: String,
    pub heartbeat_s: u64,
    pub client_timeout_s: u64,
    pub shutdown_grace_s: u64,
    /// The key of the seals on assistant messages (`server::seal`); empty = random per process.
    pub conversation_secret: String,
    /// A connection whose client takes none of the bytes it is sent for this long is reset.
    pub write_timeout_s: u64,
    /// How long a session whose connection dropped can be resumed; 0 = not at all.
    pub resume_grace_s: u64,
    /// Frames queued for a client that is not reading them before its reply is cancelled.
    pub max_queued_frames: usize,
    /// Each accepted socket's kernel send buffer in KiB; 0 = the kernel's autotuning.
    pub send_buffer_kib: usize,
    /// WebSocket sessions and API requests held at once, in all and per client address.
    pub max_connections: usize,
    pub max_connections_per_address: usize,
    /// Keyless, widgetless clients; unset: only on loopback with no tenants configured.
    #[serde(default)]
    pub allow_anonymous: Option<bool>,
    /// Origins the server's own page is served from (behind a proxy: "https://chat.example.com").
    #[serde(default)]
    pub public_origins: Vec<String>,
    /// `Host` values served; empty: loopback names and the listen address; ["*"]: any.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// A second listener for `/health` and `/metrics` alone (they leave the main port).
    #[serde(default)]
    pub admin_port: Option<u16>,
    #[serde(default = "loopback")]
    pub admin_host: String,
    /// `/metrics` needs `Authorization: Bearer TOKEN` when set.
    #[serde(default)]
    pub metrics_token: String,
}

fn loopback() -> String {
    "127.0.0.1".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSettings {
    pub max_running: usize,
    pub max_waiting: usize,
    pub step_tokens: usize,
    /// Step-time target while replies decode, in ms (0 = off: the token budget alone).
    pub itl_target_ms: u64,
    /// First-token target for prompts that fit a step, in ms (0 = off): a step may run past
    /// `itl_target_ms` so that queued turns meet it (`engine::scheduler::deadline`).
    pub ttft_target_ms: u64,
    /// Speculative decoding: `"auto"` (each step runs the n-gram drafts worth their cost) or
    /// `"off"`; the most drafts a decode may run and check in one step, and the n-gram lengths
    /// matched.
    pub speculation: String,
    pub speculate_tokens: usize,
    pub speculate_min_ngram: usize,
    pub speculate_max_ngram: usize,
    /// Where drafts come from: `"ngram"` (prompt lookup) or `"model"` (`model.draft`).
    pub draft_source: String,
    /// Keyless clients' (the default tenant's) requests running and waiting at once; 0 = only
    /// the caps above.
    pub anonymous_max_running: usize,
    pub anonymous_max_waiting: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSettings {
    pub prefix_caching: bool,
    pub lease_tokens_per_session: usize,
    pub lease_tokens_total: usize,
    pub lease_grace_s: u64,
    pub pin_widget_prompts: bool,
    /// When a conversation's oldest turns are dropped, move the kept turns' K/V to their new
    /// positions instead of prefilling them again (`kv_cache::manager`, "Context shift").
    pub context_shift: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingSettings {
    /// Each request's defaults (a knob left out here is the sampler's neutral value).
    #[serde(flatten)]
    pub knobs: crate::sampler::SamplingOverrides,
    pub max_tokens: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSettings {
    pub max_tokens: usize,
    pub max_frame_bytes: usize,
    pub max_messages: usize,
    pub max_message_chars: usize,
    pub max_stop_strings: usize,
    pub max_stop_chars: usize,
    /// Bytes of a request's `response_format` (its JSON): a schema, regex or grammar.
    pub max_schema_bytes: usize,
    /// Seconds a widget's host page has to answer a `tool_call` before the model is told the
    /// function did not answer.
    pub tool_timeout_s: u64,
    /// Function calls one turn may make before its reply must be text.
    pub max_tool_calls: usize,
    /// What a session's conversation that outgrows the context does: `drop_oldest` (the
    /// default: whole oldest turns are dropped, the instructions kept) or `error` (the turn is
    /// refused with `prompt_too_long`); a tenant or widget may set its own, a request its own
    /// (`params.overflow`). Stateless HTTP requests ask with `truncation`.
    #[serde(default = "default_overflow")]
    pub overflow: String,
    /// With `drop_oldest`: the share of the room (the context less the reply's) the kept
    /// conversation fills, so the next turns fit without dropping again.
    #[serde(default = "default_retention")]
    pub overflow_retention: f32,
    pub frames_per_s: f64,
    pub frame_burst: u32,
    pub rejected_frames_per_s: f64,
    pub rejected_frame_burst: u32,
}

fn default_overflow() -> String {
    "drop_oldest".into()
}

/// The share of the room a conversation keeps when `drop_oldest` drops its turns, unless
/// `limits.overflow_retention` says otherwise.
pub const DEFAULT_RETENTION: f32 = 0.8;

fn default_retention() -> f32 {
    DEFAULT_RETENTION
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub server: ServerSettings,
    pub model: ModelSettings,
    pub engine: EngineSettings,
    pub scheduler: SchedulerSettings,
    pub cache: CacheSettings,
    pub sampling: SamplingSettings,
    pub limits: LimitSettings,
    /// Tenants with API keys and widgets; none = one default tenant.
    #[serde(default)]
    pub tenants: Vec<TenantSettings>,
}

/// A TOML parser's error on one line: its first line (where) and its last (what), without the
/// quoted source lines between them.
fn one_line(e: &dyn std::fmt::Display) -> String {
    let text = e.to_string();
    let lines: Vec<&str> = (text.lines().map(str::trim))
        .filter(|l| !l.is_empty() && !l.contains('|'))
        .collect();
    lines.join(": ")
}

/// The error for a setting outside what is allowed (one shape for every key).
pub(crate) fn invalid(key: &str, value: impl std::fmt::Display, allowed: &str) -> EngineError {
    EngineError::InvalidSetting {
        key: key.into(),
        value: value.to_string(),
        allowed: allowed.into(),
    }
}

impl Settings {
    /// Defaults, then `file`, then the environment.
    pub fn load(file: Option<&Path>) -> Result<Self> {
        let mut b = config::Config::builder().add_source(config::File::from_str(
            DEFAULT_TOML,
            config::FileFormat::Toml,
        ));
        if let Some(f) = file {
            let config_error = |message: String| EngineError::Config {
                path: f.into(),
                message,
            };
            let text = std::fs::read_to_string(f).map_err(|e| {
                config_error(match e.kind() {
                    std::io::ErrorKind::NotFound => "not found (give --config an existing TOML \
                        file, or leave it out for config/default.toml's settings)"
                        .into(),
                    _ => format!("cannot be read: {e}"),
                })
            })?;
            // The file alone first, so a syntax error names the file rather than "the settings".
            config::Config::builder()
                .add_source(config::File::from_str(&text, config::FileFormat::Toml))
                .build()
                .map_err(|e| config_error(format!("not valid TOML: {}", one_line(&e))))?;
            b = b.add_source(config::File::from_str(&text, config::FileFormat::Toml));
        }
        b = b.add_source(
            config::Environment::with_prefix("LLAMA_RELAY")
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true),
        );
        let c = b
            .build()
            .map_err(|e| invalid("config", "(file)", &e.to_string()))?;
        c.try_deserialize::<Settings>()
            .map_err(|e| invalid("config", "(file or environment)", &e.to_string()))
    }

    pub fn threads(&self) -> usize {
        if self.engine.threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            self.engine.threads
        }
    }

    /// The `[sampling]` section as a request's defaults.
    pub fn sampling_defaults(&self) -> crate::sampler::SamplingParams {
        (self.sampling.knobs).over(&crate::sampler::SamplingParams::default())
    }

    /// Checks every value and builds the engine options.
    pub fn engine_options(&self) -> Result<EngineOptions> {
        let e = &self.engine;
        let device = parse_device(&e.device)?;
        if e.threads > MAX_THREADS {
            return Err(invalid(
                "engine.threads",
                e.threads,
                &format!("0 (all cores) to {MAX_THREADS}"),
            ));
        }
        if e.block_size == 0 || e.block_size > MAX_BLOCK_SIZE {
            return Err(invalid(
                "engine.block_size",
                e.block_size,
                &format!("1 to {MAX_BLOCK_SIZE} tokens"),
            ));
        }
        let cache = match (e.cache_mib, e.cache_tokens) {
            (0, 0) => {
                return Err(invalid(
                    "engine.cache_mib",
                    0,
                    "set engine.cache_mib or engine.cache_tokens to more than 0",
                ))
            }
            (_, t) if t > 0 => CacheSize::Tokens(t),
            (m, _) => CacheSize::Mib(m),
        };
        let attention = match e.attention.as_str() {
            "auto" => None,
            "fast" => Some(AttentionImpl::FastCpu),
            "generic" => Some(AttentionImpl::Generic),
            other => {
                return Err(invalid(
                    "engine.attention",
                    format!("{other:?}"),
                    "\"auto\", \"fast\" (CPU) or \"generic\"",
                ))
            }
        };
        if attention == Some(AttentionImpl::FastCpu) && !device.is_cpu() {
            return Err(invalid(
                "engine.attention",
                "\"fast\"",
                "the fast kernel runs on CPU only; use \"auto\" or \"generic\"",
            ));
        }
        let weights = match e.weights.as_str() {
            "auto" => WeightMode::Auto,
            "keep" => WeightMode::Keep,
            "f32" => WeightMode::F32,
            other => {
                return Err(invalid(
                    "engine.weights",
                    format!("{other:?}"),
                    "\"auto\", \"keep\" or \"f32\"",
                ))
            }
        };
        let kv_dtype = crate::kv_cache::KvDtype::parse(&e.kv_dtype).ok_or_else(|| {
            invalid(
                "engine.kv_dtype",
                format!("{:?}", e.kv_dtype),
                "\"f32\", \"f16\" or \"q8_0\"",
            )
        })?;
        let path = |s: &str| {
            if s.is_empty() {
                None
            } else {
                Some(PathBuf::from(s))
            }
        };
        Ok(EngineOptions {
            model: path(&self.model.path),
            tokenizer: path(&self.model.tokenizer),
            device,
            block_size: e.block_size,
            cache,
            max_context: if e.max_context == 0 {
                None
            } else {
                Some(e.max_context)
            },
            attention,
            weights,
            kv_dtype,
            amx_weights_mib: e.amx_weights_mib,
        })
    }
}

impl Settings {
    /// The draft model's engine options when drafts come from a model (`scheduler.draft_source
    /// = "model"` with speculation on): `model.draft` on the model's device, context and cache
    /// types, with a cache of `engine.draft_cache_mib`. Checks that the two settings agree.
    pub fn draft_options(&self) -> Result<Option<EngineOptions>> {
        let draft = &self.model.draft;
        match self.scheduler.draft_source.as_str() {
            "ngram" if draft.is_empty() => return Ok(None),
            "ngram" => {
                return Err(invalid(
                    "model.draft",
                    format!("{draft:?}"),
                    "empty while scheduler.draft_source is \"ngram\" (set it to \"model\" to draft with this model)",
                ))
            }
            "model" if draft.is_empty() => {
                return Err(invalid(
                    "scheduler.draft_source",
                    "\"model\"",
                    "\"ngram\", or \"model\" with model.draft set to a .gguf file or a Hugging Face folder",
                ))
            }
            "model" => {}
            other => {
                return Err(invalid(
                    "scheduler.draft_source",
                    format!("{other:?}"),
                    "\"ngram\" or \"model\"",
                ))
            }
        }
        if !(1..=65_536).contains(&self.engine.draft_cache_mib) {
            return Err(invalid(
                "engine.draft_cache_mib",
                self.engine.draft_cache_mib,
                "1 to 65536",
            ));
        }
        let mut o = self.engine_options()?;
        if self.scheduler.speculation == "off" {
            return Ok(None);
        }
        o.model = Some(PathBuf::from(draft));
        o.tokenizer = None;
        o.cache = CacheSize::Mib(self.engine.draft_cache_mib);
        Ok(Some(o))
    }
}

/// `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device> {
    let allowed = "\"cpu\", \"cuda\" or \"cuda:N\"";
    match s {
        "cpu" => Ok(Device::Cpu),
        _ if s == "cuda" || s.starts_with("cuda:") => {
            let ordinal = match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse::<usize>()
                    .map_err(|_| invalid("engine.device", format!("{s:?}"), allowed))?,
                None => 0,
            };
            if !cfg!(feature = "cuda") {
                return Err(invalid(
                    "engine.device",
                    format!("{s:?}"),
                    "this binary was built without the `cuda` feature (cargo build --release --features cuda)",
                ));
            }
            Device::new_cuda(ordinal).map_err(|e| {
                // (candle appends a backtrace when RUST_BACKTRACE is set: the first line says it.)
                let e = e.to_string();
                invalid(
                    "engine.device",
                    format!("{s:?}"),
                    &format!(
                        "no such CUDA device: {}",
                        e.lines().next().unwrap_or_default()
                    ),
                )
            })
        }
        other => Err(invalid("engine.device", format!("{other:?}"), allowed)),
    }
}

/// Spins of candle's thread pool before a worker parks (see `apply_process_settings`).
const CANDLE_SPIN_LIMIT: u32 = 1000;

/// The log filter without `RUST_LOG`: `info`, but actix-server's per-worker lines ("starting
/// worker", "shutting down idle worker", one per thread) only from `warn`: they say nothing the
/// server's own `listening` line does not, and its workers print them while the process ends,
/// after the error a fatal start-up failure ends with.
pub const DEFAULT_LOG_FILTER: &str = "info,actix_server=warn";

/// Logs to stderr, filtered by `RUST_LOG` (default `DEFAULT_LOG_FILTER`): what both binaries
/// (`llama-relay`, `llama-relay-bench`) install first.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// Applies process-wide settings that must come before any model work: the rayon pool size
/// (candle's matmuls and our attention share it), candle's pool spin and glibc's allocator tuning.
pub fn apply_process_settings(threads: usize, malloc_tuning: bool) {
    // candle's gemm reads RAYON_NUM_THREADS; set it before any pool exists.
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    // candle's elementwise ops run on its own pool of threads, which spin 25,000 times before
    // parking after each op; on two cores they spin against our rayon workers, so a short spin
    // is faster (docs/performance.md, "Measurements behind constants in the code"). An
    // operator's own value wins.
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var(
            "CANDLE_BARRIER_POOL_SPIN_LIMIT",
            CANDLE_SPIN_LIMIT.to_string(),
        );
    }
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    if malloc_tuning {
        tune_malloc();
    }
}

/// candle allocates a fresh buffer per op; glibc maps every buffer above its mmap threshold with
/// mmap and unmaps it on free, so each step pays page faults for its activations. Raising the
/// threshold to its maximum and keeping freed memory (trim threshold) makes those buffers reuse
/// heap memory instead. Measured in `benches/engine.rs` (`--no-malloc-tuning` for the baseline).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_malloc() {
    // SAFETY: mallopt only changes allocator parameters; it is called before threads allocate.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let s = Settings::load(None).unwrap();
        let o = s.engine_options().unwrap();
        assert!(o.model.is_none());
        assert!(o.device.is_cpu());
    }

    #[test]
    fn bad_values_name_the_key() {
        let mut s = Settings::load(None).unwrap();
        s.engine.block_size = 0;
        let e = s.engine_options().unwrap_err().to_string();
        assert!(
            e.contains("engine.block_size") && e.contains("1 to 256"),
            "{e}"
        );
        let mut s = Settings::load(None).unwrap();
        s.engine.device = "tpu".into();
        let e = s.engine_options().unwrap_err().to_string();
        assert!(e.contains("engine.device") && e.contains("\"tpu\""), "{e}");
        let mut s = Settings::load(None).unwrap();
        s.engine.attention = "flash".into();
        assert!(s
            .engine_options()
            .unwrap_err()
            .to_string()
            .contains("engine.attention"));
        let mut s = Settings::load(None).unwrap();
        s.engine.kv_dtype = "bf16".into();
        let e = s.engine_options().unwrap_err().to_string();
        assert!(
            e.contains("engine.kv_dtype") && e.contains("\"f16\""),
            "{e}"
        );
        for (name, dtype) in [
            ("f16", crate::kv_cache::KvDtype::F16),
            ("f32", crate::kv_cache::KvDtype::F32),
            ("q8_0", crate::kv_cache::KvDtype::Q8),
        ] {
            s.engine.kv_dtype = name.into();
            assert_eq!(s.engine_options().unwrap().kv_dtype, dtype);
        }
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let dir = std::env::temp_dir().join(format!("lr-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("bad.toml");
        std::fs::write(&f, "[engine]\nblok_size = 3\n").unwrap();
        let e = Settings::load(Some(&f)).unwrap_err().to_string();
        assert!(e.contains("blok_size"), "{e}");
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WidgetSettings {
    /// Public id, used as `?widget=ID` and in `data-widget`.
    pub id: String,
    /// Origins allowed to embed it, e.g. "https://shop.example.com".
    pub origins: Vec<String>,
    /// Prepended as the system message of every conversation through this widget.
    #[serde(default)]
    pub system_prompt: String,
    /// Functions the page that embeds the widget runs for the model, in the visitor's browser
    /// (docs/widget.md): described after `system_prompt`, called with `tool_call` frames.
    #[serde(default)]
    pub tools: Vec<ToolSettings>,
    /// `auto` (the model calls when it needs to, the default) or `required` (a turn's first
    /// reply is a call; after its result the model may answer). A turn makes at most
    /// `limits.max_tool_calls` calls; the reply after the last must be text.
    #[serde(default)]
    pub tool_choice: Option<String>,
    /// This widget's conversations' overflow policy (`limits.overflow`; unset: its tenant's).
    #[serde(default)]
    pub overflow: Option<String>,
}

/// A function an operator declares for a widget.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSettings {
    /// 1 to 64 of `a-z A-Z 0-9 _ -`.
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// A JSON Schema of the arguments object (a TOML table); none: no arguments.
    #[serde(default)]
    pub parameters: Option<serde_json::Value>,
}

/// A named system prompt that the tenant's API-key clients select with `/ws?prefix=NAME`;
/// prefilled and pinned at start, shared by all the tenant's principals.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefixSettings {
    pub name: String,
    pub system_prompt: String,
    /// Functions the `/ws` client that selects this prefix runs for the model (`tool_call`
    /// frames), described after `system_prompt`, as a widget's `tools`.
    #[serde(default)]
    pub tools: Vec<ToolSettings>,
    /// `auto` (the default) or `required`, as a widget's.
    #[serde(default)]
    pub tool_choice: Option<String>,
}

/// Which message roles each kind of client of a tenant may send.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientRoles {
    #[serde(default = "widget_roles")]
    pub widget: Vec<String>,
    #[serde(default = "all_roles")]
    pub api_key: Vec<String>,
}

fn widget_roles() -> Vec<String> {
    vec!["user".into()]
}

fn all_roles() -> Vec<String> {
    ["system", "user", "assistant"].map(String::from).to_vec()
}

impl Default for ClientRoles {
    fn default() -> Self {
        ClientRoles {
            widget: widget_roles(),
            api_key: all_roles(),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSettings {
    pub name: String,
    /// Keys for server-side clients (`Authorization: Bearer KEY`), at least 16 characters.
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// The same as SHA-256 hex digests, so the config file need not hold the keys.
    #[serde(default)]
    pub api_key_sha256: Vec<String>,
    #[serde(default)]
    pub widgets: Vec<WidgetSettings>,
    #[serde(default)]
    pub prefixes: Vec<PrefixSettings>,
    /// "key" (each API key its own cache partition) or "tenant" (the tenant's keys share one).
    #[serde(default)]
    pub cache_scope: Option<String>,
    #[serde(default)]
    pub client_roles: ClientRoles,
    /// WebSocket sessions and API requests the tenant's clients hold at once (unset: only the
    /// server's caps).
    #[serde(default)]
    pub max_connections: Option<usize>,
    /// The tenant's requests running and waiting at once (unset: only the scheduler's caps).
    #[serde(default)]
    pub max_running: Option<usize>,
    #[serde(default)]
    pub max_waiting: Option<usize>,
    /// The tenant's conversations' overflow policy (`limits.overflow`; unset: the server's).
    #[serde(default)]
    pub overflow: Option<String>,
}
