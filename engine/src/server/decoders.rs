//! The decode threads: where finished latents become PNGs and MP4s, beside the ranks so the
//! VAE never holds their collectives hostage. One thread on the host's CPU, or one per
//! group leader on that rank's device ([`decode_placement`] decides which, by the same
//! figures the planner reserves); a failed or panicking decode fails its output alone.

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};

use super::kind::Kind;
use super::scheduler::{DecodeJob, Media, Msg, Scheduler};
use crate::bounds::RequestBounds;
use crate::decode::{DecodeChoice, DecodeSite, DecoderBytes};
use crate::engine::Model;
use crate::execution::cuda::{self, DeviceChoice};
use crate::execution::family::Decoder;
use crate::execution::rank::EngineOptions;
use crate::media::image::encode_png;
use crate::media::video::{self, Clip, VideoFormat};
use crate::{Error, Result};

/// Where `serve` decodes (`choice` for the backend that `dp` ranks on `device` resolve to)
/// and what the decoder keeps on each rank's device there for outputs within `bounds`:
/// the engine's side of the figure the planner reserves from the profile, by the same
/// [`DecodeSite::decoder_bytes`].
pub fn decode_placement(
    model: &Model,
    choice: DecodeChoice,
    device: DeviceChoice,
    dp: usize,
    bounds: &RequestBounds,
    budget: u64,
) -> Result<(DecodeSite, DecoderBytes)> {
    let site = choice.resolve(cuda::resolve(device, dp)?.kind());
    let decode = model.checkpoint.decode_cost();
    if let (DecodeSite::Device, Some(d)) = (site, &decode) {
        // The refusal names the budget and what the smallest split needs.
        crate::decode::device_decode(d, bounds, budget)?;
    }
    let decoder = site
        .decoder_bytes(
            model.checkpoint.decoder_bytes(),
            &model.checkpoint.activation_cost(),
            decode.as_ref(),
            budget,
            bounds,
        )
        .ok_or_else(|| {
            Error::invalid(
                "max-width",
                format!(
                    "decoding an output at the bounds ({}x{}) on the device needs more memory than any device holds",
                    bounds.max_width, bounds.max_height
                ),
            )
        })?;
    Ok((site, decoder))
}

/// The decoders `decode` puts on the ranks' devices, loaded now (none when decoding on the
/// host): one per group leader, since outputs come from there. A decoder that does not
/// load fails the start.
pub(super) fn on_devices(
    model: &Model,
    opts: &EngineOptions,
    decode: DecodeSite,
) -> Result<Vec<DeviceDecoder>> {
    Ok(match decode {
        DecodeSite::Host => Vec::new(),
        DecodeSite::Device => {
            let resolved = cuda::resolve(opts.device, opts.dp * opts.sp)?;
            // Outputs come from each group's leader: a decoder on its device.
            (0..opts.dp)
                .map(|group| {
                    let rank = group * opts.sp;
                    let device = resolved.rank_device(rank)?;
                    let mut vae = model.decoder(&device).map_err(|e| Error::Rank {
                        rank,
                        msg: format!("cannot load the VAE decoder on its device: {e}"),
                    })?;
                    vae.set_decode_budget(opts.decode_budget);
                    Ok(DeviceDecoder { rank, device, vae })
                })
                .collect::<Result<Vec<_>>>()?
        }
    })
}

/// Starts the decode threads on the scheduler's decode queue `decode_rx`: one on the host's
/// CPU when `decoders` is empty, else one per device decoder.
pub(super) fn spawn(
    decoders: Vec<DeviceDecoder>,
    model: Arc<Model>,
    budget: u64,
    scheduler: &Scheduler,
    decode_rx: std::sync::mpsc::Receiver<DecodeJob>,
) -> Result<()> {
    let rt = tokio::runtime::Handle::current();
    if decoders.is_empty() {
        spawn_decoder(model, budget, scheduler.clone(), decode_rx, rt);
    } else {
        // One queue, a decoder per device: an output goes to whichever is free, and each
        // device decodes one output at a time (the peak its budget keeps free).
        let queue = Arc::new(Mutex::new(decode_rx));
        for d in decoders {
            spawn_device_decoder(d, scheduler.clone(), queue.clone(), rt.clone())?;
        }
    }
    Ok(())
}

