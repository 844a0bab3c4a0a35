//! The workloads, one subcommand each with its own typed flags: what each runs, the server
//! started in this process unless `--url` names one, and the runs of the load generator
//! (`crate::load`) with their figures printed.

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use llama_relay::engine::{Engine, EngineOptions};
use llama_relay::generate::{generate, GenerateParams};
use llama_relay::server::gate::tenants::{TenantSettings, WidgetSettings};
use llama_relay::settings::Settings;
use llama_relay::tokenizer::Message;

use crate::load;

#[derive(Subcommand)]
pub enum Workload {
    /// Independent requests: `--users` concurrent users, prompts with unique starts (no two
    /// share a prefix), greedy replies of `--max-tokens`; TTFT, inter-token gap, aggregate.
    Throughput(ThroughputArgs),
    /// A support chat: a shared system prompt, several turns per user with think time; TTFT per
    /// turn. Without `--url`, against two servers: prefix caching on, then off.
    Chat(ChatArgs),
    /// Conversations far past the context (`--turns` turns each, `limits.overflow`
    /// `drop_oldest`): every turn answered; the TTFT of the turns that dropped old turns
    /// against the others.
    LongChat(LongChatArgs),
    /// One stream's inter-token gap through the server against the engine's own decode step for
    /// the same model and prompt, with `--idle-sessions` sessions holding KV leases meanwhile.
    Overhead(OverheadArgs),
    /// `--users` streams while long prompts arrive: the streams' gaps before, during and after
    /// the long prefills, and each long prompt's time against alone.
    Mixed(MixedArgs),
    /// An API-key user's TTFT alone and while `--users` keyless clients keep the server full.
    Flood(FloodArgs),
    /// Forced disconnects of greedy replies, each resumed on a new connection and compared with
    /// the uninterrupted reply.
    Resume(ResumeArgs),
    /// `--users` type a message at `--chars-per-s`, without and then with drafts.
    Typeahead(TypeaheadArgs),
    /// `--users` streaming users beside as many clients consuming replies at `--acks-per-s`
    /// deltas a second, without and then with `--window`.
    Paced(PacedArgs),
    /// `--users` users with and without a JSON Schema on every reply (`--pairs` pairs, the order
    /// alternating): TTFT, gaps and aggregate each way, then the grammar's mask and compile times
    /// from the server's metrics.
    Structured(StructuredArgs),
    /// Speculative decoding: `--users` users whose replies quote their prompt's policy text,
    /// against two servers started here (n-gram drafts off and on), `--pairs` pairs with the
    /// order alternating; aggregate tok/s and gaps each way and their ratio.
    Quote(QuoteArgs),
    /// Through a load balancer (`--url`): conversations of `--turns` turns, a new connection
    /// each turn with `?conversation=ID`, resuming or restoring where it lands
    /// (deploy/local-cluster.sh).
    Cluster(ClusterArgs),
    /// Long abuse run against a loopback server in another process (scripts/soak.sh starts one
    /// and runs this).
    Soak(crate::soak::SoakArgs),
}

impl Workload {
    /// Whether the workload loads a model in this process (a server started here, or the
    /// engine the overhead workload compares with): the model path is checked first.
    pub fn loads_a_model(&self) -> bool {
        match self {
            Workload::Throughput(a) => a.server.url.is_none(),
            Workload::Chat(a) => a.server.url.is_none(),
            Workload::LongChat(a) => a.server.url.is_none(),
            Workload::Overhead(_) => true,
            Workload::Mixed(a) => a.server.url.is_none(),
            Workload::Flood(a) => a.server.url.is_none(),
            Workload::Resume(a) => a.server.url.is_none(),
            Workload::Typeahead(a) => a.server.url.is_none(),
            Workload::Paced(a) => a.server.url.is_none(),
            Workload::Structured(a) => a.server.url.is_none(),
            Workload::Quote(_) => true,
            Workload::Cluster(_) | Workload::Soak(_) => false,
        }
    }

