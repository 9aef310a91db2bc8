//! JSON read straight into template values, object keys in their order:
//! Python's `json.loads` keeps it, and templates show it (`tojson` of a
//! tool's parameters, `arguments | items`). A repeated key keeps its first
//! place and its last value, as in Python.

use std::fmt;

use indexmap::IndexMap;
use minijinja::value::Value;
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A JSON document as a template value.
pub struct OrderedJson(pub Value);

impl<'de> Deserialize<'de> for OrderedJson {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor).map(OrderedJson)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::from(()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(OrderedJson(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::from(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries = IndexMap::new();
        while let Some((key, OrderedJson(item))) = map.next_entry::<String, OrderedJson>()? {
            entries.insert(Value::from(key), item);
        }
        Ok(Value::from(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_their_order_and_repeats_their_first_place() {
        let OrderedJson(value) =
            serde_json::from_str(r#"{"z": 1, "a": [true, null, 1.5, "x"], "z": 2}"#).unwrap();
        let keys: Vec<String> = value.try_iter().unwrap().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["z", "a"]);
        assert_eq!(value.get_attr("z").unwrap(), Value::from(2));
        assert!(value
            .get_attr("a")
            .unwrap()
            .get_item_by_index(1)
            .unwrap()
            .is_none());
    }
}