fn spawn_decoder(
    model: Arc<Model>,
    budget: u64,
    sched: Scheduler,
    rx: std::sync::mpsc::Receiver<DecodeJob>,
    rt: tokio::runtime::Handle,
) {
    std::thread::Builder::new()
        .name("decode".into())
        .spawn(move || {
            let mut vae = match model.decoder(&Device::Cpu) {
                Ok(v) => v,
                Err(e) => {
                    rt.block_on(sched.send(Msg::Fatal {
                        msg: format!("cannot load the VAE decoder: {e}"),
                    }));
                    return;
                }
            };
            vae.set_decode_budget(budget);
            for (key, latents, kind) in rx {
                let progress = |done| rt.block_on(sched.send(Msg::Frames { key, done }));
                let media = guarded("the CPU", || {
                    make_media(vae.as_ref(), &latents, kind, progress)
                });
                rt.block_on(sched.send(Msg::Decoded { key, media }));
            }
        })
        .expect("spawn decode thread");
}

/// A decoder on one rank's device.
pub(super) struct DeviceDecoder {
    rank: usize,
    device: Device,
    vae: Box<dyn Decoder>,
}

impl DeviceDecoder {
    /// Decodes one output's host `latents` on this device into its media. A failure names
    /// the device (`name`), except latents the decoder refuses, which answer as they do
    /// on the host.
    fn decode(
        &self,
        name: &str,
        latents: &Tensor,
        kind: Kind,
        progress: impl FnMut(usize),
    ) -> Result<Media> {
        latents
            .to_device(&self.device)
            .map_err(Error::from)
            .and_then(|l| make_media(self.vae.as_ref(), &l, kind, progress))
            .map_err(|e| match e {
                e @ Error::Core(layerwise_core::Error::Invalid { .. }) => e,
                e => Error::Decode {
                    device: name.to_string(),
                    msg: e.to_string(),
                },
            })
    }
}

/// Runs one output's decode on `device`. A panic in it fails that output alone, naming the
/// device, and the decode thread goes on to the next (a panic would otherwise end the
/// thread and leave its job, and every one queued behind it, waiting forever).
fn guarded(device: &str, decode: impl FnOnce() -> Result<Media>) -> Result<Media> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode)).unwrap_or_else(|p| {
        Err(Error::Decode {
            device: device.to_string(),
            msg: format!(
                "the decoder panicked: {}",
                crate::error::panic_message(p.as_ref())
            ),
        })
    })
}

/// A decode thread on rank `d.rank`'s device, taking outputs from the shared `queue`. An
/// output that fails to decode there (out of device memory, a kernel error, latents the
/// decoder refuses) fails its job alone, naming the device; the thread carries on.
fn spawn_device_decoder(
    d: DeviceDecoder,
    sched: Scheduler,
    queue: Arc<Mutex<std::sync::mpsc::Receiver<DecodeJob>>>,
    rt: tokio::runtime::Handle,
) -> Result<()> {
    let name = match d.device {
        Device::Cpu => format!("the CPU (rank {})", d.rank),
        _ => format!("GPU {}", d.rank),
    };
    std::thread::Builder::new()
        .name(format!("decode-{}", d.rank))
        .spawn(move || loop {
            // The guard is dropped at the end of the statement: the others wait on the
            // queue only while this one does.
            let job = queue.lock().expect("decode queue lock").recv();
            let Ok((key, latents, kind)) = job else {
                return;
            };
            let progress = |done| rt.block_on(sched.send(Msg::Frames { key, done }));
            let media = guarded(&name, || d.decode(&name, &latents, kind, progress));
            rt.block_on(sched.send(Msg::Decoded { key, media }));
        })
        .map_err(|e| Error::internal("cannot start a decode thread", e))?;
    Ok(())
}

