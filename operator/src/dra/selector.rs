//! The part of CEL device classes select devices with ([`Selector`]): conjunctions of
//! equalities between `device.driver` or a device attribute and a literal, read into a
//! form the operator applies to the devices a ResourceSlice publishes; and how a device's
//! attributes are looked up by qualified or bare name. A class beyond that is refused,
//! quoting it.

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, DeviceClass};

use crate::error::Result;

/// The CEL expression a device's attribute or driver is compared in.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Field {
    Driver,
    /// An attribute: its domain (the driver's where the expression names it) and name.
    Attribute {
        domain: String,
        name: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Literal {
    Str(String),
    Int(i64),
    Bool(bool),
}

/// A DeviceClass's selectors, in the part of CEL the operator reads: every term must hold.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selector {
    terms: Vec<(Field, Literal)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    Str(String),
    Int(i64),
    And,
    Eq,
    Dot,
    Open,
    Close,
    OpenBracket,
    CloseBracket,
}

fn tokens(expr: &str) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let mut chars = expr.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            c if c.is_whitespace() => {}
            '&' | '=' => {
                if chars.next_if(|(_, n)| *n == c).is_none() {
                    return Err(format!("a lone `{c}` at {i}"));
                }
                out.push(if c == '&' { Token::And } else { Token::Eq });
            }
            '.' => out.push(Token::Dot),
            '(' => out.push(Token::Open),
            ')' => out.push(Token::Close),
            '[' => out.push(Token::OpenBracket),
            ']' => out.push(Token::CloseBracket),
            '\'' | '"' => {
                let mut s = String::new();
                loop {
                    match chars.next() {
                        Some((_, q)) if q == c => break,
                        Some((_, '\\')) => return Err("escapes in strings".into()),
                        Some((_, x)) => s.push(x),
                        None => return Err(format!("a string opened at {i} is not closed")),
                    }
                }
                out.push(Token::Str(s));
            }
            c if c.is_ascii_digit() || c == '-' => {
                let mut s = c.to_string();
                while let Some((_, d)) = chars.next_if(|(_, d)| d.is_ascii_digit()) {
                    s.push(d);
                }
                let n = s.parse().map_err(|_| format!("`{s}` at {i}"))?;
                out.push(Token::Int(n));
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let mut s = c.to_string();
                while let Some((_, d)) =
                    chars.next_if(|(_, d)| d.is_ascii_alphanumeric() || *d == '_')
                {
                    s.push(d);
                }
                out.push(Token::Ident(s));
            }
            c => return Err(format!("`{c}` at {i}")),
        }
    }
    Ok(out)
}

/// A recursive-descent reader of `term && term && ...`, each term `(…)` or `a == b`.
struct Reader {
    tokens: Vec<Token>,
    at: usize,
}

impl Reader {
    fn next(&mut self) -> Option<Token> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn eat(&mut self, t: &Token) -> bool {
        let hit = self.tokens.get(self.at) == Some(t);
        if hit {
            self.at += 1;
        }
        hit
    }

    fn conjunction(&mut self, out: &mut Vec<(Field, Literal)>) -> Result<(), String> {
        loop {
            if self.eat(&Token::Open) {
                self.conjunction(out)?;
                if !self.eat(&Token::Close) {
                    return Err("an unclosed `(`".into());
                }
            } else {
                out.push(self.equality()?);
            }
            if !self.eat(&Token::And) {
                return Ok(());
            }
        }
    }

    fn equality(&mut self) -> Result<(Field, Literal), String> {
        let a = self.operand()?;
        if !self.eat(&Token::Eq) {
            return Err("only `==` comparisons".into());
        }
        match (a, self.operand()?) {
            (Ok(f), Err(l)) | (Err(l), Ok(f)) => Ok((f, l)),
            _ => Err("a comparison of a device's field with a literal".into()),
        }
    }

