//! A request body as the API reads it: JSON, or the multipart form OpenAI's clients send,
//! turned into a typed request ([`super::requests`]) by serde. Both become fields by name,
//! read the same way: a JSON value must have its field's type, a form's text is read as
//! that type. Whatever a body gets wrong is an error naming the field at fault (its type,
//! its text, a name no request has) or, for the body as a whole, saying what it is not.

use std::collections::{btree_map, BTreeMap};
use std::fmt;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::multipart::MultipartError;
use axum::extract::{FromRequest, Multipart, Request};
use axum::http::{header, StatusCode};
use serde::de::{self, DeserializeOwned, IntoDeserializer, MapAccess, Visitor};
use serde::forward_to_deserialize_any;
use serde_json::{Map, Value};

use crate::Error;

/// Reads `req`'s body (at most `limit` bytes, within `deadline`) as fields by name, for a
/// caller that takes some out before the rest is read as a type.
pub async fn read_fields(req: Request, limit: usize, deadline: Duration) -> Result<Fields, Error> {
    tokio::time::timeout(deadline, Fields::read(req, limit))
        .await
        .unwrap_or(Err(Error::RequestTimeout {
            seconds: deadline.as_secs(),
        }))
}

/// A body's fields by name. Name order, whichever way the body came (serde_json's maps
/// are ordered so), so of several faults the same one is named for JSON and for a form.
#[derive(Debug)]
pub struct Fields(BTreeMap<String, Raw>);

/// One field's value as it came.
#[derive(Debug)]
enum Raw {
    Json(Value),
    /// A form's text, read as the type its field asks for.
    Text(String),
}

impl Fields {
    /// The fields of a JSON object.
    pub fn json(o: Map<String, Value>) -> Self {
        Fields(o.into_iter().map(|(k, v)| (k, Raw::Json(v))).collect())
    }

    /// Form fields by name (each one once), as a multipart body gives them.
    #[cfg(test)]
    pub fn form<'a>(fields: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Fields(
            fields
                .into_iter()
                .map(|(k, v)| (k.to_string(), Raw::Text(v.to_string())))
                .collect(),
        )
    }

    /// The body of `req`: a JSON object, or multipart form data whose parts are text (files
    /// are refused by name). Only types a browser cannot send across origins without asking
    /// first (no text/plain or form-urlencoded bodies), and the form OpenAI's clients send.
    async fn read(req: Request, limit: usize) -> Result<Self, Error> {
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase();
        let essence = content_type.split(';').next().unwrap_or("").trim();
        if essence == "multipart/form-data" {
            return Self::read_form(req, limit).await;
        }
        if essence != "application/json" && !essence.ends_with("+json") {
            return Err(Error::UnsupportedMediaType {
                content_type: if essence.is_empty() {
                    "(none)".into()
                } else {
                    essence.into()
                },
            });
        }
        let bytes = Bytes::from_request(req, &()).await.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                Error::PayloadTooLarge { limit }
            } else {
                Error::BadRequest { msg: r.body_text() }
            }
        })?;
        // Named as a form's text is (serde_json's own message says only "invalid unicode").
        let text = std::str::from_utf8(&bytes).map_err(|e| Error::BadRequest {
            msg: format!("body is not valid UTF-8 (at byte {})", e.valid_up_to()),
        })?;
        match serde_json::from_str(text) {
            Ok(Value::Object(o)) => Ok(Fields::json(o)),
            Ok(_) => Err(Error::BadRequest {
                msg: "body must be a JSON object".into(),
            }),
            Err(e) => Err(Error::BadRequest {
                msg: format!("body is not JSON: {e}"),
            }),
        }
    }

    async fn read_form(req: Request, limit: usize) -> Result<Self, Error> {
        let mut form = Multipart::from_request(req, &())
            .await
            .map_err(|r| Error::BadRequest { msg: r.body_text() })?;
        let mut fields = BTreeMap::new();
        while let Some(field) = form
            .next_field()
            .await
            .map_err(|e| multipart_error(e, limit))?
        {
            let name = field.name().unwrap_or_default().to_string();
            if field.file_name().is_some() {
                return Err(Error::invalid(
                    name,
                    "files are not taken: this server generates from text (and class labels) only",
                ));
            }
            let bytes = field.bytes().await.map_err(|e| multipart_error(e, limit))?;
            let text = String::from_utf8(bytes.to_vec()).map_err(|e| Error::BadRequest {
                msg: format!(
                    "multipart field `{name}` is not valid UTF-8 (at byte {})",
                    e.utf8_error().valid_up_to()
                ),
            })?;
            match fields.entry(name) {
                btree_map::Entry::Occupied(e) => {
                    return Err(Error::invalid(e.key().as_str(), "given twice"))
                }
                btree_map::Entry::Vacant(e) => e.insert(Raw::Text(text)),
            };
        }
        Ok(Fields(fields))
    }

    /// Takes the fields named in `names` out, as a body of their own.
    pub fn split_off(&mut self, names: &[&str]) -> Fields {
        Fields(
            names
                .iter()
                .filter_map(|n| self.0.remove_entry(*n))
                .collect(),
        )
    }

    /// Field `name`'s value when it is text: a JSON string, or a form's text.
    pub fn text(&self, name: &str) -> Option<&str> {
        match self.0.get(name)? {
            Raw::Json(Value::String(s)) | Raw::Text(s) => Some(s),
            Raw::Json(_) => None,
        }
    }

    /// Drops field `name`.
    pub fn remove(&mut self, name: &str) {
        self.0.remove(name);
    }

    /// The fields as a `T`: a name `T` does not have, or a value its field cannot take, is a
    /// 422 naming the field.
    pub fn parse<T: DeserializeOwned>(self) -> Result<T, Error> {
        T::deserialize(self).map_err(Error::from)
    }
}

