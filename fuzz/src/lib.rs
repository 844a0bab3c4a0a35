//! The fuzz targets' shared setup: the tokenizer they run (the tiny Llama 3 fixture's, the real
//! Llama 3 vocabulary and chat template), unpacked once per process.

use std::path::Path;
use std::sync::OnceLock;

use llama_relay::tokenizer::TextTokenizer;

pub fn tokenizer() -> &'static TextTokenizer {
    static T: OnceLock<TextTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/llama3-tiny");
        let dir = std::env::temp_dir().join(format!("llama-relay-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        let packed = std::fs::read(fixtures.join("tokenizer.json.xz")).expect("the fixture");
        let mut json = Vec::new();
        std::io::Read::read_to_end(&mut xz2::read::XzDecoder::new(&packed[..]), &mut json)
            .expect("xz");
        std::fs::write(dir.join("tokenizer.json"), json).expect("write");
        std::fs::copy(
            fixtures.join("tokenizer_config.json"),
            dir.join("tokenizer_config.json"),
        )
        .expect("copy");
        let t = TextTokenizer::from_hf_dir(&dir, &[]).expect("the fixture tokenizer loads");
        let _ = std::fs::remove_dir_all(&dir);
        t
    })
}
