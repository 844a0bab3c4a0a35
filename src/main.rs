//! The `llama-relay` binary: command line, settings, logging. `anyhow` lives here only.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use llama_relay::engine::Engine;
use llama_relay::generate::{generate, GenerateParams};
use llama_relay::settings::{apply_process_settings, Settings};
use llama_relay::tokenizer::{IncrementalDecoder, Message};

#[derive(Parser)]
#[command(
    name = "llama-relay",
    version,
    about = "Streams Llama-3-family chat completions, batched on one machine"
)]
struct Cli {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Args, Clone)]
struct Common {
    /// A settings file layered over config/default.toml.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// A .gguf file or a Hugging Face folder (overrides model.path).
    #[arg(long, global = true)]
    model: Option<PathBuf>,
    /// Threads for the model (overrides engine.threads).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Address to listen on (overrides server.host).
    #[arg(long, global = true)]
    host: Option<String>,
    /// Port (overrides server.port; 0 = any free port).
    #[arg(long, global = true)]
    port: Option<u16>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the chat page and the WebSocket API (the default).
    Serve,
    /// Load generator: concurrent chat users over the WebSocket protocol (or OpenAI's API).
    Bench(Box<BenchArgs>),
    /// Run one prompt and stream the reply to stdout, with prompt and decode speed at the end.
    Generate(GenerateArgs),
    /// Long abuse run against a loopback server (scripts/soak.sh starts one and runs this).
    Soak(SoakArgs),
}

#[derive(Args)]
struct SoakArgs {
    /// The server (ws://127.0.0.1:PORT/ws).
    #[arg(long)]
    url: String,
    /// The server's process id (its resident memory is read from /proc).
    #[arg(long)]
    server_pid: u32,
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Sessions open throughout, and how many of them generate back to back.
    #[arg(long, default_value_t = 1000)]
    sessions: usize,
    #[arg(long, default_value_t = 64)]
    active: usize,
    /// Seconds between waves of abuse.
    #[arg(long, default_value_t = 120)]
    wave_s: u64,
    /// Each wave: clients that drop their socket mid-reply, that cancel, that never read.
    #[arg(long, default_value_t = 500)]
    disconnects: usize,
    #[arg(long, default_value_t = 200)]
    cancels: usize,
    #[arg(long, default_value_t = 50)]
    non_readers: usize,
}

