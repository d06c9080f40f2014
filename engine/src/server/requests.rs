//! What each endpoint takes, as types: the bodies of the generation requests and the query
//! strings. serde reads them ([`super::body`]: JSON, or a form's text read as each field's
//! type) and the OpenAPI document is derived from the same definitions, so a field is taken
//! exactly when the document lists it. What a value means for the served model (its bounds,
//! its family) is checked after, by the handlers.

use serde::de::{Deserializer, Error as _};
use serde::Deserialize;
use utoipa::openapi::schema::{ObjectBuilder, Schema, SchemaType, Type};
use utoipa::{IntoParams, ToSchema};

use super::field::{self, AnyValue};
use crate::Error;

/// The fields every generation request has, whichever endpoint took it (each as the
/// request types document it).
#[derive(Debug, Clone, Default)]
pub struct Generation {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub negative_prompt: Option<String>,
    pub size: Option<Size>,
    pub steps: Option<u64>,
    pub guidance: Option<f64>,
    pub guidance_2: Option<f64>,
    pub seed: Option<u64>,
    pub max_sequence_length: Option<u64>,
    pub class_label: Option<u64>,
    /// The step cache asked for ([`super::cache_field`]), as given.
    pub cache: Option<serde_json::Value>,
}

/// An image request (`POST /v1/images/generations`, `POST /v1/jobs`). Class-conditional
/// families (DiT) take `class_label`, or `prompt` naming one of the model's classes (its
/// id2label names, any case), or an empty `prompt` beside `class_label`; text families
/// (Wan) take `prompt` and `negative_prompt`. A field the model's family cannot use is a 422
/// naming it, and so is any field not listed here. In JSON, integer and number fields are
/// JSON numbers (a string such as "5" is a 422 naming the field); in multipart/form-data
/// every value is text and those fields are read from it. Every text value is UTF-8
/// (anything else is a 400).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ImageRequest {
    /// The served model's name (GET /v1/models); another name is a 404.
    #[serde(default, deserialize_with = "field::string")]
    pub model: Option<String>,
    /// Text families: what to draw. Class-conditional families: a class name, or empty
    /// beside class_label.
    #[serde(default, deserialize_with = "field::string")]
    pub prompt: Option<String>,
    /// Text families: what to steer away from under guidance.
    #[serde(default, deserialize_with = "field::string")]
    #[schema(default = "")]
    pub negative_prompt: Option<String>,
    /// WxH in pixels (default: the model's native size; at most --max-width x
    /// --max-height).
    #[serde(default)]
    #[schema(value_type = Option<String>, pattern = "^[0-9]+x[0-9]+$", examples("256x256"))]
    pub size: Option<Size>,
    /// Denoising steps (default: the family's, 25 for DiT, 50 for Wan; at most the server's
    /// --max-steps).
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(minimum = 1)]
    pub steps: Option<u64>,
    /// Classifier-free guidance scale (default: 4.0 for DiT, 5.0 for Wan); ≤ 1 disables it.
    #[serde(default, deserialize_with = "field::number")]
    #[schema(minimum = 0, maximum = 100)]
    pub guidance: Option<f64>,
    /// Two-expert models (Wan 2.2): the second (low-noise) expert's guidance scale
    /// (default: guidance).
    #[serde(default, deserialize_with = "field::number")]
    #[schema(minimum = 0, maximum = 100)]
    pub guidance_2: Option<f64>,
    /// The first image's noise seed; image i uses seed + i.
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(default = 0)]
    pub seed: Option<u64>,
    /// Text families: prompts are padded and truncated to this many tokens (default 512,
    /// at most --max-prompt-tokens); a longer prompt is a 422.
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(minimum = 1)]
    pub max_sequence_length: Option<u64>,
    /// Class-conditional families: the class to draw (0..N-1).
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(maximum = 4294967295.0)]
    pub class_label: Option<u64>,
    /// Extension: the step cache (see the schema's description).
    #[serde(default, deserialize_with = "super::cache_field::setting")]
    #[schema(schema_with = super::cache_field::schema)]
    pub cache: Option<serde_json::Value>,
    /// Images (at most --max-n); image i uses seed + i.
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(minimum = 1, default = 1)]
    pub n: Option<u64>,
    /// How the images come back: `b64_json` in the answer, or `url`s of the job's results.
    #[serde(default)]
    #[schema(inline, default = "b64_json")]
    pub response_format: Option<ResponseFormat>,
}

