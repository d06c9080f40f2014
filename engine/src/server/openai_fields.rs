//! The fields of OpenAI's image and video requests that this server has no knob of its own
//! for, which OpenAI's clients and the gateways in front of a server (that fill in their
//! defaults) send anyway. Each is taken out of the body before the request is read as its
//! type, which still refuses any other name it does not have: honoured where it maps
//! (`size: "auto"` is the model's native size, `output_format: "png"` and `background:
//! "opaque"`/`"auto"` and `stream: false` are what the server does, `safety_identifier` and
//! `user` go into the request's log line), refused with a 422 naming it where it asks for
//! what the server cannot make (a JPEG, a GIF's frames, a transparent background, a
//! stream), and otherwise ignored: the names ignored come back in the
//! `x-ignored-fields` response header and are logged, as vLLM logs the fields it ignores.
//! Their values are still checked against OpenAI's own, so a typo is a 422, not silence.

use axum::http::HeaderValue;
use axum::response::{IntoResponseParts, ResponseParts};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use utoipa::openapi::schema::Schema;
use utoipa::openapi::{OpenApi, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::body::Fields;
use super::field;
use crate::Error;

/// The response header that lists, comma-separated, the fields a request gave that the
/// server accepted and ignored.
pub const IGNORED_HEADER: &str = "x-ignored-fields";

/// Which API's fields a body may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/images/generations` and `POST /v1/jobs`.
    Images,
    /// `POST /v1/videos`.
    Videos,
}

impl Api {
    fn names(self) -> &'static [&'static str] {
        match self {
            Api::Images => &[
                "quality",
                "style",
                "complexity",
                "moderation",
                "output_compression",
                "partial_images",
                "user",
                "safety_identifier",
                "output_format",
                "background",
                "stream",
                "frame_count",
                "frame_duration_ms",
                "svg",
            ],
            // OpenAI's video API has no such fields; gateways attach `user` to everything.
            Api::Videos => &["user"],
        }
    }
}

/// OpenAI's image fields, as this server reads them (merged into the image request's
/// schema in the OpenAPI document by [`document`]).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OpenAiImageFields {
    /// OpenAI's quality; accepted and ignored (listed in `x-ignored-fields`): the quality
    /// here is `steps`'.
    #[serde(default, deserialize_with = "field::string")]
    #[schema(value_type = Option<Quality>)]
    pub quality: Option<String>,
    /// OpenAI's DALL-E 3 style; accepted and ignored (listed in `x-ignored-fields`).
    #[serde(default, deserialize_with = "field::string")]
    #[schema(value_type = Option<Style>)]
    pub style: Option<String>,
    /// OpenAI's planning effort; accepted and ignored (listed in `x-ignored-fields`).
    #[serde(default, deserialize_with = "field::string")]
    #[schema(value_type = Option<Complexity>)]
    pub complexity: Option<String>,
    /// Streamed partial images, 0-3; accepted and ignored (listed in `x-ignored-fields`):
    /// this server does not stream.
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(minimum = 0, maximum = 3)]
    pub partial_images: Option<u64>,
    /// The end user (deprecated by OpenAI for `safety_identifier`): recorded in the
    /// server's log line of the request.
    #[serde(default, deserialize_with = "field::string")]
    pub user: Option<String>,
    /// A stable end-user identifier for abuse tracing: recorded in the server's log line
    /// of the request (before `user` when both are given).
    #[serde(default, deserialize_with = "field::string")]
    pub safety_identifier: Option<String>,
    /// `false`: the answer comes whole, as here (`true` is a 422: this server does not
    /// stream).
    #[serde(default, deserialize_with = "flag")]
    pub stream: Option<bool>,
    /// GIF output's frames: a 422, as this server writes no GIFs.
    #[serde(default, deserialize_with = "field::integer")]
    pub frame_count: Option<u64>,
    /// GIF output's frame delay: a 422, as this server writes no GIFs.
    #[serde(default, deserialize_with = "field::integer")]
    pub frame_duration_ms: Option<u64>,
    /// SVG output's author: a 422, as this server writes no SVGs.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub svg: Option<Value>,
    /// The image format: `png`, what this server writes (`jpeg` and `webp` are a 422).
    #[serde(default, deserialize_with = "field::string")]
    #[schema(value_type = Option<ImageFormat>)]
    pub output_format: Option<String>,
    /// `auto` or `opaque`, what this server makes (`transparent` is a 422).
    #[serde(default, deserialize_with = "field::string")]
    #[schema(value_type = Option<Background>)]
    pub background: Option<String>,
    /// OpenAI's content moderation level; accepted and ignored (listed in
    /// `x-ignored-fields`): this server moderates nothing.
    #[serde(default, deserialize_with = "field::string")]
    #[schema(value_type = Option<Moderation>)]
    pub moderation: Option<String>,
    /// JPEG and WebP compression, 0-100; accepted and ignored (listed in
    /// `x-ignored-fields`): PNG is lossless.
    #[serde(default, deserialize_with = "field::integer")]
    #[schema(minimum = 0, maximum = 100)]
    pub output_compression: Option<u64>,
}

