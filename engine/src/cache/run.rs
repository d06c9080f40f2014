//! One request's step cache over its denoising passes: which blocks of a pass run, and
//! what stands in for the ones that do not. A pass batches the guidance rows (prompt,
//! negative prompt) that diffusers runs as two forwards in two cache contexts, so each
//! row keeps its own state and decision; the blocks run when any row needs them (a row
//! that skips takes its cached result over what was computed for the others, which
//! does not depend on it), and are skipped, weights and all, when none does.

use std::collections::BTreeMap;

use candle_core::Tensor;

use super::config::{CacheKind, StepCache};
use super::sea::{self, SeaGate, SeaParams};
use super::state::{self, MagParams, RowState};
use crate::execution::need::Need;
use crate::{Error, Result};

/// What a request's cache did, for its output and the counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CacheReport {
    pub kind: Option<CacheKind>,
    /// Per denoising step, per guidance row: whether the row's blocks ran.
    pub computed: Vec<Vec<bool>>,
    /// MagCache calibration: the ratios recorded, per transformer group and row, in the
    /// order the calibrations completed, then those still open at the end.
    pub calibration: Vec<Vec<f64>>,
}

impl CacheReport {
    /// One line for a person: the steps each guidance row computed, and a calibration's
    /// ratios as the setting that uses them.
    pub fn summary(&self) -> String {
        let kind = self.kind.map_or("none", CacheKind::name);
        let rows = self.computed.first().map_or(0, Vec::len);
        let ran: Vec<String> = (0..rows)
            .map(|r| {
                let n = self.computed.iter().filter(|s| s[r]).count();
                format!("{n} of {}", self.computed.len())
            })
            .collect();
        let mut line = format!(
            "cache {kind}: steps computed per guidance row {}",
            ran.join(", ")
        );
        if let Some(ratios) = self.calibration.first() {
            let setting = serde_json::json!({ "kind": "mag", "ratios": ratios });
            line += &format!("; calibrated: --cache '{setting}'");
        }
        line
    }
}

/// The pass in progress.
struct Pass {
    group: usize,
    /// The block stack's input (MagCache's head input, First-Block Cache's block-0 input).
    input: Tensor,
    /// Output of block 0 (First-Block Cache).
    head: Option<Tensor>,
    /// Per row: its blocks run.
    compute: Vec<bool>,
}

/// A request's cache: its setting, each transformer group's row states, the pass in
/// progress and the report.
pub struct StepCacheRun {
    cfg: StepCache,
    mag: Option<MagParams>,
    sea: Option<SeaParams>,
    /// SeaCache's gate per transformer group, shared by the group's rows.
    gates: BTreeMap<usize, SeaGate>,
    steps: usize,
    states: BTreeMap<usize, Vec<RowState>>,
    pass: Option<Pass>,
    report: CacheReport,
}

impl StepCacheRun {
    /// The cache for a request of `steps` steps whose sequence is split `split` ways
    /// (a decision that reads the whole sequence is refused when it is split).
    pub fn new(cfg: &StepCache, steps: usize, split: usize) -> Result<StepCacheRun> {
        if cfg.reads_whole_sequence() && split > 1 {
            return Err(Error::invalid(
                "cache",
                format!(
                    "`{}` reads the whole sequence at every step; with sp > 1 it is split over \
                     {split} ranks",
                    cfg.kind()
                ),
            ));
        }
        let mag = match cfg {
            StepCache::Mag {
                threshold,
                max_skip_steps,
                retention_ratio,
                ratios,
                calibrate,
            } => Some(MagParams::new(
                *threshold,
                *max_skip_steps,
                *retention_ratio,
                ratios.as_deref(),
                *calibrate,
                steps,
            )),
            _ => None,
        };
        let sea = match *cfg {
            StepCache::Sea {
                threshold,
                residual_order,
                retention_steps,
                cache_end_steps,
                max_consecutive_cached,
                power_exp,
            } => Some(SeaParams {
                threshold,
                residual_order,
                retention_steps,
                cache_end_steps,
                max_consecutive_cached,
                power_exp,
            }),
            _ => None,
        };
        Ok(StepCacheRun {
            cfg: cfg.clone(),
            mag,
            sea,
            gates: BTreeMap::new(),
            steps,
            states: BTreeMap::new(),
            pass: None,
            report: CacheReport {
                kind: Some(cfg.kind()),
                ..CacheReport::default()
            },
        })
    }

    /// Whether the cache decides from the step's latents before its pass ([`Self::gate`]):
    /// SeaCache.
    pub fn gates_ahead(&self) -> bool {
        self.sea.is_some()
    }

