//! The parser of the text form written by [`crate::print()`], and the source
//! map that ties a parsed graph back to line:column positions.
//!
//! Why it exists: golden dumps, `kiln inspect` output and hand-written test
//! graphs must read back into exactly the [`Graph`] that printed them, so a
//! reviewer can diff text and a test can write a graph in a few lines.
//!
//! The parser is deliberately *syntactic*: it builds the graph as written,
//! even when it is semantically wrong (wrong arity, mismatched types, a value
//! defined twice, a use before its definition, a reference to a value that
//! does not exist). [`crate::verify()`] judges the graph; [`parse_and_verify`]
//! runs both and maps every verifier error to a line:column through the
//! [`SourceMap`] the parse recorded. The only semantic rule the parser itself
//! enforces is that value ids are dense (`%0..%N-1` each defined), because a
//! [`Graph`]'s value table cannot hold a hole; a gap is reported at its first
//! use. It never panics, whatever the input.
//!
//! Grammar (whitespace and newlines are free; `//` starts a comment):
//!
//! ```text
//! graph    := 'graph' STRING '{' stmt* '}'
//! stmt     := VALUE '=' 'input' ROLE ':' type
//!           | VALUE '=' 'weight' STRING ':' type
//!           | VALUE (',' VALUE)* '=' MNEMONIC attrs? (VALUE (',' VALUE)*)? ':' type (',' type)*
//!           | 'output' STRING '=' VALUE
//! attrs    := '{' (NAME '=' attr (',' NAME '=' attr)*)? '}'
//! attr     := NUMBER | WORD | WORD '(' (NAME '=' attr (',' NAME '=' attr)*)? ')'
//! type     := DTYPE '[' (NUMBER (',' NUMBER)*)? ']'
//! VALUE    := '%' DIGITS
//! STRING   := '"' (char | '\"' | '\\' | '\n' | '\r' | '\t' | '\u{HEX}')* '"'
//! ```
//!
//! Inputs, weights, nodes and outputs keep their textual order in
//! [`Graph::inputs`], [`Graph::weights`], [`Graph::nodes`] and
//! [`Graph::outputs`]; statements of different kinds may interleave.
//!
//! Not here: printing ([`crate::print()`]), the semantic rules
//! ([`crate::verify()`]), and any error recovery (the first syntax error ends
//! the parse; semantic errors are all collected by the verifier).

use crate::graph::{Graph, InputRole, Node, NodeId, ValueData, ValueDef, ValueId};
use crate::manifest::WeightManifest;
use crate::op::{AttnAttrs, Epilogue, Op, PreNorm, Rope, RopeScaling};
use crate::text::attr_names;
pub use crate::text::{NodeSpans, Pos, SourceMap, Span};
use crate::types::{DType, QuantType, Shape, TensorType};
use crate::verify::{verify, GraphInfo, VerifyError};
use std::collections::BTreeMap;
use std::fmt;

/// What is wrong with a text, without its position (see [`ParseError`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseErrorKind {
    #[error("unexpected character `{0}`")]
    UnexpectedChar(char),
    #[error("unterminated string: no closing `\"` on this line (write a newline as \\n)")]
    UnterminatedString,
    #[error(
        "unknown escape `{0}` in a string; valid escapes are \\\" \\\\ \\n \\r \\t \\u{{HEX}}"
    )]
    BadEscape(String),
    #[error("bad number `{text}`: {why}")]
    BadNumber { text: String, why: String },
    #[error("bad value id `{0}`: values are written %0, %1, ... and fit in 32 bits")]
    BadValueId(String),
    #[error("expected {expected}, found {found}")]
    Expected { expected: String, found: String },
    #[error("unknown op `{name}`; expected `input`, `weight` or one of {}", list(&Op::MNEMONICS))]
    UnknownOp { name: String },
    #[error("unknown input role `{name}`; expected one of token_ids, positions, slot_mapping, block_tables, context_lens, draft_tokens, k_cache.<layer>, v_cache.<layer>")]
    UnknownRole { name: String },
    #[error("unknown dtype `{name}`; expected one of bf16, f16, f32, i32")]
    UnknownDType { name: String },
    #[error("unknown storage type `{name}`; expected one of q8_0, q4_0, q4_1, q5_0, q4_k, q5_k, q6_k, fp8_e4m3")]
    UnknownStorage { name: String },
    #[error("`{op}` has no attribute `{name}`; {}", valid_attrs(valid))]
    UnknownAttr {
        op: String,
        name: String,
        valid: &'static [&'static str],
    },
    #[error("`{op}` needs attribute `{name}` ({what})")]
    MissingAttr {
        op: String,
        name: &'static str,
        what: &'static str,
    },
    #[error("attribute `{name}` of `{op}` is given twice")]
    DuplicateAttr { op: String, name: String },
    #[error("attribute `{name}` of `{op}` must be {what}, got `{got}`")]
    BadAttr {
        op: String,
        name: String,
        what: &'static str,
        got: String,
    },
    #[error("unknown rope scaling `{0}`; expected none, linear(factor = F) or llama3(factor = F, low_freq_factor = F, high_freq_factor = F, original_max_position = N)")]
    UnknownScaling(String),
    #[error("{what} defines exactly one value, not {got}")]
    OneResult { what: &'static str, got: usize },
    #[error("{results} result(s) on the left of `=` but {types} type(s) after `:`; give one type per result")]
    TypeCount { results: usize, types: usize },
    #[error("value %{0} is used but never defined")]
    UsedButUndefined(u32),
    #[error("value ids must be dense: %{missing} is never defined but %{next} is; number values %0, %1, ... without gaps")]
    IdGap { missing: u32, next: u32 },
}

fn list(items: &[&str]) -> String {
    items.join(", ")
}

fn valid_attrs(valid: &[&str]) -> String {
    if valid.is_empty() {
        "it takes no attributes".to_string()
    } else {
        format!("its attributes are {}", list(valid))
    }
}

