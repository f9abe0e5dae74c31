//! `kiln bench-spec`: speculative decoding with prompt-lookup drafts against
//! plain greedy decoding, on a repetitive and a non-repetitive prompt set.
//!
//! Each prompt is generated twice on the same engine (so graphs are captured
//! once, in a warm-up): plainly, and through a [`Speculator`]. Reported per
//! set: the acceptance rate (accepted lookup drafts over proposed ones),
//! tokens per decode step, and decode tokens/s of both, plus whether the two
//! outputs were token-identical (they must be; a difference is reported, not
//! hidden). Runs on any backend `--device` opens, through the engine API.
//!
//! With a `tokenizer.json` in the weights directory the prompts are built-in
//! English texts (copying a list, editing code; stories, explanations);
//! without one (tiny random models) they are token prompts: a random list
//! repeated, and random tokens. Not here: batching several prompts per step,
//! sampling, drafting models.

use kiln_runtime::text::TextTokenizer;
use kiln_runtime::{
    open_backend, DeviceSpec, Engine, EngineError, EngineOptions, SeqOptions, SpecError,
    SpecOptions, SpecStats, Speculator,
};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// `kiln bench-spec` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchSpecArgs {
    /// The plan file; it needs spec keys `b1q{K+1}s{K}` and a plain `b1q1s0`.
    pub plan: PathBuf,
    /// Model directory the plan was compiled from.
    #[arg(long)]
    pub weights: PathBuf,
    /// Where to run: cpu, cuda[:N] (a build with --features cuda), hip[:N].
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Drafts per step (K).
    #[arg(long, value_name = "K", default_value_t = 3)]
    pub spec: u32,
    /// Tokens to generate per prompt (generation also stops at EOS).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the table (markdown, with date and command) here.
    #[arg(long)]
    pub md: Option<PathBuf>,
}

/// Why the benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchSpecError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("--spec: {0}")]
    Spec(#[from] SpecError),
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One way of decoding a prompt set.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Side {
    /// Tokens generated after the first (the decode phase).
    pub decode_tokens: u64,
    pub decode_steps: u64,
    pub decode_s: f64,
    pub tokens_per_step: f64,
    pub tokens_per_s: f64,
}

/// Results of one prompt set.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SetReport {
    pub name: String,
    pub prompts: usize,
    pub plain: Side,
    pub spec: Side,
    /// Lookup drafts proposed and accepted, and their ratio.
    pub proposed: u64,
    pub accepted: u64,
    pub acceptance_rate: f64,
    /// Decode steps that verified drafts; rows run with filler drafts.
    pub spec_steps: u64,
    pub filler_rows: u64,
    /// spec tokens/s over plain tokens/s.
    pub speedup: f64,
    /// Prompts whose spec output equals their plain output.
    pub identical: usize,
}

/// The whole report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BenchSpecReport {
    pub date: String,
    pub command: String,
    pub device: String,
    pub plan: String,
    pub k: u32,
    pub max_tokens: u32,
    pub prompt_kind: String,
    pub sets: Vec<SetReport>,
}

struct Prompt {
    ids: Vec<u32>,
}

/// Built-in text prompt sets.
const REPETITIVE: &[&str] = &[
    "Repeat this list exactly, one item per line.\napples\nbananas\ncherries\ndates\nelderberries\nfigs\ngrapes\nhoneydew\n\nThe list again:\napples\n",
    "Rename the variable `x` to `total` in this code.\n\n```python\ndef add(a, b):\n    x = a + b\n    return x\n\ndef add3(a, b, c):\n    x = a + b + c\n    return x\n\ndef scale(a, k):\n    x = a * k\n    return x\n```\n\nThe code with `x` renamed to `total`:\n\n```python\ndef add(a, b):\n",
    "Copy this sentence five times.\nThe quick brown fox jumps over the lazy dog.\n1. The quick brown fox jumps over the lazy dog.\n2.",
];
const NON_REPETITIVE: &[&str] = &[
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how photosynthesis works to a ten year old.",
    "What are three differences between cats and dogs?",
];