#[derive(Args)]
struct BenchArgs {
    /// Server to load (ws://HOST:PORT/ws); without it, a server is started in this process.
    #[arg(long)]
    url: Option<String>,
    /// Concurrent users, one or more runs (e.g. --users 1,16,32).
    #[arg(long, value_delimiter = ',', default_value = "1,16,32")]
    users: Vec<usize>,
    /// Requests per run; 0 = 4 per user (overhead: rounds, 0 = 5).
    #[arg(long, default_value_t = 0)]
    requests: usize,
    /// Words in each prompt (about one token each).
    #[arg(long, default_value_t = 100)]
    prompt_words: usize,
    /// New tokens per request.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// `throughput` (independent requests), `chat` (a shared system prompt, several turns each;
    /// run with prefix caching on and off when the server is started here) or `overhead` (one
    /// stream's gap through the server against the engine's own step), `mixed` (`--users`
    /// streams and long prompts arriving while they stream) or `flood` (an API-key user's TTFT
    /// alone and while `--users` keyless clients keep the server full of `--max-tokens` replies)
    /// or `resume` (`--requests` forced disconnects of greedy replies, each resumed on a new
    /// connection and compared with the uninterrupted reply) or `typeahead` (`--users` type a
    /// `--prompt-words` message at `--chars-per-s`, without and then with drafts) or `paced`
    /// (`--users` streaming users beside as many clients consuming `--max-tokens` replies at
    /// `--acks-per-s` deltas a second, without and then with `--window`) or `cluster` (with
    /// `--url` of a load balancer: `--users` conversations of `--turns` turns, a new connection
    /// each turn with `?conversation=ID`, resuming or restoring the conversation where it lands;
    /// the first message has `--prompt-words` words of the user's own; deploy/local-cluster.sh).
    #[arg(long, default_value = "throughput")]
    workload: String,
    /// chat: turns per user.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// chat: words in the shared system prompt (about one token each).
    #[arg(long, default_value_t = 400)]
    system_words: usize,
    /// chat: think time between turns, in milliseconds.
    #[arg(long, default_value_t = 500)]
    think_ms: u64,
    /// chat: where the system prompt comes from: `server` (a widget's configured prompt; users
    /// connect as its visitors, each its own principal) or `client` (each user sends it).
    #[arg(long, default_value = "server")]
    system_prompt: String,
    /// chat with --url and `--system-prompt server`: the widget id and the page origin to
    /// connect as (the server's widget configuration must hold the system prompt).
    #[arg(long, num_args = 2, value_names = ["ID", "ORIGIN"])]
    widget: Option<Vec<String>>,
    /// overhead: sessions that each finish one short request and stay connected, holding a KV
    /// lease, while the stream is measured.
    #[arg(long, default_value_t = 0)]
    idle_sessions: usize,
    /// typeahead: how fast each user types.
    #[arg(long, default_value_t = 8.0)]
    chars_per_s: f64,
    /// paced: how fast each paced client consumes deltas, its window, and how long a run lasts.
    #[arg(long, default_value_t = 10.0)]
    acks_per_s: f64,
    #[arg(long, default_value_t = 8)]
    window: usize,
    #[arg(long, default_value_t = 40.0)]
    seconds: f64,
    /// throughput: `websocket`, `openai` (streamed chat completions over SSE) or `both` (each
    /// user count over both against the same server, the order alternating).
    #[arg(long, default_value = "websocket")]
    api: String,
    /// openai with --url: the API key to send (without --url the server started here gets one).
    #[arg(long)]
    api_key: Option<String>,
    /// cluster: a name for the run in its output line.
    #[arg(long)]
    label: Option<String>,
    /// mixed: words in each long prompt (about one token each).
    #[arg(long, default_value_t = 6000)]
    long_words: usize,
    /// mixed: when each long prompt is sent, in seconds after the streams start (one per value).
    #[arg(long, value_delimiter = ',', default_value = "5")]
    long_at: Vec<f64>,
}

/// The widget the in-process chat benchmark configures.
const BENCH_WIDGET: (&str, &str) = ("bench-chat", "http://bench.localhost");

#[derive(Args)]
struct GenerateArgs {
    /// The user message (or the raw prompt with --raw).
    #[arg(short, long, default_value = "Name the capital of France.")]
    prompt: String,
    /// A system message for the chat template.
    #[arg(long)]
    system: Option<String>,
    /// Send the prompt as it is, without the chat template.
    #[arg(long)]
    raw: bool,
    #[arg(short = 'n', long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(short, long, default_value_t = 0.0)]
    temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// 1 = off.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Tokens per prefill step.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// Keep going past end-of-turn tokens.
    #[arg(long)]
    ignore_eos: bool,
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// A failure whose exit status is decided where it happens (see `exit_status`).
#[derive(Debug)]
struct Fatal {
    message: String,
    /// 2: what the operator gave cannot work; 1: the machine or the engine failed.
    status: u8,
}

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Fatal {}

impl From<llama_relay::server::Failure> for Fatal {
    fn from(failure: llama_relay::server::Failure) -> Self {
        use llama_relay::server::Failure;
        match failure {
            Failure::Load { reason, usage } => Fatal {
                message: format!("the model failed to load: {reason}"),
                status: if usage { 2 } else { 1 },
            },
            Failure::Engine(reason) => Fatal {
                message: format!("the engine failed: {reason}; exiting for a restart"),
                status: 1,
            },
        }
    }
}

/// The process's exit status for an error: 2 when what the operator gave cannot work (a flag,
/// the config file, a setting, a model path that does not exist or is not a model; clap exits 2
/// for a bad flag itself), 1 when the machine or the engine failed (a read error, a port in use,
/// a folder that cannot be written, the default model's fetch, a failed step).
fn exit_status(e: &anyhow::Error) -> u8 {
    e.chain()
        .find_map(|c| {
            if let Some(f) = c.downcast_ref::<Fatal>() {
                Some(f.status)
            } else {
                (c.downcast_ref::<llama_relay::EngineError>())
                    .map(|e| if e.is_usage() { 2 } else { 1 })
            }
        })
        .unwrap_or(1)
}

/// One line on stderr: the error and its causes, `: `-joined; with RUST_BACKTRACE set, anyhow's
/// whole report (causes one per line, and the backtrace).
fn main() -> std::process::ExitCode {
    init_tracing();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
                eprintln!("llama-relay: error: {e:?}");
            } else {
                eprintln!("llama-relay: error: {e:#}");
            }
            std::process::ExitCode::from(exit_status(&e))
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let mut settings = Settings::load(cli.common.config.as_deref())?;
    if let Some(m) = &cli.common.model {
        settings.model.path = m.display().to_string();
    }
    if let Some(t) = cli.common.threads {
        settings.engine.threads = t;
    }
    if let Some(h) = &cli.common.host {
        settings.server.host = h.clone();
    }
    if let Some(p) = cli.common.port {
        settings.server.port = p;
    }
    let opts = settings.engine_options()?;
    settings.validate_server()?;
    apply_process_settings(settings.threads(), settings.engine.malloc_tuning);
    // A model path that cannot work ends the process now, before a listener is bound or a
    // background load starts (the default model is checked when it is fetched).
    let loads_a_model = match &cli.command {
        Some(Command::Soak(_)) => false,
        Some(Command::Bench(a)) => a.url.is_none(),
        _ => true,
    };
    if let (true, Some(model)) = (loads_a_model, &opts.model) {
        Engine::check_model(model, opts.tokenizer.as_deref())?;
    }
    match cli.command {
        Some(Command::Generate(args)) => run_generate(&opts, args),
        Some(Command::Serve) | None => serve(settings, opts),
        Some(Command::Bench(a)) => bench(settings, opts, *a),
        Some(Command::Soak(a)) => soak(a),
    }
}

