//! The server's counters and their Prometheus text exposition
//! (`GET /metrics`).
//!
//! The engine thread owns the engine, so it copies what the endpoint shows
//! (queue depth, running sequences, KV blocks, per-key graph counters) into
//! [`Metrics`] after every step; HTTP handlers count requests. Everything is
//! behind one mutex, held for microseconds. The text format is written here
//! (a few counters, gauges and two histograms do not need a metrics
//! framework). Not here: per-request labels, push gateways, OpenTelemetry.

use std::collections::BTreeMap;
use std::fmt::Write;

/// Seconds buckets for time to first token and time per output token.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A cumulative histogram.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }
    pub fn observe(&mut self, x: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if x <= *b {
                *c += 1;
            }
        }
        self.sum += x;
        self.count += 1;
    }
    pub fn count(&self) -> u64 {
        self.count
    }
    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// Graph counters of one compiled key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyStats {
    pub captures: u64,
    pub replays: u64,
    pub eager_steps: u64,
}

/// Everything `/metrics` shows.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// (endpoint, status) -> requests.
    pub requests: BTreeMap<(String, u16), u64>,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub queue_depth: u64,
    pub running: u64,
    /// Rows in the last step, and the most a step can hold.
    pub batch_rows: u64,
    pub batch_capacity: u64,
    /// Sum of rows over steps (with `steps`, the mean occupancy).
    pub batch_rows_total: u64,
    pub steps: u64,
    pub preemptions: u64,
    pub disconnects: u64,
    /// Connections being served now, and those refused (over the limit).
    pub connections_open: u64,
    pub connections_refused: u64,
    pub kv_blocks_free: u64,
    pub kv_blocks_total: u64,
    pub keys: BTreeMap<String, KeyStats>,
    pub ttft: Histogram,
    pub tpot: Histogram,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            requests: BTreeMap::new(),
            prompt_tokens: 0,
            generation_tokens: 0,
            queue_depth: 0,
            running: 0,
            batch_rows: 0,
            batch_capacity: 0,
            batch_rows_total: 0,
            steps: 0,
            preemptions: 0,
            disconnects: 0,
            connections_open: 0,
            connections_refused: 0,
            kv_blocks_free: 0,
            kv_blocks_total: 0,
            keys: BTreeMap::new(),
            ttft: Histogram::new(LATENCY_BUCKETS),
            tpot: Histogram::new(LATENCY_BUCKETS),
        }
    }
}

fn scalar(out: &mut String, name: &str, kind: &str, help: &str, v: impl std::fmt::Display) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
    );
}

impl Metrics {
    pub fn count_request(&mut self, endpoint: &str, status: u16) {
        *self
            .requests
            .entry((endpoint.to_string(), status))
            .or_insert(0) += 1;
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP kiln_requests_total HTTP requests by endpoint and status.\n# TYPE kiln_requests_total counter"
        );
        for ((ep, st), n) in &self.requests {
            let _ = writeln!(
                out,
                "kiln_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}"
            );
        }
        let c = "counter";
        let g = "gauge";
        scalar(
            &mut out,
            "kiln_prompt_tokens_total",
            c,
            "Prompt tokens admitted.",
            self.prompt_tokens,
        );
        scalar(
            &mut out,
            "kiln_generation_tokens_total",
            c,
            "Tokens generated.",
            self.generation_tokens,
        );
        scalar(
            &mut out,
            "kiln_queue_depth",
            g,
            "Requests waiting for admission.",
            self.queue_depth,
        );
        scalar(
            &mut out,
            "kiln_running_sequences",
            g,
            "Sequences in the engine.",
            self.running,
        );
        scalar(
            &mut out,
            "kiln_batch_rows",
            g,
            "Rows in the last engine step.",
            self.batch_rows,
        );
        scalar(
            &mut out,
            "kiln_batch_capacity",
            g,
            "Most rows a compiled decode key holds.",
            self.batch_capacity,
        );
        scalar(
            &mut out,
            "kiln_batch_rows_total",
            c,
            "Rows summed over engine steps.",
            self.batch_rows_total,
        );
        scalar(
            &mut out,
            "kiln_steps_total",
            c,
            "Engine steps run.",
            self.steps,
        );
        scalar(
            &mut out,
            "kiln_preemptions_total",
            c,
            "Sequences preempted for KV and recomputed later.",
            self.preemptions,
        );
        scalar(
            &mut out,
            "kiln_disconnects_total",
            c,
            "Requests whose client went away before the end.",
            self.disconnects,
        );
        scalar(
            &mut out,
            "kiln_connections_open",
            g,
            "HTTP connections being served.",
            self.connections_open,
        );
        scalar(
            &mut out,
            "kiln_connections_refused_total",
            c,
            "Connections refused with a 503: the server was at --max-connections.",
            self.connections_refused,
        );
        scalar(
            &mut out,
            "kiln_kv_blocks_free",
            g,
            "KV cache blocks not owned by any sequence.",
            self.kv_blocks_free,
        );
        scalar(
            &mut out,
            "kiln_kv_blocks_total",
            g,
            "KV cache blocks sequences may own.",
            self.kv_blocks_total,
        );
        for (name, help, pick) in [
            (
                "kiln_graph_captures_total",
                "Graph captures per compiled key.",
                0,
            ),
            (
                "kiln_graph_replays_total",
                "Graph replays per compiled key.",
                1,
            ),
            (
                "kiln_eager_steps_total",
                "Eager (not replayed) steps per compiled key.",
                2,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (key, k) in &self.keys {
                let v = [k.captures, k.replays, k.eager_steps][pick];
                let _ = writeln!(out, "{name}{{key=\"{key}\"}} {v}");
            }
        }
        self.ttft.render(
            &mut out,
            "kiln_time_to_first_token_seconds",
            "Time from arrival to the first token.",
        );
        self.tpot.render(
            &mut out,
            "kiln_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_an_inf_bucket() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count 3\n"), "{s}");
    }

    #[test]
    fn the_exposition_has_every_family_with_type_lines() {
        let mut m = Metrics::default();
        m.count_request("/v1/models", 200);
        m.kv_blocks_free = 7;
        m.keys.insert(
            "b1q1s0".into(),
            KeyStats {
                captures: 1,
                replays: 5,
                eager_steps: 0,
            },
        );
        let s = m.render();
        for want in [
            "kiln_requests_total{endpoint=\"/v1/models\",status=\"200\"} 1",
            "kiln_kv_blocks_free 7",
            "kiln_graph_replays_total{key=\"b1q1s0\"} 5",
            "# TYPE kiln_time_to_first_token_seconds histogram",
            "# TYPE kiln_queue_depth gauge",
        ] {
            assert!(s.contains(want), "missing {want}:\n{s}");
        }
    }
}
