//! The engine thread: a request queue, admission against free KV blocks,
//! continuous batching, preemption, and turning each step's tokens into
//! text events for the HTTP side.
//!
//! One thread owns the [`Engine`]; handlers send it [`Command`]s over a
//! channel and receive [`Event`]s on a per-request channel. Between two
//! steps the thread:
//! 1. takes new requests and drops those whose client went away (their
//!    receiver is closed): the sequence is removed and its KV blocks freed;
//! 2. admits waiting requests in arrival order while a sequence slot (the
//!    largest compiled decode batch) and the prompt's KV blocks are free, so
//!    new sequences join running ones at the next step;
//! 3. makes room for the step: when the running sequences need more new KV
//!    blocks than are free, the newest is preempted (removed, its prompt and
//!    generated tokens queued first in line, recomputed on readmission; the
//!    client sees nothing but a pause);
//! 4. picks the prefill mode: prompt chunks through the plan's query > 1
//!    keys, but after `max_decode_delay_steps` chunk steps in which decoding
//!    sequences got no token, one token-by-token step in which every row
//!    advances (so a long prompt never stalls running sequences for its
//!    whole prefill);
//! 5. steps, samples on the host the rows the graph cannot sample
//!    ([`crate::sampler`]: an argmax-only plan, or penalties on a request
//!    allowed more new tokens than the plan's penalty slots), checks EOS,
//!    stop strings and lengths, and sends text.
//!
//! Not here: prefix caching, priorities, fairness beyond arrival order,
//! mixing prefill chunks and decode rows in one step (the engine runs one
//! key per step).

use crate::api::GenRequest;
use crate::metrics::{KeyStats, Metrics};
use crate::sampler::{logprobs, Sampler, SamplingParams};
use crate::stream::{Detokenizer, StopMatcher, StopOutcome};
use kiln_runtime::text::TextTokenizer;
use kiln_runtime::{Engine, EngineError, FinishReason, PrefillMode, SeqId, SeqOptions};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::{error::TryRecvError, UnboundedReceiver, UnboundedSender};

/// What the HTTP side knows about the loaded model, fixed at load.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub name: String,
    pub max_context: u32,
    pub vocab_size: u32,
    pub has_logits: bool,
    /// The plan samples in the graph (`kiln compile --sampling`): sampled
    /// rows without penalties need no logits.
    pub in_graph_sampling: bool,
    /// `(token, count)` pairs the plan's penalties input holds per row
    /// (`kiln compile --penalty-slots`), `None` without one: penalised
    /// requests allowed at most this many new tokens are penalised in the
    /// graph, others on the host from the logits.
    pub penalty_slots: Option<u32>,
    pub usable_kv_blocks: u32,
    pub kv_block_size: u32,
    /// Sequences admitted at once: the largest compiled decode batch.
    pub max_running: u32,
}

impl ModelInfo {
    pub fn from_engine(engine: &Engine, name: String) -> ModelInfo {
        let plan = engine.plan();
        let max_running = plan
            .keys
            .iter()
            .filter(|k| k.key.query == 1 && k.key.spec == 0)
            .map(|k| k.key.batch)
            .max()
            .unwrap_or(1);
        ModelInfo {
            name,
            max_context: plan.meta.info.max_context,
            vocab_size: plan.meta.info.vocab_size,
            has_logits: engine.has_logits_output(),
            in_graph_sampling: engine.has_in_graph_sampling(),
            penalty_slots: engine.penalty_slots(),
            usable_kv_blocks: engine.usable_kv_blocks(),
            kv_block_size: plan.kv.block_size,
            max_running,
        }
    }
}

impl ModelInfo {
    /// Whether the graph draws this request's tokens itself (penalties
    /// included), so it needs no logits unless it asks for logprobs: an
    /// in-graph sampling plan, and no penalties or few enough new tokens
    /// for the penalty slots (distinct generated tokens never exceed
    /// generated tokens).
    pub fn graph_samples(&self, p: &SamplingParams, max_new_tokens: u32) -> bool {
        self.in_graph_sampling
            && (!p.has_penalties() || self.penalty_slots.is_some_and(|n| max_new_tokens <= n))
    }
}

/// One request for the engine thread.
pub struct Submission {
    pub prompt: Vec<u32>,
    pub req: GenRequest,
    /// Tokens to generate at most (already capped by the context).
    pub max_new_tokens: u32,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

pub enum Command {
    Submit(Box<Submission>),
    Shutdown,
}

/// A token's log probability and its most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What a request hears back.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// New text (possibly empty when only logprobs are new).
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// The end: `stop` (EOS or a stop string) or `length`.
    Done {
        finish_reason: &'static str,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
    Error(String),
}

/// Scheduling knobs.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Prefill chunk steps in a row that may leave decoding sequences
    /// without a token before a token-by-token step runs.
    pub max_decode_delay_steps: u32,
}