impl ImageRequest {
    /// The fields every generation request has, then `n` and `response_format`.
    pub fn split(self) -> (Generation, Option<u64>, Option<ResponseFormat>) {
        let ImageRequest {
            model,
            prompt,
            negative_prompt,
            size,
            steps,
            guidance,
            guidance_2,
            seed,
            max_sequence_length,
            class_label,
            cache,
            n,
            response_format,
        } = self;
        let common = Generation {
            model,
            prompt,
            negative_prompt,
            size,
            steps,
            guidance,
            guidance_2,
            seed,
            max_sequence_length,
            class_label,
            cache,
        };
        (common, n, response_format)
    }
}

/// An output's size, `"WxH"` in pixels: exactly what the published schema's pattern
/// ([`SIZE_PATTERN`]) takes, decimal digits on either side of a lower-case `x`, so a value
/// the document refuses is never taken (no blanks, no sign, no `X`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    pub width: usize,
    pub height: usize,
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = d.deserialize_str(AnyValue)?;
        let Some(s) = v.as_str() else {
            return Err(D::Error::custom(format!("{v}: expected a string \"WxH\"")));
        };
        let bad = || D::Error::custom(format!("`{s}`: expected \"WxH\", e.g. \"256x256\""));
        // `str::parse` takes a leading `+`: only digits pass here, as the pattern says.
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        let (w, h) = s.split_once('x').ok_or_else(bad)?;
        if !(digits(w) && digits(h)) {
            return Err(bad());
        }
        let number = |t: &str| {
            t.parse().map_err(|_| {
                D::Error::custom(format!("`{s}`: {t} pixels is more than any server allows"))
            })
        };
        Ok(Size {
            width: number(w)?,
            height: number(h)?,
        })
    }
}

/// The pattern the document gives `size` (the request types' attributes spell it out, as
/// their macro wants a literal; a test holds them to this), which [`Size`]'s reader follows
/// exactly.
pub const SIZE_PATTERN: &str = "^[0-9]+x[0-9]+$";

/// How an image request's images come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Base64 PNGs in the answer.
    B64Json,
    /// The URL of each PNG (`GET /v1/jobs/{id}/result?index=i`).
    Url,
}

impl<'de> Deserialize<'de> for ResponseFormat {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = d.deserialize_str(AnyValue)?;
        match v.as_str() {
            Some("b64_json") => Ok(ResponseFormat::B64Json),
            Some("url") => Ok(ResponseFormat::Url),
            _ => Err(D::Error::custom(format!(
                "{v}: expected \"b64_json\" or \"url\""
            ))),
        }
    }
}