/// A syntax error at a line:column. Displays as `line:column: message`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{pos}: {kind}")]
pub struct ParseError {
    pub pos: Pos,
    pub kind: ParseErrorKind,
}

impl ParseError {
    pub fn line(&self) -> u32 {
        self.pos.line
    }
    pub fn column(&self) -> u32 {
        self.pos.column
    }
}

/// A verifier error placed in the parsed text.
#[derive(Clone, Debug, PartialEq)]
pub struct LocatedError {
    pub span: Span,
    pub error: VerifyError,
}

impl fmt::Display for LocatedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.span.start, self.error)
    }
}

/// Why [`parse_and_verify`] rejected a text.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TextError {
    /// The text is not in the grammar.
    #[error(transparent)]
    Syntax(#[from] ParseError),
    /// The text parses but the graph breaks the verifier's rules; every error,
    /// in the verifier's order, each at its line:column.
    #[error("{}", located_list(.0))]
    Invalid(Vec<LocatedError>),
}

fn located_list(errs: &[LocatedError]) -> String {
    let lines: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
    lines.join("\n")
}

impl TextError {
    /// Position of the first error.
    pub fn pos(&self) -> Pos {
        match self {
            TextError::Syntax(e) => e.pos,
            TextError::Invalid(errs) => errs
                .first()
                .map(|e| e.span.start)
                .unwrap_or(Pos { line: 1, column: 1 }),
        }
    }
}

/// Parses a graph as written; see the module docs for what is checked here.
pub fn parse(text: &str) -> Result<Graph, ParseError> {
    parse_with_map(text).map(|(g, _)| g)
}

/// [`parse`], also returning where each statement and token is.
pub fn parse_with_map(text: &str) -> Result<(Graph, SourceMap), ParseError> {
    Parser::new(text).graph()
}

/// Parses and verifies: syntax errors, then every verifier error at its
/// line:column. On success, the graph and its [`GraphInfo`].
pub fn parse_and_verify(
    text: &str,
    manifest: Option<&WeightManifest>,
) -> Result<(Graph, GraphInfo), TextError> {
    let (g, map) = parse_with_map(text)?;
    match verify(&g, manifest) {
        Ok(info) => Ok((g, info)),
        Err(errs) => Err(TextError::Invalid(
            errs.errors
                .into_iter()
                .map(|error| LocatedError {
                    span: map.span(&error.location),
                    error,
                })
                .collect(),
        )),
    }
}

const LINEAR_ARGS: &[&str] = &["factor"];
const LLAMA3_ARGS: &[&str] = &[
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position",
];

// ---------------------------------------------------------------- lexer --

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Value(u32),
    Num(String),
    Str(String),
    Punct(char),
    Eof,
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    span: Span,
}

impl Token {
    /// How the token reads in an "expected ..., found ..." message.
    fn describe(&self) -> String {
        match &self.tok {
            Tok::Ident(s) => format!("`{s}`"),
            Tok::Value(v) => format!("`%{v}`"),
            Tok::Num(s) => format!("number `{s}`"),
            Tok::Str(s) => format!("string \"{}\"", crate::text::escape(s)),
            Tok::Punct(c) => format!("`{c}`"),
            Tok::Eof => "end of input".to_string(),
        }
    }
}

struct Lexer<'a> {
    src: &'a str,
    /// Byte offset of the next character.
    at: usize,
    pos: Pos,
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}
fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '.'
}

