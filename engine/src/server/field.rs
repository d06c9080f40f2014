//! How a request field's value is read: the readers the request types name in
//! `#[serde(deserialize_with)]`. Each takes the one JSON type its field has (a form's text,
//! read as that type by [`super::body`]), `null` as absent, and says what it got otherwise;
//! the body's reader puts the field's name around what it says.

use std::fmt;

use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Whatever value a field was given, as JSON (a form's text as a string, or the number its
/// field asked for): what the field's own check reads, and its error shows.
pub struct AnyValue;

impl<'de> Visitor<'de> for AnyValue {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(n.into())
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(n.into())
    }

    fn visit_f64<E>(self, x: f64) -> Result<Value, E> {
        Ok(x.into())
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(s.into())
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(s.into())
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(v) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut o = Map::new();
        while let Some((k, v)) = map.next_entry()? {
            o.insert(k, v);
        }
        Ok(Value::Object(o))
    }
}

/// What a value of the wrong JSON type is told beside the type it should have had.
fn not_text(v: &Value) -> &'static str {
    if v.is_string() {
        " (a JSON number, not a string)"
    } else {
        ""
    }
}

/// A non-negative integer.
pub fn integer<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct Integer(u64);
    impl<'de> Deserialize<'de> for Integer {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let v = d.deserialize_u64(AnyValue)?;
            v.as_u64().map(Integer).ok_or_else(|| {
                D::Error::custom(format!(
                    "{v}: expected a non-negative integer{}",
                    not_text(&v)
                ))
            })
        }
    }
    Ok(Option::<Integer>::deserialize(d)?.map(|i| i.0))
}

/// A finite number.
pub fn number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    struct Number(f64);
    impl<'de> Deserialize<'de> for Number {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let v = d.deserialize_f64(AnyValue)?;
            v.as_f64()
                .filter(|x| x.is_finite())
                .map(Number)
                .ok_or_else(|| {
                    D::Error::custom(format!("{v}: expected a finite number{}", not_text(&v)))
                })
        }
    }
    Ok(Option::<Number>::deserialize(d)?.map(|n| n.0))
}

/// A finite number, given as one or as text (OpenAI's video `seconds` is a string, `"4"`).
pub fn number_or_text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    struct NumberOrText(f64);
    impl<'de> Deserialize<'de> for NumberOrText {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let v = d.deserialize_any(AnyValue)?;
            let n = match &v {
                Value::String(s) => s.trim().parse::<f64>().ok(),
                v => v.as_f64(),
            };
            n.filter(|x| x.is_finite())
                .map(NumberOrText)
                .ok_or_else(|| D::Error::custom(format!("{v}: expected a finite number")))
        }
    }
    Ok(Option::<NumberOrText>::deserialize(d)?.map(|n| n.0))
}

/// A string.
pub fn string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct Text(String);
    impl<'de> Deserialize<'de> for Text {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            match d.deserialize_string(AnyValue)? {
                Value::String(s) => Ok(Text(s)),
                v => Err(D::Error::custom(format!("{v}: expected a string"))),
            }
        }
    }
    Ok(Option::<Text>::deserialize(d)?.map(|t| t.0))
}

/// A request type of four fields, one per reader, for the readers' tests and the body's.
#[cfg(test)]
pub(super) mod probe {
    use serde::Deserialize;
    use serde_json::Value;

    use super::*;
    use crate::server::body::Fields;
    use crate::Error;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    pub(in crate::server) struct Probe {
        #[serde(default, deserialize_with = "integer")]
        pub steps: Option<u64>,
        #[serde(default, deserialize_with = "number")]
        pub guidance: Option<f64>,
        #[serde(default, deserialize_with = "number_or_text")]
        pub seconds: Option<f64>,
        #[serde(default, deserialize_with = "string")]
        pub prompt: Option<String>,
    }

    pub(in crate::server) fn from_json(v: Value) -> Result<Probe, Error> {
        match v {
            Value::Object(o) => Fields::json(o).parse(),
            _ => unreachable!(),
        }
    }

    pub(in crate::server) fn refused(r: Result<Probe, Error>) -> (String, String) {
        match r {
            Err(Error::Core(layerwise_core::Error::Invalid { field, msg })) => (field, msg),
            other => panic!("not a 422: {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::probe::{from_json, refused, Probe};

    #[test]
    fn json_values_of_the_wrong_type_are_named_with_what_they_were() {
        let p = from_json(json!({ "steps": 5, "guidance": 2, "seconds": "4", "prompt": null }));
        assert_eq!(
            p.unwrap(),
            Probe {
                steps: Some(5),
                guidance: Some(2.0),
                seconds: Some(4.0),
                prompt: None
            }
        );
        for (body, field, said) in [
            (
                json!({ "steps": "5" }),
                "steps",
                "\"5\": expected a non-negative integer (a JSON number, not a string)",
            ),
            (
                json!({ "steps": 5.0 }),
                "steps",
                "5.0: expected a non-negative integer",
            ),
            (
                json!({ "steps": -1 }),
                "steps",
                "-1: expected a non-negative integer",
            ),
            (
                json!({ "guidance": [1] }),
                "guidance",
                "[1]: expected a finite number",
            ),
            (
                json!({ "guidance": "2" }),
                "guidance",
                "\"2\": expected a finite number (a JSON number, not a string)",
            ),
            (
                json!({ "seconds": true }),
                "seconds",
                "true: expected a finite number",
            ),
            (
                json!({ "prompt": { "a": 1 } }),
                "prompt",
                "{\"a\":1}: expected a string",
            ),
        ] {
            let (f, msg) = refused(from_json(body));
            assert_eq!((f.as_str(), msg.as_str()), (field, said));
        }
    }
}
