//! diffusers' `prompt_clean`, which `WanPipeline` applies to every prompt before its
//! tokenizer sees it: `html.unescape` twice, strip, collapse whitespace runs to one space,
//! strip. Plain string work, so it is built without the `runtime` feature.
//!
//! diffusers also runs `ftfy.fix_text` first when the `ftfy` package is installed (it is not
//! a diffusers dependency). That repair (mojibake, curly quotes, full-width characters,
//! ligatures, NFC) is not reproduced here: prompts that need it tokenize as diffusers does
//! without ftfy.

use super::entities::ENTITIES;

/// Python's `str.isspace()`, which `str.strip()` uses: Unicode White_Space plus the four
/// ASCII information separators.
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `prompt_clean` of diffusers' Wan pipelines.
pub fn prompt_clean(text: &str) -> String {
    let text = html_unescape(&html_unescape(text));
    // The pipeline's `\s` is the `regex` package's: Unicode White_Space, which is Rust's
    // `char::is_whitespace`. Its strips are Python's, which also strip U+001C..U+001F.
    let text = text.trim_matches(py_isspace);
    let mut out = String::with_capacity(text.len());
    let mut in_space = false;
    for c in text.chars() {
        if c.is_whitespace() {
            if !in_space {
                out.push(' ');
            }
            in_space = true;
        } else {
            out.push(c);
            in_space = false;
        }
    }
    out.trim_matches(py_isspace).to_string()
}

/// Python's `html.unescape` for numeric references and the names in [`ENTITIES`]: the
/// same matching (a name is up to 32 characters, a `;` is optional, a legacy name also
/// matches as the longest prefix of a longer run) and the same HTML 5 repairs of invalid
/// numbers (Windows-1252 for 0x80..0x9F, U+FFFD for surrogates and out of range, nothing
/// for other non-characters).
pub fn html_unescape(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        match reference(after) {
            Some((replacement, used)) => {
                out.push_str(&replacement);
                rest = &after[used..];
            }
            None => {
                out.push('&');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// The reference that `s` (the text after an `&`) starts with: its replacement and the
/// bytes of `s` it used, or `None` when Python's pattern does not match there.
fn reference(s: &str) -> Option<(String, usize)> {
    if let Some(num) = s.strip_prefix('#') {
        let (digits, radix, skip) = match num.strip_prefix(['x', 'X']) {
            Some(hex) => (leading(hex, |c| c.is_ascii_hexdigit()), 16, 2),
            None => (leading(num, |c| c.is_ascii_digit()), 10, 1),
        };
        if digits.is_empty() {
            return None;
        }
        let mut used = skip + digits.len();
        if s[used..].starts_with(';') {
            used += 1;
        }
        // Python's int() has no overflow: anything past u32 is past U+10FFFF.
        let code = u32::from_str_radix(digits, radix).unwrap_or(u32::MAX);
        return Some((numeric(code), used));
    }
    let name = leading_chars(s, 32, |c| {
        !matches!(c, '\t' | '\n' | '\x0c' | ' ' | '<' | '&' | '#' | ';')
    });
    if name.is_empty() {
        return None;
    }
    let semicolon = s[name.len()..].starts_with(';');
    let used = name.len() + usize::from(semicolon);
    // The whole run: any name with its `;`, a legacy name without.
    if let Some((c, legacy)) = lookup(name) {
        if semicolon || legacy {
            return Some((c.to_string(), used));
        }
    }
    // Else the longest prefix (2 characters or more, short of the whole run with its `;`)
    // that is a name; only legacy names resolve without a `;`.
    let prefixes: Vec<usize> = s[..used].char_indices().map(|(i, _)| i).skip(2).collect();
    for &end in prefixes.iter().rev() {
        if let Some((c, true)) = lookup(&s[..end]) {
            return Some((format!("{c}{}", &s[end..used]), used));
        }
    }
    None
}

fn lookup(name: &str) -> Option<(char, bool)> {
    ENTITIES
        .binary_search_by(|(n, _, _)| n.cmp(&name))
        .ok()
        .map(|i| (ENTITIES[i].1, ENTITIES[i].2))
}

/// What Python's `html` module makes of `&#N;`.
fn numeric(code: u32) -> String {
    const CP1252: [char; 32] = [
        '\u{20ac}', '\u{81}', '\u{201a}', '\u{192}', '\u{201e}', '\u{2026}', '\u{2020}',
        '\u{2021}', '\u{2c6}', '\u{2030}', '\u{160}', '\u{2039}', '\u{152}', '\u{8d}', '\u{17d}',
        '\u{8f}', '\u{90}', '\u{2018}', '\u{2019}', '\u{201c}', '\u{201d}', '\u{2022}', '\u{2013}',
        '\u{2014}', '\u{2dc}', '\u{2122}', '\u{161}', '\u{203a}', '\u{153}', '\u{9d}', '\u{17e}',
        '\u{178}',
    ];
    let c = match code {
        0 => '\u{fffd}',
        0x0d => '\r',
        0x80..=0x9f => CP1252[(code - 0x80) as usize],
        0xd800..=0xdfff => '\u{fffd}',
        _ => match char::from_u32(code) {
            None => '\u{fffd}',
            Some(c) => {
                let noncharacter = (0xfdd0..=0xfdef).contains(&code) || code & 0xfffe == 0xfffe;
                let control = matches!(code, 0x1..=0x8 | 0xb | 0xe..=0x1f | 0x7f);
                if noncharacter || control {
                    return String::new();
                }
                c
            }
        },
    };
    c.to_string()
}

/// The longest prefix of `s` whose characters satisfy `ok`.
fn leading(s: &str, ok: impl Fn(char) -> bool) -> &str {
    let end = s.find(|c: char| !ok(c)).unwrap_or(s.len());
    &s[..end]
}

/// As [`leading`], at most `max` characters.
fn leading_chars(s: &str, max: usize, ok: impl Fn(char) -> bool) -> &str {
    for (n, (i, c)) in s.char_indices().enumerate() {
        if n == max || !ok(c) {
            return &s[..i];
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapses_whitespace_as_the_pipeline_does() {
        assert_eq!(prompt_clean("  a \t b\n\n c  "), "a b c");
        assert_eq!(prompt_clean("a\u{3000}b\u{a0}c"), "a b c");
        // Python strips the ASCII separators but its `regex` `\s` does not collapse them.
        assert_eq!(prompt_clean("\u{1c} x\u{1d}y \u{1f}"), "x\u{1d}y");
        assert_eq!(prompt_clean(""), "");
    }

    #[test]
    fn unescapes_twice_with_pythons_rules() {
        assert_eq!(prompt_clean("&amp;amp; &amp;lt;"), "& <");
        assert_eq!(
            html_unescape("&lt3 &copy2024 &notit; &notin;"),
            "<3 ©2024 ¬it; ∉"
        );
        assert_eq!(
            html_unescape("&#150; &#x41; &#0; &#xD800; &#1;x"),
            "– A \u{fffd} \u{fffd} x"
        );
        assert_eq!(
            html_unescape("&#99999999999; &#; &x; &unknown;"),
            "\u{fffd} &#; &x; &unknown;"
        );
        assert_eq!(html_unescape("&eacute &Eacute; &lang;"), "é É ⟨");
        assert_eq!(html_unescape("&hellip &hellip;"), "&hellip …");
    }

    #[test]
    fn entity_table_is_sorted_for_binary_search() {
        assert!(ENTITIES.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(lookup("amp"), Some(('&', true)));
        assert_eq!(lookup("apos"), Some(('\'', false)));
    }
}