impl<'a> Lexer<'a> {
    fn new(src: &'a str) -> Lexer<'a> {
        Lexer {
            src,
            at: 0,
            pos: Pos { line: 1, column: 1 },
        }
    }

    fn peek_char(&self) -> Option<char> {
        self.src[self.at..].chars().next()
    }
    fn peek_char2(&self) -> Option<char> {
        let mut it = self.src[self.at..].chars();
        it.next();
        it.next()
    }

    fn bump_char(&mut self) -> Option<char> {
        let c = self.peek_char()?;
        self.at += c.len_utf8();
        if c == '\n' {
            self.pos.line += 1;
            self.pos.column = 1;
        } else {
            self.pos.column += 1;
        }
        Some(c)
    }

    fn err(pos: Pos, kind: ParseErrorKind) -> ParseError {
        ParseError { pos, kind }
    }

    fn skip_trivia(&mut self) {
        loop {
            match self.peek_char() {
                Some(c) if c.is_whitespace() => {
                    self.bump_char();
                }
                Some('/') if self.peek_char2() == Some('/') => {
                    while let Some(c) = self.peek_char() {
                        if c == '\n' {
                            break;
                        }
                        self.bump_char();
                    }
                }
                _ => return,
            }
        }
    }

    fn next(&mut self) -> Result<Token, ParseError> {
        self.skip_trivia();
        let start = self.pos;
        let begin = self.at;
        let Some(c) = self.peek_char() else {
            return Ok(Token {
                tok: Tok::Eof,
                span: Span { start, end: start },
            });
        };
        let tok = if is_ident_start(c) {
            while self.peek_char().is_some_and(is_ident_char) {
                self.bump_char();
            }
            Tok::Ident(self.src[begin..self.at].to_string())
        } else if c == '%' {
            self.bump_char();
            if !self.peek_char().is_some_and(|c| c.is_ascii_digit()) {
                return Err(Self::err(
                    start,
                    ParseErrorKind::Expected {
                        expected: "digits after `%` (values are written %0, %1, ...)".into(),
                        found: self
                            .peek_char()
                            .map(|c| format!("`{c}`"))
                            .unwrap_or_else(|| "end of input".into()),
                    },
                ));
            }
            while self.peek_char().is_some_and(is_ident_char) {
                self.bump_char();
            }
            let text = &self.src[begin..self.at];
            let digits = &text[1..];
            match digits.parse::<u32>() {
                Ok(v) if digits.bytes().all(|b| b.is_ascii_digit()) => Tok::Value(v),
                _ => return Err(Self::err(start, ParseErrorKind::BadValueId(text.into()))),
            }
        } else if c.is_ascii_digit() || c == '-' {
            self.number(start, begin)?
        } else if c == '"' {
            self.string(start)?
        } else if "=,:{}[]()".contains(c) {
            self.bump_char();
            Tok::Punct(c)
        } else {
            return Err(Self::err(start, ParseErrorKind::UnexpectedChar(c)));
        };
        Ok(Token {
            tok,
            span: Span {
                start,
                end: self.pos,
            },
        })
    }

    /// `-?DIGITS(.DIGITS)?([eE][+-]?DIGITS)?` or `-inf`.
    fn number(&mut self, start: Pos, begin: usize) -> Result<Tok, ParseError> {
        let bad = |me: &mut Self, why: &str| {
            // Swallow the rest of the word so the message shows all of it.
            while me
                .peek_char()
                .is_some_and(|c| is_ident_char(c) || c == '-' || c == '+')
            {
                me.bump_char();
            }
            Err(Self::err(
                start,
                ParseErrorKind::BadNumber {
                    text: me.src[begin..me.at].to_string(),
                    why: why.to_string(),
                },
            ))
        };
        if self.peek_char() == Some('-') {
            self.bump_char();
            if self.src[self.at..].starts_with("inf") {
                for _ in 0..3 {
                    self.bump_char();
                }
                if self.peek_char().is_some_and(is_ident_char) {
                    return bad(self, "expected a number");
                }
                return Ok(Tok::Num("-inf".into()));
            }
            if !self.peek_char().is_some_and(|c| c.is_ascii_digit()) {
                return bad(self, "a digit must follow `-`");
            }
        }
        let digits = |me: &mut Self| {
            let mut n = 0;
            while me.peek_char().is_some_and(|c| c.is_ascii_digit()) {
                me.bump_char();
                n += 1;
            }
            n
        };
        digits(self);
        if self.peek_char() == Some('.') {
            self.bump_char();
            if digits(self) == 0 {
                return bad(self, "digits must follow the decimal point");
            }
        }
        if matches!(self.peek_char(), Some('e' | 'E')) {
            self.bump_char();
            if matches!(self.peek_char(), Some('+' | '-')) {
                self.bump_char();
            }
            if digits(self) == 0 {
                return bad(self, "digits must follow the exponent marker");
            }
        }
        if self.peek_char().is_some_and(is_ident_char) {
            return bad(self, "a number must not run into letters");
        }
        Ok(Tok::Num(self.src[begin..self.at].to_string()))
    }

    fn string(&mut self, start: Pos) -> Result<Tok, ParseError> {
        self.bump_char(); // opening quote
        let mut out = String::new();
        loop {
            let esc_pos = self.pos;
            match self.bump_char() {
                None | Some('\n') | Some('\r') => {
                    return Err(Self::err(start, ParseErrorKind::UnterminatedString))
                }
                Some('"') => return Ok(Tok::Str(out)),
                Some('\\') => {
                    let bad = |text: String| Self::err(esc_pos, ParseErrorKind::BadEscape(text));
                    match self.bump_char() {
                        Some('"') => out.push('"'),
                        Some('\\') => out.push('\\'),
                        Some('n') => out.push('\n'),
                        Some('r') => out.push('\r'),
                        Some('t') => out.push('\t'),
                        Some('u') => {
                            let begin = self.at;
                            if self.peek_char() != Some('{') {
                                return Err(bad("\\u".into()));
                            }
                            self.bump_char();
                            let mut hex = String::new();
                            while let Some(c) = self.peek_char() {
                                if c == '}' || c == '"' || c == '\n' || hex.len() > 6 {
                                    break;
                                }
                                hex.push(c);
                                self.bump_char();
                            }
                            let closed = self.peek_char() == Some('}');
                            if closed {
                                self.bump_char();
                            }
                            let text = format!("\\u{}", &self.src[begin..self.at]);
                            let ch = (closed
                                && !hex.is_empty()
                                && hex.len() <= 6
                                && hex.bytes().all(|b| b.is_ascii_hexdigit()))
                            .then(|| u32::from_str_radix(&hex, 16).ok())
                            .flatten()
                            .and_then(char::from_u32);
                            match ch {
                                Some(ch) => out.push(ch),
                                None => return Err(bad(text)),
                            }
                        }
                        Some(c) => return Err(bad(format!("\\{c}"))),
                        None => return Err(Self::err(start, ParseErrorKind::UnterminatedString)),
                    }
                }
                Some(c) => out.push(c),
            }
        }
    }
}

// --------------------------------------------------------------- parser --

/// An attribute value before it is given a type.
#[derive(Clone, Debug)]
enum AttrVal {
    Num(String),
    Word(String),
    Call(String, Vec<Attr>),
}

#[derive(Clone, Debug)]
struct Attr {
    name: String,
    name_span: Span,
    value: AttrVal,
    value_span: Span,
}

impl AttrVal {
    fn text(&self) -> String {
        match self {
            AttrVal::Num(s) | AttrVal::Word(s) => s.clone(),
            AttrVal::Call(f, _) => format!("{f}(...)"),
        }
    }
}

struct Parser<'a> {
    lex: Lexer<'a>,
    peeked: Option<Token>,
    /// End of the last token taken.
    prev_end: Pos,
    /// First definition of each value id.
    defs: BTreeMap<u32, ValueData>,
    /// Start of the definition of each value id (first one).
    def_spans: BTreeMap<u32, Span>,
    /// First use (argument or output) of each value id.
    first_use: BTreeMap<u32, Span>,
    g: Graph,
    map: SourceMap,
}

