//! KV cache sharing across sessions and turns, through the real server.

use llama_relay::generate::{generate, GenerateParams};
use llama_relay::tokenizer::Message;
use serde_json::{json, Value};

use crate::common::*;

const BS: usize = 16;

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The cached tokens the server must report for `prompt` when `computed` holds what is cached.
fn expected_cached(prompt: &[u32], computed: &[u32]) -> usize {
    let c = common_prefix(prompt, computed).min(prompt.len() - 1);
    c / BS * BS
}

/// The same for a session's next turn, whose lease also keeps the partly filled block after the
/// full ones: when every computed token is a prefix of the new prompt (leaving one to compute),
/// all of them are reused.
fn expected_cached_with_lease(prompt: &[u32], computed: &[u32]) -> usize {
    let c = common_prefix(prompt, computed);
    if c == computed.len() && computed.len() < prompt.len() {
        c
    } else {
        expected_cached(prompt, computed)
    }
}

/// The cached tokens of a prompt that starts with a pinned prefix: all of the pin, its partly
/// filled last block included (copied into the request's own block), when a token is left.
fn expected_with_pin(prompt: &[u32], pinned: &[u32]) -> usize {
    if prompt.starts_with(pinned) && prompt.len() > pinned.len() && pinned.len() > BS {
        pinned.len()
    } else {
        expected_cached(prompt, pinned)
    }
}

fn system_prompt() -> String {
    let mut s = String::from("You are the support assistant of Example Corp. ");
    for i in 0..40 {
        s.push_str(&format!(
            "Rule {i}: answer politely and cite the manual section {i}. "
        ));
    }
    s
}

async fn chat(c: &mut Client, id: &str, messages: Value, max_tokens: usize) -> (Value, String) {
    c.send(json!({"type": "chat", "id": id, "messages": messages, "params": {"temperature": 0, "max_tokens": max_tokens}}))
        .await;
    let r = c.reply(id).await;
    assert_eq!(r.done["type"], "done", "{:?}", r.done);
    (r.started.expect("started frame"), r.text)
}

/// A tenant's system prompt, configured as a named prefix, is prefilled once at start and every
/// API key of the tenant starts from it; what one key sends after it is its own. The replies
/// equal a server's with sharing off.
#[test]
fn a_shared_system_prompt_is_computed_once() {
    use llama_relay::server::gate::tenants::{PrefixSettings, TenantSettings};
    const Q1: &str =
        "Where is my parcel? I ordered a garden hose three weeks ago and the tracking \
        page has said that it is in transit ever since.";
    const Q2: &str = "How do I get a refund?";
    let _g = model_lock();
    let sys = system_prompt();
    let config = |sharing: bool| {
        let sys = sys.clone();
        move |s: &mut llama_relay::settings::Settings| {
            s.cache.prefix_caching = sharing;
            s.tenants = vec![TenantSettings {
                name: "example".into(),
                api_keys: vec![
                    "example-key-000000001".into(),
                    "example-key-000000002".into(),
                ],
                prefixes: vec![PrefixSettings {
                    name: "support".into(),
                    system_prompt: sys,
                    ..Default::default()
                }],
                ..Default::default()
            }];
        }
    };
    let tok = Tiny::Tied.load(16).tokenizer.clone();
    let render = |q: &str| {
        tok.encode_chat(
            &[Message::new("system", &sys), Message::new("user", q)],
            true,
        )
        .unwrap()
        .1
    };
    let (p1, p2) = (render(Q1), render(Q2));
    let pinned = tok
        .encode_chat(&[Message::new("system", &sys)], false)
        .unwrap()
        .1;
    assert!(
        pinned.len() > 400,
        "a long system prompt ({} tokens)",
        pinned.len()
    );
    let app = spawn_app(Tiny::Tied.dir(), config(true));
    let (text_a, text_c) = actix_web::rt::System::new().block_on(async {
        wait_pinned(&app).await;
        let (s1, text_a) = ask(&app, "1", Q1, "a").await;
        assert_eq!(
            s1["cached_tokens"].as_u64().unwrap() as usize,
            expected_with_pin(&p1, &pinned),
            "the first request of all starts from the pinned prefix"
        );
        let (s2, _) = ask(&app, "2", Q2, "b").await;
        assert_eq!(
            s2["cached_tokens"].as_u64().unwrap() as usize,
            expected_with_pin(&p2, &pinned)
        );
        // Key 2 asks key 1's question: the prefix and key 2's own earlier request are shared
        // (up to where the questions differ), key 1's question is not.
        let (s3, text_c) = ask(&app, "2", Q1, "c").await;
        assert_eq!(
            s3["cached_tokens"].as_u64().unwrap() as usize,
            expected_cached(&p1, &p2)
        );
        assert!(expected_cached(&p1, &p2) < (p1.len() - 1) / BS * BS);
        // Key 1 again: its own blocks too.
        let (s4, text_d) = ask(&app, "1", Q1, "d").await;
        assert_eq!(
            s4["cached_tokens"].as_u64().unwrap() as usize,
            (p1.len() - 1) / BS * BS
        );
        assert_eq!(text_d, text_a);
        app.wait_idle().await;
        (text_a, text_c)
    });
    assert_eq!(text_c, text_a, "the cache hit does not change the reply");
    // A server with sharing off computes everything and answers the same.
    let off = spawn_app(Tiny::Tied.dir(), config(false));
    actix_web::rt::System::new().block_on(async {
        let (s, text) = ask(&off, "1", Q1, "a").await;
        assert_eq!(s["cached_tokens"], 0);
        assert_eq!(text, text_a, "sharing off gives the same reply");
        let (s, _) = ask(&off, "1", Q1, "b").await;
        assert_eq!(s["cached_tokens"], 0, "sharing off: nothing is reused");
        let m = crate::common::metrics_text(&off).await;
        assert!(m.contains("vllm:prefix_cache_hits_total 0"), "{m}");
    });
}

