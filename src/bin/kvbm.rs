//! The `kvbm` command: see `kvbm --help`.

fn main() -> std::process::ExitCode {
    kvbm_connector::cli::main()
}