fn soak(a: SoakArgs) -> anyhow::Result<()> {
    let cfg = llama_relay::soak::SoakConfig {
        url: a.url,
        server_pid: a.server_pid,
        duration: std::time::Duration::from_secs_f64(a.minutes * 60.0),
        sessions: a.sessions,
        active: a.active.min(a.sessions),
        wave_every: std::time::Duration::from_secs(a.wave_s),
        disconnects: a.disconnects,
        cancels: a.cancels,
        non_readers: a.non_readers,
    };
    let ok = actix_web::rt::System::new()
        .block_on(llama_relay::soak::run(cfg))
        .map_err(|e| anyhow::anyhow!(e))?;
    if !ok {
        anyhow::bail!("the soak failed (see above)");
    }
    Ok(())
}

/// How long clients get to read the errors of an engine failure before the process exits.
const FAILURE_EXIT_DELAY: std::time::Duration = std::time::Duration::from_secs(1);

fn serve(settings: Settings, opts: llama_relay::engine::EngineOptions) -> anyhow::Result<()> {
    actix_web::rt::System::new().block_on(async move {
        let running = llama_relay::server::build(&settings, opts).context("starting the server")?;
        tracing::info!(address = %running.addr, "listening; the chat page is at http://{}/", running.addr);
        let handle = running.server.handle();
        let state = running.state.clone();
        let grace = std::time::Duration::from_secs(settings.server.shutdown_grace_s);
        actix_web::rt::spawn(async move {
            wait_for_signal().await;
            tracing::info!(grace_s = grace.as_secs(), "shutting down: no new requests, finishing running ones");
            llama_relay::server::shutdown(&state, grace).await;
            handle.stop(true).await;
        });
        // A model that failed to load can never serve: exit at once. An engine that failed for
        // good has told its clients; give the sockets a moment to carry that, then exit. Either
        // way non-zero, for the supervisor to restart the process or show the crash.
        let mut failed = running.failed.clone();
        let failure = async move {
            let failure = failed.wait_for(|f| f.is_some()).await.ok()?.clone()?;
            if matches!(failure, llama_relay::server::Failure::Engine(_)) {
                actix_web::rt::time::sleep(FAILURE_EXIT_DELAY).await;
            }
            Some(failure)
        };
        tokio::select! {
            r = running.server => r.context("server"),
            Some(failure) = failure => Err(Fatal::from(failure).into()),
        }
    })
}

