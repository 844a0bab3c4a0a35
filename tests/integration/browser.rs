//! The chat page and the widget in a real browser: Debian's chromium driven by playwright-core
//! (tests/browser/scenarios.test.mjs), against the relay on the default model. This test serves
//! the host page (tests/browser/host.html) from a second server, reached as `allowed.test` (an
//! origin the widget allows) and `blocked.test` (one it does not). Screenshots land in
//! `target/browser-artifacts/`.
//!
//! Needs node, npm and chromium (`apt-get install chromium`; `.ci/run` installs it). The
//! playwright-core and axe-core packages are installed here from tests/browser/package-lock.json
//! when missing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use actix_web::{web, App, HttpResponse, HttpServer};
use llama_relay::server::gate::tenants::{TenantSettings, WidgetSettings};
use llama_relay::settings::ToolSettings;

use crate::common::model_lock;
use crate::common::*;

const WIDGET_PROMPT: &str = "You are the support assistant of Acme, a shop that sells garden \
    tools. Answer customers briefly and politely. If you do not know an order's status, ask for \
    the order number.";

/// Serves host.html at `/` and host-tools.html at `/tools` on 127.0.0.1:0, with `{{RELAY}}`
/// filled in once the relay is up.
fn spawn_host_page(relay: Arc<OnceLock<String>>) -> u16 {
    let page = std::fs::read_to_string(root().join("tests/browser/host.html")).unwrap();
    let tools = std::fs::read_to_string(root().join("tests/browser/host-tools.html")).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let server = HttpServer::new(move || {
                let serve = |page: String, relay: Arc<OnceLock<String>>| {
                    web::get().to(move || {
                        let body = page.replace("{{RELAY}}", relay.get().expect("relay started"));
                        async move {
                            HttpResponse::Ok()
                                .content_type("text/html; charset=utf-8")
                                .body(body)
                        }
                    })
                };
                App::new()
                    .route("/", serve(page.clone(), relay.clone()))
                    .route("/tools", serve(tools.clone(), relay.clone()))
            })
            .workers(1)
            .bind(("127.0.0.1", 0))
            .unwrap();
            tx.send(server.addrs()[0].port()).unwrap();
            server.run().await.unwrap();
        })
    });
    rx.recv().unwrap()
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn require(cmd: &str, hint: &str) {
    let ok = Command::new(cmd)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok, "`{cmd}` is needed for the browser tests: {hint}");
}

/// Installs playwright-core and axe-core (the accessibility checks) from the lock file when they
/// are not there yet (no browser download: the tests use Debian's chromium).
fn ensure_node_modules(dir: &Path) {
    if ["playwright-core", "axe-core"].iter().all(|p| {
        dir.join("node_modules")
            .join(p)
            .join("package.json")
            .exists()
    }) {
        return;
    }
    require("npm", "install Node.js and npm");
    let st = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund"])
        .current_dir(dir)
        .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
        .status()
        .unwrap();
    assert!(st.success(), "npm ci in {} failed", dir.display());
}

#[test]
fn chat_page_and_widget_in_chromium() {
    let _g = model_lock();
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        Path::new(&chromium).exists(),
        "{chromium} not found: the browser tests need Debian's chromium (apt-get install chromium), or CHROMIUM=/path/to/chromium"
    );
    require("node", "install Node.js (20 or newer)");
    let dir = root().join("tests/browser");
    ensure_node_modules(&dir);

    let relay = Arc::new(OnceLock::new());
    let host_port = spawn_host_page(relay.clone());
    let app = spawn_app(
        &llama_relay::default_model::ensure_default_model().unwrap(),
        |s| {
            s.sampling.max_tokens = 160;
            s.cache.lease_grace_s = 0;
            s.tenants = vec![TenantSettings {
                name: "acme".into(),
                api_keys: vec![],
                widgets: vec![
                    WidgetSettings {
                        id: "acme-help".into(),
                        origins: vec![format!("http://allowed.test:{host_port}")],
                        system_prompt: WIDGET_PROMPT.into(),
                        ..Default::default()
                    },
                    // Its page runs `order_status`; every first reply of a turn calls it.
                    WidgetSettings {
                        id: "acme-orders".into(),
                        origins: vec![format!("http://allowed.test:{host_port}")],
                        system_prompt: WIDGET_PROMPT.into(),
                        tools: vec![ToolSettings {
                            name: "order_status".into(),
                            description: "Looks up the status of an order by its number.".into(),
                            parameters: Some(serde_json::json!({
                                "type": "object",
                                "properties": {"order": {"type": "string", "maxLength": 12}},
                                "required": ["order"],
                                "additionalProperties": false,
                            })),
                        }],
                        tool_choice: Some("required".into()),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }];
            // The chat page itself is served to keyless visitors beside the widget.
            s.server.allow_anonymous = Some(true);
            s.limits.max_tool_calls = 1;
        },
    );
    relay.set(format!("http://{}", app.addr)).unwrap();

    let artifacts = root().join("target/browser-artifacts");
    let out = Command::new("node")
        .args([
            "--test",
            "--test-concurrency=1",
            "--test-reporter=spec",
            "tests/browser/scenarios.test.mjs",
        ])
        .current_dir(root())
        .env("RELAY", format!("http://{}", app.addr))
        .env("HOST_PORT", host_port.to_string())
        .env("ARTIFACTS", &artifacts)
        .env("CHROMIUM", &chromium)
        .output()
        .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{report}");
    assert!(out.status.success(), "browser scenarios failed:\n{report}");
    for shot in [
        "chat.png",
        "chat-midstream.png",
        "chat-light.png",
        "chat-dark.png",
        "widget-open.png",
        "widget-midstream.png",
        "widget-tool-call.png",
    ] {
        assert!(artifacts.join(shot).exists(), "missing screenshot {shot}");
    }
}
