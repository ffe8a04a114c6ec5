//! Compiles every `.proto` under the repository's `proto/` with protox (pure Rust, no protoc)
//! and generates prost messages plus tonic clients and servers from the descriptor set. The
//! encoded descriptor set is kept for gRPC server reflection.

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let proto_root = proto_root.canonicalize()?;
    println!("cargo:rerun-if-changed={}", proto_root.display());

    let mut files = Vec::new();
    collect_protos(&proto_root, &mut files)?;
    files.sort();
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }

    let fds = protox::compile(&files, [&proto_root])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("trellis_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;

    tonic_prost_build::configure()
        .include_file("trellis.rs")
        .emit_rerun_if_changed(false)
        .compile_fds(fds)?;
    Ok(())
}

fn collect_protos(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_protos(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}