    pub fn run(self, settings: Settings, opts: EngineOptions) -> anyhow::Result<()> {
        match self {
            Workload::Throughput(a) => throughput(settings, opts, a),
            Workload::Chat(a) => chat(settings, opts, a),
            Workload::LongChat(a) => long_chat(settings, opts, a),
            Workload::Overhead(a) => overhead(settings, opts, a),
            Workload::Mixed(a) => mixed(settings, opts, a),
            Workload::Flood(a) => flood(settings, opts, a),
            Workload::Resume(a) => resume(settings, opts, a),
            Workload::Typeahead(a) => typeahead(settings, opts, a),
            Workload::Paced(a) => paced(settings, opts, a),
            Workload::Structured(a) => structured(settings, opts, a),
            Workload::Quote(a) => quote(settings, opts, a),
            Workload::Cluster(a) => cluster(a),
            Workload::Soak(a) => crate::soak::main(a),
        }
    }
}

/// The server a workload loads.
#[derive(Args)]
pub struct Server {
    /// ws://HOST:PORT/ws; without it, a server is started in this process on a free port.
    #[arg(long)]
    pub url: Option<String>,
}

/// Which API the throughput workload's users speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ApiChoice {
    Websocket,
    /// Streamed chat completions over Server-Sent Events.
    Openai,
    /// Each user count over both against the same server, the order alternating.
    Both,
}

#[derive(Args)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub server: Server,
    /// Concurrent users, one run each (e.g. --users 1,16,32).
    #[arg(long, value_delimiter = ',', default_value = "1,16,32")]
    pub users: Vec<usize>,
    /// Requests per run; 0 = 4 per user.
    #[arg(long, default_value_t = 0)]
    pub requests: usize,
    /// Words in each prompt (about one token each).
    #[arg(long, default_value_t = 100)]
    pub prompt_words: usize,
    /// New tokens per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    #[arg(long, value_enum, default_value_t = ApiChoice::Websocket)]
    pub api: ApiChoice,
    /// With --url and the OpenAI API: the API key to send (a server started here gets one).
    #[arg(long)]
    pub api_key: Option<String>,
}

/// Where the chat workload's system prompt comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SystemPrompt {
    /// A widget's configured prompt; users connect as its visitors, each its own principal.
    Server,
    /// Each user sends it.
    Client,
}

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub server: Server,
    /// Concurrent users, one run each.
    #[arg(long, value_delimiter = ',', default_value = "1,16,32")]
    pub users: Vec<usize>,
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// Words in the shared system prompt (about one token each).
    #[arg(long, default_value_t = 400)]
    pub system_words: usize,
    /// Think time between turns, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub think_ms: u64,
    #[arg(long, value_enum, default_value_t = SystemPrompt::Server)]
    pub system_prompt: SystemPrompt,
    /// With --url and `--system-prompt server`: the widget id and the page origin to connect as
    /// (the server's widget configuration must hold the system prompt).
    #[arg(long, num_args = 2, value_names = ["ID", "ORIGIN"])]
    pub widget: Option<Vec<String>>,
    /// New tokens per reply.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sample with the server's `[sampling]` defaults (seeded per turn), as the chat page and
    /// the widget do; without it replies are greedy (the figures in docs/performance.md).
    #[arg(long)]
    pub server_sampling: bool,
    /// With --server-sampling: the seeds' base (user u's turn t samples with seed BASE + 10u + t),
    /// to compare builds over more than one set of replies.
    #[arg(long, default_value_t = 1000)]
    pub seed_base: u64,
}

#[derive(Args)]
pub struct LongChatArgs {
    #[command(flatten)]
    pub server: Server,
    #[arg(long, default_value_t = 16)]
    pub users: usize,
    #[arg(long, default_value_t = 200)]
    pub turns: usize,
    /// New tokens per reply.
    #[arg(long, default_value_t = 48)]
    pub max_tokens: usize,
    /// Think time between turns, in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub think_ms: u64,
    /// The context of the server started here (0: the model's, capped by `engine.max_context`).
    #[arg(long, default_value_t = 2048)]
    pub max_context: usize,
}

