//! `kvroute-config render [--istio] [--module native|wasm] [--wasm PATH]
//! FILE`: prints the Envoy bootstrap (or the Istio manifests) for a
//! deployment file; errors name the file and the field and exit with
//! status 1.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvroute_config::{istio, Deployment, ModuleKind, Target};

#[derive(Parser)]
#[command(
    name = "kvroute-config",
    about = "Renders kvroute's Envoy bootstrap or Istio manifests from one deployment file"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the Envoy bootstrap (default) or the Istio manifests.
    Render {
        /// The deployment file (YAML or JSON).
        file: PathBuf,
        /// Render the Istio manifests instead of a plain Envoy bootstrap.
        #[arg(long)]
        istio: bool,
        /// The kvroute build, overriding the file's `envoy.module`: the
        /// dynamic module (`native`) or kvroute.wasm (`wasm`). Istio always
        /// runs the wasm build.
        #[arg(long, value_enum)]
        module: Option<ModuleArg>,
        /// kvroute.wasm, overriding the file's `envoy.wasm` (relative to
        /// the working directory); renders the wasm build.
        #[arg(long)]
        wasm: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ModuleArg {
    Native,
    Wasm,
}

fn main() -> ExitCode {
    let Command::Render {
        file,
        istio,
        module,
        wasm,
    } = Cli::parse().command;
    let target = if istio { Target::Istio } else { Target::Envoy };
    let rendered = Deployment::load(&file, target).and_then(|mut deployment| {
        match module {
            Some(ModuleArg::Native) => deployment.envoy.module = ModuleKind::Native,
            Some(ModuleArg::Wasm) => deployment.envoy.module = ModuleKind::Wasm,
            None => {}
        }
        if let Some(wasm) = &wasm {
            deployment.set_wasm(wasm);
        }
        if istio {
            istio::render(&deployment)
        } else {
            // Rendering for another machine or a container is legitimate,
            // but a new user's missing build is the usual reason.
            if deployment.envoy.module == ModuleKind::Native {
                eprintln!(
                    "kvroute-config: Envoy loads libkvroute.so (`make native`: target/native/) from the directory in its ENVOY_DYNAMIC_MODULES_SEARCH_PATH"
                );
            } else if !deployment.envoy.wasm.exists() {
                eprintln!(
                    "kvroute-config: warning: {} does not exist here (`make wasm` builds it)",
                    deployment.envoy.wasm.display()
                );
            }
            Ok(deployment.envoy_bootstrap())
        }
    });
    match rendered {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvroute-config: {e}");
            ExitCode::FAILURE
        }
    }
}
