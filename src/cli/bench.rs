//! The `bench` command: which workload to run (typed values, checked by clap), a server started
//! in this process unless `--url` names one, and the runs of the load generator
//! (`llama_relay::bench`) with their figures printed. Part of the binary only.

use anyhow::Context;
use clap::{Args, ValueEnum};
use llama_relay::engine::Engine;
use llama_relay::generate::{generate, GenerateParams};
use llama_relay::settings::Settings;
use llama_relay::tokenizer::Message;

use crate::Fatal;

/// What `bench` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    Throughput,
    Chat,
    Overhead,
    Mixed,
    Flood,
    Resume,
    Typeahead,
    Paced,
    Cluster,
}

/// Which API the throughput workload's users speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ApiChoice {
    Websocket,
    Openai,
    Both,
}

/// Where the chat workload's system prompt comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SystemPrompt {
    Server,
    Client,
}

#[derive(Args)]
pub struct BenchArgs {
    /// Server to load (ws://HOST:PORT/ws); without it, a server is started in this process.
    #[arg(long)]
    pub url: Option<String>,
    /// Concurrent users, one or more runs (e.g. --users 1,16,32).
    #[arg(long, value_delimiter = ',', default_value = "1,16,32")]
    pub users: Vec<usize>,
    /// Requests per run; 0 = 4 per user (overhead: rounds, 0 = 5).
    #[arg(long, default_value_t = 0)]
    pub requests: usize,
    /// Words in each prompt (about one token each).
    #[arg(long, default_value_t = 100)]
    pub prompt_words: usize,
    /// New tokens per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
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
    #[arg(long, value_enum, default_value_t = Workload::Throughput)]
    pub workload: Workload,
    /// chat: turns per user.
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// chat: words in the shared system prompt (about one token each).
    #[arg(long, default_value_t = 400)]
    pub system_words: usize,
    /// chat: think time between turns, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub think_ms: u64,
    /// chat: where the system prompt comes from: `server` (a widget's configured prompt; users
    /// connect as its visitors, each its own principal) or `client` (each user sends it).
    #[arg(long, value_enum, default_value_t = SystemPrompt::Server)]
    pub system_prompt: SystemPrompt,
    /// chat with --url and `--system-prompt server`: the widget id and the page origin to
    /// connect as (the server's widget configuration must hold the system prompt).
    #[arg(long, num_args = 2, value_names = ["ID", "ORIGIN"])]
    pub widget: Option<Vec<String>>,
    /// overhead: sessions that each finish one short request and stay connected, holding a KV
    /// lease, while the stream is measured.
    #[arg(long, default_value_t = 0)]
    pub idle_sessions: usize,
    /// typeahead: how fast each user types.
    #[arg(long, default_value_t = 8.0)]
    pub chars_per_s: f64,
    /// paced: how fast each paced client consumes deltas, its window, and how long a run lasts.
    #[arg(long, default_value_t = 10.0)]
    pub acks_per_s: f64,
    #[arg(long, default_value_t = 8)]
    pub window: usize,
    #[arg(long, default_value_t = 40.0)]
    pub seconds: f64,
    /// throughput: `websocket`, `openai` (streamed chat completions over SSE) or `both` (each
    /// user count over both against the same server, the order alternating).
    #[arg(long, value_enum, default_value_t = ApiChoice::Websocket)]
    pub api: ApiChoice,
    /// openai with --url: the API key to send (without --url the server started here gets one).
    #[arg(long)]
    pub api_key: Option<String>,
    /// cluster: a name for the run in its output line.
    #[arg(long)]
    pub label: Option<String>,
    /// mixed: words in each long prompt (about one token each).
    #[arg(long, default_value_t = 6000)]
    pub long_words: usize,
    /// mixed: when each long prompt is sent, in seconds after the streams start (one per value).
    #[arg(long, value_delimiter = ',', default_value = "5")]
    pub long_at: Vec<f64>,
}

/// The widget the in-process chat benchmark configures.
const BENCH_WIDGET: (&str, &str) = ("bench-chat", "http://bench.localhost");

pub fn bench(
    mut settings: Settings,
    opts: llama_relay::engine::EngineOptions,
    a: BenchArgs,
) -> anyhow::Result<()> {
    let apis = match a.api {
        ApiChoice::Websocket => vec![llama_relay::bench::Api::WebSocket],
        ApiChoice::Openai => vec![llama_relay::bench::Api::OpenAi],
        ApiChoice::Both => vec![
            llama_relay::bench::Api::WebSocket,
            llama_relay::bench::Api::OpenAi,
        ],
    };
    if a.workload != Workload::Throughput && a.api != ApiChoice::Websocket {
        anyhow::bail!("--api applies to --workload throughput only");
    }
    if a.workload == Workload::Overhead {
        return bench_overhead(settings, opts, a);
    }
    if a.workload == Workload::Mixed {
        return bench_mixed(settings, opts, a);
    }
    if a.workload == Workload::Flood {
        return bench_flood(settings, opts, a);
    }
    if a.workload == Workload::Typeahead {
        return bench_typeahead(settings, opts, a);
    }
    if a.workload == Workload::Paced {
        return bench_paced(settings, opts, a);
    }
    if a.workload == Workload::Cluster {
        return bench_cluster(a);
    }
    if a.workload == Workload::Resume {
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
    let server_prompt = a.system_prompt == SystemPrompt::Server;
    let chat = a.workload == Workload::Chat;
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
        let variants: Vec<(String, bool)> = match (&a.url, a.workload) {
            (Some(u), _) => vec![(u.clone(), true)],
            (None, Workload::Chat) => {
                vec![("sharing on".into(), true), ("sharing off".into(), false)]
            }
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
                if a.workload == Workload::Chat {
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
