//! What a request costs in device memory beside the weights, as a function of its shape:
//! the activation figures a family computes from its checkpoint's config, and the one
//! formula over them that the engine, the planner and the request bounds all read. Below
//! the memory and timing models and the profile, which build on it.

use serde::{Deserialize, Serialize};

/// Device memory one request needs beside the weights, as a function of its size.
/// Computed by the engine from the family's shapes (f32 activations), so the planner
/// never guesses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ActivationCost {
    /// Image pixels per transformer token: (VAE upscale × patch size)².
    pub pixels_per_token: u64,
    /// Bytes live per token per sample at the peak of a block.
    pub bytes_per_token: u64,
    /// Bytes per latent token per sample live at the attention's peak beside its scores,
    /// for a family whose block peaks at one of two moments: its attention (these, the
    /// scores and the prompt) or the rest of the block, its feed-forward
    /// ([`Self::bytes_per_token`] and the prompt); the block's peak is then the larger of
    /// the two, not their sum. 0: the scores sit on top of `bytes_per_token`.
    #[serde(default)]
    pub attention_bytes_per_token: u64,
    /// Bytes per (token, token) pair per sample: the attention scores of all heads (and
    /// their softmax), for families whose attention materialises them; for a family whose
    /// attention runs in query chunks ([`Self::attention_bytes`]), the same figure caps
    /// that budget for sequences short enough to need less (0: always the budget).
    pub bytes_per_token_pair: u64,
    /// Bytes of attention scores at any time, for families whose attention runs in query
    /// chunks within this budget (a fixed cost, whatever the length).
    #[serde(default)]
    pub attention_bytes: u64,
    /// Bytes per output pixel at the peak of the VAE decoder (one image or one chunk of
    /// frames at a time).
    pub vae_bytes_per_pixel: u64,
    /// Video frames per latent frame (1 for image families; Wan: 4, the first frame
    /// alone): a clip of F frames has (F - 1) / this + 1 latent frames.
    #[serde(default = "one")]
    pub frames_per_latent: u64,
    /// Video frames the decoder holds at full resolution at its peak (its chunk).
    #[serde(default = "one")]
    pub decoder_frames: u64,
    /// Bytes per prompt token per sample live at a transformer block's peak, for text
    /// families: the text keys and values of cross-attention (or a joint block's text
    /// stream) beside the latent tokens.
    #[serde(default)]
    pub bytes_per_text_token: u64,
    /// Tokens a family's prompt template adds to each sequence beyond the prompt's own
    /// (which `max_sequence_length` bounds): a chat template's system message and markers,
    /// metadata sentences, end tokens. 0 for a family that pads its prompt to the bound.
    /// Every prompt term reads `text_tokens` plus these.
    #[serde(default)]
    pub template_tokens: u64,
    /// Bytes per prompt token per sequence at the peak of a text-encoder layer (its
    /// hidden states, projections and feed-forward), for families that encode prompts on
    /// the device.
    #[serde(default)]
    pub encoder_bytes_per_token: u64,
    /// As [`Self::attention_bytes_per_token`] for a text-encoder layer: bytes per prompt
    /// token per sequence live at its attention's peak beside the scores, when the layer
    /// peaks at its attention or at its feed-forward ([`Self::encoder_bytes_per_token`]),
    /// whichever is larger. 0: the scores sit on top of `encoder_bytes_per_token`.
    #[serde(default)]
    pub encoder_attention_bytes_per_token: u64,
    /// Bytes per (token, token) pair per sequence of a text-encoder layer whose attention
    /// materialises its scores (scores, softmax and position bias of all heads).
    #[serde(default)]
    pub encoder_bytes_per_token_pair: u64,
    /// Samples a guided output runs as at once: 2 where classifier-free guidance batches
    /// the conditional and unconditional passes (and encodes the negative prompt beside
    /// the prompt), 1 where a family runs them one after the other.
    #[serde(default = "two")]
    pub guidance_samples: u64,
    /// Whether each block computes the samples of one pass in turn (the same weights, one
    /// sequence after the other, as Cosmos3 runs its prompt and negative prompt of their
    /// own lengths) rather than as one batch: a block's peak is then one sample's, with
    /// what each other holds while it waits ([`Self::waiting_bytes_per_token`]). The time
    /// model is unchanged: the weights still pass once for every sample.
    #[serde(default)]
    pub samples_in_turn: bool,
    /// Under [`Self::samples_in_turn`]: bytes per latent token that each sample not
    /// computing holds through a block (its hidden states and rotary tables).
    #[serde(default)]
    pub waiting_bytes_per_token: u64,
    /// As [`Self::waiting_bytes_per_token`], per prompt token: what a waiting sample holds
    /// of its prompt through a transformer block (its text keys and values).
    #[serde(default)]
    pub waiting_bytes_per_text_token: u64,
    /// As [`Self::waiting_bytes_per_token`] for a text-encoder layer, per prompt token: a
    /// waiting sequence's hidden states and what it keeps of the layers behind it.
    #[serde(default)]
    pub encoder_waiting_bytes_per_token: u64,
    /// Bytes per latent token per sample that sequence parallelism adds to a rank's block
    /// peak: the attention's queries, keys, values and output held in both layouts while
    /// an all-to-all moves them (tokens split, then heads split). 0 for a family whose
    /// transformer does not split its sequence.
    #[serde(default)]
    pub exchange_bytes_per_token: u64,
    /// Bytes per latent token per sample of one hidden state of the transformer's stream
    /// (f32): what a step cache keeps per residual ([`CacheHold`]). 0
    /// for a profile written before the caches (no cache is then counted).
    #[serde(default)]
    pub hidden_bytes_per_token: u64,
    /// Bytes per latent token per sample of the transformer's output (f32): what
    /// TaylorSeer keeps per order.
    #[serde(default)]
    pub output_bytes_per_token: u64,
    /// Transformers that each keep their own cache state through a request (a two-expert
    /// model's both).
    #[serde(default = "one")]
    pub cache_states: u64,
}