fn bench(
    mut settings: Settings,
    opts: llama_relay::engine::EngineOptions,
    a: BenchArgs,
) -> anyhow::Result<()> {
    if !matches!(
        a.workload.as_str(),
        "throughput"
            | "chat"
            | "overhead"
            | "mixed"
            | "flood"
            | "resume"
            | "typeahead"
            | "paced"
            | "cluster"
    ) {
        anyhow::bail!(
            "--workload must be `throughput`, `chat`, `overhead`, `mixed`, `flood`, `resume`, `typeahead`, `paced` or `cluster`, not `{}`",
            a.workload
        );
    }
    let apis = match a.api.as_str() {
        "websocket" => vec![llama_relay::bench::Api::WebSocket],
        "openai" => vec![llama_relay::bench::Api::OpenAi],
        "both" => vec![
            llama_relay::bench::Api::WebSocket,
            llama_relay::bench::Api::OpenAi,
        ],
        other => anyhow::bail!("--api must be `websocket`, `openai` or `both`, not `{other}`"),
    };
    if a.workload != "throughput" && a.api != "websocket" {
        anyhow::bail!("--api applies to --workload throughput only");
    }
    if a.workload == "overhead" {
        return bench_overhead(settings, opts, a);
    }
    if a.workload == "mixed" {
        return bench_mixed(settings, opts, a);
    }
    if a.workload == "flood" {
        return bench_flood(settings, opts, a);
    }
    if a.workload == "typeahead" {
        return bench_typeahead(settings, opts, a);
    }
    if a.workload == "paced" {
        return bench_paced(settings, opts, a);
    }
    if a.workload == "cluster" {
        return bench_cluster(a);
    }
    if a.workload == "resume" {
        settings.server.port = 0;
        return actix_web::rt::System::new().block_on(async move {
            let url = match &a.url {
                Some(u) => u.clone(),
                None => start_in_process(&settings, opts.clone()).await?,
            };
            let n = if a.requests == 0 { 100 } else { a.requests };
            let s = llama_relay::bench::run_resume(&url, n, a.max_tokens)
                .await
                .map_err(|e| anyhow::anyhow!(e))?;
            if s.equal != s.disconnects || s.lost > 0 || s.duplicated > 0 {
                anyhow::bail!("resumed replies differ from the uninterrupted ones: {s:?}");
            }
            Ok(())
        });
    }
    let server_prompt = match a.system_prompt.as_str() {
        "server" => true,
        "client" => false,
        other => anyhow::bail!("--system-prompt must be `server` or `client`, not `{other}`"),
    };
    let chat = a.workload == "chat";
    let widget = match (&a.url, &a.widget, server_prompt && chat) {
        (_, Some(w), _) => Some((w[0].clone(), w[1].clone())),
        (None, None, true) => {
            settings
                .tenants
                .push(llama_relay::server::gate::tenants::TenantSettings {
                    name: "bench".into(),
                    widgets: vec![llama_relay::server::gate::tenants::WidgetSettings {
                        id: BENCH_WIDGET.0.into(),
                        origins: vec![BENCH_WIDGET.1.into()],
                        system_prompt: llama_relay::bench::system_prompt(a.system_words),
                    }],
                    ..Default::default()
                });
            Some((BENCH_WIDGET.0.into(), BENCH_WIDGET.1.into()))
        }
        (Some(_), None, true) => anyhow::bail!(
            "--workload chat with --url needs --widget ID ORIGIN (or --system-prompt client)"
        ),
        _ => None,
    };
    // The OpenAI users send a key (each names itself in `user`, its own cache partition, as a
    // WebSocket session is); the server started here gets one, and keeps serving keyless
    // WebSocket users.
    let api_key = match (
        &a.url,
        &a.api_key,
        apis.contains(&llama_relay::bench::Api::OpenAi),
    ) {
        (_, Some(k), _) => Some(k.clone()),
        (None, None, true) => {
            let key = format!("bench-{}", uuid::Uuid::new_v4().simple());
            settings
                .tenants
                .push(llama_relay::server::gate::tenants::TenantSettings {
                    name: "bench-api".into(),
                    api_keys: vec![key.clone()],
                    ..Default::default()
                });
            settings.server.allow_anonymous = Some(true);
            Some(key)
        }
        _ => None,
    };
    let max_users = a.users.iter().copied().max().unwrap_or(1);
    settings.server.port = 0;
    settings.scheduler.max_waiting = settings.scheduler.max_waiting.max(max_users);
    actix_web::rt::System::new().block_on(async move {
        // Without --url, a server in this process; the chat workload runs against two (prefix
        // caching on, then off) so that both columns come from one run.
        let variants: Vec<(String, bool)> = match (&a.url, a.workload.as_str()) {
            (Some(u), _) => vec![(u.clone(), true)],
            (None, "chat") => vec![("sharing on".into(), true), ("sharing off".into(), false)],
            (None, _) => vec![("in-process".into(), true)],
        };
        for (label, sharing) in variants {
            let url = match &a.url {
                Some(u) => u.clone(),
                None => {
                    settings.cache.prefix_caching = sharing;
                    start_in_process(&settings, opts.clone()).await?
                }
            };
            for (run, &users) in a.users.iter().enumerate() {
                if a.workload == "chat" {
                    let cfg = llama_relay::bench::ChatBenchConfig {
                        url: url.clone(),
                        widget: widget.clone(),
                        users,
                        turns: a.turns,
                        system_words: a.system_words,
                        max_tokens: a.max_tokens,
                        think: std::time::Duration::from_millis(a.think_ms),
                    };
                    llama_relay::bench::run_chat(cfg, &label)
                        .await
                        .map_err(|e| anyhow::anyhow!(e))?;
                } else {
                    // With both protocols, the order alternates from one user count to the next
                    // (whichever runs second finds the machine warmer).
                    let mut order = apis.clone();
                    if run % 2 == 1 {
                        order.reverse();
                    }
                    for api in order {
                        let cfg = llama_relay::bench::BenchConfig {
                            api,
                            api_key: api_key.clone(),
                            run: rand::random(),
                            url: url.clone(),
                            users,
                            requests: if a.requests == 0 {
                                4 * users
                            } else {
                                a.requests
                            },
                            prompt_words: a.prompt_words,
                            max_tokens: a.max_tokens,
                        };
                        llama_relay::bench::run(cfg)
                            .await
                            .map_err(|e| anyhow::anyhow!(e))?;
                    }
                }
            }
        }
        Ok(())
    })
}

