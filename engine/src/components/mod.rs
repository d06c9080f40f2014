//! Parts more than one model family uses and no family owns: the text encoders (UMT5,
//! Qwen2.5-VL), the VAEs (AutoencoderKL, the Wan VAE), attention and the fused CPU
//! kernels, the small layers several transformers share, and the reading of a pipeline's
//! `model_index.json`. Families import these; a component never imports a family, and no
//! family imports another, so a family can be added or removed alone.

pub mod attention;
pub mod autoencoder_kl;
#[cfg(feature = "runtime")]
pub mod chat_template;
pub mod config_checks;
pub mod config_json;
pub mod flops;
#[cfg(feature = "runtime")]
pub mod fused;
#[cfg(feature = "runtime")]
pub mod layers;
pub mod pipeline_index;
pub mod qwen2_5_vl;
#[cfg(feature = "runtime")]
pub mod resident;
#[cfg(feature = "runtime")]
pub mod rotary;
pub mod umt5;
pub mod wan_vae;