/// One request through a fresh connection with key `example-key-00000000{k}` and the
/// `support` prefix.
async fn ask(app: &crate::common::App, k: &str, q: &str, id: &str) -> (Value, String) {
    let auth = format!("Bearer example-key-00000000{k}");
    let mut c = app
        .connect_with("/ws?prefix=support", &[("Authorization", auth.as_str())])
        .await
        .unwrap();
    chat(&mut c, id, json!([{"role": "user", "content": q}]), 8).await
}

/// Waits until the configured operator prompts are prefilled and pinned.
async fn wait_pinned(app: &crate::common::App) {
    let t0 = std::time::Instant::now();
    while app.status().await.kv_blocks_held == 0 {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "the operator prompt was never pinned"
        );
        actix_web::rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[test]
fn turn_two_reuses_turn_one_prompt_and_reply() {
    let _g = model_lock();
    let app = spawn_app(Tiny::Tied.dir(), |_| {});
    let mut e = Tiny::Tied.load_as_served(16);
    let turn1 = vec![Message::new(
        "user",
        "Tell me a story about a lighthouse keeper.",
    )];
    let p1 = e.tokenizer.encode_chat(&turn1, true).unwrap().1;
    let gen = generate(
        &mut e,
        &p1,
        &GenerateParams {
            max_new_tokens: 40,
            ..Default::default()
        },
        |_, _| Ok(()),
    )
    .unwrap()
    .generated;
    actix_web::rt::System::new().block_on(async {
        let mut c = app.connect().await;
        let (_, reply) = chat(
            &mut c,
            "t1",
            json!([{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]),
            40,
        )
        .await;
        let (s2, _) = chat(
            &mut c,
            "t2",
            json!([{"role": "user", "content": "And then?"}]),
            4,
        )
        .await;
        let mut conv = turn1.clone();
        conv.push(Message::new("assistant", &reply));
        conv.push(Message::new("user", "And then?"));
        let p2 = e.tokenizer.encode_chat(&conv, true).unwrap().1;
        // What turn 1 left in the cache: its prompt and every generated token but the last.
        let mut computed = p1.clone();
        computed.extend_from_slice(&gen[..gen.len() - 1]);
        let cached = s2["cached_tokens"].as_u64().unwrap() as usize;
        assert_eq!(cached, expected_cached_with_lease(&p2, &computed));
        assert_eq!(
            cached,
            computed.len(),
            "the Llama 3 template re-renders turn 1 exactly: all of it is reused"
        );
        assert!(
            cached >= p1.len() / BS * BS,
            "turn 1's prompt is reused: {cached} of {}",
            p1.len()
        );
        app.wait_idle().await;
    });
}

const WIDGET_PROMPT: &str = "You are Alpha's helper. Answer questions about Alpha's shop: orders, parcels, \
    refunds and opening hours. Keep answers short, friendly and accurate; say when you do not know.";

fn two_tenants(s: &mut llama_relay::settings::Settings) {
    use llama_relay::server::gate::tenants::{TenantSettings, WidgetSettings};
    s.tenants = vec![
        TenantSettings {
            name: "alpha".into(),
            api_keys: vec!["alpha-key-0123456789".into()],
            widgets: vec![WidgetSettings {
                id: "alpha-help".into(),
                origins: vec!["http://shop.alpha.test".into()],
                system_prompt: WIDGET_PROMPT.into(),
                ..Default::default()
            }],
            ..Default::default()
        },
        TenantSettings {
            name: "beta".into(),
            api_keys: vec!["beta-key-0123456789".into()],
            ..Default::default()
        },
    ];
    s.server.allow_anonymous = Some(true);
}

#[test]
fn tenants_never_share_and_origins_are_checked() {
    let _g = model_lock();
    let sys = system_prompt();
    let app = spawn_app(Tiny::Tied.dir(), two_tenants);
    let tok = Tiny::Tied.load(16).tokenizer.clone();
    actix_web::rt::System::new().block_on(async {
        // The widget prompt is prefilled right after the model loads.
        wait_pinned(&app).await;
        let msgs =
            json!([{"role": "system", "content": sys}, {"role": "user", "content": "Hello"}]);
        let mut a = app
            .connect_with("/ws", &[("Authorization", "Bearer alpha-key-0123456789")])
            .await
            .unwrap();
        let (s, _) = chat(&mut a, "a1", msgs.clone(), 4).await;
        assert_eq!(s["cached_tokens"], 0);
        // Tenant B sends tenant A's prompt: nothing shared.
        let mut b = app
            .connect_with("/ws", &[("Authorization", "Bearer beta-key-0123456789")])
            .await
            .unwrap();
        let (s, _) = chat(&mut b, "b1", msgs.clone(), 4).await;
        assert_eq!(
            s["cached_tokens"], 0,
            "tenant B must not hit tenant A's blocks"
        );
        // The anonymous default tenant neither.
        let mut d = app.connect().await;
        let (s, _) = chat(&mut d, "d1", msgs.clone(), 4).await;
        assert_eq!(s["cached_tokens"], 0);
        // Within tenant A, sharing is on.
        let mut a2 = app
            .connect_with("/ws", &[("Authorization", "Bearer alpha-key-0123456789")])
            .await
            .unwrap();
        let (s, _) = chat(&mut a2, "a2", msgs.clone(), 4).await;
        assert!(s["cached_tokens"].as_u64().unwrap() > 400, "{s}");

        // Upgrades: wrong key 401, foreign origins 403, the widget's origin and same-origin accepted.
        assert_eq!(
            app.connect_with("/ws", &[("Authorization", "Bearer wrong-key-000000000")])
                .await
                .err(),
            Some(401)
        );
        assert_eq!(
            app.connect_with("/ws?widget=alpha-help", &[("Origin", "http://evil.test")])
                .await
                .err(),
            Some(403)
        );
        assert_eq!(
            app.connect_with("/ws", &[("Origin", "http://evil.test")])
                .await
                .err(),
            Some(403)
        );
        assert_eq!(
            app.connect_with("/ws?widget=nope", &[("Origin", "http://shop.alpha.test")])
                .await
                .err(),
            Some(403)
        );
        let same = format!("http://{}", app.addr);
        assert!(app
            .connect_with("/ws", &[("Origin", same.as_str())])
            .await
            .is_ok());
        // The widget's system prompt leads every conversation through it, and was pinned at start:
        // the first turn of a new conversation is already a cache hit.
        let mut w = app
            .connect_with(
                "/ws?widget=alpha-help",
                &[("Origin", "http://shop.alpha.test")],
            )
            .await
            .unwrap();
        let (s, _) = chat(&mut w, "w1", json!([{"role": "user", "content": "Hi"}]), 2).await;
        let want = tok
            .encode_chat(
                &[
                    Message::new("system", WIDGET_PROMPT),
                    Message::new("user", "Hi"),
                ],
                true,
            )
            .unwrap()
            .1;
        assert_eq!(s["prompt_tokens"].as_u64().unwrap() as usize, want.len());
        let pinned = tok
            .encode_chat(&[Message::new("system", WIDGET_PROMPT)], false)
            .unwrap()
            .1;
        assert!(pinned.len() >= 2 * BS, "{}", pinned.len());
        assert_eq!(
            s["cached_tokens"].as_u64().unwrap() as usize,
            expected_with_pin(&want, &pinned)
        );
        app.wait_idle().await;
    });
}
