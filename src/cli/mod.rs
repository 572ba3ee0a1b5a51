//! The `kvbm` command-line tool (feature `cli`).

/// Entry point of the `kvbm` binary.
pub fn main() -> std::process::ExitCode {
    std::process::ExitCode::SUCCESS
}