    /// Whether the cached residual ends after the transformer's final norm rather than
    /// after its last block: SeaCache, as diffusers cuts it on Cosmos3 (the only family it
    /// applies it to with a norm boundary).
    pub fn post_norm(&self) -> bool {
        self.sea.is_some()
    }

    /// SeaCache's decision for step `step` over `group`, from the latents [C, T, H, W] the
    /// step reads and its sigma; taken as soon as they are known, so the prefetcher reads
    /// it before the pass.
    pub fn gate(&mut self, group: usize, step: usize, latents: &Tensor, sigma: f64) -> Result<()> {
        let p = self
            .sea
            .ok_or_else(|| Error::bug("cache: a gate for a cache without one"))?;
        let indicator = sea::indicator(latents, sigma, p.power_exp)?;
        let has_history = self
            .states
            .get(&group)
            .is_some_and(|rows| rows.iter().all(|r| !r.sea.is_empty()));
        self.gates.entry(group).or_default().resolve(
            &p,
            step,
            self.steps,
            indicator,
            has_history,
        )?;
        Ok(())
    }

    /// The gated decision pending for `group`'s next pass.
    fn gated(&self, group: usize) -> Option<(usize, bool)> {
        self.gates.get(&group).and_then(|g| g.pending)
    }

    /// Before a denoising pass over `group`'s blocks, with their input `x` [rows, ..]:
    /// the decisions known before any block runs.
    pub fn begin(&mut self, group: usize, x: &Tensor) -> Result<()> {
        let rows = x.dim(0)?;
        let gated = self.gated(group);
        let states = self.states.entry(group).or_insert_with(|| {
            std::iter::repeat_with(RowState::default)
                .take(rows)
                .collect()
        });
        if states.len() != rows {
            return Err(Error::bug(format!(
                "cache: {rows} rows in a pass over group {group}, {} before",
                states.len()
            )));
        }
        if self.sea.is_some() && gated.is_none() {
            return Err(Error::bug(format!(
                "seacache: a pass over group {group} that was not gated"
            )));
        }
        let compute = states
            .iter_mut()
            .map(|s| match &self.cfg {
                StepCache::FirstBlock { .. } => true,
                StepCache::Sea { .. } => gated.is_none_or(|(_, c)| c),
                StepCache::Mag { .. } => self.mag.as_ref().expect("mag").should_compute(s),
                StepCache::Taylorseer {
                    cache_interval,
                    disable_cache_before_step,
                    disable_cache_after_step,
                    ..
                } => state::taylor_should_compute(
                    s,
                    *cache_interval,
                    *disable_cache_before_step,
                    *disable_cache_after_step,
                ),
            })
            .collect();
        self.pass = Some(Pass {
            group,
            input: x.clone(),
            head: None,
            compute,
        });
        Ok(())
    }

    /// Whether block `index` of the pass runs (for some row).
    pub fn runs(&self, index: usize) -> bool {
        match &self.pass {
            None => true,
            Some(p) => {
                (index == 0 && matches!(self.cfg, StepCache::FirstBlock { .. }))
                    || p.compute.iter().any(|&c| c)
            }
        }
    }

    /// After block `index` ran, with the hidden states `x` it left: First-Block Cache
    /// decides after block 0.
    pub fn after_block(&mut self, index: usize, x: &Tensor) -> Result<()> {
        let StepCache::FirstBlock { threshold } = self.cfg else {
            return Ok(());
        };
        if index != 0 {
            return Ok(());
        }
        let p = self.pass.as_mut().ok_or_else(no_pass)?;
        let states = self.states.get_mut(&p.group).expect("begun");
        for (r, s) in states.iter_mut().enumerate() {
            let residual = (x.narrow(0, r, 1)? - p.input.narrow(0, r, 1)?)?;
            let compute =
                state::fbc_should_compute(s.head_residual.as_ref(), &residual, threshold)?;
            p.compute[r] = compute;
            if compute {
                s.head_residual = Some(residual);
            }
        }
        p.head = Some(x.clone());
        Ok(())
    }

