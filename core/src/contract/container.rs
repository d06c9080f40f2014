//! The contract as a container runs it: the command line and the environment of an engine
//! pod, and the way back from both to the contract through the engine's own parser.
//!
//! The form is the one pods have always had: the plan's shape (the model, its roots, the
//! strategy, dp, sp, slots and the address) on the command line, its sizes (the request
//! bounds, the device budget) and decisions (the decode site, the blocks kept) in the
//! environment. A value the engine's default already gives is left out where pods never
//! carried it (`--sp 1`, `--slots` of a plan that streams nothing, no kept blocks), so a
//! plan's pod template is what it was before those flags existed and an operator upgrade
//! rolls no pod.

use clap::{Args, Command, FromArgMatches};

use super::args::EngineContract;
use super::names::{
    ENV_DP, ENV_LISTEN, ENV_MODEL, ENV_MODEL_ROOTS, ENV_SLOTS, ENV_SP, ENV_STRATEGY, SERVE_COMMAND,
};
use super::values::{ResidentBlocks, SlotsChoice};
use crate::bounds;
use crate::decode::{ENV_DECODE, ENV_DECODE_BUDGET};

/// `layerwise serve` as far as the contract goes: the contract's arguments alone.
fn serve_command() -> Command {
    EngineContract::augment_args(Command::new(SERVE_COMMAND))
}

/// `--<long>` of `command`'s argument that reads `env`, if one does.
fn flag_of(command: &Command, env: &str) -> Option<String> {
    command
        .get_arguments()
        .find(|a| a.get_env().is_some_and(|e| e == env))
        .and_then(|a| a.get_long())
        .map(|long| format!("--{long}"))
}

impl EngineContract {
    /// The engine container's arguments: `serve`, then the plan's shape as flags.
    pub fn argv(&self) -> Vec<String> {
        let command = serve_command();
        let mut args = vec![SERVE_COMMAND.to_string()];
        let mut push = |env: &str, value: String| {
            let flag = flag_of(&command, env)
                .unwrap_or_else(|| panic!("no flag of `layerwise serve` reads {env}"));
            args.extend([flag, value]);
        };
        push(ENV_MODEL, self.run.model.display().to_string());
        if !self.roots.model_roots.is_empty() {
            push(ENV_MODEL_ROOTS, join(&self.roots.model_roots));
        }
        push(ENV_STRATEGY, self.strategy.to_string());
        push(ENV_DP, self.run.dp.to_string());
        // An engine without sequence parallelism then refuses to start rather than run one
        // rank per request against a budget sized for a share of the activations.
        if self.run.sp != 1 {
            push(ENV_SP, self.run.sp.to_string());
        }
        if self.strategy.streams() || self.run.slots != SlotsChoice::default() {
            push(ENV_SLOTS, self.run.slots.to_string());
        }
        push(ENV_LISTEN, self.listen.to_string());
        args
    }

    /// The engine container's environment: the request bounds, the device budget and the
    /// plan's decisions, by the names the engine's flags read.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let b = &self.bounds;
        let mut env: Vec<(&'static str, String)> = [
            (bounds::ENV_MAX_WIDTH, b.max_width),
            (bounds::ENV_MAX_HEIGHT, b.max_height),
            (bounds::ENV_MAX_FRAMES, b.max_frames),
        ]
        .into_iter()
        .filter_map(|(name, v)| Some((name, v?.to_string())))
        .collect();
        env.extend([
            (bounds::ENV_MAX_STEPS, b.max_steps.to_string()),
            (bounds::ENV_MAX_N, b.max_n.to_string()),
            (bounds::ENV_GUIDANCE_ALLOWED, b.guidance_allowed.to_string()),
            (
                bounds::ENV_MAX_PROMPT_TOKENS,
                b.max_prompt_tokens.to_string(),
            ),
        ]);
        if let Some(mib) = self.run.device_memory_mib {
            env.push((bounds::ENV_DEVICE_MEMORY_MIB, mib.to_string()));
        }
        env.push((
            bounds::ENV_DEVICE_OVERHEAD_MIB,
            self.run.device_overhead_mib.to_string(),
        ));
        env.push((ENV_DECODE, self.decode.to_string()));
        if let Some(budget) = self.decode_budget {
            env.push((ENV_DECODE_BUDGET, budget.to_string()));
        }
        if !self.run.resident_components.is_empty() {
            env.push((
                bounds::ENV_RESIDENT_COMPONENTS,
                self.run.resident_components.join(","),
            ));
        }
        if self.kept.resident_blocks != ResidentBlocks::default() {
            env.push((
                bounds::ENV_RESIDENT_BLOCKS,
                self.kept.resident_blocks.to_string(),
            ));
        }
        if !self.kept.resident_blocks_by_component.0.is_empty() {
            env.push((
                bounds::ENV_RESIDENT_BLOCKS_BY_COMPONENT,
                self.kept.resident_blocks_by_component.to_string(),
            ));
        }
        env
    }
}

/// Paths in the comma-separated form `--model-roots` reads.
fn join(paths: &[std::path::PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The contract a container with `argv` (from `serve` on) and `env` runs, read by the
/// engine's own arguments: each entry of `env` that an argument reads becomes that
/// argument's flag, ahead of `argv`, whose flags win as they do over the environment.
/// Entries no argument reads (the job key, the pod's IP, a spec's own) are left out. The
/// process environment is not read.
pub fn parse_container(
    argv: &[String],
    env: &[(String, String)],
) -> Result<EngineContract, clap::Error> {
    let command = serve_command().args_override_self(true);
    let flags: Vec<String> = env
        .iter()
        .filter_map(|(name, value)| Some([flag_of(&command, name)?, value.clone()]))
        .flatten()
        .collect();
    let command = command.mut_args(|a| a.env(None));
    let (bin, rest) = argv
        .split_first()
        .map_or((SERVE_COMMAND, &[][..]), |(b, r)| (b.as_str(), r));
    let matches = command.try_get_matches_from(
        std::iter::once(bin.to_string())
            .chain(flags)
            .chain(rest.iter().cloned()),
    )?;
    EngineContract::from_arg_matches(&matches)
}
