//! Finds vLLM's `usage.prompt_tokens_details.cached_tokens` in a response
//! as it streams by, chunk by chunk, without buffering the response: the
//! same scan serves a JSON body and the final usage chunk of an SSE stream.
//! A short tail of each chunk is carried over so a field split across two
//! chunks is still found. O(chunk) per chunk.

const FIELD: &[u8] = b"\"cached_tokens\"";
/// Longest `"cached_tokens": 1234567890` split we must bridge.
const CARRY: usize = 48;

#[derive(Debug, Default, Clone)]
pub struct CachedTokensScanner {
    carry: Vec<u8>,
    found: Option<u64>,
}

impl CachedTokensScanner {
    /// Scans the next chunk; returns the value once found.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<u64> {
        if self.found.is_some() {
            return self.found;
        }
        let mut window = std::mem::take(&mut self.carry);
        window.extend_from_slice(chunk);
        if let Some(at) = find(&window, FIELD) {
            let rest = window.get(at + FIELD.len()..).unwrap_or_default();
            let rest = skip(rest, |b| b == b':' || b.is_ascii_whitespace());
            let digits: Vec<u8> = rest
                .iter()
                .copied()
                .take_while(u8::is_ascii_digit)
                .collect();
            let complete = digits.len() < rest.len();
            if !digits.is_empty() && complete {
                self.found = std::str::from_utf8(&digits)
                    .ok()
                    .and_then(|d| d.parse().ok());
                return self.found;
            }
            // The number may continue in the next chunk: keep from the field
            // on, unless no real value is that long (the carry stays bounded).
            if rest.len() <= CARRY {
                self.carry = window.get(at..).unwrap_or_default().to_vec();
            }
            return None;
        }
        let keep = window.len().min(CARRY);
        self.carry = window
            .get(window.len() - keep..)
            .unwrap_or_default()
            .to_vec();
        None
    }

    pub fn found(&self) -> Option<u64> {
        self.found
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn skip(bytes: &[u8], pred: impl Fn(u8) -> bool) -> &[u8] {
    let n = bytes.iter().take_while(|&&b| pred(b)).count();
    bytes.get(n..).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_field_in_json_and_across_chunks() {
        let body =
            br#"{"usage":{"prompt_tokens":900,"prompt_tokens_details":{"cached_tokens":768}}}"#;
        assert_eq!(CachedTokensScanner::default().feed(body), Some(768));
        for split in 1..body.len() {
            let mut scanner = CachedTokensScanner::default();
            let first = scanner.feed(&body[..split]);
            let second = scanner.feed(&body[split..]);
            assert_eq!(first.or(second), Some(768), "split at {split}");
        }
    }

    #[test]
    fn no_field_no_value() {
        let mut scanner = CachedTokensScanner::default();
        assert_eq!(
            scanner.feed(b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n"),
            None
        );
        assert_eq!(scanner.feed(b"data: [DONE]\n\n"), None);
        assert_eq!(scanner.found(), None);
    }
}