    /// Which blocks this request computes in its pass over `group` that comes `ahead`
    /// passes over that group from now (0: the next one), by the schedule alone.
    pub fn need(&self, group: usize, ahead: usize) -> Need {
        // A group not begun yet: its rows start from the same state.
        let fresh = [RowState::default()];
        let states = self.states.get(&group).map_or(&fresh[..], |s| &s[..]);
        let any = |f: &dyn Fn(&RowState) -> bool| states.iter().any(f);
        let computes = match &self.cfg {
            StepCache::FirstBlock { .. } => {
                return if ahead == 0 && any(&|s| s.head_residual.is_none()) {
                    Need::All
                } else {
                    Need::Head
                };
            }
            StepCache::Sea { .. } => match ahead {
                0 => self.gated(group).is_none_or(|(_, c)| c),
                1 => self
                    .gates
                    .get(&group)
                    .is_none_or(|g| g.guess_next(self.sea.as_ref().expect("sea"), self.steps)),
                _ => true,
            },
            StepCache::Mag { .. } => {
                let mag = self.mag.as_ref().expect("mag");
                any(&|s| mag.peek(s, ahead))
            }
            StepCache::Taylorseer {
                cache_interval,
                disable_cache_before_step,
                disable_cache_after_step,
                ..
            } => any(&|s| {
                state::taylor_schedule(
                    s.current_step + 1 + ahead as i64,
                    *cache_interval,
                    *disable_cache_before_step,
                    *disable_cache_after_step,
                )
            }),
        };
        if computes {
            Need::All
        } else {
            Need::Nothing
        }
    }

    /// After the pass's blocks: each row that ran them records its residual, each that
    /// did not takes its cached one over `x`.
    pub fn end_blocks(&mut self, x: &mut Tensor) -> Result<()> {
        let p = self.pass.as_ref().ok_or_else(no_pass)?;
        let states = self.states.get_mut(&p.group).expect("begun");
        let gated = self.gates.get_mut(&p.group).and_then(|g| g.pending.take());
        let mut rows = Vec::with_capacity(states.len());
        let mut changed = false;
        for (r, s) in states.iter_mut().enumerate() {
            let row = x.narrow(0, r, 1)?;
            let compute = p.compute[r];
            rows.push(match &self.cfg {
                StepCache::FirstBlock { .. } => {
                    let head = p.head.as_ref().ok_or_else(no_pass)?.narrow(0, r, 1)?;
                    if compute {
                        s.tail_residual = Some((&row - &head)?);
                        row
                    } else {
                        changed = true;
                        let tail = s.tail_residual.as_ref().ok_or_else(no_pass)?;
                        (tail + head)?
                    }
                }
                StepCache::Mag { .. } => {
                    let mag = self.mag.as_ref().expect("mag");
                    let input = p.input.narrow(0, r, 1)?;
                    let row = if compute {
                        mag.record(s, (&row - &input)?)?;
                        row
                    } else {
                        changed = true;
                        let prev = s.previous_residual.as_ref().ok_or_else(no_pass)?;
                        (input + prev)?
                    };
                    if let Some(done) = mag.advance(s) {
                        self.report.calibration.push(done);
                    }
                    row
                }
                StepCache::Sea { .. } => {
                    let sea = self.sea.as_ref().expect("sea");
                    let (step, _) = gated.ok_or_else(no_pass)?;
                    let input = p.input.narrow(0, r, 1)?;
                    if compute {
                        s.sea.record(sea, step, (&row - &input)?);
                        row
                    } else {
                        changed = true;
                        (input + s.sea.predict(sea, step)?)?
                    }
                }
                StepCache::Taylorseer { .. } => row,
            });
        }
        if changed {
            *x = Tensor::cat(&rows, 0)?;
        }
        if p.compute.iter().any(|&c| c) {
            if let Some(g) = self.gates.get_mut(&p.group) {
                g.computed();
            }
        }
        self.report.computed.push(p.compute.clone());
        Ok(())
    }

    /// The transformer's output for the step: TaylorSeer records it on the rows that
    /// ran and predicts it on the others; the other caches pass it through.
    pub fn output(&mut self, out: Tensor) -> Result<Tensor> {
        let p = self.pass.take().ok_or_else(no_pass)?;
        let StepCache::Taylorseer { max_order, .. } = self.cfg else {
            return Ok(out);
        };
        let states = self.states.get_mut(&p.group).expect("begun");
        let mut rows = Vec::with_capacity(states.len());
        for (r, s) in states.iter_mut().enumerate() {
            let row = out.narrow(0, r, 1)?;
            rows.push(if p.compute[r] {
                state::taylor_update(s, &row, max_order)?;
                row
            } else {
                state::taylor_predict(s)?
            });
        }
        if p.compute.iter().all(|&c| c) {
            return Ok(out);
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    pub fn report(&self) -> &CacheReport {
        &self.report
    }

    /// The report, with the calibrations still open at the end (a two-expert model's
    /// experts each see only their share of the steps, so theirs never complete): each
    /// group's first row's ratios so far.
    pub fn into_report(mut self) -> CacheReport {
        for rows in self.states.values_mut() {
            if let Some(r) = rows.first_mut().filter(|r| !r.calibration.is_empty()) {
                self.report
                    .calibration
                    .push(std::mem::take(&mut r.calibration));
            }
        }
        self.report
    }
}

fn no_pass() -> Error {
    Error::bug("cache: a block's result asked for outside a pass it began")
}
