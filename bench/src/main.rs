//! `llama-relay-bench`: the load generator and the soak client, a binary of its own so that the
//! server library carries no client code (its WebSocket and HTTP client, `awc`, is a dependency
//! of this package only).
//!
//! Each workload is a subcommand with its own typed flags (`workloads`). Without `--url` a
//! workload starts the server in this process, from the settings `llama-relay serve` reads
//! (config/default.toml, `--config`, `--model`, `--threads`, `LLAMA_RELAY__*`), on a free port.
//! `load`: the clients (the WebSocket protocol and OpenAI's streamed chat completions) and what
//! they measure; `soak`: the long abuse run against a server in another process.

use std::path::PathBuf;

use clap::Parser;
use llama_relay::engine::Engine;
use llama_relay::settings::{apply_process_settings, Settings};

mod load;
mod soak;
mod workloads;

#[derive(Parser)]
#[command(
    name = "llama-relay-bench",
    version,
    about = "Load generator and soak client for llama-relay"
)]
struct Cli {
    /// A settings file layered over config/default.toml (the server started here).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// A .gguf file or a Hugging Face folder (overrides model.path).
    #[arg(long, global = true)]
    model: Option<PathBuf>,
    /// Threads for the model (overrides engine.threads).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    workload: workloads::Workload,
}

/// One line on stderr for an error (its causes `: `-joined) and the server's exit status rule:
/// 2 when what the operator gave cannot work, 1 otherwise.
fn main() -> std::process::ExitCode {
    llama_relay::settings::init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llama-relay-bench: error: {e:#}");
            std::process::ExitCode::from(llama_relay::server::exit_status(e.chain()))
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let mut settings = Settings::load(cli.config.as_deref())?;
    if let Some(m) = &cli.model {
        settings.model.path = m.display().to_string();
    }
    if let Some(t) = cli.threads {
        settings.engine.threads = t;
    }
    let opts = settings.engine_options()?;
    settings.validate_server()?;
    if cli.workload.loads_a_model() {
        apply_process_settings(settings.threads(), settings.engine.malloc_tuning);
        // A model path that cannot work ends the run now, before anything starts.
        if let Some(model) = &opts.model {
            Engine::check_model(model, opts.tokenizer.as_deref())?;
        }
    }
    cli.workload.run(settings, opts)
}