/// A boolean: JSON's, or a form's `true`/`false`.
fn flag<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    struct Flag(bool);
    impl<'de> Deserialize<'de> for Flag {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            match d.deserialize_any(field::AnyValue)? {
                Value::Bool(b) => Ok(Flag(b)),
                Value::String(s) if s == "true" || s == "false" => Ok(Flag(s == "true")),
                v => Err(D::Error::custom(format!("{v}: expected true or false"))),
            }
        }
    }
    Ok(Option::<Flag>::deserialize(d)?.map(|f| f.0))
}

/// OpenAI's video fields this server takes beside its own (see [`Api::Videos`]).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OpenAiVideoFields {
    /// The end user, for abuse tracing: recorded in the server's log line of the request.
    #[serde(default, deserialize_with = "field::string")]
    pub user: Option<String>,
}

/// OpenAI's image qualities.
#[derive(ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum Quality {
    Auto,
    Max,
    Xhigh,
    High,
    Medium,
    Low,
    Hd,
    Standard,
}

/// OpenAI's DALL-E 3 styles.
#[derive(ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum Style {
    Vivid,
    Natural,
}

/// OpenAI's planning efforts.
#[derive(ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum Complexity {
    Low,
    Medium,
    High,
}

/// The image format this server writes.
#[derive(ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum ImageFormat {
    Png,
}

/// The backgrounds this server makes.
#[derive(ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum Background {
    Auto,
    Opaque,
}

/// OpenAI's moderation levels.
#[derive(ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum Moderation {
    Auto,
    Low,
}

/// What OpenAI's fields of one request came to: what was ignored and who asked.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Tolerated {
    /// The fields given and ignored, in the order [`Api::names`] lists them.
    pub ignored: Vec<&'static str>,
    /// Who asked: `safety_identifier`, else `user`, as given.
    pub user: Option<String>,
}

impl Tolerated {
    /// Writes the request's log line when it carried any of OpenAI's fields: the user it
    /// names, and what was ignored.
    pub fn log(&self, job: &str) {
        if self.user.is_some() || !self.ignored.is_empty() {
            tracing::info!(
                job,
                user = self.user.as_deref().unwrap_or(""),
                ignored = %self.ignored.join(","),
                "request with OpenAI fields"
            );
        }
    }
}

/// The ignored fields' names in [`IGNORED_HEADER`], when there are any.
impl IntoResponseParts for Tolerated {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        if !self.ignored.is_empty() {
            let names = HeaderValue::from_str(&self.ignored.join(", "))
                .expect("field names are header-safe");
            res.headers_mut().insert(IGNORED_HEADER, names);
        }
        Ok(res)
    }
}

/// Takes OpenAI's fields of `api` out of `fields` (and `size: "auto"`, which leaves the
/// size to the model's native one), checks them, and says what came of them. What remains
/// is read as the request's type, which refuses any other name.
pub fn take(fields: &mut Fields, api: Api) -> Result<Tolerated, Error> {
    if api == Api::Images && fields.text("size").is_some_and(|s| s.trim() == "auto") {
        fields.remove("size");
    }
    let taken = fields.split_off(api.names());
    match api {
        Api::Images => images(taken.parse()?),
        Api::Videos => {
            let f: OpenAiVideoFields = taken.parse()?;
            Ok(Tolerated {
                ignored: Vec::new(),
                user: f.user,
            })
        }
    }
}

