//! The server's side of the settings: who may connect, the session and batcher configurations,
//! and the checks of the `[server]` and `[[tenants]]` values. Here rather than in `settings` so
//! that the settings module (plain values read from the config file) depends on nothing above it.

use crate::error::Result;
use crate::settings::{invalid, Settings};

impl Settings {
    /// The `[server]` keys that decide who may connect.
    pub fn access(&self) -> crate::server::gate::access::AccessSettings {
        let s = &self.server;
        crate::server::gate::access::AccessSettings {
            allow_anonymous: s.allow_anonymous,
            public_origins: s.public_origins.clone(),
            allowed_hosts: s.allowed_hosts.clone(),
            metrics_token: s.metrics_token.clone(),
        }
    }

    /// Checks the server-side values (the engine's are checked by `engine_options`).
    pub fn validate_server(&self) -> Result<()> {
        crate::server::gate::tenants::Tenants::new(&self.tenants)?;
        self.access().validate()?;
        let s = &self.server;
        if s.admin_host.parse::<std::net::IpAddr>().is_err() {
            return Err(invalid(
                "server.admin_host",
                format!("{:?}", s.admin_host),
                "an IP address such as \"127.0.0.1\"",
            ));
        }
        if s.host.parse::<std::net::IpAddr>().is_err() && s.host != "localhost" {
            return Err(invalid(
                "server.host",
                format!("{:?}", s.host),
                "an IP address such as \"127.0.0.1\" or \"0.0.0.0\"",
            ));
        }
        if s.workers > 64 {
            return Err(invalid(
                "server.workers",
                s.workers,
                "0 (one per core) to 64",
            ));
        }
        if s.max_connections == 0 {
            return Err(invalid(
                "server.max_connections",
                s.max_connections,
                "1 or more",
            ));
        }
        if s.max_connections_per_address == 0 {
            return Err(invalid(
                "server.max_connections_per_address",
                s.max_connections_per_address,
                "1 or more",
            ));
        }
        if let Some(t) = self.tenants.iter().find(|t| t.max_connections == Some(0)) {
            return Err(invalid(
                &format!("tenants.{}.max_connections", t.name),
                0,
                "1 or more, or unset",
            ));
        }
        if s.heartbeat_s == 0 || s.client_timeout_s <= s.heartbeat_s {
            return Err(invalid(
                "server.client_timeout_s",
                s.client_timeout_s,
                "more than server.heartbeat_s, which must be > 0",
            ));
        }
        if !s.conversation_secret.is_empty() && s.conversation_secret.len() < 32 {
            return Err(invalid(
                "server.conversation_secret",
                format!("({} bytes)", s.conversation_secret.len()),
                "empty (a random one per process) or at least 32 bytes",
            ));
        }
        if s.write_timeout_s < 2 * s.heartbeat_s {
            return Err(invalid(
                "server.write_timeout_s",
                s.write_timeout_s,
                "at least twice server.heartbeat_s (a reading client is polled at every heartbeat)",
            ));
        }
        if s.send_buffer_kib != 0 && !(4..=65536).contains(&s.send_buffer_kib) {
            return Err(invalid(
                "server.send_buffer_kib",
                s.send_buffer_kib,
                "0 (the kernel's autotuning) or 4 to 65536",
            ));
        }
        if s.max_queued_frames < 16 {
            return Err(invalid(
                "server.max_queued_frames",
                s.max_queued_frames,
                "16 or more",
            ));
        }
        let c = &self.scheduler;
        if c.max_running == 0 || c.max_running > 1024 {
            return Err(invalid("scheduler.max_running", c.max_running, "1 to 1024"));
        }
        if c.step_tokens < c.max_running {
            return Err(invalid(
                "scheduler.step_tokens",
                c.step_tokens,
                "at least scheduler.max_running (every running sequence decodes one token a step)",
            ));
        }
        if c.max_waiting > 100_000 {
            return Err(invalid(
                "scheduler.max_waiting",
                c.max_waiting,
                "0 to 100000",
            ));
        }
        if c.itl_target_ms > 60_000 {
            return Err(invalid(
                "scheduler.itl_target_ms",
                c.itl_target_ms,
                "0 (off) to 60000",
            ));
        }
        if !["auto", "off"].contains(&c.speculation.as_str()) {
            return Err(invalid(
                "scheduler.speculation",
                format!("{:?}", c.speculation),
                "\"auto\" or \"off\"",
            ));
        }
        if !(1..=16).contains(&c.speculate_tokens) {
            return Err(invalid(
                "scheduler.speculate_tokens",
                c.speculate_tokens,
                "1 to 16",
            ));
        }
        if c.speculate_min_ngram == 0 || c.speculate_min_ngram > c.speculate_max_ngram {
            return Err(invalid(
                "scheduler.speculate_min_ngram",
                c.speculate_min_ngram,
                "1 to scheduler.speculate_max_ngram",
            ));
        }
        if c.speculate_max_ngram > 16 {
            return Err(invalid(
                "scheduler.speculate_max_ngram",
                c.speculate_max_ngram,
                "scheduler.speculate_min_ngram to 16",
            ));
        }
        if c.ttft_target_ms > 60_000 {
            return Err(invalid(
                "scheduler.ttft_target_ms",
                c.ttft_target_ms,
                "0 (off) to 60000",
            ));
        }
        let sp = &self.sampling;
        self.sampling_defaults()
            .check()
            .map_err(|e| invalid(&format!("sampling.{}", e.field), e.given, e.allowed))?;
        if sp.max_tokens == 0 || sp.max_tokens > self.limits.max_tokens {
            return Err(invalid(
                "sampling.max_tokens",
                sp.max_tokens,
                "1 to limits.max_tokens",
            ));
        }
        let l = &self.limits;
        if l.max_frame_bytes < 1024 || l.max_frame_bytes > 64 << 20 {
            return Err(invalid(
                "limits.max_frame_bytes",
                l.max_frame_bytes,
                "1024 to 67108864",
            ));
        }
        for (key, rate, burst) in [
            ("limits.frames_per_s", l.frames_per_s, l.frame_burst),
            (
                "limits.rejected_frames_per_s",
                l.rejected_frames_per_s,
                l.rejected_frame_burst,
            ),
        ] {
            if !(rate > 0.0 && rate.is_finite()) || burst == 0 {
                return Err(invalid(
                    key,
                    format!("{rate} (burst {burst})"),
                    "a rate above 0 with a burst of at least 1",
                ));
            }
        }
        self.overflow()?;
        if l.max_stop_strings > 16 {
            return Err(invalid(
                "limits.max_stop_strings",
                l.max_stop_strings,
                "0 to 16",
            ));
        }
        Ok(())
    }