fn multipart_error(e: MultipartError, limit: usize) -> Error {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        Error::PayloadTooLarge { limit }
    } else {
        Error::BadRequest {
            msg: format!("multipart body: {}", e.body_text()),
        }
    }
}

/// Fields of OpenAI's requests that no request here has, and why they are not taken.
const NOT_TAKEN: [(&str, &str); 1] = [(
    "input_reference",
    "reference images are not taken: this server generates video from text",
)];

/// What serde found wrong with a body's fields.
#[derive(Debug)]
pub enum Fault {
    /// A field's value (its type, or its text in a form).
    Field { name: String, msg: String },
    /// A name the request does not have.
    Unknown {
        name: String,
        expected: &'static [&'static str],
    },
    /// Anything else: raised by a value's own deserializer, and named by the field around
    /// it ([`FieldAccess`]).
    Other(String),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Field { name, msg } => write!(f, "`{name}`: {msg}"),
            Fault::Unknown { name, .. } => write!(f, "`{name}`: unknown field"),
            Fault::Other(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for Fault {}

impl de::Error for Fault {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Fault::Other(msg.to_string())
    }

    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        Fault::Unknown {
            name: field.into(),
            expected,
        }
    }

    fn missing_field(field: &'static str) -> Self {
        Fault::Field {
            name: field.into(),
            msg: "required".into(),
        }
    }
}

impl From<Fault> for Error {
    fn from(f: Fault) -> Self {
        match f {
            Fault::Field { name, msg } => Error::invalid(name, msg),
            Fault::Unknown { name, expected } => match NOT_TAKEN.iter().find(|n| n.0 == name) {
                Some((_, why)) => Error::invalid(name, *why),
                None => Error::invalid(
                    name,
                    format!("unknown field; expected one of {}", expected.join(", ")),
                ),
            },
            Fault::Other(msg) => Error::BadRequest { msg },
        }
    }
}