impl Default for SchedulerConfig {
    fn default() -> SchedulerConfig {
        SchedulerConfig {
            max_decode_delay_steps: 1,
        }
    }
}

/// Generation state that survives preemption.
struct Gen {
    generated: Vec<u32>,
    detok: Detokenizer,
    stop: StopMatcher,
    first_token: Option<Instant>,
}

struct Waiting {
    sub: Box<Submission>,
    gen: Gen,
}

struct Running {
    sub: Box<Submission>,
    gen: Gen,
    seq: SeqId,
    /// Admission order: the largest is the newest.
    order: u64,
}

/// The engine thread's state. See the module docs.
pub struct Scheduler {
    engine: Engine,
    tok: Arc<TextTokenizer>,
    sampler: Box<dyn Sampler>,
    eos: Vec<u32>,
    info: ModelInfo,
    cfg: SchedulerConfig,
    rx: UnboundedReceiver<Command>,
    metrics: Arc<Mutex<Metrics>>,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    next_order: u64,
    decode_wait: u32,
}

impl Scheduler {
    pub fn new(
        engine: Engine,
        tok: Arc<TextTokenizer>,
        sampler: Box<dyn Sampler>,
        info: ModelInfo,
        cfg: SchedulerConfig,
        rx: UnboundedReceiver<Command>,
        metrics: Arc<Mutex<Metrics>>,
    ) -> Scheduler {
        let eos = engine.plan().meta.info.eos_token_ids.clone();
        let s = Scheduler {
            engine,
            tok,
            sampler,
            eos,
            info,
            cfg,
            rx,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_order: 0,
            decode_wait: 0,
        };
        s.publish(0);
        s
    }

