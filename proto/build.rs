//! Compiles `proto/tern.proto` and `proto/scheduler.proto` with protox, so building Tern needs no protoc.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fds = protox::compile(["proto/tern.proto", "proto/scheduler.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto/tern.proto");
    println!("cargo:rerun-if-changed=proto/scheduler.proto");
    Ok(())
}
