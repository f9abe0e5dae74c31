//! `oracle_run`: kiln's side of the HF oracle (tests/oracle/).
//!
//! Loads a plan and a weights directory on a device, runs a list of prompts
//! given as token ids, `--batch` of them at a time (the sequences of a batch
//! are added together and step together), greedy, `--new-tokens` each, and
//! writes JSON: the generated tokens per prompt, each token's top-2 logit
//! margin and the first-step logits (raw little-endian f32, one row per
//! prompt, in a file next to the JSON) when the plan has a logits output,
//! the per-key counters and the graph decision.
//!
//! With `--drafts FILE` it runs speculative verification instead: before
//! every step of a sequence whose prompt is done, the next `spec` tokens of
//! that prompt's continuation in FILE (or, with `--wrong-drafts`, each of
//! them plus one, mod the vocabulary) are handed to the engine as drafts, and
//! every step's drafts and emitted tokens are recorded.
//!
//! It uses only the runtime's public API (`Engine`), so what it reports is
//! what a serving program would see. Not here: judging anything; the
//! comparison with HF lives in tests/oracle/compare.py.

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, ValueEnum};
use kiln_runtime::{
    open_backend, DeviceSpec, Engine, EngineOptions, PrefillMode, SeqId, SeqOptions,
};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Prefill {
    /// Prompt chunks through query > 1 keys where the plan has them.
    Chunked,
    /// Prompts token by token through query 1 keys.
    Token,
}

#[derive(Parser, Debug)]
#[command(
    name = "oracle_run",
    about = "Greedy (or speculative) decoding of token-id prompts with a kiln plan, as JSON"
)]
struct Args {
    /// The plan (`kiln compile ... -o plan.kiln`).
    #[arg(long)]
    plan: PathBuf,
    /// The model directory the plan was compiled from (safetensors).
    #[arg(long)]
    weights: PathBuf,
    /// cpu, cuda, cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// JSON with `"prompts": [[token ids], ...]`.
    #[arg(long)]
    prompts: PathBuf,
    /// Prompts per batch: each batch's sequences are added together and step together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 32)]
    new_tokens: u32,
    #[arg(long, value_enum, default_value_t = Prefill::Chunked)]
    prefill: Prefill,
    /// JSON with `"continuations": [[token ids], ...]`, one per prompt (and
    /// an optional `"kind"` label): run speculative verification with these
    /// as drafts.
    #[arg(long)]
    drafts: Option<PathBuf>,
    /// With --drafts: offer each continuation token plus one (mod vocab), drafts
    /// that should all be rejected.
    #[arg(long, requires = "drafts")]
    wrong_drafts: bool,
    /// Where to write the JSON (the first-step logits go next to it, as
    /// `<stem>.first-logits.f32`).
    #[arg(long)]
    out: PathBuf,
}

fn read_lists(path: &Path, field: &str) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let lists = v.get(field).and_then(Value::as_array).ok_or_else(|| {
        anyhow!(
            "{} has no `{field}` array; expected {{\"{field}\": [[token ids], ...]}}",
            path.display()
        )
    })?;
    lists
        .iter()
        .enumerate()
        .map(|(i, l)| {
            l.as_array()
                .ok_or_else(|| anyhow!("{}: `{field}[{i}]` is not an array", path.display()))?
                .iter()
                .map(|t| {
                    t.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| {
                            anyhow!(
                                "{}: `{field}[{i}]` holds {t}, not a token id",
                                path.display()
                            )
                        })
                })
                .collect()
        })
        .collect()
}

/// An optional string field of a JSON file.
fn read_field(path: &Path, field: &str) -> Result<Option<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    Ok(v.get(field).and_then(Value::as_str).map(str::to_string))
}