type PResult<T> = Result<T, ParseError>;

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Parser<'a> {
        let origin = Pos { line: 1, column: 1 };
        Parser {
            lex: Lexer::new(src),
            peeked: None,
            prev_end: origin,
            defs: BTreeMap::new(),
            def_spans: BTreeMap::new(),
            first_use: BTreeMap::new(),
            g: Graph::default(),
            map: SourceMap {
                graph: Span {
                    start: origin,
                    end: origin,
                },
                inputs: vec![],
                weights: vec![],
                nodes: vec![],
                outputs: vec![],
            },
        }
    }

    fn peek(&mut self) -> PResult<&Token> {
        if self.peeked.is_none() {
            self.peeked = Some(self.lex.next()?);
        }
        Ok(self.peeked.as_ref().expect("just filled"))
    }

    fn bump(&mut self) -> PResult<Token> {
        self.peek()?;
        let t = self.peeked.take().expect("peeked");
        self.prev_end = t.span.end;
        Ok(t)
    }

    fn is_punct(&mut self, c: char) -> PResult<bool> {
        Ok(self.peek()?.tok == Tok::Punct(c))
    }

    /// An "expected X, found Y" error. When Y starts on a later line than
    /// the previous token ends, the problem is the missing X at the end of
    /// that previous token, so the error points there.
    fn expected(&mut self, what: &str) -> ParseError {
        let (found, start) = match self.peek() {
            Ok(t) => (t.describe(), t.span.start),
            Err(e) => return e,
        };
        let pos = if start.line > self.prev_end.line {
            self.prev_end
        } else {
            start
        };
        ParseError {
            pos,
            kind: ParseErrorKind::Expected {
                expected: what.to_string(),
                found,
            },
        }
    }

    fn expect_punct(&mut self, c: char, what: &str) -> PResult<Token> {
        if self.is_punct(c)? {
            self.bump()
        } else {
            Err(self.expected(what))
        }
    }

    fn expect_string(&mut self, what: &str) -> PResult<(String, Span)> {
        if let Tok::Str(_) = self.peek()?.tok {
            let t = self.bump()?;
            if let Tok::Str(s) = t.tok {
                return Ok((s, t.span));
            }
        }
        Err(self.expected(what))
    }

    fn expect_value(&mut self, what: &str) -> PResult<(u32, Span)> {
        if let Tok::Value(v) = self.peek()?.tok {
            let t = self.bump()?;
            return Ok((v, t.span));
        }
        Err(self.expected(what))
    }

    fn expect_ident(&mut self, what: &str) -> PResult<(String, Span)> {
        if let Tok::Ident(_) = self.peek()?.tok {
            let t = self.bump()?;
            if let Tok::Ident(s) = t.tok {
                return Ok((s, t.span));
            }
        }
        Err(self.expected(what))
    }

    fn graph(mut self) -> PResult<(Graph, SourceMap)> {
        match &self.peek()?.tok {
            Tok::Ident(k) if k == "graph" => {
                let t = self.bump()?;
                self.map.graph = t.span;
            }
            _ => return Err(self.expected("`graph \"<name>\" {` at the start of the text")),
        }
        let (name, _) = self.expect_string("the graph name as a string, e.g. \"llama b1q1s0\"")?;
        self.g.name = name;
        self.expect_punct('{', "`{` after the graph name")?;
        loop {
            let t = self.peek()?.clone();
            match &t.tok {
                Tok::Punct('}') => {
                    self.bump()?;
                    break;
                }
                Tok::Ident(k) if k == "output" => self.output()?,
                Tok::Value(_) => self.definition()?,
                Tok::Eof => return Err(ParseError {
                    pos: t.span.start,
                    kind: ParseErrorKind::Expected {
                        expected:
                            "a statement or the closing `}` of the graph (the text is cut short)"
                                .into(),
                        found: "end of input".into(),
                    },
                }),
                _ => {
                    return Err(self
                        .expected("a statement (`%N = ...` or `output \"<name>\" = %N`) or `}`"))
                }
            }
        }
        let t = self.peek()?.clone();
        if t.tok != Tok::Eof {
            return Err(ParseError {
                pos: t.span.start,
                kind: ParseErrorKind::Expected {
                    expected: "end of input after the closing `}` of the graph".into(),
                    found: t.describe(),
                },
            });
        }
        self.finish()
    }

    fn output(&mut self) -> PResult<()> {
        let kw = self.bump()?;
        let (name, _) = self.expect_string("the output name as a string after `output`")?;
        self.expect_punct('=', "`=` after the output name")?;
        let (v, vspan) = self.expect_value("the output value `%N`")?;
        self.use_value(v, vspan);
        self.g.outputs.push((name, ValueId(v)));
        self.map.outputs.push(Span {
            start: kw.span.start,
            end: vspan.end,
        });
        Ok(())
    }

    fn use_value(&mut self, v: u32, span: Span) {
        self.first_use.entry(v).or_insert(span);
    }

    fn define(&mut self, v: u32, span: Span, data: ValueData) {
        self.defs.entry(v).or_insert(data);
        self.def_spans.entry(v).or_insert(span);
    }

    fn definition(&mut self) -> PResult<()> {
        let mut results = vec![self.expect_value("a value `%N`")?];
        while self.is_punct(',')? {
            self.bump()?;
            results.push(self.expect_value("another result `%N` after `,`")?);
        }
        self.expect_punct(
            '=',
            "`,` and another result, or `=` after the result value(s)",
        )?;
        let (word, word_span) = self.expect_ident("an op name, `input` or `weight` after `=`")?;
        let start = results[0].1.start;
        let one = |what: &'static str, results: &[(u32, Span)]| {
            if results.len() == 1 {
                Ok(())
            } else {
                Err(ParseError {
                    pos: results[1].1.start,
                    kind: ParseErrorKind::OneResult {
                        what,
                        got: results.len(),
                    },
                })
            }
        };
        match word.as_str() {
            "input" => {
                one("an input", &results)?;
                let (role_name, role_span) =
                    self.expect_ident("an input role after `input`, e.g. token_ids")?;
                let Some(role) = InputRole::from_name(&role_name) else {
                    return Err(ParseError {
                        pos: role_span.start,
                        kind: ParseErrorKind::UnknownRole { name: role_name },
                    });
                };
                self.expect_punct(':', "`:` and the input's type after its role")?;
                let (ty, ty_span) = self.ty()?;
                let (v, vspan) = results[0];
                self.define(
                    v,
                    vspan,
                    ValueData {
                        ty,
                        def: ValueDef::Input(role),
                    },
                );
                self.g.inputs.push(ValueId(v));
                self.map.inputs.push(Span {
                    start,
                    end: ty_span.end,
                });
            }
            "weight" => {
                one("a weight", &results)?;
                let (name, _) = self.expect_string(
                    "the weight's manifest name as a string after `weight`, e.g. \"model.norm.weight\"",
                )?;
                self.expect_punct(':', "`:` and the weight's type after its name")?;
                let (ty, ty_span) = self.ty()?;
                let (v, vspan) = results[0];
                self.define(
                    v,
                    vspan,
                    ValueData {
                        ty,
                        def: ValueDef::Weight(name),
                    },
                );
                self.g.weights.push(ValueId(v));
                self.map.weights.push(Span {
                    start,
                    end: ty_span.end,
                });
            }
            m if Op::MNEMONICS.contains(&m) => {
                let op = self.op(m, word_span)?;
                let mut args = vec![];
                if let Tok::Value(_) = self.peek()?.tok {
                    args.push(self.expect_value("an argument")?);
                    while self.is_punct(',')? {
                        self.bump()?;
                        args.push(self.expect_value("another argument `%N` after `,`")?);
                    }
                }
                let what = if args.is_empty() {
                    "the arguments `%N, ...` or `:` and the result type(s)"
                } else {
                    "`,` and another argument, or `:` and the result type(s)"
                };
                if !self.is_punct(':')? {
                    return Err(self.expected(what));
                }
                self.bump()?;
                let mut types = vec![self.ty()?];
                while self.is_punct(',')? {
                    self.bump()?;
                    types.push(self.ty()?);
                }
                if types.len() != results.len() {
                    return Err(ParseError {
                        pos: types[0].1.start,
                        kind: ParseErrorKind::TypeCount {
                            results: results.len(),
                            types: types.len(),
                        },
                    });
                }
                let node = NodeId(self.g.nodes.len() as u32);
                for (i, ((v, vspan), (ty, _))) in results.iter().zip(&types).enumerate() {
                    self.define(
                        *v,
                        *vspan,
                        ValueData {
                            ty: ty.clone(),
                            def: ValueDef::Node {
                                node,
                                index: i as u32,
                            },
                        },
                    );
                }
                for &(a, aspan) in &args {
                    self.use_value(a, aspan);
                }
                self.g.nodes.push(Node {
                    op,
                    args: args.iter().map(|&(a, _)| ValueId(a)).collect(),
                    results: results.iter().map(|&(r, _)| ValueId(r)).collect(),
                });
                self.map.nodes.push(NodeSpans {
                    op: word_span,
                    results: results.iter().map(|r| r.1).collect(),
                    args: args.iter().map(|a| a.1).collect(),
                    types: types.iter().map(|t| t.1).collect(),
                });
            }
            _ => {
                return Err(ParseError {
                    pos: word_span.start,
                    kind: ParseErrorKind::UnknownOp { name: word },
                })
            }
        }
        Ok(())
    }

    fn ty(&mut self) -> PResult<(TensorType, Span)> {
        let (name, span) = self.expect_ident("a type such as bf16[2,64]")?;
        let Some(dtype) = DType::from_name(&name) else {
            return Err(ParseError {
                pos: span.start,
                kind: ParseErrorKind::UnknownDType { name },
            });
        };
        self.expect_punct(
            '[',
            "`[` and the dimensions after the dtype, e.g. bf16[2,64]",
        )?;
        let mut dims = vec![];
        if !self.is_punct(']')? {
            loop {
                dims.push(self.u32_token("a dimension")?);
                if self.is_punct(',')? {
                    self.bump()?;
                } else {
                    break;
                }
            }
        }
        let close = self.expect_punct(']', "`,` and another dimension, or `]`")?;
        let mut ty = TensorType::new(dtype, Shape(dims));
        let mut end = close.span.end;
        if matches!(&self.peek()?.tok, Tok::Ident(w) if w == "stored") {
            self.bump()?;
            let (qname, qspan) =
                self.expect_ident("a storage type after `stored`, e.g. q4_k or fp8_e4m3")?;
            let Some(q) = QuantType::from_name(&qname) else {
                return Err(ParseError {
                    pos: qspan.start,
                    kind: ParseErrorKind::UnknownStorage { name: qname },
                });
            };
            ty = ty.stored(q);
            end = qspan.end;
        }
        Ok((
            ty,
            Span {
                start: span.start,
                end,
            },
        ))
    }

    fn u32_token(&mut self, what: &str) -> PResult<u32> {
        let t = self.peek()?.clone();
        match &t.tok {
            Tok::Num(s) => {
                self.bump()?;
                parse_u32(s).map_err(|why| ParseError {
                    pos: t.span.start,
                    kind: ParseErrorKind::BadNumber {
                        text: s.clone(),
                        why,
                    },
                })
            }
            _ => Err(self.expected(what)),
        }
    }

    fn attr_list(&mut self, close: char) -> PResult<Vec<Attr>> {
        let mut attrs = vec![];
        if self.is_punct(close)? {
            self.bump()?;
            return Ok(attrs);
        }
        loop {
            let (name, name_span) = self.expect_ident("an attribute name")?;
            self.expect_punct('=', "`=` after the attribute name")?;
            let t = self.peek()?.clone();
            let value = match &t.tok {
                Tok::Num(s) => {
                    self.bump()?;
                    AttrVal::Num(s.clone())
                }
                Tok::Ident(w) => {
                    self.bump()?;
                    if self.is_punct('(')? {
                        if close == ')' {
                            // Only one level exists (rope scalings); refusing
                            // deeper nesting also bounds the recursion.
                            return Err(self.expected(
                                "`,` or `)`: calls like linear(...) do not nest",
                            ));
                        }
                        self.bump()?;
                        AttrVal::Call(w.clone(), self.attr_list(')')?)
                    } else {
                        AttrVal::Word(w.clone())
                    }
                }
                _ => {
                    return Err(self.expected(
                        "an attribute value: a number, a word (true, none, bf16) or a call like linear(factor = 2)",
                    ))
                }
            };
            attrs.push(Attr {
                name,
                name_span,
                value,
                value_span: Span {
                    start: t.span.start,
                    end: self.prev_end,
                },
            });
            if self.is_punct(',')? {
                self.bump()?;
            } else {
                let what = if close == '}' {
                    "`,` and another attribute, or `}`"
                } else {
                    "`,` and another argument, or `)`"
                };
                self.expect_punct(close, what)?;
                return Ok(attrs);
            }
        }
    }

    /// Parses the optional `{...}` after a mnemonic and builds the op.
    fn op(&mut self, m: &str, m_span: Span) -> PResult<Op> {
        // A missing attribute is reported at the closing `}`, or at the
        // mnemonic when there are no braces.
        let (attrs, end) = if self.is_punct('{')? {
            self.bump()?;
            let a = self.attr_list('}')?;
            let close = Pos {
                line: self.prev_end.line,
                column: self.prev_end.column.saturating_sub(1).max(1),
            };
            (a, close)
        } else {
            (vec![], m_span.start)
        };
        let mut a = Attrs::new(m, attrs_names_checked(m, attr_names(m), &attrs)?, end);
        let op = match m {
            "embedding" => Op::Embedding,
            "rms_norm" => Op::RmsNorm {
                eps: a.f32("eps")?,
                unit_offset: a.bool("unit_offset")?,
            },
            "add_rms_norm" => Op::AddRmsNorm {
                eps: a.f32("eps")?,
                unit_offset: a.bool("unit_offset")?,
            },
            "matmul" => Op::MatMul {
                bias: a.bool("bias")?,
                out: a.dtype("out")?,
            },
            "head_rms_norm" => Op::HeadRmsNorm {
                heads: a.u32("heads")?,
                head_dim: a.u32("head_dim")?,
                eps: a.f32("eps")?,
                unit_offset: a.bool("unit_offset")?,
            },
            "rope" => Op::Rope {
                heads: a.u32("heads")?,
                head_dim: a.u32("head_dim")?,
                rope: Rope {
                    theta: a.f32("theta")?,
                    scaling: a.scaling("scaling")?,
                },
            },
            "kv_write" => Op::KvWrite,
            "paged_attention" => {
                let heads = head_attrs(&mut a)?;
                paged_attention(&mut a, heads)?
            }
            "qkv_rope_kv_write" => {
                let heads = head_attrs(&mut a)?;
                qkv_rope_kv_write(&mut a, heads)?
            }
            "rope_attention" => {
                let heads = head_attrs(&mut a)?;
                let attn = paged_attention(&mut a, heads)?;
                let rope = qkv_rope_kv_write(&mut a, heads)?;
                Op::join_rope_attention(&rope, &attn).expect("both parts have the same heads")
            }
            "matmul_qkv_rope" => {
                let bias = a.bool("bias")?;
                let eps = a.opt_f32("norm")?;
                let norm_unit_offset = a.bool_only_with(
                    "norm_unit_offset",
                    eps.is_some(),
                    "false (true needs `norm` set)",
                )?;
                let mm = Op::FusedMatMul {
                    bias,
                    out: DType::BF16,
                    pre: eps.map(|eps| PreNorm {
                        eps,
                        unit_offset: norm_unit_offset,
                    }),
                    post: Epilogue::None,
                };
                let heads = head_attrs(&mut a)?;
                let rope = qkv_rope_kv_write(&mut a, heads)?;
                Op::join_matmul_qkv_rope(&mm, &rope, DType::BF16)
                    .expect("a fused_matmul without an epilogue and a qkv_rope_kv_write")
            }
            "silu_mul" => Op::SiluMul,
            "gelu_tanh_mul" => Op::GeluTanhMul,
            "add" => Op::Add,
            "gather_last" => Op::GatherLast {
                group: a.u32("group")?,
            },
            "argmax" => Op::Argmax,
            "sample" => Op::Sample,
            "accept_greedy" => Op::AcceptGreedy {
                spec: a.u32("spec")?,
            },
            "fused_matmul" => {
                let bias = a.bool("bias")?;
                let out = a.dtype("out")?;
                let eps = a.opt_f32("norm")?;
                let unit_offset = a.bool_only_with(
                    "unit_offset",
                    eps.is_some(),
                    "false (true needs `norm` set)",
                )?;
                Op::FusedMatMul {
                    bias,
                    out,
                    pre: eps.map(|eps| PreNorm { eps, unit_offset }),
                    post: a.epilogue("epilogue")?,
                }
            }
            "scale" => Op::Scale {
                factor: a.f32("factor")?,
                softcap: a.opt_f32("softcap")?,
            },
            "all_reduce" => Op::AllReduce {
                ranks: a.u32("ranks")?,
                out: a.dtype("out")?,
            },
            "sharded_argmax" => Op::ShardedArgmax {
                ranks: a.u32("ranks")?,
            },
            "attention_partials" => {
                let heads = head_attrs(&mut a)?;
                let Op::PagedAttention(attn) = paged_attention(&mut a, heads)? else {
                    unreachable!("paged_attention builds a paged_attention")
                };
                Op::AttentionPartials {
                    attn,
                    parts: a.u32("parts")?,
                }
            }
            "attention_combine" => Op::AttentionCombine {
                heads: a.u32("heads")?,
                head_dim: a.u32("head_dim")?,
                parts: a.u32("parts")?,
                out: a.dtype("out")?,
            },
            other => {
                return Err(ParseError {
                    pos: m_span.start,
                    kind: ParseErrorKind::UnknownOp { name: other.into() },
                })
            }
        };
        Ok(op)
    }

    fn finish(mut self) -> PResult<(Graph, SourceMap)> {
        // Dense ids: the first missing id, if any, is an error.
        let missing = self
            .defs
            .keys()
            .enumerate()
            .find(|&(i, &k)| i as u64 != k as u64)
            .map(|(i, &next)| (i as u32, next));
        if let Some((missing, next)) = missing {
            return Err(match self.first_use.get(&missing) {
                Some(span) => ParseError {
                    pos: span.start,
                    kind: ParseErrorKind::UsedButUndefined(missing),
                },
                None => ParseError {
                    pos: self.def_spans[&next].start,
                    kind: ParseErrorKind::IdGap { missing, next },
                },
            });
        }
        self.g.values = std::mem::take(&mut self.defs).into_values().collect();
        Ok((self.g, self.map))
    }
}