    /// A device field (Ok) or a literal (Err).
    fn operand(&mut self) -> Result<Result<Field, Literal>, String> {
        match self.next() {
            Some(Token::Str(s)) => Ok(Err(Literal::Str(s))),
            Some(Token::Int(n)) => Ok(Err(Literal::Int(n))),
            Some(Token::Ident(b)) if b == "true" || b == "false" => {
                Ok(Err(Literal::Bool(b == "true")))
            }
            Some(Token::Ident(d)) if d == "device" => {
                if !self.eat(&Token::Dot) {
                    return Err("`device` without a field".into());
                }
                match self.next() {
                    Some(Token::Ident(f)) if f == "driver" => Ok(Ok(Field::Driver)),
                    Some(Token::Ident(f)) if f == "attributes" => {
                        let domain = self.index()?;
                        let name = if self.eat(&Token::Dot) {
                            match self.next() {
                                Some(Token::Ident(n)) => n,
                                _ => return Err("an attribute without a name".into()),
                            }
                        } else {
                            self.index()?
                        };
                        Ok(Ok(Field::Attribute { domain, name }))
                    }
                    other => Err(format!("the device field {other:?}")),
                }
            }
            other => Err(format!("the operand {other:?}")),
        }
    }

    fn index(&mut self) -> Result<String, String> {
        match (self.next(), self.next(), self.next()) {
            (Some(Token::OpenBracket), Some(Token::Str(s)), Some(Token::CloseBracket)) => Ok(s),
            _ => Err("an index that is not a quoted string".into()),
        }
    }
}

impl Selector {
    /// The selector of `class`, or what in it the operator cannot read.
    pub fn of(class: &DeviceClass) -> Result<Selector, String> {
        let mut terms = Vec::new();
        for s in class.spec.selectors.iter().flatten() {
            let Some(cel) = &s.cel else {
                return Err("a selector without a CEL expression".into());
            };
            let mut reader = Reader {
                tokens: tokens(&cel.expression)
                    .map_err(|why| format!("`{}`: cannot read {why}", cel.expression))?,
                at: 0,
            };
            reader.conjunction(&mut terms).and_then(|()| {
                if reader.at == reader.tokens.len() {
                    Ok(())
                } else {
                    Err("more after the last term (only `&&` joins terms)".into())
                }
            })
            .map_err(|why| {
                format!(
                    "`{}`: the operator reads conjunctions (`&&`) of `==` between device.driver or device.attributes['domain'].name and a literal, and met {why}",
                    cel.expression
                )
            })?;
        }
        Ok(Selector { terms })
    }

    /// The driver every selected device has, where a term pins one.
    pub fn driver(&self) -> Option<&str> {
        self.terms.iter().find_map(|(f, l)| match (f, l) {
            (Field::Driver, Literal::Str(d)) => Some(d.as_str()),
            _ => None,
        })
    }

    /// Whether `device` of `driver` has every term.
    pub fn selects(&self, driver: &str, device: &Device) -> bool {
        self.terms.iter().all(|(field, want)| match field {
            Field::Driver => *want == Literal::Str(driver.to_string()),
            Field::Attribute { domain, name } => attribute(driver, device, domain, name)
                .is_some_and(|a| literal_of(a).as_ref() == Some(want)),
        })
    }
}

pub(super) fn literal_of(a: &DeviceAttribute) -> Option<Literal> {
    a.string
        .clone()
        .or_else(|| a.version.clone())
        .map(Literal::Str)
        .or(a.int.map(Literal::Int))
        .or(a.bool.map(Literal::Bool))
}

/// A device's attribute `domain`/`name`: keyed by the qualified name, or by the bare name
/// where the domain is the driver's own.
pub(super) fn attribute<'a>(
    driver: &str,
    device: &'a Device,
    domain: &str,
    name: &str,
) -> Option<&'a DeviceAttribute> {
    let attrs = device.attributes.as_ref()?;
    attrs
        .get(&format!("{domain}/{name}"))
        .or_else(|| (domain == driver).then(|| attrs.get(name)).flatten())
}

/// `qualified` (`domain/name`, or a bare name in the driver's domain) of `device`.
pub(super) fn qualified_attribute<'a>(
    driver: &str,
    device: &'a Device,
    qualified: &str,
) -> Option<&'a DeviceAttribute> {
    match qualified.split_once('/') {
        Some((domain, name)) => attribute(driver, device, domain, name),
        None => attribute(driver, device, driver, qualified),
    }
}