/// What kind of prompts, and the named sets.
type PromptSets = (String, Vec<(String, Vec<Prompt>)>);

/// The two prompt sets: from the tokenizer when there is one, else tokens.
fn prompt_sets(weights: &Path, vocab: u32) -> Result<PromptSets, BenchSpecError> {
    if weights.join("tokenizer.json").is_file() {
        let tok = TextTokenizer::from_dir(weights)?;
        let enc = |set: &[&str]| -> Result<Vec<Prompt>, EngineError> {
            set.iter()
                .map(|t| {
                    Ok(Prompt {
                        ids: tok.encode(t)?,
                    })
                })
                .collect()
        };
        return Ok((
            "text".into(),
            vec![
                ("repetitive".into(), enc(REPETITIVE)?),
                ("non-repetitive".into(), enc(NON_REPETITIVE)?),
            ],
        ));
    }
    // No tokenizer: deterministic token prompts.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % vocab as u64) as u32
    };
    let mut rep = Vec::new();
    let mut non = Vec::new();
    for _ in 0..3 {
        let list: Vec<u32> = (0..6).map(|_| next()).collect();
        rep.push(Prompt {
            ids: list.iter().copied().cycle().take(24).collect(),
        });
        non.push(Prompt {
            ids: (0..24).map(|_| next()).collect(),
        });
    }
    Ok((
        "tokens (no tokenizer.json)".into(),
        vec![("repetitive".into(), rep), ("non-repetitive".into(), non)],
    ))
}

/// Generates `ids` to the end; returns the tokens and adds the decode phase
/// (after the first generated token) to `side`.
fn generate(
    e: &mut Engine,
    ids: &[u32],
    max_tokens: u32,
    mut spec: Option<&mut Speculator>,
    side: &mut Side,
) -> Result<Vec<u32>, EngineError> {
    let id = e.add_sequence_with(
        ids,
        SeqOptions {
            max_new_tokens: max_tokens,
            stop_on_eos: true,
        },
    )?;
    let mut first: Option<Instant> = None;
    let mut steps = 0u64;
    let mut tokens = 0u64;
    while e.sequence(id).is_some_and(|s| s.finished.is_none()) {
        let out = match spec.as_deref_mut() {
            Some(s) => s.step(e)?,
            None => e.step()?,
        };
        let n: usize = out.iter().map(|(_, t)| t.len()).sum();
        match first {
            None if n > 0 => {
                first = Some(Instant::now());
                tokens += n as u64 - 1;
            }
            None => {}
            Some(_) => {
                steps += 1;
                tokens += n as u64;
            }
        }
    }
    let dt = first.map_or(Duration::ZERO, |f| f.elapsed());
    side.decode_tokens += tokens;
    side.decode_steps += steps;
    side.decode_s += dt.as_secs_f64();
    e.remove_sequence(id)
}