    /// The server's overflow policy (`limits.overflow`, `limits.overflow_retention`).
    pub fn overflow(&self) -> Result<crate::server::request::overflow::Overflow> {
        use crate::server::request::overflow::Overflow;
        let l = &self.limits;
        let retention = Overflow::check_retention(l.overflow_retention).map_err(|_| {
            invalid(
                "limits.overflow_retention",
                l.overflow_retention,
                "above 0 and at most 1",
            )
        })?;
        Overflow::parse(&l.overflow, retention).map_err(|_| {
            invalid(
                "limits.overflow",
                format!("{:?}", l.overflow),
                "\"error\" or \"drop_oldest\"",
            )
        })
    }

    /// Keyless clients' share of the scheduler.
    pub fn anonymous_quota(&self) -> crate::engine::Quota {
        let c = &self.scheduler;
        crate::engine::Quota {
            max_running: (c.anonymous_max_running > 0).then_some(c.anonymous_max_running),
            max_waiting: (c.anonymous_max_waiting > 0).then_some(c.anonymous_max_waiting),
        }
    }

    pub fn session_config(&self) -> crate::server::SessionConfig {
        let sp = &self.sampling;
        crate::server::SessionConfig {
            limits: crate::server::request::Limits {
                max_context: self.engine.max_context,
                max_tokens: self.limits.max_tokens,
                max_frame_bytes: self.limits.max_frame_bytes,
                max_messages: self.limits.max_messages,
                max_message_chars: self.limits.max_message_chars,
                max_stop_strings: self.limits.max_stop_strings,
                max_stop_chars: self.limits.max_stop_chars,
                max_schema_bytes: self.limits.max_schema_bytes,
                max_id_chars: 128,
                tool_timeout_s: self.limits.tool_timeout_s,
                max_tool_calls: self.limits.max_tool_calls,
                overflow_retention: self.limits.overflow_retention,
                frames_per_s: self.limits.frames_per_s,
                frame_burst: self.limits.frame_burst,
                rejected_frames_per_s: self.limits.rejected_frames_per_s,
                rejected_frame_burst: self.limits.rejected_frame_burst,
            },
            sampling: self.sampling_defaults(),
            default_max_tokens: sp.max_tokens,
            heartbeat: std::time::Duration::from_secs(self.server.heartbeat_s),
            client_timeout: std::time::Duration::from_secs(self.server.client_timeout_s),
            write_timeout: std::time::Duration::from_secs(self.server.write_timeout_s),
            resume_grace: std::time::Duration::from_secs(self.server.resume_grace_s),
        }
    }