fn images(f: OpenAiImageFields) -> Result<Tolerated, Error> {
    let one_of = |name: &str, v: &Option<String>, allowed: &[&str], why: &str| match v {
        Some(v) if !allowed.contains(&v.as_str()) => Err(Error::invalid(
            name,
            format!("`{v}`: {why}, expected one of {}", allowed.join(", ")),
        )),
        _ => Ok(()),
    };
    one_of(
        "quality",
        &f.quality,
        &[
            "auto", "max", "xhigh", "high", "medium", "low", "hd", "standard",
        ],
        "not one of OpenAI's qualities",
    )?;
    one_of(
        "style",
        &f.style,
        &["vivid", "natural"],
        "not one of OpenAI's styles",
    )?;
    one_of(
        "complexity",
        &f.complexity,
        &["low", "medium", "high"],
        "not one of OpenAI's efforts",
    )?;
    one_of(
        "moderation",
        &f.moderation,
        &["auto", "low"],
        "not one of OpenAI's levels",
    )?;
    one_of(
        "output_format",
        &f.output_format,
        &["png"],
        "this server writes PNG images only",
    )?;
    one_of(
        "background",
        &f.background,
        &["auto", "opaque"],
        "this server makes opaque images only",
    )?;
    if let Some(c) = f.output_compression.filter(|c| *c > 100) {
        return Err(Error::invalid(
            "output_compression",
            format!("{c}: expected a percentage, 0 to 100"),
        ));
    }
    if let Some(p) = f.partial_images.filter(|p| *p > 3) {
        return Err(Error::invalid(
            "partial_images",
            format!("{p}: expected 0 to 3"),
        ));
    }
    if f.stream == Some(true) {
        return Err(Error::invalid(
            "stream",
            "this server does not stream; give `false` or leave it out",
        ));
    }
    for (name, given, format) in [
        ("frame_count", f.frame_count.is_some(), "GIF"),
        ("frame_duration_ms", f.frame_duration_ms.is_some(), "GIF"),
        ("svg", f.svg.as_ref().is_some_and(|v| !v.is_null()), "SVG"),
    ] {
        if given {
            return Err(Error::invalid(
                name,
                format!("only for {format} output, and this server writes PNG images only"),
            ));
        }
    }
    let given = [
        ("quality", f.quality.is_some()),
        ("style", f.style.is_some()),
        ("complexity", f.complexity.is_some()),
        ("moderation", f.moderation.is_some()),
        ("output_compression", f.output_compression.is_some()),
        ("partial_images", f.partial_images.is_some()),
    ];
    let non_empty = |u: Option<String>| u.filter(|u| !u.is_empty());
    Ok(Tolerated {
        ignored: given.iter().filter(|g| g.1).map(|g| g.0).collect(),
        user: non_empty(f.safety_identifier).or(non_empty(f.user)),
    })
}