fn finish(side: &mut Side) {
    side.tokens_per_step = ratio(side.decode_tokens as f64, side.decode_steps as f64);
    side.tokens_per_s = ratio(side.decode_tokens as f64, side.decode_s);
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Runs the benchmark. `command` is recorded in the report.
pub fn run(args: &BenchSpecArgs, command: &str) -> Result<BenchSpecReport, BenchSpecError> {
    let device: DeviceSpec = args.device.parse()?;
    let plan = kiln_runtime::loader::read_plan_file(&args.plan)?;
    kiln_runtime::spec::check_plan(&plan, args.spec)?;
    let vocab = plan.meta.info.vocab_size;
    let (prompt_kind, sets) = prompt_sets(&args.weights, vocab)?;
    let backend = open_backend(device)?;
    let opts = EngineOptions {
        log: false,
        ..EngineOptions::default()
    };
    let mut e = Engine::new(plan, &args.weights, backend, opts)?;
    let sopts = SpecOptions::new(args.spec);
    // Warm-up: every key these runs use is captured before timing.
    for (_, prompts) in &sets {
        let mut s = Speculator::new(&e, sopts)?;
        let mut scratch = Side::default();
        generate(&mut e, &prompts[0].ids, 8, None, &mut scratch)?;
        generate(&mut e, &prompts[0].ids, 8, Some(&mut s), &mut scratch)?;
    }
    let mut reports = Vec::new();
    for (name, prompts) in &sets {
        let mut plain = Side::default();
        let mut spec = Side::default();
        let mut stats = SpecStats::default();
        let mut identical = 0;
        for p in prompts {
            let want = generate(&mut e, &p.ids, args.max_tokens, None, &mut plain)?;
            let mut s = Speculator::new(&e, sopts)?;
            let got = generate(&mut e, &p.ids, args.max_tokens, Some(&mut s), &mut spec)?;
            let st = s.stats();
            stats.proposed += st.proposed;
            stats.accepted += st.accepted;
            stats.spec_steps += st.spec_steps;
            stats.filler_rows += st.filler_rows;
            if got == want {
                identical += 1;
            } else {
                eprintln!(
                    "kiln bench-spec: set {name}: speculative output differs from plain decoding \
                     ({} vs {} tokens)",
                    got.len(),
                    want.len()
                );
            }
        }
        finish(&mut plain);
        finish(&mut spec);
        reports.push(SetReport {
            name: name.clone(),
            prompts: prompts.len(),
            speedup: ratio(spec.tokens_per_s, plain.tokens_per_s),
            plain,
            spec,
            proposed: stats.proposed,
            accepted: stats.accepted,
            acceptance_rate: stats.acceptance_rate(),
            spec_steps: stats.spec_steps,
            filler_rows: stats.filler_rows,
            identical,
        });
    }
    Ok(BenchSpecReport {
        date: today(),
        command: command.to_string(),
        device: e.device().name.clone(),
        plan: args.plan.display().to_string(),
        k: args.spec,
        max_tokens: args.max_tokens,
        prompt_kind,
        sets: reports,
    })
}

impl BenchSpecReport {
    /// A markdown table with the date and command.
    pub fn table(&self) -> String {
        let mut s = format!(
            "# kiln bench-spec, {}\n\n`{}`\n\ndevice: {}; plan: {}; k = {}; up to {} tokens per prompt; prompts: {}\n\n",
            self.date, self.command, self.device, self.plan, self.k, self.max_tokens, self.prompt_kind
        );
        s += "| set | prompts | acceptance | spec steps | tokens/step plain | tokens/step spec | tokens/s plain | tokens/s spec | speedup | identical |\n";
        s += "|---|---|---|---|---|---|---|---|---|---|\n";
        for r in &self.sets {
            s += &format!(
                "| {} | {} | {:.1}% ({}/{}) | {}/{} | {:.2} | {:.2} | {:.1} | {:.1} | {:.2}x | {}/{} |\n",
                r.name,
                r.prompts,
                100.0 * r.acceptance_rate,
                r.accepted,
                r.proposed,
                r.spec_steps,
                r.spec.decode_steps,
                r.plain.tokens_per_step,
                r.spec.tokens_per_step,
                r.plain.tokens_per_s,
                r.spec.tokens_per_s,
                r.speedup,
                r.identical,
                r.prompts
            );
        }
        s
    }
}

/// Writes `text` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, text: &str) -> Result<(), BenchSpecError> {
    let err = |source| BenchSpecError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Today's UTC date as YYYY-MM-DD.
fn today() -> String {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_date((secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The proleptic Gregorian date `days` after 1970-01-01.
fn civil_date(days: i64) -> (i64, u32, u32) {
    // Shift to a calendar starting on 0000-03-01 so leap days end each cycle.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of the 400-year era
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153; // month from March = 0
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::civil_date;

    #[test]
    fn civil_dates_match_known_calendar_days() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(59), (1970, 3, 1));
        assert_eq!(civil_date(11_016), (2000, 2, 29));
        assert_eq!(civil_date(19_782), (2024, 2, 29));
        assert_eq!(civil_date(20_000), (2024, 10, 4));
        assert_eq!(civil_date(-1), (1969, 12, 31));
    }
}
