//! The text Python gives template values, where Hugging Face templates
//! turn values into text: `str()` of a printed value (`None`, `True`,
//! `['a', 1]`), `json.dumps` behind transformers' `tojson`, and
//! `datetime.strftime` behind `strftime_now`.

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Python's `str(value)`; undefined is empty, as jinja2 prints it.
pub fn write_str(value: &Value, out: &mut String) {
    match value.as_str() {
        Some(text) if value.kind() == ValueKind::String => out.push_str(text),
        _ if value.is_undefined() => {}
        _ => write_repr(value, out),
    }
}

/// jinja2's `iterable` test: whatever Python's `iter()` accepts (strings,
/// lists, dicts, generators, and jinja2's undefined; not `None`).
pub fn is_iterable(value: &Value) -> bool {
    is_sequence(value) || value.kind() == ValueKind::Iterable
}

/// jinja2's `sequence` test: whatever has a length and items (strings,
/// lists and dicts too, and jinja2's undefined; not `None`).
pub fn is_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Undefined
    )
}

/// Python's `repr(value)`.
fn write_repr(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(value, out),
        ValueKind::String | ValueKind::Bytes => {
            write_string_repr(value.as_str().unwrap_or_default(), out)
        }
        ValueKind::Map => {
            out.push('{');
            for (i, (key, item)) in map_pairs(value).enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(&key, out);
                out.push_str(": ");
                write_repr(&item, out);
            }
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter().map(Iterator::collect).unwrap_or_default();
            let (open, close) = if value.is_tuple() {
                ("(", ")")
            } else {
                ("[", "]")
            };
            out.push_str(open);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(item, out);
            }
            if value.is_tuple() && items.len() == 1 {
                out.push(',');
            }
            out.push_str(close);
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// Python's string `repr`: single quotes unless the text has a single
/// quote and no double quote.
fn write_string_repr(text: &str, out: &mut String) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c == '\x7f' => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn write_number(value: &Value, out: &mut String) {
    if value.is_integer() {
        out.push_str(&value.to_string());
    } else {
        out.push_str(&float_repr(
            f64::try_from(value.clone()).unwrap_or(f64::NAN),
        ));
    }
}

/// Python's `repr(float)`: the shortest digits that read back, positional
/// from 1e-4 up to 1e16, else with a signed, at least two-digit exponent.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip form too: `d[.ddd]e[-]n`.
    let scientific = format!("{:e}", x.abs());
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if !(-5 < exponent && exponent < 16) {
        let sign_of_exponent = if exponent < 0 { '-' } else { '+' };
        return format!(
            "{sign}{mantissa}e{sign_of_exponent}{:02}",
            exponent.unsigned_abs()
        );
    }
    let point = usize::try_from(exponent + 1).unwrap_or(0);
    if exponent < 0 {
        let zeros = "0".repeat(exponent.unsigned_abs() as usize - 1);
        format!("{sign}0.{zeros}{digits}")
    } else if digits.len() <= point {
        format!("{sign}{digits}{}.0", "0".repeat(point - digits.len()))
    } else {
        let (whole, fraction) = digits.split_at(point);
        format!("{sign}{whole}.{fraction}")
    }
}

/// The pairs of a map value, in its order.
fn map_pairs(value: &Value) -> impl Iterator<Item = (Value, Value)> + '_ {
    value.try_iter().into_iter().flatten().map(move |key| {
        let item = value.get_item(&key).unwrap_or_default();
        (key, item)
    })
}

/// Options of Python's `json.dumps` that transformers' `tojson` passes on.
#[derive(Debug, Clone, Default)]
pub struct JsonOptions {
    pub ensure_ascii: bool,
    /// `None`: one line; else each nesting level indented by this text.
    pub indent: Option<String>,
    /// Item and key separators; `None`: Python's defaults for `indent`.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

/// Python's `json.dumps(value, ...)`.
pub fn json_dumps(value: &Value, options: &JsonOptions) -> Result<String, Error> {
    let (item_separator, key_separator) = match (&options.separators, &options.indent) {
        (Some((item, key)), _) => (item.clone(), key.clone()),
        (None, Some(_)) => (",".to_string(), ": ".to_string()),
        (None, None) => (", ".to_string(), ": ".to_string()),
    };
    let mut writer = JsonWriter {
        options,
        item_separator,
        key_separator,
        out: String::new(),
    };
    writer.value(value, 0)?;
    Ok(writer.out)
}

struct JsonWriter<'a> {
    options: &'a JsonOptions,
    item_separator: String,
    key_separator: String,
    out: String,
}

