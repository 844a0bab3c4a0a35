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
    /// A smaller model with the same tokenizer that writes speculative drafts (sets model.draft
    /// and scheduler.draft_source = "model").
    #[arg(long, global = true)]
    draft_model: Option<PathBuf>,
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
    /// Run one prompt and stream the reply to stdout, with prompt and decode speed at the end.
    Generate(GenerateArgs),
    /// Score a text: perplexity, and KL divergence against a saved reference run
    /// (docs/perplexity.md).
    Perplexity(PerplexityArgs),
}

#[derive(Args)]
struct PerplexityArgs {
    /// A UTF-8 text file (e.g. /usr/share/common-licenses/GPL-3).
    file: PathBuf,
    /// Tokens a chunk (its second half is scored).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(16..))]
    ctx: u32,
    /// Chunks at most (default: as many as the text fills).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    chunks: Option<u32>,
    /// Write this run as a reference file.
    #[arg(long)]
    save_reference: Option<PathBuf>,
    /// Compare with a reference file: KL divergence and top-1 agreement.
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Score each chunk after its context dropped this many tokens of other text and was
    /// shifted back over them (the server's context shift; compare with a reference run
    /// without it).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    shift: Option<u32>,
    /// With --shift: the chunk's first tokens that stay where they are (what the server always
    /// keeps: the system prompt's head; a model's first tokens anchor its attention).
    #[arg(long, default_value_t = 16, requires = "shift")]
    shift_keep: u32,
}

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

/// One line on stderr: the error and its causes, `: `-joined; with RUST_BACKTRACE set, anyhow's
/// whole report (causes one per line, and the backtrace).
fn main() -> std::process::ExitCode {
    llama_relay::settings::init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
                eprintln!("llama-relay: error: {e:?}");
            } else {
                eprintln!("llama-relay: error: {e:#}");
            }
            std::process::ExitCode::from(llama_relay::server::exit_status(e.chain()))
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let mut settings = Settings::load(cli.common.config.as_deref())?;
    if let Some(m) = &cli.common.model {
        settings.model.path = m.display().to_string();
    }
    if let Some(d) = &cli.common.draft_model {
        if !matches!(cli.command, Some(Command::Serve) | None) {
            return Err(llama_relay::error::EngineError::InvalidSetting {
                key: "--draft-model".into(),
                value: d.display().to_string(),
                allowed: "only when serving (generate and perplexity do not speculate)".into(),
            }
            .into());
        }
        settings.model.draft = d.display().to_string();
        settings.scheduler.draft_source = "model".into();
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
    if let Some(model) = &opts.model {
        Engine::check_model(model, opts.tokenizer.as_deref())?;
    }
    if let Some(draft) = settings.draft_options()?.and_then(|o| o.model) {
        Engine::check_model(&draft, None)?;
    }
    match cli.command {
        Some(Command::Generate(args)) => run_generate(&opts, args),
        Some(Command::Perplexity(args)) => run_perplexity(&opts, args),
        Some(Command::Serve) | None => serve(settings, opts),
    }
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
        let stopper = running.server.handle();
        let mut server = actix_web::rt::spawn(running.server);
        tokio::select! {
            r = &mut server => r.context("server")?.context("server"),
            Some(failure) = failure => {
                // Listeners and workers stop first, so that the error is the last line printed.
                stopper.stop(false).await;
                let _ = server.await;
                Err(failure.into())
            }
        }
    })
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

fn run_perplexity(
    opts: &llama_relay::engine::EngineOptions,
    a: PerplexityArgs,
) -> anyhow::Result<()> {
    use llama_relay::perplexity::{perplexity, prepare, run, Divergence, Run};
    let text = std::fs::read(&a.file).map_err(|source| llama_relay::error::EngineError::Io {
        path: a.file.clone(),
        source,
    })?;
    let text = String::from_utf8(text).map_err(|e| llama_relay::error::EngineError::Config {
        path: a.file.clone(),
        message: format!("not UTF-8 text: {e}"),
    })?;
    let reference = a.reference.as_deref().map(Run::load).transpose()?;
    let mut engine = Engine::load(opts).context("loading the model")?;
    let ids = engine.tokenizer.encode_text(&text)?;
    let prepared = prepare(&engine, &ids, a.ctx as usize, a.chunks.map(|c| c as usize))?;
    if let (Some(r), Some(path)) = (&reference, &a.reference) {
        r.scored_as(&prepared)
            .map_err(|why| llama_relay::error::EngineError::Config {
                path: path.clone(),
                message: format!("the reference scored another run: {why}"),
            })?;
    }
    let mut div = Divergence::default();
    let started = std::time::Instant::now();
    let shift = a.shift.map(|d| llama_relay::perplexity::Shift {
        dropped: d as usize,
        keep: a.shift_keep as usize,
    });
    let this = run(&mut engine, &prepared, shift, |i, s, row| {
        if let Some(r) = reference.as_ref().and_then(|r| r.scored.get(i)) {
            div.add(r, s, row);
        }
    })?;
    let (ppl, err) = perplexity(&this.scored);
    println!(
        "{}: {} tokens, {} chunks of {}, {} scored in {:.1} s: perplexity {ppl:.4} +/- {err:.4}",
        a.file.display(),
        ids.len(),
        this.chunks,
        this.ctx,
        this.scored.len(),
        started.elapsed().as_secs_f64()
    );
    if let (Some(r), Some(path)) = (&reference, &a.reference) {
        let (rppl, _) = perplexity(&r.scored);
        let [mean, median, p99, max] = div.summary();
        println!(
            "against {}: reference perplexity {rppl:.4} (this run {:+.3}%); KL divergence mean {mean:.6}, median {median:.6}, p99 {p99:.6}, max {max:.6}; same top token {:.2}%",
            path.display(),
            100.0 * (ppl / rppl - 1.0),
            100.0 * div.same_top1 as f64 / div.kl.len() as f64
        );
    }
    if let Some(path) = &a.save_reference {
        this.save(path)?;
        println!("reference saved to {}", path.display());
    }
    Ok(())
}