/// The gateway's overhead: one stream's inter-token gap through the server against the engine's
/// own decode step for the same model, prompt and batch of one, with `--idle-sessions` sessions
/// holding leases meanwhile. The two alternate, one generation each per round (`--requests`
/// rounds, 5 by default), and the figure is the median over rounds of each round's difference:
/// the machine's speed drifts by more than the overhead between runs minutes apart, much less
/// within a round.
fn bench_overhead(
    mut settings: Settings,
    opts: llama_relay::engine::EngineOptions,
    a: BenchArgs,
) -> anyhow::Result<()> {
    let mut engine = Engine::load(&opts).context("loading the model")?;
    let text = llama_relay::bench::prompt(0, 0, a.prompt_words);
    let ids = engine
        .tokenizer
        .encode_chat(&[Message::new("user", &text)], true)?
        .1;
    let params = GenerateParams {
        max_new_tokens: a.max_tokens,
        stop_at_eos: false,
        ..Default::default()
    };
    // One unmeasured generation: the first of a process pays one-time costs.
    generate(&mut engine, &ids, &params, |_, _| Ok(()))?;
    settings.server.port = 0;
    settings.scheduler.max_waiting = settings.scheduler.max_waiting.max(a.idle_sessions);
    // Every session comes from this one address.
    let per_address = &mut settings.server.max_connections_per_address;
    *per_address = (*per_address).max(a.idle_sessions + 8);
    let rounds = if a.requests == 0 { 5 } else { a.requests };
    actix_web::rt::System::new().block_on(async move {
        let url = match &a.url {
            Some(u) => u.clone(),
            None => start_in_process(&settings, opts.clone()).await?,
        };
        let idle = llama_relay::bench::idle_sessions(&url, a.idle_sessions)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        let cfg = llama_relay::bench::BenchConfig {
            api: llama_relay::bench::Api::WebSocket,
            api_key: None,
            run: 0,
            url: url.clone(),
            users: 1,
            requests: 1,
            prompt_words: a.prompt_words,
            max_tokens: a.max_tokens,
        };
        // The server's first stream, unmeasured.
        llama_relay::bench::run(cfg.clone())
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        let mut diffs = Vec::new();
        for round in 0..rounds {
            let st = generate(&mut engine, &ids, &params, |_, _| Ok(()))?;
            let mut steps: Vec<f64> = st.decode_steps.iter().map(|d| d.as_secs_f64()).collect();
            steps.sort_by(f64::total_cmp);
            let step = llama_relay::bench::percentile(&steps, 50.0);
            let r = llama_relay::bench::run(cfg.clone())
                .await
                .map_err(|e| anyhow::anyhow!(e))?;
            let gap = r[2];
            diffs.push(gap - step);
            println!(
                "round {} | engine decode step p50 {:.2} ms | server gap p50 {:.2} ms, p99 {:.2} ms | gap - step {:+.2} ms",
                round + 1,
                step * 1e3,
                gap * 1e3,
                r[3] * 1e3,
                (gap - step) * 1e3,
            );
        }
        diffs.sort_by(f64::total_cmp);
        println!(
            "overhead | gap - step median of {rounds} rounds {:+.2} ms (range {:+.2} to {:+.2}) | idle sessions with leases {}",
            llama_relay::bench::percentile(&diffs, 50.0) * 1e3,
            diffs[0] * 1e3,
            diffs[diffs.len() - 1] * 1e3,
            idle.len()
        );
        drop(idle);
        Ok(())
    })
}

