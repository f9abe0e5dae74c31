//! Text out of a token stream: incremental detokenization and stop strings.
//!
//! [`Detokenizer`] turns one sequence's tokens into text pieces as they
//! arrive, holding back tokens that end inside a multi-byte character (it
//! owns its token list, so the engine thread can keep one per request next to
//! a shared tokenizer). [`StopMatcher`] checks stop strings on the
//! detokenized stream: text that could be the start of a stop string is held
//! back until it is known not to be, and the stop string itself is never
//! emitted. Not here: stop token ids (EOS is the scheduler's), regex stops.

use kiln_runtime::text::TextTokenizer;
use kiln_runtime::EngineError;

/// Incremental detokenization of one sequence (the prefix/read offset
/// scheme: decode a window of recent tokens and emit what it adds).
#[derive(Clone, Debug, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl Detokenizer {
    /// Adds a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, EngineError> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(new) = full.get(prefix.len()..) {
                let new = new.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return Ok(new);
            }
        }
        Ok(String::new())
    }

    /// The text of tokens still held back (generation ended mid-character).
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String, EngineError> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}

/// What a piece of text did to a stream with stop strings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Emit this text (possibly empty: it is held back) and go on.
    Continue(String),
    /// A stop string matched: emit this text (what came before it) and stop.
    Stopped(String),
}

/// Stop strings over a text stream. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        self.pending.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return StopOutcome::Stopped(out);
        }
        let hold = self
            .stops
            .iter()
            .map(|s| partial_suffix(&self.pending, s))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out: String = self.pending.drain(..cut).collect();
        StopOutcome::Continue(out)
    }

    /// Text held back at the end of the stream (it never became a stop).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `stop`.
fn partial_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&k| stop.is_char_boundary(k) && text.ends_with(&stop[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_pieces_stops_without_being_emitted() {
        assert_eq!(
            run(&["\n\n"], &["Hello", " world", "\n", "\nMore"]),
            ("Hello world".to_string(), true)
        );
        assert_eq!(
            run(&["STOP"], &["abST", "O", "Pcd"]),
            ("ab".to_string(), true)
        );
    }

    #[test]
    fn a_partial_match_that_goes_nowhere_is_emitted_in_the_end() {
        assert_eq!(
            run(&["STOP"], &["abST", "Oz", " more ST"]),
            ("abSTOz more ST".to_string(), false)
        );
    }

    #[test]
    fn held_back_text_is_only_what_could_start_a_stop() {
        let mut m = StopMatcher::new(vec!["xyz".into()]);
        assert_eq!(m.push("abcx"), StopOutcome::Continue("abc".into()));
        assert_eq!(m.push("q"), StopOutcome::Continue("xq".into()));
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_multibyte_text_is_safe() {
        assert_eq!(run(&["é!", "b"], &["aé", "!b"]), ("a".to_string(), true));
        assert_eq!(run(&["ü"], &["ééé"]), ("ééé".to_string(), false));
    }

    #[test]
    fn without_stops_everything_passes_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), false));
    }
}
