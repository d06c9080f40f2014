//! Sequence parallelism (`--sp`): one request split across the ranks of a group gives the
//! latents the whole request gives on one rank, bit for bit, under every strategy and
//! beside data-parallel groups; a request that fails on one rank of its group fails alone
//! and names the rank's error; topologies a model cannot run are refused naming `sp`.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::{DType, Device};
use common::{expect_err, opts};
use layerwise_engine::engine::Model;
use layerwise_engine::execution::family::{Decoder, FamilyRuntime, RankModel, Task, VideoSpec};
use layerwise_engine::execution::rank::{self, EngineOptions};
use layerwise_engine::execution::seq::Split;
use layerwise_engine::execution::weights::Weights;
use layerwise_engine::execution::work::{
    Condition, Output, Request, Taken, Work, WorkKey, WorkSource,
};
use layerwise_engine::families::cosmos3::synth::Cosmos3Synth;
use layerwise_engine::families::wan::synth::WanSynth;
use layerwise_engine::families::FamilyCheckpoint;
use layerwise_engine::layout::GroupLayout;
use layerwise_engine::tools::synth::{synth, SynthOptions};
use layerwise_engine::{Error, Result, Strategy};

/// A two-expert Wan with 4 attention heads (2 layers per expert, 2 text-encoder layers).
fn wan(dir: &Path) -> PathBuf {
    let out = dir.join("wan-sp");
    let mut o = SynthOptions::preset("wan-tiny").unwrap();
    o.set_layers(2);
    o.set_heads(Some(4), None);
    if let Some(w) = o.model_mut::<WanSynth>() {
        w.text_encoder.num_layers = 2;
    }
    o.seed = 21;
    synth(&out, &o).unwrap();
    out
}

/// Cosmos3 with 8 query heads over 4 key/value heads, 2 layers.
fn cosmos3(dir: &Path) -> PathBuf {
    let out = dir.join("cosmos3-sp");
    let mut o = SynthOptions::preset("cosmos3-tiny").unwrap();
    o.set_layers(2);
    if let Some(c) = o.model_mut::<Cosmos3Synth>() {
        c.transformer.num_attention_heads = 8;
        c.transformer.num_key_value_heads = 4;
    }
    o.seed = 23;
    synth(&out, &o).unwrap();
    out
}

fn prompt(seed: u64, steps: usize, frames: usize, guidance: f32, size: (usize, usize)) -> Request {
    Request {
        seed,
        steps,
        guidance,
        frames,
        max_sequence_length: 16,
        ..Request::image(
            Condition::Prompt {
                prompt: format!("a red fox {seed}"),
                negative: Some("blurry".into()),
            },
            size.0,
            size.1,
        )
    }
}

fn with_sp(strategy: Strategy, dp: usize, sp: usize, k: usize) -> EngineOptions {
    EngineOptions {
        sp,
        ..opts(strategy, dp, k, false)
    }
}

fn bits(model: &Model, requests: &[Request], o: &EngineOptions) -> Vec<Vec<u32>> {
    let (out, _) = model.run(requests.to_vec(), o).unwrap();
    out.iter().map(|o| common::bits(&o.latents)).collect()
}

/// Every topology of up to four ranks with a group of more than one, every strategy, K 2
/// and 3, with the copies jittered: the latents of sp 1.
fn identical_across_topologies(model: &Model, requests: &[Request], name: &str) {
    let reference = bits(model, requests, &with_sp(Strategy::Resident, 1, 1, 2));
    for strategy in Strategy::ALL {
        for (dp, sp) in [(1, 2), (1, 4), (2, 2), (1, 3)] {
            for k in [2, 3] {
                let mut o = with_sp(strategy, dp, sp, k);
                o.hook = Some(common::jitter((dp * 10 + sp * 3 + k) as u64));
                assert_eq!(
                    bits(model, requests, &o),
                    reference,
                    "{name}: {strategy} dp={dp} sp={sp} K={k}"
                );
            }
        }
    }
}