fn one() -> u64 {
    1
}

fn two() -> u64 {
    2
}

/// The shape of a request as the activation formula reads it: the size of each output,
/// how many go through at once, whether guided, and its prompt's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestShape {
    pub width: u64,
    pub height: u64,
    pub frames: u64,
    /// Outputs computed together.
    pub batch: u64,
    /// Classifier-free guidance is on.
    pub guidance: bool,
    /// Tokens of the (padded) prompt: its `max_sequence_length`; 0 for a family that reads
    /// no prompt.
    pub text_tokens: u64,
    /// What the request's step cache holds (nothing without one).
    pub cache: CacheHold,
}

/// What one request's step cache holds on a rank, per output sample (each guidance row
/// keeps its own state), in tensors of the sizes the activation cost states per latent
/// token ([`ActivationCost::hidden_bytes_per_token`],
/// [`ActivationCost::output_bytes_per_token`]): the memory model adds
/// them to a transformer block's peak
/// ([`ActivationCost::checked_phases`]), since they live through every
/// pass of the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheHold {
    /// Hidden-state tensors kept between steps by every transformer that keeps its own
    /// state (First-Block Cache: the first block's and the tail's residuals; MagCache: the
    /// stack's residual).
    pub held_hidden: u64,
    /// Hidden-state tensors a pass holds beside the block it runs (the stack's input, the
    /// first block's output), for the transformer running.
    pub pass_hidden: u64,
    /// Output-sized tensors kept between steps by every transformer that keeps its own
    /// state (TaylorSeer: `max_order + 1` divided differences).
    pub held_outputs: u64,
}

impl CacheHold {
    /// No cache: nothing held.
    pub const NONE: CacheHold = CacheHold {
        held_hidden: 0,
        pass_hidden: 0,
        held_outputs: 0,
    };
}

/// Peak bytes of each phase of one request on one rank, as [`ActivationCost`] predicts
/// them: what the engine measures beside them (`layerwise_engine::measure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PhaseBytes {
    /// A text-encoder layer's peak over every sequence of the prompt.
    pub text_encoder: u64,
    /// A transformer block's peak: latent tokens, their attention, the prompt beside them.
    pub transformer: u64,
    /// The decoder's peak on one output.
    pub decode: u64,
}

impl PhaseBytes {
    /// The largest phase: what a rank keeps free for activations.
    pub fn peak(&self) -> u64 {
        self.text_encoder.max(self.transformer).max(self.decode)
    }
}

/// Bytes of an f32, the element the cost's block terms are stated in.
pub const F32_BYTES: u64 = 4;

impl ActivationCost {
    /// Peak activation bytes of a request of `shape`. Saturates at `u64::MAX` (see
    /// [`Self::checked_bytes`]).
    pub fn bytes(&self, shape: &RequestShape) -> u64 {
        self.checked_bytes(shape).unwrap_or(u64::MAX)
    }

    /// The one activation formula the engine and the planner share: the largest of a
    /// transformer block's peak (latent tokens, their attention, the prompt's tokens beside
    /// them), a text-encoder layer's (every sequence of the prompt) and the decoder's;
    /// `None` when a request that large would overflow (no device could hold it).
    pub fn checked_bytes(&self, shape: &RequestShape) -> Option<u64> {
        self.checked_bytes_per_rank(shape, 1)
    }

