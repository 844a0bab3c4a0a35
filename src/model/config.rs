//! The model's shape and position encoding, read from a Hugging Face `config.json` or from GGUF
//! metadata (`llama.*` keys), with the Llama 3 specifics: `rope_type: "llama3"` scaling (both the
//! hub's `rope_scaling` layout and transformers 5's `rope_parameters`), tied embeddings, and
//! `eos_token_id` given as an int or a list.
//!
//! A missing key never silently falls back to another model's value where that value changes the
//! numbers (a `rope_theta` of 10000 instead of 500000 moves Llama 3 logits by 5 and more): keys that
//! have a real default in transformers get it, the rest are an error naming the key.

use std::path::Path;

use serde_json::Value;

use crate::error::{EngineError, Result};

/// How rotary frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` ("linear" in transformers).
    Linear { factor: f64 },
    /// Meta's Llama 3.1 frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// Per-frequency divisors, as GGUF files store them in `rope_freqs.weight` (llama.cpp bakes
    /// Llama 3.1 scaling into that tensor at conversion).
    FreqFactors(Vec<f32>),
}

/// Shape and hyper-parameters of a Llama-architecture decoder.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    /// End-of-turn ids from config.json (merged with generation_config.json by the loader).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Number of query heads sharing one KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// What one token takes in the KV cache.
    pub fn kv_shape(&self) -> crate::kv_cache::KvShape {
        crate::kv_cache::KvShape {
            layers: self.num_layers,
            kv_dim: self.kv_dim(),
            heads: self.num_kv_heads,
        }
    }

    /// Checks the invariants the model code relies on; `path` names the file in the error.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(EngineError::bad_file(path, m));
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_layers == 0 {
            return bad(
                "num_attention_heads, num_key_value_heads and num_hidden_layers must be > 0".into(),
            );
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim must be even and > 0, got {}",
                self.head_dim
            ));
        }
        if self.hidden_size == 0 || self.vocab_size == 0 || self.intermediate_size == 0 {
            return bad("hidden_size, vocab_size and intermediate_size must be > 0".into());
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return bad(format!("rope_theta must be > 0, got {}", self.rope_theta));
        }
        if let RopeScaling::FreqFactors(f) = &self.rope_scaling {
            if f.len() != self.head_dim / 2 {
                return bad(format!(
                    "rope_freqs has {} entries, expected head_dim/2 = {}",
                    f.len(),
                    self.head_dim / 2
                ));
            }
        }
        Ok(())
    }

    /// Parses a Hugging Face `config.json` (LlamaForCausalLM / model_type llama).
    pub fn from_hf_json(path: &Path, json: &Value) -> Result<Self> {
        let err = |m: String| EngineError::bad_file(path, m);
        let arch = json
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .map(str::to_string);
        let model_type = json.get("model_type").and_then(Value::as_str).unwrap_or("");
        let is_llama = model_type == "llama" || arch.as_deref() == Some("LlamaForCausalLM");
        if !is_llama {
            return Err(EngineError::UnsupportedArchitecture {
                path: path.into(),
                arch: arch.unwrap_or_else(|| model_type.to_string()),
            });
        }
        let req = |k: &str| -> Result<usize> {
            json.get(k)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| err(format!("missing or non-integer key `{k}`")))
        };
        let hidden_size = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        let num_kv_heads = json
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .unwrap_or(num_heads);
        let head_dim = match json.get("head_dim") {
            Some(Value::Number(n)) => n
                .as_u64()
                .ok_or_else(|| err("`head_dim` is not an integer".into()))?
                as usize,
            _ => {
                if num_heads == 0 || hidden_size % num_heads != 0 {
                    return Err(err(format!(
                        "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"
                    )));
                }
                hidden_size / num_heads
            }
        };
        // transformers 5 nests theta and scaling in `rope_parameters`; the hub layout has
        // top-level `rope_theta` and `rope_scaling`.
        let rope_params = json.get("rope_parameters").filter(|v| v.is_object());
        let rope_theta = json
            .get("rope_theta")
            .and_then(Value::as_f64)
            .or_else(|| {
                rope_params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
            })
            .unwrap_or(10_000.0); // transformers' LlamaConfig default
        let scaling = json
            .get("rope_scaling")
            .filter(|v| v.is_object())
            .or(rope_params);
        let rope_scaling = match scaling {
            None => RopeScaling::None,
            Some(s) => parse_rope_scaling(s).map_err(err)?,
        };
        let eos_token_ids = parse_id_list(json.get("eos_token_id"));
        let cfg = ModelConfig {
            vocab_size: req("vocab_size")?,
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            num_layers: req("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: json
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: json
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(2048) as usize,
            tie_word_embeddings: json
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            bos_token_id: json
                .get("bos_token_id")
                .and_then(Value::as_u64)
                .map(|v| v as u32),
            eos_token_ids,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }
}