/// Checks names against the op's attribute list (unknown, duplicate).
fn attrs_names_checked(
    op: &str,
    valid: &'static [&'static str],
    attrs: &[Attr],
) -> PResult<Vec<Attr>> {
    for (i, a) in attrs.iter().enumerate() {
        if !valid.contains(&a.name.as_str()) {
            return Err(ParseError {
                pos: a.name_span.start,
                kind: ParseErrorKind::UnknownAttr {
                    op: op.into(),
                    name: a.name.clone(),
                    valid,
                },
            });
        }
        if attrs[..i].iter().any(|b| b.name == a.name) {
            return Err(ParseError {
                pos: a.name_span.start,
                kind: ParseErrorKind::DuplicateAttr {
                    op: op.into(),
                    name: a.name.clone(),
                },
            });
        }
    }
    Ok(attrs.to_vec())
}

/// Typed access to a checked attribute list.
/// `heads`, `kv_heads` and `head_dim`, shared by the attention and rope
/// ops (`rope_attention` reads them once for its two parts).
fn head_attrs(a: &mut Attrs) -> PResult<(u32, u32, u32)> {
    Ok((a.u32("heads")?, a.u32("kv_heads")?, a.u32("head_dim")?))
}

/// The rest of a `paged_attention` (or of `rope_attention`'s attention).
fn paged_attention(a: &mut Attrs, (heads, kv_heads, head_dim): (u32, u32, u32)) -> PResult<Op> {
    Ok(Op::PagedAttention(AttnAttrs {
        heads,
        kv_heads,
        head_dim,
        query: a.u32("query")?,
        block_size: a.u32("block_size")?,
        scale: a.f32("scale")?,
        window: a.opt_u32("window")?,
        softcap: a.opt_f32("softcap")?,
    }))
}