    /// [`Self::checked_bytes`] on each rank of a group of `sp` that splits the request's
    /// sequence ([`crate::topology`]): the latent tokens' terms on the largest share of
    /// the tokens (the scores' term too: each rank's heads see every key, so its share of
    /// the token pairs is its share of the heads), the exchange's buffers beside them when
    /// `sp > 1`; the prompt, the text encoder and the decoder stay whole on every rank.
    pub fn checked_bytes_per_rank(&self, shape: &RequestShape, sp: u64) -> Option<u64> {
        self.checked_phases(shape, sp, F32_BYTES).map(|p| p.peak())
    }

    /// Each phase's peak on each rank of a group of `sp` (as
    /// [`Self::checked_bytes_per_rank`]) for blocks that compute in elements of
    /// `compute_bytes` bytes (4 for f32, 2 for bf16): the block terms, stated for f32,
    /// scale with the element; the attention's chunk budget (its scores are taken in f32
    /// whatever the dtype) and the decoder (which runs in f32) do not. `None` when a
    /// request that large would overflow.
    pub fn checked_phases(
        &self,
        shape: &RequestShape,
        sp: u64,
        compute_bytes: u64,
    ) -> Option<PhaseBytes> {
        let sp = sp.max(1);
        let elem = compute_bytes.clamp(1, F32_BYTES) as u128;
        let at = |f32_bytes: u64| f32_bytes as u128 * elem / F32_BYTES as u128;
        let latent_frames = (shape.frames.max(1) - 1) / self.frames_per_latent.max(1) + 1;
        let pixels = shape.width as u128 * shape.height as u128;
        let tokens =
            (pixels * latent_frames as u128).div_ceil(self.pixels_per_token.max(1) as u128);
        // A prompt's sequences: its own tokens up to the bound and the template's around
        // them (none for a family that reads no prompt).
        let text = match shape.text_tokens {
            0 => 0,
            t => t as u128 + self.template_tokens as u128,
        };
        let per_output = if shape.guidance {
            self.guidance_samples.max(1) as u128
        } else {
            1
        };
        let all = shape.batch as u128 * per_output;
        // Samples computing at once, and those waiting their turn beside them.
        let samples = if self.samples_in_turn {
            shape.batch as u128
        } else {
            all
        };
        let waiting = all - samples;
        let share = tokens.div_ceil(sp as u128);
        let exchange = if sp > 1 {
            at(self.exchange_bytes_per_token)
        } else {
            0
        };
        // Scores of all heads over the token pairs: whole, every sample, where the
        // attention materialises them; where it runs in query chunks within a budget (one
        // sample after another), the budget, or one sample's whole scores when those are
        // smaller (a short sequence takes a single chunk).
        let pairs = self.bytes_per_token_pair as u128 * tokens * share;
        let attention = match (self.attention_bytes as u128, pairs) {
            (0, whole) => samples * whole,
            (budget, 0) => budget,
            (budget, whole) => budget.min(whole),
        };
        let prompt = at(self.bytes_per_text_token) * text;
        let rest = samples * ((at(self.bytes_per_token) + exchange) * share + prompt);
        let held = waiting
            * (at(self.waiting_bytes_per_token) * share
                + at(self.waiting_bytes_per_text_token) * text);
        // A step cache's tensors live through every pass: each row's (the hidden states
        // on this rank's share of the tokens, the output whole), in every transformer
        // that keeps its own state, and what the running pass holds beside its block.
        let c = &shape.cache;
        let states = self.cache_states.max(1) as u128;
        let cached = all
            * (at(self.hidden_bytes_per_token)
                * share
                * (c.held_hidden as u128 * states + c.pass_hidden as u128)
                + self.output_bytes_per_token as u128 * tokens * c.held_outputs as u128 * states);
        let transformer = held
            + cached
            + match self.attention_bytes_per_token {
                0 => rest + attention,
                a => rest.max(samples * ((at(a) + exchange) * share + prompt) + attention),
            };
        let encoder_scores = self.encoder_bytes_per_token_pair as u128 * text * text;
        let encoder_rest = samples * at(self.encoder_bytes_per_token) * text;
        let encoder_held = waiting * at(self.encoder_waiting_bytes_per_token) * text;
        let encoder = encoder_held
            + match self.encoder_attention_bytes_per_token {
                0 => encoder_rest + samples * encoder_scores,
                a => encoder_rest.max(samples * (at(a) * text + encoder_scores)),
            };
        let decode = self.decode_peak(shape.width, shape.height);
        let fits = |b: u128| (b <= (u64::MAX / 4) as u128).then_some(b as u64);
        Some(PhaseBytes {
            text_encoder: fits(encoder)?,
            transformer: fits(transformer)?,
            decode: fits(decode)?,
        })
    }