/// Streams and long prompts: each stream's gaps before, during and after the long prefills.
fn bench_mixed(
    mut settings: Settings,
    opts: llama_relay::engine::EngineOptions,
    a: BenchArgs,
) -> anyhow::Result<()> {
    if a.long_at.iter().any(|t| !t.is_finite() || *t < 0.0) {
        anyhow::bail!("--long-at takes seconds from 0 up");
    }
    settings.server.port = 0;
    // The long prompts are bigger than a chat message may be by default.
    settings.limits.max_message_chars = settings.limits.max_message_chars.max(16 * a.long_words);
    settings.limits.max_frame_bytes = settings.limits.max_frame_bytes.max(32 * a.long_words);
    let users = a.users.iter().copied().max().unwrap_or(8);
    actix_web::rt::System::new().block_on(async move {
        let url = match &a.url {
            Some(u) => u.clone(),
            None => start_in_process(&settings, opts.clone()).await?,
        };
        let cfg = llama_relay::bench::MixedBenchConfig {
            url,
            users,
            long_words: a.long_words,
            long_at: a
                .long_at
                .iter()
                .map(|s| std::time::Duration::from_secs_f64(*s))
                .collect(),
            max_tokens: a.max_tokens,
        };
        llama_relay::bench::run_mixed(cfg)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        Ok(())
    })
}

fn bench_flood(
    mut settings: Settings,
    opts: llama_relay::engine::EngineOptions,
    a: BenchArgs,
) -> anyhow::Result<()> {
    settings.server.port = 0;
    // The measured user is an API key of its own tenant; the flood is keyless.
    let key = match (&a.url, &a.api_key) {
        (Some(_), Some(k)) => k.clone(),
        (Some(_), None) => anyhow::bail!("--workload flood with --url needs --api-key"),
        (None, _) => {
            let key = format!("bench-{:032x}", rand::random::<u128>());
            settings.tenants = vec![llama_relay::server::gate::tenants::TenantSettings {
                name: "bench".into(),
                api_keys: vec![key.clone()],
                ..Default::default()
            }];
            settings.server.allow_anonymous = Some(true);
            key
        }
    };
    let flood_users = a.users.iter().copied().max().unwrap_or(64);
    println!(
        "flood: {flood_users} keyless users, {} tokens a reply; scheduler max_running {}, \
         max_waiting {}, anonymous_max_running {}, anonymous_max_waiting {}",
        a.max_tokens,
        settings.scheduler.max_running,
        settings.scheduler.max_waiting,
        settings.scheduler.anonymous_max_running,
        settings.scheduler.anonymous_max_waiting
    );
    actix_web::rt::System::new().block_on(async move {
        let url = match &a.url {
            Some(u) => u.clone(),
            None => start_in_process(&settings, opts.clone()).await?,
        };
        let cfg = llama_relay::bench::FloodBenchConfig {
            url,
            api_key: key,
            flood_users,
            flood_tokens: a.max_tokens,
            requests: if a.requests == 0 { 100 } else { a.requests },
        };
        llama_relay::bench::run_flood(cfg)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        Ok(())
    })
}