/// A text-to-video request (`POST /v1/videos`), as JSON or as multipart/form-data (what
/// OpenAI's client sends; every value a string). The clip's length is `frames`, or
/// `seconds` × `fps` rounded up to a length the model makes (1 + 4k frames for Wan);
/// giving both is a 422. A field the model's family cannot use is a 422 naming it, and so
/// is any field not listed here. In JSON, integer and number fields are JSON numbers (a
/// string such as "5" is a 422 naming the field); in multipart/form-data every value is
/// text and those fields are read from it. Every text value is UTF-8 (anything else is a
/// 400).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VideoRequest {
    /// The served model's name (GET /v1/models); another name is a 404.
    #[serde(default, deserialize_with = "field::string")]
    pub model: Option<String>,
    /// What to film (required by text families).
    #[serde(default, deserialize_with = "field::string")]
    pub prompt: Option<String>,
    /// What to steer away from under guidance.
    #[serde(default, deserialize_with = "field::string")]
    #[schema(default = "")]
    pub negative_prompt: Option<String>,
    /// WxH in pixels (default: the model's native size, 832x480 for Wan; at most
    /// --max-width x --max-height); multiples of 16 for Wan.
    #[serde(default)]
    #[schema(value_type = Option<String>, pattern = "^[0-9]+x[0-9]+$", examples("832x480"))]
    pub size: Option<Size>,
    /// Denoising steps (default: the family's, 50 for Wan; at most --max-steps).
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(minimum = 1)]
    pub steps: Option<u64>,
    /// Classifier-free guidance scale (default: 5.0 for Wan); ≤ 1 disables it.
    #[serde(default, deserialize_with = "field::number")]
    #[schema(minimum = 0, maximum = 100)]
    pub guidance: Option<f64>,
    /// Two-expert models (Wan 2.2): the second (low-noise) expert's guidance scale
    /// (default: guidance).
    #[serde(default, deserialize_with = "field::number")]
    #[schema(minimum = 0, maximum = 100)]
    pub guidance_2: Option<f64>,
    /// The noise seed.
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(default = 0)]
    pub seed: Option<u64>,
    /// Prompts are padded and truncated to this many tokens (default 512, at most
    /// --max-prompt-tokens); a longer prompt is a 422.
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(minimum = 1)]
    pub max_sequence_length: Option<u64>,
    /// Class-conditional families: the class to film (0..N-1); a text family's 422.
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(maximum = 4294967295.0)]
    pub class_label: Option<u64>,
    /// Extension: the step cache (see the schema's description).
    #[serde(default, deserialize_with = "super::cache_field::setting")]
    #[schema(schema_with = super::cache_field::schema)]
    pub cache: Option<serde_json::Value>,
    /// Clip length in seconds, a string or a number (documented by [`seconds_schema`]).
    #[serde(default, deserialize_with = "field::number_or_text")]
    #[schema(schema_with = seconds_schema)]
    pub seconds: Option<f64>,
    /// Frames of the clip (1 + 4k for Wan; default 81, or the most under --max-frames).
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(minimum = 1)]
    pub frames: Option<u64>,
    /// Frames per second the MP4 plays at, 0.1 to 240 (default: the family's, 16 for Wan);
    /// Cosmos3 also conditions on it.
    #[serde(default, deserialize_with = "field::number")]
    #[schema(minimum = 0.1, maximum = 240)]
    pub fps: Option<f64>,
}

impl VideoRequest {
    /// The fields every generation request has, then `seconds`, `frames` and `fps`.
    pub fn split(self) -> (Generation, VideoLength) {
        let VideoRequest {
            model,
            prompt,
            negative_prompt,
            size,
            steps,
            guidance,
            guidance_2,
            seed,
            max_sequence_length,
            class_label,
            cache,
            seconds,
            frames,
            fps,
        } = self;
        let common = Generation {
            model,
            prompt,
            negative_prompt,
            size,
            steps,
            guidance,
            guidance_2,
            seed,
            max_sequence_length,
            class_label,
            cache,
        };
        let length = VideoLength {
            seconds,
            frames,
            fps,
        };
        (common, length)
    }
}

/// A video request's length and frame rate, as given (see [`VideoRequest`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct VideoLength {
    /// Seconds of clip at `fps`.
    pub seconds: Option<f64>,
    /// Frames of clip (not beside `seconds`).
    pub frames: Option<u64>,
    /// Frames per second.
    pub fps: Option<f64>,
}

/// `seconds` of a video request: OpenAI's video API sends a string ("4"); a number is
/// taken too. (A schema of its own replaces the field's, doc comment and all.)
fn seconds_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Number, Type::Null]))
        .description(Some(
            "Clip length in seconds, a string or a number (× fps, rounded up to a valid frame count); beyond --max-frames is a 422 naming `seconds`.",
        ))
        .into()
}

/// `GET /v1/jobs/{id}/result`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ResultQuery {
    /// Which output of the job (0..n).
    #[param(minimum = 0, default = 0)]
    pub index: Option<usize>,
}

/// `GET /v1/videos`: a page of the video jobs the server holds.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// The id of the last video of the previous page.
    pub after: Option<String>,
    /// Videos per page.
    #[param(minimum = 1, maximum = 100, default = 20)]
    pub limit: Option<usize>,
    /// `desc`: newest first; `asc`: oldest first.
    #[param(inline, value_type = Option<Order>)]
    pub order: Option<String>,
}

/// The order of a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// Oldest first.
    Asc,
    /// Newest first.
    #[default]
    Desc,
}

