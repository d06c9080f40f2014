//! What a generation request's values mean: each field, as serde read it, checked against
//! the server's bounds and then the model, and named when it is wrong, before anything is
//! queued. Images and videos share [`request`]'s checks; a video adds its length.

use super::models::check_model_name;
use super::state::AppState;
use crate::execution::work::{Condition, Request, DEFAULT_MAX_SEQUENCE_LENGTH};
use crate::server::requests::{Generation, ImageRequest, ResponseFormat, VideoRequest};
use crate::Error;

/// What every output of a request shares, checked against the server's
/// bounds; the model checks the rest when [`Model::validate`] sees the requests.
fn request(body: &Generation, s: &AppState, native: (usize, usize)) -> Result<Request, Error> {
    let b = &s.bounds;
    let family = &s.model.family;
    if let Some(m) = &body.model {
        check_model_name(s, m)?;
    }
    let condition = condition(body, s)?;
    let text = matches!(condition, Condition::Prompt { .. });
    let given = body.size.is_some();
    let (width, height) = body.size.map_or(native, |s| (s.width, s.height));
    let r = &b.request;
    if width as u64 > r.max_width || height as u64 > r.max_height {
        return Err(Error::invalid(
            "size",
            format!(
                "{width}x{height}{}: this server allows at most {}x{}",
                if given {
                    ""
                } else {
                    " (the model's native size, taken when `size` is not given)"
                },
                r.max_width,
                r.max_height
            ),
        ));
    }
    let (default_steps, default_guidance) = family.defaults();
    let steps = body
        .steps
        .unwrap_or(default_steps.min(r.max_steps as usize) as u64);
    if steps == 0 || steps > r.max_steps {
        return Err(Error::invalid(
            "steps",
            format!("{steps}: this server allows 1..={} steps", r.max_steps),
        ));
    }
    // A deployment sized for unguided requests runs them unguided unless asked otherwise.
    let default_guidance = if r.guidance { default_guidance } else { 1.0 };
    let guidance = body.guidance.map_or(default_guidance, |x| x as f32);
    let guidance_2 = body.guidance_2.map(|x| x as f32);
    for (field, g) in [("guidance", Some(guidance)), ("guidance_2", guidance_2)] {
        if let Some(g) = g.filter(|g| !(0.0..=MAX_GUIDANCE).contains(g)) {
            return Err(Error::invalid(
                field,
                format!("{g}: expected a scale in [0, {MAX_GUIDANCE}] (≤ 1 disables guidance)"),
            ));
        }
        if let Some(g) = g.filter(|g| *g > 1.0 && !r.guidance) {
            return Err(Error::invalid(
                field,
                format!("{g}: this deployment serves unguided requests only (workload.guidance: false); give a scale ≤ 1"),
            ));
        }
    }
    let max_sequence_length = match body.max_sequence_length {
        Some(_) if !text => {
            return Err(Error::invalid(
                "max_sequence_length",
                "this model is class-conditional and reads no prompt tokens",
            ))
        }
        Some(n) if n == 0 || n > b.request.max_prompt_tokens => {
            return Err(Error::invalid(
                "max_sequence_length",
                format!(
                    "{n}: this server allows 1..={} prompt tokens",
                    b.request.max_prompt_tokens
                ),
            ))
        }
        Some(n) => n as usize,
        None => DEFAULT_MAX_SEQUENCE_LENGTH.min(b.request.max_prompt_tokens as usize),
    };
    if guidance_2.is_some() && !text {
        return Err(Error::invalid(
            "guidance_2",
            "this model has one transformer; a second guidance scale needs two experts",
        ));
    }
    // The server's setting is the default and the bound; the model refuses a kind its
    // family cannot honour when it sees the request (the server's own was checked at
    // start, and a request may ask for no other).
    let cache = crate::cache::request_setting("cache", s.cache.as_ref(), body.cache.as_ref())?;
    Ok(Request {
        seed: body.seed.unwrap_or(0),
        cache,
        steps: steps as usize,
        guidance,
        guidance_2,
        max_sequence_length,
        ..Request::image(condition, width, height)
    })
}

/// The conditioning: a prompt for text families; for class-conditional ones a class
/// label, or a prompt naming one of the model's classes (what OpenAI clients send).
fn condition(body: &Generation, s: &AppState) -> Result<Condition, Error> {
    let family = &s.model.family;
    let (prompt, negative) = (body.prompt.clone(), body.negative_prompt.clone());
    let Some(classes) = family.classes() else {
        if body.class_label.is_some() {
            return Err(Error::invalid(
                "class_label",
                format!(
                    "the {} family is text-conditioned and takes no class label; send `prompt`",
                    family.name()
                ),
            ));
        }
        let prompt = prompt
            .ok_or_else(|| Error::invalid("prompt", "required: the text to generate from"))?;
        return Ok(Condition::Prompt { prompt, negative });
    };
    if negative.as_deref().is_some_and(|n| !n.trim().is_empty()) {
        return Err(Error::invalid(
            "negative_prompt",
            format!(
                "the {} family is class-conditional and takes no negative prompt",
                family.name()
            ),
        ));
    }
    let named = match prompt.as_deref().map(str::trim).filter(|p| !p.is_empty()) {
        None => None,
        Some(p) => Some(family.class_named(p).ok_or_else(|| {
            Error::invalid(
                "prompt",
                format!(
                    "`{p}` names no class of this model: it is class-conditional, so the prompt must be one of its class names (as its model_index.json id2label lists them), or empty beside `class_label` (0..{})",
                    classes - 1
                ),
            )
        })?),
    };
    let label = match body.class_label {
        None => None,
        Some(v) => Some(u32::try_from(v).map_err(|_| {
            Error::invalid(
                "class_label",
                format!("{v}: expected a non-negative integer"),
            )
        })?),
    };
    match (named, label) {
        (Some(n), Some(l)) if n != l => Err(Error::invalid(
            "class_label",
            format!("{l} disagrees with the prompt, which names class {n}; send one of them"),
        )),
        (Some(c), _) | (None, Some(c)) => Ok(Condition::Class(c)),
        (None, None) => Err(Error::invalid(
            "class_label",
            format!(
                "required: the class to draw (0..{}), or its name as `prompt`",
                classes - 1
            ),
        )),
    }
}