/// Top-2 of a logits row: (argmax, second, margin). NaN-safe (NaN never wins).
fn top2(row: &[f32]) -> (usize, usize, f32) {
    let (mut a, mut b) = (usize::MAX, usize::MAX);
    for (i, &x) in row.iter().enumerate() {
        if x.is_nan() {
            continue;
        }
        if a == usize::MAX || x > row[a] {
            b = a;
            a = i;
        } else if b == usize::MAX || x > row[b] {
            b = i;
        }
    }
    if b == usize::MAX {
        return (a, a, f32::NAN);
    }
    (a, b, row[a] - row[b])
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

#[derive(Default)]
struct SeqRecord {
    tokens: Vec<u32>,
    margins: Vec<f32>,
    second: Vec<u32>,
    /// Tokens whose logits row's host argmax is not the device's token.
    argmax_disagreements: u32,
    steps: Vec<Value>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let prompts = read_lists(&a.prompts, "prompts")?;
    if prompts.is_empty() {
        bail!("{} has no prompts", a.prompts.display());
    }
    let mut drafts_kind = Value::Null;
    let drafts = match &a.drafts {
        Some(p) => {
            let d = read_lists(p, "continuations")?;
            drafts_kind = if a.wrong_drafts {
                json!("wrong")
            } else {
                json!(read_field(p, "kind")?.unwrap_or_else(|| "given".to_string()))
            };
            if d.len() != prompts.len() {
                bail!(
                    "{} has {} continuations for {} prompts; give one per prompt",
                    p.display(),
                    d.len(),
                    prompts.len()
                );
            }
            Some(d)
        }
        None => None,
    };
    let device: DeviceSpec = a.device.parse()?;
    let backend = open_backend(device)?;
    let options = EngineOptions {
        prefill: match a.prefill {
            Prefill::Chunked => PrefillMode::Chunked,
            Prefill::Token => PrefillMode::TokenByToken,
        },
        max_new_tokens: a.new_tokens,
        // Read only when the plan has a logits output.
        keep_logits: true,
        ..EngineOptions::default()
    };
    let t_load = Instant::now();
    let mut engine = Engine::load(&a.plan, &a.weights, backend, options)
        .with_context(|| format!("loading {} with {}", a.plan.display(), a.weights.display()))?;
    let load_s = t_load.elapsed().as_secs_f64();
    let plan = engine.plan();
    let vocab = plan.meta.info.vocab_size;
    let has_logits = plan
        .keys
        .iter()
        .any(|k| k.outputs.iter().any(|(n, _)| n == "logits"));
    let spec_values: Vec<u32> = {
        let mut s: Vec<u32> = plan
            .keys
            .iter()
            .map(|k| k.key.spec)
            .filter(|&s| s > 0)
            .collect();
        s.sort_unstable();
        s.dedup();
        s
    };
    let spec = match (&drafts, spec_values.as_slice()) {
        (None, _) => 0,
        (Some(_), [s]) => *s,
        (Some(_), []) => bail!(
            "--drafts needs a plan with a speculative key (e.g. b1q3s2); {} has none",
            a.plan.display()
        ),
        (Some(_), many) => bail!(
            "{} has speculative keys for several draft counts {many:?}; oracle_run uses one",
            a.plan.display()
        ),
    };
    let dev = engine.device();

    let mut records: Vec<SeqRecord> = (0..prompts.len()).map(|_| SeqRecord::default()).collect();
    let mut first_logits: Vec<Option<Vec<f32>>> = vec![None; prompts.len()];
    let t_run = Instant::now();
    for group in (0..prompts.len()).collect::<Vec<_>>().chunks(a.batch) {
        let mut ids: BTreeMap<SeqId, usize> = BTreeMap::new();
        for &i in group {
            let id = engine
                .add_sequence_with(
                    &prompts[i],
                    SeqOptions {
                        max_new_tokens: a.new_tokens,
                        stop_on_eos: false,
                    },
                )
                .with_context(|| format!("adding prompt {i}"))?;
            ids.insert(id, i);
        }
        while engine.has_work() {
            let mut offered: BTreeMap<SeqId, (usize, Vec<u32>)> = BTreeMap::new();
            if let Some(d) = &drafts {
                for (&id, &i) in &ids {
                    let g = records[i].tokens.len();
                    let view = engine.sequence(id).expect("added above");
                    let left = a.new_tokens as usize - g;
                    // Drafts only once the prompt is done (a token exists) and
                    // while the whole verified run fits in the token budget.
                    if view.finished.is_some() || g == 0 || left < spec as usize + 1 {
                        continue;
                    }
                    let Some(src) = d[i].get(g..g + spec as usize) else {
                        continue;
                    };
                    let dr: Vec<u32> = if a.wrong_drafts {
                        src.iter().map(|&t| (t + 1) % vocab).collect()
                    } else {
                        src.to_vec()
                    };
                    engine
                        .set_drafts(id, &dr)
                        .with_context(|| format!("drafts for prompt {i}"))?;
                    offered.insert(id, (g, dr));
                }
            }
            let out = engine.step()?;
            for (id, new) in out {
                let i = ids[&id];
                let r = &mut records[i];
                if let Some((g, dr)) = offered.remove(&id) {
                    r.steps
                        .push(json!({"generated_before": g, "drafts": dr, "emitted": new}));
                } else if drafts.is_some() {
                    r.steps.push(json!({
                        "generated_before": r.tokens.len(), "drafts": [], "emitted": new
                    }));
                }
                if let Some(row) = engine.last_logits(id) {
                    if r.tokens.is_empty() {
                        first_logits[i] = Some(row.to_vec());
                    }
                    // The row belongs to the step's last new token.
                    let (arg, second, margin) = top2(row);
                    let last = *new.last().expect("a step reports only new tokens");
                    if arg != last as usize {
                        r.argmax_disagreements += 1;
                    }
                    if new.len() == 1 {
                        r.margins.push(margin);
                        r.second.push(second as u32);
                    }
                }
                r.tokens.extend_from_slice(&new);
            }
            // Drafts offered to a sequence that did not step stay pending in
            // the engine; they are replaced before its next step.
        }
        for (&id, &i) in &ids {
            let generated = engine.remove_sequence(id)?;
            if generated != records[i].tokens {
                bail!(
                    "prompt {i}: the engine's generated tokens {generated:?} differ from the \
                     tokens its steps reported {:?}",
                    records[i].tokens
                );
            }
        }
    }
    let run_s = t_run.elapsed().as_secs_f64();

    let first = if has_logits && first_logits.iter().all(Option::is_some) {
        let stem = a
            .out
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| anyhow!("--out {} has no file name", a.out.display()))?;
        let name = format!("{stem}.first-logits.f32");
        let path = a.out.with_file_name(&name);
        let mut bytes = Vec::with_capacity(prompts.len() * vocab as usize * 4);
        for row in first_logits.iter().flatten() {
            for x in row {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
        }
        write_atomic(&path, &bytes)?;
        json!({"file": name, "rows": prompts.len(), "vocab": vocab})
    } else {
        Value::Null
    };
    let counters: serde_json::Map<String, Value> = engine
        .counters()
        .iter()
        .map(|(k, c)| {
            (
                k.to_string(),
                json!({
                    "captures": c.captures, "replays": c.replays, "eager_steps": c.eager_steps,
                    "padded_rows": c.padded_rows, "recaptures": c.recaptures,
                    "capture_s": c.capture_time.as_secs_f64()
                }),
            )
        })
        .collect();
    let sequences: Vec<Value> = records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut s = json!({"prompt": i, "tokens": r.tokens,
                "argmax_disagreements": r.argmax_disagreements});
            if has_logits && drafts.is_none() {
                s["margins"] = json!(r.margins);
                s["top2"] = json!(r.second);
            }
            if drafts.is_some() {
                s["steps"] = json!(r.steps);
            }
            s
        })
        .collect();
    let report = json!({
        "tool": "oracle_run",
        "plan": a.plan.display().to_string(),
        "weights": a.weights.display().to_string(),
        "device": a.device,
        "device_kind": dev.backend,
        "device_name": dev.name,
        "device_arch": dev.arch,
        "graphs": engine.graph_decision().graphs,
        "graph_reason": engine.graph_decision().reason,
        "mode": if drafts.is_some() { "spec" } else { "greedy" },
        "spec": spec,
        "drafts_kind": drafts_kind,
        "batch": a.batch,
        "prefill": format!("{:?}", a.prefill).to_lowercase(),
        "new_tokens": a.new_tokens,
        "first_logits": first,
        "sequences": sequences,
        "counters": counters,
        "load_s": load_s,
        "wall_s": run_s,
    });
    let mut text = serde_json::to_string_pretty(&report)?;
    text.push('\n');
    write_atomic(&a.out, text.as_bytes())?;
    eprintln!(
        "oracle_run: {} prompts x {} tokens, batch {}, {} on {} ({}) in {:.2} s",
        prompts.len(),
        a.new_tokens,
        a.batch,
        if drafts.is_some() { "spec" } else { "greedy" },
        dev.name,
        engine.graph_decision().reason,
        run_s
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::top2;

    #[test]
    fn top2_finds_the_two_largest_and_ignores_nan() {
        let (a, b, m) = top2(&[0.5, f32::NAN, 3.0, -1.0, 2.5]);
        assert_eq!((a, b), (2, 4));
        assert!((m - 0.5).abs() < 1e-6);
        let (a, b, _) = top2(&[4.0, 1.0, 2.0]);
        assert_eq!((a, b), (0, 2));
    }
}