/// The rest of a `qkv_rope_kv_write` (or of `rope_attention`'s rope).
fn qkv_rope_kv_write(a: &mut Attrs, (heads, kv_heads, head_dim): (u32, u32, u32)) -> PResult<Op> {
    Ok(Op::QkvRopeKvWrite {
        heads,
        kv_heads,
        head_dim,
        rope: Rope {
            theta: a.f32("theta")?,
            scaling: a.scaling("scaling")?,
        },
        qk_norm: a.opt_f32("qk_norm")?,
        unit_offset: a.bool("unit_offset")?,
    })
}

struct Attrs {
    op: String,
    attrs: Vec<Attr>,
    /// Where a missing attribute is reported: the end of the list.
    end: Pos,
}

fn parse_u32(s: &str) -> Result<u32, String> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err("expected an unsigned integer".into());
    }
    s.parse::<u32>()
        .map_err(|_| format!("does not fit in 32 bits (at most {})", u32::MAX))
}

fn parse_f32(s: &str) -> Result<f32, String> {
    match s {
        "inf" => return Ok(f32::INFINITY),
        "-inf" => return Ok(f32::NEG_INFINITY),
        "nan" => return Ok(f32::NAN),
        _ => {}
    }
    let first = s.chars().next().unwrap_or(' ');
    if !(first.is_ascii_digit() || first == '-') {
        return Err("expected a float such as 1e-5, 0.125, inf or nan".into());
    }
    match s.parse::<f32>() {
        Ok(x) if x.is_infinite() => Err(format!(
            "out of the f32 range (at most {:e}); write inf for infinity",
            f32::MAX
        )),
        Ok(x) => Ok(x),
        Err(_) => Err("expected a float such as 1e-5, 0.125, inf or nan".into()),
    }
}