/// A body is a map of its fields. A struct checks every name before any value, so a name
/// the request does not have is the fault named, whatever else is wrong.
impl<'de> de::Deserializer<'de> for Fields {
    type Error = Fault;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        visitor.visit_map(FieldAccess {
            fields: self.0.into_iter(),
            value: None,
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Fault> {
        if let Some(name) = self.0.keys().find(|k| !fields.contains(&k.as_str())) {
            return Err(de::Error::unknown_field(name, fields));
        }
        self.deserialize_any(visitor)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// Hands the fields to a struct one by one, naming the field in any error of its value.
struct FieldAccess {
    fields: btree_map::IntoIter<String, Raw>,
    value: Option<(String, Raw)>,
}

impl<'de> MapAccess<'de> for FieldAccess {
    type Error = Fault;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Fault> {
        let Some((name, raw)) = self.fields.next() else {
            return Ok(None);
        };
        let key = seed.deserialize(name.as_str().into_deserializer())?;
        self.value = Some((name, raw));
        Ok(Some(key))
    }

    fn next_value_seed<S: de::DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, Fault> {
        let (name, raw) = self
            .value
            .take()
            .expect("serde reads a value after its key");
        let msg = match raw {
            Raw::Json(v) => seed.deserialize(Json(v)).map_err(|e| e.to_string()),
            Raw::Text(t) => seed.deserialize(Text(t)).map_err(|e| e.to_string()),
        };
        msg.map_err(|msg| Fault::Field { name, msg })
    }
}

/// A JSON value, handed to its field as what it is, whatever type the field asks for
/// (serde_json's own refuses any other type at once), so the field's reader sees the value
/// it refuses and can say what it was.
struct Json(Value);

impl<'de> de::Deserializer<'de> for Json {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_any(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            v => visitor.visit_some(Json(v)),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_enum(name, variants, visitor)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct newtype_struct seq tuple tuple_struct map struct identifier
        ignored_any
    }
}

/// A form field's text, read as the type its field asks for: an integer or a number parsed
/// from it (surrounding blanks aside), anything else the text itself.
struct Text(String);

impl Text {
    fn integer<'de, V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        match self.0.trim().parse::<u64>() {
            Ok(n) => visitor.visit_u64(n),
            Err(_) => Err(de::Error::custom(format!(
                "`{}`: expected a non-negative integer",
                self.0
            ))),
        }
    }

    fn number<'de, V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        match self.0.trim().parse::<f64>() {
            Ok(x) if x.is_finite() => visitor.visit_f64(x),
            _ => Err(de::Error::custom(format!(
                "`{}`: expected a finite number",
                self.0
            ))),
        }
    }
}

impl<'de> de::Deserializer<'de> for Text {
    type Error = Fault;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        visitor.visit_string(self.0)
    }

    fn deserialize_u8<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        self.integer(visitor)
    }

    fn deserialize_u16<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        self.integer(visitor)
    }

    fn deserialize_u32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        self.integer(visitor)
    }

    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        self.integer(visitor)
    }

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        self.number(visitor)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        self.number(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Fault> {
        visitor.visit_some(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Fault> {
        visitor.visit_enum(self.0.into_deserializer())
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u128 char str string bytes byte_buf unit unit_struct
        newtype_struct seq tuple tuple_struct map struct identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::server::field::probe::{from_json, refused, Probe};

    #[test]
    fn form_text_becomes_the_fields_type_or_names_it() {
        let p: Probe = Fields::form([
            ("steps", " 5 "),
            ("guidance", "4.5"),
            ("seconds", "4"),
            ("prompt", "5"),
        ])
        .parse()
        .unwrap();
        let want = Probe {
            steps: Some(5),
            guidance: Some(4.5),
            seconds: Some(4.0),
            prompt: Some("5".into()),
        };
        assert_eq!(p, want);
        for (f, t, said) in [
            ("steps", "-1", "`-1`: expected a non-negative integer"),
            ("steps", "2.0", "`2.0`: expected a non-negative integer"),
            ("guidance", "inf", "`inf`: expected a finite number"),
            ("steps", "", "``: expected a non-negative integer"),
            ("seconds", "soon", "\"soon\": expected a finite number"),
        ] {
            let (field, msg) = refused(Fields::form([(f, t)]).parse());
            assert_eq!((field.as_str(), msg.as_str()), (f, said));
        }
    }

    /// A name the request does not have is the fault named, before any value is read.
    #[test]
    fn unknown_names_come_first_and_list_the_fields() {
        let (f, msg) = refused(from_json(json!({ "steps": "x", "zoom": 2 })));
        assert_eq!(f, "zoom");
        assert_eq!(
            msg,
            "unknown field; expected one of steps, guidance, seconds, prompt"
        );
        let (f, _) = refused(Fields::form([("colour", "red")]).parse());
        assert_eq!(f, "colour");
    }
}