impl JsonWriter<'_> {
    fn value(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.number(value),
            ValueKind::String => self.string(value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter().map(Iterator::collect).unwrap_or_default();
                self.container('[', ']', depth, items.len(), |writer, i, depth| {
                    writer.value(items.get(i).unwrap_or(&Value::UNDEFINED), depth)
                })?;
            }
            ValueKind::Map => {
                let mut pairs: Vec<(String, Value)> = map_pairs(value)
                    .map(|(key, item)| Ok((json_key(&key)?, item)))
                    .collect::<Result<_, Error>>()?;
                if self.options.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container('{', '}', depth, pairs.len(), |writer, i, depth| {
                    let Some((key, item)) = pairs.get(i) else {
                        return Ok(());
                    };
                    writer.string(key);
                    writer.out.push_str(&writer.key_separator.clone());
                    writer.value(item, depth)
                })?;
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("Object of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn container(
        &mut self,
        open: char,
        close: char,
        depth: usize,
        len: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        let indent = self.options.indent.clone();
        for i in 0..len {
            if i > 0 {
                let separator = self.item_separator.clone();
                self.out.push_str(&separator);
            }
            if let Some(indent) = &indent {
                self.out.push('\n');
                self.out.push_str(&indent.repeat(depth + 1));
            }
            item(self, i, depth + 1)?;
        }
        if let Some(indent) = &indent {
            self.out.push('\n');
            self.out.push_str(&indent.repeat(depth));
        }
        self.out.push(close);
        Ok(())
    }

    fn number(&mut self, value: &Value) {
        if value.is_integer() {
            self.out.push_str(&value.to_string());
            return;
        }
        let x = f64::try_from(value.clone()).unwrap_or(f64::NAN);
        match x {
            x if x.is_nan() => self.out.push_str("NaN"),
            x if x.is_infinite() && x > 0.0 => self.out.push_str("Infinity"),
            x if x.is_infinite() => self.out.push_str("-Infinity"),
            x => self.out.push_str(&float_repr(x)),
        }
    }

    fn string(&mut self, text: &str) {
        self.out.push('"');
        for c in text.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\x08' => self.out.push_str("\\b"),
                '\x0c' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => self.out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.options.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        self.out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// A map key as `json.dumps` writes it: strings as they are, numbers,
/// booleans and `None` as their JSON text.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number => {
            let mut text = String::new();
            write_number(key, &mut text);
            Ok(text)
        }
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// `datetime.strftime(format)` of the UTC time `unix_seconds`, in the C
/// locale, for the directives chat templates use (`%d %b %Y` and the like);
/// any other `%x` is kept as it is, as glibc does.
pub fn strftime(format: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let second_of_day = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (
        second_of_day / 3600,
        second_of_day / 60 % 60,
        second_of_day % 60,
    );
    // 1970-01-01 was a Thursday (Monday = 0).
    let weekday = usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS
        .get(usize::try_from(month - 1).unwrap_or(0))
        .copied()
        .unwrap_or("");
    let weekday_name = WEEKDAYS.get(weekday).copied().unwrap_or("");
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{hour12:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(month_name.get(..3).unwrap_or("")),
            Some('A') => out.push_str(weekday_name),
            Some('a') => out.push_str(weekday_name.get(..3).unwrap_or("")),
            Some('u') => out.push_str(&(weekday + 1).to_string()),
            Some('w') => out.push_str(&((weekday + 1) % 7).to_string()),
            // A naive datetime has no zone.
            Some('Z') | Some('z') => {}
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian
/// (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// (year, month, day) → days since 1970-01-01.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let shifted_month = (month + 9) % 12;
    let day_of_year = (153 * shifted_month + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// Python's `str.isspace` for one character: Rust's whitespace plus the
/// information separators U+001C..U+001F, which Python counts too.
pub fn is_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// Python's `str.strip()`.
pub fn strip(text: &str) -> &str {
    text.trim_matches(is_space)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_read_as_python_writes_them() {
        for (x, python) in [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (1.5e-7, "1.5e-07"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123.456, "123.456"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (2.5e300, "2.5e+300"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(float_repr(x), python, "{x}");
        }
    }

    #[test]
    fn printed_values_read_as_python_prints_them() {
        let value = Value::from_pairs([
            ("a", Value::from(())),
            (
                "b",
                Value::from(vec![Value::from(true), Value::from("it's")]),
            ),
            ("c", Value::from(2.0)),
        ]);
        let mut out = String::new();
        write_str(&value, &mut out);
        assert_eq!(out, r#"{'a': None, 'b': [True, "it's"], 'c': 2.0}"#);
    }

    #[test]
    fn json_follows_python_separators_and_escapes() {
        let value = Value::from_pairs([
            ("z", Value::from(vec![Value::from(1), Value::from(0.5)])),
            ("a", Value::from("é\n\u{1}\"")),
        ]);
        let dumps = |options: JsonOptions| json_dumps(&value, &options).unwrap();
        assert_eq!(
            dumps(JsonOptions::default()),
            "{\"z\": [1, 0.5], \"a\": \"é\\n\\u0001\\\"\"}"
        );
        assert_eq!(
            dumps(JsonOptions {
                ensure_ascii: true,
                sort_keys: true,
                ..JsonOptions::default()
            }),
            "{\"a\": \"\\u00e9\\n\\u0001\\\"\", \"z\": [1, 0.5]}"
        );
        assert_eq!(
            dumps(JsonOptions {
                indent: Some("  ".into()),
                ..JsonOptions::default()
            }),
            "{\n  \"z\": [\n    1,\n    0.5\n  ],\n  \"a\": \"é\\n\\u0001\\\"\"\n}"
        );
        assert!(json_dumps(&Value::UNDEFINED, &JsonOptions::default()).is_err());
    }

    #[test]
    fn strftime_matches_python() {
        let cases: Vec<(i64, String, String)> = serde_json::from_str(include_str!(
            "../../tests/fixtures/chat_templates/strftime.json"
        ))
        .unwrap();
        assert!(!cases.is_empty());
        for (time, format, python) in cases {
            assert_eq!(strftime(&format, time), python, "{time} {format}");
        }
    }

    #[test]
    fn civil_dates_round_trip() {
        for days in [-719_468, -1, 0, 59, 365, 11_016, 19_723, 20_000, 2_932_896] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }
}
