//! Property tests: random model shapes and keys trace to well-formed graphs,
//! and damaged files give errors, never panics.

mod frontend_common;

use frontend_common::tiny;
use kiln_compiler::frontend::{open, FrontendError, TraceOptions};
use kiln_compiler::testing::{Family, TinySpec};
use kiln_ir::{AttnAttrs, DType, Key, Op};
use proptest::prelude::*;

fn family() -> impl Strategy<Value = Family> {
    prop::sample::select(Family::ALL.to_vec())
}

prop_compose! {
    fn spec()(
        layers in 1u32..=3,
        kv_heads in 1u32..=3,
        group in 1u32..=3,
        half_hd in 1u32..=8,
        explicit_hd in any::<bool>(),
        extra_hidden in 0u32..=3,
        intermediate in 1u32..=24,
        vocab in 3u32..=40, // the tiny models' EOS id is 2; it must lie inside the vocabulary
        tie in any::<bool>(),
        shards in 1u32..=3,
        window in prop::option::of(1u32..=64),
        max_window_layers in 0u32..=3,
        f32_weights in any::<bool>(),
        seed in any::<u64>(),
    ) -> TinySpec {
        let heads = kv_heads * group;
        let hd = 2 * half_hd;
        TinySpec {
            layers,
            heads,
            kv_heads,
            hidden: if explicit_hd { heads * hd + 2 * extra_hidden } else { heads * hd },
            head_dim: explicit_hd.then_some(hd),
            intermediate,
            vocab,
            max_position: 64,
            tie_embeddings: tie,
            shards,
            sliding_window: window,
            max_window_layers,
            dtype: if f32_weights { DType::F32 } else { DType::BF16 },
            seed,
            ..TinySpec::default()
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_models_and_keys_trace_to_graphs_of_the_predicted_size(
        family in family(),
        spec in spec(),
        batch in 1u32..=4,
        query in 1u32..=4,
        spec_frac in 0u32..4,
        logits in any::<bool>(),
    ) {
        // Qwen3's HF default head_dim is 128 (Gemma-3's 256), so tiny Qwen3
        // and Gemma-3 configs always state it.
        let spec = if matches!(family, Family::Qwen3 | Family::Gemma3) && spec.head_dim.is_none() {
            TinySpec { head_dim: Some(spec.hidden / spec.heads), ..spec }
        } else {
            spec
        };
        let dir = tiny(family, &spec);
        let m = open(dir.path()).unwrap();
        prop_assert_eq!(m.info().head_dim, spec.head_dim());
        let s = spec_frac % query;
        let key = Key::new(batch, query, s);
        let kv = m.kv_layout(4, 5);
        let r = m.trace(
            key,
            &kv,
            &TraceOptions {
                logits,
                ..TraceOptions::default()
            },
        );
        if s > 0 && query != s + 1 {
            let is_unsupported = matches!(r, Err(FrontendError::UnsupportedKey { .. }));
            prop_assert!(is_unsupported);
            return Ok(());
        }
        let g = r.unwrap();
        if let Err(e) = kiln_ir::verify(&g, Some(m.manifest())) {
            panic!("{}", e.render(&g));
        }
        let l = spec.layers as usize;
        let extra = usize::from(s == 0 && query > 1) + usize::from(s > 0);
        let qk = if family == Family::Qwen3 { 2 * l } else { 0 };
        // Gemma-3: 2 head norms and 2 more sandwich norms per layer, the
        // embedding scale and the final softcap.
        let gemma = if family == Family::Gemma3 { 4 * l + 2 } else { 0 };
        // embedding + per layer 16 ops (+2 head norms) + norm, [gather|accept], lm_head, argmax
        prop_assert_eq!(g.nodes.len(), 1 + 16 * l + qk + gemma + 3 + extra);
        prop_assert_eq!(g.weights.len(), m.manifest().entries.len());
        prop_assert_eq!(g.outputs.len(), 1 + usize::from(s > 0) + usize::from(logits));
        for (i, n) in g.nodes.iter().enumerate() {
            if let Op::PagedAttention(AttnAttrs { window, .. }) = n.op {
                let layer = g.nodes[..i].iter().filter(|n| n.op.mnemonic() == "paged_attention").count() as u32;
                let want = match family {
                    Family::Llama => None,
                    Family::Mistral => spec.sliding_window,
                    Family::Qwen2 | Family::Qwen3 => {
                        spec.sliding_window.filter(|_| layer >= spec.max_window_layers)
                    }
                    Family::Gemma3 => spec
                        .sliding_window
                        .filter(|_| kiln_compiler::testing::gemma3_layer_is_sliding(layer)),
                };
                prop_assert_eq!(window, want);
            }
        }
    }

    #[test]
    fn damaged_headers_give_errors_not_panics(
        cuts in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        truncate in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let dir = tiny(Family::Qwen2, &TinySpec { layers: 1, ..TinySpec::for_family(Family::Qwen2) });
        let p = dir.path().join("model.safetensors");
        let mut bytes = std::fs::read(&p).unwrap();
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, byte) in &cuts {
            let i = at.index(header_end);
            bytes[i] = *byte;
        }
        if let Some(t) = truncate {
            bytes.truncate(t.index(bytes.len()));
        }
        std::fs::write(&p, &bytes).unwrap();
        // Either the damage is harmless (e.g. a changed digit that still
        // describes a consistent file of the right shapes) or it is an error;
        // an error must name the file or the tensor.
        if let Err(e) = open(dir.path()) {
            let s = e.to_string();
            prop_assert!(s.contains("model.safetensors") || s.contains("tensor `"), "{}", s);
        }
    }
}