    /// Serves until [`Command::Shutdown`] or until every sender is gone.
    pub fn run(mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.rx.blocking_recv() {
                    Some(Command::Submit(s)) => self.enqueue(s),
                    Some(Command::Shutdown) | None => break,
                }
            }
            let mut closing = false;
            loop {
                match self.rx.try_recv() {
                    Ok(Command::Submit(s)) => self.enqueue(s),
                    Ok(Command::Shutdown) | Err(TryRecvError::Disconnected) => {
                        closing = true;
                        break;
                    }
                    Err(TryRecvError::Empty) => break,
                }
            }
            if closing {
                break;
            }
            self.tick();
        }
        for r in std::mem::take(&mut self.running) {
            let _ = r
                .sub
                .events
                .send(Event::Error("the server is shutting down".into()));
            let _ = self.engine.remove_sequence(r.seq);
        }
        for w in std::mem::take(&mut self.waiting) {
            let _ = w
                .sub
                .events
                .send(Event::Error("the server is shutting down".into()));
        }
        self.publish(0);
    }

    fn enqueue(&mut self, sub: Box<Submission>) {
        let stop = StopMatcher::new(sub.req.stop.clone());
        self.waiting.push_back(Waiting {
            sub,
            gen: Gen {
                generated: Vec::new(),
                detok: Detokenizer::default(),
                stop,
                first_token: None,
            },
        });
        self.publish(0);
    }

    /// One scheduling round and one engine step.
    fn tick(&mut self) {
        self.reap();
        self.admit();
        if self.running.is_empty() {
            self.publish(0);
            return;
        }
        self.make_room();
        let decoding: Vec<SeqId> = self
            .running
            .iter()
            .filter(|r| self.engine.prefill_remaining(r.seq) == Some(0))
            .map(|r| r.seq)
            .collect();
        let mode = if !decoding.is_empty() && self.decode_wait >= self.cfg.max_decode_delay_steps {
            PrefillMode::TokenByToken
        } else {
            PrefillMode::Chunked
        };
        self.engine.set_prefill_mode(mode);
        let info = &self.info;
        let logits = self.running.iter().any(|r| {
            let graph = info.graph_samples(&r.sub.req.sampling, r.sub.max_new_tokens);
            r.sub.req.needs_logits_on(graph)
        });
        self.engine.set_keep_logits(logits && self.info.has_logits);
        let rows = self.running.len() as u64;
        match self.engine.step() {
            Ok(out) => {
                let served = decoding
                    .iter()
                    .all(|id| out.iter().any(|(o, t)| o == id && !t.is_empty()));
                self.decode_wait = if served { 0 } else { self.decode_wait + 1 };
                self.process(out);
            }
            Err(e) => {
                tracing::error!("engine step failed: {e}");
                for r in std::mem::take(&mut self.running) {
                    let _ = r
                        .sub
                        .events
                        .send(Event::Error(format!("the engine failed: {e}")));
                    let _ = self.engine.remove_sequence(r.seq);
                }
            }
        }
        self.publish(rows);
    }

    /// Drops requests whose client went away.
    fn reap(&mut self) {
        let mut gone = 0;
        let engine = &mut self.engine;
        self.running.retain(|r| {
            if r.sub.events.is_closed() {
                let _ = engine.remove_sequence(r.seq);
                gone += 1;
                false
            } else {
                true
            }
        });
        self.waiting.retain(|w| {
            if w.sub.events.is_closed() {
                gone += 1;
                false
            } else {
                true
            }
        });
        if gone > 0 {
            tracing::info!("{gone} request(s) dropped: the client went away");
            self.metrics.lock().expect("metrics lock").disconnects += gone;
        }
    }

    fn admit(&mut self) {
        while let Some(w) = self.waiting.front() {
            if self.running.len() as u32 >= self.info.max_running {
                break;
            }
            let mut prompt = w.sub.prompt.clone();
            prompt.extend_from_slice(&w.gen.generated);
            let need = self.engine.kv_blocks_for(prompt.len() as u32 + 1);
            if need > self.engine.free_kv_blocks() {
                if self.running.is_empty() {
                    // Nothing will free blocks: the request cannot be served
                    // (the HTTP side refuses prompts larger than the cache,
                    // so this is a recomputed sequence that outgrew it).
                    let w = self.waiting.pop_front().expect("front exists");
                    self.finish_waiting(w, "length");
                    continue;
                }
                break;
            }
            let w = self.waiting.pop_front().expect("front exists");
            let remaining = w.sub.max_new_tokens - w.gen.generated.len() as u32;
            let opts = SeqOptions {
                max_new_tokens: remaining,
                stop_on_eos: false,
            };
            match self.engine.add_sequence_with(&prompt, opts) {
                Ok(seq) => {
                    let params = &w.sub.req.sampling;
                    if self.info.graph_samples(params, w.sub.max_new_tokens) {
                        // Greedy rows stay greedy (the default); the counter
                        // is the token index, so a recomputed sequence
                        // draws what it would have drawn; the engine counts
                        // the generated tokens (the recomputed ones too)
                        // for the penalties.
                        let set = self
                            .engine
                            .set_sampling(seq, params.in_graph())
                            .and_then(|()| {
                                if params.has_penalties() {
                                    self.engine.set_penalties(
                                        seq,
                                        params.presence_penalty,
                                        params.frequency_penalty,
                                    )
                                } else {
                                    Ok(())
                                }
                            });
                        if let Err(e) = set {
                            let _ = self.engine.remove_sequence(seq);
                            let _ = w.sub.events.send(Event::Error(e.to_string()));
                            continue;
                        }
                    }
                    if w.gen.generated.is_empty() {
                        self.metrics.lock().expect("metrics lock").prompt_tokens +=
                            prompt.len() as u64;
                    }
                    self.running.push(Running {
                        sub: w.sub,
                        gen: w.gen,
                        seq,
                        order: self.next_order,
                    });
                    self.next_order += 1;
                }
                Err(EngineError::KvExhausted { .. }) => {
                    self.waiting.push_front(w);
                    break;
                }
                Err(e) => {
                    let _ = w.sub.events.send(Event::Error(e.to_string()));
                }
            }
        }
    }

    fn finish_waiting(&mut self, w: Waiting, reason: &'static str) {
        let _ = w.sub.events.send(Event::Done {
            finish_reason: reason,
            prompt_tokens: w.sub.prompt.len() as u32,
            completion_tokens: w.gen.generated.len() as u32,
        });
    }

    /// Preempts the newest sequences until the next step's new KV blocks fit.
    fn make_room(&mut self) {
        loop {
            let need: u32 = self
                .running
                .iter()
                .map(|r| self.engine.kv_blocks_for_next_token(r.seq).unwrap_or(0))
                .sum();
            if need <= self.engine.free_kv_blocks() || self.running.len() <= 1 {
                return;
            }
            let newest = (0..self.running.len())
                .max_by_key(|&i| self.running[i].order)
                .expect("not empty");
            self.preempt(newest);
        }
    }

    fn preempt(&mut self, i: usize) {
        let r = self.running.remove(i);
        let _ = self.engine.remove_sequence(r.seq);
        tracing::info!(
            "preempted a sequence ({} prompt + {} generated tokens) for KV; it is recomputed later",
            r.sub.prompt.len(),
            r.gen.generated.len()
        );
        self.metrics.lock().expect("metrics lock").preemptions += 1;
        self.waiting.push_front(Waiting {
            sub: r.sub,
            gen: r.gen,
        });
    }

    /// Handles one step's new tokens.
    fn process(&mut self, out: Vec<(SeqId, Vec<u32>)>) {
        let mut done: Vec<(SeqId, Option<&'static str>)> = Vec::new();
        let mut new_tokens = 0u64;
        for (seq, tokens) in out {
            let Some(i) = self.running.iter().position(|r| r.seq == seq) else {
                continue;
            };
            let mut outcome = None;
            for t in tokens {
                new_tokens += 1;
                match self.accept(i, t) {
                    Ok(None) => {}
                    Ok(Some(reason)) => {
                        outcome = Some(Some(reason));
                        break;
                    }
                    Err(()) => {
                        outcome = Some(None);
                        break;
                    }
                }
            }
            if outcome.is_none() {
                outcome = match self.engine.sequence(seq).and_then(|v| v.finished.cloned()) {
                    None => None,
                    Some(FinishReason::KvExhausted(_)) if self.running.len() > 1 => {
                        self.preempt(i);
                        continue;
                    }
                    Some(_) => Some(Some("length")),
                };
            }
            if let Some(o) = outcome {
                done.push((seq, o));
            }
        }
        // Sequences the engine stopped for KV in the step's allocation pass
        // produced no tokens: preempt or end them too.
        let stalled: Vec<SeqId> = self
            .running
            .iter()
            .filter(|r| {
                matches!(
                    self.engine.sequence(r.seq).and_then(|v| v.finished),
                    Some(FinishReason::KvExhausted(_))
                ) && !done.iter().any(|d| d.0 == r.seq)
            })
            .map(|r| r.seq)
            .collect();
        for seq in stalled {
            if self.running.len() > 1 {
                if let Some(i) = self.running.iter().position(|r| r.seq == seq) {
                    self.preempt(i);
                }
            } else {
                done.push((seq, Some("length")));
            }
        }
        self.metrics.lock().expect("metrics lock").generation_tokens += new_tokens;
        for (seq, reason) in done {
            if let Some(i) = self.running.iter().position(|r| r.seq == seq) {
                let r = self.running.swap_remove(i);
                let _ = self.engine.remove_sequence(r.seq);
                match reason {
                    Some(reason) => self.finish(r, reason),
                    None if r.sub.events.is_closed() => {
                        tracing::info!("a request was dropped: the client went away");
                        self.metrics.lock().expect("metrics lock").disconnects += 1;
                    }
                    None => {}
                }
            }
        }
    }

    /// Takes one generated token of running row `i`: samples it if the row
    /// needs that, sends its text. `Ok(Some(reason))` when the row is done,
    /// `Err(())` when its client is gone or it failed (already told).
    fn accept(&mut self, i: usize, graph_token: u32) -> Result<Option<&'static str>, ()> {
        let r = &mut self.running[i];
        let params = &r.sub.req.sampling;
        let step = r.gen.generated.len() as u64;
        let in_graph = self.info.graph_samples(params, r.sub.max_new_tokens);
        let logits = if r.sub.req.needs_logits_on(in_graph) {
            match self.engine.last_logits(r.seq) {
                Some(l) => Some(l.to_vec()),
                None => {
                    let _ = r.sub.events.send(Event::Error(
                        "the plan produced no logits for a row that needs them; recompile it \
                         with `kiln compile --logits`"
                            .into(),
                    ));
                    return Err(());
                }
            }
        } else {
            None
        };
        let mut token = graph_token;
        if params.needs_host(in_graph) {
            let l = logits
                .as_deref()
                .expect("needs_logits_on covers host sampling");
            token = self.sampler.sample(l, params, &r.gen.generated, step);
            if token != graph_token {
                if let Err(e) = self.engine.replace_last_token(r.seq, token) {
                    let _ = r.sub.events.send(Event::Error(e.to_string()));
                    return Err(());
                }
            }
        }
        let mut lps = Vec::new();
        if let (Some(want), Some(l)) = (r.sub.req.logprobs, logits.as_deref()) {
            let (lp, top) = logprobs(l, token, want.top as usize);
            let name = |t: u32| self.tok.decode(&[t]).unwrap_or_default();
            lps.push(TokenLogprob {
                token: name(token),
                logprob: lp,
                top: top.into_iter().map(|(t, p)| (name(t), p)).collect(),
            });
        }
        r.gen.generated.push(token);
        if r.gen.first_token.is_none() {
            let now = Instant::now();
            r.gen.first_token = Some(now);
            self.metrics
                .lock()
                .expect("metrics lock")
                .ttft
                .observe((now - r.sub.arrived).as_secs_f64());
        }
        if self.eos.contains(&token) {
            if !lps.is_empty() && r.sub.events.send(text_event(String::new(), lps)).is_err() {
                return Err(());
            }
            return Ok(Some("stop"));
        }
        let piece = match r.gen.detok.push(&self.tok, token) {
            Ok(p) => p,
            Err(e) => {
                let _ = r.sub.events.send(Event::Error(e.to_string()));
                return Err(());
            }
        };
        let (text, stopped) = match r.gen.stop.push(&piece) {
            StopOutcome::Continue(t) => (t, false),
            StopOutcome::Stopped(t) => (t, true),
        };
        if (!text.is_empty() || !lps.is_empty())
            && r.sub.events.send(text_event(text, lps)).is_err()
        {
            return Err(());
        }
        Ok(stopped.then_some("stop"))
    }

    /// Sends what is held back and the end of the request.
    fn finish(&mut self, mut r: Running, reason: &'static str) {
        let mut tail = r.gen.detok.finish(&self.tok).unwrap_or_default();
        if let StopOutcome::Stopped(t) = r.gen.stop.push(&tail) {
            tail = t;
        } else {
            tail = r.gen.stop.flush();
        }
        if !tail.is_empty() {
            let _ = r.sub.events.send(text_event(tail, Vec::new()));
        }
        let n = r.gen.generated.len();
        if let (Some(first), true) = (r.gen.first_token, n > 1) {
            let per = first.elapsed().as_secs_f64() / (n - 1) as f64;
            self.metrics.lock().expect("metrics lock").tpot.observe(per);
        }
        let _ = r.sub.events.send(Event::Done {
            finish_reason: reason,
            prompt_tokens: r.sub.prompt.len() as u32,
            completion_tokens: n as u32,
        });
    }

    /// Copies the engine's state into the metrics.
    fn publish(&self, rows: u64) {
        let mut m = self.metrics.lock().expect("metrics lock");
        m.queue_depth = self.waiting.len() as u64;
        m.running = self.running.len() as u64;
        m.kv_blocks_free = self.engine.free_kv_blocks() as u64;
        m.kv_blocks_total = self.engine.usable_kv_blocks() as u64;
        m.batch_capacity = self.info.max_running as u64;
        if rows > 0 {
            m.batch_rows = rows;
            m.batch_rows_total += rows;
            m.steps += 1;
        } else if self.running.is_empty() {
            m.batch_rows = 0;
        }
        for (key, c) in self.engine.counters() {
            m.keys.insert(
                key.to_string(),
                KeyStats {
                    captures: c.captures,
                    replays: c.replays,
                    eager_steps: c.eager_steps,
                },
            );
        }
    }
}

