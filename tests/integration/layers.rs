//! The crate's top-level modules form layers: each may use only the modules below it, so there
//! is no import cycle. Inside `server/`, files name each other by `crate::server::` paths (no
//! `super::` outside tests) and those imports form no circle, file by file. Read from the source
//! (outside test modules), so a new path that climbs a layer or closes a circle fails here with
//! the files that do it.

use std::collections::HashMap;
use std::path::Path;

/// Lowest first; a module may use any module in an earlier layer.
const LAYERS: &[&[&str]] = &[
    &["error", "huge_pages"],
    &["files", "default_model", "sampler", "kv_cache"],
    &["model", "tokenizer"],
    &["engine", "metrics"],
    &["generate", "perplexity", "settings"],
    &["server"],
    &["fuzz_harness"],
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
        // The library's root and the binary's (there `crate::` is main.rs; the library is
        // `llama_relay::`): nothing here can climb the library's layers.
        if matches!(top, "lib" | "main") {
            continue;
        }
        let Some(&mine) = layer.get(top) else {
            wrong.push(format!("{rel}: module `{top}` is in no layer"));
            continue;
        };
        let text = std::fs::read_to_string(&f).unwrap();
        let code = outside_tests(&text);
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

/// A file's text before its test module.
fn outside_tests(text: &str) -> &str {
    text.split("#[cfg(test)]\nmod tests").next().unwrap()
}

/// The file that defines module `path` (`["server", "gate", "access"]`), if any.
fn module_file(src: &Path, path: &[String]) -> Option<std::path::PathBuf> {
    let rel = path.join("/");
    let flat = src.join(format!("{rel}.rs"));
    let dir = src.join(&rel).join("mod.rs");
    [flat, dir].into_iter().find(|p| p.exists())
}

/// The `crate::server::` paths a text names, braces expanded one level
/// (`crate::server::gate::{access, tenants::Identity}`), each as its segments.
fn server_paths(code: &str) -> Vec<Vec<String>> {
    let ident = |s: &str| -> Vec<String> {
        s.split("::")
            .map(|p| {
                p.trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|p| !p.is_empty())
            .collect()
    };
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::server::") {
        let rest = &code[i + "crate::".len()..];
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        let head = rest[..end].trim_end_matches(':');
        let base = ident(head);
        if rest[end..].starts_with('{') && rest[..end].ends_with("::") {
            let inner = &rest[end + 1..rest[end..].find('}').map_or(rest.len(), |j| end + j)];
            for item in inner.split(',') {
                let mut p = base.clone();
                p.extend(ident(item));
                out.push(p);
            }
        } else {
            out.push(base);
        }
    }
    out
}

#[test]
fn server_files_form_no_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src.join("server"), &mut files);
    let mut wrong = Vec::new();
    let mut edges: HashMap<std::path::PathBuf, Vec<std::path::PathBuf>> = HashMap::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let code = outside_tests(&text);
        let rel = f.strip_prefix(&src).unwrap().display().to_string();
        if code.contains("super::") {
            wrong.push(format!(
                "{rel}: names a sibling by `super::` (use its `crate::server::` path)"
            ));
        }
        for path in server_paths(code) {
            // The longest prefix of the path that is a module file.
            let target = (1..=path.len())
                .rev()
                .find_map(|n| module_file(&src, &path[..n]))
                .unwrap();
            if &target != f {
                edges.entry(f.clone()).or_default().push(target);
            }
        }
    }
    // Depth-first search for a back edge.
    fn visit(
        src: &Path,
        f: &std::path::PathBuf,
        edges: &HashMap<std::path::PathBuf, Vec<std::path::PathBuf>>,
        state: &mut HashMap<std::path::PathBuf, bool>,
        stack: &mut Vec<std::path::PathBuf>,
        circles: &mut Vec<String>,
    ) {
        match state.get(f) {
            Some(true) => return,
            Some(false) => {
                let at = stack.iter().position(|s| s == f).unwrap();
                let names: Vec<String> = stack[at..]
                    .iter()
                    .chain([f])
                    .map(|p| p.strip_prefix(src).unwrap().display().to_string())
                    .collect();
                circles.push(names.join(" -> "));
                return;
            }
            None => {}
        }
        state.insert(f.clone(), false);
        stack.push(f.clone());
        for t in edges.get(f).into_iter().flatten() {
            visit(src, t, edges, state, stack, circles);
        }
        stack.pop();
        state.insert(f.clone(), true);
    }
    let mut state = HashMap::new();
    let mut circles = Vec::new();
    for f in &files {
        visit(&src, f, &edges, &mut state, &mut Vec::new(), &mut circles);
    }
    wrong.extend(circles.into_iter().map(|c| format!("a circle: {c}")));
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
