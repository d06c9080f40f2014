//! The family registry: a family is one `FamilyEntry` (its name, the pipeline classes it
//! recognises, how it opens a folder) and its `FamilyCheckpoint` and `FamilyModel`
//! implementations. Shown here
//! by a family this test adds on its own, outside the engine's code, which then opens,
//! profiles and generates like the registered ones, with no shared `match` edited.

mod common;

use std::path::Path;
use std::sync::Arc;

use layerwise_engine::bounds::ModelLimits;
use layerwise_engine::checkpoint::{ActivationCost, Component};
use layerwise_engine::engine::Model;
use layerwise_engine::execution::family::FamilyRuntime;
use layerwise_engine::execution::rank::EngineOptions;
use layerwise_engine::families::dit::DitCheckpoint;
use layerwise_engine::families::{
    self, BlockGroup, Checkpoint, FamilyCheckpoint, FamilyEntry, FamilyModel, FAMILIES,
};
use layerwise_engine::Strategy;

/// A family of the test's own: a DiT under another pipeline class, whose positions it says
/// run out at 256 px.
#[derive(Debug)]
struct Toy(DitCheckpoint);

impl FamilyCheckpoint for Toy {
    fn components(&self) -> Vec<(&'static str, &Component)> {
        self.0.components()
    }
    fn groups(&self) -> Vec<(&'static str, BlockGroup)> {
        self.0.groups()
    }
    fn resident_device_bytes(&self) -> u64 {
        self.0.resident_device_bytes()
    }
    fn decoder_bytes(&self) -> u64 {
        self.0.decoder_bytes()
    }
    fn resident_stored_bytes(&self, elem: u64) -> u64 {
        self.0.resident_stored_bytes(elem)
    }
    fn decoder_stored_bytes(&self, elem: u64) -> u64 {
        self.0.decoder_stored_bytes(elem)
    }
    fn native_size(&self) -> (usize, usize) {
        (64, 64)
    }
    fn limits(&self) -> ModelLimits {
        ModelLimits {
            max_width: Some(256),
            max_height: Some(256),
            max_frames: None,
            reason: "the toy's own table".into(),
        }
    }
    fn activation_cost(&self) -> ActivationCost {
        self.0.activation_cost()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl FamilyModel for Toy {
    fn runtime(&self) -> layerwise_engine::Result<Box<dyn FamilyRuntime>> {
        self.0.runtime()
    }
}

const TOY: FamilyEntry = FamilyEntry {
    name: "toy",
    pipelines: &["ToyPipeline"],
    unnamed: false,
    presets: &[],
    open: |root| Ok(Arc::new(Toy(DitCheckpoint::open(root)?))),
};

fn set_class(model: &Path, class: &str) {
    let path = model.join("model_index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    index["_class_name"] = serde_json::json!(class);
    std::fs::write(&path, index.to_string()).unwrap();
}

/// Every registered family has a name and pipeline classes no other has, and its tiny
/// preset opens as that family, through the registry alone.
#[test]
fn the_registry_names_each_family_once_and_opens_its_folders() {
    let names = families::names();
    assert_eq!(names, ["dit", "wan", "cosmos3", "qwen-image"]);
    let mut classes: Vec<&str> = FAMILIES.iter().flat_map(|f| f.pipelines.to_vec()).collect();
    let n = classes.len();
    classes.sort();
    classes.dedup();
    assert_eq!(classes.len(), n, "a pipeline class is claimed twice");
    assert_eq!(FAMILIES.iter().filter(|f| f.unnamed).count(), 1);
    let d = tempfile::tempdir().unwrap();
    for (model, family) in [
        (common::tiny(d.path(), 2), "dit"),
        (common::wan_tiny(d.path(), 1, 1), "wan"),
        (common::cosmos3_tiny(d.path(), 2), "cosmos3"),
        (common::qwen_image_tiny(d.path(), 2), "qwen-image"),
    ] {
        let ck = Checkpoint::open(&model).unwrap();
        assert_eq!(ck.name(), family);
        assert_eq!(ck.profile().unwrap().family, family);
    }
}

/// A family added by a registration of its own (here, in this test) opens, profiles and
/// generates; the engine's default registry refuses its folders, naming the class and the
/// pipelines it does run.
#[test]
fn a_new_family_is_one_registration() {
    let d = tempfile::tempdir().unwrap();
    let model = common::tiny(d.path(), 2);
    set_class(&model, "ToyPipeline");

    let e = Checkpoint::open(&model).unwrap_err().to_string();
    assert!(
        e.contains("model_index.json")
            && e.contains("ToyPipeline")
            && e.contains("DiTPipeline, WanPipeline"),
        "{e}"
    );

    let registry: Vec<FamilyEntry> = FAMILIES.iter().copied().chain([TOY]).collect();
    let ck = Checkpoint::open_in(&model, &registry).unwrap();
    assert_eq!(ck.name(), "toy");
    assert!(ck.downcast::<Toy>().is_some());
    let p = ck.profile().unwrap();
    assert_eq!(
        (p.family.as_str(), p.native_width, p.limits.max_width),
        ("toy", 64, Some(256))
    );
    assert_eq!(p.blocks, 2);

    let family = ck.runtime().unwrap();
    let model = Model {
        checkpoint: ck,
        family,
    };
    let opts = EngineOptions {
        strategy: Strategy::OffloadSharded,
        dp: 2,
        decode: false,
        ..EngineOptions::default()
    };
    let (outputs, _) = model.run(vec![common::request(1, 2, 1.0)], &opts).unwrap();
    assert_eq!(outputs.len(), 1);
}
