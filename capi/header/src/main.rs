//! Writes `include/shmbridge.h` from the `capi` crate with cbindgen (`capi/cbindgen.toml`),
//! or with `--check` exits 1 when the committed header is not what cbindgen produces now.
//!
//!     cargo run -p shmbridge-header            regenerate the committed header
//!     cargo run -p shmbridge-header -- --check CI: fail if it is out of date

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let check = match args.as_slice() {
        [] => false,
        [a] if a == "--check" => true,
        _ => {
            eprintln!("usage: cargo run -p shmbridge-header [-- --check]");
            return ExitCode::from(2);
        }
    };
    let capi = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let header = capi.join("../include/shmbridge.h");
    let config = match cbindgen::Config::from_file(capi.join("cbindgen.toml")) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: capi/cbindgen.toml: {e}");
            return ExitCode::FAILURE;
        }
    };
    let bindings = match cbindgen::Builder::new()
        .with_crate(&capi)
        .with_config(config)
        .generate()
    {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: cbindgen could not parse capi/: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let committed = std::fs::read(&header).unwrap_or_default();
    if check {
        if committed == generated {
            println!("include/shmbridge.h is up to date with capi/src");
            return ExitCode::SUCCESS;
        }
        eprintln!(
            "error: include/shmbridge.h is not what cbindgen generates from capi/src; \
             run: cargo run -p shmbridge-header"
        );
        return ExitCode::FAILURE;
    }
    if let Err(e) = std::fs::write(&header, &generated) {
        eprintln!("error: writing {}: {e}", header.display());
        return ExitCode::FAILURE;
    }
    println!("wrote include/shmbridge.h");
    ExitCode::SUCCESS
}
