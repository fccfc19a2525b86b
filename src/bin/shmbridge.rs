//! `shmbridge`: serve a reference engine, drive it with a random-policy client, and list,
//! inspect or clean up regions (the command line is `shmbridge::cli`).

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(shmbridge::cli::run(
        std::env::args_os(),
        &shmbridge::cli::Invocation::default(),
    ))
}
