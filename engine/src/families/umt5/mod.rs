//! The UMT5 encoder (transformers' `UMT5EncoderModel`) that Wan conditions on, and the
//! prompt tokenizer in front of it.
