//! The crate's top-level modules form layers: each may use only the modules below it, so there
//! is no import cycle. Read from the source (outside test modules), so a new `crate::` path that
//! climbs a layer fails here with the file that does it.

use std::collections::HashMap;
use std::path::Path;

/// Lowest first; a module may use any module in an earlier layer.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["files", "default_model", "sampler", "kv_cache"],
    &["model", "tokenizer"],
    &["engine", "protocol", "metrics"],
    &["generate", "settings"],
    &["server"],
    &["bench", "fuzz_harness"],
    &["soak"],
];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn modules_use_only_the_layers_below_them() {
    let layer: HashMap<&str, usize> = LAYERS
        .iter()
        .enumerate()
        .flat_map(|(i, l)| l.iter().map(move |m| (*m, i)))
        .collect();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut wrong = Vec::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        let top = rel.split('/').next().unwrap().trim_end_matches(".rs");
        if matches!(top, "lib" | "main") {
            continue;
        }
        let Some(&mine) = layer.get(top) else {
            wrong.push(format!("{rel}: module `{top}` is in no layer"));
            continue;
        };
        let text = std::fs::read_to_string(&f).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        for (i, _) in code.match_indices("crate::") {
            let name: String = code[i + 7..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            match layer.get(name.as_str()) {
                Some(&theirs) if name == top || theirs < mine => {}
                Some(_) => wrong.push(format!("{rel}: `{top}` uses `{name}`, a layer above")),
                None => wrong.push(format!("{rel}: `crate::{name}` is in no layer")),
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
