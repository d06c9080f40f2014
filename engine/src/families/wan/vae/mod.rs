//! `AutoencoderKLWan`: its config and tensor specs (metadata) and its causal 3D decoder.