#[derive(Args)]
pub struct OverheadArgs {
    #[command(flatten)]
    pub server: Server,
    /// Rounds (one engine generation and one server stream each).
    #[arg(long, default_value_t = 5, value_parser = at_least_1)]
    pub rounds: usize,
    #[arg(long, default_value_t = 100)]
    pub prompt_words: usize,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sessions that each finish one short request and stay connected, holding a KV lease,
    /// while the stream is measured.
    #[arg(long, default_value_t = 0)]
    pub idle_sessions: usize,
}

#[derive(Args)]
pub struct MixedArgs {
    #[command(flatten)]
    pub server: Server,
    /// Streaming users.
    #[arg(long, default_value_t = 8)]
    pub users: usize,
    /// Words in each long prompt (about one token each).
    #[arg(long, default_value_t = 6000)]
    pub long_words: usize,
    /// When each long prompt is sent, in seconds after the streams start (one per value).
    #[arg(long, value_delimiter = ',', default_value = "5", value_parser = seconds_from_0)]
    pub long_at: Vec<f64>,
    /// New tokens per stream reply, at most (a reply ends at its end-of-turn token).
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
}

#[derive(Args)]
pub struct FloodArgs {
    #[command(flatten)]
    pub server: Server,
    /// Keyless clients flooding.
    #[arg(long, default_value_t = 64)]
    pub users: usize,
    /// New tokens per flood reply.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// The API-key user's requests.
    #[arg(long, default_value_t = 100)]
    pub requests: usize,
    /// With --url: the measured user's API key (a server started here gets one).
    #[arg(long)]
    pub api_key: Option<String>,
}

#[derive(Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    pub server: Server,
    /// Forced disconnects.
    #[arg(long, default_value_t = 100)]
    pub requests: usize,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
}

#[derive(Args)]
pub struct TypeaheadArgs {
    #[command(flatten)]
    pub server: Server,
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub users: Vec<usize>,
    /// Words in each typed message.
    #[arg(long, default_value_t = 200)]
    pub prompt_words: usize,
    /// How fast each user types.
    #[arg(long, default_value_t = 8.0, value_parser = above_0)]
    pub chars_per_s: f64,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
}

#[derive(Args)]
pub struct StructuredArgs {
    #[command(flatten)]
    pub server: Server,
    /// Concurrent users, one set of pairs each.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub users: Vec<usize>,
    /// Rounds of runs per user count: free text, with the schema and with tools, each going first
    /// in turn.
    #[arg(long, default_value_t = 2)]
    pub pairs: usize,
    /// Requests per run; 0 = 4 per user.
    #[arg(long, default_value_t = 0)]
    pub requests: usize,
    #[arg(long, default_value_t = 100)]
    pub prompt_words: usize,
    /// New tokens per request (the schema's answer is longer, so every reply has this many).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
}

#[derive(Args)]
pub struct QuoteArgs {
    /// Concurrent users, each user count a set of pairs.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub users: Vec<usize>,
    /// Rounds per user count: speculation off and on, each going first in turn.
    #[arg(long, default_value_t = 3)]
    pub pairs: usize,
    /// Requests per run; 0 = 2 per user.
    #[arg(long, default_value_t = 0)]
    pub requests: usize,
    /// New tokens per request (greedy, end-of-turn ignored; the quotation is about 80).
    #[arg(long, default_value_t = 80)]
    pub max_tokens: usize,
    /// Drafts a decode may propose (`scheduler.speculate_tokens` of the second server).
    #[arg(long, default_value_t = 8)]
    pub drafts: usize,
    /// Pause between a user's reply and its next request, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub think_ms: u64,
    /// Drafts from this model (same tokenizer) on the second server instead of n-gram lookup.
    #[arg(long)]
    pub draft_model: Option<std::path::PathBuf>,
}