impl Attrs {
    fn new(op: &str, attrs: Vec<Attr>, end: Pos) -> Attrs {
        Attrs {
            op: op.into(),
            attrs,
            end,
        }
    }

    fn get(&mut self, name: &'static str, what: &'static str) -> PResult<Attr> {
        match self.attrs.iter().position(|a| a.name == name) {
            Some(i) => Ok(self.attrs.remove(i)),
            None => Err(ParseError {
                pos: self.end,
                kind: ParseErrorKind::MissingAttr {
                    op: self.op.clone(),
                    name,
                    what,
                },
            }),
        }
    }

    fn bad(&self, a: &Attr, what: &'static str) -> ParseError {
        ParseError {
            pos: a.value_span.start,
            kind: ParseErrorKind::BadAttr {
                op: self.op.clone(),
                name: a.name.clone(),
                what,
                got: a.value.text(),
            },
        }
    }

    fn number<T>(
        &self,
        a: &Attr,
        what: &'static str,
        conv: fn(&str) -> Result<T, String>,
    ) -> PResult<T> {
        let text = match &a.value {
            AttrVal::Num(s) => s.as_str(),
            AttrVal::Word(w) if what.contains("float") && (w == "inf" || w == "nan") => w,
            _ => return Err(self.bad(a, what)),
        };
        conv(text).map_err(|why| ParseError {
            pos: a.value_span.start,
            kind: ParseErrorKind::BadNumber {
                text: text.into(),
                why,
            },
        })
    }