/// For each user count: the type-ahead workload without drafts, then with, against the same
/// server; prints the TTFT ratio and the decode rate ratio.
fn bench_cluster(a: BenchArgs) -> anyhow::Result<()> {
    let Some(url) = a.url.clone() else {
        anyhow::bail!("--workload cluster needs --url: the load balancer in front of the replicas (deploy/local-cluster.sh)");
    };
    let widget = a.widget.as_ref().map(|w| (w[0].clone(), w[1].clone()));
    let cfg = llama_relay::bench::ClusterBenchConfig {
        url,
        widget,
        users: a.users.first().copied().unwrap_or(24),
        turns: a.turns,
        context_words: a.prompt_words,
        max_tokens: a.max_tokens,
        think: std::time::Duration::from_millis(a.think_ms),
        turn_deadline: std::time::Duration::from_secs(120),
    };
    let label = a.label.clone().unwrap_or_else(|| "cluster".into());
    let s = actix_web::rt::System::new()
        .block_on(llama_relay::bench::run_cluster(cfg, &label))
        .map_err(|e| anyhow::anyhow!(e))?;
    if !s.failures.is_empty() {
        anyhow::bail!(
            "{} of {} conversations failed",
            s.failures.len(),
            s.conversations
        );
    }
    Ok(())
}

fn bench_typeahead(
    mut settings: Settings,
    opts: llama_relay::engine::EngineOptions,
    a: BenchArgs,
) -> anyhow::Result<()> {
    settings.server.port = 0;
    if !a.chars_per_s.is_finite() || a.chars_per_s <= 0.0 {
        anyhow::bail!("--chars-per-s must be above 0");
    }
    actix_web::rt::System::new().block_on(async move {
        let url = match &a.url {
            Some(u) => u.clone(),
            None => start_in_process(&settings, opts.clone()).await?,
        };
        // One short exchange first, unmeasured: the first request of a process pays one-time costs.
        let warm = llama_relay::bench::TypeaheadBenchConfig {
            url: url.clone(),
            users: 1,
            message_words: 20,
            chars_per_s: 1000.0,
            max_tokens: 4,
            drafts: true,
            print: false,
        };
        llama_relay::bench::run_typeahead(warm)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        for &users in &a.users {
            let run = |drafts| {
                llama_relay::bench::run_typeahead(llama_relay::bench::TypeaheadBenchConfig {
                    url: url.clone(),
                    users,
                    message_words: a.prompt_words,
                    chars_per_s: a.chars_per_s,
                    max_tokens: a.max_tokens,
                    drafts,
                    print: true,
                })
            };
            let off = run(false).await.map_err(|e| anyhow::anyhow!(e))?;
            let on = run(true).await.map_err(|e| anyhow::anyhow!(e))?;
            let p = llama_relay::bench::percentile;
            println!(
                "typeahead users {users}: TTFT p50 with drafts / without {:.2}x, p99 {:.2}x; reply decode p50 {:.3}x; aggregate {:.3}x",
                p(&on.ttft, 50.0) / p(&off.ttft, 50.0),
                p(&on.ttft, 99.0) / p(&off.ttft, 99.0),
                p(&on.decode_tok_s, 50.0) / p(&off.decode_tok_s, 50.0),
                on.aggregate_tok_s / off.aggregate_tok_s,
            );
        }
        Ok(())
    })
}