/// Reads `eos_token_id`-style values: an int, a list of ints, or absent.
pub fn parse_id_list(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

fn parse_rope_scaling(s: &Value) -> std::result::Result<RopeScaling, String> {
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let f = |k: &str| -> std::result::Result<f64, String> {
        s.get(k)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("rope scaling `{kind}` needs a numeric `{k}`"))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: f("factor")?,
        }),
        "llama3" => {
            let r = RopeScaling::Llama3 {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position_embeddings: f("original_max_position_embeddings")?,
            };
            if let RopeScaling::Llama3 {
                low_freq_factor,
                high_freq_factor,
                ..
            } = r
            {
                if high_freq_factor <= low_freq_factor {
                    return Err(
                        "rope scaling llama3 needs high_freq_factor > low_freq_factor".into(),
                    );
                }
            }
            Ok(r)
        }
        other => Err(format!(
            "unsupported rope_type `{other}` (supported: default, linear, llama3)"
        )),
    }
}

/// The inverse frequencies of RoPE after scaling, in f64: `theta^(-2i/d)` for `i < d/2`.
pub fn inv_freqs(cfg: &ModelConfig) -> Vec<f64> {
    let d = cfg.head_dim;
    let base: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64))
        .collect();
    match &cfg.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::FreqFactors(ff) => base.iter().zip(ff).map(|(f, d)| f / *d as f64).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&freq| {
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    if wavelen < high_wavelen {
                        freq
                    } else if wavelen > low_wavelen {
                        freq / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(extra: Value) -> Value {
        let mut v = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    }

    #[test]
    fn both_rope_layouts_parse_the_same() {
        let hub = tiny(
            serde_json::json!({"rope_theta": 500000.0, "rope_scaling": {"factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}}),
        );
        let v5 = tiny(
            serde_json::json!({"rope_parameters": {"factor": 8.0, "rope_theta": 500000.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}}),
        );
        let a = ModelConfig::from_hf_json(Path::new("a"), &hub).unwrap();
        let b = ModelConfig::from_hf_json(Path::new("b"), &v5).unwrap();
        assert_eq!(a.rope_theta, 500000.0);
        assert_eq!(b.rope_theta, 500000.0);
        assert_eq!(a.rope_scaling, b.rope_scaling);
        assert_eq!(inv_freqs(&a), inv_freqs(&b));
        assert_eq!(a.head_dim, 16);
    }

    #[test]
    fn eos_as_int_or_list() {
        assert_eq!(parse_id_list(Some(&serde_json::json!(5))), vec![5]);
        assert_eq!(parse_id_list(Some(&serde_json::json!([1, 2]))), vec![1, 2]);
        assert!(parse_id_list(None).is_empty());
    }

    #[test]
    fn unsupported_things_are_named() {
        let v = tiny(serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}));
        let e = ModelConfig::from_hf_json(Path::new("c.json"), &v)
            .unwrap_err()
            .to_string();
        assert!(e.contains("yarn") && e.contains("c.json"), "{e}");
        let v = serde_json::json!({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]});
        let e = ModelConfig::from_hf_json(Path::new("c.json"), &v)
            .unwrap_err()
            .to_string();
        assert!(e.contains("GPT2LMHeadModel"), "{e}");
        let v = tiny(serde_json::json!({"num_key_value_heads": 3}));
        let e = ModelConfig::from_hf_json(Path::new("c.json"), &v)
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let v = tiny(
            serde_json::json!({"rope_theta": 500000.0, "rope_scaling": {"factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}}),
        );
        let c = ModelConfig::from_hf_json(Path::new("a"), &v).unwrap();
        let mut plain = c.clone();
        plain.rope_scaling = RopeScaling::None;
        let (s, p) = (inv_freqs(&c), inv_freqs(&plain));
        assert_eq!(s[0], p[0]);
        assert!((s[7] - p[7] / 8.0).abs() < 1e-18);
    }
}