/// Decodes one output's latents into what the API serves: a PNG for an image; for a clip,
/// an MP4 and its first frame as a PNG thumbnail. `progress` hears the frames decoded so far.
pub fn make_media(
    vae: &dyn Decoder,
    latents: &Tensor,
    kind: Kind,
    mut progress: impl FnMut(usize),
) -> Result<Media> {
    let (mut frames, mut first, mut size) = (Vec::new(), None, (0, 0));
    vae.decode_frames(latents, &mut |batch| {
        // Frames decoded on a GPU come to the host once, to be encoded there.
        let batch = batch.to_device(&Device::Cpu)?;
        let (_, _, h, w) = batch.dims4()?;
        size = (w, h);
        if first.is_none() {
            first = Some(encode_png(&batch.get(0)?)?);
        }
        if let Kind::Video { .. } = kind {
            frames.extend(video::rgb8(&batch)?);
            progress(frames.len());
        }
        Ok(())
    })?;
    let first = first.ok_or_else(|| Error::bug("the decoder made no frames"))?;
    Ok(match kind {
        Kind::Image => Media {
            bytes: first,
            content_type: "image/png",
            thumbnail: None,
            frames: 1,
        },
        Kind::Video { fps } => {
            let clip = Clip {
                width: size.0,
                height: size.1,
                fps,
                frames: frames.iter().map(Vec::as_slice).collect(),
            };
            Media {
                bytes: video::encode(&clip, VideoFormat::Mp4)?,
                content_type: "video/mp4",
                thumbnail: Some(first),
                frames: frames.len(),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decoder that fails as a device would, or refuses the latents.
    struct Failing {
        refuse: bool,
    }

    impl Decoder for Failing {
        fn decode(&self, _: &Tensor) -> Result<Tensor> {
            Err(if self.refuse {
                Error::invalid("latents", "expected [1, 16, frames, height, width]")
            } else {
                candle_core::Error::Msg("CUDA_ERROR_OUT_OF_MEMORY: out of memory".into()).into()
            })
        }
    }

    /// A decoder with a bug.
    struct Panicking;

    impl Decoder for Panicking {
        fn decode(&self, _: &Tensor) -> Result<Tensor> {
            panic!("index out of bounds: the len is 3 but the index is 7")
        }
    }

    #[test]
    fn a_decoder_that_panics_fails_its_output_alone() {
        let latents = Tensor::zeros((1, 4, 2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let d = DeviceDecoder {
            rank: 0,
            device: Device::Cpu,
            vae: Box::new(Panicking),
        };
        let e = guarded("GPU 0", || d.decode("GPU 0", &latents, Kind::Image, |_| {})).unwrap_err();
        assert_eq!(e.label(), "decode_failed");
        let msg = e.to_string();
        assert!(
            msg.contains("GPU 0") && msg.contains("panicked") && msg.contains("index is 7"),
            "{msg}"
        );
        // The same thread decodes the next output.
        let ok = DeviceDecoder {
            rank: 0,
            device: Device::Cpu,
            vae: Box::new(Failing { refuse: true }),
        };
        let e = guarded("GPU 0", || {
            ok.decode("GPU 0", &latents, Kind::Image, |_| {})
        })
        .unwrap_err();
        assert_eq!(e.http_status(), 422, "{e}");
    }

    #[test]
    fn a_failed_decode_on_a_device_names_the_device_and_refused_latents_answer_as_on_the_host() {
        let latents = Tensor::zeros((1, 4, 2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let oom = DeviceDecoder {
            rank: 1,
            device: Device::Cpu,
            vae: Box::new(Failing { refuse: false }),
        };
        let e = oom
            .decode("GPU 1", &latents, Kind::Image, |_| {})
            .unwrap_err();
        assert!(matches!(e, Error::Decode { .. }), "{e:?}");
        assert_eq!(e.label(), "decode_failed");
        assert_eq!(e.http_status(), 500);
        let msg = e.to_string();
        assert!(
            msg.contains("decoding on GPU 1") && msg.contains("out of memory"),
            "{msg}"
        );
        let bad = DeviceDecoder {
            rank: 0,
            device: Device::Cpu,
            vae: Box::new(Failing { refuse: true }),
        };
        let e = bad
            .decode("GPU 0", &latents, Kind::Image, |_| {})
            .unwrap_err();
        assert_eq!(e.field(), Some("latents"), "{e}");
        assert_eq!(e.http_status(), 422);
    }
}