/// Each request as the model checks it, then split over the server's `sp` ranks: enough
/// latent tokens for each ([`crate::bounds::split_tokens`], what the family checks again
/// when a group takes it), so it is refused now rather than failing once queued.
fn validated(s: &AppState, requests: Vec<Request>) -> Result<Vec<Request>, Error> {
    let cost = s.model.checkpoint.activation_cost();
    for r in &requests {
        s.model.validate(r).map_err(|e| match e {
            Error::Core(layerwise_core::Error::Invalid { field, msg })
                if field == "width" || field == "height" =>
            {
                Error::invalid("size", format!("{field} {msg}"))
            }
            other => other,
        })?;
        let (w, h, f) = (r.width as u64, r.height as u64, r.frames as u64);
        crate::bounds::split_tokens(crate::bounds::latent_tokens(&cost, w, h, f), s.sp as u64)?;
    }
    Ok(requests)
}

/// Checks an image request (`/v1/images/generations`, `/v1/jobs`), its fields as serde
/// read them, against the server's bounds, then against the model. One `Request` per
/// image.
pub(super) fn parse_images(
    body: ImageRequest,
    s: &AppState,
) -> Result<(Vec<Request>, ResponseFormat), Error> {
    let (g, n, format) = body.split();
    let base = request(&g, s, s.model.family.native_size())?;
    let n = n.unwrap_or(1);
    let max_n = s.bounds.request.max_n;
    if n == 0 || n > max_n {
        return Err(Error::invalid(
            "n",
            format!("{n}: this server generates 1..={max_n} images per request"),
        ));
    }
    let format = format.unwrap_or(ResponseFormat::B64Json);
    let requests = (0..n)
        .map(|i| Request {
            seed: base.seed.wrapping_add(i),
            ..base.clone()
        })
        .collect();
    Ok((validated(s, requests)?, format))
}

/// Checks a video request (`POST /v1/videos`) as [`parse_images`] does an image one: its
/// frames from `frames`, or from `seconds` × `fps` rounded up to a length the model makes.
pub(super) fn parse_video(body: VideoRequest, s: &AppState) -> Result<(Request, f64), Error> {
    let (g, length) = body.split();
    let family = &s.model.family;
    let spec = family.video().ok_or_else(|| {
        Error::invalid(
            "model",
            format!(
                "the {} family makes images only; POST /v1/images/generations",
                family.name()
            ),
        )
    })?;
    let mut r = request(&g, s, family.native_size())?;
    let fps = crate::bounds::check_fps("fps", length.fps.unwrap_or(spec.default_fps))?;
    let max = s.bounds.request.max_frames as usize;
    r.frames = match (length.frames, length.seconds) {
        (Some(_), Some(_)) => {
            return Err(Error::invalid(
                "seconds",
                "give `seconds` or `frames`, not both",
            ))
        }
        (Some(f), None) => {
            if f as usize > max {
                return Err(Error::invalid(
                    "frames",
                    format!("{f}: this server makes at most {max} frames per clip"),
                ));
            }
            f as usize
        }
        (None, Some(secs)) => {
            if secs <= 0.0 {
                return Err(Error::invalid(
                    "seconds",
                    format!("{secs}: must be positive"),
                ));
            }
            let want = (secs * fps).ceil();
            let frames = if want > max as f64 {
                usize::MAX
            } else {
                spec.round_up(want as usize)
            };
            if frames > max {
                return Err(Error::invalid(
                    "seconds",
                    format!(
                        "{secs} s at {fps} fps needs {want} frames; this server makes at most {max} frames per clip ({:.2} s at {fps} fps)",
                        max as f64 / fps
                    ),
                ));
            }
            frames
        }
        (None, None) => {
            let unit = spec.frames_per_latent.max(1);
            spec.default_frames.min((max.max(1) - 1) / unit * unit + 1)
        }
    };
    r.fps = Some(fps);
    let mut v = validated(s, vec![r])?;
    Ok((v.remove(0), fps))
}

/// The largest guidance scale taken: far past any model's useful range (diffusers' defaults
/// are 4–5), where outputs saturate to nothing.
pub(super) const MAX_GUIDANCE: f32 = 100.0;