#[test]
fn wan_latents_with_sp_2_3_and_4_equal_sp_1_under_every_strategy() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&wan(dir.path())).unwrap();
    // Token counts sp does not divide (9 frames of 48 × 32: 3 × 2 × 3 = 18 tokens), both
    // experts, guided and not, different lengths: groups start requests while others run.
    let requests = vec![
        prompt(1, 4, 9, 5.0, (48, 32)),
        prompt(2, 2, 1, 1.0, (32, 32)),
        prompt(3, 3, 5, 3.0, (48, 48)),
    ];
    identical_across_topologies(&model, &requests, "wan");
}

#[test]
fn cosmos3_latents_with_sp_2_3_and_4_equal_sp_1_under_every_strategy() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&cosmos3(dir.path())).unwrap();
    let requests = vec![
        prompt(1, 3, 5, 5.0, (64, 48)),
        prompt(2, 2, 1, 1.0, (64, 64)),
    ];
    identical_across_topologies(&model, &requests, "cosmos3");
}

#[test]
fn a_topology_the_model_cannot_split_is_refused_naming_sp() {
    let dir = tempfile::tempdir().unwrap();
    let wan = Model::open(&wan(dir.path())).unwrap();
    let req = vec![prompt(1, 1, 1, 1.0, (32, 32))];
    let run = |m: &Model, sp: usize| m.run(req.clone(), &with_sp(Strategy::Offload, 1, sp, 2));
    expect_err(run(&wan, 5), &["sp", "5", "at most 4", "4 attention heads"]);
    expect_err(run(&wan, 0), &["sp", "0", "between 1 and 16"]);
    expect_err(run(&wan, 17), &["sp", "17"]);
    // 16 × 16 px, one frame: a single latent token for four ranks.
    expect_err(
        wan.run(
            vec![prompt(1, 1, 1, 1.0, (16, 16))],
            &with_sp(Strategy::Offload, 1, 4, 2),
        ),
        &["size", "1 latent tokens", "4 ranks"],
    );
    let cosmos = Model::open(&cosmos3(dir.path())).unwrap();
    expect_err(run(&cosmos, 8), &["sp", "at most 4", "key/value heads"]);
    let dit = Model::open(&common::tiny(dir.path(), 2)).unwrap();
    let class = vec![common::request(1, 1, 1.0)];
    expect_err(
        dit.run(class, &with_sp(Strategy::Offload, 1, 2, 2)),
        &["sp", "dit family", "one rank"],
    );
}

/// Each rank of a group keeps a share of the activations: the memory model's figure per
/// rank falls with sp, and the engine's start check uses it.
#[test]
fn each_rank_keeps_its_share_of_the_activations() {
    let dir = tempfile::tempdir().unwrap();
    let model = Model::open(&wan(dir.path())).unwrap();
    let req = vec![prompt(1, 1, 33, 5.0, (256, 256))];
    let f32 = layerwise_core::compute_dtype::ComputeElement::F32;
    let per = |sp| model.activation_bytes(&req, sp, f32).unwrap();
    let (one, two, four) = (per(1), per(2), per(4));
    assert!(two < one && four < two, "{one} {two} {four}");
    // The latent tokens' terms shrink with sp; the prompt's and the decoder's do not, so
    // four ranks hold more than a quarter each.
    assert!(four * 4 > one, "{one} {four}");
}

/// A run of `runtime` over a fixed list of requests, recording each one's outcome.
struct Recorder {
    queues: Vec<Mutex<Vec<(u64, Request)>>>,
    outcomes: Mutex<BTreeMap<u64, std::result::Result<Vec<u32>, String>>>,
}

impl WorkSource for Recorder {
    fn take(&self, rank: usize) -> Result<Taken> {
        let mut q = self.queues[rank].lock().unwrap();
        let work = (!q.is_empty()).then(|| {
            let (id, req) = q.remove(0);
            Work {
                key: WorkKey { id, index: 0 },
                req,
                cancel: None,
            }
        });
        Ok(Taken {
            work,
            generation: 0,
            closed: q.is_empty(),
        })
    }
    fn pending(&self, rank: usize) -> bool {
        !self.queues[rank].lock().unwrap().is_empty()
    }
    fn wait(&self, _: usize, _: u64) -> Result<()> {
        Ok(())
    }
    fn finished(&self, _: usize, key: WorkKey, out: Result<Output>) {
        let o = out
            .map(|o| common::bits(&o.latents))
            .map_err(|e| e.to_string());
        self.outcomes.lock().unwrap().insert(key.id, o);
    }
}