impl Order {
    /// The `order` a list query names (`desc` when it names none).
    pub fn of(order: Option<&str>) -> Result<Self, Error> {
        match order.unwrap_or("desc") {
            "desc" => Ok(Order::Desc),
            "asc" => Ok(Order::Asc),
            other => Err(Error::invalid(
                "order",
                format!("`{other}`: expected `asc` or `desc`"),
            )),
        }
    }
}

/// `GET /v1/videos/{id}/content`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ContentQuery {
    /// `video`: the clip (MP4); `thumbnail`: its first frame (PNG).
    #[param(inline, value_type = Option<Variant>)]
    pub variant: Option<String>,
}

/// What of a video to download.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Variant {
    /// The clip, H.264 in MP4.
    #[default]
    Video,
    /// Its first frame, as PNG.
    Thumbnail,
}

impl Variant {
    /// The `variant` a content query names (`video` when it names none).
    pub fn of(variant: Option<&str>) -> Result<Self, Error> {
        match variant.unwrap_or("video") {
            "video" => Ok(Variant::Video),
            "thumbnail" => Ok(Variant::Thumbnail),
            other => Err(Error::invalid(
                "variant",
                format!(
                    "`{other}`: this server has `video` (MP4) and `thumbnail` (PNG of the first frame)"
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde::de::DeserializeOwned;
    use serde_json::{json, Map, Value};
    use utoipa::PartialSchema;

    use super::*;
    use crate::server::body::Fields;

    /// The JSON types the document gives a property (`null` aside), and the values it lists
    /// (its enum or its examples).
    fn documented(p: &Value) -> (Vec<String>, Vec<Value>) {
        let (mut types, mut values) = (Vec::new(), Vec::new());
        let parts = p["oneOf"].as_array().cloned().unwrap_or(vec![p.clone()]);
        for part in &parts {
            match &part["type"] {
                Value::String(t) => types.push(t.clone()),
                Value::Array(ts) => types.extend(ts.iter().map(|t| t.as_str().unwrap().into())),
                t => panic!("{p}: type {t}"),
            }
            values.extend(part["enum"].as_array().cloned().unwrap_or_default());
            values.extend(part["examples"].as_array().cloned().unwrap_or_default());
        }
        types.retain(|t| t != "null");
        (types, values)
    }

    /// Each field of `T` takes the JSON types the document gives it (and `null`, as absent),
    /// and a form's text read as one of them; a value of any other type is a 422 naming the
    /// field, which says so when a number came as a string.
    fn fields_take_their_documented_types<T: DeserializeOwned + PartialSchema + std::fmt::Debug>() {
        let schema = serde_json::to_value(T::schema()).unwrap();
        let properties = schema["properties"].as_object().unwrap();
        assert!(!properties.is_empty());
        for (name, p) in properties {
            let (types, values) = documented(p);
            let json = |v: Value| Fields::json(Map::from_iter([(name.clone(), v)])).parse::<T>();
            let form = |t: &str| Fields::form([(name.as_str(), t)]).parse::<T>();
            let sample = |t: &str| match t {
                "integer" => json!(3),
                "number" => json!(2.5),
                "string" => values.first().cloned().unwrap_or(json!("3")),
                "object" => json!({"kind": "off"}),
                t => panic!("{name}: no sample of {t}"),
            };
            assert!(json(Value::Null).is_ok(), "{name}: null");
            for t in &types {
                let v = sample(t);
                assert!(json(v.clone()).is_ok(), "{name}: {v}");
                let text = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                assert!(form(&text).is_ok(), "{name}: form text {text}");
            }
            let others = [json!("3"), json!(3), json!(2.5), json!(true), json!([3])];
            for v in others {
                let fits = match &v {
                    Value::String(_) => types.contains(&"string".into()),
                    Value::Number(n) if n.is_u64() => {
                        types.contains(&"integer".into()) || types.contains(&"number".into())
                    }
                    Value::Number(_) => types.contains(&"number".into()),
                    _ => false,
                };
                if fits {
                    continue;
                }
                match json(v.clone()) {
                    Err(Error::Core(layerwise_core::Error::Invalid { field, msg })) => {
                        assert_eq!(&field, name, "{v}: {msg}");
                        let numeric = types.iter().any(|t| t == "integer" || t == "number");
                        if v.is_string() && numeric && types.len() == 1 {
                            assert!(msg.contains("not a string"), "{name}: {msg}");
                        }
                    }
                    other => panic!("{name} took {v}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn image_request_fields_take_their_documented_types() {
        fields_take_their_documented_types::<ImageRequest>();
    }

    #[test]
    fn video_request_fields_take_their_documented_types() {
        fields_take_their_documented_types::<VideoRequest>();
    }

    #[test]
    fn requests_split_into_what_they_share_and_their_own() {
        let body = json!({ "prompt": "a fox", "steps": 4, "n": 2, "response_format": "url" });
        let Value::Object(o) = body else {
            unreachable!()
        };
        let (g, n, format) = Fields::json(o).parse::<ImageRequest>().unwrap().split();
        assert_eq!(
            (g.prompt.as_deref(), g.steps, n, format),
            (Some("a fox"), Some(4), Some(2), Some(ResponseFormat::Url))
        );
        let (g, length) = Fields::form([("seconds", "4"), ("fps", "8"), ("seed", "7")])
            .parse::<VideoRequest>()
            .unwrap()
            .split();
        assert_eq!(
            (g.seed, length.seconds, length.fps, length.frames),
            (Some(7), Some(4.0), Some(8.0), None)
        );
    }

    #[test]
    fn sizes_are_read_as_width_and_height_or_named() {
        let size = |v: Value| {
            Fields::json(Map::from_iter([("size".to_string(), v)]))
                .parse::<ImageRequest>()
                .map(|r| r.size)
        };
        let want = Size {
            width: 64,
            height: 32,
        };
        assert_eq!(size(json!("64x32")).unwrap(), Some(want));
        assert_eq!(size(json!("064x032")).unwrap(), Some(want));
        for (v, said) in [
            (json!(64), "64: expected a string \"WxH\""),
            (json!("big"), "`big`: expected \"WxH\", e.g. \"256x256\""),
            (json!("64x"), "`64x`: expected \"WxH\", e.g. \"256x256\""),
            (
                json!("99999999999999999999x1"),
                "`99999999999999999999x1`: 99999999999999999999 pixels is more than any server allows",
            ),
        ] {
            match size(v) {
                Err(Error::Core(layerwise_core::Error::Invalid { field, msg })) => {
                    assert_eq!((&*field, &*msg), ("size", said))
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// The reader takes a size exactly when the published schema's pattern does: blanks, a
    /// sign, an upper-case `X` or a second `x` are refused, naming `size`.
    #[test]
    fn sizes_are_taken_exactly_when_the_documented_pattern_matches() {
        let schema = serde_json::to_value(ImageRequest::schema()).unwrap();
        assert_eq!(schema["properties"]["size"]["pattern"], SIZE_PATTERN);
        let video = serde_json::to_value(VideoRequest::schema()).unwrap();
        assert_eq!(video["properties"]["size"]["pattern"], SIZE_PATTERN);
        // The pattern, read by hand: digits, `x`, digits, nothing else.
        let matches = |t: &str| {
            t.split_once('x').is_some_and(|(w, h)| {
                [w, h]
                    .iter()
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            })
        };
        for text in [
            "32x32",
            "1x1",
            " 32x32",
            "32x32 ",
            "32 x32",
            "32X32",
            "+32x32",
            "32x+32",
            "-32x32",
            "32x32x32",
            "x32",
            "32x",
            "",
            "３２x32",
            "32\u{00a0}x32",
            "0x32",
        ] {
            let got = Fields::json(Map::from_iter([("size".to_string(), json!(text))]))
                .parse::<ImageRequest>();
            match got {
                Ok(r) => assert!(matches(text), "took `{text}` as {:?}", r.size),
                Err(e) => {
                    assert!(!matches(text), "refused `{text}`: {e}");
                    assert_eq!(e.field(), Some("size"), "{text}");
                }
            }
        }
    }

    #[test]
    fn list_and_content_queries_name_their_field() {
        assert_eq!(Order::of(None).unwrap(), Order::Desc);
        assert_eq!(Order::of(Some("asc")).unwrap(), Order::Asc);
        assert_eq!(Variant::of(Some("thumbnail")).unwrap(), Variant::Thumbnail);
        assert_eq!(Order::of(Some("up")).unwrap_err().field(), Some("order"));
        assert_eq!(
            Variant::of(Some("gif")).unwrap_err().field(),
            Some("variant")
        );
    }
}