fn text_event(text: String, logprobs: Vec<TokenLogprob>) -> Event {
    Event::Text { text, logprobs }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(in_graph_sampling: bool, penalty_slots: Option<u32>) -> ModelInfo {
        ModelInfo {
            name: "t".into(),
            max_context: 1024,
            vocab_size: 100,
            has_logits: true,
            in_graph_sampling,
            penalty_slots,
            usable_kv_blocks: 64,
            kv_block_size: 16,
            max_running: 4,
        }
    }

    fn params(temperature: f32, presence: f32, frequency: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            presence_penalty: presence,
            frequency_penalty: frequency,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn penalised_rows_sample_in_the_graph_only_when_their_tokens_fit_the_penalty_slots() {
        let slots = info(true, Some(256));
        for p in [params(0.0, 0.0, 0.0), params(0.8, 0.0, 0.0)] {
            assert!(slots.graph_samples(&p, 5000), "{p:?}");
            assert!(!p.needs_host(slots.graph_samples(&p, 5000)));
        }
        for p in [params(0.0, 0.5, 0.0), params(0.8, 0.0, 0.3)] {
            assert!(slots.graph_samples(&p, 256), "{p:?}");
            assert!(!p.needs_host(true));
            assert!(!slots.graph_samples(&p, 257), "{p:?}");
            assert!(p.needs_host(slots.graph_samples(&p, 257)));
            // No penalties input, or argmax only: the host samples.
            assert!(!info(true, None).graph_samples(&p, 1));
            assert!(!info(false, Some(256)).graph_samples(&p, 1));
        }
        // Greedy rows without penalties never need the host, whatever the plan.
        let g = params(0.0, 0.0, 0.0);
        assert!(!g.needs_host(info(false, None).graph_samples(&g, 1)));
    }
}