/// Two servers in this process, n-gram speculation off and on (everything else the same), the
/// same quoting users against each, alternating.
fn quote(mut settings: Settings, opts: EngineOptions, a: QuoteArgs) -> anyhow::Result<()> {
    let max_users = a.users.iter().copied().max().unwrap_or(1);
    settings.server.port = 0;
    settings.scheduler.max_waiting = settings.scheduler.max_waiting.max(max_users);
    actix_web::rt::System::new().block_on(async move {
        let mut urls = Vec::new();
        for mode in ["off", "auto"] {
            settings.scheduler.speculation = mode.into();
            settings.scheduler.speculate_tokens = a.drafts;
            if let (Some(d), "auto") = (&a.draft_model, mode) {
                settings.model.draft = d.display().to_string();
                settings.scheduler.draft_source = "model".into();
            }
            urls.push(start_in_process(&settings, opts.clone()).await?);
        }
        for &users in &a.users {
            let mut aggregate: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
            let mut itl: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
            let mut decode: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
            for pair in 0..a.pairs {
                let order: [usize; 2] = if pair % 2 == 0 { [0, 1] } else { [1, 0] };
                for which in order {
                    print!("{:<15} ", ["speculation off", "speculation on"][which]);
                    let cfg = load::BenchConfig {
                        api: load::Api::WebSocket,
                        api_key: None,
                        run: rand::random(),
                        url: urls[which].clone(),
                        users,
                        requests: if a.requests == 0 { 2 * users } else { a.requests },
                        prompt_words: 0,
                        max_tokens: a.max_tokens,
                        response_format: None,
                        quote: true,
                        think: std::time::Duration::from_millis(a.think_ms),
                    };
                    let r = load::run(cfg).await.map_err(|e| anyhow::anyhow!(e))?;
                    itl[which].push(r[2] * 1e3);
                    aggregate[which].push(r[4]);
                    decode[which].push(r[5]);
                }
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (off, on) = (median(&mut aggregate[0]), median(&mut aggregate[1]));
            let (g_off, g_on) = (median(&mut itl[0]), median(&mut itl[1]));
            let (d_off, d_on) = (median(&mut decode[0]), median(&mut decode[1]));
            println!(
                "quote | users {users:>3} | medians of {} pairs: {off:.1} -> {on:.1} tok/s aggregate ({:.2}x), decode {d_off:.1} -> {d_on:.1} tok/s a reply ({:.2}x), ITL p50 {g_off:.1} -> {g_on:.1} ms",
                a.pairs,
                on / off,
                d_on / d_off
            );
        }
        Ok(())
    })
}

#[derive(Args)]
pub struct PacedArgs {
    #[command(flatten)]
    pub server: Server,
    #[arg(long, value_delimiter = ',', default_value = "8,16")]
    pub users: Vec<usize>,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// How fast each paced client consumes deltas.
    #[arg(long, default_value_t = 10.0, value_parser = above_0)]
    pub acks_per_s: f64,
    /// The paced clients' window in the second run.
    #[arg(long, default_value_t = 8, value_parser = at_least_1)]
    pub window: usize,
    /// How long a run lasts.
    #[arg(long, default_value_t = 40.0, value_parser = above_0)]
    pub seconds: f64,
}

#[derive(Args)]
pub struct ClusterArgs {
    /// The load balancer in front of the replicas (ws://HOST:PORT/ws).
    #[arg(long)]
    pub url: String,
    /// The widget id and page origin the visitors connect as.
    #[arg(long, num_args = 2, value_names = ["ID", "ORIGIN"])]
    pub widget: Option<Vec<String>>,
    /// Conversations.
    #[arg(long, default_value_t = 24)]
    pub users: usize,
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// Words of the user's own in each first message.
    #[arg(long, default_value_t = 100)]
    pub prompt_words: usize,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Think time between turns, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub think_ms: u64,
    /// A name for the run in its output line.
    #[arg(long, default_value = "cluster")]
    pub label: String,
}

/// A finite number above 0 (a rate, a duration).
pub fn above_0(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err("a number above 0".into()),
    }
}

/// Seconds from 0 up.
fn seconds_from_0(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err("seconds from 0 up".into()),
    }
}

/// A count of at least 1.
fn at_least_1(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(v) if v >= 1 => Ok(v),
        _ => Err("a whole number of at least 1".into()),
    }
}

/// The widget the in-process chat benchmark configures.
const BENCH_WIDGET: (&str, &str) = ("bench-chat", "http://bench.localhost");

