//! `WanTransformer3DModel`: its config and tensor specs (metadata) and its forward pass.