/// Puts OpenAI's fields in the document: their properties into the image and video
/// requests' schemas, `"auto"` among the image `size`s, and [`IGNORED_HEADER`] on the
/// answers of the requests that take them.
pub fn document(doc: &mut OpenApi) {
    let Some(components) = doc.components.as_mut() else {
        return;
    };
    // The value sets the fields' schemas refer to by name.
    for (name, schema) in [
        (Quality::name(), Quality::schema()),
        (Style::name(), Style::schema()),
        (Complexity::name(), Complexity::schema()),
        (ImageFormat::name(), ImageFormat::schema()),
        (Background::name(), Background::schema()),
        (Moderation::name(), Moderation::schema()),
    ] {
        components.schemas.insert(name.into_owned(), schema);
    }
    for (name, extra) in [
        ("ImageRequest", OpenAiImageFields::schema()),
        ("VideoRequest", OpenAiVideoFields::schema()),
    ] {
        let (Some(RefOr::T(Schema::Object(target))), RefOr::T(Schema::Object(extra))) =
            (components.schemas.get_mut(name), extra)
        else {
            continue;
        };
        target.properties.extend(extra.properties);
        if name == "ImageRequest" {
            if let Some(RefOr::T(Schema::Object(size))) = target.properties.get_mut("size") {
                size.pattern = Some("^([0-9]+x[0-9]+|auto)$".into());
                let said = size.description.take().unwrap_or_default();
                size.description = Some(format!("{said} `auto`: the model's native size."));
            }
        }
    }
    for (path, status) in [("/v1/images/generations", "200"), ("/v1/jobs", "202")] {
        let response = doc
            .paths
            .paths
            .get_mut(path)
            .and_then(|p| p.post.as_mut())
            .and_then(|op| op.responses.responses.get_mut(status));
        if let Some(RefOr::T(r)) = response {
            r.headers.insert(
                IGNORED_HEADER.into(),
                RefOr::T(
                utoipa::openapi::header::HeaderBuilder::new()
                    .schema(Some(String::schema()))
                    .description(Some(
                        "OpenAI fields the request gave that the server accepted and ignored, comma-separated",
                    ))
                    .build()),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Map};

    use super::*;
    use crate::server::requests::ImageRequest;

    fn fields(v: Value) -> Fields {
        let Value::Object(o) = v else { unreachable!() };
        Fields::json(o)
    }

    #[test]
    fn openai_image_fields_are_honoured_ignored_or_refused() {
        let mut f = fields(json!({
            "prompt": "a fox", "size": "auto", "quality": "high", "style": "vivid",
            "user": "u-1", "output_format": "png", "background": "opaque",
            "moderation": "low", "output_compression": 80, "complexity": "low",
            "partial_images": 0, "stream": false, "safety_identifier": "",
        }));
        let t = take(&mut f, Api::Images).unwrap();
        assert_eq!(
            t,
            Tolerated {
                ignored: vec![
                    "quality",
                    "style",
                    "complexity",
                    "moderation",
                    "output_compression",
                    "partial_images"
                ],
                user: Some("u-1".into()),
            }
        );
        // `size: "auto"` is the native size: no size is left for the request.
        let r: ImageRequest = f.parse().unwrap();
        assert_eq!((r.size, r.prompt.as_deref()), (None, Some("a fox")));
    }

    #[test]
    fn what_cannot_be_honoured_or_is_not_openai_is_refused_by_name() {
        for (body, field) in [
            (json!({ "output_format": "jpeg" }), "output_format"),
            (json!({ "background": "transparent" }), "background"),
            (json!({ "quality": "ultra" }), "quality"),
            (json!({ "output_compression": 101 }), "output_compression"),
            (json!({ "user": 5 }), "user"),
            (json!({ "stream": true }), "stream"),
            (json!({ "frame_count": 4 }), "frame_count"),
            (json!({ "svg": {} }), "svg"),
        ] {
            let e = take(&mut fields(body.clone()), Api::Images).unwrap_err();
            assert_eq!(e.field(), Some(field), "{body}: {e}");
        }
        // A name OpenAI does not have stays a 422 of the request's own type.
        let mut f = fields(json!({ "prompt": "a fox", "sharpness": 3 }));
        take(&mut f, Api::Images).unwrap();
        assert_eq!(
            f.parse::<ImageRequest>().unwrap_err().field(),
            Some("sharpness")
        );
        // Image fields are not video fields.
        let mut f = fields(json!({ "quality": "high", "user": "u" }));
        let t = take(&mut f, Api::Videos).unwrap();
        assert_eq!(t.user.as_deref(), Some("u"));
        assert_eq!(f.parse::<Map<String, Value>>().unwrap().len(), 1);
    }

    #[test]
    fn a_form_carries_them_as_text() {
        let mut f = Fields::form([("output_compression", "50"), ("size", "auto"), ("n", "1")]);
        let t = take(&mut f, Api::Images).unwrap();
        assert_eq!(t.ignored, ["output_compression"]);
        assert_eq!(f.parse::<ImageRequest>().unwrap().size, None);
    }
}