/// For each user count: the paced workload without a window, then with `--window`, against the
/// same server; prints the ratio of the ordinary users' aggregates.
fn bench_paced(
    mut settings: Settings,
    opts: llama_relay::engine::EngineOptions,
    a: BenchArgs,
) -> anyhow::Result<()> {
    settings.server.port = 0;
    if !(a.acks_per_s.is_finite() && a.seconds.is_finite())
        || a.acks_per_s <= 0.0
        || a.window == 0
        || a.seconds <= 0.0
    {
        anyhow::bail!("--acks-per-s, --window and --seconds must be above 0");
    }
    actix_web::rt::System::new().block_on(async move {
        let url = match &a.url {
            Some(u) => u.clone(),
            None => start_in_process(&settings, opts.clone()).await?,
        };
        for &users in &a.users {
            let run = |window| {
                llama_relay::bench::run_paced(llama_relay::bench::PacedBenchConfig {
                    url: url.clone(),
                    users,
                    max_tokens: a.max_tokens,
                    acks_per_s: a.acks_per_s,
                    window,
                    seconds: a.seconds,
                })
            };
            let off = run(None).await.map_err(|e| anyhow::anyhow!(e))?;
            let on = run(Some(a.window)).await.map_err(|e| anyhow::anyhow!(e))?;
            println!(
                "paced users {users}: others' aggregate with window / without {:.2}x",
                on.others_tok_s / off.others_tok_s
            );
        }
        Ok(())
    })
}

/// Starts the server in this process and returns its WebSocket URL once the model is loaded.
async fn start_in_process(
    settings: &Settings,
    opts: llama_relay::engine::EngineOptions,
) -> anyhow::Result<String> {
    let running = llama_relay::server::build(settings, opts).context("starting the server")?;
    let addr = running.addr;
    let state = running.state.clone();
    actix_web::rt::spawn(running.server);
    let ready = loop {
        if let Some(r) = state.ready() {
            break r;
        }
        if let Some(failure) = running.failed.borrow().clone() {
            return Err(Fatal::from(failure).into());
        }
        actix_web::rt::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    // Configured prompts are pinned before the first request (a deployment starts long before
    // its users arrive): wait until that prefill is done.
    loop {
        let s = ready
            .batcher
            .send(llama_relay::server::batcher::GetStatus)
            .await?;
        if s.running + s.waiting == 0 {
            break;
        }
        actix_web::rt::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    Ok(format!("ws://{addr}/ws"))
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use actix_web::rt::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        tokio_select(actix_web::rt::signal::ctrl_c(), term.recv()).await;
    }
    #[cfg(not(unix))]
    {
        let _ = actix_web::rt::signal::ctrl_c().await;
    }
}

/// Waits for whichever of two futures finishes first.
async fn tokio_select<A: std::future::Future, B: std::future::Future>(a: A, b: B) {
    futures_util::future::select(std::pin::pin!(a), std::pin::pin!(b)).await;
}

fn run_generate(opts: &llama_relay::engine::EngineOptions, a: GenerateArgs) -> anyhow::Result<()> {
    let sampling = llama_relay::sampler::SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: Some(a.seed),
        ..Default::default()
    };
    if let Err(e) = sampling.check() {
        anyhow::bail!(
            "--{} must be {}. Given: {}",
            e.field.replace('_', "-"),
            e.allowed,
            e.given
        );
    }
    let mut engine = Engine::load(opts).context("loading the model")?;
    let ids = if a.raw || !engine.tokenizer.has_chat_template() {
        engine.tokenizer.encode_prompt(&a.prompt)?
    } else {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(Message::new("system", s));
        }
        msgs.push(Message::new("user", &a.prompt));
        engine.tokenizer.encode_chat(&msgs, true)?.1
    };
    let params = GenerateParams {
        max_new_tokens: a.max_tokens,
        sampling,
        prefill_chunk: a.prefill_chunk,
        stop_at_eos: !a.ignore_eos,
    };
    let mut detok = IncrementalDecoder::new(true);
    let mut out = std::io::stdout().lock();
    let stats = generate(&mut engine, &ids, &params, |tok, id| {
        if let Some(text) = detok.push(tok, id)? {
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
        }
        Ok(())
    });
    let stats = stats?;
    if let Some(rest) = detok.finish(&engine.tokenizer)? {
        let _ = out.write_all(rest.as_bytes());
    }
    let _ = writeln!(out);
    eprintln!(
        "prompt: {} tokens in {:.0} ms ({:.1} tok/s); generated: {} tokens, decode {:.1} tok/s{}",
        stats.prompt_tokens,
        stats.prefill.as_secs_f64() * 1e3,
        stats.prompt_tokens_per_s(),
        stats.generated.len(),
        stats.decode_tokens_per_s(),
        if stats.stopped_at_eos {
            " (end of turn)"
        } else {
            ""
        }
    );
    Ok(())
}