    pub fn batcher_config(&self) -> crate::server::batcher::BatcherConfig {
        crate::server::batcher::BatcherConfig {
            scheduler: crate::engine::scheduler::SchedulerConfig {
                max_running: self.scheduler.max_running,
                max_waiting: self.scheduler.max_waiting,
                step_tokens: self.scheduler.step_tokens,
                itl_target: (self.scheduler.itl_target_ms > 0)
                    .then(|| std::time::Duration::from_millis(self.scheduler.itl_target_ms)),
                ttft_target: (self.scheduler.ttft_target_ms > 0)
                    .then(|| std::time::Duration::from_millis(self.scheduler.ttft_target_ms)),
            },
            kv: crate::kv_cache::manager::KvConfig {
                block_size: self.engine.block_size,
                prefix_caching: self.cache.prefix_caching,
                lease_tokens_per_session: self.cache.lease_tokens_per_session,
                lease_tokens_total: self.cache.lease_tokens_total,
                context_shift: self.cache.context_shift,
            },
            lease_grace: std::time::Duration::from_secs(self.cache.lease_grace_s),
            speculation: (self.scheduler.speculation == "auto").then_some(
                crate::engine::core::Speculation {
                    max_drafts: self.scheduler.speculate_tokens,
                    min_ngram: self.scheduler.speculate_min_ngram,
                    max_ngram: self.scheduler.speculate_max_ngram,
                },
            ),
            max_context: self.engine.max_context,
            max_queued_frames: self.server.max_queued_frames,
            on_failure: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The speculation settings: a bad one is refused naming its key and what is allowed; "off"
    /// gives the batcher no speculation, "auto" the configured lengths.
    #[test]
    fn speculation_settings_are_checked_and_reach_the_batcher() {
        let bad = |f: &dyn Fn(&mut Settings)| {
            let mut s = Settings::load(None).unwrap();
            f(&mut s);
            s.validate_server().unwrap_err().to_string()
        };
        let e = bad(&|s| s.scheduler.speculation = "sometimes".into());
        assert!(
            e.contains("scheduler.speculation") && e.contains("\"auto\" or \"off\""),
            "{e}"
        );
        let e = bad(&|s| s.scheduler.speculate_tokens = 0);
        assert!(
            e.contains("scheduler.speculate_tokens") && e.contains("1 to 16"),
            "{e}"
        );
        let e = bad(&|s| s.scheduler.speculate_min_ngram = 5);
        assert!(e.contains("scheduler.speculate_min_ngram"), "{e}");
        let mut s = Settings::load(None).unwrap();
        s.validate_server().unwrap();
        assert_eq!(
            s.batcher_config().speculation,
            Some(crate::engine::core::Speculation {
                max_drafts: 8,
                min_ngram: 2,
                max_ngram: 4
            }),
            "the default"
        );
        s.scheduler.speculation = "off".into();
        assert_eq!(s.batcher_config().speculation, None);
    }

    /// The draft source and the draft model agree or the settings are refused, naming the key
    /// and what would do; "model" gives the draft model the model's options with its own cache;
    /// speculation "off" loads no draft model.
    #[test]
    fn draft_model_settings_are_checked() {
        let with = |f: &dyn Fn(&mut Settings)| {
            let mut s = Settings::load(None).unwrap();
            f(&mut s);
            s.draft_options()
        };
        let err = |f: &dyn Fn(&mut Settings)| with(f).unwrap_err().to_string();
        assert_eq!(with(&|_| {}).unwrap().map(|o| o.model), None, "the default");
        let e = err(&|s| s.model.draft = "/m/draft.gguf".into());
        assert!(e.contains("model.draft") && e.contains("\"model\""), "{e}");
        let e = err(&|s| s.scheduler.draft_source = "model".into());
        assert!(
            e.contains("scheduler.draft_source") && e.contains("model.draft"),
            "{e}"
        );
        let e = err(&|s| s.scheduler.draft_source = "eagle".into());
        assert!(
            e.contains("scheduler.draft_source") && e.contains("\"ngram\" or \"model\""),
            "{e}"
        );
        let model = |s: &mut Settings| {
            s.model.draft = "/m/draft.gguf".into();
            s.scheduler.draft_source = "model".into();
            s.engine.draft_cache_mib = 32;
        };
        let e = err(&|s| {
            model(s);
            s.engine.draft_cache_mib = 0;
        });
        assert!(e.contains("engine.draft_cache_mib"), "{e}");
        let o = with(&model).unwrap().expect("a draft model");
        assert_eq!(o.model, Some(std::path::PathBuf::from("/m/draft.gguf")));
        assert_eq!(o.cache, crate::engine::loaded::CacheSize::Mib(32));
        assert_eq!(
            o.kv_dtype,
            Settings::load(None)
                .unwrap()
                .engine_options()
                .unwrap()
                .kv_dtype
        );
        let off = with(&|s| {
            model(s);
            s.scheduler.speculation = "off".into();
        });
        assert!(off.unwrap().is_none(), "no drafts, no draft model");
    }
}