/// Wan, except that one rank of a group fails request 2's second block.
struct FailsOnOneRank(Box<dyn FamilyRuntime>, usize);

struct FailingRank(Box<dyn RankModel>, usize);

struct FailingTask(Box<dyn Task>, bool);

impl FamilyRuntime for FailsOnOneRank {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn checkpoint(&self) -> &dyn FamilyCheckpoint {
        self.0.checkpoint()
    }
    fn layouts(&self, dp: usize) -> Result<Vec<GroupLayout>> {
        self.0.layouts(dp)
    }
    fn mappings(&self) -> Vec<layerwise_engine::checkpoint::Mapped> {
        self.0.mappings()
    }
    fn video(&self) -> Option<VideoSpec> {
        self.0.video()
    }
    fn defaults(&self) -> (usize, f32) {
        self.0.defaults()
    }
    fn validate(&self, req: &Request) -> Result<()> {
        self.0.validate(req)
    }
    fn load_rank(&self, device: &Device, dtype: DType, decode: bool) -> Result<Box<dyn RankModel>> {
        Ok(Box::new(FailingRank(
            self.0.load_rank(device, dtype, decode)?,
            self.1,
        )))
    }
    fn decoder(&self, device: &Device) -> Result<Box<dyn Decoder>> {
        self.0.decoder(device)
    }
    fn sequence_parallel(&self) -> Option<(usize, String)> {
        self.0.sequence_parallel()
    }
}

impl RankModel for FailingRank {
    fn start(&self, req: Request, split: Split) -> Result<Box<dyn Task>> {
        let fails = req.seed == 2 && split.index() == self.1;
        Ok(Box::new(FailingTask(self.0.start(req, split)?, fails)))
    }
}

impl Task for FailingTask {
    fn wants(&self) -> Option<usize> {
        self.0.wants()
    }
    fn wants_after(&self) -> Option<usize> {
        self.0.wants_after()
    }
    fn begin(&mut self) -> Result<()> {
        self.0.begin()
    }
    fn block(&mut self, index: usize, w: &dyn Weights) -> Result<()> {
        // The transformer's second block (the text encoder's pass runs first, unharmed).
        if self.1 && index == 1 && self.0.wants() != Some(0) {
            return Err(Error::invalid("test", "injected failure in block 1"));
        }
        self.0.block(index, w)
    }
    fn end(&mut self) -> Result<Option<(usize, usize)>> {
        self.0.end()
    }
    fn finish(self: Box<Self>) -> Result<Output> {
        self.0.finish()
    }
}

#[test]
fn a_request_failing_on_one_rank_of_its_group_fails_alone_naming_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let path = wan(dir.path());
    let plain = Model::open(&path).unwrap();
    let requests: Vec<Request> = (1..=4).map(|s| prompt(s, 2, 5, 4.0, (32, 32))).collect();
    let reference = bits(&plain, &requests, &with_sp(Strategy::Resident, 1, 1, 2));
    // The leader and a follower failing: either way only request 2 fails, with the
    // injected error, and the group goes on to its next request.
    for failing in [0, 1] {
        let model = Model::open(&path).unwrap();
        let family = FailsOnOneRank(model.family, failing);
        let source = Recorder {
            queues: vec![
                Mutex::new(vec![(0, requests[0].clone()), (1, requests[1].clone())]),
                Mutex::new(vec![(2, requests[2].clone()), (3, requests[3].clone())]),
            ],
            outcomes: Mutex::new(BTreeMap::new()),
        };
        // Request 2 (seed 2) runs in the first group, after request 0.
        let o = with_sp(Strategy::OffloadSharded, 2, 2, 2);
        rank::drive(&family, &o, &source).unwrap();
        let outcomes = source.outcomes.into_inner().unwrap();
        assert_eq!(outcomes.len(), 4, "{outcomes:?}");
        for (id, got) in outcomes {
            match got {
                Ok(b) => {
                    assert_ne!(id, 1, "the failing request succeeded (rank {failing})");
                    assert_eq!(b, reference[id as usize], "request {id}");
                }
                Err(e) => {
                    assert_eq!(id, 1, "request {id} failed: {e}");
                    assert!(e.contains("injected failure in block 1"), "{e}");
                }
            }
        }
    }
}