fn throughput(
    mut settings: Settings,
    opts: EngineOptions,
    a: ThroughputArgs,
) -> anyhow::Result<()> {
    let apis = match a.api {
        ApiChoice::Websocket => vec![load::Api::WebSocket],
        ApiChoice::Openai => vec![load::Api::OpenAi],
        ApiChoice::Both => vec![load::Api::WebSocket, load::Api::OpenAi],
    };
    // The OpenAI users send a key (each names itself in `user`, its own cache partition, as a
    // WebSocket session is); the server started here gets one, and keeps serving keyless
    // WebSocket users.
    let api_key = match (&a.server.url, &a.api_key, a.api != ApiChoice::Websocket) {
        (_, Some(k), _) => Some(k.clone()),
        (None, None, true) => {
            let key = format!("bench-{}", uuid::Uuid::new_v4().simple());
            settings.tenants.push(TenantSettings {
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
        let url = server_url(&a.server, &settings, &opts).await?;
        for (run, &users) in a.users.iter().enumerate() {
            // With both protocols, the order alternates from one user count to the next
            // (whichever runs second finds the machine warmer).
            let mut order = apis.clone();
            if run % 2 == 1 {
                order.reverse();
            }
            for api in order {
                let cfg = load::BenchConfig {
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
                    response_format: None,
                    quote: false,
                    think: std::time::Duration::ZERO,
                };
                load::run(cfg).await.map_err(|e| anyhow::anyhow!(e))?;
            }
        }
        Ok(())
    })
}

fn chat(mut settings: Settings, opts: EngineOptions, a: ChatArgs) -> anyhow::Result<()> {
    let server_prompt = a.system_prompt == SystemPrompt::Server;
    let widget = match (&a.server.url, &a.widget, server_prompt) {
        (_, Some(w), _) => Some((w[0].clone(), w[1].clone())),
        (None, None, true) => {
            settings.tenants.push(TenantSettings {
                name: "bench".into(),
                widgets: vec![WidgetSettings {
                    id: BENCH_WIDGET.0.into(),
                    origins: vec![BENCH_WIDGET.1.into()],
                    system_prompt: load::system_prompt(a.system_words),
                    ..Default::default()
                }],
                ..Default::default()
            });
            Some((BENCH_WIDGET.0.into(), BENCH_WIDGET.1.into()))
        }
        (Some(_), None, true) => {
            anyhow::bail!("chat with --url needs --widget ID ORIGIN (or --system-prompt client)")
        }
        _ => None,
    };
    let max_users = a.users.iter().copied().max().unwrap_or(1);
    settings.server.port = 0;
    settings.scheduler.max_waiting = settings.scheduler.max_waiting.max(max_users);
    actix_web::rt::System::new().block_on(async move {
        // Without --url, two servers in this process (prefix caching on, then off), so that
        // both columns come from one run.
        let variants: Vec<(String, bool)> = match &a.server.url {
            Some(u) => vec![(u.clone(), true)],
            None => vec![("sharing on".into(), true), ("sharing off".into(), false)],
        };
        for (label, sharing) in variants {
            settings.cache.prefix_caching = sharing;
            let url = server_url(&a.server, &settings, &opts).await?;
            for &users in &a.users {
                let cfg = load::ChatBenchConfig {
                    url: url.clone(),
                    widget: widget.clone(),
                    users,
                    turns: a.turns,
                    system_words: a.system_words,
                    max_tokens: a.max_tokens,
                    think: std::time::Duration::from_millis(a.think_ms),
                    server_sampling: a.server_sampling,
                    seed_base: a.seed_base,
                };
                load::run_chat(cfg, &label)
                    .await
                    .map_err(|e| anyhow::anyhow!(e))?;
            }
        }
        Ok(())
    })
}

fn long_chat(
    mut settings: Settings,
    mut opts: EngineOptions,
    a: LongChatArgs,
) -> anyhow::Result<()> {
    settings.server.port = 0;
    settings.limits.overflow = "drop_oldest".into();
    settings.scheduler.max_waiting = settings.scheduler.max_waiting.max(a.users);
    if a.max_context > 0 {
        settings.engine.max_context = a.max_context;
        opts.max_context = Some(a.max_context);
    }
    actix_web::rt::System::new().block_on(async move {
        let url = server_url(&a.server, &settings, &opts).await?;
        let cfg = load::LongChatConfig {
            url,
            users: a.users,
            turns: a.turns,
            max_tokens: a.max_tokens,
            think: std::time::Duration::from_millis(a.think_ms),
        };
        load::run_long_chat(cfg, "drop_oldest")
            .await
            .map_err(|e| anyhow::anyhow!(e))
    })
}

fn resume(mut settings: Settings, opts: EngineOptions, a: ResumeArgs) -> anyhow::Result<()> {
    settings.server.port = 0;
    actix_web::rt::System::new().block_on(async move {
        let url = server_url(&a.server, &settings, &opts).await?;
        let s = load::run_resume(&url, a.requests, a.max_tokens)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        if s.equal != s.disconnects || s.lost > 0 || s.duplicated > 0 {
            anyhow::bail!("resumed replies differ from the uninterrupted ones: {s:?}");
        }
        Ok(())
    })
}

/// The URL of the server a workload loads: `--url`, or a server started in this process.
async fn server_url(
    server: &Server,
    settings: &Settings,
    opts: &EngineOptions,
) -> anyhow::Result<String> {
    match &server.url {
        Some(u) => Ok(u.clone()),
        None => start_in_process(settings, opts.clone()).await,
    }
}

/// The gateway's overhead: one stream's inter-token gap through the server against the engine's
/// own decode step for the same model, prompt and batch of one, with `--idle-sessions` sessions
/// holding leases meanwhile. The two alternate, one generation each per round (`--requests`
/// rounds, 5 by default), and the figure is the median over rounds of each round's difference:
/// the machine's speed drifts by more than the overhead between runs minutes apart, much less
/// within a round.
fn overhead(mut settings: Settings, opts: EngineOptions, a: OverheadArgs) -> anyhow::Result<()> {
    let mut engine = Engine::load(&opts).context("loading the model")?;
    let text = load::prompt(0, 0, a.prompt_words);
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
    let rounds = a.rounds;
    actix_web::rt::System::new().block_on(async move {
        let url = server_url(&a.server, &settings, &opts).await?;
        let idle = load::idle_sessions(&url, a.idle_sessions)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        let cfg = load::BenchConfig {
            api: load::Api::WebSocket,
            api_key: None,
            run: 0,
            url: url.clone(),
            users: 1,
            requests: 1,
            prompt_words: a.prompt_words,
            max_tokens: a.max_tokens,
            response_format: None,
            quote: false,
            think: std::time::Duration::ZERO,
        };
        // The server's first stream, unmeasured.
        load::run(cfg.clone())
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        let mut diffs = Vec::new();
        for round in 0..rounds {
            let st = generate(&mut engine, &ids, &params, |_, _| Ok(()))?;
            let mut steps: Vec<f64> = st.decode_steps.iter().map(|d| d.as_secs_f64()).collect();
            steps.sort_by(f64::total_cmp);
            let step = load::percentile(&steps, 50.0);
            let r = load::run(cfg.clone())
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
            load::percentile(&diffs, 50.0) * 1e3,
            diffs[0] * 1e3,
            diffs[diffs.len() - 1] * 1e3,
            idle.len()
        );
        drop(idle);
        Ok(())
    })
}

/// Streams and long prompts: each stream's gaps before, during and after the long prefills.
fn mixed(mut settings: Settings, opts: EngineOptions, a: MixedArgs) -> anyhow::Result<()> {
    settings.server.port = 0;
    // The long prompts are bigger than a chat message may be by default.
    settings.limits.max_message_chars = settings.limits.max_message_chars.max(16 * a.long_words);
    settings.limits.max_frame_bytes = settings.limits.max_frame_bytes.max(32 * a.long_words);
    let users = a.users;
    actix_web::rt::System::new().block_on(async move {
        let url = server_url(&a.server, &settings, &opts).await?;
        let cfg = load::MixedBenchConfig {
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
        load::run_mixed(cfg).await.map_err(|e| anyhow::anyhow!(e))?;
        Ok(())
    })
}

fn flood(mut settings: Settings, opts: EngineOptions, a: FloodArgs) -> anyhow::Result<()> {
    settings.server.port = 0;
    // The measured user is an API key of its own tenant; the flood is keyless.
    let key = match (&a.server.url, &a.api_key) {
        (Some(_), Some(k)) => k.clone(),
        (Some(_), None) => anyhow::bail!("flood with --url needs --api-key"),
        (None, _) => {
            let key = format!("bench-{:032x}", rand::random::<u128>());
            settings.tenants = vec![TenantSettings {
                name: "bench".into(),
                api_keys: vec![key.clone()],
                ..Default::default()
            }];
            settings.server.allow_anonymous = Some(true);
            key
        }
    };
    let flood_users = a.users;
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
        let url = server_url(&a.server, &settings, &opts).await?;
        let cfg = load::FloodBenchConfig {
            url,
            api_key: key,
            flood_users,
            flood_tokens: a.max_tokens,
            requests: a.requests,
        };
        load::run_flood(cfg).await.map_err(|e| anyhow::anyhow!(e))?;
        Ok(())
    })
}

/// Conversations through a load balancer; fails when any conversation failed.
fn cluster(a: ClusterArgs) -> anyhow::Result<()> {
    let widget = a.widget.as_ref().map(|w| (w[0].clone(), w[1].clone()));
    let cfg = load::ClusterBenchConfig {
        url: a.url,
        widget,
        users: a.users,
        turns: a.turns,
        context_words: a.prompt_words,
        max_tokens: a.max_tokens,
        think: std::time::Duration::from_millis(a.think_ms),
        turn_deadline: std::time::Duration::from_secs(120),
    };
    let s = actix_web::rt::System::new()
        .block_on(load::run_cluster(cfg, &a.label))
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

/// For each user count: the type-ahead workload without drafts, then with, against the same
/// server; prints the TTFT ratio and the decode rate ratio.
fn typeahead(mut settings: Settings, opts: EngineOptions, a: TypeaheadArgs) -> anyhow::Result<()> {
    settings.server.port = 0;
    actix_web::rt::System::new().block_on(async move {
        let url = server_url(&a.server, &settings, &opts).await?;
        // One short exchange first, unmeasured: the first request of a process pays one-time costs.
        let warm = load::TypeaheadBenchConfig {
            url: url.clone(),
            users: 1,
            message_words: 20,
            chars_per_s: 1000.0,
            max_tokens: 4,
            drafts: true,
            print: false,
        };
        load::run_typeahead(warm)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        for &users in &a.users {
            let run = |drafts| {
                load::run_typeahead(load::TypeaheadBenchConfig {
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
            let p = load::percentile;
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
fn paced(mut settings: Settings, opts: EngineOptions, a: PacedArgs) -> anyhow::Result<()> {
    settings.server.port = 0;
    actix_web::rt::System::new().block_on(async move {
        let url = server_url(&a.server, &settings, &opts).await?;
        for &users in &a.users {
            let run = |window| {
                load::run_paced(load::PacedBenchConfig {
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
async fn start_in_process(settings: &Settings, opts: EngineOptions) -> anyhow::Result<String> {
    let running = llama_relay::server::build(settings, opts).context("starting the server")?;
    let addr = running.addr;
    let state = running.state.clone();
    actix_web::rt::spawn(running.server);
    let ready = loop {
        if let Some(r) = state.ready() {
            break r;
        }
        if let Some(failure) = running.failed.borrow().clone() {
            return Err(failure.into());
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

/// The schema of the structured workload: a support answer with a category and a long text (at
/// least 400 characters, so that every constrained reply runs to `--max-tokens` as the free ones
/// do with `ignore_eos`).
fn bench_schema() -> serde_json::Value {
    serde_json::json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object",
        "properties": {
            "category": {"enum": ["billing", "shipping", "returns", "other"]},
            "urgent": {"type": "boolean"},
            "answer": {"type": "string", "minLength": 400},
        },
        "required": ["category", "urgent", "answer"],
        "additionalProperties": false,
    }}})
}

/// The tools of the structured workload, as the grammar a reply that must call one is held to
/// (what `tools` with `tool_choice: "required"` makes of a request): two functions, one of them
/// with a long text argument so that every call runs to `--max-tokens` as the free replies do.
fn bench_tools() -> serde_json::Value {
    use llama_relay::server::request::tools::{Tool, ToolChoice, Tools};
    let tools = Tools {
        tools: vec![
            Tool {
                name: "order_status".into(),
                description: "Looks up an order by its number.".into(),
                parameters: serde_json::json!({"type": "object",
                    "properties": {"order": {"type": "string", "maxLength": 12}},
                    "required": ["order"], "additionalProperties": false}),
            },
            Tool {
                name: "open_ticket".into(),
                description: "Opens a support ticket for a human.".into(),
                parameters: serde_json::json!({"type": "object",
                    "properties": {
                        "category": {"enum": ["billing", "shipping", "returns", "other"]},
                        "summary": {"type": "string", "minLength": 400},
                    },
                    "required": ["category", "summary"], "additionalProperties": false}),
            },
        ],
        choice: ToolChoice::Required,
        parallel: false,
        syntax: llama_relay::server::request::tools::generic_syntax(),
        native: false,
    };
    serde_json::to_value(tools.format()).expect("a format serializes")
}

fn structured(
    mut settings: Settings,
    opts: EngineOptions,
    a: StructuredArgs,
) -> anyhow::Result<()> {
    let max_users = a.users.iter().copied().max().unwrap_or(1);
    settings.server.port = 0;
    settings.scheduler.max_waiting = settings.scheduler.max_waiting.max(max_users);
    actix_web::rt::System::new().block_on(async move {
        let url = server_url(&a.server, &settings, &opts).await?;
        let metrics_url = load::completions_url(&url).replace("/v1/chat/completions", "/metrics");
        for &users in &a.users {
            for pair in 0..a.pairs {
                // Each variant goes first in turn.
                let mut order = [
                    ("free text", None),
                    ("schema", Some(bench_schema())),
                    ("tools", Some(bench_tools())),
                ];
                order.rotate_left(pair % 3);
                for (name, format) in order {
                    print!("{name:<10} ");
                    let cfg = load::BenchConfig {
                        api: load::Api::WebSocket,
                        api_key: None,
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
                        response_format: format,
                        quote: false,
                        think: std::time::Duration::ZERO,
                    };
                    load::run(cfg).await.map_err(|e| anyhow::anyhow!(e))?;
                }
            }
        }
        let mut r = awc::Client::new()
            .get(&metrics_url)
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("{metrics_url}: {e}"))?;
        let text = String::from_utf8_lossy(&r.body().limit(1 << 22).await?).to_string();
        for name in [
            "llama_relay_grammar_mask_seconds",
            "llama_relay_grammar_compile_seconds",
        ] {
            println!("{}", histogram_summary(&text, name));
        }
        Ok(())
    })
}

/// A Prometheus histogram from `/metrics` text: its count, mean, and the bucket bounds below
/// which 50% and 99% of the observations fall.
fn histogram_summary(metrics: &str, name: &str) -> String {
    let value = |line: &str| line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
    let (mut buckets, mut sum, mut count) = (Vec::new(), 0.0, 0.0);
    for line in metrics.lines() {
        if let Some(rest) = line.strip_prefix(&format!("{name}_bucket{{le=\"")) {
            let le = rest.split('"').next().unwrap_or("");
            if let (Ok(le), Some(v)) = (le.parse::<f64>(), value(line)) {
                buckets.push((le, v));
            }
        } else if line.starts_with(&format!("{name}_sum")) {
            sum = value(line).unwrap_or(0.0);
        } else if line.starts_with(&format!("{name}_count")) {
            count = value(line).unwrap_or(0.0);
        }
    }
    let under = |p: f64| {
        (buckets.iter())
            .find(|(_, v)| *v >= p * count)
            .map_or("+Inf".to_string(), |(le, _)| format!("{:.2} ms", le * 1e3))
    };
    format!(
        "{name}: {count} observed, mean {:.3} ms, p50 <= {}, p99 <= {}",
        if count > 0.0 { sum / count * 1e3 } else { 0.0 },
        under(0.5),
        under(0.99)
    )
}