    /// Peak bytes of decoding one output of `width × height` (an image, or a clip of any
    /// length: the decoder holds one chunk of frames and its cache at a time): the VAE
    /// term of [`Self::checked_bytes`], and what a decoder beside the ranks keeps free on
    /// their device ([`crate::decode::DecoderBytes::peak`]). `None` as there.
    pub fn decode_bytes(&self, width: u64, height: u64) -> Option<u64> {
        let peak = self.decode_peak(width, height);
        (peak <= (u64::MAX / 4) as u128).then_some(peak as u64)
    }

    fn decode_peak(&self, width: u64, height: u64) -> u128 {
        let pixels = width as u128 * height as u128;
        (self.vae_bytes_per_pixel as u128 * self.decoder_frames.max(1) as u128)
            .saturating_mul(pixels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost() -> ActivationCost {
        ActivationCost {
            pixels_per_token: 256,
            bytes_per_token: 1000,
            attention_bytes_per_token: 0,
            bytes_per_token_pair: 0,
            attention_bytes: 0,
            vae_bytes_per_pixel: 10,
            frames_per_latent: 1,
            decoder_frames: 1,
            bytes_per_text_token: 100,
            template_tokens: 0,
            encoder_bytes_per_token: 400,
            encoder_attention_bytes_per_token: 0,
            encoder_bytes_per_token_pair: 8,
            guidance_samples: 2,
            samples_in_turn: false,
            waiting_bytes_per_token: 0,
            waiting_bytes_per_text_token: 0,
            encoder_waiting_bytes_per_token: 0,
            exchange_bytes_per_token: 0,
            hidden_bytes_per_token: 0,
            output_bytes_per_token: 0,
            cache_states: 1,
        }
    }

    // 64 × 64 px at 256 px a token: 16 latent tokens.
    fn shape(text_tokens: u64) -> RequestShape {
        RequestShape {
            width: 64,
            height: 64,
            frames: 1,
            batch: 1,
            guidance: true,
            text_tokens,
            cache: Default::default(),
        }
    }

    #[test]
    fn phases_sum_or_take_the_larger_moment() {
        let c = cost();
        let p = c.checked_phases(&shape(10), 1, F32_BYTES).unwrap();
        // 16 tokens, 2 samples: (1000·16 + 100·10) each.
        assert_eq!(p.transformer, 2 * (1000 * 16 + 100 * 10));
        // Scores summed on top: (400·10 + 8·100) each.
        assert_eq!(p.text_encoder, 2 * (400 * 10 + 8 * 100));
        assert_eq!(p.decode, 10 * 64 * 64);
        assert_eq!(c.checked_bytes(&shape(10)), Some(p.peak()));
        // Peaking at one of two moments: the larger, not the sum.
        let two = ActivationCost {
            attention_bytes_per_token: 300,
            bytes_per_token_pair: 50,
            attention_bytes: 1 << 20,
            encoder_attention_bytes_per_token: 100,
            ..c.clone()
        };
        let q = two.checked_phases(&shape(10), 1, F32_BYTES).unwrap();
        // Attention: 2·(300·16 + 1000) + one sample's whole scores (50·16·16 < budget).
        let attention = 2 * (300 * 16 + 100 * 10) + 50 * 16 * 16;
        assert_eq!(q.transformer, p.transformer.max(attention));
        // The text encoder peaks in its feed-forward (2·400·10) above its attention
        // (2·(100·10 + 8·100)): the larger, not the sum.
        assert_eq!(q.text_encoder, 2 * 400 * 10);
        // A budget below the whole scores caps them.
        let capped = ActivationCost {
            attention_bytes: 1000,
            attention_bytes_per_token: 2000,
            ..two.clone()
        };
        let r = capped.checked_phases(&shape(10), 1, F32_BYTES).unwrap();
        assert_eq!(r.transformer, 2 * (2000 * 16 + 100 * 10) + 1000);
        // A budget with no per-pair figure is the budget, whatever the length.
        let budget_only = ActivationCost {
            bytes_per_token_pair: 0,
            attention_bytes: 777,
            ..cost()
        };
        let b = budget_only
            .checked_phases(&shape(10), 1, F32_BYTES)
            .unwrap();
        assert_eq!(b.transformer, p.transformer + 777);
    }

    #[test]
    fn samples_in_turn_hold_one_peak_and_the_others_waiting() {
        let batched = ActivationCost {
            template_tokens: 6,
            ..cost()
        };
        let turn = ActivationCost {
            samples_in_turn: true,
            waiting_bytes_per_token: 30,
            waiting_bytes_per_text_token: 7,
            encoder_waiting_bytes_per_token: 50,
            ..batched.clone()
        };
        // A 10-token prompt with 6 template tokens: 16 tokens a sequence.
        let b = batched.checked_phases(&shape(10), 1, F32_BYTES).unwrap();
        assert_eq!(b.transformer, 2 * (1000 * 16 + 100 * 16));
        let t = turn.checked_phases(&shape(10), 1, F32_BYTES).unwrap();
        // One sample's block, and the other waiting with its tokens and its prompt.
        assert_eq!(t.transformer, (1000 * 16 + 100 * 16) + (30 * 16 + 7 * 16));
        assert_eq!(t.text_encoder, (400 * 16 + 8 * 256) + 50 * 16);
        // Unguided: nothing waits, and the two read alike.
        let one = RequestShape {
            guidance: false,
            ..shape(10)
        };
        assert_eq!(
            turn.checked_phases(&one, 1, F32_BYTES),
            batched.checked_phases(&one, 1, F32_BYTES)
        );
        // A family that reads no prompt pays no template.
        let none = batched.checked_phases(&shape(0), 1, F32_BYTES).unwrap();
        assert_eq!(none.transformer, 2 * 1000 * 16);
    }

    #[test]
    fn a_step_caches_tensors_sit_on_the_block_peak() {
        let c = ActivationCost {
            hidden_bytes_per_token: 64,
            output_bytes_per_token: 16,
            cache_states: 2,
            ..cost()
        };
        let plain = c.checked_phases(&shape(10), 1, F32_BYTES).unwrap();
        let with = |cache: CacheHold, sp: u64| {
            c.checked_phases(&RequestShape { cache, ..shape(10) }, sp, F32_BYTES)
                .unwrap()
        };
        // No cache, no term: a profile without the figures reads as before.
        assert_eq!(with(CacheHold::NONE, 1), plain);
        // First-Block Cache: two residuals kept by each of two experts, two beside the
        // pass; 16 tokens, 2 guided samples.
        let fbc = CacheHold {
            held_hidden: 2,
            pass_hidden: 2,
            held_outputs: 0,
        };
        let f = with(fbc, 1);
        assert_eq!(f.transformer - plain.transformer, 2 * 64 * 16 * (2 * 2 + 2));
        assert_eq!(
            (f.text_encoder, f.decode),
            (plain.text_encoder, plain.decode)
        );
        // In bf16 the hidden states halve; split over 2 ranks each holds its share.
        let bf16 = c
            .checked_phases(
                &RequestShape {
                    cache: fbc,
                    ..shape(10)
                },
                1,
                2,
            )
            .unwrap();
        let plain_bf16 = c.checked_phases(&shape(10), 1, 2).unwrap();
        assert_eq!(bf16.transformer - plain_bf16.transformer, 2 * 32 * 16 * 6);
        let half =
            with(fbc, 2).transformer - c.checked_phases(&shape(10), 2, 4).unwrap().transformer;
        assert_eq!(half, 2 * 64 * 8 * 6);
        // TaylorSeer of order 1: two whole outputs per sample and expert.
        let ts = CacheHold {
            held_hidden: 0,
            pass_hidden: 0,
            held_outputs: 2,
        };
        assert_eq!(
            with(ts, 1).transformer - plain.transformer,
            2 * 16 * 16 * 2 * 2
        );
    }

    #[test]
    fn block_terms_scale_with_the_compute_dtype_and_the_decoder_does_not() {
        let c = ActivationCost {
            bytes_per_token_pair: 8,
            attention_bytes: 1 << 20,
            ..cost()
        };
        let f32 = c.checked_phases(&shape(10), 1, 4).unwrap();
        let bf16 = c.checked_phases(&shape(10), 1, 2).unwrap();
        let scores = 8 * 16 * 16;
        assert_eq!(bf16.transformer - scores, (f32.transformer - scores) / 2);
        assert_eq!(bf16.text_encoder, 2 * (200 * 10 + 8 * 100));
        assert_eq!(bf16.decode, f32.decode);
        // Past f32 the element is clamped: the terms are stated for f32.
        assert_eq!(c.checked_phases(&shape(10), 1, 8), Some(f32));
    }
}