    fn f32(&mut self, name: &'static str) -> PResult<f32> {
        const WHAT: &str = "a float";
        let a = self.get(name, WHAT)?;
        self.number(&a, WHAT, parse_f32)
    }

    fn u32(&mut self, name: &'static str) -> PResult<u32> {
        const WHAT: &str = "an unsigned integer";
        let a = self.get(name, WHAT)?;
        self.number(&a, WHAT, parse_u32)
    }

    fn bool(&mut self, name: &'static str) -> PResult<bool> {
        const WHAT: &str = "true or false";
        let a = self.get(name, WHAT)?;
        match &a.value {
            AttrVal::Word(w) if w == "true" => Ok(true),
            AttrVal::Word(w) if w == "false" => Ok(false),
            _ => Err(self.bad(&a, WHAT)),
        }
    }

    /// A bool that may only be `true` when `allowed` (an attribute that
    /// only means something next to another one, so every op has one text
    /// form); `what_else` describes the accepted value otherwise.
    fn bool_only_with(
        &mut self,
        name: &'static str,
        allowed: bool,
        what_else: &'static str,
    ) -> PResult<bool> {
        let what = if allowed { "true or false" } else { what_else };
        let a = self.get(name, what)?;
        match &a.value {
            AttrVal::Word(w) if w == "true" && allowed => Ok(true),
            AttrVal::Word(w) if w == "false" => Ok(false),
            _ => Err(self.bad(&a, what)),
        }
    }

    fn epilogue(&mut self, name: &'static str) -> PResult<Epilogue> {
        const WHAT: &str = "an epilogue (none, silu_mul, gelu_tanh_mul, residual)";
        let a = self.get(name, WHAT)?;
        match &a.value {
            AttrVal::Word(w) => Epilogue::from_name(w).ok_or_else(|| self.bad(&a, WHAT)),
            _ => Err(self.bad(&a, WHAT)),
        }
    }

    fn dtype(&mut self, name: &'static str) -> PResult<DType> {
        const WHAT: &str = "a dtype (bf16, f16, f32, i32)";
        let a = self.get(name, WHAT)?;
        match &a.value {
            AttrVal::Word(w) => DType::from_name(w).ok_or_else(|| self.bad(&a, WHAT)),
            _ => Err(self.bad(&a, WHAT)),
        }
    }

    fn is_none(a: &Attr) -> bool {
        matches!(&a.value, AttrVal::Word(w) if w == "none")
    }

    fn opt_u32(&mut self, name: &'static str) -> PResult<Option<u32>> {
        const WHAT: &str = "none or an unsigned integer";
        let a = self.get(name, WHAT)?;
        if Self::is_none(&a) {
            return Ok(None);
        }
        self.number(&a, WHAT, parse_u32).map(Some)
    }

    fn opt_f32(&mut self, name: &'static str) -> PResult<Option<f32>> {
        const WHAT: &str = "none or a float";
        let a = self.get(name, WHAT)?;
        if Self::is_none(&a) {
            return Ok(None);
        }
        self.number(&a, WHAT, parse_f32).map(Some)
    }

    fn scaling(&mut self, name: &'static str) -> PResult<RopeScaling> {
        const WHAT: &str = "none, linear(...) or llama3(...)";
        let a = self.get(name, WHAT)?;
        let unknown = |w: &str| ParseError {
            pos: a.value_span.start,
            kind: ParseErrorKind::UnknownScaling(w.to_string()),
        };
        match &a.value {
            AttrVal::Word(w) if w == "none" => Ok(RopeScaling::None),
            AttrVal::Word(w) => Err(unknown(w)),
            AttrVal::Num(_) => Err(self.bad(&a, WHAT)),
            AttrVal::Call(f, args) => {
                let valid = match f.as_str() {
                    "linear" => LINEAR_ARGS,
                    "llama3" => LLAMA3_ARGS,
                    _ => return Err(unknown(f)),
                };
                let op = format!("{}.{}({})", self.op, name, f);
                let close = Pos {
                    line: a.value_span.end.line,
                    column: a.value_span.end.column.saturating_sub(1).max(1),
                };
                let mut s = Attrs::new(&op, attrs_names_checked(&op, valid, args)?, close);
                Ok(match f.as_str() {
                    "linear" => RopeScaling::Linear {
                        factor: s.f32("factor")?,
                    },
                    _ => RopeScaling::Llama3 {
                        factor: s.f32("factor")?,
                        low_freq_factor: s.f32("low_freq_factor")?,
                        high_freq_factor: s.f32("high_freq_factor")?,
                        original_max_position: s.u32("original_max_position")?,
                    },
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_outside_the_f32_range_are_rejected_not_rounded_to_infinity() {
        assert!(parse_f32("1e39")
            .unwrap_err()
            .contains("out of the f32 range"));
        assert_eq!(parse_f32("-inf").unwrap(), f32::NEG_INFINITY);
        assert_eq!(parse_f32("1e-45").unwrap(), f32::from_bits(1));
    }

    #[test]
    fn u32_fields_reject_signs_fractions_and_overflow() {
        assert!(parse_u32("-1").is_err());
        assert!(parse_u32("1.5").is_err());
        assert!(parse_u32("1e3").is_err());
        assert!(parse_u32("4294967296").unwrap_err().contains("32 bits"));
        assert_eq!(parse_u32("4294967295").unwrap(), u32::MAX);
    }
}
